"""Regenerate examples/debugging.ipynb (run from the repository root), executed:

    python examples/tools/make_debugging.py

A debugger's prompts are answered by a person, which neither nbval nor `nbconvert --execute`
can do: this script runs the notebook in a kernel itself and types each interactive cell's
answers (kept in the cell's metadata, `jupyter_scale.answers`), storing what the cell showed,
prompts and answers included, as JupyterLab shows them. nbval runs every other cell and skips
those (`nbval-skip`); tests/test_debugging.py runs the whole notebook live with those answers.
"""
import sys
from pathlib import Path

import nbformat as nbf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def ignore(source, *tags):
    # Timings, pids and losses vary between runs: nbval runs the cell, does not compare it.
    return code(source, metadata={"tags": ["nbval-ignore-output", *tags]})


def interactive(source, answers):
    """A cell whose debugger prompts `answers` answer, one per prompt."""
    return code(source, metadata={"tags": ["nbval-skip"], "jupyter_scale": {"answers": answers}})


CELLS = [
md("""# Debugging a distributed cell

When one rank misbehaves, the notebook is the place to look at it: stop it at a breakpoint,
open pdb where it raised, see where every rank is when a cell hangs, and read the ranks'
output as one program's. Everything here works the same on ipyparallel, Dask and Ray, and
for workers on other hosts.

The cells with a debugger prompt show the output of a run in JupyterLab: pdb's prompts come
as the notebook's ordinary input box (`[rank 1] (Pdb) `), and what was typed there is shown
after each prompt."""),
code("%load_ext jupyter_scale"),
code("""import time
import torch, torch.nn as nn
import torch.distributed as dist
from torch.utils.data import TensorDataset, DataLoader
import jupyter_scale

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
data = TensorDataset(torch.randn(768, 32), torch.randint(0, 4, (768,)))"""),
md("""## Logs that read like one program

Above two workers, a line that several ranks print alike shows once, labelled with their
ranks; a rank's own lines keep its label:"""),
ignore("""%%distribute --workers 3
loader = DataLoader(data, batch_size=64, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    print(f"epoch {epoch} done")
    print(f"last loss {loss.item():.3f}")"""),
md("""## A breakpoint on one rank

`breakpoint()` stops the rank that reaches it, and the notebook asks for pdb's commands. The
other ranks go on until they block (in a training loop, at the next gradient averaging,
waiting for rank 1); here rank 0 finishes the cell. `c` lets rank 1 go on. With several
ranks stopped, `@0,2 p x` or `@all c` sends one command to several of them."""),
interactive("""%%distribute
x, y = next(iter(DataLoader(data, batch_size=64)))
loss = nn.functional.cross_entropy(model(x), y)
if rank == 1:
    breakpoint()
loss.backward()
print("backward done")""", ["p loss", "p x.shape", "c"]),
md("""## Post-mortem: `%scale debug`

Rank 1 gets a batch of the wrong width (a bug that only one rank's data shows) and raises.
The error names rank 1 and shows its traceback:"""),
ignore("""%%distribute
def features(batch):
    width = batch.shape[1]
    if width != 32:
        raise ValueError(f"expected 32 features, got {width}")
    return model(batch)
batch = torch.randn(8, 32 if rank != 1 else 30)
out = features(batch)""", "raises-exception"),
md("""`%scale debug` opens pdb on the rank the error names, in the frames where it raised, with
its variables as they were (like IPython's `%debug`):"""),
interactive("%scale debug", ["p width", "up", "p batch.shape", "q"]),
md("""## Where is everyone

A cell that times out (or that you interrupt) says where each rank was: rank 0 waited in
`all_reduce`, rank 1 never got there."""),
ignore("""%%distribute --timeout 3
t = torch.ones(1)
if rank == 1:
    time.sleep(30)
dist.all_reduce(t)""", "raises-exception"),
md("""While a cell runs (here, in a thread of its own, as a background job does),
`stacks()` prints every rank's Python stacks, each headed by where its cell is:"""),
ignore("""import threading
session = jupyter_scale.get_session()

def hanging_cell():
    try:
        session.run("t = torch.ones(1)\\nif rank == 1:\\n    time.sleep(6)\\ndist.all_reduce(t)\\n", timeout=4)
    except Exception as exc:
        print("the hanging cell:", type(exc).__name__)

hung = threading.Thread(target=hanging_cell)
hung.start()
time.sleep(2)
print(session.stacks())
hung.join()"""),
md("The workers are ready for the next cell:"),
code("""%%distribute
t = torch.ones(1) * rank
dist.all_reduce(t)
if rank == 0:
    print("sum of ranks:", int(t.item()))"""),
code("%scale stop"),
]


def run(cells) -> None:
    """Execute the cells in a kernel, answering the interactive ones; store their outputs."""
    from kernel import Kernel

    k = Kernel()
    try:
        for count, cell in enumerate((c for c in cells if c.cell_type == "code"), start=1):
            answers = list(cell.metadata.get("jupyter_scale", {}).get("answers", []))
            shown: list[list[str]] = []  # [stream, text], in the order they came

            def on_stream(name, text, shown=shown):
                if shown and shown[-1][0] == name:
                    shown[-1][1] += text
                else:
                    shown.append([name, text])

            def typed(prompt, answers=answers, shown=shown):
                answer = answers.pop(0)
                on_stream("stdout", f"{prompt}{answer}\n")  # as the frontend shows what was typed
                return answer

            result = k.cell(cell.source, timeout=300, on_stream=on_stream, stdin=typed if answers else None,
                            history=True)
            assert not answers, f"prompts left unanswered in:\n{cell.source}"
            cell.execution_count = count
            cell.outputs = [nbf.v4.new_output("stream", name=name, text=text) for name, text in shown]
            if result.error is not None:
                cell.outputs.append(nbf.v4.new_output("error", ename=result.error["ename"],
                                                      evalue=result.error["evalue"],
                                                      traceback=result.error["traceback"]))
    finally:
        k.shutdown()


if __name__ == "__main__":
    nb = nbf.v4.new_notebook()
    nb.cells = CELLS
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    run(nb.cells)
    nbf.write(nb, ROOT / "examples" / "debugging.ipynb")
