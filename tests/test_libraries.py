"""Automatic mode next to libraries that distribute by themselves, library objects built in
the notebook, and what automatic mode says when distribution did nothing. Real cells on a
real 2-rank gloo group on the default engine (the libraries run in the ranks' own code, which
no engine touches); the rebuilding mechanism itself in this process."""

import copy
import dataclasses
import sys
import weakref

import pytest
import torch

from conftest import COUNT_AVERAGING
from jupyter_scale import libraries, shipping
from jupyter_scale.receiving import Receiver
from jupyter_scale.training import ITERABLE, NOTHING_DISTRIBUTED, OWN_SAMPLER, SAME_BATCHES

NOTEBOOK = """
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(512, 8, generator=g), torch.randint(0, 4, (512,), generator=g))
"""

# The Hugging Face Trainer builds its eval loader without a sampler (automatic mode puts one
# in) and its train loader with a RandomSampler; accelerate then wraps both loaders' batch
# samplers in its BatchSamplerShard. 300 samples, batches of 10 (train) and 8 (eval).
TRAINER = "%%distribute --workers 2" + COUNT_AVERAGING + """
import os, tempfile
os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
import jupyter_scale.training as training
transformers.logging.set_verbosity_error()

class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, 100, (n, 16), generator=torch.Generator().manual_seed(seed))
        self.seen = []
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        self.seen.append(int(i))
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

train_ds, eval_ds = Tokens(300, 0), Tokens(300, 1)
gpt = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32))
# No use_cpu=True: the workers have accelerate's environment for CPU, as `accelerate launch --cpu` gives.
args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], num_train_epochs=1,
                         per_device_train_batch_size=10, per_device_eval_batch_size=8,
                         save_strategy="no", logging_strategy="no", disable_tqdm=True)
trainer = Trainer(model=gpt, args=args, train_dataset=train_ds, eval_dataset=eval_ds)
with averaging_counted() as averaged:
    trainer.train()
averaged_by_us = averaged.count
train_seen = list(train_ds.seen)
trainer.evaluate()
eval_seen = list(eval_ds.seen)
pred_rows = trainer.predict(eval_ds).predictions.shape[0]
gpt_w = torch.cat([p.detach().flatten() for p in gpt.parameters()])
"""


@pytest.fixture(scope="module")
def k(kernel):
    kernel.ok(NOTEBOOK)
    return kernel


def gathered(k, name):
    return k.value(f"jupyter_scale.get_session().gather({name!r})")


def test_hugging_face_trainer_splits_train_and_eval_data_once(k):
    out = k.ok(TRAINER, timeout=300)
    assert OWN_SAMPLER not in out.stderr  # the train loader is accelerate's to split
    assert NOTHING_DISTRIBUTED not in out.stderr and SAME_BATCHES not in out.stderr
    t0, t1 = gathered(k, "train_seen")
    assert len(t0) == len(t1) == 150, (len(t0), len(t1))  # half each, not all (nor a quarter)
    assert not set(t0) & set(t1) and sorted(t0 + t1) == list(range(300))
    e0, e1 = gathered(k, "eval_seen")
    # 38 batches of 8, 19 per rank (accelerate pads the last one from the first samples);
    # with both splits each rank saw 10 batches of a quarter of the data.
    assert len(e0) == len(e1) == 152, (len(e0), len(e1))
    assert set(e0 + e1) == set(range(300))
    assert gathered(k, "pred_rows") == [300, 300]  # gathered across ranks, padding dropped
    assert gathered(k, "averaged_by_us") == [0, 0]  # accelerate's DDP averaged; not twice
    k.ok("w = jupyter_scale.get_session().gather('gpt_w')\nassert torch.equal(w[0], w[1])")


def test_a_shuffled_loader_prepared_by_accelerate_is_split_by_accelerate_alone(k):
    out = k.ok("""%%distribute
from accelerate import Accelerator
prepared = Accelerator(cpu=True).prepare(DataLoader(TensorDataset(torch.arange(300)), batch_size=8, shuffle=True))
acc_len = len(prepared)
acc_seen = [torch.cat([b[0] for b in prepared]).tolist() for epoch in range(2)]
""")
    assert OWN_SAMPLER not in out.stderr
    assert gathered(k, "acc_len") == [19, 19]  # ceil(300 / 8) = 38 batches, half each
    r0, r1 = gathered(k, "acc_seen")
    for epoch in range(2):
        a, b = r0[epoch], r1[epoch]
        assert len(a) == len(b) == 152
        assert set(a + b) == set(range(300))
        assert len(set(a) & set(b)) <= 4  # only accelerate's padding of the last batch repeats
    assert r0[0] != r0[1] and r0[0] != sorted(r0[0])  # shuffled, anew every epoch


def test_a_loader_that_every_rank_iterates_whole_is_said_once_when_iterated(k):
    built = k.ok("""%%distribute
from torch.utils.data import SequentialSampler
never_iterated = DataLoader(data, batch_size=64, sampler=SequentialSampler(data))
n_never = len(never_iterated)
""")
    assert OWN_SAMPLER not in built.stderr
    assert gathered(k, "n_never") == [8, 8]
    split = k.ok("""%%distribute
from torch.utils.data import DistributedSampler
n_split = sum(len(x) for x, y in DataLoader(data, batch_size=64, sampler=DistributedSampler(data)))
""")
    assert OWN_SAMPLER not in split.stderr
    assert gathered(k, "n_split") == [256, 256]
    whole = k.ok("""%%distribute
own = [DataLoader(data, batch_size=64, sampler=SequentialSampler(data)) for _ in range(2)]
n_whole = [sum(len(x) for x, y in loader) for loader in own for epoch in range(2)]
""")
    assert whole.stderr.count(OWN_SAMPLER) == 1, whole.stderr  # once per cell, from rank 0
    assert gathered(k, "n_whole") == [[512] * 4] * 2


def test_an_iterable_dataset_is_said_when_iterated(k):
    out = k.ok("""%%distribute
class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))
stream_loader = DataLoader(Stream(), batch_size=5)
n_stream = [sum(len(b) for b in stream_loader) for _ in range(2)]
""")
    assert out.stderr.count(ITERABLE) == 1, out.stderr
    assert gathered(k, "n_stream") == [[10, 10]] * 2


# The PyTorch word language model example's way: batches sliced by hand from one long
# tensor (its get_batch(source, i)), the model's zero_grad(), backward(), then `{sync}` and a
# hand-written SGD update. `{rows}` picks the batch columns a rank trains on.
WORD_LM = """
torch.manual_seed(0)
corpus = torch.randint(0, 50, (2000,))
batches = corpus[: 2000 // 10 * 10].view(10, -1).t().contiguous()   # batchify: (steps, 10)
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(50, 16), nn.LSTM(16, 16), nn.Linear(16, 50)
    def forward(self, x):
        return self.out(self.rnn(self.emb(x))[0])
def get_batch(source, i):
    return source[i:i + 20, {rows}], source[i + 1:i + 21, {rows}]
lm = TinyLM()
for i in range(0, 100, 20):
    x, y = get_batch(batches, i)
    lm.zero_grad()
    loss = nn.functional.cross_entropy(lm(x).view(-1, 50), y.reshape(-1))
    loss.backward()
    {sync}
    for p in lm.parameters():
        p.data.add_(p.grad, alpha=-0.1)
"""
CLIPPED = "torch.nn.utils.clip_grad_norm_(lm.parameters(), 0.25)"  # the example's own clipping


def word_lm(sync="pass", rows=":"):
    return WORD_LM.format(sync=sync, rows=rows)


# Hand-made batches and a torch.optim step.
OPTIM_LOOP = """
torch.manual_seed(0)
xs, ys = data.tensors
net = nn.Linear(8, 4)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
for i in range(0, 256, 32):
    x, y = xs[i:i + 32][{rows}], ys[i:i + 32][{rows}]
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
"""


def optim_loop(rows=":"):
    return OPTIM_LOOP.format(rows=rows)


def test_hand_made_batches_and_a_manual_update_are_pointed_out_once(k):
    out = k.ok("%%distribute" + word_lm())
    assert out.stderr.count(NOTHING_DISTRIBUTED) == 1, out.stderr
    assert NOTHING_DISTRIBUTED not in out.stdout and SAME_BATCHES not in out.stderr


@pytest.mark.parametrize("cell", [word_lm(sync=CLIPPED), optim_loop()], ids=["word_language_model", "torch_optim"])
def test_every_rank_training_on_the_same_batches_is_pointed_out_once(k, cell):
    """Clipping or the optimizer step averages the gradients: but every rank computed the same."""
    out = k.ok("%%distribute" + cell)
    assert out.stderr.count(SAME_BATCHES) == 1, out.stderr
    assert NOTHING_DISTRIBUTED not in out.stderr and SAME_BATCHES not in out.stdout


@pytest.mark.parametrize("cell", [word_lm(sync=CLIPPED, rows="rank::world_size"), optim_loop("rank::world_size")],
                         ids=["word_language_model", "torch_optim"])
def test_no_note_when_the_cell_splits_its_batches_by_rank(k, cell):
    out = k.ok("%%distribute" + cell)
    assert SAME_BATCHES not in out.stderr and NOTHING_DISTRIBUTED not in out.stderr, out.stderr


def test_a_loader_with_its_own_sampler_is_said_once_not_twice(k):
    out = k.ok("""%%distribute
from torch.utils.data import SequentialSampler
net = nn.Linear(8, 4)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
for x, y in DataLoader(data, batch_size=64, sampler=SequentialSampler(data)):
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
""")
    assert out.stderr.count(OWN_SAMPLER) == 1, out.stderr
    assert SAME_BATCHES not in out.stderr and NOTHING_DISTRIBUTED not in out.stderr


def test_the_resync_after_a_failed_cell_does_not_count_as_the_cells_collective(k):
    assert not k.cell("%%distribute\nraise ValueError('failed on purpose')").ok
    out = k.ok("%%distribute" + word_lm())  # starts by resyncing the ranks
    assert out.stderr.count(NOTHING_DISTRIBUTED) == 1, out.stderr


README_LOOP = """%%distribute
net = nn.Linear(8, 4)
loader = DataLoader(data, batch_size=64, shuffle=True)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
"""

EVALUATION_ONLY = """%%distribute
net = nn.Linear(8, 4)
xs, ys = data.tensors
with torch.no_grad():
    accuracy = (net(xs).argmax(1) == ys).float().mean()
"""

OWN_ALL_REDUCE = "%%distribute" + word_lm(sync="""for p in lm.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size""")


@pytest.mark.parametrize("cell", [README_LOOP, "%%distribute --manual" + word_lm(), "%%distribute --manual" + optim_loop(),
                                  EVALUATION_ONLY, OWN_ALL_REDUCE],
                         ids=["dataloader_and_optimizer", "manual", "manual_optim", "evaluation_only", "own_all_reduce"])
def test_no_note_when_the_cell_distributed_or_trained_nothing(k, cell):
    out = k.ok(cell)
    assert NOTHING_DISTRIBUTED not in out.stderr + out.stdout
    assert SAME_BATCHES not in out.stderr + out.stdout
    assert OWN_SAMPLER not in out.stderr


# --------------------------------------------------------------------------------------
# Library objects built in the notebook: rebuilt on the workers
# --------------------------------------------------------------------------------------

# A GPT-2 of 2 layers from a config (nothing downloaded), without dropout so that runs can be
# compared step by step, on 300 random sequences; the Trainer logs the loss of every step.
HF_NOTEBOOK = """
import os, tempfile
os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
transformers.logging.set_verbosity_error()

class Sequences(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, 100, (n, 16), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

def arguments(batch):
    return TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], num_train_epochs=1, learning_rate=1e-3,
                             per_device_train_batch_size=batch, save_strategy="no", logging_strategy="steps",
                             logging_steps=1, disable_tqdm=True)

def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]

sequences = Sequences(300)
"""


def test_a_trainer_built_in_the_notebook_trains_as_one_built_in_the_cell(k):
    k.ok(HF_NOTEBOOK + """
nb_model = gpt2()
nb_args = arguments(10)
nb_trainer = Trainer(model=nb_model, args=nb_args, train_dataset=sequences)
assert nb_args.world_size == 1
""", timeout=120)
    out = k.ok("""%%distribute --workers 2
nb_trainer.train()
nb_losses = losses(nb_trainer)
nb_world = [nb_args.world_size, nb_args.parallel_mode.value, nb_trainer.args.world_size,
            nb_trainer.accelerator.num_processes, nb_trainer.args is nb_args, nb_trainer.model is nb_model]
""", timeout=300)
    assert NOTHING_DISTRIBUTED not in out.stderr and SAME_BATCHES not in out.stderr
    assert gathered(k, "nb_world") == [[2, "distributed", 2, 2, True, True]] * 2
    k.ok("""%%distribute
cell_trainer = Trainer(model=gpt2(), args=arguments(10), train_dataset=sequences)
cell_trainer.train()
cell_losses = losses(cell_trainer)
mixed_trainer = Trainer(model=gpt2(), args=nb_args, train_dataset=sequences)  # only the arguments from the notebook
mixed_trainer.train()
mixed_losses = losses(mixed_trainer)
""", timeout=300)
    nb0, nb1 = gathered(k, "nb_losses")
    cell0, cell1 = gathered(k, "cell_losses")
    assert len(nb0) == 15 and nb0 == nb1 == cell0 == cell1, (nb0, cell0)  # 300 / (2 x 10) steps
    assert gathered(k, "mixed_losses") == [nb0, nb0]
    assert 4 < nb0[0] < 5  # about ln(100) = 4.6 for an untrained model; twice that with the world size taken as 1
    # One process with the two ranks' batches together: the same losses, up to float rounding.
    local = k.value("""(lambda t: (t.train(), losses(t))[1])(Trainer(model=gpt2(), args=arguments(20),
                                                                   train_dataset=sequences))""", timeout=120)
    assert torch.allclose(torch.tensor(nb0), torch.tensor(local), rtol=1e-4, atol=1e-5), (nb0, local)


def test_accelerate_state_built_in_the_notebook_is_the_workers_own(k):
    k.ok("""
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
nb_accelerator = Accelerator(cpu=True)
nb_state = PartialState()
nb_accelerator_state = AcceleratorState()
assert nb_accelerator.num_processes == nb_state.num_processes == 1
""")
    k.ok("""%%distribute
prepared = nb_accelerator.prepare(DataLoader(TensorDataset(torch.arange(300)), batch_size=10))
acc_world = [nb_accelerator.num_processes, nb_accelerator.process_index, nb_state.num_processes,
             nb_state.process_index, nb_accelerator_state.num_processes, nb_accelerator.distributed_type.name,
             nb_state.__dict__ is PartialState._shared_state, len(prepared)]
""", timeout=120)
    assert gathered(k, "acc_world") == [[2, 0, 2, 0, 2, "MULTI_CPU", True, 15], [2, 1, 2, 1, 2, "MULTI_CPU", True, 15]]


# The mechanism, in this process: a class of a third library that reads the world it is built in.
WORLD = {"size": 1}


class Snapshot:
    def __init__(self, data, scale=1.0):
        self.data, self.scale = data, scale
        self.world = WORLD["size"]  # read once, at construction


@dataclasses.dataclass
class Settings:
    lr: float = 0.1
    world: int = dataclasses.field(init=False, default=0)

    def __post_init__(self):
        self.world = WORLD["size"]


def shipped(namespace: dict, names: list[str]) -> dict:
    """`names` of `namespace` through the kernel's shipping and a worker's receiving, as a cell
    sends them; the receiving side runs with a world of 2."""
    shipper = shipping.Shipper(namespace)
    shipment = shipper.prepare(shipper.plan({name: namespace[name] for name in names}))
    WORLD["size"] = 2
    try:
        return Receiver({}).receive({"names": shipment.names}, tuple(shipment.frames))
    finally:
        WORLD["size"] = 1


@pytest.fixture
def registered(monkeypatch):
    """Snapshot (by its construction) and Settings (by its fields) registered and watched here,
    then everything as it was."""
    monkeypatch.setattr(libraries, "_REGISTERED", dict(libraries._REGISTERED))
    monkeypatch.setattr(libraries, "_how", weakref.WeakKeyDictionary())
    monkeypatch.setattr(libraries, "_watching", False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # watch() adds its import hook
    init = Snapshot.__init__
    libraries.rebuild_on_workers(f"{__name__}.Snapshot")
    libraries.rebuild_on_workers(f"{__name__}.Settings", arguments="fields")
    libraries.watch()
    yield
    libraries.unwatch()
    assert Snapshot.__init__ is init and "__new__" not in vars(Snapshot)  # as they were


def test_a_registered_object_is_rebuilt_where_it_lands_with_what_it_was_built_from(registered):
    data = {"rows": torch.arange(4.0)}
    snap = Snapshot(data, scale=3.0)
    settings = Settings(lr=0.5)
    settings.lr = 0.25  # a field set after construction travels
    got = shipped({"data": data, "snap": snap, "settings": settings}, ["snap", "settings"])
    assert (got["snap"].world, got["snap"].scale, got["settings"].world, got["settings"].lr) == (2, 3.0, 2, 0.25)
    assert got["snap"].data is got["data"]  # the notebook's `data`, one object on the receiving side
    assert (snap.world, settings.world) == (1, 1)  # the notebook's own are left alone


def test_an_object_built_again_from_the_same_arguments_is_sent_again(registered):
    """A Trainer built again in the notebook is a new one on the workers, not the one they trained."""
    data = {"rows": [1, 2]}
    namespace = {"data": data, "snap": Snapshot(data)}
    shipper = shipping.Shipper(namespace)
    for rebuilt, sent in ((False, True), (False, False), (True, True)):
        if rebuilt:
            namespace["snap"] = Snapshot(data)  # a new object: its state on the workers starts afresh
        shipment = shipper.prepare(shipper.plan({"snap": namespace["snap"]}))
        assert ("snap" in dict(shipment.names)) == sent
        shipper.commit(shipment)


def test_a_copy_or_an_object_built_before_watching_is_refused_by_name(registered):
    from jupyter_scale.errors import ShippingError

    for value in (copy.copy(Snapshot(torch.zeros(1))), Snapshot.__new__(Snapshot)):
        with pytest.raises(ShippingError, match="cannot tell what this Snapshot was built from"):
            shipped({"snap": value}, ["snap"])


def test_a_class_whose_module_is_imported_after_watching_is_recorded(registered, tmp_path, monkeypatch):
    (tmp_path / "late_library.py").write_text("class State:\n    def __init__(self, n):\n        self.n = n\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    libraries.rebuild_on_workers("late_library.State")
    import late_library

    try:
        assert libraries.reduce(late_library.State(5))[1][1:] == ((5,), {})
    finally:
        sys.modules.pop("late_library", None)
