"""Explicit distribution helpers: `wrap(model)` and `shard(data)`.

Both return their argument unchanged when no process group of more than one rank is
running, so a cell that calls them also runs as plain local code.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, Subset


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _group_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wrap(model: torch.nn.Module, **ddp_options: Any) -> torch.nn.Module:
    """DistributedDataParallel around `model`, on this rank's device.

    Idempotent (a DDP model is returned as is). DDP broadcasts rank 0's parameters and
    buffers when it is built, so every rank starts from the same weights.
    """
    if not _distributed() or isinstance(model, DistributedDataParallel):
        return model
    options = dict(ddp_options)
    device = _group_device()
    if device.type == "cuda":
        model = model.to(device)
        ddp_options.setdefault("device_ids", [device.index])
        ddp_options.setdefault("output_device", device.index)
    wrapped = DistributedDataParallel(model, **ddp_options)
    # Remembered so the worker can wrap the model again if the process group is re-formed.
    wrapped._jupyter_scale_options = options
    return wrapped


class EpochAwareSampler(DistributedSampler):
    """A DistributedSampler that advances its epoch by itself at every new pass.

    Calling `set_epoch(e)` explicitly still works: the next pass uses epoch `e`.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._next_epoch = 0
        self._explicit = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._explicit = True

    def __iter__(self):
        if not self._explicit:
            self.epoch = self._next_epoch
        self._explicit = False
        self._next_epoch = self.epoch + 1
        return super().__iter__()


def _loader_options(loader: DataLoader) -> dict:
    options = dict(
        batch_size=loader.batch_size,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    return options


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
    if not _distributed():
        return data
    if isinstance(data, DataLoader):
        return _shard_loader(data, shuffle=shuffle, seed=seed, drop_last=drop_last)
    if isinstance(data, IterableDataset):
        raise TypeError("shard() cannot split an IterableDataset: split its source by "
                        "jupyter_scale's `rank` and `world_size` inside the dataset instead")
    if isinstance(data, Dataset) or hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        indices = list(DistributedSampler(data, shuffle=False, drop_last=drop_last))
        return Subset(data, indices)
    raise TypeError(f"shard() takes a DataLoader or a Dataset, not {type(data).__name__}")


def _shard_loader(loader: DataLoader, *, shuffle: bool | None, seed: int, drop_last: bool) -> DataLoader:
    if isinstance(loader.sampler, DistributedSampler):
        return loader  # already sharded (by us or by the user)
    if isinstance(loader.dataset, IterableDataset):
        warnings.warn("shard(): a DataLoader over an IterableDataset is left as is", stacklevel=3)
        return loader
    if loader.batch_size is None:
        warnings.warn("shard(): a DataLoader with a custom batch_sampler is left as is", stacklevel=3)
        return loader
    if shuffle is None:
        shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = EpochAwareSampler(loader.dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(loader.dataset, sampler=sampler, **_loader_options(loader))
