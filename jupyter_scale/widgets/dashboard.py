"""Dashboard widget and the kernel-side aggregation that feeds it.

`DashboardFeed` is plain Python (tested without a browser): it folds the event stream
into what the dashboard shows. `Dashboard` is the anywidget whose synced traits carry
that; the Session pushes to it at most `max_rate` times a second whatever the report rate.
`snapshot_html` renders the same content as static HTML, left in the output when the run
ends, so the notebook stays readable when reopened without a kernel.
"""

from __future__ import annotations

import bisect
import collections
import html
import math
import pathlib
import time

import anywidget
import traitlets

MAX_POINTS = 400  # per curve on the chart; the full history stays in the kernel
# What one push carries at most, over every curve of every metric (the frontend switches
# metrics without asking the kernel, which does not answer while a cell runs): many ranks
# or metrics get fewer points per curve (never fewer than MIN_POINTS).
POINTS_PER_PUSH = 2400
MIN_POINTS = 20
MAX_OUTPUT_LINES = 500  # of the ranks' output, for the dashboard's view by rank (the cell keeps all)
_META = ("rank", "step", "time", "epoch", "kind")


# The ranks' curves, rank by rank in turn: the one palette of the loss charts (this widget,
# its static snapshot and the JupyterLab sidebar all get it from here).
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


class Dashboard(anywidget.AnyWidget):
    _esm = pathlib.Path(__file__).with_name("dashboard.js")
    _css = pathlib.Path(__file__).with_name("dashboard.css")

    state = traitlets.Unicode("starting").tag(sync=True)  # starting running finished failed interrupted
    message = traitlets.Unicode("").tag(sync=True)
    metric = traitlets.Unicode("").tag(sync=True)  # the one charted first (the first one reported)
    metrics: traitlets.List[str] = traitlets.List().tag(sync=True)  # every reported name, in the order first seen
    series = traitlets.Dict().tag(sync=True)  # {name: {"0": [[step, value], ...], ..., "mean": [...]}}
    progress = traitlets.Dict().tag(sync=True)  # step, total, epoch, rate, eta, elapsed
    workers: traitlets.List[dict] = traitlets.List().tag(sync=True)  # one row per rank
    lost = traitlets.Int(0).tag(sync=True)
    colors = traitlets.List(PALETTE).tag(sync=True)
    output: traitlets.List[list] = traitlets.List().tag(sync=True)  # the last lines: [[ranks, stream, text], ...]


class DashboardFeed:
    """Folds events into the dashboard's content: per-rank curves, progress, worker rows."""

    def __init__(self, world_size: int, total_steps: int | None = None):
        self.world_size = world_size
        self.total_steps = total_steps
        self.started = time.monotonic()
        self.metrics: list[str] = []  # every reported name, in the order first seen
        self.curves: dict[str, dict[int, list[list[float]]]] = {}  # name -> rank -> [[step, value], ...]
        self._means: dict[str, list[list[float]]] = {}  # name -> [[step, mean over the ranks], ...]
        self._partial: dict[str, dict[float, list[float]]] = {}  # name -> step -> [sum, count] so far
        self.not_finite = 0  # NaN or infinite values, left off the chart
        self.rows: dict[int, dict] = {r: {"rank": r, "state": "starting"} for r in range(world_size)}
        self.state, self.message, self.lost = "starting", "", 0
        self._rate_mark: dict[int, tuple[float, int]] = {}
        self._rates: dict[int, float] = {}  # rank -> steps/s, unrounded (a slow model's can be far below 0.1)
        self.output: collections.deque[list] = collections.deque(maxlen=MAX_OUTPUT_LINES)

    def add_output(self, ranks: list[int], stream: str, text: str) -> None:
        """A line that `ranks` printed (one rank's, or several ranks' alike)."""
        self.output.append([list(ranks), stream, text])

    def add(self, event: dict) -> None:
        rank = event.get("rank", 0)
        row = self.rows.setdefault(rank, {"rank": rank})
        if event.get("kind") == "state":
            row.update({k: event[k] for k in ("state", "host", "pid", "device") if k in event})
            if event["state"] == "running" and self.state == "starting":
                self.state = "running"
            return
        if event.get("kind") == "stats":
            row["memory"] = f"{event['rss'] / 2**20:.0f} MB"
            return
        row["last_step"] = event["step"]
        if "epoch" in event:
            row["epoch"] = event["epoch"]
        # Each rank's rate by its own clock, from its first reported step: not the cluster's
        # start before it, nor when the batches happened to reach the kernel.
        now = event["time"]
        mark_time, mark_step = self._rate_mark.setdefault(rank, (now, event["step"]))
        if event["step"] < mark_step or now < mark_time:  # steps counted anew (an epoch), or the clock set back
            self._rate_mark[rank] = (now, event["step"])
        elif now - mark_time >= 1.0:
            self._rates[rank] = (event["step"] - mark_step) / (now - mark_time)
            row["steps_per_s"] = round(self._rates[rank], 2)
            self._rate_mark[rank] = (now, event["step"])
        step = event["step"]
        for name, value in event.items():
            if name in _META:
                continue
            if not math.isfinite(value):  # a chart cannot place it (history() keeps it)
                self.not_finite += 1
                continue
            curves = self.curves.get(name)
            if curves is None:
                self.metrics.append(name)
                curves = self.curves[name] = {r: [] for r in range(self.world_size)}
                self._means[name], self._partial[name] = [], {}
            curves.setdefault(rank, []).append([step, value])
            # The mean at each step, kept as the points arrive: a push must not go over every
            # point of a long run (10 a second).
            partial = self._partial[name].setdefault(step, [0.0, 0])
            partial[0] += value
            partial[1] += 1
            if partial[1] == len(curves):
                del self._partial[name][step]
                means, mean = self._means[name], [step, partial[0] / partial[1]]
                if means and means[-1][0] > step:  # completed out of step order (rare): put in place
                    bisect.insort(means, mean)
                else:
                    means.append(mean)

    @property
    def metric(self) -> str:
        """The name charted first: the first one reported."""
        return self.metrics[0] if self.metrics else ""

    def finish(self, state: str, message: str = "", lost: int = 0) -> None:
        self.state, self.message, self.lost = state, message, lost
        for row in self.rows.values():
            if row.get("state") == "running":
                row["state"] = state if state != "failed" else "stopped"

    def series(self, metric: str | None = None, limit: int = MAX_POINTS) -> dict:
        """One name's curves (default: the first reported): per rank, and the mean at the
        steps every rank reported."""
        name = self.metric if metric is None else metric
        curves = self.curves.get(name, {})
        out = {str(r): _downsample(c, limit) for r, c in sorted(curves.items()) if c}
        means = self._means.get(name, [])
        if means and len(curves) > 1:
            out["mean"] = _downsample(means, limit)
        return out

    def all_series(self, budget: int = POINTS_PER_PUSH, least: int = MIN_POINTS) -> dict:
        """Every name's curves, `budget` points in all (`least` a curve where there are more
        curves than that allows), values to 6 significant digits: what one push carries."""
        count = sum(len(c) + (len(c) > 1) for c in self.curves.values())
        limit = max(least, min(MAX_POINTS, budget // max(count, 1)))
        return {name: {key: [[s, float(f"{v:.6g}")] for s, v in curve]
                       for key, curve in self.series(name, limit).items()}
                for name in self.metrics}

    def progress(self) -> dict:
        steps = [row.get("last_step", -1) + 1 for row in self.rows.values()]
        step = max(steps) if steps else 0
        elapsed = time.monotonic() - self.started
        rates = [r for r in self._rates.values() if r > 0]
        rate = min(rates) if rates else 0.0  # none shown (nor an ETA) until a rank measured one
        info = {"step": step, "elapsed": round(elapsed, 1), "rate": round(rate, 3 if rate < 1 else 1)}
        epochs = [row["epoch"] for row in self.rows.values() if "epoch" in row]
        if epochs:
            info["epoch"] = max(epochs)
        if self.total_steps:
            info["total"] = self.total_steps
            if rate > 0:
                info["eta"] = round(max(0, self.total_steps - step) / rate, 1)
        return info

    def push(self, widget: Dashboard) -> None:
        with widget.hold_sync():  # one message for all traits
            widget.state, widget.message, widget.metric = self.state, self.message, self.metric
            widget.metrics, widget.series, widget.progress = list(self.metrics), self.all_series(), self.progress()
            # Copies: traitlets compares with the previous value, which would share these dicts.
            widget.workers = [dict(self.rows[r]) for r in sorted(self.rows)]
            widget.lost = self.lost
            widget.output = list(self.output)


def _downsample(curve: list[list[float]], limit: int = MAX_POINTS) -> list[list[float]]:
    if len(curve) <= limit:
        return [list(p) for p in curve]
    stride = len(curve) / limit
    picked = [curve[int(i * stride)] for i in range(limit - 1)] + [curve[-1]]
    return [list(p) for p in picked]


def snapshot_html(feed: DashboardFeed) -> str:
    """The dashboard as static HTML + SVG (what the notebook keeps once the kernel is gone)."""
    series = feed.series()
    width, height, pad = 420, 160, 28
    points = [p for curve in series.values() for p in curve]
    lines = []
    if points:
        x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
        y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
        sx = (width - 2 * pad) / ((x1 - x0) or 1)
        sy = (height - 2 * pad) / ((y1 - y0) or 1)
        for name, curve in series.items():
            xy = " ".join(f"{pad + (s - x0) * sx:.1f},{height - pad - (v - y0) * sy:.1f}" for s, v in curve)
            style = ('stroke="#000" stroke-dasharray="4 3"' if name == "mean"
                     else f'stroke="{PALETTE[int(name) % len(PALETTE)]}"')
            label = "mean" if name == "mean" else f"rank {name}"
            lines.append(f'<polyline data-series="{label}" fill="none" stroke-width="1.5" {style} points="{xy}"/>')
        lines.append(f'<text x="{pad}" y="14" font-size="11">{html.escape(feed.metric)} '
                     f'({y0:.4g} to {y1:.4g}), steps {x0:g} to {x1:g}</text>')
    legend = " ".join(
        f'<span data-series="{"mean" if name == "mean" else f"rank {name}"}" style="color:'
        f'{"#000" if name == "mean" else PALETTE[int(name) % len(PALETTE)]}">'
        f'{"- - mean of the ranks" if name == "mean" else f"&mdash; rank {name}"}</span>'
        for name in series)
    progress = feed.progress()
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(row.get(k, '')))}</td>"
                         for k in ("rank", "host", "pid", "device", "state", "last_step", "steps_per_s",
                                   "memory")) + "</tr>"
        for _, row in sorted(feed.rows.items()))
    head = "".join(f"<th>{h}</th>" for h in ("rank", "host", "pid", "device", "state", "last step", "steps/s",
                                             "memory"))
    status = html.escape(f"{feed.state}{': ' + feed.message if feed.message else ''}")
    lost = f" · {feed.lost} points lost" if feed.lost else ""
    return (f'<div class="jupyter-scale-snapshot"><b>jupyter_scale</b> · {status} · step {progress["step"]}'
            f' · {progress["elapsed"]} s{lost}'
            f'<svg width="{width}" height="{height}" style="display:block">{"".join(lines)}</svg>'
            f'<div>{legend}</div>'
            f'<table><tr>{head}</tr>{rows}</table></div>')
