"""Dask engine: an embedded LocalCluster on 127.0.0.1, or any running Dask scheduler.

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
import multiprocessing
import os
import shlex
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import dask
import psutil
from distributed import Client, LocalCluster, Nanny, get_worker
from distributed.core import Status
from distributed.security import Security
from traitlets import Bool

from .. import capture, forkserver, metrics, patches, processes, worker
from ..errors import ClusterError
from ..launchers import Launcher, SlurmLauncher
from . import CONNECT_TIMEOUT_S, Backend, Job, WorkerCallFailed, WorkerLost, channel, describe_exit, engine_errors
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
# What the embedded cluster's fork server imports once: what every worker imports anyway.
FORK_PRELOAD = ["distributed", "torch", "jupyter_scale.worker", __name__]
_OUR_PRELOADS = patches.Patch("distributed.utils._forkserver_preload_set", "Dask's fork server imports ours, "
                              "not every optional package Dask knows of", "engine dask")
MULTIPROCESSING_METHOD = "distributed.worker.multiprocessing-method"
# Dask's logs for debugging (see DaskBackend.start), short: they hold output and arguments.
_FEW_KEPT = {"distributed.admin.low-level-log-length": 16}


def _nested(settings: dict) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}}, as Dask's configuration files are."""
    nested: dict = {}
    for key, value in settings.items():
        *parents, last = key.split(".")
        place = nested
        for part in parents:
            place = place.setdefault(part, {})
        place[last] = value
    return nested


def _worker_settings() -> dict:
    """Dask settings for our workers (and the scheduler), wherever they run."""
    return {
        # Non-daemonic workers may start processes of their own (DataLoader num_workers>0).
        "distributed.worker.daemon": False,
        # Every wake-up of a worker's event loop competes with the training thread for
        # the GIL. Dask's sampling profiler (every 10 ms) and its loop-latency tick (every
        # 20 ms) cost the training loop steps/s for numbers nobody reads here.
        "distributed.worker.profile.enabled": False,
        "distributed.admin.tick.interval": "1s",
        # The scheduler keeps the last events of every topic (the output and metrics
        # batches of every cell: 1000 each by default), and every process the last
        # messages of each of its streams, for debugging: a few will do.
        **_FEW_KEPT,
        # Dask's nanny pins OMP/MKL/OpenBLAS to 1 thread per worker; leave the choice to
        # the worker code, which (like torchrun, and as on ipyparallel) gives each worker
        # cores / workers-per-host unless OMP_NUM_THREADS is set. It also sets glibc's
        # MALLOC_TRIM_THRESHOLD_ to 64 KiB, which hands freed memory back to the OS at
        # once: a training step's activations and gradients are then faulted in afresh
        # every step (1200 page faults a step, 0.76x the steps/s of ipyparallel here).
        "distributed.nanny.pre-spawn-environ": {
            k: v for k, v in dask.config.get("distributed.nanny.pre-spawn-environ", {}).items()
            if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_")
        },
    }


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


def as_a_process_of_its_own() -> None:
    """Python's default start method for the cell's own processes: a worker that the nanny
    started through spawn or the fork server inherits that method, and a DataLoader with
    workers would then pickle the cell's Dataset by reference to a __main__ without it."""
    multiprocessing.set_start_method(None, force=True)


def dask_setup(dask_worker) -> None:
    """Dask preload hook for the embedded cluster's workers: a process group of their own.

    A kernel interrupt signals the kernel's whole process group; a worker process in it
    would take SIGINT in its event loop and die. The kernel interrupts cells itself.
    """
    os.setpgrp()
    as_a_process_of_its_own()
    # A fork of the fork server: Python's random reseeded itself, NumPy's global generator
    # would be the same in every worker (drawn once, in the server).
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


async def _interrupt(run: str | None = None) -> bool:
    # A coroutine, so Client.run can fire it without waiting: it runs in the worker's event
    # loop, beside the busy task thread.
    return worker.interrupt_cell(run)


# --------------------------------------------------------------------------------------
# Kernel side
# --------------------------------------------------------------------------------------

class _Nanny(Nanny):
    """A nanny that remembers how its worker processes ended (Dask only logs it)."""

    born: list  # set per cluster (see start): its nannies, reachable even if the start fails

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.born.append(self)
        self.exit_codes: dict[int | None, int] = {}  # pid (None: died while starting) -> code
        self._worker_pid: int | None = None
        self._own_env = dict(self.env)

    async def instantiate(self):
        self._worker_pid = None
        # A worker forked from the fork server has the environment the server started
        # with; it is given the kernel's as it is now, as a spawned one would have.
        self.env = {**os.environ, **self._own_env}
        status = await super().instantiate()
        self._worker_pid = self.process.pid if self.process is not None else None
        return status

    def _on_worker_exit_sync(self, exitcode):
        self.exit_codes[self._worker_pid] = exitcode
        super()._on_worker_exit_sync(exitcode)

    async def _on_worker_exit(self, exitcode):
        # Dask's nanny starts a new worker when its worker dies. A rank's state dies with its
        # worker, so the session renews every worker (replace_workers): one started here would
        # only be stopped again, after a start competing with theirs for the CPU. It closes.
        if self.status == Status.running:
            self.close_gracefully(reason="jupyter_scale: its worker died")
        await super()._on_worker_exit(exitcode)


class _LocalCluster(LocalCluster):
    """A LocalCluster that never gives a worker name twice.

    15 s after a worker left the scheduler (`distributed.deploy.lost-worker-timeout`), a
    SpecCluster closes the worker of the same name if the scheduler does not list it: with
    names given again after `scale(0)` (its counter starts over from where the names were
    free), that was a new worker of a later restart, closed under a running cell.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._names_given = max((k for k in self.worker_spec if isinstance(k, int)), default=-1)

    def _new_worker_name(self, worker_number):
        self._names_given = max(self._names_given + 1, worker_number)
        return self._names_given


def _rank_order(workers: dict) -> list[str]:
    """Worker addresses by (host, name): names that are numbers (a LocalCluster's) by value."""
    def key(address: str) -> tuple:
        info = workers[address]
        name = str(info.get("name", ""))
        return (info.get("host", ""), (0, int(name), "") if name.isdigit() else (1, 0, name), address)

    return sorted(workers, key=key)


def _end(found: list) -> None:
    """Wait (5 s at most) for processes the nannies were told to stop; kill what is left."""
    processes.end(processes.wait(found, 5), grace=0)


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
        self._settings: dict = {}  # the Dask settings the embedded cluster's workers start under
        self._nannies: list[_Nanny] = []  # the embedded cluster's nannies, with how their workers ended
        self._exit_codes: dict[int | None, int] = {}  # pid -> exit code, of the workers of nannies gone
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
        self._scratch: tempfile.TemporaryDirectory | None = None
        self._watch: processes.Watch | None = None  # the embedded cluster's (see processes)

    # -- lifecycle -----------------------------------------------------------------
    def warm_up(self) -> None:
        self._fork_server()

    def _fork_server(self, verify: float | None = None) -> bool:
        """Whether the embedded cluster's workers can fork from multiprocessing's fork server
        (started here unless it runs), preloaded with FORK_PRELOAD; `verify`: the seconds to
        wait for its imports and a probe forked from it (see forkserver.multiprocessing_server)."""
        if not self.fork_workers or "worker_class" in self.cluster_options:  # only our nanny passes the environment
            return False
        # What each of our nannies writes into this process's environment before it starts a
        # worker, written now: the server starts with it (Dask gives its workers one string
        # hash seed: a fork keeps the server's).
        pre_spawn = {k: str(v) for k, v in _worker_settings()["distributed.nanny.pre-spawn-environ"].items()}
        if pre_spawn.get("PYTHONHASHSEED") in (None, "0"):
            pre_spawn["PYTHONHASHSEED"] = "6640"  # as Dask's nanny does
        os.environ.update(pre_spawn)
        # Dask sets the fork server's imports once, at its first start, importing every
        # optional package it knows of into this process to list them: ours are set instead.
        _OUR_PRELOADS.install(lambda _: True)
        try:
            return forkserver.multiprocessing_server(FORK_PRELOAD, os.environ, verify)
        except Exception:  # workers start as new processes: what Dask does by default
            log.info("multiprocessing's fork server failed to start", exc_info=True)
            return False

    def start(self, n: int, timeout: float, launcher: Launcher | None = None) -> None:
        if self.client is not None:
            raise ClusterError("the Dask cluster is already running")
        if isinstance(launcher, SlurmLauncher):
            return self._start_on_slurm(n, timeout, launcher)
        if launcher is not None and launcher.name != "local":
            raise ClusterError(f"the {launcher.name} launcher starts ipyparallel engines; on Dask, start the cluster "
                               "yourself (dask-mpi) and %scale connect to its scheduler")
        try:
            security = Security.temporary()
        except ImportError as exc:
            raise ClusterError("the embedded Dask cluster needs the cryptography package for its TLS "
                               "(pip install 'jupyter_scale[dask]')") from exc
        options = dict(
            n_workers=n,
            threads_per_worker=1,  # one rank per worker, its calls in order
            processes=True,
            host="127.0.0.1",
            # Mutual TLS with a throwaway CA made for this cluster: loopback is open to every
            # local user, and a Dask client runs code on the scheduler (in this kernel) and
            # the workers. Only holders of this cluster's certificate (the kernel's client,
            # the scheduler, the nannies and workers) get in.
            security=security,
            protocol="tls://",
            scheduler_port=0,
            dashboard_address="127.0.0.1:0",  # loopback, a free port (8787 may be someone else's)
            memory_limit=0,  # no nanny killing a worker that trains a big model
            silence_logs=logging.ERROR,
            preload=[__name__],  # dask_setup above
        )
        nannies: list[_Nanny] = []
        options.setdefault("worker_class", type("_Nanny", (_Nanny,), {"born": nannies}))
        options.update(self.cluster_options)
        scratch = tempfile.TemporaryDirectory(prefix="jupyter_scale-dask-")
        # What the kernel's watcher ends and removes if the kernel dies: this directory, the workers.
        self._watch = processes.watch()
        self._watch.add_path(scratch.name)
        settings = {
            **_worker_settings(),
            # The scheduler's and workers' files: not in Dask's /tmp/dask-scratch-space, shared
            # by every user and readable by all, but in a directory of the cluster's own,
            # owner-only, removed with it.
            "temporary-directory": scratch.name,
        }
        self._settings, self._nannies, self._exit_codes = settings, nannies, {}
        # Read when a nanny starts a worker (here, and in replace_workers), not kept by it.
        fork = {MULTIPROCESSING_METHOD: "forkserver"} if self._fork_server(verify=timeout / 2) else {}
        failed = f"could not start {n} Dask workers"
        with dask.config.set({**settings, **fork}), engine_errors(failed, detail=lambda exc: self._died_starting()):
            cluster = _LocalCluster(**options)
        with dask.config.set({**settings, **fork}), engine_errors(failed, cleanup=cluster.close):
            # Direct: results and big arguments go straight between the kernel and a worker,
            # not through the scheduler (which would copy them once more). The scheduler
            # makes its stream to the client now: it keeps few messages too.
            with dask.config.set(_FEW_KEPT):
                client = Client(cluster, set_as_default=False, timeout=timeout, direct_to_workers=True)
            client.wait_for_workers(n, timeout=timeout)
        self._cluster, self.owns_cluster, self._scratch = cluster, True, scratch
        self._attach(client, n, timeout)

    @property
    def replaces_workers(self) -> bool:
        cluster = self._cluster
        return (self.client is not None and isinstance(cluster, LocalCluster) and not self._remote
                and getattr(cluster.scheduler, "status", None) == Status.running)

    def replace_workers(self, n: int, timeout: float) -> None:
        """New nannies and workers for the embedded cluster, whose scheduler stays (its
        address, dashboard and client with it)."""
        if not self.replaces_workers:
            return super().replace_workers(n, timeout)
        cluster, client = self._cluster, self.client
        assert client is not None
        deadline = time.monotonic() + timeout
        failed = f"could not start {n} new Dask workers"
        # Every call of the old workers goes first: one the scheduler still held (a job
        # nobody waited for to the end: a cell's farewell to its ranks, a wait that failed) is
        # pinned to its worker's address, and would run on a new worker that gets that port.
        for job in self.relay.jobs():
            job.release()
        with dask.config.set(self._settings), engine_errors(failed, detail=lambda exc: self._died_starting()):
            # Every nanny goes (a dead worker's too), stopping its worker; new ones start fresh.
            processes = self.local_processes()
            cluster.scale(0)
            try:
                while cluster.workers or client.scheduler_info(n_workers=-1)["workers"]:
                    if time.monotonic() > deadline:
                        raise ClusterError(f"{failed}: the old ones did not stop within {timeout:.0f} s")
                    time.sleep(0.01)
            finally:
                _end(processes)
            self._addresses, self._pids = [], []
            self._forget_nannies()
            # Only now (the old workers would lose their server), anew if the kernel's
            # environment no longer suits it.
            method = dask.config.get(MULTIPROCESSING_METHOD)  # the user's, unless we fork
            if self._fork_server(verify=max(deadline - time.monotonic(), 1.0) / 2):
                method = "forkserver"
            with dask.config.set({MULTIPROCESSING_METHOD: method}):
                cluster.scale(n)
                while len(client.scheduler_info(n_workers=-1)["workers"]) < n:
                    if self._died_starting() or time.monotonic() > deadline:
                        why = self._died_starting() or f"they did not join within {timeout:.0f} s"
                        raise ClusterError(f"{failed}: {why}")
                    time.sleep(0.01)
        self._adopt_workers(client, n)

    def _forget_nannies(self) -> None:
        """Drop the closed nannies (each holds its monitor's history), keeping how their workers ended."""
        for nanny in self._nannies:
            self._exit_codes.update(nanny.exit_codes)
        self._nannies[:] = []  # in place: the cluster's nanny class appends to this list

    def _died_starting(self) -> str | None:
        """How a worker of the current nannies ended while starting, if one did."""
        died = [code for nanny in self._nannies for code in nanny.exit_codes.values()]
        if not died:
            return None
        # Their output went to the kernel's own stderr, not to the notebook.
        return (f"a worker process {describe_exit(died[0])} while starting (its output is in the kernel's log, "
                "e.g. the terminal running Jupyter); fix the workers' environment and run the cell again")

    # `dask worker` imports a preload module in the nanny too (to check its arguments), which
    # would import torch there as well (a second or two and 250 MB per job): given as code, the
    # preload defines a hook that imports ours (and torch) in the worker only, before the first cell.
    _SLURM_WORKER_PRELOAD = ("def dask_setup(worker):\n    import jupyter_scale.backends.dask as engine\n"
                             "    engine.as_a_process_of_its_own()\n")

    def _start_on_slurm(self, n: int, timeout: float, launcher: SlurmLauncher) -> None:
        """dask-jobqueue's SLURMCluster: the scheduler in this kernel, one Slurm job per worker
        (its way), mutual TLS with a throwaway CA whose worker certificate waits for the jobs in
        the launcher's owner-only directory."""
        try:
            from dask_jobqueue import SLURMCluster
        except ImportError as exc:
            raise ClusterError(
                "the slurm launcher on Dask needs dask-jobqueue (pip install 'jupyter_scale[slurm]')"
            ) from exc
        launcher.check(tasks=1, worker_per_job=True)
        directory = launcher.directory()
        address = launcher.listen_address()
        extra = [line for line in launcher.directives(worker_per_job=True)
                 if not line.startswith(("--cpus-per-task", "--mem=", "--partition", "--account", "--time"))]
        # The workers read our settings as a Dask worker started by a LocalCluster does.
        inherited = dask.config.serialize(_nested(_worker_settings()))
        options = dict(
            cores=1, processes=1,  # one single-threaded worker per job: one rank
            memory=f"{launcher.memory_megabytes or 1024}MiB", job_cpu=launcher.cpus_per_worker,
            job_mem=f"{launcher.memory_megabytes}M" if launcher.memory_megabytes else None,
            # Without a memory asked, no --mem (the partition's default), as ipyparallel's job.
            job_directives_skip=[] if launcher.memory_megabytes else ["--mem"],
            queue=launcher.partition or None, account=launcher.account or None,
            walltime=launcher.time_limit or None,
            job_extra_directives=extra, job_name="jupyter_scale",
            job_script_prologue=[f"export DASK_INTERNAL_INHERIT_CONFIG={inherited}"],
            python=sys.executable,
            log_directory=directory, local_directory=directory, shared_temp_directory=directory,
            security=Security.temporary(), protocol="tls://",
            scheduler_options={"host": address, "dashboard_address": f"{address}:0"},
            # After jobqueue's own: no nanny killing a worker that trains a big model.
            worker_extra_args=["--preload", shlex.quote(self._SLURM_WORKER_PRELOAD), "--memory-limit", "0"],
        )
        options.update(self.cluster_options)
        # No time limit asked: none in the script (the partition's), not dask-jobqueue's 30 minutes.
        with (dask.config.set({"jobqueue.slurm.walltime": None, **_FEW_KEPT}),
              engine_errors("could not start the Dask scheduler for Slurm")):
            cluster = SLURMCluster(**options)
        launcher.find_jobs = lambda: [str(getattr(job, "job_id", "") or "") for job in list(cluster.workers.values())]
        with engine_errors(f"could not start {n} Dask workers on Slurm", cleanup=lambda: cluster.close(timeout=15)):
            cluster.scale(n)  # closing the cluster scancels the jobs
            with dask.config.set(_FEW_KEPT):
                client = Client(cluster, set_as_default=False, timeout=timeout, direct_to_workers=True)

            def ready(seconds: float) -> bool:
                try:
                    client.wait_for_workers(n, timeout=seconds)
                    return True
                except TimeoutError:
                    return False

            launcher.wait_for_workers(ready, n, timeout)
        # The workers are processes on the compute nodes: none of them is ours to signal.
        self._cluster, self.owns_cluster, self._remote = cluster, True, True
        self._attach(client, n, timeout)

    def connect(self, n: int | None, timeout: float, *, address: str = "", tls: dict | None = None,
                **unknown: Any) -> None:
        if unknown:
            raise ClusterError(f"a Dask cluster is found by its scheduler address, not {sorted(unknown)}")
        if self.client is not None:
            raise ClusterError("already attached to a Dask cluster")
        # Without files given, Security() is Dask's own configuration (distributed.comm.tls.*).
        security = Security() if not tls else Security(
            tls_ca_file=tls["ca_file"], tls_client_cert=tls["cert"], tls_client_key=tls.get("key"),
            require_encryption=True)
        # Dask's timeout here is for reaching the scheduler (it retries a refused port until
        # then); the workers get `timeout` below. A scheduler we connect to keeps the events
        # of our topics as it is configured to (distributed.admin.low-level-log-length, 1000
        # by default); our client keeps few messages.
        with dask.config.set(_FEW_KEPT), engine_errors(f"could not connect to the Dask scheduler at {address}",
                                                       detail=str):
            client = Client(address, set_as_default=False, timeout=CONNECT_TIMEOUT_S, security=security)
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
            if not client.scheduler_info(n_workers=-1)["workers"]:
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
        ordered = _rank_order(client.scheduler_info(n_workers=-1)["workers"])
        addresses = ordered[:n] if n else ordered
        try:
            pids = client.run(_pid, workers=addresses)
        except Exception as exc:  # e.g. jupyter_scale is missing in the workers' environment
            raise ClusterError(f"the Dask workers cannot run jupyter_scale ({type(exc).__name__}: {exc}); "
                               "install jupyter_scale and torch in the workers' environment") from exc
        self._addresses, self._pids = addresses, [pids[a] for a in addresses]
        self._alive = self._alive_before = set(addresses)
        if self._watch is not None:
            self._watch.add_processes(self.local_processes())

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
        if cluster is not None:
            try:
                cluster.close(timeout=15)
            finally:
                _end(processes)  # what we started, by pid: a worker that ignored the nanny is stopped here
                if self._scratch is not None:
                    self._scratch.cleanup()
                    self._scratch = None
                if self._watch is not None:
                    self._watch.close()
                    self._watch = None
                # dask-jobqueue's copies of the worker certificate (the Slurm jobs read them).
                for key in ("ca_file", "cert", "key"):
                    with contextlib.suppress(Exception):
                        getattr(cluster, f"_job_{key}").close()

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
        if self._scratch is not None:  # the embedded cluster's files (its scheduler's and workers')
            info["temp_dir"] = self._scratch.name
        return info

    def exit_code(self, pid: int) -> int | None:
        for nanny in self._nannies:
            if pid in nanny.exit_codes:
                return nanny.exit_codes[pid]
        return self._exit_codes.get(pid)

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
                answer = set(self._require_client().scheduler_info(n_workers=-1)["workers"])
            except Exception:  # no answer (a busy or gone scheduler): nothing learnt, keep what we knew
                log.debug("scheduler_info failed", exc_info=True)
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
