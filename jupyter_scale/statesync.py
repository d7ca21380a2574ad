"""The state model: after every cell the notebook holds what a local run would have left.

A cell run locally leaves two kinds of effect in the notebook: the names it binds, rebinds
or deletes, and the changes it makes in place to the objects it reaches (a model's weights
and mode, a parameter's `requires_grad`, an optimizer's hyperparameters and state, a
scheduler's step, a list it appends to). A distributed cell runs on the workers' copies, so
both come back from rank 0:

- As the cell starts, rank 0 takes a digest of every notebook name the cell can reach (the
  kernel's plan: the names it reads, those its notebook functions read, those other values
  hold): the value's structure and its tensors' bytes (`Snapshot`). A module's digest is
  its structure alone (`module_signature`): its weights come back by their own, cheaper
  path (the state dict, only the tensors that differ).
- After the cell, a name whose digest moved was changed in place: its value is sent back
  and written into the notebook's own object (`adopt`), so that everything else in the
  notebook holding that object sees it too. A name the cell bound comes back as its value;
  one it deleted is deleted.
- What does not come back stays the workers' own, and the kernel knows it (the next cell
  uses the workers' value until the notebook writes the name): per-rank objects (a
  DataLoader split across ranks, a DDP wrapper; see `PER_RANK`), wrappers around a notebook
  model (`torch.compile`, DDP: the weights come back into the notebook's module, whose name
  keeps the notebook's object), values that cannot be pickled, and values the cell bound
  that are larger than the session's `bring_back_limit` (said in one line).

The kernel then records that the workers hold what the notebook holds, so the next cell
sends exactly the names whose notebook value differs from it: a value set back to an earlier
one, a flag flipped back, an optimizer's learning rate edited (its state, which came back,
travels with it).
"""

from __future__ import annotations

import io
import sys
import types
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import xxhash

from . import shipping, tensorbytes, writewatch
from .namespacepickle import shared_by_identity


def _per_rank_types() -> tuple[type, ...]:
    from torch.utils.data import DataLoader, Sampler

    return (DataLoader, Sampler)


def per_rank_reason(value: Any) -> str | None:
    """Why `value` (met anywhere inside a value going back) belongs to its rank, or None."""
    for kind in _per_rank_types():
        if isinstance(value, kind):
            return f"holds a {type(value).__name__}, which is each rank's own"
    return None


def going_back(value: Any) -> Any:
    """What goes back for `value`, met inside a value rank 0 sends: the model a wrapper wraps
    (as the notebook's name keeps it); raises TypeError for what is each rank's own."""
    why = per_rank_reason(value)
    if why is not None:
        raise TypeError(why)
    return unwrap(value)


def unwrap(value: Any) -> Any:
    """The module inside the wrappers a cell may put around one (torch.compile, DDP)."""
    for _ in range(8):
        if type(value).__name__ == "OptimizedModule" and isinstance(getattr(value, "_orig_mod", None), torch.nn.Module):
            value = value._orig_mod
        elif isinstance(value, torch.nn.parallel.DistributedDataParallel):
            value = value.module
        else:
            return value
    return value


# --------------------------------------------------------------------------------------
# Rank 0: what the cell changed
# --------------------------------------------------------------------------------------


# What wrapping a module writes on it (torch.compile): the wrapper's, not the module's state.
_WRAPPER_MARKS = {"_is_torch_compile"}


# The key of a name's object as the cell started, sent back apart from the name's new value
# when the cell changed that object and then rebound the name: the notebook's object (which
# other names may hold) takes the change before the name is bound anew.
BEFORE = "<before>"


def module_signature(module: torch.nn.Module) -> bytes:
    """A digest of a module's structure, not its weights' bytes: each submodule's type and
    attributes (by identity, so a replaced attribute counts), training flag, and each
    parameter's and buffer's identity, shape, dtype and `requires_grad`. What it misses: a
    container attribute changed in place (a list the module keeps, appended to)."""
    h = xxhash.xxh3_128()
    for path, sub in module.named_modules(remove_duplicate=False):
        h.update(f"|{path}:{type(sub).__qualname__}:{id(sub)}:{sub.training}".encode())
        for key, value in sub.__dict__.items():
            if key in ("_parameters", "_buffers"):
                for name, t in value.items():
                    meta = None if t is None else (id(t), t.requires_grad, tuple(t.shape), t.dtype)
                    h.update(f"{key}.{name}:{meta}".encode())
            elif key == "_modules":
                h.update(repr(list(value)).encode())
            elif key not in _WRAPPER_MARKS:
                h.update(f"{key}:{id(value)}".encode())
    return h.digest()


class Snapshot:
    """Rank 0's digests of the names a cell can reach, taken as it starts (`names` that the
    namespace holds), and their tensors' digests (id -> digest)."""

    def __init__(self, namespace: dict, names: Iterable[str]) -> None:
        self.namespace = namespace
        # A name the workers hold as a wrapper around the notebook's model (an earlier cell's
        # torch.compile) stands for the model.
        self.values = {n: unwrap(namespace[n]) for n in names if n in namespace}  # as the cell starts
        self.named = self._named()
        self.tensor_digests: dict[int, bytes] = {}
        self.digests = {n: self._digest(v, self.tensor_digests) for n, v in self.values.items()}

    def _named(self) -> dict[int, str]:
        """id -> name of the notebook's objects the workers hold as that same object now."""
        named: dict[int, str] = {}
        for name, value in self.values.items():
            if shared_by_identity(value, self.namespace):
                named.setdefault(id(value), name)
        return named

    def _digest(self, value: Any, tensor_digests: dict[int, bytes]) -> bytes | None:
        if isinstance(value, torch.nn.Module):
            return module_signature(value)
        tensors: dict = {}
        file = io.BytesIO()
        pickler = shipping._StructurePickler(file, tensors, self.namespace, self.named, value)
        try:
            with writewatch.watch().digest_pass():
                pickler.dump(value)
        except Exception:  # cannot be pickled (it travelled, so the cell made it so): changed
            return None
        h = xxhash.xxh3_128(file.getvalue())
        for d in pickler.buffer_digests:
            h.update(d)
        for key in pickler.keys:
            tensor_digests[key] = tensors[key][2]
            h.update(tensors[key][2])
        return h.digest()

    def changed(self, rebound: Iterable[str]) -> tuple[list[str], list[str], dict[int, bytes]]:
        """After the cell: the names whose object it changed in place (also when it then
        rebound the name: other names, or other objects, may hold the object); the names it
        rebound to a wrapper around their object (`unwrap`); and the tensors reached from
        them, with their digests now."""
        rebound = set(rebound)
        now: dict[int, bytes] = {}
        changed, wrapped = [], []
        for name, before in self.values.items():
            if name in rebound and self.namespace.get(name) is not before:
                if unwrap(self.namespace.get(name)) is before:
                    wrapped.append(name)  # rebound to a wrapper around the same model
                elif not shared_by_identity(before, self.namespace):
                    continue  # nothing else can hold it
            digest = self._digest(before, now)
            if digest is None or digest != self.digests[name]:
                changed.append(name)
        return changed, wrapped, now

    def unchanged_tensors(self, now: dict[int, bytes]) -> set[int]:
        """Ids of the tensors whose bytes the cell did not change (the notebook holds them)."""
        return {key for key, digest in now.items() if self.tensor_digests.get(key) == digest}


# --------------------------------------------------------------------------------------
# The kernel: rank 0's value into the notebook's object
# --------------------------------------------------------------------------------------

_ATOMS = (int, float, complex, str, bytes, bool, type(None), frozenset, range)
# Values that are never written into: code, classes and modules travel by reference or
# are rebuilt whole, and the notebook keeps its own.
_NOT_MERGED = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
               torch.dtype, torch.device)


def adopt(old: Any, new: Any) -> bool:
    """Write rank 0's `new` into the notebook's `old` in place, keeping the identity of `old`
    and of every object inside it that has a counterpart in `new` (a list's items, a dict's
    values, an object's attributes, a module's submodules, an optimizer's state tensors).
    False when `old` cannot take it (another type, an immutable value that differs, an object
    without a `__dict__`): the caller binds `new` instead."""
    return _Merge().into(old, new)


class _Merge:
    def __init__(self) -> None:
        self.done: dict[tuple[int, int], bool] = {}

    def into(self, old: Any, new: Any) -> bool:
        if old is new:
            return True
        if type(old) is not type(new):
            return False
        if isinstance(old, _ATOMS):
            return old == new or (old != old and new != new)  # NaN is itself
        key = (id(old), id(new))
        if key in self.done:
            return self.done[key]
        self.done[key] = True  # a cycle back here: assume it fits while it is merged
        self.done[key] = result = self._merge(old, new)
        return result

    def _kept(self, old: Any, new: Any) -> Any:
        """`old`, with `new` written into it when it can take it; else `new`."""
        return old if self.into(old, new) else new

    def _merge(self, old: Any, new: Any) -> bool:
        if isinstance(old, _NOT_MERGED):
            return False
        if isinstance(old, torch.Tensor):
            return _tensor_into(old, new)
        if isinstance(old, np.ndarray):
            if old.shape != new.shape or old.dtype != new.dtype or not old.flags.writeable:
                return False
            old[...] = new
            return True
        if isinstance(old, tuple):
            return len(old) == len(new) and all(self.into(o, n) for o, n in zip(old, new))
        if isinstance(old, list):
            old[:] = [self._kept(old[i], n) if i < len(old) else n for i, n in enumerate(new)]
        elif isinstance(old, dict):
            merged = {k: self._kept(old[k], v) if k in old else v for k, v in new.items()}
            old.clear()
            old.update(merged)
        elif isinstance(old, set):
            old.clear()
            old.update(new)
        elif isinstance(old, bytearray):
            old[:] = new
        elif not hasattr(old, "__dict__"):
            return False
        else:
            return self._attributes(old, new)
        # A container written: a subclass's own attributes too
        return self._attributes(old, new) if hasattr(old, "__dict__") else True

    def _attributes(self, old: Any, new: Any) -> bool:
        cls = type(new)
        custom_state = cls.__getstate__ is not object.__getstate__
        state = new.__getstate__() if custom_state else new.__dict__
        if not isinstance(state, dict):
            return False
        merged = {k: self._kept(old.__dict__[k], v) if k in old.__dict__ else v for k, v in state.items()}
        if hasattr(cls, "__setstate__"):
            old.__setstate__(merged)  # the class rebuilds what its pickle leaves out (an optimizer's hooks)
        elif custom_state:
            old.__dict__.update(merged)
        else:  # the whole __dict__ travelled: an attribute deleted on the workers goes here too
            old.__dict__.clear()
            old.__dict__.update(merged)
        return True


def _tensor_into(old: torch.Tensor, new: torch.Tensor) -> bool:
    if old.shape != new.shape or old.dtype != new.dtype or old.layout != new.layout or not old.is_leaf:
        return False
    with torch.no_grad():
        old.copy_(new)
    old.requires_grad_(new.requires_grad)
    return True


# --------------------------------------------------------------------------------------
# Replicas that disagree
# --------------------------------------------------------------------------------------

_PLAIN = (int, float, bool, str, type(None))


# A parameter's sample: a block of bytes from every stretch of SAMPLE_EVERY, and its last.
SAMPLE_BLOCK, SAMPLE_EVERY = 4096, 1 << 18


def sampled_digest(array: np.ndarray) -> str:
    """A digest of a sample of a flat uint8 array's bytes (1/64 of them past 256 KiB): ranks
    that drift apart (another learning rate, a step skipped, a checkpoint loaded on one) do so
    in nearly every weight, and every rank hashes its whole model at the end of every cell."""
    # `.data`: an array's buffer, not copied (numpy types ndarray as a buffer only from Python 3.12).
    if array.nbytes <= SAMPLE_EVERY:
        return xxhash.xxh3_128(array.data).hexdigest()
    count = (array.nbytes - SAMPLE_BLOCK) // SAMPLE_EVERY + 1
    blocks = np.lib.stride_tricks.as_strided(array, shape=(count, SAMPLE_BLOCK), strides=(SAMPLE_EVERY, 1))
    h = xxhash.xxh3_128(np.ascontiguousarray(blocks).data)
    h.update(array[-SAMPLE_BLOCK:].data)
    return h.hexdigest()


def replica_digests(namespace: dict, names: Iterable[str]) -> dict[str, dict]:
    """What automatic mode keeps equal on every rank, of the models and optimizers among
    `names`: each parameter's sampled digest, and each optimizer's hyperparameters. Buffers are
    left out: they may differ (batch statistics) and the kernel makes them rank 0's after the
    cell; so are sharded parameters, each rank's own part."""
    found: dict[str, dict] = {}
    for name in names:
        value = unwrap(namespace.get(name))
        if isinstance(value, torch.nn.Module):
            weights = {}
            for key, param in value.named_parameters():
                if type(param).__name__ == "DTensor" or not tensorbytes.shippable(param):
                    continue
                weights[key] = sampled_digest(tensorbytes.tensor_bytes(param)[0])
            found[name] = {"weights": weights}
        elif isinstance(value, torch.optim.Optimizer):
            found[name] = {"hyper": [{k: v for k, v in group.items() if isinstance(v, _PLAIN)}
                                     for group in value.param_groups]}
    return found


def say_disagreements(headers: dict[int, Any]) -> None:
    """Automatic mode keeps every rank's models and optimizers alike; where a cell made
    them differ (a decision taken on each rank's own shard of a metric), say so: the
    notebook gets rank 0's. `headers`: each rank's answer to the cell."""
    replicas = {r: h["replicas"] for r, h in headers.items() if h.get("replicas") is not None}
    said = disagreements(replicas) if len(replicas) == len(headers) else []
    if said:
        print(f"jupyter_scale: the ranks disagree after this cell: {'; '.join(said)}. The notebook holds rank "
              "0's. A decision taken on each rank's own data (a scheduler stepped on a validation loss) "
              "needs the value reduced across ranks first: dist.all_reduce(loss); loss /= world_size "
              "(README: Per-rank decisions)", file=sys.stderr, flush=True)


def disagreements(replicas: dict[int, dict[str, dict]]) -> list[str]:
    """What differs across the ranks' `replica_digests` (rank -> theirs), said per name."""
    ranks = sorted(replicas)
    if len(ranks) < 2:
        return []
    said = []
    for name in sorted(set().union(*(replicas[r] for r in ranks))):
        seen = {r: v for r in ranks if (v := replicas[r].get(name)) is not None}
        if len(seen) < len(ranks):
            continue  # not on every rank: nothing to compare
        first = seen[ranks[0]]
        if "weights" in first:
            keys = sorted(k for k in first["weights"] if any(seen[r]["weights"].get(k) != first["weights"][k]
                                                             for r in ranks[1:]))
            if keys:
                others = [r for r in ranks[1:] if seen[r]["weights"] != first["weights"]]
                said.append(f"{name}'s weights differ on rank {_ranks(others)} from rank {ranks[0]}'s "
                            f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})")
        else:
            for i, group in enumerate(first["hyper"]):
                for key, mine in group.items():
                    values = {r: seen[r]["hyper"][i].get(key) if i < len(seen[r]["hyper"]) else None for r in ranks}
                    if any(v != mine for v in values.values()):
                        where = f"param_groups[{i}]['{key}']" if len(first["hyper"]) > 1 else key
                        shown = ", ".join(f"rank {r} {values[r]}" for r in ranks[:4])
                        said.append(f"{name}'s {where} differs: {shown}{', ...' if len(ranks) > 4 else ''}")
    return said


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks[:4]) + (", ..." if len(ranks) > 4 else "")
