"""What automatic mode tells the user when distributing a cell did nothing.

A cell distributes its work when the ranks train on different data and combine what they
learned. Automatic mode sees the data split when a loader it sharded is iterated (or
`shard()`, a library's distributing sampler, a DDP model, a collective of the cell's own);
when none of that happened, the evidence comes from the gradients: automatic mode averages
them at each optimizer step (and before clipping), and at the first of those averagings
every rank adds a digest of its own gradients to the all-reduce it runs anyway (32 bits as
0/1 values, whose sums are 0 or the world size exactly when every rank has the same bit).
Ranks that computed the same gradients from the same model saw the same batches: hand-made
batches sliced from the whole data (PyTorch's word language model example, `get_batch(source,
i)`), whatever the update that follows (a `torch.optim` step, or `p.data.add_(p.grad, ...)`
after `clip_grad_norm_`). A cell that splits its data by `rank` computes different gradients
and is left alone.
"""

from __future__ import annotations

import torch
import xxhash

OWN_SAMPLER = ("jupyter_scale: a DataLoader with its own sampler is not sharded automatically; every rank "
               "iterates all of it (use a DistributedSampler, jupyter_scale.shard(loader), or --manual)")
ITERABLE = ("jupyter_scale: a DataLoader over an IterableDataset is not sharded automatically; every rank "
            "iterates all of it (split the stream by `rank` and `world_size` in the dataset)")
NOTHING_DISTRIBUTED = (
    "jupyter_scale: this cell computed gradients but sharded no DataLoader and averaged no gradients, "
    "so every rank trained alone and the notebook gets rank 0's model. To split it, draw batches from a "
    "DataLoader (or jupyter_scale.shard(...)) and update with a torch.optim optimizer; --manual silences this.")
SAME_BATCHES = (
    "jupyter_scale: every rank computed the same gradients at this cell's first steps: its batches are not split "
    "across the ranks, so each rank repeated the same work. To split them, draw batches from a DataLoader "
    "(automatic mode shards it) or jupyter_scale.shard(...), or slice by `rank` and `world_size` "
    "(`data[rank::world_size]`); --manual silences this.")

# Averagings that carry the digest: the first few of the cell (a clip and a step average the
# same gradients twice: the second, already averaged, is no evidence and does not count).
WINDOW = 4
BITS = 32
# Of a large gradient, its first and last so many bytes are hashed: any data-dependent
# gradient differs there between ranks that saw different data, and a big model's first
# steps are not slowed by hashing it whole.
EDGE_BYTES = 256 * 1024


def sampler_chain(*samplers) -> list:
    """The samplers a loader draws from: each, then what it wraps (`.batch_sampler`, `.sampler`).

    Libraries wrap samplers in their own (accelerate: BatchSamplerShard around the loader's
    BatchSampler around its sampler); only attributes tell what is inside.
    """
    chain: list = []
    todo = list(samplers)
    while todo and len(chain) < 16:  # a few deep; the cap stops attributes that build new objects
        sampler = todo.pop(0)
        if sampler is None or any(sampler is seen for seen in chain):
            continue
        chain.append(sampler)
        todo += [getattr(sampler, "batch_sampler", None), getattr(sampler, "sampler", None)]
    return chain


def splits(sampler) -> bool:
    """Whether a sampler splits the data across ranks by itself (duck-typed).

    A DistributedSampler (and Lightning's, which derive from it) says so with
    `num_replicas`, accelerate's BatchSamplerShard with `num_processes`.
    """
    return any(isinstance(n, int) and n > 1
               for n in (getattr(sampler, "num_replicas", None), getattr(sampler, "num_processes", None)))


class SameGradients:
    """Whether every rank computed the same gradients at the cell's first averagings.

    Every rank adds `extra()` (the same number of values on every rank, as the all-reduce
    needs) to the first averagings and hands their sums to `reduced`.
    """

    def __init__(self) -> None:
        self.calls = 0  # averagings that carried a digest
        self.samples = 0  # of them, those where every rank had fresh, non-zero gradients
        self.differ = False
        self.fresh = False  # a backward() ran since the last averaging

    def backward(self) -> None:
        self.fresh = True

    def extra(self, grads: list[torch.Tensor | None]) -> tuple[float, ...]:
        """This rank's values for the next averaging: () after the window, else whether its
        gradients are evidence (fresh and not all zero), then their digest's bits."""
        if self.calls >= WINDOW:
            return ()
        fresh, self.fresh = self.fresh, False
        found = _digest(grads) if fresh else None
        if found is None:
            return (0.0,) * (BITS + 1)
        return (1.0, *(float(found >> i & 1) for i in range(BITS)))

    def reduced(self, sums: list[float], world: int) -> None:
        """The sums over the ranks of what `extra` gave."""
        if not sums:
            return
        self.calls += 1
        if sums[0] != world:  # some rank's gradients were stale or zero: no evidence
            return
        self.samples += 1
        if any(s not in (0, world) for s in sums[1:]):
            self.differ = True

    @property
    def same(self) -> bool:
        return self.samples > 0 and not self.differ


def _digest(grads: list[torch.Tensor | None]) -> int | None:
    """A 64-bit digest of the gradients' bytes, or None when they are all zero (any data
    gives those) or cannot be read as bytes."""
    h = xxhash.xxh3_64()
    nonzero = False
    for g in grads:
        if g is None:
            h.update(b"\0")
            continue
        if g.layout != torch.strided:
            return None
        flat = g.detach().reshape(-1)
        edge = max(1, EDGE_BYTES // flat.element_size())
        for part in (flat,) if flat.numel() <= 2 * edge else (flat[:edge], flat[-edge:]):
            part = part.cpu().contiguous()
            nonzero = nonzero or bool(part.any())
            # `.data`: the array's buffer, not copied (numpy types ndarray as a buffer only from Python 3.12).
            h.update(part.view(torch.uint8).numpy().data if part.numel() else b"")
    return h.intdigest() if nonzero else None
