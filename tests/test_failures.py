"""Failures never leave anything behind: injected faults on real clusters of both engines."""

import contextlib
import os
import signal
import time

import psutil
import pytest

from conftest import CLUSTER_ENGINES, DEFAULT_ENGINES, ENGINES, SETUP, kernel_fixture, on_engines, wait_gone
from kernel import Kernel

pytestmark = pytest.mark.cluster

# What the session decides after a failure is the same on every engine: the default engine. How
# an engine loses, ends and reports its workers, escalates a stop and keeps its logs is its own:
# those tests run on every engine (and the backend protocol's own tests, tests/test_backend_protocol.py).
kernel = kernel_fixture(DEFAULT_ENGINES)


def _listening_ports(processes):
    ports = set()
    for process in processes:
        try:
            ports |= {c.laddr.port for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return ports


def _directories_made(k: Kernel, described: dict) -> set[str]:
    """The cluster's temporary directories: its engine's (Dask's scratch, Ray's), the direct
    channel's (where the kernel's IPC sockets are), multiprocessing's of the kernel (the
    fork server's socket)."""
    made = {described["temp_dir"]} if described.get("temp_dir") else set()
    with contextlib.suppress(psutil.Error):
        for c in psutil.Process(k.pid).net_connections(kind="unix"):
            directory = os.path.dirname(c.laddr) if isinstance(c.laddr, str) else ""
            if os.path.basename(directory).startswith(("jupyter_scale-", "pymp-")):
                made.add(directory)
    return made


def _cluster_files(profile_dir: str, cluster_id: str) -> list[str]:
    """ipyparallel's files of that cluster: connection files, logs, the controller's engine list."""
    return [os.path.join(profile_dir, d, n) for d in ("security", "log") if os.path.isdir(os.path.join(profile_dir, d))
            for n in os.listdir(os.path.join(profile_dir, d)) if cluster_id in n]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_killed_kernel_leaves_no_worker_controller_or_port(engine):
    k = Kernel(backend=engine)
    try:
        k.ok(SETUP)
        k.ok("%%distribute --workers 2\nt = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2")
        described = k.value("jupyter_scale.get_session().backend.describe()")
        made = _directories_made(k, described)
        cluster_files = (_cluster_files(described["profile_dir"], described["cluster_id"])
                         if described.get("cluster_id") else [])
        if engine == "ipyparallel":
            assert cluster_files, "no connection or log file of the cluster found"
        if engine != "ray":  # whose calls take Ray's own path: no direct channel
            assert any(os.path.basename(p).startswith("jupyter_scale-") for p in made), made  # the channel's
        if engine != "ipyparallel":
            assert described.get("temp_dir") in made, described
        store = k.value("jupyter_scale.get_session().group.store['file']")
        scratch = k.value("jupyter_scale.get_session().backend.describe().get('temp_dir')")  # Ray's
        started = psutil.Process(k.pid).children(recursive=True)
        ports = _listening_ports(started)
        assert len(started) >= 2 and ports
        os.kill(k.pid, signal.SIGKILL)  # no chance to stop its cluster
        still = wait_gone(started, timeout=30)
        for process in still:  # clean up what the test caused, by pid, before failing
            process.kill()
        assert not still, f"left behind by a SIGKILLed kernel: {still}"
        listening = {c.laddr.port for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        assert not ports & listening, f"ports still listening: {ports & listening}"
        # The kernel's watcher (jupyter_scale.processes) removes the group's store directory.
        assert not os.path.exists(os.path.dirname(store)), "the group's store directory was left behind"
        assert not scratch or not os.path.exists(scratch), f"{scratch} (the token, Ray's logs) was left behind"
        # Every file and directory the cluster made goes with it, within seconds.
        deadline = time.monotonic() + 15
        while [p for p in [*made, *cluster_files] if os.path.lexists(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in [*made, *cluster_files] if os.path.lexists(p)]
        assert not left, f"files and directories of the cluster left behind by a SIGKILLed kernel: {left}"
    finally:
        k.client.stop_channels()
        k.manager.cleanup_resources()


def _footprint(kernel):
    """Processes, threads, open fds and inet sockets of the kernel and everything it started."""
    processes = [psutil.Process(kernel.pid), *kernel.descendants()]
    threads = fds = sockets = 0
    for p in processes:
        threads += p.num_threads()
        fds += p.num_fds()
        sockets += len(p.net_connections(kind="inet"))
    return {"processes": len(processes), "threads": threads, "fds": fds, "sockets": sockets}


FAILING = """%%distribute
t = torch.ones(1)
if rank == 1:
    raise ValueError("injected")
dist.all_reduce(t)
"""
OK = "%%distribute\nt = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2\nreport(loss=t)"


@on_engines(ENGINES)
def test_fifty_cells_with_failures_leak_nothing(kernel):
    for code in (OK, FAILING, OK, FAILING, OK):  # warm up: every path has run once
        kernel.cell(code, timeout=60)
    before = _footprint(kernel)
    for i in range(50):
        failing = i % 5 in (1, 3)  # 20 failures, each re-forming the process group
        out = kernel.cell(FAILING if failing else OK, timeout=60)
        assert out.ok != failing, out.error_text
        if failing:
            assert "rank 1 failed: ValueError: injected" in out.error_text
    after = _footprint(kernel)
    assert after["processes"] == before["processes"], (before, after)
    # A few threads and fds come and go with the engines' pools; a leak per failed cell
    # would be 20 or more.
    for what in ("threads", "fds", "sockets"):
        assert after[what] <= before[what] + 6, (what, before, after)


# The rendezvous is the session's, whatever the engine: the two that start a cluster of ours
# (Ray adds 45 s to CI's time here).
@pytest.mark.parametrize("engine", CLUSTER_ENGINES)
def test_two_kernels_distribute_at_once_with_torchruns_port_taken(engine):
    import socket
    import threading

    blocker = socket.socket()
    try:
        blocker.bind(("127.0.0.1", 29500))  # torchrun's default port: someone else's
        blocker.listen()
    except OSError:  # already taken by someone: just as good for this test
        pass
    kernels = [Kernel(backend=engine) for _ in range(2)]
    try:
        for k in kernels:
            k.ok(SETUP)
        cell = """%%distribute --workers 2
import os
t = torch.ones(1)
for _ in range(200):
    dist.all_reduce(t)
    t /= 2   # stays 1.0 when exactly this cell's two ranks add into it
print("port", os.environ["MASTER_PORT"], "sum", t.item())
"""
        results = [None, None]

        def run(i):
            results[i] = kernels[i].cell(cell, timeout=180)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        ports = set()
        for out in results:
            assert out is not None and out.ok, out.error_text if out else "no result"
            assert "[rank 1] port" in out.stdout and "sum 1.0" in out.stdout, out.stdout
            ports.add(out.stdout.split("port ")[1].split()[0])
        assert "29500" not in ports  # a free port, never the fixed default
    finally:
        blocker.close()
        for k in kernels:
            k.cell("%scale stop", timeout=60)
            k.shutdown()


def test_a_rank_that_never_comes_is_named_while_the_others_wait(kernel):
    # No --timeout: the cell may run as long as it needs, but the user is told who is missing.
    kernel.ok("s = jupyter_scale.get_session(); s.heartbeat_interval = 0.5; s.hang_warning = 2")
    try:
        out = kernel.cell("""%%distribute
import time
if rank == 1:
    time.sleep(8)        # rank 0 waits for it in the all_reduce below
t = torch.ones(1)
dist.all_reduce(t)
print("sum", t.item())
""", timeout=120)
        assert out.ok, out.error_text
        assert "[rank 0] sum 2.0" in out.stdout
        assert "rank(s) [0] have waited" in out.stderr and "in all_reduce" in out.stderr, out.stderr
        assert "rank(s) [1] are not in it" in out.stderr
        # A healthy cell where every rank computes says nothing.
        quiet = kernel.ok("%%distribute\nimport time\ntime.sleep(4)\ndist.barrier()")
        assert "have waited" not in quiet.stderr
    finally:
        kernel.ok("s.heartbeat_interval = 5.0; s.hang_warning = 60.0")


def test_workers_that_cannot_import_torch_fail_the_start_with_the_cause(tmp_path):
    # The engines start (ipyparallel's engine does not need torch), but jupyter_scale's code
    # cannot run on them: the first cell says why, within the start timeout, and starts nothing.
    broken = tmp_path / "site"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text('raise ImportError("simulated broken torch install")\n')
    k = Kernel(backend="ipyparallel")
    try:
        k.ok(SETUP)
        k.ok(f"import os; os.environ['PYTHONPATH'] = {str(broken)!r}; "
             "jupyter_scale.get_session().start_timeout = 60")
        out = k.cell("%%distribute --workers 2\nprint('ran', rank)", timeout=120)
        assert not out.ok
        assert out.error["ename"] == "WorkerCallFailed"
        assert "ImportError: simulated broken torch install" in out.error["evalue"]
        assert "ran" not in out.stdout
        assert k.descendants() == []  # the half-started cluster was stopped
        k.ok("del os.environ['PYTHONPATH']")
        assert "[rank 1] ran 1" in k.ok("%%distribute --workers 2\nprint('ran', rank)", timeout=120).stdout
    finally:
        k.cell("%scale stop", timeout=60)
        k.shutdown()


# Runs in every Python process started with this PYTHONPATH; ends the engine's worker
# processes (ipyparallel engines, Dask's spawned workers, Ray's workers) at start, as a broken shared
# library or a bad site package would, and leaves every other process alone.
DIES_AT_START = '''
import os, sys
_cmd = open("/proc/self/cmdline", "rb").read()
if (b"ipyparallel.engine" in _cmd or b"ipp_engine.py" in _cmd or b"spawn_main" in _cmd
        or b"multiprocessing.forkserver" in _cmd or b"default_worker.py" in _cmd):
    sys.stderr.write("ImportError: libsimulated.so: cannot open shared object file\\n")
    sys.stderr.flush()
    os._exit(3)
'''


@pytest.mark.parametrize("engine", ENGINES)
def test_a_worker_process_that_dies_at_start_fails_the_cell_with_how_it_died(engine, tmp_path):
    if engine == "ray":
        pytest.skip("Ray's ray.init waits, without a timeout, for a raylet whose worker processes die as they "
                    "start (README, How Ray is driven)")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DIES_AT_START)
    k = Kernel(backend=engine)
    try:
        k.ok(SETUP)
        k.ok(f"import os; os.environ['PYTHONPATH'] = {str(site)!r}; "
             "jupyter_scale.get_session().start_timeout = 120")
        # The deadline is well under the start timeout: the failure is noticed, not waited out.
        out = k.cell("%%distribute --workers 2\nprint('ran', rank)", timeout=60)
        assert not out.ok
        assert out.error["ename"] == "ClusterError"
        message = out.error["evalue"]
        assert len(message.splitlines()) == 1
        # Ray reaps its workers: it keeps what they wrote, not how they ended.
        assert ("exited while starting" if engine == "ray" else "exited with status 3 while starting") in message
        assert "fix the" in message and "environment" in message  # what to do next
        if engine != "dask":  # the engine's own output; Dask's went to the kernel's stderr
            assert "ImportError: libsimulated.so" in message
        assert "ran" not in out.stdout
        assert k.descendants() == []  # nothing half-started is left
        k.ok("del os.environ['PYTHONPATH']")
        assert "[rank 1] ran 1" in k.ok("%%distribute --workers 2\nprint('ran', rank)", timeout=120).stdout
    finally:
        k.cell("%scale stop", timeout=60)
        k.shutdown()


def test_a_hang_under_timeout_names_the_silent_rank_and_the_cell_after_works(kernel):
    out = kernel.cell("""%%distribute --timeout 5
import time
if rank == 1:
    time.sleep(120)      # silent: never reaches the all_reduce rank 0 waits in
t = torch.ones(1)
dist.all_reduce(t)
""", timeout=90)
    assert not out.ok
    assert out.error["ename"] == "CellTimeout"
    assert out.error["evalue"] == ("still running after --timeout 5 s: rank(s) [1] never reached the "
                                   "all_reduce that rank(s) [0] waited in")
    text = out.error_text
    assert "--- rank 1 traceback ---" in text and "time.sleep(120)" in text  # where the silent rank was
    assert "(all_reduce in cell line 5)" in text  # rank 0's line says where it waited, in the cell
    assert "Where the ranks were: rank 0: all_reduce in cell line 5; rank 1: cell line 3" in text
    assert kernel.value("jupyter_scale.get_session().runs[-1].status") == "timed out"
    again = kernel.ok("%%distribute\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())", timeout=120)
    assert "[rank 1] sum 2.0" in again.stdout


TRAIN_UNTIL_STOPPED = """%%distribute
import time
loader = DataLoader(data, batch_size=32, shuffle=True)
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
print("training", flush=True)
started = time.time()
while time.time() - started < 120:      # far longer than the test lets it run
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        report(loss=0.0)
"""


# Run on the workers: how many threads gloo's process groups run in this process.
GLOO_THREADS = """
import os
def _thread_name(t):
    try:
        return open(f"/proc/self/task/{t}/comm").read()
    except (FileNotFoundError, ProcessLookupError):  # a thread that ended since it was listed
        return ""
gloo_threads = sum(_thread_name(t).startswith(("pt_gloo", "gloo_")) for t in os.listdir("/proc/self/task"))
"""


def test_interrupting_training_stops_every_rank_and_training_goes_on_from_equal_weights(kernel):
    import threading

    kernel.ok("torch.manual_seed(0)\nnet = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))\n"
              "data = TensorDataset(torch.randn(4096, 16), torch.randint(0, 4, (4096,)))")
    kernel.ok("%%distribute --manual\n" + GLOO_THREADS)
    threads_of_one_group = kernel.value("jupyter_scale.get_session().gather('gloo_threads')")
    assert all(n > 0 for n in threads_of_one_group)  # what is counted exists (torch names these threads)
    timer = threading.Timer(2.0, kernel.manager.interrupt_kernel)  # mid-epoch, ranks inside steps

    def on_stream(name, text):
        if "[rank 1] training" in text and not timer.is_alive():
            timer.start()

    try:
        out = kernel.cell(TRAIN_UNTIL_STOPPED, timeout=90, on_stream=on_stream)
    finally:
        timer.cancel()
    assert timer.finished.is_set(), "training never started"
    assert not out.ok
    assert out.error["ename"] == "KeyboardInterrupt", out.error_text
    assert "ranks [0, 1] stopped" in out.error["evalue"]
    assert kernel.value("jupyter_scale.get_session().runs[-1].status") == "interrupted"
    # The workers are reusable, and the next automatic cell starts from rank 0's weights on
    # every rank, even where an interrupt caught the ranks a step apart: here they are made
    # to differ on purpose (a manual cell leaves them alone).
    kernel.ok("%%distribute --manual\nfor p in net.parameters():\n    p.data.add_(rank)\n"
              "    opt.state[p]['momentum_buffer'].add_(rank)")
    kernel.ok("""%%distribute
x, y = next(iter(loader))
opt.zero_grad()
nn.functional.cross_entropy(net(x), y).backward()
opt.step()
weights = torch.cat([p.detach().flatten() for p in net.parameters()])
""")
    assert kernel.value("torch.equal(*jupyter_scale.get_session().gather('weights'))") is True
    assert kernel.value("torch.equal(torch.cat([p.detach().flatten() for p in net.parameters()]), "
                        "jupyter_scale.get_session().gather('weights')[0])") is True
    # The group the interrupt ended is gone from the workers, not kept beside the new one
    # (the training cell's optimizer imported torch._dynamo after the group formed).
    kernel.ok("%%distribute --manual\n" + GLOO_THREADS)
    assert kernel.value("jupyter_scale.get_session().gather('gloo_threads')") == threads_of_one_group


def test_an_interrupt_while_a_rank_waits_in_a_collective_is_a_keyboard_interrupt(kernel):
    # Rank 1 spends its time in all_reduce waiting for rank 0, so the interrupt frees it
    # with gloo's "connection closed" (rank 0 stopped first): still the user's interrupt,
    # not an error of rank 1.
    import threading

    for _ in range(2):
        timer = threading.Timer(1.5, kernel.manager.interrupt_kernel)

        def on_stream(name, text, timer=timer):  # this pass's timer
            if "[rank 0] looping" in text and not timer.is_alive() and not timer.finished.is_set():
                timer.start()

        try:
            out = kernel.cell("""%%distribute
import time
t = torch.ones(1)
print("looping", flush=True)
for _ in range(10_000):
    if rank == 0:
        time.sleep(0.2)
    dist.all_reduce(t)
""", timeout=90, on_stream=on_stream)
        finally:
            timer.cancel()
        assert out.error is not None and out.error["ename"] == "KeyboardInterrupt", out.error_text
        assert kernel.value("jupyter_scale.get_session().runs[-1].status") == "interrupted"
    assert "[rank 1] fine" in kernel.ok("%%distribute\ndist.barrier()\nprint('fine')").stdout


@on_engines(ENGINES)
def test_a_double_interrupt_stops_every_rank_and_the_next_cell_sees_its_own_tensors(kernel):
    # Interrupts 0.3 ms apart, as an impatient double press sends them: one may land while
    # the kernel handles the other. The ranks still stop, and the next cell neither waits for
    # the old one nor reads frames the old one still reads.
    import threading
    import time

    kernel.ok("big = torch.full((1_000_000,), 1.0)")  # 4 MB: through shared memory

    def interrupt_twice():
        for _ in range(3):
            os.kill(kernel.pid, signal.SIGINT)
            time.sleep(0.0003)

    timer = threading.Timer(1.0, interrupt_twice)

    def on_stream(name, text):
        if "[rank 1] looping" in text and not timer.is_alive() and not timer.finished.is_set():
            timer.start()

    try:
        out = kernel.cell("""%%distribute
import time
print("looping", flush=True)
for progress in range(400):
    total = big.sum().item()
    time.sleep(0.05)
""", timeout=90, on_stream=on_stream)
    finally:
        timer.cancel()
    assert timer.finished.is_set(), "the loop never started"
    assert out.error is not None and out.error["ename"] == "KeyboardInterrupt", out.error_text
    assert "ranks [0, 1] stopped" in out.error["evalue"], out.error_text
    assert kernel.value("jupyter_scale.get_session().runs[-1].status") == "interrupted"
    kernel.ok("big = torch.full((1_000_000,), 2.0)")
    out = kernel.ok("""%%distribute
assert progress < 399, progress          # the old loop was stopped, not waited for
assert torch.equal(big, torch.full((1_000_000,), 2.0))
print("right")
""")
    assert "[rank 0] right" in out.stdout and "[rank 1] right" in out.stdout


@pytest.mark.parametrize("change", [
    "m.append(nn.Linear(2, 2))",          # a layer added: keys the notebook's model lacked
    "m[1] = nn.Linear(4, 3)",             # a layer reshaped
    "m.double()",                         # another dtype
])
def test_a_model_whose_structure_the_cell_changed_comes_back_changed_as_locally(kernel, change):
    """Into the notebook's own model (the same object, its unchanged layers too), as the same
    cell run locally leaves it: what a new layer was drawn with differs (the ranks' seed)."""
    def body(m):
        return f"with torch.no_grad():\n    for p in {m}.parameters():\n        p.add_(1.0)\n" + change.replace("m", m, 1)

    kernel.ok("import copy\ntorch.manual_seed(0)\nm = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))\n"
              "local, first = copy.deepcopy(m), m[0]")
    kernel.ok(body("local"))
    out = kernel.ok(f"%%distribute\n{body('m')}")
    assert "could not pull" not in out.stderr, out.stderr
    assert kernel.value("m[0] is first and [(k, v.shape, v.dtype) for k, v in m.state_dict().items()] == "
                        "[(k, v.shape, v.dtype) for k, v in local.state_dict().items()]") is True
    assert kernel.value("torch.equal(m[0].weight, local[0].weight) and m[0].weight.dtype == local[0].weight.dtype")


@on_engines(ENGINES)
def test_processes_a_cell_left_running_stop_with_the_cluster(kernel):
    # A cell that starts a server, or forgets to join its helper process: they outlive the
    # cell, and would outlive the workers (orphans no one stops) without %scale stop's care.
    kernel.ok("""%%distribute
import multiprocessing, subprocess, time

def start_and_forget():
    helper = multiprocessing.Process(target=time.sleep, args=(600,))  # not a daemon: a worker's exit waits for it
    helper.start()
    return [subprocess.Popen(["sleep", "600"]).pid, helper.pid]

left = start_and_forget()
""")
    pids = [pid for pair in kernel.value("jupyter_scale.get_session().gather('left')") for pid in pair]
    processes = [psutil.Process(pid) for pid in pids]
    assert len(processes) == 4 and all(p.is_running() for p in processes)
    kernel.ok("%scale stop", timeout=60)
    still = wait_gone(processes, timeout=15)
    for process in still:  # clean up what the test caused, by pid, before failing
        process.kill()
    assert not still, f"left running by %scale stop: {still}"


@on_engines(ENGINES)
def test_bytes_that_are_not_utf8_in_an_engines_log_do_not_break_stop_or_restart(kernel):
    # What a cell writes to fd 1 and 2 goes to the engine's log file, which is read when
    # an engine ends (to say why); an engine that dies reads it at once.
    out = kernel.cell("%%distribute\nimport os\nos.write(2, b'bad \\xff\\xfe\\xc3( bytes\\n')\n"
                      "os.write(1, b'\\x80\\x81\\n')\nif rank == 1:\n    os._exit(3)", timeout=60)
    assert "rank 1 failed: WorkerLost" in out.error_text, out.error_text
    restarted = kernel.ok("%scale restart", timeout=120)
    assert "2 workers ready" in restarted.stdout and "UnicodeDecodeError" not in restarted.stderr, restarted.stderr
    kernel.ok("%%distribute\nimport os\nos.write(2, b'\\xff again\\n')")
    stopped = kernel.ok("%scale stop", timeout=60)
    assert "stopped 2 workers" in stopped.stdout and "UnicodeDecodeError" not in stopped.stderr, stopped.stderr


def test_an_error_in_the_kernels_wait_stops_every_rank_before_the_cell_fails(kernel):
    # Not an interrupt: anything else that ends the kernel's wait early (here a fault put
    # into the kernel's event handling) must not leave the ranks running on unseen.
    kernel.ok("""
from jupyter_scale.run import CellRun
real_take_events = CellRun.take_events
calls = []
def failing_take_events(*args):
    calls.append(1)
    if len(calls) == 20:
        raise RuntimeError("a fault in the kernel")
    return real_take_events(*args)
CellRun.take_events = failing_take_events
""")
    try:
        out = kernel.cell("""%%distribute
import time
for progress in range(400):
    time.sleep(0.05)
""", timeout=90)
    finally:
        kernel.ok("CellRun.take_events = real_take_events")
    assert out.error is not None and "a fault in the kernel" in out.error_text, out.error_text
    out = kernel.ok("%%distribute\nassert progress < 399, progress\nprint('stopped at', progress)")
    assert "[rank 0] stopped at" in out.stdout and "[rank 1] stopped at" in out.stdout
