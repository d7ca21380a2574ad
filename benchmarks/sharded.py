"""Memory per worker and steps/s with `%%distribute --shard` against unsharded automatic mode, from real kernels.

    python benchmarks/sharded.py [--workers 1 2 4] [--repeat 2] [--steps 10] [--warm 3]
                                 [--width 1024] [--depth 24] [--batch 32]
                                 [--modes unsharded,sharded,unsharded-mmap] [--timeout 300]
                                 [--out benchmarks/results/sharded-latest.json]

One fixed model built in the notebook (an nn.Sequential of `--depth` nn.Linear(width, width)
layers with ReLUs between them: 25.2 M parameters, 96 MiB of float32, by default), trained with
Adam (two state tensors per parameter) on synthetic data by one training-loop cell that never
changes (a DataLoader over a notebook TensorDataset, batch `--batch` per rank, `--warm` +
`--steps` steps per rank). For each number of workers K:

  unsharded       `%%distribute --workers K`: automatic mode, every rank a whole replica (the baseline)
  sharded         `%%distribute --workers K --shard`: FSDP2 on the model, block by block, before the cell
  unsharded-mmap  unsharded, with MALLOC_MMAP_THRESHOLD_=4194304 in the kernel's environment (and
                  so its workers'): the fixed glibc mmap threshold that a rank which shards sets
                  itself (jupyter_scale since 3a7ddce: otherwise glibc keeps FSDP2's per-step
                  buffers in its heap). It tells the cost of that allocator setting from the cost
                  of sharding in steps/s. Not run at K = 1, where --shard shards nothing
                  (automatic mode works with two ranks or more).

Each configuration runs in a fresh kernel through nbclient (as nbval and papermill run a
notebook), so each starts fresh workers: peaks are never a previous run's. Three cells after
the notebook's own set-up, all on the workers:

  idle      starts the cluster (the model is not read yet): each rank's RSS with torch
            imported and the process group formed; resets the peak
  training  the loop. Before it, the peak since `idle` (the model and the data received,
            and sharded with --shard) and the RSS then; after it, the peak during the loop
            (after `--warm` steps and until the end), the RSS, each rank's training state
            counted from its local tensors (parameters, gradients, optimizer state; a DTensor
            by `to_local()`), and rank 0's steps/s over the last `--steps` steps
  after     the peak since the loop ended: the model's pull-back into the notebook (rank 0
            sends it; a sharded one is gathered by every rank first); the RSS then, and the
            bytes of jupyter_scale's memory file (rank 0 writes the pull-back into it and keeps
            it: memory in no process's RSS)

Peaks are the kernel's high-water mark of each worker process (VmHWM in /proc/self/status,
what `ru_maxrss` reports), reset between phases by writing 5 to /proc/self/clear_refs, so a
phase's peak is its own and no short spike is missed, as sampling would. Also recorded, as a
diagnostic that reads jupyter_scale's internals: the bytes of tensors the worker keeps from
the notebook's shipment (one per notebook tensor) that no longer back a parameter (the whole
copy a sharded model was made from).

Configurations run in an order reversed every other round; medians over the rounds; ratios
to unsharded automatic mode at the same K from the same run. Every cell has a deadline
(`--timeout`, also the cell's `--timeout` on the workers); every kernel ends with a cell that
stops its cluster (`%scale stop`); processes a kernel started that outlive it by 15 s are
reported, stopped by pid, and fail the run; at the end no process this script started may be
left. The package measured is the one this script imports (PYTHONPATH included: a copy of a
commit can be measured while the tree changes); every worker must import that same file.
Writes every raw result to `--out`. Not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare import (  # noqa: E402  benchmarks/, the script's own folder
    bench_records,
    fmt,
    median,
    print_table,
    progress,
    ratio,
    run_cells,
    save_results,
    spread,
)

# name -> (the flags on the %%distribute line, environment for the kernel and so its workers)
MMAP_THRESHOLD = str(4 << 20)  # what jupyter_scale's shard_model sets with mallopt (fixed: no dynamic raise)
MODES = {
    "unsharded": ("", {}),
    "sharded": ("--shard", {}),
    "unsharded-mmap": ("", {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}),
}
LABELS = {"unsharded": "unsharded", "sharded": "`--shard`",
          "unsharded-mmap": f"unsharded, MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"}

# The notebook's own cell: the model, its data, and the measuring helpers (notebook functions:
# they travel to the workers with the cells that call them).
SETUP = """
%load_ext jupyter_scale
import json, os, time, torch, torch.nn as nn
from torch.utils.data import TensorDataset, DataLoader
import jupyter_scale
WIDTH, DEPTH, BATCH, WARM, STEPS = {width}, {depth}, {batch}, {warm}, {steps}
g = torch.Generator().manual_seed(1)
n = (WARM + STEPS) * BATCH * {max_workers}  # the same data at every K: each rank stops after WARM + STEPS
data = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randint(0, WIDTH, (n,), generator=g))
torch.manual_seed(0)
layers = []
for _ in range(DEPTH):
    layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
model = nn.Sequential(*layers[:-1])

def mem():
    # This process's memory (MiB): now (VmRSS and its parts) and its peak since reset_peak() (VmHWM).
    found = {{}}
    with open('/proc/self/status') as f:
        for line in f:
            key, _, value = line.partition(':')
            if key in ('VmRSS', 'VmHWM', 'RssAnon', 'RssFile', 'RssShmem'):
                found[key] = int(value.split()[0]) / 1024
    # jupyter_scale's own memory file (a memfd rank 0 writes the pulled-back model into, kept
    # between cells): written, never mapped, so it is in no RSS; its allocated bytes.
    found['memfd'] = 0.0
    for fd in os.listdir('/proc/self/fd'):
        try:
            if os.readlink(f'/proc/self/fd/{{fd}}').startswith('/memfd:jupyter_scale'):
                found['memfd'] += os.stat(f'/proc/self/fd/{{fd}}').st_blocks * 512 / 2**20
        except OSError:
            pass
    return found

def reset_peak():
    # VmHWM (ru_maxrss) back to the current RSS: the next reading is the next phase's own peak.
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return True
    except OSError:
        return False

def local_bytes(tensors):
    total = 0
    for t in tensors:
        if torch.is_tensor(t):
            t = t.to_local() if jupyter_scale.sharding.is_sharded(t) else t
            total += t.numel() * t.element_size()
    return total

def state_bytes(model, opt):
    # This rank's training state, from its local tensors.
    params = list(model.parameters())
    return {{'params': local_bytes(params), 'grads': local_bytes(p.grad for p in params),
            'optimizer': local_bytes(v for s in opt.state.values() for v in s.values()),
            'sharded_params': sum(jupyter_scale.sharding.is_sharded(p) for p in params), 'n_params': len(params)}}

def held_copies(model, in_use=()):
    # Diagnostic, from jupyter_scale's internals: bytes of the tensors this worker keeps from the
    # notebook's shipment (one per notebook tensor) that back neither the model's parameters
    # now nor the tensors `in_use` (the dataset's).
    local = lambda p: p.to_local() if jupyter_scale.sharding.is_sharded(p) else p
    try:
        from jupyter_scale import worker
        held = [local(t) for t in worker._state.receiver.tensors.values()]
    except Exception as exc:
        return {{'error': repr(exc)}}
    used = {{t.untyped_storage().data_ptr() for t in [*map(local, model.parameters()), *in_use]}}
    stale = [t for t in held if t.untyped_storage().data_ptr() not in used]
    return {{'held': sum(t.numel() * t.element_size() for t in held),
            'not_backing_a_parameter': sum(t.numel() * t.element_size() for t in stale), 'tensors': len(held)}}
"""

IDLE = """
at = mem()
reset_ok = reset_peak()
print('BENCH ' + json.dumps({'phase': 'idle', 'rank': rank, 'pid': os.getpid(), 'threads': torch.get_num_threads(),
                             'reset_ok': reset_ok, 'package': jupyter_scale.__file__,
                             'mmap_threshold': os.environ.get('MALLOC_MMAP_THRESHOLD_'), **at}), flush=True)
"""

# The training loop cell: the same text for both modes; only the measuring lines around it are added.
TRAIN = """
received = mem(); reset_peak()  # the model and data arrived (and were sharded, with --shard)
loader = DataLoader(data, batch_size=BATCH, shuffle=True)
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
done = 0
for x, y in loader:
    if done == WARM:
        t0 = time.perf_counter()
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    done += 1
    if done == WARM + STEPS:
        break
rate = STEPS / (time.perf_counter() - t0)
trained = mem(); reset_peak()
print('BENCH ' + json.dumps({'phase': 'train', 'rank': rank, 'rate': rate, 'steps': done, 'loss': loss.item(),
                             'received': received, 'trained': trained, 'state': state_bytes(model, opt),
                             'copies': held_copies(model, data.tensors)}), flush=True)
"""

AFTER = """
print('BENCH ' + json.dumps({'phase': 'after', 'rank': rank, **mem()}), flush=True)
"""


def cells(args, workers: int, flags: str) -> list[str]:
    line = f"%%distribute --workers {workers} --timeout {args.timeout:g} {flags}".rstrip()
    setup = SETUP.format(width=args.width, depth=args.depth, batch=args.batch, warm=args.warm, steps=args.steps,
                         max_workers=max(args.workers))
    return [setup, line + "\n" + IDLE, line + "\n" + TRAIN, line + "\n" + AFTER]


def run_once(args, workers: int, mode: str) -> dict:
    """One configuration in a fresh kernel: per rank, its idle / train / after records."""
    t0 = time.monotonic()
    flags, env = MODES[mode]
    # Only the mode's own allocator setting: none from this script's environment.
    full_env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | env
    left: list[str] = []  # what outlived the kernel: stopped by pid, and fails the run
    _, text = run_cells(cells(args, workers, flags), args.timeout + 60, full_env, left)
    seconds = time.monotonic() - t0
    records = bench_records(text)
    ranks: dict[int, dict] = {}
    for r in records:
        ranks.setdefault(int(r["rank"]), {})[r.pop("phase")] = r
    problems = []
    if left:
        problems.append("left running 15 s after the kernel ended (killed now): " + "; ".join(left))
    if sorted(ranks) != list(range(workers)) or any(set(v) != {"idle", "train", "after"} for v in ranks.values()):
        problems.append(f"expected idle/train/after from ranks 0..{workers - 1}, got "
                        f"{ {k: sorted(v) for k, v in ranks.items()} }:\n{text[-3000:]}")
    import jupyter_scale  # the workers must run the package this script sees (PYTHONPATH included)

    wrong = {v["idle"].get("package") for v in ranks.values() if "idle" in v} - {jupyter_scale.__file__}
    if wrong:
        problems.append(f"the workers imported jupyter_scale from {sorted(wrong)}, not {jupyter_scale.__file__}")
    if {v["idle"].get("mmap_threshold") for v in ranks.values() if "idle" in v} - {env.get("MALLOC_MMAP_THRESHOLD_")}:
        problems.append("the workers' MALLOC_MMAP_THRESHOLD_ is not the one asked for")
    if problems:
        raise RuntimeError("\n".join(problems))
    return {"seconds": seconds, "ranks": {str(k): v for k, v in sorted(ranks.items())}}


def summarize(run: dict) -> dict:
    """The numbers of one run that the tables show (MiB; steps/s)."""
    ranks = [run["ranks"][k] for k in sorted(run["ranks"], key=int)]
    r0 = ranks[0]
    st = [r["train"]["state"] for r in ranks]
    state = [s["params"] + s["grads"] + s["optimizer"] for s in st]
    copies = [r["train"]["copies"].get("not_backing_a_parameter") for r in ranks]
    return {
        "rate": r0["train"]["rate"],
        "state_mib": max(state) / 2**20,  # the largest rank's (FSDP pads the last shard)
        "params_mib": max(s["params"] for s in st) / 2**20,
        "grads_mib": max(s["grads"] for s in st) / 2**20,
        "optimizer_mib": max(s["optimizer"] for s in st) / 2**20,
        "sharded_params": r0["train"]["state"]["sharded_params"],
        "idle_rss": max(r["idle"]["VmRSS"] for r in ranks),
        "receive_peak": max(r["train"]["received"]["VmHWM"] for r in ranks),
        "received_rss": max(r["train"]["received"]["VmRSS"] for r in ranks),
        "train_peak": max(r["train"]["trained"]["VmHWM"] for r in ranks),
        "train_peak_over_idle": max(r["train"]["trained"]["VmHWM"] - r["idle"]["VmRSS"] for r in ranks),
        "trained_rss": max(r["train"]["trained"]["VmRSS"] for r in ranks),
        "pull_peak_rank0": r0["after"]["VmHWM"],
        "after_rss_rank0": r0["after"]["VmRSS"],
        "after_memfd_rank0": r0["after"]["memfd"],
        "cell_peak": max(max(r["train"]["received"]["VmHWM"], r["train"]["trained"]["VmHWM"], r["after"]["VmHWM"])
                         for r in ranks),
        "stale_copy_mib": max(c for c in copies) / 2**20 if all(c is not None for c in copies) else None,
        "threads": r0["idle"]["threads"],
        "reset_ok": all(r["idle"]["reset_ok"] for r in ranks),
    }


def own_processes() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="cluster sizes")
    parser.add_argument("--repeat", type=int, default=2, help="rounds (every configuration once), medians over them")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per rank, after --warm")
    parser.add_argument("--warm", type=int, default=3, help="untimed warm-up steps per rank")
    parser.add_argument("--width", type=int, default=1024, help="the Linear layers' width")
    parser.add_argument("--depth", type=int, default=24, help="how many Linear(width, width) layers")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"any of {','.join(MODES)} (unsharded-mmap: with more than one worker only)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds any one cell may take")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "sharded-latest.json",
                        help="where the raw results and medians go (JSON)")
    args = parser.parse_args()
    if any(k < 1 for k in args.workers) or min(args.repeat, args.steps, args.warm) < 1:
        parser.error("--workers, --repeat, --steps and --warm take numbers from 1")
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)} (choose from {','.join(MODES)})")
    if "unsharded" not in modes:
        parser.error("the unsharded mode is the baseline of every ratio: keep it in --modes")

    def terminated(*_):  # a SIGTERM ends the run through the finally blocks, like a Ctrl-C
        progress("sharded.py: SIGTERM, cleaning up")
        sys.exit(143)
    signal.signal(signal.SIGTERM, terminated)

    import ipyparallel
    import torch

    import jupyter_scale

    params = args.depth * (args.width * args.width + args.width)
    commit = subprocess.run(["git", "-C", str(HERE.parent), "describe", "--always", "--dirty"],
                            capture_output=True, text=True, timeout=15).stdout.strip() or None
    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "host": socket.gethostname(),
            "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "jupyter_scale": getattr(jupyter_scale, "__version__", None), "ipyparallel": ipyparallel.__version__,
            "commit": commit, "package": jupyter_scale.__file__,
            "parameters": params, "parameter_mib": params * 4 / 2**20,
            "loadavg_start": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"{socket.gethostname()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch "
          f"{torch.__version__}; model {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB), "
          f"Adam; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    started = time.monotonic()
    before = {p.pid for p in own_processes()}
    sizes = list(dict.fromkeys(args.workers))
    # At one worker --shard shards nothing (automatic mode needs a group of two or more), so
    # no rank fixes its allocator: the allocator variant is left out there.
    runs = [(k, m) for k in sizes for m in MODES if m in modes and not (m == "unsharded-mmap" and k == 1)]
    raw: dict[str, dict[str, list[dict]]] = {str(k): {m: [] for kk, m in runs if kk == k} for k in sizes}
    for i in range(args.repeat):
        for k, mode in (runs if i % 2 == 0 else runs[::-1]):
            load = os.getloadavg()[0]
            try:
                r = run_once(args, k, mode)
                r["summary"] = summarize(r)
            except Exception as exc:  # the other runs still go; the failure is kept in the results
                traceback.print_exc()
                r = {"error": f"{type(exc).__name__}: {str(exc)[:4000]}"}
                progress(f"round {i + 1} {mode} x{k}: FAILED")
            else:
                s = r["summary"]
                progress(f"round {i + 1} {mode} x{k}: state {s['state_mib']:.0f} MiB/worker, training peak "
                         f"{s['train_peak']:.0f} MiB (idle {s['idle_rss']:.0f}), {s['rate']:.2f} steps/s, "
                         f"{r['seconds']:.0f} s")
            r.update(load=load, round=i + 1)
            raw[str(k)][mode].append(r)

    # Nothing this script started may be left: every kernel and what it started is gone.
    leaked = [p for p in own_processes() if p.pid not in before]
    _, leaked = psutil.wait_procs(leaked, timeout=15)
    meta["leaked"] = [f"pid {p.pid}" for p in leaked]
    for p in leaked:
        progress(f"sharded.py: pid {p.pid} still running at the end (killed now)")
        with contextlib.suppress(psutil.Error):
            p.kill()

    ok = {k: {m: [r["summary"] for r in rs if "error" not in r] for m, rs in by.items()} for k, by in raw.items()}
    keys = next((list(s[0]) for by in ok.values() for s in by.values() if s), [])
    medians = {k: {m: {key: median(s[key] for s in ss) if not isinstance(ss[0][key], bool) else all(
        x[key] for x in ss) for key in keys} if ss else {} for m, ss in by.items()} for k, by in ok.items()}
    ratios = {}
    for k, by in medians.items():
        base = by.get("unsharded", {})
        ratios[k] = {m: {key: ratio(v.get(key), base.get(key)) for key in
                         ("state_mib", "train_peak", "train_peak_over_idle", "cell_peak", "rate")}
                     for m, v in by.items()}
    rows, rows2 = [], []
    for k, m in runs:
        v, x = medians[str(k)][m], ratios[str(k)][m]
        if not v:
            rows.append([k, LABELS[m], None, None, None, None, None, None, None, None, None, "failed"])
            continue
        rates = [s["rate"] for s in ok[str(k)][m]]
        rows.append([k, LABELS[m], v["state_mib"], x["state_mib"], v["train_peak"], v["train_peak_over_idle"],
                     x["train_peak_over_idle"], v["cell_peak"], x["cell_peak"], v["rate"], x["rate"],
                     spread(rates)])
        rows2.append([k, LABELS[m], v["idle_rss"], v["receive_peak"], v["received_rss"], v["train_peak"],
                      v["trained_rss"], v["pull_peak_rank0"], v["after_rss_rank0"], v["after_memfd_rank0"],
                      v["stale_copy_mib"]])
    print_table(f"state and peak memory per worker, steps/s ({args.repeat} round(s), medians; MiB, the largest "
                f"rank's; x: against unsharded at the same K)",
                ["workers", "mode", "state / worker (MiB)", "x", "training peak RSS (MiB)", "over idle (MiB)", "x",
                 "cell peak RSS (MiB)", "x", "steps/s rank 0", "x", "min-max"],
                rows, [0, 0, 0, 2, 0, 0, 2, 0, 2, 2, 2, 0])
    # Sharded ranks run with a fixed mmap threshold: their steps/s against unsharded with the same.
    same_allocator = {k: ratio(by.get("sharded", {}).get("rate"), by.get("unsharded-mmap", {}).get("rate"))
                      for k, by in medians.items() if "unsharded-mmap" in by}
    if same_allocator:
        print("\nsteps/s, `--shard` against unsharded with the same fixed mmap threshold: "
              + ", ".join(f"{k} workers {fmt(x)}" for k, x in same_allocator.items()))
    print_table("where the memory goes (MiB, medians, the largest rank's unless said)",
                ["workers", "mode", "idle RSS", "receive (+shard) peak", "RSS after receive", "training peak",
                 "RSS after training", "pull-back peak rank 0", "RSS after pull-back rank 0",
                 "+ memory file rank 0 (not in RSS)", "shipped tensors kept, backing no parameter"],
                rows2, [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    state_rows = [[k, LABELS[m], medians[str(k)][m].get("params_mib"), medians[str(k)][m].get("grads_mib"),
                   medians[str(k)][m].get("optimizer_mib"), medians[str(k)][m].get("sharded_params"),
                   medians[str(k)][m].get("threads")] for k, m in runs]
    print_table("training state per worker (MiB, from each rank's local tensors)",
                ["workers", "mode", "parameters", "gradients", "Adam state", "DTensor parameters", "torch threads"],
                state_rows, [0, 0, 1, 1, 1, 0, 0])
    if leaked:
        print(f"\nLEFT RUNNING at the end (killed): {meta['leaked']}")
    else:
        print("\nNothing left running: every kernel and every process it started is gone.")
    failed = {f"{m} x{k}": len(rs) - len(ok[k][m]) for k, by in raw.items() for m, rs in by.items()
              if len(rs) != len(ok[k][m])}
    if leaked:
        failed["leaked processes"] = len(leaked)
    save_results(args.out, meta, started, failed, labels=LABELS,
                 modes={m: {"flags": f, "env": e} for m, (f, e) in MODES.items()},
                 raw=raw, median=medians, ratio_to_unsharded=ratios,
                 sharded_rate_to_unsharded_same_allocator=same_allocator)


if __name__ == "__main__":
    main()
