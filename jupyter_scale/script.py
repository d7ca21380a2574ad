"""A %%distribute cell's semantics in a plain script, for the jobs `%scale export` writes.

    job = jupyter_scale.script.start(seed=1234)    # the process group from torchrun's variables
    ...                                             # the notebook's code the cell needs
    values = job.load("values.pt")                  # the notebook's values, saved at export
    rank, world_size, local_rank, device, report = job.cell()
    ...                                             # the cell's code, unchanged
    job.finish(model=model)                         # rank 0 saves the models' weights

What the workers do around a cell, done once around the script: the process group (gloo
on CPU, NCCL when every process has a GPU), automatic mode (the same seed on every rank,
DataLoaders sharded, gradients averaged at each optimizer step) unless `automatic=False`,
`report()` written as JSON lines, and rank 0's weights saved at the end. Without torchrun
(`python train.py`) the script runs as one process, as the cell runs without %%distribute.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import rendezvous, torchrun, training
from .metrics import Recorder

# How often rank 0 prints the last reported values (every point goes to the JSON lines).
PRINT_INTERVAL_S = 2.0


class _JsonLines:
    """report()'s points, one JSON object a line, in this rank's file; rank 0 also prints
    the latest now and then, for the job's log."""

    def __init__(self, path: Path, echo: bool):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w", buffering=1)  # a line at a time: a killed job keeps its points
        self._echo = echo
        self._last: dict | None = None
        self._printed = 0.0

    def emit(self, point: dict) -> None:
        self._file.write(json.dumps(point) + "\n")
        self._last = point
        if self._echo and point["time"] - self._printed >= PRINT_INTERVAL_S:
            self.print_last()

    def print_last(self) -> None:
        if self._last is not None and self._echo:
            self._printed = self._last["time"]
            values = " ".join(f"{k}={v:.6g}" for k, v in self._last.items() if k not in ("rank", "time", "step"))
            print(f"[step {self._last['step']}] {values}", flush=True)
            self._last = None

    def close(self) -> None:
        self.print_last()
        self._file.close()


class Job:
    """One process of an exported job: see the module's docstring."""

    def __init__(self, seed: int, automatic: bool, output: Path, directory: Path):
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.output, self.directory = output, directory
        cuda_count = torch.cuda.device_count()
        backend = rendezvous.select_backend([cuda_count])
        self.device = rendezvous.select_device(backend, self.local_rank, cuda_count)
        if self.device.type == "cpu":
            os.environ.setdefault("ACCELERATE_USE_CPU", "True")  # as on the workers (worker.join_group)
        if self.world_size > 1 or "RANK" in os.environ:
            if "MASTER_ADDR" in os.environ:
                rendezvous.set_gloo_interface(os.environ["MASTER_ADDR"])
            if backend == "nccl":
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend)
        self._sink = _JsonLines(output / f"metrics-rank{self.rank}.jsonl", echo=self.rank == 0)
        self._recorder = Recorder(rank=self.rank, sink=self._sink)  # type: ignore[arg-type]
        # As %%distribute: automatic mode where there is more than one rank. Entered (and every
        # rank seeded) before the notebook's code runs: what it makes is made alike on every
        # rank, and a DataLoader it builds is sharded as one built in the cell.
        self.seed = seed
        self._mode = training.AutoMode(seed) if automatic and self.world_size > 1 else None
        if self._mode is not None:
            self._mode.__enter__()
        self.started = time.time()

    def cell(self) -> tuple[int, int, int, torch.device, Any]:
        """The cell begins: the seed again (as %%distribute seeds right before the cell), and
        the names it sees: rank, world_size, local_rank, device, report."""
        if self._mode is not None:
            training.seed_everything(self.seed)
        return self.names()

    def names(self) -> tuple[int, int, int, torch.device, Any]:
        """rank, world_size, local_rank, device, report: the names a cell sees."""
        return self.rank, self.world_size, self.local_rank, self.device, self._recorder.report

    def report(self, step: int | None = None, epoch: int | None = None, **scalars: Any) -> None:
        self._recorder.report(step=step, epoch=epoch, **scalars)

    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        """The notebook's values saved at export (`path`: beside the script unless absolute),
        by name. A DataLoader among them is sharded as one sent to %%distribute's workers."""
        # GPU tensors go to this rank's GPU, as the workers receive them; CPU ones stay.
        def place(storage, location: str):
            if not location.startswith("cuda"):
                return storage
            return storage.cuda(self.device.index) if self.device.type == "cuda" else storage.cpu()

        values = torch.load(self.directory / path, weights_only=False, map_location=place)
        if self._mode is not None:
            values = {name: self._mode.shard_shipped(value) for name, value in values.items()}
        return values

    def finish(self, **models: torch.nn.Module) -> None:
        """The end of the cell: rank 0 saves each model's weights as OUTPUT/NAME.pt (a state
        dict, what %%distribute copies into the notebook's model), then the group ends."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._sink.close()
        if self.rank == 0:
            self.output.mkdir(parents=True, exist_ok=True)
            for name, model in models.items():
                module = model.module if isinstance(model, DistributedDataParallel) else model
                torch.save(module.state_dict(), self.output / f"{name}.pt")
            saved = ", ".join(f"{self.output / name}.pt" for name in models)
            print(f"jupyter_scale: finished in {time.time() - self.started:.1f} s" +
                  (f"; saved {saved}" if saved else ""), flush=True)
        if dist.is_initialized():
            dist.barrier()  # no rank leaves while rank 0 writes: torchrun ends the job when one fails
            rendezvous.destroy_group()


def start(seed: int = 0, automatic: bool = True, output: str | os.PathLike | None = None) -> Job:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...) and
    enter automatic mode. `output`: where metrics and weights go (default
    $JUPYTER_SCALE_OUTPUT, else `output` beside the script)."""
    directory = Path(sys.argv[0]).resolve().parent if sys.argv and sys.argv[0] else Path.cwd()
    if output is None:
        output = os.environ.get("JUPYTER_SCALE_OUTPUT") or directory / "output"
    return Job(seed, automatic, Path(output), directory)


# A cell written for torchrun calls init_process_group itself: the group is up already, as
# in a %%distribute cell, so that call does nothing. Before the script imports it by name.
torchrun.keep_process_group()
