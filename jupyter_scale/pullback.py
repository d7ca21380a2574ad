"""The pull-back: what a cell's `--pull` brings from rank 0 into the notebook.

Values land whole or not at all: a state dict is checked against the notebook's model
before one tensor is copied, a sharded model's tensors are checked before the first chunk
comes. The notebook then holds what the workers hold, and shipping knows it (`mark_synced`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import byvalue, shipping, statesync, worker, writewatch
from .backends import Backend, Job
from .export import human_size

if TYPE_CHECKING:
    from .backends.channel import CellChannel
    from .protocol import CellReply
    from .records import RunRecord


@dataclass
class Puller:
    namespace: dict  # the notebook's
    shipper: shipping.Shipper
    calls: Backend | CellChannel  # what carries the chunks' calls
    chunk_bytes: int  # a sharded model comes back in chunks of whole tensors of at most this
    timeout: float  # for each chunk's answer
    abandon: Callable[[Job], None]  # stops a chunk's job that failed; the group is then formed anew
    plan: shipping.Plan | None = None  # the cell's: what the notebook's values were as it began
    bring_back_limit: int = 0  # for the note on values left on the workers

    def apply(self, header: CellReply, frames: Sequence, record: RunRecord) -> None:
        """Rank 0's answer to the cell's pulls: each value into the notebook, all or nothing
        per value; what cannot apply is said in one line and the rest goes on."""
        at = 0
        held = None
        values: dict
        hashed: list = []
        returned = header.get("returned", {})
        back_tokens = returned.get("back", {}).get("count", 0)  # given by rank 0 to tensors it sent back
        kept = [names[0] for names, kind, _ in header.get("pulled", []) if kind == "kept"]
        if kept:
            print(f"jupyter_scale: {listed(kept)} stay{'s' if len(kept) == 1 else ''} sharded on the workers "
                  "(--keep-sharded); the notebook's holds the weights from before the cell", file=sys.stderr,
                  flush=True)
        for names, kind, count in header.get("pulled", []):
            if kind == "kept":
                continue
            if kind != "sharded":  # a sharded model's `count` is the plan of its state dict, not frames
                stream, buffers = frames[at], frames[at + 1: at + count]
                at += count
                record.pulled_bytes[", ".join(names)] = sum(memoryview(f).nbytes for f in (stream, *buffers))
            try:
                if kind == "sharded":
                    self._sharded(names[0], count)
                    values = {}
                elif kind in ("tensorflow_weights", "paddle_weights"):
                    value = byvalue.loads(stream, buffers, copy=False, namespace=self.namespace)
                    set_weights(self.namespace[names[0]], value)
                    values = {}
                elif kind == "state_dict":
                    # Copied into the notebook's model at once: no copy before.
                    value = byvalue.loads(stream, buffers, copy=False, namespace=self.namespace)
                    module = self.namespace[names[0].removeprefix(statesync.BEFORE)]
                    same, digests = header.get("state_digests", {}).get(names[0], ([], {}))
                    own = module.state_dict(keep_vars=True)
                    # The notebook holds these bytes already: copying a tensor onto itself is a no-op.
                    value.update((key, own[key]) for key in same)
                    check_state_dict(module, value, own)  # all or nothing
                    changed = value.keys() - set(same)
                    for key in changed:  # overwritten whole: see writewatch
                        writewatch.will_write(own[key])
                    if changed:  # else every entry is the notebook's own: nothing to load
                        with torch.no_grad():
                            module.load_state_dict(value)
                    targets = module.state_dict(keep_vars=True) if changed else own
                    hashed = [(targets[key], digest) for key, digest in digests.items() if key in targets]
                    values = {}
                else:
                    # The tensors the notebook sent are written into the notebook's own, and
                    # so is each value of the notebook's that the cell changed in place.
                    held = self.shipper.held_tensors() if held is None else held
                    values, taken = byvalue.load_values(names, stream, buffers, self.namespace, held)
                    self.shipper.took_back(taken, back_tokens)
                    back_tokens = 0
                    adopt = set(returned.get("adopt", ()))
                    for key, value in values.items():
                        name = key.removeprefix(statesync.BEFORE)
                        if not self.shipper.eligible(name):  # IPython's own (`_i`, `Out`): the kernel's
                            continue
                        if key in adopt and name in self.namespace and statesync.adopt(self.namespace[name], value):
                            continue
                        if key == name:  # a name's object as the cell started that cannot take it stays as it was
                            self.namespace[name] = value
                    names = [n for n in names if not n.startswith(statesync.BEFORE) and self.shipper.eligible(n)]
            except Exception as exc:  # e.g. the architecture changed, or a class is missing here
                print(f"jupyter_scale: could not pull {listed(names)} back: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
                continue
            for name in names:
                if name.startswith(statesync.BEFORE):  # its name is bound anew, below
                    continue
                record.pulled.append(name)
                # The notebook now holds what the workers hold: don't send it back unchanged.
                if kind == "state_dict":
                    self.shipper.mark_synced(name, self.namespace[name], hashed, self.plan)
                else:
                    self.shipper.mark_synced(name, self.namespace[name])
        for name, problem in header.get("pull_errors", {}).items():
            print(f"jupyter_scale: could not pull {name!r}: it {problem}", file=sys.stderr, flush=True)
        if back_tokens:  # the values did not load: no token of theirs is held
            self.shipper.took_back({}, back_tokens)
        for name in returned.get("deleted", ()):  # deleted by the cell, as a local run would
            if self.shipper.eligible(name):
                self.namespace.pop(name, None)
                self.shipper.forget_name(name)
        if returned.get("too_big"):
            sizes = ", ".join(f"{n!r} ({human_size(b)})" for n, b in returned["too_big"].items())
            print(f"jupyter_scale: {sizes} stay{'s' if len(returned['too_big']) == 1 else ''} on the workers: "
                  f"over bring_back_limit ({human_size(self.bring_back_limit)}); --pull "
                  f"{','.join(returned['too_big'])} brings {'it' if len(returned['too_big']) == 1 else 'them'} "
                  "back", file=sys.stderr, flush=True)

    def _sharded(self, name: str, plan: list) -> None:
        """Copy a sharded model's trained weights into the notebook's model, a chunk of
        whole tensors at a time (at most `pull_chunk_bytes`, or one tensor if larger):
        every rank gathers the chunk's shards, rank 0 sends it, the kernel copies it in
        place. Neither the kernel nor any rank holds a second whole copy of the model."""
        module = self.namespace[name]
        targets = module.state_dict(keep_vars=True)
        wanted = {key: (shape, dtype) for key, shape, dtype, _, _ in plan}
        mismatched = sorted(k for k in wanted.keys() | targets.keys() if k not in wanted or k not in targets
                            or (list(targets[k].shape), str(targets[k].dtype)) != wanted[k])
        if mismatched:  # checked before anything is written: all or nothing
            raise ValueError(f"the notebook's {name} and the workers' differ at {listed(mismatched[:5])}")
        chunks: list[list[str]] = [[]]
        size = 0
        for key, _, _, nbytes, alias in plan:
            if alias is not None:
                continue  # tied to an earlier key: the same tensor
            if chunks[-1] and size + nbytes > self.chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(key)
            size += nbytes
        written = 0
        for keys in chunks:
            job = self.calls.submit(worker.whole_tensors, name, keys)
            try:
                answers = job.wait(self.timeout)
            except BaseException as exc:
                self.abandon(job)
                raise RuntimeError(f"{exc}; {written} of {sum(len(c) for c in chunks)} of its tensors were written: "
                                   f"the notebook's {name} is partly updated "
                                   "(the workers still hold the trained model)") from None
            finally:
                job.release()
            values = byvalue.loads(answers[0][1], answers[0][2:], copy=False, namespace=self.namespace)
            with torch.no_grad():
                for key, value in values.items():
                    targets[key].copy_(value)
            written += len(keys)
            del values, answers
        with torch.no_grad():
            for key, _, _, _, alias in plan:  # tied on the workers: tied in the notebook too, or copied
                if alias is not None and targets[key] is not targets[alias]:
                    targets[key].copy_(targets[alias])


def check_state_dict(module: torch.nn.Module, state: dict, own: dict | None = None) -> None:
    """Raise, naming the first difference, unless `state` fits `module` exactly (keys,
    shapes, dtypes): load_state_dict would copy every tensor that fits before raising on
    one that does not, leaving the notebook's model half rank 0's. `own`: the module's
    state dict, when the caller has it."""
    own = module.state_dict() if own is None else own
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unexpected:
        raise ValueError(f"the workers' model has {'no ' + repr(missing[0]) if missing else repr(unexpected[0])} "
                         f"({len(missing)} missing, {len(unexpected)} unexpected entries); the notebook's model "
                         "is unchanged")
    for key, tensor in own.items():
        theirs = state[key]
        if not isinstance(tensor, torch.Tensor):  # a module's extra state: its own to check
            continue
        if not isinstance(theirs, torch.Tensor) or theirs.shape != tensor.shape or theirs.dtype != tensor.dtype:
            got = f"{tuple(theirs.shape)} {theirs.dtype}" if isinstance(theirs, torch.Tensor) else type(theirs).__name__
            raise ValueError(f"{key!r} is {got} on the workers, {tuple(tensor.shape)} {tensor.dtype} here; "
                             "the notebook's model is unchanged")


def set_weights(model, weights: list | dict) -> None:
    """A Keras model's (a list) or a Paddle Layer's (a state dict) weights from rank 0,
    checked whole before any is written, as check_state_dict does for torch."""
    own = model.get_weights() if isinstance(weights, list) else {k: v.numpy() for k, v in model.state_dict().items()}
    pairs = list(zip(own, weights)) if isinstance(weights, list) else [(own.get(k), v) for k, v in weights.items()]
    if len(own) != len(weights) or any(mine is None or mine.shape != theirs.shape for mine, theirs in pairs):
        raise ValueError("the workers' model has other weights (shapes or names) than the notebook's; "
                         "the notebook's model is unchanged")
    if isinstance(weights, list):
        model.set_weights(weights)
    else:
        model.set_state_dict(weights)


def listed(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)
