"""TensorFlow cells: TF_CONFIG and one MultiWorkerMirroredStrategy per worker, on a real
ipyparallel cluster; TensorFlow's own data-parallel API (a custom loop with strategy.run)."""

import importlib.util

import framework_cells
import pytest

from conftest import _started_kernel, _stop_and_check

# Never imported here: Paddle crashes a process that imported TensorFlow (see test_frameworks).
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed"),
]

NOTEBOOK = """
import numpy as np
import tensorflow as tf
import keras

rng = np.random.default_rng(0)
X = rng.normal(size=(1024, 8)).astype("float32")
Y = (X @ np.arange(1, 9, dtype="float32")[:, None] / 10 + 0.5).astype("float32")

def build_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])

def same_everywhere(ranks, notebook):
    return len(ranks) == 2 and all(
        np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(ranks[0], ranks[1], notebook))

model = build_model()

def weights_now():
    return [w.copy() for w in model.get_weights()]

before = [w.copy() for w in model.get_weights()]
"""

# As TensorFlow's multi-worker tutorial writes it for a custom loop; `model` is the notebook's.
TRAIN = """%%distribute --workers 2
EPOCHS = {epochs}
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

epoch_losses = []
for epoch in range(EPOCHS):
    losses = [float(train_step(batch)) for batch in batches]
    epoch_losses.append(sum(losses) / len(losses))
    report(loss=epoch_losses[-1], epoch=epoch)
weights = [w.copy() for w in model.get_weights()]
"""


def train(epochs):
    return TRAIN.replace("{epochs}", str(epochs))

SAME_ON_BOTH_RANKS = "same_everywhere(jupyter_scale.get_session().gather('weights'), model.get_weights())"


@pytest.fixture(scope="module")
def kernel():
    k = _started_kernel()
    yield k
    _stop_and_check(k)


def test_tensorflow_is_refused_until_the_user_allows_its_unauthenticated_server(kernel):
    framework_cells.refused_until_allowed(kernel, "%%distribute --workers 2\nimport tensorflow as tf\nprint(tf.__version__)")


def test_two_workers_train_with_the_strategy_and_the_notebook_model_gets_rank_0s_weights(kernel):
    losses = framework_cells.trains_and_brings_rank_0s_weights_back(kernel, NOTEBOOK, train, SAME_ON_BOTH_RANKS)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0] / 4, losses  # strategy.reduce: one loss
    # The strategy is the worker's one: formed once, the next cell gets it again and trains on.
    kernel.ok("%%distribute\nimport json, os\nsame = tf.distribute.MultiWorkerMirroredStrategy() is strategy\n"
              "workers = json.loads(os.environ['TF_CONFIG'])['cluster']['worker']", timeout=120)
    assert kernel.value("jupyter_scale.get_session().gather('same')") == [True, True]
    workers = kernel.value("jupyter_scale.get_session().gather('workers')")
    assert workers[0] == workers[1] and len(set(workers[0])) == 2 and all(w.startswith("127.0.0.1:") for w in workers[0])
    kernel.ok(train(1), timeout=240)
    assert kernel.value(SAME_ON_BOTH_RANKS) is True


def test_an_error_on_rank_1_names_it_and_the_next_cell_trains_on_fresh_workers(kernel):
    framework_cells.error_on_rank_1_is_named_and_the_next_cell_trains_on_fresh_workers(kernel, train, SAME_ON_BOTH_RANKS)


def test_an_interrupt_stops_both_ranks_and_the_next_cell_works(kernel):
    framework_cells.interrupt_stops_both_ranks_and_the_next_cell_trains(kernel, train, SAME_ON_BOTH_RANKS)


def test_weights_that_do_not_fit_leave_the_notebook_model_unchanged(kernel):
    kernel.ok("from jupyter_scale.pullback import set_weights\n"
              "other = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])\n"
              "snapshot = [w.copy() for w in model.get_weights()]")
    for wrong in ("other.get_weights()", "model.get_weights()[:1]"):
        out = kernel.cell(f"set_weights(model, {wrong})")
        assert not out.ok and "unchanged" in out.error["evalue"], out.error_text
    assert kernel.value("all(np.array_equal(a, b) for a, b in zip(snapshot, model.get_weights()))") is True


def test_a_paddle_cell_after_tensorflow_cells_gets_fresh_workers(kernel):
    # Importing Paddle into a process that imported TensorFlow crashes it: the workers are
    # replaced first, and the notebook (which never imports Paddle here) is left alone.
    out = kernel.cell("%%distribute --framework paddle\nimport paddle, paddle.distributed as dist\n"
                      "dist.init_parallel_env()\nt = paddle.to_tensor([rank + 1.0])\ndist.all_reduce(t)\n"
                      "total = float(t[0])", timeout=300)
    assert out.ok, out.error_text
    assert "PaddlePaddle crashes a process that has imported TensorFlow" in out.stderr
    assert kernel.value("jupyter_scale.get_session().gather('total')") == [3.0, 3.0]
