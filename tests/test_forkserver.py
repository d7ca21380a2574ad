"""Workers forked from multiprocessing's fork server (jupyter_scale/forkserver.py): on the real
ipyparallel engine (its controller and engines, forked as programs) and on Dask (its nannies'
workers): they are forks of it, they start like new processes, the server is replaced when it
dies or the thread settings change, one that is unsafe to fork is not used, restarts keep the
controller or scheduler, and nothing of it outlives `%scale stop` or the kernel."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from stranger import run_as_stranger
from traitlets.config import Config

from conftest import _started_kernel, wait_gone
from jupyter_scale import forkserver, programs
from jupyter_scale.backends import ipyparallel_cluster
from jupyter_scale.backends.dask_cluster import workers_of
from jupyter_scale.session import ScaleSession

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not forkserver.supported(), reason="forking workers needs Linux"),
]


def _fork_server() -> psutil.Process:
    pid = forkserver._server_pid()
    assert pid is not None, "no fork server runs"
    return psutil.Process(pid)


def _ipp_server() -> psutil.Process:
    """The fork server of ipyparallel's imports, started now if none runs, once it serves."""
    assert forkserver.multiprocessing_server(ipyparallel_cluster.FORK_PRELOAD, os.environ, verify=60)
    return _fork_server()


def _worker_parents(session: ScaleSession) -> set[int]:
    return {psutil.Process(w["pid"]).ppid() for w in session.workers}


@pytest.fixture
def session():
    forkserver.close_all()
    s = ScaleSession()
    yield s
    s.stop()
    forkserver.close_all()


def test_workers_are_forks_of_the_server_and_start_as_new_processes(session, tmp_path, monkeypatch):
    server = _ipp_server()
    monkeypatch.chdir(tmp_path)  # the server started elsewhere: the workers run in the kernel's directory
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "the-kernels-own")])  # not a new Python's
    session.start(2)
    assert _worker_parents(session) == {server.pid}
    controller = session.backend.local_processes()[0]
    assert controller.ppid() == server.pid  # the controller too
    monkeypatch.setenv("JUPYTER_SCALE_T", "set-after-the-server")  # not a thread setting: still forked
    session.restart(2)
    assert _worker_parents(session) == {server.pid}
    session.run(textwrap.dedent("""
        import os, sys, numpy as np
        seen = (os.getsid(0) == os.getpid(), sys.argv[0], os.environ.get("JUPYTER_SCALE_T"), os.getcwd(),
                float(np.random.rand()), sys.stdin.read(), sys.path)
    """), manual=True)  # automatic mode seeds every rank alike
    seen = session.gather("seen")
    # Each its own session leader, with the kernel's environment and directory of now, its
    # program's file and sys.path as a Python started anew, stdin at /dev/null, and NumPy's
    # random numbers its own.
    engine = programs.path("ipp_engine")
    assert [s[:4] for s in seen] == [(True, engine, "set-after-the-server", str(tmp_path))] * 2
    assert seen[0][4] != seen[1][4]
    assert [s[5] for s in seen] == ["", ""]
    assert all(s[6][0] == "" and str(tmp_path / "the-kernels-own") not in s[6] for s in seen)


def test_a_forked_workers_exit_status_is_reported(session):
    _ipp_server()
    session.start(2)
    pid = session.workers[1]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while session.backend.exit_code(pid) is None:
        assert time.monotonic() < deadline, "the server never reported the worker's end"
        time.sleep(0.05)
    assert session.backend.exit_code(pid) == -signal.SIGKILL
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # reaped
    session.ensure()  # the lost worker is replaced, from the server
    assert session.size == 2 and len(_worker_parents(session)) == 1


def test_a_dead_server_is_replaced_and_its_workers_live_on(session):
    first = _ipp_server()
    session.start(2)
    first.kill()  # as the OOM killer would: nobody reaps it but the kernel
    deadline = time.monotonic() + 10
    while first.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    session.run("x = rank")
    assert session.gather("x") == [0, 1]  # the workers do not depend on it
    session.restart(2)
    second = _fork_server()
    assert second.pid != first.pid and _worker_parents(session) == {second.pid}


def test_other_thread_settings_get_a_server_of_their_own(session, monkeypatch):
    first = _ipp_server()
    session.start(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read by OpenMP as it loads: the server's is stale
    session.restart(2)
    second = _fork_server()
    assert second.pid != first.pid and _worker_parents(session) == {second.pid}
    assert wait_gone([first], timeout=10) == []  # the stale one ended
    session.run("import torch\nthreads = torch.get_num_threads()")
    assert session.gather("threads") == [1, 1]


def test_a_server_whose_imports_start_threads_is_refused_and_workers_start_anew(session, tmp_path, monkeypatch,
                                                                                capsys):
    (tmp_path / "starts_a_thread.py").write_text("import threading, time\n"
                                                 "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(ipyparallel_cluster, "FORK_PRELOAD", [*ipyparallel_cluster.FORK_PRELOAD, "starts_a_thread"])
    assert not forkserver.multiprocessing_server(ipyparallel_cluster.FORK_PRELOAD, os.environ, verify=60)
    assert "its imports started threads" in capsys.readouterr().err
    assert forkserver._server_pid() is None  # ended
    session.start(2)
    assert _worker_parents(session) == {os.getpid()}  # started the usual way, by the kernel
    session.run("x = rank")
    assert session.gather("x") == [0, 1]


def test_a_fork_that_cannot_start_fails_as_a_failed_exec_and_the_server_serves_on(tmp_path):
    program = tmp_path / "program.py"
    program.write_text("import sys\nprint('ran', sys.argv[1:])\nsys.exit(7)\n")
    output = tmp_path / "out.log"
    forkserver.close_all()
    try:
        forked = forkserver.fork(["json"], str(program), ["a"], dict(os.environ), str(tmp_path / "missing"),
                                 str(output), wait=60)
        assert forked is not None and forked.wait(10) and forked.exit_code() == 127  # as a failed exec
        assert "FileNotFoundError" in output.read_text() and "ran" not in output.read_text()
        forked = forkserver.fork(["json"], str(program), ["a"], dict(os.environ), str(tmp_path), str(output), wait=60)
        assert forked is not None and forked.wait(10) and forked.exit_code() == 7
        assert "ran ['a']" in output.read_text()
        # A worker whose thread settings are not the kernel's is not forked: the caller starts it anew.
        assert forkserver.fork(["json"], str(program), [], {**os.environ, "OMP_NUM_THREADS": "7"}, str(tmp_path),
                               str(output), wait=60) is None
    finally:
        forkserver.close_all()


def test_stop_ends_the_server(session):
    server = _ipp_server()
    session.start(2)
    session.stop()
    assert wait_gone([server], timeout=10) == []
    assert forkserver._server_pid() is None


@pytest.mark.parametrize("engine", ["ipyparallel", "dask"])
def test_workers_start_anew_when_forking_is_off(engine):
    forkserver.close_all()
    backend = {"ipyparallel": "IPyParallelBackend", "dask": "DaskBackend"}[engine]
    session = ScaleSession(config=Config({backend: {"fork_workers": False}}))
    session.backend_name = engine
    try:
        session.warm_up()
        session.start(2)
        # ipyparallel's Popen or multiprocessing's spawn, from this process
        assert _worker_parents(session) == {os.getpid()}
        assert forkserver._server_pid() is None
    finally:
        session.stop()


KERNEL = """
import sys, time
sys.path.insert(0, {tests!r})
import jupyter_scale
session = jupyter_scale.get_session()
session.backend_name = {engine!r}
session.warm_up()
session.start(2)
print("PIDS", " ".join(str(p.pid) for p in __import__("psutil").Process().children(recursive=True)), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("engine", ["ipyparallel", "dask"])
def test_nothing_is_left_once_the_kernel_is_killed(engine):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL.format(tests=os.path.dirname(__file__), engine=engine)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = ""
        while not line.startswith("PIDS"):
            line = kernel.stdout.readline()
            assert line, "the kernel ended before its cluster started"
        pids = [int(p) for p in line.split()[1:]]
        processes = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
        # The fork server, the resource tracker, and the controller and its helpers with 2
        # engines, or 2 Dask workers.
        assert len(processes) >= 4, line
    finally:
        kernel.kill()
        kernel.wait(10)
    still = wait_gone(processes, timeout=30)
    for p in still:
        p.kill()
    assert not still, f"left behind by a SIGKILLed kernel: {still}"


@pytest.mark.parametrize("engine,imports", [("ipyparallel", "ipyparallel.controller.app"),
                                            ("dask", "distributed")])
def test_a_notebook_kernel_starts_its_fork_server_at_load_ext(engine, imports):
    kernel = _started_kernel(engine)
    try:
        kernel.ok("import psutil, sys\n"
                  "children = [p.cmdline()[-1] for p in psutil.Process().children()]\n"
                  f"assert any('multiprocessing.forkserver' in c and {imports!r} in c for c in children), children")
    finally:
        kernel.cell("%scale stop", timeout=60)
        leftovers = psutil.Process(kernel.pid).children(recursive=True)
        kernel.shutdown()
        assert not wait_gone(leftovers)


def _resize_to_3_then_lose_rank_1(session: ScaleSession, kept) -> psutil.Process:
    """`%scale restart --workers 3`: new workers that form a group, with `kept()` (the
    controller or scheduler) unchanged; then rank 1's worker is SIGKILLed, and the session
    knows within 10 s (by its pid on ipyparallel, before missed heartbeats). Its process."""
    before = kept()
    first = [psutil.Process(w["pid"]) for w in session.workers]
    session.restart(3)
    assert kept() == before
    assert len(session.workers) == 3 and not {p.pid for p in first} & {w["pid"] for w in session.workers}
    assert wait_gone(first) == []
    session.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\ntotal = t.item()")
    assert session.gather("total") == [3.0] * 3
    dead = psutil.Process(session.workers[1]["pid"])
    dead.kill()
    deadline = time.monotonic() + 10
    while session.backend.dead_ranks() != [1]:
        assert time.monotonic() < deadline, "the dead worker was not noticed"
        time.sleep(0.01)
    return dead


def test_restart_resize_and_a_dead_worker_keep_the_controller_and_renew_the_workers(session):
    session.start(2)
    controller = session.backend.local_processes()[0]
    dead = _resize_to_3_then_lose_rank_1(session, lambda: session.backend.local_processes()[0])
    session.run("x = rank")  # restarts the workers first
    assert session.gather("x") == [0, 1, 2] and dead.pid not in {w["pid"] for w in session.workers}
    assert session.backend.local_processes()[0] == controller


def test_a_cluster_of_another_engine_ends_the_server_load_ext_started(session):
    session.warm_up()  # as %load_ext does, for the default engine
    first = _fork_server()
    session.backend_name = "dask"  # %%distribute --backend dask
    session.start(2)
    assert wait_gone([first], timeout=10) == []  # its memory is not kept for nothing
    assert _worker_parents(session) == {_fork_server().pid}  # one with Dask's imports


# -- Dask: multiprocessing's fork server --------------------------------------------------

def _worker_names(session: ScaleSession) -> set:
    return {w.get("name") for w in workers_of(session.backend.client).values()}


@pytest.fixture
def dask_session():
    forkserver.close_all()
    s = ScaleSession()
    s.backend_name = "dask"
    yield s
    s.stop()
    forkserver.close_all()


def test_dask_workers_are_forks_of_the_fork_server_with_the_kernels_environment(dask_session, tmp_path,
                                                                                monkeypatch):
    session = dask_session
    monkeypatch.setenv("JUPYTER_SCALE_GONE", "set when the server started")
    session.start(2)
    server = _fork_server()
    assert _worker_parents(session) == {server.pid}
    assert "torch" in " ".join(server.cmdline())  # preloaded

    # Set after the server started, in another directory: the new workers have both.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JUPYTER_SCALE_T", "set-after-the-server")
    session.restart(2)
    assert _worker_parents(session) == {server.pid}
    probe = ("import os, torch, numpy as np\nseen = (os.environ.get('JUPYTER_SCALE_T'), "
             "os.environ.get('JUPYTER_SCALE_GONE'), os.getcwd(), torch.get_num_threads(), float(np.random.rand()))")
    session.run(probe, manual=True)  # automatic mode seeds every rank alike
    seen = session.gather("seen")
    assert [s[:3] for s in seen] == [("set-after-the-server", "set when the server started", str(tmp_path))] * 2
    assert seen[0][4] != seen[1][4]  # NumPy's random numbers their own

    # A thread setting changed since: a new server, whose workers have it.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    session.restart(2)
    assert wait_gone([server], timeout=10) == []  # the old one ended
    server = _fork_server()
    assert _worker_parents(session) == {server.pid}
    session.run(probe, manual=True)
    assert [s[3] for s in session.gather("seen")] == [1, 1]

    # A variable removed since: a new server, and workers without it.
    monkeypatch.delenv("JUPYTER_SCALE_GONE")
    session.restart(2)
    assert wait_gone([server], timeout=10) == []
    assert _worker_parents(session) == {_fork_server().pid}
    session.run(probe, manual=True)
    assert [s[:4] for s in session.gather("seen")] == [("set-after-the-server", None, str(tmp_path), 1)] * 2


def test_dask_restart_resize_and_a_dead_worker_keep_the_scheduler_and_renew_the_workers(dask_session):
    session = dask_session
    session.start(2)
    scheduler = session.backend.describe()["scheduler"]
    server = _fork_server()
    names = [_worker_names(session)]
    dead = _resize_to_3_then_lose_rank_1(session, lambda: session.backend.describe()["scheduler"])
    names.append(_worker_names(session))  # the two of the three that live
    time.sleep(1)  # a nanny restarting its worker would have started by now
    assert {p.pid for p in server.children()} == {w["pid"] for w in session.workers} - {dead.pid}
    session.run("x = rank")  # restarts the workers first
    assert session.gather("x") == [0, 1, 2] and dead.pid not in {w["pid"] for w in session.workers}
    assert session.backend.describe()["scheduler"] == scheduler
    assert {p.pid for p in server.children()} == {w["pid"] for w in session.workers}
    names.append(_worker_names(session))
    session.restart(1)  # and down
    assert session.size == 1 and session.backend.describe()["scheduler"] == scheduler
    # No name given twice: 15 s after a worker left, Dask closes a worker of the same name.
    names.append(_worker_names(session))
    assert sum(map(len, names)) == len(set().union(*names)), names
    # The kept scheduler holds no call of the past: one still wanted would be computed again
    # on a new worker that got a lost worker's address, ahead of that worker's own calls.
    tasks = session.backend._cluster.scheduler.tasks
    deadline = time.monotonic() + 10
    while tasks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tasks, sorted(tasks)


def test_stop_ends_the_fork_server(dask_session):
    dask_session.start(2)
    server = _fork_server()
    dask_session.stop()
    assert wait_gone([server], timeout=10) == []
    assert forkserver._server_pid() is None


def test_a_stranger_cannot_reach_the_fork_server(dask_session):
    import multiprocessing.forkserver

    dask_session.start(1)
    address = multiprocessing.forkserver._forkserver._forkserver_address
    # Another local user cannot connect to it (and have it fork what they send).
    result = run_as_stranger(f"""
        import socket
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect({address!r})
        except OSError as exc:
            print("REFUSED", type(exc).__name__)
        else:
            print("CONNECTED")
    """)
    assert "REFUSED PermissionError" in result.stdout, result.stdout + result.stderr


def test_a_fork_server_stuck_in_its_imports_is_ended_and_not_used(tmp_path, monkeypatch):
    forkserver.close_all()
    (tmp_path / "stuck_at_import.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # where the server, a new Python, imports from
    try:
        started = time.monotonic()
        assert forkserver.multiprocessing_server(["stuck_at_import"], dict(os.environ), verify=3) is False
        assert time.monotonic() - started < 30
        assert forkserver._server_pid() is None  # ended, not left importing
        # The same environment is not tried again (it would hang again); another one is.
        assert forkserver.multiprocessing_server(["stuck_at_import"], dict(os.environ), verify=3) is False
        assert time.monotonic() - started < 30
        # One whose imports fail is not used either (the workers would import it all themselves).
        assert forkserver.multiprocessing_server(["no_such_module_here"], {**os.environ, "OMP_NUM_THREADS": "2"},
                                                 verify=30) is False
        assert forkserver.multiprocessing_server(["os"], {**os.environ, "OMP_NUM_THREADS": "3"}, verify=30) is True
        server = psutil.Process(forkserver._server_pid())
    finally:
        forkserver.close_all()
    assert wait_gone([server], timeout=10) == []
