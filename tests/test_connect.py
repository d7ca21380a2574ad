"""`%scale connect`: attach to clusters someone else started, and leave them running.

The clusters here are real CLI processes (`dask scheduler` / `dask worker`, `ipcluster`)
on 127.0.0.1, started by the test (not by the kernel) and stopped by the test, by pid.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import SETUP, wait_gone
from kernel import Kernel

pytestmark = pytest.mark.cluster

BIN = Path(sys.executable).parent
# Every port of a `dask` CLI process on loopback: its HTTP server (health, metrics) listens
# even with --no-dashboard, on 0.0.0.0 (the scheduler's on the fixed 8787) unless told.
LOOPBACK = ["--host", "127.0.0.1", "--no-dashboard", "--dashboard-address", "127.0.0.1:0"]

TRAIN = """%%distribute
loader = DataLoader(data, batch_size=32, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    report(loss=loss)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
print("host", rank, world_size)
"""

NOTEBOOK = """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 2, (256,), generator=g))
"""

CHECK_EQUAL = """
ws = jupyter_scale.get_session().gather("weights")
local = torch.cat([p.detach().flatten() for p in model.parameters()])
assert len(ws) == 2 and torch.equal(ws[0], ws[1]) and torch.equal(ws[0], local)
"""


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"{what} within {timeout} s")


def _listening_ips(processes):
    """The addresses that processes (and what they started) listen on."""
    ips = set()
    for started in processes:
        parent = psutil.Process(started.pid)
        for process in [parent, *parent.children(recursive=True)]:
            ips |= {c.laddr.ip for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    return ips


def _stop(processes):
    """Stop what the test started, by pid, and check that it is gone."""
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
    assert all(p.poll() is not None for p in processes)


@pytest.fixture
def dask_cli_cluster(tmp_path):
    """A scheduler and 2 single-threaded workers, as `dask` CLI processes on 127.0.0.1."""
    scheduler_file = tmp_path / "scheduler.json"
    env = dict(os.environ, DASK_DISTRIBUTED__WORKER__DAEMON="False")
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    scheduler = subprocess.Popen(
        [BIN / "dask", "scheduler", *LOOPBACK, "--port", "0", "--scheduler-file", scheduler_file], **quiet)
    processes = [scheduler]
    try:
        _wait_for(lambda: scheduler_file.exists() and scheduler_file.stat().st_size > 0, 60, "no scheduler file")
        address = json.loads(scheduler_file.read_text())["address"]
        for _ in range(2):
            processes.append(subprocess.Popen(
                [BIN / "dask", "worker", address, "--nthreads", "1", *LOOPBACK, "--memory-limit", "0"], **quiet))
        from distributed import Client

        with Client(address, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
        assert _listening_ips(processes) == {"127.0.0.1"}
        yield address, processes
    finally:
        _stop(processes)


def test_connect_to_a_dask_cli_cluster_trains_and_leaves_it_running(dask_cli_cluster):
    address, processes = dask_cli_cluster
    k = Kernel()
    try:
        k.ok(SETUP)
        k.ok(NOTEBOOK)
        out = k.ok(f"%scale connect {address}", timeout=120)
        assert f"connecting to the dask cluster at {address}" in out.stdout
        assert "2 workers ready" in out.stdout
        status = k.ok("%scale").stdout
        assert "connected dask cluster, 2 workers" in status and address in status
        # The workers are the CLI processes, not anything the kernel started.
        pids = k.value("[w['pid'] for w in jupyter_scale.get_session().workers]")
        assert set(pids) <= {c.pid for p in processes[1:]
                             for c in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]}
        assert k.descendants() == []

        trained = k.ok(TRAIN, timeout=180)
        assert "[rank 0] host 0 2" in trained.stdout and "[rank 1] host 1 2" in trained.stdout
        k.ok(CHECK_EQUAL)
        assert k.value("len(jupyter_scale.history())") == 2 * 4  # 256 / 2 ranks / 32

        out = k.ok("%scale stop")
        assert "disconnected; the cluster's 2 workers keep running" in out.stdout
        assert "no cluster running" in k.ok("%scale").stdout
    finally:
        k.shutdown()
    # Disconnect, not kill: the scheduler and both workers are alive and still work.
    assert all(p.poll() is None for p in processes)
    from distributed import Client

    from jupyter_scale.backends.dask_cluster import workers_of

    with Client(address, timeout=30) as client:
        assert len(workers_of(client)) == 2
        assert client.submit(sum, [1, 2, 3], pure=False).result(timeout=30) == 6
        assert sorted(client.run(os.getpid).values()) == sorted(pids)  # the same worker processes
        # ... which no longer hold the session's variables (the model, the loader).
        held = client.run(eval, "[n for n in __import__('jupyter_scale.worker').worker._state.namespace "
                                "if not n.startswith('__')]")
        assert all(names == [] for names in held.values()), held


def test_connect_with_more_workers_than_the_cluster_has_fails_clearly(dask_cli_cluster):
    address, _ = dask_cli_cluster
    k = Kernel()
    try:
        k.ok(SETUP)
        k.ok("jupyter_scale.get_session().start_timeout = 3")
        out = k.cell(f"%scale connect {address} --workers 5", timeout=60)
        assert not out.ok
        assert "did not offer 5 workers within 3 s" in out.error_text
        assert "no cluster running" in k.ok("%scale").stdout
        # Nothing was left half-attached: the 2 workers it has are usable right after.
        k.ok(f"%scale connect {address}", timeout=60)
        assert "[rank 1] 1" in k.ok("%%distribute\nprint(rank)").stdout
        k.ok("%scale stop")
    finally:
        k.shutdown()


def test_connect_to_an_ipcluster_by_its_connection_file(tmp_path):
    profile = tmp_path / "profile"
    cluster = subprocess.Popen(
        [BIN / "ipcluster", "start", "--n=2", f"--profile-dir={profile}", "--cluster-id=t"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url_file = profile / "security" / "ipcontroller-t-client.json"
        _wait_for(url_file.exists, 60, "no controller connection file")
        k = Kernel()
        try:
            k.ok(SETUP)
            k.ok(NOTEBOOK)
            out = k.ok(f"%scale connect {url_file} --workers 2", timeout=120)
            assert "2 workers ready" in out.stdout
            pids = k.value("[w['pid'] for w in jupyter_scale.get_session().workers]")
            k.ok(TRAIN, timeout=180)
            k.ok(CHECK_EQUAL)
            assert "disconnected" in k.ok("%scale stop").stdout
            assert k.descendants() == []
        finally:
            k.shutdown()
        assert cluster.poll() is None
        import ipyparallel as ipp

        client = ipp.Client(str(url_file), timeout=30)
        try:
            assert len(client.ids) == 2
            assert sorted(client[:].apply_sync(os.getpid)) == sorted(pids)  # the same engines, working
        finally:
            client.close()
    finally:
        engines = psutil.Process(cluster.pid).children(recursive=True) if cluster.poll() is None else []
        _stop([cluster])
        assert wait_gone(engines, timeout=20) == []


def test_connect_to_nothing_fails_within_seconds_in_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed: nothing listens there
    # What a cluster that is gone leaves behind: its controller's connection file.
    url_file = tmp_path / "ipcontroller-gone-client.json"
    url_file.write_text(json.dumps({
        "ssh": "", "interface": "tcp://127.0.0.1", "location": "127.0.0.1", "task_scheme": "leastload",
        **{channel: port for channel in ("registration", "control", "mux", "task", "iopub", "notification",
                                         "broadcast", "hb_ping", "hb_pong")},
        "key": "0" * 32, "signature_scheme": "hmac-sha256", "pack": "json", "unpack": "json"}))
    k = Kernel()
    try:
        k.ok(SETUP)
        for target, says in [(f"tcp://127.0.0.1:{port}", f"could not connect to the Dask scheduler at tcp://127.0.0.1:{port}"),
                             (url_file, f"could not connect to the ipyparallel controller ({url_file})")]:
            started = time.monotonic()
            out = k.cell(f"%scale connect {target}", timeout=150)
            elapsed = time.monotonic() - started
            assert out.error is not None and says in out.error["evalue"], out.error_text
            assert len(out.error["traceback"]) == 1, out.error_text  # one line, no traceback
            # Not the 120 s start timeout: a bound loose enough for a busy shared machine.
            assert elapsed < 60, f"{target}: {elapsed:.1f} s"
            assert "no cluster running" in k.ok("%scale").stdout
        assert k.descendants() == []
    finally:
        k.shutdown()


def test_connect_to_dask_workers_without_torch_names_the_cause(tmp_path):
    broken = tmp_path / "site"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text('raise ImportError("simulated broken torch install")\n')
    scheduler_file = tmp_path / "scheduler.json"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    processes = [subprocess.Popen(
        [BIN / "dask", "scheduler", *LOOPBACK, "--port", "0", "--scheduler-file", scheduler_file], **quiet)]
    try:
        _wait_for(lambda: scheduler_file.exists() and scheduler_file.stat().st_size > 0, 60, "no scheduler file")
        address = json.loads(scheduler_file.read_text())["address"]
        processes.append(subprocess.Popen(
            [BIN / "dask", "worker", address, "--nthreads", "1", *LOOPBACK],
            env=dict(os.environ, PYTHONPATH=str(broken)), **quiet))
        k = Kernel()
        try:
            k.ok(SETUP)
            out = k.cell(f"%scale connect {address} --workers 1", timeout=120)
            assert not out.ok
            assert "simulated broken torch install" in out.error["evalue"]
            assert "install jupyter_scale and torch in the workers' environment" in out.error["evalue"]
            assert "no cluster running" in k.ok("%scale").stdout
        finally:
            k.shutdown()
        assert all(p.poll() is None for p in processes)  # not ours: left running
    finally:
        _stop(processes)


@pytest.fixture
def dask_tls_cluster(tmp_path):
    """A `dask` CLI scheduler and worker that speak TLS only, with a CA of the test's own."""
    from distributed.security import Security

    made = Security.temporary()  # a self-signed certificate: its own CA
    cert, key = tmp_path / "cluster.pem", tmp_path / "cluster.key"
    cert.write_text(made.tls_ca_file)
    key.write_text(made.tls_client_key)
    tls = ["--tls-ca-file", cert, "--tls-cert", cert, "--tls-key", key]
    scheduler_file = tmp_path / "scheduler.json"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    scheduler = subprocess.Popen([BIN / "dask", "scheduler", "--protocol", "tls", *LOOPBACK, "--port", "0",
                                  "--scheduler-file", scheduler_file, *tls], **quiet)
    processes = [scheduler]
    try:
        _wait_for(lambda: scheduler_file.exists() and scheduler_file.stat().st_size > 0, 60, "no scheduler file")
        address = json.loads(scheduler_file.read_text())["address"]
        assert address.startswith("tls://127.0.0.1:")
        processes.append(subprocess.Popen([BIN / "dask", "worker", address, "--nthreads", "1", *LOOPBACK,
                                           "--memory-limit", "0", *tls], **quiet))
        yield address, cert, key
    finally:
        _stop(processes)


def test_connect_to_a_tls_dask_cluster_takes_the_users_certificates(dask_tls_cluster):
    address, cert, key = dask_tls_cluster
    k = Kernel()
    try:
        k.ok(SETUP)
        # Without credentials the scheduler turns the kernel away, and says so in one line.
        out = k.cell(f"jupyter_scale.get_session().start_timeout = 10\n%scale connect {address}", timeout=120)
        assert not out.ok and "could not connect to the Dask scheduler" in out.error_text, out.error_text
        out = k.cell(f"%scale connect {address} --tls-cert {cert}", timeout=30)
        assert "UsageError: TLS needs --tls-ca-file and --tls-cert" in out.stderr, out.stderr
        k.ok(f"%scale connect {address} --workers 1 --tls-ca-file {cert} --tls-cert {cert} --tls-key {key}",
             timeout=120)
        out = k.ok("%%distribute\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item(), world_size)")
        assert "[rank 0] sum 1.0 1" in out.stdout
        k.ok("%scale stop")
    finally:
        k.shutdown()


@pytest.mark.parametrize("how", ["ray://", "gcs"])
def test_connect_to_a_ray_cli_cluster_trains_and_leaves_it_running(ray_cli_cluster, how):
    gcs, client_port, token, head = ray_cli_cluster
    address = f"ray://127.0.0.1:{client_port}" if how == "ray://" else f"{gcs} --backend ray"
    k = Kernel()
    try:
        k.ok(SETUP)
        k.ok(NOTEBOOK)
        # The user's token for their cluster, as Ray's docs say to give it.
        k.ok(f"import os\nos.environ.update(RAY_AUTH_MODE='token', RAY_AUTH_TOKEN_PATH={token!r})")
        out = k.ok(f"%scale connect {address} --workers 2", timeout=180)
        assert "2 workers ready" in out.stdout
        status = k.ok("%scale").stdout
        assert "connected ray cluster, 2 workers" in status
        pids = k.value("[w['pid'] for w in jupyter_scale.get_session().workers]")
        ours = {c.pid for c in psutil.Process(head.pid).children(recursive=True)}
        assert set(pids) <= ours and k.descendants() == []  # the actors are the cluster's processes

        trained = k.ok(TRAIN, timeout=180)
        assert "[rank 0] host 0 2" in trained.stdout and "[rank 1] host 1 2" in trained.stdout
        k.ok(CHECK_EQUAL)
        assert k.value("len(jupyter_scale.history())") == 2 * 4

        out = k.ok("%scale stop")
        assert "disconnected" in out.stdout
        # Our actors are gone (they were ours, made on connect); the head lives on.
        assert wait_gone([psutil.Process(p) for p in pids if psutil.pid_exists(p)]) == []
    finally:
        k.shutdown()
    assert head.poll() is None
