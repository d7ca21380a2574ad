"""Rank 0's state to every rank, in automatic mode: module buffers after each cell, and
models and optimizer states before the cell that follows a failed one.

Only names that every rank holds with the same tensor names, shapes and dtypes take part
(a collective needs the same calls on every rank); a sharded tensor is each rank's own
part (FSDP keeps them consistent), not rank 0's to give.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import rendezvous, sharding, training


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


def _buffers(value) -> list:
    module = _module_of(value)
    return list(module.named_buffers()) if module is not None else []


def _module_of(value) -> torch.nn.Module | None:
    if isinstance(value, DistributedDataParallel):
        value = value.module
    return value if isinstance(value, torch.nn.Module) else None


def _broadcast_from_rank0(namespace: dict, tensors_of) -> list[str]:
    """Broadcast rank 0's `tensors_of(value)` (named tensors) for the namespace's values
    that every rank holds alike. Returns those names."""
    named = _named_tensors(namespace, tensors_of)
    signatures = _signatures(named)
    with training.own_collectives():  # resync runs inside the automatic-mode cell, before the cell's code
        everyone = rendezvous.all_gather_json(signatures, rendezvous.group_device())
        mine = everyone[dist.get_rank()]  # as JSON made it (lists for tuples), to compare alike
        common = [n for n in sorted(named) if all(other.get(n) == mine[n] for other in everyone)]
        _broadcast(named, common)
    return common


def _named_tensors(namespace: dict, tensors_of) -> dict[str, list]:
    named = {}
    for name, value in namespace.items():
        tensors = [(key, t) for key, t in tensors_of(value) if not sharding.is_sharded(t)]
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
