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
start_new_session=True)` would have started for `python -c CODE ARGS...`, and the template
reaps it and tells the kernel its exit status (the kernel is not its parent).

Libraries read some settings from the environment once, when they load (OpenMP's and the
BLAS libraries' thread counts): a template serves only a worker environment that agrees
with its own on those (`Template.suits`); otherwise the engine starts a new template.

The template exits when the kernel closes its pipe or dies; its workers have their own
watch on the kernel. Linux only (a fork of a process with loaded frameworks is unsafe on
macOS).

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
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

# Environment variables read when a library loads, not when a worker starts: a template
# started under other values would give its workers the wrong ones.
LOAD_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "BLIS_", "VECLIB_", "NUMEXPR_", "LD_",
                      "PYTHON", "TORCH_", "PYTORCH_", "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "MALLOC_")

# The template's program (`python -c TEMPLATE_MAIN '["module", ...]'`): imports what it is
# given, checks that a fork is still safe, says "ready", then forks a worker for each request
# line on stdin and reports every exit on stdout.
TEMPLATE_MAIN = r"""
import atexit, gc, json, os, select, signal, sys, traceback

def send(fd, **message):
    os.write(fd, json.dumps(message).encode() + b"\n")

def threads():
    return len(os.listdir("/proc/self/task"))

def unsafe_to_fork(allowed):
    if threads() != allowed:
        return f"{threads() - allowed} threads were started by the imports"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialized by the imports"
    return None

def become(request, inherited):
    # In the fork: what Popen(start_new_session=True) with these streams would have started.
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = ["-c", *request["args"]]
        # Python's random reseeds itself in a fork; NumPy's global generator would be the
        # same in every worker (drawn once, in the template).
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:
            numpy_random.seed()
    except BaseException:  # as a failed exec: nothing of the template's loop may run here
        traceback.print_exc()
        os._exit(127)
    code = 0
    try:
        exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    # What the interpreter does at exit: wait for non-daemon threads, run atexit, flush.
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if code == -signal.SIGINT:  # ended by Ctrl-C: as Python does, by the signal itself
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)

def serve():
    reply = os.dup(1)  # the kernel's pipe; fd 1 itself goes nowhere, so no import's print reaches it
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    try:
        # NumPy's OpenBLAS starts its threads as it loads; they survive a fork (OpenBLAS
        # stops and restarts them in its fork handlers). No other thread may run.
        try:
            import numpy
        except ImportError:
            pass
        allowed = threads()
        for name in json.loads(sys.argv[1]):
            __import__(name)
        problem = unsafe_to_fork(allowed)
    except BaseException as exc:
        problem = f"importing the workers' code failed: {type(exc).__name__}: {exc}"
    if problem:
        send(reply, error=problem)
        os._exit(1)
    gc.collect()
    gc.freeze()  # the imports' objects: a collection in a fork does not write to their pages
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below as a child exits
    kernel = os.getppid()
    send(reply, ready=os.getpid())
    pending = b""
    while os.getppid() == kernel:
        readable = select.select([0, wake_r], [], [], 1.0)[0]
        if wake_r in readable:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while True:  # reap every worker that ended: a zombie would look alive to the kernel
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send(reply, exited=pid, code=os.waitstatus_to_exitcode(status))
        if 0 not in readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the kernel closed the pipe, or is gone
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as exc:  # out of processes or memory: say so, and serve on
                send(reply, spawned=f"fork failed: {exc}", id=request["id"])
                continue
            if pid == 0:
                become(request, (reply, wake_r, wake_w))
            send(reply, spawned=pid, id=request["id"])
    os._exit(0)

serve()
"""


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
            [sys.executable, "-c", TEMPLATE_MAIN, json.dumps(self.preload)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env, cwd=self.cwd, start_new_session=True)
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

    def spawn(self, code: str, args: list[str], env: Mapping[str, str], cwd: str, output: str,
              timeout: float) -> int:
        """Fork `python -c code *args` with this environment and directory, its output
        appended to `output`; its pid."""
        if not self.suits(env):
            raise TemplateError("the worker's thread settings differ from the template's")
        if not self.wait_ready(timeout):
            if self.error:  # refused, or ended
                raise TemplateError(self.error)
            self._give_up(f"the template was not ready within {timeout:.0f} s")
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            line = json.dumps(dict(id=ident, code=code, args=list(args), env=dict(env), cwd=cwd, output=output))
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
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
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
    if not supported() or util.is_abstract_socket_namespace(connection.arbitrary_address("AF_UNIX")):
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
    return _verified(verify)


def _verified(within: float | None) -> bool:
    """Whether the fork server works: a probe forked from it, once, ran (None: not checked)."""
    global _server_started_with, _server_works
    if within is None or _server_works is not None:
        return _server_works is not False
    deadline = time.monotonic() + within
    preload = list(multiprocessing.forkserver._forkserver._preload_modules or ())
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
        with contextlib.suppress(OSError):
            os.kill(probe.pid, signal.SIGKILL)
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
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:
        with contextlib.suppress(OSError, ChildProcessError):
            stop()
