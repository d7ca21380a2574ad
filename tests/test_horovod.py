"""Horovod cells: horovodrun's gloo rendezvous and variables, one hvd.init() per worker, on a
real ipyparallel cluster; Horovod's own data-parallel API (DistributedOptimizer,
broadcast_parameters) on a torch model."""

import importlib.util
import os
import subprocess
import sys

import framework_cells
import pytest

from conftest import _started_kernel, _stop_and_check

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                       reason="horovod is not installed (scripts/build_horovod.sh builds it)"),
]

NOTEBOOK = """
import numpy as np
import torch

torch.manual_seed(0)
X = torch.randn(1024, 8)
Y = X @ torch.arange(1.0, 9.0)[:, None] / 10 + 0.5
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

def weights_now():
    return [v.detach().numpy().copy() for v in model.state_dict().values()]

def same_everywhere(ranks, notebook):
    return len(ranks) == 2 and all(
        np.array_equal(ranks[0][k], ranks[1][k]) and np.array_equal(ranks[0][k], notebook[k].numpy()) for k in notebook)

before = weights_now()
"""

# As Horovod's PyTorch guide writes it; `model` is the notebook's.
TRAIN = """%%distribute --workers 2
EPOCHS = {epochs}
import horovod.torch as hvd
hvd.init()
data = torch.utils.data.TensorDataset(X, Y)
sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank())
loader = torch.utils.data.DataLoader(data, batch_size=32, sampler=sampler)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
epoch_losses = []
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    losses = []
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    epoch_losses.append(sum(losses) / len(losses))
    report(loss=epoch_losses[-1], epoch=epoch)
weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
"""

SAME_ON_BOTH_RANKS = "same_everywhere(jupyter_scale.get_session().gather('weights'), model.state_dict())"


def train(epochs):
    return TRAIN.replace("{epochs}", str(epochs))


@pytest.fixture(scope="module")
def kernel():
    k = _started_kernel()
    yield k
    _stop_and_check(k)


def test_horovod_is_refused_until_the_user_allows_its_unauthenticated_rendezvous(kernel):
    framework_cells.refused_until_allowed(kernel, "%%distribute --workers 2\nimport horovod.torch as hvd\nhvd.init()")


def test_two_workers_train_with_distributed_optimizer_and_the_notebook_model_gets_rank_0s_weights(kernel):
    losses = framework_cells.trains_and_brings_rank_0s_weights_back(kernel, NOTEBOOK, train, SAME_ON_BOTH_RANKS)
    assert losses[0][-1] < losses[0][0] / 4 and losses[1][-1] < losses[1][0] / 4, losses  # each rank's own batches
    assert losses[0] != losses[1]  # each rank trained on its own shard
    # Horovod's ranks are the cluster's, with horovodrun's variables; its group is formed once
    # and the next cell's hvd.init() keeps it.
    out = kernel.cell("%%distribute\nimport os\nimport horovod.torch as hvd\nhvd.init()\n"
                      "hvd.shutdown()  # kept for the next cells, with a warning\n"
                      "place = [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), "
                      "hvd.cross_size(), rank, hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum).item()]\n"
                      "env = {k: v for k, v in os.environ.items() if k.startswith('HOROVOD_')}", timeout=120)
    assert out.ok and "hvd.shutdown() does nothing" in out.stdout + out.stderr, out.error_text
    assert kernel.value("jupyter_scale.get_session().runs[-1].framework") == "horovod"
    assert kernel.value("jupyter_scale.get_session().gather('place')") == [[0, 2, 0, 2, 0, 1, 0, 3.0],
                                                                           [1, 2, 1, 2, 0, 1, 1, 3.0]]
    # A cell that only reads what a Horovod cell bound on the workers is Horovod's too.
    kernel.ok("%%distribute\nsize_again = hvd.size()")
    assert kernel.value("jupyter_scale.get_session().runs[-1].framework") == "horovod"
    env = kernel.value("jupyter_scale.get_session().gather('env')")
    assert env[0]["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1" and env[0]["HOROVOD_GLOO_IFACE"] == "lo"
    assert env[0]["HOROVOD_CONTROLLER"] == env[0]["HOROVOD_CPU_OPERATIONS"] == "gloo"
    kernel.ok(train(1), timeout=240)
    assert kernel.value(SAME_ON_BOTH_RANKS) is True


def test_the_rendezvous_is_closed_once_every_rank_has_joined(kernel):
    """Rank 0 serves Horovod's rendezvous only while the group forms: afterwards nothing of it
    listens, and another local user finds no port to join or read."""
    kernel.ok("%%distribute\nimport os\nport = int(os.environ['HOROVOD_GLOO_RENDEZVOUS_PORT'])")
    port = kernel.value("jupyter_scale.get_session().gather('port')")[0]
    stranger = subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c",
         "import socket, sys\ntry:\n    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5)\n"
         "except ConnectionRefusedError:\n    print('refused')\n", str(port)],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ.get("PATH", "")})
    assert stranger.stdout.strip() == "refused", stranger


def test_process_sets_are_refused_in_one_line_and_the_next_cell_trains(kernel):
    out = kernel.cell("%%distribute\nimport horovod.torch as hvd\nhvd.init(process_sets='dynamic')", timeout=120)
    assert not out.ok and out.error["evalue"].startswith(("rank 0 failed: FrameworkError", "rank 1 failed: FrameworkError"))
    assert "process_sets" in out.error["evalue"], out.error_text
    kernel.ok(train(1), timeout=300)
    assert kernel.value(SAME_ON_BOTH_RANKS) is True


def test_an_error_on_rank_1_names_it_and_the_next_cell_trains_on_fresh_workers(kernel):
    framework_cells.error_on_rank_1_is_named_and_the_next_cell_trains_on_fresh_workers(kernel, train, SAME_ON_BOTH_RANKS)


def test_an_interrupt_stops_both_ranks_and_the_next_cell_works(kernel):
    framework_cells.interrupt_stops_both_ranks_and_the_next_cell_trains(kernel, train, SAME_ON_BOTH_RANKS)
