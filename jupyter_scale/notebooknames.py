"""Which of the notebook's names a cell reads, and which of them may travel to the workers.

A cell reads the names it uses before it binds them (cellnames.free_names). Of those, the
notebook's travel, but for the names the workers set themselves before each cell
(worker.INJECTED_NAMES), dunders, and IPython's own (its history and output caches).
"""

from __future__ import annotations

from . import cellnames, worker
from .errors import DistributeError


def free_names(code: str) -> list[str]:
    """The names `code` reads before it binds them; DistributeError if it is not Python."""
    try:
        return cellnames.free_names(code)
    except SyntaxError as exc:
        raise DistributeError(f"the cell is not valid Python: {exc}") from None


def shippable(name: str) -> bool:
    """Not a name the workers set themselves, a dunder, or IPython's own."""
    return name not in worker.INJECTED_NAMES and not name.startswith("__") and not _is_ipython_internal(name)


def to_ship(namespace: dict, free: list[str]) -> list[str]:
    """Of the names a cell reads before it binds them (`free`), the notebook's that may travel."""
    return [n for n in free if n in namespace and shippable(n)]


def _is_ipython_internal(name: str) -> bool:
    # IPython's history and output caches (_, __, _i, _i3, _oh, In, Out, exit, ...)
    return name in {"_", "In", "Out", "exit", "quit", "get_ipython", "_oh", "_ih", "_dh"} or (
        name.startswith("_i") and (name[2:].isdigit() or name[2:] in {"", "i", "ii"})
    ) or (name.startswith("_") and name[1:].isdigit())
