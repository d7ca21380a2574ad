"""Sharded models (FSDP2's `fully_shard`) in %%distribute cells, on a real 2-rank gloo group.

A cell that shards its model itself trains exactly as the unsharded automatic mode does: FSDP2
reduce-scatters the sharded gradients, and automatic mode must not average them a second time;
afterwards the notebook's model holds the whole trained weights, gathered from every rank.
"""

import textwrap

import pytest

from conftest import COUNT_AVERAGING

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


# FSDP2 runs in the ranks' own code, which no engine touches: the default engine only (conftest's
# `kernel`); the engines' own paths are tested in test_distribute, test_failures, test_backend_protocol.


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
    k.ok("%%distribute --workers 2" + COUNT_AVERAGING + "import jupyter_scale.sharding as sharding\n"
         "for layer in model.body:\n"
         "    if any(True for _ in layer.parameters()):\n"
         "        fully_shard(layer)\n"
         "fully_shard(model)\n"
         "sharded = all(sharding.is_sharded(p) for p in model.parameters())\n"
         "with averaging_counted() as averaged:\n" + textwrap.indent(LOOP, "    ") +
         "averaged_by_us = averaged.count\n", timeout=300)
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
               "import jupyter_scale.training as training, jupyter_scale.sharding as sharding\n"
               "sharded = [n for n, p in model.named_parameters() if sharding.is_sharded(p)]\n"
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
    assert out.stderr.startswith(
        "UsageError: --shard is automatic mode's; with --manual, call jupyter_scale.shard_model"), out.stderr


def test_a_sharded_checkpoint_of_two_ranks_loads_into_three_and_into_the_notebook(k, tmp_path):
    path = str(tmp_path / "ckpt")
    k.ok("torch.manual_seed(0)\nmodel = Tied()\ntorch.manual_seed(7)")
    k.ok("%%distribute --workers 2 --shard\n"
         "opt = torch.optim.Adam(model.parameters(), lr=0.01)"
         + LOOP.replace("opt = torch.optim.SGD(model.parameters(), lr=0.1)\n", "") +
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


def test_the_pull_back_of_a_sharded_model_comes_in_chunks_and_is_whole(k):
    # 2 KB chunks: every parameter of Tied is its own request (most are larger than that).
    k.ok("torch.manual_seed(0)\nstart = Tied()\nmodel = copy.deepcopy(start)\ntorch.manual_seed(7)")
    k.ok("%%distribute --workers 2" + LOOP, timeout=300)
    k.ok("unsharded = copy.deepcopy(model)\nmodel = copy.deepcopy(start)\ntorch.manual_seed(7)\n"
         "%config ScaleSession.pull_chunk_bytes = 2000")
    try:
        k.ok("%%distribute --workers 2 --shard\n"
             "import jupyter_scale.worker as w\n"
             "import jupyter_scale.training as training, jupyter_scale.sharding as sharding\n"
             "calls = []\n"
             "if not hasattr(training, 'counted'):\n"
             "    training.counted, original = True, sharding.whole_tensors\n"
             "    sharding.whole_tensors = lambda m, keys: (calls.append(len(keys)), original(m, keys))[1]"
             + LOOP, timeout=300)
        k.ok("""
assert (flat(model) - flat(unsharded)).abs().max().item() <= 1e-5
assert model.out.weight is model.inp.weight
for a, b in zip(model.body[1].buffers(), unsharded.body[1].buffers()):
    assert (a.float() - b.float()).abs().max().item() <= 1e-5
""")
        # Rank 0 answered one chunk per request; the tied weight was asked for once.
        calls = k.value("jupyter_scale.get_session().gather('calls')")
        assert calls[0] == calls[1] and len(calls[0]) >= 4, calls
        entries = k.value("len(start.state_dict())")
        assert sum(calls[0]) == entries - 1, (calls, entries)
    finally:
        k.ok("%config ScaleSession.pull_chunk_bytes = 64 << 20")
        k.ok("%%distribute\nimport jupyter_scale.training as training, jupyter_scale.sharding as sharding\n"
             "if hasattr(training, 'counted'):\n"
             "    sharding.whole_tensors = original\n"
             "    del training.counted", timeout=120)


def test_a_model_built_on_the_meta_device_in_the_cell_trains_sharded_as_one_built_whole(k):
    net_loop = LOOP.replace("model", "net")
    gather = ("final = {key: value.clone() for key, value in "
              "sharding.whole_tensors(net, list(net.state_dict())).items()}\n")
    k.ok("torch.manual_seed(7)")
    k.ok("%%distribute --workers 2 --pull final\n"
         "import jupyter_scale.training as training, jupyter_scale.sharding as sharding\n"
         "net = Tied()\n" + net_loop + gather, timeout=300)
    k.ok("whole = final\ndel net  # the unsharded one came back\ntorch.manual_seed(7)")
    # The same cell, the model built on the meta device: nothing allocated, nothing drawn;
    # --shard shards and materializes it when the optimizer is built over its parameters.
    k.ok("%%distribute --workers 2 --shard --pull final\n"
         "import jupyter_scale.training as training, jupyter_scale.sharding as sharding\n"
         "with torch.device('meta'):\n"
         "    net = Tied()\n"
         "built_on_meta = all(p.is_meta for p in net.parameters())\n"
         + net_loop.replace("for x, y in loader:", "sharded = all(sharding.is_sharded(p) for p in net.parameters())\n"
                            "for x, y in loader:") + gather, timeout=300)
    assert k.value("jupyter_scale.get_session().gather('built_on_meta')") == [True, True]
    assert k.value("jupyter_scale.get_session().gather('sharded')") == [True, True]
    k.ok("""
assert 'net' not in dir(), "the kernel never builds the model"
assert final.keys() == whole.keys()
for key in whole:
    assert (final[key].float() - whole[key].float()).abs().max().item() <= 1e-5, key
""")


def test_mixed_precision_trains_and_the_notebook_gets_float32_weights(k):
    k.ok("torch.manual_seed(0)\nmodel = Tied()\nstart = copy.deepcopy(model)")
    k.ok("%%distribute --workers 2 --shard --mixed-precision bf16\n"
         "dtypes = set()\n"
         "hook = model.head.register_forward_hook(lambda m, i, o: dtypes.add(str(o.dtype)))\n"
         + LOOP + "hook.remove()\n", timeout=300)
    assert k.value("jupyter_scale.get_session().gather('dtypes')") == [{"torch.bfloat16"}] * 2
    k.ok("""
assert all(p.dtype == torch.float32 for p in model.parameters())
assert torch.isfinite(flat(model)).all() and (flat(model) - flat(start)).abs().max().item() > 1e-3
""")


def test_shard_options_are_refused_in_one_line_where_they_cannot_work(k):
    out = k.cell("%%distribute --mixed-precision bf16\nx = 1")
    assert out.stderr.startswith("UsageError: --mixed-precision and --cpu-offload are options of --shard"), out.stderr
    out = k.cell("%%distribute --shard --mixed-precision fp8\nx = 1")
    assert "argument --mixed-precision: invalid choice: 'fp8'" in out.stderr, out.stderr
    # CPU offload moves shards off an accelerator: these workers have none.
    k.ok("model = Tied()")  # not sharded yet on the workers
    out = k.cell("%%distribute --workers 2 --shard --cpu-offload\nopt = torch.optim.SGD(model.parameters(), lr=0.1)")
    assert "offload=True keeps the shards in CPU memory between uses on an accelerator" in out.stderr + str(out.error)
    k.ok("%%distribute --workers 2\nx = 1")  # and the cluster is usable


def test_shard_model_outside_a_cell_only_materializes_a_meta_model(k):
    k.ok("""
class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(4, 16))
        self.mix = nn.Linear(16, 16)

class Attending(nn.Module):  # attention initializes its out_proj after building it
    def __init__(self):
        super().__init__()
        self.tied = Tied()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)

torch.manual_seed(3)
built = Attending()
torch.manual_seed(3)
with torch.device("meta"):
    later = Attending()
assert jupyter_scale.shard_model(later) is later
assert later.tied.out.weight is later.tied.inp.weight
assert torch.equal(flat(later), flat(built))
for a, b in zip(later.buffers(), built.buffers()):
    assert torch.equal(a, b)
with torch.device("meta"):
    positions = Positions()
try:
    jupyter_scale.shard_model(positions)
except ValueError as exc:
    message = str(exc)
else:
    raise AssertionError("no error")
assert message.startswith("shard_model: table (Positions) was built on the meta device and nothing initializes it"), message
with torch.device("meta"):
    positions = Positions()
jupyter_scale.shard_model(positions,
                          init=lambda m: nn.init.zeros_(m.table) if isinstance(m, Positions) else m.reset_parameters())
assert torch.equal(positions.table, torch.zeros(4, 16))
""")


def test_a_sharded_model_frees_its_whole_copy_and_takes_the_notebooks_later_changes(k):
    # Shapes no other test's model has: what the workers still hold of it is countable.
    k.ok("torch.manual_seed(0)\nwide = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 4))\n"
         "torch.manual_seed(7)")
    k.ok("%%distribute --workers 2 --shard" + LOOP.replace("model", "wide"), timeout=300)
    # Each rank holds its shard of every parameter and no whole copy of any: the tensors
    # kept for the notebook's later changes are the shards.
    k.ok("%%distribute\n"
         "import jupyter_scale.worker as w\n"
         "import jupyter_scale.training as training, jupyter_scale.sharding as sharding\n"
         "shapes = [(24, 16), (24,), (4, 24)]  # (4,) is also a bias of Tied\n"
         "held = list(w._state.receiver.tensors.values())\n"
         "whole_left = sum(1 for t in held if not sharding.is_sharded(t) and tuple(t.shape) in shapes)\n"
         "held_shards = sum(1 for t in held if any(t is p for p in wide.parameters()))\n", timeout=120)
    assert k.value("jupyter_scale.get_session().gather('whole_left')") == [0, 0]
    assert k.value("jupyter_scale.get_session().gather('held_shards')") == [4, 4]
    # A change in the notebook reaches the workers' shards (written in place, rank by rank).
    k.ok("with torch.no_grad():\n    wide[2].weight.fill_(0.5)")
    k.ok("%%distribute\nhead = wide[2].weight.full_tensor()\nstill_sharded = sharding.is_sharded(wide[2].weight)",
         timeout=120)
    k.ok("heads = jupyter_scale.get_session().gather('head')\n"
         "assert all(torch.equal(h, torch.full((4, 24), 0.5)) for h in heads)")
    assert k.value("jupyter_scale.get_session().gather('still_sharded')") == [True, True]


def test_a_transformers_model_built_on_the_meta_device_trains_sharded(k):
    # Someone else's model: a small GPT-2 from a config, built where it trains, initialized
    # by its own _init_weights (its Conv1D layers have no reset_parameters).
    k.ok("from transformers import GPT2Config, GPT2LMHeadModel\n"
         "config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=32)\n"
         "g = torch.Generator().manual_seed(0)\n"
         "tokens = TensorDataset(torch.randint(0, 96, (256, 1), generator=g).repeat(1, 32) // 1)\n"
         "torch.manual_seed(7)")
    out = k.cell("%%distribute --workers 2 --shard\n"
                 "with torch.device('meta'):\n"
                 "    gpt = GPT2LMHeadModel(config)\n"
                 "jupyter_scale.shard_model(gpt)\n")
    assert "pass init=model._init_weights" in out.stderr + str(out.error), out.stderr
    k.ok("torch.manual_seed(7)")
    k.ok("%%distribute --workers 2 --shard\n"
         "with torch.device('meta'):\n"
         "    gpt = GPT2LMHeadModel(config)\n"
         "jupyter_scale.shard_model(gpt, init=gpt._init_weights)\n"
         "import jupyter_scale.training as training, jupyter_scale.sharding as sharding\n"
         "opt = torch.optim.AdamW(gpt.parameters(), lr=1e-2)\n"
         "losses = []\n"
         "for epoch in range(2):\n"
         "    for (x,) in DataLoader(tokens, batch_size=16, shuffle=True):\n"
         "        opt.zero_grad()\n"
         "        loss = gpt(input_ids=x, labels=x).loss\n"
         "        loss.backward()\n"
         "        opt.step()\n"
         "        losses.append(loss.item())\n"
         "sharded = all(sharding.is_sharded(p) for p in gpt.parameters())\n"
         "whole = sharding.whole_tensors(gpt, ['transformer.wte.weight'])['transformer.wte.weight']\n", timeout=300)
    k.ok("session = jupyter_scale.get_session()\n"
         "losses = session.gather('losses')\n"
         "assert len(losses[0]) == 16 and sum(losses[0][-4:]) < 0.5 * sum(losses[0][:4]), losses[0]\n"
         "assert session.gather('sharded') == [True, True]\n"
         "first, second = session.gather('whole')\n"
         "assert torch.equal(first, second) and torch.isfinite(first).all()")


def test_keep_sharded_leaves_the_trained_model_on_the_workers(k):
    k.ok("torch.manual_seed(0)\nmodel = Tied()\nstart = copy.deepcopy(model)\ntorch.manual_seed(7)")
    out = k.ok("%%distribute --workers 2 --shard --keep-sharded" + LOOP +
               "trained_head = model.head.weight.full_tensor()\n", timeout=300)
    assert "'model' stays sharded on the workers (--keep-sharded)" in out.stderr, out.stderr
    k.ok("assert torch.equal(flat(model), flat(start)), 'the notebook kept its weights'")
    # The workers train on from their model; a cell without the option brings it back.
    k.ok("%%distribute\nsame = torch.equal(model.head.weight.full_tensor(), trained_head)", timeout=120)
    assert k.value("jupyter_scale.get_session().gather('same')") == [True, True]
    k.ok("trained = jupyter_scale.get_session().gather('trained_head')[0]\n"
         "assert torch.equal(model.head.weight, trained) and not torch.equal(trained, start.head.weight)")


def test_mixed_precision_with_batchnorm_inside_a_sharding_unit(k):
    # BatchNorm computes in float32 in a unit of its own, sharded before the block holding it.
    k.ok("class Blocked(nn.Module):\n"
         "    def __init__(self):\n"
         "        super().__init__()\n"
         "        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU())\n"
         "                                     for _ in range(2)])\n"
         "        self.head = nn.Linear(16, 4)\n"
         "    def forward(self, x):\n"
         "        for block in self.blocks:\n"
         "            x = block(x)\n"
         "        return self.head(x)\n"
         "torch.manual_seed(0)\nmodel = Blocked()\nstart = copy.deepcopy(model)")
    k.ok("%%distribute --workers 2 --shard --mixed-precision bf16" + LOOP, timeout=300)
    k.ok("assert torch.isfinite(flat(model)).all() and (flat(model) - flat(start)).abs().max().item() > 1e-3")


def test_sharded_models_that_end_the_cell_evaluating_come_back_and_train_on(k):
    # No container: the whole model is FSDP's outermost unit, which a forward without
    # backward leaves whole until it is resharded; a notebook optimizer that has stepped
    # already; a submodule bound to a name of its own; a tied weight across two layers.
    k.ok("""
class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

torch.manual_seed(0)
plain = Plain()
backbone = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
stacked = nn.Sequential(backbone, nn.Linear(16, 16), nn.Linear(16, 4))
stacked[1].weight = backbone[0].weight  # tied across two of the default units
momentum = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
x0, y0 = data[:64]
nn.functional.cross_entropy(plain(x0), y0).backward()
momentum.step()
start, start_stacked = copy.deepcopy(plain), copy.deepcopy(stacked)
""")
    k.ok("%%distribute --workers 2 --shard\n"
         "import jupyter_scale.training as training, jupyter_scale.sharding as sharding\n"
         "other = torch.optim.SGD(stacked.parameters(), lr=0.1)\n"
         "for x, y in DataLoader(data, batch_size=32, shuffle=True):\n"
         "    momentum.zero_grad(); other.zero_grad()\n"
         "    nn.functional.cross_entropy(plain(x), y).backward()\n"
         "    nn.functional.cross_entropy(stacked(x), y).backward()\n"
         "    momentum.step(); other.step()\n"
         "with torch.no_grad():\n"
         "    evaluated = nn.functional.cross_entropy(plain(x0), y0).item()\n"
         "    stacked(x0)\n"
         "tied = stacked[1].weight is backbone[0].weight\n", timeout=300)
    assert k.value("jupyter_scale.get_session().gather('tied')") == [True, True]
    k.ok("""
assert stacked[1].weight is backbone[0].weight and stacked[0] is backbone
assert (flat(plain) - flat(start)).abs().max().item() > 1e-3
assert (flat(stacked) - flat(start_stacked)).abs().max().item() > 1e-3
with torch.no_grad():
    here = nn.functional.cross_entropy(plain(x0), y0).item()
evaluated = jupyter_scale.get_session().gather('evaluated')
assert all(abs(e - here) <= 1e-5 for e in evaluated), (evaluated, here)
""")
    # The next cell, without --shard, trains on from the sharded models on every rank.
    k.ok("%%distribute\n"
         "for x, y in DataLoader(data, batch_size=32):\n"
         "    momentum.zero_grad()\n"
         "    nn.functional.cross_entropy(plain(x), y).backward()\n"
         "    momentum.step()\n", timeout=300)
    # A sharded optimizer cannot come back by value: said by name, the cell still succeeds.
    out = k.ok("%%distribute --pull momentum\nx = 1", timeout=120)
    assert "could not pull 'momentum': it holds sharded tensors" in out.stderr, out.stderr


def test_shard_model_refuses_initializations_it_cannot_replay(k):
    k.ok("""
class Nano(nn.Module):  # initializes its modules with its own _init_weights, as nanoGPT does
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(8, 4)
        self.apply(self._init_weights)
    def _init_weights(self, module):
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

def refused(build):
    with torch.device("meta"):
        model = build()
    try:
        jupyter_scale.shard_model(model)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("no error")

message = refused(Nano)
assert "Nano initializes its modules with its own _init_weights" in message and "init=model._init_weights" in message
message = refused(lambda: nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                         dim_feedforward=16))
assert message.startswith("shard_model: Transformer (the model) initializes its children's tensors itself"), message
with torch.device("meta"):
    nano = Nano()
jupyter_scale.shard_model(nano, init=nano._init_weights)
assert 0.005 < nano.wte.weight.std().item() < 0.05
""")


def test_on_one_worker_shard_materializes_a_meta_model_and_trains_it_whole(k):
    # One worker: no automatic seeding, so seeded here (some draws of the weights and the
    # shuffle learn too little in 60 steps to tell)
    k.ok("%%distribute --workers 1 --shard\n"
         "import jupyter_scale.training as training, jupyter_scale.sharding as sharding\n"
         "torch.manual_seed(0)\n"
         "with torch.device('meta'):\n"
         "    solo = Tied()\n"
         "opt = torch.optim.SGD(solo.parameters(), lr=0.1)\n"
         "losses = []\n"
         "for epoch in range(3):\n"
         "    for x, y in DataLoader(data, batch_size=64, shuffle=True):\n"
         "        opt.zero_grad()\n"
         "        loss = nn.functional.cross_entropy(solo(x), y)\n"
         "        loss.backward()\n"
         "        opt.step()\n"
         "        losses.append(loss.item())\n"
         "whole = not any(sharding.is_sharded(p) or p.is_meta for p in solo.parameters())\n"
         "tied = solo.out.weight is solo.inp.weight\n", timeout=300)
    assert k.value("jupyter_scale.get_session().gather('whole')") == [True]
    assert k.value("jupyter_scale.get_session().gather('tied')") == [True]
    k.ok("losses = jupyter_scale.get_session().gather('losses')[0]\n"
         "assert len(losses) == 60 and sum(losses[-10:]) < sum(losses[:10]), losses")
    k.ok("%scale restart --workers 2", timeout=180)
