"""A call's output on a worker whose engine does not capture it (Dask, Ray), or that came
over the kernel's own channel (see channel): what `fn` prints and displays goes to the
kernel in small batches while it runs, through whatever channel carries them, and the
kernel turns the batches back into `Output`s.

ipyparallel engines are IPython kernels and capture the output of the engine's own calls
themselves; during a call that came over the kernel's channel their streams write here.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import secrets
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from . import patches
from .protocol import Output

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


# The end marker of a call's output on a watched file descriptor (see _FdSync): an OSC
# escape sequence, which terminals do not show.
_MARKER_START = "\x1b]jupyter_scale;"
_MARKER = re.compile(r"\x1b\]jupyter_scale;[0-9a-f]{8}\x07")
_MARKER_LENGTH = len(_MARKER_START) + 9


def _may_start_marker(text: str) -> bool:
    """Whether `text` (the end of a chunk) may be the start of a marker cut by the chunking."""
    if len(text) >= _MARKER_LENGTH:
        return False
    if len(text) <= len(_MARKER_START):
        return _MARKER_START.startswith(text)
    return text.startswith(_MARKER_START) and all(c in "0123456789abcdef" for c in text[len(_MARKER_START):])


class _Forward(io.TextIOBase):
    """A worker's stdout or stderr during and between calls: what is written goes to the
    running call's pump, and between calls (a thread a call left running, a logging handler
    an earlier call made) where it went before. `fd` and `watcher`: the file descriptor an
    IPython kernel's pipe watcher thread reads into this stream."""

    def __init__(self, name: str, fallback: Callable[[str], Any], fallback_flush: Callable[[], Any],
                 fd: int | None = None, watcher: threading.Thread | None = None):
        self.name, self._fallback, self._fallback_flush = name, fallback, fallback_flush
        self.fd, self.watcher = fd, watcher
        self._pid = os.getpid()
        self._lock = threading.Lock()  # the watcher's writes against expect() and arrived()
        self._awaited: str | None = None  # the marker on its way through the pipe
        self._held = ""  # the end of the watcher's last chunk, which may start a marker
        self._marker_seen = threading.Event()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if os.getpid() != self._pid:
            # A process the call forked (a DataLoader's workers): it must not touch the
            # parent's pump or sockets. Its output takes the watched file descriptor, which
            # the parent's watcher reads into the call's output, where there is one.
            if self.fd is not None:
                os.write(self.fd, text.encode(errors="replace"))
                return len(text)
            return self._fallback(text) or len(text)
        if self.watcher is not None and threading.current_thread() is self.watcher:
            text = self._from_watcher(text)
        pump = _current
        if pump is None:
            return self._fallback(text) or len(text)
        pump.add(self.name, text)
        return len(text)

    def flush(self) -> None:
        pump = _current
        if pump is not None and os.getpid() == self._pid:
            pump.send()
        else:
            self._fallback_flush()

    def _from_watcher(self, text: str) -> str:
        """The watcher's chunk without our markers (the awaited one, and any that arrived
        after its wait gave up); the watcher reads in chunks, so a marker may be cut in two."""
        with self._lock:
            text, self._held = self._held + text, ""
            if "\x1b" not in text:
                return text
            if self._awaited is not None and self._awaited in text:
                self._awaited = None
                self._marker_seen.set()
            text = _MARKER.sub("", text)
            cut = text.rfind("\x1b")
            if cut >= 0 and _may_start_marker(text[cut:]):
                text, self._held = text[:cut], text[cut:]
            return text

    def expect(self, marker: str) -> None:
        with self._lock:
            self._marker_seen.clear()
            self._awaited = marker
        assert self.fd is not None
        os.write(self.fd, marker.encode())

    def arrived(self, timeout: float) -> bool:
        seen = self._marker_seen.wait(timeout)
        with self._lock:
            self._awaited = None  # a late one is still taken out of the output
        return seen


def _flush_c_stdio() -> None:
    """What C code printed and its stdio still buffers (all of it, on a pipe) goes to the pipe."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask
        pass


class _FdSync:
    """An IPython kernel's streams also carry what is written to the file descriptors 1 and
    2 (C code, subprocesses), read from a pipe by a thread of the kernel's. At the end of a
    call, a marker written to each descriptor comes back through that thread once everything
    written before it has: the call's last output is not left behind."""

    TIMEOUT_S = 0.5

    def __init__(self, watched: list[_Forward]):
        self.watched = watched

    def wait(self) -> None:
        if not self.watched:
            return
        _flush_c_stdio()
        for forward in self.watched:
            forward.expect(f"{_MARKER_START}{secrets.token_hex(4)}\x07")
        for forward in self.watched:
            forward.arrived(self.TIMEOUT_S)


_plain: dict[str, _Forward] = {}  # a plain worker's (Dask's, Ray's), redirected to per call
_WHY_STREAMS = "an ipyparallel engine's output during a call over the kernel's channel goes to that call"
_STREAMS = {(name, method): patches.Patch(f"sys.{name}.{method}", _WHY_STREAMS, patches.CAPTURE)
            for name in ("stdout", "stderr") for method in ("write", "flush")}
_PUBLISH = patches.Patch("IPython.core.displaypub.DisplayPublisher.publish (the engine's)",
                         "display() during such a call goes to that call", patches.CAPTURE)
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

    if _kernel_sync is not None and any(p.is_installed for p in _STREAMS.values()):
        return _kernel_sync
    streams: list[Any] = [s for s in (sys.stdout, sys.stderr) if type(s).__module__ == "ipykernel.iostream"]
    if not streams:
        return None
    watched = []
    for stream in streams:
        watching = getattr(stream, "_should_watch", False) and getattr(stream, "watch_fd_thread", None) is not None
        forward = _Forward(stream.name, stream.write, stream.flush, fd=stream._original_stdstream_fd if watching
                           else None, watcher=stream.watch_fd_thread if watching else None)
        for method in ("write", "flush"):  # over the class's methods, on this object only
            _STREAMS[stream.name, method].install(_returning(getattr(forward, method)), owner=stream)
        if watching:
            watched.append(forward)
    if InteractiveShell.initialized():
        def patch_publish(publish):
            def to_pump(data, metadata=None, *args, **kwargs):
                if _current is None:
                    return publish(data, metadata, *args, **kwargs)
                _current.add_display(data, metadata)

            return to_pump

        _PUBLISH.install(patch_publish, owner=InteractiveShell.instance().display_pub)
    _kernel_sync = _FdSync(watched)
    return _kernel_sync


def _returning(value: Any) -> Callable[[Any], Any]:
    return lambda _original: value


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


def _forget_call_in_child() -> None:
    global _current
    _current = None  # a forked child's copy of the pump has no thread, and its sends are the parent's


os.register_at_fork(after_in_child=_forget_call_in_child)


def outputs_of(message: dict) -> tuple[int, list[Output], bool]:
    """Kernel side: a pump's message as (rank, its outputs, whether the call's output ended)."""
    rank = message["rank"]
    outputs = [Output(rank, "display", data=part[1], metadata=part[2]) if part[0] == "display"
               else Output(rank, part[0], part[1]) for part in message["parts"]]
    return rank, outputs, bool(message["end"])
