"""The notebook's cells as they ran, and one of them written as a job (%scale export).

`CellHistory` keeps what the shell ran (IPython's history, and every cell since the
extension loaded: nbval and other clients run cells that the history does not keep) and
finds a `%%distribute` cell in it. `export_cell` slices the cells before it into the job's
script (see export), chooses which values it saves (see cellstart) and writes the job
directory (see jobfiles).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from . import cellstart, export, frameworks, jobfiles
from .records import RunRecord, draw_seed


class CellHistory:
    """(In [n] or None, source) of every cell the shell ran."""

    def __init__(self, shell: Any):
        self.shell = shell
        self.cells: list[tuple[int | None, str]] = []  # the cells run since record()
        self._before: int | None = None  # how many IPython's history held then

    def record(self) -> None:
        """From now on, note every cell the shell runs (its pre_run_cell event)."""
        if self.shell is None or self._before is not None:
            return
        self._before = len(self.shell.history_manager.input_hist_raw)
        self.shell.events.register("pre_run_cell", self._note_cell)

    def _note_cell(self, info: Any) -> None:
        # Before the shell stores the cell: it goes at the history's end, if it is kept.
        number = len(self.shell.history_manager.input_hist_raw) if info.store_history else None
        self.cells.append((number, info.raw_cell))

    def executed(self) -> list[tuple[int | None, str]]:
        """The notebook's cells run so far: those IPython's history kept before record(),
        then every one since (this one's magic defines nothing)."""
        if self.shell is None:
            return []
        raw = self.shell.history_manager.input_hist_raw
        if self._before is None:
            return [(n, raw[n]) for n in range(1, len(raw))]
        return [(n, raw[n]) for n in range(1, min(self._before, len(raw)))] + list(self.cells)

    def number_of(self, body: str) -> int | None:
        """In [n] of the cell running now, whose body is `body`. IPython 9 counts a cell it
        keeps in its history before running it, IPython 8 after: the history says which."""
        count = getattr(self.shell, "execution_count", None)
        history = getattr(getattr(self.shell, "history_manager", None), "input_hist_raw", None) or []
        if count and len(history) == count and body.strip() and history[-1].rstrip().endswith(body.strip()):
            return count - 1
        return count

    def distribute_cell(self, number: int | None = None) -> tuple[int | None, str | None, str]:
        """(In [n], its %%distribute line or None for a plain cell, its body): In [`number`],
        else the last %%distribute cell run."""
        cells = self.executed()
        found = [(n, source) for n, source in cells if source.lstrip().startswith("%%distribute")]
        if number is not None:
            found = [(n, source) for n, source in cells if n == number]
            if not found:
                raise export.ExportError(f"cannot export: no cell In [{number}] ran before this one")
        if not found:
            raise export.ExportError("cannot export: no %%distribute cell ran in this notebook yet (or name one: --cell N)")
        n, source = found[-1]
        first, _, body = source.lstrip().partition("\n")
        if not first.startswith("%%distribute"):
            return n, None, source  # a plain cell exports as %%distribute would run it
        return n, first.removeprefix("%%distribute"), body


def export_cell(directory: str | os.PathLike, code: str, cell: int | None, *, history: CellHistory,
                namespace: dict, runs: list[RunRecord], transform: Callable[[str], str],
                names_read: Callable[[str], list[str]], shippable: Callable[[str], bool], workers_own: set[str],
                injected: Collection[str], keeper: cellstart.StartKeeper | None, workers: int,
                targets: Sequence[str], save_values: bool, nodes: int, image: str | None, gpus_per_node: int,
                manual: bool, values_from: str) -> dict:
    """Write In [`cell`] (`code`, its body) as a job directory; see ScaleSession.export.
    `names_read(code)`: the notebook names the transformed cell reads."""
    if values_from != "auto" and not save_values:
        raise export.ExportError("cannot export: --from picks the saved values; with --no-values the notebook's "
                                 "code makes them")
    if workers % nodes:
        raise export.ExportError(f"cannot export: {workers} workers do not split evenly over {nodes} nodes")
    try:
        export.check_script_syntax(code, transform)
        try:
            framework = frameworks.choose(code, namespace, names_read(transform(code)))
        except frameworks.FrameworkError:
            framework = "more than one framework"
        if framework != "torch":
            raise export.ExportError(f"cannot export: the cell uses {framework}; export writes torch jobs "
                                     "(torchrun, Slurm, Kubeflow, KubeRay)")
        statements = export.notebook_statements(history.executed(), transform)
        plan = export.plan_script(code, namespace, statements, save_values=save_values, eligible=shippable,
                                  workers_own=workers_own, injected=injected)
    except SyntaxError as exc:
        raise export.ExportError(f"cannot export: the cell is not valid Python: {exc}") from None
    plan.values, values_from, note = cellstart.choose(plan.values, runs, cell, keeper.start if keeper else None,
                                                      values_from)
    name = jobfiles.job_name(os.path.basename(os.path.abspath(directory)))
    shape = jobfiles.JobShape(name=name, per_node=workers // nodes, nodes=nodes, image=image or f"{name}:latest",
                              gpus_per_node=gpus_per_node)
    # The seed the cell drew when it ran, else the one it would draw now: the notebook's RNG
    # is left as it was, so that the cell run after its export draws the export's seed.
    ran = [r for r in runs if cell is not None and r.execution_count == cell]
    if ran and ran[-1].seed is not None:
        seed = ran[-1].seed
    else:
        with torch.random.fork_rng(devices=[]):
            seed = draw_seed()
    when = {"start": f"as In [{cell}] started (copied before it ran)",
            "now": f"as they were at export, after In [{cell}] ran"}.get(values_from, "as they were at export")
    done = jobfiles.write(Path(directory), plan, shape, seed=seed, automatic=not manual, cell=cell,
                          targets=tuple(targets), values_when=when)
    if note:
        print(note, file=sys.stderr, flush=True)
    done["values_from"] = values_from
    return done
