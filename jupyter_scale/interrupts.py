"""Interrupting a cell on a worker, as the notebook's interrupt stops a kernel's cell.

An engine that runs cells in the worker's main thread (ipyparallel) passes the interrupt
on as SIGINT (`gate_sigint`); one that runs them in a thread (Dask, Ray) calls `interrupt`
from another thread. Either way a KeyboardInterrupt is raised only inside the cell's code
(`cell_may_be_interrupted`), never between cells, while the engine packs the reply, or
during a failed cell's clean-up (`sigint_ignored`).
"""

from __future__ import annotations

import ctypes
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from . import patches

_lock = threading.Lock()
_cell_thread: int | None = None  # the thread running a cell's code, while it may be interrupted
_cell_run = ""  # the run id of that cell
_interrupted = threading.Event()  # wakes the cell thread's time.sleep for an interrupt
_original_sleep = time.sleep
# An interrupt from another thread (PyThreadState_SetAsyncExc) lands only when the cell's
# thread runs Python again: without this, a cell sleeping in a thread (Dask, Ray) would sleep on.
_SLEEP = patches.Patch("time.sleep", "an interrupt wakes a cell that sleeps in a thread (Dask, Ray), as SIGINT "
                       "wakes the main thread", patches.INTERRUPTS)


def interrupt(run: str | None = None) -> bool:
    """Raise KeyboardInterrupt in the thread running the cell, as SIGINT does in a main thread.

    Called from another thread; fires at most once per cell. Like SIGINT, it takes effect
    when the cell's thread next runs Python code, and it wakes a time.sleep of the cell.
    `run`: only if the cell running is that run (an interrupt held up on the way, e.g. by a
    network outage, must not stop a later cell).
    """
    global _cell_thread
    with _lock:
        if run is not None and run != _cell_run:
            return False
        ident, _cell_thread = _cell_thread, None
        if ident is None:
            return False
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt))
        _interrupted.set()
        return True


def forget() -> None:
    """No cell of this worker's may be interrupted any more (the worker is reset)."""
    global _cell_thread, _cell_run
    with _lock:
        _cell_thread, _cell_run = None, ""
        _interrupted.clear()


def cell_may_be_interrupted(yes: bool, run: str = "") -> None:
    """The calling thread starts (yes) or stops running the code of cell `run`."""
    global _cell_thread, _cell_run
    with _lock:
        if yes:
            _cell_thread, _cell_run = threading.get_ident(), run
            _interrupted.clear()
            if threading.current_thread() is not threading.main_thread():
                _SLEEP.install(lambda original: _interruptible_sleep)  # only the cell's own thread sleeps differently
        else:
            _cell_thread = None
            # Drop an interrupt requested but not raised yet: it would hit the clean-up.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), ctypes.c_void_p(0))


def gate_sigint() -> None:
    """In a worker that runs cells in its main thread, SIGINT interrupts the cell only."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _sigint_in_cell)


@contextmanager
def sigint_ignored() -> Iterator[None]:
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to guard
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interruptible_sleep(seconds: float) -> None:
    """time.sleep, except that in a cell running off the main thread an interrupt wakes it."""
    if _cell_thread is None or threading.get_ident() != _cell_thread:
        return _original_sleep(seconds)
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    _interrupted.wait(seconds)


def _sigint_in_cell(signum, frame) -> None:
    """SIGINT handler of a worker that runs cells in its main thread (ipyparallel engines).

    A KeyboardInterrupt is raised only inside the cell's code. The kernel may interrupt a
    rank just as its cell ends: raised while the engine packs the reply, it would turn a
    clean answer into an engine error, and the rank would count as lost.
    """
    if _cell_thread == threading.get_ident():
        raise KeyboardInterrupt
