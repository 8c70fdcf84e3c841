"""Both ends of a ``link_clusters`` link can use it, and each end unlinks its own.

The original's rule (hicann/hixl examples/python/switch_role_sample.py, push_blocks_sample.py,
transfer_cache_async_sample.py): after one side links, the side it linked to pushes and pulls
to the linker's cluster id over that same link, and *both* sides call
``unlink_clusters(..., force=True)`` (the samples raise "unlink failed" unless both return
LLM_SUCCESS). A forced unlink of a cluster never linked returns (LLM_SUCCESS, [LLM_SUCCESS]).
Here: the linker opens a reverse channel (docs/protocol.md, "Reverse channels") and serves
the listener's requests on it.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import datadist as llm
from datadist.core.errors import NotLinked
from datadist.wire.protocol import local_name

from ._support import DECODER_ID, PROMPT_ID, code, units

pytestmark = pytest.mark.timeout(30)

S = llm.LLMStatusCode


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def one_way(make_side):
    """A listening PROMPT and a DECODER that never listens and links to it."""
    p = make_side(PROMPT_ID, remote_cache_accessible=True)
    d = make_side(DECODER_ID, listen=False, role=2, remote_cache_accessible=True)
    d.engine.link(PROMPT_ID, *p.engine.listen_address, 5.0)
    return p, d


class TestListenerUsesTheInboundLink:
    def test_push_and_pull_to_the_linker(self, one_way):
        p, d = one_way
        src, x = p.register(2, [4, 32], blocks=True, model_id=0, seed=1)
        _, y = d.register(2, [4, 32], blocks=True, model_id=0)
        key = llm.BlocksCacheKey(DECODER_ID, 0)
        p.cm.push_blocks(key, src, [0, 3], [2, 1])  # listener -> linker
        want = np.zeros_like(y)
        units(want, 4)[:, [2, 1]] = units(x, 4)[:, [0, 3]]
        np.testing.assert_array_equal(y, want)
        # and back: the listener pulls what the linker holds
        back, z = p.register(2, [4, 32], blocks=True)
        y[...] = np.random.default_rng(5).integers(0, 256, y.shape, dtype=np.uint8)
        p.cm.pull_blocks(key, back, [1, 2], [0, 3])
        want = np.zeros_like(z)
        units(want, 4)[:, [0, 3]] = units(y, 4)[:, [1, 2]]
        np.testing.assert_array_equal(z, want)

    def test_the_linker_still_pulls_over_its_control_channel(self, one_way):
        p, d = one_way
        _, x = p.register(2, [4, 32], blocks=True, model_id=0, seed=2)
        dst, y = d.register(2, [4, 32], blocks=True)
        d.cm.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 0), dst, [0, 1, 2, 3], [3, 2, 1, 0])
        np.testing.assert_array_equal(units(y, 4), units(x, 4)[:, ::-1])

    def test_each_end_unlinks_its_own(self, one_way):
        p, d = one_way
        src, _ = p.register(2, [4, 32], blocks=True, model_id=0, seed=1)
        d.register(2, [4, 32], blocks=True, model_id=0)
        p.engine.unlink(DECODER_ID, 1.0, force=True)  # the listener's end only
        with code(S.LLM_NOT_YET_LINK):
            p.cm.push_blocks(llm.BlocksCacheKey(DECODER_ID, 0), src, [0], [0])
        with pytest.raises(NotLinked):
            p.engine.unlink(DECODER_ID, 1.0, force=True)
        d.engine.unlink(PROMPT_ID, 1.0, force=True)
        assert not d.engine.has_links()

    def test_a_polite_unlink_by_the_linker_ends_the_listener_end_too(self, one_way):
        p, d = one_way
        assert p.engine.has_links()
        d.engine.unlink(PROMPT_ID, 1.0)  # Bye
        wait_for(lambda: not p.engine.has_links())  # switch_role may follow (the sample)
        with pytest.raises(NotLinked):
            p.engine.get_link(DECODER_ID)

    def test_a_polite_unlink_by_the_listener_says_bye_on_the_reverse_channel(self, one_way):
        p, d = one_way
        _, x = p.register(2, [4, 32], blocks=True, model_id=0, seed=4)
        dst, y = d.register(2, [4, 32], blocks=True)
        assert DECODER_ID in p.engine.reverse_ids()
        p.engine.unlink(DECODER_ID, 1.0)  # Bye: the linker answers Ok and stops serving
        wait_for(lambda: DECODER_ID not in p.engine.reverse_ids())  # the reverse channel is gone
        with pytest.raises(NotLinked):
            p.engine.get_link(DECODER_ID)
        assert d.engine.get_link(PROMPT_ID).cluster_id == PROMPT_ID  # the linker keeps its end
        d.cm.pull_blocks(llm.BlocksCacheKey(PROMPT_ID, 0), dst, [1], [2])  # its own end works
        np.testing.assert_array_equal(units(y, 4)[:, 2], units(x, 4)[:, 1])

    def test_a_linker_gone_without_a_word_fails_the_listener_transfer(self, one_way):
        p, d = one_way
        src, _ = p.register(2, [4, 32], blocks=True, model_id=0, seed=1)
        d.register(2, [4, 32], blocks=True, model_id=0)
        d.engine.close()
        with code(S.LLM_LINK_FAILED):
            p.cm.push_blocks(llm.BlocksCacheKey(DECODER_ID, 0), src, [0], [0])
        wait_for(lambda: not p.engine.has_links())

    @staticmethod
    def _link_twice_at_once(p, d) -> list[BaseException | None]:
        """``d`` links to ``p`` from two threads at once: each link's outcome (None: linked)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(d.engine.link, PROMPT_ID, *p.engine.listen_address, 5.0)
                       for _ in range(2)]
            return [f.exception(10) for f in futures]

    def test_two_links_to_one_cluster_at_once(self, make_side):
        """One link per cluster: one of two concurrent links fails, and the reverse channel
        the listener keeps is the surviving link's (it can push over it)."""
        from datadist.core.errors import AlreadyLinked, LinkFailed

        p = make_side(PROMPT_ID, remote_cache_accessible=True)
        d = make_side(DECODER_ID, listen=False, role=2, remote_cache_accessible=True)
        outcomes = self._link_twice_at_once(p, d)
        assert sum(e is None for e in outcomes) == 1, outcomes
        assert all(e is None or isinstance(e, (AlreadyLinked, LinkFailed)) for e in outcomes)
        src, x = p.register(2, [4, 32], blocks=True, seed=6)
        _, y = d.register(2, [4, 32], blocks=True, model_id=0)
        p.cm.push_blocks(llm.BlocksCacheKey(DECODER_ID, 0), src, [3], [0])
        np.testing.assert_array_equal(units(y, 4)[:, 0], units(x, 4)[:, 3])

    def test_the_loser_of_two_links_at_once_is_already_link(self, make_side):
        from datadist.core.errors import AlreadyLinked

        p = make_side(PROMPT_ID, remote_cache_accessible=True)
        d = make_side(DECODER_ID, listen=False, role=2, remote_cache_accessible=True)
        outcomes = self._link_twice_at_once(p, d)
        assert sum(e is None for e in outcomes) == 1, outcomes
        assert all(e is None or isinstance(e, AlreadyLinked) for e in outcomes), outcomes

    def test_both_linked_each_other_own_links_win(self, make_side):
        """The `pair` situation: each side made a link; transfers use one's own."""
        p, d = make_side(PROMPT_ID), make_side(DECODER_ID, role=2)
        d.engine.link(PROMPT_ID, *p.engine.listen_address, 5.0)
        p.engine.link(DECODER_ID, *d.engine.listen_address, 5.0)
        assert not p.engine.get_link(DECODER_ID).inbound
        d.engine.unlink(PROMPT_ID, 1.0, force=True)
        assert p.engine.get_link(DECODER_ID) is not None  # p's own link is untouched


class TestFacade:
    def test_forced_unlink_of_a_never_linked_cluster_is_success(self, make_datadist):
        dd = make_datadist({"llm.EnableCacheManager": "1", "llm.listenIpInfo": "127.0.0.1:0"})
        c = llm.LLMClusterInfo()
        c.remote_cluster_id = 77
        assert dd.unlink_clusters([c], 1000, force=True) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        # without force the original dials the listener, so it needs one remote address
        assert dd.unlink_clusters([c], 1000) == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID])
        c.append_remote_ip_info("127.0.0.1", dd.listen_address[1])  # a listener that answers
        assert dd.unlink_clusters([c], 1000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])

    def test_listener_unlinks_the_inbound_link(self, make_datadist, make_side):
        dd = make_datadist({"llm.EnableCacheManager": "1", "llm.listenIpInfo": "127.0.0.1:0"})
        d = make_side(DECODER_ID, listen=False, role=2)
        d.engine.link(PROMPT_ID, *dd.listen_address, 5.0)
        c = llm.LLMClusterInfo()
        c.remote_cluster_id = DECODER_ID
        with code(S.LLM_EXIST_LINK):
            dd.switch_role(llm.LLMRole.DECODER)
        assert DECODER_ID in dd.engine.reverse_ids()
        assert dd.unlink_clusters([c], 1000, force=True) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        wait_for(lambda: DECODER_ID not in dd.engine.reverse_ids())  # the reverse channel ends
        assert [link.cluster_id for link in d.engine.links()] == [PROMPT_ID]  # the linker's stays
        d.engine.unlink(PROMPT_ID, 1.0, force=True)
        wait_for(lambda: not dd.engine.has_links())
        dd.switch_role(llm.LLMRole.DECODER)


class TestWire:
    """The reverse channel as another implementation sees it (docs/protocol.md, "Reverse
    channels"), with raw frames: a client that never listens says HELLO with
    FEATURE_REVERSE, and then *answers* the server's WRITE on that connection."""

    @staticmethod
    def _frame(sock):
        from datadist.wire import protocol as p

        head = b""
        while len(head) < p.HEADER_SIZE:
            head += sock.recv(p.HEADER_SIZE - len(head))
        h = p.decode_header(head)
        body = b""
        while len(body) < h.length:
            body += sock.recv(h.length - len(body))
        return h.request_id, p.decode_payload(h.type, body)

    def test_a_raw_client_serves_the_servers_write(self, make_side):
        import os
        import socket
        import threading

        from datadist.core.config import HostIdentity
        from datadist.wire import protocol as p

        server = make_side(PROMPT_ID, remote_cache_accessible=True)
        src, x = server.register(1, [4, 16], blocks=True, seed=8)
        me = HostIdentity.current()
        # The control channel first: its Welcome carries the link token the reverse
        # channel must echo (docs/protocol.md, "Reverse channels").
        control = socket.create_connection(server.engine.listen_address, timeout=5)
        control.sendall(p.encode(p.Hello(DECODER_ID, 2, os.getpid() + 1, me.pid_ns,
                                         me.boot_id), 1))
        _, cwelcome = self._frame(control)
        assert cwelcome.features & p.FEATURE_TOKEN
        token = p.split_token(cwelcome.proof, cwelcome.features)[1]
        assert len(token) == p.LINK_TOKEN_BYTES
        sock = socket.create_connection(server.engine.listen_address, timeout=5)
        try:
            sock.sendall(p.encode(p.Hello(DECODER_ID, 2, os.getpid() + 1, me.pid_ns,
                                          me.boot_id, p.FEATURE_REVERSE | p.FEATURE_TOKEN,
                                          token), 1))
            rid, welcome = self._frame(sock)
            assert rid == 1 and isinstance(welcome, p.Welcome)
            assert welcome.features & p.FEATURE_REVERSE  # the server takes reverse channels
            assert server.engine.get_link(DECODER_ID).inbound
            errors = []

            def push():  # local block 1 into the client's block 2 (public API, core-planned)
                try:
                    server.cm.push_blocks(llm.BlocksCacheKey(DECODER_ID, 0), src, [1], [2])
                except Exception as e:  # noqa: BLE001 - checked below
                    errors.append(e)

            t = threading.Thread(target=push)
            t.start()
            rid, write = self._frame(sock)  # the server is the requester now
            assert isinstance(write, p.Write)
            assert list(write.tensors) == [0] and list(write.offsets) == [32]
            assert list(write.lengths) == [16]
            sock.sendall(p.encode(p.Ok(), rid))  # go ahead
            data = b""
            while len(data) < 16:
                data += sock.recv(16 - len(data))
            assert data == x[0, 16:32].tobytes()  # the server's block 1
            sock.sendall(p.encode(p.Ok(), rid))  # landed
            t.join(5)
            assert not errors
        finally:
            sock.close()
            control.close()


    def test_a_client_that_serves_eager_writes_gets_the_push_in_one_trip(self, make_side):
        """A reverse HELLO with FEATURE_EAGER_WRITE (the client serves WRITE with flag EAGER
        on this channel, as datadist's linker does): the server's push comes as one WRITE
        with flag EAGER and its bytes right behind it, answered by one OK (no go-ahead)."""
        import os
        import socket
        import threading

        from datadist.core.config import HostIdentity
        from datadist.wire import protocol as p

        server = make_side(PROMPT_ID, remote_cache_accessible=True)
        src, x = server.register(1, [4, 16], blocks=True, seed=9)
        me = HostIdentity.current()
        control = socket.create_connection(server.engine.listen_address, timeout=5)
        control.sendall(p.encode(p.Hello(DECODER_ID, 2, os.getpid() + 1, me.pid_ns,
                                         me.boot_id), 1))
        _, cwelcome = self._frame(control)
        token = p.split_token(cwelcome.proof, cwelcome.features)[1]
        sock = socket.create_connection(server.engine.listen_address, timeout=5)
        try:
            sock.sendall(p.encode(p.Hello(
                DECODER_ID, 2, os.getpid() + 1, me.pid_ns, me.boot_id,
                p.FEATURE_REVERSE | p.FEATURE_TOKEN | p.FEATURE_EAGER_WRITE, token), 1))
            _, welcome = self._frame(sock)
            assert isinstance(welcome, p.Welcome)
            errors = []

            def push():  # local blocks 1 and 3 into the client's blocks 2 and 0
                try:
                    server.cm.push_blocks(llm.BlocksCacheKey(DECODER_ID, 0), src, [1, 3],
                                          [2, 0])
                except Exception as e:  # noqa: BLE001 - checked below
                    errors.append(e)

            t = threading.Thread(target=push)
            t.start()
            rid, write = self._frame(sock)
            assert isinstance(write, p.Write) and write.flags == p.WRITE_EAGER
            total = int(sum(write.lengths)) * len(write.tensors)
            assert total == 32
            data = b""
            while len(data) < total:  # sent at once: no go-ahead was asked for
                data += sock.recv(total - len(data))
            by_offset = dict(zip((int(o) for o in write.offsets),
                                 (int(n) for n in write.lengths), strict=True))
            landed, at = {}, 0
            for off, n in by_offset.items():
                landed[off] = data[at:at + n]
                at += n
            assert landed[32] == x[0, 16:32].tobytes() and landed[0] == x[0, 48:64].tobytes()
            sock.sendall(p.encode(p.Ok(), rid))  # landed: the one answer
            t.join(5)
            assert not t.is_alive() and not errors
        finally:
            sock.close()
            control.close()


def test_stopping_to_listen_closes_the_local_channel_too(make_side):
    """switch_role away from listening (engine.stop_listening) leaves no way in: not the TCP
    listener and not the same-host local channel (whose name any local process can compute
    from our pid); listening again opens both."""
    import os
    import socket

    p = make_side(PROMPT_ID)

    def local_open() -> bool:  # the name docs/protocol.md gives the local channel
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(local_name(os.getpid(), PROMPT_ID))
            return True
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        finally:
            s.close()

    assert local_open()
    p.engine.stop_listening()
    assert p.engine.listen_address is None and not local_open()
    p.engine.start_listening("127.0.0.1", 0)
    assert local_open()
    d = make_side(DECODER_ID, listen=False, role=2)
    d.engine.link(PROMPT_ID, *p.engine.listen_address, 5.0)
    assert d.engine.get_link(PROMPT_ID).path_name in ("cma", "shm")  # the same-host path
