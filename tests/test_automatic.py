"""Automatic mode: the README's loop runs unchanged on 2 workers and computes the right thing.

Every comparison trains real models on a real 2-rank gloo group and checks the weights.
"""

import pytest

from conftest import COUNT_AVERAGING

README_LOOP = """%%distribute --workers 2
loader = DataLoader(data, batch_size=64, shuffle=True)   # each rank gets its own shard
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(3):
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()                 # gradients are averaged across ranks
        report(loss=loss)
"""

NOTEBOOK = """
import copy
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(32, 64)
        self.l2 = nn.Linear(64, 4)
    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

torch.manual_seed(0)
model = Net()
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(2048, 32, generator=g), torch.randint(0, 4, (2048,), generator=g))

def flat(m):
    return torch.cat([p.detach().flatten() for p in m.parameters()])

def close(a, b, tol=1e-5):
    return (flat(a) - flat(b)).abs().max().item() <= tol
"""

GATHER_WEIGHTS = "%%distribute\nweights = torch.cat([p.detach().flatten() for p in model.parameters()])"


@pytest.fixture(scope="module")
def k(kernel):
    kernel.ok(NOTEBOOK)
    # Every test here runs with averaging during backward on, also for these small models
    # (it is for more than one bucket of gradients): it must change nothing they check.
    kernel.ok("%%distribute --workers 2\nimport jupyter_scale.training\njupyter_scale.training.OVERLAP_MIN_BYTES = 0")
    kernel.ok("jupyter_scale.get_session().average_during_backward = True")
    return kernel


def test_design_loop_unchanged_ranks_end_bitwise_equal(k):
    k.ok("start = copy.deepcopy(model)")
    out = k.ok(README_LOOP, timeout=300)
    assert "Traceback" not in out.stderr
    k.ok("""
steps = [sum(1 for p in jupyter_scale.history() if p["rank"] == r) for r in (0, 1)]
assert steps == [3 * 16, 3 * 16], steps     # 2048 / 2 ranks / 64 = 16 steps per epoch
""")
    k.ok(GATHER_WEIGHTS)
    k.ok("""
w = jupyter_scale.get_session().gather("weights")
assert torch.equal(w[0], w[1]), "ranks diverged"
assert torch.equal(w[0], flat(model)), "notebook model is not rank 0's"
assert not close(model, start), "did not train"
""")


def test_each_epoch_the_ranks_see_disjoint_samples_covering_the_dataset(k):
    k.ok("""%%distribute
ids = TensorDataset(torch.arange(1000))
loader = DataLoader(ids, batch_size=50, shuffle=True)
seen = [torch.cat([b[0] for b in loader]).tolist() for epoch in range(3)]
""")
    k.ok("""
r0, r1 = jupyter_scale.get_session().gather("seen")
for epoch in range(3):
    a, b = r0[epoch], r1[epoch]
    assert len(a) == len(b) == 500
    assert not set(a) & set(b), "ranks overlap"
    assert sorted(a + b) == list(range(1000)), "not covering"
assert r0[0] != r0[1] != r0[2], "no reshuffle between epochs"
assert r0[0] != sorted(r0[0]), "shuffle=True not honoured"
""")


def test_automatic_equals_explicit_ddp(k):
    k.ok("torch.manual_seed(0)\nbase = Net()\nm_auto = copy.deepcopy(base)\nm_ddp = copy.deepcopy(base)")
    k.ok("""%%distribute
loader = DataLoader(data, batch_size=32, shuffle=True)
opt = torch.optim.SGD(m_auto.parameters(), lr=0.05, momentum=0.9)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(m_auto(x), y).backward()
        opt.step()
auto_seed = loader.sampler.seed
""")
    k.ok("%%distribute --pull auto_seed\npass")
    k.ok("""%%distribute --manual
net = jupyter_scale.wrap(m_ddp)
loader = jupyter_scale.shard(DataLoader(data, batch_size=32, shuffle=True), seed=auto_seed)
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
""")
    k.ok("assert not close(m_auto, base)\nassert close(m_auto, m_ddp), (flat(m_auto) - flat(m_ddp)).abs().max()")


def test_two_workers_at_batch_b_equal_one_process_at_batch_2b(k):
    k.ok("torch.manual_seed(0)\nm2 = Net()\nm_local = copy.deepcopy(m2)")
    k.ok("""%%distribute
loader = DataLoader(data, batch_size=16, shuffle=True)
opt = torch.optim.SGD(m2.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(m2(x), y).backward()
        opt.step()
seed2 = loader.sampler.seed
""")
    k.ok("%%distribute --pull seed2\npass")
    # One process, batch 32, in the order DistributedSampler draws (randperm(seed + epoch)):
    # each local batch is the union of the two ranks' batches of that step.
    k.ok("""
opt = torch.optim.SGD(m_local.parameters(), lr=0.1)
xs, ys = data.tensors
for epoch in range(2):
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed2 + epoch))
    for start in range(0, len(order), 32):
        idx = order[start:start + 32]
        opt.zero_grad()
        nn.functional.cross_entropy(m_local(xs[idx]), ys[idx]).backward()
        opt.step()
assert close(m2, m_local), (flat(m2) - flat(m_local)).abs().max()
""")


BN_MODEL = """
class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2),
                                  nn.Linear(64, 4))
    def forward(self, x):
        return self.body(self.frozen(x))

torch.manual_seed(3)
bn_base = BNNet()
bn_auto, bn_ddp = copy.deepcopy(bn_base), copy.deepcopy(bn_base)
"""

BN_LOOP = """
torch.manual_seed(7)                      # same dropout masks in both modes
loader = DataLoader(data, batch_size=32, shuffle=True{seed})
opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
for epoch in range(2):
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(net(x), y) / 2
        loss.backward()                   # gradient accumulation: 2 micro-batches per step
        if i % 2 == 1:
            opt.step()
            opt.zero_grad(set_to_none=True)
"""


def test_batchnorm_dropout_frozen_layer_and_gradient_accumulation(k):
    k.ok(BN_MODEL)
    k.ok("%%distribute\nnet = bn_auto" + BN_LOOP.format(seed="") + "bn_seed = loader.sampler.seed")
    # Buffers become rank 0's at the end of the cell: look in the next one.
    k.ok("%%distribute\nbn_stats = torch.cat([b.flatten().float() for b in bn_auto.buffers()])")
    k.ok("""
r0, r1 = jupyter_scale.get_session().gather("bn_stats")
assert torch.equal(r0, r1), "buffers differ across ranks"
assert torch.equal(torch.cat([b.flatten().float() for b in bn_auto.buffers()]), r0)
assert torch.equal(bn_auto.frozen.weight, bn_base.frozen.weight), "frozen layer changed"
assert not close(bn_auto, bn_base)
""")
    k.ok("%%distribute --pull bn_seed\npass")
    k.ok("%%distribute --manual\nnet = jupyter_scale.wrap(bn_ddp)\n"
         + BN_LOOP.format(seed="").replace("loader = DataLoader(data, batch_size=32, shuffle=True)",
                                           "loader = jupyter_scale.shard(DataLoader(data, batch_size=32, shuffle=True), "
                                           "seed=bn_seed)"))
    k.ok("""
assert close(bn_auto, bn_ddp), (flat(bn_auto) - flat(bn_ddp)).abs().max()
ra = dict(bn_auto.named_buffers()); rd = dict(bn_ddp.named_buffers())
assert all(torch.allclose(ra[n].float(), rd[n].float(), atol=1e-5) for n in ra), "running stats differ from DDP's"
""")


def test_parameter_used_on_one_rank_only_does_not_hang(k):
    k.ok("""
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(4, 1)
    def forward(self, x, use_b):
        return self.b(x) if use_b else self.a(x)
torch.manual_seed(0)
branchy = Branchy()
""")
    k.ok("""%%distribute --timeout 60
opt = torch.optim.SGD(branchy.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad(set_to_none=True)
    branchy(torch.ones(2, 4), use_b=(rank == 0)).sum().backward()
    opt.step()
branchy_w = torch.cat([p.detach().flatten() for p in branchy.parameters()])
""")
    k.ok("r0, r1 = jupyter_scale.get_session().gather('branchy_w')\nassert torch.equal(r0, r1)")


def test_explicit_wrap_and_shard_are_not_doubled(k):
    k.ok("torch.manual_seed(0)\nm_w = Net()")
    k.ok("%%distribute" + COUNT_AVERAGING)
    k.ok("""%%distribute
net = jupyter_scale.wrap(m_w)
loader = jupyter_scale.shard(DataLoader(data, batch_size=64, shuffle=True))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
with averaging_counted() as averaged:
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
n_batches, averaged_by_us = len(loader), averaged.count
plain = copy.deepcopy(m_w)
plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
with averaging_counted() as averaged:  # the counter counts: the same step without DDP is averaged by us
    nn.functional.cross_entropy(plain(x), y).backward()
    plain_opt.step()
averaged_plain = averaged.count
""")
    assert k.value("jupyter_scale.get_session().gather('n_batches')") == [16, 16]  # not 8: sharded once
    assert k.value("jupyter_scale.get_session().gather('averaged_by_us')") == [0, 0]  # DDP averaged
    count = k.value("len(list(m_w.parameters()))")
    assert k.value("jupyter_scale.get_session().gather('averaged_plain')") == [count, count]


def test_loader_from_the_notebook_is_sharded_and_custom_samplers_are_left_alone(k):
    k.ok("nb_loader = DataLoader(data, batch_size=64, shuffle=True)")
    k.ok("%%distribute\nn_nb = len(nb_loader)")
    assert k.value("jupyter_scale.get_session().gather('n_nb')") == [16, 16]
    out = k.ok("""%%distribute
from torch.utils.data import SequentialSampler
custom = [DataLoader(data, batch_size=64, sampler=SequentialSampler(data)) for _ in range(2)]
n_custom = [sum(1 for _ in loader) for loader in custom]
""")
    assert out.stderr.count("with its own sampler is not sharded") == 1  # once, from rank 0, when iterated
    assert k.value("jupyter_scale.get_session().gather('n_custom')") == [[32, 32], [32, 32]]


def test_manual_mode_does_nothing_automatic(k):
    k.ok("""%%distribute --manual
loader = DataLoader(data, batch_size=64, shuffle=True)
n_manual = len(loader)
""")
    assert k.value("jupyter_scale.get_session().gather('n_manual')") == [32, 32]


def test_gradient_clipping_sees_averaged_gradients(k):
    k.ok("torch.manual_seed(0)\nc_auto = Net()\nc_ddp = copy.deepcopy(c_auto)")
    loop = """
opt = torch.optim.SGD(net.parameters(), lr=0.5)
for x, y in loader:
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)   # clips hard: every step
    opt.step()
"""
    k.ok("%%distribute\nnet = c_auto\nloader = DataLoader(data, batch_size=64, shuffle=True)" + loop
         + "clip_seed = loader.sampler.seed")
    k.ok("%%distribute --pull clip_seed\npass")
    k.ok("%%distribute --manual\nnet = jupyter_scale.wrap(c_ddp)\n"
         "loader = jupyter_scale.shard(DataLoader(data, batch_size=64, shuffle=True), seed=clip_seed)" + loop)
    k.ok("assert close(c_auto, c_ddp), (flat(c_auto) - flat(c_ddp)).abs().max()")


def test_closure_optimizers_average_inside_the_closure(k):
    k.ok("torch.manual_seed(0)\nlb = nn.Linear(32, 4)")
    k.ok("""%%distribute
opt = torch.optim.LBFGS(lb.parameters(), lr=0.5, max_iter=5)
xs, ys = data.tensors
x, y = xs[rank::world_size][:256], ys[rank::world_size][:256]   # different data per rank
def closure():
    opt.zero_grad()
    loss = nn.functional.cross_entropy(lb(x), y)
    loss.backward()
    return loss
for _ in range(2):
    opt.step(closure)
lb_w = torch.cat([p.detach().flatten() for p in lb.parameters()])
""")
    k.ok("r0, r1 = jupyter_scale.get_session().gather('lb_w')\nassert torch.equal(r0, r1)")


def test_samplers_and_shards_of_the_users_own_are_respected(k):
    k.ok("from torch.utils.data import SubsetRandomSampler\n"
         "held_in = DataLoader(data, batch_size=64, sampler=SubsetRandomSampler(list(range(128))))")
    k.ok("""%%distribute
seen_idx = sorted(i for b in DataLoader(jupyter_scale.shard(TensorDataset(torch.arange(1000))), batch_size=100)
                  for i in b[0].tolist())
n_held = sum(len(b[0]) for b in held_in)
""")
    s0, s1 = k.value("jupyter_scale.get_session().gather('seen_idx')")
    assert len(s0) == len(s1) == 500 and not set(s0) & set(s1)  # shard(dataset) is not sharded twice
    assert k.value("jupyter_scale.get_session().gather('n_held')") == [128, 128]  # its sampler kept


def test_a_live_ddp_wrapper_does_not_stop_averaging_of_its_module(k):
    k.ok("torch.manual_seed(0)\nwm = Net()")
    k.ok("%%distribute --manual\nwm_ddp = jupyter_scale.wrap(wm)")
    k.ok("""%%distribute
opt = torch.optim.SGD(wm.parameters(), lr=0.1)
for x, y in DataLoader(data, batch_size=64, shuffle=True):
    opt.zero_grad()
    nn.functional.cross_entropy(wm(x), y).backward()   # the module itself, not the wrapper
    opt.step()
wm_w = torch.cat([p.detach().flatten() for p in wm.parameters()])
""")
    k.ok("r0, r1 = jupyter_scale.get_session().gather('wm_w')\nassert torch.equal(r0, r1)")


MIXED = """
class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.l1 = nn.Linear(32, 64)
        self.l2 = nn.Linear(64, 4)
        self.extra = nn.Linear(64, 4)   # used on rank 0 only
    def forward(self, x, use_extra):
        h = torch.relu(self.l1(self.frozen(x)))
        return self.l2(h) + (self.extra(h) if use_extra else 0)

torch.manual_seed(0)
mixed_base = Mixed()
mixed_overlap, mixed_step = copy.deepcopy(mixed_base), copy.deepcopy(mixed_base)
"""

# One optimizer, one backward() per step: averaged during backward from the second step on.
# Rank 1 has no batch at step 3 (it calls no backward: it averages at the step), every step
# clips, and rank 0 alone uses a layer.
MIXED_LOOP = """%%distribute
import jupyter_scale.training as training
opt = torch.optim.AdamW({net}.parameters(), lr=0.01)
xs, ys = data.tensors
during_backward = []
for step in range(6):
    opt.zero_grad(set_to_none=True)
    if not (rank == 1 and step == 3):
        x, y = xs[64 * (2 * step + rank):][:64], ys[64 * (2 * step + rank):][:64]
        nn.functional.cross_entropy({net}(x, use_extra=rank == 0), y).backward()
    torch.nn.utils.clip_grad_norm_({net}.parameters(), 0.5)
    during_backward.append(training._active._overlap is not None)
    opt.step()
"""


def test_gradients_averaged_during_backward_equal_those_averaged_at_the_step(k):
    k.ok(MIXED)
    k.ok(MIXED_LOOP.format(net="mixed_overlap"))
    assert k.value("jupyter_scale.get_session().gather('during_backward')") == [[False] + [True] * 5] * 2
    k.ok("jupyter_scale.get_session().average_during_backward = False")
    try:
        k.ok(MIXED_LOOP.format(net="mixed_step"))
        assert k.value("jupyter_scale.get_session().gather('during_backward')") == [[False] * 6] * 2
    finally:
        k.ok("jupyter_scale.get_session().average_during_backward = True")
    k.ok("""
assert not close(mixed_overlap, mixed_base)
assert torch.equal(mixed_overlap.frozen.weight, mixed_base.frozen.weight)
assert not torch.equal(mixed_overlap.extra.weight, mixed_base.extra.weight)   # rank 0's gradient, halved
assert close(mixed_overlap, mixed_step, 1e-6), (flat(mixed_overlap) - flat(mixed_step)).abs().max()
""")
    k.ok("%%distribute\nw = torch.cat([p.detach().flatten() for p in mixed_overlap.parameters()])")
    k.ok("r0, r1 = jupyter_scale.get_session().gather('w')\nassert torch.equal(r0, r1)")


def test_ranks_that_call_backward_unequally_are_told_instead_of_averaging_wrong_gradients(k):
    k.ok("torch.manual_seed(0)\nuneven = Net()")
    out = k.cell("""%%distribute --timeout 60
opt = torch.optim.SGD(uneven.parameters(), lr=0.1)
xs, ys = data.tensors
for step in range(6):
    opt.zero_grad()
    for _ in range(2 if rank == 0 and step == 3 else 1):   # rank 0 alone accumulates at step 3
        nn.functional.cross_entropy(uneven(xs[:64]), ys[:64]).backward()
    opt.step()
""", timeout=120)
    assert not out.ok and out.error["ename"] == "RemoteError"
    assert "called backward() a different number of times" in out.error_text
    k.ok("%%distribute\nt = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2")  # the next cell works


def test_a_backward_with_create_graph_goes_back_to_averaging_at_the_step(k):
    k.ok("torch.manual_seed(0)\ncg = Net()")
    k.ok("""%%distribute
import warnings
import jupyter_scale.training as training
opt = torch.optim.SGD(cg.parameters(), lr=0.1)
xs, ys = data.tensors
cg_modes = []
for step in range(4):
    opt.zero_grad()
    x, y = xs[64 * (2 * step + rank):][:64], ys[64 * (2 * step + rank):][:64]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch's note on create_graph's reference cycle
        nn.functional.cross_entropy(cg(x), y).backward(create_graph=step == 2)
    cg_modes.append(training._active._overlap is not None)
    opt.step()
cg_w = torch.cat([p.detach().flatten() for p in cg.parameters()])
""")
    assert k.value("jupyter_scale.get_session().gather('cg_modes')") == [[False, True, False, False]] * 2
    k.ok("r0, r1 = jupyter_scale.get_session().gather('cg_w')\nassert torch.equal(r0, r1)")
