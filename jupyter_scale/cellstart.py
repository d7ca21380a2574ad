"""Where a %%distribute cell started, for an export after it ran.

A cell's run writes what it did back into the notebook (the models' trained weights, what
it changed in place, the names it bound: see pullback). After it the notebook holds where
the cell ended, so an export then would save those values and its job would start there,
not where the cell did: the job would go on training, not repeat the run.

With `ScaleSession.export_keep_start` on, `StartKeeper` keeps, as each cell starts (once
its values are planned, before any worker runs it), one deep copy of the notebook values
the cell reads: objects they share stay shared in the copy (an optimizer holds the copied
model's parameters). An export of that cell then saves the copy, and its job repeats the
run. Only the last cell's copy is kept, and none while the setting is off (the default):
then a cell costs what it always did, and an export after it saves the values as they are
and says so in one line, naming those that a run since the cell's start wrote back.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .export import ExportError

if TYPE_CHECKING:
    from .records import RunRecord

CHOICES = ("auto", "start", "now")
# Code and modules: an export writes them as code, so they need no copy (and most cannot be copied).
_NOT_COPIED = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class Observed(Protocol):
    """What the keeper reads of the session that it observes."""

    export_keep_start: bool
    namespace: dict
    observers: list


@dataclass
class Start:
    """The values one run's cell read, copied as it started."""

    run: int  # RunRecord.index
    values: dict[str, Any]
    failed: dict[str, str] = field(default_factory=dict)  # name -> why it could not be copied


class StartKeeper:
    """A session observer (see ScaleSession.observers): copies each torch cell's values as it
    starts, while `export_keep_start` is on."""

    def __init__(self, session: Observed):
        self.session = session
        self.start: Start | None = None

    def run_started(self, record: RunRecord, total_steps: int | None = None) -> None:
        self.start = None  # dropped before the next copy is made: at most one at a time
        if not self.session.export_keep_start or record.framework != "torch":
            return
        namespace = self.session.namespace
        names = dict.fromkeys([*record.shipped, *record.skipped])  # the names planned for the cell
        values = {n: namespace[n] for n in names if n in namespace and not isinstance(namespace[n], _NOT_COPIED)}
        copies, failed = _deep_copies(values)
        self.start = Start(record.index, copies, failed)


def _deep_copies(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A deep copy of `values`, sharing among them kept; a value that cannot be copied (a
    generator, an open file) is left out, and why."""
    try:
        return copy.deepcopy(values), {}
    except Exception:  # copying raises many types: find which, and copy the others
        pass
    memo: dict[int, Any] = {}
    copies, failed = {}, {}
    for name, value in values.items():
        attempt = dict(memo)  # a copy that fails half-way leaves nothing behind
        try:
            copies[name] = copy.deepcopy(value, attempt)
            memo = attempt
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    return copies, failed


def attach(session: Observed) -> StartKeeper:
    """The session's StartKeeper, registered with it once."""
    found = keeper(session)
    if found is None:
        found = StartKeeper(session)
        session.observers.append(found)
    return found


def keeper(session: Observed) -> StartKeeper | None:
    return next((o for o in getattr(session, "observers", ()) if isinstance(o, StartKeeper)), None)


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _why_missing(name: str, kept: Start | None, run: int) -> str:
    if kept is None:
        return "it ran with ScaleSession.export_keep_start off: %config ScaleSession.export_keep_start = True, run it again"
    if kept.run != run:
        return "only the last cell's start is kept: run it again"
    return kept.failed.get(name, "the cell did not read it as it started")


def choose(values: dict[str, Any], runs: list[RunRecord], cell: int | None, kept: Start | None,
           values_from: str = "auto") -> tuple[dict[str, Any], str, str | None]:
    """The values an export of In [`cell`] saves (`values`: the notebook's now), from where
    (`start`: as the cell's last run started, without the names bound since; `now`: as they
    are, after it; '' when the cell has not run, so that now is its start) and the one line to
    say when they are not where the cell started. Raises ExportError for `start` when a value
    its run changed has no copy."""
    if values_from not in CHOICES:
        raise ExportError(f"cannot export: values from {values_from!r}? (one of {', '.join(CHOICES)})")
    ran = [r for r in runs if cell is not None and r.execution_count == cell]
    if not ran or not values:
        return values, "", None
    run = ran[-1]
    where = f"In [{cell}]"
    # What the runs since wrote back: values the cell read as it started (changed), and names
    # that were not there then (bound by a cell; the cell reads them only where it binds them).
    written = {name for r in runs if r.index >= run.index for name in r.pulled}
    there = {*run.shipped, *run.skipped}  # the names planned for the cell as it started
    changed = sorted((name for name in values if name in written and name in there),
                     key=lambda name: (not isinstance(values[name], torch.nn.Module), name))  # the weights first
    bound = {name for name in values if name in written and name not in there}
    have = kept if kept is not None and kept.run == run.index else None
    missing = [name for name in changed if have is None or name not in have.values]
    if values_from == "start" or (values_from == "auto" and have is not None and not missing):
        if missing:
            raise ExportError(f"cannot export {where} as it started: its run changed {_listed(missing)}, of which no "
                              f"copy from before it is kept ({_why_missing(missing[0], kept, run.index)}); "
                              "or export --from now")
        chosen = {name: have.values[name] if have is not None and name in have.values else value
                  for name, value in values.items() if name not in bound}
        return chosen, "start", None
    if not changed:
        return values, "now", None
    them = "it" if len(changed) == 1 else "them"
    trained = " (trained)" if any(isinstance(values[name], torch.nn.Module) for name in changed) else ""
    how = ("--from start exports the start" if not missing else
           f"no copy of {_listed(missing)} from before it is kept: {_why_missing(missing[0], kept, run.index)}")
    return values, "now", (f"jupyter_scale: the job starts from {_listed(changed)} as the notebook holds {them} now, "
                           f"written back by {where}'s run{trained}, not as {where} started; {how}")
