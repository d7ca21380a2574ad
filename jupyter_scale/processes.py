"""Processes and files of ours: whether a process still runs, how one is ended, and the one
watch that ends a cluster's processes and removes its files when the kernel dies.

- `alive(pid)`: the one test of a process; a zombie is gone (an orphan's init may never reap
  it), and a pid given with its start time is not a later process that got the same pid.
- `wait(processes, timeout)`: until they ended, or the deadline; what still runs.
- `end(processes, grace)`: the one stop escalation: SIGTERM, a wait of `grace` s, SIGKILL,
  then our own children reaped. By pid only (psutil checks that a pid was not reused).
- `watch()`: a group of what one cluster made, its processes, Slurm jobs, files and
  directories, each registered as it is made. If the kernel dies first (even by SIGKILL), the
  kernel's watcher ends those processes and every process they started, cancels those jobs
  and removes those files;
  `Watch.close()` forgets them once the kernel stopped the cluster itself. `kernel_watch()`
  is the group of what the kernel keeps across clusters (the fork server, the group's
  store directories).

The watcher is one process per kernel, started with the first process registered: this
module, run by path (`python -P processes.py PID START`, see `command`; `-m` would import the
package, and torch with it), reading the kernel's registrations as JSON lines on a pipe. It acts
when the pipe ends (the kernel exited or was killed) or the kernel's pid no longer names the
kernel, whichever it sees first (a fork of the kernel may hold the pipe open). It removes only
what is the user's own: a path it was given that is still the same file (device and inode as
registered), never a symbolic link, never through one.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import TypeAlias

import psutil

# psutil's start time of a process is its start tick plus the boot time, which Linux derives
# from the wall clock: a clock adjustment moves it by whole seconds (both workers of a cluster
# once exited together, taking their kernel for gone). A pid reused within seconds of the first
# process's start is no concern.
START_TIME_SLACK_S = 2.0
# How often the watcher asks whether the kernel still runs.
POLL_S = 0.5
# How long `end` waits for SIGKILLed processes to be gone.
KILL_WAIT_S = 5.0

ProcessLike: TypeAlias = int | psutil.Process


def alive(process: ProcessLike, created: float | None = None) -> bool:
    """Whether `process` (a pid or a psutil handle) runs: a zombie does not. With `created`
    (its start time, psutil's create_time), a process that got the pid since is not it. A
    process we may not inspect counts as running."""
    try:
        handle = process if isinstance(process, psutil.Process) else psutil.Process(process)
        if isinstance(process, psutil.Process) and not handle.is_running():  # its pid reused
            return False
        if created is not None and abs(handle.create_time() - created) >= START_TIME_SLACK_S:
            return False
        return handle.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # not ours to inspect: it exists
        return True


def descendants(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Every process that `processes` started, directly or not, now: once its parent exits, an
    orphan can no longer be traced back to it."""
    found = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            found.extend(process.children(recursive=True))
    return found


def _handles(processes: Iterable[ProcessLike]) -> list[psutil.Process]:
    found = []
    for process in processes:
        if isinstance(process, psutil.Process):
            found.append(process)
        elif not isinstance(process, int):  # a Popen
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(process.pid))
        else:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(process))
    return found


def _reap(process: psutil.Process) -> None:
    """Reap `process` if it is our child and ended (a no-op otherwise)."""
    with contextlib.suppress(psutil.Error, ChildProcessError, OSError):
        process.wait(timeout=0)


def wait(processes: Iterable[ProcessLike], timeout: float, reap: bool = True) -> list[psutil.Process]:
    """Wait up to `timeout` s for `processes` to end (our own children reaped as they do, unless
    `reap` is False: a Popen that will wait for its process must read its status itself);
    those still running."""
    processes = _handles(processes)
    deadline = time.monotonic() + timeout
    while True:
        for process in processes if reap else ():
            _reap(process)
        processes = [p for p in processes if alive(p)]
        if not processes or time.monotonic() >= deadline:
            return processes
        time.sleep(0.02)


def end(processes: Iterable[ProcessLike], grace: float, reap: bool = True) -> list[psutil.Process]:
    """End `processes` (pids or psutil handles): SIGTERM, up to `grace` s to exit (0: none),
    then SIGKILL for what still runs; our own children are reaped (see `wait`). What could not
    be ended (still running KILL_WAIT_S after SIGKILL) is returned."""
    live = [p for p in _handles(processes) if alive(p)]
    if grace > 0 and live:
        for process in live:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        live = wait(live, grace, reap)
    for process in live:
        with contextlib.suppress(psutil.Error):
            process.kill()
    return wait(live, KILL_WAIT_S, reap) if live else []


# --------------------------------------------------------------------------------------
# The kernel's side of the watch
# --------------------------------------------------------------------------------------

def command(pid: int, created: float) -> list[str]:
    """The watcher's command line for the process `pid` (started at `created`): this file, run
    by path (as `-m` would import the package, and torch with it), without its directory on
    sys.path."""
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe, os.path.abspath(__file__), str(pid), repr(created)]


class _Watcher:
    """The kernel's end of its watcher process: a pipe of registrations."""

    def __init__(self) -> None:
        me = psutil.Process()
        self._lock = threading.Lock()
        # Its own session: a Ctrl-C in the terminal running Jupyter, or a signal to the
        # kernel's process group, does not reach it. In "/": it keeps no directory in use.
        self.process = subprocess.Popen(command(me.pid, me.create_time()), stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/",
                                        start_new_session=True, close_fds=True)
        self.pid = self.process.pid

    def send(self, message: dict) -> None:
        line = json.dumps(message).encode() + b"\n"
        with self._lock:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(line)
                self.process.stdin.flush()
            except (OSError, ValueError):  # it is gone (ended by someone): nothing to tell
                pass

    @property
    def running(self) -> bool:
        return self.process.poll() is None


_watcher: _Watcher | None = None
_watcher_owner = 0  # the pid whose watcher it is: a fork of the kernel has the object, not the watcher
_watcher_lock = threading.Lock()
_groups = iter(range(1, 1 << 62))
# Registrations made before any process was: files alone are made only for processes to come
# (a cluster's directory before its processes), so the watcher starts with the first process.
_pending: list[dict] = []


def _register(message: dict, start: bool = False) -> None:
    """Tell the watcher; start it (and tell it what waited) if `start`, else keep the
    message until a process is registered."""
    global _watcher, _watcher_owner
    with _watcher_lock:
        ours = _watcher is not None and _watcher_owner == os.getpid()
        if not ours and not start:
            _pending.append(message)
            return
        if _watcher is None or not ours or not _watcher.running:  # the first, or one that was ended
            _watcher, _watcher_owner = _Watcher(), os.getpid()
            waiting = list(_pending)
            _pending.clear()
            for earlier in waiting:
                _watcher.send(earlier)
        _watcher.send(message)


class Watch:
    """One cluster's processes and files, for the kernel's watcher to end and remove if the
    kernel dies before it stopped the cluster (see the module's doc)."""

    def __init__(self, group: str) -> None:
        self.group = group

    def add_processes(self, processes: Iterable[ProcessLike]) -> None:
        """Processes of the cluster's (pids or psutil handles), and what they start."""
        for process in _handles(processes):
            with contextlib.suppress(psutil.Error):
                _register({"g": self.group, "pid": process.pid, "created": process.create_time()}, start=True)

    def add_path(self, path: str) -> None:
        """A file or directory the cluster made (a directory goes with everything in it)."""
        try:
            found = os.lstat(path)
        except OSError:
            return
        if stat.S_ISLNK(found.st_mode) or found.st_uid != os.getuid():
            return  # not ours to remove
        _register({"g": self.group, "path": os.path.abspath(path), "dev": found.st_dev, "ino": found.st_ino})

    def add_files(self, directory: str, pattern: str) -> None:
        """Files that the cluster's processes will make in `directory` (a shared one: a profile's
        security or log directory), named to match `pattern` (fnmatch), which names only this
        cluster's."""
        if pattern.strip("*?") == "":
            raise ValueError(f"{pattern!r} would match other files than the cluster's")
        _register({"g": self.group, "dir": os.path.abspath(directory), "match": pattern})

    def add_slurm_job(self, job: str) -> None:
        """A Slurm job of the cluster's, cancelled with `scancel` (as the kernel's Slurm
        settings say: its SLURM_* variables now, not the watcher's from its start). Starts the
        watcher: a job queued or running is like a process of ours."""
        scancel = shutil.which("scancel")
        if scancel is None or not job.isdigit():
            return
        slurm = {k: v for k, v in os.environ.items() if k.startswith("SLURM_")}
        _register({"g": self.group, "scancel": job, "argv0": scancel, "env": slurm}, start=True)

    def close(self) -> None:
        """Forget everything registered: the kernel stopped the cluster (and removed its files)."""
        with _watcher_lock:
            _pending[:] = [m for m in _pending if m.get("g") != self.group]
            if _watcher is not None and _watcher_owner == os.getpid():
                _watcher.send({"forget": self.group})


def watch() -> Watch:
    """A new group of registrations (one cluster's), for the kernel's watcher (started with the
    first process registered; one that was ended is started again, knowing only what is
    registered after)."""
    return Watch(f"g{next(_groups)}")


_kernel_watch = Watch("kernel")


def kernel_watch() -> Watch:
    """The group of what the kernel keeps across clusters (never forgotten: each entry is
    checked to be the same process or file before anything is done to it)."""
    return _kernel_watch


# --------------------------------------------------------------------------------------
# The watcher process
# --------------------------------------------------------------------------------------

def _remove_path(path: str, dev: int, ino: int) -> None:
    """Remove `path` if it is still the file or directory registered (ours, not a link)."""
    try:
        found = os.lstat(path)
    except OSError:
        return
    if (found.st_dev, found.st_ino) != (dev, ino) or found.st_uid != os.getuid() or stat.S_ISLNK(found.st_mode):
        return
    if stat.S_ISDIR(found.st_mode):
        # rmtree walks by file descriptors where the platform allows it: it never follows a
        # link planted inside.
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _remove_files(directory: str, pattern: str) -> None:
    """Remove the regular files of ours in `directory` whose names match `pattern`."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            found = os.lstat(path)
            if stat.S_ISREG(found.st_mode) and found.st_uid == os.getuid():
                os.unlink(path)


def clean_up(registered: Iterable[dict]) -> None:
    """End every registered process that still runs and everything it started (SIGKILL, all at
    once: the kernel is gone, nothing here is worth a graceful exit, and a process told to stop
    may stop its siblings' parent first, orphaning them), then remove the registered files."""
    items = list(registered)
    processes = _handles(item["pid"] for item in items
                         if "pid" in item and alive(item["pid"], item.get("created")))
    everything = {p.pid: p for p in [*processes, *descendants(processes)] if p.pid != os.getpid()}
    end(everything.values(), grace=0)
    for item in items:
        if "scancel" in item:  # the job's processes, on nodes of their own, end with it
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run([item["argv0"], item["scancel"]], env={**os.environ, **item["env"]},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        if "path" in item:
            _remove_path(item["path"], item["dev"], item["ino"])
        elif "dir" in item:
            _remove_files(item["dir"], item["match"])


def main(argv: list[str]) -> int:
    """The watcher: registrations on stdin until it ends or the kernel is gone; then clean_up."""
    kernel, created = int(argv[0]), float(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups: dict[str, list[dict]] = {}
    pending = b""
    while alive(kernel, created):
        if not select.select([0], [], [], POLL_S)[0]:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the kernel exited, or was killed
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "forget" in message:
                groups.pop(message["forget"], None)
            else:
                groups.setdefault(message.pop("g"), []).append(message)
    clean_up(item for items in groups.values() for item in items)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
