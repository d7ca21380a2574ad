"""The worker template's program (see jupyter_scale.forkserver): `python worker_template.py
'["module", ...]'` imports what it is given, checks that a fork is still safe, says "ready",
then forks a worker for each request line on stdin and reports every exit on stdout. It ends
when the kernel closes the pipe; a kernel that dies ends it through the kernel's watcher
(jupyter_scale.processes).

A request: {"id", "path" (a program's file), "args", "env", "cwd", "output"}; the fork becomes
what `Popen([python, path, *args], env=, cwd=, stdin=/dev/null, stdout=stderr=output,
start_new_session=True)` would have started.
"""

import atexit
import gc
import json
import os
import runpy
import select
import signal
import sys
import traceback
from typing import Any


def send(fd: int, **message: Any) -> None:
    os.write(fd, json.dumps(message).encode() + b"\n")


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def unsafe_to_fork(allowed: int) -> str | None:
    if threads() != allowed:
        return f"{threads() - allowed} threads were started by the imports"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialized by the imports"
    return None


def become(request: dict, inherited: tuple[int, ...]) -> None:
    """In the fork: what Popen(start_new_session=True) with these streams would have started.
    Never returns."""
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
        sys.argv = [request["path"], *request["args"]]
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
        runpy.run_path(request["path"], run_name="__main__")
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
            threading._shutdown()  # type: ignore[attr-defined]
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


def serve(preload: list[str]) -> None:
    reply = os.dup(1)  # the kernel's pipe; fd 1 itself goes nowhere, so no import's print reaches it
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    try:
        # NumPy's OpenBLAS starts its threads as it loads; they survive a fork (OpenBLAS
        # stops and restarts them in its fork handlers). No other thread may run.
        try:
            import numpy  # noqa: F401
        except ImportError:
            pass
        allowed = threads()
        for name in preload:
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
    send(reply, ready=os.getpid())
    pending = b""
    while True:
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


if __name__ == "__main__":
    sys.path[0] = ""  # the working directory, as `python -c`, not this one (see programs)
    serve(json.loads(sys.argv[1]))
