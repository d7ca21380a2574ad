"""Automatic mode: the cell's own training loop, distributed without being rewritten.

While a cell runs in automatic mode on a worker (`with AutoMode(...)`), every rank starts
from the same seed, the DataLoaders the cell builds or receives iterate this rank's shard
(see sampling), the gradients are averaged across ranks before each optimizer step and
before clipping (in buckets; during backward once every rank steps alike: see overlap), and
a DDP or FSDP model's own averaging is left to it. The patches that do it are installed
once per worker and act only while such a cell runs; `Sharding` uses one of them for a
--shard cell's optimizers. What automatic mode says when nothing was distributed: notes.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from . import patches, rendezvous, sharding
from .notes import ITERABLE, NOTHING_DISTRIBUTED, OWN_SAMPLER, SAME_BATCHES, SameGradients, sampler_chain, splits
from .overlap import Overlap, buckets, divide_into
from .sampling import EpochAwareSampler, loader_options

# Gradients are averaged in buckets of about this many bytes: few collectives per step
# (not one per parameter), none so large that the flattened copy dominates memory.
BUCKET_BYTES = 25 * 2**20
# Averaging during backward (overlap.py) only for more gradients than this: below, backward
# fills one bucket at its very end anyway, and the hooks and a second, small bucket cost
# ~10 % of a small model's step here.
OVERLAP_MIN_BYTES = BUCKET_BYTES


_sharding = None  # the Sharding of the --shard cell running now

# Every DDP model built on this worker: automatic mode must not average their gradients
# a second time.
DDP_MODELS: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()


@functools.cache
def _has_accelerator() -> bool:
    """torch.manual_seed also queues the seed for each accelerator not initialized yet, taking
    a stack trace for each: in an engine's deep stack most of a trivial cell's time on a
    worker. Without any accelerator (asked once: none appears later) nothing would take it."""
    return (torch.cuda.is_available() or torch.xpu.is_available() or torch.mtia.is_available()
            or torch.backends.mps.is_available() or hasattr(torch, torch._C._get_privateuse1_backend_name()))


def seed_everything(seed: int) -> None:
    """The same seed for torch, numpy and random on every rank."""
    import random

    import numpy as np

    if _has_accelerator():
        torch.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _average_gradients(params: list[torch.Tensor], skip: set[int], extra: tuple[float, ...] = ()) -> list[float] | None:
    """Average the gradients of `params` across ranks, in buckets; returns the sums of
    `extra` (small counts every rank adds, riding in the first bucket), or None when there
    was nothing to average.

    A parameter can have a gradient on some ranks and not on others (a branch that only
    some ranks' data takes): a missing gradient counts as zeros, so every rank reduces the
    same buckets in the same order, and a count of the ranks that had one travels with the
    first bucket (no collective of its own, which cost a round trip per step). A parameter
    with a gradient nowhere gets `grad=None` back (frozen, unused, or zeroed with
    set_to_none), as it would locally.
    """
    params = [p for p in params if p.requires_grad and id(p) not in skip]
    if not params:
        return None
    world = dist.get_world_size()
    had = [p.grad is not None for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            raise TypeError("automatic mode does not average sparse gradients; use --manual with "
                            "jupyter_scale.wrap(model)")
    counts: list[float] = []
    sums: list[float] = []
    for index, bucket in enumerate(buckets(params, BUCKET_BYTES)):
        grads = [p.grad for p in bucket if p.grad is not None]
        assert len(grads) == len(bucket)  # every one has a gradient by now (zeros where it had none)
        parts = [g.reshape(-1) for g in grads]
        if index == 0:  # counts up to the world size are exact in any float dtype used for training
            parts.append(torch.tensor([*had, *extra], dtype=grads[0].dtype, device=grads[0].device))
        flat = torch.cat(parts)
        dist.all_reduce(flat)
        if index == 0:
            counts = flat[len(flat) - len(params) - len(extra):].tolist()
            sums, counts = counts[len(params):], counts[:len(params)]
        at = 0
        for g in grads:
            divide_into(g, flat[at: at + g.numel()], world)
            at += g.numel()
    for p, count in zip(params, counts):
        if count == 0:
            p.grad = None  # no rank had a gradient: as it was
    return sums


_active: AutoMode | None = None  # the automatic mode of the cell running now, if any
# > 0 while automatic mode runs collectives that are not the cell's: resync, before the
# cell's code (its gradient averaging needs no exclusion: that is distribution anyway).
_own_depth = 0


def note_distributed_work() -> None:
    """The cell distributes its work itself (`shard()`, a DDP model): nothing to point out."""
    if _active is not None:
        _active._distributed_work = True


def note_collective() -> None:
    """A torch.distributed collective was called (the worker's collective marks tell us)."""
    if _active is not None and not _own_depth:
        _active._distributed_work = True  # the cell combines something across ranks itself


@contextmanager
def own_collectives():
    """Collectives automatic mode runs for the cell (averaging, resync) are not the cell's own."""
    global _own_depth
    _own_depth += 1
    try:
        yield
    finally:
        _own_depth -= 1


def _leave_split_to_wrapper(loader: DataLoader) -> None:
    """A new loader wraps a sampler we put in inside one that splits by itself: ours passes through.

    accelerate's `prepare` (the Hugging Face Trainer's too) builds a new loader around the
    old one's batch sampler; sharded twice, each rank would see 1/world² of the data.
    """
    chain = sampler_chain(loader.batch_sampler, loader.sampler)
    if any(splits(s) and not _injected(s) for s in chain):
        for sampler in filter(_injected, chain):
            sampler.pass_through()


def _injected(sampler) -> bool:
    return isinstance(sampler, EpochAwareSampler) and sampler.automatic


_LOADER_INIT = patches.Patch("torch.utils.data.DataLoader.__init__", "a loader built in an automatic cell iterates its "
                             "rank's shard; one wrapping ours is not split twice", patches.AUTOMATIC)
_LOADER_ITER = patches.Patch("torch.utils.data.DataLoader.__iter__", "notes which loaders an automatic cell iterates "
                             "(the warnings when nothing split the data)", patches.AUTOMATIC)
_BACKWARD = patches.Patch("torch.autograd.backward", "counts backward passes; averaging during backward (opt-in)",
                          patches.AUTOMATIC)
_DDP_INIT = patches.Patch("torch.nn.parallel.DistributedDataParallel.__init__", "a DDP model's gradients are left to "
                          "DDP, not averaged twice", patches.AUTOMATIC)
_OPTIMIZER_INIT = patches.Patch("torch.optim.Optimizer.__init__", "--shard: an optimizer built in the cell shards the "
                                "models it trains first", patches.AUTOMATIC)
_OPTIMIZER_STEP = patches.Patch("torch.optim.Optimizer.step", "averages the gradients across ranks before each step "
                                "(a global step pre-hook)", patches.AUTOMATIC)
_CLIPS = [patches.Patch(f"torch.nn.utils.{name}", "clipping sees the averaged gradients, as under DDP", patches.AUTOMATIC,
                        also=(f"torch.nn.utils.clip_grad.{name}",)) for name in ("clip_grad_norm_", "clip_grad_value_")]


def _install_patches() -> None:
    """Install the automatic-mode hooks once per worker process; they act only in a cell.

    Kept between cells (removed with the worker, or by patches.remove_all), they dispatch on
    `_active`: leaving a cell (even through an interrupt landing at the worst moment) is one
    assignment, so no patch can be left half-installed or saved as someone else's "original".
    """
    import inspect

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def patch_loader_init(original_loader_init):
        signature = inspect.signature(original_loader_init)

        def loader_init(loader, *args, **kwargs):
            mode = _active
            if mode is not None:
                bound = signature.bind(loader, *args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
                sampler = mode._sampler_for(a["dataset"], a["sampler"], a["batch_sampler"], a["shuffle"])
                if sampler is not None:
                    a["sampler"], a["shuffle"] = sampler, None
                args, kwargs = bound.args[1:], bound.kwargs
            original_loader_init(loader, *args, **kwargs)
            # Also outside automatic cells: a sampler we put in earlier must not split a second time.
            _leave_split_to_wrapper(loader)

        return loader_init

    _LOADER_INIT.install(patch_loader_init)

    def patch_loader_iter(original_loader_iter):
        @functools.wraps(original_loader_iter)
        def loader_iter(loader):
            if _active is not None:
                _active._iterating(loader)
            return original_loader_iter(loader)

        return loader_iter

    _LOADER_ITER.install(patch_loader_iter)

    def patch_backward(original_backward):
        @functools.wraps(original_backward)
        def backward(*args, **kwargs):  # Tensor.backward() calls it too
            if _active is not None:
                return _active._backward_pass(original_backward, args, kwargs)
            return original_backward(*args, **kwargs)

        return backward

    _BACKWARD.install(patch_backward)

    def patch_ddp_init(original_ddp_init):
        def ddp_init(ddp, *args, **kwargs):
            if _active is not None:  # DDP averages its parameters' gradients in backward: not twice
                _active._stop_overlap()  # before DDP's own collectives
            original_ddp_init(ddp, *args, **kwargs)
            register_ddp(ddp)

        return ddp_init

    _DDP_INIT.install(patch_ddp_init)

    def patch_optimizer_init(original_optimizer_init):
        @functools.wraps(original_optimizer_init)
        def optimizer_init(optimizer, params, *args, **kwargs):
            if _sharding is not None:
                params = _sharding.sharded_params(params)
            original_optimizer_init(optimizer, params, *args, **kwargs)

        return optimizer_init

    _OPTIMIZER_INIT.install(patch_optimizer_init)

    def before_step(optimizer, args, kwargs):
        return _active._before_step(optimizer, args, kwargs) if _active is not None else None

    _OPTIMIZER_STEP.hook(lambda: register_optimizer_step_pre_hook(before_step).remove)

    def patch_clip(original_clip):
        def clip(parameters, *args, **kwargs):
            # Clipping must see the averaged gradients, as it would under DDP.
            if _active is not None and rendezvous.distributed():
                parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
                _active._average(parameters)
            return original_clip(parameters, *args, **kwargs)

        return clip

    for patch in _CLIPS:
        patch.install(patch_clip)


def register_ddp(ddp: DistributedDataParallel) -> None:
    """Track a DDP model, and whether its forward ran since the last optimizer step."""
    if ddp in DDP_MODELS:
        return
    DDP_MODELS.add(ddp)

    def mark_used(module, inputs):
        module._jupyter_scale_used = True
        if _active is not None:
            _active._distributed_work = True  # DDP averages in backward

    ddp.register_forward_pre_hook(mark_used)


class Sharding:
    """While a --shard cell runs on a worker: building an optimizer shards the models it
    trains first (see sharded_params). Entered around the cell and left afterwards."""

    def __init__(self, namespace: dict, options: dict, replaced=None):
        self.namespace = namespace
        self.options = options  # shard_model's
        self._replaced = replaced  # told {id of an old parameter: its new one}

    def __enter__(self) -> Sharding:
        global _sharding
        _install_patches()
        _sharding = self
        return self

    def __exit__(self, *exc) -> None:
        global _sharding
        _sharding = None

    def sharded_params(self, params) -> list | torch.Tensor:
        """An optimizer is being built over `params`. The cell's models that own them (bound
        to names in the cell's namespace) are sharded first, as the notebook's were before
        the cell (a model built on the meta device is materialized then; with one rank, only
        that), and the optimizer gets the new parameters."""
        def group(item):
            if isinstance(item, dict):
                inner = item["params"]
                return {**item, "params": [inner] if isinstance(inner, torch.Tensor) else list(inner)}
            return item

        def tensors(item):
            if isinstance(item, dict):
                return [t for entry in item["params"] for t in tensors(entry)]
            return [item[1]] if isinstance(item, tuple) else [item]  # (name, parameter) pairs too

        if isinstance(params, torch.Tensor):
            return params  # the optimizer refuses it, in its own words
        params = [group(item) for item in params]
        wanted = {id(t) for item in params for t in tensors(item)}
        replaced: dict[int, torch.Tensor] = {}
        for value in sharding.outermost_models(dict(self.namespace)).values():
            if any(id(p) in wanted for p in value.parameters()) and not sharding.is_sharded_model(value):
                replaced.update(sharding.shard_keeping_names(value, self.options))
        if replaced and self._replaced is not None:
            self._replaced(replaced)

        def swap(item):
            if isinstance(item, dict):
                return {**item, "params": [swap(entry) for entry in item["params"]]}
            if isinstance(item, tuple):
                return (item[0], replaced.get(id(item[1]), item[1]))
            return replaced.get(id(item), item)

        return [swap(item) for item in params] if replaced else params


class AutoMode:
    """While a cell runs: loaders shard, optimizer steps average, DDP is not averaged twice.

    Entered around each automatic-mode cell on every worker (`with AutoMode(...)`) and
    left afterwards, so nothing of it acts between cells or outside %%distribute.
    """

    def __init__(self, seed: int, namespace: dict | None = None, warn=None, overlap: bool = False):
        self.seed = seed
        self.namespace = namespace if namespace is not None else {}
        self._warned: set[str] = set()
        self._warn = warn or (lambda msg: warnings.warn(msg, stacklevel=3))
        self._backward = False  # a backward pass ran in the cell
        # The data was split (a sharded loader, shard()), a DDP or FSDP model combined gradients,
        # or the cell ran a collective itself.
        self._distributed_work = False
        self._averaged = False  # gradients were averaged: the ranks' own, if they saw different data
        self._same = SameGradients()  # whether they did (see notes.py)
        # Averaging during backward (see overlap.py): for the cell's one optimizer, once every
        # rank called backward() once per step; off for the rest of the cell when a second
        # optimizer steps, a closure is used or a DDP model is built (the same on every rank).
        self._backward_calls = 0
        self._calls_at_step: dict[int, int] = {}  # id(optimizer) -> backward calls at its last step
        self._overlap: Overlap | None = None
        self._overlap_off = not overlap

    def __enter__(self) -> AutoMode:
        global _active
        _install_patches()
        # DDP models made before the hooks existed (e.g. in an earlier --manual cell):
        # registered once here, not looked for at every optimizer step.
        for value in self.namespace.values():
            if isinstance(value, DistributedDataParallel):
                register_ddp(value)
        seed_everything(self.seed)
        _active = self
        return self

    def __exit__(self, exc_type, *exc) -> None:
        global _active
        _active = None
        self._stop_overlap(catch_up=exc_type is None)  # no hooks act between cells
        if exc_type is not None or not self._backward or self._distributed_work:
            return
        if not self._averaged:
            # A hand-written update without clipping: nothing for automatic mode to hook.
            self._warn(NOTHING_DISTRIBUTED)
        elif self._same.same and not self._warned & {"sampler", "iterable"}:  # those said it already
            # Hand-made batches from the whole data: averaging the same gradients changes nothing.
            self._warn(SAME_BATCHES)

    # -- DataLoaders ---------------------------------------------------------------
    def _sampler_for(self, dataset, sampler, batch_sampler, shuffle):
        """An epoch-aware DistributedSampler for a loader that has no sampler of its own."""
        if getattr(dataset, "_jupyter_scale_shard", False):
            return None  # shard(dataset) already gave this rank its part
        if sampler is not None or batch_sampler is not None or isinstance(dataset, IterableDataset):
            return None  # left alone; said if the cell iterates it undistributed (see _iterating)
        # drop_last=False: the last shard is padded with a few repeated samples, so every
        # rank runs the same number of steps (their collectives must pair up).
        sampler = EpochAwareSampler(dataset, shuffle=bool(shuffle), seed=self.seed, drop_last=False)
        sampler.automatic = True
        return sampler

    def shard_shipped(self, value):
        """A DataLoader sent from the notebook is sharded like one built in the cell."""
        if not isinstance(value, DataLoader) or value.batch_size is None:
            return value
        if type(value.sampler) not in (SequentialSampler, RandomSampler):
            sampler = value.sampler  # its own sampler: left alone (warned about if iterated)
        else:
            sampler = None
        sharded = self._sampler_for(value.dataset, sampler, None, isinstance(value.sampler, RandomSampler))
        if sharded is None:
            return value
        return DataLoader(value.dataset, sampler=sharded, **loader_options(value))

    def _iterating(self, loader: DataLoader) -> None:
        """A pass over a loader begins: is this rank's share of it split off?

        Judged here, not when the loader is built: a library may build a loader with its
        own sampler and then iterate only its own distributing wrapper of it (accelerate).
        """
        chain = sampler_chain(loader.batch_sampler, loader.sampler)
        # A dataset splits too: shard(dataset)'s Subset, accelerate's IterableDatasetShard.
        if getattr(loader.dataset, "_jupyter_scale_shard", False) or any(map(splits, [*chain, loader.dataset])):
            self._distributed_work = True
        elif isinstance(loader.dataset, IterableDataset):
            self._warn_once("iterable", ITERABLE)
        elif not any(map(_injected, chain)):  # ours, passing through for a wrapper: not its own
            self._warn_once("sampler", OWN_SAMPLER)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self._warn(message)

    # -- gradients -----------------------------------------------------------------
    def _average(self, params, extra: tuple[float, ...] = ()) -> list[float] | None:
        # Parameters of a DDP model whose forward ran since the last step were averaged
        # by DDP during backward; a DDP model that is merely alive changes nothing. Sharded
        # parameters (FSDP2's DTensors) had their gradients reduce-scattered in backward;
        # those averaged during backward were averaged at its end: what the cell did to them
        # since is its own, as under DDP.
        skip = {id(p) for ddp in list(DDP_MODELS) if getattr(ddp, "_jupyter_scale_used", False)
                for p in ddp.parameters()}
        sharded = {id(p) for p in params if sharding.is_sharded(p)}
        if sharded:
            self._distributed_work = True  # FSDP combined them, in collectives of its own
        skip |= sharded
        with own_collectives():
            if self._overlap is not None:
                self._overlap.catch_up()
                skip.update(id(p) for p in params if self._overlap.holds(p))
            digest = self._same.extra([p.grad for p in params if p.requires_grad and id(p) not in skip])
            sums = _average_gradients(params, skip, extra + digest)
        if sums is None:
            return None
        self._averaged = True
        self._same.reduced(sums[len(extra):], dist.get_world_size())
        return sums[:len(extra)]

    def _backward_pass(self, backward, args, kwargs):
        self._backward = True
        self._backward_calls += 1
        self._same.backward()
        overlap = self._overlap
        if overlap is None or not rendezvous.distributed():
            return backward(*args, **kwargs)
        with own_collectives():  # the hooks' collectives are automatic mode's, not the cell's
            return self._overlapped_backward(overlap, backward, args, kwargs)

    def _overlapped_backward(self, overlap, backward, args, kwargs):
        if kwargs.get("create_graph") or (len(args) > 3 and args[3]):
            # The gradients carry a graph that a second backward may use: written into at the
            # step, not now (every rank is here: the step averages them, as before).
            self._stop_overlap(catch_up=False)
            return backward(*args, **kwargs)
        overlap.begin()
        try:
            result = backward(*args, **kwargs)
        except Exception:
            overlap.drop()  # the cell may catch it and go on: the ranks' collectives stay paired
            raise
        except BaseException:  # an interrupt: the cell ends, the group is formed anew
            overlap.round = None
            raise
        overlap.finish()
        return result

    def _stop_overlap(self, catch_up: bool = True) -> None:
        """Average at steps for the rest of the cell. A rank that called no backward() since
        the last step first runs the round that the ranks that did wait in."""
        overlap, self._overlap, self._overlap_off = self._overlap, None, True
        if overlap is not None:
            try:
                if catch_up and rendezvous.distributed():
                    with own_collectives():
                        overlap.catch_up()
            finally:
                overlap.remove()

    def _may_overlap(self, params) -> bool:
        """Averaging during backward needs hooks on parameters nothing else averages."""
        ddp = {id(p) for model in list(DDP_MODELS) for p in model.parameters()}
        trained = [p for p in params if p.requires_grad]
        return (sum(p.numel() * p.element_size() for p in trained) > OVERLAP_MIN_BYTES
                and all(id(p) not in ddp and not sharding.is_sharded(p) and p.layout == torch.strided for p in params))

    def _before_step(self, optimizer, args, kwargs):
        if not rendezvous.distributed():  # the cell tore the group down: steps are local again
            return None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # The hook sees step's arguments with the optimizer itself first.
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        since = self._backward_calls - self._calls_at_step.get(id(optimizer), 0)
        self._calls_at_step[id(optimizer)] = self._backward_calls
        if closure is not None or any(k != id(optimizer) for k in self._calls_at_step):
            self._stop_overlap()  # averaged at each step from here on
        if self._overlap is not None:
            # A rank that called no backward() since the last step averages now; then what
            # changed after its round, or is not hooked (unfrozen since).
            self._average(params)
            self._overlap.stepped()
            for ddp in list(DDP_MODELS):
                ddp._jupyter_scale_used = False
            return None
        if closure is not None:
            # The closure computes the gradients (LBFGS calls it many times): average
            # after each call, not before the step.
            def averaged_closure(*a, **kw):
                with torch.enable_grad():
                    loss = closure(*a, **kw)
                self._average(params)
                return loss

            return args[:1], {**{k: v for k, v in kwargs.items() if k != "closure"}, "closure": averaged_closure}
        # Every rank called backward() once since this optimizer's last step (the sums of that
        # count and of its square are both the world size): average during backward from now on.
        sums = self._average(params, extra=() if self._overlap_off else (since, since * since))
        world = dist.get_world_size()
        if sums == [world, world]:
            if self._may_overlap(params):
                self._overlap = Overlap(params, BUCKET_BYTES)
            else:  # a small model, DDP's or FSDP's parameters: not rechecked at every step
                self._overlap_off = True
        for ddp in list(DDP_MODELS):
            ddp._jupyter_scale_used = False
        return None
