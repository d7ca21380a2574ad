"""Workers forked from a template process that imported their code once.

Starting a worker means a new Python importing torch, the engine and the worker code: a
second or two of CPU for each, paid again at every restart. A template process imports
them once (started early: at `%load_ext`, and kept across restarts); each worker is then a
fork of it, ready at once, its pages shared with the template until written (copy on write).

The template is never the kernel (whose threads and sockets a fork would copy in a broken
state) and forks only while it is safe: one thread, no CUDA context, no torch operation run
yet (libgomp's thread pool does not survive a fork); NumPy's OpenBLAS threads, which are
fork-safe, are the only others allowed. It checks that after its imports and refuses to serve
otherwise; the engine then starts its workers the usual way.

A fork becomes what `Popen(argv, env=, cwd=, stdin=/dev/null, stdout=stderr=output file,
start_new_session=True)` would have started for `python PROGRAM ARGS...` (a program of
jupyter_scale.programs), and the template reaps it and tells the kernel its exit status (the
kernel is not its parent). The template's own program is programs/worker_template.py.

Libraries read some settings from the environment once, when they load (OpenMP's and the
BLAS libraries' thread counts): a template serves only a worker environment that agrees
with its own on those (`Template.suits`); otherwise the engine starts a new template.

The template exits when the kernel closes its pipe; a kernel that dies ends it, and its
workers, through the kernel's watcher (processes.kernel_watch, and each cluster's watch).
Linux only (a fork of a process with loaded frameworks is unsafe on macOS).

Engines that start their workers through `multiprocessing` (Dask's nannies) use its own fork
server instead (`multiprocessing_server`), with the same imports preloaded: multiprocessing
gives each fork the kernel's directory and `sys.path`, and the engine passes the environment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from . import processes, programs

log = logging.getLogger(__name__)

# Environment variables read when a library loads, not when a worker starts: a template
# started under other values would give its workers the wrong ones.
LOAD_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "BLIS_", "VECLIB_", "NUMEXPR_", "LD_",
                      "PYTHON", "TORCH_", "PYTORCH_", "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "MALLOC_")

class TemplateError(RuntimeError):
    """The template cannot start a worker (it failed to start, refused, or is gone)."""


def supported() -> bool:
    return sys.platform.startswith("linux")


def load_time_settings(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES)}


def _suits(started_with: Mapping[str, str], started_in: str, env: Mapping[str, str]) -> bool:
    """Whether a template started with this environment in this directory serves workers of `env`."""
    relative = any(p and not os.path.isabs(p) for p in env.get("PYTHONPATH", "").split(os.pathsep))
    return (load_time_settings(env) == load_time_settings(started_with)
            and not (relative and os.getcwd() != started_in))


class Template:
    """A template process (see the module's doc): `spawn` forks a worker from it."""

    def __init__(self, preload: list[str], env: Mapping[str, str] | None = None):
        self.preload = list(preload)
        self.env = dict(os.environ if env is None else env)
        # Its directory: Python makes relative PYTHONPATH entries absolute against it.
        self.cwd = os.getcwd()
        self.error: str | None = None  # why it cannot serve
        self.refused = False  # its own check (or its imports) failed: it never will, in this environment
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._next_id = 0
        self._spawned: dict[int, int | str] = {}  # request id -> pid, or why it failed
        self._replies = threading.Condition(self._lock)
        self._exits: dict[int, int] = {}  # pid -> exit status (minus the signal)
        self._gone = False
        # Its own session: a Ctrl-C in the terminal running Jupyter does not reach it.
        self.process = subprocess.Popen(
            [*programs.command("worker_template"), json.dumps(self.preload)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env, cwd=self.cwd, start_new_session=True)
        processes.kernel_watch().add_processes([self.process.pid])
        self._reader = threading.Thread(target=self._read, name="jupyter_scale-template", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return not self._gone and self.error is None

    def suits(self, env: Mapping[str, str]) -> bool:
        """Whether a worker with this environment (and this process's directory) may come from
        this template."""
        return _suits(self.env, self.cwd, env)

    def wait_ready(self, timeout: float) -> bool:
        """Until it has imported everything (True), failed, or `timeout` passed (False)."""
        self._ready.wait(timeout)
        return self._ready.is_set() and self.alive

    def spawn(self, path: str, args: list[str], env: Mapping[str, str], cwd: str, output: str,
              timeout: float) -> int:
        """Fork `python path *args` (`path`: a program's file) with this environment and
        directory, its output appended to `output`; its pid."""
        if not self.suits(env):
            raise TemplateError("the worker's thread settings differ from the template's")
        if not self.wait_ready(timeout):
            if self.error:  # refused, or ended
                raise TemplateError(self.error)
            self._give_up(f"the template was not ready within {timeout:.0f} s")
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            line = json.dumps(dict(id=ident, path=path, args=list(args), env=dict(env), cwd=cwd, output=output))
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(line.encode() + b"\n")
                self.process.stdin.flush()
            except (OSError, ValueError) as exc:  # ValueError: closed
                raise TemplateError(f"the template is gone ({exc})") from None
            deadline = time.monotonic() + timeout
            while ident not in self._spawned and not self._gone:
                if not self._replies.wait(max(0.0, deadline - time.monotonic())):
                    break
            pid = self._spawned.pop(ident, None)
        if pid is None and not self._gone:
            self._give_up(f"the template did not fork within {timeout:.0f} s")
        if not isinstance(pid, int):
            raise TemplateError(pid or "the template ended while forking")
        return pid

    def _give_up(self, why: str) -> None:
        """A stuck template: ended (a fork it makes later is not left behind untracked), and
        marked as refusing, so that the workers after this one do not wait for it too."""
        with self._lock:
            self.error, self.refused = why, True
        self.process.kill()
        raise TemplateError(why)

    def exit_code(self, pid: int) -> int | None:
        """How a worker it forked ended (None: running, or the template is gone and cannot tell)."""
        with self._lock:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float) -> bool:
        """Until the template reports `pid`'s end (True), it is gone, or `timeout` passed."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits and not self._gone:
                if not self._replies.wait(max(0.0, deadline - time.monotonic())):
                    break
            return pid in self._exits

    def close(self, timeout: float = 5.0) -> None:
        """End the template (its workers live on: they are stopped through their engine)."""
        if not self._ready.is_set():  # still importing, with no fork yet: it would read the pipe's end only after
            self.process.kill()
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        # The pipe's end is its SIGTERM; reaped by its Popen, which reads how it ended.
        processes.end(processes.wait([self.process.pid], timeout, reap=False), grace=0, reap=False)
        self.process.wait()
        self._reader.join(timeout)
        with contextlib.suppress(OSError):
            if self.process.stdout is not None:
                self.process.stdout.close()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self._lock:
                if "ready" in message:
                    self._ready.set()
                elif "error" in message:
                    self.error, self.refused = message["error"], True
                    log.info("the worker template refused to serve: %s", self.error)
                elif "spawned" in message:
                    self._spawned[message["id"]] = message["spawned"]
                    self._exits.pop(message["spawned"], None)  # a pid used again: the old end is not this one's
                elif "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                self._replies.notify_all()
            if self.error is not None:
                break
        with self._lock:
            self._gone = True
            self.error = self.error or f"the template process ended (status {self.process.poll()})"
            self._replies.notify_all()
        self._ready.set()


# One template per preload list in this process (the kernel), kept across clusters' restarts.
_templates: dict[tuple[str, ...], Template] = {}
_templates_lock = threading.Lock()


def template(preload: list[str], env: Mapping[str, str] | None = None) -> Template | None:
    """The kernel's template for these imports, started now if there is none that suits
    `env` (default: this process's); None where forking is not supported."""
    if not supported():
        return None
    env = dict(os.environ if env is None else env)
    key = tuple(preload)
    with _templates_lock:
        found = _templates.get(key)
        # One that refused is kept (its workers start the usual way): it would refuse again.
        if found is not None and found.suits(env) and (found.alive or found.refused):
            return found
        if found is not None:
            log.info("starting a new worker template: %s",
                     "the environment's thread settings changed" if found.alive else found.error)
            found.close()
        _templates[key] = Template(preload, env)
        return _templates[key]


def close_all() -> None:
    """End every template of this process (`%scale stop`, the extension unloaded), and
    multiprocessing's fork server if `multiprocessing_server` started it."""
    with _templates_lock:
        found = list(_templates.values())
        _templates.clear()
    for each in found:
        each.close()
    _stop_multiprocessing_server()


# multiprocessing's fork server, as we started it: its environment and directory (None: not ours),
# and whether a probe forked from it ran (None: not tried yet).
_server_started_with: tuple[dict[str, str], str] | None = None
_server_works: bool | None = None


def multiprocessing_server(preload: list[str], env: Mapping[str, str], verify: float | None = None) -> bool:
    """Have multiprocessing's "forkserver" start method fork from a server that imported
    `preload`, started now unless the one started here before still suits `env` (this
    process's environment, less what the engine sets in it for its own workers).

    Its forks get this process's directory and `sys.path` from multiprocessing, and the
    environment the server started with: the caller passes the kernel's current one for the
    fork to apply (Dask's nanny does, see backends.dask). A variable removed since, or a
    changed load-time setting, needs a new server. False where it cannot serve safely, or
    (`verify`: the seconds to wait for its imports) where a probe forked from it does not run:
    the environment breaks every new Python (a sitecustomize failing), or an import hangs.
    """
    global _server_started_with, _server_works
    from multiprocessing import connection, util

    # Its socket must be a file in a directory of ours: Pythons before 3.10.9 and 3.11.1 put it
    # in Linux's abstract namespace, which every local user can connect to (and have it fork).
    if not supported() or util.is_abstract_socket_namespace(
            connection.arbitrary_address("AF_UNIX")):  # type: ignore[attr-defined]
        return False
    env = dict(env)
    if _server_started_with is not None:
        started_with, started_in = _server_started_with
        if _suits(started_with, started_in, env) and not set(started_with) - set(env):
            if _server_works is False:  # it would fail again in this environment
                return False
            if _server_pid() is not None:
                return _verified(verify)
        else:
            log.info("starting a new fork server: the environment changed")
        _stop_multiprocessing_server()
    elif _server_pid() is not None:
        return False  # someone else's in this process (a DataLoader's): its imports and environment are not known
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    multiprocessing.forkserver.ensure_running()  # it imports `preload` on its own; forks wait for that
    _server_started_with, _server_works = (env, os.getcwd()), None
    # Ended with the kernel by the kernel's watcher, with the directory of its socket.
    processes.kernel_watch().add_processes([p for p in [_server_pid()] if p is not None])
    processes.kernel_watch().add_path(util.get_temp_dir())
    return _verified(verify)


def _verified(within: float | None) -> bool:
    """Whether the fork server works: a probe forked from it, once, ran (None: not checked)."""
    global _server_started_with, _server_works
    if within is None or _server_works is not None:
        return _server_works is not False
    deadline = time.monotonic() + within
    preload = list(multiprocessing.forkserver._forkserver._preload_modules or ())  # type: ignore[attr-defined]
    probe = multiprocessing.get_context("forkserver").Process(target=_preloaded, args=(preload,),
                                                              name="jupyter_scale-probe", daemon=True)
    failed: list[BaseException] = []

    def start() -> None:
        try:
            probe.start()  # returns once the server forked it, after its imports: maybe never
        except Exception as exc:  # it is gone (died as it started): nothing answers
            failed.append(exc)

    starter = threading.Thread(target=start, name="jupyter_scale-probe", daemon=True)
    starter.start()
    starter.join(within)
    why: str | None
    if starter.is_alive():
        why = f"it did not fork within {within:.0f} s"
    elif failed:
        why = f"{type(failed[0]).__name__}: {failed[0]}"
    else:
        probe.join(max(deadline - time.monotonic(), 1.0))
        why = (None if probe.exitcode == 0 else "its imports failed" if probe.exitcode == _NOT_PRELOADED
               else f"a probe it forked did not finish within {within:.0f} s" if probe.exitcode is None
               else f"a probe it forked ended with {probe.exitcode}")
    if why is None:
        _server_works = True
        return True
    print(f"jupyter_scale: multiprocessing's fork server does not work ({why}); workers start as new processes",
          file=sys.stderr, flush=True)
    if probe.pid is not None:  # before the server goes: then the probe could no longer tell it is alive
        processes.end([probe.pid], grace=0)
    started_with = _server_started_with
    _stop_multiprocessing_server()  # which also ends a start still waiting for it
    starter.join(5)
    with contextlib.suppress(Exception):
        probe.join(5)
    _server_started_with, _server_works = started_with, False  # kept: the same environment fails again
    return False


_NOT_PRELOADED = 3


def _preloaded(modules: list[str]) -> None:
    """The probe: whether the fork server imported every module it was given (it skips one
    that fails to import, which would leave the workers to import it themselves)."""
    missing = [m for m in modules if m not in sys.modules]
    if missing:
        print(f"not imported by the fork server: {missing}", file=sys.stderr)
        sys.exit(_NOT_PRELOADED)


def _server_pid() -> int | None:
    # multiprocessing keeps its one fork server in a private object.
    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)


def _stop_multiprocessing_server() -> None:
    global _server_started_with
    if _server_started_with is None:
        return
    _server_started_with = None
    pid = _server_pid()
    if pid is None:
        return
    # It reads the end of its pipe only after its imports, which may take long or never end:
    # it is ended by pid (ours; it holds nothing that needs a clean exit), then multiprocessing
    # reaps it and forgets it (its private `_stop`: it has no public way to end its fork server).
    processes.end([pid], grace=0, reap=False)
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:
        with contextlib.suppress(OSError, ChildProcessError):
            stop()
