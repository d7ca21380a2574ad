"""Cluster engines behind one small protocol.

A backend starts and stops workers, runs a function on each (rank order) and hands back
its results, the output each worker printed, and signals workers. It knows nothing of
torch: everything torch-related runs inside `jupyter_scale.worker` on the workers.

Engines are found through the ``jupyter_scale.backends`` entry-point group, so another
engine (Ray, plain MPI) is one new module plus one line in its package metadata.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from ..errors import ClusterError, WorkerCallFailed, WorkerLost
from .base import (
    CONNECT_TIMEOUT_S,
    OUTPUT_GRACE_S,
    Backend,
    Job,
    Output,
    descendants,
    describe_exit,
    end_processes,
    engine_errors,
)

__all__ = ["CONNECT_TIMEOUT_S", "OUTPUT_GRACE_S", "Backend", "Job", "Output", "WorkerCallFailed", "WorkerLost",
           "available_backends", "backend_class", "create_backend", "describe_exit", "descendants",
           "end_processes", "engine_errors", "find_connection"]

ENTRY_POINT_GROUP = "jupyter_scale.backends"


def available_backends() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_class(name: str) -> type[Backend]:
    found = available_backends()
    if name not in found:
        known = ", ".join(sorted(found)) or "none installed"
        raise ClusterError(f"unknown backend {name!r} (available: {known})")
    try:
        return found[name].load()
    except ImportError as exc:  # the engine's own package is missing
        raise ClusterError(f"the {name} backend needs {exc.name or 'a package'} installed "
                           f"(pip install 'jupyter_scale[{name}]'): {exc}") from exc


def create_backend(name: str, **options: Any) -> Backend:
    """An engine's backend; `parent=` a session makes it configurable through the session's config."""
    return backend_class(name)(**options)


def find_connection(address: str | None, backend: str | None = None, **options: Any) -> tuple[str, dict]:
    """Which engine `%scale connect` means, and the arguments of its `connect`: each engine
    is asked whether the address (and the options: profile, cluster_id, url_file, tls)
    names one of its clusters, the fallback engine last; `backend` asks that one only.
    Raises ValueError, saying what each engine takes, when none does. An engine whose
    package is missing is skipped (named, when it is the one asked)."""
    options = {k: v for k, v in options.items() if v}
    if backend is not None:
        options["named"] = True  # the engine was named: it may take a bare host:port
        try:
            classes = {backend: backend_class(backend)}
        except ClusterError as exc:
            raise ValueError(str(exc)) from None
    else:
        classes = {}
        for name in available_backends():
            try:
                classes[name] = backend_class(name)
            except Exception:  # a broken engine must not stop connecting to the others
                continue
    for name in sorted(classes, key=lambda n: (classes[n].fallback, n)):
        where = classes[name].parse_address(address, options)
        if where is not None:
            return name, where
    takes = "; or ".join(c.connect_help for _, c in sorted(classes.items()) if c.connect_help)
    if backend is not None:
        raise ValueError(f"{address or 'that'} does not name {'an' if backend[0] in 'aeiou' else 'a'} {backend} "
                         f"cluster: give {takes}")
    if address:
        raise ValueError(f"no installed engine connects to {address}: give {takes}")
    raise ValueError(f"connect to what? give {takes}")
