"""Debugging a rank from the notebook (worker side).

- `breakpoint()` and `pdb.set_trace()` in a cell stop this rank in a pdb whose prompt the
  kernel shows as an input request (`[rank 1] (Pdb) `); the other ranks go on until they
  block. `post_mortem` opens pdb where this rank's last failed cell raised (`%scale debug`).
- `where` says in one line where a rank is: the innermost line of notebook code and what it
  waits in ("all_reduce in cell line 7"); `stacks` gives every thread's stack.

What pdb prints travels with its prompt, as one event through the cell's event stream, so
the two arrive together on every engine and from every host. The answer comes back through
a mailbox that a rank can read while its cell holds every engine's own way to reach it: the
group's store, which the kernel writes to as it does to cut a group. Each answer is signed
with the cell's events key, which only the kernel and the ranks hold: someone who can reach a
store across hosts cannot type into a rank's debugger.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import io
import os
import pdb
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any, cast

from . import patches

# Seconds a rank waits for its answer in the store at a time: an interrupt (raised when the
# waiting thread next runs Python) ends the wait within that.
WAIT_S = 0.2
POLL_S = 0.05  # between looks at a mailbox that holds an answer not signed by the kernel
# What the kernel answers to end a rank's debugger: the user interrupted the notebook, or its
# frontend answers no input requests.
STOP, NO_STDIN = "\x00stop", "\x00no-stdin"
# Modules pdb does not stop in when stepping out of the cell: this package's and the
# engines' own frames, which hold nothing of the user's.
SKIP = ("jupyter_scale", "jupyter_scale.*", "ipyparallel.*", "ipykernel.*", "distributed.*", "ray.*",
        "concurrent.*", "threading", "asyncio.*", "tornado.*", "zmq.*", "contextlib", "runpy")
CELL_PREFIX = "<distribute-cell-"

_BREAKPOINT = patches.Patch("sys.breakpointhook", "breakpoint() in a cell stops this rank in a pdb that the "
                            "notebook answers", patches.DEBUGGER)
_SET_TRACE = patches.Patch("pdb.set_trace", "pdb.set_trace() in a cell stops this rank in a pdb that the "
                           "notebook answers", patches.DEBUGGER)


class NoPrompt(RuntimeError):
    """A rank stopped in the debugger, and nobody can answer its prompt."""


def answer_key(run: str, rank: int, seq: int) -> str:
    return f"jupyter_scale/debug/{run}/{rank}/{seq}"


def sign(key: str, where: str, answer: str) -> str:
    """The answer as the kernel writes it to the mailbox: MAC(where + answer), then the answer."""
    mac = hmac.new(key.encode(), f"{where}\n{answer}".encode(), hashlib.sha256).hexdigest()
    return mac + answer


def verify(key: str, where: str, signed: str) -> str | None:
    mac, answer = signed[:64], signed[64:]
    expected = hmac.new(key.encode(), f"{where}\n{answer}".encode(), hashlib.sha256).hexdigest()
    return answer if hmac.compare_digest(mac, expected) else None


# --------------------------------------------------------------------------------------
# Where a rank is
# --------------------------------------------------------------------------------------

def is_notebook_code(filename: str) -> bool:
    """A cell's own code, or a notebook function's (it has no file on this worker)."""
    if filename.startswith(CELL_PREFIX):
        return True
    return not filename.startswith("<") and not os.path.exists(filename)


def _label(code: types.CodeType, line: int | None) -> str:
    if code.co_filename.startswith(CELL_PREFIX):
        return f"cell line {line}"
    return f"{code.co_qualname} line {line}"


def where(frames: list[tuple[types.FrameType, int | None]], collective: str | None = None) -> str | None:
    """"all_reduce in cell line 7", "_BaseDataLoaderIter.__next__ in cell line 5", "cell line 3":
    the innermost notebook line of `frames` (outermost first) and what it is in; None where no
    notebook code runs."""
    found = [i for i, (frame, _) in enumerate(frames) if is_notebook_code(frame.f_code.co_filename)]
    if not found:
        return None
    i = found[-1]
    frame, line = frames[i]
    label = _label(frame.f_code, line)
    if collective:
        return f"{collective} in {label}"
    if i + 1 == len(frames) or _ours(str(frames[i + 1][0].f_globals.get("__name__", ""))):
        return label  # in the line itself, or in what this package put there (a patched sleep, pdb)
    return f"{frames[i + 1][0].f_code.co_qualname} in {label}"


def _ours(module: str) -> bool:
    """This package's frames, and the debugger's (a rank stopped at a breakpoint is in them)."""
    return module.startswith("jupyter_scale") or module in ("bdb", "pdb")


def _frames_of(frame: types.FrameType | None) -> list[tuple[types.FrameType, int | None]]:
    frames = []
    while frame is not None:
        frames.append((frame, frame.f_lineno))
        frame = frame.f_back
    return frames[::-1]


def where_failed(exc: BaseException, collective: str | None) -> str | None:
    """Where `exc` was raised (see where)."""
    frames: list[tuple[types.FrameType, int | None]] = list(traceback.walk_tb(exc.__traceback__))
    return where(frames, collective)


def where_now(thread: int | None, collective: str | None) -> str | None:
    """Where thread `thread` is now (from another thread: the heartbeat's)."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    return where(_frames_of(frame), collective) if frame is not None else None


def stacks() -> str:
    """Where the cell is (its first line: see where), then every thread's Python stack, the
    cell's first, with the cells' lines (they are in linecache); "idle" between cells."""
    cell = _cell_thread
    if cell is None:
        return "idle: no cell is running\n"
    from . import collectives

    place = where_now(cell, collectives.heartbeat_status()["collective"]) or "outside the notebook's code"
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    parts = []
    for ident in sorted(frames, key=lambda i: i != cell):
        if ident == threading.get_ident():
            continue  # the thread that asks
        stack = traceback.extract_stack(frames[ident])
        if ident == cell:  # from the cell's own frame on: what calls it is the engine's
            first = next((i for i, f in enumerate(stack) if f.filename.startswith(CELL_PREFIX)), 0)
            stack = traceback.StackSummary.from_list(stack[first:])
        lines = traceback.format_list(stack)
        name = "the cell's" if ident == cell else names.get(ident, ident)
        parts.append(f"Thread {name}:\n{''.join(lines)}")
    return f"{place}\n" + "\n".join(parts)


# --------------------------------------------------------------------------------------
# A rank's pdb
# --------------------------------------------------------------------------------------

@dataclass
class Line:
    """How this rank's debugger reaches the notebook during one cell (or post-mortem call)."""

    sink: Any  # metrics.EventSink of the call
    store_spec: dict  # the group's store: the mailbox
    key: str  # the events key: answers are signed with it
    run: str
    rank: int
    thread: int = field(default_factory=threading.get_ident)  # the cell's thread: the one that may stop
    seq: int = 0
    _store: Any = None

    def ask(self, text: str, prompt: str) -> str:
        """Show `text`, then `prompt`, in the notebook; the line the user answered."""
        self.seq += 1
        self.sink.emit({"kind": "debug", "rank": self.rank, "time": time.time(), "seq": self.seq,
                        "text": text, "prompt": prompt})
        self.sink.flush()
        where = answer_key(self.run, self.rank, self.seq)
        store = self._mailbox()
        while True:
            try:
                store.wait([where], datetime.timedelta(seconds=WAIT_S))
            except RuntimeError:  # not yet (torch's DistStoreError); a broken store raises below
                if not store.check([where]):
                    continue
            answer = verify(self.key, where, store.get(where).decode())
            if answer is not None:
                break
            time.sleep(POLL_S)  # a forged answer in its place: the kernel's overwrites it
        if answer == STOP:
            raise KeyboardInterrupt("the notebook was interrupted at the debugger's prompt")
        if answer == NO_STDIN:
            raise NoPrompt(f"rank {self.rank} stopped in the debugger, but the notebook's frontend answers no "
                           "input requests (nbclient, nbval): run the cell in JupyterLab, Notebook 7 or VS Code, "
                           "or remove the breakpoint")
        return answer

    def leave(self, text: str) -> None:
        """The rank goes on: show `text` (what pdb printed last) in the notebook."""
        self.sink.emit({"kind": "debug", "rank": self.rank, "time": time.time(), "seq": self.seq,
                        "text": text, "prompt": None})
        self.sink.flush()

    def _mailbox(self) -> Any:
        if self._store is None:
            from . import rendezvous

            self._store = rendezvous.group_store(self.store_spec, timeout=30)
        return self._store


class _Console(io.TextIOBase):
    """pdb's stdin and stdout on a rank: what it writes waits for its next read, and goes to
    the notebook with the prompt (the unfinished last line)."""

    def __init__(self, line: Line):
        self._line = line
        self._pending: list[str] = []

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending.append(text)
        return len(text)

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        written = "".join(self._pending)
        self._pending.clear()
        text, _, prompt = written.rpartition("\n")
        return self._line.ask(text + "\n" if text else "", prompt) + "\n"

    def leave(self) -> None:
        rest = "".join(self._pending)
        self._pending.clear()
        self._line.leave(rest)


class RankPdb(pdb.Pdb):
    """pdb on one rank, answered from the notebook. An interrupt at its prompt ends the cell
    (plain pdb would catch it and prompt again)."""

    def __init__(self, line: Line):
        self.console = _Console(line)
        console = cast(IO[str], self.console)
        super().__init__(stdin=console, stdout=console, skip=SKIP, nosigint=True, readrc=False)
        self.prompt = f"[rank {line.rank}] (Pdb) "

    def setup(self, frame, tb):  # type: ignore[no-untyped-def]
        # The stack starts at the cell (`bt`, `up` stop there): what called it is the engine's.
        done = super().setup(frame, tb)
        first = next((i for i, (f, _) in enumerate(self.stack) if f.f_code.co_filename.startswith(CELL_PREFIX)), 0)
        if 0 < first <= self.curindex:
            del self.stack[:first]
            self.curindex -= first
        return done

    def _cmdloop(self) -> None:
        self.allow_kbdint = True
        try:
            self.cmdloop()
        finally:
            self.allow_kbdint = False

    def interaction(self, frame, tb) -> None:  # type: ignore[no-untyped-def]
        try:
            super().interaction(frame, tb)
        finally:
            self.console.leave()


_line: Line | None = None  # the running cell's, while it may stop in the debugger
_cell_thread: int | None = None  # the thread that runs a cell's code, while it does


def _stop_here(frame: types.FrameType, header: str | None = None) -> None:
    line = _line
    if line is None or threading.get_ident() != line.thread:
        # Another thread of the cell, or nothing to answer a prompt: as pdb does without a
        # terminal, go on, but say so.
        print(f"jupyter_scale: a breakpoint at {frame.f_code.co_filename}:{frame.f_lineno} was skipped: only the "
              "cell's own thread can stop in the debugger", file=sys.stderr, flush=True)
        return
    debugger = RankPdb(line)
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame)


def _breakpointhook(*args: Any, **kwargs: Any) -> None:
    _stop_here(sys._getframe(1))


def _set_trace(*, header: str | None = None) -> None:
    _stop_here(sys._getframe(1), header)


@contextmanager
def cell_running(line: Line | None) -> Iterator[None]:
    """While a cell's code runs in this thread: breakpoint() and pdb.set_trace() stop it in a
    RankPdb on `line` (if any), and `stacks` shows this thread first."""
    global _line, _cell_thread
    _cell_thread = threading.get_ident()
    if line is None:
        try:
            yield
        finally:
            _cell_thread = None
        return
    _line = line
    try:
        with _BREAKPOINT.during(lambda original: _breakpointhook), _SET_TRACE.during(lambda original: _set_trace):
            yield
    finally:
        _line = _cell_thread = None
        if isinstance(getattr(sys.gettrace(), "__self__", None), RankPdb):
            sys.settrace(None)  # a debugger told to step past the cell's end stops here


# --------------------------------------------------------------------------------------
# Post-mortem
# --------------------------------------------------------------------------------------

_failure: BaseException | None = None  # the exception of this rank's last failed cell


def keep_failure(exc: BaseException, first_user_frame: types.TracebackType | None) -> None:
    """Keep a failed cell's exception (its frames with it) for `post_mortem`, from the
    first frame of the user's code on, as IPython keeps sys.last_traceback."""
    global _failure
    _failure = exc
    exc.__jupyter_scale_tb__ = first_user_frame  # type: ignore[attr-defined]


def forget_failure() -> None:
    global _failure
    _failure = None


def failure_kept() -> str | None:
    """'ValueError: ...' of the kept failure, or None."""
    exc = _failure
    return None if exc is None else f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def post_mortem(line: Line) -> dict:
    """pdb in the frames of this rank's last failure, until the user continues or quits."""
    exc = _failure
    if exc is None:
        return {"debugged": False}
    tb = getattr(exc, "__jupyter_scale_tb__", None) or exc.__traceback__
    debugger = RankPdb(line)
    debugger.reset()
    debugger.message(f"post-mortem of {failure_kept()}")
    try:
        debugger.interaction(None, tb)
    except pdb.bdb.BdbQuit:  # type: ignore[attr-defined]
        pass
    return {"debugged": True}
