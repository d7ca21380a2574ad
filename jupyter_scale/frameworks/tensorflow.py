"""TensorFlow on the workers: `TF_CONFIG` as a multi-worker launcher sets it, and one
MultiWorkerMirroredStrategy per process, formed before the cell's first TensorFlow op
(TensorFlow configures its collectives at program startup, once).

The cell calls `tf.distribute.MultiWorkerMirroredStrategy()` as under any launcher and
gets that strategy, in this cell and the next. Notebook models arrive under its scope,
so their variables are mirrored across the workers.

TensorFlow's server (the TF_CONFIG port) listens on every interface and runs whatever
graph anyone sends it: the kernel forms this group only where the user allows servers
without authentication (see session.allow_unauthenticated_servers).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from .. import patches, rendezvous
from . import FrameworkError, Place

_strategy: Any = None
_STRATEGY = patches.Patch("tensorflow.distribute.MultiWorkerMirroredStrategy", "the cell's strategy is the one "
                          "formed for the worker, in this cell and the next", "framework tensorflow")


def form(place: Place, gather: Callable[[Any], list]) -> set[int]:
    global _strategy
    # TensorFlow binds its server to every interface, whatever TF_CONFIG names; the port is
    # free there now. The others reach this rank at `place.address`.
    port = rendezvous.free_port("0.0.0.0")
    workers = gather(f"{_host(place.address)}:{port}")
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers},
                                          "task": {"type": "worker", "index": place.rank}})
    import tensorflow as tf

    if place.device.type == "cuda":  # this rank's GPU only, as for torch (before TensorFlow sees any)
        gpus = tf.config.list_physical_devices("GPU")
        tf.config.set_visible_devices(gpus[place.device.index or 0] if gpus else [], "GPU")
    original = tf.distribute.MultiWorkerMirroredStrategy

    class MultiWorkerMirroredStrategy(original):  # type: ignore[misc, valid-type]
        """The worker's one strategy: formed here, and what the cell's calls get."""

        _formed = None

        def __new__(cls, *args, **kwargs):
            return cls._formed if cls._formed is not None else super().__new__(cls)

        def __init__(self, *args, **kwargs):
            if type(self)._formed is self:
                if args or kwargs:
                    warnings.warn("jupyter_scale: the worker's MultiWorkerMirroredStrategy was formed before the "
                                  "cell ran; the arguments given to it here do not apply", stacklevel=2)
                return
            super().__init__(*args, **kwargs)
            type(self)._formed = self

    MultiWorkerMirroredStrategy.__qualname__ = original.__qualname__
    try:
        _strategy = MultiWorkerMirroredStrategy()
    except RuntimeError as exc:
        if "startup" in str(exc):  # "Collective ops must be configured at program startup"
            raise FrameworkError("TensorFlow already ran on this worker before its group was formed (an earlier "
                                 "cell without --framework tensorflow?): %scale restart, then run the "
                                 "TensorFlow cell first") from None
        raise
    _STRATEGY.install(lambda _: MultiWorkerMirroredStrategy, owner=tf.distribute)
    return set()  # its connections are made later, by TensorFlow's own threads: `abort` frees them


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def receiving() -> AbstractContextManager:
    """Notebook models and optimizers are rebuilt under the strategy: mirrored variables."""
    return _strategy.scope()


def abort() -> None:
    from tensorflow.python.eager import context
    from tensorflow.python.framework import errors

    # A collective blocked in C++ never returns to Python for SIGINT; this makes it raise.
    context.context().abort_collective_ops(errors.ABORTED, "jupyter_scale: another rank failed or was interrupted")


def weights(model: Any) -> list:
    """A Keras model's weights as NumPy arrays (the kernel's model gets them with set_weights)."""
    return model.get_weights()
