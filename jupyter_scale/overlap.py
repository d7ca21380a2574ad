"""Automatic mode's gradient averaging during backward, as DDP does it.

Once every rank has shown one `backward()` per step of a cell's one optimizer, its
gradients are averaged in buckets while backward still runs: a bucket is all-reduced
(asynchronously) as soon as its parameters' gradients are accumulated, so communication
overlaps the rest of backward. `training.AutoMode` decides when; this module does it.

The collectives must pair up across ranks: every rank issues the same buckets in the same
order, once per round. A round is one `backward()` call (every rank runs the same calls,
as the cell is SPMD) or, for a rank that called none before a step, one at that step.
Each round carries the optimizer's step count and its place in the step: a rank that
called `backward()` more often than the others is told so, instead of averaging with
the wrong gradients.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

FIRST_BUCKET_BYTES = 2**20  # a small first bucket: the last layers' gradients go out at once

MISMATCH = ("the ranks called backward() a different number of times before an optimizer step (this rank: {rounds} "
            "since the last step). Automatic mode averages gradients during backward() once it has seen one "
            "backward() per step on every rank, as DDP does, so every rank must call it alike; "
            "%%distribute --manual leaves averaging to the cell")


def buckets(params: list[torch.Tensor], cap: int) -> Iterator[list[torch.Tensor]]:
    """`params` in order, in runs of one dtype and device of at most `cap` bytes (or one
    parameter): few collectives per step, not one per parameter."""
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if bucket and ((p.dtype, p.device) != (bucket[0].dtype, bucket[0].device) or size + nbytes > cap):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        yield bucket


def divide_into(grad: torch.Tensor, total: torch.Tensor, world: int) -> None:
    """`grad` becomes `total / world`, in one pass where it can: a gradient that requires
    grad (made with create_graph) takes a recorded copy, as out= would refuse it."""
    if grad.is_contiguous() and not grad.requires_grad:
        torch.div(total.view_as(grad), world, out=grad)
    else:
        grad.copy_(total.view_as(grad) / world)


class _Round:
    def __init__(self, sizes: list[int]):
        self.waiting = list(sizes)  # per bucket, parameters not accumulated yet
        self.accumulated: set[int] = set()
        self.next = 0  # buckets launch strictly in order: the ranks' collectives pair up
        self.works: list = []


class Overlap:
    """The hooks and buckets of one optimizer's parameters (the same list on every rank)."""

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int):
        unique: dict[int, torch.Tensor] = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        # Backward makes gradients roughly in reverse order of the parameters.
        order = self.params[::-1]
        first = next(buckets(order, FIRST_BUCKET_BYTES), [])
        self.buckets = [first, *buckets(order[len(first):], bucket_bytes)] if first else []
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.index = {id(p): i for i, p in enumerate(self.params)}
        # One flat buffer per bucket, kept (as DDP's): fresh memory each round costs page faults.
        # The last one also carries, per parameter, whether this rank had a gradient, and the
        # round's tag (step, round in the step).
        self.flats = []
        for bucket in self.buckets:
            size = sum(p.numel() for p in bucket) + (len(self.params) + 2 if bucket is self.buckets[-1] else 0)
            self.flats.append(torch.empty(size, dtype=bucket[0].dtype, device=bucket[0].device))
        self.round: _Round | None = None
        self.steps = 0  # optimizer steps since the hooks were put on
        self.rounds = 0  # rounds since the last step
        # The tag's numbers wrap at a power of two small enough that their sums over the ranks
        # stay exact integers in the last bucket's dtype (256 in bfloat16).
        self.wrap = 4096
        if self.flats:
            exact = 2 / torch.finfo(self.flats[-1].dtype).eps
            while self.wrap > 2 and dist.get_world_size() * self.wrap > exact:
                self.wrap //= 2
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self.params]

    def holds(self, p: torch.Tensor) -> bool:
        return id(p) in self.index

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.flats = [], []

    # -- a round ---------------------------------------------------------------------
    def begin(self) -> None:
        self.round = _Round([len(b) for b in self.buckets])

    def _accumulated(self, p: torch.Tensor) -> None:
        r = self.round
        if r is None or id(p) in r.accumulated:  # not a round of ours: a backward with create_graph
            return
        r.accumulated.add(id(p))
        r.waiting[self.bucket_of[id(p)]] -= 1
        while r.next < len(self.buckets) and r.waiting[r.next] == 0:
            self._launch(r)

    @torch.no_grad()
    def _launch(self, r: _Round) -> None:
        b, at = r.next, 0
        flat = self.flats[b]
        for p in self.buckets[b]:
            n = p.numel()
            if p.grad is None:  # none on this rank (yet): counts as zeros
                flat[at: at + n].zero_()
            elif p.grad.is_sparse:
                raise TypeError("automatic mode does not average sparse gradients; use --manual with "
                                "jupyter_scale.wrap(model)")
            else:
                flat[at: at + n].copy_(p.grad.reshape(-1))
            at += n
        if b == len(self.buckets) - 1:
            had = [p.grad is not None for p in self.params] + list(self._tag())
            flat[at:].copy_(torch.tensor(had, dtype=flat.dtype))
        r.works.append(dist.all_reduce(flat, async_op=True))
        r.next += 1

    @torch.no_grad()
    def finish(self) -> None:
        """The end of a round: launch the buckets backward did not fill (unused parameters
        count as zeros), wait, and write the averages into the gradients."""
        r, self.round = self.round, None
        if r is None:
            return
        world = dist.get_world_size()
        tag = self._tag()
        self._complete(r)
        counts = self.flats[-1][-len(self.params) - 2:].tolist()
        if counts[-2:] != [world * t for t in tag]:  # a pairing of different rounds
            raise RuntimeError(MISMATCH.format(rounds=self.rounds))
        for bucket, flat in zip(self.buckets, self.flats):
            at = 0
            for p in bucket:
                n = p.numel()
                if p.grad is not None:
                    divide_into(p.grad, flat[at: at + n], world)
                elif counts[self.index[id(p)]] > 0:  # another rank had one: this rank's is the average too
                    p.grad = flat[at: at + n].view_as(p) / world
                at += n

    def _complete(self, r: _Round) -> None:
        """Launch what is left of round `r` (in order) and wait for all of it."""
        while r.next < len(self.buckets):
            self._launch(r)
        self.rounds += 1
        for work in r.works:
            work.wait()

    def _tag(self) -> tuple[int, int]:
        return self.steps % self.wrap, self.rounds % self.wrap

    def drop(self) -> None:
        """A backward that raised: launch the rest and wait, so that the ranks' collectives
        stay paired if the cell goes on (its gradients are left as they are)."""
        r, self.round = self.round, None
        if r is not None:
            self._complete(r)

    def catch_up(self) -> None:
        """Before gradients are used (a step, clipping): a rank that ran no round since the
        last step (it had no batch) runs one now, on its gradients as they are, as the ranks
        that called backward() did during it."""
        if self.rounds == 0:
            self.begin()
            self.finish()

    def stepped(self) -> None:
        self.steps += 1
        self.rounds = 0
