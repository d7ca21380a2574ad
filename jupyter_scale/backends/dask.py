"""Dask engine: an embedded LocalCluster on 127.0.0.1, dask-jobqueue's on Slurm (both started
by backends.dask_cluster), or any running Dask scheduler.

One rank per Dask worker, pinned to it (worker restrictions, no stealing), each worker a
process with one thread, so a worker runs one rank's calls in order and keeps
`jupyter_scale.worker`'s state (the rank's namespace, its process group) across cells.

Dask runs calls in a worker thread and does not capture what they print, so each call is
wrapped (`_call`): its stdout/stderr go to the kernel as Dask events (`Worker.log_event`
-> `Client.subscribe_topic`), and so do the metrics points (a `dask-topic://` address
for `metrics.EventSink`). That channel goes wherever the client reaches the scheduler,
so workers on other hosts (dask-jobqueue, dask-kubernetes) stream too. Interrupts cannot
be signals (they would hit the worker's event loop, in the main thread): they raise
KeyboardInterrupt in the cell's thread (`worker.interrupt_cell`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psutil
from distributed import Client, get_worker
from traitlets import Bool

from .. import capture, metrics, worker
from ..errors import ClusterError
from ..launchers import Launcher, SlurmLauncher
from . import Backend, Job, WorkerCallFailed, WorkerLost, channel, engine_errors
from . import dask_cluster as launch
from .base import Frames, split_frames
from .relay import Relay, RelayedJob

log = logging.getLogger(__name__)

# Seconds between checks of which workers the scheduler still has (a dead worker's pinned
# task would wait for it forever: the kernel must notice the worker is gone).
LIVENESS_INTERVAL_S = 0.25
# Arguments bigger than this travel once, to rank 0's worker; the others fetch them from
# there (worker to worker), so the kernel sends a model once whatever the cluster size.
SCATTER_MIN_BYTES = 1 << 20
CLIENT_SEND_INTERVAL_S = 0.001
TOPIC_SCHEME = "dask-topic"
# --------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------

def _call(fn: Callable, job: str, rank: int, topic: str, args: tuple, payload: Any = None) -> Any:
    """What a Dask task runs: fn(*args, *payload) with its output streamed to the kernel
    as events of the topic the kernel's client subscribed to."""
    if payload is not None:
        args = (*args, *payload.frames)
    dask_worker = get_worker()  # only a task's thread knows its worker
    result = capture.call_captured(fn, args, lambda message: dask_worker.log_event(topic, message), job, rank)
    return Frames(list(result)) if isinstance(result, tuple) else result


class _TopicTransport:
    """metrics.EventSink transport over Dask events (created in the task's thread)."""

    def __init__(self, address: str):
        self._topic = address.split("://", 1)[1]
        self._worker = get_worker()  # only a task's thread knows its worker

    def send(self, message: str) -> bool:
        self._worker.log_event(self._topic, message)
        return True

    def close(self) -> None:
        pass


metrics.register_transport(TOPIC_SCHEME, _TopicTransport)


def _pid() -> int:
    return os.getpid()


async def _interrupt(run: str | None = None) -> bool:
    # A coroutine, so Client.run can fire it without waiting: it runs in the worker's event
    # loop, beside the busy task thread.
    return worker.interrupt_cell(run)


# --------------------------------------------------------------------------------------
# Kernel side
# --------------------------------------------------------------------------------------

def _rank_order(workers: dict) -> list[str]:
    """Worker addresses by (host, name): names that are numbers (a LocalCluster's) by value."""
    def key(address: str) -> tuple:
        info = workers[address]
        name = str(info.get("name", ""))
        return (info.get("host", ""), (0, int(name), "") if name.isdigit() else (1, 0, name), address)

    return sorted(workers, key=key)


class _TopicEventQueue(metrics.EventQueue):
    """The kernel's end of the metrics stream when it travels as Dask events."""

    def __init__(self, client: Client):
        super().__init__()
        self._client = client
        self._topic = f"jupyter_scale-events-{uuid.uuid4().hex[:12]}"
        self.address = f"{TOPIC_SCHEME}://{self._topic}"
        client.subscribe_topic(self._topic, lambda event: self.accept(event[1]))

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a closed client has no subscriptions left
            self._client.unsubscribe_topic(self._topic)


class _DaskJob(RelayedJob):
    def __init__(self, backend: DaskBackend, job_id: str, futures: dict, held: list):
        super().__init__(backend.relay, job_id, list(futures))
        self._backend = backend
        self._futures = futures
        self._held = held  # scattered arguments: released with the job
        self._values: dict[int, Any] = {}  # results fetched, not yet handed over
        for future in futures.values():
            future.add_done_callback(lambda _f: self.notify())

    def _replied(self, rank: int) -> bool:
        return self._futures[rank].done()

    def _worker_gone(self, rank: int) -> bool:
        return rank in self._backend.gone_ranks()

    def result(self, rank: int) -> Any:
        future = self._futures[rank]
        if not future.done():
            raise WorkerLost(rank, f"its Dask worker {self._backend.address_of(rank)} left the cluster")
        if future.status == "error":
            exc = future.exception()
            raise WorkerCallFailed(rank, f"{type(exc).__name__}: {exc}")
        if future.status != "finished":
            raise WorkerLost(rank, f"the Dask task was {future.status}")
        if rank not in self._values:
            # Every result that is ready, in one round trip (not one per rank).
            ready = [r for r, f in self._futures.items() if r not in self._values and f.status == "finished"]
            values = self._backend._require_client().gather([self._futures[r] for r in ready])
            self._values.update(zip(ready, values))
        value = self._values.pop(rank)
        return tuple(value.frames) if isinstance(value, Frames) else value

    def release(self) -> None:
        super().release()
        pending = [f for f in self._futures.values() if not f.done()]
        if pending:
            with contextlib.suppress(Exception):
                self._backend._require_client().cancel(pending)
        for future in [*self._futures.values(), *self._held]:
            with contextlib.suppress(Exception):
                future.release()
        self._futures = {r: _Released() for r in self._futures}
        self._held, self._values = [], {}


class _Released:
    """What a released job holds in place of its futures."""

    status = "released"

    def done(self) -> bool:
        return True


class DaskBackend(Backend):
    """Workers are Dask workers; rank i is the i-th worker by (host, name)."""

    name = "dask"
    hub = "scheduler"
    fallback = True
    connect_help = "a Dask scheduler's address (tcp://HOST:PORT, tls://HOST:PORT, ws:// ...)"
    launchers = (Launcher, SlurmLauncher)
    instead_of_launcher = "on Dask, start the cluster yourself (dask-mpi) and %scale connect to its scheduler"

    @classmethod
    def parse_address(cls, address: str | None, options: dict) -> dict | None:
        if not address:
            return None
        from distributed.comm.registry import backends as transports

        scheme = address.split("://", 1)[0] if "://" in address else "tcp"
        if scheme not in transports:  # another engine's (ray://)
            return None
        if options.get("profile") or options.get("cluster_id") or options.get("url_file"):
            raise ValueError("--profile, --cluster-id and connection files find an ipyparallel cluster, not a "
                             "Dask scheduler")
        return {"address": address if "://" in address else f"tcp://{address}",
                **({"tls": options["tls"]} if options.get("tls") else {})}

    fork_workers = Bool(True, config=True,
                        help="The embedded cluster's workers are forks of multiprocessing's fork server, which "
                             "imported torch and the worker code once and is kept across restarts (Linux); False: "
                             "each worker is a new Python process (Dask's default, spawn).")

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._cluster: Any = None  # a LocalCluster, or dask-jobqueue's SLURMCluster
        self._embedded: launch.Embedded | None = None  # the LocalCluster's, with how its workers ended
        self.client: Client | None = None
        self._addresses: list[str] = []
        self._pids: list[int] = []
        self.relay = Relay()  # output to its job (events come on a topic of their own: open_events)
        self._output_topic = ""
        self._alive: set[str] = set()
        self._alive_before: set[str] = set()
        self._alive_at = 0.0
        self.owns_cluster = True
        self._remote = False  # workers on other machines (a Slurm job's): no pids of ours

    # -- lifecycle -----------------------------------------------------------------
    def warm_up(self) -> None:
        launch.fork_server(self.fork_workers, self.cluster_options)

    def start(self, n: int, timeout: float, launcher: Launcher | None = None) -> None:
        """The embedded cluster, or dask-jobqueue's on Slurm (see dask_cluster)."""
        if self.client is not None:
            raise ClusterError("the Dask cluster is already running")
        if isinstance(launcher, SlurmLauncher):
            self._cluster, client = launch.start_on_slurm(n, timeout, launcher, self.cluster_options)
            # The workers are processes on the compute nodes: none of them is ours to signal.
            self._embedded, self.owns_cluster, self._remote = None, True, True
        else:
            embedded = launch.Embedded(self.cluster_options, self.fork_workers)
            client = embedded.start(n, timeout)
            self._cluster, self._embedded, self.owns_cluster = embedded.cluster, embedded, True
        self._attach(client, n, timeout)

    @property
    def replaces_workers(self) -> bool:
        return self.client is not None and self._embedded is not None and self._embedded.running

    def replace_workers(self, n: int, timeout: float) -> None:
        """New nannies and workers for the embedded cluster, whose scheduler stays (its
        address, dashboard and client with it)."""
        if not self.replaces_workers:
            return super().replace_workers(n, timeout)
        client, embedded = self.client, self._embedded
        assert client is not None and embedded is not None
        # Every call of the old workers goes first: one the scheduler still held (a job
        # nobody waited for to the end: a cell's farewell to its ranks, a wait that failed) is
        # pinned to its worker's address, and would run on a new worker that gets that port.
        for job in self.relay.jobs():
            job.release()
        old = self.local_processes()
        self._addresses, self._pids = [], []
        embedded.renew_workers(client, n, timeout, old)
        self._adopt_workers(client, n)

    def connect(self, n: int | None, timeout: float, *, address: str = "", tls: dict | None = None,
                **unknown: Any) -> None:
        if unknown:
            raise ClusterError(f"a Dask cluster is found by its scheduler address, not {sorted(unknown)}")
        if self.client is not None:
            raise ClusterError("already attached to a Dask cluster")
        client = launch.connect(address, tls)
        self.owns_cluster = False

        def forget() -> None:
            client.close()
            self.client = None

        with engine_errors(f"the Dask cluster at {address} did not offer {n} workers within {timeout:.0f} s",
                           cleanup=forget, detail=str):
            if n:
                client.wait_for_workers(n, timeout=timeout)
            self._attach(client, n, timeout)

    def _attach(self, client: Client, n: int | None, timeout: float) -> None:
        """Take `client`'s cluster's workers as the ranks; on failure, stop what start() started
        (a cluster we only connect to: the client is closed)."""
        self.client = client
        try:
            if not launch.workers_of(client):
                raise ClusterError("the Dask cluster has no workers (start some, or pass --workers N to wait for "
                                   "them)")
            # The client batches what it sends the scheduler every 10 ms: a cell submitted
            # within 10 ms of the last message (the previous cell's release) waited that long
            # before leaving the kernel, half of a trivial cell's time here. 1 ms, as a worker's.
            stream = getattr(client, "scheduler_comm", None)
            if stream is not None and hasattr(stream, "interval"):
                stream.interval = min(stream.interval, CLIENT_SEND_INTERVAL_S)
            self._output_topic = f"jupyter_scale-output-{uuid.uuid4().hex[:12]}"
            client.subscribe_topic(self._output_topic, lambda event: self.relay.output(event[1]))
            self._adopt_workers(client, n)
        except BaseException:
            self.stop()  # the cluster, its workers and its directory: not left behind
            raise

    def _adopt_workers(self, client: Client, n: int | None) -> None:
        """The cluster's workers (`n` of them, else all) are the ranks, in order."""
        ordered = _rank_order(launch.workers_of(client))
        addresses = ordered[:n] if n else ordered
        try:
            pids = client.run(_pid, workers=addresses)
        except Exception as exc:  # e.g. jupyter_scale is missing in the workers' environment
            raise ClusterError(f"the Dask workers cannot run jupyter_scale ({type(exc).__name__}: {exc}); "
                               "install jupyter_scale and torch in the workers' environment") from exc
        self._addresses, self._pids = addresses, [pids[a] for a in addresses]
        self._alive = self._alive_before = set(addresses)
        if self._embedded is not None:
            self._embedded.watch_workers(self.local_processes())

    def stop(self) -> None:
        client, cluster = self.client, self._cluster
        processes = self.local_processes() if self.owns_cluster else []
        self.client, self._cluster = None, None
        self._addresses, self._pids = [], []
        self.relay.clear()
        if client is not None:
            with contextlib.suppress(Exception):
                client.unsubscribe_topic(self._output_topic)
            with contextlib.suppress(Exception):  # a cluster that is gone cannot answer
                client.close(timeout=10)
        if cluster is not None and self._embedded is not None:
            self._embedded.close(processes)  # kept: it knows how its workers ended
        elif cluster is not None:
            launch.close_slurm(cluster)

    @property
    def running(self) -> bool:
        return self.client is not None

    @property
    def size(self) -> int:
        return len(self._addresses)

    def address_of(self, rank: int) -> str:
        return self._addresses[rank] if rank < len(self._addresses) else "?"

    def describe(self) -> dict:
        if self.client is None:
            return {}
        info = {"scheduler": self.client.scheduler.address, "worker_addresses": list(self._addresses),
                "connected": not self.owns_cluster}
        with contextlib.suppress(Exception):  # no dashboard, or none the client knows of
            info["dashboard"] = self.client.dashboard_link
        scratch = self._embedded.scratch if self._embedded is not None else None
        if scratch is not None:  # the embedded cluster's files (its scheduler's and workers')
            info["temp_dir"] = scratch.name
        return info

    def exit_code(self, pid: int) -> int | None:
        return self._embedded.exit_code(pid) if self._embedded is not None else None

    def local_processes(self) -> list:
        """psutil handles of the worker processes this backend started."""
        if not self.owns_cluster or self._remote:
            return []
        found = []
        # Workers in this process (cluster_options processes=False) are not processes of their own.
        for pid in set(self._pids) - {os.getpid()}:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(pid))
        return found

    def order_ranks(self, order: list[int]) -> None:
        self._addresses = [self._addresses[i] for i in order]
        self._pids = [self._pids[i] for i in order]

    def open_events(self) -> metrics.EventQueue:
        return _TopicEventQueue(self._require_client())

    def contact_address(self) -> str | None:
        if self.client is None:
            return None
        from distributed.comm import get_address_host

        return get_address_host(self.client.scheduler.address)

    # -- liveness ------------------------------------------------------------------
    def _alive_addresses(self, fresh: bool = False) -> set[str]:
        now = time.monotonic()
        if fresh or now - self._alive_at > LIVENESS_INTERVAL_S:
            try:
                answer = set(launch.workers_of(self._require_client()))
            except Exception:  # no answer (a busy or gone scheduler): nothing learnt, keep what we knew
                log.debug("asking the scheduler for its workers failed", exc_info=True)
                return self._alive
            self._alive_before, self._alive, self._alive_at = self._alive, answer, now
        return self._alive

    def gone_ranks(self) -> list[int]:
        """Ranks whose worker two answers of the scheduler in a row no longer list."""
        alive = self._alive_addresses()
        before = self._alive_before
        return [r for r, a in enumerate(self._addresses) if a not in alive and a not in before]

    def dead_ranks(self) -> list[int]:
        if self.client is None:
            return []
        alive = self._alive_addresses(fresh=True)
        return [r for r, a in enumerate(self._addresses) if a not in alive]

    # -- calls ---------------------------------------------------------------------
    def _require_client(self) -> Client:
        if self.client is None:
            raise ClusterError("no Dask cluster is attached")
        return self.client

    def _new_job(self, fn: Callable, calls: dict[int, tuple], held: list) -> _DaskJob:
        client = self._require_client()
        job_id = self.relay.new_id(fn)
        futures = {}
        for rank, (args, payload) in calls.items():
            futures[rank] = client.submit(
                _call, fn, job_id, rank, self._output_topic, args, payload,
                key=f"jupyter_scale-{job_id}-rank{rank}", workers=[self._addresses[rank]],
                allow_other_workers=False, pure=False, retries=0,
            )
        job = _DaskJob(self, job_id, futures, held)
        self.relay.add(job)
        return job

    def submit(self, fn: Callable, *args: Any, ranks: list[int] | None = None) -> Job:
        client = self._require_client()
        ranks = list(range(self.size)) if ranks is None else list(ranks)
        # Leading arguments travel with each task; big trailing buffers (the shipped
        # frames) once, to the first rank's worker, which the others fetch them from.
        head, frames = split_frames(args)
        payload, held = (Frames(frames) if frames else None), []
        if frames and sum(memoryview(f).nbytes for f in frames) >= SCATTER_MIN_BYTES:
            payload = client.scatter(payload, workers=[self._addresses[ranks[0]]], hash=False)
            held.append(payload)
        return self._new_job(fn, {r: (head, payload) for r in ranks}, held)

    def channel_server(self) -> Callable[..., int] | None:
        # Calls over the channel run in a thread of its own, as Dask's run in a thread of the
        # worker's (interrupted alike, by worker.interrupt_cell).
        return channel.serve

    def submit_each(self, fn: Callable, args_per_rank: list[tuple]) -> Job:
        self._require_client()
        return self._new_job(fn, {r: (tuple(a), None) for r, a in enumerate(args_per_rank)}, [])

    def interrupt(self, ranks: list[int], run: str | None = None) -> None:
        if self.client is None:
            return
        alive = self._alive_addresses(fresh=True)
        targets = [self._addresses[r] for r in ranks if self._addresses[r] in alive]
        if targets:
            # From a thread of its own: the scheduler answers once it reached every target,
            # and a worker whose host left the network is reached late or never; the cell's
            # wait loop goes on meanwhile.
            client = self.client

            def send() -> None:
                with contextlib.suppress(Exception):
                    client.run(_interrupt, run, workers=targets, wait=False, on_error="ignore")

            threading.Thread(target=send, name="jupyter_scale-interrupt", daemon=True).start()
