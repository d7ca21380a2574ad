"""Play another local user: code run under a different uid on this machine.

Loopback is not a trust boundary: every account on a shared machine (a JupyterHub node,
a login node) can reach 127.0.0.1. The security tests run what such a neighbour would
try as uid/gid 65534 (nobody), which needs root (CI runs as root) and `setpriv`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

STRANGER_UID = 65534


def require_stranger() -> None:
    """Skip, saying why, where another user cannot be played."""
    if os.geteuid() != 0:
        pytest.skip("playing another local user needs root (setpriv --reuid)")
    if shutil.which("setpriv") is None:
        pytest.skip("playing another local user needs setpriv (util-linux)")


def run_as_stranger(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run Python `code` as another local user, with this test run's interpreter and
    packages (readable by everyone) but none of our files, keys or environment."""
    require_stranger()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    command = ["setpriv", f"--reuid={STRANGER_UID}", f"--regid={STRANGER_UID}", "--clear-groups",
               sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(command, env=env, cwd="/", capture_output=True, text=True, timeout=timeout)
