"""Ray engine: an embedded one-node Ray on 127.0.0.1, or any running Ray cluster.

One actor per rank, in a placement group (all of them or none), each running one rank's calls
in order in one thread and keeping `jupyter_scale.worker`'s state across cells. Ray does not
capture what a call prints: each call's output, and the metrics points, wait in the actor's
outbox until the kernel takes them (a long poll per actor), so they reach the kernel wherever
it reaches the cluster, through ray:// too, and the kernel opens no port. Interrupts raise
KeyboardInterrupt in the cell's thread (`worker.interrupt_cell`), from a method of the actor's
"control" concurrency group, which runs beside the busy cell.

The embedded cluster is `ray start --head --block` in a session of its own (a kernel interrupt
signals the kernel's process group), tied to the kernel (processes.watch), with token
authentication: every gRPC port of Ray's answers only peers that hold this cluster's token.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psutil
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from traitlets import Dict, Float

from .. import capture, metrics, patches, processes, programs, rendezvous, worker
from ..errors import ClusterError
from ..launchers import Launcher
from . import Backend, Job, WorkerCallFailed, WorkerLost, descendants, engine_errors
from .base import Frames, split_frames
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

_ONE_NODE = patches.Patch("ray._private.ray_constants.ENABLE_RAY_CLUSTER", "while ray.init runs: the embedded "
                         "cluster's ports stay on loopback", "engine ray")


@contextlib.contextmanager
def _one_node():
    """Ray takes 127.0.0.1 for the machine's network address unless it runs a cluster of one
    node (its setting for laptops): then every port of the embedded cluster, and the
    kernel's, stays on loopback. The head gets it as RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0;
    the kernel, whose Ray may have read the environment already, for its ray.init."""
    with _ONE_NODE.during(lambda _: False):
        yield


_NO_ERROR_LISTENER = patches.Patch("ray._private.worker.listen_error_messages", "while ray.init runs: no thread "
                                  "printing the cluster's errors into whatever cell runs", "engine ray")


@contextlib.contextmanager
def _as_kernel_driver():
    """ray.init makes SIGTERM raise SystemExit, which IPython catches: the kernel would outlive
    its manager's SIGTERM. The kernel keeps its own handler. And the driver's thread that
    prints the cluster's error messages is not started: it prints into whatever cell runs
    then, and what it says of our ranks (a worker died) the session says itself."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        with _NO_ERROR_LISTENER.during(lambda _: lambda *args: None):
            yield
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, before)


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
        self._head: subprocess.Popen | None = None
        self._scratch: str | None = None
        self._watch: processes.Watch | None = None  # the embedded cluster's (see processes)
        self._client_port = 0
        self._client_mode = False  # through Ray Client (ray://): buffers travel in band
        self._environ: dict[str, str | None] = {}  # the kernel's variables before ours
        self._address = ""
        self._reader: threading.Thread | None = None
        self._reading = threading.Event()
        self.relay = Relay()  # output to its job, events to the queue (see _read_outboxes)
        self.owns_cluster = True

    # -- lifecycle -----------------------------------------------------------------
    def start(self, n: int, timeout: float, launcher: Launcher | None = None) -> None:
        if launcher is not None and launcher.name != "local":
            raise ClusterError(f"the {launcher.name} launcher starts ipyparallel engines; for Ray, start the cluster "
                               "yourself (ray start, KubeRay) and %scale connect ray://HEAD:10001")
        self._refuse_second_ray()
        deadline = time.monotonic() + timeout
        with engine_errors("could not start the embedded Ray cluster", cleanup=self.stop):
            address = self._start_head(deadline)
            # A token in RAY_AUTH_TOKEN (another cluster's) would win over our file: unset while ours runs.
            self._environ = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
            _set_environ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": None, "RAY_AUTH_TOKEN_PATH": self._token_file()})
            with _one_node(), _as_kernel_driver():
                ray.init(address=address, namespace=f"jupyter_scale-{uuid.uuid4().hex[:12]}",
                         log_to_driver=False, logging_level=logging.ERROR, configure_logging=False)
            self._address = address
        cores = os.cpu_count() or 1
        cpus = self.cpus_per_worker or cores / n  # Ray rounds OMP_NUM_THREADS down, to at least 1
        with engine_errors(f"could not start {n} Ray workers", cleanup=self.stop):
            self._attach(n, max(1.0, deadline - time.monotonic()), cpus)

    def _refuse_second_ray(self) -> None:
        if ray.is_initialized():
            raise ClusterError("this kernel is already connected to Ray (ray.init): call ray.shutdown() first, "
                               "or %scale connect to that cluster")

    def _token_file(self) -> str:
        return os.path.join(self._scratch or "", "token")

    def _start_head(self, deadline: float) -> str:
        # Ray's socket paths live under its temp directory and must stay under 108 bytes.
        base = tempfile.gettempdir() if len(tempfile.gettempdir()) < 20 else "/tmp"
        self._scratch = tempfile.mkdtemp(prefix="jsray-", dir=base)  # owner-only
        # If the kernel dies, its watcher ends `ray start` and every process of Ray's, and
        # removes this directory (the token, Ray's logs and sockets, spilled objects).
        self._watch = processes.watch()
        self._watch.add_path(self._scratch)
        fd = os.open(self._token_file(), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        environ = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self._token_file(),
                       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                       # As Dask's memory_limit=0: no monitor killing a rank that trains a big model.
                       RAY_memory_monitor_refresh_ms="0")
        environ.pop("RAY_AUTH_TOKEN", None)  # it would win over our token file
        flags = {"num_cpus": os.cpu_count() or 1, **self.cluster_options}
        self._client_port = rendezvous.free_port(rendezvous.LOOPBACK)
        command = [*programs.command("ray_head"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                   "--port=0", f"--ray-client-server-port={self._client_port}",
                   "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={os.path.join(self._scratch, 'r')}",
                   *(f"--{key.replace('_', '-')}={value}" for key, value in flags.items())]
        log_path = os.path.join(self._scratch, "head.log")
        with open(log_path, "w") as out:
            self._head = subprocess.Popen(command, env=environ, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        self._watch.add_processes([self._head.pid])
        # Ray opens its own temp directory to everyone (0777): ours around it is owner-only.
        found = os.path.join(self._scratch, "r", "ray_current_cluster")
        while not (os.path.exists(found) and open(found).read().strip()):
            if self._head.poll() is not None:
                with open(log_path, errors="replace") as f:
                    said = [line.strip() for line in f if line.strip()]
                raise ClusterError(f"ray start exited with status {self._head.returncode}: "
                                   f"{said[-1] if said else 'no output'}")
            if time.monotonic() > deadline:
                raise ClusterError("the Ray head did not come up within the start timeout")
            time.sleep(0.1)
        with open(found) as f:
            return f.read().strip()

    def connect(self, n: int | None, timeout: float, *, address: str = "", **unknown: Any) -> None:
        if unknown:
            raise ClusterError(f"a Ray cluster is found by its address, not {sorted(unknown)}")
        self._refuse_second_ray()
        self.owns_cluster = False
        self._client_mode = address.startswith("ray://")
        _set_environ({})  # the token the kernel's environment names now (RAY_AUTH_TOKEN, _PATH)
        host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
        # A head on loopback is a one-node cluster of this machine's (see _one_node); any
        # other is reached as Ray reaches it.
        one_node = _one_node() if not address.startswith("ray://") and _is_loopback(host) else contextlib.nullcontext()
        with (engine_errors(f"could not connect to the Ray cluster at {address}", cleanup=self.stop), one_node,
              _as_kernel_driver()):
            for attempt in (1, 2):
                try:
                    ray.init(address=address, namespace=f"jupyter_scale-{uuid.uuid4().hex[:12]}", log_to_driver=False,
                             logging_level=logging.ERROR, configure_logging=False,
                             runtime_env=self.runtime_env or None)
                    break
                except ConnectionAbortedError as exc:
                    # Ray Client's head starts a server process per client, which now and then
                    # exits as it starts ("Starting Ray client server failed", or an
                    # "Initialization failure from server" when the head finds it a zombie): a
                    # second client gets another.
                    if attempt == 2 or not any(said in str(exc) for said in (
                            "client server failed", "Initialization failure from server")):
                        raise
                    log.info("Ray Client's server did not start; connecting again", exc_info=True)
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
        gpus = self._gpus(n)
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        group = self._group = placement_group([bundle] * n, strategy="PACK")
        if not ray.wait([group.ready()], timeout=timeout)[0]:
            raise ClusterError(f"the Ray cluster has no room for {n} workers of {bundle} within {timeout:.0f} s "
                               f"(free now: {ray.available_resources()})")
        self._actors = [_Rank.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=i)).remote(max(1, int(cpus))) for i in range(n)]
        pings = [actor.pid.remote() for actor in self._actors]
        if len(ray.wait(pings, num_returns=n, timeout=timeout)[0]) < n:
            raise ClusterError(f"Ray did not start {n} actors within {timeout:.0f} s")
        self._pids = ray.get(pings)
        self._reading = threading.Event()  # this reader's: one left from a stop that timed out keeps its own
        self._reader = threading.Thread(target=self._read_outboxes, args=(list(self._actors), self._reading),
                                        name="jupyter_scale-ray-outbox", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        self._reading.set()
        if self._reader is not None:
            self._reader.join(timeout=2 * TAKE_WAIT_S + 1)
            self._reader = None
        # Ray's processes, found while the head still holds them (they are orphans once it exits).
        tree = _tree(self._head.pid) if self._head is not None else []
        actors, group, self._actors, self._group, self._pids = self._actors, self._group, [], None, []
        self.relay.clear()
        head, self._head = self._head, None
        try:
            if ray.is_initialized():
                for actor in actors:
                    with contextlib.suppress(Exception):
                        ray.kill(actor)
                if group is not None:
                    with contextlib.suppress(Exception):
                        remove_placement_group(group)
                ray.shutdown()
            if self._environ:
                _set_environ(self._environ)
        finally:  # whatever Ray said, nothing of the embedded cluster stays
            self._environ = {}
            if head is not None:
                processes.end([head.pid], grace=20)  # ray start --block stops what it started
                head.poll()
                processes.end(tree, grace=5)  # by pid, what did not stop
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None
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
                **({"temp_dir": self._scratch, "client": f"ray://127.0.0.1:{self._client_port}"}
                   if self._scratch else {})}

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


def _set_environ(values: dict[str, str | None]) -> None:
    """Set (None: unset) Ray's variables in the kernel, and have its Ray read them again: it
    reads the authentication mode and token once, and keeps them (C++'s RayConfig and token
    loader), so the embedded cluster's token would otherwise not reach a Ray imported before."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _tree(pid: int) -> list:
    """psutil handles of a process and every process it started."""
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(pid)
        return [process, *descendants([process])]
    return []
