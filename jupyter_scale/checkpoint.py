"""Checkpoints of sharded (or whole) models and their optimizers, with torch.distributed.checkpoint.

    %%distribute --shard
    ...
    jupyter_scale.save_checkpoint("ckpt", model=model, optimizer=opt)   # every rank writes its shards

    %%distribute --workers 3 --shard
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    jupyter_scale.load_checkpoint("ckpt", model=model, optimizer=opt)   # resharded to 3 ranks

Each rank writes and reads only its own part (a directory of files, one per rank, plus
metadata), so no process ever holds the whole model; a checkpoint loads into any number of
ranks, sharded or not, and into the notebook's own model outside %%distribute. Across hosts
the path must be on a file system every host sees.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch


def _pairs(objects: dict) -> tuple[dict, dict]:
    """{name: module}, {name: (optimizer, the module whose parameters it updates)}."""
    modules = {k: v for k, v in objects.items() if isinstance(v, torch.nn.Module)}
    optimizers = {}
    for name, value in objects.items():
        if isinstance(value, torch.nn.Module):
            continue
        if not isinstance(value, torch.optim.Optimizer):
            raise TypeError(f"{name} is a {type(value).__name__}; checkpoints hold nn.Modules and optimizers")
        params = {id(p) for group in value.param_groups for p in group["params"]}
        owner = next((m for m in modules.values() if params & {id(p) for p in m.parameters()}), None)
        if owner is None:
            raise ValueError(f"the optimizer {name} updates none of the modules given; pass its model too")
        optimizers[name] = (value, owner)
    return modules, optimizers


@contextmanager
def _quiet_outside_a_group():
    """Without a process group torch.distributed.checkpoint warns that it assumes one
    process: in the notebook, that is the point."""
    with warnings.catch_warnings():
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _state(objects: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    modules, optimizers = _pairs(objects)
    state = {name: get_model_state_dict(module) for name, module in modules.items()}
    state.update({name: get_optimizer_state_dict(owner, optimizer) for name, (optimizer, owner) in optimizers.items()})
    return state


def save_checkpoint(path: str | os.PathLike, **objects) -> None:
    """Write the models and optimizers given by name to the directory `path`. In a
    %%distribute cell every rank calls it (a collective) and writes its own shards."""
    import torch.distributed.checkpoint as dcp

    with _quiet_outside_a_group():
        dcp.save(_state(objects), checkpoint_id=os.fspath(path))


def load_checkpoint(path: str | os.PathLike, **objects) -> None:
    """Read the models and optimizers given by name (the names they were saved under) from
    `path`, in place; each rank reads the part its shards need, whatever the number of
    ranks that saved it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    modules, optimizers = _pairs(objects)
    state = _state(objects)
    with _quiet_outside_a_group():
        dcp.load(state, checkpoint_id=os.fspath(path))
    for name, module in modules.items():
        set_model_state_dict(module, state[name])
    for name, (optimizer, owner) in optimizers.items():
        set_optimizer_state_dict(owner, optimizer, state[name])
