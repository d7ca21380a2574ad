"""What report() costs: steps/s with report() every step against none, and its latency.

    python benchmarks/report_overhead.py [--repeat 3] [--steps 400]

The DESIGN.md loop in automatic mode on 2 workers (MLP 256-512-512-10, batch 64 per
rank), alternating runs with and without `report(loss=loss)` every step, each timing its
own steady state inside the cell. Latency: time from report() on a worker to the event's
arrival in the kernel (same host, same clock), over every event of the runs.
Not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from jupyter_scale.session import Session

LOOP = """
import time
loader = DataLoader(data, batch_size=64, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
done, t0 = 0, None
while done < 30 + STEPS:
    for x, y in loader:
        if done == 30:
            t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        {report}
        done += 1
        if done == 30 + STEPS:
            break
steps_per_s = STEPS / (time.perf_counter() - t0)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backend", choices=["ipyparallel", "dask"], default="ipyparallel")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.manual_seed(0)
    ns = {"torch": torch, "nn": nn, "DataLoader": torch.utils.data.DataLoader, "STEPS": args.steps,
          "data": TensorDataset(torch.randn(32768, 256), torch.randint(0, 10, (32768,)))}
    session = Session(namespace=ns, backend_name=args.backend, progress_interval=3600)  # no progress lines in the timing
    session.start(2)
    results = {"report() every step": [], "no report()": []}
    latencies = []
    try:
        for _ in range(args.repeat):
            for name, report in (("no report()", "pass"), ("report() every step", "report(loss=loss)")):
                ns["model"] = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                            nn.Linear(512, 10))
                session.events and session.events.latencies.clear()
                session.run(LOOP.format(report=report))
                results[name].append(statistics.mean(session.gather("steps_per_s")))
                if report != "pass":
                    latencies.extend(session.events.latencies)
    finally:
        session.stop()
    with_report, without = (statistics.median(results[k]) for k in ("report() every step", "no report()"))
    for name, values in results.items():
        print(f"{name:22s} {statistics.median(values):8.1f} steps/s  {[round(v, 1) for v in values]}")
    print(f"overhead of report() every step: {100 * (1 - with_report / without):.2f} %")
    latencies.sort()
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    print(f"worker-to-kernel latency over {len(latencies)} events: p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
