"""The kernel's end of the JupyterLab sidebar: a comm target named `jupyter_scale`.

The sidebar (labextension/) opens a comm to this target when it attaches to a notebook's
kernel (also after a page reload), and the kernel opens one to the frontend when
`%load_ext jupyter_scale` runs, so a sidebar that was already open learns of it. Over it:

kernel -> sidebar   {"type": "state", "cluster": {...}, "ranks": [...], "job": {...} | None}
                    on open, after every action, and while a cell runs at most every 0.25 s;
                    {"type": "error", "message": "..."} when an action failed.
sidebar -> kernel   {"action": "refresh" | "start" | "stop" | "restart" | "resize", "workers": N}

Actions arrive on the kernel's shell channel, so they run between cells; interrupting a
running job is the kernel's own interrupt (the sidebar calls it), which %%distribute passes
to every rank. The state is built from the same event stream as the cell's dashboard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, TypedDict, cast

from ._version import __version__
from .errors import DistributeError
from .widgets import PALETTE, DashboardFeed

log = logging.getLogger(__name__)

COMM_TARGET = "jupyter_scale"
PUSH_INTERVAL = 0.25  # seconds between state messages while a cell runs
SERIES_BUDGET, SERIES_LEAST = 600, 10  # chart points in a state message, in all and at least a curve


# What the sidebar is sent. labextension/src/connection.ts declares the same shapes (its
# IScaleState, ICluster, IRank, IJob, IProgress); tests/test_sidebar.py checks the two agree.
class ClusterState(TypedDict):
    running: bool
    engine: str
    workers: int
    connected: bool
    addresses: dict[str, str]  # what the engine says where it is (scheduler, dashboard ...)
    group: dict  # the process group: backend, master_addr, master_port, ready


class _RankShown(TypedDict):
    rank: int
    state: str  # idle, starting, running, in collective, finished, failed, stopped, dead
    pid: int | None
    host: str | None
    device: str


class RankState(_RankShown, total=False):  # and, once it reported them:
    memory: str
    last_step: int
    steps_per_s: float
    epoch: int
    collective: str  # while it waits in one
    waiting_s: float


class _Progress(TypedDict):
    step: int
    rate: float
    elapsed: float


class ProgressState(_Progress, total=False):
    total: int  # given --steps
    eta: float
    epoch: int


class JobState(TypedDict):
    index: int
    status: str  # running, finished, failed, interrupted, timed out
    error: str
    workers: int
    metric: str  # the one charted first (the first reported)
    metrics: list[str]  # every reported name, in the order first seen
    series: dict[str, dict[str, list[list[float]]]]  # name -> "0", "1", ..., "mean" -> [[step, value], ...]
    colors: list[str]  # the ranks' curves in turn
    progress: ProgressState
    fraction: float | None


class ScaleState(TypedDict):
    type: str  # "state"
    version: str
    cluster: ClusterState
    ranks: list[RankState]
    job: JobState | None


class SidebarChannel:
    """Session observer that keeps every attached sidebar up to date."""

    def __init__(self, session: Any):
        self.session = session
        self.comms: dict[str, Any] = {}  # comms a sidebar holds: they get every state
        self.feed: DashboardFeed | None = None
        self.record: Any = None  # the RunRecord of the current or last job
        self._pushed_at = 0.0
        session.observers.append(self)

    # -- comms ---------------------------------------------------------------------
    def register(self, shell: Any) -> bool:
        """Register the comm target in `shell`'s kernel and tell an open sidebar.
        False where there is no kernel (plain IPython, scripts): nothing to attach to."""
        if getattr(shell, "kernel", None) is None:
            return False
        from comm import get_comm_manager

        get_comm_manager().register_target(COMM_TARGET, self._on_open)
        # A sidebar already showing opens its comm when the reply to this cell carries this
        # payload. Frontends ignore payloads they do not know; a comm opened from here would
        # make every frontend without the extension (nbclient, nbval, nbconvert) log
        # "No handler found for comm target".
        payloads = getattr(shell, "payload_manager", None)
        if payloads is not None:
            payloads.write_payload({"source": COMM_TARGET, "comm_target": COMM_TARGET})
        return True

    def _on_open(self, comm: Any, open_msg: dict) -> None:
        self._attach(comm)
        comm.send(self.state())

    def _attach(self, comm: Any) -> None:
        self.comms[comm.comm_id] = comm
        comm.on_msg(lambda msg, comm=comm: self._on_msg(comm, msg))
        comm.on_close(lambda msg, comm_id=comm.comm_id: self.comms.pop(comm_id, None))

    def _on_msg(self, comm: Any, msg: dict) -> None:
        data = msg.get("content", {}).get("data", {}) or {}
        action = data.get("action")
        try:
            self.act(action, data.get("workers"))
        except (DistributeError, ValueError) as exc:  # the answer goes to the sidebar that asked
            comm.send({"type": "error", "message": f"{action}: {exc}"})
        except Exception as exc:  # a sidebar button must never leave the user without an answer
            log.exception("sidebar action %s failed", action)
            comm.send({"type": "error", "message": f"{action}: {type(exc).__name__}: {exc}"})
        self.push(force=True)

    def act(self, action: str | None, workers: Any = None) -> None:
        """What a sidebar button does (between cells)."""
        n = None if workers is None else int(workers)
        if n is not None and n < 1:
            raise ValueError(f"workers must be at least 1, not {n}")
        session = self.session
        if action == "refresh":
            return
        if action == "start":
            session.start(n)
        elif action == "stop":
            session.stop()
        elif action == "restart":
            session.restart(n)
        elif action == "resize":
            if n is None:
                raise ValueError("resize needs a number of workers")
            session.restart(n) if session.running else session.start(n)
        else:
            raise ValueError(f"unknown action {action!r}")

    def broadcast(self, message: Mapping[str, Any]) -> None:
        for comm_id, comm in list(self.comms.items()):
            try:
                comm.send(message)
            except Exception:  # a closed frontend: forget it
                log.debug("sidebar comm %s failed", comm_id, exc_info=True)
                self.comms.pop(comm_id, None)

    def push(self, force: bool = False) -> None:
        if not self.comms:
            return
        now = time.monotonic()
        if force or now - self._pushed_at >= PUSH_INTERVAL:
            self._pushed_at = now
            self.broadcast(self.state())

    # -- session observer ----------------------------------------------------------
    def run_started(self, record: Any, total_steps: int | None) -> None:
        self.record = record
        self.feed = DashboardFeed(record.workers, total_steps)
        self.push(force=True)

    def event(self, event: dict) -> None:
        if self.feed is not None and event.get("kind") != "heartbeat":
            self.feed.add(event)

    def tick(self) -> None:
        self.push()

    def run_finished(self, record: Any) -> None:
        if self.feed is not None:
            self.feed.finish(record.status, record.error, record.lost_events)
        self.push(force=True)

    def cluster_changed(self) -> None:
        self.push(force=True)

    # -- what the sidebar shows ----------------------------------------------------
    def state(self) -> ScaleState:
        session = self.session
        info = session.status()
        cluster: ClusterState = {
            "running": info["running"],
            "engine": info["backend"],
            "workers": info["workers"],
            "connected": info["connected"],
            "addresses": {k: v for k, v in info.items() if isinstance(v, str) and k not in ("backend",)},
            "group": info.get("group", {}),
        }
        return {"type": "state", "version": __version__, "cluster": cluster, "ranks": self._ranks(info),
                "job": self._job()}

    def _ranks(self, info: dict) -> list[RankState]:
        if not info["running"]:
            return []
        running = self.record is not None and self.record.status == "running"
        lost = set(info.get("lost", []))
        if not running:  # between cells: a worker may have died since the last cell
            lost |= set(self.session.backend.dead_ranks())
        rows = []
        now = time.time()
        for described in info.get("ranks", []):
            rank = described["rank"]
            row: RankState = {"rank": rank, "pid": described.get("pid"), "host": described.get("hostname"),
                   "device": described.get("device", ""), "state": "idle"}
            fed = self.feed.rows.get(rank, {}) if self.feed is not None else {}
            if fed.get("pid") != row["pid"]:  # the job ran on workers since replaced
                fed = {}
            for key in ("last_step", "steps_per_s", "memory", "epoch"):
                if key in fed:
                    row[key] = fed[key]
            if running:
                row["state"] = fed.get("state", "starting")
                beat = self.session.beats.get(rank) or {}
                if row["state"] == "running" and beat.get("collective"):
                    row["state"] = "in collective"
                    row["collective"] = beat["collective"]
                    row["waiting_s"] = round(now - beat["since"], 1)
            elif fed and rank == self.record.failed_rank and self.record.status != "interrupted":
                row["state"] = "failed"  # the rank the error blames, until the next cell
            if rank in lost:
                row["state"] = "dead"
            rows.append(row)
        return rows

    def _job(self) -> JobState | None:
        record, feed = self.record, self.feed
        if record is None or feed is None:
            return None
        progress = cast(ProgressState, feed.progress())
        total = progress.get("total")
        return {
            "index": record.index,
            "status": record.status,
            "error": record.error,
            "workers": record.workers,
            "metric": feed.metric,
            "metrics": list(feed.metrics),
            # Every name's, few points each (a 240 px chart; a state goes out 4 times a second):
            # the sidebar switches among them while the cell runs, when the kernel answers nothing.
            "series": feed.all_series(budget=SERIES_BUDGET, least=SERIES_LEAST),
            "colors": PALETTE,
            "progress": progress,
            "fraction": min(1.0, progress["step"] / total) if total else None,
        }
