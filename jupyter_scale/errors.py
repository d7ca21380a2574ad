"""Typed errors. Each keeps its cause and says what to do next."""

from __future__ import annotations

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

    def __init__(self, name: str, value: object, cause: BaseException):
        self.name = name
        self.cause = cause
        super().__init__(
            f"cannot send variable {name!r} ({type(value).__name__}) to the workers: "
            f"{type(cause).__name__}: {cause}. Create it inside the %%distribute cell instead, "
            "or make it picklable."
        )


class ClusterError(DistributeError):
    """Starting, reaching or stopping the cluster failed."""


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

    @property
    def summary(self) -> str:
        return f"{self.etype}: {self.message}" if self.message else self.etype


class RemoteError(DistributeError):
    """A cell failed on one or more ranks. `rank` is the rank that failed first.

    IPython shows `_render_traceback_()` instead of the kernel-side stack, so the user
    sees the failing rank's own traceback, not jupyter_scale's internals.
    """

    def __init__(self, failures: list[RankFailure]):
        # Which failure is the cause: a dead worker (its peers' collectives fail because
        # it died, often before its death is noticed), else the earliest exception; ranks
        # we interrupted come last.
        self.failures = sorted(failures, key=lambda f: (not f.lost, f.interrupted, f.time, f.rank))
        first = self.failures[0]
        self.rank = first.rank
        self.etype = first.etype
        others = [f.rank for f in self.failures[1:]]
        note = f" (then ranks {others} stopped)" if others else ""
        super().__init__(f"rank {first.rank} failed: {first.summary}{note}")

    def _render_traceback_(self) -> list[str]:
        first = self.failures[0]
        lines = [f"--- rank {first.rank} traceback ---", *first.traceback.rstrip().splitlines()]
        lines.append(str(self))
        for f in self.failures[1:]:
            lines.append(f"  rank {f.rank}: {f.summary}")
        if any(f.lost for f in self.failures):
            lines.append("A worker died: the next %%distribute restarts the cluster (or run %scale restart).")
        else:
            lines.append("The workers are still running; fix the cell and run it again.")
        return lines
