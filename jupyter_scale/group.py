"""The workers' process group: ranks laid out, torch.distributed formed, the cells' transport.

`form` asks every worker where it runs, numbers the ranks as torchrun would (host by host),
chooses where they meet (a FileStore only this user can open when every rank is on this
host; rank 0's TCPStore on a trusted network otherwise), has every rank join, and opens
the kernel's direct channel where it can. It returns a frozen `Group`; the session keeps
it until the workers go or a cell cuts it, then forms another.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from . import rendezvous, sharedmem, worker
from .backends import Backend, channel
from .errors import ClusterError, WorkerLost
from .metrics import EventQueue
from .protocol import Layout

log = logging.getLogger(__name__)
# How long the workers on this host get to answer on the kernel's channel once told of it
# (they connect in milliseconds); without every answer the engine carries the cells.
CHANNEL_HELLO_S = 5.0


@dataclass(frozen=True)
class Group:
    """A formed process group: who the ranks are, where they met, what carries the cells."""

    workers: tuple[dict, ...]  # each rank's describe() (host, pid, node, ...) and its device
    backend: str  # torch.distributed's: gloo or nccl
    master_addr: str
    master_port: int
    store: dict  # {"file": path} on one host; {"addr", "port", "prefix"} across hosts
    store_dir: str | None  # the one-host FileStore's private directory
    hosts: int
    shared_memory: bool  # large frames go through shared memory (see sharedmem)
    channel: channel.CellChannel | None  # the kernel's direct channel, when it opened

    @property
    def all_local(self) -> bool:
        return self.store_dir is not None

    def describe(self) -> dict:
        return {"backend": self.backend, "master_addr": self.master_addr, "master_port": self.master_port,
                "store": self.store}

    def close(self) -> None:
        """Close the channel and remove the store's directory (the workers leave on their own)."""
        if self.channel is not None:
            self.channel.close()
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)


def form(backend: Backend, *, timeout: float, frames: sharedmem.SharedFrames | None, rendezvous_address: str,
         direct_channel: bool, events: Callable[[], EventQueue]) -> Group:
    """Lay out ranks (host, local rank, device), initialize torch.distributed on every
    worker, and open the direct channel when every worker runs here. Raises ClusterError
    naming the rank that could not join."""
    n = backend.size
    # Workers on this machine get large frames through shared memory instead of the
    # engine's messages (see sharedmem), when they read ours and we read theirs.
    probe = sharedmem.probe(frames) if frames is not None else None
    # The kernel's FileStore directory, made before asking: a worker that sees it shares
    # the kernel's file system (the one-host group's store lives there).
    store_dir = rendezvous.new_store_dir()
    toward = backend.contact_address() or rendezvous.LOOPBACK
    try:
        workers = backend.submit_each(worker.describe, [(probe, toward, store_dir)] * n).wait(timeout)
        workers = _in_rank_order(backend, workers)
        probes_back = [w.pop("shared_memory") for w in workers]
        here = rendezvous.node_identity()
        all_local = all(w["node"] == here and w["sees_store_dir"] for w in workers)
        if not all_local:
            shutil.rmtree(store_dir, ignore_errors=True)
        master_addr, port, store = (_one_host_store(store_dir) if all_local
                                    else _rank0_store(backend, workers, rendezvous_address, timeout))
        layouts = _layouts(workers, master_addr, port, store, timeout)
        joined = backend.submit_each(worker.join_group, [(layout,) for layout in layouts]).wait(timeout)
    except BaseException:
        shutil.rmtree(store_dir, ignore_errors=True)
        raise
    failed = [(rank, j["error"]) for rank, j in enumerate(joined) if "error" in j]
    if failed:
        shutil.rmtree(store_dir, ignore_errors=True)
        rank, error = failed[0]
        hint = ("" if all_local else ". Every host must reach rank 0 there; pick the address with "
                "%scale connect --rendezvous (see README, Several hosts)")
        raise ClusterError(f"rank {rank} (host {workers[rank]['hostname']}) could not join the process "
                           f"group at {master_addr}:{port}: {error}{hint}")
    for w, j in zip(workers, joined):
        w["device"] = j["device"]
    opened = _open_channel(backend, events, timeout) if all_local and direct_channel else None
    return Group(workers=tuple(workers), backend=layouts[0]["backend"], master_addr=master_addr, master_port=port,
                 store=store, store_dir=store_dir if all_local else None,
                 hosts=len({w["node"] for w in workers}),
                 shared_memory=all(p is not None and sharedmem.check_probe(*p) for p in probes_back),
                 channel=opened)


def _in_rank_order(backend: Backend, workers: list[dict]) -> list[dict]:
    """Each host's ranks next to each other, hosts in the order their first rank came: ranks
    numbered as torchrun numbers them (node by node), and a ring collective crosses between
    hosts once per host, not at every hop."""
    n = len(workers)
    given = [w.get("launcher_rank") for w in workers]
    if sorted(g[0] for g in given if g) == list(range(n)) and all(g and g[1] == n for g in given):
        # mpiexec or srun numbered them: rank i is MPI rank i (mpi4py in the cell agrees).
        order = sorted(range(n), key=lambda r: given[r][0])  # type: ignore[index]
    else:
        first_seen = {node: i for i, node in enumerate(dict.fromkeys(w["node"] for w in workers))}
        order = sorted(range(n), key=lambda r: first_seen[workers[r]["node"]])  # stable within a host
    if order == list(range(n)):
        return workers
    backend.order_ranks(order)
    return [workers[r] for r in order]


def _one_host_store(store_dir: str) -> tuple[str, int, dict]:
    """One host (the embedded cluster): loopback only, and a store that only this user can
    open (see rendezvous); MASTER_PORT is merely free for the cell's use."""
    return rendezvous.LOOPBACK, rendezvous.free_port(rendezvous.LOOPBACK), {"file": os.path.join(store_dir, "store")}


def _rank0_store(backend: Backend, workers: list[dict], address: str, timeout: float) -> tuple[str, int, dict]:
    """Several hosts: an address of rank 0's that every rank reaches, on a network the user
    trusts (see README, "Security"). Only rank 0 listens; it binds port 0."""
    n = len(workers)
    try:
        master_addr = rendezvous.choose_rendezvous_address(workers, address)
    except ValueError as exc:
        raise ClusterError(f"cannot form the process group: {exc}") from None
    opened = backend.submit_each(
        worker.open_rendezvous, [(r == 0, master_addr, n, timeout) for r in range(n)]
    ).wait(timeout)[0]
    if isinstance(opened, str):  # rank 0 could not listen there
        raise ClusterError(f"cannot form the process group: rank 0 (host {workers[0]['hostname']}) "
                           f"cannot listen on {master_addr}: {opened}; choose with %scale connect --rendezvous")
    # Handed to the ranks over the engine's authenticated channel only.
    return master_addr, opened, {"addr": master_addr, "port": opened, "prefix": f"jupyter_scale/{secrets.token_hex(16)}/"}


def _layouts(workers: list[dict], master_addr: str, port: int, store: dict, timeout: float) -> list[Layout]:
    n = len(workers)
    node_rank = {node: i for i, node in enumerate(dict.fromkeys(w["node"] for w in workers))}
    per_node = Counter(w["node"] for w in workers)
    dist_backend = rendezvous.select_backend([w["cuda_count"] for w in workers])
    seen: Counter = Counter()
    layouts: list[Layout] = []
    for rank, w in enumerate(workers):
        layouts.append(Layout(
            rank=rank, world_size=n, local_rank=seen[w["node"]], local_world_size=per_node[w["node"]],
            group_rank=node_rank[w["node"]], nodes=len(node_rank), master_addr=master_addr, master_port=port,
            store=store, backend=dist_backend, cuda_count=w["cuda_count"], timeout=timeout,
        ))
        seen[w["node"]] += 1
    return layouts


def _open_channel(backend: Backend, events: Callable[[], EventQueue], timeout: float) -> channel.CellChannel | None:
    """The cells' calls over the kernel's own channel, when the engine can serve it (see
    channel); else (None) through the engine."""
    serve: Any = backend.channel_server()
    if serve is None:
        return None
    try:
        opened = channel.CellChannel(backend.size, backend.gone_ranks, events())
    except (OSError, zmq.ZMQError) as exc:
        log.info("no direct channel (%s); cells go through the engine", exc)
        return None
    job = backend.submit_each(serve, opened.worker_arguments())
    try:
        job.wait(timeout)
        ready = opened.await_workers(CHANNEL_HELLO_S)
    except (ClusterError, WorkerLost) as exc:  # a worker that cannot: the engine carries the cells
        log.info("the workers' direct channel could not open (%s); cells go through the engine", exc)
        ready = False
    finally:
        job.release()
    if ready:
        return opened
    opened.close()
    with contextlib.suppress(ClusterError, WorkerLost):  # the ends that opened stop reconnecting
        backend.submit(channel.close_worker_end).wait(timeout)
    return None
