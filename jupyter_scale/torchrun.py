"""Code written for torchrun, on the group we run: its `init_process_group()` call.

A cell or an exported script written for torchrun calls `init_process_group()` itself. On
the workers (and in an exported `train.py`) the group exists already: the call is a no-op.
After the cell destroyed the group, the call forms a new one through our store, as
torchrun's env:// rendezvous cannot (MASTER_PORT is taken by our store).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from . import patches

_INIT_PROCESS_GROUP = patches.Patch(
    "torch.distributed.distributed_c10d.init_process_group", "a cell written for torchrun calls it: a no-op while "
    "the group exists, a new group through ours after the cell destroyed it", patches.TORCHRUN,
    also=("torch.distributed.init_process_group",))  # where `import torch.distributed as dist` finds it
# How a worker joins a new group through its store (worker.py): True if it did.
_rejoin: Callable[[Any, Any], bool] | None = None


def keep_process_group(rejoin: Callable[[Any, Any], bool] | None = None) -> None:
    """Make torchrun-style `init_process_group()` calls work on the group we run (workers,
    exported scripts): a no-op while the group exists; after the cell destroyed it, `rejoin
    (backend, timeout)` forms a new one. Before the cell or script imports it by name."""
    global _rejoin
    if rejoin is not None:
        _rejoin = rejoin

    def patch(original):
        @functools.wraps(original)  # pickles by reference, as the original
        def init_process_group(backend=None, init_method=None, timeout=None, *args, **kwargs):
            if dist.is_initialized():
                return None  # the group the cell runs in
            if (_rejoin is not None and init_method is None and kwargs.get("store") is None
                    and _rejoin(backend, timeout)):
                return None
            return original(backend, init_method, timeout, *args, **kwargs)  # the user's own rendezvous

        return init_process_group

    _INIT_PROCESS_GROUP.install(patch)
