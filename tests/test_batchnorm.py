"""jupyter_scale.sync_batchnorm: BatchNorm over the global batch on CPU/gloo.

The unit tests run a real 2-rank gloo group (two spawned processes) and compare with one
nn.BatchNorm in one process over the whole batch; the kernel tests run the README loop
with the converted model on the default engine (the layer runs in the ranks' own code).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import jupyter_scale
from jupyter_scale import rendezvous
from jupyter_scale.batchnorm import SyncBatchNorm

ATOL = 1e-5
DEADLINE = 120.0  # seconds for the spawned group, start to finish

# name -> (layer, one sample's shape without the batch dimension): every input rank BatchNorm takes.
SHAPES = {
    "2d": (lambda: nn.BatchNorm2d(3), (3, 5, 4)),
    "1d-flat": (lambda: nn.BatchNorm1d(6), (6,)),
    "1d-seq": (lambda: nn.BatchNorm1d(4, momentum=None), (4, 7)),  # cumulative average
    "3d": (lambda: nn.BatchNorm3d(2), (2, 3, 2, 4)),
}
SPLITS = [(8, 8), (5, 11), (0, 16)]  # samples on rank 0 and rank 1; a rank may have none
STEPS = 3  # forward/backward passes, so running statistics accumulate


def _layer(kind: str) -> nn.Module:
    torch.manual_seed(0)
    bn = SHAPES[kind][0]()
    with torch.no_grad():  # not the identity, so weight and bias matter
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s whole batch of 16 (mean far from zero) and the loss's weights."""
    g = torch.Generator().manual_seed(100 + step)
    shape = (16, *SHAPES[kind][1])
    return 3 + 2 * torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _train(bn: nn.Module, kind: str, rows: slice) -> list[dict]:
    """STEPS passes on rows `rows` of each batch; what each pass produced."""
    results = []
    for step in range(STEPS):
        x, g = _batch(kind, step)
        x = x[rows].clone().requires_grad_(True)
        for p in bn.parameters():
            p.grad = None
        out = bn(x)
        # A sum (not a mean) of the rank's part: the whole batch's loss is the sum of the
        # ranks' losses, whose gradients the ranks' summed weight gradients must equal.
        (out * g[rows]).sum().backward()
        results.append({"out": out.detach(), "x_grad": x.grad, "weight_grad": bn.weight.grad,
                        "bias_grad": bn.bias.grad, "running_mean": bn.running_mean.clone(),
                        "running_var": bn.running_var.clone(), "tracked": bn.num_batches_tracked.item()})
    return results


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = rendezvous.loopback_interface() or "lo"
    store = rendezvous.connect_store("127.0.0.1", port, None, timeout=60)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for kind in SHAPES:
        for split in SPLITS:
            start = 0 if rank == 0 else split[0]
            rows = slice(start, start + split[rank])
            bn = jupyter_scale.sync_batchnorm(_layer(kind))
            assert type(bn) is SyncBatchNorm
            trained = _train(bn, kind, rows)
            bn.eval()
            x, _ = _batch(kind, STEPS)
            results[kind, split] = {"train": trained, "eval": bn(x[rows]).detach()}
    # Under DDP, whose gradient allreduces run in the same backward as ours.
    model = DistributedDataParallel(jupyter_scale.sync_batchnorm(_convnet()))
    _train_convnet(model, slice(8 * rank, 8 * rank + 8))
    results["ddp"] = model.module.state_dict()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each rank of a real 2-rank gloo group computed (see `_rank_main`)."""
    out_dir = tmp_path_factory.mktemp("ranks")
    store, port = rendezvous.open_store("127.0.0.1", 2, timeout=60)  # binds port 0: no fixed port
    context = mp.start_processes(_rank_main, args=(port, str(out_dir)), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + DEADLINE
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the 2-rank group did not finish within {DEADLINE} s")
    finally:
        for p in context.processes:  # ours, by pid
            if p.is_alive():
                p.kill()
        del store
    return [torch.load(out_dir / f"rank{r}.pt") for r in (0, 1)]


def _reference(kind: str) -> tuple[list[dict], torch.Tensor]:
    """Plain nn.BatchNorm in this process over each whole batch."""
    bn = _layer(kind)
    trained = _train(bn, kind, slice(None))
    bn.eval()
    return trained, bn(_batch(kind, STEPS)[0]).detach()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"{s[0]}+{s[1]}")
@pytest.mark.parametrize("kind", SHAPES)
def test_two_ranks_equal_one_batchnorm_over_the_whole_batch(ranks, kind, split):
    expected, expected_eval = _reference(kind)
    r0, r1 = (r[kind, split] for r in ranks)
    for step, (want, a, b) in enumerate(zip(expected, r0["train"], r1["train"])):
        where = f"{kind} {split} step {step}"
        assert _close(torch.cat([a["out"], b["out"]]), want["out"]), f"output differs: {where}"
        if split[0]:  # a rank without samples has an empty gradient
            assert _close(torch.cat([a["x_grad"], b["x_grad"]]), want["x_grad"]), f"input gradient differs: {where}"
        # Summed over ranks; automatic mode averages them, which is the gradient of the mean of
        # the ranks' losses, as DDP with torch's SyncBatchNorm.
        for name in ("weight_grad", "bias_grad"):
            assert _close(a[name] + b[name], want[name]), f"{name} differs: {where}"
        for rank in (a, b):  # the global statistics on every rank, not the rank's own
            assert _close(rank["running_mean"], want["running_mean"]), f"running_mean differs: {where}"
            assert _close(rank["running_var"], want["running_var"]), f"running_var differs: {where}"
            assert rank["tracked"] == want["tracked"] == step + 1
    assert _close(torch.cat([r0["eval"], r1["eval"]]), expected_eval), "eval mode differs from BatchNorm"


def _assert_bitwise_batchnorm(kind: str) -> None:
    expected, expected_eval = _reference(kind)
    bn = jupyter_scale.sync_batchnorm(_layer(kind))
    got = _train(bn, kind, slice(None))
    bn.eval()
    assert torch.equal(bn(_batch(kind, STEPS)[0]), expected_eval)
    for want, have in zip(expected, got):
        for key, value in want.items():
            assert torch.equal(torch.as_tensor(have[key]), torch.as_tensor(value)), key


@contextlib.contextmanager
def _group_of_one():
    store, _ = rendezvous.open_store("127.0.0.1", 1, timeout=30)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", SHAPES)
def test_without_a_group_it_is_the_batchnorm_it_replaced(kind):
    assert not dist.is_initialized()
    _assert_bitwise_batchnorm(kind)


@pytest.mark.parametrize("kind", SHAPES)
def test_a_group_of_one_rank_is_the_batchnorm_it_replaced(kind):
    with _group_of_one():
        _assert_bitwise_batchnorm(kind)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, affine=False), nn.Linear(8, 4))

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _convnet() -> ConvNet:
    torch.manual_seed(0)
    return ConvNet()


def _train_convnet(model: nn.Module, rows: slice) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 3, 6, 6, generator=g) + 1, torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()


def test_under_ddp_two_ranks_train_as_one_process_over_the_whole_batch(ranks):
    # Equal halves: DDP's average of the ranks' mean losses is the whole batch's mean loss.
    local = _convnet()
    _train_convnet(local, slice(None))
    for rank in ranks:
        for name, value in local.state_dict().items():
            assert _close(rank["ddp"][name].float(), value.float()), name


def test_conversion_keeps_tensors_flags_and_state_dict_keys():
    torch.manual_seed(0)
    model = ConvNet()
    model(torch.randn(4, 3, 6, 6))  # running statistics that are not the defaults
    model.bn.weight.requires_grad_(False)
    model.head[1].eval()
    original = copy.deepcopy(model)
    params = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}

    converted = jupyter_scale.sync_batchnorm(model)
    assert converted is model  # in place, like nn.SyncBatchNorm.convert_sync_batchnorm
    assert type(model.bn) is SyncBatchNorm and type(model.head[1]) is SyncBatchNorm
    assert model.head[1].affine is False and not model.head[1].training and model.bn.training
    assert not model.bn.weight.requires_grad
    # The very same tensors: an optimizer built over the model before still drives it.
    assert all(p is params[name] for name, p in model.named_parameters())
    assert all(b is buffers[name] for name, b in model.named_buffers())
    assert list(model.state_dict()) == list(original.state_dict())

    # Weights go both ways between the converted and the unconverted model.
    fresh = ConvNet()
    fresh.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), original.state_dict().values()))
    with torch.no_grad():
        for t in original.state_dict().values():
            t.add_(1) if t.is_floating_point() else t.add_(7)
    model.load_state_dict(original.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), original.state_dict().values()))

    # A BatchNorm itself comes back as a new module; torch's SyncBatchNorm converts too;
    # converting twice changes nothing.
    bn = nn.BatchNorm3d(2)
    assert type(jupyter_scale.sync_batchnorm(bn)) is SyncBatchNorm
    assert type(jupyter_scale.sync_batchnorm(nn.SyncBatchNorm(2))) is SyncBatchNorm
    again = jupyter_scale.sync_batchnorm(model)
    assert again.bn is model.bn


def test_torch_sync_batchnorm_refuses_cpu():
    """What the README says of torch's own SyncBatchNorm, checked in one process."""
    with _group_of_one():
        layer = nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(3))
        with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
            layer(torch.randn(4, 3, 2, 2))


# --------------------------------------------------------------------------------------
# Through a real kernel, on the default engine: the README loop with the converted model
# --------------------------------------------------------------------------------------

NOTEBOOK = """
import copy
class BNConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)
    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))

torch.manual_seed(0)
bn_model = BNConv()
bn_start = copy.deepcopy(bn_model)
bn_start_conv = bn_model.conv  # the notebook's own layer, which the pull-back writes into
g = torch.Generator().manual_seed(1)
# Per-sample offsets, so that two ranks' shards have clearly different statistics.
images = torch.randn(256, 3, 8, 8, generator=g) + 2 * torch.randn(256, 3, 1, 1, generator=g)
bn_data = TensorDataset(images, torch.randint(0, 4, (256,), generator=g))
"""

CELL = """%%distribute --workers 2 --timeout 120 --pull bn_seed
model = jupyter_scale.sync_batchnorm(bn_model)
loader = DataLoader(bn_data, batch_size=16, shuffle=True)   # each rank gets its own shard
opt = torch.optim.SGD(model.parameters(), lr=0.05)
firsts = []
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if not firsts:
            firsts = [x, model.bn.running_mean.clone(), model.bn.running_var.clone()]
# Before the end-of-cell broadcast of rank 0's buffers, which would hide per-rank statistics.
bn_stats = torch.cat([b.flatten().float() for b in model.buffers()])
bn_weights = torch.cat([p.detach().flatten() for p in model.parameters()])
bn_type = type(model.bn).__module__ + "." + type(model.bn).__name__
bn_seed = loader.sampler.seed
"""

# One process, plain BatchNorm2d, batch 32 in the order DistributedSampler draws
# (randperm(seed + epoch)): each local batch is the union of the ranks' batches of that step.
ONE_PROCESS = """
local = copy.deepcopy(bn_start)
opt = torch.optim.SGD(local.parameters(), lr=0.05)
xs, ys = bn_data.tensors
for epoch in range(2):
    order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(bn_seed + epoch))
    for start in range(0, len(xs), 32):
        idx = order[start:start + 32]
        opt.zero_grad()
        nn.functional.cross_entropy(local(xs[idx]), ys[idx]).backward()
        opt.step()
for (name, a), b in zip(local.state_dict().items(), bn_model.state_dict().values()):
    assert torch.allclose(a.float(), b.float(), atol=1e-5, rtol=0), (name, (a.float() - b.float()).abs().max())
"""


@pytest.fixture(scope="module")
def nb(kernel):
    kernel.ok(NOTEBOOK)
    return kernel


def test_readme_loop_with_sync_batchnorm_on_two_workers(nb):
    out = nb.ok(CELL, timeout=300)
    assert "Traceback" not in out.stderr and "FutureWarning" not in out.stderr, out.stderr
    nb.ok("""
session = jupyter_scale.get_session()
assert session.gather("bn_type") == ["jupyter_scale.batchnorm.SyncBatchNorm"] * 2
# Step 1's running statistics on each rank are one BatchNorm's over the union of the
# ranks' first batches: per-rank statistics would be over half of it.
(x0, m0, v0), (x1, m1, v1) = session.gather("firsts")
reference = copy.deepcopy(bn_start).train()
reference(torch.cat([x0, x1]))
for m, v in ((m0, v0), (m1, v1)):
    assert torch.allclose(m, reference.bn.running_mean, atol=1e-5), (m, reference.bn.running_mean)
    assert torch.allclose(v, reference.bn.running_var, atol=1e-5), (v, reference.bn.running_var)
alone = copy.deepcopy(bn_start).train()
alone(x0)
assert not torch.allclose(m0, alone.bn.running_mean, atol=1e-3), "the check cannot tell per-rank statistics"
# At the end, before rank 0's buffers were broadcast, the ranks' statistics agree.
s0, s1 = session.gather("bn_stats")
assert torch.equal(s0, s1), (s0 - s1).abs().max()
# The notebook's model came back converted, as the cell run locally leaves it (sync_batchnorm
# converts in place; outside %%distribute the layer normalizes as a plain BatchNorm2d), with
# rank 0's weights and buffers.
w0, w1 = session.gather("bn_weights")
assert torch.equal(w0, w1), "ranks diverged"
assert type(bn_model.bn) is jupyter_scale.batchnorm.SyncBatchNorm and bn_model.conv is bn_start_conv
assert torch.equal(torch.cat([p.detach().flatten() for p in bn_model.parameters()]), w0)
assert torch.equal(torch.cat([b.flatten().float() for b in bn_model.buffers()]), s0)
assert not torch.equal(bn_model.conv.weight, bn_start.conv.weight), "did not train"
assert bn_model.bn.num_batches_tracked.item() == 2 * 8      # 256 / 2 ranks / 16 per step, 2 epochs
""")
    # Gradients crossed the ranks through the statistics, as under DDP with torch's SyncBatchNorm:
    # the trained weights and statistics are one process's at the global batch.
    nb.ok(ONE_PROCESS)


def test_torch_sync_batchnorm_fails_on_the_cpu_workers(nb):
    """The README's reason for sync_batchnorm, as a distributed cell meets it."""
    nb.ok("""%%distribute --workers 2 --timeout 60
try:
    nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(3))(torch.randn(4, 3, 2, 2))
    torch_error = None
except ValueError as e:
    torch_error = str(e)
""")
    errors = nb.value("jupyter_scale.get_session().gather('torch_error')")
    assert len(errors) == 2 and all(e and e.startswith("SyncBatchNorm expected input tensor to be on GPU")
                                    for e in errors), errors
