"""Workers forked from the kernel's template (jupyter_scale/forkserver.py), on the real
ipyparallel engine, and from multiprocessing's fork server on Dask: they are forks of it, they
start like new processes, the template is replaced when it dies or the thread settings change,
restarts keep the controller or scheduler, and nothing of it outlives `%scale stop` or the
kernel."""

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
from jupyter_scale.backends import ipyparallel as ipp_backend
from jupyter_scale.session import ScaleSession

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not forkserver.supported(), reason="worker templates need Linux"),
]


def _template() -> forkserver.Template:
    found = forkserver.template(ipp_backend.TEMPLATE_PRELOAD)
    assert found is not None and found.wait_ready(60), found and found.error
    return found


def _worker_parents(session: ScaleSession) -> set[int]:
    return {psutil.Process(w["pid"]).ppid() for w in session.workers}


@pytest.fixture
def session():
    forkserver.close_all()
    s = ScaleSession()
    yield s
    s.stop()
    forkserver.close_all()


def test_workers_are_forks_of_the_template_and_start_as_new_processes(session, tmp_path, monkeypatch):
    template = _template()
    monkeypatch.chdir(tmp_path)  # the template started elsewhere: the workers run in the kernel's directory
    session.start(2)
    assert _worker_parents(session) == {template.pid}
    controller = session.backend.local_processes()[0]
    assert controller.ppid() == template.pid  # the controller too
    os.environ["JUPYTER_SCALE_T"] = "set-after-the-template"  # not a thread setting: still forked
    try:
        session.restart(2)
        assert _worker_parents(session) == {template.pid}
        session.run(textwrap.dedent("""
            import os, sys, numpy as np
            seen = (os.getsid(0) == os.getpid(), sys.argv[0], os.environ.get("JUPYTER_SCALE_T"), os.getcwd(),
                    float(np.random.rand()), sys.stdin.read())
        """), manual=True)  # automatic mode seeds every rank alike
    finally:
        del os.environ["JUPYTER_SCALE_T"]
    seen = session.gather("seen")
    # Each its own session leader, with the kernel's environment and directory of now, its
    # program's file as a Python started anew, stdin at /dev/null, and NumPy's random numbers its own.
    engine = programs.path("ipp_engine")
    assert [s[:4] for s in seen] == [(True, engine, "set-after-the-template", os.getcwd())] * 2
    assert seen[0][4] != seen[1][4]
    assert [s[5] for s in seen] == ["", ""]


def test_a_forked_workers_exit_status_is_reported(session):
    _template()
    session.start(2)
    pid = session.workers[1]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while session.backend.exit_code(pid) is None:
        assert time.monotonic() < deadline, "the template never reported the worker's end"
        time.sleep(0.05)
    assert session.backend.exit_code(pid) == -signal.SIGKILL
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # reaped
    session.ensure()  # the lost worker is replaced, from the template
    assert session.size == 2 and len(_worker_parents(session)) == 1


def test_a_dead_template_is_replaced_and_its_workers_live_on(session):
    first = _template()
    session.start(2)
    os.kill(first.pid, signal.SIGKILL)
    first.process.wait(10)
    session.run("x = rank")
    assert session.gather("x") == [0, 1]  # the workers do not depend on it
    session.restart(2)
    second = _template()
    assert second.pid != first.pid and _worker_parents(session) == {second.pid}


def test_other_thread_settings_get_a_template_of_their_own(session):
    first = _template()
    session.start(2)
    os.environ["OMP_NUM_THREADS"] = "1"  # read by OpenMP as it loads: the template's is stale
    try:
        session.restart(2)
        second = _template()
        assert second.pid != first.pid and _worker_parents(session) == {second.pid}
        assert first.process.poll() is not None  # the stale one ended
        session.run("import torch\nthreads = torch.get_num_threads()")
        assert session.gather("threads") == [1, 1]
    finally:
        del os.environ["OMP_NUM_THREADS"]


def test_a_template_whose_imports_start_threads_is_refused_and_workers_start_anew(session, tmp_path, monkeypatch):
    (tmp_path / "starts_a_thread.py").write_text("import threading, time\n"
                                                 "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(ipp_backend, "TEMPLATE_PRELOAD", [*ipp_backend.TEMPLATE_PRELOAD, "starts_a_thread"])
    template = forkserver.template(ipp_backend.TEMPLATE_PRELOAD)
    assert not template.wait_ready(60) and "1 threads were started by the imports" in template.error
    session.start(2)
    assert template.pid not in _worker_parents(session)
    session.run("x = rank")
    assert session.gather("x") == [0, 1]


def test_a_fork_that_cannot_start_and_a_stuck_template_fail_in_one_line(tmp_path):
    template = forkserver.Template(["json"])
    try:
        assert template.wait_ready(60), template.error
        output = tmp_path / "out.log"
        program = tmp_path / "program.py"
        program.write_text("print('ran')\n")
        pid = template.spawn(str(program), [], dict(os.environ), str(tmp_path / "missing"), str(output), timeout=10)
        assert template.wait_exit(pid, 10) and template.exit_code(pid) == 127  # as a failed exec
        assert "FileNotFoundError" in output.read_text() and "ran" not in output.read_text()
        pid = template.spawn(str(program), [], dict(os.environ), str(tmp_path), str(output), timeout=10)
        assert template.wait_exit(pid, 10) and template.exit_code(pid) == 0  # it serves on
    finally:
        template.close()
    slow = forkserver.Template(["torch"])  # seconds of imports: not ready within 10 ms
    try:
        with pytest.raises(forkserver.TemplateError, match="not ready within"):
            slow.spawn(str(program), [], dict(os.environ), str(tmp_path), str(tmp_path / "o"), timeout=0.01)
        assert slow.refused and slow.process.wait(10) is not None  # ended, and not waited for again
    finally:
        slow.close()


def test_stop_ends_the_template(session):
    template = _template()
    session.start(2)
    session.stop()
    assert template.process.poll() is not None
    assert not [p for p in psutil.Process().children() if p.pid == template.pid]


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
        # The template, the controller and its helpers, 2 engines; or the fork server, the
        # resource tracker and 2 Dask workers.
        assert len(processes) >= 4, line
    finally:
        kernel.kill()
        kernel.wait(10)
    still = wait_gone(processes, timeout=30)
    for p in still:
        p.kill()
    assert not still, f"left behind by a SIGKILLed kernel: {still}"


@pytest.mark.parametrize("engine,imports", [("ipyparallel", "ipyparallel.controller.app"),
                                            ("dask", "multiprocessing.forkserver")])
def test_a_notebook_kernel_starts_its_template_at_load_ext(engine, imports):
    kernel = _started_kernel(engine)
    try:
        kernel.ok("import psutil, sys\n"
                  "children = [p.cmdline()[-1] for p in psutil.Process().children()]\n"
                  f"assert any({imports!r} in c for c in children), children")
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


def test_a_cluster_of_another_engine_ends_the_template_load_ext_started(session):
    session.warm_up()  # as %load_ext does, for the default engine
    template = _template()
    session.backend_name = "dask"  # %%distribute --backend dask
    session.start(2)
    assert template.process.wait(10) is not None  # its memory is not kept for nothing
    assert not [p for p in psutil.Process().children() if p.pid == template.pid]


# -- Dask: multiprocessing's fork server --------------------------------------------------

def _fork_server() -> psutil.Process:
    pid = forkserver._server_pid()
    assert pid is not None, "no fork server runs"
    return psutil.Process(pid)


def _worker_names(session: ScaleSession) -> set:
    return {w.get("name") for w in session.backend.client.scheduler_info(n_workers=-1)["workers"].values()}


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


def test_dask_workers_start_anew_when_forking_is_off():
    forkserver.close_all()
    session = ScaleSession(config=Config({"DaskBackend": {"fork_workers": False}}))
    session.backend_name = "dask"
    try:
        session.start(2)
        assert _worker_parents(session) == {os.getpid()}  # multiprocessing's spawn, from this process
        assert forkserver._server_pid() is None
    finally:
        session.stop()


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
