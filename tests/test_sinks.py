"""--log-to: every report() point of a real run, written by the kernel to TensorBoard event
files and an MLflow store, read back with TensorBoard's and MLflow's own readers."""

import math
from pathlib import Path

import pytest

from conftest import README_DATA, README_LOOP, SETUP, _stop_and_check
from kernel import Kernel

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def kernel():
    import os

    before = os.environ.get("JPY_SESSION_NAME")
    os.environ["JPY_SESSION_NAME"] = "/home/me/projects/train.ipynb"  # as jupyter_server tells its kernels
    try:
        k = Kernel()
    finally:
        if before is None:
            del os.environ["JPY_SESSION_NAME"]
        else:
            os.environ["JPY_SESSION_NAME"] = before
    try:
        k.ok(SETUP + README_DATA, history=True)
        yield k
    finally:
        _stop_and_check(k)


def history(kernel) -> dict[tuple[int, int], float]:
    """The run's points as the notebook has them: (rank, step) -> loss."""
    return {(p["rank"], p["step"]): p["loss"] for p in kernel.value("jupyter_scale.get_session().runs[-1].metrics")}


def tensorboard_scalars(directory: Path) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def test_every_point_of_every_rank_reaches_tensorboard_under_the_notebook_and_cells_name(kernel, tmp_path):
    out = kernel.ok(f"%%distribute --workers 2 --log-to tensorboard:{tmp_path}\n" + README_LOOP, history=True)
    assert out.stderr == ""  # TensorBoard's writer brought no TensorFlow (nor its log lines) into the cell
    cell = kernel.value("len(In) - 1")
    points = history(kernel)
    assert len(points) == 2 * 32  # 2 ranks, 2 epochs of 16 batches
    [run] = list(tmp_path.iterdir())
    assert run.name.startswith(f"train-cell{cell}-")
    assert sorted(p.name for p in run.iterdir()) == ["rank0", "rank1"]
    for rank in (0, 1):
        written = tensorboard_scalars(run / f"rank{rank}")
        assert set(written) == {"loss"}
        mine = {step: loss for (r, step), loss in points.items() if r == rank}
        assert {e.step: e.value for e in written["loss"]} == pytest.approx(mine, rel=1e-6)


def test_the_mean_at_each_step_reaches_mlflow_from_the_sessions_default(kernel, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    kernel.ok(f"jupyter_scale.get_session().log_to = ['mlflow:{uri}']\njupyter_scale.get_session().log_as = 'mean'")
    try:
        out = kernel.ok("%%distribute\n" + README_LOOP, history=True)
    finally:
        kernel.ok("jupyter_scale.get_session().log_to = []\njupyter_scale.get_session().log_as = 'ranks'")
    assert out.stderr == ""  # no MLflow log lines in the cell
    cell = kernel.value("len(In) - 1")
    points = history(kernel)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("train")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name.startswith(f"train-cell{cell}-") and run.info.status == "FINISHED"
    assert run.data.tags["jupyter_scale.cell"] == str(cell) and run.data.tags["jupyter_scale.engine"] == "ipyparallel"
    assert run.data.tags["jupyter_scale.workers"] == "2"
    assert "opt.step()" in run.data.tags["mlflow.note.content"]  # the cell's code
    assert set(run.data.metrics) == {"loss"}
    steps = sorted({step for _, step in points})
    written = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert sorted(written) == steps
    for step in steps:
        assert math.isclose(written[step], (points[(0, step)] + points[(1, step)]) / 2, rel_tol=1e-9)


def test_a_failed_cell_keeps_its_points_and_marks_the_run_failed(kernel, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = kernel.cell(f"%%distribute --log-to mlflow:{uri} --log-to tensorboard:{tmp_path / 'tb'}\n"
                      "for i in range(5):\n    report(loss=float(i + rank))\n"
                      "if rank == 1:\n    raise ValueError('bad batch')")
    assert not out.ok and "rank 1" in out.error["evalue"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    assert run.info.status == "FAILED"
    assert sorted(run.data.metrics) == ["loss/rank0", "loss/rank1"]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss/rank1")] == [1.0, 2.0, 3.0, 4.0, 5.0]
    [tb_run] = list((tmp_path / "tb").iterdir())
    assert [e.value for e in tensorboard_scalars(tb_run / "rank0")["loss"]] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_target_that_cannot_work_fails_the_cell_in_one_line_before_it_runs(kernel, tmp_path):
    kernel.ok("marker = 1")
    runs = kernel.value("len(jupyter_scale.get_session().runs)")
    for flags, message in [("--log-to wandb", "--log-to 'wandb': the targets are tensorboard[:DIR] and mlflow"),
                           ("--log-to tensorboard --log-as median", "argument --log-as: invalid choice"),
                           (f"--log-to mlflow:{tmp_path}/nowhere/x.db", "--log-to: ")]:
        out = kernel.cell(f"%%distribute {flags}\nmarker = 2")
        said = out.error["evalue"] if out.error else out.stderr  # IPython prints a UsageError
        assert message in said, (out.error_text, out.stderr)
        assert len(said.strip().splitlines()) == 1
    assert kernel.value("marker") == 1
    assert kernel.value("len(jupyter_scale.get_session().runs)") == runs  # none of them started
    assert "[rank 1] fine" in kernel.ok("%%distribute\nprint('fine')").stdout


# RunSinks fed as the session feeds it (its run_started, event, tick, run_finished), with the
# real TensorBoard writer: the cases a short real run does not show.
class _Record:
    def __init__(self, workers):
        self.workers, self.status = workers, "running"


def _fed(tmp_path, events, mode="mean", workers=2, status="finished", targets=None):
    from jupyter_scale import sinks

    run = sinks.RunSinks(targets or [f"tensorboard:{tmp_path}"], mode, "nb-cell1-x",
                         {"notebook": "nb", "engine": "test", "cell": "1", "code": ""})
    record = _Record(workers)
    run.run_started(record, None)
    for event in events:
        run.event(event)
        run.tick()
    record.status = status
    run.run_finished(record)
    return run


def test_a_rank_reporting_one_step_many_times_counts_once_in_the_mean(tmp_path):
    # step=epoch, a report per batch: each rank's own mean first, then the mean over the ranks.
    events = [{"rank": r, "step": epoch, "time": 100.0 + epoch, "loss": float(v)}
              for epoch, values in enumerate([([1, 3], [10, 30]), ([2, 2], [20, 20])])
              for r, rank_values in enumerate(values) for v in rank_values]
    _fed(tmp_path, events)
    written = tensorboard_scalars(tmp_path / "nb-cell1-x" / "mean")["loss"]
    assert [(e.step, e.value) for e in written] == [(0, 11.0), (1, 11.0)]  # (2 + 20) / 2 and (2 + 20) / 2


def test_a_scalar_only_some_ranks_report_and_a_lost_ranks_steps_are_written_at_the_end(tmp_path):
    events = [{"rank": 0, "step": 0, "time": 1.0, "loss": 1.0, "grad_norm": 5.0},
              {"rank": 1, "step": 0, "time": 1.0, "loss": 3.0},
              {"rank": 0, "step": 1, "time": 2.0, "loss": 2.0},
              {"rank": 1, "step": 1, "time": 2.0, "loss": 4.0},
              {"rank": 0, "step": 2, "time": 3.0, "loss": 7.0}]  # rank 1 died before step 2
    _fed(tmp_path, events, status="failed")
    written = tensorboard_scalars(tmp_path / "nb-cell1-x" / "mean")
    assert [(e.step, e.value) for e in written["loss"]] == [(0, 2.0), (1, 3.0), (2, 7.0)]
    assert [(e.step, e.value) for e in written["grad_norm"]] == [(0, 5.0)]
    assert [e.wall_time for e in written["loss"]] == [1.0, 2.0, 3.0]  # when reported, not when written


def test_a_sink_that_fails_says_so_once_and_the_others_go_on(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    events = [{"rank": r, "step": i, "time": 1.0 + i, "loss": float(i + r)} for i in range(3) for r in (0, 1)]
    run = _fed(tmp_path, events, mode="ranks", targets=[f"tensorboard:{blocked}", f"mlflow:{uri}"])
    said = [r.getMessage() for r in caplog.records if "stopped writing" in r.getMessage()]
    assert len(said) == 1 and f"tensorboard:{blocked}" in said[0]
    assert run.finished
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    [written] = client.search_runs([client.get_experiment_by_name("nb").experiment_id])
    assert [m.value for m in client.get_metric_history(written.info.run_id, "loss/rank1")] == [1.0, 2.0, 3.0]
