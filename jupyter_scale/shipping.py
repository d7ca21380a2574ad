"""How the values of the notebook names a cell needs travel (which names: see cellnames).

Values are pickled by value with cloudpickle (so classes and functions defined in the
notebook travel too), with pickle protocol 5: the bytes of tensors and numpy arrays leave
the pickle stream as out-of-band buffers, which the engines send as separate frames
without copying them into the stream.

Kernel to workers (`Shipper` / `Receiver`): every tensor is sent as a persistent
reference with an identity token. The workers keep one tensor per token, so

- a tensor shared by several names (a model's parameters and the optimizer that holds
  them) stays one tensor on the workers, across names and across cells;
- a tensor whose bytes did not change is not sent again, only its token;
- a tensor that changed is updated in place on the workers (same object), so every
  worker object that holds it sees the new values.

Whether a name changed is decided by a content digest: its pickle (with each tensor
replaced by its identity and the xxh3 hash of its bytes) hashed again.

Functions and classes defined in the notebook keep living in a namespace, not in a copy
of it: a notebook function lands on the workers with the worker's namespace as its
globals, so it reads and writes the names there at call time, as it does in the kernel
(`_NamespaceFunctions`). The globals such functions read travel as names of their own
(`Plan` follows them, transitively), and so do the notebook classes of the values sent,
so that `__main__.Net` means the same class on the workers as in the notebook.

Objects the notebook's names share stay shared: the names a cell sends travel in one
pickle stream with one memo, and an object of another name met inside a value (a
scheduler's optimizer) is a reference to that name when the workers hold it already.

Last writer wins: a name that a distributed cell bound on the workers is theirs until
the notebook rebinds or changes it (`Shipper.workers_rebound`); only then is the
notebook's value sent over it, and the cell says so (`Shipment.replaced`).
"""

from __future__ import annotations

import enum
import functools
import io
import itertools
import pickle
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FunctionType, ModuleType
from typing import Any, cast

import cloudpickle
import cloudpickle.cloudpickle as _cloudpickle
import numpy as np
import torch
import xxhash

from . import libraries, writewatch
from .cellnames import global_names
from .errors import ShippingError

# --------------------------------------------------------------------------------------
# Tensors as (identity, bytes)
# --------------------------------------------------------------------------------------


def _shippable_tensor(obj: Any) -> bool:
    return (
        type(obj) in (torch.Tensor, torch.nn.Parameter)
        and obj.layout == torch.strided
        and obj.device.type in ("cpu", "cuda")
        and not obj.is_quantized
        and not obj.is_neg()
        and not obj.is_conj()
    )


def _tensor_bytes(tensor: torch.Tensor) -> tuple[np.ndarray, tuple]:
    """The tensor's elements as a flat uint8 array (a view when it can be) and its meta.

    A view is sent as its own elements, not its base's whole storage; on the workers it
    becomes a tensor of its own.
    """
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    array = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else np.empty(0, np.uint8)
    return array, _tensor_meta(tensor)


def _tensor_meta(tensor: torch.Tensor) -> tuple:
    requires_grad = tensor.requires_grad and tensor.grad_fn is None  # non-leaf: just data
    return (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), requires_grad,
            type(tensor) is torch.nn.Parameter, tensor.device.type)


def _build_tensor(meta: tuple, buffer, device: torch.device | None, copy: bool = True) -> torch.Tensor:
    dtype_name, shape, requires_grad, is_parameter, device_type = meta
    dtype = getattr(torch, dtype_name)
    # The received frame may be read-only and owned by the transport: copy it into
    # memory the tensor owns (one memcpy per worker), unless the caller copies it itself.
    if not copy and memoryview(buffer).readonly:
        copy = True
    raw = (torch.frombuffer(bytearray(buffer) if copy else buffer, dtype=torch.uint8) if len(buffer)
           else torch.empty(0, dtype=torch.uint8))
    tensor = (raw.view(dtype) if raw.numel() else torch.empty(0, dtype=dtype)).reshape(shape)
    if device_type == "cuda" and device is not None and device.type == "cuda":
        tensor = tensor.to(device)  # a notebook GPU tensor lands on this rank's GPU
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


_digest = writewatch.digest


def _tensor_digest(tensor: torch.Tensor, array: np.ndarray) -> bytes:
    """The digest of `array`, `tensor`'s bytes: their chunks hashed only if they were
    written since they were last hashed (see writewatch)."""
    return writewatch.watch().digest(tensor, array)


# --------------------------------------------------------------------------------------
# Functions that live in a namespace
# --------------------------------------------------------------------------------------

_NO_IDENTITY = (int, float, complex, str, bytes, bool, type(None), tuple, frozenset, range, slice,
                type, ModuleType, enum.Enum, torch.dtype, torch.device, torch.Tensor)


def _shared_by_identity(value: Any, namespace: dict) -> bool:
    """Whether another value holding `value` must hold the very same object on the workers:
    an optimizer that a scheduler steps, a model that a trainer wraps, a list a function
    appends to, a notebook function kept in a list of callbacks."""
    if isinstance(value, _NO_IDENTITY):
        return False
    if callable(value) and not isinstance(value, FunctionType) and type(value).__module__ == "builtins":
        return False  # builtins and their bound methods travel by reference
    return not isinstance(value, FunctionType) or value.__globals__ is namespace


class _NamespaceFunctions:
    """A pickler mixin: values that live in the namespace stay the namespace's.

    cloudpickle gives a function defined in `__main__` a private copy of the globals it
    reads; on the workers it would then see the notebook's values of the moment it was
    sent, never the names the cell binds there (`step_size = 0.5; show()`), and its
    `global` statements would write into that copy. Here the function's globals are a
    reference to the namespace itself ("ns"), which the receiving side resolves to its
    own: the worker's namespace on a worker, the notebook's in the kernel. The names it
    reads are collected in `reads` (and sent as names of their own by the Shipper), and
    so are the notebook classes met on the way, which the receiving `__main__` must hold
    for pickling by reference (`torch.save(model)`) to find them.

    Likewise an object that is the value of another notebook name (`named`: id -> name),
    met inside the value pickled (a scheduler's optimizer), is a reference to that name
    ("name", ...), recorded in `refs`, unless it is pickled here by value (`inline`):
    on the workers `scheduler.optimizer is optimizer` holds as in the notebook.
    """

    namespace: dict | None = None

    def _init_namespace(self, namespace: dict | None, named: dict[int, str] | None = None,
                        inline: Collection[int] = frozenset()) -> None:
        self.namespace = namespace
        self.named = named or {}
        self.inline = inline
        self.reads: set[str] = set()
        self.refs: set[str] = set()

    def _dynamic_function_reduce(self, func):
        if self.namespace is None or func.__globals__ is not self.namespace:
            return super()._dynamic_function_reduce(func)
        code, _, _, _, closure = self._function_getnewargs(func)
        state, slotstate = _cloudpickle._function_getstate(func)
        slotstate["__globals__"] = {}  # never written over the receiving namespace's names
        self.reads |= global_names(code)
        # The namespace pickles as a persistent reference (see `_namespace_ref`).
        return (_cloudpickle._make_function, (code, func.__globals__, None, None, closure),
                (state, slotstate), None, None, _cloudpickle._function_setstate)

    def reducer_override(self, obj):
        # An object that read the process it was built in is rebuilt where it lands (libraries.py).
        if (rebuilt := libraries.reduce(obj)) is not None:
            return rebuilt
        if (self.namespace is not None and isinstance(obj, type) and obj.__module__ == "__main__"
                and self.namespace.get(obj.__qualname__) is obj):
            self.reads.add(obj.__qualname__)
        return super().reducer_override(obj)

    def _namespace_ref(self, obj):
        if self.namespace is not None and obj is self.namespace:
            return ("ns",)
        name = self.named.get(id(obj))
        if name is not None and id(obj) not in self.inline:
            self.refs.add(name)
            return ("name", name)
        return None


# --------------------------------------------------------------------------------------
# Kernel side
# --------------------------------------------------------------------------------------


@dataclass
class _Known:
    """A notebook tensor the workers hold, and the digest of the bytes they hold."""

    token: int
    ref: weakref.ref
    digest: bytes
    meta: tuple


@dataclass
class _NameState:
    """What the workers hold for one name: its structure, and its tensors' digests."""

    structure: bytes
    tensor_digests: dict[int, bytes]  # id(tensor) -> digest, for tensors not in the registry


@dataclass
class Plan:
    """The values a cell reads, each one's structure digest and tensors, hashed once."""

    values: dict[str, Any]
    structure: dict[str, bytes] = field(default_factory=dict)
    tensor_keys: dict[str, list[int]] = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)  # id -> (tensor, array, digest, meta)
    # Names reached only through notebook functions and classes, or held by other values
    # (not read by the cell itself).
    reached: list[str] = field(default_factory=list)
    # name -> the other names whose objects its value holds (a scheduler: its optimizer).
    refs: dict[str, set[str]] = field(default_factory=dict)
    # id -> name of the notebook's values that other values hold by reference, as planned.
    named: dict[int, str] = field(default_factory=dict)
    # Names the workers own whose notebook value cannot be pickled and is the same object as
    # when they took it: nothing to compare, nothing to send.
    unchanged_owned: set[str] = field(default_factory=set)


@dataclass
class Shipment:
    """What one cell sends: changed names, in-place tensor updates, and their frames."""

    # (name, count of out-of-band buffers): the names share one pickle stream (the first
    # frame), unpickled in this order, so that an object two of them hold stays one object.
    names: list[tuple[str, int]] = field(default_factory=list)
    updates: list[tuple[int, tuple]] = field(default_factory=list)  # (token, meta), one frame each
    frames: list = field(default_factory=list)
    tensor_frames: list[bool] = field(default_factory=list)  # per frame: a tensor's bytes?
    nbytes: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    forget: list[int] = field(default_factory=list)
    # Names the workers had bound themselves, replaced by a notebook value that changed since.
    replaced: list[str] = field(default_factory=list)
    # Names the notebook deleted since the workers took its value: deleted there too.
    deleted: list[str] = field(default_factory=list)


class _StructurePickler(_NamespaceFunctions, cloudpickle.Pickler):
    """Pickles for the structure digest: each tensor is (identity, dtype/shape), no bytes."""

    def __init__(self, file, tensors: dict, namespace: dict | None = None, named: dict | None = None,
                 root: Any = None):
        super().__init__(file, protocol=5, buffer_callback=self._hash_buffer)
        # Other names' values are references; the value's own object is not.
        self._init_namespace(namespace, named, {id(root)})
        self.tensors = tensors  # id -> (tensor, array, digest, meta), shared with _ShipPickler
        self.keys: dict[int, None] = {}  # ids in first-seen order (an ordered set)
        self.buffer_digests: list[bytes] = []

    def reducer_override(self, obj):
        # cloudpickle sends a file opened for reading as a copy of its contents: a handle
        # that silently becomes a StringIO on the workers is not what the cell meant.
        if isinstance(obj, io.IOBase) and not isinstance(obj, (io.BytesIO, io.StringIO)):
            raise TypeError("an open file handle belongs to the notebook's process; open the file "
                            "inside the cell")
        return super().reducer_override(obj)

    def _hash_buffer(self, buffer: pickle.PickleBuffer) -> None:  # numpy arrays and the like
        self.buffer_digests.append(xxhash.xxh3_128(buffer.raw()).digest())

    def persistent_id(self, obj):
        if not _shippable_tensor(obj):
            return self._namespace_ref(obj)
        found = self.tensors.get(id(obj))
        if found is None:
            array, meta = _tensor_bytes(obj)
            found = self.tensors[id(obj)] = (obj, array, _tensor_digest(obj, array), meta)
        self.keys.setdefault(id(obj))
        return ("t", id(obj), found[3])


def _frames(pickler_class, value: Any, *args) -> tuple[list, list[bool]]:
    """Pickle `value` to frames (stream, *out-of-band buffers), and which hold a tensor's bytes
    (a receiver copies those into its tensors; other buffers it must own as they are)."""
    buffers: list[pickle.PickleBuffer] = []
    file = io.BytesIO()
    pickler = pickler_class(file, *args, buffers)
    pickler.dump(value)
    tensor_buffers = {id(b) for b in pickler.tensor_buffers}
    return ([file.getvalue(), *(b.raw() for b in buffers)],
            [False, *(id(b) in tensor_buffers for b in buffers)])


class _ShipPickler(_NamespaceFunctions, cloudpickle.Pickler):
    """Pickles for the workers: each tensor becomes a reference to its token, and each
    object of a name that is not sent (the workers hold it) a reference to the name."""

    def __init__(self, file, shipper: Shipper, plan: Plan, sent: list[str], buffers: list):
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        # By value, but the object of a name the workers hold already (the notebook bound it
        # to another name too: `alias = items`), which is a reference to that name.
        held = [n for n in plan.values if n not in sent]
        named = dict(plan.named)
        named.update((id(plan.values[n]), n) for n in held if id(plan.values[n]) in plan.named)
        self._init_namespace(shipper.namespace, named,
                             {id(plan.values[n]) for n in sent if named.get(id(plan.values[n])) not in held})
        self.shipper = shipper
        self.tensors = plan.tensors
        self.tensor_buffers: list[pickle.PickleBuffer] = []

    def persistent_id(self, obj):
        if not _shippable_tensor(obj):
            return self._namespace_ref(obj)
        pid = self.shipper._reference(obj, self.tensors)
        if pid[0] != "ref":
            self.tensor_buffers.append(pid[3])
        return pid


class Shipper:
    """Kernel side: what the workers hold, and what a cell must send them.

    A name is sent again when its structure changed (anything but tensor bytes: a new
    object, an attribute, a shape) or when a tensor the registry does not track changed.
    A tracked tensor whose bytes changed is sent alone and updated in place, so objects
    holding it on the workers (an optimizer holding a model's parameters) keep working.
    A name whose value holds another name's object is sent again with that name, so that
    it holds the workers' new object. `plan` pickles and hashes; `prepare` builds the
    shipment; `commit` records it once every worker received it (a failed delivery is
    simply prepared again next time).
    """

    def __init__(self, namespace: dict | None = None,
                 eligible: Callable[[str], bool] = lambda name: not name.startswith("__")) -> None:
        # The notebook's namespace: its functions travel without their globals, which
        # are followed and sent as names (see _NamespaceFunctions); so do the names whose
        # objects other values hold. `eligible` says which of its names may travel.
        self.namespace = namespace
        self.eligible = eligible
        self._known: dict[int, _Known] = {}  # id(tensor) -> what the workers hold
        self._names: dict[str, _NameState] = {}
        # Names the workers bound themselves -> the notebook's value as it was then:
        # ("structure", digest), ("object", id) when it cannot be pickled, or ("absent",).
        self._owned: dict[str, tuple] = {}
        self._forgotten: list[int] = []
        self._tokens = itertools.count(1)
        self._pending_tensors: dict[int, _Known] = {}
        self._pending_names: dict[str, _NameState] = {}
        self._in_shipment: dict[int, int] = {}  # id -> token, within one prepare()
        self.next_back_token = -1  # tokens of tensors the workers send back count down from here

    def _named(self) -> dict[int, str]:
        """id -> name of the notebook's values that other values may hold (the first name
        of an object bound to several)."""
        named: dict[int, str] = {}
        namespace = self.namespace or {}
        for name, value in namespace.items():
            if self.eligible(name) and _shared_by_identity(value, namespace):
                named.setdefault(id(value), name)
        return named

    def _structure(self, value: Any, tensors: dict,
                   named: dict[int, str] | None = None) -> tuple[bytes, list[int], set[str], set[str]]:
        """The value's structure digest, its tensors' ids, the notebook names its functions
        and classes reach, and the names whose objects it holds (by reference)."""
        file = io.BytesIO()
        pickler = _StructurePickler(file, tensors, self.namespace, self._named() if named is None else named, value)
        with writewatch.watch().digest_pass():
            pickler.dump(value)
        h = xxhash.xxh3_128(file.getvalue())
        h.update(repr(id(value)).encode())  # a new object is a new value, even if equal
        for d in pickler.buffer_digests:
            h.update(d)
        return h.digest(), list(pickler.keys), pickler.reads, pickler.refs

    def plan(self, values: dict[str, Any]) -> Plan:
        """Pickle and hash every value, and every eligible notebook name that their
        notebook functions read, their notebook classes are bound to, or whose object
        they hold (transitively): a function the cell calls needs its globals on the
        workers, as a script's `main()` does, and a scheduler its optimizer. The first
        value that cannot be pickled is named."""
        plan = Plan({}, named=self._named())
        pending: list[tuple[str, Any, str | None]] = [(name, value, None) for name, value in values.items()]
        queued = set(values)
        while pending:
            name, value, via = pending.pop(0)
            plan.values[name] = value
            if via is not None:
                plan.reached.append(name)
            if self._owned.get(name) == ("object", id(value)):
                plan.unchanged_owned.add(name)  # the workers' own; this one cannot be sent anyway
                continue
            try:
                plan.structure[name], plan.tensor_keys[name], reads, plan.refs[name] = self._structure(
                    value, plan.tensors, plan.named)
            except Exception as exc:  # pickling raises many types: TypeError, PicklingError, ...
                raise ShippingError(name, value, exc, via) from exc
            for read in sorted((reads | plan.refs[name]) - queued):
                if self.namespace is not None and read in self.namespace and self.eligible(read):
                    queued.add(read)
                    pending.append((read, self.namespace[read], name))
        return plan

    def workers_rebound(self, names: Iterable[str], plan: Plan) -> None:
        """A cell bound (or deleted) `names` on the workers: their values there are the
        workers' own until the notebook rebinds or changes its value (last writer wins)."""
        named = self._named()
        for name in names:
            if self.namespace is None or name not in self.namespace:
                self._owned[name] = ("absent",)
                continue
            value = self.namespace[name]
            if plan.values.get(name) is value and name in plan.structure:
                self._owned[name] = ("structure", plan.structure[name])
                continue
            try:
                self._owned[name] = ("structure", self._structure(value, {}, named)[0])
            except Exception:  # cannot be pickled: at least notice when it is rebound
                self._owned[name] = ("object", id(value))

    def workers_own(self) -> set[str]:
        """Names a distributed cell bound on the workers (see workers_rebound)."""
        return set(self._owned)

    def _owned_unchanged(self, name: str, plan: Plan) -> bool:
        """Whether the workers own `name` and the notebook's value is as it was then.

        Only the structure counts: tensor bytes travel on their own, in place (the
        pull-back writes the notebook's tensors, which must not make an optimizer that
        holds them look rebound)."""
        owned = self._owned.get(name)
        if owned is None:
            return False
        if name in plan.unchanged_owned:
            return True
        return owned == ("structure", plan.structure[name])

    def _held_digest(self, key: int, obj: Any, state: _NameState | None) -> bytes | None:
        known = self._known.get(key)
        if known is not None and known.ref() is obj:
            return known.digest
        return state.tensor_digests.get(key) if state else None

    def _unchanged(self, name: str, plan: Plan) -> bool:
        """Whether the workers hold `name` as the notebook has it (bar tracked tensors' bytes)."""
        state = self._names.get(name)
        if state is None or state.structure != plan.structure[name]:
            return False
        return not any(
            key not in self._known
            and self._held_digest(key, plan.tensors[key][0], state) != plan.tensors[key][2]
            for key in plan.tensor_keys[name]
        )

    def prepare(self, plan: Plan) -> Shipment:
        shipment = Shipment(forget=list(self._forgotten), deleted=self._deleted())
        self._pending_tensors, self._pending_names, self._in_shipment = {}, {}, {}
        sent: list[str] = []
        kept: list[str] = []  # held by the workers as the notebook has it
        for name in plan.values:
            if name in self._owned:
                if self._owned_unchanged(name, plan):  # the workers' value stands
                    shipment.skipped.append(name)
                    continue
                shipment.replaced.append(name)  # the notebook wrote it last: sent whole
                sent.append(name)
            elif self._unchanged(name, plan):
                kept.append(name)
            else:
                sent.append(name)
        # A kept value that holds a sent name's object would keep holding the workers'
        # old one: it goes again, and shares the new one through the pickle's memo.
        grown = True
        while grown:
            grown = False
            for name in kept:
                if plan.refs.get(name, set()) & set(sent):
                    kept.remove(name)
                    sent.append(name)
                    grown = True
                    break
        shipment.skipped.extend(kept)
        sent.sort(key=list(plan.values).index)
        if sent:
            self._pickle(plan, sent, shipment)
        for name in shipment.skipped:  # tracked tensors travel alone, updated in place
            for key in plan.tensor_keys.get(name, ()):
                obj, array, digest, meta = plan.tensors[key]
                known = self._known.get(key)
                if key in self._in_shipment or known is None or known.ref() is not obj or known.digest == digest:
                    continue
                self._in_shipment[key] = known.token
                self._pending_tensors[key] = _Known(known.token, known.ref, digest, meta)
                shipment.updates.append((known.token, meta))
                shipment.frames.append(memoryview(array))
                shipment.tensor_frames.append(True)
                shipment.nbytes[name] = shipment.nbytes.get(name, 0) + array.nbytes
        return shipment

    def _deleted(self) -> list[str]:
        """Names the workers hold as the notebook's value (or took over from it) that the
        notebook has deleted since: a name only the workers ever had stays theirs."""
        if self.namespace is None:  # values given one by one, not a namespace's
            return []
        held = [*self._names, *(n for n, owned in self._owned.items() if owned != ("absent",))]
        return sorted({n for n in held if n not in self.namespace})

    def _pickle(self, plan: Plan, sent: list[str], shipment: Shipment) -> None:
        """The sent names, one after another into one stream, with one memo."""
        buffers: list[pickle.PickleBuffer] = []
        file = io.BytesIO()
        pickler = _ShipPickler(file, self, plan, sent, buffers)
        for name in sent:
            start, first = file.tell(), len(buffers)
            try:
                pickler.dump(plan.values[name])
            except Exception as exc:  # the plan pickled it already; be safe all the same
                raise ShippingError(name, plan.values[name], exc) from exc
            shipment.names.append((name, len(buffers) - first))
            shipment.nbytes[name] = file.tell() - start + sum(b.raw().nbytes for b in buffers[first:])
            self._pending_names[name] = _NameState(plan.structure[name], {})
        tensor_buffers = {id(b) for b in pickler.tensor_buffers}
        shipment.frames[:0] = [file.getvalue(), *(b.raw() for b in buffers)]
        shipment.tensor_frames[:0] = [False, *(id(b) in tensor_buffers for b in buffers)]

    def _reference(self, obj: torch.Tensor, tensors: dict):
        key = id(obj)
        if key in self._in_shipment:  # second sighting in this cell: already on its way
            return ("ref", self._in_shipment[key])
        _, array, digest, meta = tensors[key]  # filled by the plan
        known = self._known.get(key)
        if known is not None and known.ref() is obj:
            self._in_shipment[key] = known.token
            if known.digest == digest and known.meta == meta:
                return ("ref", known.token)
            self._pending_tensors[key] = _Known(known.token, known.ref, digest, meta)
            return ("update", known.token, meta, pickle.PickleBuffer(array))
        token = next(self._tokens)
        self._in_shipment[key] = token
        self._pending_tensors[key] = _Known(token, weakref.ref(obj), digest, meta)
        return ("new", token, meta, pickle.PickleBuffer(array))

    def commit(self, shipment: Shipment) -> None:
        """Every worker received `shipment`."""
        for key, known in self._pending_tensors.items():
            obj = known.ref()
            if obj is None:
                continue
            if key not in self._known:
                # When the notebook's tensor goes away, the workers may drop theirs.
                weakref.finalize(obj, self._forget, key, known.token)
            self._known[key] = known
        self._names.update(self._pending_names)
        for name in self._pending_names:  # the notebook's value is what the workers hold
            self._owned.pop(name, None)
        forgotten = set(shipment.forget)
        self._forgotten = [t for t in self._forgotten if t not in forgotten]
        for name in shipment.deleted:
            self.forget_name(name)
        self.discard()

    def discard(self) -> None:
        """A shipment did not reach every worker: it is prepared again next time."""
        self._pending_tensors, self._pending_names, self._in_shipment = {}, {}, {}

    def mark_synced(self, name: str, value: Any, hashed: Iterable[tuple[torch.Tensor, bytes]] = (),
                    planned: Plan | None = None) -> None:
        """The workers hold what the notebook's `value` holds now (after a pull-back).
        `hashed`: the notebook's tensors whose bytes rank 0 hashed as it sent them, with
        their digests; they are not hashed again. `planned`: the cell's plan, when `value`
        is a module whose state dict was loaded: see _planned_structure_stands."""
        tensors: dict = {id(obj): (obj, None, digest, _tensor_meta(obj)) for obj, digest in hashed}
        if planned is not None and self._planned_structure_stands(name, value, tensors, planned):
            # Skipping this pickle is what makes an unchanged model's pull-back cheap. Were
            # a load hook to change anything else, the next plan's structure differs from
            # this one: the value is sent again, never taken as the workers' by mistake.
            structure, keys = planned.structure[name], planned.tensor_keys[name]
            tensors = {key: tensors.get(key) or planned.tensors[key] for key in keys}
        else:
            structure, keys, _, _ = self._structure(value, tensors)
        self._owned.pop(name, None)
        untracked = {}
        for key in keys:
            obj, _, digest, meta = tensors[key]
            known = self._known.get(key)
            if known is not None and known.ref() is obj:
                known.digest, known.meta = digest, meta
            else:
                untracked[key] = digest
        self._names[name] = _NameState(structure, untracked)

    @staticmethod
    def _planned_structure_stands(name: str, value: torch.nn.Module, tensors: dict, planned: Plan) -> bool:
        """Whether loading a state dict into the module `value` left its structure as
        planned: every entry of it is a tensor whose bytes travel apart from the structure
        (`tensors`: those rank 0 digested), the same object the plan saw, of the same
        dtype and shape. An extra state or a tensor subclass is part of the structure."""
        if planned.values.get(name) is not value or name not in planned.structure:
            return False
        state = value.state_dict(keep_vars=True)
        return all(
            id(obj) in tensors and _shippable_tensor(obj) and (found := planned.tensors.get(id(obj))) is not None
            and found[0] is obj and found[3] == tensors[id(obj)][3] for obj in state.values())

    def took_back(self, tensors: dict[int, torch.Tensor], count: int) -> None:
        """The notebook took these tensors (token -> tensor) from rank 0's answer, which gave
        `count` tokens: the workers hold them by those tokens (their digests come with
        mark_synced); a token given to a tensor the notebook did not take is forgotten."""
        for token, tensor in tensors.items():
            self._known[id(tensor)] = _Known(token, weakref.ref(tensor), b"", _tensor_meta(tensor))
            weakref.finalize(tensor, self._forget, id(tensor), token)
        self._forgotten.extend(t for t in range(self.next_back_token, self.next_back_token - count, -1)
                               if t not in tensors)
        self.next_back_token -= count

    def forget_name(self, name: str) -> None:
        """`name` is gone from the notebook and from the workers."""
        self._names.pop(name, None)
        self._owned.pop(name, None)

    def held_tensors(self) -> dict[int, torch.Tensor]:
        """token -> the notebook's tensor, for every tensor the workers hold of the notebook's:
        a pull-back writes into these (see `loads`)."""
        held = {}
        for known in self._known.values():
            obj = known.ref()
            if obj is not None:
                held[known.token] = obj
        return held

    def _forget(self, key: int, token: int) -> None:
        known = self._known.get(key)
        if known is not None and known.token == token:
            del self._known[key]
            self._forgotten.append(token)


# --------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------


class _ReceiveUnpickler(pickle.Unpickler):
    def __init__(self, file, buffers, receiver: Receiver):
        super().__init__(file, buffers=buffers)
        self.receiver = receiver

    def persistent_load(self, pid):
        return self.receiver._resolve(pid)


def _copy_into(held: torch.Tensor, meta: tuple, buffer) -> bool:
    """Write new bytes straight into a held CPU tensor of the same layout (one memcpy)."""
    dtype_name, shape, requires_grad, _, _ = meta
    if (held.device.type != "cpu" or not held.is_contiguous() or tuple(held.shape) != tuple(shape)
            or str(held.dtype).removeprefix("torch.") != dtype_name or held.requires_grad != requires_grad):
        return False
    if held.numel():
        with torch.no_grad():
            held.detach().reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(buffer, np.uint8)
    return True


class Receiver:
    """Worker side: one tensor per token, for as long as the notebook holds its own."""

    def __init__(self, namespace: dict | None = None) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.device: torch.device | None = None
        # The worker's namespace: the globals of the notebook's functions received here.
        self.namespace = namespace if namespace is not None else {}

    def receive(self, request: Mapping[str, Any], frames: Sequence) -> dict:
        """Apply a Shipment: forget, unpickle the names, update tensors in place."""
        for token in request.get("forget", ()):
            self.tensors.pop(token, None)
        for name in request.get("deleted", ()):
            self.namespace.pop(name, None)
        values, at = {}, 0
        names = request.get("names", ())
        if names:  # one stream, one memo: an object two names hold stays one object
            at = 1 + sum(count for _, count in names)
            unpickler = _ReceiveUnpickler(io.BytesIO(frames[0]), list(frames[1:at]), self)
            for name, _ in names:
                values[name] = unpickler.load()
                _rewrap_scheduled_step(values[name])
        for token, meta in request.get("updates", ()):
            self._resolve(("update", token, meta, frames[at]))
            at += 1
        return values

    def replace(self, replaced: dict[int, torch.Tensor]) -> None:
        """Tensors received here were replaced (sharded: `replaced` maps the id of each old
        one to its new one): the tokens stand for the new ones, and the old, whole ones are
        freed. The notebook's later in-place changes are written into the new ones."""
        for token, tensor in self.tensors.items():
            if id(tensor) in replaced:
                self.tensors[token] = replaced[id(tensor)]

    def _resolve(self, pid):
        if pid[0] == "ns":
            return self.namespace
        if pid[0] == "name":  # a value this worker holds already: the same object
            try:
                return self.namespace[pid[1]]
            except KeyError:
                raise RuntimeError(f"this worker no longer holds {pid[1]!r}, which a value sent refers to; "
                                   "%scale restart starts afresh") from None
        kind, token = pid[0], pid[1]
        if kind == "ref":
            try:
                return self.tensors[token]
            except KeyError:
                raise RuntimeError("this worker does not hold a tensor the notebook's value shares with it (the "
                                   "ranks' values differ); %scale restart starts afresh") from None
        meta, buffer = pid[2], pid[3]
        held = self.tensors.get(token) if kind == "update" else None
        if held is not None:
            return _write_into(held, meta, buffer)
        fresh = self.tensors[token] = _build_tensor(meta, buffer, self.device)
        return fresh


def _rewrap_scheduled_step(value: Any) -> None:
    """Give a received LR scheduler's optimizer back the `step` wrapper torch's scheduler put
    on it when it was made. The wrapper is an attribute of the optimizer's instance, which
    its pickle leaves out; without it every rank would warn at the scheduler's first step
    that `optimizer.step()` was overridden, which the notebook's cell does not."""
    from torch.optim.lr_scheduler import LRScheduler

    if not isinstance(value, LRScheduler) or hasattr(value.optimizer.step, "_wrapped_by_lr_sched"):
        return
    optimizer = weakref.ref(value.optimizer)
    step = type(value.optimizer).step

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        held = optimizer()
        held._opt_called = True  # what the scheduler checks at its first step
        return step(held, *args, **kwargs)

    # As torch's LRScheduler marks and sets it: an attribute on the function, the instance's own step.
    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    value.optimizer.step = wrapper  # type: ignore[method-assign]


def _write_into(held: torch.Tensor, meta: tuple, buffer) -> torch.Tensor:
    """`held` with the bytes of `buffer`: the same object, so everything holding it sees them."""
    if type(held).__name__ == "DTensor":  # sharded since it was received: this rank's part of the new value
        from torch.distributed.tensor import DTensor, distribute_tensor

        sharded = cast(DTensor, held)  # its type's name says so
        whole = _build_tensor(meta, buffer, held.device)
        if tuple(whole.shape) != tuple(held.shape):
            raise RuntimeError(f"a sharded tensor of shape {tuple(held.shape)} cannot take a new value of shape "
                               f"{tuple(whole.shape)}; %scale restart starts afresh")
        with torch.no_grad():
            sharded.to_local().copy_(distribute_tensor(whole.detach(), sharded.device_mesh, sharded.placements,
                                                       src_data_rank=None).to_local())
        return held
    writewatch.will_write(held)
    if _copy_into(held, meta, buffer):
        return held
    fresh = _build_tensor(meta, buffer, held.device)
    with torch.no_grad():
        if held.shape == fresh.shape and held.dtype == fresh.dtype:
            held.copy_(fresh)
        else:
            held.data = fresh.data.to(held.device)
    if held.is_leaf:
        held.requires_grad_(fresh.requires_grad)
    return held


# --------------------------------------------------------------------------------------
# By value, both ways (pull-back, gather): tensors as out-of-band buffers
# --------------------------------------------------------------------------------------


class _ValuePickler(_NamespaceFunctions, cloudpickle.Pickler):
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
        if not _shippable_tensor(obj):
            return self._namespace_ref(obj)
        token = self.held.get(id(obj))
        if token is not None and id(obj) in self.same:
            return ("same", _tensor_meta(obj), token)
        if token is None and self.back is not None and (token := self.back.given.get(id(obj))) is not None:
            return ("backref", token)  # met before in this stream: the same tensor
        array, meta = self.arrays.get(id(obj)) or _tensor_bytes(obj)
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
            tensor = self.back[pid[3]] = _build_tensor(pid[1], pid[2], None, self.copy)
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
        return _build_tensor(pid[1], pid[2], None, self.copy)

    def apply_writes(self) -> None:
        for tensor, meta, buffer in self.writes:
            if buffer is not None:
                _write_into(tensor, meta, buffer)
            elif tensor.is_leaf and tensor.requires_grad != meta[2]:
                tensor.requires_grad_(meta[2])


def dumps(value: Any, namespace: dict | None = None, held: dict[int, int] | None = None,
          arrays: dict[int, tuple] | None = None) -> tuple[list, list[bool]]:
    """Frames (stream, *buffers) of `value`, tensors by value, out of band; and which
    frames hold a tensor's bytes. Functions whose globals are `namespace` (the worker's)
    travel without them and resolve them in the namespace `loads` is given. A tensor in
    `held` (id -> token: one the notebook sent) is marked with its token. `arrays` (id ->
    its bytes and meta) are tensors' bytes made already, e.g. to hash them."""
    return _frames(_ValuePickler, value, namespace, held, arrays)


def state_digests(module: torch.nn.Module, tensors: dict) -> dict[str, tuple]:
    """key -> (digest, dtype, shape) of the module's state dict entries whose tensors a
    plan hashed (`Plan.tensors`): what the notebook holds, for rank 0 to compare with."""
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
            if not _shippable_tensor(tensor):
                continue
            array, meta = arrays[id(tensor)] = _tensor_bytes(tensor)
            where = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            digest = digests[key] = by_storage.get(where) or by_storage.setdefault(where, _tensor_digest(tensor, array))
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
