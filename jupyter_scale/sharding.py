"""Models sharded across the ranks with FSDP2 (`--shard`, `jupyter_scale.shard_model`).

`shard_model` wraps a model's blocks, then the model, with torch's `fully_shard`,
materializing one built on the meta device block by block; `shard_models` does it for the
notebook's models a cell trains; `whole_tensors_plan` and `whole_tensors` bring a sharded
model's tensors back whole, a chunk at a time (see pullback). Nothing here imports torch's
sharding until a model is sharded: the checks run after every cell and at every step.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import rendezvous


def _loaded(module: str, name: str):
    """`module.name` when something imported that module, else None. Nothing is sharded
    until torch's sharding is imported (the cell's or shard_model's doing), so asking
    costs no import: these checks run after every cell and at every averaging step."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def is_sharded(tensor: torch.Tensor) -> bool:
    """A parameter that torch's sharding (FSDP2's fully_shard, tensor parallel) manages."""
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(tensor, dtensor)


def _fsdp_modules(model: torch.nn.Module) -> list:
    fsdp_module = _loaded("torch.distributed.fsdp", "FSDPModule")
    return [m for m in model.modules() if isinstance(m, fsdp_module)] if fsdp_module is not None else []


def is_sharded_model(model: torch.nn.Module) -> bool:
    """A model FSDP2 manages (in whole or in part). Its parameters tell it only between
    passes: after a forward without backward (an evaluation) the outermost unit holds
    whole ones until it is resharded."""
    return bool(_fsdp_modules(model))


def reshard(namespace: dict) -> None:
    """Every FSDP2 model of the namespace back to its shards (local, no collective): at the
    end of a cell, so that every rank holds and hands back the same kind of tensors."""
    if _loaded("torch.distributed.fsdp", "FSDPModule") is None:
        return
    seen: set[int] = set()
    for value in list(namespace.values()):
        if isinstance(value, torch.nn.Module):
            for module in _fsdp_modules(value):
                if id(module) not in seen:
                    seen.add(id(module))
                    module.reshard()


def _blocks(model: torch.nn.Module, policy=None) -> list[torch.nn.Module]:
    """The units to shard one by one, deepest first. By default the members (holding
    parameters) of the outermost nn.Sequentials and nn.ModuleLists in the model: a
    transformer's layers, a Sequential's layers, not the layers inside a transformer layer
    (units that small cost a gather each and save nothing). `policy` (module -> bool, or
    a tuple of module classes) picks them instead. The model itself takes what is left."""
    if policy is None:
        found = _outermost_members(model)
    else:
        picks = (lambda m: isinstance(m, policy)) if isinstance(policy, (type, tuple)) else policy
        found = [m for m in model.modules() if m is not model and picks(m) and any(True for _ in m.parameters())]
    # A parameter tied across a unit's edge (an output layer sharing the embedding's weight)
    # must live in one unit: such units are left to the model's.
    ties = _ties(model)

    def tied_across(unit):
        inside = {id(m) for m in unit.modules()}
        return any(len({id(m) in inside for m, _ in owners}) > 1 for owners in ties)

    return _deepest_first(model, [unit for unit in found if not tied_across(unit)])


def _deepest_first(model: torch.nn.Module, units: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """fully_shard takes a module's units before the module's own."""
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    return sorted(units, key=lambda m: -depth.get(id(m), 0))


def _outermost_members(module: torch.nn.Module) -> list[torch.nn.Module]:
    containers = (torch.nn.Sequential, torch.nn.ModuleList)
    found = []
    for child in module.children():
        if isinstance(module, containers) and not isinstance(child, containers):
            if any(True for _ in child.parameters()):
                found.append(child)  # a unit: not looked into
        else:
            found.extend(_outermost_members(child))
    return found


PRECISIONS = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def _fsdp_options(mixed_precision, offload: bool) -> dict:
    """fully_shard's keyword arguments for the given precision and offload choices."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    options: dict[str, Any] = {}
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        options["mp_policy"] = mixed_precision
    elif mixed_precision is not None:
        dtype = PRECISIONS.get(mixed_precision, mixed_precision) if isinstance(mixed_precision, str) else mixed_precision
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"mixed_precision must be one of {', '.join(PRECISIONS)}, a torch dtype or a "
                             f"MixedPrecisionPolicy, not {mixed_precision!r}")
        # Compute in `dtype`, reduce gradients in float32: what torch's own examples do.
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if offload:
        if rendezvous.group_device().type == "cpu":
            raise ValueError("offload=True keeps the shards in CPU memory between uses on an accelerator; "
                             "these ranks train on the CPU already")
        options["offload_policy"] = CPUOffloadPolicy()
    return options


def shard_model(model: torch.nn.Module, *, blocks=None, mixed_precision=None, offload: bool = False,
                init=None) -> torch.nn.Module:
    """Shard `model` across the ranks with FSDP2 (`fully_shard`), block by block, then whole;
    each rank keeps 1/N of every parameter (and so of its gradient and optimizer state).
    Returns the model, changed in place. Call it before building the optimizer.

    A model built under `torch.device("meta")` (no memory, no initialization) is
    materialized here, one module at a time: every rank initializes that module's whole
    tensors with its `reset_parameters()` (or `init(module)`), children before their
    parent as when the model was built (and as Module.apply), and keeps its shard, so no
    process ever holds the whole model; with the same seed the weights are those of the
    model built whole when its modules initialize their own tensors (torch's layers do).

    `blocks`: which submodules are sharding units (module -> bool, or module classes);
    by default the members of the outermost nn.Sequentials and nn.ModuleLists. `mixed_precision`:
    "bf16"/"fp16" (compute in it, reduce gradients in float32) or a MixedPrecisionPolicy.
    `offload=True`: FSDP2's CPUOffloadPolicy (accelerators only). Outside a process group
    of two ranks or more (the cell run without %%distribute, or on one worker) the model is
    only materialized.
    """
    if rendezvous.distributed() and not is_sharded_model(model):
        from torch.distributed.fsdp import fully_shard

        options = _fsdp_options(mixed_precision, offload)
        _give_back_freed_blocks()

        units = _blocks(model, blocks)
        if "mp_policy" in options:
            # BatchNorm keeps float32 running statistics, which a lower-precision forward
            # cannot use: it computes in float32 in a unit of its own (which casts its input),
            # as under autocast, and hands its neighbours the lower precision they compute in.
            from torch.distributed.fsdp import MixedPrecisionPolicy

            norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
            units = _deepest_first(model, units + [m for m in norms if m not in units and m is not model])
            full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                        output_dtype=options["mp_policy"].param_dtype)
        for unit in units:
            norm = "mp_policy" in options and isinstance(unit, torch.nn.modules.batchnorm._BatchNorm)
            fully_shard(unit, **{**options, "mp_policy": full} if norm else options)
        fully_shard(model, **options)
    _materialize(model, init)
    return model


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_threshold_fixed = False


def _give_back_freed_blocks() -> None:
    """Make this process's allocator return large freed blocks to the system at once.

    glibc's malloc serves large blocks with mmap, and frees them with munmap, until one is
    freed: then it raises that threshold (up to 32 MiB), and the blocks FSDP gathers and
    frees at every step come from the heap, which keeps them. Measured on CPU workers, each
    sharded rank then grew by 1.7 GB in three steps, more than the unsharded process: the
    memory sharding saves was never given back. A fixed threshold keeps glibc from raising
    it. At 4 MiB: a sharding unit's gathered weights (a layer of 1024 x 1024 and up) are
    given back, smaller blocks are still reused from the heap (1 MiB cost half the steps/s
    for little more memory: benchmarks/README.md). Process-wide, once; a no-op with another
    C library."""
    global _threshold_fixed
    if _threshold_fixed:
        return
    _threshold_fixed = True
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 4 << 20)
    except (OSError, AttributeError):  # not glibc
        pass


def _materialize(model: torch.nn.Module, init=None) -> None:
    """Give a model built on the meta device real values, module by module (see shard_model)."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors):
        return
    if not all(t.is_meta for t in tensors):
        raise ValueError("shard_model: the model is partly on the meta device; build all of it under "
                         "torch.device('meta'), or none")
    if init is None and callable(getattr(model, "_init_weights", None)):
        # transformers models (and nanoGPT-like ones) initialize every module with their own
        # _init_weights from __init__: module by module, reset_parameters would draw others.
        raise ValueError(f"shard_model: {_class_name(model)} initializes its modules with its own _init_weights, "
                         "which building it on the meta device skipped: pass init=model._init_weights")
    grouped = dist.is_available() and dist.is_initialized()
    if grouped:
        # Every rank draws the same whole tensors and keeps its part: they need the same
        # random state (automatic mode seeds them alike; a --manual cell may not have).
        state = [torch.get_rng_state()]
        dist.broadcast_object_list(state, src=0)
        torch.set_rng_state(state[0])
    device = rendezvous.group_device() if grouped else torch.device("cpu")
    ties = _ties(model)
    model.to_empty(device=device)  # a sharded parameter gets room for its shard only
    for owners in ties:  # to_empty may give each owner of a tied parameter a new one of its own
        for module, name in owners[1:]:
            module._parameters[name] = owners[0][0]._parameters[owners[0][1]]
    done: set[int] = set()
    with torch.no_grad():
        for prefix, module in _children_first(model):
            params = {n: p for n, p in module._parameters.items() if p is not None}
            buffers = {n: b for n, b in module._buffers.items() if b is not None}
            if not params and not buffers:
                own = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
                if own is not None and init is None and any(True for _ in module.parameters()):
                    # It initializes tensors of its children (nn.Transformer): not one module at a time.
                    raise ValueError(f"shard_model: {_class_name(module)} ({prefix or 'the model'}) initializes its "
                                     "children's tensors itself, which cannot be replayed one module at a time; "
                                     "build it whole, or pass init=, a function of a module")
                continue
            named = [f"{prefix}.{n}".lstrip(".") for n in [*params, *buffers]]
            reset = init or getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
            if reset is None:
                kind, one = _class_name(module), len(named) == 1
                # A transformers model initializes every module with its own _init_weights.
                hint = "init=model._init_weights" if hasattr(model, "_init_weights") else \
                    "init=, a function of a module that sets " + ("it" if one else "them")
                raise ValueError(f"shard_model: {', '.join(named)} ({kind}) {'was' if one else 'were'} built on "
                                 f"the meta device and nothing initializes {'it' if one else 'them'}: {kind} has no "
                                 f"reset_parameters(); pass {hint}")
            # The module's whole tensors, marked unwritten, for its initialization to fill.
            for name, p in params.items():
                module._parameters[name] = torch.nn.Parameter(_unwritten(p.shape, p.dtype, device), p.requires_grad)
            for b in buffers.values():
                b.copy_(_unwritten(b.shape, b.dtype, device))
            try:
                reset(module) if init is not None else reset()
            finally:
                whole = {name: module._parameters[name] for name in params}
                module._parameters.update(params)
            for name, p in params.items():
                if id(p) in done:
                    continue  # tied: the first module's draw stays, as when the model is built whole
                done.add(id(p))
                _check_written(whole[name], f"{prefix}.{name}".lstrip("."))
                if is_sharded(p):
                    from torch.distributed.tensor import distribute_tensor

                    # Every rank drew the same whole tensor: each takes its part, no communication.
                    p.to_local().copy_(distribute_tensor(whole[name].detach(), p.device_mesh, p.placements,
                                                         src_data_rank=None).to_local())
                else:
                    p.copy_(whole[name])
            for name, b in buffers.items():
                _check_written(b, f"{prefix}.{name}".lstrip("."))


def _children_first(module: torch.nn.Module, prefix: str = "", seen: set | None = None):
    """(name, module) of every module under `module`, each after its children: the order
    their initializations ran in when the model was built (a module's __init__ builds its
    children, then resets its own tensors), and the order of Module.apply."""
    seen = set() if seen is None else seen
    for name, child in module._modules.items():
        if child is not None and id(child) not in seen:
            yield from _children_first(child, f"{prefix}.{name}" if prefix else name, seen)
    seen.add(id(module))
    yield prefix, module


def _ties(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """The (module, name) owners of each parameter that more than one module holds."""
    owners: dict[int, list] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, name))
    return [o for o in owners.values() if len(o) > 1]


def _class_name(module: torch.nn.Module) -> str:
    """The module's own class name (fully_shard makes it an instance of FSDP<name>)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def _unwritten(shape, dtype, device) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


def _check_written(tensor: torch.Tensor, name: str) -> None:
    """A meta tensor that initialization left as _unwritten made it (bool: cannot tell)."""
    if tensor.dtype == torch.bool or tensor.numel() == 0:
        return
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        left = torch.isnan(tensor).any().item()
    else:
        left = (tensor == torch.iinfo(tensor.dtype).min).any().item()
    if left:
        raise ValueError(f"shard_model: {name} was built on the meta device and its initialization left it (partly) "
                         "unset: set it in its module's reset_parameters(), or pass init=a function of a module "
                         "that sets it")


def shard_models(namespace: dict, names: list[str], options: dict | None = None, replaced=None) -> list[str]:
    """shard_model on the models among `names` that are not sharded yet. Optimizers in the
    namespace that hold a model's parameters are given the sharded ones (an optimizer made
    in the notebook keeps training the model). `replaced`, when given, is called with
    {id of an old parameter: its sharded one}. Returns the names sharded."""
    sharded = []
    optimizers = [v for v in namespace.values() if isinstance(v, torch.optim.Optimizer)]
    models = outermost_models({name: namespace.get(name) for name in names})
    for name, model in models.items():
        if not any(True for _ in model.parameters()) or is_sharded_model(model):
            continue  # nothing to shard, or sharded already (by an earlier cell, or the cell itself)
        new = shard_keeping_names(model, options or {})
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [new.get(id(p), p) for p in group["params"]]
            for old in [p for p in list(optimizer.state) if id(p) in new]:
                param = new[id(old)]
                # Its state so far (momentum, Adam's moments), sharded as the parameter is.
                optimizer.state[param] = {key: _sharded_like(value, param)
                                          for key, value in optimizer.state.pop(old).items()}
        if replaced is not None:
            replaced(new)
        sharded.append(name)
    return sharded


def outermost_models(values: dict) -> dict[str, torch.nn.Module]:
    """The nn.Modules among `values` (by name) that no other of them contains: sharding a
    model shards its submodules (a `backbone` bound to a name of its own too), not the
    other way round. One name per module."""
    modules = {name: v for name, v in values.items()
               if isinstance(v, torch.nn.Module) and not isinstance(v, DistributedDataParallel)}
    inner = {id(m) for v in modules.values() for m in v.modules() if m is not v}
    found, seen = {}, set()
    for name, module in modules.items():
        if id(module) not in inner and id(module) not in seen:
            seen.add(id(module))
            found[name] = module
    return found


def _sharded_like(value, param: torch.Tensor):
    """An optimizer state tensor of a parameter now sharded, sharded alike (no communication:
    every rank holds the same whole one)."""
    if (isinstance(value, torch.Tensor) and not is_sharded(value) and value.dim() > 0
            and tuple(value.shape) == tuple(param.shape)):
        from torch.distributed.tensor import DTensor, distribute_tensor

        sharded = cast(DTensor, param)  # a parameter of a model fully_shard sharded
        return distribute_tensor(value.to(param.device), sharded.device_mesh, sharded.placements, src_data_rank=None)
    return value


def shard_keeping_names(model: torch.nn.Module, options: dict) -> dict[int, torch.Tensor]:
    """shard_model(model), answering {id of an old parameter: the sharded one of its name}."""
    before = {id(p): key for key, p in model.named_parameters()}
    shard_model(model, **options)
    after = dict(model.named_parameters())
    return {old: after[key] for old, key in before.items()}


def whole_tensors_plan(module: torch.nn.Module) -> list[tuple[str, list[int], str, int, str | None]]:
    """(key, whole shape, dtype, whole size in bytes, the earlier key of the same tensor or None)
    for each entry of a sharded module's state dict: what the kernel asks for, a chunk at
    a time, to bring the module back whole (see whole_tensors)."""
    first: dict[int, str] = {}
    plan = []
    for key, t in module.state_dict(keep_vars=True).items():
        plan.append((key, list(t.shape), str(t.dtype), t.numel() * t.element_size(), first.get(id(t))))
        first.setdefault(id(t), key)
    return plan


def whole_tensors(module: torch.nn.Module, keys: list[str]) -> dict[str, torch.Tensor]:
    """The whole tensors of `keys` of the module's state dict, on CPU: each sharded one is
    gathered from every rank (a collective: every rank calls it with the same keys)."""
    state = module.state_dict(keep_vars=True)
    found = {}
    for key in keys:
        tensor = state[key].detach()
        found[key] = (tensor.full_tensor() if is_sharded(tensor) else tensor).cpu()
    return found


