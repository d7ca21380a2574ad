"""Regenerate examples/horovod.ipynb (run from the repository root), then execute it:

    python examples/tools/make_horovod.py
    jupyter nbconvert --to notebook --execute --inplace examples/horovod.ipynb
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def ignore(source):
    # Timings and losses vary between runs: nbval runs the cell, does not compare it.
    return nbf.v4.new_code_cell(source, metadata={"tags": ["nbval-ignore-output"]})


nb.cells = [
md("""# Horovod on the workers

A `%%distribute` cell that imports Horovod gets what `horovodrun --gloo` gives its workers: a gloo
rendezvous and `HOROVOD_RANK`, `HOROVOD_SIZE`, `HOROVOD_LOCAL_RANK`, `HOROVOD_CROSS_RANK`, ... The
cell is written as Horovod's PyTorch guide writes it: `hvd.init()`, `hvd.broadcast_parameters`,
`hvd.DistributedOptimizer`. Horovod is set up once per worker and the next cells reuse it. The
model is a torch model: afterwards the notebook's holds rank 0's weights.

Horovod is not on PyPI as a wheel: see the README (Frameworks) for how to build it."""),
md("""Horovod's rendezvous, and gloo's connections between the workers after it, take anyone who
connects: a stranger could join the group or break it. jupyter_scale sets it up only where you say
that every user of this machine and every host that reaches it is trusted:"""),
code("""%load_ext jupyter_scale
%config ScaleSession.allow_unauthenticated_servers = True"""),
code("""import numpy as np
import torch
import jupyter_scale

torch.manual_seed(0)
X = torch.randn(2048, 8)
Y = X @ torch.arange(1.0, 9.0)[:, None] / 10 + 0.5
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
loss_before = torch.nn.functional.mse_loss(model(X), Y).item()"""),
md("""## Training on two workers

`DistributedSampler` gives each worker its part of every epoch, with Horovod's rank and size;
`DistributedOptimizer` averages the gradients across the workers."""),
ignore("""%%distribute --workers 2
import horovod.torch as hvd
hvd.init()
data = torch.utils.data.TensorDataset(X, Y)
sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank())
loader = torch.utils.data.DataLoader(data, batch_size=32, sampler=sampler)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
for epoch in range(5):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    report(loss=loss.item(), epoch=epoch)
weights = {k: v.numpy().copy() for k, v in model.state_dict().items()}"""),
md("## Every worker, and the notebook, hold the same weights"),
code("""ranks = jupyter_scale.get_session().gather("weights")
print("equal on both workers:", all(np.array_equal(ranks[0][k], ranks[1][k]) for k in ranks[0]))
print("the notebook's model is rank 0's:",
      all(np.array_equal(v, model.state_dict()[k].numpy()) for k, v in ranks[0].items()))"""),
code("""loss_after = torch.nn.functional.mse_loss(model(X), Y).item()
print("the loss went down:", loss_after < loss_before / 4)"""),
ignore("jupyter_scale.history(as_frame=True).groupby(\"rank\").tail(1)"),
md("""## Once per worker

`hvd.init()` in the next cell gets the group formed before, with the ranks of the cluster, and
`hvd.shutdown()` leaves it to the next cells. Running the training cell again wraps a new
`DistributedOptimizer` over the same model: the newest one takes over its gradients (the hooks of
two would each start the same allreduce, which Horovod refuses). After a failed or interrupted
cell, the next Horovod cell starts fresh workers."""),
code("""%%distribute
import os
import horovod.torch as hvd
hvd.init()
place = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
         "rendezvous": os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"]}"""),
code("""print(jupyter_scale.get_session().gather("place"))"""),
ignore("%scale stop"),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "examples/horovod.ipynb")
