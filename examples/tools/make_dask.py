"""Regenerate examples/dask.ipynb (run from the repository root), then execute it:

    python examples/tools/make_dask.py
    jupyter nbconvert --to notebook --execute --inplace examples/dask.ipynb
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def ignore(source):
    # Timings, addresses and losses vary between runs: nbval runs the cell, does not compare it.
    return nbf.v4.new_code_cell(source, metadata={"tags": ["nbval-ignore-output"]})


nb.cells = [
md("""# The same training cell on Dask

`%%distribute` runs on ipyparallel by default and on Dask with `--backend dask`. The cell,
its output, `report()`, failures and interrupts behave the same on both; what differs is the
cluster underneath. To make Dask the default once, set `JUPYTER_SCALE_BACKEND=dask` in the
environment, or `c.ScaleSession.backend_name = "dask"` in `ipython_config.py`.

This notebook trains on an embedded Dask `LocalCluster` (two single-threaded worker processes
on 127.0.0.1), then attaches to a Dask cluster it did not start, as you would to one from
dask-jobqueue (Slurm, PBS) or dask-kubernetes."""),
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

g = torch.Generator().manual_seed(0)
x = torch.randn(8192, 32, generator=g)
teacher = torch.randn(32, 4, generator=g)
y = (x @ teacher).argmax(dim=1)
data = TensorDataset(x, y)

torch.manual_seed(0)
model = Net()

def accuracy(m):
    with torch.no_grad():
        return (m(x).argmax(dim=1) == y).float().mean().item()"""),
md("## An embedded Dask cluster\n\nThe first `%%distribute --backend dask` starts it; later cells reuse it."),
ignore("""%%distribute --backend dask --workers 2
loader = DataLoader(data, batch_size=64, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(3):
    for xb, yb in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        report(loss=loss, epoch=epoch)
    print(f"epoch {epoch}: loss {loss.item():.3f}")"""),
code("""print("trained model is accurate:", accuracy(model) > 0.9)
print("reports from both ranks:", sorted({p["rank"] for p in jupyter_scale.history()}))"""),
md("Each worker keeps its variables between cells, as a kernel does:"),
code("""%%distribute
batches = len(loader)  # the training cell's loader, still on each worker: its shard's batches"""),
code("""print("batches per epoch on each rank:", jupyter_scale.get_session().gather("batches"))"""),
ignore("%scale"),
code("%scale stop"),
md("""## Attaching to a running Dask cluster

`%scale connect tcp://HOST:PORT` attaches to any Dask scheduler: one from `dask scheduler` /
`dask worker` on the command line, dask-jobqueue's `SLURMCluster`, dask-kubernetes'
`KubeCluster`. The workers need `jupyter_scale` and `torch` installed. One rank per worker;
`--workers N` uses N of them (waiting for them to join). `%scale stop` then disconnects and
leaves the cluster running: it is not ours to stop.

Here the notebook starts a small cluster itself, to have one to attach to."""),
code("""import logging
from dask.distributed import LocalCluster

cluster = LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1",
                       dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR)
address = cluster.scheduler_address"""),
ignore("%scale connect {address}"),
ignore("""%%distribute
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for xb, yb in DataLoader(data, batch_size=64, shuffle=True):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
print(f"rank {rank}: one more epoch, loss {loss.item():.3f}")"""),
code("""print("still accurate:", accuracy(model) > 0.9)"""),
ignore("%scale stop"),
code("""print("the cluster keeps its workers:", len(cluster.scheduler_info["workers"]))
cluster.close()"""),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "examples/dask.ipynb")
