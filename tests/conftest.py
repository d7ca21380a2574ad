import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kernel import Kernel  # noqa: E402

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


ENGINES = ["ipyparallel", "dask"]


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


@pytest.fixture(scope="module", params=ENGINES)
def kernel(request):
    """A real kernel with jupyter_scale loaded, once per engine (picked the way users do, with
    $JUPYTER_SCALE_BACKEND); afterwards nothing it started may remain."""
    k = _started_kernel(request.param)
    yield k
    _stop_and_check(k)


@pytest.fixture
def fresh_kernel():
    k = _started_kernel()
    yield k
    _stop_and_check(k)
