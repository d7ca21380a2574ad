"""What every engine must do (jupyter_scale/backends/base.py), on the real engines, with no
kernel and no torch in the calls: the rules the session relies on, one test each.

The calls are functions the workers import by name (os, operator, builtins): what a
worker runs must be importable there, and these tests' own module is not.
"""

import operator
import os
import signal
import time

import psutil
import pytest

from conftest import ENGINES, wait_gone
from jupyter_scale import worker
from jupyter_scale.backends import WorkerCallFailed, WorkerLost, create_backend
from jupyter_scale.backends.channel import CellChannel
from jupyter_scale.backends.dask_cluster import workers_of

pytestmark = pytest.mark.cluster


class OverTheChannel:
    """A started engine whose calls take the kernel's direct channel, as a session on the
    workers' machine sends them (see jupyter_scale/channel.py): held to the same rules."""

    def __init__(self, backend):
        self.backend = backend
        self._open()

    def _open(self):
        self.channel = CellChannel(self.backend.size, self.backend.dead_ranks, None)
        self.backend.submit_each(self.backend.channel_server(), self.channel.worker_arguments()).wait(60)
        assert self.channel.await_workers(30), "the workers never answered on the channel"

    def submit(self, fn, *args, ranks=None):
        return self.channel.submit(fn, *args, ranks=ranks)

    def submit_each(self, fn, args_per_rank):
        return self.channel.submit_each(fn, args_per_rank)

    def order_ranks(self, order):  # the session opens the channel after laying the ranks out
        self.channel.close()
        self.backend.order_ranks(order)
        self._open()

    def __getattr__(self, name):  # the rest (dead_ranks, interrupt, ...) is the engine's
        return getattr(self.backend, name)


@pytest.fixture(params=[*ENGINES, "ipyparallel over the channel", "dask over the channel"])
def engine(request):
    backend = create_backend(request.param.split()[0])
    backend.start(3, timeout=120)
    started = backend.local_processes()
    calls = None
    try:
        calls = OverTheChannel(backend) if "channel" in request.param else backend
        yield calls
    finally:
        if isinstance(calls, OverTheChannel):
            calls.channel.close()
        backend.stop()
        assert not backend.running
        wait_gone(started)  # stop() leaves no process start() made


def _pids(backend, ranks=None):
    return backend.submit(os.getpid, ranks=ranks).wait(60)


def test_results_come_in_rank_order_from_the_ranks_asked(engine):
    pids = _pids(engine)
    assert len(set(pids)) == 3
    assert [w["pid"] for w in engine.submit(worker.describe).wait(60)] == pids
    assert _pids(engine, ranks=[2, 0]) == [pids[2], pids[0]]
    assert engine.submit_each(operator.add, [(1, 2), (3, 4), (5, 6)]).wait(60) == [3, 7, 11]
    engine.order_ranks([1, 0, 2])  # rank i becomes the worker that was rank order[i]
    assert _pids(engine) == [pids[1], pids[0], pids[2]]


def test_a_calls_output_has_arrived_once_its_rank_is_done(engine):
    job = engine.submit(print, "hello")
    deadline = time.monotonic() + 60
    while not all(job.done(r) for r in job.ranks):
        assert time.monotonic() < deadline, "the call never finished"
        job.wait_activity(0.1)
    said = [(o.rank, o.stream, o.text) for o in job.new_output()]
    assert sorted(said) == [(r, "stdout", "hello\n") for r in range(3)]
    assert [job.result(r) for r in job.ranks] == [None] * 3
    job.release()


def test_a_call_that_raises_in_the_engine_is_worker_call_failed(engine):
    job = engine.submit_each(int, [("1",), ("x",), ("3",)])
    with pytest.raises(WorkerCallFailed, match="ValueError") as caught:
        job.wait(60)
    assert caught.value.rank == 1
    assert _pids(engine)  # the workers are fine


def test_a_killed_worker_is_lost_named_dead_and_its_call_ends(engine):
    pids = _pids(engine)
    job = engine.submit(time.sleep, 60)
    time.sleep(1.0)  # the call runs
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not job.done(1):
        assert time.monotonic() < deadline, "the engine never noticed the dead worker"
        job.wait_activity(0.1)
    with pytest.raises(WorkerLost) as caught:
        job.result(1)
    assert caught.value.rank == 1
    assert not job.done(0)  # the others still run their call
    while engine.dead_ranks() != [1]:
        assert time.monotonic() < deadline, engine.dead_ranks()
        time.sleep(0.1)
    # SIGKILLed: gone, or a zombie, once the kernel has finished it off (not at once on a busy machine)
    try:
        still = wait_gone([psutil.Process(pids[1])], timeout=15)
    except psutil.NoSuchProcess:
        still = []
    assert not still
    engine.interrupt([0, 2])  # the others' calls end, as a stopped cell's do, before the engine stops
    job.release()


def test_an_engines_settings_in_the_sessions_config_reach_the_cluster_it_starts():
    from traitlets.config import Config

    from jupyter_scale.session import ScaleSession

    config = Config()
    config.DaskBackend.cluster_options = {"threads_per_worker": 2}  # ours is 1
    session = ScaleSession(namespace={}, config=config)
    session.backend_name = "dask"
    try:
        session.start(2)
        workers = workers_of(session.backend.client).values()
        assert [w["nthreads"] for w in workers] == [2, 2]
    finally:
        session.stop()


def test_rays_settings_reach_the_head_and_the_actors():
    import ray
    from traitlets.config import Config

    from jupyter_scale.session import ScaleSession

    config = Config()
    config.RayBackend.cluster_options = {"num_cpus": 3}  # a flag of `ray start`
    config.RayBackend.cpus_per_worker = 1.5
    session = ScaleSession(namespace={}, config=config)
    session.backend_name = "ray"
    try:
        session.start(2)
        assert ray.cluster_resources()["CPU"] == 3
        assert ray.available_resources().get("CPU", 0) == 0  # two ranks of 1.5 each hold them all
        # Ray gives an actor as many threads as CPUs, rounded down: torch uses 1 here.
        threads = session.backend.submit(os.getenv, "OMP_NUM_THREADS").wait(60)
        assert threads == ["1", "1"]
    finally:
        session.stop()
    assert not ray.is_initialized()


def test_a_wait_that_times_out_leaves_the_job_running_for_its_caller_to_stop(engine):
    job = engine.submit(time.sleep, 3)
    with pytest.raises(Exception, match="did not answer"):
        job.wait(0.5)
    assert not any(job.done(r) for r in job.ranks)  # still running, as the caller that stops it sees
    deadline = time.monotonic() + 30
    while not all(job.done(r) for r in job.ranks):
        assert time.monotonic() < deadline, "the calls never finished"
        job.wait_activity(0.1)
    assert [job.result(r) for r in job.ranks] == [None] * 3
    job.release()
