"""The workers' processes, as one object: started (or attached to), tied to the kernel,
replaced and stopped.

`Cluster` knows the engine (a `Backend`), where the workers run (a launcher's placement)
and, for a cluster someone else started, where it is (`connection`). It knows nothing of
cells or of the process group: the session forms the group over the workers this object
gives it, and decides when to restart them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from . import forkserver, launchers, rendezvous, worker
from .backends import Backend, create_backend, descendants, end_processes, find_connection
from .display import StatusLine
from .errors import ClusterError, WorkerLost
from .settings import SessionSettings

log = logging.getLogger(__name__)


class Cluster:
    """The engine's workers this session uses."""

    def __init__(self, settings: SessionSettings, status_line: Callable[[bool], StatusLine]):
        self.settings = settings
        self.status_line = status_line  # a one-line status: (live where the frontend can update it)
        self.backend: Backend | None = None
        # Set by connect(): (engine name, where) of a running cluster to attach to instead of
        # starting one; restarts re-attach, forget() drops it.
        self.connection: tuple[str, dict] | None = None
        # Where the workers of the cluster we start run (launchers), and the name and options
        # it was made from: a restart (or a resubmitted job) uses the same.
        self.placement: launchers.Launcher | None = None
        self.launch: tuple[str, dict] | None = None
        self.helpers: set = set()  # processes the cluster's own processes started (psutil)
        self.warmed_up: str | None = None  # the engine whose warm_up ran (its fork server may be running)

    @property
    def running(self) -> bool:
        return self.backend is not None and self.backend.running

    @property
    def size(self) -> int:
        return self.backend.size if self.backend is not None and self.backend.running else 0

    def require_backend(self) -> Backend:
        if self.backend is None or not self.backend.running:
            raise ClusterError("no cluster is running; start one with %scale start --workers N")
        return self.backend

    # -- start ---------------------------------------------------------------------------
    def start(self, workers: int | None, launcher: str | None, options: dict) -> StatusLine:
        """Start the engine's workers (or attach to the connected cluster's); returns the
        status line that says so, for the session to say when they are ready."""
        settings = self.settings
        if self.warmed_up is not None and (self.connection is not None or self.warmed_up != settings.backend_name):
            forkserver.close_all()  # what warm_up prepared for another engine, or for a cluster we start
            self.warmed_up = None
        if self.connection is not None:
            name, where = self.connection
            backend = create_backend(name, parent=settings)
            line = self.status_line(True)  # "connecting ...", then "ready": one line where the frontend can update it
            line.say(f"jupyter_scale: connecting to the {name} cluster at {_where(where)} ...")
            backend.connect(workers, timeout=settings.start_timeout, **where)
            self.backend = backend
            return line
        n = workers or settings.default_workers
        if n < 1:
            raise ValueError(f"workers must be at least 1, not {n}")
        if launcher is not None or options:
            self.launch = (launcher or settings.launcher, options)
        name, launch_options = self.launch or (settings.launcher, {})
        placement = launchers.create_launcher(name, parent=settings, **launch_options)
        backend = create_backend(settings.backend_name, parent=settings)
        # Printed lines where the launcher prints its own progress between the two (a Slurm job pending).
        line = self.status_line(placement.name == "local")
        if placement.name == "local":
            line.say(f"jupyter_scale: starting a local {settings.backend_name} cluster of {n} workers on 127.0.0.1 ...")
        else:
            how = ("mpiexec" if placement.name == "mpi" else "a Slurm job" if settings.backend_name == "ipyparallel"
                   else "Slurm jobs")
            line.say(f"jupyter_scale: starting {n} {settings.backend_name} workers with {how} (the kernel's "
                     f"{backend.hub} at {placement.listen_address()}) ...")
        try:
            backend.check_launcher(placement)
            backend.start(n, timeout=settings.start_timeout, launcher=placement)
        except BaseException:
            _release(placement)
            raise
        self.placement = placement
        self.backend = backend
        return line

    def connect(self, address: str | None, workers: int | None, backend: str | None, **where: Any) -> StatusLine:
        """Attach to the cluster `address` (or `where`) names; see ScaleSession.connect."""
        self.connection = find_connection(address, backend, **where)
        try:
            return self.start(workers, None, {})
        except BaseException:
            self.connection = None
            raise

    def reset_attached(self) -> None:
        """Workers of a cluster we attach to start clean (what an earlier session left goes)."""
        backend = self.require_backend()
        if not backend.owns_cluster:
            backend.submit(worker.reset).wait(self.settings.call_timeout)

    def welcome(self, workers: tuple[dict, ...]) -> None:
        """After the group formed over new workers: tie ours to this kernel, and note what the
        cluster's own processes started (the engine stops those)."""
        backend = self.require_backend()
        if not backend.owns_cluster:
            return
        self._tie_to_kernel(backend, workers)
        if isinstance(self.placement, launchers.SlurmLauncher):
            nodes = sorted({w["hostname"] for w in workers})
            print(f"jupyter_scale: {self.placement.jobs_text()} on {', '.join(nodes)}; %scale stop cancels it",
                  flush=True)
        # What the cluster's processes started themselves (ipyparallel's schedulers, its
        # engines' nannies): the engine stops those (see stop).
        self.helpers = set(descendants(backend.local_processes()))

    def warm_up(self) -> None:
        """Let the engine prepare a faster first start (its fork server), unless this
        session's workers are not local or the engine cannot be loaded: nothing fails here."""
        settings = self.settings
        if self.connection is not None or (self.launch or (settings.launcher, {}))[0] != "local":
            return
        try:
            create_backend(settings.backend_name, parent=settings).warm_up()
            self.warmed_up = settings.backend_name
        except Exception:  # the start says what is wrong, with its context
            log.debug("warming up the %s engine failed", settings.backend_name, exc_info=True)

    def _tie_to_kernel(self, backend: Backend, workers: tuple[dict, ...]) -> None:
        """Workers we started end when this process dies, even by SIGKILL (no orphans): the
        kernel's watcher (see processes) ends them, with what they started."""
        here = rendezvous.node_identity()
        # Workers on other nodes (a Slurm job's) cannot be seen from here: their job ends them.
        backend.tie_to_kernel([w["pid"] for w in workers if w["node"] == here])

    # -- stop ----------------------------------------------------------------------------
    def dismiss_workers(self) -> None:
        """Before the workers stop: they leave the group, and what cells started on them ends."""
        self._dismiss(self.require_backend())

    def _dismiss(self, backend: Backend) -> None:
        # A cluster we only connected to lives on: free what this session left on its
        # workers (the namespaces, the process group), not just the group.
        farewell = worker.leave_group if backend.owns_cluster else worker.reset
        # What cells left running in a cluster we started (a server, a Popen, a helper
        # process) stops with it. Found while the workers live (an orphan cannot be traced
        # back to them), and stopped first: a worker's exit waits for its non-daemonic
        # children.
        forked = ([p for p in descendants(backend.local_processes()) if p not in self.helpers]
                  if backend.owns_cluster else [])
        try:
            backend.submit(farewell).wait(timeout=self.settings.stop_timeout)
        except (ClusterError, WorkerLost):  # a dead or stuck worker is stopped below anyway
            log.debug("leaving the workers failed during stop", exc_info=True)
        end_processes(forked, timeout=self.settings.stop_timeout)

    def shut_down(self) -> None:
        """Stop the workers (a connected cluster's: disconnect) and release where they ran."""
        backend, self.backend = self.backend, None
        placement, self.placement = self.placement, None
        try:
            if backend is not None and backend.running:
                self._dismiss(backend)
                backend.stop()
        finally:
            _release(placement)

    def replace_workers(self, n: int) -> None:
        """New workers for the running cluster, whose controller or scheduler the engine
        keeps (the caller dismissed the old ones). Raises ClusterError when it cannot."""
        self.require_backend().replace_workers(n, timeout=self.settings.start_timeout)

    def can_replace(self, launcher: str | None, options: dict) -> bool:
        """A restart that keeps the cluster and replaces only its workers."""
        return (self.running and self.connection is None and launcher is None and not options
                and self.require_backend().replaces_workers)

    def forget(self) -> None:
        """After stop: no connection, no launch options, no fork server."""
        forkserver.close_all()
        self.connection = None
        self.launch = None

    def ended(self) -> str | None:
        """Why the workers' allocation ended (a Slurm job cancelled), else None."""
        return self.placement.ended() if self.placement is not None else None

    def describe(self) -> dict:
        info: dict = {}
        if self.placement is not None:
            info.update(self.placement.describe())
        if self.running:
            info.update(self.require_backend().describe())
        return info


def _release(placement: launchers.Launcher | None) -> None:
    """After the engine stopped its workers: nothing of them left (a Slurm job out of the queue)."""
    if placement is not None:
        try:
            placement.after_stop()
        except ClusterError as exc:
            print(f"jupyter_scale: {exc}", file=sys.stderr, flush=True)


def _where(where: dict) -> str:
    return where.get("address") or ", ".join(f"{k} {v}" for k, v in where.items())

