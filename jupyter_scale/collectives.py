"""Which blocking torch.distributed collective a cell's rank is in.

The Python entry points of the collectives (what cells and automatic mode call) are marked:
the heartbeat says which one a rank waits in, and a rank freed from one (a peer cut the
group, an interrupt) says which it was in when it failed, so that the kernel tells waiting
ranks from the ones they waited for. DDP's own allreduces run inside backward(), in C++,
and are not marked. A mark also tells automatic mode that the cell combines across ranks.
"""

from __future__ import annotations

import functools
import time

from . import patches, training

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
                "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                "barrier", "gather", "scatter", "broadcast_object_list", "gather_object", "send", "recv")


_MARKS = {name: patches.Patch(f"torch.distributed.{name}", "the heartbeat says which collective a rank waits in",
                              patches.MARKS, also=(f"torch.distributed.distributed_c10d.{name}",))
          for name in _COLLECTIVES}

_waiting: tuple[str, float] | None = None  # (name, since) of the blocking collective the cell is in
_failed_in: str | None = None  # the collective the cell was in when it raised


def install_marks() -> None:
    """Mark the collectives of this torch (once per process)."""
    import torch.distributed as dist

    def mark(original, name):
        def marked(*args, **kwargs):
            global _waiting, _failed_in
            training.note_collective()  # automatic mode: the cell combines across ranks itself
            if kwargs.get("async_op") or _waiting is not None:
                return original(*args, **kwargs)
            _waiting = (name, time.time())
            try:
                return original(*args, **kwargs)
            except BaseException:
                _failed_in = name
                raise
            finally:
                _waiting = None

        return functools.update_wrapper(marked, original)

    for name, patch in _MARKS.items():
        if hasattr(dist, name):  # the collectives of this torch
            patch.install(functools.partial(mark, name=name))


def cell_started() -> None:
    global _waiting, _failed_in
    _waiting = _failed_in = None


def failed_in() -> str | None:
    """The collective the cell was in when it raised, if any."""
    return _failed_in


def heartbeat_status() -> dict:
    found = _waiting
    return {"collective": found[0], "since": found[1]} if found else {"collective": None}
