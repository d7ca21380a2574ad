"""An engine in the kernel's own process, for the session's state machine.

Each rank is a thread per call; what a cell does on a rank is a script the test gives
(answer, fail, hang, ignore interrupts, die, go silent), with the timing it wants. The
session, its wait loop, the event stream (a real ZeroMQ socket and the workers' real
EventSink) and the group's store are the real ones: only the engine and the workers' cell
code are stand-ins. Plugged in as the "fake" entry point (see `installed`), never in the
package. The real-cluster tests stay the proof that engines behave so.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from jupyter_scale import backends, metrics, rendezvous, worker
from jupyter_scale.backends import Backend, Job, Output
from jupyter_scale.errors import WorkerLost


class Died(Exception):
    """Raised by a script: the rank's worker process dies (the engine reports it lost)."""


class Rank:
    """What a script sees of its rank while the cell runs."""

    def __init__(self, rank: int, request: dict, job: FakeJob, store: dict):
        self.rank, self.request, self._job, self._store = rank, request, job, store
        self.interrupted = threading.Event()
        self.sink = metrics.EventSink(request["events"], rank, request["events_key"])
        self.sink.begin(request["run"])
        self.sink.heartbeat_interval = request.get("heartbeat", 0.0)
        self.collective: tuple[str, float] | None = None  # (name, since) while "in" one
        self.sink.heartbeat_status = lambda: ({"collective": self.collective[0], "since": self.collective[1]}
                                              if self.collective else {"collective": None})

    def print(self, text: str, stream: str = "stdout") -> None:
        self._job.output(Output(self.rank, stream, text))

    def report(self, step: int, **values: float) -> None:
        self.sink.emit({"rank": self.rank, "step": step, "time": time.time(), **values})

    def sleep(self, seconds: float) -> None:
        """Sleep as a cell does: an interrupt ends it with KeyboardInterrupt."""
        if self.interrupted.wait(seconds):
            raise KeyboardInterrupt

    def wait_in_collective(self, name: str, seconds: float) -> None:
        """Block as a rank in a collective does: deaf to interrupts, freed only when the
        kernel asks the group's store to abort (what the real ranks' AbortWatch reads)."""
        self.collective = (name, time.time())
        store = rendezvous.group_store(self._store, timeout=5)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if store.check([rendezvous.ABORT_KEY]):
                raise RuntimeError(f"Connection closed by peer (in {name})")
            time.sleep(0.01)
        self.collective = None

    def go_silent(self) -> None:
        """No word from here on (a host that left the network): the heartbeats stop."""
        self.sink.heartbeat_interval = 0.0


Script = Callable[[Rank], Any]


class FakeJob(Job):
    def __init__(self, ranks: list[int]):
        super().__init__(ranks)
        self._answers: dict[int, Any] = {}
        self._errors: dict[int, BaseException] = {}

    def output(self, out: Output) -> None:
        self.accept_output([out])

    def finish(self, rank: int, answer: Any = None, error: BaseException | None = None) -> None:
        if error is not None:
            self._errors[rank] = error
        else:
            self._answers[rank] = answer
        self.notify()

    def _replied(self, rank: int) -> bool:
        return rank in self._answers or rank in self._errors

    def _worker_gone(self, rank: int) -> bool:
        return False  # a dying fake worker answers with WorkerLost at once

    def result(self, rank: int) -> Any:
        if rank in self._errors:
            raise self._errors[rank]
        return self._answers[rank]


class FakeBackend(Backend):
    name = "fake"
    # What cells do, rank by rank: set by the test before it runs one (a rank without a
    # script answers at once).
    scripts: dict[int, Script] = {}
    starts = 0  # clusters started, over every instance (a restart makes a new one)

    def __init__(self, **options: Any):
        super().__init__(**options)
        self._size = 0
        self._dead: set[int] = set()
        self._running_cells: dict[int, tuple[str, Rank]] = {}  # rank -> (run id, its view)
        self._group: dict = {}

    # -- lifecycle ------------------------------------------------------------------
    def start(self, n: int, timeout: float, launcher: Any = None) -> None:
        type(self).starts += 1
        self._size = n

    def stop(self) -> None:
        self._size = 0

    @property
    def running(self) -> bool:
        return self._size > 0

    @property
    def size(self) -> int:
        return self._size

    def dead_ranks(self) -> list[int]:
        return sorted(self._dead)

    def kill(self, rank: int) -> None:
        """The rank's worker process dies between cells."""
        self._dead.add(rank)

    # -- calls ----------------------------------------------------------------------
    def submit(self, fn: Callable, *args: Any, ranks: list[int] | None = None) -> Job:
        ranks = list(range(self._size)) if ranks is None else list(ranks)
        return self._calls(fn, {r: args for r in ranks})

    def submit_each(self, fn: Callable, args_per_rank: list[tuple]) -> Job:
        return self._calls(fn, dict(enumerate(args_per_rank)))

    def _calls(self, fn: Callable, calls: dict[int, tuple]) -> Job:
        job = FakeJob(sorted(calls))
        for rank, args in calls.items():
            threading.Thread(target=self._call, args=(job, fn, rank, args), daemon=True).start()
        return job

    def _call(self, job: FakeJob, fn: Callable, rank: int, args: tuple) -> None:
        if rank in self._dead:
            job.finish(rank, error=WorkerLost(rank, "its fake worker is dead"))
            return
        try:
            answer = self._answer(job, fn, rank, args)
        except Died:
            self._dead.add(rank)
            job.finish(rank, error=WorkerLost(rank, "its fake worker died"))
            return
        job.finish(rank, answer)

    def _answer(self, job: FakeJob, fn: Callable, rank: int, args: tuple) -> Any:
        if fn is worker.describe:
            return {"shared_memory": None, "hostname": socket.gethostname(), "node": rendezvous.node_identity(),
                    "interfaces": [], "address": None, "sees_store_dir": True, "pid": os.getpid(),
                    "launcher_rank": None, "cuda_count": 0, "python": "", "torch": ""}
        if fn is worker.join_group:
            self._group = {"store": args[0]["store"]}
            return {"rank": rank, "backend": "gloo", "device": "cpu", "rewrapped": []}
        if fn is worker.run_cell:
            return self._run_cell(job, rank, args[0])
        if fn in (worker.leave_group, worker.reset, worker.sync_buffers):
            return None
        raise NotImplementedError(f"the fake backend does not run {fn.__name__}")

    def _run_cell(self, job: FakeJob, rank: int, request: dict) -> tuple:
        view = Rank(rank, request, job, self._group["store"])
        self._running_cells[rank] = (request["run"], view)
        started = time.time()
        try:
            frames = self.scripts.get(rank, lambda r: None)(view) or ()  # what it sends back, if any
        except Died:
            view.sink.close()
            raise
        except BaseException as exc:  # noqa: B036 - as a worker, answer whatever happened
            failure = {"rank": rank, "etype": type(exc).__name__, "message": str(exc), "traceback": "",
                       "time": time.time(), "interrupted": isinstance(exc, KeyboardInterrupt),
                       "collective": view.collective[0] if view.collective else None}
            return ({"status": "error", "rank": rank, "failure": failure, "group_ready": False, "received": True,
                     "elapsed": time.time() - started, "rebound": [], **self._close(view)},)
        finally:
            self._running_cells.pop(rank, None)
        header = {"status": "ok", "rank": rank, "group_ready": True, "received": True,
                  "elapsed": time.time() - started, "buffers": {}, "rebound": [], **self._close(view)}
        if rank == 0:
            header["pulled"], header["pull_errors"] = [], {}
        return (header, *frames)

    @staticmethod
    def _close(view: Rank) -> dict:
        view.sink.flush()
        counts = {"events_sent": view.sink.sent, "events_dropped": view.sink.dropped}
        view.sink.close()
        return counts

    def tie_to_kernel(self, pids: list[int]) -> None:
        pass  # the ranks are threads of this process: nothing to end when it goes

    def interrupt(self, ranks: list[int], run: str | None = None) -> None:
        for rank in ranks:
            running = self._running_cells.get(rank)
            if running is not None and (run is None or running[0] == run):
                running[1].interrupted.set()


class _EntryPoint:
    name = "fake"

    def load(self):
        return FakeBackend


@contextlib.contextmanager
def installed(monkeypatch):
    """The fake engine among the installed ones, for this test only."""
    real = backends.available_backends
    monkeypatch.setattr(backends, "available_backends", lambda: {**real(), "fake": _EntryPoint()})
    FakeBackend.scripts, FakeBackend.starts = {}, 0
    yield FakeBackend
