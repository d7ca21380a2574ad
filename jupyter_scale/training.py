"""Explicit distribution helpers: `wrap(model)` and `shard(data)`.

Both return their argument unchanged when no process group of more than one rank is
running, so a cell that calls them also runs as plain local code.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler,
                              SequentialSampler, Subset)

from . import rendezvous


# Every DDP model built on this worker: automatic mode must not average their gradients
# a second time.
DDP_MODELS: "weakref.WeakSet[DistributedDataParallel]" = weakref.WeakSet()


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
    _register_ddp(wrapped)
    return wrapped


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
        self.num_samples = self.total_size = len(self.dataset)

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
    if _active is not None:  # the cell splits its data: automatic mode has nothing to point out
        _active._distributed_work = True
    if isinstance(data, DataLoader):
        return _shard_loader(data, shuffle=shuffle, seed=seed, drop_last=drop_last)
    if isinstance(data, IterableDataset):
        raise TypeError("shard() cannot split an IterableDataset: split its source by "
                        "jupyter_scale's `rank` and `world_size` inside the dataset instead")
    if isinstance(data, Dataset) or hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        indices = list(DistributedSampler(data, shuffle=False, drop_last=drop_last))
        part = Subset(data, indices)
        part._jupyter_scale_shard = True  # automatic mode must not shard it again
        return part
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


# --------------------------------------------------------------------------------------
# Automatic mode: the cell's own loop, distributed without being rewritten
# --------------------------------------------------------------------------------------

# Gradients are averaged in buckets of about this many bytes: few collectives per step
# (not one per parameter), none so large that the flattened copy dominates memory.
BUCKET_BYTES = 25 * 2**20

# How many parameter gradients automatic mode has averaged on this worker (diagnostics).
averaged_parameters = 0


def seed_everything(seed: int) -> None:
    """The same seed for torch, numpy and random on every rank."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def is_sharded(tensor: torch.Tensor) -> bool:
    """A parameter that torch's sharding (FSDP2's fully_shard, tensor parallel) manages."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing is sharded
        return False
    return isinstance(tensor, DTensor)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The units to shard one by one, deepest first: the members of every nn.Sequential and
    nn.ModuleList in the model (a transformer's layers, a Sequential's layers) that hold
    parameters of their own; the model itself takes what is left."""
    found = []
    for module in model.modules():
        if isinstance(module, (torch.nn.Sequential, torch.nn.ModuleList)):
            found.extend(child for child in module.children()
                         if not isinstance(child, (torch.nn.Sequential, torch.nn.ModuleList))
                         and any(True for _ in child.parameters()))
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    return sorted(found, key=lambda m: -depth.get(id(m), 0))


def shard_models(namespace: dict, names: list[str]) -> list[str]:
    """FSDP2 (`fully_shard`) on the models among `names` that are not sharded yet, block by
    block, then whole; each rank keeps its shard of every parameter. Optimizers in the
    namespace that hold a model's parameters are given the sharded ones (an optimizer made
    in the notebook keeps training the model). Returns the names sharded."""
    from torch.distributed.fsdp import fully_shard

    sharded = []
    optimizers = [v for v in namespace.values() if isinstance(v, torch.optim.Optimizer)]
    for name in names:
        model = namespace.get(name)
        if not isinstance(model, torch.nn.Module) or isinstance(model, DistributedDataParallel):
            continue
        params = dict(model.named_parameters())
        if not params or any(is_sharded(p) for p in params.values()):
            continue  # nothing to shard, or sharded already (by an earlier cell, or the cell itself)
        before = {id(p): key for key, p in params.items()}
        for block in _blocks(model):
            fully_shard(block)
        fully_shard(model)
        after = dict(model.named_parameters())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [after[before[id(p)]] if id(p) in before else p for p in group["params"]]
            for old in [p for p in list(optimizer.state) if id(p) in before]:
                optimizer.state[after[before[id(old)]]] = optimizer.state.pop(old)
        sharded.append(name)
    return sharded


def full_state_dicts(namespace: dict, names: list[str]) -> dict[str, dict]:
    """The whole state dicts of the sharded modules among `names`, gathered onto rank 0 (on
    CPU; empty on the other ranks). A collective: every rank calls it, in the same order."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    found = {}
    for name in names:
        module = namespace.get(name)
        if isinstance(module, torch.nn.Module) and any(is_sharded(p) for p in module.parameters()):
            found[name] = get_model_state_dict(module, options=options)
    return found


def _average_gradients(params: list[torch.Tensor], skip: set[int]) -> None:
    """Average the gradients of `params` across ranks, in buckets.

    A parameter can have a gradient on some ranks and not on others (a branch that only
    some ranks' data takes): a missing gradient counts as zeros, so every rank reduces the
    same buckets in the same order, and a count of the ranks that had one travels with the
    first bucket (no collective of its own, which cost a round trip per step). A parameter
    with a gradient nowhere gets `grad=None` back (frozen, unused, or zeroed with
    set_to_none), as it would locally.
    """
    params = [p for p in params if p.requires_grad and id(p) not in skip]
    if not params:
        return
    world = dist.get_world_size()
    had = [p.grad is not None for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            raise TypeError("automatic mode does not average sparse gradients; use --manual with "
                            "jupyter_scale.wrap(model)")
    counts: list[float] = []
    for index, bucket in enumerate(_buckets(params)):
        grads = [p.grad for p in bucket]
        parts = [g.reshape(-1) for g in grads]
        if index == 0:  # counts up to the world size are exact in any float dtype used for training
            parts.append(torch.tensor(had, dtype=grads[0].dtype, device=grads[0].device))
        flat = torch.cat(parts)
        dist.all_reduce(flat)
        if index == 0:
            counts = flat[-len(params):].tolist()
        flat.div_(world)
        at = 0
        for g in grads:
            g.copy_(flat[at: at + g.numel()].view_as(g))
            at += g.numel()
    global averaged_parameters
    for p, count in zip(params, counts):
        if count == 0:
            p.grad = None  # no rank had a gradient: as it was
        else:
            averaged_parameters += 1


def _buckets(params: list[torch.Tensor]):
    bucket, size = [], 0
    for p in params:
        key = (p.dtype, p.device)
        if bucket and (key != (bucket[0].dtype, bucket[0].device) or size + p.numel() * p.element_size() > BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel() * p.element_size()
    if bucket:
        yield bucket


_active: "AutoMode | None" = None  # the automatic mode of the cell running now, if any
# > 0 while automatic mode runs collectives that are not the cell's: resync, before the
# cell's code (its gradient averaging needs no exclusion: that is distribution anyway).
_own_collectives = 0


def note_collective() -> None:
    """A torch.distributed collective was called (the worker's collective marks tell us)."""
    if _active is not None and not _own_collectives:
        _active._distributed_work = True  # the cell combines something across ranks itself


def _sampler_chain(*samplers) -> list:
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


def _splits(sampler) -> bool:
    """Whether a sampler splits the data across ranks by itself (duck-typed).

    A DistributedSampler (and Lightning's, which derive from it) says so with
    `num_replicas`, accelerate's BatchSamplerShard with `num_processes`.
    """
    return any(isinstance(n, int) and n > 1
               for n in (getattr(sampler, "num_replicas", None), getattr(sampler, "num_processes", None)))


def _leave_split_to_wrapper(loader: DataLoader) -> None:
    """A new loader wraps a sampler we put in inside one that splits by itself: ours passes through.

    accelerate's `prepare` (the Hugging Face Trainer's too) builds a new loader around the
    old one's batch sampler; sharded twice, each rank would see 1/world² of the data.
    """
    chain = _sampler_chain(loader.batch_sampler, loader.sampler)
    if any(_splits(s) and not _injected(s) for s in chain):
        for sampler in filter(_injected, chain):
            sampler.pass_through()


def _injected(sampler) -> bool:
    return isinstance(sampler, EpochAwareSampler) and sampler.automatic


def _install_patches() -> None:
    """Install the automatic-mode hooks once per worker process; they act only in a cell.

    Installed once and never removed, they dispatch on `_active`: leaving a cell (even
    through an interrupt landing at the worst moment) is one assignment, so no patch can
    be left half-installed or saved as someone else's "original".
    """
    if getattr(DataLoader.__init__, "_jupyter_scale", False):
        return
    import functools
    import inspect

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    original_loader_init = DataLoader.__init__
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

    loader_init._jupyter_scale = True
    DataLoader.__init__ = loader_init

    original_loader_iter = DataLoader.__iter__

    @functools.wraps(original_loader_iter)
    def loader_iter(loader):
        if _active is not None:
            _active._iterating(loader)
        return original_loader_iter(loader)

    DataLoader.__iter__ = loader_iter

    original_backward = torch.autograd.backward

    @functools.wraps(original_backward)
    def backward(*args, **kwargs):  # Tensor.backward() calls it too
        if _active is not None:
            _active._backward = True
        return original_backward(*args, **kwargs)

    torch.autograd.backward = backward

    original_ddp_init = DistributedDataParallel.__init__

    def ddp_init(ddp, *args, **kwargs):
        original_ddp_init(ddp, *args, **kwargs)
        _register_ddp(ddp)

    DistributedDataParallel.__init__ = ddp_init

    def before_step(optimizer, args, kwargs):
        return _active._before_step(optimizer, args, kwargs) if _active is not None else None

    register_optimizer_step_pre_hook(before_step)

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        original_clip = getattr(torch.nn.utils, name)

        def clip(parameters, *args, _original=original_clip, **kwargs):
            # Clipping must see the averaged gradients, as it would under DDP.
            if _active is not None and _distributed():
                parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
                _active._average(parameters)
            return _original(parameters, *args, **kwargs)

        setattr(torch.nn.utils, name, clip)
        setattr(torch.nn.utils.clip_grad, name, clip)


def _register_ddp(ddp: DistributedDataParallel) -> None:
    """Track a DDP model, and whether its forward ran since the last optimizer step."""
    if ddp in DDP_MODELS:
        return
    DDP_MODELS.add(ddp)

    def mark_used(module, inputs):
        module._jupyter_scale_used = True
        if _active is not None:
            _active._distributed_work = True  # DDP averages in backward

    ddp.register_forward_pre_hook(mark_used)


OWN_SAMPLER = ("jupyter_scale: a DataLoader with its own sampler is not sharded automatically; every rank "
               "iterates all of it (use a DistributedSampler, jupyter_scale.shard(loader), or --manual)")
ITERABLE = ("jupyter_scale: a DataLoader over an IterableDataset is not sharded automatically; every rank "
            "iterates all of it (split the stream by `rank` and `world_size` in the dataset)")
NOTHING_DISTRIBUTED = (
    "jupyter_scale: this cell computed gradients but sharded no DataLoader and averaged no gradients, "
    "so every rank did the same work alone. To split it, draw batches from a DataLoader (or "
    "jupyter_scale.shard(...)) and update with a torch.optim optimizer; --manual silences this.")


class AutoMode:
    """While a cell runs: loaders shard, optimizer steps average, DDP is not averaged twice.

    Entered around each automatic-mode cell on every worker (`with AutoMode(...)`) and
    left afterwards, so nothing of it acts between cells or outside %%distribute.
    """

    def __init__(self, seed: int, namespace: dict | None = None, warn=None):
        self.seed = seed
        self.namespace = namespace if namespace is not None else {}
        self._warned: set[str] = set()
        self._warn = warn or (lambda msg: warnings.warn(msg, stacklevel=3))
        self._backward = False  # a backward pass ran in the cell
        # A loader was sharded, gradients were averaged or the cell ran a collective itself.
        self._distributed_work = False

    def __enter__(self) -> "AutoMode":
        global _active
        _install_patches()
        # DDP models made before the hooks existed (e.g. in an earlier --manual cell):
        # registered once here, not looked for at every optimizer step.
        for value in self.namespace.values():
            if isinstance(value, DistributedDataParallel):
                _register_ddp(value)
        seed_everything(self.seed)
        _active = self
        return self

    def __exit__(self, exc_type, *exc) -> None:
        global _active
        _active = None
        if exc_type is None and self._backward and not self._distributed_work:
            # Hand-made batches and a hand-written update (the PyTorch word language model
            # example): nothing for automatic mode to hook, so the ranks repeat each other.
            self._warn(NOTHING_DISTRIBUTED)

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
        return DataLoader(value.dataset, sampler=sharded, **_loader_options(value))

    def _iterating(self, loader: DataLoader) -> None:
        """A pass over a loader begins: is this rank's share of it split off?

        Judged here, not when the loader is built: a library may build a loader with its
        own sampler and then iterate only its own distributing wrapper of it (accelerate).
        """
        chain = _sampler_chain(loader.batch_sampler, loader.sampler)
        # A dataset splits too: shard(dataset)'s Subset, accelerate's IterableDatasetShard.
        if getattr(loader.dataset, "_jupyter_scale_shard", False) or any(map(_splits, [*chain, loader.dataset])):
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
    def _average(self, params) -> None:
        # Parameters of a DDP model whose forward ran since the last step were averaged
        # by DDP during backward; a DDP model that is merely alive changes nothing. Sharded
        # parameters (FSDP2's DTensors) had their gradients reduce-scattered in backward.
        skip = {id(p) for ddp in list(DDP_MODELS) if getattr(ddp, "_jupyter_scale_used", False)
                for p in ddp.parameters()}
        skip.update(id(p) for p in params if is_sharded(p))
        self._distributed_work = True
        _average_gradients(params, skip)

    def _before_step(self, optimizer, args, kwargs):
        if not _distributed():  # the cell tore the group down: steps are local again
            return None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # The hook sees step's arguments with the optimizer itself first.
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is not None:
            # The closure computes the gradients (LBFGS calls it many times): average
            # after each call, not before the step.
            def averaged_closure(*a, **kw):
                with torch.enable_grad():
                    loss = closure(*a, **kw)
                self._average(params)
                return loss

            return args[:1], {**{k: v for k, v in kwargs.items() if k != "closure"}, "closure": averaged_closure}
        self._average(params)
        for ddp in list(DDP_MODELS):
            ddp._jupyter_scale_used = False
        return None


def _buffers(value) -> list:
    module = _module_of(value)
    return list(module.named_buffers()) if module is not None else []


def buffer_signatures(namespace: dict) -> dict[str, list]:
    """This rank's module buffers, by name: what `broadcast_buffers` would send (no bytes)."""
    return _signatures(_named_tensors(namespace, _buffers))


def broadcast_buffers(namespace: dict, names: list[str]) -> None:
    """Give every rank rank 0's module buffers (BatchNorm running stats and the like).

    The policy of automatic mode, as DDP's broadcast_buffers: each rank updates its
    buffers from its own shard during the cell; at the end of the cell rank 0's win, so
    the ranks (and the model pulled back into the notebook) hold the same values. `names`
    are those every rank holds with the same `buffer_signatures` (the kernel compares
    them: a cell without buffers then costs no collective at all).
    """
    _broadcast(_named_tensors(namespace, _buffers), names)


def resync(namespace: dict) -> list[str]:
    """Give every rank rank 0's models (parameters, buffers) and optimizer states.

    After a failed or interrupted cell the ranks may stand a step apart (one applied an
    optimizer step the other never reached); automatic mode runs this before the next
    cell so that training goes on from equal states, as DDP's re-wrap does for DDP weights.
    """
    def state(value) -> list:
        module = _module_of(value)
        if module is not None:
            return [*module.named_parameters(), *module.named_buffers()]
        if isinstance(value, torch.optim.Optimizer):
            params = [p for group in value.param_groups for p in group["params"]]
            return [(f"{i}.{key}", v) for i, p in enumerate(params)
                    for key, v in sorted(value.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
        return []

    return _broadcast_from_rank0(namespace, state)


def _module_of(value) -> torch.nn.Module | None:
    if isinstance(value, DistributedDataParallel):
        value = value.module
    return value if isinstance(value, torch.nn.Module) else None


def _broadcast_from_rank0(namespace: dict, tensors_of) -> list[str]:
    """Broadcast rank 0's `tensors_of(value)` (named tensors) for the namespace's values.

    Only names that every rank holds with the same tensor names, shapes and dtypes take
    part (a collective needs the same calls on every rank). Returns those names.
    """
    global _own_collectives
    named = _named_tensors(namespace, tensors_of)
    signatures = _signatures(named)
    _own_collectives += 1  # resync runs inside the automatic-mode cell, before the cell's code
    try:
        everyone = rendezvous.all_gather_json(signatures, _group_device())
        mine = everyone[dist.get_rank()]  # as JSON made it (lists for tuples), to compare alike
        common = [n for n in sorted(named) if all(other.get(n) == mine[n] for other in everyone)]
        _broadcast(named, common)
    finally:
        _own_collectives -= 1
    return common


def _named_tensors(namespace: dict, tensors_of) -> dict[str, list]:
    named = {}
    for name, value in namespace.items():
        tensors = tensors_of(value)
        if tensors:
            named[name] = tensors
    return named


def _signatures(named: dict[str, list]) -> dict[str, list]:
    return {name: [(k, tuple(t.shape), str(t.dtype)) for k, t in tensors] for name, tensors in named.items()}


def _broadcast(named: dict[str, list], names: list[str]) -> None:
    seen: set[int] = set()
    with torch.no_grad():
        for name in sorted(names):
            for _, tensor in named.get(name, ()):
                if id(tensor) in seen:  # shared by two names (a model and its submodule)
                    continue
                seen.add(id(tensor))
                dist.broadcast(tensor.detach(), src=0)
