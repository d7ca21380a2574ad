"""A call's output on a worker whose engine does not capture it (Dask, Ray): what `fn`
prints and displays goes to the kernel in small batches while it runs, through whatever
channel the engine has, and the kernel turns the batches back into `Output`s.

ipyparallel engines are IPython kernels and capture output themselves.
"""

from __future__ import annotations

import contextlib
import io
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
        self._thread = threading.Thread(target=self._run, name="jupyter_scale-output", daemon=True)
        self._thread.start()
        self.stdout, self.stderr = Stream(self, "stdout"), Stream(self, "stderr")

    def add(self, stream: str, text: str) -> None:
        with self._lock:
            if self._parts and self._parts[-1][0] == stream:
                self._parts[-1][1] += text
            else:
                self._parts.append([stream, text])

    def add_display(self, data: dict, metadata: dict) -> None:
        with self._lock:
            self._parts.append(["display", data, metadata or {}])

    def send(self, end: bool = False) -> None:
        # Under the lock from taking the parts to handing them to Dask: batches stay in order
        # whichever thread (the pump's, the call's) sends them.
        with self._lock:
            parts, self._parts = self._parts, []
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
        while not self._stop.wait(OUTPUT_INTERVAL_S):
            self.send()

    def close(self) -> None:
        # The call's thread sends the rest itself: no waiting for the pump's thread, which
        # sees the stop at its next wake-up and ends.
        self._stop.set()
        self.send(end=True)


class Stream(io.TextIOBase):
    def __init__(self, pump: OutputPump, name: str):
        self._pump, self.name = pump, name

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pump.add(self.name, text)
        return len(text)

    def flush(self) -> None:
        self._pump.send()


_current: OutputPump | None = None


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
    display_shell()
    pump = _current = OutputPump(send, job, rank)
    try:
        with contextlib.redirect_stdout(pump.stdout), contextlib.redirect_stderr(pump.stderr):
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
