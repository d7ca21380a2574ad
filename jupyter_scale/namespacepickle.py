"""Pickling the notebook's own functions and classes by value, as living in a namespace.

cloudpickle pickles a function or class defined in `__main__` by value. Ours keep living in
a namespace, not in a copy of it: a notebook function lands on the workers with the
worker's namespace as its globals, so it reads and writes the names there at call time,
as it does in the kernel. And an object that is the value of another notebook name, met
inside the value pickled, stays that name's object where it lands. Every pickler of the
notebook's values (shipping, byvalue) mixes in `NamespacePickler`.
"""

from __future__ import annotations

import enum
from collections import ChainMap
from collections.abc import Collection
from types import CodeType, FunctionType, ModuleType
from typing import Any

import cloudpickle.cloudpickle as _cloudpickle
import torch

from . import libraries
from .cellnames import global_names

_NO_IDENTITY = (int, float, complex, str, bytes, bool, type(None), tuple, frozenset, range, slice,
                type, ModuleType, enum.Enum, torch.dtype, torch.device, torch.Tensor)


def shared_by_identity(value: Any, namespace: dict) -> bool:
    """Whether another value holding `value` must hold the very same object on the workers:
    an optimizer that a scheduler steps, a model that a trainer wraps, a list a function
    appends to, a notebook function kept in a list of callbacks."""
    if isinstance(value, _NO_IDENTITY):
        return False
    if callable(value) and not isinstance(value, FunctionType) and type(value).__module__ == "builtins":
        return False  # builtins and their bound methods travel by reference
    return not isinstance(value, FunctionType) or value.__globals__ is namespace


def _code_keeping_its_file(code: CodeType) -> tuple:
    """cloudpickle names every code object's file "<dynamic-code>": the notebook cell's own name
    stays, so the workers' tracebacks and debuggers show its lines (the cell's request carries
    them: see cellrequest.notebook_sources)."""
    constructor, args = _cloudpickle._code_reduce(code)
    return constructor, tuple(code.co_filename if arg == "<dynamic-code>" else arg for arg in args)


class NamespacePickler:
    """A cloudpickle pickler mixin: values that live in the namespace stay the namespace's.

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
    dispatch_table = ChainMap({CodeType: _code_keeping_its_file}, _cloudpickle.Pickler.dispatch_table)

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
