"""What every rank gets to run a cell: the plan of what to send (`plan`), then the
`protocol.CellRequest` the session sends with `worker.run_cell`, put together from the cell,
its plan and shipment (shipping), what the kernel knows of its workers
(cellend.WorkerStanding) and the session's settings.
"""

from __future__ import annotations

import linecache
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from . import byvalue, cellnames, frameworks, notebooknames
from .cellend import WorkerStanding
from .errors import DistributeError
from .frameworks.rules import refuse_unsafe
from .protocol import CellRequest
from .records import RunRecord
from .settings import SessionSettings
from .shipping import Plan, Shipment


def plan(code: str, namespace: dict, standing: WorkerStanding, framework: str | None, shard: bool | dict,
         connected: bool, allow_unauthenticated: bool) -> tuple[str, list[str], Plan]:
    """The cell's framework, the notebook names it reads and the plan to send them.
    Pickles before any worker runs: an unpicklable value fails here, naming it."""
    free = notebooknames.free_names(code)
    names = notebooknames.to_ship(namespace, free)
    try:
        framework = frameworks.choose(code, namespace, names, framework, standing.frameworks.held(free, namespace))
    except frameworks.FrameworkError as exc:
        raise DistributeError(str(exc)) from None
    if framework != "torch":
        refuse_unsafe(framework, shard, connected, allow_unauthenticated)
    if framework == "paddle" and "paddle" in sys.modules:  # the notebook's Layers travel as Layers
        from .frameworks import paddle

        paddle.pickle_parameters()
    # The plan adds the names that the notebook functions the cell calls read.
    found = standing.shipper.plan({n: namespace[n] for n in names})
    return framework, list(found.values), found


def build(code: str, record: RunRecord, names: list[str], plan: Plan, shipment: Shipment, *, namespace: dict,
          standing: WorkerStanding, settings: SessionSettings, events: tuple[str, str, str], pull: list[str],
          manual: bool, shard: bool | dict, keep_sharded: bool, seed: int, shared_memory: bool,
          mailbox: dict | None) -> CellRequest:
    """The request of the cell `code` (run `record`), which reads the notebook's `names`.
    `events`: where the workers send its events, the key that signs them, and the run's id;
    `mailbox`: the group's store, through which the ranks' debuggers get their answers."""
    stores, deletes = cellnames.stored_names(code)
    # The notebook's models the cell uses, also through the notebook functions it calls.
    modules = [n for n in names if frameworks.is_model(namespace[n])]
    framework = record.framework
    address, key, run_id = events
    return {
        "names": shipment.names,
        "updates": shipment.updates,
        "forget": shipment.forget,
        "deleted": shipment.deleted,
        "stores": stores,
        "deletes": deletes,
        "code": code,
        "filename": f"<distribute-cell-{record.index}>",
        "modules": modules,
        # What the notebook holds of them: rank 0 sends back only the tensors that differ.
        "digests": {n: byvalue.state_digests(namespace[n], plan.tensors) for n in modules
                    if isinstance(namespace[n], torch.nn.Module)},
        "pull": pull,
        # Rank 0 sends back what the cell changed of these and what it bound (torch cells:
        # see statesync), the values it bound up to this size in all.
        "watch": names if framework == "torch" else None,
        "back_base": standing.shipper.next_back_token,
        # The other ranks give their tensors the tokens rank 0 gave its own last cell.
        "register_back": standing.register_back,
        "bring_back_bytes": settings.bring_back_limit,
        "keep_sharded": keep_sharded,
        "auto": not manual,
        "shard": None if shard is False or shard is None else dict(shard) if isinstance(shard, dict) else {},
        "events": address,
        # Signs the workers' batches: the event port is open to every local user, the
        # engine's channel that carries this request is not.
        "events_key": key,
        "run": run_id,
        "heartbeat": settings.heartbeat_interval,
        "resync": standing.resync,
        # Rank 0 sends the pull-back through a file of its own there.
        "pull_through": settings.shared_memory_keep if shared_memory else None,
        "seed": seed,
        "framework": framework,
        "overlap": settings.average_during_backward,
        "write_watch": settings.write_watch,
        "mailbox": mailbox,
        "sources": notebook_sources(plan.values, namespace, standing.sources_sent),
    }


def notebook_sources(values: dict, namespace: dict, sent: set[str]) -> dict[str, str]:
    """The lines of the notebook cells that defined the functions and classes among `values`
    (or the classes of values), those the workers do not hold yet (`sent`, updated): their
    tracebacks and debuggers show notebook code's lines, as the kernel's do."""
    files = {fn.__code__.co_filename for value in values.values() for fn in _notebook_functions(value, namespace)}
    found = {}
    for filename in sorted(files - sent):
        lines = linecache.getlines(filename)
        if lines and not os.path.exists(filename):  # a cell's: no file a worker could read
            found[filename] = "".join(lines)
    sent.update(found)
    return found


def _notebook_functions(value: Any, namespace: dict) -> Iterator[types.FunctionType]:
    if isinstance(value, types.FunctionType):
        if value.__globals__ is namespace:
            yield value
        return
    cls = value if isinstance(value, type) else type(value)
    if cls.__module__ == "__main__":
        for attribute in vars(cls).values():
            function = getattr(attribute, "__func__", attribute)  # a classmethod's, a staticmethod's
            if isinstance(function, types.FunctionType):
                yield function
