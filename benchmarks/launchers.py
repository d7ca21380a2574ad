"""Cold start to the first optimizer step, per launcher: Slurm and MPI against the embedded cluster.

    python benchmarks/launchers.py [--workers 2 4] [--repeats 3]
                                   [--configs ipp-local,ipp-slurm,ipp-mpi,dask-local,dask-slurm]
                                   [--out benchmarks/results/launchers-latest.json]

For each configuration and number of workers: a fresh `ScaleSession` (display "text") over a
notebook namespace that already holds a model (MLP 256-512-512-10, 1.6 MB) and a dataset
(TensorDataset, 4096 x 256 floats, 4 MiB); the clock starts as `start(n, launcher)` is
called and stops when the first cell returns, a cell that builds a DataLoader and an SGD
optimizer and takes one optimizer step on one batch (automatic mode: the loader sharded, the
gradients averaged; the model and the data shipped, the model pulled back from rank 0):

  ipp-local   ipyparallel, the embedded cluster: `start(n)`, the baseline of the ipyparallel rows
  ipp-slurm   ipyparallel, `start(n, "slurm", time_limit="10:00")`: one Slurm job of n tasks
  ipp-mpi     ipyparallel, `start(n, "mpi")`: one `mpiexec -n N` (Open MPI)
  dask-local  Dask, the embedded cluster: the baseline of the Dask rows
  dask-slurm  Dask, `start(n, "slurm", ...)`: dask-jobqueue, one Slurm job per worker

Slurm is a real one-node Slurm on this machine (tests/slurm.py: its own munged, slurmctld and
slurmd, 8 declared CPUs or more, over-subscribed), started once before the first run and not
timed, as a user's Slurm already runs. Also recorded: `start()` and the first cell apart, and
how long `stop()` took. Every session is stopped in a `finally`; after each Slurm stop
`squeue -h` must be empty (a job left in the queue fails that run, is cancelled, and makes
the script exit non-zero), and no process of the run may be left 5 s after it (job
processes, children of this process; how many were still ending as stop() returned, and how
long after it they were gone, is recorded). The kernel-side imports (ipyparallel,
distributed, dask-jobqueue, the backends) and Python's multiprocessing resource tracker are
set up before the first run, so that no configuration pays them alone (a kernel pays them
once); each run starts fresh worker processes, which import torch themselves.

All configurations and sizes run once per repeat, interleaved, in an order that reverses
every other repeat, so that drift hits them alike; medians over the repeats, the ratio to the
embedded cluster of the same engine and size (its median, the same process run), and the
min-max across repeats. Slurm rows are skipped (with the reason) where tests/slurm.py cannot
start a Slurm here, MPI rows where `mpiexec` or mpi4py is missing. Writes every raw result
to `--out`. Not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tests/slurm.py
sys.path.insert(0, str(HERE))  # compare.py's helpers
# Nothing heavy is imported at the top: the embedded Dask cluster's nannies start their workers
# with multiprocessing's spawn, which imports this script (the main module) in every worker
# process, where importing compare.py (nbformat, nbclient) cost 1.3 s each. tests/slurm.py and
# compare.py are imported in the functions that use them (a kernel's main module, ipykernel's
# launcher, costs its workers next to nothing).

# name -> (engine, launcher, how the table calls it)
CONFIGS = {
    "ipp-local": ("ipyparallel", "local", "embedded"),
    "ipp-slurm": ("ipyparallel", "slurm", "Slurm (1 job)"),
    "ipp-mpi": ("ipyparallel", "mpi", "MPI (`mpiexec`)"),
    "dask-local": ("dask", "local", "embedded"),
    "dask-slurm": ("dask", "slurm", "Slurm (1 job per worker)"),
}
BASELINE = {"ipyparallel": "ipp-local", "dask": "dask-local"}
SLURM_OPTIONS = {"time_limit": "10:00"}
SAMPLES, FEATURES, CLASSES = 4096, 256, 10

# The first cell: one optimizer step on one batch (the model and data come from the notebook).
CELL = """
import torch
from torch.utils.data import DataLoader
loader = DataLoader(data, batch_size=64, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = next(iter(loader))
opt.zero_grad()
loss = torch.nn.functional.cross_entropy(model(x), y)
loss.backward()
opt.step()
"""


def namespace() -> dict:
    """The notebook's namespace before the first cell: a model and its data."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g),
                         torch.randint(0, CLASSES, (SAMPLES,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, CLASSES))
    return {"model": model, "data": data}


def skip_reasons(configs: list[str]) -> dict[str, str]:
    """config -> why it cannot run here."""
    import slurm

    reasons = {}
    slurm_reason = slurm.unavailable_reason()
    if slurm_reason is None and importlib.util.find_spec("dask_jobqueue") is None:
        dask_reason = "dask-jobqueue is not installed (pip install 'jupyter_scale[slurm]')"
    else:
        dask_reason = slurm_reason
    mpi_reason = ("mpiexec is not on PATH" if shutil.which("mpiexec") is None
                  else "mpi4py is not installed" if importlib.util.find_spec("mpi4py") is None else None)
    for config in configs:
        launcher = CONFIGS[config][1]
        reason = (slurm_reason if config == "ipp-slurm" else dask_reason if config == "dask-slurm"
                  else mpi_reason if launcher == "mpi" else None)
        if reason:
            reasons[config] = reason
    return reasons


def _version(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=15, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def _squeue() -> str:
    """`squeue -h` of the benchmark's Slurm (its SLURM_CONF is in os.environ)."""
    done = subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"squeue -h failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} {' '.join(p.cmdline())[:160]}"
    except psutil.Error:
        return f"pid {p.pid}"


def _stop_processes(processes: list[psutil.Process], grace: float = 5.0) -> None:
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace)


def run_once(config: str, n: int, cluster, timeout: float) -> dict:
    """One cold start: a fresh session, start(), the first cell, stop(); seconds of each. `cluster`:
    the test Slurm (tests/slurm.py) for the Slurm rows, else None."""
    from jupyter_scale.session import ScaleSession

    engine, launcher, _ = CONFIGS[config]
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}  # the test Slurm's daemons among them
    ns = namespace()
    session = ScaleSession(namespace=ns, backend_name=engine, display="text", start_timeout=timeout)
    said = io.StringIO()  # what start() and the cell print ("starting ...", "N workers ready in ...")
    result: dict = {}
    problems: list[str] = []
    try:
        with contextlib.redirect_stdout(said):
            t0 = time.perf_counter()
            try:
                if launcher == "local":
                    session.start(n)
                elif launcher == "slurm":
                    session.start(n, "slurm", **SLURM_OPTIONS)
                else:
                    session.start(n, launcher)
                t1 = time.perf_counter()
                record = session.run(CELL, timeout=timeout)
                t2 = time.perf_counter()
            finally:
                t3 = time.perf_counter()
                try:
                    session.stop()
                finally:
                    result["stop"] = time.perf_counter() - t3
        if record.status != "finished":
            raise RuntimeError(f"the cell ended {record.status}: {record.error}")
        if record.workers != n:
            raise RuntimeError(f"the cell ran on {record.workers} workers, not {n}")
        result.update(cold=t2 - t0, start=t1 - t0, cell=t2 - t1, shipped_mib=record.bytes_shipped / 2**20)
    except Exception as exc:  # reported with what the checks below find
        tail = "\n".join(said.getvalue().strip().splitlines()[-15:])
        problems.append(f"{type(exc).__name__}: {exc}\n--- what the session said:\n{tail}")
    finally:
        # After every stop, failed runs included: Slurm's queue is empty, nothing of the run is left.
        if launcher == "slurm" and cluster is not None:
            queue = _squeue()
            if queue.strip():
                cluster.cancel()
                deadline = time.monotonic() + 30
                while cluster.jobs() and time.monotonic() < deadline:
                    time.sleep(0.2)
                problems.append(f"squeue -h not empty after stop() (cancelled now):\n{queue.rstrip()}")
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        if cluster is not None:
            left += [p for p in cluster.processes() if p.pid not in {q.pid for q in left}]
        result["alive_at_stop"] = len(left)  # still ending as stop() returned (a job's processes, say)
        if left:
            waited = time.perf_counter()
            _, left = psutil.wait_procs(left, timeout=5)  # ones on their way out
            result["ended_after_stop"] = None if left else time.perf_counter() - waited
        if left:
            problems.append("left running after stop() (stopped now): " + "; ".join(_describe(p) for p in left))
            _stop_processes(left)
    if problems:
        raise RuntimeError("\n".join(problems))
    return result


def main() -> None:
    import slurm
    from compare import median, print_table, progress, ratio, save_results, spread

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="cluster sizes (each is a row)")
    parser.add_argument("--repeats", "--repeat", type=int, default=3,
                        help="rounds (every configuration once each, interleaved), medians over them")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {','.join(CONFIGS)}")
    parser.add_argument("--timeout", type=float, default=180,
                        help="seconds the workers may take to start, and the first cell to run")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "launchers-latest.json",
                        help="where the raw results and medians go (JSON)")
    args = parser.parse_args()
    configs = args.configs.split(",")
    if unknown := set(configs) - set(CONFIGS):
        parser.error(f"unknown configurations {sorted(unknown)} (choose from {','.join(CONFIGS)})")
    if any(n < 1 for n in args.workers) or args.repeats < 1:
        parser.error("--workers and --repeats take numbers from 1")
    skipped = skip_reasons(configs)
    for config, reason in skipped.items():
        progress(f"launchers.py: skipping {config}: {reason}")
    runnable = [c for c in configs if c not in skipped]
    # A SIGTERM ends the run through the finally blocks (sessions, Slurm) like a Ctrl-C.
    def terminated(*_):
        progress("launchers.py: SIGTERM, cleaning up")
        sys.exit(143)
    signal.signal(signal.SIGTERM, terminated)

    # The kernel side's imports, before any clock runs (a notebook's first %%distribute pays
    # them once; here every configuration would otherwise pay them, or the first one alone).
    # Python's resource tracker (one per process, for the rest of its life), which the first
    # spawned process starts (Dask's nannies spawn their workers).
    from multiprocessing import resource_tracker

    import distributed
    import ipyparallel
    import torch

    import jupyter_scale
    import jupyter_scale.backends.dask  # noqa: F401
    import jupyter_scale.backends.ipyparallel  # noqa: F401
    import jupyter_scale.session  # noqa: F401
    resource_tracker.ensure_running()
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "jupyter_scale": getattr(jupyter_scale, "__version__", None),
                "ipyparallel": ipyparallel.__version__, "distributed": distributed.__version__}
    if any(CONFIGS[c][1] == "slurm" for c in runnable):
        import dask_jobqueue
        versions["dask_jobqueue"] = dask_jobqueue.__version__
    if "ipp-mpi" in runnable:
        import mpi4py
        versions["mpi4py"] = mpi4py.__version__
        versions["mpiexec"] = _version(["mpiexec", "--version"])

    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "host": socket.gethostname(),
            "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), **versions,
            # The package is measured as it is in the tree (a "-dirty" commit: with changes not committed).
            "commit": _version(["git", "-C", str(HERE.parent), "describe", "--always", "--dirty"]),
            "loadavg_start": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"{socket.gethostname()}, {os.cpu_count()} cores, "
          + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
          + f"; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    started = time.monotonic()
    sizes = list(dict.fromkeys(args.workers))
    raw: dict[str, dict[str, list[dict]]] = {c: {str(n): [] for n in sizes} for c in runnable}
    runs = [(n, c) for n in sizes for c in runnable]
    with contextlib.ExitStack() as stack:
        cluster = None
        if any(CONFIGS[c][1] == "slurm" for c in runnable):
            t0 = time.monotonic()
            cluster = stack.enter_context(slurm.Slurm(cpus=max(8, *sizes)))
            os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
            stack.callback(os.environ.pop, "SLURM_CONF", None)
            meta["slurm_started_s"] = round(time.monotonic() - t0, 2)
            meta["slurm"] = _version(["sbatch", "--version"])  # Slurm's clients need its SLURM_CONF
            progress(f"launchers.py: a one-node Slurm ({cluster.node}, {meta['slurm']}) up in "
                     f"{meta['slurm_started_s']:.1f} s (not timed)")
        for i in range(args.repeats):
            order = runs if i % 2 == 0 else runs[::-1]
            for position, (n, config) in enumerate(order, 1):
                load = os.getloadavg()[0]  # the machine is shared: how busy it was as this run began
                try:
                    r = run_once(config, n, cluster, args.timeout)
                except Exception as exc:  # the other runs still go; the failure is kept in the results
                    traceback.print_exc()
                    r = {"error": f"{type(exc).__name__}: {str(exc)[:4000]}"}
                    progress(f"round {i + 1} {config} x{n}: FAILED")
                else:
                    progress(f"round {i + 1} {config} x{n}: cold {r['cold']:.2f} s (start {r['start']:.2f} s, "
                             f"first cell {r['cell']:.2f} s), stop {r['stop']:.2f} s"
                             + (f" ({r['alive_at_stop']} processes still ending, gone "
                                f"{r['ended_after_stop']:.2f} s later)" if r["alive_at_stop"] else ""))
                r.update(load=load, round=i + 1, order=position)
                raw[config][str(n)].append(r)

    keys = ("cold", "start", "cell", "stop")
    ok = {c: {k: [r for r in rs if "error" not in r] for k, rs in by_n.items()} for c, by_n in raw.items()}
    medians = {c: {n: {k: median(r.get(k) for r in rs) for k in keys} for n, rs in by_n.items()}
               for c, by_n in ok.items()}
    ranges = {c: {n: {k: [min(v), max(v)] if (v := [r[k] for r in rs if r.get(k) is not None]) else None
                      for k in keys} for n, rs in by_n.items()} for c, by_n in ok.items()}
    ratios = {}
    for c in runnable:
        base = BASELINE[CONFIGS[c][0]]
        ratios[c] = {str(n): {k: ratio(medians[c][str(n)][k], medians.get(base, {}).get(str(n), {}).get(k))
                              for k in ("cold", "start", "cell")} for n in sizes}
    rows = []
    for n in sizes:
        for c in configs:
            engine, _, label = CONFIGS[c]
            if c in skipped:
                rows.append([engine, label, n, None, None, f"skipped: {skipped[c]}", None, None, None])
                continue
            m, x = medians[c][str(n)], ratios[c][str(n)]
            rows.append([engine, label, n, m["cold"], x["cold"], spread(r["cold"] for r in ok[c][str(n)]),
                         m["start"], m["cell"], m["stop"]])
    print_table(f"cold start to the first optimizer step: {args.repeats} round(s), medians, min-max across rounds; "
                f"x embedded: the embedded cluster of the same engine and size",
                ["engine", "launcher", "workers", "start to first step (s)", "x embedded", "min-max",
                 "start() (s)", "first cell (s)", "stop() (s)"],
                rows, [0, 0, 0, 2, 2, 0, 2, 2, 2])
    failed = {f"{c} x{n}": len(rs) - len(ok[c][n]) for c, by_n in raw.items() for n, rs in by_n.items()
              if len(rs) != len(ok[c][n])}
    save_results(args.out, meta, started, failed, labels={c: f"{CONFIGS[c][0]}, {CONFIGS[c][2]}" for c in configs},
                 baseline={c: BASELINE[CONFIGS[c][0]] for c in configs}, skipped=skipped, raw=raw, median=medians,
                 min_max=ranges, ratio_to_embedded=ratios)


if __name__ == "__main__":
    main()
