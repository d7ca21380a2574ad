"""Core-path numbers of %%distribute, each against a baseline measured in the same run.

    python benchmarks/core.py [--backend ipyparallel|dask|ray] [--workers 2] [--repeat 20]

- cold start: Session.start + the first trivial cell, vs a hand-rolled cluster of the same
  engine started with the same options + one trivial call per worker.
- warm trivial-cell latency: median Session.run("x = 1") vs a bare call of a no-op on
  every worker of the same cluster (ipyparallel: a broadcast apply, what a hand-rolled
  `%%px` round trip costs; Dask: one pinned submit per worker, gathered; Ray: a bare actor
  per worker in the session's Ray, called and gathered with ray.get, and for the cold start
  a local `ray.init` with those actors).
- shipping: a cell reading a changed 100 MB tensor, vs a bare call carrying the same
  100 MB through the engine's own transport; and the same cell with the tensor unchanged
  (not re-sent) vs the bare no-op call.

Not a test: no assertions on time. Prints a table of medians and ratios.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import ipyparallel as ipp
import torch

from jupyter_scale.backends.dask_cluster import workers_of
from jupyter_scale.backends.ipyparallel_cluster import HEARTBEAT_MS
from jupyter_scale.session import Session


def _noop():
    return None


def _nbytes(buffer):
    return len(buffer)


def cold_start_baseline(n: int) -> float:
    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=n, controller_ip="127.0.0.1", controller_location="127.0.0.1",
                          controller_args=[f"--ping={HEARTBEAT_MS}", "--nodb"],
                          log=logging.getLogger("baseline"))
    client = cluster.start_and_connect_sync(activate=False)
    client.wait_for_engines(n, timeout=120)
    client.broadcast_view().apply_sync(_noop)
    elapsed = time.perf_counter() - t0
    client.close()
    cluster.stop_cluster_sync()
    return elapsed


class _IPyParallelBaseline:
    """Hand-rolled use of the session's own ipyparallel cluster."""

    cold_start = staticmethod(cold_start_baseline)

    def __init__(self, session: Session):
        client = session.backend._client
        self._view = client.broadcast_view(targets=session.backend._engine_ids)

    def noop(self) -> None:
        self._view.apply_sync(_noop)

    def carry(self, raw) -> None:
        self._view.apply_sync(_nbytes, raw)


class _DaskBaseline:
    """Hand-rolled use of the session's own Dask cluster: pinned submits, gathered."""

    @staticmethod
    def cold_start(n: int) -> float:
        from distributed import Client, LocalCluster

        t0 = time.perf_counter()
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1",
                               dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR)
        client = Client(cluster, set_as_default=False, direct_to_workers=True)
        client.wait_for_workers(n)
        addresses = list(workers_of(client))
        client.gather([client.submit(_noop, workers=[a], pure=False) for a in addresses])
        elapsed = time.perf_counter() - t0
        client.close()
        cluster.close()
        return elapsed

    def __init__(self, session: Session):
        self._client = session.backend.client
        self._addresses = list(session.backend._addresses)

    def noop(self) -> None:
        self._client.gather([self._client.submit(_noop, workers=[a], pure=False) for a in self._addresses])

    def carry(self, raw) -> None:
        # As a user would: scatter once, every worker's task reads it (fetched worker to worker).
        data = self._client.scatter(raw.obj, workers=[self._addresses[0]], hash=False)  # the array
        self._client.gather([self._client.submit(_nbytes, data, workers=[a], pure=False)
                             for a in self._addresses])
        data.release()


class _Bare:
    """A hand-rolled Ray actor: what a user would write to run a function on each worker."""

    def noop(self):
        return None

    def nbytes(self, buffer):
        return len(buffer)


class _RayBaseline:
    """Hand-rolled use of Ray: one bare actor per worker, called and gathered with ray.get."""

    @staticmethod
    def cold_start(n: int) -> float:
        import ray

        t0 = time.perf_counter()
        ray.init(address="local", num_cpus=max(n, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False, logging_level=logging.ERROR)
        actors = [ray.remote(_Bare).remote() for _ in range(n)]
        ray.get([a.noop.remote() for a in actors])
        elapsed = time.perf_counter() - t0
        ray.shutdown()
        return elapsed

    def __init__(self, session: Session):
        import ray

        self._ray = ray
        # In the session's own Ray, beside its ranks' actors: CPUs of their own.
        self._actors = [ray.remote(num_cpus=0)(_Bare).remote() for _ in range(session.size)]

    def noop(self) -> None:
        self._ray.get([a.noop.remote() for a in self._actors])

    def carry(self, raw) -> None:
        # As a user would: put once, every actor reads it from the object store.
        ref = self._ray.put(raw.obj)
        self._ray.get([a.nbytes.remote(ref) for a in self._actors])


BASELINES = {"ipyparallel": _IPyParallelBaseline, "dask": _DaskBaseline, "ray": _RayBaseline}


def cold_start_session(n: int, backend: str) -> float:
    session = Session(namespace={}, backend_name=backend)
    t0 = time.perf_counter()
    session.start(n)
    session.run("x = 1")
    elapsed = time.perf_counter() - t0
    session.stop()
    return elapsed


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(BASELINES), default="ipyparallel")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    n, repeat, engine = args.workers, args.repeat, BASELINES[args.backend]

    rows = []
    # Interleave the two cold starts so drift on a shared machine hits both alike.
    base, ours = [], []
    for _ in range(3):
        base.append(engine.cold_start(n))
        ours.append(cold_start_session(n, args.backend))
    rows.append(("cold start to first finished cell (s)", statistics.median(ours), statistics.median(base)))

    namespace: dict = {}
    session = Session(namespace=namespace, backend_name=args.backend)
    session.start(n)
    try:
        baseline = engine(session)
        session.run("x = 1")
        ours = median_time(lambda: session.run("x = 1"), repeat)
        base = median_time(baseline.noop, repeat)
        rows.append(("warm trivial cell (ms)", ours * 1e3, base * 1e3))

        size = 100 * 2**20
        namespace["t"] = torch.zeros(size // 4)
        session.run("y = t.numel()")  # sent once

        def changed():
            namespace["t"].add_(1)  # in place: the version counter says "send again"
            record = session.run("y = t.numel()")
            assert record.shipped.get("t", 0) >= size

        def unchanged():
            record = session.run("y = t.numel()")
            assert "t" in record.skipped

        raw = memoryview(namespace["t"].numpy()).cast("B")
        t_changed = median_time(changed, max(5, repeat // 4))
        t_raw = median_time(lambda: baseline.carry(raw), max(5, repeat // 4))
        t_unchanged = median_time(unchanged, repeat)
        rows.append(("cell reading a changed 100 MB tensor (ms)", t_changed * 1e3, t_raw * 1e3))
        rows.append(("cell reading an unchanged 100 MB tensor (ms)", t_unchanged * 1e3, base * 1e3))
        throughput = size / t_changed / 1e9
    finally:
        session.stop()

    print(f"{'metric':45s} {'jupyter_scale':>14s} {'baseline':>10s} {'ratio':>7s}")
    for name, ours, base in rows:
        print(f"{name:45s} {ours:14.2f} {base:10.2f} {ours / base:7.2f}")
    print(f"shipping: 100 MB to {n} workers in one cell = {throughput:.2f} GB/s per worker")
    print(f"engine {args.backend}; baselines: a hand-rolled cluster start + one call per worker; "
          "a bare no-op call on every worker; a bare call carrying the same 100 MB buffer")


if __name__ == "__main__":
    main()
