"""Explicit distribution helpers: `wrap(model)`, `shard(data)` and `prepare(...)`.

What a cell calls to distribute its own loop (`%%distribute --manual`), and what an
automatic cell may call too (automatic mode then leaves that part to them). They return
their argument unchanged when no process group of more than one rank is running, so a cell
that calls them also runs as plain local code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Subset

from . import rendezvous, training
from .sampling import shard_loader


def wrap(model: torch.nn.Module, **ddp_options: Any) -> torch.nn.Module:
    """DistributedDataParallel around `model`, on this rank's device.

    Idempotent (a DDP model is returned as is). DDP broadcasts rank 0's parameters and
    buffers when it is built, so every rank starts from the same weights.
    """
    if not rendezvous.distributed() or isinstance(model, DistributedDataParallel):
        return model
    options = dict(ddp_options)
    device = rendezvous.group_device()
    if device.type == "cuda":
        model = model.to(device)
        ddp_options.setdefault("device_ids", [device.index])
        ddp_options.setdefault("output_device", device.index)
    wrapped = DistributedDataParallel(model, **ddp_options)
    # Remembered so the worker can wrap the model again if the process group is re-formed.
    wrapped._jupyter_scale_options = options  # type: ignore[assignment]  # torch types Module attributes as tensors or modules
    training.register_ddp(wrapped)
    return wrapped


def shard(data: Any, *, shuffle: bool | None = None, seed: int = 0, drop_last: bool = False) -> Any:
    """This rank's share of a DataLoader or Dataset.

    - A DataLoader comes back as a new DataLoader with the same options over an
      epoch-aware DistributedSampler; `shuffle` defaults to what the loader did.
    - A map-style Dataset comes back as the `Subset` of indices rank, rank+world, ...
      (no shuffling; shard the DataLoader to reshuffle each epoch).

    The ranks' shards are disjoint and together cover the data; with `drop_last=False`
    (the default) DistributedSampler pads the last shard by repeating a few samples so
    every rank runs the same number of steps.
    """
    if not rendezvous.distributed():
        return data
    training.note_distributed_work()  # the cell splits its data: automatic mode has nothing to point out
    if isinstance(data, DataLoader):
        return shard_loader(data, shuffle=shuffle, seed=seed, drop_last=drop_last)
    if isinstance(data, IterableDataset):
        raise TypeError("shard() cannot split an IterableDataset: split its source by "
                        "jupyter_scale's `rank` and `world_size` inside the dataset instead")
    if isinstance(data, Dataset) or hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        indices: list[int] = list(DistributedSampler(data, shuffle=False, drop_last=drop_last))
        part = Subset(data, indices)
        part._jupyter_scale_shard = True  # type: ignore[attr-defined]  # automatic mode must not shard it again
        return part
    raise TypeError(f"shard() takes a DataLoader or a Dataset, not {type(data).__name__}")


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            loader: DataLoader | None = None, *, seed: int = 0,
            **ddp_options: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer | None, DataLoader | None]:
    """Distribute a training loop explicitly, without automatic mode's patches (for
    `%%distribute --manual`), as Lightning Fabric's `setup` or accelerate's `prepare` do:

        model, opt, loader = jupyter_scale.prepare(model, opt, loader)

    returns the model in DistributedDataParallel on this rank's device (`wrap`), the
    optimizer as it is (it steps the same parameters, which DDP averages in backward), and
    the loader over this rank's shard (`shard`: an epoch-aware DistributedSampler seeded
    with `seed`). Outside a distributed cell everything comes back unchanged.
    """
    return wrap(model, **ddp_options), optimizer, shard(loader, seed=seed) if loader is not None else None
