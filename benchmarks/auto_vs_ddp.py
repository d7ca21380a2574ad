"""Automatic mode's steady-state steps/s against explicit DDP on the same loop.

    python benchmarks/auto_vs_ddp.py [--backend ipyparallel|dask] [--repeat 3] [--steps 300]

The same MLP, data and batch (64 per rank) on 2 workers: once as the README's loop in
automatic mode, once with --manual and jupyter_scale.wrap/shard (DDP). Runs alternate,
each times its own steady state (after a warm-up) inside the cell; medians and the ratio
are printed. Not a test: nothing asserts on time.
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
{setup}
opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
done, t0 = 0, None
while done < WARMUP + STEPS:
    for x, y in loader:
        if done == WARMUP:
            t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        done += 1
        if done == WARMUP + STEPS:
            break
steps_per_s = STEPS / (time.perf_counter() - t0)
"""

AUTO = LOOP.format(setup="net = model\nloader = DataLoader(data, batch_size=64, shuffle=True)")
DDP = LOOP.format(setup="net = jupyter_scale.wrap(model)\n"
                        "loader = jupyter_scale.shard(DataLoader(data, batch_size=64, shuffle=True))")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backend", choices=["ipyparallel", "dask"], default="ipyparallel")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    torch.manual_seed(0)
    ns = {
        "torch": torch, "nn": nn, "DataLoader": torch.utils.data.DataLoader,
        "jupyter_scale": __import__("jupyter_scale"), "WARMUP": 30, "STEPS": args.steps,
        "data": TensorDataset(torch.randn(32768, 256), torch.randint(0, 10, (32768,))),
    }
    session = Session(namespace=ns, backend_name=args.backend)
    session.start(2)
    results = {"automatic": [], "explicit DDP": []}
    try:
        for _ in range(args.repeat):
            for name, code, manual in (("automatic", AUTO, False), ("explicit DDP", DDP, True)):
                torch.manual_seed(0)
                ns["model"] = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                            nn.Linear(512, 10))
                session.run(code, manual=manual)
                results[name].append(statistics.mean(session.gather("steps_per_s")))
    finally:
        session.stop()
    auto, ddp = (statistics.median(results[k]) for k in ("automatic", "explicit DDP"))
    print(f"{'mode':14s} {'steps/s (median)':>17s}  runs")
    for name, values in results.items():
        print(f"{name:14s} {statistics.median(values):17.1f}  {[round(v, 1) for v in values]}")
    print(f"ratio automatic / explicit DDP: {auto / ddp:.3f}")


if __name__ == "__main__":
    main()
