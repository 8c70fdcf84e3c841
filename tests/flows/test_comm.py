"""Two-sided links: ``link`` / ``query_register_mem_status`` / ``unlink`` and the rank table.

The state machine (core/comm.py) is driven with two engines in this process; the facade
(``LLMDataDist.link``) with a real LLMDataDist here and the other member as a bare engine,
also here. The two-process version is examples/flow1 (run by test_examples.py).
"""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

import datadist as llm
from datadist.api import rank_table
from datadist.core.comm import CommManager, CommState, Member
from datadist.core.errors import AlreadyLinked, InvalidArgument, NotLinked
from datadist.core.layout import Geometry, layer_tensor_indices, plan_blocks
from datadist.wire.protocol import KeyKind, KeyRef

from ._support import DECODER_ID, PROMPT_ID, code, units

pytestmark = pytest.mark.timeout(30)

S = llm.LLMStatusCode
CM_OPTS = {"llm.EnableCacheManager": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def table(*ports: int | None, version: str = "1.0", ip: str = "127.0.0.1") -> str:
    devices = []
    for rank, port in enumerate(ports):
        dev = {"device_id": str(rank), "device_ip": ip, "rank_id": str(rank)}
        if port is not None:
            dev["device_port"] = port
        devices.append(dev)
    doc = {"version": version, "server_count": "1", "status": "completed",
           "server_list": [{"server_id": "node-0", "device": devices}]}
    if version == "1.2":
        doc["super_pod_list"] = [{"super_pod_id": "0", "server_list": [{"server_id": "node-0"}]}]
        for dev in devices:
            dev["super_device_id"] = "0"
    return json.dumps(doc)


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# ================================================================================ rank table


class TestRankTable:
    @pytest.mark.parametrize("version", ["1.0", "1.2"])
    def test_parse(self, version):
        ranks = rank_table.parse(table(26000, None, version=version))
        assert ranks[0] == rank_table.RankEntry(0, "127.0.0.1", 26000)
        assert ranks[1] == rank_table.RankEntry(1, "127.0.0.1", None)

    def test_several_servers_and_int_fields(self):
        doc = {"version": "1.0", "server_list": [
            {"device": [{"device_ip": "10.0.0.1", "rank_id": 0}]},
            {"device": [{"device_ip": "10.0.0.2", "rank_id": 1, "device_port": "7000"}]}]}
        ranks = rank_table.parse(json.dumps(doc))
        assert ranks[1].device_ip == "10.0.0.2" and ranks[1].device_port == 7000

    def test_port_rule(self):
        given, plain = rank_table.RankEntry(3, "h", 1234), rank_table.RankEntry(3, "h", None)
        assert rank_table.port_of(given, 5000) == 1234  # device_port wins
        assert rank_table.port_of(plain, 5000) == 5000  # else our own listen port
        assert rank_table.port_of(plain, None) == rank_table.DEFAULT_BASE_PORT + 3

    @pytest.mark.parametrize("text", [
        "not json", "[]", json.dumps({"version": "2.0", "server_list": []}),
        json.dumps({"version": "1.0"}), json.dumps({"version": "1.0", "server_list": [{}]}),
        json.dumps({"version": "1.0", "server_list": [{"device": [{"rank_id": "0"}]}]}),
        json.dumps({"version": "1.0", "server_list": [{"device": [
            {"rank_id": "0", "device_ip": "not-an-ip"}]}]}),
        json.dumps({"version": "1.0", "server_list": [{"device": [
            {"rank_id": "x", "device_ip": "1.2.3.4"}]}]}),
        json.dumps({"version": "1.0", "server_list": [{"device": [
            {"rank_id": "0", "device_ip": "1.2.3.4", "device_port": 70000}]}]}),
        table(1, 2).replace('"rank_id": "1"', '"rank_id": "0"'),
    ])
    def test_bad_tables(self, text):
        with code(S.LLM_PARAM_INVALID):
            rank_table.parse(text)


# ================================================================================ state machine


@pytest.fixture
def comm_pair(make_side):
    """Two unlinked engines, each with a CommManager, and their members."""
    a, b = make_side(PROMPT_ID, listen=False), make_side(DECODER_ID, listen=False)
    ma = Member(PROMPT_ID, 0, "127.0.0.1", free_port())
    mb = Member(DECODER_ID, 1, "127.0.0.1", free_port())
    ca, cb = CommManager(a.engine), CommManager(b.engine)
    yield a, b, ca, cb, ma, mb
    ca.close()
    cb.close()


class TestStateMachine:
    def test_preparing_until_every_member_joined_then_ok(self, comm_pair):
        a, b, ca, cb, ma, mb = comm_pair
        ida = ca.link("c", ma, [mb], 10.0)
        time.sleep(0.2)
        assert ca.status(ida) == CommState.PREPARING
        assert a.engine.links() == []  # nothing usable before OK
        with pytest.raises(NotLinked):
            a.engine.get_link(DECODER_ID)
        idb = cb.link("c", mb, [ma], 10.0)
        wait_for(lambda: ca.status(ida) == cb.status(idb) == CommState.OK)
        assert [link.cluster_id for link in a.engine.links()] == [DECODER_ID]
        assert [link.cluster_id for link in b.engine.links()] == [PROMPT_ID]

    def test_data_moves_both_ways_after_ok(self, comm_pair):
        a, b, ca, cb, ma, mb = comm_pair
        src_a, x = a.register(2, [4, 32], blocks=True, model_id=0, seed=1)
        src_b, y = b.register(2, [4, 32], blocks=True, model_id=0, seed=2)
        dst_a, x2 = a.register(2, [4, 32], blocks=True)
        dst_b, y2 = b.register(2, [4, 32], blocks=True)
        ida, idb = ca.link("c", ma, [mb], 10.0), cb.link("c", mb, [ma], 10.0)
        wait_for(lambda: ca.status(ida) == cb.status(idb) == CommState.OK)
        g = Geometry(2, 128, 4, True)
        plan = plan_blocks(g, [0, 3], [2, 1], layer_tensor_indices(2, None, None, 2))
        key = KeyRef(KeyKind.BLOCKS_KEY, 0, 0, 0)
        b.engine.pull(PROMPT_ID, key, 32, plan, dst_b.cache_id)
        a.engine.pull(DECODER_ID, key, 32, plan, dst_a.cache_id)
        np.testing.assert_array_equal(units(y2, 4)[:, [2, 1]], units(x, 4)[:, [0, 3]])
        np.testing.assert_array_equal(units(x2, 4)[:, [2, 1]], units(y, 4)[:, [0, 3]])

    def test_failed_when_a_member_never_comes(self, comm_pair):
        a, _, ca, _, ma, mb = comm_pair
        ida = ca.link("c", ma, [mb], 0.5)
        wait_for(lambda: ca.status(ida) != CommState.PREPARING)
        assert ca.status(ida) == CommState.FAILED
        assert "not reachable" in ca.describe(ida).reason
        assert a.engine.links() == []
        # the listener it started is gone: its port can be bound again
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ma.host, ma.port))

    def test_unlink_drops_its_links_and_tells_the_peer(self, comm_pair):
        a, b, ca, cb, ma, mb = comm_pair
        ida, idb = ca.link("c", ma, [mb], 10.0), cb.link("c", mb, [ma], 10.0)
        wait_for(lambda: ca.status(ida) == cb.status(idb) == CommState.OK)
        ca.unlink(ida)
        assert a.engine.links() == []
        wait_for(lambda: all(p.cluster_id != PROMPT_ID for p in b.engine.inbound_peers()))
        with pytest.raises(InvalidArgument):
            ca.status(ida)
        with pytest.raises(InvalidArgument):
            ca.unlink(ida)

    def test_an_existing_link_is_used_and_left_alone(self, comm_pair):
        a, b, ca, cb, ma, mb = comm_pair
        b.engine.start_listening(mb.host, mb.port)  # b serves its member address itself
        a.engine.link(DECODER_ID, mb.host, mb.port, 5.0)  # as link_clusters would
        ida, idb = ca.link("c", ma, [mb], 10.0), cb.link("c", mb, [ma], 10.0)
        wait_for(lambda: ca.status(ida) == cb.status(idb) == CommState.OK)
        ca.unlink(ida)
        assert [link.cluster_id for link in a.engine.links()] == [DECODER_ID]

    def test_duplicate_name_and_members(self, comm_pair):
        _, _, ca, _, ma, mb = comm_pair
        ca.link("c", ma, [mb], 10.0)
        with pytest.raises(AlreadyLinked):
            ca.link("c", ma, [mb], 10.0)
        with pytest.raises(InvalidArgument):
            ca.link("d", ma, [ma], 10.0)


# ================================================================================ the facade


def member_side(make_side, port):
    """The other member, a bare engine in this process, with a blocks cache to pull."""
    side = make_side(DECODER_ID, listen=False)
    cache, arr = side.register(2, [8, 16], blocks=True, model_id=0, seed=3)
    return side, arr, CommManager(side.engine)


class TestFacade:
    def test_link_pull_unlink(self, make_datadist, make_side):
        ports = free_port(), free_port()
        dd = make_datadist(CM_OPTS)
        cm = dd.cache_manager
        desc = llm.CacheDesc(2, [8, 16], llm.DataType.DT_UINT8)
        mine = np.zeros((2, 128), np.uint8)
        cache = cm.register_blocks_cache(desc, [int(mine[i].ctypes.data) for i in range(2)],
                                         llm.BlocksCacheKey(PROMPT_ID, 0))
        other, theirs, comms = member_side(make_side, ports[1])
        comm_id = dd.link("pd_comm", {PROMPT_ID: 0, DECODER_ID: 1}, table(*ports, version="1.2"))
        assert isinstance(comm_id, int)
        assert dd.query_register_mem_status(comm_id) == llm.RegisterMemStatus.PREPARING
        key = llm.BlocksCacheKey(DECODER_ID, 0)
        with code(S.LLM_NOT_YET_LINK):
            cm.pull_blocks(key, cache, [0], [0])
        try:
            comms.link("pd_comm", Member(DECODER_ID, 1, "127.0.0.1", ports[1]),
                       [Member(PROMPT_ID, 0, "127.0.0.1", ports[0])], 10.0)
            wait_for(lambda: dd.query_register_mem_status(comm_id) == llm.RegisterMemStatus.OK)
            cm.pull_blocks(key, cache, [1, 2, 7], [0, 5, 6])
            want = np.zeros_like(mine)
            units(want, 8)[:, [0, 5, 6]] = units(theirs, 8)[:, [1, 2, 7]]
            np.testing.assert_array_equal(mine, want)
            with code(S.LLM_EXIST_LINK):
                dd.switch_role(llm.LLMRole.DECODER)
            dd.unlink(comm_id)
            with code(S.LLM_NOT_YET_LINK):
                cm.pull_blocks(key, cache, [0], [0])
            with code(S.LLM_PARAM_INVALID):
                dd.query_register_mem_status(comm_id)
        finally:
            comms.close()

    def test_marks_the_cache_manager_linked(self, make_datadist):
        dd = make_datadist(CM_OPTS)
        dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(free_port(), free_port()))
        arr = np.zeros(64, np.uint8)
        with code(S.LLM_PARAM_INVALID):
            dd.cache_manager.register_cache(llm.CacheDesc(1, [64], llm.DataType.DT_UINT8),
                                            [int(arr.ctypes.data)], remote_accessible=True)

    def test_failed_after_link_total_time(self, make_datadist):
        dd = make_datadist({**CM_OPTS, "llm.LinkTotalTime": "1"})
        comm_id = dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(free_port(), free_port()))
        wait_for(lambda: dd.query_register_mem_status(comm_id) != llm.RegisterMemStatus.PREPARING)
        assert dd.query_register_mem_status(comm_id) == llm.RegisterMemStatus.FAILED
        dd.unlink(comm_id)

    def test_hccl_connect_timeout_is_the_fallback(self, make_datadist, monkeypatch):
        monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1")
        dd = make_datadist(CM_OPTS)
        comm_id = dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(free_port(), free_port()))
        wait_for(lambda: dd.query_register_mem_status(comm_id) == llm.RegisterMemStatus.FAILED,
                 timeout=5)

    def test_own_listener_serves_the_comm(self, make_datadist):
        """Without device_port, members listen on this instance's own listen port."""
        dd = make_datadist({**CM_OPTS, "llm.listenIpInfo": "127.0.0.1:0"})
        host, port = dd.listen_address
        dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(None, None))
        comms = dd._comms
        assert comms is not None and comms._listeners == {}  # no second listener
        assert dd.listen_address == (host, port)

    def test_types(self, make_datadist):
        dd = make_datadist(CM_OPTS)
        t = table(1, 2)
        for call in [
            lambda: dd.link(1, {PROMPT_ID: 0, DECODER_ID: 1}, t),
            lambda: dd.link("c", [(PROMPT_ID, 0), (DECODER_ID, 1)], t),
            lambda: dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, json.loads(t)),
            lambda: dd.link("c", {"1": 0, DECODER_ID: 1}, t),
            lambda: dd.link("c", {PROMPT_ID: "0", DECODER_ID: 1}, t),
            lambda: dd.query_register_mem_status("1"),
            lambda: dd.unlink(None),
        ]:
            with pytest.raises(TypeError):
                call()
        with pytest.raises(ValueError):
            dd.link("c", {PROMPT_ID: 0, -1: 1}, t)
        with pytest.raises(ValueError):
            dd.link("c", {PROMPT_ID: 0, DECODER_ID: -1}, t)

    def test_param_invalid(self, make_datadist):
        dd = make_datadist(CM_OPTS)
        t = table(1, 2, 3, 4, 5)
        for name, info, text in [
            ("", {PROMPT_ID: 0, DECODER_ID: 1}, t),
            ("x" * 128, {PROMPT_ID: 0, DECODER_ID: 1}, t),
            ("c", {PROMPT_ID: 0}, t),
            ("c", {PROMPT_ID: 0, 2: 1, 3: 2, 4: 3, 5: 4}, t),
            ("c", {DECODER_ID: 1, PROMPT_ID: 0}, t),  # ranks descending in dict order
            ("c", {PROMPT_ID: 0, DECODER_ID: 0}, t),  # duplicate rank
            ("c", {7: 0, DECODER_ID: 1}, t),  # this instance is not a member
            ("c", {PROMPT_ID: 0, DECODER_ID: 9}, t),  # rank not in the table
            ("c", {PROMPT_ID: 0, DECODER_ID: 1}, "{}"),
        ]:
            with code(S.LLM_PARAM_INVALID):
                dd.link(name, info, text)
        with code(S.LLM_PARAM_INVALID):
            dd.query_register_mem_status(12345)
        with code(S.LLM_PARAM_INVALID):
            dd.unlink(12345)

    def test_a_live_comm_name_is_already_linked(self, make_datadist):
        dd = make_datadist(CM_OPTS)
        t = table(free_port(), free_port())
        dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, t)
        with code(S.LLM_ALREADY_LINK):
            dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, t)

    def test_cache_manager_mode_only(self, make_datadist):
        dd = make_datadist({"llm.listenIpInfo": "127.0.0.1:0"})
        for call in [lambda: dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(1, 2)),
                     lambda: dd.query_register_mem_status(1), lambda: dd.unlink(1)]:
            with code(S.LLM_PARAM_INVALID):
                call()

    def test_not_initialized(self):
        dd = llm.LLMDataDist(llm.LLMRole.PROMPT, PROMPT_ID)
        for call in [lambda: dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(1, 2)),
                     lambda: dd.query_register_mem_status(1), lambda: dd.unlink(1)]:
            with pytest.raises(RuntimeError, match="not initialized"):
                call()

    def test_finalize_stops_linking_and_frees_the_port(self, make_datadist):
        ports = free_port(), free_port()
        dd = make_datadist(CM_OPTS)
        dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(*ports))
        time.sleep(0.1)
        dd.finalize()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", ports[0]))
