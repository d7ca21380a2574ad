"""Workers forked from a process that imported their code once: multiprocessing's fork server.

Starting a worker means a new Python importing torch, the engine and the worker code: a
second or two of CPU for each, paid again at every restart. multiprocessing's fork server,
started with those imports preloaded (`multiprocessing_server`: early, at `%load_ext`, and
kept across restarts), imports them once; each worker is then a fork of it, ready at once,
its pages shared with the server until written (copy on write). There is one per process
(multiprocessing's), so one per kernel, for the engine in use:

- Engines that start their workers through `multiprocessing` (Dask's nannies) use its
  "forkserver" start method: multiprocessing gives each fork the kernel's directory and
  `sys.path`, and the engine passes the environment.
- Engines that start programs (ipyparallel's controller and engines) fork them with `fork`:
  each becomes what `Popen([python, PROGRAM, *ARGS], env=, cwd=, stdin=/dev/null,
  stdout=stderr=output file, start_new_session=True)` would have started (a new Python's
  `sys.path` too), and the server, which reaps it, tells the kernel its exit status.

The server is never the kernel (whose threads and sockets a fork would copy in a broken
state) and serves only while a fork is safe: one thread, no CUDA context, no torch operation
run yet (libgomp's thread pool does not survive a fork); NumPy's OpenBLAS stops its threads
before each fork. A probe forked from it checks that, and that every import succeeded, before
the first worker; otherwise the server is ended and the engine starts its workers the usual way.

Libraries read some settings from the environment once, when they load (OpenMP's and the
BLAS libraries' thread counts): the server serves only a worker environment that agrees with
its own on those (`_suits`); otherwise a new server starts.

The server ends with `close_all`; a kernel that dies ends it, and its workers, through the
kernel's watcher (processes.kernel_watch, and each cluster's watch). Linux only (a fork of a
process with loaded frameworks is unsafe on macOS).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping

import psutil

from . import processes

log = logging.getLogger(__name__)

# Environment variables read when a library loads, not when a worker starts: a server
# started under other values would give its workers the wrong ones.
LOAD_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "BLIS_", "VECLIB_", "NUMEXPR_", "LD_",
                      "PYTHON", "TORCH_", "PYTORCH_", "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "MALLOC_")

# sys.path as this module was imported. The fork server imports it first (see
# multiprocessing_server), so there it is a new Python's, which the programs it forks get back.
_NEW_PYTHON_PATH = list(sys.path)


def supported() -> bool:
    return sys.platform.startswith("linux")


def load_time_settings(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES)}


def _suits(started_with: Mapping[str, str], started_in: str, env: Mapping[str, str]) -> bool:
    """Whether a server started with this environment in this directory serves workers of `env`."""
    relative = any(p and not os.path.isabs(p) for p in env.get("PYTHONPATH", "").split(os.pathsep))
    return (load_time_settings(env) == load_time_settings(started_with)
            and not (relative and os.getcwd() != started_in))


# multiprocessing's fork server, as we started it: its imports, environment and directory
# (None: not ours), and whether a probe forked from it found it serving (None: not tried yet).
_server_started_with: tuple[list[str], dict[str, str], str] | None = None
_server_works: bool | None = None
_server_lock = threading.RLock()


def multiprocessing_server(preload: list[str], env: Mapping[str, str], verify: float | None = None) -> bool:
    """Have multiprocessing's "forkserver" start method fork from a server that imported
    `preload`, started now unless the one started here before has those imports and still
    suits `env` (this process's environment, less what the engine sets in it for its own
    workers).

    Its forks through multiprocessing get this process's directory and `sys.path`, and the
    environment the server started with: the caller passes the kernel's current one for the
    fork to apply (Dask's nanny does, see backends.dask). A variable removed since, or a
    changed load-time setting, needs a new server. False where it cannot serve safely, or
    (`verify`: the seconds to wait for its imports) where a probe forked from it finds it
    unsafe to fork, or does not run: the environment breaks every new Python (a
    sitecustomize failing), or an import hangs.
    """
    global _server_started_with, _server_works
    from multiprocessing import connection, util

    # Its socket must be a file in a directory of ours: Pythons before 3.10.9 and 3.11.1 put it
    # in Linux's abstract namespace, which every local user can connect to (and have it fork).
    if not supported() or util.is_abstract_socket_namespace(
            connection.arbitrary_address("AF_UNIX")):  # type: ignore[attr-defined]
        return False
    preload, env = [__name__, *preload], dict(env)
    with _server_lock:
        if _server_started_with is not None:
            imports, started_with, started_in = _server_started_with
            if imports == preload and _suits(started_with, started_in, env) and not set(started_with) - set(env):
                if _server_works is False:  # it would fail again in this environment
                    return False
                pid = _server_pid()
                if pid is not None and processes.alive(pid):
                    return _verified(verify)
            else:
                log.info("starting a new fork server: %s", "other imports" if imports != preload
                         else "the environment changed")
            _stop_server()
        elif _server_pid() is not None:
            return False  # someone else's in this process (a DataLoader's): its imports and environment are not known
        multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
        multiprocessing.forkserver.ensure_running()  # it imports `preload` on its own; forks wait for that
        _server_started_with, _server_works = (preload, env, os.getcwd()), None
        # Ended with the kernel by the kernel's watcher, with the directory of its socket.
        processes.kernel_watch().add_processes([p for p in [_server_pid()] if p is not None])
        processes.kernel_watch().add_path(util.get_temp_dir())
        return _verified(verify)


def _verified(within: float | None) -> bool:
    """Whether the fork server works: a probe forked from it, once, found it serving (None:
    not checked)."""
    global _server_started_with, _server_works
    if within is None or _server_works is not None:
        return _server_works is not False
    deadline = time.monotonic() + within
    preload = list(multiprocessing.forkserver._forkserver._preload_modules or ())  # type: ignore[attr-defined]
    probe = multiprocessing.get_context("forkserver").Process(target=_probe, args=(preload,),
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
        why = (None if probe.exitcode == 0 else _REFUSED.get(probe.exitcode or 0)
               or (f"a probe it forked did not finish within {within:.0f} s" if probe.exitcode is None
                   else f"a probe it forked ended with {probe.exitcode}"))
    if why is None:
        _server_works = True
        return True
    print(f"jupyter_scale: multiprocessing's fork server does not work ({why}); workers start as new processes",
          file=sys.stderr, flush=True)
    if probe.pid is not None:  # before the server goes: then the probe could no longer tell it is alive
        processes.end([probe.pid], grace=0)
    started_with = _server_started_with
    _stop_server()  # which also ends a start still waiting for it
    starter.join(5)
    with contextlib.suppress(Exception):
        probe.join(5)
    _server_started_with, _server_works = started_with, False  # kept: the same environment fails again
    return False


# The probe's exit codes: why the server may not serve.
_REFUSED = {3: "its imports failed", 4: "its imports started threads, which a fork would not copy",
            5: "its imports initialized CUDA, which a fork cannot use"}


def _probe(modules: list[str]) -> None:
    """Forked from the fork server: whether it imported every module it was given (it skips one
    that fails to import, which would leave the workers to import it themselves), and whether a
    fork of it is safe (see the module's doc). Exits with one of _REFUSED's codes if not."""
    missing = [m for m in modules if m not in sys.modules]
    threads = len(os.listdir(f"/proc/{os.getppid()}/task"))  # the server's, now
    torch = sys.modules.get("torch")
    problem = ((3, f"not imported by the fork server: {missing}") if missing
               else (4, f"the fork server runs {threads - 1} threads besides its own") if threads > 1
               else (5, "the fork server initialized CUDA") if torch is not None and torch.cuda.is_initialized()
               else None)
    if problem is not None:
        print(problem[1], file=sys.stderr)
        sys.exit(problem[0])


def _server_pid() -> int | None:
    # multiprocessing keeps its one fork server in a private object.
    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)


def _stop_server() -> None:
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
    server = multiprocessing.forkserver._forkserver
    stop = getattr(server, "_stop", None)
    if stop is not None:
        try:
            stop()
        except ChildProcessError:  # reaped already, by someone else: else it would wait for it at every start
            server._forkserver_pid = None  # type: ignore[attr-defined]
        except OSError:
            pass


def close_all() -> None:
    """End the fork server if `multiprocessing_server` started it (`%scale stop`, the extension
    unloaded, another engine's turn); what it forked lives on."""
    with _server_lock:
        _stop_server()


# --------------------------------------------------------------------------------------
# Programs forked from the server
# --------------------------------------------------------------------------------------

class Program:
    """A program forked from the fork server (see `fork`): its pid, and how it ended."""

    def __init__(self, process: multiprocessing.process.BaseProcess, server: psutil.Process):
        self._process = process
        self._server = server
        self.pid: int = process.pid  # type: ignore[assignment]
        try:
            self._handle: psutil.Process | None = psutil.Process(self.pid)
        except psutil.NoSuchProcess:  # ended at once, and the server reaped it
            self._handle = None

    def exit_code(self) -> int | None:
        """How it ended: None while it runs, or where the server that forked it ended first
        (nothing can tell then)."""
        code = self._process.exitcode
        # multiprocessing reads 255 once the server's end of the pipe closed, whatever the program did.
        return None if code == 255 and not processes.alive(self._server) else code

    def wait(self, timeout: float) -> bool:
        """Whether it ended, waiting up to `timeout` s."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            return False
        if self.exit_code() is not None or self._handle is None:
            return True
        return not processes.wait([self._handle], timeout)  # the server went first: its pid tells


def fork(preload: list[str], path: str, args: list[str], env: Mapping[str, str], cwd: str, output: str,
         wait: float) -> Program | None:
    """`python path *args` (`path`: a program's file), forked from the fork server of `preload`
    (see `multiprocessing_server`, waiting up to `wait` s for its imports) with this environment
    and directory, its output appended to `output`. None where it cannot be forked: the caller
    starts it the usual way."""
    if load_time_settings(env) != load_time_settings(os.environ):
        log.info("%s starts as a new process: its thread settings differ from the kernel's", path)
        return None
    process = multiprocessing.get_context("forkserver").Process(
        target=_become, args=(path, list(args), dict(env), cwd, output), name=f"jupyter_scale-{os.path.basename(path)}")
    with _server_lock:
        if not multiprocessing_server(preload, os.environ, verify=wait):
            return None
        try:
            server = psutil.Process(_server_pid())  # not None: it was found serving
            process.start()
        except Exception as exc:  # it went since: the usual start says what is wrong, if anything
            log.info("%s starts as a new process: the fork server failed (%s)", path, exc)
            return None
    # Not multiprocessing's to poll (its other starts would read the exit status first) or to join at exit.
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
    return Program(process, server)


def _become(path: str, args: list[str], env: dict[str, str], cwd: str, output: str) -> None:
    """In the fork: what Popen(start_new_session=True) with these streams would have started.
    Never returns."""
    try:
        gc.freeze()  # the server's objects: a collection here does not write to their pages
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [path, *args]
        sys.path = list(_NEW_PYTHON_PATH)
        multiprocessing.set_start_method(None, force=True)  # its own processes start as a new Python's would
        # Python's random reseeds itself in a fork; NumPy's global generator would be the
        # same in every worker (drawn once, in the server).
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:
            numpy_random.seed()
    except BaseException:  # as a failed exec: nothing of multiprocessing's may run here
        traceback.print_exc()
        os._exit(127)
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
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
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if code == -signal.SIGINT:  # ended by Ctrl-C: as Python does, by the signal itself
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)
