"""The state model (jupyter_scale.statesync): after a distributed cell the notebook holds what
a local run of the cell would have left, and the next cell sends what the notebook changed
since, in either direction.

The unit tests check the two halves alone (rank 0's digests; writing rank 0's value into the
notebook's object); the cluster tests run the cells of issue reports on the default engine (what the notebook
holds afterwards is the session's doing, whatever engine carries the bytes), each against
the same cells run locally in the same kernel.
"""

import pytest
import torch
import torch.nn as nn

from jupyter_scale import statesync

# -- unit: rank 0 sees what a cell changed -----------------------------------------------


def _snapshot(ns):
    return statesync.Snapshot(ns, list(ns))


def test_a_snapshot_finds_changes_made_in_place_and_nothing_else():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ns = {"net": net, "opt": opt, "log": [1], "cfg": {"lr": 0.1}, "t": torch.zeros(3), "n": 3, "same": [0]}
    snap = _snapshot(ns)
    net.eval()
    opt.param_groups[0]["lr"] = 0.001
    ns["log"].append(2)
    ns["cfg"]["lr"] = 0.2
    ns["t"].add_(1)
    changed, wrapped, _ = snap.changed([])
    assert sorted(changed) == ["cfg", "log", "net", "opt", "t"] and wrapped == []


@pytest.mark.parametrize("change", [
    lambda net: net[0].weight.requires_grad_(False),
    lambda net: setattr(net, "note", "x"),
    lambda net: net.__setitem__(1, nn.Linear(2, 1)),
])
def test_a_modules_structure_counts_its_flags_attributes_and_submodules(change):
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    ns = {"net": net}
    snap = _snapshot(ns)
    assert snap.changed([])[0] == []
    change(net)
    assert snap.changed([])[0] == ["net"]


def test_a_module_wrapped_by_the_cell_is_compared_as_itself():
    net = nn.Linear(2, 1)
    ns = {"net": net}
    snap = _snapshot(ns)
    ns["net"] = torch.compile(net, backend="eager")
    assert snap.changed(["net"])[:2] == ([], ["net"])
    net.eval()
    assert snap.changed(["net"])[:2] == (["net"], ["net"])


# -- unit: rank 0's value into the notebook's object ---------------------------------------


def test_adopt_writes_containers_in_place_and_keeps_what_they_hold():
    inner = [1]
    old = {"a": inner, "b": 2}
    assert statesync.adopt(old, {"a": [1, 5], "b": 3, "c": (1, 2)})
    assert old == {"a": [1, 5], "b": 3, "c": (1, 2)} and old["a"] is inner
    items = [{"k": 1}, 2]
    first = items[0]
    assert statesync.adopt(items, [{"k": 9}, 2, 3]) and items == [{"k": 9}, 2, 3] and items[0] is first


def test_adopt_an_optimizer_keeps_its_parameters_hooks_and_state_tensors():
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    net(torch.ones(1, 2)).sum().backward()
    opt.step()
    buffer = opt.state[net.weight]["momentum_buffer"]
    # Rank 0's optimizer over the same parameters (as the pull-back resolves them), stepped twice more.
    theirs = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    theirs.load_state_dict(opt.state_dict())
    theirs.state[net.weight]["momentum_buffer"] = buffer * 3
    theirs.param_groups[0]["lr"] = 0.025
    assert statesync.adopt(opt, theirs)
    assert opt.param_groups[0]["lr"] == 0.025 and opt.param_groups[0]["params"][0] is net.weight
    assert opt.state[net.weight]["momentum_buffer"] is buffer
    assert torch.equal(buffer, theirs.state[net.weight]["momentum_buffer"])
    assert sched.optimizer is opt and hasattr(opt.step, "_wrapped_by_lr_sched")


def test_adopt_a_module_keeps_its_submodules_and_takes_their_flags():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    first = net[0]
    theirs = nn.Sequential(nn.Linear(2, 2), nn.ReLU()).eval()
    theirs[0].weight.requires_grad_(False)
    assert statesync.adopt(net, theirs)
    assert net[0] is first and not net.training and not first.training
    assert not net[0].weight.requires_grad and torch.equal(net[0].weight, theirs[0].weight)


@pytest.mark.parametrize("old, new", [([1], (1,)), ((1, [2]), (2, [2])), (torch.zeros(2), torch.zeros(3)),
                                      (3, 4), (len, print)])
def test_adopt_refuses_what_cannot_take_the_value(old, new):
    assert not statesync.adopt(old, new)


# -- in a kernel: the cells of the reports, against the same cells run locally ----------

MODEL = """
torch.manual_seed(0)
sm_net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
sm_opt = torch.optim.SGD(sm_net.parameters(), lr=0.1, momentum=0.9)
sm_sched = torch.optim.lr_scheduler.StepLR(sm_opt, step_size=1, gamma=0.5)
sm_x = torch.linspace(-1, 1, 64).reshape(16, 4)
def sm_train(steps):
    for _ in range(steps):
        sm_opt.zero_grad()
        nn.functional.mse_loss(sm_net(sm_x), sm_x.sum(1, keepdim=True)).backward()
        sm_opt.step()
        sm_sched.step()
"""
# What the notebook can see of the model, its optimizer and scheduler.
STATE = ("(sm_net.training, [p.requires_grad for p in sm_net.parameters()], "
         "[round(v, 5) for p in sm_net.parameters() for v in p.detach().flatten().tolist()], "
         "sm_opt.param_groups[0]['lr'], len(sm_opt.state), sm_sched.last_epoch, "
         "[round(v, 5) for s in sm_opt.state.values() for v in s['momentum_buffer'].flatten().tolist()])")


def _same_as_local(k, setup, cells, seen):
    """Run `setup`, then `cells` ((distributed?, code), ...) locally, then again from `setup` with
    the distributed ones under %%distribute; `seen` after each cell must be the same."""
    runs = []
    for distributed in (False, True):
        k.ok(setup)
        values = []
        for on_workers, code in cells:
            k.ok(f"%%distribute\n{code}" if distributed and on_workers else code)
            values.append(k.value(seen))
        runs.append(values)
    assert runs[1] == runs[0]


@pytest.fixture(scope="module")
def k(kernel):
    kernel.ok("%%distribute --workers 2\npass")
    return kernel


@pytest.mark.parametrize("value", ["3", "'adam'", "True", "None", "0.5", "(1, 2)", "[1]"])
def test_a_value_set_back_in_the_notebook_is_what_the_next_cell_reads(k, value):
    """Re-running a config cell after a distributed cell changed the value."""
    cells = [(True, "epochs = 5"), (False, f"epochs = {value}"), (True, "seen_epochs = repr(epochs)")]
    _same_as_local(k, f"epochs = {value}", cells, "repr(epochs)")
    assert k.value("seen_epochs") == value


def test_flags_a_cell_changes_come_back_and_the_notebooks_setting_back_goes_out(k):
    cells = [(True, "sm_net.eval()\nsm_net[0].weight.requires_grad_(False)\nsm_opt.param_groups[0]['lr'] = 0.001"),
             (False, "sm_net.train()\nsm_net[0].weight.requires_grad_(True)\nsm_opt.param_groups[0]['lr'] = 0.1"),
             (True, "seen_flags = (sm_net.training, sm_net[0].weight.requires_grad, sm_opt.param_groups[0]['lr'])")]
    _same_as_local(k, MODEL, cells, STATE)
    assert k.value("seen_flags") == (True, True, 0.1)


def test_an_optimizers_lr_edited_in_the_notebook_keeps_the_workers_momentum_and_schedule(k):
    """Same numbers as the cells run locally: the state the workers trained comes back, and an
    edit of the notebook's learning rate sends it out again whole."""
    cells = [(True, "sm_train(3)"), (False, "sm_opt.param_groups[0]['lr'] = 0.01"), (True, "sm_train(2)")]
    _same_as_local(k, MODEL, cells, STATE)
    assert k.value("(len(sm_opt.state), sm_sched.last_epoch)") == (4, 5)


def test_a_model_left_in_eval_mode_by_the_cell_is_in_eval_mode_in_the_notebook(k):
    """mnist's test() ends with model.eval()."""
    _same_as_local(k, MODEL, [(True, "sm_train(1)\nsm_net.eval()\nwith torch.no_grad():\n    out = sm_net(sm_x)")],
                   STATE)
    assert k.value("sm_net.training") is False


def test_a_compiled_model_trains_the_notebooks_own_module(k):
    """`model = torch.compile(model)` in the cell: the weights come back into the notebook's
    module, which its name keeps (the eager backend: no compiler needed for the wrapper)."""
    k.ok(MODEL + "sm_original = sm_net")
    k.ok("%%distribute\nsm_net = torch.compile(sm_net, backend='eager')\nsm_train(2)")
    assert k.value("sm_net is sm_original") is True
    k.ok("%%distribute\nsm_workers = torch.cat([p.detach().flatten() for p in sm_net.parameters()])")
    k.ok("assert torch.equal(sm_workers, torch.cat([p.detach().flatten() for p in sm_net.parameters()]))")
    k.ok(MODEL)
    k.ok("sm_net = torch.compile(sm_net, backend='eager')\nsm_train(2)\n"
         "sm_local = torch.cat([p.detach().flatten() for p in sm_net.parameters()])")
    assert k.value("torch.allclose(sm_local, sm_workers, atol=1e-6)") is True


def test_a_value_bound_past_the_limit_stays_on_the_workers_and_the_cell_says_so(k):
    k.ok("jupyter_scale.get_session().bring_back_limit = 1 << 20")
    try:
        out = k.ok("%%distribute\nbig_made = torch.zeros(1 << 19)\nsmall_made = 1")
    finally:
        k.ok("jupyter_scale.get_session().bring_back_limit = 256 << 20")
    assert "'big_made' (2.1 MB) stays on the workers" in out.stderr, out.stderr
    assert k.value("('big_made' in globals(), small_made)") == (False, 1)
    k.ok("%%distribute --pull big_made\npass")
    assert k.value("big_made.numel()") == 1 << 19


def test_a_name_the_cell_deletes_is_deleted_in_the_notebook(k):
    k.ok("doomed = [1]")
    k.ok("%%distribute\ndel doomed")
    assert k.value("'doomed' in globals()") is False
    k.ok("doomed = 2")
    out = k.ok("%%distribute\nseen_doomed = doomed")
    assert "replace" not in out.stderr and k.value("seen_doomed") == 2


def test_ranks_that_decide_apart_are_said_and_named(k):
    """ReduceLROnPlateau stepped on each rank's own shard of a validation metric: the ranks'
    learning rates part, then their weights; the cell says which and where."""
    k.ok(MODEL + "sm_plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(sm_opt, factor=0.5, patience=0)\n"
         "sm_val = TensorDataset(torch.arange(8.))")
    out = k.ok("%%distribute\nsm_train(1)")
    assert "disagree" not in out.stderr, out.stderr
    out = k.ok("""%%distribute
metric = float(sum(x.sum() for (x,) in DataLoader(sm_val, batch_size=4)))  # rank 0: 12, rank 1: 16
sm_plateau.step(14.0)
sm_plateau.step(metric)
sm_opt.zero_grad()
nn.functional.mse_loss(sm_net(sm_x), sm_x.sum(1, keepdim=True)).backward()
sm_opt.step()
""")
    assert "the ranks disagree after this cell" in out.stderr, out.stderr
    assert "sm_opt's lr differs: rank 0 0.05, rank 1 0.025" in out.stderr, out.stderr
    assert "sm_net's weights differ on rank 1 from rank 0's" in out.stderr, out.stderr
    assert "dist.all_reduce" in out.stderr and k.value("sm_opt.param_groups[0]['lr']") == 0.05


def test_a_model_the_cell_changes_then_rebinds_is_changed_in_the_notebook_too(k):
    """`net.load_state_dict(...); net = Net()`: locally the old model, which other names hold,
    keeps the loaded weights."""
    k.ok(MODEL + "sm_holder = {'net': sm_net}")
    k.ok("%%distribute\nwith torch.no_grad():\n    sm_net[0].weight.fill_(1.0)\nsm_net = nn.Linear(1, 1)")
    assert k.value("bool((sm_holder['net'][0].weight == 1).all()) and isinstance(sm_net, nn.Linear)") is True
