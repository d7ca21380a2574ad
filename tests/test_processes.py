"""jupyter_scale.processes on real processes: `alive`, `end`, and the kernel's watcher ending
a cluster's processes and removing its files when the kernel is SIGKILLed."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from jupyter_scale import processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and fork semantics of Linux")


def _started(code: str) -> subprocess.Popen:
    """A Python child running `code`, once it printed its first line."""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


IGNORES_SIGTERM = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n" \
                  "time.sleep(60)"


def test_end_kills_what_ignores_sigterm_after_the_grace_and_reaps_it():
    child = _started(IGNORES_SIGTERM)
    try:
        started = time.monotonic()
        assert processes.end([child.pid], grace=0.5) == []
        took = time.monotonic() - started
        assert 0.5 <= took < 5, took
        assert not processes.alive(child.pid)
        assert not os.path.exists(f"/proc/{child.pid}")  # reaped: not even a zombie is left
    finally:
        child.kill()
        child.wait()


def test_end_of_a_process_that_exits_on_sigterm_does_not_wait_the_grace():
    child = _started("import time\nprint('ready', flush=True)\ntime.sleep(60)")
    started = time.monotonic()
    assert processes.end([psutil.Process(child.pid)], grace=30) == []
    assert time.monotonic() - started < 5
    assert child.wait(5) == -signal.SIGTERM or not processes.alive(child.pid)


def test_a_zombie_is_not_alive_and_a_reused_pid_is_not_the_process():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # ended, not reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not processes.alive(child.pid)
    child.wait()
    me = psutil.Process()
    assert processes.alive(me.pid) and processes.alive(me) and processes.alive(me.pid, me.create_time())
    assert not processes.alive(me.pid, me.create_time() - 60)  # another process, with the pid reused
    assert not processes.alive(child.pid)


KERNEL = """
import os, sys, time
sys.path.insert(0, {repo!r})
from jupyter_scale import processes

cluster, stopped = processes.watch(), processes.watch()
cluster.add_path({directory!r})
for name in ({shared!r}, {link!r}):
    cluster.add_path(name)  # a link is not registered: never followed
cluster.add_files({profile!r}, "ipcontroller-CLUSTER-*")
import subprocess
worker = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                          start_new_session=True)
cluster.add_processes([worker.pid])
other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
stopped.add_processes([other.pid])
stopped.close()  # stopped by the kernel itself: forgotten
time.sleep(1)
print("ready", worker.pid, other.pid, processes._watcher.pid, flush=True)
time.sleep(60)
"""


def test_the_watcher_ends_the_processes_and_removes_the_files_of_a_killed_kernel(tmp_path):
    directory = tmp_path / "cluster"
    (directory / "sub").mkdir(parents=True)
    (directory / "sub" / "file").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    (directory / "link").symlink_to(outside)  # inside the directory: removed as a link, not followed
    link = tmp_path / "link-to-outside"
    link.symlink_to(outside)
    shared = tmp_path / "shared"
    shared.mkdir()
    profile = tmp_path / "profile"
    profile.mkdir()
    for name in ("ipcontroller-CLUSTER-client.json", "ipcontroller-OTHER-client.json"):
        (profile / name).write_text("{}")
    (profile / "ipcontroller-CLUSTER-link").symlink_to(outside / "keep")
    code = KERNEL.format(repo=os.path.dirname(os.path.dirname(processes.__file__)), directory=str(directory),
                         shared=str(shared / "missing"), link=str(link), profile=str(profile))
    kernel = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    started = []
    try:
        said = kernel.stdout.readline().split()
        assert said[:1] == ["ready"], said
        worker, other, watcher = (psutil.Process(int(pid)) for pid in said[1:])
        started = [worker, *worker.children(), other, watcher]
        assert len(started) == 4
        kernel.kill()  # no chance to stop its cluster
        kernel.wait(10)
        deadline = time.monotonic() + 15
        while (processes.alive(worker) or directory.exists() or processes.alive(watcher)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in started[:2] if processes.alive(p)], "the cluster's processes were left"
        assert processes.alive(other), "a process of a group the kernel forgot was ended"
        assert not directory.exists(), "the cluster's directory was left"
        assert (outside / "keep").read_text() == "x" and link.is_symlink(), "a link was followed"
        assert sorted(os.listdir(profile)) == ["ipcontroller-CLUSTER-link", "ipcontroller-OTHER-client.json"]
        assert not processes.alive(watcher), "the watcher outlived its work"
    finally:
        kernel.kill()
        processes.end([p for p in started if processes.alive(p)], grace=0)
        kernel.wait(10)


def test_a_kernel_that_exits_closes_the_pipe_and_the_watcher_cleans_up_what_was_not_stopped(tmp_path):
    directory = tmp_path / "left"
    directory.mkdir()
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.dirname(processes.__file__))!r})\n"
            "import subprocess, time\nfrom jupyter_scale import processes\nw = processes.watch()\n"
            f"w.add_path({str(directory)!r})\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
            "w.add_processes([p.pid])\nprint(p.pid, processes._watcher.pid, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    worker, watcher = (int(pid) for pid in out.stdout.split())
    deadline = time.monotonic() + 15
    while (processes.alive(worker) or processes.alive(watcher) or directory.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes.alive(worker) and not directory.exists() and not processes.alive(watcher)
