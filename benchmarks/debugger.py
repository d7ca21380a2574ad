"""How long one pdb command takes on a rank, against pdb in the kernel itself.

A frontend answers the kernel's input requests as fast as it can (`p 1`, COMMANDS times);
the time from an answer to the next prompt is one command's round trip: through the kernel's
stdin, the rank's mailbox (the group's store) and its event stream for a rank's pdb, through
the kernel's stdin alone for the notebook's own pdb (`pdb.set_trace()` in a plain cell: the
baseline, measured in the same run). Medians, and the ratio to the baseline, per engine:

    python benchmarks/debugger.py [--engines ipyparallel,dask,ray] [--commands 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from kernel import Kernel  # noqa: E402


def round_trips(kernel: Kernel, code: str, commands: int) -> list[float]:
    """Seconds from each answer to the next prompt, answering `p 1` `commands` times, then `c`."""
    client = kernel.client
    msg_id = client.execute(code, allow_stdin=True, store_history=False)
    times, answered_at = [], None
    for i in range(commands + 1):
        client.get_stdin_msg(timeout=120)
        if answered_at is not None:
            times.append(time.perf_counter() - answered_at)
        answered_at = time.perf_counter()
        client.input("p 1" if i < commands else "c")
    kernel._reply(msg_id, timeout=120)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="ipyparallel,dask,ray")
    parser.add_argument("--commands", type=int, default=30)
    args = parser.parse_args()
    print(f"{'engine':<12} {'kernel pdb (ms)':>16} {'rank pdb (ms)':>14} {'ratio':>7}")
    for engine in args.engines.split(","):
        os.environ["JUPYTER_SCALE_BACKEND"] = engine
        kernel = Kernel(backend=engine)
        try:
            kernel.ok("%load_ext jupyter_scale")
            kernel.ok("%%distribute --workers 2\nx = 1\n", timeout=300)  # the cluster and its group
            # In the kernel, breakpoint() goes to debugpy (JupyterLab's visual debugger): pdb.set_trace()
            # is the notebook's own pdb there.
            local = statistics.median(round_trips(kernel, "import pdb; pdb.set_trace()\ny = 1\n", args.commands))
            rank = statistics.median(round_trips(
                kernel, "%%distribute\nif rank == 1:\n    breakpoint()\ny = 1\n", args.commands))
            print(f"{engine:<12} {local * 1e3:>16.1f} {rank * 1e3:>14.1f} {rank / local:>7.1f}")
        finally:
            kernel.cell("%scale stop", timeout=120)
            kernel.shutdown()


if __name__ == "__main__":
    main()
