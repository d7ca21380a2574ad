"""Run an exported train.py on the workers of a Ray cluster, as torchrun would run it.

    python -m jupyter_scale.ray_job --workers 4 /job/train.py [arguments for train.py]

The entrypoint of the KubeRay RayJob that `%scale export` writes; it runs against any Ray
cluster (the address in RAY_ADDRESS, which Ray's job supervisor sets for an entrypoint, else a
local Ray). Each rank is an actor in one placement group (its CPUs and GPUs reserved); each
starts `python train.py` in the script's directory, on its node, with torchrun's variables:
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and MASTER_ADDR and MASTER_PORT at rank 0's
node, by address (host names need not resolve between pods). Each rank's output is printed
with its rank. The first rank that fails ends the others, and the job exits with its status.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import psutil
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from . import processes, rendezvous

STOP_GRACE_S = 10.0



class _Rank:
    """One rank: runs the script in a process of its own (`python train.py`, as torchrun would)
    and answers with its exit status. The script ends with its actor (a job stopped, a node
    lost) rather than outliving it: the actor's watcher (processes.watch) ends it."""

    def __init__(self, rank: int):
        self.rank = rank
        self._process: subprocess.Popen | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def where(self) -> tuple[str, str]:
        """(this node's id, its address)."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A free port at this node's address, for rank 0's store."""
        return rendezvous.free_port(ray.util.get_node_ip_address())

    def run(self, script: str, arguments: list[str], env: dict[str, str]) -> int:
        with self._lock:  # stop() either comes first, or sees the process
            if self._stopped.is_set():
                return -signal.SIGTERM
            self._process = subprocess.Popen(
                [sys.executable, script, *arguments], cwd=os.path.dirname(script) or ".",
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True)
            watch = processes.watch()
            watch.add_processes([self._process.pid])
        assert self._process.stdout is not None
        try:
            for line in self._process.stdout:
                print(f"[rank {self.rank}] {line}", end="", flush=True)
            return self._process.wait()
        finally:
            watch.close()

    def stop(self) -> None:
        """End the script and what it started: SIGTERM, then SIGKILL after a grace period."""
        with self._lock:
            self._stopped.set()
            process = self._process
        if process is None or process.poll() is not None:
            return
        try:
            script = psutil.Process(process.pid)
        except psutil.Error:  # ended meanwhile
            return
        # Not reaped here: run() reads the script's status from its Popen.
        processes.end([script, *processes.descendants([script])], grace=STOP_GRACE_S, reap=False)
        process.wait()


def torchrun_env(rank: int, nodes: list[str], master: tuple[str, int], threads: int = 1) -> dict[str, str]:
    """torchrun's variables for `rank`, given each rank's node (in rank order); a thread per
    CPU the rank holds."""
    same_node = [r for r, node in enumerate(nodes) if node == nodes[rank]]
    return {"RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "LOCAL_RANK": str(same_node.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(same_node)), "GROUP_RANK": str(sorted(set(nodes), key=nodes.index).index(
                nodes[rank])), "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}


def run(script: str, arguments: list[str], workers: int, cpus: float, gpus: float, strategy: str,
        timeout: float) -> int:
    """Run `script` on `workers` Ray actors; returns the job's exit status."""
    script = os.path.abspath(script)
    group = placement_group([{"CPU": cpus, **({"GPU": gpus} if gpus else {})}] * workers, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        print(f"jupyter_scale.ray_job: the cluster did not offer {workers} workers of {cpus:g} CPU"
              f"{f' and {gpus:g} GPU' if gpus else ''} within {timeout:.0f} s", file=sys.stderr)
        return 1
    remote: Any = ray.remote(_Rank)
    ranks = [remote.options(num_cpus=cpus, num_gpus=gpus, max_concurrency=2, max_restarts=0,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote(i)
             for i in range(workers)]
    where = ray.get([r.where.remote() for r in ranks])
    master = (where[0][1], ray.get(ranks[0].free_port.remote()))
    nodes = [node for node, _ in where]
    print(f"jupyter_scale.ray_job: {workers} ranks on {len(set(nodes))} node(s), rank 0 at {master[0]}:{master[1]}",
          flush=True)
    threads = max(1, int(cpus))
    runs = {r.run.remote(script, arguments, torchrun_env(i, nodes, master, threads)): i for i, r in enumerate(ranks)}
    status = 0
    pending = list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            code = ray.get(done[0])
        except ray.exceptions.RayError as exc:  # the actor itself died
            code = 1
            print(f"jupyter_scale.ray_job: rank {runs[done[0]]} was lost: {exc}", file=sys.stderr, flush=True)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            print(f"jupyter_scale.ray_job: rank {runs[done[0]]} exited with status {code}; stopping the others",
                  file=sys.stderr, flush=True)
            for stopped in [r.stop.remote() for r in ranks]:
                try:
                    ray.get(stopped)
                except ray.exceptions.RayError:  # that rank's actor is gone already
                    pass
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jupyter_scale.ray_job", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, required=True, help="ranks in all")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--gpus-per-worker", type=float, default=0.0)
    parser.add_argument("--strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                        help="how the ranks are placed on the nodes (Ray's placement group strategy)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the workers' resources")
    parser.add_argument("script")
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    ray.init(log_to_driver=True)
    try:
        return run(args.script, args.arguments, args.workers, args.cpus_per_worker, args.gpus_per_worker,
                   args.strategy, args.timeout)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
