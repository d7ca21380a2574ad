"""%%distribute across hosts against torchrun on the same hosts.

    python benchmarks/multihost.py [--repeat 3] [--steps 300] [--warm 30]
                                   [--tools torchrun,ipyparallel,dask]
                                   [--out benchmarks/results/multihost-latest.json]

Three network-namespace hosts on this machine (tests/hosts.py: own address, host name, PID
namespace, /tmp and /dev/shm, linked by a bridge): host 0 is the head (ipcontroller or the
Dask scheduler), hosts 1 and 2 run 2 ranks each (4 in all). compare.py's loop (MLP
256-512-512-10, batch 64 per rank, the dataset sized for 4 ranks) under

  torchrun     the baseline: `torchrun --nnodes 2 --nproc-per-node 2` in hosts 1 and 2, c10d
               rendezvous at host 1, gloo on eth0, one thread per rank; cold start from
               launching both torchruns to rank 0's first finished step;
  ipyparallel  a notebook (a fresh kernel, through nbclient) `%scale connect`s to an ipcontroller
               + 2 x 2 ipengines already running in the hosts, then runs the loop in
               `%%distribute --workers 4`; cold start from the start of the connect cell;
  dask         the same against a `dask scheduler` + `dask worker --nworkers 2` per host, TLS.

Each round starts the clusters afresh (before the notebook: their start is not timed, as a
user's cluster already runs) and stops them after; the tools' order alternates per round.
Also reported: the connect cell's own duration. Medians, ratios to torchrun, and the
min-max across rounds (the noise). Writes every raw result to `--out`. Not a test: nothing
asserts on time. Needs root (namespaces); waits for another process's test hosts to close.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import hosts  # noqa: E402  tests/hosts.py
from compare import (  # noqa: E402  benchmarks/, the script's own folder
    bench_record,
    cell_started,
    distribute_cells,
    median,
    print_table,
    progress,
    ratio,
    run_cells,
    save_results,
    spread,
    torchrun_script,
    training_result,
)

TOOLS = {  # name -> how the table calls it
    "torchrun": "torchrun --nnodes 2",
    "ipyparallel": "`%%distribute`, connected ipyparallel",
    "dask": "`%%distribute`, connected Dask (TLS)",
}
PER_HOST = 2
RANKS = 2 * PER_HOST


def _cell_seconds(nb, index: int) -> float:
    """How long cell `index` ran in the kernel (execute_input to execute_reply)."""
    timing = nb.cells[index].metadata["execution"]
    parse = lambda s: datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()  # noqa: E731
    return parse(timing["shell.execute_reply"]) - parse(timing["iopub.execute_input"])


def _leftovers(net: hosts.Hosts, what: str) -> list[str]:
    """Stop whatever still runs in the hosts after a tool's run (nothing should); say what it was."""
    found = []
    for host in net:
        for p in host.processes():
            try:
                found.append(f"{host.name}: pid {p.pid} {' '.join(p.cmdline())[:160]}")
            except Exception:
                found.append(f"{host.name}: pid {p.pid}")
        host.stop_processes()
    if found:
        progress(f"multihost.py: left running in the hosts after {what} (stopped now):\n  " + "\n  ".join(found))
    return found


def run_torchrun_hosts(net: hosts.Hosts, script: Path, logs: Path, timeout: float) -> dict:
    """torchrun --nnodes 2 --nproc-per-node 2 in hosts 1 and 2; rank 0's BENCH line as a result."""
    nodes = [net[1], net[2]]
    port = random.randint(20000, 29999)
    rdzv_id = uuid.uuid4().hex[:12]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    paths = [logs / f"torchrun-{rdzv_id}-{h.name}.log" for h in nodes]
    procs: list[subprocess.Popen] = []
    t0 = time.time()
    try:
        for rank, (host, log) in enumerate(zip(nodes, paths)):
            procs.append(host.popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(PER_HOST),
                 "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes[0].address}:{port}",
                 "--rdzv-id", rdzv_id,
                 # The hosts' names resolve nowhere: torchrun's guess whether it hosts the rendezvous
                 # store (getaddrinfo of its own host name) fails, and the address it gives its
                 # ranks to meet at (MASTER_ADDR) would be that name. As on such a cluster, say both.
                 "--rdzv-conf", f"is_host={int(rank == 0)}", "--local-addr", host.address,
                 str(script)], env=env, log=str(log)))
        # Until both end; one that fails ends the run (the other would wait for it up to its
        # rendezvous timeout).
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchrun did not end within {timeout:.0f} s\n" + _tails(paths))
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # its ranks: _leftovers stops what is left in the hosts
                p.wait(10)
    codes = [p.returncode for p in procs]  # a torchrun killed above: -9
    if any(codes):
        raise RuntimeError(f"torchrun exit codes {codes}\n" + _tails(paths))
    text = "".join(path.read_text(errors="replace") for path in paths)
    try:
        record = bench_record(text)
    except RuntimeError:
        raise RuntimeError("no single BENCH line from rank 0\n" + _tails(paths)) from None
    return training_result(record, t0)


def _tails(paths: list[Path], lines: int = 30) -> str:
    out = []
    for path in paths:
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as e:
            text = [f"({e})"]
        out.append(f"--- {path}\n" + "\n".join(text))
    return "\n".join(out)


def connect_line(engine: str, cluster) -> str:
    if engine == "ipyparallel":
        return f"%scale connect {cluster.client_file}"
    tls = cluster.tls
    return (f"%scale connect {cluster.address} --tls-ca-file {tls['ca_file']} --tls-cert {tls['cert']} "
            f"--tls-key {tls['key']}")


def run_notebook_hosts(net: hosts.Hosts, engine: str, steps: int, warm: int, directory: Path,
                       cluster_timeout: float, cell_timeout: float) -> dict:
    """A fresh cluster of 2 x 2 workers in hosts 1, 2 (head: host 0); a notebook connects and trains."""
    start = hosts.start_ipcluster if engine == "ipyparallel" else hosts.start_dask_cluster
    cluster = start(net[0], [net[1], net[2]], PER_HOST, str(directory), timeout=cluster_timeout)
    try:
        data_cell, train_cell = distribute_cells(steps, warm, "", workers=RANKS)
        try:
            nb, text = run_cells([data_cell, connect_line(engine, cluster), train_cell], timeout=cell_timeout)
        except Exception as exc:
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n" + _tails(cluster.logs, 15)) from None
    finally:
        cluster.stop()
    result = training_result(bench_record(text), cell_started(nb, 1))
    result["connect"] = _cell_seconds(nb, 1)
    result["train_cell"] = _cell_seconds(nb, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="rounds (the tools' order alternates), medians over them")
    parser.add_argument("--steps", type=int, default=300, help="training steps per rank")
    parser.add_argument("--warm", type=int, default=30, help="warm-up steps before steady-state timing")
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"any of {','.join(TOOLS)}")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run (torchrun, a notebook cell) may take")
    parser.add_argument("--hosts-wait", type=float, default=1800,
                        help="seconds to wait for another process's test hosts to close")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "multihost-latest.json",
                        help="where the raw results and medians go (JSON)")
    args = parser.parse_args()
    tools = args.tools.split(",")
    if unknown := set(tools) - set(TOOLS):
        parser.error(f"unknown tools {sorted(unknown)} (choose from {','.join(TOOLS)})")
    if reason := hosts.unavailable_reason():
        sys.exit(f"multihost.py: {reason}")
    # A SIGTERM ends the run through the finally blocks (clusters, kernel, hosts) like a Ctrl-C.
    def terminated(*_):
        progress("multihost.py: SIGTERM, cleaning up")
        sys.exit(143)
    signal.signal(signal.SIGTERM, terminated)

    import distributed
    import ipyparallel
    import torch

    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "host": socket.gethostname(),
            "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "ipyparallel": ipyparallel.__version__, "distributed": distributed.__version__,
            "loadavg_start": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"{socket.gethostname()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch "
          f"{torch.__version__}, ipyparallel {ipyparallel.__version__}, distributed {distributed.__version__}; "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    started = time.monotonic()
    raw: dict[str, list[dict]] = {t: [] for t in tools}
    leftovers: list[str] = []
    with hosts.Hosts(3, wait=args.hosts_wait) as net:
        shared = Path(net.directory)
        script = shared / "train.py"  # the hosts' /tmp is their own: the script lives in the shared directory
        script.write_text(torchrun_script(args.steps, args.warm, ranks=RANKS))
        logs = shared / "logs"
        logs.mkdir(exist_ok=True)
        runs = {
            "torchrun": lambda i: run_torchrun_hosts(net, script, logs, args.timeout),
            "ipyparallel": lambda i: run_notebook_hosts(net, "ipyparallel", args.steps, args.warm,
                                                        shared / f"ipp-{i}", 120, args.timeout),
            "dask": lambda i: run_notebook_hosts(net, "dask", args.steps, args.warm, shared / f"dask-{i}",
                                                 120, args.timeout),
        }
        for i in range(args.repeat):
            for tool in (tools if i % 2 == 0 else tools[::-1]):
                load = os.getloadavg()[0]  # the machine is shared: how busy it was as this run began
                try:
                    r = runs[tool](i)
                except Exception as exc:  # the other runs still go; the failure is kept in the results
                    traceback.print_exc()
                    r = {"error": f"{type(exc).__name__}: {str(exc)[:4000]}"}
                    progress(f"round {i + 1} {tool}: FAILED")
                else:
                    extra = f", connect cell {r['connect']:.2f} s" if "connect" in r else ""
                    progress(f"round {i + 1} {tool}: cold {r['cold']:.2f} s, {r['rate']:.1f} steps/s{extra}")
                r["load"] = load
                r["round"], r["order"] = i + 1, (tools if i % 2 == 0 else tools[::-1]).index(tool) + 1
                raw[tool].append(r)
                leftovers += _leftovers(net, f"{tool} in round {i + 1}")

    keys = ("cold", "rate", "maxrss_mib", "connect", "train_cell")
    ok = {t: [r for r in raw[t] if "error" not in r] for t in tools}
    medians = {t: {k: median(r.get(k) for r in ok[t]) for k in keys} for t in tools}
    ranges = {t: {k: [min(v), max(v)] if (v := [r[k] for r in ok[t] if r.get(k) is not None]) else None
                  for k in keys} for t in tools}
    base = medians.get("torchrun", {})
    ratios = {t: {k: ratio(medians[t][k], base.get(k)) for k in ("cold", "rate", "maxrss_mib")} for t in tools}
    print_table(f"across hosts: 2 hosts x 2 ranks, {args.repeat} rounds, {args.steps} steps, steady state after "
                f"{args.warm}; medians, min-max across rounds",
                ["tool", "cold start (s)", "x torchrun", "min-max", "steps/s", "x torchrun", "min-max",
                 "connect cell (s)", "peak RSS rank 0 (MiB)"],
                [[TOOLS[t], medians[t]["cold"], ratios[t]["cold"], spread(r["cold"] for r in ok[t]),
                  medians[t]["rate"], ratios[t]["rate"], spread(r["rate"] for r in ok[t]),
                  medians[t]["connect"], medians[t]["maxrss_mib"]] for t in tools],
                [0, 2, 2, 0, 1, 2, 0, 2, 0])
    failed = {t: len(raw[t]) - len(ok[t]) for t in tools if len(raw[t]) != len(ok[t])}
    save_results(args.out, meta, started, failed, labels={t: TOOLS[t] for t in tools}, raw=raw, median=medians,
                 min_max=ranges, ratio_to_torchrun=ratios, left_in_hosts=leftovers)


if __name__ == "__main__":
    main()
