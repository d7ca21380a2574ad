"""Which notebook names a cell needs, and how their values travel.

Values are pickled by value with cloudpickle (so classes and functions defined in the
notebook travel too), with pickle protocol 5: the bytes of CPU tensors and numpy arrays
leave the pickle stream as out-of-band buffers, which the engines send as separate
frames without copying them into the stream.

A `Payload` is the in-band pickle plus its buffers; `Fingerprint` decides whether a value
changed since it was last sent, cheaply: tensors are compared by identity, storage
pointer and torch's in-place version counter, everything else by a hash of its bytes.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import io
import pickle
from dataclasses import dataclass, field
from typing import Any, Iterable

import cloudpickle
import torch

from .errors import ShippingError

# --------------------------------------------------------------------------------------
# Free-name analysis
# --------------------------------------------------------------------------------------

_BUILTINS = frozenset(dir(builtins))


class _FreeNames(ast.NodeVisitor):
    """Collect the names a cell reads before it binds them itself.

    Top-level statements are walked in evaluation order (the value of an assignment
    before its targets, a loop's iterable before its target). A name counts as bound only
    when straight-line code assigned it; assignments inside `if`/`for`/`while`/`try` may
    not run, so a later read still takes the notebook's value when there is one. Reads
    inside functions, lambdas, classes and comprehensions defined in the cell are global
    reads at call time: free unless the cell binds that name at top level somewhere.
    """

    def __init__(self) -> None:
        self.free: list[str] = []  # ordered, for stable error messages
        self.bound: set[str] = set()
        self.top_level_stores: set[str] = set()
        self.deferred_reads: list[str] = []
        self._conditional = 0

    # -- helpers -------------------------------------------------------------------
    def _read(self, name: str) -> None:
        if name not in self.bound and name not in self.free:
            self.free.append(name)

    def _store(self, name: str) -> None:
        self.top_level_stores.add(name)
        if not self._conditional:
            self.bound.add(name)

    def _conditional_block(self, nodes: Iterable[ast.AST]) -> None:
        self._conditional += 1
        for node in nodes:
            self.visit(node)
        self._conditional -= 1

    def _nested_scope(self, node: ast.AST, local_names: set[str]) -> None:
        inner = _ScopeReads(local_names)
        inner.visit_body(node)
        for name in inner.reads:
            self.deferred_reads.append(name)

    # -- names ---------------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self._read(node.id)
        elif isinstance(node.ctx, ast.Store):
            self._store(node.id)
        else:  # Del
            self._read(node.id)

    # -- statements in evaluation order --------------------------------------------
    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            self._read(node.target.id)
            self._store(node.target.id)
        else:
            self.visit(node.target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        # The loop variable is bound wherever the body reads it.
        self.visit(node.target)
        self._conditional_block([*node.body, *node.orelse])

    visit_AsyncFor = visit_For

    def visit_While(self, node: ast.While) -> None:
        self.visit(node.test)
        self._conditional_block([*node.body, *node.orelse])

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        self._conditional_block([*node.body, *node.orelse])

    def visit_Try(self, node: ast.Try) -> None:
        self._conditional_block([*node.body])
        for handler in node.handlers:
            if handler.type is not None:
                self.visit(handler.type)
            if handler.name:
                self._store(handler.name)  # bound in the handler, where it is read
            self._conditional += 1
            for stmt in handler.body:
                self.visit(stmt)
            self._conditional -= 1
        self._conditional_block([*node.orelse])
        for stmt in node.finalbody:
            self.visit(stmt)

    visit_TryStar = visit_Try

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._store((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name != "*":
                self._store(alias.asname or alias.name)

    # -- nested scopes ---------------------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for expr in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)
        self._nested_scope(node, _argument_names(node.args))
        self._store(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for expr in [*node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)
        self._nested_scope(node, _argument_names(node.args))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)
        self._nested_scope(node, set())
        self._store(node.name)

    def _visit_comprehension(self, node: ast.AST) -> None:
        # The first iterable is evaluated in the enclosing scope; the rest is nested.
        generators = node.generators  # type: ignore[attr-defined]
        self.visit(generators[0].iter)
        self._nested_scope(node, set())

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _visit_comprehension


class _ScopeReads(ast.NodeVisitor):
    """Reads of a nested scope that are not local to it (so global at run time)."""

    def __init__(self, local_names: set[str]) -> None:
        self.local_names = set(local_names)
        self.global_decls: set[str] = set()
        self.loads: list[str] = []

    def visit_body(self, node: ast.AST) -> None:
        if isinstance(node, ast.Lambda):
            self.visit(node.body)
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            self._comprehension(node.generators, [node.elt])
        elif isinstance(node, ast.DictComp):
            self._comprehension(node.generators, [node.key, node.value])
        else:
            for stmt in node.body:  # type: ignore[attr-defined]
                self.visit(stmt)

    def _comprehension(self, generators, elements) -> None:
        for i, gen in enumerate(generators):
            if i:
                self.visit(gen.iter)
            self.visit(gen.target)
            for cond in gen.ifs:
                self.visit(cond)
        for elt in elements:
            self.visit(elt)

    @property
    def reads(self) -> list[str]:
        return [n for n in self.loads if n not in self.local_names or n in self.global_decls]

    def visit_Global(self, node: ast.Global) -> None:
        self.global_decls.update(node.names)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.loads.append(node.id)
        else:
            self.local_names.add(node.id)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.local_names.add(node.name)
        for expr in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)
        inner = _ScopeReads(_argument_names(node.args))
        inner.visit_body(node)
        self.loads.extend(inner.reads)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.local_names.add(node.name)
        for expr in [*node.decorator_list, *node.bases]:
            self.visit(expr)
        inner = _ScopeReads(set())
        inner.visit_body(node)
        self.loads.extend(inner.reads)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        inner = _ScopeReads(_argument_names(node.args))
        inner.visit_body(node)
        self.loads.extend(inner.reads)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.local_names.add((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            self.local_names.add(alias.asname or alias.name)


def _argument_names(args: ast.arguments) -> set[str]:
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    if args.vararg:
        names.add(args.vararg.arg)
    if args.kwarg:
        names.add(args.kwarg.arg)
    return names


def free_names(source: str) -> list[str]:
    """Names `source` reads that it does not bind first, in order of first read.

    Builtins are left out unless the cell could only mean a notebook value (the caller
    intersects with the notebook namespace, which shadows builtins the same way).
    """
    tree = ast.parse(source)
    visitor = _FreeNames()
    for stmt in tree.body:
        visitor.visit(stmt)
    names = list(visitor.free)
    for name in visitor.deferred_reads:
        if name not in visitor.top_level_stores and name not in names:
            names.append(name)
    return names


# --------------------------------------------------------------------------------------
# Serialization by value with out-of-band tensor buffers
# --------------------------------------------------------------------------------------


def _rebuild_tensor(buffer, dtype, shape, stride, offset, requires_grad):
    # The received frame may be read-only and owned by the transport: copy it into
    # memory the tensor owns (one memcpy per worker).
    raw = torch.frombuffer(bytearray(buffer), dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    flat = raw.view(dtype) if raw.numel() else torch.empty(0, dtype=dtype)
    tensor = torch.as_strided(flat, shape, stride, offset)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _rebuild_parameter(tensor_args, requires_grad):
    return torch.nn.Parameter(_rebuild_tensor(*tensor_args[:5], False), requires_grad=requires_grad)


def _plain_cpu_tensor(obj: Any) -> bool:
    return (
        type(obj) is torch.Tensor
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.is_quantized
        and not obj.is_neg()
        and not obj.is_conj()
        and obj.grad_fn is None  # non-leaf tensors pickle as their data, as torch does
    )


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with plain CPU tensors sent as out-of-band buffers of their storage."""

    def __init__(self, file, buffer_callback):
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self.tensor_keys: list[tuple] = []

    def reducer_override(self, obj):
        if _plain_cpu_tensor(obj):
            return self._reduce_tensor(obj)
        if type(obj) is torch.nn.Parameter and _plain_cpu_tensor(obj.detach()):
            # Parameter's own reduce goes through `.data`, whose version counter is not
            # the parameter's: in-place updates would go unnoticed by `fingerprint`.
            rebuild, args = self._reduce_tensor(obj)
            return _rebuild_parameter, (args, obj.requires_grad)
        return super().reducer_override(obj)

    def _reduce_tensor(self, tensor: torch.Tensor):
        data = tensor.detach()
        whole_storage = (
            data.is_contiguous()
            and data.storage_offset() == 0
            and data.numel() * data.element_size() == data.untyped_storage().nbytes()
        )
        if not whole_storage:
            # A view into a larger storage: send just its elements, not the whole storage.
            data = data.contiguous().clone()
        flat = data.reshape(-1).view(torch.uint8) if data.numel() else None
        if flat is None:
            buffer = pickle.PickleBuffer(b"")
        else:
            array = flat.numpy()
            buffer = pickle.PickleBuffer(array)
            if whole_storage:
                # Identified by address + version instead of hashing the bytes.
                self.tensor_keys.append((array.ctypes.data, array.nbytes, tensor._version))
        return (
            _rebuild_tensor,
            (buffer, tensor.dtype, tuple(tensor.shape), tuple(data.stride()), 0, tensor.requires_grad),
        )


@dataclass
class Payload:
    """One pickled value: the in-band stream plus its out-of-band buffers."""

    stream: bytes
    buffers: list[memoryview]
    tensor_keys: list[tuple] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return len(self.stream) + sum(b.nbytes for b in self.buffers)

    def frames(self) -> list:
        return [self.stream, *self.buffers]


def dumps(value: Any) -> Payload:
    buffers: list[pickle.PickleBuffer] = []
    file = io.BytesIO()
    pickler = _Pickler(file, buffer_callback=buffers.append)
    pickler.dump(value)
    views = [b.raw() for b in buffers]
    return Payload(file.getvalue(), views, pickler.tensor_keys)


def loads(stream, buffers) -> Any:
    return pickle.loads(stream, buffers=list(buffers))


def dumps_named(values: dict[str, Any]) -> dict[str, Payload]:
    """Pickle each value on its own; the first failure names its variable."""
    out = {}
    for name, value in values.items():
        try:
            out[name] = dumps(value)
        except Exception as exc:  # pickling raises many types: TypeError, PicklingError, ...
            raise ShippingError(name, value, exc) from exc
    return out


# --------------------------------------------------------------------------------------
# Change detection
# --------------------------------------------------------------------------------------


def fingerprint(value: Any, payload: Payload) -> tuple:
    """A key that changes whenever the value a worker would receive changes.

    The in-band stream is hashed (it holds everything but tensor and array bytes).
    Tensor bytes are identified by storage pointer, size and torch's version counter,
    which every in-place op bumps, so a 100 MB weight is never hashed. Other out-of-band
    buffers (numpy arrays) are hashed. Writing to a tensor through a numpy view bypasses
    the version counter; that is the one change this misses (documented in the README).
    """
    digest = hashlib.blake2b(payload.stream, digest_size=16)
    tensor_bytes = {key[0] for key in payload.tensor_keys}
    for buffer in payload.buffers:
        address = _address(buffer)
        if address is not None and address in tensor_bytes:
            continue
        digest.update(buffer)
    return (id(value), digest.hexdigest(), tuple(payload.tensor_keys))


def _address(buffer: memoryview) -> int | None:
    try:
        import numpy as np

        return np.frombuffer(buffer, dtype=np.uint8).ctypes.data if buffer.nbytes else None
    except (ValueError, TypeError):
        return None
