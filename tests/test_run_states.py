"""The session's state machine for one cell, on an in-process engine (tests/fake_backend.py).

What a cell's wait decides (stop the others after a failure, give up on ranks that ignore
an interrupt, count a silent rank lost, restart dead workers before the next cell) in
seconds, and for timings a real cluster cannot be made to produce on demand. The same
cases on real ipyparallel and Dask clusters are in test_failures and test_distribute.
"""

import gc
import os
import signal
import threading
import time
import weakref

import pytest

from fake_backend import Died, installed
from jupyter_scale.errors import CellTimeout, ClusterError, RemoteError, WorkerDied
from jupyter_scale.run import CellRun
from jupyter_scale.session import ScaleSession


@pytest.fixture
def fake(monkeypatch):
    with installed(monkeypatch) as engine:
        session = ScaleSession(namespace={})
        session.backend_name = "fake"
        session.abort_grace, session.stop_deadline, session.poll_interval = 0.05, 1.0, 0.01
        session.heartbeat_interval, session.silence_limit = 0.1, 0.5
        try:
            yield session, engine
        finally:
            session.stop()
            engine.scripts = {}


def sleeper(seconds, seen=None):
    def script(r):
        try:
            r.sleep(seconds)
        except KeyboardInterrupt:
            if seen is not None:
                seen.append(r.rank)
            raise
    return script


def test_a_failed_rank_is_named_and_the_other_is_stopped_after_the_grace(fake):
    session, engine = fake
    stopped = []

    def fails(r):
        time.sleep(0.1)
        raise ValueError("bad batch")

    engine.scripts = {0: sleeper(60, stopped), 1: fails}
    with pytest.raises(RemoteError) as caught:
        session.run("pass", workers=2)
    assert str(caught.value) == "rank 1 failed: ValueError: bad batch (then ranks [0] stopped)"
    assert type(caught.value) is RemoteError and stopped == [0]  # interrupted, not waited out
    assert session.runs[-1].status == "failed" and session.runs[-1].failed_rank == 1
    engine.scripts = {}
    session.run("pass")  # the workers are reusable
    assert engine.starts == 1


def test_a_worker_that_dies_fails_the_cell_and_the_next_cell_restarts_the_cluster(fake, capsys):
    session, engine = fake

    def dies(r):
        time.sleep(0.1)
        raise Died

    engine.scripts = {0: sleeper(60), 1: dies}
    with pytest.raises(WorkerDied) as caught:
        session.run("pass", workers=2)
    assert caught.value.rank == 1 and "its fake worker died" in str(caught.value)
    engine.scripts = {}
    session.run("pass")
    assert "the worker of rank(s) [1] is gone; restarting the cluster with 2 workers" in capsys.readouterr().out
    assert engine.starts == 2


def test_a_timeout_names_the_rank_the_other_waited_for(fake):
    session, engine = fake
    engine.scripts = {0: lambda r: r.wait_in_collective("all_reduce", 60), 1: sleeper(60)}
    with pytest.raises(CellTimeout) as caught:
        session.run("pass", workers=2, timeout=0.5)
    # Rank 0 ignores interrupts (as in a collective): the abort through the group's store freed it.
    assert str(caught.value) == ("still running after --timeout 0.5 s: rank(s) [1] never reached the all_reduce "
                                 "that rank(s) [0] waited in")
    assert session.runs[-1].status == "timed out"


def test_the_users_interrupt_stops_every_rank_and_the_workers_stay(fake):
    session, engine = fake
    stopped = []
    engine.scripts = {0: sleeper(60, stopped), 1: sleeper(60, stopped)}
    interrupt = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    interrupt.start()
    try:
        with pytest.raises(KeyboardInterrupt, match=r"ranks \[0, 1\] stopped and are ready for the next cell"):
            session.run("pass", workers=2)
    finally:
        interrupt.cancel()
    assert sorted(stopped) == [0, 1] and session.runs[-1].status == "interrupted"
    engine.scripts = {}
    session.run("pass")
    assert engine.starts == 1  # not restarted


def test_ranks_that_ignore_the_interrupt_are_given_up_and_replaced_by_the_next_cell(fake, capsys):
    session, engine = fake

    def deaf(r):
        time.sleep(3)  # not the cell's interruptible sleep: a rank stuck in C code

    engine.scripts = {0: deaf, 1: deaf}
    interrupt = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    interrupt.start()
    try:
        with pytest.raises(ClusterError) as caught:
            session.run("pass", workers=2)
    finally:
        interrupt.cancel()
    assert str(caught.value) == ("ranks [0, 1] did not stop within 1 s of being interrupted; the next "
                                 "%%distribute restarts the workers")
    engine.scripts = {}
    session.run("pass")
    assert "the worker of rank(s) [0, 1] is gone; restarting" in capsys.readouterr().out
    assert engine.starts == 2


def test_a_rank_that_goes_silent_is_counted_lost(fake):
    session, engine = fake

    def leaves_the_network(r):
        time.sleep(0.3)  # heard from: heartbeats every 0.1 s
        r.go_silent()
        time.sleep(4)

    engine.scripts = {0: sleeper(60), 1: leaves_the_network}
    with pytest.raises(WorkerDied) as caught:
        session.run("pass", workers=2)
    assert caught.value.rank == 1
    assert "nothing heard from it" in str(caught.value) and "for 2.2 s" in str(caught.value)


def test_output_is_labelled_by_rank_and_reports_arrive(fake, capsys):
    session, engine = fake

    def talks(r):
        r.print(f"hello from {r.rank}\npartial")
        r.report(step=0, loss=1.5 + r.rank)

    engine.scripts = {0: talks, 1: talks}
    record = session.run("pass", workers=2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0\n" in out and "[rank 1] hello from 1\n" in out
    assert "[rank 1] partial\n" in out  # a line without its end, shown when the cell ends
    assert sorted(p["loss"] for p in record.metrics) == [1.5, 2.5] and record.lost_events == 0


def test_a_fault_in_the_kernels_wait_stops_every_rank_before_the_cell_fails(fake, monkeypatch):
    session, engine = fake
    stopped = []
    engine.scripts = {0: sleeper(60, stopped), 1: sleeper(60, stopped)}
    real, calls = CellRun.take_events, []

    def failing(self):
        calls.append(1)
        if len(calls) == 20:
            raise RuntimeError("a fault in the kernel")
        return real(self)

    monkeypatch.setattr(CellRun, "take_events", failing)
    with pytest.raises(RuntimeError, match="a fault in the kernel"):
        session.run("pass", workers=2)
    assert sorted(stopped) == [0, 1]  # none runs on unseen
    assert session.runs[-1].status == "failed"


def test_a_worker_that_died_between_cells_is_replaced_first(fake, capsys):
    session, engine = fake
    session.run("pass", workers=2)
    session.backend.kill(1)
    session.run("pass")
    assert "the worker of rank(s) [1] is gone; restarting the cluster with 2 workers" in capsys.readouterr().out
    assert engine.starts == 2


def test_what_a_cell_sent_back_is_not_kept_after_it(fake):
    # The session keeps the last run's heartbeats (the sidebar shows them), not its answers:
    # a pulled model can be gigabytes.
    session, engine = fake

    class Frame(bytearray):
        pass

    sent = Frame(1 << 20)
    engine.scripts = {0: lambda r, frame=sent: (frame,)}
    session.run("pass", workers=2)
    gone = weakref.ref(sent)
    del sent
    engine.scripts = {}
    gc.collect()
    assert gone() is None
