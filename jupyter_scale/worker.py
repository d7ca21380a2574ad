"""What runs inside each worker process, whatever the cluster engine.

The engine calls these module-level functions with plain arguments and gets plain
values back: `(header_dict, *frames)` where frames are the pickled payloads. Nothing here
knows which engine carries the calls. A worker keeps one namespace across cells, as a
kernel does, and one torch.distributed process group until it is torn down. What a cell
goes through on the way has modules of its own: receiving (the notebook's values),
interrupts, collectives (the one a rank waits in), training (automatic mode) and resync,
torchrun (a cell's own init_process_group), sendback (what rank 0 answers).
"""

from __future__ import annotations

import linecache
import os
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from . import (
    byvalue,
    collectives,
    debugging,
    frameworks,
    interrupts,
    patches,
    rendezvous,
    resync,
    sendback,
    sharding,
    sharedmem,
    statesync,
    torchrun,
    training,
    writewatch,
)
from .metrics import EventSink, Recorder
from .protocol import CellRequest, Described, Layout
from .receiving import Receiver

# Names every cell sees; they are set again before each cell so they stay truthful.
INJECTED_NAMES = ("rank", "world_size", "local_rank", "device", "report")


def _main_module() -> types.ModuleType:
    """The module whose namespace the cells run in. While a cell runs it is
    `sys.modules["__main__"]`, as the notebook's namespace is in the kernel: pickling by
    reference (`torch.save(model)` of a notebook class) finds `__main__.Net` there."""
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = __builtins__
    return module


@dataclass
class _WorkerState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    main: types.ModuleType = field(default_factory=_main_module)
    namespace: dict = field(init=False)  # main's __dict__
    recorder: Recorder = field(default_factory=Recorder)
    receiver: Receiver = field(init=False)
    store: Any = None  # this rank's handle on the group's store (see rendezvous.group_store)
    store_file: str | None = None  # the one-host group's FileStore
    master_store: Any = None  # rank 0 of a group across hosts hosts its TCPStore; it must outlive the group
    group_ready: bool = False
    group_sockets: set = field(default_factory=set)  # what abort_group cuts
    backend: str = "gloo"
    reinits: int = 0
    watch: Any = None  # rendezvous.AbortWatch of the current group
    layout: Any = None  # this rank's place in the current group (protocol.Layout)
    sink: Any = None  # metrics.EventSink to the kernel's event stream
    frames_out: Any = None  # sharedmem.SharedFrames: rank 0's pull-back through shared memory

    def __post_init__(self) -> None:
        self.namespace = self.main.__dict__
        self.receiver = Receiver(self.namespace)


_state = _WorkerState()


def interrupt_cell(run: str | None = None) -> bool:
    """Raise KeyboardInterrupt in the thread running the cell, as SIGINT does in a main thread.

    For engines that run cells in a worker thread (Dask), where a signal cannot reach the
    cell; a rank blocked in a collective is freed by the abort watch instead. `run`: only
    if the cell running is that run. See interrupts.interrupt.
    """
    return interrupts.interrupt(run)


def describe(shared_memory_probe: tuple | None = None, toward: str | None = None,
             store_dir: str | None = None) -> Described:
    """Facts the kernel needs to lay out ranks: host, pid, GPUs, and whether this worker
    reads the kernel's shared memory (`sharedmem.probe`); if it does, a probe of this
    worker's own for the kernel to check (large frames then go both ways through it).

    Where it is on the network: its network stack (`node`: who shares its loopback), its
    addresses, the one it reaches the cluster's controller or scheduler (`toward`) from,
    and whether it sees the kernel's `store_dir` (one file system for a FileStore)."""
    probe_back = None
    if shared_memory_probe and sharedmem.check_probe(*shared_memory_probe):
        if _state.frames_out is None:
            _state.frames_out = sharedmem.SharedFrames()
        probe_back = sharedmem.probe(_state.frames_out)
    return {
        "shared_memory": probe_back,
        "hostname": socket.gethostname(),
        "node": rendezvous.node_identity(),
        "interfaces": rendezvous.interfaces(),
        "address": rendezvous.source_address(toward) if toward else None,
        "sees_store_dir": bool(store_dir and os.path.isdir(store_dir)),
        "pid": os.getpid(),
        "launcher_rank": rendezvous.launcher_rank(),  # (rank, size) from mpiexec or srun
        "cuda_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


# What else a reset clears on this worker: an engine's end of a channel (see backends.channel).
_on_reset: list[Callable[[], None]] = []


def when_reset(hook: Callable[[], None]) -> None:
    """Call `hook` whenever this worker is reset (the kernel that used it is done with it)."""
    if hook not in _on_reset:
        _on_reset.append(hook)


def reset() -> None:
    """Forget every cell's state: a worker of a cluster that another session used starts clean."""
    global _state
    leave_group()
    for hook in _on_reset:
        hook()
    if _state.sink is not None:
        _state.sink.close()
    if _state.frames_out is not None:
        _state.frames_out.close()
    _state = _WorkerState()
    interrupts.forget()
    debugging.forget_failure()  # its frames hold the last session's values
    # And what it patched: torch's as it was (the next session's cells put back what they use).
    # Not the engine's streams: this very call's output still goes through them.
    patches.remove_all(keep=(patches.CAPTURE,))


def installed_patches() -> tuple:
    """What is patched in this worker's process (for `%scale patches`)."""
    return ({"rank": _state.rank, "patches": patches.installed()},)


def open_rendezvous(is_master: bool, master_addr: str, world_size: int, timeout: float) -> int | str | None:
    """On rank 0 of a group across hosts: listen for the group; returns the port chosen,
    or why it cannot listen at `master_addr` (for the kernel to say)."""
    if not is_master:
        return None
    _state.store = _state.master_store = None  # close the previous store first (frees its port)
    try:
        _state.master_store, port = rendezvous.open_store(master_addr, world_size, timeout)
    except OSError as exc:
        return exc.strerror or str(exc)
    return port


def join_group(layout: Layout) -> dict:
    """Set this worker's rank, env and device, and join the process group."""
    _stop_watch()
    rendezvous.abort_group(_state.group_sockets)
    _state.group_ready = False
    rank, world_size = layout["rank"], layout["world_size"]
    _state.rank, _state.world_size = rank, world_size
    _state.local_rank, _state.local_world_size = layout["local_rank"], layout["local_world_size"]
    _state.device = rendezvous.select_device(layout["backend"], _state.local_rank, layout["cuda_count"])
    _state.recorder = Recorder(rank=rank)
    _state.layout = layout
    rendezvous.set_torchrun_env(rank, world_size, _state.local_rank, _state.local_world_size,
                                layout["master_addr"], layout["master_port"], layout.get("group_rank", 0))
    if _state.device.type == "cpu":
        # As `accelerate launch --cpu` does: without it accelerate (the Hugging Face Trainer)
        # takes a machine without a GPU for one process, and every rank trains on all the data.
        os.environ.setdefault("ACCELERATE_USE_CPU", "True")
    if "OMP_NUM_THREADS" not in os.environ:
        # Like torchrun, don't let N workers on one host each claim every core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // _state.local_world_size))
    # Rank 0 of a group across hosts opened the TCPStore in open_rendezvous.
    _state.store_file = layout["store"].get("file")
    master = _state.master_store if rank == 0 and "file" not in layout["store"] else None
    _state.backend = layout["backend"]
    try:
        _state.store = rendezvous.group_store(layout["store"], layout["timeout"], master)
        _state.group_sockets = rendezvous.init_group(_state.store, _state.backend, rank, world_size, _state.device)
    except (RuntimeError, OSError) as exc:  # e.g. rank 0's address unreachable from this host
        _state.store = None
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    _state.group_ready = True
    _state.watch = rendezvous.AbortWatch(layout["store"], _state.group_sockets, on_cut=frameworks.abort_all,
                                         rank=rank, stacks=debugging.stacks)
    torchrun.keep_process_group(_rejoin)
    collectives.install_marks()
    rewrapped = _rewrap_stale_ddp()
    return {"rank": rank, "backend": layout["backend"], "device": str(_state.device), "rewrapped": rewrapped}


def _rewrap_stale_ddp() -> list[str]:
    """Models wrapped for a previous (torn-down) group are wrapped again for this one.

    DDP's constructor broadcasts rank 0's weights, so ranks that diverged when a cell
    failed half-way through a step start the next cell equal again. Building a DDP is a
    collective: only names that hold a DDP model on every rank are wrapped, in one order.
    """
    from torch.nn.parallel import DistributedDataParallel

    from .explicit import wrap

    mine = sorted(n for n, v in _state.namespace.items() if isinstance(v, DistributedDataParallel))
    everyone = rendezvous.all_gather_json(mine, _state.device)
    common = [n for n in mine if all(n in names for names in everyone)]
    for name in common:
        value = _state.namespace[name]
        _state.namespace[name] = wrap(value.module, **getattr(value, "_jupyter_scale_options", {}))
    for name in sorted(set(mine) - set(common)):
        print(f"jupyter_scale: {name!r} is a DDP model of the previous process group on this rank "
              "only; wrap it again with jupyter_scale.wrap()", file=sys.stderr)
    return common


def _rejoin(backend, timeout) -> bool:
    """A cell's `init_process_group()` after it destroyed the group: a new group through our
    store (see torchrun.keep_process_group); False where there is no store to join through."""
    import torch.distributed as dist

    if _state.store is None:
        return False
    _state.reinits += 1
    store = dist.PrefixStore(f"jupyter_scale/reinit/{_state.reinits}", _state.store)
    _state.group_sockets |= rendezvous.init_group(store, backend or _state.backend, _state.rank,
                                                  _state.world_size, _state.device, timeout=timeout)
    return True


def leave_group() -> None:
    """Cut and tear down the process group (peers blocked on us fail fast)."""
    _stop_watch()
    frameworks.abort_all()  # their groups cannot be formed again in this process: the kernel restarts it
    rendezvous.abort_group(_state.group_sockets)
    _state.group_sockets = set()
    _state.group_ready = False
    _state.store = None


def _stop_watch() -> None:
    if _state.watch is not None:
        _state.watch.stop()
        _state.watch = None


def _inject() -> None:
    ns = _state.namespace
    from IPython import get_ipython

    if get_ipython() is not None:  # an IPython engine: magics in the cell run there
        ns["get_ipython"] = get_ipython
    ns.update(
        rank=_state.rank,
        world_size=_state.world_size,
        local_rank=_state.local_rank,
        device=_state.device,
        report=_state.recorder.report,
    )


def _first_user_frame(exc: BaseException) -> types.TracebackType | None:
    """Where the user's code starts in `exc`'s traceback: below this module's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _user_traceback(exc: BaseException) -> str:
    """The traceback without this module's frames."""
    return "".join(traceback.format_exception(type(exc), exc, _first_user_frame(exc)))


def _heartbeat_status(thread: int) -> Callable[[], dict]:
    """What each heartbeat says: the collective the cell waits in, and where the cell is."""
    def status() -> dict:
        found = collectives.heartbeat_status()
        return {**found, "where": debugging.where_now(thread, found["collective"])}

    return status


def stacks() -> tuple:
    """Every thread's stack of this worker (asked between cells, through the engine)."""
    return ({"rank": _state.rank, "stacks": debugging.stacks()},)


def post_mortem(events: tuple[str, str, str], mailbox: dict) -> tuple:
    """`%scale debug`: pdb in the frames where this rank's last cell failed, answered from
    the notebook through `events` (address, key, run) and the store `mailbox`."""
    address, key, run = events
    sink = _connect_events(address, key, run)
    if sink is None:
        return ({"debugged": False},)
    line = debugging.Line(sink, mailbox, key, run, _state.rank)
    interrupts.gate_sigint()
    interrupts.cell_may_be_interrupted(True, run)
    try:
        with _as_main():
            return (debugging.post_mortem(line),)
    except KeyboardInterrupt:
        return ({"debugged": True, "interrupted": True},)
    finally:
        interrupts.cell_may_be_interrupted(False)
        _flush()
        sink.flush()


def _register_source(filename: str, code: str) -> None:
    # Tracebacks then show the cell's lines, as IPython does for its own cells.
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)


def run_cell(request: CellRequest, *frames: Any) -> tuple:
    """Receive the shipped names, run the cell body, answer with status and pulls.

    Every exception, KeyboardInterrupt included, is caught and returned: the process
    group is torn down first, so ranks waiting for this one in a collective fail at once
    instead of blocking until the collective's timeout.
    """
    started = time.time()
    rank = _state.rank
    received = False
    before = None  # the namespace's bindings when the cell's code started
    snapshot = None  # rank 0's digests of what the cell can reach (see statesync)
    buffers = replicas = bound = None
    if _state.frames_out is not None:  # the kernel has read the last cell's pull-back
        _state.frames_out.trim()
    writewatch.enable(request.get("write_watch", True))
    if rank != 0 and (register_back := request.get("register_back")):
        sendback.register_back(register_back, _state.namespace, _state.receiver)
    framework = request.get("framework", "torch")
    auto = request.get("auto", False) and _state.world_size > 1 and _state.group_ready and framework == "torch"
    mode = (training.AutoMode(request.get("seed", 0), _state.namespace, warn=_warn, overlap=request.get("overlap", False))
            if auto else nullcontext())
    # --shard (one worker too: it materializes models built on the meta device). A model
    # sharded here keeps the notebook's tokens of its parameters: their whole tensors are
    # freed, and the notebook's later changes reach the shards.
    shard = request.get("shard") if request.get("auto") else None
    sharding_cell = (training.Sharding(_state.namespace, shard, _state.receiver.replace) if shard is not None
                     else nullcontext())
    if _state.device.type == "cuda":  # the current device is the thread's: the call's may be new
        torch.cuda.set_device(_state.device)
    interrupts.gate_sigint()  # the engine (or the channel) restores its own handler once the call is answered
    run = request.get("run", "")
    sink = _connect_events(request.get("events"), request.get("events_key", ""), run)
    collectives.cell_started()
    line = None
    if sink is not None:
        sink.heartbeat_interval = request.get("heartbeat", 0.0)
        sink.heartbeat_status = _heartbeat_status(threading.get_ident())
        sink.state("running", pid=os.getpid(), host=socket.gethostname(), device=str(_state.device))
        if mailbox := request.get("mailbox"):
            line = debugging.Line(sink, mailbox, request.get("events_key", ""), run, rank)
    try:
        interrupts.cell_may_be_interrupted(True, run)
        with mode, sharding_cell:
            _state.receiver.device = _state.device
            # Another framework's group first: TensorFlow's must exist before any TensorFlow op,
            # and notebook models arrive under it.
            group = _framework_group(framework) if framework != "torch" else None
            with sharedmem.unpacked(frames, request.get("shared_frames")) as arrived, \
                    group.receiving() if group is not None else nullcontext():
                del frames  # only `arrived` holds them now, emptied at the block's end: the cell does not keep them
                shipped = _state.receiver.receive(request, arrived)
            if isinstance(mode, training.AutoMode):  # auto
                shipped = {name: mode.shard_shipped(value) for name, value in shipped.items()}
            _state.namespace.update(shipped)
            received = True
            if auto and request.get("resync"):  # the last cell failed: ranks may stand a step apart
                resync.resync(_state.namespace)
            if auto and request.get("shard") is not None:  # --shard: the notebook's models the cell uses
                sharding.shard_models(_state.namespace, request.get("modules", []), request["shard"],
                                      _state.receiver.replace)
            _inject()
            _register_source(request["filename"], request["code"])
            for filename, text in request.get("sources", {}).items():  # the notebook functions' own cells
                _register_source(filename, text)
            code = compile(request["code"], request["filename"], "exec")
            if rank == 0 and (watch := request.get("watch")) is not None:
                snapshot = statesync.Snapshot(_state.namespace, watch)
            before = _bindings()
            with _as_main(), debugging.cell_running(line):
                exec(code, _state.namespace)
            sharding.reshard(_state.namespace)  # an evaluation at the end leaves whole weights out
            if auto and rendezvous.distributed():  # the cell may have destroyed the group
                # The kernel compares every rank's and asks for `sync_buffers` if any.
                buffers = resync.buffer_signatures(_state.namespace)
                # And these, to say where the ranks' models or optimizers drifted apart.
                bound = _bound_by_cell(before, request)
                replicas = statesync.replica_digests(_state.namespace, {*(request.get("watch") or ()), *bound})
        interrupts.cell_may_be_interrupted(False)
    except BaseException as exc:  # noqa: B036 - a worker must answer whatever happened
        interrupts.cell_may_be_interrupted(False)
        failed_at = time.time()
        # A second SIGINT (the kernel interrupts every rank still running) must not cut
        # the clean-up short: this rank answers, with its group cut, whatever comes.
        with interrupts.sigint_ignored():
            try:
                leave_group()
            except Exception:  # a broken group: still answer
                pass
            _flush()
        failure = {
            "rank": rank,
            "etype": type(exc).__name__,
            "message": str(exc),
            "traceback": _user_traceback(exc),
            "time": failed_at,
            "interrupted": isinstance(exc, KeyboardInterrupt),
            "collective": collectives.failed_in(),
            "where": debugging.where_failed(exc, collectives.failed_in()),
        }
        debugging.keep_failure(exc, _first_user_frame(exc))
        with interrupts.sigint_ignored():
            counts = _close_events(sink, "failed", error=failure["etype"])
            rebound = _rebound(before) if before is not None else []
            if snapshot is not None:  # what the cell changed before it failed is the workers' own now
                rebound = sorted({*rebound, *snapshot.changed(rebound)[0]})
        return ({"status": "error", "rank": rank, "failure": failure, "group_ready": False,
                 "received": received, "elapsed": failed_at - started, "rebound": rebound, **counts},)
    _flush()
    import torch.distributed as dist

    _state.group_ready = _state.group_ready and dist.is_initialized()  # the cell may destroy it
    rebound = bound if bound is not None else _bound_by_cell(before, request)
    header = {"status": "ok", "rank": rank, "group_ready": _state.group_ready, "received": True,
              "elapsed": time.time() - started, "buffers": buffers, "replicas": replicas, "rebound": rebound,
              **_close_events(sink, "finished")}
    out_frames: list = []
    if rank == 0:
        tensor_frames: list[bool] = []
        packing = time.perf_counter()
        back = sendback.Return(request, snapshot, header["rebound"], _state.namespace, _state.receiver)
        header["pulled"], header["pull_errors"], header["state_digests"] = back.pack(out_frames, tensor_frames)
        header["returned"] = back.returned
        # What changed and stays here is the workers' own, as what the cell bound is.
        header["rebound"] = sorted({*header["rebound"], *back.returned["left"]})
        header["pack_seconds"] = time.perf_counter() - packing
        if request.get("pull_through") and _state.frames_out is not None:  # the kernel reads ours
            _state.frames_out.keep = request["pull_through"]
            try:
                out_frames, header["shared_frames"] = _state.frames_out.pack(out_frames, tensor_frames)
            except OSError:  # out of memory there: the engine carries them
                pass
    return (header, *out_frames)


def _framework_group(name: str) -> frameworks.Group:
    """`name`'s group on this worker: formed with every rank at its first cell, then reused."""
    if not _state.group_ready:
        raise RuntimeError("no process group: the cluster could not form one")
    layout = _state.layout
    master = layout["master_addr"]
    place = frameworks.Place(
        rank=_state.rank, world_size=_state.world_size, local_rank=_state.local_rank,
        local_world_size=_state.local_world_size,
        nodes=layout.get("nodes", 1), device=_state.device,
        address=master if master == rendezvous.LOOPBACK else rendezvous.source_address(master) or master)
    group, sockets = frameworks.form(name, place, rendezvous.all_gather_json)
    _state.group_sockets.update(sockets)  # the abort watch holds this set: it cuts them too
    return group


@contextmanager
def _as_main():
    """The cells' module is `__main__` while the cell runs (see _main_module); the engine's
    own `__main__` is back afterwards."""
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = _state.main
    try:
        yield
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous


def _bindings() -> dict[str, int]:
    return {name: id(value) for name, value in _state.namespace.items() if not name.startswith("__")}


def _rebound(before: dict[str, int]) -> list[str]:
    """Names the cell bound, rebound or deleted (the kernel keeps them as the workers' own)."""
    after = _bindings()
    changed = {n for n, i in after.items() if before.get(n) != i} | (before.keys() - after.keys())
    return sorted(changed - set(INJECTED_NAMES))


def _bound_by_cell(before: dict[str, int], request: CellRequest) -> list[str]:
    """What the cell bound, rebound or deleted (see _rebound), and also the names it assigned
    that hold the object they held before (an interned string, a small int: the notebook may
    not hold it), and those it deleted that this worker did not hold."""
    stored = [n for n in request.get("stores", ()) if n in _state.namespace and n not in INJECTED_NAMES]
    deleted = [n for n in request.get("deletes", ()) if n not in _state.namespace]
    return sorted({*_rebound(before), *stored, *deleted})


def sync_buffers(names: list[str]) -> None:
    """Rank 0's module buffers of `names` to every rank (automatic mode, after a cell)."""
    resync.broadcast_buffers(_state.namespace, names)


def whole_tensors(name: str, keys: list[str]) -> tuple:
    """Whole tensors of the sharded module `name`'s state dict entries `keys`: every rank
    gathers them, rank 0 answers them (the kernel's pull-back of a sharded model)."""
    value = sharding.whole_tensors(_state.namespace[name], keys)
    if _state.rank != 0:
        return ({"rank": _state.rank},)
    return ({"rank": 0}, *byvalue.dumps(value, _state.namespace)[0])


def gather_value(name: str) -> tuple:
    """This worker's value of `name` (for Session.gather)."""
    if name not in _state.namespace:
        return ({"rank": _state.rank, "missing": True},)
    return ({"rank": _state.rank, "missing": False}, *byvalue.dumps(_state.namespace[name], _state.namespace)[0])


def _connect_events(address: str | None, key: str, run: str) -> EventSink | None:
    """The sink to the kernel's event stream (kept across cells while the address and key
    hold), sending this cell's events as run `run`'s."""
    if not address:
        _state.recorder.sink = None
        return None
    sink = _state.sink
    if sink is None or (sink.address, sink.key, sink.rank) != (address, key, _state.rank):
        if sink is not None:
            sink.close()
        _state.sink = EventSink(address, _state.rank, key)
    _state.sink.begin(run)
    _state.recorder.sink = _state.sink
    return _state.sink


def _close_events(sink: EventSink | None, state: str, **details) -> dict:
    """Final state event, then everything sent: the kernel has all points with the reply."""
    if sink is None:
        return {}
    sink.heartbeat_interval = 0.0  # between cells a worker is quiet
    sink.state(state, **details)
    sink.flush()
    return {"events_sent": sink.sent, "events_dropped": sink.dropped}


def _warn(message: str) -> None:
    if _state.rank == 0:  # once per cell, not once per rank
        print(message, file=sys.stderr, flush=True)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or replaced stream must not fail the cell
            pass
