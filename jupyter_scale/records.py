"""What one %%distribute cell did: its `RunRecord`, which `Session.runs` keeps.

A plain value that every kernel-side module may read (the run's wait fills it, the display
shows it, the pull-back and the export read it); it knows nothing of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class RunRecord:
    """What one %%distribute cell did."""

    index: int
    workers: int
    execution_count: int | None = None  # the notebook's In [n] of the cell, when there is one
    seed: int | None = None  # automatic mode's seed, drawn from the notebook's RNG
    shipped: dict[str, int] = field(default_factory=dict)  # name -> bytes sent
    skipped: list[str] = field(default_factory=list)  # names unchanged since last sent
    pulled: list[str] = field(default_factory=list)
    pulled_bytes: dict[str, int] = field(default_factory=dict)  # what came back from rank 0, per pull
    # Rank 0 packing what comes back (hashing it to leave out what the notebook holds) and
    # the kernel writing it into the notebook's objects; not the transport between them.
    pullback_seconds: float = 0.0
    metrics: list[dict] = field(default_factory=list)
    states: list[dict] = field(default_factory=list)  # workers' state changes, in arrival order
    lost_events: int = 0  # reported points that never reached the kernel (shown, never silent)
    status: str = "running"  # running, finished, failed, interrupted, timed out
    framework: str = "torch"  # whose process group the cell used (see frameworks)
    error: str = ""
    failed_rank: int | None = None  # the rank the error blames
    started: float = field(default_factory=time.time)
    elapsed: float = 0.0

    @property
    def bytes_shipped(self) -> int:
        return sum(self.shipped.values())



def draw_seed() -> int:
    """Automatic mode's seed, drawn from the notebook's RNG as the cell would draw locally:
    a notebook that calls torch.manual_seed gets the same worker runs every time."""
    return int(torch.randint(0, 2**31 - 1, ()).item())


def points_frame(points: list[dict]):
    """Reported points as a pandas DataFrame (history(as_frame=True))."""
    try:
        import pandas
    except ImportError:
        raise ImportError("history(as_frame=True) needs pandas: pip install pandas") from None
    return pandas.DataFrame(points)
