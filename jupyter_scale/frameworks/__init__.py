"""What a cell's process group is: torch's (the default, with automatic mode), or the group
of TensorFlow, PaddlePaddle or Horovod, set up on the workers as that framework's own
launcher would set it up.

Everything else a cell goes through (shipping, output, metrics, interrupts, failures) is
the same for every framework. torch's group is always formed (it carries the abort and
the exchanges below); another framework's group is formed on the workers from it, once,
the first time a cell of that framework runs, and reused by the next cells (see `worker`).

Kernel side: `choose` (the cell's framework) and `is_model`. Worker side: `form` and, one
module each, imported only where that framework runs: `tensorflow`, `paddle`, `horovod`.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
import types
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, cast

from .. import rendezvous

FRAMEWORKS = ("torch", "tensorflow", "paddle", "horovod")
# A module's top-level package, and the framework whose training it means.
_PACKAGES = {"torch": "torch", "tensorflow": "tensorflow", "keras": "tensorflow", "tf_keras": "tensorflow",
             "paddle": "paddle", "horovod": "horovod"}


class FrameworkError(ValueError):
    """The cell's framework cannot be told, or its group cannot be formed on this worker."""


def choose(code: str, namespace: dict, free: list[str], named: str | None = None,
           held: Collection[str] = ()) -> str:
    """The cell's framework: `named` (--framework) if given, else the one the cell uses.

    Used means imported by the cell, or read from the notebook: a module (`tf`), or a
    value, class or function that one defines (a Keras model); `held`: the frameworks of
    the cells that bound the workers' own names the cell reads. Horovod runs over another
    framework, so it wins; otherwise torch is the default, and a cell that uses two of
    them (a TensorFlow model fed torch tensors) must name one.
    """
    if named is not None:
        if named not in FRAMEWORKS:
            raise FrameworkError(f"unknown framework {named!r} (one of {', '.join(FRAMEWORKS)})")
        return named
    frameworks = (_framework_of(namespace[n]) for n in free if n in namespace)
    used = _imported(code) | {f for f in frameworks if f is not None} | set(held)
    if "horovod" in used:
        return "horovod"
    others = sorted(used - {"torch"})
    if not others:
        return "torch"
    if len(others) == 1 and "torch" not in used:
        return others[0]
    raise FrameworkError(f"the cell uses {' and '.join(sorted(used))}: name the one that trains with "
                         "%%distribute --framework")


def _imported(code: str) -> set:
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {_package_framework(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(_package_framework(node.module))
    return found - {None}


def _package_framework(module: str) -> str | None:
    package = module.split(".")[0]
    if package == "keras":  # Keras 3 runs on the backend its users choose
        backend = os.environ.get("KERAS_BACKEND", "tensorflow")
        return backend if backend in ("tensorflow", "torch") else None
    return _PACKAGES.get(package)


def _framework_of(value: Any) -> str | None:
    if isinstance(value, types.ModuleType):
        return _package_framework(value.__name__)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return _package_framework(value.__module__ or "")
    # A value or a class: the first framework in its class's ancestry (a notebook class
    # of `__main__` subclasses keras.Model or paddle.nn.Layer).
    for cls in (value if isinstance(value, type) else type(value)).__mro__:
        if (framework := _package_framework(cls.__module__)) is not None:
            return framework
    return None


def is_model(value: Any) -> str | None:
    """The framework of a model whose weights come back from rank 0 after a cell (a torch
    nn.Module, a Keras model, a Paddle Layer), else None. Only frameworks already imported
    are looked at: nothing is imported for the asking."""
    import torch

    if isinstance(value, torch.nn.Module):
        return "torch"
    keras = [sys.modules[m] for m in ("keras", "tf_keras") if m in sys.modules]
    if any(isinstance(value, getattr(k, "Model", ())) for k in keras):
        return "tensorflow"
    paddle_nn = sys.modules.get("paddle.nn")
    if paddle_nn is not None and isinstance(value, paddle_nn.Layer):
        return "paddle"
    return None


# --------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Place:
    """Where a rank is, as the framework's launcher would tell it (from torch's group)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    nodes: int
    address: str  # this rank's address that the others reach (127.0.0.1 on one host)
    device: Any  # torch.device: cpu, or the rank's GPU


class Group(Protocol):
    """A worker-side framework module (`tensorflow`, `paddle`, `horovod`). `weights` is for
    models of the framework's own (not Horovod's: it trains torch models)."""

    def form(self, place: Place, gather: Callable[[Any], list]) -> set[int]: ...
    def receiving(self) -> AbstractContextManager: ...
    def abort(self) -> None: ...
    def weights(self, model: Any) -> Any: ...


_formed: dict[str, tuple[Group, Place]] = {}  # this process's framework groups, formed once each


def form(name: str, place: Place, gather: Callable[[Any], list]) -> tuple[Group, set[int]]:
    """The framework's group in this worker: formed the first time (every rank at once;
    `gather` exchanges JSON data over torch's group), then reused. Returns it, and the
    sockets it opened that an abort cuts (see rendezvous.abort_group)."""
    if name in _formed:
        group, formed_at = _formed[name]
        if formed_at != place:  # the cluster's layout changed: its ranks, or rank 0's address
            raise FrameworkError(f"this worker formed its {name} group as rank {formed_at.rank} of "
                                 f"{formed_at.world_size} and cannot form another: %scale restart")
        return group, set()
    group = cast(Group, importlib.import_module(f"{__name__}.{name}"))
    sockets = group.form(place, gather)
    _formed[name] = (group, place)
    return group, sockets


def formed(name: str) -> Group | None:
    found = _formed.get(name)
    return found[0] if found else None


def connections_between_ranks(opened: set[int], gather: Callable[[Any], list], except_port: int | None = None
                              ) -> set[int]:
    """Of the TCP connections `opened` (socket inodes) while a framework formed its group,
    those between ranks: whose far end another rank opened too (not a server's, nor the
    engine's own), and neither end on `except_port`. An abort cuts them."""
    endpoints = {inode: ends for inode, ends in rendezvous.tcp_endpoints(opened).items() if ends[1] is not None}
    mine = [list(local) for local, _ in endpoints.values()]
    theirs = {tuple(local) for ends in gather(mine) for local in ends} - {tuple(e) for e in mine}
    return {inode for inode, (local, remote) in endpoints.items()
            if tuple(remote) in theirs and except_port not in (local[1], remote[1])}


def abort_all() -> None:
    """Free this rank from every framework's collective it is blocked in (from any thread)."""
    for group, _ in list(_formed.values()):
        try:
            group.abort()
        except Exception:  # aborting is best effort: the kernel's deadline follows
            pass
