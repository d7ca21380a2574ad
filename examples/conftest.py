"""nbval runs every example notebook. horovod.ipynb's cells are skipped, with the reason, where
Horovod is not installed (it is built from source: scripts/build_horovod.sh). Two of them need
something that only the tests make, made here before the notebook's kernel starts (so that the
kernel inherits where to find it) and removed after its last cell; where it cannot be made here,
that notebook's cells are skipped with the reason:

- multihost.ipynb attaches to a cluster across hosts: one is made on network-namespace hosts
  (tests/hosts.py), its client file in $JUPYTER_SCALE_EXAMPLE_CLUSTER; it is stopped after the
  notebook's last cell.
- slurm.ipynb submits its workers as a Slurm job: a one-node Slurm is started (tests/slurm.py),
  found by the kernel's sbatch and squeue through $SLURM_CONF; it is closed once the notebook's
  kernel has stopped, so the kernel never talks to a Slurm that is gone.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MULTIHOST = "multihost.ipynb"
SLURM = "slurm.ipynb"
HOROVOD = "horovod.ipynb"
_made: dict = {}


def _is_notebook(item, name: str) -> bool:
    return item is not None and Path(str(item.fspath)).name == name


def _is_multihost(item) -> bool:
    return _is_notebook(item, MULTIHOST)


@pytest.hookimpl(tryfirst=True)  # before nbval's setup starts the notebook's kernel
def pytest_runtest_setup(item):
    if _is_notebook(item, HOROVOD) and importlib.util.find_spec("horovod") is None:
        pytest.skip("horovod is not installed (scripts/build_horovod.sh builds it)")
    if _is_notebook(item, SLURM):
        _start_slurm()
    if not _is_multihost(item) or "cluster" in _made:
        return
    import hosts

    reason = hosts.unavailable_reason()
    if reason:
        pytest.skip(f"needs network-namespace hosts: {reason}")
    net = _made["net"] = hosts.Hosts(3)  # a head for the controller, two hosts of two engines
    _made["cluster"] = hosts.start_ipcluster(net[0], list(net)[1:], 2, net.directory)
    os.environ["JUPYTER_SCALE_EXAMPLE_CLUSTER"] = _made["cluster"].client_file


def _start_slurm():
    if "slurm" in _made:
        return
    if "slurm_failed" in _made:  # the notebook's first cell already reported why in full
        pytest.fail(f"the test Slurm did not start: {_made['slurm_failed']}", pytrace=False)
    import slurm

    reason = slurm.unavailable_reason()
    if reason:
        pytest.skip(f"needs a one-node Slurm: {reason}")
    try:
        _made["slurm"] = slurm.Slurm(cpus=8)
    except slurm.SlurmError as exc:
        _made["slurm_failed"] = str(exc).splitlines()[0]
        raise
    _made["slurm_conf_before"] = os.environ.get("SLURM_CONF")  # a real cluster's, if any: put back after
    os.environ["SLURM_CONF"] = _made["slurm"].env["SLURM_CONF"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    if _is_multihost(item) and not _is_multihost(nextitem):
        _stop()
    yield  # nbval stops the notebook's kernel here, after its last cell
    if _is_notebook(item, SLURM) and not _is_notebook(nextitem, SLURM):
        _close_slurm()


def pytest_sessionfinish(session):
    try:
        _stop()
    finally:
        _close_slurm()


def _stop():
    os.environ.pop("JUPYTER_SCALE_EXAMPLE_CLUSTER", None)
    cluster, net = _made.pop("cluster", None), _made.pop("net", None)
    try:
        if cluster is not None:
            cluster.stop()
    finally:
        if net is not None:
            net.close()


def _close_slurm():
    _made.pop("slurm_failed", None)
    cluster = _made.pop("slurm", None)
    if cluster is None:
        return
    before = _made.pop("slurm_conf_before", None)
    if before is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = before
    cluster.close()
