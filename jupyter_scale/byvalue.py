"""Values pickled whole into frames: what rank 0 sends back, and what a worker answers.

The way back (pull-back, gather, a sharded model's whole tensors) pickles values by value,
each tensor as its bytes in an out-of-band buffer (`tensorbytes`), with the notebook's
functions and classes living in a namespace (`namespacepickle`): `dumps` / `loads` for one
value, `dump_values` / `load_values` for several in one stream with one memo (an object two
of them hold stays one object).

A tensor of the notebook's that the workers hold by a token (see shipping) comes back
marked with it and is written into the notebook's own tensor, once the whole value loaded.
A state dict's tensors that the notebook holds already are left out (`state_digests`,
`drop_unchanged`), and the other tensors sent back get tokens of their own (`BackTokens`),
by which the workers then hold them.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Collection
from typing import Any

import cloudpickle
import torch

from . import tensorbytes, writewatch
from .namespacepickle import NamespacePickler


class _ValuePickler(NamespacePickler, cloudpickle.Pickler):
    def __init__(self, file, namespace: dict | None, held: dict[int, int] | None, arrays: dict[int, tuple] | None,
                 buffers: list, named: dict[int, str] | None = None, same: Collection[int] = frozenset(),
                 substitute: Callable[[Any], Any] | None = None, back: BackTokens | None = None):
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._init_namespace(namespace, named)
        self.held = held or {}
        self.arrays = arrays or {}
        self.same = same  # ids of held tensors whose bytes the receiver holds already
        self.substitute = substitute  # what travels for an object met inside (it may raise)
        self.back = back  # tokens for the other tensors, which both sides then hold
        self.tensor_buffers: list[pickle.PickleBuffer] = []

    def reducer_override(self, obj):
        if self.substitute is not None and (other := self.substitute(obj)) is not obj:
            return _same, (other,)
        return super().reducer_override(obj)

    def persistent_id(self, obj):
        if not tensorbytes.shippable(obj):
            return self._namespace_ref(obj)
        token = self.held.get(id(obj))
        if token is not None and id(obj) in self.same:
            return ("same", tensorbytes.tensor_meta(obj), token)
        if token is None and self.back is not None and (token := self.back.given.get(id(obj))) is not None:
            return ("backref", token)  # met before in this stream: the same tensor
        array, meta = self.arrays.get(id(obj)) or tensorbytes.tensor_bytes(obj)
        # A view is its own copy where it lands (as a tensor the notebook sends): written into
        # by token, it would write into what it views on the workers.
        if token is None and self.back is not None and obj._base is None:
            self.tensor_buffers.append(pickle.PickleBuffer(array))
            return ("back", meta, self.tensor_buffers[-1], self.back.give(obj))
        self.tensor_buffers.append(pickle.PickleBuffer(array))
        if token is not None:
            return ("held", meta, self.tensor_buffers[-1], token)
        return ("value", meta, self.tensor_buffers[-1])


def _same(value: Any) -> Any:
    return value


class _ValueUnpickler(pickle.Unpickler):
    def __init__(self, file, buffers, copy: bool, namespace: dict | None, held: dict | None):
        super().__init__(file, buffers=buffers)
        self.copy = copy
        self.namespace = namespace if namespace is not None else {}
        self.held = held or {}
        self.writes: list[tuple] = []  # into the notebook's tensors, once the whole value loaded
        self.back: dict[int, torch.Tensor] = {}  # token -> tensor, of the tensors that came with a token

    def persistent_load(self, pid):
        if pid[0] == "ns":
            return self.namespace
        if pid[0] == "back":
            tensor = self.back[pid[3]] = tensorbytes.build(pid[1], pid[2], None, self.copy)
            return tensor
        if pid[0] == "backref":
            return self.back[pid[1]]
        if pid[0] == "name":  # an object the notebook holds as that name
            return self.namespace[pid[1]]
        if pid[0] == "same":  # the notebook's tensor, whose bytes did not change
            self.writes.append((self.held[pid[2]], pid[1], None))
            return self.held[pid[2]]
        if pid[0] == "held" and pid[3] in self.held:
            self.writes.append((self.held[pid[3]], pid[1], pid[2]))
            return self.held[pid[3]]
        return tensorbytes.build(pid[1], pid[2], None, self.copy)

    def apply_writes(self) -> None:
        for tensor, meta, buffer in self.writes:
            if buffer is not None:
                tensorbytes.write_into(tensor, meta, buffer)
            elif tensor.is_leaf and tensor.requires_grad != meta[2]:
                tensor.requires_grad_(meta[2])


def dumps(value: Any, namespace: dict | None = None, held: dict[int, int] | None = None,
          arrays: dict[int, tuple] | None = None) -> tuple[list, list[bool]]:
    """Frames (stream, *buffers) of `value`, tensors by value, out of band; and which
    frames hold a tensor's bytes (a receiver copies those into its tensors; other buffers
    it must own as they are). Functions whose globals are `namespace` (the worker's)
    travel without them and resolve them in the namespace `loads` is given. A tensor in
    `held` (id -> token: one the notebook sent) is marked with its token. `arrays` (id ->
    its bytes and meta) are tensors' bytes made already, e.g. to hash them."""
    buffers: list[pickle.PickleBuffer] = []
    file = io.BytesIO()
    pickler = _ValuePickler(file, namespace, held, arrays, buffers)
    pickler.dump(value)
    tensor_buffers = {id(b) for b in pickler.tensor_buffers}
    return ([file.getvalue(), *(b.raw() for b in buffers)],
            [False, *(id(b) in tensor_buffers for b in buffers)])


def state_digests(module: torch.nn.Module, tensors: dict) -> dict[str, tuple]:
    """key -> (digest, dtype, shape) of the module's state dict entries whose tensors a
    plan hashed (`shipping.Plan.tensors`): what the notebook holds, for rank 0 to compare with."""
    found = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        planned = tensors.get(id(tensor))
        if planned is not None:
            found[key] = (planned[2], *planned[3][:2])
    return found


def drop_unchanged(state: dict, notebook: dict[str, tuple]) -> tuple[list[str], dict[str, bytes], dict[int, tuple]]:
    """Take out of the state dict `state` the tensors whose bytes, dtype and shape the
    notebook holds already (`notebook`: see state_digests). Returns the keys taken out,
    every tensor's digest (the kernel then need not hash what it receives), and the bytes
    made to hash them (id -> (array, meta), for `dumps`)."""
    same, digests, arrays = [], {}, {}
    by_storage: dict[tuple, bytes] = {}  # tied weights are hashed once
    with writewatch.watch().digest_pass():
        for key, tensor in list(state.items()):
            if not tensorbytes.shippable(tensor):
                continue
            array, meta = arrays[id(tensor)] = tensorbytes.tensor_bytes(tensor)
            where = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            digest = digests[key] = by_storage.get(where) or by_storage.setdefault(
                where, tensorbytes.digest(tensor, array))
            if notebook.get(key) == (digest, *meta[:2]):
                same.append(key)
                del state[key]
    return same, digests, arrays


def loads(stream, buffers, copy: bool = True, namespace: dict | None = None,
          held: dict[int, torch.Tensor] | None = None) -> Any:
    """The value of `dumps`' frames. With `copy=False` its tensors may share the frames'
    memory (writable frames only): for a caller that copies them out at once. Functions
    that lived in the sender's namespace get `namespace` (the notebook's) as globals. A
    tensor marked with a token in `held` (token -> the notebook's tensor) is written into
    that tensor: an optimizer pulled back holds the notebook model's parameters. They are
    written only once the whole value loaded: a value that fails to load changes nothing."""
    unpickler = _ValueUnpickler(io.BytesIO(stream), list(buffers), copy, namespace, held)
    value = unpickler.load()
    unpickler.apply_writes()
    return value


class BackTokens:
    """Tokens for the tensors of values sent back that the notebook did not send: counted
    down from `base` (the kernel's tokens count up), in the order a pickle meets them, so
    that every rank walking its own values alike gives its own tensors the same tokens."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.given: dict[int, int] = {}  # id -> token
        self.tensors: dict[int, torch.Tensor] = {}  # token -> tensor

    def give(self, tensor: torch.Tensor) -> int:
        token = self.given[id(tensor)] = self.base - len(self.given)
        self.tensors[token] = tensor
        return token


def dump_values(values: dict[str, Any], namespace: dict, held: dict[int, int], *, named: dict[int, str],
                same: Collection[int] = frozenset(), substitute: Callable[[Any], Any] | None = None,
                back: BackTokens | None = None, own: dict[str, str] | None = None
                ) -> tuple[list, list[bool], dict[str, int]]:
    """Frames of `values` (name -> value) in one stream with one memo, for `load_values`:
    an object two of them hold stays one. An object of `named` (id -> the name the receiver
    holds it as) is a reference to the receiver's, but where it is that name's value dumped
    (`own`: the name each key stands for, where it is not the key itself).
    Tensors as in `dumps`; a held one in `same` goes without its bytes. Also: each value's
    bytes. `substitute(obj)` is what travels for each object met (it may raise). With `back`,
    the tensors not `held` get tokens from it."""
    buffers: list[pickle.PickleBuffer] = []
    file = io.BytesIO()
    pickler = _ValuePickler(file, namespace, held, None, buffers, named, same, substitute, back)
    sizes = {}
    for name, value in values.items():
        start, first = file.tell(), len(buffers)
        # By value where it is the receiver's object under this very name (to be written into
        # it), else a reference when the receiver holds it (another name's object).
        stands_for = (own or {}).get(name, name)
        pickler.inline = {id(value)} if named.get(id(value)) == stands_for else set()
        # A key standing for another name's object (one the notebook writes into) gives no
        # tokens: the other ranks, walking the names' values alike, never meet it.
        pickler.back = back if stands_for == name else None
        pickler.dump(value)
        sizes[name] = file.tell() - start + sum(b.raw().nbytes for b in buffers[first:])
    tensor_buffers = {id(b) for b in pickler.tensor_buffers}
    return ([file.getvalue(), *(b.raw() for b in buffers)], [False, *(id(b) in tensor_buffers for b in buffers)],
            sizes)


def load_values(names: list[str], stream, buffers, namespace: dict,
                held: dict[int, torch.Tensor]) -> tuple[dict[str, Any], dict[int, torch.Tensor]]:
    """The values of `dump_values`' frames, by name, and the tensors that came with a token
    (token -> tensor); tensors written into the notebook's held ones only once every value
    loaded (a value that fails to load changes nothing)."""
    unpickler = _ValueUnpickler(io.BytesIO(stream), list(buffers), True, namespace, held)
    values = {name: unpickler.load() for name in names}
    unpickler.apply_writes()
    return values, unpickler.back
