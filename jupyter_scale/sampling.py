"""Each rank's share of the data: an epoch-aware DistributedSampler, and a DataLoader rebuilt
over it with the options of the loader it replaces. `shard()` and automatic mode both
split loaders this way.
"""

from __future__ import annotations

import warnings
from collections.abc import Sized
from typing import Any, cast

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler


class EpochAwareSampler(DistributedSampler):
    """A DistributedSampler that advances its epoch by itself at every new pass.

    Calling `set_epoch(e)` explicitly still works: the next pass uses epoch `e`.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._next_epoch = 0
        self._explicit = False
        self.automatic = False  # put in by automatic mode, not asked for with shard()

    def pass_through(self) -> None:
        """Stop sharding: every rank draws all of the dataset, in the same order.

        For a sampler that a library's own distributing wrapper (accelerate's
        BatchSamplerShard) splits: that split must be the only one. Same seed and epoch on
        every rank, so the wrapper sees one order everywhere, as it expects; no padding.
        """
        self.num_replicas, self.rank = 1, 0
        self.num_samples = self.total_size = len(cast(Sized, self.dataset))  # DistributedSampler needs a sized one

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._explicit = True

    def __iter__(self):
        if not self._explicit:
            self.epoch = self._next_epoch
        self._explicit = False
        self._next_epoch = self.epoch + 1
        return super().__iter__()


def loader_options(loader: DataLoader) -> dict:
    """What a DataLoader was built with, but its dataset and sampler: to build it again."""
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


def shard_loader(loader: DataLoader, *, shuffle: bool | None, seed: int, drop_last: bool) -> DataLoader:
    """`loader` over an EpochAwareSampler of this rank's share (see explicit.shard)."""
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
    return DataLoader(loader.dataset, sampler=sampler, **loader_options(loader))
