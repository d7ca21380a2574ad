"""Regenerate examples/sharded.ipynb (run from the repository root), then execute it:

    python examples/tools/make_sharded.py
    jupyter nbconvert --to notebook --execute --inplace examples/sharded.ipynb
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def ignore(source):
    # Losses and timings vary between runs: nbval runs the cell, does not compare it.
    return nbf.v4.new_code_cell(source, metadata={"tags": ["nbval-ignore-output"]})


nb.cells = [
md("""# A model bigger than one worker: sharded training

Plain `%%distribute` gives every rank a whole copy of the model, its gradients and its
optimizer state (Adam's is twice the model). When that does not fit one worker, `--shard`
splits all three across the ranks with PyTorch's own FSDP2 (`fully_shard`): each of N ranks
keeps 1/N of every parameter and gathers a block's whole weights only while it computes
that block.

This notebook builds a small GPT-like model *on the meta device inside the cell*: no memory
is taken and nothing is initialized until the workers shard it, so neither the kernel nor any
worker ever holds the whole model. It trains on 2 workers, saves a sharded checkpoint, and
loads it into 3."""),
code("%load_ext jupyter_scale"),
code("""import shutil, tempfile
import torch, torch.nn as nn
from torch.utils.data import TensorDataset, DataLoader
import jupyter_scale


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, dim=64, heads=4, layers=2, context=32):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied input and output embeddings

    def forward(self, idx):
        length = idx.shape[1]
        mask = torch.triu(torch.full((length, length), float("-inf"), device=idx.device), diagonal=1)
        x = self.tokens(idx) + self.positions(torch.arange(length, device=idx.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


# A toy language: each token is the previous one times 5 plus 3, modulo 64; sequences start anywhere.
g = torch.Generator().manual_seed(0)
starts = torch.randint(0, 64, (2048, 1), generator=g)
sequences = [starts]
for _ in range(32):
    sequences.append((sequences[-1] * 5 + 3) % 64)
sequences = torch.cat(sequences, dim=1)
data = TensorDataset(sequences[:, :-1], sequences[:, 1:])
probe = sequences[:64]  # a fixed batch to compare models on
checkpoint = tempfile.mkdtemp(prefix="tinygpt-")"""),
md("""## Training, sharded on 2 workers

The cell builds the model under `torch.device("meta")`. With `--shard`, building the optimizer
over its parameters shards it (each `Block` one unit, the rest of the model another) and
materializes it shard by shard: every rank initializes one module's tensors at a time, as
`reset_parameters()` would, and keeps its part. With the same seed the weights are those of
the model built whole. The loop itself is the one that would run in one process."""),
ignore("""%%distribute --workers 2 --shard
with torch.device("meta"):
    model = TinyGPT()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
loader = DataLoader(data, batch_size=32, shuffle=True)   # each rank gets its own shard of the data
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        report(loss=loss)
    print(f"epoch {epoch}: loss {loss.item():.3f}")

held = sum(p.to_local().numel() for p in model.parameters())
total = sum(p.numel() for p in model.parameters())
print(f"rank {rank} holds {held:,} of the model's {total:,} parameters (and their gradients and Adam state)")
with torch.no_grad():
    probe_loss = nn.functional.cross_entropy(model(probe[:, :-1]).flatten(0, 1), probe[:, 1:].flatten()).item()
jupyter_scale.save_checkpoint(checkpoint, model=model, optimizer=opt)   # every rank writes its shards"""),
md("""The model lives on the workers only: the kernel never built it (a model that *is* in the
notebook comes back whole after a `--shard` cell, a chunk of tensors at a time). Each rank held
about half of it:"""),
code("""session = jupyter_scale.get_session()
assert "model" not in dir(), "the kernel never held the model"
held, total = session.gather("held"), session.gather("total")[0]
assert sum(held) >= total and max(held) < 0.6 * total, (held, total)
losses = [p["loss"] for p in jupyter_scale.history() if p["rank"] == 0]
assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10, "the loss went down"
trained_probe_loss = session.gather("probe_loss")[0]
print(f"each rank held {max(held) / total:.0%} of the parameters; the loss went down")"""),
md("""## Loading the checkpoint into 3 workers

A sharded checkpoint (`torch.distributed.checkpoint` underneath: one file per rank plus
metadata) loads into any number of ranks: each reads the parts its own shards need. Here 3
workers build the same model on the meta device, shard it three ways, and load the weights
and the optimizer state that 2 workers saved."""),
ignore("""%%distribute --workers 3 --shard
with torch.device("meta"):
    model = TinyGPT()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
jupyter_scale.load_checkpoint(checkpoint, model=model, optimizer=opt)
with torch.no_grad():
    probe_loss = nn.functional.cross_entropy(model(probe[:, :-1]).flatten(0, 1), probe[:, 1:].flatten()).item()
print(f"rank {rank} of {world_size}: loss on the probe batch {probe_loss:.4f}")"""),
code("""reloaded = session.gather("probe_loss")
assert len(reloaded) == 3
assert all(abs(value - trained_probe_loss) < 1e-5 for value in reloaded), (reloaded, trained_probe_loss)
print("3 workers hold the model that 2 trained: the same loss on the probe batch")"""),
md("""The same checkpoint loads into a model in the notebook too (no process group needed), for
evaluation or export, when it fits here:"""),
code("""local = TinyGPT()
jupyter_scale.load_checkpoint(checkpoint, model=local)
with torch.no_grad():
    local_loss = nn.functional.cross_entropy(local(probe[:, :-1]).flatten(0, 1), probe[:, 1:].flatten()).item()
assert abs(local_loss - trained_probe_loss) < 1e-5, (local_loss, trained_probe_loss)
print("the notebook's model holds the trained weights")"""),
code("""%scale stop
shutil.rmtree(checkpoint)"""),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "examples/sharded.ipynb")
