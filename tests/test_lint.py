"""The code passes ruff's checks (pyflakes, pycodestyle, import order, bugbear, pyupgrade;
configured in pyproject.toml): part of the test command, so a local run catches what CI would."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:]


def test_mypy_finds_nothing_in_the_kernel_side_modules():
    # The modules and settings are in pyproject.toml ([tool.mypy]).
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-5000:]
