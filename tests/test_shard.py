"""Sharded models (FSDP2's `fully_shard`) in %%distribute cells, on a real 2-rank gloo group.

A cell that shards its model itself trains exactly as the unsharded automatic mode does: FSDP2
reduce-scatters the sharded gradients, and automatic mode must not average them a second time;
afterwards the notebook's model holds the whole trained weights, gathered from every rank.
"""

import pytest

NOTEBOOK = """
import copy
from torch.distributed.fsdp import fully_shard

class Tied(nn.Module):
    # BatchNorm, and an output layer that shares the input layer's weight.
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16))
        self.out = nn.Linear(16, 16)
        self.out.weight = self.inp.weight
        self.head = nn.Linear(16, 4)
    def forward(self, x):
        return self.head(torch.relu(self.out(self.body(self.inp(x)))))

g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(1280, 16, generator=g), torch.randint(0, 4, (1280,), generator=g))

def flat(m):
    return torch.cat([p.detach().flatten() for p in m.parameters()])
"""

# 20 SGD steps: 1280 samples / 2 ranks / 32 per batch.
LOOP = """
loader = DataLoader(data, batch_size=32, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
steps = len(loader)
"""


@pytest.fixture(scope="module")
def k(kernel):
    kernel.ok(NOTEBOOK)
    return kernel


def test_a_cell_that_shards_its_model_trains_as_unsharded_automatic_mode_does(k):
    # The kernel's seed decides the cell's (its shuffles, its initializations): the same for both runs.
    k.ok("torch.manual_seed(0)\nstart = Tied()\nmodel = copy.deepcopy(start)\ntorch.manual_seed(7)")
    k.ok("%%distribute --workers 2" + LOOP, timeout=300)
    k.ok("unsharded = copy.deepcopy(model)\nmodel = copy.deepcopy(start)\ntorch.manual_seed(7)")
    # The same loop; the cell shards the body's layers and the whole model first (FSDP2).
    k.ok("%%distribute --workers 2\n"
         "import jupyter_scale.training as training\n"
         "for layer in model.body:\n"
         "    if any(True for _ in layer.parameters()):\n"
         "        fully_shard(layer)\n"
         "fully_shard(model)\n"
         "sharded = all(training.is_sharded(p) for p in model.parameters())\n"
         "before = training.averaged_parameters" + LOOP +
         "averaged_by_us = training.averaged_parameters - before\n", timeout=300)
    assert k.value("jupyter_scale.get_session().gather('steps')") == [20, 20]
    assert k.value("jupyter_scale.get_session().gather('sharded')") == [True, True]
    # FSDP2 reduced the gradients; automatic mode left them alone (no double averaging).
    assert k.value("jupyter_scale.get_session().gather('averaged_by_us')") == [0, 0]
    # The notebook's model came back whole (the gathered state dict), trained as unsharded.
    k.ok("""
assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
assert model.out.weight is model.inp.weight  # still tied in the notebook
difference = (flat(model) - flat(unsharded)).abs().max().item()
assert difference <= 1e-5, difference
assert (flat(model) - flat(start)).abs().max().item() > 1e-3, "did not train"
for a, b in zip(model.body[1].buffers(), unsharded.body[1].buffers()):  # BatchNorm's running statistics
    assert (a.float() - b.float()).abs().max().item() <= 1e-5
""")
    # The next cell trains on from the sharded model the workers hold.
    k.ok("%%distribute" + LOOP, timeout=300)
    k.ok("assert (flat(model) - flat(unsharded)).abs().max().item() > 1e-4")


def test_shard_trains_the_unchanged_loop_sharded_and_equal_to_unsharded(k):
    k.ok("torch.manual_seed(0)\nstart = Tied()\nmodel = copy.deepcopy(start)\ntorch.manual_seed(7)")
    k.ok("%%distribute --workers 2" + LOOP, timeout=300)
    k.ok("unsharded = copy.deepcopy(model)\nmodel = copy.deepcopy(start)\ntorch.manual_seed(7)")
    out = k.ok("%%distribute --workers 2 --shard\n"
               "import jupyter_scale.training as training\n"
               "sharded = [n for n, p in model.named_parameters() if training.is_sharded(p)]\n"
               "units = sum(1 for m in model.modules() if type(m).__name__.startswith('FSDP'))" + LOOP, timeout=300)
    assert "Traceback" not in out.stderr
    names = k.value("[n for n, _ in start.named_parameters()]")
    assert k.value("jupyter_scale.get_session().gather('sharded')") == [names, names]  # every parameter
    assert k.value("jupyter_scale.get_session().gather('units')") == [4, 4]  # 3 layers of body, and the model
    k.ok("""
assert (flat(model) - flat(unsharded)).abs().max().item() <= 1e-5
assert model.out.weight is model.inp.weight
""")


def test_shard_keeps_an_optimizer_made_in_the_notebook_training_the_model(k):
    k.ok("torch.manual_seed(0)\nstart = Tied()\nmodel = copy.deepcopy(start)\n"
         "opt = torch.optim.SGD(model.parameters(), lr=0.1)\ntorch.manual_seed(7)")
    k.ok("%%distribute --workers 2 --shard\n"
         "loader = DataLoader(data, batch_size=32, shuffle=True)\n"
         "for x, y in loader:\n"
         "    opt.zero_grad()\n"
         "    nn.functional.cross_entropy(model(x), y).backward()\n"
         "    opt.step()\n", timeout=300)
    k.ok("""
assert (flat(model) - flat(start)).abs().max().item() > 1e-3, "the notebook's optimizer did not train the model"
""")


def test_shard_with_manual_is_refused_in_one_line(k):
    out = k.cell("%%distribute --shard --manual\nx = 1")
    assert out.stderr.startswith("UsageError: --shard is automatic mode's; with --manual, call fully_shard"), out.stderr


def test_a_sharded_checkpoint_of_two_ranks_loads_into_three_and_into_the_notebook(k, tmp_path):
    path = str(tmp_path / "ckpt")
    k.ok("torch.manual_seed(0)\nmodel = Tied()\ntorch.manual_seed(7)")
    k.ok("%%distribute --workers 2 --shard\n"
         "opt = torch.optim.Adam(model.parameters(), lr=0.01)" + LOOP.replace("opt = torch.optim.SGD(model.parameters(), lr=0.1)\n", "") +
         f"jupyter_scale.save_checkpoint({path!r}, model=model, optimizer=opt)\n", timeout=300)
    k.ok("trained = copy.deepcopy(model)")
    # Three ranks, a model initialized differently, a fresh optimizer: all from the checkpoint.
    k.ok("torch.manual_seed(1)\nmodel = Tied()\nassert (flat(model) - flat(trained)).abs().max().item() > 1e-2")
    k.ok("%scale restart --workers 3", timeout=180)
    k.ok("%%distribute --shard\n"
         "opt = torch.optim.Adam(model.parameters(), lr=0.01)\n"
         f"jupyter_scale.load_checkpoint({path!r}, model=model, optimizer=opt)\n"
         "steps_taken = [s['step'] for s in opt.state_dict()['state'].values()][:1]\n", timeout=300)
    k.ok("assert torch.equal(flat(model), flat(trained))")
    assert k.value("[float(s[0]) for s in jupyter_scale.get_session().gather('steps_taken')]") == [20.0] * 3
    # And into the notebook's own model, no process group at all.
    k.ok(f"local = Tied()\njupyter_scale.load_checkpoint({path!r}, model=local)\n"
         "assert torch.equal(flat(local), flat(trained))")
    k.ok("%scale restart --workers 2", timeout=180)
