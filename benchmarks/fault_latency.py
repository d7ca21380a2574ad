"""How fast failures end a cell, per engine, next to torchrun failing on the same fault.

    python benchmarks/fault_latency.py [--engines ipyparallel,dask] [--repeat 3]

Each fault is injected for real in a real kernel (driven over its Jupyter channels, as a
notebook is) on a 2-worker embedded cluster:

- raise:     rank 1 raises while rank 0 waits for it in an all_reduce. From the raise to
             the cell's end (the kernel back to idle with the error).
- sigkill:   rank 0 SIGKILLs rank 1's process mid-loop. From the kill to the cell's end.
- interrupt: the kernel is interrupted (SIGINT) during a training loop. From the
             interrupt request to the cell's end (every rank stopped and answered).
- timeout:   rank 1 sleeps before an all_reduce under --timeout 10. The cell's duration.
- restart:   the cell after a dead worker (cluster restarted, group formed, cell run).
- orphans:   the kernel is SIGKILLed; from the kill until every process it started is gone.

The baseline for raise and sigkill is `torchrun --nproc-per-node 2` running the same fault:
from the fault to torchrun's exit (its agent notices the failed rank and stops the others).
Times are wall-clock seconds taken from one clock (the worker prints time.time() at the
fault). Not a test: nothing asserts on time. Prints medians.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from torchrun import run_torchrun  # noqa: E402  (benchmarks/, the script's own folder)

from kernel import Kernel  # noqa: E402

SETUP = "%load_ext jupyter_scale\nimport torch, torch.nn as nn, torch.distributed as dist\nimport jupyter_scale"

RAISE = """%%distribute
import time
t = torch.ones(1)
if rank == 1:
    time.sleep(0.5)
    print("fault at", repr(time.time()), flush=True)
    raise ValueError("injected")
dist.all_reduce(t)
"""

SIGKILL = """%%distribute
import os, signal, time
pids = [None, None]
dist.all_gather_object(pids, os.getpid())
t = torch.ones(1)
for step in range(100_000):
    if rank == 0 and step == 200:
        print("fault at", repr(time.time()), flush=True)
        os.kill(pids[1], signal.SIGKILL)
    dist.all_reduce(t)
    t.fill_(1)
"""

TRAIN = """%%distribute
import time
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
print("training", flush=True)
t0 = time.time()
while time.time() - t0 < 300:
    opt.zero_grad()
    model(torch.randn(64, 64)).sum().backward()
    opt.step()
"""

HANG = """%%distribute --timeout 10
import time
if rank == 1:
    time.sleep(600)
dist.all_reduce(torch.ones(1))
"""

TORCHRUN_RAISE = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)            # both ranks up
if dist.get_rank() == 1:
    time.sleep(0.5)
    print("fault at", repr(time.time()), flush=True)
    raise ValueError("injected")
dist.all_reduce(t)
"""

TORCHRUN_SIGKILL = """
import os, signal, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
pids = [None, None]
dist.all_gather_object(pids, os.getpid())
t = torch.ones(1)
for step in range(100_000):
    if dist.get_rank() == 0 and step == 200:
        print("fault at", repr(time.time()), flush=True)
        os.kill(pids[1], signal.SIGKILL)
    dist.all_reduce(t)
    t.fill_(1)
"""


def _fault_time(text: str) -> float:
    return float(text.split("fault at ")[1].split()[0])


def _cell_after_fault(kernel: Kernel, code: str) -> float:
    out = kernel.cell(code, timeout=120)
    ended = time.time()
    assert not out.ok, "the fault did not fail the cell"
    return ended - _fault_time(out.stdout)


def _interrupt(kernel: Kernel) -> float:
    asked: list[float] = []

    def on_stream(name, text):
        if "[rank 1] training" in text and not asked:
            def later():
                time.sleep(1.0)
                asked.append(time.time())
                kernel.manager.interrupt_kernel()
            threading.Thread(target=later, daemon=True).start()

    out = kernel.cell(TRAIN, timeout=120, on_stream=on_stream)
    ended = time.time()
    assert out.error and out.error["ename"] == "KeyboardInterrupt", out.error
    return ended - asked[0]


def _timed(kernel: Kernel, code: str, ok: bool) -> float:
    t0 = time.time()
    out = kernel.cell(code, timeout=180)
    assert out.ok == ok, out.error_text
    return time.time() - t0


def _orphans(engine: str) -> float:
    k = Kernel(backend=engine)
    try:
        k.ok(SETUP)
        k.ok("%%distribute --workers 2\ndist.barrier()", timeout=180)
        started = psutil.Process(k.pid).children(recursive=True)
        t0 = time.time()
        os.kill(k.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(started, timeout=60)
        elapsed = time.time() - t0
        for p in alive:  # clean up by pid what survived (should be none)
            p.kill()
        return elapsed if not alive else float("inf")
    finally:
        k.client.stop_channels()
        k.manager.cleanup_resources()


def _torchrun(script: str) -> float:
    done = run_torchrun(script, timeout=120)
    ended = time.time()
    assert done.returncode != 0, "torchrun did not fail"
    return ended - _fault_time(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="ipyparallel,dask")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    engines = args.engines.split(",")
    results: dict[tuple[str, str], list[float]] = {}

    def add(engine, metric, value):
        results.setdefault((engine, metric), []).append(value)

    kernels = {e: Kernel(backend=e) for e in engines}
    try:
        for k in kernels.values():
            k.ok(SETUP)
            k.ok("%%distribute --workers 2\ndist.barrier()", timeout=180)
        for i in range(args.repeat):  # interleaved: every engine and torchrun in each round
            add("torchrun", "raise", _torchrun(TORCHRUN_RAISE))
            add("torchrun", "sigkill", _torchrun(TORCHRUN_SIGKILL))
            for engine, k in kernels.items():
                add(engine, "raise", _cell_after_fault(k, RAISE))
                add(engine, "sigkill", _cell_after_fault(k, SIGKILL))
                add(engine, "restart", _timed(k, "%%distribute\ndist.barrier()", ok=True))
                add(engine, "interrupt", _interrupt(k))
                add(engine, "timeout", _timed(k, HANG, ok=False))
            print(f"round {i + 1}/{args.repeat} done", file=sys.stderr, flush=True)
    finally:
        for k in kernels.values():
            k.cell("%scale stop", timeout=60)
            k.shutdown()
    for engine in engines:
        for _ in range(min(args.repeat, 2)):
            add(engine, "orphans", _orphans(engine))

    metrics = ["raise", "sigkill", "interrupt", "timeout", "restart", "orphans"]
    columns = ["torchrun", *engines]
    print("| fault (s, median) | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for metric in metrics:
        cells = []
        for column in columns:
            values = results.get((column, metric))
            cells.append(f"{statistics.median(values):.2f}" if values else "")
        print(f"| {metric} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
