"""Where report()'s points go besides the notebook: TensorBoard and MLflow (`--log-to`).

The kernel writes them from the event stream it already receives (the workers write
nothing, need no tracking credentials, and a lost worker loses no written point): each
rank's points as they arrive, or with `--log-as mean` the mean over the ranks at each
step. A run is named after the notebook and the cell (`train-cell12-20261206-101500`).

    %%distribute --log-to tensorboard:runs            # runs/<run>/rank0, rank1, ... (or mean)
    %%distribute --log-to mlflow                      # MLFLOW_TRACKING_URI, or MLflow's default
    %%distribute --log-to mlflow:sqlite:///mlflow.db --log-as mean

TensorBoard's writer comes with torch but needs the `tensorboard` package; MLflow's client is
`mlflow-skinny` (or `mlflow`): the extras `jupyter_scale[tensorboard]` and `[mlflow]`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any

from .errors import DistributeError

log = logging.getLogger(__name__)

TARGETS = ("tensorboard", "mlflow")
MODES = ("ranks", "mean")
MLFLOW_FLUSH_S = 1.0  # an MLflow store write costs milliseconds: points go in batches
MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch
_NOT_SCALARS = frozenset(("rank", "step", "epoch", "time", "kind"))


class SinkError(ValueError):
    """A --log-to target that cannot be used; the message is one line for the user."""


def _target(spec: str) -> tuple[str, str]:
    name, _, where = spec.partition(":")
    if name not in TARGETS:
        raise SinkError(f"--log-to {spec!r}: the targets are tensorboard[:DIR] and mlflow[:TRACKING_URI]")
    try:
        if name == "tensorboard":
            import tensorboard  # noqa: F401  (torch's SummaryWriter imports it)
        else:
            import mlflow  # noqa: F401
    except ImportError:
        package = "tensorboard" if name == "tensorboard" else "mlflow-skinny"
        raise SinkError(f"--log-to {name} needs the {package} package: pip install 'jupyter_scale[{name}]'") from None
    if name == "tensorboard" and "://" in where:
        raise SinkError(f"--log-to {spec!r}: DIR is a local directory (TensorBoard's writer is used without TensorFlow, "
                        "whose file systems reach URLs)")
    return name, where


def run_name(notebook: str, cell: int | None, index: int, started: float) -> str:
    """`<notebook>-cell<In [n]>-<when>`: what a team finds the run by."""
    which = f"cell{cell}" if cell is not None else f"run{index}"
    return f"{notebook}-{which}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}"


def for_run(targets: list[str], mode: str, *, notebook: str, cell: int | None, index: int, started: float,
            engine: str, code: str) -> RunSinks | None:
    """The sinks of one run (None without targets), opened before any worker runs it: a
    target that cannot work fails the cell first, with DistributeError."""
    if not targets:
        return None
    details = {"notebook": notebook, "engine": engine, "cell": str(cell) if cell is not None else "", "code": code}
    try:
        return RunSinks(targets, mode, run_name(notebook, cell, index, started), details)
    except SinkError as exc:
        raise DistributeError(str(exc)) from None
    except Exception as exc:  # the tracking store itself: a bad URI, a server that does not answer
        raise DistributeError(f"--log-to: {type(exc).__name__}: {' '.join(str(exc).split())}") from None


class RunSinks:
    """One run's sinks: a session observer from run_started to run_finished."""

    def __init__(self, specs: list[str], mode: str, name: str, details: dict[str, str]):
        if mode not in MODES:
            raise SinkError(f"--log-as {mode!r}: choose {' or '.join(MODES)}")
        targets = [_target(spec) for spec in specs]  # every one checked before any store opens
        self.mode, self.name, self.details = mode, name, details
        self.sinks: list[Any] = [_TensorBoard(where or "runs", name) if target == "tensorboard"
                                 else _MLflow(where or None, name, details) for target, where in targets]
        self.workers = 0
        # --log-as mean: (step, name) -> rank -> [sum, count, latest time], written once every
        # rank has reported a later step (a rank may report one step many times: step=epoch).
        self._pending: dict[tuple[int, str], dict[int, list[float]]] = {}
        self._reached: dict[int, int] = {}  # rank -> the highest step it reported
        self._failed: set[int] = set()
        self.finished = False

    def run_started(self, record: Any, total_steps: int | None) -> None:
        self.workers = record.workers
        for i, sink in enumerate(self.sinks):
            self._guard(i, sink.start, record)

    def event(self, event: dict) -> None:
        if event.get("kind") is not None or self.finished:
            return
        step, rank, wall = event["step"], event["rank"], event["time"]
        scalars = [(k, float(v)) for k, v in event.items() if k not in _NOT_SCALARS]
        if self.mode == "ranks":
            self._write(f"rank{rank}", scalars, step, wall)
            return
        for key, value in scalars:
            total = self._pending.setdefault((step, key), {}).setdefault(rank, [0.0, 0, wall])
            total[0] += value
            total[1] += 1
            total[2] = max(total[2], wall)
        self._reached[rank] = max(self._reached.get(rank, step), step)
        if len(self._reached) == self.workers:
            self._write_means(below=min(self._reached.values()))

    def _write_means(self, below: float) -> None:
        """The mean over the ranks (each rank's own mean where it reported a step more than
        once) of every pending step below `below`."""
        by_step: dict[int, list[tuple[str, float]]] = {}
        walls: dict[int, float] = {}
        for step, key in sorted(k for k in self._pending if k[0] < below):
            per_rank = self._pending.pop((step, key))
            means = [total / count for total, count, _ in per_rank.values()]
            by_step.setdefault(step, []).append((key, math.fsum(means) / len(means)))
            walls[step] = max([walls.get(step, 0.0)] + [t for _, _, t in per_rank.values()])
        for step, scalars in by_step.items():
            self._write("mean", scalars, step, walls[step])

    def tick(self) -> None:
        for i, sink in enumerate(self.sinks):
            self._guard(i, sink.flush, False)

    def run_finished(self, record: Any) -> None:
        self.close(record.status)

    def close(self, status: str) -> None:
        """The run ended (`status`: finished, failed, interrupted, ...): what is pending is
        written (the last steps; with ranks lost, the mean of those that reported), and
        each sink closed. Called again, it does nothing."""
        if self.finished:
            return
        self.finished = True
        self._write_means(below=math.inf)
        for i, sink in enumerate(self.sinks):
            self._guard(i, sink.finish, status)

    def _write(self, series: str, scalars: list[tuple[str, float]], step: int, wall: float) -> None:
        if scalars:
            for i, sink in enumerate(self.sinks):
                self._guard(i, sink.write, series, scalars, step, wall)

    def _guard(self, i: int, method: Any, *args: Any) -> None:
        """A sink that fails (a full disk, a tracking server gone) says so once and stops;
        the run and the other sinks go on."""
        if i in self._failed:
            return
        try:
            method(*args)
        except Exception as exc:
            self._failed.add(i)
            log.warning("jupyter_scale: --log-to %s stopped writing: %s: %s", self.sinks[i].label,
                        type(exc).__name__, exc)


class _TensorBoard:
    """An event file per series (DIR/<run>/rank0, ..., or DIR/<run>/mean), as TensorBoard
    shows runs side by side; a scalar's tag is its name in report()."""

    def __init__(self, directory: str, name: str):
        self.root = Path(directory).expanduser() / name
        self.label = f"tensorboard:{directory}"
        self._writers: dict[str, Any] = {}

    def start(self, record: Any) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def write(self, series: str, scalars: list[tuple[str, float]], step: int, wall: float) -> None:
        writer = self._writers.get(series)
        if writer is None:
            _tensorboard_without_tensorflow()
            from torch.utils.tensorboard import SummaryWriter

            writer = self._writers[series] = SummaryWriter(log_dir=str(self.root / series))
        for key, value in scalars:
            writer.add_scalar(key, value, global_step=step, walltime=wall)

    def flush(self, final: bool) -> None:
        pass  # the writers flush on their own (every 2 minutes) and at finish

    def finish(self, status: str) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


def _tensorboard_without_tensorflow() -> None:
    """TensorBoard's writer uses TensorFlow where it can import it: seconds in the kernel and
    TensorFlow's log lines in the cell, for files its own stub writes alike (local paths; S3
    directories). A module named tensorboard.compat.notf is TensorBoard's switch for the stub; it
    stays for the kernel's life, so TensorBoard's own TensorFlow-backed APIs there see the stub."""
    if "tensorflow" not in sys.modules:
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))


class _MLflow:
    """One MLflow run per cell, in the notebook's experiment; a rank's scalar is NAME/rankR,
    the mean is NAME. Tags say the notebook, the cell, the engine and the worker count.

    The store is opened before the cell runs (a bad URI fails it first); the run's writes go
    through one thread of their own, in order: a slow tracking server (MLflow retries a
    failed request for minutes) must not hold up the cell's wait loop, its interrupts and
    timeouts. At the end the run waits FINISH_S for them, then leaves them to finish."""

    STATUS = {"finished": "FINISHED", "interrupted": "KILLED"}
    FINISH_S = 30.0

    def __init__(self, uri: str | None, name: str, details: dict[str, str]):
        from mlflow.tracking import MlflowClient

        self.label = f"mlflow:{uri}" if uri else "mlflow"
        # Creating a database store logs its migrations at INFO: not the user's business.
        quiet = logging.getLogger("mlflow.store.db.utils")
        level = quiet.level
        quiet.setLevel(logging.WARNING)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or details["notebook"]
            experiment = self.client.get_experiment_by_name(experiment_name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(experiment_name))
        finally:
            quiet.setLevel(level)
        self.experiment_id, self.name, self.details = experiment_id, name, details
        self.run_id: str | None = None
        self._pending: list[Any] = []
        self._flushed_at = time.monotonic()
        self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jupyter_scale-mlflow")
        self._failure: BaseException | None = None

    def _in_order(self, call: Any, *args: Any, **kwargs: Any) -> None:
        """`call` on the writing thread, after what was queued before; a failure there is
        raised at the next write (through RunSinks._guard: said once, then the sink stops)."""
        if self._failure is not None:
            raise self._failure

        def run() -> None:
            if self._failure is None:
                try:
                    call(*args, **kwargs)
                except BaseException as exc:
                    self._failure = exc
        self._writes.submit(run)

    def start(self, record: Any) -> None:
        tags = {f"jupyter_scale.{k}": v for k, v in self.details.items() if k != "code"}
        if self.details.get("code"):
            tags["mlflow.note.content"] = f"```python\n{self.details['code']}\n```"
        tags["mlflow.source.name"] = self.details["notebook"]
        tags["jupyter_scale.workers"] = str(record.workers)

        def create() -> None:
            self.run_id = self.client.create_run(self.experiment_id, run_name=self.name, tags=tags).info.run_id
        self._in_order(create)

    def write(self, series: str, scalars: list[tuple[str, float]], step: int, wall: float) -> None:
        from mlflow.entities import Metric

        suffix = "" if series == "mean" else f"/{series}"
        stamp = int(wall * 1000)
        self._pending.extend(Metric(f"{key}{suffix}", value, stamp, step) for key, value in scalars)

    def flush(self, final: bool) -> None:
        if not final and time.monotonic() - self._flushed_at < MLFLOW_FLUSH_S:
            return
        self._flushed_at = time.monotonic()

        def log_batch(metrics: list[Any]) -> None:
            # start's create_run ran before on the writing thread (a failed one stops every later write).
            assert self.run_id is not None
            self.client.log_batch(self.run_id, metrics=metrics)
        while self._pending:
            batch, self._pending = self._pending[:MLFLOW_BATCH], self._pending[MLFLOW_BATCH:]
            self._in_order(log_batch, batch)

    def finish(self, status: str) -> None:
        self.flush(True)

        def terminate() -> None:
            if self.run_id is not None:
                self.client.set_terminated(self.run_id, status=self.STATUS.get(status, "FAILED"))
        self._in_order(terminate)
        done = self._writes.submit(lambda: None)
        self._writes.shutdown(wait=False)
        try:
            done.result(timeout=self.FINISH_S)
        except FuturesTimeout:
            raise TimeoutError(f"its writes were still going after {self.FINISH_S:.0f} s; "
                               "they go on in the background") from None
        if self._failure is not None:
            raise self._failure


def notebook_name(namespace: dict) -> str:
    """The notebook's name (a run's label in TensorBoard and MLflow), or "notebook"."""
    path = os.environ.get("JPY_SESSION_NAME") or str(namespace.get("__session__") or "")
    return Path(path).stem if path else "notebook"
