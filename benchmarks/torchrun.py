"""Run a script under `torchrun --nproc-per-node N` on 127.0.0.1: the baseline of the benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def run_torchrun(script: str, nproc: int = 2, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run `script` (source text) under torchrun; its stdout (text) and return code.

    c10d rendezvous on a free loopback port (a static one with port 0 never meets), one
    thread per rank with several ranks and torch's default with one (torchrun's own
    defaults: it sets OMP_NUM_THREADS=1 only for more than one rank), gloo on loopback. On
    timeout, torchrun and its ranks (the session it leads) are killed before raising.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "script.py")
        path.write_text(script)
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
