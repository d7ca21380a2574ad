"""nbval runs every example notebook. multihost.ipynb attaches to a cluster across hosts: one is
made here for it, on network-namespace hosts (tests/hosts.py), before its kernel starts, and
stopped after its last cell; where such hosts cannot be made, its cells are skipped."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MULTIHOST = "multihost.ipynb"
_made: dict = {}


def _is_multihost(item) -> bool:
    return item is not None and Path(str(item.fspath)).name == MULTIHOST


@pytest.hookimpl(tryfirst=True)  # before nbval's setup starts the notebook's kernel
def pytest_runtest_setup(item):
    if not _is_multihost(item) or "cluster" in _made:
        return
    import hosts

    reason = hosts.unavailable_reason()
    if reason:
        pytest.skip(f"needs network-namespace hosts: {reason}")
    net = _made["net"] = hosts.Hosts(3)  # a head for the controller, two hosts of two engines
    _made["cluster"] = hosts.start_ipcluster(net[0], list(net)[1:], 2, net.directory)
    os.environ["JUPYTER_SCALE_EXAMPLE_CLUSTER"] = _made["cluster"].client_file


def pytest_runtest_teardown(item, nextitem):
    if _is_multihost(item) and not _is_multihost(nextitem):
        _stop()


def pytest_sessionfinish(session):
    _stop()


def _stop():
    os.environ.pop("JUPYTER_SCALE_EXAMPLE_CLUSTER", None)
    cluster, net = _made.pop("cluster", None), _made.pop("net", None)
    try:
        if cluster is not None:
            cluster.stop()
    finally:
        if net is not None:
            net.close()
