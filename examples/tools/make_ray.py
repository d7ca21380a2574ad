"""Regenerate examples/ray.ipynb (run from the repository root), then execute it:

    python examples/tools/make_ray.py
    jupyter nbconvert --to notebook --execute --inplace examples/ray.ipynb
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def ignore(source):
    # Timings, addresses and losses vary between runs: nbval runs the cell, does not compare it.
    return nbf.v4.new_code_cell(source, metadata={"tags": ["nbval-ignore-output"]})


nb.cells = [
md("""# The same training cell on Ray

`%%distribute --backend ray` runs the cell on Ray actors, one per rank
(`pip install 'jupyter_scale[ray]'`). The cell, its output, `report()`, failures and interrupts
behave as on ipyparallel and Dask; what differs is the cluster underneath.

This notebook trains on an embedded one-node Ray (started for the notebook on 127.0.0.1, with a
token of its own), then attaches to a Ray cluster it did not start, as you would to a KubeRay
`RayCluster` or one made with `ray start`/`ray up`."""),
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
md("## An embedded Ray cluster\n\nThe first `%%distribute --backend ray` starts it; later cells reuse it."),
ignore("""%%distribute --backend ray --workers 2
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
md("Each rank's actor keeps its variables between cells, as a kernel does:"),
code("""%%distribute
batches = len(loader)  # the training cell's loader, still in each actor: its shard's batches"""),
code("""print("batches per epoch on each rank:", jupyter_scale.get_session().gather("batches"))"""),
ignore("%scale"),
code("%scale stop"),
md("""## Attaching to a running Ray cluster

`%scale connect ray://HEAD:10001` attaches to a Ray cluster through its Ray Client port (a
KubeRay `RayCluster`'s head service, or `ray start --head`); with `--backend ray`, a GCS address
(`HEAD:6379`, or `auto` on a node of the cluster) attaches as a driver on that node. Ray makes
the workers on connect: one actor per rank, reserving `c.RayBackend.cpus_per_worker` CPUs
(default 1) and a GPU each where the cluster has one per rank, placed together in one placement
group. `%scale stop` ends those actors and leaves the cluster running. The cluster's Python
environment needs `jupyter_scale` and `torch` (or give `c.RayBackend.runtime_env`).

Here the notebook starts a one-node Ray with the `ray` CLI, with a token of its own (Ray's token
authentication: nobody without the token reaches it), to have one to attach to."""),
code("""import os, secrets, socket, subprocess, sys, tempfile, time

head_dir = tempfile.mkdtemp(prefix="rayhead-")   # owner-only; Ray's files and the token go here
token_path = os.path.join(head_dir, "token")
with open(os.open(token_path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(secrets.token_hex(32))
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    client_port = s.getsockname()[1]
env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path,
           RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")    # Ray's one-node setting: everything on loopback
ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--port=0",
                         f"--ray-client-server-port={client_port}", "--include-dashboard=false",
                         "--disable-usage-stats", f"--temp-dir={head_dir}/r", "--num-cpus=2"],
                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
found = os.path.join(head_dir, "r", "ray_current_cluster")
deadline = time.monotonic() + 120
while not (os.path.exists(found) and open(found).read().strip()):
    assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not start"
    time.sleep(0.2)
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path)   # the kernel's token for it
address = f"ray://127.0.0.1:{client_port}\""""),
ignore("%scale connect {address} --workers 2"),
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
code("""import shutil, psutil

print("the cluster is still running:", head.poll() is None)
started = [psutil.Process(head.pid), *psutil.Process(head.pid).children(recursive=True)]
head.terminate()                                  # ray start --block stops what it started
head.wait(60)
gone, alive = psutil.wait_procs(started, timeout=20)
for p in alive:                                   # by pid, whatever did not stop
    p.kill()
shutil.rmtree(head_dir, ignore_errors=True)
del os.environ["RAY_AUTH_MODE"], os.environ["RAY_AUTH_TOKEN_PATH"]"""),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "examples/ray.ipynb")
