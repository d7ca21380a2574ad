"""The differential checker of the state model, longer than the test suite's budget.

    python benchmarks/differential.py [--engines ipyparallel,dask,ray] [--sequences 1000] [--seed 100000]

Runs `--sequences` seeded random notebooks per engine (tests/differential.py's grammar), each
in a plain local kernel and with its distributed cells on a 2-worker cluster, and compares
what the notebook can see after every cell. Prints how many ran and every one that differed
(its seed, cells and the difference); exits 1 if any did. A seed reproduces its notebook.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import SETUP as LOAD  # noqa: E402
from differential import SETUP, describe, run_sequence, sequence  # noqa: E402
from kernel import Kernel  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="ipyparallel,dask,ray")
    parser.add_argument("--sequences", type=int, default=1000, help="per engine")
    parser.add_argument("--seed", type=int, default=100000, help="the first seed (the test suite uses 0-2069)")
    args = parser.parse_args()
    local = Kernel()
    local.ok(SETUP)
    failures = 0
    try:
        for offset, engine in enumerate(args.engines.split(",")):
            dist = Kernel(backend=engine)
            try:
                dist.ok(LOAD)
                dist.ok(SETUP)
                dist.ok("%%distribute --workers 2\npass")
                started, ran, cells_run = time.monotonic(), 0, 0
                first = args.seed + offset * args.sequences
                for seed in range(first, first + args.sequences):
                    cells = sequence(seed)
                    difference = run_sequence(local, dist, cells)
                    ran += 1
                    cells_run += len(cells)
                    if difference is not None:
                        failures += 1
                        print(f"--- {engine} seed {seed} differs:\n{describe(cells)}\n=== {difference}\n", flush=True)
                print(f"{engine}: {ran} sequences ({cells_run} cells), {failures} differing so far, "
                      f"{time.monotonic() - started:.0f} s", flush=True)
            finally:
                dist.cell("%scale stop", timeout=60)
                dist.shutdown()
    finally:
        local.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
