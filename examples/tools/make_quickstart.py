"""Regenerate examples/quickstart.ipynb (run from the repository root), then execute it:

    python examples/tools/make_quickstart.py
    jupyter nbconvert --to notebook --execute --inplace examples/quickstart.ipynb
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell
def ignore(source):
    # Timings and losses vary between runs: nbval runs this cell but does not compare it.
    return nbf.v4.new_code_cell(source, metadata={"tags": ["nbval-ignore-output"]})
nb.cells = [
md("""# Quickstart: one training cell, two workers

A model and a dataset defined right here in the notebook are trained on two worker
processes by putting `%%distribute --workers 2` on top of an ordinary training cell.
Nothing in the loop is rewritten: in automatic mode the `DataLoader` gives each rank its
own shard of the data, every `opt.step()` averages the gradients across the ranks, and all
ranks start from the same seed. Afterwards the notebook's `model` holds the trained
weights. (`%%distribute --manual` turns the automatic part off, for cells that call
`jupyter_scale.wrap`/`shard` or `torch.distributed` themselves.)"""),
code("%load_ext jupyter_scale"),
code("""import torch, torch.nn as nn
from torch.utils.data import TensorDataset, DataLoader
import jupyter_scale

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    def forward(self, x):
        return self.layers(x)

# Synthetic data: 4 classes given by a fixed random "teacher" projection.
g = torch.Generator().manual_seed(0)
x = torch.randn(8192, 32, generator=g)
teacher = torch.randn(32, 4, generator=g)
y = (x @ teacher).argmax(dim=1)
data = TensorDataset(x, y)

torch.manual_seed(0)
model = Net()

def accuracy(m):
    with torch.no_grad():
        return (m(x).argmax(dim=1) == y).float().mean().item()

print(f"accuracy before training: {accuracy(model):.2f}")"""),
md("The training cell. It runs on every rank; `rank`, `world_size` and `report` are defined there."),
ignore("""%%distribute --workers 2
loader = DataLoader(data, batch_size=64, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(3):
    for xb, yb in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        report(loss=loss, epoch=epoch)
    print(f"epoch {epoch}: loss {loss.item():.3f} on {len(loader)} batches")"""),
md("Every `report()` of every rank is kept in the kernel:"),
ignore("""points = jupyter_scale.history()
per_epoch = {}
for p in points:
    per_epoch.setdefault(p["epoch"], []).append(p["loss"])
for epoch, losses in per_epoch.items():
    print(f"epoch {epoch}: mean loss {sum(losses) / len(losses):.3f} over {len(losses)} reports")"""),
code("""first, last = per_epoch[0], per_epoch[2]
print("loss went down:", sum(last) / len(last) < sum(first) / len(first))"""),
md("The notebook's `model` was updated in place with rank 0's trained weights:"),
ignore("""print(f"accuracy after training: {accuracy(model):.2f}")"""),
code("""print("trained model is accurate:", accuracy(model) > 0.9)"""),
code("""%scale stop"""),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "examples/quickstart.ipynb")
