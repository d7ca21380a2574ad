"""Process-group setup on the workers: store, backend and device choice, teardown.

Rank 0 hosts the TCPStore on a socket it binds itself to `master_addr` with port 0, so
the port is free by construction (no race between choosing and binding, no fixed 29500)
and a loopback cluster listens on 127.0.0.1 only (TCPStore would bind every interface).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def select_backend(cuda_counts: list[int]) -> str:
    """NCCL when every worker has a GPU, else gloo (NCCL cannot mix with CPU ranks)."""
    if cuda_counts and all(c > 0 for c in cuda_counts) and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def select_device(backend: str, local_rank: int, cuda_count: int) -> torch.device:
    """One GPU per local rank (wrapping when there are more ranks than GPUs); else CPU."""
    if backend == "nccl" and cuda_count > 0:
        return torch.device("cuda", local_rank % cuda_count)
    return torch.device("cpu")


def loopback_interface() -> str | None:
    """Name of the loopback interface ('lo' on Linux, 'lo0' on macOS), if any."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return None


def open_store(master_addr: str, world_size: int, timeout: float) -> tuple[dist.TCPStore, int]:
    """Rank 0: listen on master_addr at a free port; return the store and its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((master_addr, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        master_addr,
        port,
        world_size=world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),  # the store takes ownership of the socket
    )
    return store, port


def connect_store(master_addr: str, port: int, world_size: int | None, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(
        master_addr,
        port,
        world_size=world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def set_torchrun_env(rank: int, world_size: int, local_rank: int, local_world_size: int,
                     master_addr: str, master_port: int) -> None:
    """The variables torchrun sets, so code written for torchrun runs unchanged."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_world_size),
        GROUP_RANK="0",
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    if master_addr == LOOPBACK and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo otherwise listens on the address the hostname resolves to.
        iface = loopback_interface()
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface


def tcp_socket_inodes() -> set[int]:
    """Inodes of this process's open sockets (Linux; empty elsewhere)."""
    inodes = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def init_group(store: dist.Store, backend: str, rank: int, world_size: int,
               device: torch.device, timeout: datetime.timedelta | None = None) -> set[int]:
    """Join the group; returns the inodes of the sockets the group opened."""
    if backend == "nccl":
        torch.cuda.set_device(device)
    before = tcp_socket_inodes()
    # No short collective timeout: a 30-minute training step is normal. A failing rank
    # unblocks its peers' collectives by cutting its connections (see abort_group).
    # The real one, also when a worker has replaced it for torchrun-style cells.
    init = getattr(dist.init_process_group, "__wrapped__", dist.init_process_group)
    options = {"timeout": timeout} if timeout is not None else {}
    init(backend, store=store, rank=rank, world_size=world_size, **options)
    return tcp_socket_inodes() - before


def abort_group(group_sockets: set[int]) -> None:
    """Cut this rank's connections to the group, then tear the group down.

    destroy_process_group() alone does not close gloo's connections while anything still
    references the group (a DDP model does), and ProcessGroup.abort() is a no-op for
    gloo; peers blocked in a collective with this rank would wait for the collective
    timeout (30 min). Shutting the sockets down makes every peer's pending collective
    fail at once with "connection closed by peer", which then aborts that peer too.
    """
    cut_connections(group_sockets)
    destroy_group()


def cut_connections(group_sockets: set[int]) -> None:
    """Shut down the group's TCP connections (safe from any thread; fds stay open)."""
    if not group_sockets or not os.path.isdir("/proc/self/fd"):
        return
    for fd in os.listdir("/proc/self/fd"):
        _shutdown_if_ours(int(fd), group_sockets)


ABORT_KEY = "jupyter_scale/abort"


class AbortWatch:
    """A thread that cuts this rank's group connections when the kernel asks.

    A rank blocked inside a collective never returns to Python, so neither SIGINT nor a
    message to the engine reaches it. The kernel bumps a counter in the group's store
    instead; this thread sees it, cuts the connections, and the blocked collective fails
    with an error the cell then reports. The group is formed anew for the next cell.
    """

    def __init__(self, master_addr: str, port: int, group_sockets: set[int], poll: float = 0.25):
        self._store = connect_store(master_addr, port, None, timeout=30)
        self._seen = self._store.add(ABORT_KEY, 0)
        self._sockets = group_sockets
        self._poll = poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jupyter_scale-abort-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            try:
                value = self._store.add(ABORT_KEY, 0)
            except Exception:  # the store went away with its group: nothing left to watch
                return
            if value != self._seen:
                self._seen = value
                cut_connections(self._sockets)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._poll + 1)


def request_abort(master_addr: str, port: int) -> None:
    """From the kernel: make every rank's AbortWatch cut its connections."""
    connect_store(master_addr, port, None, timeout=2).add(ABORT_KEY, 1)


def _shutdown_if_ours(fd: int, group_sockets: set[int]) -> None:
    try:
        # dup() first, then check the dup's inode: the number `fd` may be closed and
        # reused by another socket meanwhile, the dup cannot. Shutdown acts on the
        # shared socket; only the dup is closed, so gloo's own fd stays valid.
        dup = os.dup(fd)
    except OSError:
        return
    try:
        if os.fstat(dup).st_ino not in group_sockets:
            return
        sock = socket.socket(fileno=dup)
        dup = -1  # the socket object owns it now
        try:
            # Only connections: shutting gloo's listening socket down makes its accept
            # loop throw, which terminates the process.
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already disconnected
        finally:
            sock.close()
    finally:
        if dup >= 0:
            os.close(dup)


def destroy_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
