"""Typed errors. Each keeps its cause, names the rank it is about, and says what to do next.

    DistributeError            everything jupyter_scale raises on purpose
    ├── ShippingError          a notebook value cannot be sent (nothing ran)
    ├── ClusterError           starting, reaching or stopping the cluster failed
    │   └── WorkerLost         a worker process went away (engine level)
    │       └── WorkerCallFailed   a worker could not run jupyter_scale's code
    └── RemoteError            a cell failed on one or more ranks (`rank`, `failures`)
        ├── WorkerDied         ... because a rank's worker process died
        └── CellTimeout        ... because --timeout ran out (also a TimeoutError)

A user interrupt ends the cell with KeyboardInterrupt, as any interrupted cell does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class DistributeError(Exception):
    """Base class of everything jupyter_scale raises on purpose.

    IPython renders it as one line (`_render_traceback_`): the message says what went
    wrong and what to do; jupyter_scale's own stack would only hide that.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class ShippingError(DistributeError):
    """A notebook value the cell reads cannot be sent to the workers."""

    def __init__(self, name: str, value: object, cause: BaseException, via: str | None = None):
        self.name = name
        self.cause = cause
        self.via = via  # the notebook function or class that reads it, when the cell does not
        read_by = f", used by {via!r}," if via else ""
        super().__init__(
            f"cannot send variable {name!r} ({type(value).__name__}){read_by} to the workers: "
            f"{type(cause).__name__}: {cause}. Create it inside the %%distribute cell instead, "
            "or make it picklable."
        )


class ClusterError(DistributeError):
    """Starting, reaching or stopping the cluster failed."""


class WorkerLost(ClusterError):
    """A worker process went away while running (crashed, killed, or unregistered)."""

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        self.detail = detail
        super().__init__(f"worker for rank {rank} was lost: {detail}")


class WorkerCallFailed(WorkerLost):
    """The engine could not run our function on a worker (e.g. jupyter_scale or torch does
    not import there); the process may be alive, but the rank is unusable all the same."""

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        self.detail = detail
        ClusterError.__init__(self, f"the worker of rank {rank} could not run jupyter_scale's code: {detail} "
                                    "(check that jupyter_scale and torch import in the workers' environment)")


@dataclass
class RankFailure:
    """What one rank reported when its part of a cell failed."""

    rank: int
    etype: str
    message: str
    traceback: str
    time: float = 0.0
    interrupted: bool = False  # KeyboardInterrupt: stopped by us or the user, not a cause
    lost: bool = False  # the worker process died
    collective: str | None = None  # the torch.distributed collective it was in when it failed
    where: str | None = None  # "all_reduce in cell line 7": where in the notebook's code it was
    cause: BaseException | None = None  # the kernel-side exception, for a lost worker

    @property
    def summary(self) -> str:
        return f"{self.etype}: {self.message}" if self.message else self.etype


class RemoteError(DistributeError):
    """A cell failed on one or more ranks. `rank` is the rank that failed first, `failures`
    every rank's `RankFailure` (the cause first).

    IPython shows `_render_traceback_()` instead of the kernel-side stack, so the user
    sees the failing rank's own traceback, not jupyter_scale's internals.
    """

    hint = "The workers are still running; fix the cell and run it again."

    def __init__(self, failures: list[RankFailure]):
        self.failures = self._blame(failures)
        first = self.failures[0]
        self.rank = first.rank
        self.etype = first.etype
        self.traceback = first.traceback
        if first.cause is not None:
            self.__cause__ = first.cause
        super().__init__(self._headline())

    @staticmethod
    def _blame(failures: list[RankFailure]) -> list[RankFailure]:
        # Which failure is the cause: a dead worker (its peers' collectives fail because
        # it died, often before its death is noticed), else the earliest exception; ranks
        # we interrupted come last.
        return sorted(failures, key=lambda f: (f.interrupted, not f.lost, f.time, f.rank))

    def _headline(self) -> str:
        first = self.failures[0]
        others = [f.rank for f in self.failures[1:]]
        note = f" (then ranks {others} stopped)" if others else ""
        return f"rank {first.rank} failed: {first.summary}{note}"

    def _render_traceback_(self) -> list[str]:
        first = self.failures[0]
        lines = []
        if first.traceback.strip():
            lines += [f"--- rank {first.rank} traceback ---", *first.traceback.rstrip().splitlines()]
        lines.append(f"{type(self).__name__}: {self}")
        for f in self.failures[1:]:
            where = f" ({f.where})" if f.where else f" (in {f.collective})" if f.collective else ""
            lines.append(f"  rank {f.rank}: {f.summary}{where}")
        if self.where_ranks_were():
            lines.append(f"Where the ranks were: {self.where_ranks_were()}")
        lines.append(self.hint)
        return lines

    def where_ranks_were(self) -> str:
        """"rank 0: DataLoader.__iter__ in cell line 5; rank 1: all_reduce in cell line 7" for a
        cell that was stopped (timed out, interrupted), else ""."""
        stopped = [f for f in self.failures if f.interrupted or isinstance(self, CellTimeout)]
        return "; ".join(f"rank {f.rank}: {f.where}" for f in sorted(stopped, key=lambda f: f.rank) if f.where)


class WorkerDied(RemoteError):
    """A rank's worker process died (or became unusable) while the cell ran.

    `__cause__` is the engine's `WorkerLost`; the message says how the process ended
    where the engine can tell (`killed by SIGKILL`, `exited with status 1`).
    """

    hint = ("A worker died: the next %%distribute restarts the cluster at the same size "
            "(worker variables are lost; notebook variables are intact), or run %scale restart.")


class CellTimeout(RemoteError, TimeoutError):
    """The cell ran past --timeout. Names the silent ranks: those still running outside any
    collective (their traceback shows where), which the ranks waiting in a collective were
    waiting for."""

    def __init__(self, failures: list[RankFailure], *, timeout: float, finished: Iterable[int] = ()):
        self.timeout = timeout
        self.finished = sorted(finished)  # ranks that had completed the cell
        for f in failures:  # stopped by the deadline: each is part of the story, none "interrupted"
            f.interrupted = False
            if f.etype == "KeyboardInterrupt":
                f.etype, f.message = "TimeoutError", f.message or f"still running after --timeout {timeout:g} s"
        super().__init__(failures)

    @staticmethod
    def _blame(failures: list[RankFailure]) -> list[RankFailure]:
        # A dead worker first, then ranks that were running outside a collective (the ones
        # the others waited for), then those that waited.
        return sorted(failures, key=lambda f: (not f.lost, f.collective is not None, f.rank))

    @property
    def silent_ranks(self) -> list[int]:
        """Ranks still running outside any collective when the time ran out."""
        return sorted(f.rank for f in self.failures if f.collective is None and not f.lost)

    @property
    def waiting_ranks(self) -> list[int]:
        """Ranks that were blocked in a collective when the time ran out."""
        return sorted(f.rank for f in self.failures if f.collective is not None)

    def _headline(self) -> str:
        start = f"still running after --timeout {self.timeout:g} s"
        waiting = [f for f in self.failures if f.collective is not None]
        where = ", ".join(sorted({f.collective for f in waiting if f.collective is not None}))
        silent = self.silent_ranks
        if self.failures[0].lost:
            return f"{start}: the worker of rank {self.failures[0].rank} died ({self.failures[0].message})"
        if silent and waiting:
            return (f"{start}: rank(s) {silent} never reached the {where} that rank(s) "
                    f"{self.waiting_ranks} waited in")
        if waiting and self.finished:
            return (f"{start}: rank(s) {self.waiting_ranks} waited in {where}, which rank(s) "
                    f"{self.finished} never joined (they had finished the cell)")
        if len({f.collective for f in waiting}) > 1:
            each = ", ".join(f"rank {f.rank} in {f.collective}" for f in sorted(waiting, key=lambda f: f.rank))
            return f"{start}: the ranks waited in different collectives ({each})"
        if waiting:
            return f"{start}: every rank waited in {where}"
        return f"{start}: rank(s) {silent} were still computing"

    @property
    def hint(self) -> str:  # type: ignore[override]
        reusable = "The workers are reusable."
        if self.failures[0].lost:
            return WorkerDied.hint
        silent, waiting = self.silent_ranks, self.waiting_ranks
        if silent and waiting:
            return (f"Rank {silent[0]}'s traceback above shows where it was: make every rank reach the same "
                    f"collectives, or raise --timeout if it was only slow. {reusable}")
        if waiting and (self.finished or len({f.collective for f in self.failures}) > 1):
            return ("Every rank must call the same collectives in the same order (e.g. the same number of "
                    f"optimizer steps on every rank). {reusable}")
        return f"Raise --timeout if the cell needs longer. {reusable}"
