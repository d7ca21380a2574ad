"""What rank 0 sends back after a cell (see statesync for the model), and the tokens the
other ranks give their own tensors of it.

Runs inside a worker, on the namespace and the receiver of its cells.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import byvalue, frameworks, sharding, statesync
from .receiving import Receiver


class Return:
    """What rank 0 sends back after a cell (see statesync for the model): the notebook's
    modules the cell used (their weights, as state dicts: only the tensors the notebook does
    not hold already), every value the cell changed in place or bound, and the `--pull`
    names. A module whose structure changed (its mode, a frozen parameter) travels whole.
    Each entry of `pack`'s list is (names, kind, frame count)."""

    def __init__(self, request: Mapping[str, Any], snapshot: statesync.Snapshot | None, rebound: list[str], namespace: dict,
                 receiver: Receiver) -> None:
        self.request, self.snapshot, self.ns, self.receiver = request, snapshot, namespace, receiver
        self.pull = list(request.get("pull", []))
        changed, self.wrapped, self.now = snapshot.changed(rebound) if snapshot is not None else ([], [], {})
        self.changed = set(changed)
        self.rebound = [n for n in rebound if n not in self.wrapped]
        self.pulled: list = []
        self.errors: dict[str, str] = {}
        self.state_digests: dict = {}
        self.returned: dict = {"adopt": [], "deleted": [n for n in self.rebound if n not in self.ns], "left": {},
                               "too_big": {}}
        self.same: set[int] = snapshot.unchanged_tensors(self.now) if snapshot is not None else set()

    def pack(self, out_frames: list, tensor_frames: list) -> tuple[list, dict, dict]:
        values: dict[str, Any] = {}
        for name in self.request.get("modules", []):
            if name not in self.ns:
                if name not in self.returned["deleted"]:
                    self.errors[name] = "is not defined on the workers"
                continue
            if name in self.pull or (name in self.rebound and name not in self.wrapped):
                before = self.snapshot.values.get(name) if self.snapshot is not None else None
                if isinstance(before, torch.nn.Module) and name not in self.pull:
                    # Rebound after the cell changed the notebook's model (`net.load_state_dict(...);
                    # net = Net()`): the notebook's model, which other names may hold, takes the change.
                    self._module(statesync.BEFORE + name, before, values, out_frames, tensor_frames)
                continue  # the name's new value: by value, below
            self._module(name, statesync.unwrap(self.ns[name]), values, out_frames, tensor_frames)
        for name in self.pull:
            if name not in self.ns:
                self.errors[name] = "is not defined on the workers"
            elif holds_shards(self.ns[name]):
                self.errors[name] = ("holds sharded tensors, this rank's part of them: save a checkpoint "
                                     "(jupyter_scale.save_checkpoint) and load it in the notebook instead")
            else:
                values[name] = statesync.unwrap(self.ns[name])
        if self.snapshot is not None:
            modules = set(self.request.get("modules", []))
            for name in sorted(self.changed):
                if name in self.rebound:
                    values[statesync.BEFORE + name] = self.snapshot.values[name]
                elif name not in modules and name not in values:
                    values[name] = self.ns[name]
            for name in self.rebound:
                if name in self.ns and name not in values:
                    value = statesync.unwrap(self.ns[name])  # a model the cell made and wrapped: the model
                    if statesync.per_rank_reason(value) is not None or holds_shards(value):
                        self.returned["left"][name] = "its rank's own"
                    else:
                        values[name] = value
        if values:
            self._values(values, out_frames, tensor_frames)
        return self.pulled, self.errors, self.state_digests

    def _module(self, name: str, value: Any, values: dict, out_frames: list, tensor_frames: list) -> None:
        kind = frameworks.is_model(value)
        if kind not in ("torch", None) and (group := frameworks.formed(kind)) is not None:
            frames = self._packed(name, value, lambda: byvalue.dumps(group.weights(value), self.ns))
            if frames is not None:
                self._add([name], f"{kind}_weights", frames, out_frames, tensor_frames)
            return
        if kind is None:
            self.errors[name] = f"is no longer a model on the workers ({type(value).__name__})"
            return
        if kind != "torch":
            self.errors[name] = f"is a {kind} model, and no {kind} group ran this cell (--framework {kind})"
            return
        if sharding.is_sharded_model(value):
            if self.request.get("keep_sharded"):  # left on the workers: the notebook's stays as it was
                self.pulled.append(([name], "kept", 0))
            else:
                self.pulled.append(([name], "sharded", sharding.whole_tensors_plan(value)))
            return
        notebook = self.request.get("digests", {}).get(name.removeprefix(statesync.BEFORE), {})
        if name.removeprefix(statesync.BEFORE) in self.changed:  # its structure changed: whole, but for
            # the tensors the notebook holds
            state = value.state_dict(keep_vars=True)
            same, _, _ = byvalue.drop_unchanged(dict(state), notebook)
            self.same.update(id(state[key]) for key in same)
            values[name] = value
            return
        # Only what the notebook does not hold already: an unchanged model costs a hash.
        state = value.state_dict()
        same, digests, arrays = byvalue.drop_unchanged(state, notebook)
        frames = self._packed(name, state, lambda: byvalue.dumps(state, self.ns, None, arrays))
        if frames is not None:
            self._add([name], "state_dict", frames, out_frames, tensor_frames)
            self.state_digests[name] = (same, digests)

    def _packed(self, name: str, value: Any, dump) -> tuple | None:
        try:
            return dump()
        except Exception as exc:  # pickling raises many types
            self.errors[name] = f"cannot be sent back: {type(exc).__name__}: {exc}"
            return None

    def _add(self, names: list, kind: str, frames: tuple, out_frames: list, tensor_frames: list) -> None:
        out_frames.extend(frames[0])
        tensor_frames.extend(frames[1])
        self.pulled.append((names, kind, len(frames[0])))

    def _values(self, values: dict, out_frames: list, tensor_frames: list) -> None:
        """Every value in one stream (an object two of them hold stays one); one that cannot
        travel is named (a --pull name) or left on the workers (a name the cell touched), and
        values the cell bound past the size limit stay too."""
        held = {id(t): token for token, t in self.receiver.tensors.items()}
        named = self.snapshot.named if self.snapshot is not None else {}
        own = {key: key.removeprefix(statesync.BEFORE) for key in values}
        base = self.request.get("back_base")
        back = None

        def dump(chosen: dict):
            nonlocal back
            back = byvalue.BackTokens(base) if base is not None else None
            return byvalue.dump_values(chosen, self.ns, held, named=named, same=self.same,
                                        substitute=statesync.going_back, back=back, own=own)

        try:
            frames = dump(values)
        except Exception:  # find the ones that cannot travel; the others go together
            for name in list(values):
                try:
                    dump({name: values[name]})
                except Exception as exc:  # pickling raises many types
                    self._cannot(name, f"cannot be sent back: {type(exc).__name__}: {exc}")
                    del values[name]
            frames = dump(values) if values else None
        limit = self.request.get("bring_back_bytes")
        if frames is not None and limit is not None:
            bound = {n: size for n, size in frames[2].items() if n not in self.pull and id(values[n]) not in named
                     and not isinstance(values[n], torch.nn.Module)}
            while bound and sum(bound.values()) > limit:
                name = max(bound, key=bound.__getitem__)
                self.returned["too_big"][name] = bound.pop(name)
                self.returned["left"][name] = "over the size limit"
                del values[name]
            if self.returned["too_big"]:
                frames = dump(values) if values else None
        if frames is not None:
            self._add(list(values), "values", frames[:2], out_frames, tensor_frames)
            self.returned["adopt"] = [n for n in values if named.get(id(values[n])) == own[n]]
            if back is not None and back.tensors:  # the other ranks give theirs these tokens next cell
                self.receiver.tensors.update(back.tensors)
                self.returned["back"] = {"names": list(values), "named": sorted(set(named.values())),
                                         "base": base, "count": len(back.tensors)}

    def _cannot(self, name: str, why: str) -> None:
        if name in self.pull:
            self.errors[name] = why
        else:
            self.returned["left"][name] = why


def register_back(back: dict, ns: dict, receiver: Receiver) -> None:
    """Give this rank's tensors the tokens rank 0 gave its own when it sent the last cell's
    values back: the same walk over this rank's values of the same names. A rank whose values
    differ (another count of tensors) keeps none of them."""
    named = {id(statesync.unwrap(ns[n])): n for n in back["named"] if n in ns}
    tokens = byvalue.BackTokens(back["base"])
    held = {id(t): token for token, t in receiver.tensors.items()}
    try:
        byvalue.dump_values({n: statesync.unwrap(ns[n]) for n in back["names"] if n in ns}, ns, held, named=named,
                             substitute=statesync.going_back, back=tokens, own={})
    except Exception:  # pickling raises many types; this rank's values are not rank 0's
        return
    if len(tokens.tensors) == back["count"]:
        receiver.tensors.update(tokens.tensors)


def holds_shards(value) -> bool:
    if isinstance(value, torch.nn.Module):
        return sharding.is_sharded_model(value)
    if isinstance(value, torch.optim.Optimizer):
        return any(sharding.is_sharded(p) for group in value.param_groups for p in group["params"])
    return isinstance(value, torch.Tensor) and sharding.is_sharded(value)
