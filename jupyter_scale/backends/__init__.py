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
from .base import (CONNECT_TIMEOUT_S, OUTPUT_GRACE_S, Backend, Job, Output, describe_exit, descendants,
                   end_processes, engine_errors)

__all__ = ["CONNECT_TIMEOUT_S", "OUTPUT_GRACE_S", "Backend", "Job", "Output", "WorkerCallFailed", "WorkerLost",
           "available_backends", "create_backend", "describe_exit", "descendants", "end_processes",
           "engine_errors"]

ENTRY_POINT_GROUP = "jupyter_scale.backends"


def available_backends() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def create_backend(name: str, **options: Any) -> Backend:
    found = available_backends()
    if name not in found:
        known = ", ".join(sorted(found)) or "none installed"
        raise ClusterError(f"unknown backend {name!r} (available: {known})")
    try:
        backend_class = found[name].load()
    except ImportError as exc:  # the engine's own package is missing
        raise ClusterError(f"the {name} backend needs {exc.name or 'a package'} installed "
                           f"(pip install 'jupyter_scale[{name}]'): {exc}") from exc
    return backend_class(**options)
