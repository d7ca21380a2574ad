"""A differential checker of the state model: random notebooks, run locally and distributed.

A sequence is a list of cells drawn from a grammar of what notebooks do between and inside
distributed cells: bind and rebind plain values (often to an earlier value, as re-running a
config cell does), change them in place, make and change a model (`eval()`, `train()`,
`requires_grad_`, `.data` writes, `load_state_dict`), its optimizer (`param_groups`) and
scheduler, train it through a notebook function that reads them as globals, call a notebook
function whose global the notebook rebinds, and wrap the model with `torch.compile` inside
a distributed cell. Each sequence runs in a plain local kernel and, with some of its cells
under `%%distribute`, in a kernel with a 2-worker cluster; after every cell what the notebook
can see of the names (values, flags, weights, optimizer and scheduler state, which object
holds which) must be the same in both.

Every rank trains on the whole batch, so the averaged gradients equal the local ones exactly
and the comparison needs no tolerance beyond printing floats to 6 places.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

POOL = ["epochs", "label", "flag", "maybe", "ratio", "pair", "items", "alias", "cfg", "t", "k", "scaled", "net",
        "holder", "opt", "sched"]

SETUP = '''
import torch, torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 1)
        with torch.no_grad():  # the same weights wherever it is made (no RNG)
            for i, p in enumerate(self.parameters()):
                p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (0.5 + 0.1 * i))
    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

X = torch.linspace(-1, 1, 32).reshape(8, 4)

def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        (net(X) - X.sum(1, keepdim=True)).pow(2).mean().backward()
        opt.step()

def scale():
    return k * 2

def bump():
    items.append(len(items))

def _canon(v):
    if isinstance(v, nn.Module):
        v = getattr(v, "_orig_mod", v)
        return ("module", type(v).__name__, [m.training for m in v.modules()],
                [(n, p.requires_grad, _canon(p.detach())) for n, p in v.named_parameters()])
    if isinstance(v, torch.optim.Optimizer):
        params = [p for g in v.param_groups for p in g["params"]]
        mine = list(getattr(globals().get("net"), "parameters", lambda: [])())
        return ("optimizer", [{key: _canon(x) for key, x in g.items() if key != "params"} for g in v.param_groups],
                [[i for i, q in enumerate(mine) if q is p] for p in params],
                [(i, {key: _canon(x) for key, x in v.state[p].items()}) for i, p in enumerate(params) if p in v.state])
    if isinstance(v, torch.optim.lr_scheduler.LRScheduler):
        return ("scheduler", v.optimizer is globals().get("opt"),
                {key: _canon(x) for key, x in v.state_dict().items() if key != "_get_lr_called_within_step"})
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.requires_grad, [round(x, 6) for x in v.detach().flatten().tolist()])
    if isinstance(v, float):
        return round(v, 9)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, [_canon(x) for x in v])
    if isinstance(v, dict):
        return ("dict", [(key, _canon(x)) for key, x in v.items()])
    return (type(v).__name__, repr(v))

def _fingerprint():
    # Which object is which, too; a torch.compile wrapper as the module it wraps (the
    # notebook's name keeps the module after a distributed cell wrapped it: documented).
    present = [name for name in POOL if name in globals()]
    value = {name: getattr(globals()[name], "_orig_mod", globals()[name]) for name in present}
    atoms = (int, float, str, bool, type(None), tuple)
    shared = [(a, b) for i, a in enumerate(present) for b in present[i + 1:]
              if value[a] is value[b] and not isinstance(value[a], atoms)]
    inside = [(a, b) for a in present for b in present if isinstance(value[a], dict) and not isinstance(value[b], atoms)
              and any(getattr(v, "_orig_mod", v) is value[b] for v in value[a].values())]
    return repr([(name, _canon(globals()[name])) for name in present] + [shared, inside])

def _reset():
    for name in POOL:
        globals().pop(name, None)
'''.replace("POOL", repr(POOL))


@dataclass
class _Facts:
    """What the generator knows of the notebook it is writing, to write only cells that run."""

    defined: set[str] = field(default_factory=set)
    compiled: bool = False  # `net` is a torch.compile wrapper in a local run


def _statement(r: random.Random, facts: _Facts, distributed: bool) -> str | None:
    """One statement, or None when the one drawn cannot run in this state."""
    d = facts.defined
    small = r.choice([0, 1, 2, 3])
    lr = r.choice([0.1, 0.05, 0.01])
    choices = [
        ("epochs", None, f"epochs = {small}"),
        ("epochs", "epochs", "epochs += 1"),
        ("label", None, f"label = {r.choice(['adam', 'sgd'])!r}"),
        ("flag", None, f"flag = {r.choice([True, False])}"),
        ("maybe", None, r.choice(["maybe = None", f"maybe = {small}"])),
        ("ratio", None, f"ratio = {r.choice([0.5, 0.25])}"),
        ("pair", None, f"pair = ({small}, {r.choice([0, 1])})"),
        ("items", None, f"items = [{small}, 1]"),
        ("items", "items", f"items.append({small})"),
        ("items", "items", f"items[0] = {small}"),
        ("items", "items", "bump()"),
        ("alias", "items", "alias = items"),
        ("alias", "alias", f"alias.append({small})"),
        ("cfg", None, f"cfg = {{'lr': {lr}, 'n': {small}}}"),
        ("cfg", "cfg", f"cfg['lr'] = {lr}"),
        ("cfg", "cfg", f"cfg['extra'] = [{small}]"),
        ("t", None, f"t = torch.arange(4.) * {small}"),
        ("t", "t", f"t.add_({small})"),
        ("t", "t", "t.data.mul_(2)"),
        ("k", None, f"k = {small}"),
        ("scaled", "k", "scaled = scale()"),
        ("net", None, "net = Net()"),
        ("net", "net", "net.eval()"),
        ("net", "net", "net.train()"),
        ("net", "net", f"net.fc1.weight.requires_grad_({r.choice([True, False])})"),
        ("net", "net", "net.fc2.weight.data.mul_(0.5)"),
        ("net", "net", "net.load_state_dict(Net().state_dict())"),
        ("opt", "net", f"opt = torch.optim.SGD(net.parameters(), lr={lr}, momentum=0.9)"),
        ("opt", "opt", f"opt.param_groups[0]['lr'] = {lr}"),
        ("opt", "net", f"opt = torch.optim.Adam(net.parameters(), lr={lr})"),
        ("holder", "net", "holder = {'net': net}"),
        ("holder", "holder", "holder['net'].eval()"),
        ("label", "label", "del label"),
        ("sched", "opt", "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)"),
        # Gradients (`.grad`) stay on the workers (README: what differs): a step starts from none.
        ("sched", "sched", "opt.zero_grad()\nopt.step()\nsched.step()"),
        ("net", "opt", f"train({r.choice([1, 2])})"),
        ("net", "net", "net = torch.compile(net, backend='eager')"),
    ]
    bound, needs, code = r.choice(choices)
    if needs is not None and needs not in d:
        return None
    if code == "del label":
        d.discard("label")
        return code
    if code == "train(1)" or code == "train(2)":
        if "net" not in d:
            return None
    if code.startswith("net = torch.compile"):
        if not distributed or facts.compiled:
            return None  # a distributed cell wraps it; the notebook's name keeps the module
        facts.compiled = True
    elif code.startswith("net.load_state_dict") and facts.compiled:
        return None  # the wrapper's keys carry its prefix locally
    elif code == "net = Net()":
        facts.compiled = False
    d.add(bound)
    return code


def sequence(seed: int, steps: int | None = None) -> list[tuple[bool, str]]:
    """A notebook: (distributed?, cell source), in order."""
    r = random.Random(seed)
    facts = _Facts()
    cells = []
    for _ in range(steps or r.randint(4, 8)):
        distributed = r.random() < 0.5
        lines: list[str] = []
        count = r.randint(1, 3)
        while len(lines) < count:
            stmt = _statement(r, facts, distributed)
            if stmt is not None:
                lines.append(stmt)
        cells.append((distributed, "\n".join(lines)))
    return cells


def run_sequence(local, dist, cells: list[tuple[bool, str]]) -> str | None:
    """Run `cells` in the `local` kernel and the `dist` one (tests/kernel.py's Kernel, SETUP
    run in both, a cluster in `dist`): the first difference, described, or None."""
    for kernel in (local, dist):
        kernel.ok("_reset()")
    for i, (distributed, code) in enumerate(cells):
        ran_local = local.cell(code)
        ran_dist = dist.cell(f"%%distribute\n{code}" if distributed else code)
        if ran_local.ok != ran_dist.ok:
            return (f"cell {i} {'failed' if ran_dist.ok else 'passed'} locally but not distributed:\n"
                    f"{ran_local.error_text or ran_dist.error_text}")
        seen = [k.value("_fingerprint()") for k in (local, dist)]
        if seen[0] != seen[1]:
            return f"after cell {i}:\n  local:       {seen[0]}\n  distributed: {seen[1]}"
    return None


def describe(cells: list[tuple[bool, str]]) -> str:
    return "\n".join(f"--- {'%%distribute' if d else 'notebook'}\n{code}" for d, code in cells)
