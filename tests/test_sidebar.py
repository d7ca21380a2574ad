"""The sidebar's kernel end, spoken to as the JupyterLab extension does: comm messages to and
from a real kernel driving a real cluster (no browser; test_browser.py has the browser)."""

import json
import re
from pathlib import Path

import pytest

from conftest import SETUP, wait_gone
from jupyter_scale import sidebar as kernel_end
from kernel import Kernel

ROOT = Path(__file__).resolve().parent.parent
# Each shape the kernel sends, by its name in labextension/src/connection.ts.
SHAPES = {"IScaleState": kernel_end.ScaleState, "ICluster": kernel_end.ClusterState, "IRank": kernel_end.RankState,
          "IJob": kernel_end.JobState, "IProgress": kernel_end.ProgressState}


def _keys(shape) -> dict[str, bool]:
    """A TypedDict's keys: whether each is always there."""
    return {k: k in shape.__required_keys__ for k in shape.__required_keys__ | shape.__optional_keys__}


def _conforms(data: dict, shape) -> None:
    keys = _keys(shape)
    assert set(data) <= set(keys), f"{shape.__name__} does not declare {sorted(set(data) - set(keys))}"
    assert {k for k, always in keys.items() if always} <= set(data), f"{shape.__name__}: missing keys in {data}"


def states(result):
    """The state messages the kernel sent, in order; each checked against the declared shapes."""
    found = []
    for comm in result.comms:
        data = comm.get("data") or {}
        if data.get("type") == "state":
            _conforms(data, kernel_end.ScaleState)
            _conforms(data["cluster"], kernel_end.ClusterState)
            for rank in data["ranks"]:
                _conforms(rank, kernel_end.RankState)
            if data["job"] is not None:
                _conforms(data["job"], kernel_end.JobState)
                _conforms(data["job"]["progress"], kernel_end.ProgressState)
            found.append(data)
    return found


def test_the_sidebars_typescript_declares_what_the_kernel_sends():
    text = (ROOT / "labextension" / "src" / "connection.ts").read_text()
    declared = {}
    for name, body in re.findall(r"export interface (\w+) \{\n(.*?)\n\}", text, re.S):
        declared[name] = {m.group(1): m.group(2) != "?"
                          for m in (re.match(r"\s+(\w+)(\??):", line) for line in body.splitlines()) if m}
    for name, shape in SHAPES.items():
        assert declared.get(name) == _keys(shape), f"{name} in connection.ts and {shape.__name__} differ"


def errors(result):
    return [c["data"]["message"] for c in result.comms if (c.get("data") or {}).get("type") == "error"]


@pytest.fixture(scope="module")
def sidebar():
    """A kernel with jupyter_scale loaded and a comm open to it, as an attached sidebar has."""
    k = Kernel()
    _, refused = k.comm_open("jupyter_scale")  # a sidebar showing before %load_ext
    assert [c["msg_type"] for c in refused.comms] == ["comm_close"]
    loaded = k.ok(SETUP)
    # The kernel opens no comm itself (frontends without the extension would log "No handler
    # found for comm target"): the reply to the cell tells a sidebar that is showing.
    assert loaded.comms == []
    assert {"source": "jupyter_scale", "comm_target": "jupyter_scale"} in loaded.payload
    assert k.ok("x = 1").payload == []  # once
    comm_id, answer = k.comm_open("jupyter_scale")  # what the sidebar does on that payload
    assert states(answer)[-1]["cluster"]["running"] is False
    yield k, comm_id
    k.cell("%scale stop", timeout=60)
    leftovers = k.descendants()
    k.shutdown()
    assert wait_gone(leftovers) == []


def test_start_from_the_sidebar_lists_every_rank_idle(sidebar):
    k, comm = sidebar
    state = states(k.comm_send(comm, {"action": "start", "workers": 2}))[-1]
    assert state["cluster"]["running"] is True and state["cluster"]["workers"] == 2
    assert state["cluster"]["engine"] == "ipyparallel"
    assert state["cluster"]["addresses"]["controller"].startswith("tcp://127.0.0.1:")
    ranks = state["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["state"] for r in ranks} == {"idle"}
    assert {r["pid"] for r in ranks} <= {p.pid for p in k.descendants()}
    assert all(r["host"] and r["device"] == "cpu" for r in ranks)


def test_a_running_job_streams_progress_and_its_curve_then_finishes(sidebar):
    k, comm = sidebar
    seen = []
    out = k.cell("%%distribute --steps 40\nimport time\nfor i in range(40):\n"
                 "    report(loss=1.0 / (i + 1) + rank)\n    time.sleep(0.05)",
                 on_comm=lambda kind, content: seen.append(content.get("data", {})))
    assert out.ok, out.error_text
    jobs = [s["job"] for s in states(out) if s["job"]]
    running = [j for j in jobs if j["status"] == "running"]
    assert len(running) >= 2  # live updates while the cell runs, not only at the end
    assert any(0 < (j["fraction"] or 0) < 1 for j in running)
    assert any(r["state"] == "running" for s in states(out) for r in s["ranks"])
    last = states(out)[-1]
    assert last["job"]["status"] == "finished" and last["job"]["fraction"] == 1.0
    assert last["job"]["metric"] == "loss" and last["job"]["metrics"] == ["loss"]
    curves = last["job"]["series"]["loss"]
    assert set(curves) == {"0", "1", "mean"} and len(curves["0"]) == 40
    assert [r["state"] for r in last["ranks"]] == ["idle", "idle"]
    assert all(r["last_step"] == 39 and r["memory"].endswith(" MB") for r in last["ranks"])
    assert len(json.dumps(last)) < 20_000  # a state message stays small


def test_a_rank_waiting_in_a_collective_and_a_failed_rank_are_shown(sidebar):
    k, comm = sidebar
    k.ok("jupyter_scale.get_session().heartbeat_interval = 0.3")
    try:
        out = k.cell("%%distribute\nimport time\nif rank == 1:\n    time.sleep(2)\n    raise ValueError('bad')\n"
                     "dist.all_reduce(torch.ones(1))", timeout=120)
    finally:
        k.ok("jupyter_scale.get_session().heartbeat_interval = 5.0")
    assert not out.ok
    waiting = [r for s in states(out) for r in s["ranks"] if r["state"] == "in collective"]
    assert waiting and waiting[0]["rank"] == 0 and waiting[0]["collective"] == "all_reduce"
    last = states(out)[-1]
    assert last["job"]["status"] == "failed" and "rank 1 failed: ValueError: bad" in last["job"]["error"]
    assert [r["state"] for r in last["ranks"]] == ["idle", "failed"]  # rank 0 was only stopped


def test_a_worker_that_died_between_cells_is_shown_dead(sidebar):
    import time

    import psutil

    k, comm = sidebar
    pid = states(k.comm_send(comm, {"action": "refresh"}))[-1]["ranks"][1]["pid"]
    psutil.Process(pid).kill()
    deadline = time.monotonic() + 30  # the engine notices within a few heartbeats
    while True:
        ranks = states(k.comm_send(comm, {"action": "refresh"}))[-1]["ranks"]
        if ranks[1]["state"] == "dead":
            break
        assert time.monotonic() < deadline, ranks
        time.sleep(0.5)
    assert ranks[0]["state"] == "idle"
    state = states(k.comm_send(comm, {"action": "restart"}))[-1]
    assert [r["state"] for r in state["ranks"]] == ["idle", "idle"]


def test_resize_restart_stop_and_a_bad_action_from_the_sidebar(sidebar):
    k, comm = sidebar
    state = states(k.comm_send(comm, {"action": "resize", "workers": 3}))[-1]
    assert state["cluster"]["workers"] == 3 and len(state["ranks"]) == 3
    pids = {r["pid"] for r in state["ranks"]}
    state = states(k.comm_send(comm, {"action": "restart"}))[-1]
    assert len(state["ranks"]) == 3 and not pids & {r["pid"] for r in state["ranks"]}
    bad = k.comm_send(comm, {"action": "resize", "workers": 0})
    assert errors(bad) == ["resize: workers must be at least 1, not 0"]
    assert errors(k.comm_send(comm, {"action": "explode"})) == ["explode: unknown action 'explode'"]
    assert states(bad)[-1]["cluster"]["workers"] == 3  # nothing changed
    started = k.descendants()
    state = states(k.comm_send(comm, {"action": "stop"}))[-1]
    assert state["cluster"]["running"] is False and state["ranks"] == []
    assert wait_gone(started) == [] and k.descendants() == []


def test_the_python_and_npm_packages_have_one_version():
    import jupyter_scale

    package = json.loads((ROOT / "labextension" / "package.json").read_text())
    assert package["version"] == jupyter_scale.__version__


def test_a_state_stays_small_with_many_ranks_and_names():
    # Every name's curves go in each state (the sidebar switches among them while the cell runs).
    from jupyter_scale.widgets import DashboardFeed

    feed = DashboardFeed(world_size=8)
    for i in range(5000):
        for r in range(8):
            feed.add({"rank": r, "step": i, "time": 1.0 + i,
                      **{name: 1.0 / (i + 1) + r for name in ("loss", "acc", "lr", "grad_norm", "tokens")}})
    series = feed.all_series(budget=kernel_end.SERIES_BUDGET, least=kernel_end.SERIES_LEAST)
    assert set(series) == {"loss", "acc", "lr", "grad_norm", "tokens"}
    assert all(len(curve) >= kernel_end.SERIES_LEAST for curves in series.values() for curve in curves.values())
    assert len(json.dumps(series)) < 15_000
