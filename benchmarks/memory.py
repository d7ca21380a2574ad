"""Memory of the process tree a 2-rank %%distribute cell runs on, against torchrun's, process by process.

    python benchmarks/memory.py [--repeat 3] [--backend ipyparallel,dask] [--steps 50] [--warm 10]
                                [--timeout 300] [--out benchmarks/results/memory-latest.json]

The same loop as compare.py's (fixed-seed MLP 256-512-512-10, synthetic data, SGD with
momentum, batch 64 per rank, 2 ranks, gloo on 127.0.0.1; `--steps` steps per rank), measured
once its ranks have trained and are still alive with everything they hold:

  torchrun     the baseline: a DDP + DistributedSampler script under `torchrun --nproc-per-node 2`
               (c10d rendezvous on 127.0.0.1, OMP_NUM_THREADS=1). After the loop each rank writes
               a file and waits (with a deadline) for this script's go; the tree is measured
               in between: torchrun's agent (the launcher) and the two ranks.
  ipyparallel  a fresh Jupyter kernel (nbclient, as a notebook runs) runs the loop under
  dask         `%%distribute --workers 2` (automatic mode, the loop unchanged; `--backend dask`
               for Dask). The workers keep the cell's namespace, so after the cell they hold what
               torchrun's waiting ranks hold. Measured: every process the kernel started (all its
               descendants: multiprocessing's fork server and resource tracker, ipyparallel's controller and
               the processes it forks, the engines and their nannies; Dask's workers, where the
               scheduler and the nannies are objects in the kernel), each labelled by role from
               its command line. The kernel itself is not part of the cluster's tree: it is
               reported apart, before the cluster started (torch imported, the data built) and
               after the cell, whose difference includes what the cluster costs inside the kernel
               (Dask's scheduler and nannies, the clients).

Per process: PSS and USS (psutil's memory_full_info: /proc/<pid>/smaps_rollup; the same user
or root), RSS, threads, whether torch's library is mapped, and the bytes of jupyter_scale's
memory files (memfds a process writes values into and keeps between cells: memory that is in
no process's RSS or PSS). Per tree: the sums, and the distinct resident pages of all its
processes, each page counted once whoever maps it (from /proc/<pid>/pagemap; root only): PSS
splits a shared page between every process that maps it, those outside the tree too (the
kernel, or any other torch process on the machine), so the tree's PSS moves with what else
runs; its distinct pages do not. Also measured alone, for scale: a bare interpreter, one that
imported torch, one that imported jupyter_scale's worker side.

Rounds interleave the three trees (order reversed every other round); medians over rounds;
ratios to torchrun's tree. Every wait has a deadline; every kernel ends with a cell that stops
its cluster; what a kernel or torchrun left running 15 s after it ended is stopped by pid and
fails the run. Writes the raw results and medians to `--out` (JSON). Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import nbformat
import numpy as np
import psutil
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare import (  # noqa: E402  benchmarks/, the script's own folder
    CLEANUP,
    SAMPLER_LOADER,
    _Descendants,
    bench_records,
    data,
    distribute_cells,
    fmt,
    loop,
    median,
    print_table,
    progress,
    ratio,
    save_results,
)

MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")
SETTLE_S = 1.0  # after the ranks are ready, before measuring: late frees and replies land
BACKENDS = {"ipyparallel": "", "dask": "--backend dask"}
TREES = ("torchrun", *BACKENDS)
TITLES = {"torchrun": "torchrun --nproc-per-node 2", "ipyparallel": "`%%distribute --workers 2` (ipyparallel)",
          "dask": "`%%distribute --workers 2 --backend dask`"}

# A rank of torchrun's tree, after the loop: tells this script it is ready, and waits for its go
# (with a deadline), holding its model, optimizer, loader and data as the workers do after a cell.
WAIT = """
import pathlib
here = pathlib.Path(os.environ['MEMORY_BENCH_DIR'])
(here / f'ready-{dist.get_rank()}').write_text(str(os.getpid()))
deadline = time.monotonic() + float(os.environ['MEMORY_BENCH_WAIT'])
while not (here / 'go').exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""

# Measured alone, one at a time, for scale: what an interpreter, torch and our worker side cost.
REFERENCES = {
    "python, bare interpreter": "",
    "python + import torch": "import torch",
    "python + import jupyter_scale.worker (torch included)": "import jupyter_scale.worker",
    "python + an engine's imports (jupyter_scale.worker, ipyparallel.engine.app)":
        "import jupyter_scale.worker, ipyparallel.engine.app",
    "python + a Dask worker's imports (jupyter_scale.backends.dask, distributed)":
        "import jupyter_scale.backends.dask, distributed",
    "python + an engine nanny's imports (ipyparallel.engine.nanny)": "import ipyparallel.engine.nanny",
}


def torchrun_script(steps: int, warm: int) -> str:
    return ("import os, time, torch.distributed as dist\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "from torch.utils.data import DistributedSampler\n"
            "dist.init_process_group('gloo')\n"
            + data(steps, warm, 2)
            + loop(SAMPLER_LOADER, "DDP(model)", "dist.get_rank() == 0")
            + WAIT
            + "dist.barrier()\ndist.destroy_process_group()\n")


# ----------------------------------------------------------------------------------
# Measuring processes
# ----------------------------------------------------------------------------------

def resident_frames(pid: int) -> np.ndarray | None:
    """The physical page numbers of every resident page `pid` maps (None where they cannot be read:
    not root, or the process is gone)."""
    ranges, current = [], None
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = head.split("-")
                    current = (int(start, 16), int(end, 16))
                elif head == "Rss:" and int(line.split()[1]) > 0 and current is not None:
                    ranges.append(current)
        found = []
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            for start, end in ranges:
                f.seek(start // PAGE * 8)
                entries = np.frombuffer(f.read((end - start) // PAGE * 8), dtype=np.uint64)
                present = entries[(entries >> np.uint64(63)) == 1]
                found.append(present & np.uint64((1 << 55) - 1))
    except (OSError, ValueError):
        return None
    frames = np.concatenate(found) if found else np.zeros(0, dtype=np.uint64)
    if len(frames) and not frames.any():  # without CAP_SYS_ADMIN the kernel reads every frame as 0
        return None
    return frames


def rollup(pid: int) -> dict[str, float]:
    """PSS split into anonymous memory (heaps, stacks: the process's own data) and files (libraries,
    code), MiB, from /proc/<pid>/smaps_rollup."""
    found = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Pss_Anon", "Pss_File", "Pss_Shmem"):
                found[key.lower()] = int(value.split()[0]) / 1024
    return found


def memory_files(pid: int) -> dict[int, int]:
    """jupyter_scale's memory files `pid` holds open: inode -> bytes allocated."""
    found = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:jupyter_scale"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    found[st.st_ino] = st.st_blocks * 512
    return found


def classify(cmd: str, parent_cmd: str, tree: str, grandparent_cmd: str = "",
             child_cmds: tuple[str, ...] = ()) -> tuple[str, bool]:
    """(role, whether it is a rank that trains), from a process's command line and its
    parent's; for forks of multiprocessing's fork server (which show its command line), from
    where they are in the tree."""
    server = "multiprocessing.forkserver"  # its forks show its command line
    if server in cmd:
        if server not in parent_cmd:
            forks = "the Dask workers are" if tree == "dask" else "the controller and engines are"
            return f"multiprocessing fork server ({forks} its forks)", False
        if tree == "dask":
            return "Dask worker (a rank; a fork of the fork server; its nanny is in the kernel)", True
        if any("ipyparallel.engine.nanny" in c for c in child_cmds):
            return "engine (a rank)", True
        if server in grandparent_cmd:  # forked by the controller
            return "controller's forked schedulers + heart monitor", False
        return "controller (hub)", False
    if tree == "torchrun":
        if "torch.distributed.run" in cmd:
            return "torchrun agent (launcher, c10d store)", False
        if "train.py" in cmd:
            return "rank", True
    if "ipyparallel.engine.nanny" in cmd:
        return "engine nanny", False
    if "ipyparallel.engine.app" in cmd:
        return "engine (a rank)", True
    if "ipyparallel.controller.app" in cmd:
        if "ipyparallel.controller.app" in parent_cmd:  # forked by the controller: the same command line
            return "controller's forked schedulers + heart monitor", False
        return "controller (hub)", False
    if "multiprocessing.spawn" in cmd and tree == "dask":
        return "Dask worker (a rank; its nanny is in the kernel)", True
    if "multiprocessing.resource_tracker" in cmd:
        return "multiprocessing resource tracker", False
    return "other: " + " ".join(cmd.split())[:60], False


def measure(procs: list[psutil.Process], tree: str) -> dict:
    """Every process of `procs` (those still alive) and the tree's totals."""
    records, frames, files = [], [], {}
    commands, parents = {}, {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            commands[p.pid], parents[p.pid] = " ".join(p.cmdline()), p.ppid()
    for p in procs:
        try:
            with p.oneshot():
                ppid, threads = p.ppid(), p.num_threads()
            full = p.memory_full_info()
            maps = Path(f"/proc/{p.pid}/maps").read_text()
            parts = rollup(p.pid)
        except (psutil.Error, OSError):
            continue
        cmd = commands.get(p.pid, "")
        children = tuple(commands[c] for c, parent in parents.items() if parent == p.pid)
        role, trains = classify(cmd, commands.get(ppid, ""), tree, commands.get(parents.get(ppid, -1), ""), children)
        held = memory_files(p.pid)
        files.update(held)
        found = resident_frames(p.pid)
        if found is not None:
            frames.append(found)
        records.append({"pid": p.pid, "ppid": ppid, "role": role, "trains": trains, "cmd": cmd[-200:],
                        "pss": full.pss / MIB, "uss": full.uss / MIB, "rss": full.rss / MIB, "swap": full.swap / MIB,
                        "threads": threads, "torch": "libtorch_cpu" in maps, "memfd": sum(held.values()) / MIB,
                        "pss_anon": parts.get("pss_anon"), "pss_file": parts.get("pss_file"),
                        "pss_shmem": parts.get("pss_shmem")})
    distinct = None
    if frames and len(frames) == len(records):
        distinct = len(np.unique(np.concatenate(frames))) * PAGE / MIB
    return {"processes": records, "total": {
        "count": len(records), "pss": sum(r["pss"] for r in records), "uss": sum(r["uss"] for r in records),
        "rss": sum(r["rss"] for r in records), "distinct": distinct, "memfd": sum(files.values()) / MIB,
        "pss_anon": sum(r["pss_anon"] or 0.0 for r in records), "pss_file": sum(r["pss_file"] or 0.0 for r in records)}}


def by_role(snapshot: dict) -> dict[str, dict]:
    roles: dict[str, dict] = {}
    for r in snapshot["processes"]:
        role = roles.setdefault(r["role"], {"count": 0, "pss": 0.0, "uss": 0.0, "rss": 0.0, "threads": 0,
                                            "torch": 0, "trains": r["trains"], "memfd": 0.0, "pss_anon": 0.0,
                                            "pss_file": 0.0})
        role["count"] += 1
        for key in ("pss", "uss", "rss", "threads", "memfd", "pss_anon", "pss_file"):
            role[key] += r[key] or 0.0
        role["torch"] += r["torch"]
    return roles


def stop(procs: list[psutil.Process], why: str, grace: float = 0.0) -> list[str]:
    """Kill (by pid) those of `procs` still running after `grace` s; says which they were."""
    killed = []
    _, alive = psutil.wait_procs([p for p in procs if p.is_running()], timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            if p.is_running():
                killed.append(f"pid {p.pid} {' '.join(p.cmdline())[:160]}")
                progress(f"memory.py: killing {killed[-1]} ({why})")
                p.kill()
    psutil.wait_procs(procs, timeout=10)
    return killed


# ----------------------------------------------------------------------------------
# The trees
# ----------------------------------------------------------------------------------

def run_torchrun(args) -> dict:
    """torchrun's tree, measured while both ranks wait after the loop."""
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp:
        script, output = Path(tmp, "train.py"), Path(tmp, "output")
        script.write_text(torchrun_script(args.steps, args.warm))
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MEMORY_BENCH_DIR=tmp,
                   MEMORY_BENCH_WAIT=str(args.timeout))
        with open(output, "w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", "127.0.0.1:0", str(script)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        root = psutil.Process(process.pid)
        seen: dict[int, psutil.Process] = {}
        left: list[str] = []
        try:
            deadline = time.monotonic() + args.timeout
            while not all(Path(tmp, f"ready-{rank}").exists() for rank in (0, 1)):
                with contextlib.suppress(psutil.Error):
                    seen.update((p.pid, p) for p in root.children(recursive=True))
                if process.poll() is not None:
                    raise RuntimeError(f"torchrun exited with {process.returncode} before both ranks were ready:\n"
                                       + output.read_text()[-3000:])
                if time.monotonic() > deadline:
                    raise TimeoutError(f"torchrun's ranks not ready in {args.timeout:g} s:\n" + output.read_text()[-3000:])
                time.sleep(0.1)
            time.sleep(SETTLE_S)
            tree = [root, *root.children(recursive=True)]
            seen.update((p.pid, p) for p in tree)
            snapshot = measure(tree, "torchrun")
            Path(tmp, "go").touch()
            process.wait(timeout=60)
        finally:
            if process.poll() is None:  # a failure on the way: torchrun and its ranks go now
                with contextlib.suppress(psutil.Error):
                    seen.update((p.pid, p) for p in [root, *root.children(recursive=True)])
                stop(list(seen.values()), "torchrun stopped after a failure")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
            else:  # torchrun ended: its ranks must be gone too, 15 s on
                left = stop(list(seen.values()), "left by torchrun", grace=15)
        text = output.read_text()
    problems = []
    if process.returncode != 0:
        problems.append(f"torchrun exited with {process.returncode}")
    if left:
        problems.append(f"left running: {left}")
    steps = [r.get("steps") for r in bench_records(text)]
    if steps != [args.steps]:
        problems.append(f"rank 0 reported steps {steps}, not [{args.steps}]")
    if problems:
        raise RuntimeError("; ".join(problems) + ":\n" + text[-3000:])
    return {"tree": snapshot}


def run_kernel(backend: str, args) -> dict:
    """A fresh kernel runs the loop under %%distribute; its cluster's tree and the kernel, measured after the cell."""
    setup, train = distribute_cells(args.steps, args.warm, f"--timeout {args.timeout:g} {BACKENDS[backend]}".strip())
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.strip("\n")) for c in (setup, train, CLEANUP)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(nb, timeout=args.timeout + 60, kernel_name="python3",
                            resources={"metadata": {"path": tempfile.gettempdir()}})
    descendants = None
    left: list[str] = []
    try:
        with client.setup_kernel():
            kernel = psutil.Process(client.km.provisioner.pid)
            descendants = _Descendants(kernel.pid)
            try:
                client.execute_cell(nb.cells[0], 0)
                before = measure([kernel], backend)
                client.execute_cell(nb.cells[1], 1)
                descendants.look()
                time.sleep(SETTLE_S)
                tree = measure(kernel.children(recursive=True), backend)
                after = measure([kernel], backend)
            finally:
                descendants.look()
                try:
                    client.execute_cell(nb.cells[2], 2)
                except Exception as exc:  # reported; the first failure is the one raised
                    progress(f"memory.py: the cleanup cell failed: {exc}")
    finally:
        if descendants is not None:
            left = descendants.reap()
    text = "".join(o.get("text", "") for o in nb.cells[1].get("outputs", []))
    steps = [r.get("steps") for r in bench_records(text)]
    problems = []
    if left:
        problems.append(f"left running 15 s after the kernel ended (killed now): {left}")
    if steps != [args.steps]:
        problems.append(f"rank 0 reported steps {steps}, not [{args.steps}]:\n{text[-3000:]}")
    if sum(r["trains"] for r in tree["processes"]) != 2:
        problems.append(f"expected 2 ranks in the kernel's tree, found {[r['role'] for r in tree['processes']]}")
    if problems:
        raise RuntimeError("; ".join(problems))
    return {"tree": tree, "kernel_before": before, "kernel_after": after}


def run_reference(name: str, code: str, timeout: float) -> dict:
    """One interpreter alone, after `code`: its memory (it waits on stdin, with a deadline, to be measured)."""
    process = subprocess.Popen([sys.executable, "-c", f"{code}\nimport sys\nprint('ready', flush=True)\nsys.stdin.read()"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        if not ready or process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{name}: not ready in {timeout:g} s (exit status {process.poll()})")
        time.sleep(SETTLE_S)
        snapshot = measure([psutil.Process(process.pid)], "reference")
    finally:
        with contextlib.suppress(OSError):
            process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    record = snapshot["processes"][0]
    return {k: record[k] for k in ("pss", "uss", "rss", "threads", "pss_anon")}


# ----------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------

def summarize(rounds: list[dict]) -> dict:
    """Medians over the rounds of one tree: per role and in total (MiB)."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {}
    roles: dict[str, dict] = {}
    order: list[str] = []
    for r in ok:
        for role in by_role(r["tree"]):
            if role not in order:
                order.append(role)
    for role in order:
        found = [by_role(r["tree"]).get(role) for r in ok]
        found = [f for f in found if f is not None]
        roles[role] = {key: median(f[key] for f in found)
                       for key in ("count", "pss", "uss", "rss", "threads", "memfd", "torch", "pss_anon", "pss_file")}
        roles[role]["trains"] = found[0]["trains"]
        roles[role]["rounds"] = len(found)
    total = {key: median(r["tree"]["total"][key] for r in ok)
             for key in ("count", "pss", "uss", "rss", "distinct", "memfd", "pss_anon", "pss_file")}
    out = {"roles": roles, "total": total}
    if "kernel_after" in ok[0]:
        for when in ("kernel_before", "kernel_after"):
            out[when] = {key: median(r[when]["total"][key] for r in ok)
                         for key in ("pss", "uss", "rss", "distinct", "memfd", "pss_anon", "pss_file")}
        out["kernel_growth"] = {key: median(r["kernel_after"]["total"][key] - r["kernel_before"]["total"][key]
                                            for r in ok) for key in ("pss", "uss", "rss", "memfd", "pss_anon", "pss_file")}
    return out


def costs_line(tree: str, s: dict, base: dict) -> str:
    """What each process of the tree costs, and what it runs that torchrun does not (PSS, MiB)."""
    each = [f"{role} {v['pss'] / v['count']:.0f}" + (f" x {v['count']:g}" if v["count"] != 1 else "")
            for role, v in s["roles"].items()]
    line = f"{TITLES[tree]}, PSS per process (MiB): " + "; ".join(each) + "."
    if tree == "torchrun" or not base:
        return line
    ranks = sum(v["pss"] for v in s["roles"].values() if v["trains"])
    rest = s["total"]["pss"] - ranks
    base_ranks = sum(v["pss"] for v in base["roles"].values() if v["trains"])
    base_rest = base["total"]["pss"] - base_ranks
    return (line + f" Its 2 ranks: {ranks:.0f} against torchrun's {base_ranks:.0f} ({ranks - base_ranks:+.0f}); "
            f"its processes that do not train: {rest:.0f} against torchrun's agent {base_rest:.0f} "
            f"({rest - base_rest:+.0f}); the tree: {s['total']['pss'] - base['total']['pss']:+.0f}.")


def print_tree(tree: str, s: dict, base: dict, repeat: int) -> None:
    rows = []
    for role, v in s["roles"].items():
        rows.append([role, v["count"], v["pss"], v["pss_anon"], v["pss_file"], v["uss"], v["rss"],
                     v["pss"] / v["count"], v["threads"], f"{v['torch']:g}/{v['count']:g}", v["memfd"]])
    t = s["total"]
    rows.append(["**tree total**", t["count"], t["pss"], t["pss_anon"], t["pss_file"], t["uss"], t["rss"], None, None,
                 None, t["memfd"]])
    if tree != "torchrun" and base:
        b = base["total"]
        rows.append(["x torchrun's tree", None, ratio(t["pss"], b["pss"]), ratio(t["pss_anon"], b["pss_anon"]),
                     ratio(t["pss_file"], b["pss_file"]), ratio(t["uss"], b["uss"]), ratio(t["rss"], b["rss"]), None,
                     None, None, None])
    if "kernel_after" in s:
        k, g, k0 = s["kernel_after"], s["kernel_growth"], s["kernel_before"]
        rows.append(["notebook kernel before the cluster (not in the tree)", 1, k0["pss"], k0["pss_anon"],
                     k0["pss_file"], k0["uss"], k0["rss"], None, None, None, k0["memfd"]])
        rows.append(["notebook kernel after the cell (not in the tree)", 1, k["pss"], k["pss_anon"], k["pss_file"],
                     k["uss"], k["rss"], None, None, None, k["memfd"]])
        rows.append(["kernel's growth", None, g["pss"], g["pss_anon"], g["pss_file"], g["uss"], g["rss"], None, None,
                     None, g["memfd"]])
    print_table(f"{TITLES[tree]}: processes by role (MiB, medians of {repeat} round(s))",
                ["process", "count", "PSS", "PSS anon", "PSS files", "USS", "RSS", "PSS per process", "threads",
                 "torch loaded", "memory files"],
                rows, [0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1])
    print("\n" + costs_line(tree, s, base))


def print_summary(summaries: dict, references: dict, repeat: int) -> dict:
    base = summaries.get("torchrun", {}).get("total", {})
    rows, ratios = [], {}
    for tree, s in summaries.items():
        if not s:
            rows.append([TITLES[tree], None, None, None, None, None, None, None, None, None, None, "failed"])
            continue
        t = s["total"]
        ratios[tree] = {key: ratio(t[key], base.get(key)) for key in ("pss", "uss", "rss", "distinct")}
        k = s.get("kernel_after", {})
        rows.append([TITLES[tree], t["count"], t["pss"], ratios[tree]["pss"], t["uss"], ratios[tree]["uss"],
                     t["distinct"], ratios[tree]["distinct"], t["memfd"], k.get("pss"), k.get("uss"),
                     s.get("kernel_growth", {}).get("uss")])
    print_table(f"the trees (MiB, medians of {repeat} round(s); target: PSS <= 1.2x torchrun's)",
                ["tree", "processes", "PSS", "x torchrun", "USS", "x torchrun", "distinct pages", "x torchrun",
                 "memory files (not in PSS)", "kernel PSS (not in the tree)", "kernel USS",
                 "kernel USS growth"], rows, [0, 0, 0, 2, 0, 2, 0, 2, 0, 0, 0, 0])
    if references:
        print_table("for scale: one interpreter alone, idle after its imports (MiB, median)",
                    ["process", "PSS", "PSS anon", "USS", "RSS", "threads"],
                    [[name, r["pss"], r["pss_anon"], r["uss"], r["rss"], r["threads"]] for name, r in references.items()],
                    [0, 1, 1, 1, 1, 0])
    return ratios


# ----------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="rounds (the trees interleaved), medians over them")
    parser.add_argument("--backend", default=",".join(BACKENDS), help=f"any of {','.join(BACKENDS)}")
    parser.add_argument("--steps", type=int, default=50, help="training steps per rank before measuring")
    parser.add_argument("--warm", type=int, default=10, help="the loop's warm-up steps (its steps/s line only)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds any one wait may take")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "memory-latest.json",
                        help="where the raw results and medians go (JSON)")
    args = parser.parse_args()
    backends = args.backend.split(",")
    if unknown := set(backends) - set(BACKENDS):
        parser.error(f"unknown backends {sorted(unknown)} (choose from {','.join(BACKENDS)})")
    if min(args.repeat, args.steps) < 1 or not 0 < args.warm < args.steps:
        parser.error("--repeat and --steps take numbers from 1, --warm from 1 to --steps - 1")

    def terminated(*_):  # a SIGTERM ends the run through the finally blocks, like a Ctrl-C
        progress("memory.py: SIGTERM, cleaning up")
        sys.exit(143)
    signal.signal(signal.SIGTERM, terminated)

    import torch

    import jupyter_scale

    versions = {}
    for name in ("ipyparallel", "distributed"):
        with contextlib.suppress(ImportError):
            versions[name] = __import__(name).__version__
    commit = subprocess.run(["git", "-C", str(HERE.parent), "describe", "--always", "--dirty"],
                            capture_output=True, text=True, timeout=15).stdout.strip() or None
    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "host": socket.gethostname(),
            "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__, **versions,
            "jupyter_scale": getattr(jupyter_scale, "__version__", None), "commit": commit, "page_bytes": PAGE,
            "loadavg_start": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"{socket.gethostname()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch "
          f"{torch.__version__}; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    started = time.monotonic()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    trees = ["torchrun", *backends]
    raw: dict[str, list[dict]] = {t: [] for t in trees}
    refs: dict[str, list[dict]] = {name: [] for name in REFERENCES}
    for i in range(args.repeat):
        for tree in (trees if i % 2 == 0 else trees[::-1]):
            load = os.getloadavg()[0]
            t0 = time.monotonic()
            try:
                r = run_torchrun(args) if tree == "torchrun" else run_kernel(tree, args)
            except Exception as exc:  # the other runs still go; the failure is kept in the results
                traceback.print_exc()
                r = {"error": f"{type(exc).__name__}: {str(exc)[:4000]}"}
                progress(f"round {i + 1} {tree}: FAILED")
            else:
                t = r["tree"]["total"]
                progress(f"round {i + 1} {tree}: {t['count']} processes, PSS {t['pss']:.0f} MiB, USS {t['uss']:.0f}, "
                         f"distinct pages {fmt(t['distinct'], 0)}" + (
                             f"; kernel PSS {r['kernel_after']['total']['pss']:.0f}" if "kernel_after" in r else ""))
            r.update(load=load, round=i + 1, seconds=round(time.monotonic() - t0, 1))
            raw[tree].append(r)
        for name, code in REFERENCES.items():
            try:
                refs[name].append(run_reference(name, code, args.timeout))
            except Exception as exc:
                traceback.print_exc()
                refs[name].append({"error": f"{type(exc).__name__}: {exc}"})

    # Nothing this script started may be left.
    leaked = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, leaked = psutil.wait_procs(leaked, timeout=15)
    meta["leaked"] = stop(leaked, "still running at the end")

    summaries = {tree: summarize(rounds) for tree, rounds in raw.items()}
    base = summaries.get("torchrun", {})
    for tree, s in summaries.items():
        if s:
            print_tree(tree, s, base, args.repeat)
    references = {name: {k: median(r[k] for r in rs if "error" not in r) for k in ("pss", "uss", "rss", "threads",
                                                                                  "pss_anon")}
                  for name, rs in refs.items() if any("error" not in r for r in rs)}
    ratios = print_summary(summaries, references, args.repeat)
    if meta["leaked"]:
        print(f"\nLEFT RUNNING at the end (killed): {meta['leaked']}")
    else:
        print("\nNothing left running: every kernel, torchrun and every process they started is gone.")
    failed = {tree: sum("error" in r for r in rounds) for tree, rounds in raw.items() if any("error" in r for r in rounds)}
    failed.update({name: sum("error" in r for r in rs) for name, rs in refs.items() if any("error" in r for r in rs)})
    if meta["leaked"]:
        failed["leaked processes"] = len(meta["leaked"])
    save_results(args.out, meta, started, failed, titles=TITLES, raw=raw, median=summaries,
                 ratio_to_torchrun=ratios, references={"raw": refs, "median": references})


if __name__ == "__main__":
    main()
