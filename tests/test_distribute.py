"""%%distribute end to end: a real kernel, a real ipyparallel or Dask cluster, real gloo."""

import re
import threading

import psutil
import pytest

from conftest import ENGINES, on_engines, ranks_of, wait_gone

MODEL = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    def forward(self, x):
        return self.body(x)

torch.manual_seed(0)
model = Net()
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(1024, 16, generator=g), torch.randint(0, 4, (1024,), generator=g))
before = [p.detach().clone() for p in model.parameters()]
"""

TRAIN = """%%distribute --workers 2
model = jupyter_scale.wrap(model)
loader = jupyter_scale.shard(DataLoader(data, batch_size=32, shuffle=True))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        report(loss=loss)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
steps_seen = len(loader) * 2
print("trained", rank)
"""


@pytest.fixture(scope="module")
def trained(kernel):
    kernel.ok(MODEL)
    result = kernel.ok(TRAIN, timeout=240)
    return result


@on_engines(ENGINES)
def test_notebook_model_gets_rank0_weights_and_ranks_are_bitwise_equal(kernel, trained):
    kernel.ok("""
ranks_weights = jupyter_scale.get_session().gather("weights")
local = torch.cat([p.detach().flatten() for p in model.parameters()])
assert len(ranks_weights) == 2
assert torch.equal(ranks_weights[0], ranks_weights[1]), "ranks diverged"
assert torch.equal(local, ranks_weights[0]), "notebook model != rank 0"
assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "model did not change"
assert type(model).__name__ == "Net"   # the notebook object, updated in place
""")


def test_each_rank_trained_on_its_own_shard(kernel, trained):
    # 1024 samples / 2 ranks / batch 32 = 16 steps per epoch on each rank.
    assert kernel.value("jupyter_scale.get_session().gather('steps_seen')") == [32, 32]
    counts = kernel.value("[sum(1 for p in jupyter_scale.history() if p['rank'] == r) for r in (0, 1)]")
    assert counts == [32, 32]  # every report() of both ranks is in the history


@on_engines(ENGINES)
def test_second_cell_sees_worker_variables(kernel, trained):
    out = kernel.ok("""%%distribute
print("still here", rank, type(opt).__name__, steps_seen, float(loss) > 0)
""")
    assert "[rank 0] still here 0 SGD 32 True" in out.stdout
    assert "[rank 1] still here 1 SGD 32 True" in out.stdout
    # `model` was pulled back after training: the notebook and the workers agree, so it
    # is not sent again (which would replace the workers' DDP model with a plain Net).
    kernel.ok("%%distribute\nassert type(model).__name__ == 'DistributedDataParallel', type(model)")
    assert "model" in kernel.value("jupyter_scale.get_session().runs[-1].skipped")


def test_optimizer_built_in_the_notebook_trains_the_shipped_model(kernel):
    # opt holds model's parameters: on the workers it must hold the same tensors.
    kernel.ok("lin = nn.Linear(4, 1)\nlin_opt = torch.optim.SGD(lin.parameters(), lr=0.5)\n"
              "lin_before = lin.weight.detach().clone()")
    kernel.ok("""%%distribute
for _ in range(3):
    lin_opt.zero_grad()
    lin(torch.ones(2, 4)).sum().backward()
    lin_opt.step()
assert lin_opt.param_groups[0]["params"][0] is lin.weight
""")
    assert kernel.value("bool((lin.weight != lin_before).all())") is True

def test_output_is_labelled_by_rank(kernel):
    out = kernel.ok("%%distribute\nprint(rank)\nimport sys\nprint('err', rank, file=sys.stderr)")
    assert "[rank 0] 0\n" in out.stdout and "[rank 1] 1\n" in out.stdout
    assert "[rank 0] err 0\n" in out.stderr and "[rank 1] err 1\n" in out.stderr


@on_engines(ENGINES)
def test_output_arrives_while_the_cell_runs(kernel, tmp_path):
    # The workers block until the test has seen their first line: if output only came
    # at the end, the workers would wait out their deadline and the cell would fail.
    flag = tmp_path / "seen"
    seen = threading.Event()

    def on_stream(name, text):
        if "[rank 1] waiting" in text:
            flag.write_text("ok")
            seen.set()

    out = kernel.cell(f"""%%distribute
import time, pathlib
print("waiting", flush=True)
deadline = time.time() + 60
while not pathlib.Path({str(flag)!r}).exists():
    assert time.time() < deadline, "the kernel never saw my output"
    time.sleep(0.05)
print("released")
""", on_stream=on_stream)
    assert out.ok, out.error_text
    assert seen.is_set()
    assert "[rank 0] released" in out.stdout


@on_engines(["dask"])
def test_the_dask_scheduler_keeps_no_history_of_the_output(kernel):
    if kernel.backend != "dask":
        pytest.skip("Dask's scheduler keeps events by topic; ipyparallel's controller runs with --nodb")
    out = kernel.ok("%%distribute\nimport time\nfor i in range(60):\n"
                    "    print('line', i, flush=True)\n    report(loss=float(i))\n    time.sleep(0.06)")
    assert out.stdout.count("] line ") == 120  # in some 150 output batches, and metrics batches
    kernel.ok("session = jupyter_scale.get_session()\n"
              "topics = [session.backend._output_topic, session.events.address.split('://')[1]]")
    kept = kernel.value("session.backend.client.run_on_scheduler(lambda dask_scheduler, topics=topics: ("
                        "[len(dask_scheduler.get_events(t)) for t in topics], "
                        "[len(c.recent_message_log) for c in dask_scheduler.client_comms.values()]))")
    assert max(kept[0] + kept[1]) <= 16, kept  # the scheduler's events of our topics, and its stream to us


def test_torchrun_environment_and_injected_names(kernel):
    out = kernel.ok("""%%distribute
import os
env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
assert env["RANK"] == str(rank) == str(dist.get_rank())
assert env["WORLD_SIZE"] == str(world_size) == "2"
assert env["LOCAL_RANK"] == str(local_rank) and env["LOCAL_WORLD_SIZE"] == "2"
assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
assert dist.get_backend() == "gloo" and str(device) == "cpu"
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print("sum", t.item(), "port", env["MASTER_PORT"])
""")
    assert "[rank 0] sum 3.0" in out.stdout and "[rank 1] sum 3.0" in out.stdout


def test_torchrun_style_cell_runs_unchanged(kernel):
    # What a torchrun script does: init from the environment, work, destroy.
    script = """%%distribute
import os
dist.init_process_group("gloo")   # the group exists already: a no-op
t = torch.tensor([float(os.environ["RANK"])])
dist.all_reduce(t)
print("sum", t.item(), "world", dist.get_world_size())
dist.destroy_process_group()
"""
    for _ in range(2):  # the next cell forms the group again
        out = kernel.ok(script)
        assert "[rank 1] sum 1.0 world 2" in out.stdout
    out = kernel.ok("%%distribute\ndist.destroy_process_group()\ndist.init_process_group('gloo')\n"
                    "t = torch.ones(1)\ndist.all_reduce(t)\nprint('again', t.item())")
    assert "[rank 0] again 2.0" in out.stdout


def test_rank_stuck_in_a_collective_is_freed(kernel):
    # Only rank 0 enters the collective; rank 1 goes on (in manual mode it returns, in
    # automatic mode it waits in the end-of-cell buffer sync). --timeout ends it anyway.
    for flags in ("--manual", ""):
        out = kernel.cell(f"%%distribute --timeout 3 {flags}\nif rank == 0:\n    dist.all_reduce(torch.ones(1))",
                          timeout=60)
        assert not out.ok
        assert out.error["ename"] == "CellTimeout"
        assert out.error["evalue"].startswith("still running after --timeout 3 s: ")
        if flags:  # rank 1 returned: rank 0 waited for a rank that had finished
            assert "rank(s) [0] waited in all_reduce, which rank(s) [1] never joined" in out.error["evalue"]
        assert "rank 0" in out.error["evalue"] or "rank(s) [0]" in out.error["evalue"]
    again = kernel.ok("%%distribute\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())", timeout=120)
    assert "[rank 0] sum 2.0" in again.stdout


def test_changed_names_are_resent_unchanged_big_tensor_is_not(kernel):
    kernel.ok("big = torch.zeros(25_000_000)  # 100 MB\nsmall = 1")
    read_both = "%%distribute\nprint('seen', small, float(big[0]), big.numel())"
    first = kernel.ok(read_both)
    assert "[rank 1] seen 1 0.0 25000000" in first.stdout
    shipped = kernel.value("jupyter_scale.get_session().runs[-1].shipped")
    assert shipped["big"] >= 100_000_000 and "small" in shipped

    kernel.ok("small = 2")
    second = kernel.ok(read_both)
    assert "[rank 1] seen 2 0.0 25000000" in second.stdout
    run = kernel.value("(r := jupyter_scale.get_session().runs[-1]).shipped, r.skipped")
    shipped, skipped = run
    assert "big" in skipped and "big" not in shipped
    assert "small" in shipped
    assert sum(shipped.values()) < 1_000_000  # the 100 MB were not sent again

    kernel.ok("big.add_(1)")  # an in-place change must be seen
    third = kernel.ok(read_both)
    assert "[rank 0] seen 2 1.0 25000000" in third.stdout
    kernel.ok("del big")  # and on the workers too, as the next cell starts
    kernel.ok("%%distribute\nassert 'big' not in globals()")


# 1024: weights of 4 MiB, whose unwritten chunks neither side hashes again (writewatch);
# every way of writing them must still be seen.
@pytest.mark.parametrize("width", [256, 1024])
def test_only_the_tensors_a_cell_changed_come_back(kernel, width):
    kernel.ok(f"W = {width}")
    kernel.ok("""
pm = nn.Sequential(nn.Linear(W, W), nn.Linear(W, W), nn.BatchNorm1d(W))
def pulled():
    run = jupyter_scale.get_session().runs[-1]
    assert 'pm' in run.pulled, run.pulled
    return run.pulled_bytes['pm'], run.shipped.get('pm', 0)
def rank0_holds_the_notebooks():
    ranks = jupyter_scale.get_session().gather('state')
    ours = pm.state_dict()
    assert ranks[0].keys() == ours.keys()
    assert all(torch.equal(ranks[0][k], ours[k]) for k in ours), 'the notebook differs from rank 0'
""")
    whole = 2 * (width * width + width) * 4
    # Read but not changed: no tensor comes back, only the state dict's frame.
    kernel.ok("%%distribute\nn = sum(p.numel() for p in pm.parameters())")
    back, _ = kernel.value("pulled()")
    assert back < 4096, back
    if width == 1024:  # nor is it hashed again, where pages can be watched: neither in the kernel nor on rank 0
        probe = ("%%distribute --pull hashed\nfrom jupyter_scale import writewatch\n"
                 "hashed = writewatch.watch().hashed_bytes if writewatch.watch().watching else None")
        kernel.ok(probe)
        before = kernel.value("hashed, jupyter_scale.writewatch.watch().hashed_bytes")
        kernel.ok("%%distribute\nn = sum(p.numel() for p in pm.parameters())")
        back, _ = kernel.value("pulled()")
        assert back < 4096, back
        kernel.ok(probe)
        after = kernel.value("hashed, jupyter_scale.writewatch.watch().hashed_bytes")
        if before[0] is not None:  # at most the chunks at the weights' two ends (see writewatch)
            assert after[0] - before[0] < 3 * whole / 4, (before, after)
            assert after[1] - before[1] < 3 * whole / 4, (before, after)
        kernel.ok("%%distribute\ndel hashed")
    # Writes that bypass autograd's version counters (.data, NumPy) are seen: by their bytes.
    kernel.ok("""%%distribute
pm[0].weight.data.add_(1)
pm[1].bias.detach().numpy()[:] = 3
state = {k: v.clone() for k, v in pm.state_dict().items()}
""")
    back, _ = kernel.value("pulled()")
    assert width * width * 4 + width * 4 <= back < width * width * 4 + width * 4 + 4096 < whole, back
    kernel.ok("rank0_holds_the_notebooks()\nassert bool((pm[1].bias == 3).all())")
    # The notebook's digests of what came back are rank 0's: the next cell sends nothing back
    # and nothing out.
    kernel.ok("%%distribute\nstate = {k: v.clone() for k, v in pm.state_dict().items()}")
    back, shipped = kernel.value("pulled()")
    assert back < 4096 and shipped == 0, (back, shipped)
    # Two elements written through NumPy on the workers, after a cell that changed nothing.
    kernel.ok("%%distribute\npm[1].weight.detach().numpy()[3, :2] = 5\n"
              "state = {k: v.clone() for k, v in pm.state_dict().items()}")
    back, _ = kernel.value("pulled()")
    assert width * width * 4 <= back < width * width * 4 + 4096, back
    kernel.ok("rank0_holds_the_notebooks()\nassert pm[1].weight[3, 1].item() == 5")
    # The notebook's own changes go out and do not come back.
    kernel.ok("pm[2].weight.data.fill_(2)\npm[0].weight.detach().numpy()[-1, -1] = 7")
    kernel.ok("%%distribute\nstate = {k: v.clone() for k, v in pm.state_dict().items()}")
    back, shipped = kernel.value("pulled()")
    assert back < 4096 and width * width * 4 <= shipped, (back, shipped)
    kernel.ok("rank0_holds_the_notebooks()\nassert bool((pm[2].weight == 2).all()) and pm[0].weight[-1, -1] == 7")
    # A training step changes everything: all of it comes back.
    kernel.ok("""%%distribute
opt = torch.optim.SGD(pm.parameters(), lr=0.1)
pm(torch.randn(8, W)).mul(torch.linspace(-1, 1, W)).sum().backward()  # through BatchNorm: not a constant
opt.step()
state = {k: v.clone() for k, v in pm.state_dict().items()}
""")
    back, _ = kernel.value("pulled()")
    assert back >= whole, back
    kernel.ok("rank0_holds_the_notebooks()\ndel pm, pulled, rank0_holds_the_notebooks, W, state, opt, n")
    kernel.ok("%%distribute\nassert not {'pm', 'state', 'opt', 'n', 'W'} & set(globals())")


def test_error_on_rank_1_names_it_and_the_next_cell_works(kernel, trained):
    failed = kernel.cell("""%%distribute
if rank == 1:
    raise ValueError("bad value on one rank")
t = torch.ones(1)
dist.all_reduce(t)   # rank 0 waits here for rank 1, which never comes
""", timeout=60)
    assert not failed.ok
    assert failed.error["ename"] == "RemoteError"
    text = failed.error_text
    assert "rank 1 failed: ValueError: bad value on one rank" in text
    assert 'raise ValueError("bad value on one rank")' in text  # rank 1's own traceback
    # The next cell re-forms the group; the DDP model from before trains on.
    again = kernel.ok("""%%distribute
t = torch.ones(1)
dist.all_reduce(t)
x, y = next(iter(loader))
loss = nn.functional.cross_entropy(model(x), y)
loss.backward()
print("sum", t.item())
""", timeout=120)
    assert "[rank 0] sum 2.0" in again.stdout and "[rank 1] sum 2.0" in again.stdout


@pytest.mark.parametrize("name, make", [
    ("lock", "import threading\nlock = threading.Lock()"),
    ("handle", "handle = open(__import__('os').devnull)"),
    ("numbers", "numbers = (i for i in range(3))"),
])
def test_unserializable_value_is_named_and_nothing_runs(kernel, name, make):
    kernel.ok(make)
    runs_before = kernel.value("len(jupyter_scale.get_session().runs)")
    out = kernel.cell(f"%%distribute\nprint('ran on', rank)\nx = {name}")
    assert not out.ok
    assert out.error["ename"] == "ShippingError"
    assert f"'{name}'" in out.error["evalue"]
    assert len(out.error["evalue"].splitlines()) == 1
    assert "ran on" not in out.stdout
    assert kernel.value("len(jupyter_scale.get_session().runs)") == runs_before
    # Nothing lost: the value is still the notebook's, and the workers still work.
    assert kernel.value(f"type({name}).__name__") in ("lock", "TextIOWrapper", "generator")
    assert "[rank 1] fine" in kernel.ok("%%distribute\nprint('fine')").stdout


def test_pull_copies_rank0_values(kernel):
    kernel.ok("%%distribute --pull result,name\nresult = [rank, world_size * 10]\nname = f'from rank {rank}'")
    assert kernel.value("result") == [0, 20]
    assert kernel.value("name") == "from rank 0"
    missing = kernel.cell("%%distribute --pull nowhere\nx = 1")
    assert missing.ok and "could not pull 'nowhere'" in missing.stderr


def test_timeout_stops_a_slow_rank(kernel):
    out = kernel.cell("""%%distribute --timeout 3
import time
if rank == 1:
    time.sleep(120)
""", timeout=60)
    assert not out.ok
    assert out.error["ename"] == "CellTimeout"
    assert "rank(s) [1]" in out.error["evalue"] and "time.sleep(120)" in out.error_text
    kernel.ok("%%distribute\nprint('alive', rank)")


@on_engines(ENGINES)
def test_kernel_interrupt_stops_every_rank(kernel):
    import time as _time

    def interrupt_later():
        _time.sleep(3)
        kernel.manager.interrupt_kernel()

    threading.Thread(target=interrupt_later, daemon=True).start()
    out = kernel.cell("""%%distribute
import time
t0 = time.time()
while time.time() - t0 < 120:
    time.sleep(0.01)
""", timeout=60)
    assert not out.ok
    assert out.error["ename"] == "KeyboardInterrupt"
    after = kernel.ok("%%distribute\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('reusable', t.item())")
    assert "[rank 1] reusable 2.0" in after.stdout


@on_engines(ENGINES)
def test_rich_output_from_rank0_is_shown_once(kernel):
    out = kernel.ok("%%distribute\nfrom IPython.display import display, HTML\ndisplay(HTML(f'<b>from rank {rank}</b>'))")
    html = [d["text/html"] for d in out.displays if "text/html" in d]
    assert html == ["<b>from rank 0</b>"]


@on_engines(ENGINES)
def test_every_listening_socket_of_the_cluster_is_on_loopback(kernel):
    kernel.ok("%%distribute\nt = torch.ones(1)\ndist.all_reduce(t)")  # group formed and used
    listening = []
    # The kernel too: the event stream, and Dask's scheduler, nannies and dashboard live there.
    for process in [psutil.Process(kernel.pid), *kernel.descendants()]:
        for conn in process.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening.append((process.pid, conn.laddr.ip, conn.laddr.port))
    assert len(listening) >= 4  # controller or scheduler, engines or workers, TCPStore, gloo
    # Ray's servers listen on IPv6 sockets that take IPv4 too: ::ffff:127.0.0.1 is loopback.
    assert {ip.removeprefix("::ffff:") for _, ip, _ in listening} == {"127.0.0.1"}, listening

@on_engines(ENGINES)
def test_the_clusters_files_are_readable_by_the_owner_only(kernel):
    import os
    import tempfile

    kernel.ok("%%distribute\nimport os\nos.write(1, b'in the log\\n')")  # the engines' logs hold this
    info = kernel.value("jupyter_scale.get_session().backend.describe()")
    if kernel.backend == "ipyparallel":
        # The controller's connection files (keys), the controller's and engines' logs.
        below = info["profile_dir"]
        files = [os.path.join(below, d, f) for d in ("security", "log")
                 for f in os.listdir(os.path.join(below, d)) if info["cluster_id"] in f]
        assert len(files) >= 5, files
    elif kernel.backend == "ray":  # Ray's temporary directory: sockets, logs, the token
        below = os.path.dirname(info["temp_dir"])
        files = [os.path.join(d, f) for d, dirs, names in os.walk(info["temp_dir"]) for f in dirs + names]
        assert any(f.endswith(".out") for f in files) and any("sockets" in f for f in files), files
    else:  # Everything the scheduler and workers keep: scratch directories, lock files
        below = tempfile.gettempdir()
        workdir = next(iter(kernel.value(
            "jupyter_scale.get_session().backend.client.run(lambda dask_worker: dask_worker.local_directory)"
        ).values()))
        files = [os.path.join(d, f) for d, dirs, names in os.walk(os.path.dirname(workdir)) for f in dirs + names]
        assert len(files) >= 5, files  # 2 workers' and the scheduler's directories, their locks
    for path in files:
        assert _closed_to_others(path, below), f"{path} is readable by other users"
    kernel.ok("%scale stop")
    assert not [path for path in files if os.path.exists(path)]  # and nothing is left


def _closed_to_others(path, below):
    """`path`, or one of its directories up to `below`, is open to its owner only."""
    import os

    while path != below:
        if os.stat(path).st_mode & 0o077 == 0:
            return True
        path = os.path.dirname(path)
    return False


def _how_it_died(kernel, pid, how):
    """What the error says of a dead worker's process: Ray reaps its actors' processes and says
    only that they died."""
    return f"its Ray actor (pid {pid}) died" if kernel.backend == "ray" else f"(its process {pid} {how})"


def test_dead_worker_fails_the_cell_and_the_next_cell_restarts(kernel):
    kernel.ok("%%distribute\npass")  # the cluster is up
    pids = kernel.value("[w['pid'] for w in jupyter_scale.get_session().workers]")
    out = kernel.cell("""%%distribute
import os
if rank == 1:
    os._exit(1)
t = torch.ones(1)
dist.all_reduce(t)
""", timeout=60)
    assert not out.ok
    assert "rank 1 failed: WorkerLost" in out.error_text
    assert _how_it_died(kernel, pids[1], "exited with status 1") in out.error_text
    assert "rank(s) [1]" in kernel.ok("%scale").stdout
    again = kernel.ok("%%distribute\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())", timeout=120)
    assert "is gone; restarting the cluster with 2 workers" in again.stdout
    assert "[rank 1] sum 2.0" in again.stdout
    assert wait_gone([psutil.Process(p) for p in pids if psutil.pid_exists(p)]) == []

def test_worker_killed_mid_epoch_fails_the_cell_naming_it(kernel):
    kernel.ok("%%distribute\nimport os\npid = os.getpid()")
    pid = kernel.value("jupyter_scale.get_session().gather('pid')[1]")
    out = kernel.cell(f"""%%distribute
import os, signal, time
t = torch.ones(1)
for step in range(10_000):
    if rank == 0 and step == 50:
        os.kill({pid}, signal.SIGKILL)   # rank 1's process, from rank 0, mid-loop
    dist.all_reduce(t)
    t.fill_(1)
    time.sleep(0.001)
""", timeout=60)
    assert not out.ok
    assert "rank 1 failed: WorkerLost" in out.error_text
    assert _how_it_died(kernel, pid, "killed by SIGKILL") in out.error_text
    assert "rank(s) [1]" in kernel.ok("%scale").stdout
    again = kernel.ok("%%distribute\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())", timeout=120)
    assert "[rank 1] sum 2.0" in again.stdout

@on_engines(ENGINES)
def test_worker_dying_between_cells_is_replaced(kernel):
    kernel.ok("%%distribute --workers 2\npass")  # the cluster is up
    pid = kernel.value("jupyter_scale.get_session().workers[1]['pid']")
    psutil.Process(pid).kill()
    assert wait_gone([psutil.Process(pid)] if psutil.pid_exists(pid) else []) == []
    import time
    deadline = time.monotonic() + 30  # the controller notices within a few heartbeats
    while time.monotonic() < deadline:
        if kernel.value("jupyter_scale.get_session().backend.dead_ranks()") == [1]:
            break
        time.sleep(0.5)
    out = kernel.ok("%%distribute\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())", timeout=120)
    assert "is gone; restarting the cluster with 2 workers" in out.stdout
    assert "[rank 1] sum 2.0" in out.stdout
    assert "(raylet)" not in out.stdout  # the session says it; Ray's driver does not say it again

@on_engines(ENGINES)
def test_resize_then_stop_leaves_no_process(kernel):
    kernel.ok("%%distribute --workers 2\npass")
    out = kernel.ok("%%distribute --workers 3\nprint('size', world_size)", timeout=120)
    assert "resizing from 2 to 3 workers" in out.stdout
    # Every rank said it (above 2 ranks, alike lines printed together show once: [rank 0-2] size 3).
    said = [r for label in re.findall(r"\[rank ([\d,-]+)\] size 3", out.stdout) for r in ranks_of(label)]
    assert sorted(said) == [0, 1, 2], out.stdout
    status = kernel.ok("%scale").stdout
    assert "3 workers" in status and "rank 2: pid" in status
    started = kernel.descendants()
    ranks = kernel.value("[w['pid'] for w in jupyter_scale.get_session().workers]")
    # The 3 workers (+ ipyparallel's controller; Dask's scheduler and nannies live in the kernel).
    assert set(ranks) <= {p.pid for p in started} and len(ranks) == 3
    kernel.ok("%scale stop")
    assert wait_gone(started) == []
    assert kernel.descendants() == []
    assert "no cluster running" in kernel.ok("%scale status").stdout


# Shared memory is the same on every engine; what goes through the engine is each engine's own.
@pytest.mark.parametrize("kernel, shared_memory", [("ipyparallel", True), *((e, False) for e in ENGINES)],
                         indirect=["kernel"])
def test_big_values_travel_both_ways_through_shared_memory_or_the_engine(kernel, shared_memory):
    session = "jupyter_scale.get_session()"
    kernel.ok(f"{session}.shared_memory_enabled = {shared_memory}\n%scale restart --workers 2", timeout=120)
    assert kernel.value(f"{session}.shared_memory") is shared_memory
    kernel.ok("import numpy as np\n"
              "arr = np.arange(1_000_000)  # 8 MB, not a tensor: each worker gets a writable copy\n"
              "net = nn.Linear(1024, 1024)  # 4 MB of weights, pulled back after the cell\n"
              "with torch.no_grad(): net.weight.fill_(0.5)")
    cell = ("%%distribute\narr += rank\nwith torch.no_grad(): net.weight.add_(1)\n"
            "print('seen', int(arr[10]), float(net.weight[0, 0]))")
    first = kernel.ok(cell)
    assert "[rank 0] seen 10 1.5" in first.stdout and "[rank 1] seen 11 1.5" in first.stdout
    assert kernel.value("float(net.weight[0, 0]), int(arr[10])") == (1.5, 10)  # pulled back; arr is ours
    rank0 = kernel.value(f"{session}.workers[0]['pid']")
    # The frames went through the kernel's and rank 0's memory files, kept for the next cell.
    assert (_memory_files(kernel.pid), _memory_files(rank0)) == ((1, 1) if shared_memory else (0, 0))
    kernel.ok("with torch.no_grad(): net.weight.mul_(2)")  # changed in the notebook: sent in place
    second = kernel.ok("%%distribute\nprint('again', float(net.weight[0, 0]), int(arr[10]))")
    assert "[rank 1] again 3.0 11" in second.stdout  # the worker's own arr is unchanged: not re-sent
    if shared_memory:  # the kernel's shared memory fails (say, out of memory): the engine carries the cell
        kernel.ok(f"def full(*args, **kwargs):\n    raise OSError(28, 'No space left on device')\n"
                  f"{session}._frames_out.file.pack = full\nwith torch.no_grad(): net.weight.add_(1)")
        third = kernel.ok("%%distribute\nprint('third', float(net.weight[0, 0]))")
        assert "[rank 1] third 4.0" in third.stdout
    kernel.ok("%scale stop")
    assert _memory_files(kernel.pid) == 0
    kernel.ok(f"{session}.shared_memory_enabled = True")


def _memory_files(pid):
    """How many of jupyter_scale's shared-memory files (memfds) process `pid` holds open."""
    import os

    fds = f"/proc/{pid}/fd"
    return sum("memfd:jupyter_scale-frames" in os.readlink(f"{fds}/{fd}") for fd in os.listdir(fds)
               if os.path.exists(f"{fds}/{fd}"))
