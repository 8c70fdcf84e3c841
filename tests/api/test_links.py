"""Two-sided links: ``link`` / ``query_register_mem_status`` / ``unlink`` and the rank table.

The state machine (core/comm.py) is driven with two engines in this process; the facade
(``LLMDataDist.link``) with a real LLMDataDist here and the other member as a bare engine,
also here. The two-process version is examples/flow1 (run by test_examples.py).
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import datadist as llm
from datadist.api import rank_table
from datadist.core.comm import CommManager, CommState, Member
from datadist.core.errors import AlreadyLinked, InvalidArgument, LinkFailed, NotLinked

from ._support import DECODER_ID, PROMPT_ID, code, units

pytestmark = pytest.mark.timeout(30)

S = llm.LLMStatusCode
CM_OPTS = {"llm.EnableCacheManager": "1"}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ipv6_loopback() -> bool:
    try:
        free_port("::1")
        return socket.has_ipv6
    except OSError:
        return False


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


def in_thread(fn, *args):
    """Run ``fn(*args)`` on a thread; ``.result()`` waits for its return or raise."""
    return _POOL.submit(fn, *args)


_POOL = ThreadPoolExecutor(8)


def link_both(ca, cb, ma, mb, timeout=10.0, name="c"):
    """Both members link at once (link blocks until the other joins): their comm ids."""
    fa = in_thread(ca.link, name, ma, [mb], timeout)
    idb = cb.link(name, mb, [ma], timeout)
    return fa.result(timeout + 5), idb


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
        assert ranks[0] == rank_table.RankEntry(0, "127.0.0.1", 26000, 0)
        assert ranks[1] == rank_table.RankEntry(1, "127.0.0.1", None, 1)

    def test_several_servers_and_int_fields(self):
        doc = {"version": "1.0", "server_list": [
            {"device": [{"device_ip": "10.0.0.1", "rank_id": 0}]},
            {"device": [{"device_ip": "10.0.0.2", "rank_id": 1, "device_port": "7000"}]}]}
        ranks = rank_table.parse(json.dumps(doc))
        assert ranks[1].device_ip == "10.0.0.2" and ranks[1].device_port == 7000

    def test_port_rule(self):
        given = rank_table.RankEntry(3, "h", 1234, 5)
        plain = rank_table.RankEntry(3, "h", None, 5)
        bare = rank_table.RankEntry(3, "h", None)
        assert rank_table.port_of(given) == 1234  # device_port overrides
        assert rank_table.port_of(plain) == rank_table.DEFAULT_BASE_PORT + 5  # device id
        assert rank_table.port_of(bare) == rank_table.DEFAULT_BASE_PORT + 3  # no device_id

    def test_vllm_ascend_table_gives_workers_on_one_host_distinct_ports(self):
        """vllm-ascend's LLMDataDistCMgrConnector builds rank tables from device_id,
        device_ip, super_device_id and rank_id only (no listen_ip_info, no device_port):
        workers sharing one host address must still get distinct ports."""
        devices = [{"device_id": str(d), "device_ip": "10.0.0.1", "super_device_id": "0",
                    "rank_id": str(r)} for r, d in enumerate([0, 1, 2, 3])]
        doc = {"version": "1.2", "server_count": "1", "status": "completed",
               "server_list": [{"server_id": "10.0.0.1", "device": devices}]}
        ranks = rank_table.parse(json.dumps(doc))
        ports = {rank_table.port_of(e) for e in ranks.values()}
        assert len(ports) == 4
        assert ranks[2].device_id == 2

    def test_ipv6_device_ip_is_taken_in_short_form(self):
        """HCCL rank tables may carry IPv6 device ips (issue 22 item 8; the original's
        CheckIp takes IPv4 or IPv6, hicann/hixl src/hixl/common/hixl_utils.cc): kept in short
        form, so that two spellings of one address are one address."""
        ranks = rank_table.parse(table(26000, 26001, ip="0:0:0:0:0:0:0:1"))
        assert ranks[0].device_ip == "::1" and ranks[1].device_port == 26001

    @pytest.mark.parametrize("text", [
        "not json", "[]", json.dumps({"version": "2.0", "server_list": []}),
        json.dumps({"version": "1.0"}), json.dumps({"version": "1.0", "server_list": [{}]}),
        json.dumps({"version": "1.0", "server_list": [{"device": [{"rank_id": "0"}]}]}),
        json.dumps({"version": "1.0", "server_list": [{"device": [
            {"rank_id": "0", "device_ip": "not-an-ip"}]}]}),
        json.dumps({"version": "1.0", "server_list": [{"device": [
            {"rank_id": "x", "device_ip": "1.2.3.4"}]}]}),
        table(1, 2, ip="[::1]"), table(1, 2, ip="::1::2"), table(1, 2, ip="fe80::1%eth0"),
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
    def test_link_blocks_until_every_member_joined_then_ok(self, comm_pair):
        """LLM-DataDist's link returns only once the communicator is up on every rank
        (hixl comm_link_manager.cc, CommLinkManager::Link: HcclCommInitClusterInfoMemConfig
        under the process lock)."""
        a, b, ca, cb, ma, mb = comm_pair
        fa = in_thread(ca.link, "c", ma, [mb], 10.0)
        time.sleep(0.3)
        assert not fa.done()  # still waiting for b
        assert a.engine.links() == []  # nothing usable before every member joined
        with pytest.raises(NotLinked):
            a.engine.get_link(DECODER_ID)
        idb = cb.link("c", mb, [ma], 10.0)
        ida = fa.result(10)
        assert ca.status(ida) == cb.status(idb) == CommState.OK
        assert [link.cluster_id for link in a.engine.links()] == [DECODER_ID]
        assert [link.cluster_id for link in b.engine.links()] == [PROMPT_ID]

    def test_data_moves_both_ways_after_ok(self, comm_pair):
        a, b, ca, cb, ma, mb = comm_pair
        src_a, x = a.register(2, [4, 32], blocks=True, model_id=0, seed=1)
        src_b, y = b.register(2, [4, 32], blocks=True, model_id=0, seed=2)
        dst_a, x2 = a.register(2, [4, 32], blocks=True)
        dst_b, y2 = b.register(2, [4, 32], blocks=True)
        link_both(ca, cb, ma, mb)
        # through the public API (the core plans the pulls): remote blocks 0, 3 -> local 2, 1
        b.cm.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 0), dst_b, [0, 3], [2, 1])
        a.cm.pull_blocks(llm.BlocksCacheKey(DECODER_ID, 0), dst_a, [0, 3], [2, 1])
        np.testing.assert_array_equal(units(y2, 4)[:, [2, 1]], units(x, 4)[:, [0, 3]])
        np.testing.assert_array_equal(units(x2, 4)[:, [2, 1]], units(y, 4)[:, [0, 3]])

    def test_failed_when_a_member_never_comes(self, comm_pair):
        a, _, ca, _, ma, mb = comm_pair
        with pytest.raises(LinkFailed, match="not reachable"):
            ca.link("c", ma, [mb], 0.5)
        assert a.engine.links() == []
        assert ca._comms == {}  # no comm id was handed out
        # the listener it started is gone: its port can be bound again
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ma.host, ma.port))

    def test_unlink_drops_its_links_and_tells_the_peer(self, comm_pair):
        a, b, ca, cb, ma, mb = comm_pair
        ida, _ = link_both(ca, cb, ma, mb)
        ca.unlink(ida)
        assert a.engine.links() == []
        wait_for(lambda: all(p.cluster_id != PROMPT_ID for p in b.engine.inbound_peers()))
        with pytest.raises(NotLinked):  # the original's Unlink: LLM_NOT_YET_LINK
            ca.status(ida)
        with pytest.raises(NotLinked):
            ca.unlink(ida)

    def test_an_existing_link_is_used_and_left_alone(self, comm_pair):
        a, b, ca, cb, ma, mb = comm_pair
        b.engine.start_listening(mb.host, mb.port)  # b serves its member address itself
        a.engine.link(DECODER_ID, mb.host, mb.port, 5.0)  # as link_clusters would
        ida, _ = link_both(ca, cb, ma, mb)
        ca.unlink(ida)
        assert [link.cluster_id for link in a.engine.links()] == [DECODER_ID]

    def test_two_links_at_once_in_one_process(self, make_side):
        """MindIE links to many peers at once; the original serialises links inside a
        process (CommLinkManager::Link holds mutex_), so two calls on one member address
        never race for its listener ("Address already in use")."""
        a = make_side(PROMPT_ID, listen=False)
        b, c = make_side(DECODER_ID, listen=False), make_side(3, listen=False)
        ma = Member(PROMPT_ID, 0, "127.0.0.1", free_port())
        mb = Member(DECODER_ID, 1, "127.0.0.1", free_port())
        mc = Member(3, 2, "127.0.0.1", free_port())
        ca, cb, cc = CommManager(a.engine), CommManager(b.engine), CommManager(c.engine)
        try:
            futures = [in_thread(ca.link, "x", ma, [mb], 10.0),
                       in_thread(ca.link, "y", ma, [mc], 10.0),
                       in_thread(cb.link, "x", mb, [ma], 10.0),
                       in_thread(cc.link, "y", mc, [ma], 10.0)]
            ids = [f.result(15) for f in futures]
            assert ca.status(ids[0]) == ca.status(ids[1]) == CommState.OK
            assert sorted(link.cluster_id for link in a.engine.links()) == [DECODER_ID, 3]
        finally:
            for m in (ca, cb, cc):
                m.close()

    def test_duplicate_name_and_members(self, comm_pair):
        _, _, ca, cb, ma, mb = comm_pair
        link_both(ca, cb, ma, mb)
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
        key = llm.BlocksCacheKey(DECODER_ID, 0)
        with code(S.LLM_NOT_YET_LINK):
            cm.pull_blocks(key, cache, [0], [0])
        try:
            peer = in_thread(comms.link, "pd_comm", Member(DECODER_ID, 1, "127.0.0.1", ports[1]),
                             [Member(PROMPT_ID, 0, "127.0.0.1", ports[0])], 10.0)
            comm_id = dd.link("pd_comm", {PROMPT_ID: 0, DECODER_ID: 1},
                              table(*ports, version="1.2"))
            assert isinstance(comm_id, int)
            peer.result(10)
            assert dd.query_register_mem_status(comm_id) == llm.RegisterMemStatus.OK
            cm.pull_blocks(key, cache, [1, 2, 7], [0, 5, 6])
            want = np.zeros_like(mine)
            units(want, 8)[:, [0, 5, 6]] = units(theirs, 8)[:, [1, 2, 7]]
            np.testing.assert_array_equal(mine, want)
            with code(S.LLM_EXIST_LINK):
                dd.switch_role(llm.LLMRole.DECODER)
            dd.unlink(comm_id)
            with code(S.LLM_NOT_YET_LINK):
                cm.pull_blocks(key, cache, [0], [0])
            with code(S.LLM_NOT_YET_LINK):  # CommLinkManager::QueryRegisterMemStatus
                dd.query_register_mem_status(comm_id)
        finally:
            comms.close()

    def test_link_over_ipv6(self, make_datadist, make_side):
        """A rank table whose device ips are IPv6 (issue 22 item 8): the instance's own
        listener on [::1] serves its rank (written 0:0:...:1 in the table), the other member
        is reached at ::1, and data moves."""
        if not _ipv6_loopback():
            pytest.skip("no IPv6 loopback on this host")
        dd = make_datadist({**CM_OPTS, "llm.listenIpInfo": "[::1]:0"})
        host, port = dd.listen_address
        assert host == "::1"
        other_port = free_port("::1")
        desc = llm.CacheDesc(2, [8, 16], llm.DataType.DT_UINT8)
        mine = np.zeros((2, 128), np.uint8)
        cache = dd.cache_manager.register_blocks_cache(
            desc, [int(mine[i].ctypes.data) for i in range(2)], llm.BlocksCacheKey(PROMPT_ID, 0))
        _, theirs, comms = member_side(make_side, other_port)
        try:
            peer = in_thread(comms.link, "c", Member(DECODER_ID, 1, "::1", other_port),
                             [Member(PROMPT_ID, 0, "::1", port)], 10.0)
            comm_id = dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1},
                              table(port, other_port, ip="0:0:0:0:0:0:0:1"))
            peer.result(10)
            assert dd._comms is not None and dd._comms._listeners == {}  # its own listener
            dd.cache_manager.pull_blocks(llm.BlocksCacheKey(DECODER_ID, 0), cache, [3], [1])
            np.testing.assert_array_equal(units(mine, 8)[:, 1], units(theirs, 8)[:, 3])
            dd.unlink(comm_id)
        finally:
            comms.close()

    def test_marks_the_cache_manager_linked_only_on_success(self, make_datadist, make_side):
        """The original calls set_is_call_linked after handle_llm_status: a failed link
        leaves remote-accessible registration open, a successful one closes it."""
        dd = make_datadist({**CM_OPTS, "llm.LinkTotalTime": "1"})
        ports = free_port(), free_port()
        arr = np.zeros(64, np.uint8)
        desc = llm.CacheDesc(1, [64], llm.DataType.DT_UINT8)
        with code(S.LLM_LINK_FAILED):
            dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(*ports))
        dd.cache_manager.register_cache(desc, [int(arr.ctypes.data)], remote_accessible=True)
        _, _, comms = member_side(make_side, ports[1])
        try:
            peer = in_thread(comms.link, "c", Member(DECODER_ID, 1, "127.0.0.1", ports[1]),
                             [Member(PROMPT_ID, 0, "127.0.0.1", ports[0])], 10.0)
            dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(*ports))
            peer.result(10)
        finally:
            comms.close()
        with code(S.LLM_PARAM_INVALID):
            dd.cache_manager.register_cache(desc, [int(arr.ctypes.data)], remote_accessible=True)

    def test_link_failed_after_link_total_time(self, make_datadist):
        """The original's link returns LLM_LINK_FAILED itself when a member never joins
        (CommLinkManager::Link); no comm id is handed out."""
        dd = make_datadist({**CM_OPTS, "llm.LinkTotalTime": "1"})
        t0 = time.monotonic()
        with code(S.LLM_LINK_FAILED):
            dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(free_port(), free_port()))
        assert 0.9 < time.monotonic() - t0 < 5
        assert dd._comms is not None and dd._comms._comms == {}

    def test_hccl_connect_timeout_is_the_fallback(self, make_datadist, monkeypatch):
        monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1")
        dd = make_datadist(CM_OPTS)
        t0 = time.monotonic()
        with code(S.LLM_LINK_FAILED):
            dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(free_port(), free_port()))
        assert time.monotonic() - t0 < 5

    def test_own_listener_serves_the_comm(self, make_datadist, make_side):
        """A member whose port is the instance's own listener uses it: no second one."""
        dd = make_datadist({**CM_OPTS, "llm.listenIpInfo": "127.0.0.1:0"})
        host, port = dd.listen_address
        other_port = free_port()
        _, _, comms = member_side(make_side, other_port)
        try:
            peer = in_thread(comms.link, "c", Member(DECODER_ID, 1, "127.0.0.1", other_port),
                             [Member(PROMPT_ID, 0, "127.0.0.1", port)], 10.0)
            dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(port, other_port))
            peer.result(10)
            assert dd._comms is not None and dd._comms._listeners == {}  # no second listener
            assert dd.listen_address == (host, port)
        finally:
            comms.close()

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
        ]:
            with code(S.LLM_PARAM_INVALID):
                dd.link(name, info, text)

    def test_a_table_that_cannot_link_is_link_failed(self, make_datadist):
        # hixl comm_link_manager.cc CommLinkManager::Link: the table goes to HCCL
        # (HcclCommInitClusterInfoMemConfig), whose refusal is LLM_LINK_FAILED; here the
        # table is read first, its faults named, nothing dialled.
        dd = make_datadist(CM_OPTS)
        for info, text in [
            ({PROMPT_ID: 0, DECODER_ID: 9}, table(1, 2)),  # rank not in the table
            ({PROMPT_ID: 0, DECODER_ID: 1}, "{}"),
            ({PROMPT_ID: 0, DECODER_ID: 1}, "not json"),
            ({PROMPT_ID: 0, DECODER_ID: 1}, '{"server_list":[{"device":[{}]}]}'),
        ]:
            with pytest.raises(llm.LLMException, match="rank_table",
                               check=lambda e: e.status_code is S.LLM_LINK_FAILED):
                dd.link("c", info, text)

    def test_unknown_comm_ids_are_not_yet_link(self, make_datadist):
        """CommLinkManager::Unlink / QueryRegisterMemStatus: LLM_NOT_YET_LINK."""
        dd = make_datadist(CM_OPTS)
        with code(S.LLM_NOT_YET_LINK):
            dd.query_register_mem_status(12345)
        with code(S.LLM_NOT_YET_LINK):
            dd.unlink(12345)

    def test_a_live_comm_name_is_already_linked(self, make_datadist, make_side):
        dd = make_datadist(CM_OPTS)
        ports = free_port(), free_port()
        _, _, comms = member_side(make_side, ports[1])
        try:
            peer = in_thread(comms.link, "c", Member(DECODER_ID, 1, "127.0.0.1", ports[1]),
                             [Member(PROMPT_ID, 0, "127.0.0.1", ports[0])], 10.0)
            dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(*ports))
            peer.result(10)
            with code(S.LLM_ALREADY_LINK):
                dd.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, table(*ports))
        finally:
            comms.close()

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
        linking = in_thread(dd.link, "c", {PROMPT_ID: 0, DECODER_ID: 1}, table(*ports))
        time.sleep(0.3)
        dd.finalize()
        with pytest.raises(llm.LLMException):
            linking.result(5)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", ports[0]))
