"""Automatic mode next to libraries that distribute by themselves, and what it says when
distribution did nothing. Real cells on a real 2-rank gloo group, on both engines."""

import pytest

from conftest import COUNT_AVERAGING
from jupyter_scale.training import ITERABLE, NOTHING_DISTRIBUTED, OWN_SAMPLER

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
    assert NOTHING_DISTRIBUTED not in out.stderr
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
# tensor, and a hand-written SGD update. Automatic mode has nothing to hook.
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
lm = TinyLM()
for i in range(0, 100, 20):
    x, y = batches[i:i + 20], batches[i + 1:i + 21]
    lm.zero_grad()
    loss = nn.functional.cross_entropy(lm(x).view(-1, 50), y.reshape(-1))
    loss.backward()
    {sync}
    for p in lm.parameters():
        p.data.add_(p.grad, alpha=-0.1)
"""


def test_hand_made_batches_and_a_manual_update_are_pointed_out_once(k):
    out = k.ok("%%distribute" + WORD_LM.format(sync="pass"))
    assert out.stderr.count(NOTHING_DISTRIBUTED) == 1, out.stderr
    assert NOTHING_DISTRIBUTED not in out.stdout


def test_the_resync_after_a_failed_cell_does_not_count_as_the_cells_collective(k):
    assert not k.cell("%%distribute\nraise ValueError('failed on purpose')").ok
    out = k.ok("%%distribute" + WORD_LM.format(sync="pass"))  # starts by resyncing the ranks
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

OWN_ALL_REDUCE = "%%distribute" + WORD_LM.format(sync="""for p in lm.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size""")


@pytest.mark.parametrize("cell", [README_LOOP, "%%distribute --manual" + WORD_LM.format(sync="pass"),
                                  EVALUATION_ONLY, OWN_ALL_REDUCE],
                         ids=["dataloader_and_optimizer", "manual", "evaluation_only", "own_all_reduce"])
def test_no_note_when_the_cell_distributed_or_trained_nothing(k, cell):
    out = k.ok(cell)
    assert NOTHING_DISTRIBUTED not in out.stderr + out.stdout
    assert OWN_SAMPLER not in out.stderr
