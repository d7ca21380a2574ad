"""Which framework a cell is for, and whose failure is the cause: the logic, without a
cluster. (TensorFlow and Paddle are never imported into the test process: Paddle crashes a
process that imported TensorFlow. Their weights' way back is tested in their kernels.)"""

import types

import pytest

from jupyter_scale import frameworks
from jupyter_scale.errors import RankFailure, RemoteError


def _module(name):
    return types.ModuleType(name)


def test_the_cells_imports_and_the_notebook_values_it_reads_name_its_framework():
    choose = frameworks.choose
    assert choose("x = 1", {}, []) == "torch"
    assert choose("import tensorflow as tf\nx = tf.ones(1)", {}, []) == "tensorflow"
    assert choose("from keras import layers", {}, []) == "tensorflow"
    assert choose("import paddle.distributed as dist", {}, []) == "paddle"
    # read from the notebook: a module, a class of a framework, a notebook subclass of one
    ns = {"tf": _module("tensorflow"), "pd": _module("paddle.nn")}
    assert choose("tf.constant(1)", ns, ["tf"]) == "tensorflow"
    assert choose("pd.Linear(1, 1)", ns, ["pd"]) == "paddle"
    Base = type("Model", (), {"__module__": "keras.src.models.model"})
    Net = type("Net", (Base,), {"__module__": "__main__"})
    assert choose("model.fit()", {"model": Net()}, ["model"]) == "tensorflow"
    assert choose("x = Net", {"Net": Net}, ["Net"]) == "tensorflow"
    # Horovod runs over torch or TensorFlow: it wins; torch tensors are not a framework of their own
    assert choose("import horovod.torch as hvd\nimport torch", {}, []) == "horovod"
    assert choose("import torch\nx = torch.ones(1)", {}, []) == "torch"


def test_a_cell_that_uses_two_frameworks_must_name_one_and_a_named_one_wins():
    with pytest.raises(frameworks.FrameworkError, match="paddle and torch.*--framework"):
        frameworks.choose("import paddle\nimport torch", {}, [])
    with pytest.raises(frameworks.FrameworkError, match="paddle and tensorflow"):
        frameworks.choose("import paddle\nimport tensorflow", {}, [])
    assert frameworks.choose("import paddle\nimport torch", {}, [], named="paddle") == "paddle"
    assert frameworks.choose("import tensorflow", {}, [], named="torch") == "torch"
    with pytest.raises(frameworks.FrameworkError, match="unknown framework 'jax'"):
        frameworks.choose("x = 1", {}, [], named="jax")


def _failure(rank, etype, t, **kw):
    return RankFailure(rank, etype, "", "", time=t, **kw)


def test_a_death_after_a_ranks_own_error_is_its_consequence_and_a_death_before_is_the_cause():
    # Paddle ends rank 0's process when rank 1's error cuts the group: rank 1 is the cause,
    # even when the kernel notices the death first.
    error = RemoteError([_failure(0, "WorkerLost", 10.5, lost=True), _failure(1, "ValueError", 10.0)])
    assert error.rank == 1 and str(error).startswith("rank 1 failed: ValueError")
    # A worker killed first: its peer's collective fails ("connection closed"), then the death
    # is noticed. The death is the cause.
    error = RemoteError([_failure(1, "RuntimeError", 10.0, collective="all_reduce"),
                         _failure(0, "WorkerLost", 10.5, lost=True)])
    assert error.rank == 0
    # A death with no error before it stays the cause of what follows.
    error = RemoteError([_failure(0, "WorkerLost", 10.5, lost=True), _failure(1, "ValueError", 11.0)])
    assert error.rank == 0
