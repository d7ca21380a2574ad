"""Unit tests: which names a cell needs, serialization by value, change detection."""

import threading
import warnings

import numpy as np
import pytest
import torch

from jupyter_scale import byvalue, cellnames, shipping, tensorbytes, writewatch
from jupyter_scale.errors import ShippingError
from jupyter_scale.receiving import Receiver


@pytest.mark.parametrize(
    "source, expected",
    [
        ("y = x + 1", ["x"]),
        ("x = 1\ny = x", []),
        ("x = x + 1", ["x"]),  # read before written
        ("x += 1", ["x"]),
        ("for a, b in loader:\n    print(a, b, model)", ["loader", "print", "model"]),
        ("if flag:\n    z = 1\nprint(z)", ["flag", "print", "z"]),  # maybe-unbound: ship if present
        ("import torch\ntorch.zeros(1)", []),
        ("from torch import nn\nnn.Linear", []),
        ("def f(a):\n    return a + w\nf(1)", ["w"]),  # read inside a function at call time
        ("def f():\n    return w\nw = 2\nf()", []),  # ...of a name the cell itself binds
        ("g = lambda t: t * scale", ["scale"]),
        ("vals = [v * k for v in items]", ["items", "k"]),
        ("d = {k: v for k, v in pairs.items() if k in keep}", ["pairs", "keep"]),
        ("class A(Base):\n    n = size\n", ["Base", "size"]),
        ("try:\n    r = risky()\nexcept Err as e:\n    print(e)", ["risky", "Err", "print"]),
        ("with ctx() as c:\n    c.run(data)", ["ctx", "data"]),
        ("del old", ["old"]),
        ("(n := count) and n", ["count"]),
        # Comprehensions run where they stand: a later binding does not hide the read.
        ("xs = torch.stack([xs[i] * 2 for i in range(3)])", ["torch", "range", "xs"]),
        # Methods do not see their class's names, so their reads are global reads.
        ("class Ev:\n    accuracy = 0\n    def score(self, y):\n        return accuracy(y)", ["accuracy"]),
        ("def f(x: Tensor) -> Out:\n    return x", ["Tensor", "Out"]),  # annotations run at def
        ("n: Size = 3", ["Size"]),
    ],
)
def test_free_names(source, expected):
    assert cellnames.free_names(source) == expected


class Link:
    """A kernel-side Shipper and a worker-side Receiver, frames passed as bytes."""

    def __init__(self):
        self.shipper = shipping.Shipper()
        self.receiver = Receiver()
        self.namespace = {}

    def send(self, **values):
        shipment = self.shipper.prepare(self.shipper.plan(values))
        request = {"names": shipment.names, "updates": shipment.updates, "forget": shipment.forget}
        frames = [bytes(memoryview(f)) for f in shipment.frames]  # the transport may hand back read-only bytes
        self.namespace.update(self.receiver.receive(request, frames))
        self.shipper.commit(shipment)
        return shipment


def roundtrip(value):
    link = Link()
    link.send(v=value)
    return link.namespace["v"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool,
                                   torch.complex64])
def test_tensor_roundtrip_by_buffer(dtype):
    t = (torch.arange(24) % 3).to(dtype).reshape(2, 3, 4)
    shipment = Link().shipper.prepare(shipping.Shipper().plan({"t": t}))
    assert shipment.nbytes["t"] >= t.numel() * t.element_size()
    back = roundtrip(t)
    assert back.dtype == dtype and torch.equal(back, t)
    before = t.clone()
    back.view(-1)[0] = 1  # owned, writable memory
    assert torch.equal(t, before)


def test_views_send_only_their_elements_and_keep_values():
    base = torch.arange(100_000.0)
    view = base[10:20]
    shipment = shipping.Shipper().prepare(shipping.Shipper().plan({"v": view}))
    assert shipment.nbytes["v"] < 10_000
    assert torch.equal(roundtrip(view), view)
    strided = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(roundtrip(strided), strided)
    assert roundtrip(torch.zeros(0, 5)).shape == (0, 5)


def test_parameters_and_notebook_classes_travel_by_value():
    class Local(torch.nn.Module):  # defined here, not importable by the receiver
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

    m = Local()
    back = roundtrip(m)
    assert type(back).__name__ == "Local"
    assert isinstance(back.lin.weight, torch.nn.Parameter) and back.lin.weight.requires_grad
    assert torch.equal(back.lin.weight, m.lin.weight)


def test_a_model_and_its_optimizer_share_parameters_on_the_workers():
    link = Link()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    link.send(model=model, opt=opt)
    wm, wo = link.namespace["model"], link.namespace["opt"]
    assert wo.param_groups[0]["params"][0] is wm.weight
    # ...also when they travel in different cells.
    link2 = Link()
    link2.send(model=model)
    link2.send(opt=opt)
    assert link2.namespace["opt"].param_groups[0]["params"][0] is link2.namespace["model"].weight


def test_unchanged_values_are_not_sent_again():
    link = Link()
    big = torch.zeros(1_000_000)
    first = link.send(big=big, n=1)
    assert first.nbytes["big"] >= 4_000_000
    second = link.send(big=big, n=1)
    assert second.names == [] and sorted(second.skipped) == ["big", "n"] and second.frames == []
    third = link.send(big=big, n=2)
    assert [n for n, _ in third.names] == ["n"] and sum(third.nbytes.values()) < 1000


def test_changed_tensor_bytes_are_updated_in_place():
    link = Link()
    model = torch.nn.Linear(4, 4)
    link.send(model=model)
    held = link.namespace["model"]
    held_weight = held.weight
    with torch.no_grad():
        model.weight.add_(1)
    model.bias.data.mul_(0)  # through .data: bypasses torch's version counter
    shipment = link.send(model=model)
    assert shipment.names == [] and len(shipment.updates) == 2  # only the tensors travel
    assert link.namespace["model"] is held and held.weight is held_weight
    assert torch.equal(held.weight, model.weight) and torch.equal(held.bias, model.bias)


def test_structural_changes_resend_the_name():
    link = Link()
    model = torch.nn.Linear(2, 2)
    link.send(model=model)
    model.tag = "new attribute"
    assert [n for n, _ in link.send(model=model).names] == ["model"]
    assert link.namespace["model"].tag == "new attribute"
    same_looking = torch.nn.Linear(2, 2)
    same_looking.load_state_dict(model.state_dict())
    assert [n for n, _ in link.send(model=same_looking).names] == ["model"]  # a new object
    values = [1, 2]
    link.send(values=values)
    values.append(3)
    assert link.send(values=values).names and link.namespace["values"] == [1, 2, 3]
    import numpy as np

    a = np.zeros(100)
    link.send(a=a)
    a[3] = 1  # numpy arrays are hashed with the structure
    link.send(a=a)
    assert link.namespace["a"][3] == 1


def test_tensors_the_notebook_dropped_are_forgotten_by_the_workers():
    link = Link()
    t = torch.ones(10)
    link.send(t=t)
    assert len(link.receiver.tensors) == 1
    del t
    import gc

    gc.collect()
    shipment = link.send(other=1)
    assert shipment.forget and link.receiver.tensors == {}


def test_a_discarded_shipment_is_sent_again():
    shipper = shipping.Shipper()
    t = torch.ones(10)
    shipper.prepare(shipper.plan({"t": t}))
    shipper.discard()
    again = shipper.prepare(shipper.plan({"t": t}))
    assert [n for n, _ in again.names] == ["t"]


def test_mark_synced_after_pull_back_sends_nothing():
    link = Link()
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    link.send(model=model, opt=opt)
    with torch.no_grad():
        model.weight.mul_(2)  # what a pull-back of trained weights does
    link.shipper.mark_synced("model", model)
    shipment = link.send(model=model, opt=opt)
    assert shipment.names == [] and shipment.updates == []
    pulled = torch.arange(5.0)  # a --pull value: the registry does not track it
    link.shipper.mark_synced("pulled", pulled)
    assert link.shipper.prepare(link.shipper.plan({"pulled": pulled})).names == []
    pulled.add_(1)
    assert [n for n, _ in link.shipper.prepare(link.shipper.plan({"pulled": pulled})).names] == ["pulled"]


class Marked(torch.Tensor):
    """A tensor subclass (as quantized weights are): pickled into the structure, bytes and all."""


def pull_back(shipper, plan, module, trained):
    """What Puller.apply does with rank 0's state dict `trained`: load what differs,
    then record that the workers hold what the notebook now does."""
    state = trained.state_dict()
    same, digests, _ = byvalue.drop_unchanged(state, byvalue.state_digests(module, plan.tensors))
    own = module.state_dict(keep_vars=True)
    state.update((key, own[key]) for key in same)
    with torch.no_grad():
        module.load_state_dict(state)
    targets = module.state_dict(keep_vars=True)
    shipper.mark_synced("m", module, [(targets[k], d) for k, d in digests.items() if k in targets], plan)


@pytest.mark.parametrize("extra", ["none", "subclass buffer"])
def test_a_pull_back_keeps_the_planned_structure_only_when_it_wrote_plain_tensors(extra):
    """The plan's structure is reused after a pull-back (no second pickle of the model)
    unless the load wrote something pickled into the structure: then the notebook's
    next change of it must still be sent."""
    def make():
        m = torch.nn.Linear(4, 4)
        if extra == "subclass buffer":
            m.register_buffer("q", torch.zeros(4).as_subclass(Marked))
        return m
    module, link = make(), Link()
    link.send(m=module)
    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    plan = link.shipper.plan({"m": module})
    link.shipper.commit(link.shipper.prepare(plan))  # the cell that trains it
    trained = make()
    trained.load_state_dict(saved)
    with torch.no_grad():
        trained.weight.add_(1)
        if extra == "subclass buffer":
            trained.q.fill_(5)
    pull_back(link.shipper, plan, module, trained)
    assert torch.equal(module.weight, trained.weight)
    again = link.shipper.prepare(link.shipper.plan({"m": module}))
    assert again.names == [] and again.updates == [], "what came back is not sent out again"
    with torch.no_grad():
        module.load_state_dict(saved)  # the notebook goes back to its checkpoint
    back = link.shipper.prepare(link.shipper.plan({"m": module}))
    assert back.names or back.updates, "the checkpoint's values must reach the workers"


def test_rank_0_sends_back_only_the_state_it_does_not_share_with_the_notebook():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight
            self.norm = torch.nn.LayerNorm(4)

    notebook = Tied()
    planned = shipping.Shipper({"m": notebook}).plan({"m": notebook})
    digests = byvalue.state_digests(notebook, planned.tensors)
    assert set(digests) == set(notebook.state_dict())
    workers = Tied()
    workers.load_state_dict(notebook.state_dict())
    with torch.no_grad():
        workers.norm.bias.add_(1)  # changed; the tied weights are not
    state = workers.state_dict()
    same, hashed, _ = byvalue.drop_unchanged(state, digests)
    assert sorted(same) == ["embed.weight", "head.weight", "norm.weight"] and list(state) == ["norm.bias"]
    assert hashed["embed.weight"] == hashed["head.weight"] == digests["embed.weight"][0]
    # The same bytes under another dtype are not the same value.
    half = {"norm.weight": workers.norm.weight.detach().to(torch.float16)}
    assert byvalue.drop_unchanged(half, {"norm.weight": (writewatch.digest(tensorbytes.tensor_bytes(half["norm.weight"])[0]),
                                                         "float32", (4,))})[0] == []


def test_unserializable_value_names_the_variable():
    with pytest.raises(ShippingError) as info:
        shipping.Shipper().plan({"ok": 1, "lock": threading.Lock()})
    assert info.value.name == "lock"
    assert "'lock'" in str(info.value) and "lock" in str(info.value.cause)


def test_by_value_frames_roundtrip():
    state = torch.nn.Linear(3, 2).state_dict()
    frames, tensor_frames = byvalue.dumps({"state": state, "n": 3, "array": np.arange(4)})
    assert tensor_frames == [False, True, True, False]  # weight, bias; the numpy array's buffer is not a tensor
    back = byvalue.loads(frames[0], [bytes(f) for f in frames[1:]])
    assert back["n"] == 3 and all(torch.equal(back["state"][k], v) for k, v in state.items())
    assert back["array"].tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------------------
# Notebook functions live in the receiving namespace; last writer wins
# --------------------------------------------------------------------------------------


class NotebookLink:
    """A notebook namespace, a Shipper over it, and a worker namespace behind a Receiver."""

    def __init__(self, source: str):
        self.notebook: dict = {"__name__": "__main__"}
        exec(source, self.notebook)
        self.shipper = shipping.Shipper(self.notebook)
        self.worker: dict = {"__name__": "__main__"}
        self.receiver = Receiver(self.worker)

    def send(self, *names):
        plan = self.shipper.plan({n: self.notebook[n] for n in names})
        shipment = self.shipper.prepare(plan)
        request = {"names": shipment.names, "updates": shipment.updates, "forget": shipment.forget}
        self.worker.update(self.receiver.receive(request, [bytes(memoryview(f)) for f in shipment.frames]))
        self.shipper.commit(shipment)
        return plan, shipment


def test_a_notebook_function_reads_and_writes_the_receiving_namespace():
    link = NotebookLink("step = 0.1\ncount = 0\ndef show():\n    return step\n"
                        "def bump():\n    global count\n    count += 1\n")
    plan, shipment = link.send("show", "bump")
    assert sorted(plan.reached) == ["count", "step"]  # the globals they read travel as names
    assert link.worker["show"].__globals__ is link.worker
    link.worker["step"] = 0.5
    assert link.worker["show"]() == 0.5
    link.worker["bump"]()
    assert link.worker["count"] == 1 and link.notebook["count"] == 0


def test_globals_are_followed_through_functions_classes_and_instances():
    link = NotebookLink("import math\nwidth = 3\nclass Block:\n    def size(self):\n        return width * helper()\n"
                        "def helper():\n    return math.floor(factor)\nfactor = 2.5\nblock = Block()\n")
    plan, _ = link.send("block")
    assert set(plan.reached) == {"Block", "width", "helper", "math", "factor"}
    assert link.worker["block"].size() == 6
    assert type(link.worker["block"]) is link.worker["Block"]  # one class, as in the notebook


def test_a_value_a_function_needs_that_cannot_be_sent_names_the_function():
    link = NotebookLink("import threading\nlock = threading.Lock()\ndef guarded():\n    return lock\n")
    with pytest.raises(ShippingError) as info:
        link.send("guarded")
    assert info.value.name == "lock" and info.value.via == "guarded"
    assert "'lock'" in str(info.value) and "used by 'guarded'" in str(info.value)


def test_a_name_the_workers_rebound_is_theirs_until_the_notebook_changes_it():
    link = NotebookLink("sched = {'lr': 1.0, 'epoch': 0}\n")
    plan, _ = link.send("sched")
    link.worker["sched"] = {"lr": 0.125, "epoch": 3}  # a distributed cell rebuilt it
    link.shipper.workers_rebound(["sched"], plan)
    plan, shipment = link.send("sched")
    assert shipment.names == [] and shipment.replaced == []
    assert link.worker["sched"] == {"lr": 0.125, "epoch": 3}
    link.notebook["sched"]["epoch"] = 1  # the notebook writes it: the notebook's wins, and says so
    plan, shipment = link.send("sched")
    assert shipment.replaced == ["sched"]
    assert link.worker["sched"] == {"lr": 1.0, "epoch": 1}
    plan, shipment = link.send("sched")  # and it is the notebook's again: unchanged, not sent
    assert shipment.names == [] and shipment.replaced == []


def test_a_name_only_the_workers_had_is_replaced_when_the_notebook_defines_it():
    link = NotebookLink("")
    plan, _ = link.send()
    link.shipper.workers_rebound(["lr"], plan)
    link.notebook["lr"] = 0.01
    _, shipment = link.send("lr")
    assert shipment.replaced == ["lr"]


def test_pulled_values_resolve_functions_in_the_notebook():
    worker = {"__name__": "__main__"}
    exec("scale = 2\ndef double(x):\n    return x * scale\n", worker)
    frames, _ = byvalue.dumps(worker["double"], worker)
    notebook = {"scale": 10}
    back = byvalue.loads(frames[0], frames[1:], namespace=notebook)
    assert back.__globals__ is notebook and back(1) == 10


# --------------------------------------------------------------------------------------
# An object two names hold is one object on the workers, as in the notebook
# --------------------------------------------------------------------------------------

SCHEDULED = """import torch
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
"""


def test_a_scheduler_steps_the_optimizer_the_workers_train_with():
    link = NotebookLink(SCHEDULED)
    plan, _ = link.send("model", "scheduler")  # the cell steps the scheduler; its optimizer comes along
    assert plan.reached == ["optimizer"] and plan.refs["scheduler"] == {"optimizer"}
    optimizer = link.worker["optimizer"]
    assert link.worker["scheduler"].optimizer is optimizer
    assert optimizer.param_groups[0]["params"][0] is link.worker["model"].weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as in the notebook: no "optimizer.step() has been overridden"
        optimizer.step()
        link.worker["scheduler"].step()
    assert optimizer.param_groups[0]["lr"] == 0.5  # the lr the training loop's optimizer uses


def test_a_value_holding_a_name_that_is_sent_again_is_sent_with_it():
    link = NotebookLink(SCHEDULED)
    link.send("optimizer", "scheduler")
    _, unchanged = link.send("optimizer", "scheduler")
    assert unchanged.names == []
    link.notebook["optimizer"].add_param_group({"params": [torch.zeros(3, requires_grad=True)]})
    _, shipment = link.send("optimizer", "scheduler")  # the optimizer changed; the scheduler did not
    assert [n for n, _ in shipment.names] == ["optimizer", "scheduler"]
    assert link.worker["scheduler"].optimizer is link.worker["optimizer"]
    assert len(link.worker["optimizer"].param_groups) == 2


def test_a_value_sent_alone_refers_to_the_object_the_workers_hold():
    link = NotebookLink(SCHEDULED + "history = []\ndef log(x):\n    history.append(x)\ncallbacks = [log]\n")
    link.send("optimizer", "log")
    held_optimizer, held_log = link.worker["optimizer"], link.worker["log"]
    _, shipment = link.send("scheduler", "callbacks")
    assert [n for n, _ in shipment.names] == ["scheduler", "callbacks"]  # log, history: held
    assert link.worker["scheduler"].optimizer is held_optimizer  # not a copy beside it
    assert link.worker["callbacks"][0] is held_log
    link.worker["callbacks"][0](1)
    assert link.worker["history"] == [1]


def test_objects_that_hold_each_other_stay_one_pair():
    link = NotebookLink("class Node:\n    pass\na = Node()\nb = Node()\na.other = b\nb.other = a\n")
    link.send("a")
    assert link.worker["a"].other is link.worker["b"] and link.worker["b"].other is link.worker["a"]


def test_a_rebound_name_is_no_longer_what_other_values_hold():
    link = NotebookLink(SCHEDULED)
    link.send("scheduler")
    link.notebook["optimizer"] = torch.optim.Adam(link.notebook["model"].parameters())
    plan, _ = link.send("scheduler", "optimizer")
    assert plan.refs["scheduler"] == set()  # it holds the old optimizer, which no name holds now
    assert link.worker["scheduler"].optimizer is not link.worker["optimizer"]
    assert isinstance(link.worker["optimizer"], torch.optim.Adam)


def test_a_pulled_optimizer_holds_the_notebook_models_parameters():
    link = NotebookLink(SCHEDULED)
    link.send("model", "optimizer")
    worker_model, worker_optimizer = link.worker["model"], link.worker["optimizer"]
    worker_model(torch.ones(1, 4)).sum().backward()
    worker_optimizer.step()
    held = {id(t): token for token, t in link.receiver.tensors.items()}
    frames, _ = byvalue.dumps({"optimizer": worker_optimizer}, link.worker, held)
    back = byvalue.loads(frames[0], frames[1:], namespace=link.notebook, held=link.shipper.held_tensors())
    weight = link.notebook["model"].weight
    assert back["optimizer"].param_groups[0]["params"][0] is weight
    assert torch.equal(weight, worker_model.weight)  # the worker's step, in the notebook's model


def test_a_name_bound_to_an_object_the_workers_hold_under_another_name_stays_that_object():
    link = NotebookLink("items = [0, 1]\n")
    link.send("items")
    link.notebook["alias"] = link.notebook["items"]
    _, shipment = link.send("items", "alias")
    assert shipment.skipped == ["items"] and link.worker["alias"] is link.worker["items"]


def test_names_a_cell_binds_and_surely_deletes():
    stores, deletes = cellnames.stored_names("a = 1\nif a:\n    b = 2\n    del c\nfor i in range(2):\n    pass\ndel d\n")
    assert stores == ["a", "b", "i"] and deletes == ["d"]


def test_a_name_sent_for_an_object_the_workers_hold_under_a_later_name_stays_that_object():
    link = NotebookLink("items = [0, 1]\nalias = items\n")
    link.send("alias")  # the workers hold the list as `alias`; `items` comes first in the notebook
    _, shipment = link.send("alias", "items")
    assert shipment.skipped == ["alias"] and link.worker["items"] is link.worker["alias"]
