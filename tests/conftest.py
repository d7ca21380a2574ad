import sys
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
