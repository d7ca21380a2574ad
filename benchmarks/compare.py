"""The same training loop under the tools a user would pick, from a real Jupyter kernel.

    python benchmarks/compare.py [--repeat 3] [--steps 300] [--tools torchrun,auto,manual,px,dask,accelerate]

One loop (fixed-seed MLP 256-512-512-10 on synthetic data, SGD with momentum, batch 64 per
rank, 2 ranks, gloo on 127.0.0.1) under:

- torchrun:  the baseline, a script run with `torchrun --nproc-per-node 2` (DDP +
             DistributedSampler, as its docs write it); timed from the process start.
- auto:      `%%distribute` automatic mode: the single-process loop, unchanged.
- manual:    `%%distribute --manual` with `jupyter_scale.wrap` / `jupyter_scale.shard`.
- px:        hand-rolled ipyparallel: start a cluster, set the rendezvous up by hand, DDP in `%%px`.
- dask:      `%%distribute --backend dask` automatic mode.
- accelerate: accelerate's `notebook_launcher` (`pip install accelerate`): the loop in a
             function with an `Accelerator(cpu=True)`, forked into 2 processes.

Each notebook runs in a fresh kernel through nbclient (as nbval and papermill do). Metrics:
cold start (from the start of the first cell that launches anything, the kernel already up,
to the end of the first training step on rank 0) and steady-state steps/s (rank 0, after
`--warm` steps). Tools run interleaved in every round; medians; ratios to torchrun.
Not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import re
import socket
import statistics
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient

from torchrun import run_torchrun  # benchmarks/, the script's own folder

# The loop as a user writes it for one process; {shard} and {wrap} are where each tool
# needs (or does not need) its own lines.
DATA = """
import time, torch, torch.nn as nn
from torch.utils.data import TensorDataset, DataLoader
STEPS, WARM = {steps}, {warm}
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(STEPS * 64 * 2, 256, generator=g), torch.randint(0, 10, (STEPS * 64 * 2,), generator=g))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
"""

LOOP = """
loader = {loader}
model = {model}
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
step = 0
for x, y in loader:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    step += 1
    if step == 1:
        first = time.time()
    if step == WARM:
        warm_at = time.time()
if {is_rank0}:
    print(f"BENCH first={{first!r}} rate={{(step - WARM) / (time.time() - warm_at)!r}} steps={{step}}", flush=True)
"""

PLAIN_LOADER = "DataLoader(data, batch_size=64, shuffle=True)"


def loop(loader: str, model: str, is_rank0: str) -> str:
    return LOOP.format(loader=loader, model=model, is_rank0=is_rank0)


def torchrun_script(steps: int, warm: int) -> str:
    return ("import os, torch.distributed as dist\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "from torch.utils.data import DistributedSampler\n"
            "dist.init_process_group('gloo')\n"
            + DATA.format(steps=steps, warm=warm)
            + loop("DataLoader(data, batch_size=64, sampler=DistributedSampler(data, shuffle=True))",
                   "DDP(model)", "dist.get_rank() == 0")
            + "dist.destroy_process_group()\n")


def distribute_cells(steps: int, warm: int, flags: str) -> list[str]:
    if "--manual" in flags:
        body = loop(f"jupyter_scale.shard({PLAIN_LOADER})", "jupyter_scale.wrap(model)", "rank == 0")
    else:
        body = loop(PLAIN_LOADER, "model", "rank == 0")
    return ["%load_ext jupyter_scale\nimport jupyter_scale" + DATA.format(steps=steps, warm=warm),
            f"%%distribute --workers 2 {flags}\n" + body]


def px_cells(steps: int, warm: int) -> list[str]:
    # What a user writes by hand with ipyparallel: a cluster, a rendezvous port, env, DDP.
    return [
        DATA.format(steps=steps, warm=warm),
        "import ipyparallel as ipp, socket\n"
        "cluster = ipp.Cluster(n=2, controller_ip='127.0.0.1', controller_location='127.0.0.1')\n"
        "rc = cluster.start_and_connect_sync(activate=True)\n"
        "rc.wait_for_engines(2, timeout=120)\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "rc[:].push({'port': port, 'data': data, 'model': model, 'STEPS': STEPS, 'WARM': WARM}, block=True)\n"
        "rc[:].scatter('rank', [0, 1], flatten=True, block=True)",
        "%%px\nimport os, time, torch, torch.nn as nn, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.utils.data import DataLoader, DistributedSampler\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), GLOO_SOCKET_IFNAME='lo')\n"
        "torch.set_num_threads(1)\n"
        "dist.init_process_group('gloo', rank=rank, world_size=2)\n"
        + loop("DataLoader(data, batch_size=64, sampler=DistributedSampler(data, shuffle=True))",
               "DDP(model)", "rank == 0"),
        "%%px\ndist.destroy_process_group()",
        "rc.close()\ncluster.stop_cluster_sync()",
    ]


def accelerate_cells(steps: int, warm: int) -> list[str]:
    # accelerate's notebook_launcher: the loop in a function, prepared by an Accelerator,
    # forked into 2 processes (its CPU path: gloo on 127.0.0.1).
    body = loop("DataLoader(data, batch_size=64, shuffle=True)", "model", "accelerator.is_main_process")
    body = body.replace("    nn.functional.cross_entropy(model(x), y).backward()",
                        "    accelerator.backward(nn.functional.cross_entropy(model(x), y))")
    body = body.replace("opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)",
                        "opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)\n"
                        "model, opt, loader = accelerator.prepare(model, opt, loader)")
    function = "def train():\n    global model\n    accelerator = Accelerator(cpu=True)\n" + \
        "".join(f"    {line}\n" for line in body.strip().splitlines())
    return [DATA.format(steps=steps, warm=warm) + "from accelerate import Accelerator, notebook_launcher\n"
            "import socket\ns = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
            + function,
            "notebook_launcher(train, num_processes=2, use_port=str(port))"]


def parse(text: str) -> tuple[float, float]:
    found = re.search(r"BENCH first=([0-9.e+]+) rate=([0-9.e+]+)", text)
    if not found:
        raise RuntimeError(f"no result in the output:\n{text[-3000:]}")
    return float(found.group(1)), float(found.group(2))


def run_notebook(cells: list[str], launch_cell: int) -> tuple[float, float]:
    """Run `cells` in a fresh kernel; (cold start, steps/s). The clock starts when cell
    `launch_cell` starts executing."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(nb, timeout=900, kernel_name="python3", record_timing=True,
                            resources={"metadata": {"path": tempfile.gettempdir()}})
    client.execute()
    # Streams, and display data too: %%px shows each engine's stdout as display_data.
    text = "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                   for c in nb.cells for o in c.get("outputs", []))
    first, rate = parse(text)
    started = nb.cells[launch_cell].metadata["execution"]["iopub.execute_input"]
    t0 = datetime.datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp()
    return first - t0, rate


def torchrun_baseline(steps: int, warm: int) -> tuple[float, float]:
    t0 = time.time()
    done = run_torchrun(torchrun_script(steps, warm))
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    first, rate = parse(done.stdout)
    return first - t0, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warm", type=int, default=30)
    parser.add_argument("--tools", default="torchrun,auto,manual,px,dask,accelerate")
    args = parser.parse_args()
    tools = args.tools.split(",")
    if "accelerate" in tools and importlib.util.find_spec("accelerate") is None:
        print("accelerate is not installed (pip install accelerate): skipping it", file=sys.stderr)
        tools.remove("accelerate")
    runs = {
        "torchrun": lambda: torchrun_baseline(args.steps, args.warm),
        "auto": lambda: run_notebook(distribute_cells(args.steps, args.warm, ""), 1),
        "manual": lambda: run_notebook(distribute_cells(args.steps, args.warm, "--manual"), 1),
        "px": lambda: run_notebook(px_cells(args.steps, args.warm), 1),
        "dask": lambda: run_notebook(distribute_cells(args.steps, args.warm, "--backend dask"), 1),
        "accelerate": lambda: run_notebook(accelerate_cells(args.steps, args.warm), 1),
    }
    results: dict[str, list[tuple[float, float]]] = {t: [] for t in tools}
    for i in range(args.repeat):
        for tool in tools:
            results[tool].append(runs[tool]())
            print(f"round {i + 1} {tool}: cold {results[tool][-1][0]:.2f} s, "
                  f"{results[tool][-1][1]:.1f} steps/s", file=sys.stderr, flush=True)
    base = results.get("torchrun")
    base_cold = statistics.median(r[0] for r in base) if base else None
    base_rate = statistics.median(r[1] for r in base) if base else None
    print(f"\n{socket.gethostname()}, {os.cpu_count()} cores, {args.repeat} rounds, {args.steps} steps, "
          f"steady state after {args.warm}")
    print("| tool | cold start (s) | x torchrun | steps/s | x torchrun |")
    print("|---|---:|---:|---:|---:|")
    for tool in tools:
        cold = statistics.median(r[0] for r in results[tool])
        rate = statistics.median(r[1] for r in results[tool])
        rc = f"{cold / base_cold:.2f}" if base_cold else ""
        rr = f"{rate / base_rate:.2f}" if base_rate else ""
        print(f"| {tool} | {cold:.2f} | {rc} | {rate:.1f} | {rr} |")


if __name__ == "__main__":
    main()
