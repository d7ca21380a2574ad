"""Automatic mode's steady-state steps/s against explicit DDP on the same loop.

    python benchmarks/auto_vs_ddp.py [--backend ipyparallel|dask] [--model mlp|wide] [--repeat 3]
                                     [--steps 300] [--warmup 30]

The same model, data and batch (64 per rank) on 2 workers: as the README's loop in
automatic mode (gradients averaged during backward, the default), the same with
`average_during_backward = False` (averaged at each optimizer step), and with --manual and
jupyter_scale.wrap/shard (DDP). Runs alternate, each times its own steady state (after a
warm-up) inside the cell; medians, and per round each mode's rate over DDP's in that round
(paired: a noisy minute slows both), are printed.

`--model mlp` is a small MLP (256-512-512-10) whose step is mostly Python; `--model wide`
is 12 Linear(2048, 2048) layers with ReLUs (50.4M parameters), where communication is a
large part of a step and DDP's overlap of it with backward shows (use e.g. --steps 10
--warmup 3: a step takes about a second here). Not a test: nothing asserts on time.
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


MODES = (("automatic", AUTO, False, True), ("automatic, at step", AUTO, False, False),
         ("explicit DDP", DDP, True, True))


def build(kind: str) -> tuple[nn.Module, TensorDataset]:
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        return model, TensorDataset(torch.randn(32768, 256), torch.randint(0, 10, (32768,)))
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    return nn.Sequential(*layers[:-1]), TensorDataset(torch.randn(4096, 2048), torch.randint(0, 2048, (4096,)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backend", choices=["ipyparallel", "dask"], default="ipyparallel")
    parser.add_argument("--model", choices=["mlp", "wide"], default="mlp")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()

    torch.manual_seed(0)
    _, data = build(args.model)
    ns = {
        "torch": torch, "nn": nn, "DataLoader": torch.utils.data.DataLoader,
        "jupyter_scale": __import__("jupyter_scale"), "WARMUP": args.warmup, "STEPS": args.steps, "data": data,
    }
    session = Session(namespace=ns, backend_name=args.backend)
    session.start(2)
    results: dict[str, list[float]] = {name: [] for name, *_ in MODES}
    try:
        for _ in range(args.repeat):
            for name, code, manual, during_backward in MODES:
                torch.manual_seed(0)
                ns["model"], _ = build(args.model)
                session.average_during_backward = during_backward
                session.run(code, manual=manual)
                results[name].append(statistics.mean(session.gather("steps_per_s")))
    finally:
        session.stop()
    ddp = results["explicit DDP"]
    print(f"{args.model} model, {args.backend}, {args.repeat} rounds of {args.steps} steps after {args.warmup}")
    print(f"{'mode':20s} {'steps/s (median)':>17s} {'x DDP (median of rounds)':>25s}  runs")
    for name, values in results.items():
        paired = statistics.median(v / d for v, d in zip(values, ddp))
        print(f"{name:20s} {statistics.median(values):17.2f} {paired:25.3f}  {[round(v, 2) for v in values]}")


if __name__ == "__main__":
    main()
