"""The differential checker (tests/differential.py) on every engine: seeded random notebooks,
run in a plain local kernel and with some cells under %%distribute on 2 workers, must leave
the same notebook-visible state after every cell. `benchmarks/differential.py` runs more."""

import pytest

from conftest import _started_kernel, _stop_and_check
from differential import SETUP, describe, run_sequence, sequence
from kernel import Kernel

SEQUENCES_PER_ENGINE = 70  # 210 across the three engines


@pytest.fixture(scope="module")
def local():
    k = Kernel()
    k.ok(SETUP)
    yield k
    k.shutdown()


@pytest.fixture(scope="module", params=["ipyparallel", "dask", "ray"])
def dist(request):
    k = _started_kernel(request.param)
    k.ok(SETUP)
    k.ok("%%distribute --workers 2\npass")
    yield k
    _stop_and_check(k)


def test_random_notebooks_leave_the_same_state_as_run_locally(local, dist):
    # Seeds differ per engine: together they cover more sequences.
    offset = {"ipyparallel": 0, "dask": 1000, "ray": 2000}[dist.backend]
    for seed in range(offset, offset + SEQUENCES_PER_ENGINE):
        cells = sequence(seed)
        difference = run_sequence(local, dist, cells)
        assert difference is None, f"seed {seed}:\n{describe(cells)}\n=== {difference}"
