"""Regenerate examples/export.ipynb (run from the repository root), then execute it:

    python examples/tools/make_export.py
    jupyter nbconvert --to notebook --execute --inplace examples/export.ipynb
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def ignore(source):
    # Paths, timings and losses vary between runs: nbval runs the cell, does not compare it.
    return nbf.v4.new_code_cell(source, metadata={"tags": ["nbval-ignore-output"]})


# The training cell, exported first, then run.
TRAIN = """loader = DataLoader(data, batch_size=64, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(2):
    for xb, yb in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        report(loss=loss)"""

nb.cells = [
md("""# From the notebook to a job: `%scale export`

A cell that trains well with `%%distribute` becomes a job directory that runs without the
notebook: `train.py` (the notebook code the cell needs, then the cell), the notebook's values
it reads (`values.pt`), and how to launch it: `run.sh` (torchrun), `job.sbatch` (Slurm),
`trainjob.yaml` (Kubeflow Trainer), `pytorchjob.yaml` (Kubeflow's older training operator) and
`rayjob.yaml` (KubeRay), with a `Dockerfile`, a pinned
`requirements.txt` and a README.

This notebook exports a training cell, runs the job with the real `torchrun`, and checks that
it trains to the weights the same cell trains to under `%%distribute`."""),
code("%load_ext jupyter_scale"),
code("""import torch, torch.nn as nn
from torch.utils.data import TensorDataset, DataLoader
import jupyter_scale

HIDDEN = 64"""),
code("""class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 4))
    def forward(self, x):
        return self.layers(x)"""),
code("""g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 32, generator=g)
y = (x @ torch.randn(32, 4, generator=g)).argmax(dim=1)
data = TensorDataset(x, y)

torch.manual_seed(0)
model = Net()
start = {k: v.clone() for k, v in model.state_dict().items()}  # to train again from here"""),
md("""## Export the cell

`--export DIR` on the cell writes the job instead of running the cell (`%scale export DIR`
exports the last `%%distribute` cell run). The seed of automatic mode is drawn from the
notebook's RNG, as a run draws it: seeding the notebook first makes the export and the run
below start alike."""),
code("""import os, tempfile

torch.manual_seed(1)           # the export draws automatic mode's seed from here
where = tempfile.mkdtemp()     # a directory of our own for the job
job = os.path.join(where, "job")"""),
ignore("%%distribute --workers 2 --export {job}\n" + TRAIN),
code("""print(sorted(os.listdir(job)))"""),
md("""`train.py` holds the imports, the literal `HIDDEN`, the class `Net` (from the cell that
defined it), the loading of `data` and `model` (saved, with the model's current weights), and
the cell, run under `jupyter_scale.script`: the process group from torchrun's variables,
automatic mode with that seed, `report()` as JSON lines, rank 0's weights saved at the end."""),
ignore("""print(open(os.path.join(job, "train.py")).read())"""),
md("## The same cell, with `%%distribute`, from the same state"),
code("""model.load_state_dict(start)
torch.manual_seed(1)
print("the model and the notebook's RNG are back where the export found them")"""),
ignore("%%distribute --workers 2\n" + TRAIN),
md("""## The job, with torchrun

`run.sh` is what you would run on a machine with the requirements installed; here it uses the
kernel's environment (its `torchrun`)."""),
code("""import subprocess, sys

env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
done = subprocess.run(["bash", os.path.join(job, "run.sh")], env=env, capture_output=True, text=True, timeout=600)
print("exit status", done.returncode)"""),
code("""trained = torch.load(os.path.join(job, "output", "model.pt"))
print("the job's weights are the cell's:",
      all(torch.allclose(trained[k], v, atol=1e-6) for k, v in model.state_dict().items()))"""),
code("""import json

job_losses = [json.loads(line)["loss"] for line in open(os.path.join(job, "output", "metrics-rank0.jsonl"))]
cell_losses = [p["loss"] for p in jupyter_scale.history() if p["rank"] == 0]
print("rank 0's losses too:", len(job_losses) == len(cell_losses) and
      all(abs(a - b) < 1e-6 for a, b in zip(job_losses, cell_losses)))"""),
ignore("%scale stop"),
code("""import shutil

shutil.rmtree(where)"""),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "examples/export.ipynb")
