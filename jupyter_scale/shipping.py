"""How the notebook's values travel to the workers, kernel side (which names: see cellnames).

Values are pickled by value with cloudpickle (so classes and functions defined in the
notebook travel too, living in a namespace: see namespacepickle), with pickle protocol 5:
the bytes of tensors and numpy arrays leave the pickle stream as out-of-band buffers, which
the engines send as separate frames without copying them into the stream.

Kernel to workers (`Shipper` here, `receiving.Receiver` on the workers): every tensor is
sent as a persistent reference with an identity token. The workers keep one tensor per
token, so

- a tensor shared by several names (a model's parameters and the optimizer that holds
  them) stays one tensor on the workers, across names and across cells;
- a tensor whose bytes did not change is not sent again, only its token;
- a tensor that changed is updated in place on the workers (same object), so every
  worker object that holds it sees the new values.

Whether a name changed is decided by a content digest: its pickle (with each tensor
replaced by its identity and the xxh3 hash of its bytes) hashed again.

The globals that the notebook's functions read travel as names of their own (`Plan`
follows them, transitively), and so do the notebook classes of the values sent, so that
`__main__.Net` means the same class on the workers as in the notebook.

Objects the notebook's names share stay shared: the names a cell sends travel in one
pickle stream with one memo, and an object of another name met inside a value (a
scheduler's optimizer) is a reference to that name when the workers hold it already.

Last writer wins: a name that a distributed cell bound on the workers is theirs until
the notebook rebinds or changes it (`Shipper.workers_rebound`); only then is the
notebook's value sent over it, and the cell says so (`Shipment.replaced`).
"""

from __future__ import annotations

import io
import itertools
import pickle
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch
import xxhash

from . import tensorbytes, writewatch
from .errors import ShippingError
from .namespacepickle import NamespacePickler, shared_by_identity


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


class _StructurePickler(NamespacePickler, cloudpickle.Pickler):
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
        if not tensorbytes.shippable(obj):
            return self._namespace_ref(obj)
        found = self.tensors.get(id(obj))
        if found is None:
            array, meta = tensorbytes.tensor_bytes(obj)
            found = self.tensors[id(obj)] = (obj, array, tensorbytes.digest(obj, array), meta)
        self.keys.setdefault(id(obj))
        return ("t", id(obj), found[3])


class _ShipPickler(NamespacePickler, cloudpickle.Pickler):
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
        if not tensorbytes.shippable(obj):
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
        # are followed and sent as names (see NamespacePickler); so do the names whose
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
            if self.eligible(name) and shared_by_identity(value, namespace):
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
        tensors: dict = {id(obj): (obj, None, digest, tensorbytes.tensor_meta(obj)) for obj, digest in hashed}
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
            id(obj) in tensors and tensorbytes.shippable(obj) and (found := planned.tensors.get(id(obj))) is not None
            and found[0] is obj and found[3] == tensors[id(obj)][3] for obj in state.values())

    def took_back(self, tensors: dict[int, torch.Tensor], count: int) -> None:
        """The notebook took these tensors (token -> tensor) from rank 0's answer, which gave
        `count` tokens: the workers hold them by those tokens (their digests come with
        mark_synced); a token given to a tensor the notebook did not take is forgotten."""
        for token, tensor in tensors.items():
            self._known[id(tensor)] = _Known(token, weakref.ref(tensor), b"", tensorbytes.tensor_meta(tensor))
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
