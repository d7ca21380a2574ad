"""The dashboard widget at the message level (no browser): content, order, rate cap, snapshot."""

import time
from pathlib import Path

from jupyter_scale.display import RunView
from jupyter_scale.records import RunRecord
from jupyter_scale.widgets import PALETTE, Dashboard, DashboardFeed, snapshot_html


def events(n, ranks=(0, 1)):
    for i in range(n):
        for r in ranks:
            yield {"rank": r, "step": i, "time": time.time(), "epoch": i // 100, "loss": 1.0 / (i + 1) + r}


def test_events_from_two_ranks_reach_the_widget_model_in_order():
    feed = DashboardFeed(world_size=2, total_steps=300)
    feed.add({"kind": "state", "rank": 0, "state": "running", "pid": 11, "host": "h", "device": "cpu"})
    feed.add({"kind": "state", "rank": 1, "state": "running", "pid": 12, "host": "h", "device": "cpu"})
    for e in events(200):
        feed.add(e)
    widget = Dashboard()
    sent = []
    widget._send = lambda msg, buffers=None: sent.append(msg)
    feed.push(widget)
    assert len(sent) == 1  # hold_sync: all traits in one message
    state = sent[0]["state"]
    assert state["metric"] == "loss" and state["metrics"] == ["loss"] and state["state"] == "running"
    for r in ("0", "1"):
        steps = [p[0] for p in state["series"]["loss"][r]]
        assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == 199
    assert state["series"]["loss"]["mean"][0] == [0, 1.5]  # mean of rank 0's 1.0 and rank 1's 2.0
    assert [w["pid"] for w in state["workers"]] == [11, 12]
    assert state["workers"][1]["last_step"] == 199 and state["progress"]["total"] == 300
    assert state["progress"]["step"] == 200 and state["progress"]["epoch"] == 1
    feed.finish("finished")
    feed.push(widget)  # rows changed in place must still be sent
    assert [w["state"] for w in sent[-1]["state"]["workers"]] == ["finished", "finished"]


def test_the_rate_and_eta_count_training_only():
    feed = DashboardFeed(world_size=1, total_steps=1000)
    time.sleep(0.2)  # the cluster starting
    feed.add({"rank": 0, "step": 0, "time": 100.0, "loss": 1.0})
    feed.add({"rank": 0, "step": 50, "time": 100.5, "loss": 0.9})
    assert feed.progress()["rate"] == 0 and "eta" not in feed.progress()  # not measured yet: nothing shown
    feed.add({"rank": 0, "step": 200, "time": 101.0, "loss": 0.5})  # by the rank's clock, 200 steps in 1 s
    assert feed.progress()["rate"] == 200 and feed.progress()["eta"] == 4.0  # 799 steps left
    feed.add({"rank": 0, "step": 0, "time": 102.0, "loss": 0.4})  # steps counted from 0 again: no negative rate
    feed.add({"rank": 0, "step": 100, "time": 103.0, "loss": 0.3})
    assert feed.progress()["rate"] == 100


def test_a_slow_model_still_gets_a_rate_and_an_eta():
    feed = DashboardFeed(world_size=1, total_steps=10)
    feed.add({"rank": 0, "step": 0, "time": 100.0, "loss": 1.0})
    feed.add({"rank": 0, "step": 1, "time": 130.0, "loss": 0.9})  # 30 s a step
    assert feed.progress()["rate"] == 0.033 and feed.progress()["eta"] == 240.0  # 8 steps left


def test_long_runs_are_downsampled_for_the_chart_only():
    feed = DashboardFeed(world_size=1)
    for e in events(10_000, ranks=(0,)):
        feed.add(e)
    curve = feed.series()["0"]
    assert len(curve) <= 400 and curve[0][0] == 0 and curve[-1][0] == 9999
    assert len(feed.curves["loss"][0]) == 10_000


def test_updates_are_capped_at_ten_a_second_whatever_the_report_rate(monkeypatch):
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: None)
    view = RunView(True, 2.0, RunRecord(index=1, workers=2), total_steps=None)
    pushes = []
    original = view.feed.push
    view.feed.push = lambda widget: (pushes.append(time.monotonic()), original(widget))
    started = time.monotonic()
    for e in events(20_000):  # far more than 10 reports per second
        view.add(e)
        view.tick()
    elapsed = time.monotonic() - started
    assert len(pushes) <= elapsed * RunView.MAX_RATE + 2
    assert all(b - a >= 1 / RunView.MAX_RATE - 1e-3 for a, b in zip(pushes, pushes[1:]))


def test_snapshot_shows_each_rank_and_the_final_state():
    feed = DashboardFeed(world_size=2)
    for e in events(50):
        feed.add(e)
    feed.finish("failed", "rank 1 failed: ValueError: bad")
    html = snapshot_html(feed)
    assert 'data-series="rank 0"' in html and 'data-series="rank 1"' in html and 'data-series="mean"' in html
    assert "failed: rank 1 failed: ValueError: bad" in html


def test_a_kernel_with_a_frontend_shows_the_dashboard_and_keeps_a_snapshot(kernel):
    kernel.ok("jupyter_scale.get_session().display = 'widget'")
    try:
        out = kernel.ok("%%distribute --workers 2 --steps 50\nfor i in range(50):\n    report(loss=1.0 / (i + 1))")
    finally:
        kernel.ok("jupyter_scale.get_session().display = 'auto'")
    views = [d for d in out.displays if "application/vnd.jupyter.widget-view+json" in d]
    assert views, out.displays
    final = out.displays[-1]
    assert "text/html" in final and 'data-series="rank 1"' in final["text/html"]
    assert "finished" in final["text/html"]
    assert "jupyter_scale: step" not in out.stdout  # the widget replaces the text lines


def test_the_loss_charts_draw_with_one_palette():
    # The widget, its snapshot and the sidebar all take the kernel's PALETTE; no copy of it
    # lives in their JavaScript or TypeScript (copies drift apart).
    root = Path(__file__).resolve().parent.parent
    sources = [*root.glob("jupyter_scale/**/*.py"), *root.glob("jupyter_scale/widgets/*.js"),
               *root.glob("labextension/src/*.ts")]
    holders = [p.relative_to(root).as_posix() for p in sources if PALETTE[1] in p.read_text()]
    assert holders == ["jupyter_scale/widgets/dashboard.py"]
    assert Dashboard().colors == PALETTE
    feed = DashboardFeed(world_size=2, total_steps=None)
    feed.add({"rank": 1, "step": 0, "time": 0.0, "loss": 1.0})
    feed.add({"rank": 1, "step": 1, "time": 1.0, "loss": 0.5})
    snapshot = snapshot_html(feed)
    assert f'stroke="{PALETTE[1]}"' in snapshot and f'stroke="{PALETTE[0]}"' not in snapshot  # rank 1's own colour


def test_every_reported_scalar_is_sent_within_one_pushs_budget_of_points():
    feed = DashboardFeed(world_size=8)
    for i in range(2000):
        for r in range(8):
            feed.add({"rank": r, "step": i, "time": 100.0 + i, "loss": 1.0 + r, "acc": 0.5, "lr": 0.1 * (i + 1)})
    series = feed.all_series()
    assert list(series) == feed.metrics == ["loss", "acc", "lr"]
    assert all(set(curves) == {*map(str, range(8)), "mean"} for curves in series.values())
    points = sum(len(c) for curves in series.values() for c in curves.values())
    assert 2000 <= points <= 2400  # what one push carries, whatever the ranks and names
    assert series["loss"]["mean"][0] == [0, 4.5] and series["lr"]["3"][-1] == [1999, 200.0]


def test_the_chart_leaves_out_what_it_cannot_place_and_means_come_as_points_arrive():
    feed = DashboardFeed(world_size=2)
    feed.add({"rank": 0, "step": 0, "time": 1.0, "loss": float("nan")})
    feed.add({"rank": 1, "step": 0, "time": 1.0, "loss": 1.0})
    feed.add({"rank": 1, "step": 1, "time": 2.0, "loss": 3.0})  # rank 1 first this time
    feed.add({"rank": 0, "step": 1, "time": 2.0, "loss": float("inf")})
    feed.add({"rank": 0, "step": 2, "time": 3.0, "loss": 2.0})
    feed.add({"rank": 1, "step": 2, "time": 3.0, "loss": 4.0})
    assert feed.not_finite == 2
    assert feed.series() == {"0": [[2, 2.0]], "1": [[0, 1.0], [1, 3.0], [2, 4.0]], "mean": [[2, 3.0]]}


def test_the_ranks_lines_reach_the_widget_with_whose_they_are():
    """The dashboard's output view filters by rank: each line comes with the ranks that printed
    it (several, for a line they printed alike), and only the last MAX_OUTPUT_LINES."""
    from jupyter_scale.display import LineLabeler
    from jupyter_scale.widgets.dashboard import MAX_OUTPUT_LINES

    feed = DashboardFeed(world_size=3)
    labeler = LineLabeler.for_cell(3, None, 60, on_line=feed.add_output)
    for rank in range(3):
        labeler.feed(rank, "stdout", "epoch 1 done\n")
    labeler.feed(2, "stderr", "warning on 2\n")
    labeler.feed(1, "stdout", "progress\r")  # a line redrawn in place is not kept
    labeler.flush()
    assert list(feed.output) == [[[0, 1, 2], "stdout", "epoch 1 done"], [[2], "stderr", "warning on 2"]]
    widget = Dashboard()
    sent = []
    widget._send = lambda msg, buffers=None: sent.append(msg)
    feed.push(widget)
    assert sent[-1]["state"]["output"] == [[[0, 1, 2], "stdout", "epoch 1 done"], [[2], "stderr", "warning on 2"]]
    for i in range(MAX_OUTPUT_LINES + 5):
        feed.add_output([0], "stdout", f"line {i}")
    assert len(feed.output) == MAX_OUTPUT_LINES and feed.output[-1][2] == f"line {MAX_OUTPUT_LINES + 4}"
