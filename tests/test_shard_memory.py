"""`--shard` trains a model that does not fit in one memory-capped worker.

Every worker's data size (RLIMIT_DATA, set from here with `resource.prlimit` on the worker
processes only, never on the kernel) is capped at what it holds when the cap is set plus
3 x the model's parameter bytes P (`BUDGET_IN_P`): one whole replica and Adam's two moments, no
room left for the gradients. Trained in one process the cell needs about 4.5 P (the
model, its gradients, Adam's state and the step's temporaries) and fails with the
allocator's "can't allocate memory", naming rank 0; the worker survives it. The same
cell, unchanged, under `%%distribute --workers 4 --shard` on four workers capped alike
needs about 2 P at its peak (the model arriving whole, from the shared-memory file, and
its copy) and then P / 4 of parameters, gradients and Adam state each: it trains, its loss
goes down, and the notebook's model comes back trained.

RLIMIT_DATA rather than a memory cgroup: it fails the allocation that crosses the cap
with a message the user reads (a cgroup's OOM killer sends SIGKILL instead), and it
counts what the process maps for itself (the kernel's shared-memory file, which workers
map copy-on-write, included); not the memory file rank 0 writes the pull-back into (written,
never mapped, by the worker).

Measured here (2 cores, torch 2.13, P = 256 MB, cap +768 MB): one process needs +1163 MB
(it fails at +761 MB, making Adam's second moment); each of 4 sharded workers peaks at
+524 MB as the model arrives, and holds +352 MB while it trains. Those figures hold because a
rank that shards fixes glibc's mmap threshold: with glibc's default, a dynamic threshold that
rises to 16 MB after the first such buffer is freed, the 16 MB blocks FSDP all-gathers and
reduce-scatters at every step came from and went back into the heap, which kept them: each
sharded worker grew by about 1.7 GB in three steps (more than the one unsharded process) and
failed in reduce_scatter with "can't allocate memory" (sharding._give_back_freed_blocks).
"""

import re
import resource
import threading
import time

import psutil
import pytest

from conftest import _started_kernel, _stop_and_check, wait_gone

pytestmark = pytest.mark.cluster

WIDTH, DEPTH = 2048, 16  # 16 blocks of 2048 x 2048 float32 (+ a head): P = 256 MB
BUDGET_IN_P = 3  # the cap above each worker's own data size: one replica + Adam's two moments

NOTEBOOK = f"""
torch.manual_seed(0)
layers = []
for _ in range({DEPTH}):
    layers += [nn.Linear({WIDTH}, {WIDTH}), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear({WIDTH}, 1))
P = sum(p.numel() * p.element_size() for p in model.parameters())
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(64, {WIDTH}, generator=g), torch.randn(64, 1, generator=g)
data = TensorDataset(X, Y)
start = [p.detach().clone() for p in model.parameters()]
with torch.no_grad():
    loss_before = nn.functional.mse_loss(model(X), Y).item()
"""

# The training cell, the same in both runs. Four ranks: 16 samples each per epoch, 3 Adam
# steps; one process: 4 steps per epoch (it fails at the first).
CELL = """
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
loader = DataLoader(data, batch_size=16)
losses = []
for epoch in range(3):
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
with torch.no_grad():
    final = nn.functional.mse_loss(model(X), Y).item()
"""

OUT_OF_MEMORY = re.compile(r"can't allocate memory|Cannot allocate memory|MemoryError|out of memory", re.I)


def _data_size(pid: int) -> int:
    """VmData of `pid` in bytes: what RLIMIT_DATA counts."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmData for process {pid}")


def _worker_pids(k) -> list[int]:
    """The pids of the session's workers, checked to be local engines the kernel started."""
    pids = k.value("[w['pid'] for w in jupyter_scale.get_session().workers]")
    started = {p.pid for p in psutil.Process(k.pid).children(recursive=True)}
    assert pids and all(pid in started for pid in pids), (pids, sorted(started))
    return pids


def _cap_workers(k, budget: int) -> dict[int, int]:
    """Cap each current worker's data size at its present size plus `budget` bytes (soft and
    hard RLIMIT_DATA, set from outside with prlimit); the kernel stays uncapped. Returns
    pid -> cap. A new cluster (%scale restart) has fresh, uncapped workers: cap them again."""
    caps = {}
    for pid in _worker_pids(k):
        cap = _data_size(pid) + budget
        resource.prlimit(pid, resource.RLIMIT_DATA, (cap, cap))
        assert resource.prlimit(pid, resource.RLIMIT_DATA) == (cap, cap)
        caps[pid] = cap
    assert k.pid not in caps  # the kernel keeps the limit it started with
    assert resource.prlimit(k.pid, resource.RLIMIT_DATA) == resource.getrlimit(resource.RLIMIT_DATA)
    return caps


def _still_alive(pids, timeout: float = 30.0) -> list:
    """Those of `pids` still running after `timeout` s."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return wait_gone(processes, timeout=timeout)


class _PeakData:
    """Samples the processes' VmData every few ms, for the failure messages: how far above
    its size when capped each worker went."""

    def __init__(self, pids):
        self.start = {pid: _data_size(pid) for pid in pids}
        self.peak = dict(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.005):
            for pid in self.peak:
                try:
                    self.peak[pid] = max(self.peak[pid], _data_size(pid))
                except (OSError, AssertionError):  # gone
                    pass

    def stop(self) -> str:
        self._stop.set()
        self._thread.join(timeout=5)
        return ", ".join(f"{pid}: +{(self.peak[pid] - self.start[pid]) / 2**20:.0f} MB" for pid in self.peak)


@pytest.fixture
def k():
    """A kernel of its own (the ipyparallel engine) with the model built in the notebook;
    afterwards nothing it started may remain (the caps go with the worker processes)."""
    kernel = _started_kernel("ipyparallel")
    try:
        kernel.ok(NOTEBOOK, timeout=120)
        yield kernel
    finally:
        _stop_and_check(kernel)


def test_shard_trains_on_four_capped_workers_what_one_capped_process_cannot(k):
    P = k.value("P")
    assert 250 * 2**20 <= P <= 260 * 2**20, P
    budget = BUDGET_IN_P * P

    # One process: a single worker, capped; --shard across one rank shards nothing.
    k.ok("%scale start --workers 1", timeout=180)
    caps = _cap_workers(k, budget)
    [single] = caps
    peaks = _PeakData(caps)
    out = k.cell("%%distribute --workers 1 --shard" + CELL, timeout=300)
    grew = peaks.stop()
    assert not out.ok, f"one process trained within {BUDGET_IN_P} x P of data ({grew}): the cap is no cap"
    message = out.error_text
    assert message.startswith("RemoteError") and "rank 0 failed" in message, message
    assert OUT_OF_MEMORY.search(message), f"not an out-of-memory error:\n{message}\n{out.stderr}"
    # A failed allocation, not a crash: the worker process lives on. (It stays full of the
    # cell's model, gradients and half-made Adam state, as a local kernel would after a
    # MemoryError, so its next cell could not even re-form the process group: the four
    # workers below are new ones.) The notebook's model is as it was: nothing came back.
    assert psutil.pid_exists(single) and psutil.Process(single).status() != psutil.STATUS_ZOMBIE
    k.ok("assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start))")

    # Four workers, each capped the same, the same cell unchanged under --shard.
    k.ok("%scale restart --workers 4", timeout=180)
    assert not _still_alive([single])  # the old worker went with its cluster
    caps = _cap_workers(k, budget)
    assert len(caps) == 4 and single not in caps
    peaks = _PeakData(caps)
    started = time.monotonic()
    out = k.cell("%%distribute --workers 4 --shard" + CELL, timeout=400)
    grew = peaks.stop()
    assert out.ok, (f"the sharded cell failed on workers capped at +{budget / 2**20:.0f} MB "
                    f"(data size growth per worker: {grew}):\n{out.error_text}\n{out.stderr}")
    assert "Traceback" not in out.stderr, out.stderr
    elapsed = time.monotonic() - started
    # Still the capped workers: none died and none was replaced during the cell.
    assert sorted(_worker_pids(k)) == sorted(caps)
    for pid, cap in caps.items():
        assert resource.prlimit(pid, resource.RLIMIT_DATA) == (cap, cap)

    # The loss went down: every step's loss is each rank's batch's; their mean over the
    # ranks is the loss on all the data at that step.
    losses = k.value("jupyter_scale.get_session().gather('losses')")
    assert len(losses) == 4 and all(len(steps) == 3 for steps in losses), losses
    mean = [sum(rank[i] for rank in losses) / 4 for i in range(3)]
    assert mean[2] < mean[1] < mean[0], (mean, losses)
    # The notebook's model holds the trained weights, whole and finite: its loss on all the
    # data is what every rank computed with the sharded model after training, and lower
    # than before.
    finals = k.value("jupyter_scale.get_session().gather('final')")
    k.ok("""
assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
assert all(p.shape == q.shape and torch.isfinite(p).all() for p, q in zip(model.parameters(), start))
changed = sum(not torch.equal(p, q) for p, q in zip(model.parameters(), start))
assert changed == len(start), f"only {changed} of {len(start)} parameters changed"
with torch.no_grad():
    loss_after = nn.functional.mse_loss(model(X), Y).item()
""")
    loss_before, loss_after = k.value("(loss_before, loss_after)")
    assert all(abs(f - loss_after) <= 1e-5 * max(1.0, abs(loss_after)) for f in finals), (finals, loss_after)
    assert loss_after < loss_before, (loss_before, loss_after)
    print(f"P = {P / 2**20:.0f} MB, cap +{budget / 2**20:.0f} MB; sharded cell {elapsed:.0f} s, "
          f"data size growth per worker: {grew}; loss {loss_before:.4f} -> {loss_after:.4f}")
    k.ok("%scale stop", timeout=60)
    assert not _still_alive(caps)
