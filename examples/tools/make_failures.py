"""Regenerate examples/failures.ipynb (run from the repository root), then execute it:

    python examples/tools/make_failures.py
    jupyter nbconvert --to notebook --execute --inplace --allow-errors examples/failures.ipynb
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def failing(source):
    # The cell is meant to raise (nbval allows it); its traceback varies, so it is not compared.
    # The cell after it checks what the failure was.
    return nbf.v4.new_code_cell(source, metadata={"tags": ["raises-exception", "nbval-ignore-output"]})


def ignore(source):
    return nbf.v4.new_code_cell(source, metadata={"tags": ["nbval-ignore-output"]})


nb.cells = [
md("""# When a rank fails

A distributed cell can fail on one rank while the others wait for it inside a collective.
`%%distribute` never leaves them hanging: the cell ends within seconds with an error that
names the rank and shows its traceback, the other ranks are stopped, and the next cell works
on the same workers. Nothing in the notebook is lost."""),
code("%load_ext jupyter_scale"),
code("""import torch, torch.nn as nn
import torch.distributed as dist
import jupyter_scale

torch.manual_seed(0)
model = nn.Linear(8, 2)
weights_before = model.weight.detach().clone()"""),
ignore("""%%distribute --workers 2
print("ready on rank", rank)"""),
md("Rank 1 raises while rank 0 is already inside an `all_reduce`, waiting for it:"),
failing("""%%distribute
t = torch.ones(1)
if rank == 1:
    raise ValueError("bad batch on rank 1")
dist.all_reduce(t)   # rank 0 waits here for rank 1, which never comes"""),
code("""last = jupyter_scale.get_session().runs[-1]
print(last.status)
print("names rank 1:", "rank 1 failed: ValueError: bad batch on rank 1" in last.error)
print("the model is untouched:", torch.equal(model.weight, weights_before))"""),
md("The next cell re-forms the process group and runs:"),
code("""%%distribute
t = torch.ones(1)
dist.all_reduce(t)
if rank == 0:
    print("all_reduce over", int(t.item()), "ranks")"""),
md("""## A rank that hangs

Rank 1 sleeps before the collective. There is no time limit by default (long training cells
are normal: a heartbeat names a rank the others have waited for a minute); `--timeout` sets
one, and the error names the silent rank and shows where it was."""),
failing("""%%distribute --timeout 3
import time
if rank == 1:
    time.sleep(600)
dist.all_reduce(torch.ones(1))"""),
code("""last = jupyter_scale.get_session().runs[-1]
print(last.status)
print(last.error)"""),
md("""The errors are typed, so code that drives the session can tell them apart:
`RemoteError` (a rank raised), `WorkerDied` (a worker process died), `CellTimeout` (also a
`TimeoutError`), each with the rank and every rank's failure."""),
code("""try:
    jupyter_scale.get_session().run("import time\\nif rank == 0:\\n    time.sleep(600)\\ndist.barrier()", timeout=3)
except jupyter_scale.CellTimeout as error:
    print("silent:", error.silent_ranks, "waiting:", error.waiting_ranks)"""),
md("""## A worker that dies

Rank 1's process exits in the middle of the cell. The cell fails at once, saying how the
process ended; the next cell replaces the worker (the workers' variables are lost, the
notebook's are not)."""),
failing("""%%distribute
import os
if rank == 1:
    os._exit(1)
dist.all_reduce(torch.ones(1))"""),
code("""last = jupyter_scale.get_session().runs[-1]
print(last.status)
print("names rank 1 and how it died:", "rank 1 failed" in last.error and "exited with status 1" in last.error)"""),
ignore("""%%distribute
t = torch.ones(1)
dist.all_reduce(t)
if rank == 0:
    print("all_reduce over", int(t.item()), "ranks")"""),
code("""print("the model is still the notebook's:", torch.equal(model.weight, weights_before))"""),
code("%scale stop"),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "examples/failures.ipynb")
