"""Regenerate examples/paddle.ipynb (run from the repository root), then execute it:

    python examples/tools/make_paddle.py
    jupyter nbconvert --to notebook --execute --inplace examples/paddle.ipynb
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def ignore(source):
    # Timings and losses vary between runs: nbval runs the cell, does not compare it.
    return nbf.v4.new_code_cell(source, metadata={"tags": ["nbval-ignore-output"]})


nb.cells = [
md("""# PaddlePaddle on the workers: `paddle.distributed`

A `%%distribute` cell that uses Paddle gets the environment of `python -m paddle.distributed.launch`
(`PADDLE_TRAINER_ID`, `PADDLE_TRAINERS_NUM`, `PADDLE_MASTER`, `PADDLE_CURRENT_ENDPOINT`,
`PADDLE_TRAINER_ENDPOINTS`, ...). The cell calls `paddle.distributed.init_parallel_env()` and wraps
its model in `paddle.DataParallel` as under the launcher; the group is formed once per worker
and the next cells reuse it. Afterwards the notebook's `Layer` holds rank 0's weights."""),
md("""Rank 0's Paddle store (`PADDLE_MASTER`) listens on every interface and serves anyone who
connects: a stranger could read it, or stall or break the group. jupyter_scale forms it only where
you say that every user of this machine and every host that reaches it is trusted:"""),
code("""%load_ext jupyter_scale
%config ScaleSession.allow_unauthenticated_servers = True"""),
ignore("""import numpy as np
import paddle
import jupyter_scale"""),
code("""rng = np.random.default_rng(0)
X = rng.normal(size=(2048, 8)).astype("float32")
Y = (X @ np.arange(1, 9, dtype="float32")[:, None] / 10 + 0.5).astype("float32")

class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.hidden = paddle.nn.Linear(8, 32)
        self.out = paddle.nn.Linear(32, 1)

    def forward(self, x):
        return self.out(paddle.nn.functional.relu(self.hidden(x)))

paddle.seed(0)
model = Net()
loss_before = float(paddle.nn.functional.mse_loss(model(paddle.to_tensor(X)), paddle.to_tensor(Y)))"""),
md("""## Training on two workers

`DistributedBatchSampler` gives each worker its part of every epoch; `DataParallel` averages the
gradients across the workers."""),
ignore("""%%distribute --workers 2
import paddle.distributed as dist
dist.init_parallel_env()
parallel = paddle.DataParallel(model)
data = paddle.io.TensorDataset([paddle.to_tensor(X), paddle.to_tensor(Y)])
sampler = paddle.io.DistributedBatchSampler(data, batch_size=32, shuffle=True)
loader = paddle.io.DataLoader(data, batch_sampler=sampler)
optimizer = paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters())
for epoch in range(5):
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = paddle.nn.functional.mse_loss(parallel(x), y)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
    report(loss=float(loss), epoch=epoch)
weights = {k: v.numpy() for k, v in model.state_dict().items()}"""),
md("## Every worker, and the notebook, hold the same weights"),
code("""ranks = jupyter_scale.get_session().gather("weights")
print("equal on both workers:", all(np.array_equal(ranks[0][k], ranks[1][k]) for k in ranks[0]))
print("the notebook's model is rank 0's:",
      all(np.array_equal(v, model.state_dict()[k].numpy()) for k, v in ranks[0].items()))"""),
code("""loss_after = float(paddle.nn.functional.mse_loss(model(paddle.to_tensor(X)), paddle.to_tensor(Y)))
print("the loss went down:", loss_after < loss_before / 4)"""),
ignore("jupyter_scale.history(as_frame=True).groupby(\"rank\").tail(1)"),
md("""## Once per worker

Running the cell again trains on: `init_parallel_env()` returns the group formed before, and
`DataParallel(model)` the wrapper made before (a second one would hook the same parameters
twice). After a failed or interrupted cell, the next Paddle cell starts fresh workers: Paddle
cannot form its group again in the same process."""),
code("""%%distribute
import os
master, me = os.environ["PADDLE_MASTER"], os.environ["PADDLE_CURRENT_ENDPOINT"]
same = paddle.DataParallel(model) is parallel"""),
code("""print(jupyter_scale.get_session().gather("same"))"""),
ignore("%scale stop"),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "examples/paddle.ipynb")
