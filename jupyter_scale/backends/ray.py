"""Ray engine: an embedded one-node Ray on 127.0.0.1 (backends.ray_cluster), or any running
Ray cluster.

One actor per rank, in a placement group (all of them or none), each running one rank's calls
in order in one thread and keeping `jupyter_scale.worker`'s state across cells. Ray does not
capture what a call prints: each call's output, and the metrics points, wait in the actor's
outbox until the kernel takes them (a long poll per actor), so they reach the kernel wherever
it reaches the cluster, through ray:// too, and the kernel opens no port. Interrupts raise
KeyboardInterrupt in the cell's thread (`worker.interrupt_cell`), from a method of the actor's
"control" concurrency group, which runs beside the busy cell.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import ray
import torch
from traitlets import Dict, Float

from .. import capture, metrics, processes, rendezvous, worker
from ..errors import ClusterError
from ..launchers import Launcher
from . import Backend, Job, WorkerCallFailed, WorkerLost, engine_errors
from .base import Frames, split_frames
from .ray_cluster import EmbeddedHead, init_driver, place_actors, refuse_second_ray, remove_actors, set_environ
from .relay import Relay, RelayedJob

log = logging.getLogger(__name__)

# Shipped frames at least this big go to Ray's object store once (ray.put), and every rank's
# actor reads them from there (shared memory on one node) instead of each call carrying them.
PUT_MIN_BYTES = 1 << 20
# How long an actor holds the kernel's request for its outbox when nothing is in it.
TAKE_WAIT_S = 0.2
OUTBOX_SCHEME = "ray-outbox"

# --------------------------------------------------------------------------------------
# Worker side (in each rank's actor process)
# --------------------------------------------------------------------------------------

_outbox: collections.deque = collections.deque()  # ("output", pump message) | ("event", signed batch)
_posted = threading.Condition()


def _post(kind: str, message: Any) -> None:
    with _posted:
        _outbox.append((kind, message))
        _posted.notify_all()


class _OutboxTransport:
    """metrics.EventSink transport: the batches wait in the outbox with the output."""

    def __init__(self, address: str):
        pass

    def send(self, message: str) -> bool:
        _post("event", message)
        return True

    def close(self) -> None:
        pass


metrics.register_transport(OUTBOX_SCHEME, _OutboxTransport)


class _RankActor:
    """One rank: its calls in order in one thread; interrupts and the outbox beside them."""

    def __init__(self, threads: int):
        # Torch's threads follow the CPUs the actor reserved (as Ray sets OMP_NUM_THREADS for
        # whole CPUs), unless the cluster's environment says otherwise.
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        with contextlib.suppress(ValueError):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    def call(self, fn: Callable, job: str, rank: int, args: tuple, payload: Frames | None, in_band: bool) -> Any:
        if payload is not None:
            # Frames read from Ray's object store are its shared memory, read-only: each rank
            # gets its own copy to unpickle into writable arrays, as on the other engines.
            args = (*args, *map(_writable, payload.frames))
        result = capture.call_captured(fn, args, lambda message: _post("output", message), job, rank)
        return Frames(list(result), in_band) if isinstance(result, tuple) else result

    @ray.method(concurrency_group="control")
    def interrupt(self, run: str | None) -> bool:
        return worker.interrupt_cell(run)

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="outbox")
    def take(self, wait: float) -> list:
        """What waits in the outbox, after up to `wait` s for something to come."""
        with _posted:
            if not _outbox:
                _posted.wait(wait)
            taken = list(_outbox)
            _outbox.clear()
        return taken


def _writable(frame: Any) -> Any:
    """A buffer of Ray's object store (its shared memory, read-only) copied; anything else as it is."""
    if isinstance(frame, (bytes, bytearray, str)):
        return frame
    try:
        view = memoryview(frame)
    except TypeError:
        return frame
    return bytearray(view) if view.readonly else frame


# No restarts: a rank that died lost its namespace, and the session says so and starts anew.
_Rank: Any = ray.remote(max_restarts=0, max_task_retries=0,  # type: ignore[call-overload]
                        concurrency_groups={"control": 1, "outbox": 1})(_RankActor)


# --------------------------------------------------------------------------------------
# Kernel side
# --------------------------------------------------------------------------------------

class _OutboxEventQueue(metrics.EventQueue):
    """The kernel's end of the metrics stream: fed by the backend's outbox reader."""

    address = f"{OUTBOX_SCHEME}://"

    def __init__(self, relay: Relay):
        super().__init__()
        self._relay = relay
        relay.events = self

    def close(self) -> None:
        if self._relay.events is self:
            self._relay.events = None


class _RayJob(RelayedJob):
    def __init__(self, backend: RayBackend, job_id: str, ranks: list[int], held: list):
        super().__init__(backend.relay, job_id, ranks)
        self._backend, self._held = backend, held
        self._refs: dict[int, Any] = dict.fromkeys(ranks)
        self._answered: set[int] = set()

    def attach(self, refs: dict) -> None:
        """The calls' replies, once sent (the job is known to the outbox reader before)."""
        self._refs.update(refs)
        for rank, ref in refs.items():
            ref.future().add_done_callback(lambda _f, r=rank: self._answer(r))

    def _answer(self, rank: int) -> None:
        self._answered.add(rank)
        self.notify()

    def _replied(self, rank: int) -> bool:
        # The done callback is the fast path; Ray Client's futures may never call it.
        ref = self._refs[rank]
        if rank not in self._answered and ref is not None and ray.wait([ref], timeout=0)[0]:
            self._answered.add(rank)
        return rank in self._answered

    def _worker_gone(self, rank: int) -> bool:
        return False  # a dead actor's call answers with ActorDiedError at once

    def result(self, rank: int) -> Any:
        if rank not in self._answered:
            raise WorkerLost(rank, "its Ray actor did not answer")
        try:
            value = ray.get(self._refs[rank])
        except ray.exceptions.RayActorError as exc:
            raise WorkerLost(rank, self._backend.how_it_died(rank, exc)) from exc
        except ray.exceptions.RayError as exc:  # the call could not run (e.g. unpickling it failed)
            cause = getattr(exc, "cause", None) or exc
            raise WorkerCallFailed(rank, f"{type(cause).__name__}: {cause}") from exc
        if isinstance(value, Frames):  # out of the object store, read-only: the notebook's to keep and change
            return tuple(map(_writable, value.frames))
        return value

    def release(self) -> None:
        super().release()
        for rank, ref in self._refs.items():
            if rank not in self._answered:  # queued behind a stuck call: never run it
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
        self._refs = {r: None for r in self._refs}
        self._held = []


class RayBackend(Backend):
    """Workers are Ray actors, one per rank, placed together in one placement group."""

    name = "ray"
    hub = "head"
    creates_workers = True
    knows_exit_codes = False  # Ray reaps its actors: how_it_died gives Ray's account instead
    connect_help = "a Ray cluster (ray://HOST:10001, or with --backend ray a GCS address HOST:6379 or auto)"
    launchers = (Launcher,)  # the local one: Ray's own tools start clusters elsewhere
    instead_of_launcher = "for Ray, start the cluster yourself (ray start, KubeRay) and %scale connect ray://HEAD:10001"

    cpus_per_worker = Float(0.0, config=True, help="CPUs each rank's actor reserves; Ray gives it as many "
                                                   "threads (OMP_NUM_THREADS). 0: the embedded cluster shares "
                                                   "the machine's cores among the ranks (as torchrun does); a "
                                                   "connected cluster, 1 each.")
    gpus_per_worker = Float(-1.0, config=True, help="GPUs each rank's actor reserves. -1: one each where the "
                                                    "cluster has a GPU for every rank, else none.")
    runtime_env = Dict(config=True, help="Ray's runtime_env for the actors (pip packages, environment variables, "
                                         "a working directory), on a connected cluster whose workers lack "
                                         "what the cells need. The actors need jupyter_scale and torch.")

    @classmethod
    def parse_address(cls, address: str | None, options: dict) -> dict | None:
        if not address or not (address.startswith("ray://") or options.get("named")):
            return None  # a bare host:port is a Dask scheduler's unless --backend ray says otherwise
        if options.get("profile") or options.get("cluster_id") or options.get("url_file") or options.get("tls"):
            raise ValueError("a Ray cluster is found by its address alone (ray://HOST:10001, HOST:6379 or auto)")
        return {"address": address}

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._actors: list = []
        self._pids: list[int] = []
        self._group: Any = None  # the placement group
        self._head: EmbeddedHead | None = None
        self._watch: processes.Watch | None = None  # the embedded cluster's (see processes)
        self._client_mode = False  # through Ray Client (ray://): buffers travel in band
        self._address = ""
        self._reader: threading.Thread | None = None
        self._reading = threading.Event()
        self.relay = Relay()  # output to its job, events to the queue (see _read_outboxes)
        self.owns_cluster = True

    # -- lifecycle -----------------------------------------------------------------
    def start(self, n: int, timeout: float, launcher: Launcher | None = None) -> None:
        refuse_second_ray()
        deadline = time.monotonic() + timeout
        with engine_errors("could not start the embedded Ray cluster", cleanup=self.stop):
            self._watch = processes.watch()  # the kernel's watcher ends the cluster if the kernel dies
            self._head = EmbeddedHead(self._watch)
            self._address = self._head.start(deadline, {"num_cpus": os.cpu_count() or 1, **self.cluster_options})
            init_driver(self._address)
        cores = os.cpu_count() or 1
        cpus = self.cpus_per_worker or cores / n  # Ray rounds OMP_NUM_THREADS down, to at least 1
        with engine_errors(f"could not start {n} Ray workers", cleanup=self.stop):
            self._attach(n, max(1.0, deadline - time.monotonic()), cpus)

    def connect(self, n: int | None, timeout: float, *, address: str = "", **unknown: Any) -> None:
        if unknown:
            raise ClusterError(f"a Ray cluster is found by its address, not {sorted(unknown)}")
        refuse_second_ray()
        self.owns_cluster = False
        self._client_mode = address.startswith("ray://")
        set_environ({})  # the token the kernel's environment names now (RAY_AUTH_TOKEN, _PATH)
        with engine_errors(f"could not connect to the Ray cluster at {address}", cleanup=self.stop):
            init_driver(address, self.runtime_env or None)
        self._address = address
        if not n:
            n = max(1, int(ray.cluster_resources().get("CPU", 1) // (self.cpus_per_worker or 1)))
        with engine_errors(f"the Ray cluster at {address} did not offer {n} workers within {timeout:.0f} s",
                           cleanup=self.stop):
            self._attach(n, timeout, self.cpus_per_worker or 1.0)

    def _gpus(self, n: int) -> float:
        if self.gpus_per_worker >= 0:
            return self.gpus_per_worker
        return 1.0 if ray.cluster_resources().get("GPU", 0) >= n else 0.0

    def _attach(self, n: int, timeout: float, cpus: float) -> None:
        self._group, self._actors, self._pids = place_actors(_Rank, n, cpus, self._gpus(n), timeout)
        self._reading = threading.Event()  # this reader's: one left from a stop that timed out keeps its own
        self._reader = threading.Thread(target=self._read_outboxes, args=(list(self._actors), self._reading),
                                        name="jupyter_scale-ray-outbox", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        self._reading.set()
        if self._reader is not None:
            self._reader.join(timeout=2 * TAKE_WAIT_S + 1)
            self._reader = None
        actors, group, self._actors, self._group, self._pids = self._actors, self._group, [], None, []
        self.relay.clear()
        head, self._head = self._head, None
        try:
            with head.stopping() if head is not None else contextlib.nullcontext():
                if ray.is_initialized():
                    remove_actors(actors, group)
                    ray.shutdown()
        finally:
            if self._watch is not None:
                self._watch.close()
                self._watch = None

    @property
    def running(self) -> bool:
        return bool(self._actors)

    @property
    def size(self) -> int:
        return len(self._actors)

    def describe(self) -> dict:
        if not self._actors:
            return {}
        return {"head": self._address, "connected": not self.owns_cluster,
                "namespace": ray.get_runtime_context().namespace,
                **(self._head.describe() if self._head is not None else {})}

    def local_processes(self) -> list:
        """The ranks' processes (the embedded cluster only). Not the head: it ends itself and
        Ray's daemons when the kernel dies (the kernel's watcher), and a SIGTERM from a rank would
        make `ray start` exit and leave the daemons behind."""
        if not self.owns_cluster:
            return []
        found = []
        for pid in self._pids:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(pid))
        return found

    def order_ranks(self, order: list[int]) -> None:
        self._actors = [self._actors[i] for i in order]
        self._pids = [self._pids[i] for i in order]

    def open_events(self) -> metrics.EventQueue:
        return _OutboxEventQueue(self.relay)

    def contact_address(self) -> str | None:
        if self.owns_cluster:
            return rendezvous.LOOPBACK
        with contextlib.suppress(Exception):
            return ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
        return None

    # -- liveness ------------------------------------------------------------------
    def dead_ranks(self) -> list[int]:
        if not self._actors:
            return []
        if self.owns_cluster:  # our processes: no need to ask Ray
            return [r for r, pid in enumerate(self._pids) if not processes.alive(pid)]
        pings = [actor.pid.remote() for actor in self._actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=2)
        dead = []
        for rank, ping in enumerate(pings):
            if ping in ready:
                try:
                    ray.get(ping)
                except ray.exceptions.RayActorError:
                    dead.append(rank)
        return dead

    def how_it_died(self, rank: int, error: Exception) -> str:
        """One line of Ray's account of a dead actor (its first line and the worker's exit detail)."""
        text = str(error)
        detail = text.split("Worker exit detail:", 1)[1].split(". ")[0].strip() if "Worker exit detail:" in text \
            else text.strip().splitlines()[0]
        pid = self._pids[rank] if rank < len(self._pids) else "?"
        return f"its Ray actor (pid {pid}) died: {detail}"

    # -- calls ---------------------------------------------------------------------
    def _require_actors(self) -> list:
        if not self._actors:
            raise ClusterError("no Ray cluster is attached")
        return self._actors

    def _read_outboxes(self, actors: list, stopped: threading.Event) -> None:
        """The kernel's side of the outboxes: output to its job, metrics to the event queue."""
        pending = {actor.take.remote(TAKE_WAIT_S): actor for actor in actors}
        while pending and not stopped.is_set():
            try:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=TAKE_WAIT_S * 2)
            except Exception:  # Ray shut down under us
                return
            for ref in ready:
                actor = pending.pop(ref)
                try:
                    messages = ray.get(ref)
                except Exception:  # a dead actor: its call's answer says so
                    continue
                for kind, message in messages:
                    self._route(kind, message)
                if stopped.is_set():
                    continue
                try:
                    pending[actor.take.remote(TAKE_WAIT_S)] = actor
                except Exception:  # Ray going away: the loop ends with nothing pending
                    log.debug("could not ask an outbox again", exc_info=True)

    def _route(self, kind: str, message: Any) -> None:
        if kind == "event":
            self.relay.event(message)
        else:
            self.relay.output(message)

    def _new_job(self, fn: Callable, calls: dict[int, tuple], held: list) -> _RayJob:
        actors = self._require_actors()
        job_id = self.relay.new_id(fn)
        job = _RayJob(self, job_id, list(calls), held)
        self.relay.add(job)
        job.attach({rank: actors[rank].call.remote(fn, job_id, rank, args, payload, self._client_mode)
                    for rank, (args, payload) in calls.items()})
        return job

    def submit(self, fn: Callable, *args: Any, ranks: list[int] | None = None) -> Job:
        self._require_actors()
        ranks = list(range(self.size)) if ranks is None else list(ranks)
        head, frames = split_frames(args)
        payload: Any = Frames(frames, self._client_mode) if frames else None
        held = []
        if frames and sum(memoryview(f).nbytes for f in frames) >= PUT_MIN_BYTES:
            payload = ray.put(payload)  # once, for every rank
            held.append(payload)
        return self._new_job(fn, {r: (head, payload) for r in ranks}, held)

    def submit_each(self, fn: Callable, args_per_rank: list[tuple]) -> Job:
        return self._new_job(fn, {r: (tuple(a), None) for r, a in enumerate(args_per_rank)}, [])

    def interrupt(self, ranks: list[int], run: str | None = None) -> None:
        for rank in ranks:
            if rank < len(self._actors):
                with contextlib.suppress(Exception):  # a dead actor needs none
                    self._actors[rank].interrupt.remote(run)

