"""PaddlePaddle on the workers: the `PADDLE_*` variables of `paddle.distributed.launch`,
then `paddle.distributed.init_parallel_env()`, once per process (Paddle's group cannot be
formed again in a process: a second call returns the first group).

The cell calls `init_parallel_env()` and wraps its model in `paddle.DataParallel` as under
the launcher. Rank 0's store (PADDLE_MASTER) listens on every interface without
authentication: the kernel forms this group only where the user allows that (see
session.allow_unauthenticated_servers).
"""

from __future__ import annotations

import copyreg
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .. import patches, rendezvous
from . import FrameworkError, Place, connections_between_ranks

_group_sockets: set[int] = set()
_DATA_PARALLEL = patches.Patch("paddle.DataParallel", "a model wrapped again gets its wrapper (a second reducer "
                               "crashes Paddle's backward)", "framework paddle", also=("paddle.distributed.DataParallel",))
_PICKLE_PARAMETERS = patches.Patch("copyreg.dispatch_table[paddle.base.framework.EagerParamBase]", "parameters travel "
                                   "as parameters, not plain tensors", "framework paddle")


def form(place: Place, gather: Callable[[Any], list]) -> set[int]:
    if "tensorflow" in sys.modules:  # checked before anything is set up: no rank forms a part of the group
        raise FrameworkError("this worker has imported TensorFlow, and importing PaddlePaddle after it crashes "
                             "the process: %scale restart, then run the Paddle cell")
    # Ports as the launcher picks them: rank 0's store, and an endpoint per rank (Paddle
    # names them to the ranks; on the CPU nothing listens there).
    endpoints = gather(f"{place.address}:{rendezvous.free_port(place.address)}")
    master = gather(rendezvous.free_port("0.0.0.0") if place.rank == 0 else None)[0]  # Paddle binds every interface
    os.environ.update(
        PADDLE_TRAINER_ID=str(place.rank), PADDLE_TRAINERS_NUM=str(place.world_size),
        PADDLE_GLOBAL_RANK=str(place.rank), PADDLE_GLOBAL_SIZE=str(place.world_size),
        PADDLE_LOCAL_RANK=str(place.local_rank), PADDLE_LOCAL_SIZE=str(place.local_world_size),
        PADDLE_RANK_IN_NODE=str(place.local_rank), PADDLE_NNODES=str(place.nodes),
        PADDLE_MASTER=f"{endpoints[0].rsplit(':', 1)[0]}:{master}",
        PADDLE_CURRENT_ENDPOINT=endpoints[place.rank], PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
        PADDLE_DISTRI_BACKEND="nccl" if place.device.type == "cuda" else "gloo",
    )
    if place.device.type == "cuda":
        os.environ["FLAGS_selected_gpus"] = str(place.device.index or 0)
    # Paddle's import puts C handlers of its own on SIGTERM and the fatal signals (they
    # print and exit); the engine's, and faulthandler's, are put back.
    main = threading.current_thread() is threading.main_thread()  # handlers are the main thread's to set
    handler = signal.getsignal(signal.SIGTERM)
    import faulthandler

    import paddle.distributed as dist

    if main and handler is not None:
        signal.signal(signal.SIGTERM, handler)
    if faulthandler.is_enabled():
        faulthandler.disable()
        try:  # the process's own stderr: an engine's sys.stderr may be a capture without a descriptor
            faulthandler.enable(file=sys.__stderr__ or sys.stderr)  # (no __stderr__: enable's own default)
        except (OSError, ValueError, AttributeError):
            pass
    pickle_parameters()
    _wrap_once()
    before = rendezvous.tcp_socket_inodes()
    dist.init_parallel_env()
    opened = rendezvous.tcp_socket_inodes() - before
    # Not the store's connections: Paddle aborts the process when one breaks.
    _group_sockets.update(connections_between_ranks(opened, gather, except_port=master))
    return set(_group_sockets)


def _wrap_once() -> None:
    """`paddle.DataParallel(model)` of a model already wrapped gives that wrapper: a cell
    run twice would otherwise hook a second reducer onto the same parameters, and
    Paddle's backward then crashes the process (SIGSEGV)."""
    def patch(original: Any) -> type:
        wrappers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(model) -> its wrapper

        class DataParallel(original):  # type: ignore[misc, valid-type]
            def __new__(cls, layers, *args, **kwargs):
                if isinstance(layers, original):  # `model = DataParallel(model)`, run again
                    return layers
                found = wrappers.get(id(layers))
                return found if found is not None else super().__new__(cls)

            def __init__(self, layers, *args, **kwargs):
                if self is layers or wrappers.get(id(layers)) is self:
                    return
                super().__init__(layers, *args, **kwargs)
                wrappers[id(layers)] = self  # the wrapper holds the model: its id stays its own

        DataParallel.__qualname__ = original.__qualname__
        return DataParallel

    _DATA_PARALLEL.install(patch)


def pickle_parameters() -> None:
    """Pickle Paddle's parameters as parameters: by default one comes back a plain Tensor,
    which neither DataParallel nor an optimizer takes. Kernel and workers both need it."""
    from paddle.base.framework import EagerParamBase

    def register() -> Callable[[], None]:
        before = copyreg.dispatch_table.get(EagerParamBase)
        copyreg.pickle(EagerParamBase, _reduce_parameter)

        def remove() -> None:
            if before is None:
                copyreg.dispatch_table.pop(EagerParamBase, None)
            else:
                copyreg.dispatch_table[EagerParamBase] = before

        return remove

    _PICKLE_PARAMETERS.hook(register)


def _reduce_parameter(param: Any) -> tuple:
    return _parameter, (param.detach(), param.trainable, param.name)


def _parameter(tensor: Any, trainable: bool, name: str) -> Any:
    from paddle.base.framework import EagerParamBase

    return EagerParamBase.from_tensor(tensor, trainable=trainable, name=name)


def receiving() -> AbstractContextManager:
    return nullcontext()


def abort() -> None:
    """Shut gloo's connections between ranks: a peer blocked in a collective fails at once."""
    rendezvous.cut_connections(_group_sockets)


def weights(model: Any) -> dict:
    """A Layer's state dict as NumPy arrays (the kernel's Layer gets them with set_state_dict)."""
    return {key: value.numpy() for key, value in model.state_dict().items()}
