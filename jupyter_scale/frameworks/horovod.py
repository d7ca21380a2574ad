"""Horovod on the workers, over gloo: the rendezvous and the variables that `horovodrun`
gives its workers, then `hvd.init()`, once per process: the cell's own `hvd.init()` gets
that group, and its `hvd.shutdown()` leaves it to the next cells.

`horovodrun` serves the rendezvous from its driver; here rank 0 serves it, on the address
the other ranks reach, and only until every rank has joined. Horovod trains the torch
model the cell uses (`horovod.torch`): it comes back to the notebook as a torch model does.
That rendezvous, and gloo's connections after it, take anyone who connects: the kernel
forms this group only where the user allows that (see session.allow_unauthenticated_servers).
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .. import patches, rendezvous
from . import FrameworkError, Place, connections_between_ranks

_group_sockets: set[int] = set()
_INIT = patches.Patch("horovod.torch.mpi_ops.init", "the cell's hvd.init() gets the group formed for the worker",
                      "framework horovod", also=("horovod.torch.init",))  # `hvd.init` is mpi_ops' own
_SHUTDOWN = patches.Patch("horovod.torch.mpi_ops.shutdown", "the cell's hvd.shutdown() leaves the group to the next "
                          "cells", "framework horovod", also=("horovod.torch.shutdown",))
_MAKE_HOOKS = [patches.Patch(f"horovod.torch.optimizer.{name}._make_hook", "only the newest optimizer over a "
                             "parameter allreduces it in backward (a cell run again makes a second)", "framework horovod")
               for name in ("_DistributedOptimizer", "_DistributedAdasumOptimizer")]


def form(place: Place, gather: Callable[[Any], list]) -> set[int]:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise FrameworkError(f"Horovod for PyTorch cannot be imported on this worker ({exc}): see README, "
                             "Frameworks, for how to build it") from None
    if not hvd.gloo_built():
        raise FrameworkError("this worker's Horovod was built without gloo (HOROVOD_WITH_GLOO=1)")
    _latest_optimizer_hooks()
    # Who is where, as horovodrun's host assignment says it: a host is an address the
    # others reach (names need not resolve), its ranks numbered locally and across hosts.
    # Every rank checks what every rank said, so that all refuse together or none does.
    iface = rendezvous.interface_of(place.address) or (
        rendezvous.loopback_interface() if place.address == rendezvous.LOOPBACK else None)
    hosts = gather([place.address, place.local_rank, place.local_world_size, iface])
    if missing := [rank for rank, (*_, found) in enumerate(hosts) if found is None]:
        raise FrameworkError(f"no network interface holds the address of rank(s) {missing} "
                             f"({', '.join(hosts[r][0] for r in missing)}): Horovod's gloo needs one")
    assert iface is not None  # this rank's is among those checked
    addresses = list(dict.fromkeys(address for address, *_ in hosts))
    taken = {(address, local_rank) for address, local_rank, *_ in hosts}
    if len(taken) < len(hosts):  # two hosts behind one address: Horovod could not tell them apart
        raise FrameworkError("two ranks on different machines reach the others from one address, "
                             "which Horovod takes for one host")
    from horovod.runner.common.util.hosts import SlotInfo

    slots = []
    for rank, (address, local_rank, local_size, _) in enumerate(hosts):
        across = [a for a in addresses if (a, local_rank) in taken]  # the hosts with a rank of this local rank
        slots.append(SlotInfo(hostname=address, rank=rank, local_rank=local_rank, cross_rank=across.index(address),
                              size=place.world_size, local_size=local_size, cross_size=len(across)))
    server = _serve_rendezvous(place.address, slots) if place.rank == 0 else None
    try:
        port = gather(server.server_address[1] if server else None)[0]
        mine = slots[place.rank]
        os.environ.update(
            HOROVOD_GLOO_RENDEZVOUS_ADDR=hosts[0][0], HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
            HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
            HOROVOD_GLOO_IFACE=iface,
            HOROVOD_HOSTNAME=mine.hostname, HOROVOD_RANK=str(place.rank), HOROVOD_SIZE=str(place.world_size),
            HOROVOD_LOCAL_RANK=str(mine.local_rank), HOROVOD_LOCAL_SIZE=str(mine.local_size),
            HOROVOD_CROSS_RANK=str(mine.cross_rank), HOROVOD_CROSS_SIZE=str(mine.cross_size),
        )
        before = rendezvous.tcp_socket_inodes()
        hvd.init()
        opened = rendezvous.tcp_socket_inodes() - before
        gather(None)  # every rank has joined: the rendezvous is done with
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    _keep_for_the_next_cells(hvd)
    _group_sockets.update(connections_between_ranks(opened, gather))
    return set(_group_sockets)


def _keep_for_the_next_cells(hvd: Any) -> None:
    """The cell's `hvd.init()` gets the group formed here, and `hvd.shutdown()` leaves it to
    the next cells: a second rendezvous cannot happen (its server is closed)."""
    def init(comm: Any = None, process_sets: Any = None) -> None:
        if comm or process_sets:
            raise FrameworkError("Horovod's group was formed before the cell ran, of every rank and without "
                                 "process sets: hvd.init(comm=..., process_sets=...) cannot apply (see README, "
                                 "Frameworks)")

    def shutdown() -> None:
        warnings.warn("jupyter_scale: Horovod's group is kept for the next cells; hvd.shutdown() does nothing "
                      "(%scale restart ends the workers)", stacklevel=2)

    _INIT.install(lambda _: init)
    _SHUTDOWN.install(lambda _: shutdown)


def _serve_rendezvous(address: str, slots: list) -> Any:
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    server = RendezvousHTTPServer((address, 0), RendezvousHandler, 0)  # horovodrun's binds every interface
    server.init(slots)
    threading.Thread(target=server.serve_forever, name="horovod-rendezvous", daemon=True).start()
    return server


def _latest_optimizer_hooks() -> None:
    """Only the DistributedOptimizer made over a parameter last starts its allreduce during
    backward. A cell run again wraps a new optimizer over the model the worker kept; the
    first one's hooks would still fire, and Horovod refuses a second allreduce of the same
    name in one step. (An older optimizer that is still stepped averages in its step.)"""
    latest: dict[int, weakref.ref] = {}  # id(parameter) -> its newest optimizer (tensors are no dict keys)

    def only_for_latest(make_hook: Callable) -> Callable:
        def _make_hook(self: Any, p: Any) -> Callable:
            hook = make_hook(self, p)
            if id(p) not in latest:
                weakref.finalize(p, latest.pop, id(p), None)
            latest[id(p)] = weakref.ref(self)

            def latest_only(*args: Any) -> Any:
                if latest[id(p)]() is self:
                    return hook(*args)
                return None

            return latest_only

        return _make_hook

    # DistributedOptimizer() makes its class from a copy of these classes' dicts.
    for patch in _MAKE_HOOKS:
        patch.install(only_for_latest)


def receiving() -> AbstractContextManager:
    return nullcontext()


def abort() -> None:
    """Shut gloo's connections between ranks: Horovod fails the collective it is blocked in."""
    rendezvous.cut_connections(_group_sockets)

