"""The kernel's end of what workers send besides their answers, written once for the engines.

A rank's output travels as `capture`'s messages, each naming the call (job) it belongs to;
its report() batches travel as signed messages for the event queue (see metrics). An engine
carries both its own way (Dask's topics, Ray's outboxes, the direct channel's socket) and
hands each message to its `Relay`, which routes output to its job and events to the queue.
A `RelayedJob` is a call whose ranks' output arrives that way: it counts a rank's output
complete once that rank's end marker came.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable
from typing import Any

from .. import capture, metrics
from .base import Job


class RelayedJob(Job):
    """One call whose ranks' output arrives as capture's messages, routed by its `job_id`."""

    def __init__(self, relay: Relay, job_id: str, ranks: list[int]):
        super().__init__(ranks)
        self.relay, self.job_id = relay, job_id
        self._ended: set[int] = set()  # ranks whose last output arrived

    def take_output(self, message: dict) -> None:
        rank, outputs, end = capture.outputs_of(message)
        # Output first: a rank counts as done once its end is seen, and whatever arrived
        # after the session took the last output would never be shown.
        self.accept_output(outputs)
        if end:
            self._ended.add(rank)

    def _output_complete(self, rank: int) -> bool:
        return rank in self._ended

    def release(self) -> None:
        self.relay.forget(self.job_id)


class Relay:
    """Job id -> job, for one engine's calls; and where its workers' events go."""

    def __init__(self, events: metrics.EventQueue | None = None):
        self.events = events
        self._jobs: dict[str, RelayedJob] = {}
        self._count = itertools.count()
        self._lock = threading.Lock()  # jobs come and go in the kernel's thread, output in the engine's

    def new_id(self, fn: Callable) -> str:
        """An id no other call of this kernel has (the engines' workers may outlive a relay)."""
        return f"{getattr(fn, '__name__', 'call')}-{uuid.uuid4().hex[:8]}-{next(self._count)}"

    def add(self, job: RelayedJob) -> None:
        """Known before any of its calls goes out: a short call's output may come at once."""
        with self._lock:
            self._jobs[job.job_id] = job

    def job(self, job_id: Any) -> RelayedJob | None:
        with self._lock:
            return self._jobs.get(job_id)

    def jobs(self) -> list[RelayedJob]:
        with self._lock:
            return list(self._jobs.values())

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def clear(self) -> None:
        with self._lock:
            self._jobs.clear()

    def output(self, message: dict) -> None:
        """A piece of a rank's output (or its end), to its job; a forgotten job's is dropped."""
        job = self.job(message.get("job"))
        if job is not None:
            job.take_output(message)

    def event(self, message: Any) -> None:
        """A batch of report() points: the queue checks its signature and counts what it drops."""
        if self.events is not None:
            self.events.accept(message)
