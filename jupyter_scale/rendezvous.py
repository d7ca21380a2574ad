"""Process-group setup on the workers: store, backend and device choice, teardown.

The group's store is where the ranks meet (gloo's addresses) and where the kernel asks
them to abort. torch's TCPStore authenticates nobody and lists its keys to anyone who
connects, and loopback is open to every local user; so when every rank runs on the
kernel's machine the store is a FileStore in a directory only this user can enter
(`new_store_dir`). Across hosts rank 0 hosts a TCPStore on a socket it binds itself to
`master_addr` with port 0 (the port is free by construction, and TCPStore alone would
bind every interface), its keys under a random prefix: that stops blind writes, not a
peer who lists the keys, so such a network must be trusted (see README, "Security").
A store is described by a `spec`: {"file": path} or {"addr", "port", "prefix"}.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist

# Imported before any group forms, for its import-time defaults: see forget_group_in_defaults
# (the first optimizer imports torch._dynamo, which imports this module).
import torch.distributed.nn.functional  # noqa: F401

log = logging.getLogger(__name__)

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


# --------------------------------------------------------------------------------------
# Where the ranks meet, across hosts
# --------------------------------------------------------------------------------------

def node_identity() -> str:
    """Which network stack this process sees: the boot (machine) and its network namespace.

    Processes with the same identity share a loopback; a host name proves nothing (two
    containers may share one, one machine's namespaces each have their own). Falls back to
    the host name where /proc does not say.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/net')}"
    except OSError:
        return socket.gethostname()


def interfaces() -> list[dict]:
    """This host's IPv4 interfaces other than loopback: name, address, prefix length."""
    import ipaddress

    import psutil

    found = []
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family != socket.AF_INET or not a.netmask or a.address.startswith("127."):
                continue
            prefix = ipaddress.ip_interface(f"{a.address}/{a.netmask}").network.prefixlen
            found.append({"name": name, "address": a.address, "prefixlen": prefix})
    return found


def source_address(toward: str) -> str | None:
    """The address this host sends from to reach `toward` (the kernel's routing table
    decides; a UDP connect sends nothing), or None without a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((toward, 9))
            return sock.getsockname()[0]
        except OSError:
            return None


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address` (loopback included)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


def choose_rendezvous_address(workers: list[dict], wanted: str = "") -> str:
    """Rank 0's address that every rank can reach, from what `worker.describe` said.

    `wanted`: an address of rank 0's, or a network (10.1.0.0/16) to take rank 0's address
    in. Otherwise rank 0's address on a network that holds every other host's address
    toward the cluster, else the one rank 0 itself reaches the cluster from.
    Raises ValueError, saying what rank 0 has, when neither gives an address.
    """
    import ipaddress

    first = workers[0]
    own = first.get("interfaces") or []
    where = f"rank 0 (host {first.get('hostname', '?')}) has {', '.join(i['address'] for i in own) or 'no address'}"
    if wanted:
        if "/" in wanted:
            network = ipaddress.ip_network(wanted, strict=False)
            for i in own:
                if ipaddress.ip_address(i["address"]) in network:
                    return i["address"]
            raise ValueError(f"rendezvous network {wanted}: {where}, none in it")
        if wanted not in {i["address"] for i in own} and wanted != LOOPBACK:
            raise ValueError(f"rendezvous address {wanted} is not rank 0's: {where}")
        return wanted
    others = [w.get("address") for w in workers[1:] if w.get("node") != first.get("node")]
    for i in own:
        network = ipaddress.ip_network(f"{i['address']}/{i['prefixlen']}", strict=False)
        if others and all(a and ipaddress.ip_address(a) in network for a in others):
            return i["address"]
    if first.get("address") and not first["address"].startswith("127."):
        return first["address"]
    if not others:  # every rank on rank 0's host, which reaches the cluster over loopback
        return LOOPBACK
    raise ValueError(f"no address to meet at: {where}, and none on the other hosts' networks; "
                     "choose one with %scale connect --rendezvous")


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


STORE_DIR_PREFIX = "jupyter_scale-group-"


def new_store_dir() -> str:
    """A directory for a one-host group's FileStore that only this user can enter (0700).

    Named after this process, so that the directories of kernels that died without
    removing theirs are found and removed here; a kernel killed by SIGKILL has its watcher
    remove it (processes.kernel_watch).
    """
    from . import processes

    _remove_orphan_store_dirs()
    path = tempfile.mkdtemp(prefix=f"{STORE_DIR_PREFIX}{os.getpid()}-")
    processes.kernel_watch().add_path(path)
    return path


def _remove_orphan_store_dirs() -> None:
    import shutil

    from . import processes

    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(STORE_DIR_PREFIX):
            continue
        pid = name[len(STORE_DIR_PREFIX):].split("-")[0]
        path = os.path.join(root, name)
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid() or processes.alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def free_port(host: str) -> int:
    """A port free on `host` now (for MASTER_PORT where no TCPStore takes one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def group_store(spec: dict, timeout: float, master: dist.Store | None = None) -> dist.Store:
    """This process's handle on the group's store; `master`: rank 0's own TCPStore."""
    if "file" in spec:
        # world size -1: torch does not count handles to delete the file; the kernel
        # removes the directory when the group is replaced.
        store = dist.FileStore(spec["file"], -1)
        store.set_timeout(datetime.timedelta(seconds=timeout))
        return store
    base = master if master is not None else connect_store(spec["addr"], spec["port"], None, timeout)
    return dist.PrefixStore(spec["prefix"], base)


def all_gather_json(value, device: torch.device | None = None) -> list:
    """Every rank's `value` (JSON data), in rank order, through tensors: unlike
    all_gather_object, nothing a peer sends is unpickled. Tuples come back as lists."""
    device = device or torch.device("cpu")
    mine = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(gathered, padded)
    return [json.loads(bytes(g[:int(n.item())].cpu().tolist()).decode()) for g, n in zip(gathered, sizes)]


_gloo_interface_set: str | None = None  # what set_torchrun_env last put in GLOO_SOCKET_IFNAME


def set_torchrun_env(rank: int, world_size: int, local_rank: int, local_world_size: int,
                     master_addr: str, master_port: int, group_rank: int = 0) -> None:
    """The variables torchrun sets, so code written for torchrun runs unchanged, and the
    interface gloo listens on: without GLOO_SOCKET_IFNAME gloo takes the address the host
    name resolves to, which may be none, or one the other hosts cannot reach."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_world_size),
        GROUP_RANK=str(group_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    set_gloo_interface(master_addr)


def set_gloo_interface(master_addr: str) -> None:
    """GLOO_SOCKET_IFNAME: the interface this host reaches rank 0 from, unless the user chose."""
    global _gloo_interface_set
    current = os.environ.get("GLOO_SOCKET_IFNAME")
    if current is not None and current != _gloo_interface_set:
        return  # the user's choice
    if master_addr == LOOPBACK:
        iface = loopback_interface()
    else:  # the interface this host reaches rank 0 from (rank 0's own, on rank 0's host)
        iface = interface_of(source_address(master_addr) or "")
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = _gloo_interface_set = iface


def tcp_socket_inodes() -> set[int]:
    """Inodes of this process's open sockets (Linux; empty elsewhere)."""
    return set(_socket_fds())


def _socket_fds() -> dict[int, int]:
    """This process's open sockets: inode -> a file descriptor of it (Linux; empty elsewhere)."""
    found: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.setdefault(int(target[8:-1]), int(fd))
    return found


def tcp_endpoints(inodes: set[int]) -> dict[int, tuple]:
    """For those of `inodes` that are TCP sockets: (local, remote) endpoints as (address,
    port), remote None for a listening socket. Read from the kernel's tables, not from the
    sockets: a socket object made on another thread's descriptor can change its flags."""
    endpoints = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/self/net/{table}") as rows:
                lines = rows.read().splitlines()[1:]
        except OSError:  # not Linux, or no IPv6
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or int(fields[9]) not in inodes:
                continue
            local, remote = _endpoint(fields[1], family), _endpoint(fields[2], family)
            endpoints[int(fields[9])] = (local, None if fields[3] == "0A" else remote)  # 0A: LISTEN
    return endpoints


def _endpoint(hex_address: str, family: int) -> tuple[str, int]:
    """'0100007F:1F90' (as /proc/net/tcp writes it) -> ('127.0.0.1', 8080)."""
    address, port = hex_address.split(":")
    raw = bytes.fromhex(address)
    if sys.byteorder == "little":  # each 32-bit word is printed as a number in host order
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    text = socket.inet_ntop(family, raw)
    return (text.removeprefix("::ffff:") if "." in text else text), int(port, 16)


LISTENERS_KEY = "jupyter_scale/listeners/"
LISTENERS_WAIT_S = 30.0


def _groups_own(opened: set[int], store: dist.Store, rank: int, world_size: int) -> set[int]:
    """Of the sockets this process opened while joining the group, the group's own.

    The engine's threads open connections of their own meanwhile (a Dask worker to its
    scheduler, a peer fetching a result); cutting one of those at an abort kills the
    worker. The group's are its listening sockets and the connections to or from one of
    them: each rank publishes its listeners' endpoints in the group's store.
    """
    endpoints = tcp_endpoints(opened)  # none off Linux: nothing is cut there
    mine = sorted(local for local, remote in endpoints.values() if remote is None)
    listeners = {tuple(local) for local in mine}
    try:
        store.set(f"{LISTENERS_KEY}{rank}", json.dumps(mine))
        keys = [f"{LISTENERS_KEY}{other}" for other in range(world_size) if other != rank]
        # Every rank has joined (gloo connected them all): their answers are due at once.
        store.wait(keys, datetime.timedelta(seconds=LISTENERS_WAIT_S))
        for key in keys:
            listeners.update(tuple(e) for e in json.loads(store.get(key)))
    except Exception:  # a peer that died since: cut what was opened meanwhile, as before
        log.warning("could not learn the group's listeners; an abort cuts every connection opened while "
                    "joining", exc_info=True)
        return opened
    any_address = {port for address, port in listeners if address in ("0.0.0.0", "::")}
    return {inode for inode, (local, remote) in endpoints.items()
            if remote is None or local in listeners or remote in listeners
            or local[1] in any_address or remote[1] in any_address}


def init_group(store: dist.Store, backend: str, rank: int, world_size: int,
               device: torch.device, timeout: datetime.timedelta | None = None) -> set[int]:
    """Join the group; returns the inodes of the sockets the group opened."""
    if backend == "nccl":
        torch.cuda.set_device(device)
    before = tcp_socket_inodes()
    # No short collective timeout: a 30-minute training step is normal. A failing rank
    # unblocks its peers' collectives by cutting its connections (see abort_group).
    # The real one, also when a worker has replaced it for torchrun-style cells.
    # (Untyped: torch's overloads do not take the optional timeout as **options.)
    init = cast(Callable[..., None], getattr(dist.init_process_group, "__wrapped__", dist.init_process_group))
    options = {"timeout": timeout} if timeout is not None else {}
    init(backend, store=store, rank=rank, world_size=world_size, **options)
    return _groups_own(tcp_socket_inodes() - before, store, rank, world_size)


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
STACKS_KEY = "jupyter_scale/stacks"  # a count: the kernel adds one to ask every rank for its stacks


def stacks_key(asked: int, rank: int) -> str:
    """Where `rank` answers the `asked`-th request for its stacks."""
    return f"{STACKS_KEY}/{asked}/{rank}"


class AbortWatch:
    """A thread that cuts this rank's group connections when the kernel asks.

    A rank blocked inside a collective never returns to Python, so neither SIGINT nor a
    message to the engine reaches it. The kernel sets a key in the group's store instead
    (each group has a store of its own); this thread sees it, cuts the connections, and
    the blocked collective fails with an error the cell then reports. The group is
    formed anew for the next cell.

    The same thread answers the kernel's requests for this rank's stacks (`%scale stacks`),
    with `stacks()`: it runs while the cell's thread hangs, in a collective or elsewhere.
    """

    # Across hosts, a store that does not answer for this long means rank 0's process or
    # host is gone: the group cannot go on, and a peer blocked in a collective with a host
    # that left the network would otherwise wait for TCP to give up (many minutes).
    UNREACHABLE_S = 10.0

    def __init__(self, spec: dict, group_sockets: set[int], poll: float = 0.25,
                 on_cut: Callable[[], None] | None = None, rank: int = 0, stacks: Callable[[], str] | None = None):
        self._remote = "file" not in spec
        self._rank, self._stacks = rank, stacks
        self._stacks_answered = 0
        self._on_cut = on_cut  # frees what the sockets do not (another framework's collectives)
        self._store = group_store(spec, timeout=self.UNREACHABLE_S if self._remote else 30)
        self._sockets = group_sockets
        self._poll = poll
        self._stop = threading.Event()
        self._cut_done = threading.Event()
        self._cut_lock = threading.Lock()
        self._answered = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="jupyter_scale-abort-watch", daemon=True)
        self._thread.start()
        if self._remote:  # a store's read may block for good on a dead link: timed apart from it
            threading.Thread(target=self._guard, name="jupyter_scale-abort-guard", daemon=True).start()

    def _run(self) -> None:
        # After the cut it answers for the stacks still: a rank that does not stop is stuck
        # somewhere, and where is what the user asks next.
        while not self._stop.wait(self._poll):
            try:
                asked = not self._cut_done.is_set() and self._store.check([ABORT_KEY])  # reads only
                if self._stacks is not None and self._store.check([STACKS_KEY]):
                    self._answer_stacks()
            except Exception:  # the store went away: with rank 0 (across hosts), or with its group
                asked = self._remote and not self._cut_done.is_set()
            if self._stop.is_set():
                return
            self._answered = time.monotonic()
            if asked:
                self._cut()

    def _answer_stacks(self) -> None:
        asked = int(self._store.get(STACKS_KEY))
        if asked > self._stacks_answered:
            self._stacks_answered = asked
            assert self._stacks is not None
            self._store.set(stacks_key(asked, self._rank), self._stacks())

    def _guard(self) -> None:
        while not self._stop.wait(1.0) and not self._cut_done.is_set():
            if time.monotonic() - self._answered > self.UNREACHABLE_S:
                self._cut()

    def _cut(self) -> None:
        with self._cut_lock:  # once, from whichever thread sees the cause first
            if self._cut_done.is_set():
                return
            self._cut_done.set()
        cut_connections(self._sockets)
        if self._on_cut is not None:
            self._on_cut()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._poll + 1)


def request_abort(spec: dict) -> None:
    """From the kernel: make every rank's AbortWatch cut its connections."""
    if "addr" in spec:  # a store on a host that left the network: say so in one line, not in
        # a C++ traceback from TCPStore's own connect on the kernel's stderr
        socket.create_connection((spec["addr"], spec["port"]), timeout=2).close()
    group_store(spec, timeout=2).set(ABORT_KEY, "1")


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
        forget_group_in_defaults()
        dist.destroy_process_group()


def forget_group_in_defaults() -> None:
    """Before the group is destroyed: torch functions whose default argument is `group.WORLD`,
    evaluated when their module was imported (torch.distributed.nn.functional, FSDP's
    ShardedGradScaler, ZeroRedundancyOptimizer's helpers), hold the group that was the world
    then, if it was imported after the group formed. Destroyed, that group would live on, and
    gloo's threads with it: a process could abort at exit ("terminate called without an
    active exception") when one of them frees a tensor as Python finalizes, and a re-formed
    group's calls there would go to the dead one. Those defaults become None (the group of
    the moment, at each call), as if the module had been imported first."""
    group = dist.group.WORLD
    if group is None:
        return
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            # type(), not isinstance(): that reads __class__, which some of torch's
            # deprecated module attributes warn about (torch.distributed.reduce_op).
            kind = type(value)
            if issubclass(kind, type) and getattr(value, "__module__", None) == name:
                functions = [f for f in vars(value).values() if type(f) is types.FunctionType]
            else:
                functions = [value] if kind is types.FunctionType else []
            for function in functions:
                if function.__defaults__ and any(d is group for d in function.__defaults__):
                    function.__defaults__ = tuple(None if d is group else d for d in function.__defaults__)
                if function.__kwdefaults__ and any(d is group for d in function.__kwdefaults__.values()):
                    function.__kwdefaults__ = {k: None if d is group else d for k, d in function.__kwdefaults__.items()}


def launcher_rank() -> tuple[int, int] | None:
    """(rank, size) that the launcher gave this process (srun, mpiexec), or None."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMIX_RANK", "PMIX_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    if "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_STEP_NUM_TASKS"])
    return None


def distributed() -> bool:
    """A process group of more than one rank is running in this process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def group_device() -> torch.device:
    """Where the running group's collectives take their tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
