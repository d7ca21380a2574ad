"""The differential checker (tests/differential.py) on the default engine: seeded random notebooks,
run in a plain local kernel and with some cells under %%distribute on 2 workers, must leave
the same notebook-visible state after every cell. `benchmarks/differential.py` runs more."""

import pytest

from conftest import _started_kernel, _stop_and_check
from differential import SETUP, describe, run_sequence, sequence
from kernel import Kernel

pytestmark = pytest.mark.cluster

SEQUENCES = 70  # per offset: 210 in all (the seeds the three engines used to share)


@pytest.fixture(scope="module")
def local():
    k = Kernel()
    k.ok(SETUP)
    yield k
    k.shutdown()


@pytest.fixture(scope="module")
def dist():
    # What a notebook holds after each cell is the session's doing (shipping, pull-back, the
    # state model), whatever engine carries the bytes: the default engine runs all the sequences
    # the three engines used to share (the engines' own paths: test_distribute, test_failures).
    k = _started_kernel()
    k.ok(SETUP)
    k.ok("%%distribute --workers 2\npass")
    yield k
    _stop_and_check(k)


@pytest.mark.parametrize("offset", [0, 1000, 2000])
def test_random_notebooks_leave_the_same_state_as_run_locally(local, dist, offset):
    for seed in range(offset, offset + SEQUENCES):
        cells = sequence(seed)
        difference = run_sequence(local, dist, cells)
        assert difference is None, f"seed {seed}:\n{describe(cells)}\n=== {difference}"
