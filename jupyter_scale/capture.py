"""A call's output on a worker whose engine does not capture it (Dask, Ray), or that came
over the kernel's own channel (see channel): what `fn` prints and displays goes to the
kernel in small batches while it runs, through whatever channel carries them, and the
kernel turns the batches back into `Output`s.

ipyparallel engines are IPython kernels and capture the output of the engine's own calls
themselves; during a call that came over the kernel's channel their streams write here.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from .backends.base import Output

# Seconds between batches while a call prints.
OUTPUT_INTERVAL_S = 0.05


class OutputPump:
    """Sends what a call prints to the kernel, every 50 ms and when the call ends.

    `send(message)` hands one message to the engine's channel (a Dask event, a Ray
    actor's queue): {"job", "rank", "parts": [[stream, text] | ["display", data,
    metadata], ...], "end"}; `outputs_of` reads it on the kernel's side.
    """

    def __init__(self, send: Callable[[dict], Any], job: str, rank: int):
        self._send, self._job, self._rank = send, job, rank
        self._parts: list[list[Any]] = []  # [stream, text] or ["display", data, metadata]
        self._lock = threading.RLock()  # send() holds it while add() may be called from a print in Dask code
        self._stop = threading.Event()
        self._pending = threading.Event()  # parts wait to be sent
        # Started by the first output: a call that prints nothing (most) costs no thread, and
        # a thread that woke every 50 ms for nothing would cost the training loop CPU.
        self._thread: threading.Thread | None = None

    def add(self, stream: str, text: str) -> None:
        with self._lock:
            if self._parts and self._parts[-1][0] == stream:
                self._parts[-1][1] += text
            else:
                self._parts.append([stream, text])
            self._pending.set()
            self._start()

    def add_display(self, data: dict, metadata: dict) -> None:
        with self._lock:
            self._parts.append(["display", data, metadata or {}])
            self._pending.set()
            self._start()

    def _start(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="jupyter_scale-output", daemon=True)
            self._thread.start()

    def send(self, end: bool = False) -> None:
        # Under the lock from taking the parts to handing them to Dask: batches stay in order
        # whichever thread (the pump's, the call's) sends them.
        with self._lock:
            parts, self._parts = self._parts, []
            if not self._stop.is_set():  # once stopped, the pump's thread must not wait again
                self._pending.clear()
            if not parts and not end:
                return
            message = {"job": self._job, "rank": self._rank, "parts": parts, "end": end}
            try:
                self._send(message)
            except TypeError:  # a display bundle the engine cannot carry (Dask's msgpack): say so, keep the text
                parts = [p if p[0] != "display" else ["stderr", "jupyter_scale: a display() output could "
                                                      "not be sent from this worker\n"] for p in parts]
                self._send(dict(message, parts=parts))

    def _run(self) -> None:
        # Asleep while nothing is printed; a batch gathers for OUTPUT_INTERVAL_S.
        while not self._stop.is_set():
            self._pending.wait()
            self._stop.wait(OUTPUT_INTERVAL_S)
            self.send()

    def close(self) -> None:
        # The call's thread sends the rest itself: no waiting for the pump's thread, which
        # wakes at the stop and ends.
        self._stop.set()
        self._pending.set()
        self.send(end=True)


_current: OutputPump | None = None  # the running call's


class _Forward(io.TextIOBase):
    """A worker's stdout or stderr during and between calls: what is written goes to the
    running call's pump, and between calls (a thread a call left running, a logging handler
    an earlier call made) where it went before."""

    def __init__(self, name: str, fallback: Callable[[str], Any], fallback_flush: Callable[[], Any]):
        self.name, self._fallback, self._fallback_flush = name, fallback, fallback_flush
        # A marker on its way through a pipe watcher (see _FdSync): (marker, what may be its start).
        self._awaited: tuple[str, str] | None = None
        self._marker_seen = threading.Event()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        pump = _current
        if pump is None:
            return self._fallback(text) or len(text)
        if self._awaited is not None:
            text = self._strip_marker(text)
        pump.add(self.name, text)
        return len(text)

    def flush(self) -> None:
        pump = _current
        if pump is not None:
            pump.send()
        else:
            self._fallback_flush()

    def _strip_marker(self, text: str) -> str:
        # The pipe watcher reads in chunks: the marker may come split across two of them.
        marker, held = self._awaited
        text = held + text
        found = text.find(marker)
        if found >= 0:
            self._awaited = None
            self._marker_seen.set()
            return text[:found] + text[found + len(marker):]
        keep = next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)
        self._awaited = (marker, text[len(text) - keep:])
        return text[:len(text) - keep]


class _FdSync:
    """An IPython kernel's streams also carry what is written to the file descriptors 1 and
    2 (C code, subprocesses), read from a pipe by a thread of the kernel's. At the end of a
    call, a marker written to each descriptor comes back through that thread once everything
    written before it has: the call's last output is not left behind."""

    TIMEOUT_S = 0.5

    def __init__(self, watched: list[tuple[int, _Forward]]):
        self.watched = watched

    def wait(self) -> None:
        for fd, forward in self.watched:
            forward._marker_seen.clear()
            marker = f"\x1b]jupyter_scale;{secrets.token_hex(4)}\x07"  # an OSC sequence: terminals show nothing
            forward._awaited = (marker, "")
            os.write(fd, marker.encode())
        for _, forward in self.watched:
            if not forward._marker_seen.wait(self.TIMEOUT_S):
                _, held = forward._awaited or ("", "")
                forward._awaited = None
                if held and _current is not None:
                    _current.add(forward.name, held)


_plain: dict[str, _Forward] = {}  # a plain worker's (Dask's, Ray's), redirected to per call
_kernel_sync: _FdSync | None = None  # an IPython kernel's (ipyparallel's), diverted once


def _plain_streams() -> dict[str, _Forward]:
    if not _plain:
        for name in ("stdout", "stderr"):
            def write(text: str, name: str = name) -> int:
                original = getattr(sys, f"__{name}__")  # None in a process without one
                return original.write(text) if original is not None else len(text)

            def flush(name: str = name) -> None:
                original = getattr(sys, f"__{name}__")
                if original is not None:
                    original.flush()

            _plain[name] = _Forward(name, write, flush)
    return _plain


def _divert_kernel_streams() -> _FdSync | None:
    """Where the worker is an IPython kernel (an ipyparallel engine) its own streams and
    display publisher write to the running call's pump, once and for good: output that does
    not go through sys.stdout (a logging handler an earlier cell made, the file descriptors
    the kernel's streams watch) would otherwise be published under the kernel's last
    request, to nobody. Between calls, and in the engine's own calls, they work as before.
    None where the worker is no IPython kernel."""
    global _kernel_sync
    from IPython.core.interactiveshell import InteractiveShell

    if _kernel_sync is not None:
        return _kernel_sync
    streams: list[Any] = [s for s in (sys.stdout, sys.stderr) if type(s).__module__ == "ipykernel.iostream"]
    if not streams:
        return None
    watched = []
    for stream in streams:
        forward = _Forward(stream.name, stream.write, stream.flush)
        stream.write, stream.flush = forward.write, forward.flush  # over the class's methods
        if getattr(stream, "_should_watch", False) and getattr(stream, "_fid", None) is not None:
            watched.append((stream._original_stdstream_fd, forward))
    if InteractiveShell.initialized():
        publisher = InteractiveShell.instance().display_pub
        publish = publisher.publish

        def to_pump(data, metadata=None, *args, **kwargs):
            if _current is None:
                return publish(data, metadata, *args, **kwargs)
            _current.add_display(data, metadata)

        publisher.publish = to_pump
    _kernel_sync = _FdSync(watched)
    return _kernel_sync


def display_shell() -> None:
    """An IPython shell whose display() output goes to the kernel, as on ipyparallel engines.

    Without one, IPython's display() prints the plain-text repr. The shell gets a module of
    its own: the worker's __main__ is left alone.
    """
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    if InteractiveShell.initialized():
        return

    class _ToKernel(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **_kw):
            if _current is not None:
                _current.add_display(data, metadata)

    config = Config()
    config.HistoryManager.enabled = False
    InteractiveShell.instance(config=config, user_module=types.ModuleType("__jupyter_scale_display__"),
                              display_pub_class=_ToKernel)


def call_captured(fn: Callable, args: tuple, send: Callable[[dict], Any], job: str, rank: int) -> Any:
    """fn(*args), with what it prints and displays sent to the kernel through `send`."""
    global _current
    kernel = _divert_kernel_streams()
    if kernel is None:
        display_shell()
    pump = _current = OutputPump(send, job, rank)
    try:
        if kernel is not None:
            try:
                return fn(*args)
            finally:
                kernel.wait()  # what the file descriptors carried comes with the call's output
        streams = _plain_streams()
        with contextlib.redirect_stdout(streams["stdout"]), contextlib.redirect_stderr(streams["stderr"]):
            return fn(*args)
    finally:
        _current = None
        pump.close()


def outputs_of(message: dict) -> tuple[int, list[Output], bool]:
    """Kernel side: a pump's message as (rank, its outputs, whether the call's output ended)."""
    rank = message["rank"]
    outputs = [Output(rank, "display", data=part[1], metadata=part[2]) if part[0] == "display"
               else Output(rank, part[0], part[1]) for part in message["parts"]]
    return rank, outputs, bool(message["end"])
