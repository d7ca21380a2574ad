"""Workers forked from the kernel's template (jupyter_scale/forkserver.py), on the real
ipyparallel engine: they are forks of it, they start like new processes, the template is
replaced when it dies or the thread settings change, and nothing of it outlives `%scale stop`
or the kernel."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import _started_kernel, wait_gone
from jupyter_scale import forkserver
from jupyter_scale.backends import ipyparallel as ipp_backend
from jupyter_scale.session import ScaleSession

pytestmark = pytest.mark.skipif(not forkserver.supported(), reason="worker templates need Linux")


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
    # Each its own session leader, with the kernel's environment and directory of now, `-c`
    # as a Python started anew, stdin at /dev/null, and NumPy's random numbers its own.
    assert [s[:4] for s in seen] == [(True, "-c", "set-after-the-template", os.getcwd())] * 2
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
        pid = template.spawn("print('ran')", [], dict(os.environ), str(tmp_path / "missing"), str(output), timeout=10)
        assert template.wait_exit(pid, 10) and template.exit_code(pid) == 127  # as a failed exec
        assert "FileNotFoundError" in output.read_text() and "ran" not in output.read_text()
        pid = template.spawn("print('ran')", [], dict(os.environ), str(tmp_path), str(output), timeout=10)
        assert template.wait_exit(pid, 10) and template.exit_code(pid) == 0  # it serves on
    finally:
        template.close()
    slow = forkserver.Template(["torch"])  # seconds of imports: not ready within 10 ms
    try:
        with pytest.raises(forkserver.TemplateError, match="not ready within"):
            slow.spawn("pass", [], dict(os.environ), str(tmp_path), str(tmp_path / "o"), timeout=0.01)
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
session.warm_up()
session.start(2)
print("PIDS", " ".join(str(p.pid) for p in __import__("psutil").Process().children(recursive=True)), flush=True)
time.sleep(600)
"""


def test_nothing_is_left_once_the_kernel_is_killed():
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL.format(tests=os.path.dirname(__file__))],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = ""
        while not line.startswith("PIDS"):
            line = kernel.stdout.readline()
            assert line, "the kernel ended before its cluster started"
        pids = [int(p) for p in line.split()[1:]]
        processes = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
        assert len(processes) >= 4, line  # the template, the controller and its helpers, 2 engines
    finally:
        kernel.kill()
        kernel.wait(10)
    still = wait_gone(processes, timeout=30)
    for p in still:
        p.kill()
    assert not still, f"left behind by a SIGKILLed kernel: {still}"


def test_a_notebook_kernel_starts_its_template_at_load_ext():
    kernel = _started_kernel("ipyparallel")
    try:
        kernel.ok("import psutil, sys\n"
                  "children = [p.cmdline()[-1] for p in psutil.Process().children()]\n"
                  "assert any('ipyparallel.controller.app' in c for c in children), children")
    finally:
        kernel.cell("%scale stop", timeout=60)
        leftovers = psutil.Process(kernel.pid).children(recursive=True)
        kernel.shutdown()
        assert not wait_gone(leftovers)


def test_restart_resize_and_a_dead_worker_keep_the_controller_and_renew_the_workers(session):
    session.start(2)
    controller = session.backend.local_processes()[0]
    first = [psutil.Process(w["pid"]) for w in session.workers]
    session.restart(3)
    assert session.backend.local_processes()[0] == controller
    assert len(session.workers) == 3 and not {p.pid for p in first} & {w["pid"] for w in session.workers}
    assert wait_gone(first) == []
    session.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\ntotal = t.item()")
    assert session.gather("total") == [3.0] * 3
    dead = psutil.Process(session.workers[1]["pid"])
    dead.kill()
    deadline = time.monotonic() + 10
    while session.backend.dead_ranks() != [1]:  # seen by its pid, before the controller misses its heartbeats
        assert time.monotonic() < deadline, "the dead worker was not noticed"
        time.sleep(0.01)
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
