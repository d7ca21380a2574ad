"""Regenerate examples/multihost.ipynb (run from the repository root), then execute it against a
cluster across hosts (its client file in $JUPYTER_SCALE_EXAMPLE_CLUSTER):

    python examples/tools/make_multihost.py
    jupyter nbconvert --to notebook --execute --inplace examples/multihost.ipynb

Under pytest (nbval), examples/conftest.py makes that cluster on network-namespace hosts.
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def ignore(source):
    # Timings, addresses and losses vary between runs: nbval runs the cell, does not compare it.
    return nbf.v4.new_code_cell(source, metadata={"tags": ["nbval-ignore-output"]})


TRAIN = """%%distribute --workers 4
loader = DataLoader(data, batch_size=32, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(3):
    for xb, yb in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        report(loss=loss, epoch=epoch)
print(f"rank {rank} on {socket.gethostname()}: loss {loss.item():.3f}")"""

nb.cells = [
md("""# The same training cell on one machine and across hosts

The cell below trains on the embedded cluster (four workers on this machine), then, unchanged,
on a cluster whose workers run on two other hosts, two on each. The results are the same:
automatic mode splits the data and averages the gradients the same way whatever the hosts.

The second cluster is started by whoever runs your machines, for example:

```bash
# the head node: a controller on the address the other hosts reach
python -m ipyparallel.controller --ip=10.1.0.5 --IPController.enable_curve=True
# each worker host: two engines (the engine file from the head node's profile)
python -m ipyparallel.engine --file=ipcontroller-engine.json &
python -m ipyparallel.engine --file=ipcontroller-engine.json &
```

and the notebook attaches with `%scale connect ipcontroller-client.json`. The README's
"Several hosts" section says which addresses and ports each host must reach."""),
code("%load_ext jupyter_scale"),
code("""import os, socket
import torch, torch.nn as nn
from torch.utils.data import TensorDataset, DataLoader
import jupyter_scale

g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 32, generator=g)
teacher = torch.randn(32, 4, generator=g)
y = (x @ teacher).argmax(dim=1)
data = TensorDataset(x, y)

def fresh_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

def accuracy(m):
    with torch.no_grad():
        return (m(x).argmax(dim=1) == y).float().mean().item()"""),
md("## On this machine\n\nThe embedded cluster: four worker processes on 127.0.0.1."),
code("model = fresh_model()"),
ignore(TRAIN),
code("""on_one_machine = {name: value.clone() for name, value in model.state_dict().items()}
print("accurate:", accuracy(model) > 0.9)"""),
code("%scale stop"),
md("""## Across hosts

`%scale connect` attaches to the running cluster (here the client file of an ipcluster whose
engines run on two other hosts). Connecting says in one line what travels unencrypted between
those hosts: keep them on a network you trust."""),
code("""cluster_file = os.environ.get("JUPYTER_SCALE_EXAMPLE_CLUSTER",
                              os.path.expanduser("~/.ipython/profile_default/security/ipcontroller-client.json"))"""),
ignore("%scale connect {cluster_file}"),
ignore("%scale status"),
code("model = fresh_model()"),
ignore(TRAIN),
code("""hosts = {w["hostname"] for w in jupyter_scale.get_session().workers}
print("ranks on", len(hosts), "hosts other than this one:", socket.gethostname() not in hosts)
same = all(torch.allclose(value, on_one_machine[name], atol=1e-6) for name, value in model.state_dict().items())
print("the same weights as on one machine:", same)"""),
code("%scale stop"),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "examples/multihost.ipynb")
