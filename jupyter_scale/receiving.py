"""The worker's side of shipping: what a worker holds of the notebook's values.

A `Receiver` applies each cell's `shipping.Shipment`: it keeps one tensor per token the
kernel gave (so a tensor several names share stays one tensor, across names and cells),
writes a changed tensor's new bytes into the tensor it holds (every object holding it sees
them), and unpickles the names sent in one stream with one memo (an object two names hold
stays one object). A reference to a name (`("name", ...)`) is the object this worker holds
as that name; a notebook function's globals (`("ns",)`) are this worker's namespace.
"""

from __future__ import annotations

import functools
import io
import pickle
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import tensorbytes


class Receiver:
    """Worker side: one tensor per token, for as long as the notebook holds its own."""

    def __init__(self, namespace: dict | None = None) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.device: torch.device | None = None
        # The worker's namespace: the globals of the notebook's functions received here.
        self.namespace = namespace if namespace is not None else {}

    def receive(self, request: Mapping[str, Any], frames: Sequence) -> dict:
        """Apply a Shipment: forget, unpickle the names, update tensors in place."""
        for token in request.get("forget", ()):
            self.tensors.pop(token, None)
        for name in request.get("deleted", ()):
            self.namespace.pop(name, None)
        values, at = {}, 0
        names = request.get("names", ())
        if names:  # one stream, one memo: an object two names hold stays one object
            at = 1 + sum(count for _, count in names)
            unpickler = _ReceiveUnpickler(io.BytesIO(frames[0]), list(frames[1:at]), self)
            for name, _ in names:
                values[name] = unpickler.load()
                _rewrap_scheduled_step(values[name])
        for token, meta in request.get("updates", ()):
            self._resolve(("update", token, meta, frames[at]))
            at += 1
        return values

    def replace(self, replaced: dict[int, torch.Tensor]) -> None:
        """Tensors received here were replaced (sharded: `replaced` maps the id of each old
        one to its new one): the tokens stand for the new ones, and the old, whole ones are
        freed. The notebook's later in-place changes are written into the new ones."""
        for token, tensor in self.tensors.items():
            if id(tensor) in replaced:
                self.tensors[token] = replaced[id(tensor)]

    def _resolve(self, pid):
        if pid[0] == "ns":
            return self.namespace
        if pid[0] == "name":  # a value this worker holds already: the same object
            try:
                return self.namespace[pid[1]]
            except KeyError:
                raise RuntimeError(f"this worker no longer holds {pid[1]!r}, which a value sent refers to; "
                                   "%scale restart starts afresh") from None
        kind, token = pid[0], pid[1]
        if kind == "ref":
            try:
                return self.tensors[token]
            except KeyError:
                raise RuntimeError("this worker does not hold a tensor the notebook's value shares with it (the "
                                   "ranks' values differ); %scale restart starts afresh") from None
        meta, buffer = pid[2], pid[3]
        held = self.tensors.get(token) if kind == "update" else None
        if held is not None:
            return tensorbytes.write_into(held, meta, buffer)
        fresh = self.tensors[token] = tensorbytes.build(meta, buffer, self.device)
        return fresh


class _ReceiveUnpickler(pickle.Unpickler):
    def __init__(self, file, buffers, receiver: Receiver):
        super().__init__(file, buffers=buffers)
        self.receiver = receiver

    def persistent_load(self, pid):
        return self.receiver._resolve(pid)


def _rewrap_scheduled_step(value: Any) -> None:
    """Give a received LR scheduler's optimizer back the `step` wrapper torch's scheduler put
    on it when it was made. The wrapper is an attribute of the optimizer's instance, which
    its pickle leaves out; without it every rank would warn at the scheduler's first step
    that `optimizer.step()` was overridden, which the notebook's cell does not."""
    from torch.optim.lr_scheduler import LRScheduler

    if not isinstance(value, LRScheduler) or hasattr(value.optimizer.step, "_wrapped_by_lr_sched"):
        return
    optimizer = weakref.ref(value.optimizer)
    step = type(value.optimizer).step

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        held = optimizer()
        held._opt_called = True  # what the scheduler checks at its first step
        return step(held, *args, **kwargs)

    # As torch's LRScheduler marks and sets it: an attribute on the function, the instance's own step.
    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    value.optimizer.step = wrapper  # type: ignore[method-assign]
