"""Regenerate examples/slurm.ipynb (run from the repository root), then execute it on a Slurm
login node (sbatch and squeue on PATH; they find the cluster as always, or through $SLURM_CONF):

    python examples/tools/make_slurm.py
    jupyter nbconvert --to notebook --execute --inplace examples/slurm.ipynb

Without a Slurm at hand (as root, with Debian's slurm-wlm and munge), execute it on the tests'
one-node Slurm:

    python -c "import os, subprocess, sys; sys.path.insert(0, 'tests'); import slurm
    with slurm.Slurm(cpus=8) as s: subprocess.run(['jupyter', 'nbconvert', '--to', 'notebook', '--execute',
        '--inplace', 'examples/slurm.ipynb'], env=dict(os.environ, SLURM_CONF=s.env['SLURM_CONF']), check=True)"

Under pytest (nbval), examples/conftest.py starts that one-node Slurm for it (tests/slurm.py).
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def ignore(source):
    # Job ids, addresses, node names and losses vary between runs: nbval runs the cell, does not compare it.
    return nbf.v4.new_code_cell(source, metadata={"tags": ["nbval-ignore-output"]})


nb.cells = [
md("""# Training on workers that Slurm runs

`%scale start --launcher slurm` submits the workers as a Slurm job (one job of N tasks, each
task one worker) and keeps the cluster's controller in this kernel. From then on
`%%distribute` cells run on that job's workers exactly as on the local cluster: the notebook's
model and data travel to them, and the trained model comes back into the notebook.

Run the notebook where `sbatch` and `squeue` work (a login node, or a JupyterHub on one). The
job's script, output and credentials go to an owner-only directory under
`~/.jupyter_scale/jobs`, which the compute nodes must see under the same path (home is, at most
sites)."""),
code("%load_ext jupyter_scale"),
code("""import os, socket, subprocess
import torch, torch.nn as nn
from torch.utils.data import TensorDataset, DataLoader
import jupyter_scale

g = torch.Generator().manual_seed(0)
x = torch.randn(1024, 16, generator=g)
teacher = torch.randn(16, 4, generator=g)
y = (x @ teacher).argmax(dim=1)
data = TensorDataset(x, y)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
before = torch.cat([p.detach().flatten() for p in model.parameters()])"""),
md("""## Submitting the workers

Two workers, one CPU each, for at most ten minutes. The cell returns once both workers run
and have formed their process group; while the job is pending it says so every few seconds
(interrupt the kernel to cancel it). No partition is given here, so the cluster's default
partition is used. At a site, add what its jobs need:

```python
%scale start --launcher slurm --workers 8 --partition gpu --account proj42 --qos normal \\
    --cpus-per-worker 4 --gpus-per-worker 1 --mem 16G --time 02:00:00
```

or set it once for every notebook, in `~/.ipython/profile_default/ipython_config.py` (or the
site's IPython configuration):

```python
c.SlurmLauncher.partition = "gpu"
c.SlurmLauncher.account = "proj42"
c.SlurmLauncher.sbatch_options = ["--constraint=a100"]
```

`%%distribute --launcher slurm --workers 2 ...` does the same at the first cell that needs
the workers."""),
ignore("%scale start --launcher slurm --workers 2 --time 00:10:00"),
md("`%scale status` shows the job, its state and its node, with the workers' ranks:"),
ignore("%scale status"),
md("""## Training

The training cell is the one that runs locally, unchanged. Automatic mode gives each rank
its shard of the DataLoader and averages the gradients at every step. The last line keeps
each rank's weights in a worker variable, to compare them below."""),
ignore("""%%distribute
loader = DataLoader(data, batch_size=32, shuffle=True)   # each rank gets its own shard
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(2):
    for xb, yb in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()                 # gradients are averaged across ranks
        report(loss=loss)
    print(f"epoch {epoch} loss {loss.item():.3f}")
weights = torch.cat([p.detach().flatten() for p in model.parameters()])"""),
md("""The notebook's `model` is the same object as before the cell, and now holds the trained
weights: rank 0's, which are every rank's, since every rank took the same averaged steps."""),
code("""session = jupyter_scale.get_session()
after = torch.cat([p.detach().flatten() for p in model.parameters()])
per_rank = session.gather("weights")
assert len(per_rank) == 2
assert all(torch.equal(w, after) for w in per_rank), "the notebook's model holds every rank's weights"
assert not torch.equal(after, before), "the model was trained"
losses = [p["loss"] for p in jupyter_scale.history() if p["rank"] == 0]  # the last cell's points
assert sum(losses[-5:]) < sum(losses[:5]), "the loss went down"
print("trained weights, equal on every rank and in the notebook")"""),
md("""Each rank is a task of the Slurm job: it runs with Slurm's environment, and rank i is
the job's task i (`SLURM_PROCID`), as `srun` numbered them."""),
ignore("""%%distribute
slurm_job, slurm_task = os.environ["SLURM_JOB_ID"], int(os.environ["SLURM_PROCID"])
print(f"Slurm job {slurm_job}, task {slurm_task} of {os.environ['SLURM_NTASKS']}, on {socket.gethostname()}")"""),
code("""job = [j["job"] for j in session.status()["jobs"]]
assert len(job) == 1, job
assert session.gather("slurm_job") == job * 2  # both ranks in the one job submitted
assert session.gather("slurm_task") == [0, 1]  # rank i is task i
print("ranks 0 and 1 are tasks 0 and 1 of the notebook's Slurm job")"""),
md("""## Giving the nodes back

`%scale stop` cancels the job and waits until it has left the queue. Keep the cluster
between cells while you work (the job holds its nodes, up to its time limit), and stop it
when you are done. Should the job end under a running cell (`scancel`, its time limit,
preemption), that cell fails with `WorkerDied` naming the job, and the next `%%distribute`
submits a new job."""),
code("%scale stop"),
md("""Nothing is left in the queue (on a shared cluster, `squeue -h -u $USER` lists only your
own jobs):"""),
code("""queue = subprocess.run(["squeue", "-h"], capture_output=True, text=True, check=True).stdout
assert queue == "", queue
print("the queue is empty")"""),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "examples/slurm.ipynb")
