"""Unit tests for the worker-side helpers that need no cluster."""

import os
import socket
import subprocess
import sys

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import jupyter_scale
from jupyter_scale import metrics, rendezvous, sampling
from jupyter_scale.display import LineLabeler
from jupyter_scale.errors import RankFailure, RemoteError


def test_helpers_are_no_ops_outside_distribute():
    model = torch.nn.Linear(2, 2)
    data = TensorDataset(torch.randn(10, 2))
    loader = DataLoader(data, batch_size=2)
    assert jupyter_scale.wrap(model) is model
    assert jupyter_scale.shard(loader) is loader
    assert jupyter_scale.shard(data) is data


def test_epoch_aware_sampler_reshuffles_each_pass_and_honours_set_epoch():
    data = list(range(20))
    sampler = sampling.EpochAwareSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    first, second = list(sampler), list(sampler)
    assert first != second  # a new pass is a new epoch
    sampler.set_epoch(0)
    assert list(sampler) == first  # explicit set_epoch wins
    assert list(sampler) == second  # ...and counting resumes after it
    other = sampling.EpochAwareSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    assert sorted(first + list(other)) == data  # disjoint shards covering the data


@pytest.mark.parametrize(
    "backend, local_rank, count, expected",
    [("nccl", 0, 2, "cuda:0"), ("nccl", 3, 2, "cuda:1"), ("gloo", 1, 0, "cpu"), ("gloo", 1, 4, "cpu")],
)
def test_device_per_local_rank(backend, local_rank, count, expected):
    assert str(rendezvous.select_device(backend, local_rank, count)) == expected


def test_backend_choice():
    assert rendezvous.select_backend([0, 0]) == "gloo"
    assert rendezvous.select_backend([1, 0]) == "gloo"  # NCCL needs a GPU on every rank
    expected = "nccl" if torch.distributed.is_nccl_available() else "gloo"
    assert rendezvous.select_backend([2, 2]) == expected


def test_store_listens_on_loopback_only_at_a_free_port():
    store, port = rendezvous.open_store(rendezvous.LOOPBACK, 1, timeout=5)
    try:
        listening = [c for c in psutil.Process().net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)
        store.set("k", "v")
        assert store.get("k") == b"v"
        second, port2 = rendezvous.open_store(rendezvous.LOOPBACK, 1, timeout=5)
        assert port2 != port
        del second
    finally:
        del store


def test_report_records_scalars_with_rank_and_step():
    recorder = metrics.Recorder(rank=3)
    recorder.report(loss=torch.tensor(0.5))
    recorder.report(loss=0.25, acc=1, epoch=2)
    recorder.report(step=10, loss=0.1)
    points = recorder.drain()
    assert [(p["rank"], p["step"]) for p in points] == [(3, 0), (3, 1), (3, 10)]
    assert points[0]["loss"] == 0.5 and points[1]["epoch"] == 2 and points[1]["acc"] == 1.0
    with pytest.raises(ValueError):
        recorder.report(loss=torch.ones(3))
    with pytest.raises(TypeError):
        recorder.report(loss="high")
    with pytest.raises(TypeError):
        recorder.report()


def test_line_labels_keep_partial_lines_per_rank():
    labeler = LineLabeler()
    assert labeler.feed(0, "stdout", "hel") == ""
    assert labeler.feed(1, "stdout", "a\nb") == "[rank 1] a\n"
    assert labeler.feed(0, "stdout", "lo\n") == "[rank 0] hello\n"
    assert labeler.flush() == [("stdout", "[rank 1] b\n")]
    # Progress bars redraw with \r: each redraw is shown (and labelled) as it comes.
    assert labeler.feed(0, "stderr", " 10%|#\r") == "[rank 0]  10%|#\r"
    assert labeler.feed(0, "stderr", " 20%|##\r\n") == "[rank 0]  20%|##\r\n"
    # ... also when the \r\n comes in two writes: no blank line is made up.
    assert labeler.feed(0, "stderr", " 30%|###\r") == "[rank 0]  30%|###\r"
    assert labeler.feed(0, "stderr", "\n") == "\n"
    assert labeler.feed(0, "stderr", "\n") == "[rank 0] \n"  # a blank line of its own


def _lines_run(code, call) -> int:
    """Lines of Python that `call()` ran in function `code`: work counted, not timed."""
    count = 0

    def count_lines(frame, event, arg):
        nonlocal count
        count += event == "line"
        return count_lines

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: count_lines if frame.f_code is code else None)
    try:
        call()
    finally:
        sys.settrace(previous)
    return count


def test_one_character_writes_are_each_scanned_once():
    # A process that prints a character at a time (a progress dot per step): each write
    # costs the same, however long the line so far. (Re-scanning it made 20k writes 14 s.)
    labeler, text = LineLabeler(), ("x" * 999 + "\n") * 2
    out = []
    work = _lines_run(LineLabeler.feed.__code__, lambda: out.extend(labeler.feed(3, "stdout", ch) for ch in text))
    assert "".join(out) == f"[rank 3] {'x' * 999}\n" * 2
    assert work < 20 * len(text), work  # a few lines per write, not a pass over the line
    labeler = LineLabeler()
    out = [labeler.feed(0, "stdout", ch) for ch in "y" * 20_000]
    assert "".join(out) == "" and labeler.flush() == [("stdout", f"[rank 0] {'y' * 20_000}\n")]


def test_a_line_that_never_ends_is_shown_at_64_kb():
    labeler = LineLabeler()
    assert labeler.feed(1, "stdout", "z" * (64 * 1024 - 1)) == ""
    assert labeler.feed(1, "stdout", "z") == f"[rank 1] {'z' * 64 * 1024}\n"  # shown, and no longer held
    assert labeler.feed(1, "stdout", "rest\n") == "[rank 1] rest\n"
    assert labeler.flush() == []


def test_remote_error_blames_the_first_real_failure():
    failures = [
        RankFailure(0, "RuntimeError", "Connection closed by peer", "tb0", time=2.0),
        RankFailure(2, "KeyboardInterrupt", "", "tb2", time=1.5, interrupted=True),
        RankFailure(1, "ValueError", "bad", "Traceback...\nValueError: bad", time=1.0),
    ]
    error = RemoteError(failures)
    assert error.rank == 1 and error.etype == "ValueError"
    assert str(error).startswith("rank 1 failed: ValueError: bad")
    rendered = "\n".join(error._render_traceback_())
    assert "--- rank 1 traceback ---" in rendered and "rank 0: RuntimeError" in rendered


def test_a_timeout_names_the_rank_the_others_waited_for():
    from jupyter_scale.errors import CellTimeout

    failures = [
        RankFailure(0, "RuntimeError", "Connection closed by peer", "tb0", time=1.0, collective="all_reduce"),
        RankFailure(1, "KeyboardInterrupt", "", "Traceback...\n    time.sleep(60)", time=2.0, interrupted=True),
    ]
    error = CellTimeout(failures, timeout=10)
    assert isinstance(error, TimeoutError) and isinstance(error, RemoteError)
    assert error.rank == 1 and error.silent_ranks == [1] and error.waiting_ranks == [0]
    assert str(error) == ("still running after --timeout 10 s: rank(s) [1] never reached the all_reduce "
                          "that rank(s) [0] waited in")
    rendered = error._render_traceback_()
    assert rendered[0] == "--- rank 1 traceback ---" and "time.sleep(60)" in rendered[2]
    assert "  rank 0: RuntimeError: Connection closed by peer (in all_reduce)" in rendered
    assert "raise --timeout" in rendered[-1] and "reusable" in rendered[-1]

    # One rank finished the cell while the other waited for it in a collective.
    alone = CellTimeout([RankFailure(0, "RuntimeError", "cut", "tb", collective="all_reduce")], timeout=3, finished=[1])
    assert "rank(s) [0] waited in all_reduce, which rank(s) [1] never joined" in str(alone)
    assert "same collectives" in alone.hint
    mismatch = CellTimeout([RankFailure(0, "RuntimeError", "cut", "tb", collective="all_reduce"),
                            RankFailure(1, "RuntimeError", "cut", "tb", collective="broadcast")], timeout=3)
    assert "different collectives (rank 0 in all_reduce, rank 1 in broadcast)" in str(mismatch)
    busy = CellTimeout([RankFailure(r, "KeyboardInterrupt", "", "tb", interrupted=True) for r in (0, 1)], timeout=5)
    assert str(busy) == "still running after --timeout 5 s: rank(s) [0, 1] were still computing"
    assert busy.failures[0].etype == "TimeoutError" and not busy.failures[0].interrupted


def test_a_dead_worker_is_the_cause_and_keeps_the_engines_error():
    from jupyter_scale.errors import WorkerDied, WorkerLost

    cause = WorkerLost(1, "its engine died while running the cell")
    failures = [
        RankFailure(0, "RuntimeError", "Connection reset by peer", "tb0", time=1.0, collective="all_reduce"),
        RankFailure(1, "WorkerLost", f"{cause} (its process 42 killed by SIGKILL)", "", time=3.0, lost=True,
                    cause=cause),
    ]
    error = WorkerDied(failures)
    assert error.rank == 1 and error.__cause__ is cause
    assert str(error).startswith("rank 1 failed: WorkerLost: worker for rank 1 was lost")
    assert "killed by SIGKILL" in str(error)
    assert "restarts the cluster" in error._render_traceback_()[-1]


def test_loopback_interface_exists():
    name = rendezvous.loopback_interface()
    assert name and name in {n for _, n in socket.if_nameindex()}


def _host(name, node, address, *interfaces):
    return {"hostname": name, "node": node, "address": address,
            "interfaces": [{"name": n, "address": a, "prefixlen": p} for n, a, p in interfaces]}


def test_the_rendezvous_is_rank_0s_address_on_the_other_hosts_network():
    # rank 0's host has a management interface (routed toward the controller) and the
    # cluster network that the other hosts are on: the ranks meet on the latter.
    workers = [_host("a", "n0", "10.9.0.4", ("mgmt", "10.9.0.4", 24), ("ib0", "192.168.7.1", 24)),
               _host("a", "n0", "10.9.0.4", ("mgmt", "10.9.0.4", 24), ("ib0", "192.168.7.1", 24)),
               _host("b", "n1", "192.168.7.2", ("ib0", "192.168.7.2", 24))]
    assert rendezvous.choose_rendezvous_address(workers) == "192.168.7.1"
    # No shared network: where rank 0 reaches the cluster from (a routed network).
    workers[2] = _host("b", "n1", "172.16.0.9", ("eth0", "172.16.0.9", 16))
    assert rendezvous.choose_rendezvous_address(workers) == "10.9.0.4"
    # The user's choice: an address of rank 0's, or a network to take rank 0's address in.
    assert rendezvous.choose_rendezvous_address(workers, "192.168.7.1") == "192.168.7.1"
    assert rendezvous.choose_rendezvous_address(workers, "192.168.0.0/16") == "192.168.7.1"
    with pytest.raises(ValueError, match=r"10.1.2.3 is not rank 0's: rank 0 \(host a\) has 10.9.0.4, 192.168.7.1"):
        rendezvous.choose_rendezvous_address(workers, "10.1.2.3")
    with pytest.raises(ValueError, match="rendezvous network 10.77.0.0/16: .* none in it"):
        rendezvous.choose_rendezvous_address(workers, "10.77.0.0/16")
    # Nothing but loopback toward the cluster and no network in common: say what there is.
    # Every rank on one host that reaches its controller over loopback (a tunnel): loopback.
    assert rendezvous.choose_rendezvous_address([_host("a", "n0", "127.0.0.1")] * 2) == "127.0.0.1"
    lonely = [_host("a", "n0", "127.0.0.1"), _host("b", "n1", "172.16.0.9", ("eth0", "172.16.0.9", 16))]
    with pytest.raises(ValueError, match="no address to meet at: .* choose one with %scale connect --rendezvous"):
        rendezvous.choose_rendezvous_address(lonely)


@pytest.fixture
def torchrun_env(monkeypatch):
    """set_torchrun_env writes os.environ: whatever it sets is undone afterwards (the kernels
    later tests start inherit this process's environment)."""
    saved = dict(os.environ)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(rendezvous, "_gloo_interface_set", None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_gloo_listens_on_the_interface_toward_the_rendezvous(torchrun_env):
    env = dict(rank=1, world_size=2, local_rank=0, local_world_size=1, master_port=1234)
    rendezvous.set_torchrun_env(master_addr="127.0.0.1", **env)
    assert os.environ["GLOO_SOCKET_IFNAME"] == rendezvous.loopback_interface()
    own = rendezvous.interfaces()
    if own:  # a group across hosts that meets at this host's address: that address's interface
        rendezvous.set_torchrun_env(master_addr=own[0]["address"], group_rank=1, **env)
        assert os.environ["GLOO_SOCKET_IFNAME"] == own[0]["name"]
        assert os.environ["GROUP_RANK"] == "1"
    os.environ["GLOO_SOCKET_IFNAME"] = "users-own"  # set by the user: kept
    rendezvous.set_torchrun_env(master_addr="127.0.0.1", **env)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "users-own"


def test_processes_share_a_node_when_they_share_a_network_stack():
    here = rendezvous.node_identity()
    assert here == rendezvous.node_identity() and "net:[" in here
    other = subprocess.run(["unshare", "--net", sys.executable, "-c",
                            "from jupyter_scale import rendezvous; print(rendezvous.node_identity())"],
                           capture_output=True, text=True, timeout=60)
    if other.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {other.stderr.strip()[-200:]}")
    assert other.stdout.strip() != here and other.stdout.split("/")[0] == here.split("/")[0]


def test_default_engine_comes_from_config_then_environment(monkeypatch):
    from traitlets.config import Config

    from jupyter_scale.session import ScaleSession

    monkeypatch.delenv("JUPYTER_SCALE_BACKEND", raising=False)
    assert ScaleSession(namespace={}).backend_name == "ipyparallel"
    monkeypatch.setenv("JUPYTER_SCALE_BACKEND", "dask")
    assert ScaleSession(namespace={}).backend_name == "dask"
    config = Config()
    config.ScaleSession.backend_name = "ipyparallel"
    assert ScaleSession(namespace={}, config=config).backend_name == "ipyparallel"  # config wins


def test_every_engine_is_found_through_the_entry_point_group():
    from jupyter_scale.backends import Backend, available_backends, create_backend

    found = available_backends()
    assert {"ipyparallel", "dask"} <= set(found)
    for name in ("ipyparallel", "dask"):
        backend = create_backend(name)
        assert isinstance(backend, Backend) and backend.name == name and not backend.running


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_the_end_marker_is_taken_out_however_the_pipe_watcher_cuts_the_text(chunk):
    """What a watched file descriptor carried reaches the call whole, without the markers
    that end calls (this one's, and a late one of a wait that gave up), in whatever pieces
    the kernel's pipe watcher reads it."""
    import threading

    from jupyter_scale import capture

    sent = []
    pump = capture.OutputPump(sent.append, "job", 0)
    read_end, write_end = os.pipe()  # where expect() writes the marker (the watcher here is this thread)
    forward = capture._Forward("stdout", lambda text: pytest.fail(f"fell back: {text!r}"), lambda: None,
                               fd=write_end, watcher=threading.current_thread())
    marker = "\x1b]jupyter_scale;0123abcd\x07"
    forward.expect(marker)
    text = ("out \x1b]8;;link\x07 \x1b]jupyter_scale;0 almost\n" + marker
            + "\x1b]jupyter_scale;deadbeef\x07after\n")
    capture._current = pump
    try:
        for start in range(0, len(text), chunk):
            forward.write(text[start:start + chunk])
        assert forward.arrived(0)
    finally:
        capture._current = None
        pump.close()
        os.close(read_end)
        os.close(write_end)
    received = "".join(part[1] for message in sent for part in message["parts"])
    assert received == "out \x1b]8;;link\x07 \x1b]jupyter_scale;0 almost\nafter\n"
