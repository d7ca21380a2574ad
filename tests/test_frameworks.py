"""Which framework a cell is for, and whose failure is the cause: the logic, without a
cluster. (TensorFlow and Paddle are never imported into the test process: Paddle crashes a
process that imported TensorFlow. Their weights' way back is tested in their kernels.)"""

import types

import pytest

from jupyter_scale import frameworks
from jupyter_scale.errors import RankFailure, RemoteError


def _module(name):
    return types.ModuleType(name)


def test_the_cells_imports_and_the_notebook_values_it_reads_name_its_framework(monkeypatch):
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
    # Keras 3 on torch is torch
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    assert choose("import keras", {}, []) == "torch"
    # Horovod runs over torch or TensorFlow: it wins; torch tensors are not a framework of their own
    assert choose("import horovod.torch as hvd\nimport torch", {}, []) == "horovod"
    assert choose("import torch\nx = torch.ones(1)", {}, []) == "torch"
    # Names an earlier cell bound on the workers count with the framework of that cell
    assert choose("print(hvd.rank())", {}, [], held={"horovod"}) == "horovod"
    assert choose("strategy.run(step)", {}, [], held={"tensorflow"}) == "tensorflow"


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


def test_a_dead_worker_is_the_cause_even_when_a_peer_failed_first():
    # A worker killed (out of memory): its peer's collective fails at once ("connection
    # closed", inside DDP's backward where nothing marks the collective), the death is noticed
    # later. The death is the cause. (Paddle's cells differ: Paddle ends a process whose
    # group a failing peer cut; tests/test_paddle.py shows rank 1's error named there.)
    error = RemoteError([_failure(1, "RuntimeError", 10.0), _failure(0, "WorkerLost", 10.5, lost=True)])
    assert error.rank == 0
    error = RemoteError([_failure(1, "KeyboardInterrupt", 10.0, interrupted=True), _failure(0, "ValueError", 10.2)])
    assert error.rank == 0
