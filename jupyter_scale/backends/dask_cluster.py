"""The Dask engine's cluster, below its calls: the embedded LocalCluster, or dask-jobqueue's
SLURMCluster, that the backend starts, or a running scheduler it connects to (backends.dask
holds the engine).

The embedded cluster (`Embedded`) runs on 127.0.0.1 with mutual TLS (a throwaway CA made for
it), keeps its scheduler's and workers' files in an owner-only directory of its own and is tied
to the kernel (processes.watch). Its workers, one single-threaded process per rank, are forks of
multiprocessing's fork server where they can be (`fork_server`), and its nannies remember how
their workers ended. On Slurm (`start_on_slurm`), each worker is a job of its own, with mutual
TLS too.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shlex
import sys
import tempfile
import time
from typing import Any

import dask
from distributed import Client, LocalCluster, Nanny
from distributed.core import Status
from distributed.security import Security

from .. import forkserver, patches, processes
from ..errors import ClusterError
from ..launchers import SlurmLauncher
from .base import CONNECT_TIMEOUT_S, describe_exit, engine_errors

log = logging.getLogger(__name__)

# The engine's module: every worker imports it (its calls are functions of it).
ENGINE = "jupyter_scale.backends.dask"
# What the embedded cluster's fork server imports once: what every worker imports anyway.
FORK_PRELOAD = ["distributed", "torch", "jupyter_scale.worker", ENGINE]
_OUR_PRELOADS = patches.Patch("distributed.utils._forkserver_preload_set", "Dask's fork server imports ours, "
                              "not every optional package Dask knows of", "engine dask")
MULTIPROCESSING_METHOD = "distributed.worker.multiprocessing-method"
# Dask's logs for debugging (see Embedded.start), short: they hold output and arguments.
FEW_KEPT = {"distributed.admin.low-level-log-length": 16}


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


def worker_settings() -> dict:
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
        **FEW_KEPT,
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


class _Nanny(Nanny):
    """A nanny that remembers how its worker processes ended (Dask only logs it)."""

    born: list  # set per cluster (see Embedded.start): its nannies, reachable even if the start fails

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



def workers_of(client: Client) -> dict[str, dict]:
    """The scheduler's workers now, address -> info. Not `Client.scheduler_info()`: it fetches
    into the client's cached identity and returns the cache, which the client's own periodic
    refresh (distributed.client.scheduler-info-interval) may replace in between with an
    identity that lists no workers."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]

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


def fork_server(fork_workers: bool, cluster_options: dict, verify: float | None = None) -> bool:
    """Whether the embedded cluster's workers can fork from multiprocessing's fork server
    (started here unless it runs), preloaded with FORK_PRELOAD; `verify`: the seconds to wait
    for its imports and a probe forked from it (see forkserver.multiprocessing_server)."""
    if not fork_workers or "worker_class" in cluster_options:  # only our nanny passes the environment
        return False
    # What each of our nannies writes into this process's environment before it starts a
    # worker, written now: the server starts with it (Dask gives its workers one string
    # hash seed: a fork keeps the server's).
    pre_spawn = {k: str(v) for k, v in worker_settings()["distributed.nanny.pre-spawn-environ"].items()}
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


class Embedded:
    """The embedded cluster (see the module's doc): `start`, `renew_workers`, `close`."""

    def __init__(self, cluster_options: dict, fork_workers: bool):
        self._options, self._fork = cluster_options, fork_workers
        self.cluster: LocalCluster | None = None
        self.scratch: tempfile.TemporaryDirectory | None = None  # the scheduler's and workers' files
        self._watch: processes.Watch | None = None
        self._settings: dict = {}  # the Dask settings its workers start under
        self._nannies: list[_Nanny] = []  # its nannies, with how their workers ended
        self._exit_codes: dict[int | None, int] = {}  # pid -> exit code, of the workers of nannies gone

    def start(self, n: int, timeout: float) -> Client:
        """Start it with `n` workers; a client of it, once they joined."""
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
        options.setdefault("worker_class", type("_Nanny", (_Nanny,), {"born": self._nannies}))
        options.update(self._options)
        self.scratch = tempfile.TemporaryDirectory(prefix="jupyter_scale-dask-")
        # What the kernel's watcher ends and removes if the kernel dies: this directory, the workers.
        self._watch = processes.watch()
        self._watch.add_path(self.scratch.name)
        self._settings = {
            **worker_settings(),
            # The scheduler's and workers' files: not in Dask's /tmp/dask-scratch-space, shared
            # by every user and readable by all, but in a directory of the cluster's own,
            # owner-only, removed with it.
            "temporary-directory": self.scratch.name,
        }
        # Read when a nanny starts a worker (here, and in renew_workers), not kept by it.
        fork = {MULTIPROCESSING_METHOD: "forkserver"} if fork_server(self._fork, self._options, timeout / 2) else {}
        failed = f"could not start {n} Dask workers"
        with dask.config.set({**self._settings, **fork}), engine_errors(failed, detail=lambda exc: self.died_starting()):
            cluster = _LocalCluster(**options)
        with dask.config.set({**self._settings, **fork}), engine_errors(failed, cleanup=cluster.close):
            # Direct: results and big arguments go straight between the kernel and a worker,
            # not through the scheduler (which would copy them once more). The scheduler
            # makes its stream to the client now: it keeps few messages too.
            with dask.config.set(FEW_KEPT):
                client = Client(cluster, set_as_default=False, timeout=timeout, direct_to_workers=True)
            client.wait_for_workers(n, timeout=timeout)
        self.cluster = cluster
        return client

    def watch_workers(self, found: list) -> None:
        """Its workers' processes, for the kernel's watcher to end if the kernel dies."""
        if self._watch is not None:
            self._watch.add_processes(found)

    @property
    def running(self) -> bool:
        return self.cluster is not None and getattr(self.cluster.scheduler, "status", None) == Status.running

    def renew_workers(self, client: Client, n: int, timeout: float, old: list) -> None:
        """New nannies and `n` new workers in place of all the cluster's (`old`: their
        processes), its scheduler kept (its address, dashboard and client with it)."""
        cluster = self.cluster
        assert cluster is not None
        deadline = time.monotonic() + timeout
        failed = f"could not start {n} new Dask workers"
        with dask.config.set(self._settings), engine_errors(failed, detail=lambda exc: self.died_starting()):
            # Every nanny goes (a dead worker's too), stopping its worker; new ones start fresh.
            cluster.scale(0)
            try:
                while cluster.workers or workers_of(client):
                    if time.monotonic() > deadline:
                        raise ClusterError(f"{failed}: the old ones did not stop within {timeout:.0f} s")
                    time.sleep(0.01)
            finally:
                end(old)
            self._forget_nannies()
            # Only now (the old workers would lose their server), anew if the kernel's
            # environment no longer suits it.
            method = dask.config.get(MULTIPROCESSING_METHOD)  # the user's, unless we fork
            if fork_server(self._fork, self._options, max(deadline - time.monotonic(), 1.0) / 2):
                method = "forkserver"
            with dask.config.set({MULTIPROCESSING_METHOD: method}):
                cluster.scale(n)
                while len(workers_of(client)) < n:
                    if self.died_starting() or time.monotonic() > deadline:
                        why = self.died_starting() or f"they did not join within {timeout:.0f} s"
                        raise ClusterError(f"{failed}: {why}")
                    time.sleep(0.01)

    def _forget_nannies(self) -> None:
        """Drop the closed nannies (each holds its monitor's history), keeping how their workers ended."""
        for nanny in self._nannies:
            self._exit_codes.update(nanny.exit_codes)
        self._nannies[:] = []  # in place: the cluster's nanny class appends to this list

    def died_starting(self) -> str | None:
        """How a worker of the current nannies ended while starting, if one did."""
        died = [code for nanny in self._nannies for code in nanny.exit_codes.values()]
        if not died:
            return None
        # Their output went to the kernel's own stderr, not to the notebook.
        return (f"a worker process {describe_exit(died[0])} while starting (its output is in the kernel's log, "
                "e.g. the terminal running Jupyter); fix the workers' environment and run the cell again")

    def exit_code(self, pid: int) -> int | None:
        """How a worker of its nannies' ended (None: running, or not one of theirs)."""
        for nanny in self._nannies:
            if pid in nanny.exit_codes:
                return nanny.exit_codes[pid]
        return self._exit_codes.get(pid)

    def close(self, old: list) -> None:
        """Close the cluster, its workers (`old`: their processes) and its directory."""
        try:
            if self.cluster is not None:
                self.cluster.close(timeout=15)
        finally:
            end(old)  # what we started, by pid: a worker that ignored the nanny is stopped here
            if self.scratch is not None:
                self.scratch.cleanup()
            if self._watch is not None:
                self._watch.close()
            self.cluster = self.scratch = self._watch = None


def end(found: list) -> None:
    """Wait (5 s at most) for processes the nannies were told to stop; kill what is left."""
    processes.end(processes.wait(found, 5), grace=0)


# `dask worker` imports a preload module in the nanny too (to check its arguments), which
# would import torch there as well (a second or two and 250 MB per job): given as code, the
# preload defines a hook that imports ours (and torch) in the worker only, before the first cell.
_SLURM_WORKER_PRELOAD = (f"def dask_setup(worker):\n    import {ENGINE}, {__name__} as cluster\n"
                         "    cluster.as_a_process_of_its_own()\n")


def start_on_slurm(n: int, timeout: float, launcher: SlurmLauncher,
                   cluster_options: dict) -> tuple[Any, Client]:
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
    inherited = dask.config.serialize(_nested(worker_settings()))
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
        worker_extra_args=["--preload", shlex.quote(_SLURM_WORKER_PRELOAD), "--memory-limit", "0"],
    )
    options.update(cluster_options)
    # No time limit asked: none in the script (the partition's), not dask-jobqueue's 30 minutes.
    with (dask.config.set({"jobqueue.slurm.walltime": None, **FEW_KEPT}),
          engine_errors("could not start the Dask scheduler for Slurm")):
        cluster = SLURMCluster(**options)
    launcher.find_jobs = lambda: [str(getattr(job, "job_id", "") or "") for job in list(cluster.workers.values())]
    with engine_errors(f"could not start {n} Dask workers on Slurm", cleanup=lambda: cluster.close(timeout=15)):
        cluster.scale(n)  # closing the cluster scancels the jobs
        with dask.config.set(FEW_KEPT):
            client = Client(cluster, set_as_default=False, timeout=timeout, direct_to_workers=True)

        def ready(seconds: float) -> bool:
            try:
                client.wait_for_workers(n, timeout=seconds)
                return True
            except TimeoutError:
                return False

        launcher.wait_for_workers(ready, n, timeout)
    return cluster, client


def connect(address: str, tls: dict | None) -> Client:
    """A client of the running scheduler at `address`; `tls`: the files of a client
    certificate (without them, Dask's own configuration: distributed.comm.tls.*)."""
    security = Security() if not tls else Security(
        tls_ca_file=tls["ca_file"], tls_client_cert=tls["cert"], tls_client_key=tls.get("key"),
        require_encryption=True)
    # Dask's timeout here is for reaching the scheduler (it retries a refused port until
    # then). A scheduler we connect to keeps the events of our topics as it is configured to
    # (distributed.admin.low-level-log-length, 1000 by default); our client keeps few messages.
    with dask.config.set(FEW_KEPT), engine_errors(f"could not connect to the Dask scheduler at {address}", detail=str):
        return Client(address, set_as_default=False, timeout=CONNECT_TIMEOUT_S, security=security)


def close_slurm(cluster: Any) -> None:
    """Close a cluster `start_on_slurm` started (which cancels its jobs)."""
    try:
        cluster.close(timeout=15)
    finally:
        # dask-jobqueue's copies of the worker certificate (the Slurm jobs read them).
        for key in ("ca_file", "cert", "key"):
            with contextlib.suppress(Exception):
                getattr(cluster, f"_job_{key}").close()
