"""core/transfers.py: the Python engine's pool of transfer threads, without sockets."""

from __future__ import annotations

import threading

import pytest

from datadist.core.errors import Closed
from datadist.core.transfers import Job, Transfer, TransferPool

pytestmark = pytest.mark.timeout(30)


def _job(body, log, name):
    t = Transfer(name)
    return t, Job(t, body, lambda err: log.append((name, err)))


def test_threads_start_only_when_needed_and_stay_bounded():
    pool = TransferPool(3, "test-xfer")
    assert pool.threads == 0  # nothing before the first transfer
    gate = threading.Event()
    log: list = []
    jobs = [_job(gate.wait, log, str(i)) for i in range(50)]
    before = threading.active_count()
    for _, job in jobs:
        pool.submit(job)
    assert pool.threads == 3
    assert threading.active_count() - before == 3
    gate.set()
    for t, _ in jobs:
        assert t.wait(10)
        assert t.error() is None
    assert len(log) == 50  # finish ran once per job
    pool.close()
    pool.join(5)


def test_one_idle_thread_serves_sequential_jobs():
    pool = TransferPool(4)
    for i in range(5):
        t, job = _job(lambda: None, [], str(i))
        pool.submit(job)
        assert t.wait(10)
    assert pool.threads == 1
    pool.close()
    pool.join(5)


def test_a_failing_body_is_the_transfers_error_and_finish_sees_it():
    pool = TransferPool(1)
    log: list = []
    boom = RuntimeError("boom")

    def body():
        raise boom

    t, job = _job(body, log, "x")
    assert t.error() is None and not t.done()
    pool.submit(job)
    assert t.wait(10)
    assert t.error() is boom
    assert log == [("x", boom)]
    pool.close()
    pool.join(5)


def test_close_fails_queued_jobs_and_lets_the_running_one_finish():
    pool = TransferPool(1)
    started, gate = threading.Event(), threading.Event()
    log: list = []

    def running():
        started.set()
        gate.wait()

    first, job = _job(running, log, "running")
    pool.submit(job)
    assert started.wait(10)
    queued = [_job(lambda: None, log, f"q{i}") for i in range(3)]
    for _, j in queued:
        pool.submit(j)
    pool.close()
    for t, _ in queued:
        assert t.done()
        assert isinstance(t.error(), Closed)
    assert not first.done()
    gate.set()
    pool.join(5)
    assert first.done() and first.error() is None
    late, j = _job(lambda: None, log, "late")
    pool.submit(j)  # after close: failed at once, nothing started
    assert isinstance(late.error(), Closed)
    assert pool.threads == 1
