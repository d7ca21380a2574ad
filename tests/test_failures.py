"""Failures never leave anything behind: injected faults on real clusters of both engines."""

import os
import signal

import psutil
import pytest

from conftest import ENGINES, SETUP, wait_gone
from kernel import Kernel


def _listening_ports(processes):
    ports = set()
    for process in processes:
        try:
            ports |= {c.laddr.port for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return ports


@pytest.mark.parametrize("engine", ENGINES)
def test_a_killed_kernel_leaves_no_worker_controller_or_port(engine):
    k = Kernel(backend=engine)
    try:
        k.ok(SETUP)
        k.ok("%%distribute --workers 2\nt = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2")
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
    finally:
        k.client.stop_channels()
        k.manager.cleanup_resources()
