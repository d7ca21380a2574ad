import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kernel import Kernel  # noqa: E402

# A small seeded model and dataset, and the README's loop on them (automatic mode, unchanged),
# ending with the flat weights each rank holds: the tests of where workers run (other hosts,
# Slurm, MPI) append what each rank saw of its place.
README_DATA = """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 2, (1024,), generator=g))
"""
README_LOOP = """
loader = DataLoader(data, batch_size=32, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        report(loss=loss)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
"""
# Run in the kernel after README_LOOP on `n` workers: every rank and the notebook hold the same weights.
SAME_WEIGHTS = """
ws = jupyter_scale.get_session().gather("weights")
local = torch.cat([p.detach().flatten() for p in model.parameters()])
assert len(ws) == {n} and all(torch.equal(w, local) for w in ws), "weights differ across ranks or the notebook"
"""

# Run on the workers first (in a %%distribute cell): `with averaging_counted() as averaged:`
# around training counts the parameter gradients automatic mode averaged (`averaged.count`).
COUNT_AVERAGING = """
import jupyter_scale.training as training

class averaging_counted:
    def __enter__(self):
        self.count, self.original = 0, training._average_gradients
        def counted(params, skip, *args, **kwargs):
            self.count += sum(1 for p in params if id(p) not in skip and p.grad is not None)
            return self.original(params, skip, *args, **kwargs)
        training._average_gradients = counted
        return self
    def __exit__(self, *exc):
        training._average_gradients = self.original
"""

SETUP = """
%load_ext jupyter_scale
import torch, torch.nn as nn
import torch.distributed as dist
from torch.utils.data import TensorDataset, DataLoader
import jupyter_scale
"""


def wait_gone(processes, timeout=15.0):
    """Processes still alive after `timeout` (zombies count as gone)."""
    gone, alive = psutil.wait_procs(processes, timeout=timeout)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


ENGINES = ["ipyparallel", "dask", "ray"]
# The engines whose clusters the tests start across hosts and on Slurm (a Ray cluster there is
# started with Ray's own tools, then connected to).
CLUSTER_ENGINES = ["ipyparallel", "dask"]


def _started_kernel(backend=None):
    k = Kernel(backend=backend)
    k.ok(SETUP)
    return k


def _stop_and_check(k):
    """%scale stop, shut the kernel down, and fail if anything it started survives."""
    k.cell("%scale stop", timeout=60)
    leftovers = psutil.Process(k.pid).children(recursive=True)  # the resource tracker too
    k.shutdown()
    still = wait_gone(leftovers)
    for p in still:  # clean up what we started, by pid, before failing
        p.kill()
    assert not still, f"processes left behind by the kernel: {still}"


def kernel_fixture(engines):
    """A module-scoped `kernel` fixture over `engines`: a real kernel with jupyter_scale loaded,
    once per engine (picked the way users do, with $JUPYTER_SCALE_BACKEND); afterwards nothing
    it started may remain. A test module that assigns `kernel = kernel_fixture([...])` runs its
    tests on those engines only."""
    @pytest.fixture(scope="module", params=engines)
    def kernel(request):
        k = _started_kernel(request.param)
        yield k
        _stop_and_check(k)

    return kernel


kernel = kernel_fixture(ENGINES)


@pytest.fixture
def fresh_kernel():
    k = _started_kernel()
    yield k
    _stop_and_check(k)


@pytest.fixture
def ray_cli_cluster():
    """A Ray head of 2 CPUs from the `ray` CLI, as a user or KubeRay starts one: on loopback
    only (Ray's one-node setting) and with a token of its own, which the kernel is given as a
    user gives it (RAY_AUTH_TOKEN_PATH)."""
    import secrets
    import tempfile

    temp = tempfile.mkdtemp(prefix="rayt-", dir="/tmp")  # short: Ray's socket paths
    token = os.path.join(temp, "token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        client_port = s.getsockname()[1]
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    ray = Path(sys.executable).parent / "ray"
    head = subprocess.Popen([ray, "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--port=0",
                             f"--ray-client-server-port={client_port}", "--include-dashboard=false",
                             "--disable-usage-stats", f"--temp-dir={temp}", "--num-cpus=2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    found = Path(temp) / "ray_current_cluster"
    tree = []
    try:
        deadline = time.monotonic() + 60
        while not (found.exists() and found.read_text().strip()):
            assert time.monotonic() < deadline and head.poll() is None, "no Ray head within 60 s"
            time.sleep(0.2)
        tree = [psutil.Process(head.pid), *psutil.Process(head.pid).children(recursive=True)]
        yield found.read_text().strip(), client_port, token, head
    finally:
        if head.poll() is None:  # and what it started since
            tree += [p for p in psutil.Process(head.pid).children(recursive=True) if p not in tree]
        if head.poll() is None:
            head.terminate()
        try:
            head.wait(timeout=20)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=10)
        for p in wait_gone(tree, timeout=10):  # what `ray start` did not stop, by pid
            p.kill()
        import shutil

        shutil.rmtree(temp, ignore_errors=True)
