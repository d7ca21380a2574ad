"""Regenerate examples/tensorflow.ipynb (run from the repository root), then execute it:

    python examples/tools/make_tensorflow.py
    jupyter nbconvert --to notebook --execute --inplace examples/tensorflow.ipynb
"""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def ignore(source):
    # Timings and losses vary between runs: nbval runs the cell, does not compare it.
    return nbf.v4.new_code_cell(source, metadata={"tags": ["nbval-ignore-output"]})


nb.cells = [
md("""# TensorFlow on the workers: `MultiWorkerMirroredStrategy`

A `%%distribute` cell that uses TensorFlow gets what a multi-worker launcher gives each worker:
`TF_CONFIG` (every worker's address, a free port each, and this worker's index), and a
`tf.distribute.MultiWorkerMirroredStrategy` formed once per worker, before the cell's first
TensorFlow op. The cell calls `MultiWorkerMirroredStrategy()` as under any launcher and gets that
strategy, in this cell and the next ones.

Training is TensorFlow's own: a custom loop with `strategy.run` and
`experimental_distribute_dataset` (Keras 3's `model.fit` does not run under this strategy; see
the README's Frameworks table). Afterwards the notebook's Keras model holds rank 0's weights."""),
md("""TensorFlow's server (the `TF_CONFIG` port) listens on every interface and runs any graph that
anyone sends it, as you. jupyter_scale forms it only where you say that every user of this machine
and every host that reaches it is trusted:"""),
code("""%load_ext jupyter_scale
%config ScaleSession.allow_unauthenticated_servers = True"""),
ignore("""import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's C++ log (its probing for CUDA), here and on the workers

import numpy as np
import tensorflow as tf
import keras
import jupyter_scale"""),
code("""rng = np.random.default_rng(0)
X = rng.normal(size=(2048, 8)).astype("float32")
Y = (X @ np.arange(1, 9, dtype="float32")[:, None] / 10 + 0.5).astype("float32")

def build_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])

model = build_model()
loss_before = float(keras.losses.MeanSquaredError()(Y, model.predict(X, verbose=0)))"""),
md("""## Training on two workers

`model` is the notebook's: it arrives on each worker under the strategy's scope, so its
variables are mirrored, and the gradients of the global batch are summed across the workers
at every step."""),
ignore("""%%distribute --workers 2
strategy = tf.distribute.MultiWorkerMirroredStrategy()
GLOBAL_BATCH = 64
batches = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH))
with strategy.scope():
    optimizer = keras.optimizers.SGD(0.05)
    optimizer.build(model.trainable_variables)

@tf.function
def train_step(batch):
    def step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(x, training=True) - y), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return strategy.reduce("SUM", strategy.run(step, args=batch), axis=None)

for epoch in range(5):
    losses = [float(train_step(batch)) for batch in batches]
    report(loss=sum(losses) / len(losses), epoch=epoch)
weights = model.get_weights()"""),
md("## Every worker, and the notebook, hold the same weights"),
code("""ranks = jupyter_scale.get_session().gather("weights")
print("equal on both workers:", all(np.array_equal(a, b) for a, b in zip(*ranks)))
print("the notebook's model is rank 0's:", all(np.array_equal(a, b) for a, b in zip(ranks[0], model.get_weights())))"""),
code("""loss_after = float(keras.losses.MeanSquaredError()(Y, model.predict(X, verbose=0)))
print("the loss went down:", loss_after < loss_before / 4)"""),
ignore("jupyter_scale.history(as_frame=True).groupby(\"rank\").tail(1)"),
md("""## The strategy is formed once

The next cell's `MultiWorkerMirroredStrategy()` is the same strategy: its collectives are set
up once per process. After a failed or interrupted cell, the next TensorFlow cell starts fresh
workers (TensorFlow cannot form its group again in the same process)."""),
code("""%%distribute
import json, os
same = tf.distribute.MultiWorkerMirroredStrategy() is strategy
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]"""),
code("""print(jupyter_scale.get_session().gather("same"), jupyter_scale.get_session().gather("index"))"""),
ignore("%scale stop"),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "examples/tensorflow.ipynb")
