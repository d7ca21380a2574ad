"""What the kernel and the workers say to each other, typed once for both sides.

On the wire these are plain dicts (pickled by whichever engine carries them), so a worker
and a kernel of slightly different versions still read each other's keys; the kernel
builds them as these types and the worker reads them as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict


@dataclass
class Output:
    """A piece of what a worker printed or displayed while running."""

    rank: int
    stream: str  # "stdout", "stderr" or "display"
    text: str = ""
    data: dict = field(default_factory=dict)  # mimebundle, for "display"
    metadata: dict = field(default_factory=dict)


class Described(TypedDict):
    """`worker.describe`: where a worker is, for laying out ranks."""

    shared_memory: tuple | None  # the worker's own probe, when it reads the kernel's shared memory
    hostname: str
    node: str  # who shares its loopback (rendezvous.node_identity)
    interfaces: list[dict]
    address: str | None  # the one it reaches the controller or scheduler from
    sees_store_dir: bool  # shares the kernel's file system (a one-host FileStore)
    pid: int
    launcher_rank: tuple[int, int] | None  # (rank, size) from mpiexec or srun
    cuda_count: int
    python: str
    torch: str


class Layout(TypedDict):
    """`worker.join_group`'s argument: one rank's place in the process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int  # the host's index, as torchrun's GROUP_RANK
    nodes: int  # how many hosts the ranks are on
    master_addr: str
    master_port: int
    store: dict  # {"file": path} or {"addr", "port", "prefix"} (see rendezvous)
    backend: str  # gloo or nccl
    cuda_count: int
    timeout: float


class _CellRequired(TypedDict):
    names: list[tuple[str, int]]  # shipping's (name, token) of each value the cell reads
    updates: list[tuple[int, tuple]]  # shipping's (token, meta) of each value sent, a frame each
    forget: list[int]  # tokens the worker may drop
    code: str
    filename: str  # <distribute-cell-N>, in tracebacks
    run: str  # the run's id: events and interrupts of other runs are dropped


class CellRequest(_CellRequired, total=False):
    """`worker.run_cell`'s request: the cell, what comes with it, and how to report."""

    modules: list[str]  # the notebook's models the cell uses
    digests: dict[str, dict[str, tuple]]  # per module: state dict key -> (digest, dtype, shape) in the notebook
    pull: list[str]
    deleted: list[str]  # names the notebook deleted: the worker deletes them too
    stores: list[str]  # names the cell binds at its top level
    deletes: list[str]  # names the cell deletes at its top level, unconditionally
    watch: list[str] | None  # rank 0 sends back what the cell changed of these (see statesync)
    bring_back_bytes: int  # values the cell bound, in all, up to this size come back
    back_base: int  # rank 0 gives the tensors it sends back tokens counting down from here
    register_back: dict | None  # the other ranks give theirs the tokens rank 0 gave last cell
    keep_sharded: bool
    auto: bool  # automatic mode
    shard: dict | None  # shard_model's options under --shard, else None
    events: str  # where the rank's events go (a transport address)
    events_key: str  # signs them
    heartbeat: float  # seconds between heartbeats
    resync: bool  # the last cell failed: equalize the models first
    pull_through: int | None  # rank 0 sends the pull-back through shared memory, keeping this much
    seed: int
    framework: str  # whose process group the cell uses (frameworks.FRAMEWORKS)
    overlap: bool  # automatic mode may average gradients during backward (see overlap.py)
    write_watch: bool  # hash again only the tensor pages written since (see writewatch)
    shared_frames: dict | None  # where the big frames are in the kernel's shared memory
    mailbox: dict | None  # the group's store: the debugger's answers come through it (see debugging)
    sources: dict[str, str]  # filename -> the lines of notebook cells that defined the code sent


class Failure(TypedDict):
    """A rank's error: the fields of errors.RankFailure."""

    rank: int
    etype: str
    message: str
    traceback: str
    time: float
    interrupted: bool
    collective: str | None  # the collective it was in
    where: str | None  # debugging.where: its innermost notebook line, and what it was in there


class _ReplyRequired(TypedDict):
    status: str  # "ok" or "error"
    rank: int
    group_ready: bool
    received: bool  # it holds the cell's values
    elapsed: float
    rebound: list[str]  # names the cell bound on the worker


class Returned(TypedDict, total=False):
    """Rank 0's account of what came back of a cell's effects (sendback.Return)."""

    adopt: list[str]  # values written into the notebook's objects of those names
    deleted: list[str]  # names the cell deleted
    left: dict[str, str]  # names that stay the workers' own, and why
    too_big: dict[str, int]  # of those, the values past bring_back_limit, with their size
    back: dict  # tokens rank 0 gave the tensors sent back: names, named, base, count


class CellReply(_ReplyRequired, total=False):
    """The first item of `worker.run_cell`'s answer (frames follow it)."""

    failure: Failure  # with status "error"
    buffers: dict | None  # module buffer signatures (automatic mode)
    events_sent: int
    events_dropped: int
    pulled: list  # rank 0: (names, kind, frame count or plan) per pulled value
    pull_errors: dict[str, str]
    state_digests: dict[str, tuple]  # per module pulled as a state dict: (keys left out, key -> digest)
    pack_seconds: float  # rank 0's time packing its pulls (hashing included)
    shared_frames: dict | None  # rank 0's pull-back in its shared memory
    returned: Returned  # rank 0: what of the cell's effects came back, and what stays (see statesync)
    replicas: dict[str, dict] | None  # automatic mode: statesync.replica_digests of what the cell touched
