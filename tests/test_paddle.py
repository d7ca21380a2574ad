"""PaddlePaddle cells: the PADDLE_* variables and one init_parallel_env per worker, on a
real ipyparallel cluster; Paddle's own data-parallel API (DataParallel, DistributedBatchSampler)."""

import importlib.util

import framework_cells
import pytest

from conftest import _started_kernel, _stop_and_check

# Never imported here: Paddle crashes a process that imported TensorFlow (see test_frameworks).
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(importlib.util.find_spec("paddle") is None, reason="paddle is not installed"),
]

NOTEBOOK = """
import numpy as np
import paddle

rng = np.random.default_rng(0)
X = rng.normal(size=(1024, 8)).astype("float32")
Y = (X @ np.arange(1, 9, dtype="float32")[:, None] / 10 + 0.5).astype("float32")

class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.hidden = paddle.nn.Linear(8, 16)
        self.out = paddle.nn.Linear(16, 1)

    def forward(self, x):
        return self.out(paddle.nn.functional.relu(self.hidden(x)))

def same_everywhere(ranks, notebook):
    return len(ranks) == 2 and all(
        np.array_equal(ranks[0][k], ranks[1][k]) and np.array_equal(ranks[0][k], notebook[k].numpy()) for k in notebook)

paddle.seed(0)
model = Net()

def weights_now():
    return [v.numpy().copy() for v in model.state_dict().values()]

before = weights_now()
"""

# As Paddle's data-parallel guide writes it; `model` is the notebook's.
TRAIN = """%%distribute --workers 2
EPOCHS = {epochs}
import paddle.distributed as dist
dist.init_parallel_env()
parallel = paddle.DataParallel(model)
data = paddle.io.TensorDataset([paddle.to_tensor(X), paddle.to_tensor(Y)])
sampler = paddle.io.DistributedBatchSampler(data, batch_size=32, shuffle=True)
loader = paddle.io.DataLoader(data, batch_sampler=sampler)
optimizer = paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters())
epoch_losses = []
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    losses = []
    for x, y in loader:
        loss = paddle.nn.functional.mse_loss(parallel(x), y)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    epoch_losses.append(sum(losses) / len(losses))
    report(loss=epoch_losses[-1], epoch=epoch)
weights = {k: v.numpy().copy() for k, v in model.state_dict().items()}
"""

SAME_ON_BOTH_RANKS = "same_everywhere(jupyter_scale.get_session().gather('weights'), model.state_dict())"


def train(epochs):
    return TRAIN.replace("{epochs}", str(epochs))



@pytest.fixture(scope="module")
def kernel():
    k = _started_kernel()
    yield k
    _stop_and_check(k)


def test_paddle_is_refused_until_the_user_allows_its_unauthenticated_store(kernel):
    framework_cells.refused_until_allowed(kernel, "%%distribute --workers 2\nimport paddle\nprint(paddle.__version__)")


def test_two_workers_train_with_dataparallel_and_the_notebook_layer_gets_rank_0s_weights(kernel):
    losses = framework_cells.trains_and_brings_rank_0s_weights_back(kernel, NOTEBOOK, train, SAME_ON_BOTH_RANKS)
    assert losses[0][-1] < losses[0][0] / 4 and losses[1][-1] < losses[1][0] / 4, losses  # each rank's own batches
    # The group is the worker's one: formed once, the next cell's init_parallel_env gets it again.
    kernel.ok("%%distribute\nimport os\nsame = dist.init_parallel_env() is dist.init_parallel_env()\n"
              "endpoints = [os.environ['PADDLE_MASTER'], *os.environ['PADDLE_TRAINER_ENDPOINTS'].split(',')]",
              timeout=120)
    assert kernel.value("jupyter_scale.get_session().gather('same')") == [True, True]
    endpoints = kernel.value("jupyter_scale.get_session().gather('endpoints')")
    assert endpoints[0] == endpoints[1] and len(set(endpoints[0])) == 3
    assert all(e.startswith("127.0.0.1:") for e in endpoints[0])
    kernel.ok(train(1), timeout=240)
    assert kernel.value(SAME_ON_BOTH_RANKS) is True


def test_an_error_on_rank_1_names_it_and_the_next_cell_trains_on_fresh_workers(kernel):
    framework_cells.error_on_rank_1_is_named_and_the_next_cell_trains_on_fresh_workers(kernel, train, SAME_ON_BOTH_RANKS)


def test_an_interrupt_stops_both_ranks_and_the_next_cell_works(kernel):
    framework_cells.interrupt_stops_both_ranks_and_the_next_cell_trains(kernel, train, SAME_ON_BOTH_RANKS)


def test_state_that_does_not_fit_leaves_the_notebook_layer_unchanged_and_parameters_travel_as_parameters(kernel):
    kernel.ok("from jupyter_scale.pullback import set_weights\n"
              "snapshot = {k: v.numpy().copy() for k, v in model.state_dict().items()}\n"
              "state = dict(snapshot)")
    for wrong in ("{**state, 'hidden.weight': np.zeros((3, 3), 'float32')}", "{'other': state['out.bias']}"):
        out = kernel.cell(f"set_weights(model, {wrong})")
        assert not out.ok and "unchanged" in out.error["evalue"], out.error_text
    assert kernel.value("all(np.array_equal(v, model.state_dict()[k].numpy()) for k, v in snapshot.items())") is True
    # Shipped to a worker, a parameter must still be one: DataParallel and the optimizers want them.
    kernel.ok("import pickle, cloudpickle")
    assert kernel.value("{type(p).__name__ for p in pickle.loads(cloudpickle.dumps(model)).parameters()}") \
        == {"EagerParamBase"}
