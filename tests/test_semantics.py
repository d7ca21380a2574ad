"""Same as local: a distributed cell sees the notebook's names as the notebook's own code does.

Each case is a notebook cell (`setup`) and a cell body run twice in one real kernel: once
locally, once under `%%distribute --workers 2`, each after running `setup` again so that
both start from the same notebook state. The names listed are then compared one by one:
the local run's values against rank 0's on the workers (brought back with `--pull`). Every
difference that remains between the two is listed in the README and asserted here as such.
"""

import pytest

# (id, setup, cell, names compared)
CASES = [
    ("function-reads-global-the-cell-rebinds",
     "step_size = 0.1\ndef show():\n    return step_size\n",
     "step_size = 0.5\nshown = show()\n",
     ["shown", "step_size"]),
    ("function-reads-global-only-the-cell-defines",
     "def train_lr():\n    return lr_only_in_cell * 2\n",
     "lr_only_in_cell = 0.25\ntrained = train_lr()\n",
     ["trained"]),
    ("global-statement-in-notebook-function",
     "counter = 0\ndef bump():\n    global counter\n    counter += 1\n",
     "bump()\nbump()\nseen = counter\n",
     ["seen", "counter"]),
    ("function-returns-the-same-object",
     "net = nn.Linear(2, 2)\ndef get_net():\n    return net\n",
     "same = get_net() is net\n",
     ["same"]),
    ("closure-and-global",
     "def make_scaler(k):\n    def scale(x):\n        return x * k * factor\n    return scale\n"
     "factor = 2\nscaler = make_scaler(3)\n",
     "factor = 10\nscaled = scaler(1)\n",
     ["scaled"]),
    ("class-methods-read-globals",
     "offset = 1\nclass Adder:\n    def __init__(self, n):\n        self.n = n\n"
     "    def add(self, x):\n        return x + self.n + offset\nadder = Adder(2)\n",
     "offset = 100\nadded = (adder.add(1), Adder(5).add(0), isinstance(adder, Adder))\n",
     ["added"]),
    ("transitive-functions",
     "def inner():\n    return base + 1\ndef outer():\n    return inner() * 2\nbase = 1\n",
     "base = 10\nouter_value = outer()\n",
     ["outer_value"]),
    ("notebook-function-mutates-notebook-list",
     "events = []\ndef record(x):\n    events.append(x)\n",
     "record(1)\nrecord(2)\nevent_count = len(events)\n",
     ["event_count", "events"]),
    ("in-place-mutation-in-the-cell",
     "log = []\nconfig = {'lr': 0.1}\n",
     "log.append(1)\nconfig['lr'] = 0.2\nsnapshot = (list(log), dict(config))\n",
     ["snapshot", "log", "config"]),
    ("module-class-built-from-another-notebook-class",
     "class Block(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
     "        self.lin = nn.Linear(4, width)\n    def forward(self, x):\n        return self.lin(x)\n"
     "class Tower(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
     "        self.blocks = nn.ModuleList([Block() for _ in range(depth)])\n"
     "width, depth = 3, 2\n",
     "width = 5\ntower_shapes = [tuple(p.shape) for p in Tower().parameters()]\n",
     ["tower_shapes"]),
    ("default-arguments-are-bound-at-definition",
     "scale_default = 2\ndef times(x, k=scale_default):\n    return x * k\n",
     "scale_default = 7\ntimes_value = (times(3), times(3, scale_default))\n",
     ["times_value"]),
    ("lambda-and-comprehension-read-globals",
     "bias = 1\nadd_bias = lambda x: x + bias\ndef squares(n):\n    return [i * i + bias for i in range(n)]\n",
     "bias = 3\nlam = (add_bias(1), squares(3))\n",
     ["lam"]),
    # An object two names hold is one object on the workers too.
    ("scheduler-steps-the-optimizer-the-loop-uses",
     "sched_model = nn.Linear(2, 1)\nsched_opt = torch.optim.SGD(sched_model.parameters(), lr=1.0)\n"
     "sched = torch.optim.lr_scheduler.StepLR(sched_opt, step_size=1, gamma=0.5)\n",
     "for _ in range(2):\n    sched_opt.step()\n    sched.step()\n"
     "lrs = (sched_opt.param_groups[0]['lr'], sched.get_last_lr()[0], sched.optimizer is sched_opt)\n",
     ["lrs"]),
    ("container-holds-another-names-object",
     "items = []\nholder = {'items': items}\n",
     "holder['items'].append(1)\nshared = (holder['items'] is items, len(items))\n",
     ["shared"]),
    ("function-kept-in-a-list",
     "def callback():\n    return 1\ncallbacks = [callback]\n",
     "same_callback = callbacks[0] is callback\n",
     ["same_callback"]),
]


@pytest.fixture(scope="module")
def k(kernel):
    kernel.ok("%%distribute --workers 2\npass")
    return kernel


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_as_local(k, case):
    _, setup, cell, names = case
    k.ok(setup)
    k.ok("_before_local = set(globals())")
    k.ok(cell)
    local = {n: k.value(n) for n in names}
    # The same notebook state again: what the local run bound is gone, the setup's are new objects.
    k.ok("for _name in set(globals()) - _before_local - {'_before_local'}:\n    del globals()[_name]")
    k.ok(setup)
    out = k.ok(f"%%distribute --pull {','.join(names)}\n{cell}")
    assert "Traceback" not in out.stderr, out.stderr
    distributed = {n: k.value(n) for n in names}
    assert distributed == local


def test_notebook_objects_mutated_on_the_workers_come_back_into_the_notebooks_objects(k):
    """As a local run: rank 0's changes land in the notebook's own object (others holding it see
    them), and the names the cell binds come back without --pull."""
    k.ok("ledger = []\nbook = {'ledger': ledger}")
    k.ok("%%distribute\nledger.append(rank)\nledger_len = len(ledger)")
    assert k.value("(ledger, book['ledger'] is ledger, ledger_len)") == ([0], True, 1)


def test_model_used_only_inside_a_notebook_function_is_pulled_back(k):
    k.ok("""
torch.manual_seed(0)
fn_model = nn.Linear(4, 1)
fn_opt = torch.optim.SGD(fn_model.parameters(), lr=0.1)
fn_data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
def train_epoch():
    for x, y in DataLoader(fn_data, batch_size=32):
        fn_opt.zero_grad()
        nn.functional.mse_loss(fn_model(x), y).backward()
        fn_opt.step()
before = fn_model.weight.detach().clone()
""")
    k.ok("%%distribute\ntrain_epoch()")
    k.ok("assert not torch.equal(fn_model.weight, before), 'the notebook model did not come back'")
    k.ok("%%distribute\nfn_weights = fn_model.weight.detach().clone()")
    k.ok("""
w = jupyter_scale.get_session().gather("fn_weights")
assert torch.equal(w[0], fn_model.weight.detach()) and torch.equal(w[1], w[0])
""")


def test_a_pulled_optimizer_and_scheduler_drive_the_notebooks_model(k):
    k.ok("torch.manual_seed(0)\npo_model = nn.Linear(4, 1)\n"
         "po_opt = torch.optim.SGD(po_model.parameters(), lr=0.1, momentum=0.9)\n"
         "po_sched = torch.optim.lr_scheduler.StepLR(po_opt, step_size=1, gamma=0.5)")
    out = k.ok("%%distribute --pull po_opt,po_sched\nx = torch.randn(8, 4)\n"
               "nn.functional.mse_loss(po_model(x), x.sum(1, keepdim=True)).backward()\n"
               "po_opt.step()\npo_sched.step()")
    assert "Warning" not in out.stderr, out.stderr  # torch's "optimizer.step() has been overridden"
    assert k.value("po_opt.param_groups[0]['params'][0] is po_model.weight") is True
    assert k.value("po_sched.optimizer is po_opt") is True
    assert k.value("(po_opt.param_groups[0]['lr'], len(po_opt.state))") == (0.05, 2)
    k.ok("before = po_model.weight.detach().clone()\npo_model(torch.ones(1, 4)).sum().backward()\npo_opt.step()\n"
         "assert not torch.equal(before, po_model.weight), 'the pulled optimizer steps another model'")


def test_a_scheduler_the_workers_rebuilt_comes_back_and_a_later_notebook_one_goes_out(k):
    k.ok("""
sched_model = nn.Linear(2, 1)
sched_opt = torch.optim.SGD(sched_model.parameters(), lr=1.0)
sched = torch.optim.lr_scheduler.StepLR(sched_opt, step_size=1, gamma=0.5)   # a dry run
""")
    k.ok("""%%distribute
sched_opt = torch.optim.SGD(sched_model.parameters(), lr=1.0)
sched = torch.optim.lr_scheduler.StepLR(sched_opt, step_size=1, gamma=0.5)
for _ in range(3):
    sched_opt.step()
    sched.step()
""")
    assert k.value("(sched.get_last_lr()[0], sched.last_epoch, sched.optimizer is sched_opt)") == (0.125, 3, True)
    assert k.value("sched_opt.param_groups[0]['params'][0] is sched_model.weight") is True
    k.ok("sched = torch.optim.lr_scheduler.StepLR(sched_opt, step_size=1, gamma=0.5)")
    out = k.ok("%%distribute\nsched_state = (sched.get_last_lr()[0], sched.last_epoch)")
    assert "replace" not in out.stderr  # the workers held the notebook's value: nothing of theirs is lost
    assert k.value("sched_state") == (0.125, 0)  # a new StepLR over the stepped optimizer


def test_a_name_left_on_the_workers_then_defined_in_the_notebook_is_sent_with_a_note(k):
    """A DataLoader is each rank's own (split across them): it stays on the workers."""
    k.ok("%%distribute\nfresh_loader = DataLoader(list(range(8)), batch_size=2)")
    assert k.value("'fresh_loader' in globals()") is False
    k.ok("fresh_loader = DataLoader(list(range(4)), batch_size=4)")
    out = k.ok("%%distribute\nseen_batches = len(fresh_loader)")
    assert "the notebook's 'fresh_loader' replaces the workers'" in out.stderr, out.stderr
    assert k.value("seen_batches") == 1
    # Unchanged since: the workers' value stands, nothing is said.
    out = k.ok("%%distribute\nseen_batches = len(fresh_loader)")
    assert "replace" not in out.stderr


def test_init_process_group_imported_by_name_is_a_no_op(k):
    k.ok("""
from torch.distributed import init_process_group, destroy_process_group
import os
def setup_ddp():
    init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
""")
    k.ok("""%%distribute
from torch.distributed import init_process_group as ipg
ipg("gloo")
setup_ddp()
init_process_group(backend="gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == world_size
""")


def test_torch_save_of_a_notebook_class_on_the_workers_loads_in_the_notebook(k, tmp_path):
    path = tmp_path / "saved-{}.pt"
    k.ok("""
class SavedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
    def forward(self, x):
        return self.lin(x)
saved_net = SavedNet()
""")
    k.ok(f"%%distribute\ntorch.save(saved_net, {str(path)!r}.format(rank))\n"
         f"torch.save(SavedNet(), {str(path)!r}.format(rank) + '.fresh')")
    k.ok(f"""
loaded = torch.load({str(path)!r}.format(0), weights_only=False)
assert type(loaded) is SavedNet
assert torch.equal(loaded.lin.weight, saved_net.lin.weight)
assert type(torch.load({str(path)!r}.format(1) + '.fresh', weights_only=False)) is SavedNet
""")


def test_status_names_the_notebook_cell(k):
    count = k.value("get_ipython().execution_count")
    k.ok("%%distribute\npass")
    out = k.ok("%scale")
    last = [line for line in out.stdout.splitlines() if "last run" in line][0]
    assert f"In [{count}]" in last, last
