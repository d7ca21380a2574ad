"""`report(**scalars)`: record training metrics.

On a worker, points are recorded with the rank and a per-rank step counter and come
back to the kernel with the cell's result (live streaming is a later step). In the
notebook itself (no %%distribute) `report` records locally, so the same cell runs there.
"""

from __future__ import annotations

import numbers
import time
from typing import Any

import torch


def _scalar(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"report({name}=...) takes a scalar; got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().item())
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool):
        return float(value)
    raise TypeError(f"report({name}=...) takes numbers or one-element tensors, not {type(value).__name__}")


class Recorder:
    """Collects the points one process reports."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.points: list[dict] = []
        self._step = 0

    def report(self, step: int | None = None, epoch: int | None = None, **scalars: Any) -> None:
        if not scalars:
            raise TypeError("report() needs at least one named value, e.g. report(loss=loss)")
        if step is None:
            step = self._step
        self._step = int(step) + 1
        point = {"rank": self.rank, "step": int(step), "time": time.time()}
        if epoch is not None:
            point["epoch"] = int(epoch)
        for name, value in scalars.items():
            point[name] = _scalar(name, value)
        self.points.append(point)

    def drain(self) -> list[dict]:
        points, self.points = self.points, []
        return points


local_recorder = Recorder(rank=0)


def report(step: int | None = None, epoch: int | None = None, **scalars: Any) -> None:
    """Record metrics, e.g. ``report(loss=loss)``; in the notebook this records locally."""
    local_recorder.report(step=step, epoch=epoch, **scalars)
