"""Core-path numbers of %%distribute, each against a baseline measured in the same run.

    python benchmarks/core.py [--workers 2] [--repeat 20]

- cold start: Session.start + the first trivial cell, vs a hand-rolled ipyparallel
  cluster start + one trivial apply (same engine, same controller options).
- warm trivial-cell latency: median Session.run("x = 1") vs a bare broadcast apply of a
  no-op function on the same cluster (what a hand-rolled `%%px` round trip costs).
- shipping: a cell reading a changed 100 MB tensor, vs a bare broadcast apply carrying the
  same 100 MB (the engine's own transport); and the same cell with the tensor unchanged
  (not re-sent) vs the bare no-op apply.

Not a test: no assertions on time. Prints a table of medians and ratios.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import ipyparallel as ipp
import torch

from jupyter_scale.backends.ipyparallel import HEARTBEAT_MS
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


def cold_start_session(n: int) -> float:
    session = Session(namespace={})
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
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    n, repeat = args.workers, args.repeat

    rows = []
    # Interleave the two cold starts so drift on a shared machine hits both alike.
    base, ours = [], []
    for _ in range(3):
        base.append(cold_start_baseline(n))
        ours.append(cold_start_session(n))
    rows.append(("cold start to first finished cell (s)", statistics.median(ours), statistics.median(base)))

    namespace: dict = {}
    session = Session(namespace=namespace)
    session.start(n)
    try:
        client = session.backend._client
        view = client.broadcast_view(targets=session.backend._engine_ids)
        session.run("x = 1")
        ours = median_time(lambda: session.run("x = 1"), repeat)
        base = median_time(lambda: view.apply_sync(_noop), repeat)
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
        t_raw = median_time(lambda: view.apply_sync(_nbytes, raw), max(5, repeat // 4))
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
    print("baselines: hand-rolled ipyparallel start + apply; bare broadcast apply of a no-op; "
          "a bare broadcast apply carrying the same 100 MB buffer")


if __name__ == "__main__":
    main()
