"""The side-by-side numbers in one command: %%distribute against the tools a user would pick, from real Jupyter kernels.

    python benchmarks/compare.py [--sections tools,warm,report,shipping,scaling,recovery] [--repeat 3] [--steps 300]
                                 [--tools torchrun,auto,manual,px,dask,accelerate] [--ship-sizes 10,100,500]
                                 [--out benchmarks/results/compare-latest.json] [--plot benchmarks/compare.png]

Every notebook runs in a fresh kernel through nbclient (as nbval and papermill do); what it
measures it prints as `BENCH ...` lines (`key=value` pairs, or one JSON object) that this
driver parses. Every baseline is measured in the same run; results are medians, with ratios
to the baseline. Not a test: nothing asserts on time. Sections (`--sections`, default all):

- tools:    one training loop (fixed-seed MLP 256-512-512-10 on synthetic data, SGD with
            momentum, batch 64 per rank, 2 ranks, gloo on 127.0.0.1) under
              torchrun    the baseline: a DDP + DistributedSampler script under
                          `torchrun --nproc-per-node 2`, timed from the process start;
              auto        `%%distribute` automatic mode: the single-process loop, unchanged;
              manual      `%%distribute --manual` with `jupyter_scale.wrap` / `jupyter_scale.shard`;
              px          hand-rolled ipyparallel: a cluster, a rendezvous by hand, DDP in `%%px`;
              dask        `%%distribute --backend dask`, automatic mode;
              accelerate  accelerate's `notebook_launcher` (`pip install accelerate`): the loop in
                          a function with an `Accelerator(cpu=True)`, forked into 2 processes.
            Cold start (from the start of the first cell that launches anything, the kernel
            up, to the end of rank 0's first step), steady-state steps/s (rank 0, after
            `--warm` steps) and rank 0's peak RSS (ru_maxrss). Tools interleaved per round.
- warm:     the latency of a trivial cell on a warm 2-worker cluster: 20 runs of
            `%%distribute --workers 2` `x = 1` against 20 runs of a hand-rolled `%%px x = 1`
            on an ipyparallel cluster started in the same kernel, in alternating chunks after
            2 warm-ups each. Once with the default engine, once with `--backend dask` (a second
            kernel, with its own `%%px` baseline).
- report:   what `report(loss=loss)` every step costs: the loop in automatic mode with and
            without it, alternating, `--repeat` rounds in one kernel; rank 0's steps/s;
            overhead = 1 - with / without; worker-to-kernel latency of the reported points.
- shipping: in one kernel with a 2-worker cluster, for each `--ship-sizes` model (MiB of
            float32 weights in bias-free nn.Linear layers): the first cell that reads it, the
            cell after every parameter changed in place (re-sent), and the same cell with
            nothing changed (what the cell's RunRecord says it sent and skipped). In automatic
            and manual mode alike, every module a cell reads is pulled back from rank 0 at the
            end of the cell: that is part of each cell's time. Baseline: the same model pushed
            by hand (`rc[:].push`, ipyparallel's own serialization) to a hand-rolled 2-engine
            cluster in the same kernel, pulled back from engine 0 (`rc[0].pull`), and its
            weights pushed as numpy arrays (raw buffers: ipyparallel's fastest path). Then the
            kernel's CPU time for the 100 MiB changed-in-place cell at 1, 2 and 4 workers: the
            kernel sends a value once, so it should not grow with the workers. Then the
            largest model's cells again in a kernel with the write watch off
            (ScaleSession.write_watch = False: every tensor hashed whole), and each cell's
            pull-back time (RunRecord.pullback_seconds) with it on and off.
- scaling:  cold start and steps/s of torchrun and `%%distribute` automatic mode at 1, 2 and
            4 ranks (batch 64 per rank: the global batch grows with the ranks).
- recovery: in one kernel per engine, `%%distribute --workers 2` `x = rank` cells: the first
            (the cluster's start, right after the `%load_ext` cell), the cell after `%scale
            restart` (restart included), the cell after rank 1's process was SIGKILLed
            between cells (the restart it does included; how long the death took to be
            noticed is kept apart), and the first cell with `--workers 3` (the resize
            included); `--repeat` rounds of each. Baseline: torchrun's cold start (the tools
            section's script, 40 steps), measured in the same run.

Writes every raw result and the medians to `--out` (JSON), prints one markdown table per
section, and draws `--plot` with benchmarks/plot.py when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import nbformat
import psutil
from nbclient import NotebookClient
from torchrun import run_torchrun  # benchmarks/, the script's own folder

HERE = Path(__file__).resolve().parent
SECTIONS = ("tools", "warm", "report", "shipping", "scaling", "recovery")
TOOLS = {  # name -> how the tables and the plot call it
    "torchrun": "torchrun",
    "auto": "`%%distribute` (automatic)",
    "manual": "`%%distribute --manual` + `wrap`",
    "px": "hand-rolled ipyparallel `%%px`",
    "dask": "`%%distribute --backend dask`",
    "accelerate": "accelerate `notebook_launcher`",
}
WARM_CELLS, WARM_UPS, WARM_CHUNK = 20, 2, 5  # warm section: timed runs, untimed first runs, runs per chunk
SCALING_WORKERS = (1, 2, 4)
KERNEL_CPU_MIB = 100  # shipping section: the model whose kernel CPU time is measured at 1, 2, 4 workers

# ----------------------------------------------------------------------------------
# Notebook code
# ----------------------------------------------------------------------------------

# The loop as a user writes it for one process; {loader}, {model} and {is_rank0} are
# where each tool needs (or does not need) its own lines. Each rank runs STEPS steps:
# the dataset holds STEPS batches of 64 per rank.
DATA = """
import time, torch, torch.nn as nn
from torch.utils.data import TensorDataset, DataLoader
STEPS, WARM, RANKS = {steps}, {warm}, {ranks}
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(STEPS * 64 * RANKS, 256, generator=g),
                     torch.randint(0, 10, (STEPS * 64 * RANKS,), generator=g))
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
    import resource
    print(f"BENCH first={{first!r}} rate={{(step - WARM) / (time.time() - warm_at)!r}} steps={{step}} "
          f"maxrss={{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss!r}}", flush=True)
"""

PLAIN_LOADER = "DataLoader(data, batch_size=64, shuffle=True)"
SAMPLER_LOADER = "DataLoader(data, batch_size=64, sampler=DistributedSampler(data, shuffle=True))"

# A hand-rolled ipyparallel cluster of 2 engines, `%%px` active, as its docs write it.
PX_START = """
import ipyparallel as ipp
cluster = ipp.Cluster(n=2, controller_ip='127.0.0.1', controller_location='127.0.0.1')
rc = cluster.start_and_connect_sync(activate=True)
rc.wait_for_engines(2, timeout=120)
"""

# Every notebook's last cell, run even when a cell before it failed: stops what the
# notebook started (jupyter_scale's cluster, a hand-rolled ipyparallel one).
CLEANUP = """
import sys
try:
    if 'jupyter_scale' in sys.modules:
        sys.modules['jupyter_scale'].get_session().stop()  # what %scale stop does
finally:
    if 'rc' in globals():
        rc.close()
    if 'cluster' in globals():
        cluster.stop_cluster_sync()
"""

# The kernel side of the sections that time cells from inside the kernel.
TIMING = """
%load_ext jupyter_scale
import json, statistics, time, torch, torch.nn as nn
import jupyter_scale
ip = get_ipython()
session = jupyter_scale.get_session()

def timed(run, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times
"""


def loop(loader: str, model: str, is_rank0: str) -> str:
    return LOOP.format(loader=loader, model=model, is_rank0=is_rank0)


def data(steps: int, warm: int, ranks: int) -> str:
    return DATA.format(steps=steps, warm=warm, ranks=ranks)


def torchrun_script(steps: int, warm: int, ranks: int = 2) -> str:
    return ("import os, torch.distributed as dist\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "from torch.utils.data import DistributedSampler\n"
            "dist.init_process_group('gloo')\n"
            + data(steps, warm, ranks)
            + loop(SAMPLER_LOADER, "DDP(model)", "dist.get_rank() == 0")
            # Without the barrier a rank at 4 ranks aborts at times in the teardown
            # ("terminate called without an active exception"), after its measurement.
            + "dist.barrier()\ndist.destroy_process_group()\n")


def distribute_cells(steps: int, warm: int, flags: str, workers: int = 2) -> list[str]:
    if "--manual" in flags:
        body = loop(f"jupyter_scale.shard({PLAIN_LOADER})", "jupyter_scale.wrap(model)", "rank == 0")
    else:
        body = loop(PLAIN_LOADER, "model", "rank == 0")
    return ["%load_ext jupyter_scale\nimport jupyter_scale" + data(steps, warm, workers),
            f"%%distribute --workers {workers} {flags}\n" + body]


def px_cells(steps: int, warm: int) -> list[str]:
    # What a user writes by hand with ipyparallel: a cluster, a rendezvous port, env, DDP.
    return [
        data(steps, warm, 2),
        PX_START + "import socket\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "rc[:].push({'port': port, 'data': data, 'model': model, 'STEPS': STEPS, 'WARM': WARM}, block=True)\n"
        "rc[:].scatter('rank', [0, 1], flatten=True, block=True)",
        "%%px\nimport os, time, torch, torch.nn as nn, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.utils.data import DataLoader, DistributedSampler\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), GLOO_SOCKET_IFNAME='lo')\n"
        "torch.set_num_threads(1)\n"
        "dist.init_process_group('gloo', rank=rank, world_size=2)\n"
        + loop(SAMPLER_LOADER, "DDP(model)", "rank == 0"),
        "%%px\ndist.destroy_process_group()",
    ]


def accelerate_cells(steps: int, warm: int) -> list[str]:
    # accelerate's notebook_launcher: the loop in a function, prepared by an Accelerator,
    # forked into 2 processes (its CPU path: gloo on 127.0.0.1).
    body = loop(PLAIN_LOADER, "model", "accelerator.is_main_process")
    body = body.replace("    nn.functional.cross_entropy(model(x), y).backward()",
                        "    accelerator.backward(nn.functional.cross_entropy(model(x), y))")
    body = body.replace("opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)",
                        "opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)\n"
                        "model, opt, loader = accelerator.prepare(model, opt, loader)")
    function = "def train():\n    global model\n    accelerator = Accelerator(cpu=True)\n" + \
        "".join(f"    {line}\n" for line in body.strip().splitlines())
    return [data(steps, warm, 2) + "from accelerate import Accelerator, notebook_launcher\n"
            "import socket\ns = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
            + function,
            "notebook_launcher(train, num_processes=2, use_port=str(port))"]


def warm_cells(flags: str) -> list[str]:
    dask = "dask" in flags
    return [
        TIMING,
        f"%%distribute --workers 2 {flags}\nx = 1",  # starts the cluster
        PX_START,
        f"""
ours = lambda: ip.run_cell_magic('distribute', '--workers 2', 'x = 1')
px = lambda: ip.run_cell_magic('px', '', 'x = 1')
runs = {{'ours': ours, 'px': px}}
if {dask}:  # Dask's own round trip: one pinned no-op task per worker, gathered
    client = session.backend.client
    addresses = [session.backend.address_of(r) for r in range(2)]
    def noop():
        return None
    runs['bare'] = lambda: client.gather([client.submit(noop, workers=[a], allow_other_workers=False, pure=False)
                                          for a in addresses])
for run in runs.values():
    timed(run, {WARM_UPS})
times = {{name: [] for name in runs}}
for _ in range({WARM_CELLS // WARM_CHUNK}):
    for name, run in runs.items():
        times[name] += timed(run, {WARM_CHUNK})
# The same cells through the engine (the path before the direct channel), same cluster size.
session.direct_channel = False
ip.run_line_magic('scale', 'restart')
timed(ours, {WARM_UPS})
times['engine'] = []
for _ in range({WARM_CELLS // WARM_CHUNK}):
    times['engine'] += timed(ours, {WARM_CHUNK})
print('BENCH ' + json.dumps(times))
""",
    ]


RECOVERY = """
import os, signal
def cell(n=2):
    ip.run_cell_magic('distribute', f'--workers {{n}} {flags}', 'x = rank')
def seconds(run):
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0
times = {{'first': [seconds(cell)], 'restart': [], 'detect': [], 'dead': [], 'resize': []}}
for _ in range({rounds}):
    times['restart'].append(seconds(lambda: (ip.run_line_magic('scale', 'restart'), cell())))
    os.kill(session.workers[1]['pid'], signal.SIGKILL)
    t0, deadline = time.perf_counter(), time.monotonic() + 60
    while not session.backend.dead_ranks() and time.monotonic() < deadline:
        time.sleep(0.002)
    times['detect'].append(time.perf_counter() - t0)
    times['dead'].append(seconds(cell))
    times['resize'].append(seconds(lambda: cell(3)))
    cell(2)
print('BENCH ' + json.dumps(times))
"""


def recovery_cells(flags: str, rounds: int) -> list[str]:
    return [TIMING, RECOVERY.format(flags=flags, rounds=rounds)]


REPORT_LOOP = """
import threading
def sender_cpu():  # CPU seconds of the thread that batches and sends reported points
    # Its own CPU clock (nanoseconds): /proc's per-thread times count 10 ms ticks, more
    # than the whole thread spends in a run of this length.
    return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threading.enumerate()
               if t.name == 'jupyter_scale-events')
loader = DataLoader(data, batch_size=64, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
done, t0, in_report = 0, None, 0.0
while done < WARM + STEPS:
    for x, y in loader:
        if done == WARM:
            t0, cpu0 = time.perf_counter(), sender_cpu()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if {with_report}:
            r0 = time.thread_time()  # CPU time: not the GIL waits that any Python code has
            report(loss=loss)
            in_report += time.thread_time() - r0
        done += 1
        if done == WARM + STEPS:
            break
elapsed, sent_cpu = time.perf_counter() - t0, sender_cpu() - cpu0
if rank == 0:
    print(f"BENCH report={with_report} rate={{STEPS / elapsed!r}} in_report={{in_report / elapsed!r}} "
          f"sender={{sent_cpu / elapsed!r}}", flush=True)
"""


def report_cells(steps: int, warm: int, rounds: int) -> list[str]:
    cells = [TIMING + "from torch.utils.data import TensorDataset, DataLoader\n"
             f"STEPS, WARM = {steps}, {warm}\n"
             "data = TensorDataset(torch.randn(32768, 256), torch.randint(0, 10, (32768,)))\n"
             "latencies = []",
             "%%distribute --workers 2\nx = 1"]  # starts the cluster
    for _ in range(rounds):
        for with_report in (0, 1):
            cells.append("model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), "
                         "nn.Linear(512, 10))\nif session.events is not None:\n    session.events.latencies.clear()")
            cells.append("%%distribute --workers 2\n" + REPORT_LOOP.format(with_report=with_report))
            if with_report:
                cells.append("latencies.extend(session.events.latencies)")
    cells.append("latencies.sort()\nprint('BENCH ' + json.dumps({'latency_events': len(latencies), "
                 "'latency_p50': latencies[len(latencies) // 2] if latencies else None, "
                 "'latency_p99': latencies[int(len(latencies) * 0.99)] if latencies else None}))")
    return cells


SHIPPING_SETUP = """
READ = 'n = sum(p.numel() for p in model.parameters())'

def make_model(mib):
    # `mib` MiB of float32 weights in bias-free nn.Linear(1024, <=1024) layers, without the
    # cost of a random init (nothing on the way compresses, so zeros ship like any values).
    rows, layers = mib * 256, []
    while rows:
        layer = nn.Linear(1024, min(1024, rows), bias=False, device='meta').to_empty(device='cpu')
        torch.nn.init.zeros_(layer.weight)
        layers.append(layer)
        rows -= layer.out_features
    return nn.Sequential(*layers)

def bump(model):  # every parameter changed in place
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)

def cell(workers=2):
    # One %%distribute cell reading `model`: wall and kernel CPU time, and what it sent.
    wall, cpu = time.perf_counter(), time.process_time()
    ip.run_cell_magic('distribute', f'--workers {workers}', READ)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    run = session.runs[-1]
    return {'wall': wall, 'kernel_cpu': cpu, 'elapsed': run.elapsed, 'workers': run.workers,
            'shipped': run.shipped.get('model', 0), 'skipped': 'model' in run.skipped, 'pulled': 'model' in run.pulled,
            'pulled_bytes': run.pulled_bytes.get('model', 0), 'pullback': run.pullback_seconds}

def by_hand(model):
    # The same model through a hand-rolled cluster: pushed to both engines (pickled, as
    # ipyparallel does by default), pulled from engine 0; and its weights pushed as numpy
    # arrays (which ipyparallel sends as raw buffers, uncopied).
    t0 = time.perf_counter()
    rc[:].push({'model': model}, block=True)
    t1 = time.perf_counter()
    rc[0].pull('model', block=True)
    t2 = time.perf_counter()
    rc[:].push({'weights': [p.detach().numpy() for p in model.parameters()]}, block=True)
    t3 = time.perf_counter()
    rc[:].execute('del model, weights', block=True)
    return {'push': t1 - t0, 'pull': t2 - t1, 'push_numpy': t3 - t2}
"""

# Untimed first runs of both ways: the engines import torch when the first model arrives.
SHIPPING_WARMUP = """
model = make_model(1)
cell(), bump(model), cell(), by_hand(model)
del model
"""


def shipping_cells(sizes: list[int], rounds: int, kernel_cpu: bool = True) -> list[str]:
    cells = [TIMING + SHIPPING_SETUP,
             "%%distribute --workers 2\nx = 1",  # starts the cluster
             PX_START,
             SHIPPING_WARMUP]
    for mib in sizes:
        cells.append(f"""
out = {{'mib': {mib}, 'rounds': []}}
for _ in range({rounds}):
    model = make_model({mib})  # a new object: the next cell sends it whole
    out['bytes'] = sum(p.numel() * p.element_size() for p in model.parameters())
    first = cell()
    bump(model)
    changed = cell()
    unchanged = cell()
    out['rounds'].append({{'first': first, 'changed': changed, 'unchanged': unchanged, **by_hand(model)}})
del model
print('BENCH ' + json.dumps({{'size': out}}))
""")
    if not kernel_cpu:
        return cells
    cells.append(f"""
model = make_model({KERNEL_CPU_MIB})
per_workers = []
for k in {SCALING_WORKERS!r}:
    cell(k)  # resizes the cluster (fresh workers) and sends the model whole
    for _ in range({rounds}):
        bump(model)
        per_workers.append(cell(k))
print('BENCH ' + json.dumps({{'kernel_cpu': per_workers, 'mib': {KERNEL_CPU_MIB}}}))
""")
    return cells


# ----------------------------------------------------------------------------------
# Running notebooks and reading what they print
# ----------------------------------------------------------------------------------

def bench_records(text: str) -> list[dict]:
    """Every `BENCH ...` line of `text`: a JSON object, or `key=value` pairs (numbers where they parse)."""
    records = []
    for found in re.finditer(r"BENCH (.*)", text):
        payload = found.group(1).strip()
        if payload.startswith("{"):
            records.append(json.loads(payload))
            continue
        record = {}
        for key, value in (pair.split("=", 1) for pair in payload.split()):
            try:
                record[key] = float(value)
            except ValueError:
                record[key] = value
        records.append(record)
    return records


def bench_record(text: str) -> dict:
    records = bench_records(text)
    if len(records) != 1:
        raise RuntimeError(f"expected one BENCH line, found {len(records)} in the output:\n{text[-3000:]}")
    return records[0]


class _Descendants:
    """The processes a kernel started, seen while it ran: a safety net for what its cells leave behind."""

    def __init__(self, pid: int):
        self.kernel = psutil.Process(pid)
        self.seen: dict[int, psutil.Process] = {}

    def look(self) -> None:
        try:
            for child in self.kernel.children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.Error:
            pass

    def reap(self, grace: float = 15.0) -> list[str]:
        """Kill (by pid) what outlived the kernel by `grace` s; says what it was."""
        alive = [p for p in self.seen.values() if p.is_running()]  # is_running checks the create time too
        _, alive = psutil.wait_procs(alive, timeout=grace)
        killed = []
        for p in alive:
            try:
                killed.append(f"pid {p.pid} {' '.join(p.cmdline())[:200]}")
                print(f"compare.py: killing {killed[-1]}, left behind by a kernel", file=sys.stderr, flush=True)
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        return killed


def run_cells(cells: list[str], timeout: float = 900, env: dict | None = None,
              left: list | None = None) -> tuple[nbformat.NotebookNode, str]:
    """Run `cells` and then CLEANUP (always) in a fresh kernel; the notebook and all its output text.

    Raises nbclient's CellExecutionError when a cell fails. Processes the kernel started
    and left behind are killed once the kernel is gone (and said in `left`, when given).
    `env`: the kernel's environment (its workers inherit it; default: this process's).
    """
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.strip("\n")) for c in [*cells, CLEANUP]]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=True,
                            resources={"metadata": {"path": tempfile.gettempdir()}})
    descendants = None
    try:
        with client.setup_kernel(**({"env": env} if env is not None else {})):
            descendants = _Descendants(client.km.provisioner.pid)
            try:
                for index, cell in enumerate(nb.cells[:-1]):
                    client.execute_cell(cell, index)
                    descendants.look()
            finally:
                descendants.look()
                try:
                    client.execute_cell(nb.cells[-1], len(nb.cells) - 1)
                except Exception as exc:  # report it; the first failure is the one raised
                    print(f"compare.py: the cleanup cell failed: {exc}", file=sys.stderr, flush=True)
    finally:
        if descendants is not None:
            killed = descendants.reap()
            if left is not None:
                left.extend(killed)
    # Streams, and display data too: %%px shows each engine's stdout as display_data.
    text = "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                   for c in nb.cells for o in c.get("outputs", []))
    return nb, text


def cell_started(nb: nbformat.NotebookNode, index: int) -> float:
    """When cell `index` started executing in the kernel (epoch seconds)."""
    started = nb.cells[index].metadata["execution"]["iopub.execute_input"]
    return datetime.datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp()


def training_result(record: dict, t0: float) -> dict:
    """cold start (s), steady steps/s, rank 0's peak RSS (MiB) from a loop's BENCH line."""
    return {"cold": record["first"] - t0, "rate": record["rate"], "maxrss_mib": record["maxrss"] / 1024}


def run_training_notebook(cells: list[str], launch_cell: int = 1) -> dict:
    """A training notebook: the clock starts when cell `launch_cell` starts executing."""
    nb, text = run_cells(cells)
    return training_result(bench_record(text), cell_started(nb, launch_cell))


def torchrun_baseline(steps: int, warm: int, nproc: int = 2) -> dict:
    t0 = time.time()
    done = run_torchrun(torchrun_script(steps, warm, nproc), nproc=nproc)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return training_result(bench_record(done.stdout), t0)


# ----------------------------------------------------------------------------------
# Numbers and tables
# ----------------------------------------------------------------------------------

def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def save_results(out, meta: dict, started: float, failed: dict, **results) -> None:
    """The run's end: how long and how loaded, the JSON written to `out` (meta, the results,
    failed, seconds), and exit status 1 when some runs failed."""
    meta["loadavg_end"] = os.getloadavg()
    seconds = round(time.monotonic() - started, 1)
    print(f"\n{seconds:.0f} s; load average at the start {meta['loadavg_start'][0]:.2f}, "
          f"at the end {meta['loadavg_end'][0]:.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, **results, "failed": failed, "seconds": seconds}, indent=1) + "\n")
    print(f"raw results and medians: {out}")
    if failed:
        sys.exit(f"runs that failed: {failed}")


def spread(values) -> str:
    """'min-max' of the values that are not None (a table's range column)."""
    values = [v for v in values if v is not None]
    return f"{min(values):.2f}-{max(values):.2f}" if values else ""


def ratio(ours: float | None, base: float | None) -> float | None:
    return ours / base if ours is not None and base else None


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return f"{value:.{digits}f}"


def print_table(title: str, header: list[str], rows: list[list], digits: list[int] | None = None) -> None:
    digits = digits or [2] * len(header)
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for row in rows:
        print("| " + " | ".join([str(row[0])] + [fmt(v, d) for v, d in zip(row[1:], digits[1:])]) + " |")


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------
# Sections: each runs its notebooks, prints its table and returns its raw results + medians
# ----------------------------------------------------------------------------------

def section_tools(args) -> dict:
    tools = args.tools.split(",")
    if "accelerate" in tools and importlib.util.find_spec("accelerate") is None:
        progress("accelerate is not installed (pip install accelerate, or .[bench]): skipping it")
        tools.remove("accelerate")
    s, w = args.steps, args.warm
    runs: dict[str, Callable[[], dict]] = {
        "torchrun": lambda: torchrun_baseline(s, w),
        "auto": lambda: run_training_notebook(distribute_cells(s, w, "")),
        "manual": lambda: run_training_notebook(distribute_cells(s, w, "--manual")),
        "px": lambda: run_training_notebook(px_cells(s, w)),
        "dask": lambda: run_training_notebook(distribute_cells(s, w, "--backend dask")),
        "accelerate": lambda: run_training_notebook(accelerate_cells(s, w)),
    }
    raw: dict[str, list[dict]] = {t: [] for t in tools}
    for i in range(args.repeat):
        for tool in tools:
            raw[tool].append(runs[tool]())
            r = raw[tool][-1]
            progress(f"tools round {i + 1} {tool}: cold {r['cold']:.2f} s, {r['rate']:.1f} steps/s, "
                     f"rank 0 peak RSS {r['maxrss_mib']:.0f} MiB")
    medians = {t: {k: median(r[k] for r in raw[t]) for k in ("cold", "rate", "maxrss_mib")} for t in tools}
    base = medians.get("torchrun", {})
    ratios = {t: {k: ratio(m[k], base.get(k)) for k in m} for t, m in medians.items()}
    print_table(f"tools: the same loop, 2 ranks ({args.repeat} rounds, {args.steps} steps, "
                f"steady state after {args.warm}; medians)",
                ["tool", "cold start (s)", "x torchrun", "steps/s", "x torchrun", "peak RSS rank 0 (MiB)",
                 "x torchrun"],
                [[TOOLS[t], medians[t]["cold"], ratios[t]["cold"], medians[t]["rate"], ratios[t]["rate"],
                  medians[t]["maxrss_mib"], ratios[t]["maxrss_mib"]] for t in tools],
                [0, 2, 2, 1, 2, 0, 2])
    return {"labels": {t: TOOLS[t] for t in tools}, "raw": raw, "median": medians, "ratio_to_torchrun": ratios}


def section_warm(args) -> dict:
    engines = {"ipyparallel": "", "dask": "--backend dask"}
    raw: dict[str, list[dict]] = {e: [] for e in engines}
    for i in range(args.repeat):
        for engine, flags in engines.items():
            _, text = run_cells(warm_cells(flags))
            times = bench_record(text)
            raw[engine].append(times)
            progress(f"warm round {i + 1} {engine}: " + ", ".join(f"{name} {1e3 * median(t):.2f} ms"
                                                                   for name, t in times.items()))
    # Medians over every timed cell of every round.
    medians = {e: {k: 1e3 * median(t for r in raw[e] for t in r[k]) for k in raw[e][0]} for e in engines}
    for m in medians.values():
        m["ratio"] = ratio(m["ours"], m["px"])
        m["engine_ratio"] = ratio(m["engine"], m["px"])
        if "bare" in m:
            m["bare_ratio"] = ratio(m["ours"], m["bare"])
    print_table(f"warm: a trivial cell `x = 1` on a warm 2-worker cluster (median of {WARM_CELLS} x "
                f"{args.repeat} runs; target ratio <= 1.0)",
                ["engine", "`%%distribute` (ms)", "hand-rolled `%%px` (ms)", "ratio",
                 "Dask submit+gather (ms)", "ratio", "through the engine (ms)", "x `%%px`"],
                [[e, m["ours"], m["px"], m["ratio"], m.get("bare", "-"), m.get("bare_ratio", "-"), m["engine"],
                  m["engine_ratio"]] for e, m in medians.items()])
    return {"unit": "s (raw), ms (median)", "raw": raw, "median": medians}


def section_report(args) -> dict:
    _, text = run_cells(report_cells(args.steps, args.warm, args.repeat))
    records = bench_records(text)
    rates = {"no report()": [r["rate"] for r in records if r.get("report") == 0],
             "report() every step": [r["rate"] for r in records if r.get("report") == 1]}
    latency = next(r for r in records if "latency_events" in r)
    without, with_report = median(rates["no report()"]), median(rates["report() every step"])
    overhead = 100 * (1 - with_report / without)
    # Sharper than the rates: the CPU time report() itself takes on the training thread, and
    # the sending thread's CPU time beyond what it spends without reports (heartbeats), as
    # shares of the loop's time, measured in the same runs. The sending thread takes the
    # training thread's place (the GIL) at most.
    in_report = median(r["in_report"] for r in records if r.get("report") == 1)
    sender = (median(r["sender"] for r in records if r.get("report") == 1)
              - median(r["sender"] for r in records if r.get("report") == 0))
    cost = 100 * (in_report + max(sender, 0.0))
    print_table(f"report: `report(loss=loss)` every step, automatic mode, 2 workers ({args.repeat} rounds "
                f"alternating, {args.steps} steps after {args.warm}; target cost < 0.5 %)",
                ["", "steps/s rank 0 (median)", "runs"],
                [["no `report()`", without, ", ".join(f"{v:.1f}" for v in rates["no report()"])],
                 ["`report()` every step", with_report, ", ".join(f"{v:.1f}" for v in rates["report() every step"])],
                 ["overhead from the rates (%)", overhead, ""],
                 ["report()'s own CPU (% of the loop)", 100 * in_report, ""],
                 ["sending thread's extra CPU (% of the loop)", 100 * sender, ""],
                 ["cost per step (%): the two above", cost, ""]],
                [0, 2, 0])
    if latency["latency_events"]:
        print(f"\nworker-to-kernel latency over {latency['latency_events']} reported points: "
              f"p50 {1e3 * latency['latency_p50']:.1f} ms, p99 {1e3 * latency['latency_p99']:.1f} ms")
    return {"raw": rates, "median": {"no report()": without, "report() every step": with_report},
            "overhead_percent": overhead, "in_report_percent": 100 * in_report, "sender_percent": 100 * sender,
            "cost_percent": cost, "latency_s": latency}


def section_shipping(args) -> dict:
    sizes = [int(s) for s in args.ship_sizes.split(",")]
    _, text = run_cells(shipping_cells(sizes, args.repeat))
    records = bench_records(text)
    per_size = [r["size"] for r in records if "size" in r]
    kernel_cpu = next(r for r in records if "kernel_cpu" in r)
    rows, medians = [], []
    for size in per_size:
        rounds, nbytes = size["rounds"], size["bytes"]
        m = {"mib": size["mib"], "bytes": nbytes,
             **{k: median(r[k] for r in rounds) for k in ("push", "pull", "push_numpy")}}
        for kind in ("first", "changed", "unchanged"):
            m[kind] = median(r[kind]["wall"] for r in rounds)
            m[f"{kind}_shipped"] = median(r[kind]["shipped"] for r in rounds)
        m["unchanged_pullback"] = median(r["unchanged"]["pullback"] for r in rounds)
        m["unchanged_not_resent"] = all(r["unchanged"]["skipped"] and r["unchanged"]["shipped"] == 0 for r in rounds)
        m["pulled_back"] = all(r[k]["pulled"] for r in rounds for k in ("first", "changed", "unchanged"))
        medians.append(m)
        rows.append([f"{size['mib']} MiB", m["first"], m["changed"], m["changed_shipped"] / m["changed"] / 1e9,
                     m["unchanged"], 1e3 * m["unchanged_pullback"], "yes" if m["unchanged_not_resent"] else "no",
                     m["push"], m["pull"], m["push_numpy"], ratio(m["changed"], m["push"]),
                     ratio(m["changed"], m["push"] + m["pull"]), ratio(m["changed"], m["push_numpy"])])
    print_table(f"shipping: a cell reading an nn.Module, 2 workers ({args.repeat} rounds, medians; each cell "
                "includes pulling the module back from rank 0; GB/s = bytes sent / changed-cell time)",
                ["model", "first cell (s)", "changed in place (s)", "GB/s", "unchanged (s)",
                 "its pull-back (ms)", "unchanged not re-sent",
                 "by hand: push (s)", "pull (s)", "push numpy (s)", "changed x push", "x (push+pull)",
                 "x push numpy"],
                rows, [0, 3, 3, 2, 3, 1, 0, 3, 3, 3, 2, 2, 2])
    # The same cells for the largest model with the write watch off (every tensor hashed
    # whole, as before it), in a kernel of their own.
    unwatched_cells = shipping_cells([max(sizes)], args.repeat, kernel_cpu=False)
    unwatched_cells.insert(1, "%config ScaleSession.write_watch = False")  # after %load_ext, before the cluster
    _, text = run_cells(unwatched_cells)
    unwatched = next(r["size"] for r in bench_records(text) if "size" in r)
    watched = next(m for m in medians if m["mib"] == max(sizes))
    watch_rows = []
    for label, size_rounds in (("on", [r for r in per_size if r["mib"] == max(sizes)][0]["rounds"]),
                               ("off (write_watch = False)", unwatched["rounds"])):
        watch_rows.append([label, *(median(r[k]["wall"] for r in size_rounds) for k in ("first", "changed", "unchanged")),
                           1e3 * median(r["unchanged"]["pullback"] for r in size_rounds),
                           1e3 * median(r["changed"]["pullback"] for r in size_rounds)])
    print_table(f"shipping: the write watch (writewatch.py), {max(sizes)} MiB, on and off ({args.repeat} rounds, "
                "medians, each in a kernel of its own)",
                ["write watch", "first cell (s)", "changed in place (s)", "unchanged (s)",
                 "unchanged: pull-back (ms)", "changed: pull-back (ms)"], watch_rows, [0, 3, 3, 3, 1, 1])
    watched["unwatched"] = {"rounds": unwatched["rounds"], "median": dict(zip(
        ["first", "changed", "unchanged", "unchanged_pullback_ms", "changed_pullback_ms"], watch_rows[1][1:]))}
    by_workers = {}
    for r in kernel_cpu["kernel_cpu"]:
        by_workers.setdefault(r["workers"], []).append(r)
    cpu_rows = [[k, median(r["kernel_cpu"] for r in rs), median(r["wall"] for r in rs)] for k, rs in by_workers.items()]
    print_table(f"shipping: the kernel's CPU time for the {kernel_cpu['mib']} MiB changed-in-place cell "
                "(flat = the kernel sends once, whatever the workers)",
                ["workers", "kernel CPU (s)", "cell wall (s)"], cpu_rows, [0, 3, 3])
    return {"raw": {"sizes": per_size, "kernel_cpu": kernel_cpu}, "median": medians,
            "kernel_cpu_median": {str(k): {"kernel_cpu": c, "wall": w} for k, c, w in cpu_rows}}


def section_scaling(args) -> dict:
    s, w = args.steps, args.warm
    raw: dict[str, dict[str, list[dict]]] = {str(k): {"torchrun": [], "auto": []} for k in SCALING_WORKERS}
    for i in range(args.repeat):
        for k in SCALING_WORKERS:
            raw[str(k)]["torchrun"].append(torchrun_baseline(s, w, nproc=k))
            raw[str(k)]["auto"].append(run_training_notebook(distribute_cells(s, w, "", workers=k)))
            t, a = raw[str(k)]["torchrun"][-1], raw[str(k)]["auto"][-1]
            progress(f"scaling round {i + 1}, {k} workers: torchrun {t['cold']:.2f} s / {t['rate']:.1f} steps/s, "
                     f"%%distribute {a['cold']:.2f} s / {a['rate']:.1f} steps/s")
    medians = {k: {tool: {m: median(r[m] for r in runs) for m in ("cold", "rate", "maxrss_mib")}
                   for tool, runs in by_tool.items()} for k, by_tool in raw.items()}
    rows = []
    for k, m in medians.items():
        t, a = m["torchrun"], m["auto"]
        rows.append([k, t["cold"], a["cold"], ratio(a["cold"], t["cold"]), t["rate"], a["rate"],
                     ratio(a["rate"], t["rate"])])
    print_table(f"scaling: torchrun vs `%%distribute` automatic mode, batch 64 per rank ({args.repeat} rounds, "
                f"{args.steps} steps, medians)",
                ["workers", "torchrun cold (s)", "ours cold (s)", "x", "torchrun steps/s", "ours steps/s", "x"],
                rows, [0, 2, 2, 2, 1, 1, 2])
    cores = os.cpu_count() or 0
    if max(SCALING_WORKERS) > cores:
        print(f"\nNote: {max(SCALING_WORKERS)} workers oversubscribe this {cores}-core machine; "
              "steps/s there says little about scaling.")
    return {"raw": raw, "median": medians}


def section_recovery(args) -> dict:
    engines = {"ipyparallel": "", "dask": "--backend dask"}
    raw: dict[str, list] = {"torchrun": []}
    raw.update({e: [] for e in engines})
    for i in range(args.repeat):
        raw["torchrun"].append(torchrun_baseline(40, 10)["cold"])
        progress(f"recovery round {i + 1}: torchrun cold start {raw['torchrun'][-1]:.2f} s")
    for engine, flags in engines.items():
        _, text = run_cells(recovery_cells(flags, args.repeat))
        raw[engine].append(bench_record(text))
        progress(f"recovery {engine}: " + ", ".join(f"{k} {median(v):.2f} s" for k, v in raw[engine][-1].items()))
    base = median(raw["torchrun"])
    what = ("first", "restart", "dead", "resize")
    medians = {e: {k: median(t for r in raw[e] for t in r[k]) for k in (*what, "detect")} for e in engines}
    print_table(f"recovery: a `x = rank` cell on 2 workers ({args.repeat} rounds, medians; torchrun's cold start "
                f"{base:.2f} s; target <= 1.0x for the first cell, <= 0.3x for the others)",
                ["engine", "first cell (s)", "x torchrun", "after restart (s)", "x", "after a dead worker (s)", "x",
                 "noticed in (s)", "to 3 workers (s)", "x"],
                [[e, m["first"], ratio(m["first"], base), m["restart"], ratio(m["restart"], base), m["dead"],
                  ratio(m["dead"], base), m["detect"], m["resize"], ratio(m["resize"], base)]
                 for e, m in medians.items()],
                [0, 2, 2, 2, 2, 2, 2, 3, 2, 2])
    return {"unit": "s", "raw": raw, "median": medians, "torchrun_cold": base}


SECTION_RUNS = {"tools": section_tools, "warm": section_warm, "report": section_report,
                "shipping": section_shipping, "scaling": section_scaling, "recovery": section_recovery}


def draw(out: Path, png: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        progress("matplotlib is not installed: no plot (pip install matplotlib, or pip install -e '.[bench]'; "
                 f"then python benchmarks/plot.py {out})")
        return
    from plot import plot  # benchmarks/, the script's own folder

    plot(out, png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"any of {','.join(SECTIONS)}")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (interleaved), medians over them")
    parser.add_argument("--steps", type=int, default=300, help="training steps per rank")
    parser.add_argument("--warm", type=int, default=30, help="warm-up steps before steady-state timing")
    parser.add_argument("--tools", default=",".join(TOOLS), help="tools section: which tools")
    parser.add_argument("--ship-sizes", default="10,100,500", help="shipping section: model sizes in MiB")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "compare-latest.json",
                        help="where the raw results and medians go (JSON)")
    parser.add_argument("--plot", type=Path, default=HERE / "compare.png", help="where plot.py draws them")
    args = parser.parse_args()
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)} (choose from {','.join(SECTIONS)})")

    import torch

    results: dict = {"meta": {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "host": socket.gethostname(),
        "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()}}}
    print(f"{socket.gethostname()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}; sections {','.join(sections)}")
    failed = []
    for section in sections:
        started = time.monotonic()
        try:
            results[section] = SECTION_RUNS[section](args)
        except Exception as exc:  # the other sections still run; the failure is kept in the results
            traceback.print_exc()
            failed.append(section)
            results[section] = {"error": f"{type(exc).__name__}: {exc}"}
        results[section + "_seconds"] = round(time.monotonic() - started, 1)
        progress(f"section {section} took {time.monotonic() - started:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # A run of some sections replaces those in the file and keeps the others (each section
    # says when it ran).
    kept = json.loads(args.out.read_text()) if args.out.exists() and set(sections) != set(SECTIONS) else {}
    dates = {**kept.get("section_dates", {}), **{s: results["meta"]["date"] for s in sections}}
    results = {**kept, **results, "section_dates": dates}
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nraw results and medians: {args.out}")
    if any(s in results and "error" not in results[s] for s in ("tools", "scaling")):
        draw(args.out, args.plot)
    if failed:
        sys.exit(f"sections that failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
