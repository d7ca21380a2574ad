"""One Session per kernel: the cluster, the worker group, shipping state, runs.

Everything `%%distribute` and `%scale` do is a method here, so tests and UIs drive the
same code as the magics.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import zmq
from traitlets import Bool, Float, Integer, List, Unicode, default, observe
from traitlets.config import LoggingConfigurable

from . import (
    channel,
    export,
    forkserver,
    frameworks,
    jobfiles,
    launchers,
    metrics,
    pullback,
    rendezvous,
    sharedmem,
    shipping,
    sinks,
    statesync,
    worker,
)
from .backends import Backend, Job, create_backend, descendants, end_processes, find_connection
from .display import RunView, StatusLine
from .errors import CellTimeout, ClusterError, DistributeError, RemoteError, WorkerLost
from .protocol import CellReply, CellRequest, Layout
from .run import CellRun, RunRecord, interrupts_noted

log = logging.getLogger(__name__)
# How long the workers on this host get to answer on the kernel's channel once told of it
# (they connect in milliseconds); without every answer the engine carries the cells.
CHANNEL_HELLO_S = 5.0
class ScaleSession(LoggingConfigurable):
    """The kernel's handle on its cluster and the cells it distributes."""

    backend_name = Unicode(config=True,
                           help="Cluster engine for the embedded cluster: 'ipyparallel' or 'dask' (any "
                                "engine in the `jupyter_scale.backends` entry-point group). Default: "
                                "$JUPYTER_SCALE_BACKEND, else ipyparallel.")
    launcher = Unicode("local", config=True,
                       help="Where a started cluster's workers run: 'local' (this machine), 'slurm' (a Slurm job; "
                            "options in c.SlurmLauncher) or 'mpi' (one mpiexec, ipyparallel; c.MPILauncher).")
    default_workers = Integer(2, config=True,
                              help="Workers to start when %%distribute has no --workers and no cluster runs.")
    start_timeout = Float(120.0, config=True,
                          help="Seconds to wait for workers to start and to form the process group.")
    abort_grace = Float(1.0, config=True,
                        help="After one rank fails, seconds to let the others fail on their own "
                             "(a torn-down process group unblocks them) before interrupting them.")
    stop_deadline = Float(15.0, config=True,
                          help="Seconds interrupted ranks get to stop before the cell gives up on them.")
    allow_unauthenticated_servers = Bool(False, config=True,
                                         help="Let TensorFlow and PaddlePaddle cells form their own process groups: "
                                              "TensorFlow's server runs any graph anyone sends it, PaddlePaddle's "
                                              "store serves anyone; both listen on every interface. Only where "
                                              "every user of these machines and every host that reaches them "
                                              "is trusted (see README, Frameworks).")
    display = Unicode("auto", config=True,
                      help="How a running cell shows its progress: 'widget' (the live dashboard), "
                           "'text' (a line every few seconds), or 'auto': the widget in a kernel "
                           "that a Jupyter server or VS Code started, text elsewhere (nbval, terminals).")
    progress_interval = Float(2.0, config=True,
                              help="Seconds between the plain-text progress lines of a running cell.")
    heartbeat_interval = Float(5.0, config=True,
                               help="Seconds between the heartbeats each rank sends while a cell runs.")
    silence_limit = Float(20.0, config=True,
                          help="Seconds a running rank may go without a word (it sends a heartbeat every "
                               "heartbeat_interval s) before the cell counts its worker as lost: its host left "
                               "the network, or the process hangs holding the GIL. 0 turns it off.")
    hang_warning = Float(60.0, config=True,
                         help="Without --timeout there is no time limit; instead, when some ranks have "
                              "waited this many seconds in a collective that others are not in, say which "
                              "rank they wait for (again every as many seconds). 0 turns it off.")
    average_during_backward = Bool(False, config=True,
                                   help="Automatic mode: once every rank has called backward() once per step of "
                                        "the cell's optimizer, average the gradients in buckets during backward(), "
                                        "overlapping communication with it, with DDP's rules: every rank must then "
                                        "call backward() alike, and what the cell does to the gradients after "
                                        "backward() acts on averaged ones. Faster where communication matters (a "
                                        "model of tens of MB or more). False averages them at each step.")
    log_to = List(Unicode(), config=True,
                  help="Where every %%distribute cell's report() points also go, as --log-to: "
                       "'tensorboard[:DIR]' (default DIR: runs), 'mlflow[:TRACKING_URI]'. A cell's own "
                       "--log-to replaces these.")
    log_as = Unicode("ranks", config=True,
                     help="What --log-to writes: 'ranks' (each rank's points) or 'mean' (the mean over the "
                          "ranks at each step)")
    shared_memory_enabled = Bool(True, config=True,
                                 help="When every worker runs on this machine and reads the kernel's shared "
                                      "memory (the embedded cluster), send values' pieces of 1 MB or more through "
                                      "it rather than in the engine's messages (several times faster).")
    shared_memory_keep = Integer(1 << 30, config=True,
                                 help="Bytes of shared memory the kernel (and rank 0, for the pull-back) may "
                                      "keep between cells, so that the next cell writes into memory already "
                                      "handed out (several times faster than fresh memory); a larger cell's "
                                      "file is emptied after the cell.")
    pull_chunk_bytes = Integer(64 << 20, config=True,
                               help="A sharded model comes back to the notebook in chunks of whole tensors of "
                                    "at most this many bytes (one tensor when it is larger), so that no process "
                                    "holds a second whole copy of it.")
    bring_back_limit = Integer(256 << 20, config=True,
                               help="A torch cell's effects come back into the notebook from rank 0, as a local run "
                                    "leaves them: the values it changes in place and the names it binds. Values it "
                                    "binds that are larger than this many bytes in all (a dataset loaded in the "
                                    "cell) stay on the workers, and the cell says so; --pull NAME brings one back. "
                                    "Models always come back.")
    rendezvous_address = Unicode("", config=True,
                                 help="For a cluster across hosts: where the ranks meet, an address of rank 0's "
                                      "host or a network (10.1.0.0/16) to take rank 0's address in. Default: rank "
                                      "0's address on the network of the other hosts' (else the one it reaches "
                                      "the controller or scheduler from). Each host's gloo then uses its "
                                      "interface toward that address (unless GLOO_SOCKET_IFNAME is set).")
    direct_channel = Bool(True, config=True,
                          help="When every worker runs on this machine, send each cell to the workers over "
                               "sockets of the kernel's own (in a directory only this user can open) "
                               "instead of through the engine: a cell's round trip in well under a "
                               "millisecond rather than several. The engine still starts, signals and "
                               "stops the workers.")
    poll_interval = Float(0.1, config=True,
                          help="Longest wait between checks for deadlines while a cell runs "
                               "(results and output wake the kernel at once).")

    @default("backend_name")
    def _default_backend_name(self) -> str:
        return os.environ.get("JUPYTER_SCALE_BACKEND", "").strip() or "ipyparallel"

    def __init__(self, namespace: dict | None = None, shell: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.shell = shell
        self.namespace = namespace if namespace is not None else (shell.user_ns if shell else {})
        self.backend: Backend | None = None
        self.workers: list[dict] = []  # describe() of each rank
        self.group: dict = {}  # backend, master address/port of the current process group
        self.runs: list[RunRecord] = []
        self.shipper = shipping.Shipper(self.namespace, self._shippable)  # what the workers hold of the notebook's values
        self._register_back: dict | None = None  # rank 0's tokens of the last values it sent back (see worker)
        self.shared_memory = False  # large frames go through shared memory (see _form_group)
        self._frames_out: sharedmem.SharedFrames | None = None  # the kernel's, for large frames
        self._store_dir: str | None = None  # the one-host group's FileStore lives here
        self._helpers: set = set()  # processes the cluster's own processes started (psutil)
        self._group_ready = False
        self._network_noted = False  # said once per cluster that gloo across hosts is unencrypted
        self._resync = False  # a cell failed: the next automatic cell equalizes the workers' models
        self._lost_workers: list[int] = []  # ranks whose process died: restart before reuse
        # Frameworks whose group the workers formed (see frameworks), and those whose group
        # cannot go on (a failed cell, or torch's group formed anew): their next cell
        # restarts the workers, as neither TensorFlow nor Paddle forms a group twice.
        self._framework_groups: set[str] = set()
        self._spent_frameworks: set[str] = set()
        # Names a cell of another framework than torch bound on the workers -> that framework:
        # a later cell that reads them (and imports nothing) is that framework's too.
        self._bound_by_framework: dict[str, str] = {}
        self._cell: CellRun | None = None  # the running (or last) cell's wait
        self._channel: channel.CellChannel | None = None  # the cells' calls, when it is open
        self.events: metrics.EventQueue | None = None  # workers -> kernel, one per session
        # Set by connect(): (backend name, where) of a running cluster to attach to instead
        # of starting one; restarts re-attach, stop() forgets it.
        self.connection: tuple[str, dict] | None = None
        # Where the workers of the cluster we start run (launchers), and the name and options
        # it was made from: a restart (or a resubmitted job) uses the same.
        self.placement: launchers.Launcher | None = None
        self._launch: tuple[str, dict] | None = None
        # Objects told of runs and cluster changes (the JupyterLab sidebar's channel): any of
        # run_started(record, total_steps), event(event), tick(), run_finished(record),
        # cluster_changed().
        self.observers: list[Any] = []
        # The cells run since record_cells (In [n] where the shell keeps them, else None):
        # what export slices. nbval and other clients run cells that IPython's history
        # does not keep.
        self.cells: list[tuple[int | None, str]] = []
        self._history_before: int | None = None
        self._warmed_up: str | None = None  # the engine whose warm_up ran (its worker template may be running)

    def record_cells(self) -> None:
        """From now on, note every cell the shell runs (its pre_run_cell event)."""
        if self.shell is None or self._history_before is not None:
            return
        self._history_before = len(self.shell.history_manager.input_hist_raw)
        self.shell.events.register("pre_run_cell", self._note_cell)

    def _note_cell(self, info: Any) -> None:
        # Before the shell stores the cell: it goes at the history's end, if it is kept.
        number = len(self.shell.history_manager.input_hist_raw) if info.store_history else None
        self.cells.append((number, info.raw_cell))

    def _notify(self, what: str, *args: Any) -> None:
        for observer in list(self.observers):
            handler = getattr(observer, what, None)
            if handler is None:
                continue
            try:
                handler(*args)
            except Exception:  # a display must never break a run
                log.warning("observer %r failed in %s", observer, what, exc_info=True)

    # ------------------------------------------------------------------------------
    # Cluster
    # ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.backend is not None and self.backend.running

    @property
    def beats(self) -> dict[int, dict]:
        """Each rank's latest heartbeat in the running (or last) cell: where it is, e.g. in which collective."""
        return self._cell.beats if self._cell is not None else {}

    @property
    def size(self) -> int:
        return self.backend.size if self.running else 0

    def start(self, workers: int | None = None, launcher: str | None = None, **launcher_options: Any) -> None:
        """Start the embedded cluster (or attach to the connected one) and form the group.

        `launcher`: where the workers run ('local', 'slurm', 'mpi'; default: the `launcher`
        setting, or what the cluster being restarted used), with its options (partition,
        time_limit, account, qos, cpus_per_worker, gpus_per_worker, memory: see launchers)."""
        if self.running:
            raise ClusterError(f"a cluster of {self.size} workers is already running; "
                               "use %scale restart --workers N to change it")
        started = time.monotonic()
        if self._warmed_up is not None and (self.connection is not None or self._warmed_up != self.backend_name):
            forkserver.close_all()  # what warm_up prepared for another engine, or for a cluster we start
            self._warmed_up = None
        if self.connection is not None:
            name, where = self.connection
            backend = create_backend(name, parent=self)
            line = StatusLine(self)  # "connecting ...", then "ready": one line where the frontend can update it
            line.say(f"jupyter_scale: connecting to the {name} cluster at {_where(where)} ...")
            backend.connect(workers, timeout=self.start_timeout, **where)
        else:
            n = workers or self.default_workers
            if n < 1:
                raise ValueError(f"workers must be at least 1, not {n}")
            if launcher is not None or launcher_options:
                self._launch = (launcher or self.launcher, launcher_options)
            name, options = self._launch or (self.launcher, {})
            placement = launchers.create_launcher(name, parent=self, **options)
            backend = create_backend(self.backend_name, parent=self)
            # Printed lines where the launcher prints its own progress between the two (a Slurm job pending).
            line = StatusLine(self, live=placement.name == "local")
            if placement.name == "local":
                line.say(f"jupyter_scale: starting a local {self.backend_name} cluster of {n} workers on 127.0.0.1 ...")
            else:
                how = ("mpiexec" if placement.name == "mpi" else "a Slurm job" if self.backend_name == "ipyparallel"
                       else "Slurm jobs")
                line.say(f"jupyter_scale: starting {n} {self.backend_name} workers with {how} (the kernel's "
                         f"{backend.hub} at {placement.listen_address()}) ...")
            try:
                backend.start(n, timeout=self.start_timeout, launcher=placement)
            except BaseException:
                self._release(placement)
                raise
            self.placement = placement
        self.backend = backend
        self._welcome_workers(started, line)

    def _welcome_workers(self, started: float, line: StatusLine | None = None) -> None:
        """New workers (a new cluster's, or replacements): the group, the tie to this kernel."""
        backend = self._require_backend()
        try:
            if not backend.owns_cluster:  # workers of a cluster we attach to start clean
                backend.submit(worker.reset).wait(self.start_timeout)
            self._form_group()
            if backend.owns_cluster:
                self._tie_workers_to_kernel(backend)
                if isinstance(self.placement, launchers.SlurmLauncher):
                    nodes = sorted({w["hostname"] for w in self.workers})
                    print(f"jupyter_scale: {self.placement.jobs_text()} on {', '.join(nodes)}; %scale stop cancels "
                          "it", flush=True)
                # What the cluster's processes started themselves (ipyparallel's schedulers,
                # its engines' nannies): the engine stops those (see _stop_backend).
                self._helpers = set(descendants(backend.local_processes()))
        except BaseException:
            self._shutdown()
            raise
        (line or StatusLine(self)).say(f"jupyter_scale: {backend.size} workers ready ({self.group['backend']}) in "
                                       f"{time.monotonic() - started:.1f} s")
        self._notify("cluster_changed")

    def warm_up(self) -> None:
        """Let the engine prepare a faster first start (its worker template), unless this
        session's workers are not local or the engine cannot be loaded: nothing fails here."""
        if self.connection is not None or (self._launch or (self.launcher, {}))[0] != "local":
            return
        try:
            create_backend(self.backend_name, parent=self).warm_up()
            self._warmed_up = self.backend_name
        except Exception:  # the start says what is wrong, with its context
            log.debug("warming up the %s engine failed", self.backend_name, exc_info=True)

    def _tie_workers_to_kernel(self, backend: Backend) -> None:
        """Workers we started exit when this process dies, even by SIGKILL (no orphans)."""
        import psutil

        me = psutil.Process()
        here = rendezvous.node_identity()
        # Workers on other nodes (a Slurm job's) cannot see this process: their job ends them.
        ranks = [r for r, w in enumerate(self.workers) if w["node"] == here]
        if not ranks:
            return
        pids = {w["pid"] for w in self.workers}  # described by _form_group
        helpers = []
        for process in backend.local_processes():
            try:
                if process.pid not in pids:
                    helpers.append((process.pid, process.create_time()))
            except psutil.Error:  # already gone
                continue
        backend.submit(worker.watch_parent, me.pid, me.create_time(), helpers, ranks=ranks).wait(self.start_timeout)

    def connect(self, address: str | None = None, *, workers: int | None = None, backend: str | None = None,
                profile: str | None = None, cluster_id: str | None = None, url_file: str | None = None,
                tls: dict | None = None) -> None:
        """Attach to a cluster someone else started, instead of starting one.

        The engine is the one whose cluster `address` names (see backends.find_connection;
        `backend` picks one): a Dask scheduler (tcp://host:port, from dask-jobqueue,
        dask-kubernetes, `dask scheduler`) or an ipyparallel `ipcontroller-*-client.json`
        file; `profile` / `cluster_id` / `url_file` find an ipyparallel controller (ipcluster)
        too. `workers`: use that many (waiting for them to join), else every worker the
        cluster has. `stop()` disconnects and leaves the cluster running. `tls` (Dask):
        {"ca_file", "cert", "key"} PEM files for a tls:// scheduler; without it Dask's own
        configuration (distributed.comm.tls) applies. Raises ValueError for what names no
        cluster, before anything starts.
        """
        if self.running:
            raise ClusterError(f"a cluster of {self.size} workers is already running; %scale stop it first")
        name, where = find_connection(address, backend, profile=profile, cluster_id=cluster_id, url_file=url_file,
                                      tls=tls)
        self.connection = (name, where)
        self._network_noted = False
        try:
            self.start(workers)
        except BaseException:
            self.connection = None
            raise
        self.backend_name = name

    def stop(self) -> None:
        """Stop the embedded cluster (every process it started), or disconnect from a connected one;
        the worker template goes too (restarts keep it)."""
        try:
            self._shutdown()
        finally:
            forkserver.close_all()
        self.connection = None
        self._launch = None
        self._notify("cluster_changed")

    def _shutdown(self) -> None:
        backend, self.backend = self.backend, None
        self._forget_workers()
        if self.events is not None:  # frees its port; the next run binds a new one
            self.events.close()
            self.events = None
        placement, self.placement = self.placement, None
        try:
            if backend is not None and backend.running:
                self._stop_backend(backend)
        finally:
            self._release(placement)
            self._remove_store_dir()
            if self._frames_out is not None:  # its memory goes with it
                self._frames_out.close()
                self._frames_out = None

    @staticmethod
    def _release(placement: launchers.Launcher | None) -> None:
        """After the engine stopped its workers: nothing of them left (a Slurm job out of the queue)."""
        if placement is not None:
            try:
                placement.after_stop()
            except ClusterError as exc:
                print(f"jupyter_scale: {exc}", file=sys.stderr, flush=True)

    def _stop_backend(self, backend: Backend) -> None:
        self._dismiss_workers(backend)
        backend.stop()

    def _dismiss_workers(self, backend: Backend) -> None:
        """Before the workers stop: they leave the group, and what cells started on them ends."""
        # A cluster we only connected to lives on: free what this session left on its
        # workers (the namespaces, the process group), not just the group.
        farewell = worker.leave_group if backend.owns_cluster else worker.reset
        # What cells left running in a cluster we started (a server, a Popen, a helper
        # process) stops with it. Found while the workers live (an orphan cannot be traced
        # back to them), and stopped first: a worker's exit waits for its non-daemonic
        # children (20 s of %scale stop on ipyparallel, and the child stayed).
        forked = ([p for p in descendants(backend.local_processes()) if p not in self._helpers]
                  if backend.owns_cluster else [])
        try:
            backend.submit(farewell).wait(timeout=5)
        except (ClusterError, WorkerLost):  # a dead or stuck worker is stopped below anyway
            log.debug("leaving the workers failed during stop", exc_info=True)
        end_processes(forked, timeout=5)

    def restart(self, workers: int | None = None, launcher: str | None = None, **launcher_options: Any) -> None:
        """Fresh workers (a connected cluster: attach again, to the workers it has now); a
        cluster of a launcher's: submitted again, with its options unless new ones are given."""
        n = workers or (None if self.connection else self.size or self.default_workers)
        if (self.running and self.connection is None and launcher is None and not launcher_options
                and self.backend.replaces_workers):
            self._replace_workers(n or self.default_workers)
            return
        self._shutdown()
        self.start(n, launcher, **launcher_options)

    def _replace_workers(self, n: int) -> None:
        """New workers for the running cluster, whose controller or scheduler the engine keeps."""
        backend = self._require_backend()
        started = time.monotonic()
        line = StatusLine(self)
        line.say(f"jupyter_scale: starting {n} new workers in the running {self.backend_name} cluster ...")
        self._dismiss_workers(backend)
        self._forget_workers()
        self._remove_store_dir()
        try:
            backend.replace_workers(n, timeout=self.start_timeout)
        except ClusterError as exc:  # the whole cluster anew, once
            print(f"jupyter_scale: {exc}; restarting the whole cluster", file=sys.stderr, flush=True)
            self._shutdown()
            self.start(n)
            return
        except BaseException:
            self._shutdown()
            raise
        self._welcome_workers(started, line)

    def launch_options(self) -> dict:
        """The launcher options the running (or last) cluster was started with."""
        return dict(self._launch[1]) if self._launch else {}

    def ensure(self, workers: int | None = None, launcher: str | None = None,
               launcher_options: dict | None = None) -> None:
        """A running cluster of `workers` (default: the current size, else the default)."""
        if self.running and not self._lost_workers:
            self._lost_workers = self.backend.dead_ranks()  # died between cells
        if not self.running:
            self.start(workers, launcher, **(launcher_options or {}))
        elif self._lost_workers:
            # A connected cluster: the workers it has now (the lost ones may never come back).
            n = workers or (None if self.connection else self.size)
            ended = self.placement.ended() if self.placement is not None else None
            if ended and not getattr(self.placement, "resubmit", True):
                raise ClusterError(f"{ended}; %scale restart submits a new job (c.SlurmLauncher.resubmit "
                                   "= True does it at the next cell)")
            how = ("attaching again to the cluster's workers" if self.connection
                   else f"submitting a new Slurm job of {n} workers" if ended
                   else f"restarting the cluster with {n} workers")
            print(f"jupyter_scale: the worker of rank(s) {self._lost_workers} is gone; {how} "
                  "(worker variables are lost)", flush=True)
            self.restart(n)
        elif workers and workers != self.size:
            how = "attaches again to the cluster" if self.connection else "restarts the workers"
            print(f"jupyter_scale: resizing from {self.size} to {workers} workers "
                  f"({how}: their variables are lost)", flush=True)
            self.restart(workers)
        elif not self._group_ready:
            self._form_group()

    def status(self) -> dict:
        info = {"running": self.running, "backend": self.backend_name, "workers": self.size,
                "connected": self.connection is not None}
        if self.placement is not None:
            info.update(self.placement.describe())
        if self.running:
            info.update(self.backend.describe())
            info["group"] = dict(self.group, ready=self._group_ready)
            if self._group_ready:
                info["cells_through"] = ("the kernel's direct channel" if self._channel is not None
                                         else f"the {self.backend_name} engine")
            info["lost"] = list(self._lost_workers)
            info["ranks"] = [dict(rank=r, **w) for r, w in enumerate(self.workers)]
        if self.runs:
            last = self.runs[-1]
            info["last_run"] = {"index": last.index, "execution_count": last.execution_count,
                                "status": last.status, "elapsed": round(last.elapsed, 3)}
        return info

    def _forget_workers(self) -> None:
        self._close_channel()
        self._lost_workers = []
        self._framework_groups, self._spent_frameworks = set(), set()
        self._bound_by_framework = {}
        self.workers = []
        self.group = {}
        self.shared_memory = False
        self.shipper = shipping.Shipper(self.namespace, self._shippable)
        self._register_back = None
        self._group_ready = False
        self._resync = False

    def _form_group(self) -> None:
        """Lay out ranks (host, local rank, device) and initialize torch.distributed."""
        backend = self._require_backend()
        self._spent_frameworks |= self._framework_groups  # their sockets go with torch's group
        n = backend.size
        timeout = self.start_timeout
        # Workers on this machine get large frames through shared memory instead of the
        # engine's messages (see sharedmem), when they read ours and we read theirs.
        probe = None
        if self.shared_memory_enabled and sharedmem.available():
            if self._frames_out is None:
                self._frames_out = sharedmem.SharedFrames(self.shared_memory_keep)
            probe = sharedmem.probe(self._frames_out)
        # The kernel's FileStore directory, made before asking: a worker that sees it shares
        # the kernel's file system (the one-host group's store lives there).
        self._remove_store_dir()  # the previous group's
        store_dir = rendezvous.new_store_dir()
        toward = backend.contact_address() or rendezvous.LOOPBACK
        try:
            self.workers = backend.submit_each(worker.describe, [(probe, toward, store_dir)] * n).wait(timeout)
        except BaseException:
            shutil.rmtree(store_dir, ignore_errors=True)
            raise
        # Each host's ranks next to each other, hosts in the order their first rank came: ranks
        # numbered as torchrun numbers them (node by node), and a ring collective crosses
        # between hosts once per host, not at every hop.
        given = [w.get("launcher_rank") for w in self.workers]
        if sorted(g[0] for g in given if g) == list(range(n)) and all(g and g[1] == n for g in given):
            # mpiexec or srun numbered them: rank i is MPI rank i (mpi4py in the cell agrees).
            order = sorted(range(n), key=lambda r: given[r][0])
        else:
            first_seen = {node: i for i, node in enumerate(dict.fromkeys(w["node"] for w in self.workers))}
            order = sorted(range(n), key=lambda r: first_seen[self.workers[r]["node"]])  # stable within a host
        if order != list(range(n)):
            backend.order_ranks(order)
            self.workers = [self.workers[r] for r in order]
        node_rank = {node: i for i, node in enumerate(dict.fromkeys(w["node"] for w in self.workers))}
        probes_back = [w.pop("shared_memory") for w in self.workers]
        self.shared_memory = all(p is not None and sharedmem.check_probe(*p) for p in probes_back)
        here = rendezvous.node_identity()
        all_local = all(w["node"] == here and w["sees_store_dir"] for w in self.workers)
        dist_backend = rendezvous.select_backend([w["cuda_count"] for w in self.workers])
        if all_local:
            # One host (the embedded cluster): loopback only, and a store that only this
            # user can open (see rendezvous); MASTER_PORT is merely free for the cell's use.
            master_addr = rendezvous.LOOPBACK
            self._store_dir = store_dir
            store = {"file": os.path.join(self._store_dir, "store")}
            port = rendezvous.free_port(master_addr)
        else:
            # Several: an address of rank 0's that every rank reaches, on a network the user
            # trusts (see README, "Security"). Only rank 0 listens; it binds port 0.
            shutil.rmtree(store_dir, ignore_errors=True)
            try:
                master_addr = rendezvous.choose_rendezvous_address(self.workers, self.rendezvous_address)
            except ValueError as exc:
                raise ClusterError(f"cannot form the process group: {exc}") from None
            opened = backend.submit_each(
                worker.open_rendezvous, [(r == 0, master_addr, n, timeout) for r in range(n)]
            ).wait(timeout)[0]
            if isinstance(opened, str):  # rank 0 could not listen there
                raise ClusterError(f"cannot form the process group: rank 0 (host {self.workers[0]['hostname']}) "
                                   f"cannot listen on {master_addr}: {opened}; choose with %scale connect --rendezvous")
            port = opened
            # Handed to the ranks over the engine's authenticated channel only.
            store = {"addr": master_addr, "port": port, "prefix": f"jupyter_scale/{secrets.token_hex(16)}/"}
        per_node = Counter(w["node"] for w in self.workers)
        seen: Counter = Counter()
        layouts: list[Layout] = []
        for rank, w in enumerate(self.workers):
            layouts.append(Layout(
                rank=rank, world_size=n, local_rank=seen[w["node"]], local_world_size=per_node[w["node"]],
                group_rank=node_rank[w["node"]], nodes=len(node_rank), master_addr=master_addr, master_port=port,
                store=store, backend=dist_backend, cuda_count=w["cuda_count"], timeout=timeout,
            ))
            seen[w["node"]] += 1
        joined = backend.submit_each(worker.join_group, [(layout,) for layout in layouts]).wait(timeout)
        failed = [(rank, j["error"]) for rank, j in enumerate(joined) if "error" in j]
        if failed:
            rank, error = failed[0]
            hint = ("" if all_local else ". Every host must reach rank 0 there; pick the address with "
                    "%scale connect --rendezvous (see README, Several hosts)")
            raise ClusterError(f"rank {rank} (host {self.workers[rank]['hostname']}) could not join the process "
                               f"group at {master_addr}:{port}: {error}{hint}")
        for w, j in zip(self.workers, joined):
            w["device"] = j["device"]
        self.group = {"backend": dist_backend, "master_addr": master_addr, "master_port": port, "store": store}
        self._open_channel(backend, all_local)
        self._group_ready = True
        if len(node_rank) > 1 and not self._network_noted:
            self._network_noted = True
            print(f"jupyter_scale: the ranks span {len(node_rank)} hosts and exchange tensors (gloo) and the group's "
                  f"store ({master_addr}) unencrypted and unauthenticated: keep these hosts on a network "
                  "you trust (see README, Security)", file=sys.stderr, flush=True)

    def _open_channel(self, backend: Backend, all_local: bool) -> None:
        """The cells' calls over the kernel's own channel, when every worker runs on this host
        and the engine can serve it (see channel); else through the engine."""
        self._close_channel()
        serve = backend.channel_server() if all_local and self.direct_channel else None
        if serve is None:
            return
        try:
            opened = channel.CellChannel(backend.size, backend.gone_ranks, self._event_stream())
        except (OSError, zmq.ZMQError) as exc:
            log.info("no direct channel (%s); cells go through %s", exc, self.backend_name)
            return
        job = backend.submit_each(serve, opened.worker_arguments())
        try:
            job.wait(self.start_timeout)
            ready = opened.await_workers(CHANNEL_HELLO_S)
        except (ClusterError, WorkerLost) as exc:  # a worker that cannot: the engine carries the cells
            log.info("the workers' direct channel could not open (%s); cells go through %s", exc, self.backend_name)
            ready = False
        finally:
            job.release()
        if ready:
            self._channel = opened
            return
        opened.close()
        with contextlib.suppress(ClusterError, WorkerLost):  # the ends that opened stop reconnecting
            backend.submit(channel.close_worker_end).wait(self.start_timeout)

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _calls(self) -> Backend | channel.CellChannel:
        """What carries a cell's calls: the direct channel when it is open, else the engine."""
        return self._channel if self._channel is not None else self._require_backend()

    def _remove_store_dir(self) -> None:
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    def _require_backend(self) -> Backend:
        if not self.running:
            raise ClusterError("no cluster is running; start one with %scale start --workers N")
        return self.backend

    # ------------------------------------------------------------------------------
    # Running cells
    # ------------------------------------------------------------------------------
    def run(self, code: str, *, workers: int | None = None, pull: Iterable[str] = (),
            timeout: float | None = None, manual: bool = False, steps: int | None = None,
            launcher: str | None = None, launcher_options: dict | None = None, shard: bool | dict = False,
            keep_sharded: bool = False, framework: str | None = None, log_to: Sequence[str] | None = None,
            log_as: str | None = None) -> RunRecord:
        """Run `code` on every worker, as %%distribute does. Raises RemoteError on failure.

        Automatic mode (the default) seeds every rank alike, shards the cell's DataLoaders
        and averages gradients at every optimizer step; `manual=True` does none of it.
        `launcher` and its options: where the workers run when no cluster runs (see start).
        `shard=True` (automatic mode): the models the cell trains are sharded across the ranks
        with FSDP2 (`jupyter_scale.shard_model`): the notebook's before the cell runs, the
        cell's own when an optimizer is built over their parameters; a dict gives
        shard_model's options (`mixed_precision`, `offload`, `blocks`, `init`). `keep_sharded`:
        sharded models stay on the workers, not copied back into the notebook's.
        `framework`: whose process group the cell uses, torch (the default), tensorflow,
        paddle; by default the one the cell uses (see frameworks.choose). Another than
        torch's turns automatic mode off: the cell uses that framework's own API.
        `log_to`, `log_as`: where report()'s points also go (see sinks; default: the
        session's `log_to` and `log_as`).
        """
        if shard and manual:
            raise ValueError("shard is automatic mode's; with manual, call jupyter_scale.shard_model in the cell")
        number = self._cell_number(code)
        code = self._transform(code)
        pull = list(pull)
        free = self._free_names(code)
        stores, deletes = shipping.stored_names(code)
        names = self._names_to_ship(free)
        held = {self._bound_by_framework[n] for n in free if n in self._bound_by_framework and n not in self.namespace}
        try:
            framework = frameworks.choose(code, self.namespace, names, framework, held)
        except frameworks.FrameworkError as exc:
            raise DistributeError(str(exc)) from None
        if framework != "torch":
            self._check_framework(framework, shard)
            manual = True
        if framework == "paddle" and "paddle" in sys.modules:  # the notebook's Layers travel as Layers
            from .frameworks import paddle

            paddle.pickle_parameters()
        # Pickle before any worker runs: an unpicklable value fails here, naming it. The
        # plan adds the names that the notebook functions the cell calls read.
        plan = self.shipper.plan({n: self.namespace[n] for n in names})
        names = list(plan.values)
        if self.running and not self._lost_workers:
            # torch's group formed anew (a cell destroyed it) cuts the framework's connections too
            if framework in self._spent_frameworks or framework in self._framework_groups and not self._group_ready:
                why = f"the workers' {framework} group cannot go on after the failed cell (it forms once per process)"
            elif framework == "paddle" and "tensorflow" in self._framework_groups:
                why = "PaddlePaddle crashes a process that has imported TensorFlow"
            else:
                why = ""
            if why:
                print(f"jupyter_scale: {why}; restarting the workers (their variables are lost)", file=sys.stderr,
                      flush=True)
                self.restart(workers)
        started = time.time()
        # Opened before a worker starts: a target that cannot work fails the cell first.
        run_sinks = self._sinks(self.log_to if log_to is None else list(log_to), log_as or self.log_as,
                                number, started, code)
        self.ensure(workers, launcher, launcher_options)
        record = RunRecord(index=len(self.runs) + 1, workers=self.size, execution_count=number, seed=_draw_seed(),
                           framework=framework, started=started)
        self.runs.append(record)
        shipment = self.shipper.prepare(plan)
        record.shipped, record.skipped = dict(shipment.nbytes), list(shipment.skipped)
        if shipment.replaced:
            print(f"jupyter_scale: the notebook's {pullback.listed(shipment.replaced)} replace"
                  f"{'s' if len(shipment.replaced) == 1 else ''} the workers' own (set by an earlier "
                  "%%distribute cell; the notebook changed it since)", file=sys.stderr, flush=True)
        # The notebook's models the cell uses, also through the notebook functions it calls.
        modules = [n for n in names if frameworks.is_model(self.namespace[n])]
        events = self._event_stream()
        run_id = events.begin(record.workers)  # from here on, late points of earlier runs are dropped
        request: CellRequest = {
            "names": shipment.names,
            "updates": shipment.updates,
            "forget": shipment.forget,
            "deleted": shipment.deleted,
            "stores": stores,
            "deletes": deletes,
            "code": code,
            "filename": f"<distribute-cell-{record.index}>",
            "modules": modules,
            # What the notebook holds of them: rank 0 sends back only the tensors that differ.
            "digests": {n: shipping.state_digests(self.namespace[n], plan.tensors) for n in modules
                        if isinstance(self.namespace[n], torch.nn.Module)},
            "pull": pull,
            # Rank 0 sends back what the cell changed of these and what it bound (torch cells:
            # see statesync), the values it bound up to this size in all.
            "watch": names if framework == "torch" else None,
            "back_base": self.shipper.next_back_token,
            # The other ranks give their tensors the tokens rank 0 gave its own last cell.
            "register_back": self._register_back,
            "bring_back_bytes": self.bring_back_limit,
            "keep_sharded": keep_sharded,
            "auto": not manual,
            "shard": None if shard is False or shard is None else dict(shard) if isinstance(shard, dict) else {},
            "events": self.events_address,
            # Signs the workers' batches: the event port is open to every local user, the
            # engine's channel that carries this request is not.
            "events_key": events.key,
            "run": run_id,
            "heartbeat": self.heartbeat_interval,
            "resync": self._resync,
            # Rank 0 sends the pull-back through a file of its own there.
            "pull_through": self.shared_memory_keep if self.shared_memory else None,
            "seed": record.seed,
            "framework": framework,
            "overlap": self.average_during_backward,
        }
        if framework != "torch":
            self._framework_groups.add(framework)
        view = RunView(self, record, steps)
        if run_sinks is not None:
            self.observers.append(run_sinks)
        self._notify("run_started", record, steps)
        try:
            with interrupts_noted() as interrupts:
                frames, request["shared_frames"] = self._pack_frames(shipment)
                try:
                    job = self._calls().submit(worker.run_cell, request, *frames)
                except BaseException as exc:  # nothing runs: the run ends here, as after a broken wait
                    self._end_broken_run(view, record, exc)
                    raise
                self._cell = cell = CellRun(self, job, record, view, timeout, interrupts)
                answered = False
                try:
                    headers, frames_back, error, lost = cell.wait()
                    answered = True
                except BaseException as exc:
                    # Whatever ended the wait early (an engine's error, a bug): no rank may run
                    # on unseen, reading frames the next cell writes.
                    answered = self._stop_abandoned(job)
                    self._end_broken_run(view, record, exc)
                    raise
                finally:
                    job.release()
                    cell.forget_answers()  # the session keeps the run's heartbeats, not what it sent back
                    self._done_with_frames(answered)
                # Pull-back and buffer sync are not cut half-way by an interrupt either.
                rank0 = headers[0].get("shared_frames") if 0 in headers else None
                with sharedmem.unpacked(frames_back.get(0, ()), rank0) as frames_back[0]:
                    self._end_run(cell, headers, frames_back, error, lost, shipment, plan, manual)
        finally:
            if run_sinks is not None:  # closed by run_finished, or here where the run broke before it
                run_sinks.close(record.status if record.status != "running" else "failed")
                self.observers.remove(run_sinks)
        if interrupts.count > interrupts.handled:
            raise KeyboardInterrupt("interrupted as the cell ended: it had finished on every rank, "
                                    "and the notebook holds its results")
        return record

    def _check_framework(self, framework: str, shard: bool | dict) -> None:
        if shard:
            raise DistributeError(f"--shard is for torch cells (FSDP2), not {framework} ones")
        if self.connection is not None:
            raise DistributeError(f"{framework} cells run on workers this session starts: a connected cluster's "
                                  "processes outlive the session, and a framework's group formed in them with them")
        if not self.allow_unauthenticated_servers:
            what = {"tensorflow": "TensorFlow's server (TF_CONFIG) runs any graph anyone sends it, and listens on "
                                  "every interface",
                    "paddle": "PaddlePaddle's store (PADDLE_MASTER) serves anyone, who can then stall or break "
                              "the group, and listens on every interface",
                    "horovod": "Horovod's gloo rendezvous and connections take anyone, who can then join or break "
                               "the group"}[framework]
            raise DistributeError(
                f"{what}: on a machine that others use, they could reach it. "
                "Where every user and host is trusted: %config ScaleSession.allow_unauthenticated_servers = True "
                "(see README, Frameworks)")

    # The export's, kept beside it (see cellstart).
    export_keep_start = Bool(False, config=True,
                             help="Before each %%distribute cell, keep a deep copy of the notebook values it reads "
                                  "(as they are before it runs), so that %scale export after the cell writes the "
                                  "values the cell started from and its job repeats the run (--from start). Costs "
                                  "memory for a second copy of those values (the last cell's only) and the time to "
                                  "copy them at every cell. Off: nothing is copied, and an export after a cell saves "
                                  "the values as they are then (the trained weights) and says so.")

    @observe("export_keep_start")
    def _keep_start_changed(self, change: Any) -> None:
        from . import cellstart

        # While the session is being made (the setting in a config file) it has no observers
        # yet: the extension attaches the keeper as it loads.
        if getattr(self, "observers", None) is not None:
            cellstart.attach(self).start = None  # turned off: the copy goes; on: from the next cell

    def export(self, directory: str | os.PathLike, *, code: str | None = None, cell: int | None = None,
               targets: Sequence[str] = jobfiles.TARGETS, save_values: bool = True, workers: int | None = None,
               nodes: int = 1, image: str | None = None, gpus_per_node: int = 0, manual: bool = False,
               values_from: str = "auto") -> dict:
        """Write a %%distribute cell as a job directory (train.py, its values, run.sh,
        job.sbatch, Kubeflow and KubeRay manifests; see jupyter_scale.export and jobfiles).

        The cell is `code` (a %%distribute cell's body; `cell` its In [n], if any), else
        In [`cell`] or the last %%distribute cell run (see distribute_cell; its %%distribute
        options are for the caller to read). `workers` in all over `nodes` (default: the
        cluster's size); `manual`: the cell is --manual. `save_values=False`: the notebook's
        values are made by the notebook code that made them, not saved. `values_from`, for a
        cell that ran: "start" saves the values as it started (kept by `export_keep_start`),
        "now" as they are; "auto" the start when it was kept, else now, saying so in one line
        when its run wrote any of them back (see cellstart). Raises ExportError naming what
        cannot be exported; writes nothing then. The directory must be the user's own, which
        no one else can write (see jobdir).
        """
        from . import cellstart

        if values_from != "auto" and not save_values:
            raise export.ExportError("cannot export: --from picks the saved values; with --no-values the notebook's "
                                     "code makes them")
        cells = self._executed_cells()
        if code is None:
            cell, _, code = self.distribute_cell(cell)
        elif cell is None:
            cell = self._cell_number(code)
        workers = workers or (self.size if self.running else self.default_workers)
        if workers % nodes:
            raise export.ExportError(f"cannot export: {workers} workers do not split evenly over {nodes} nodes")
        try:
            export.check_script_syntax(code, self._transform)
            try:
                free = self._free_names(self._transform(code))
                framework = frameworks.choose(code, self.namespace, self._names_to_ship(free))
            except frameworks.FrameworkError:
                framework = "more than one framework"
            if framework != "torch":
                raise export.ExportError(f"cannot export: the cell uses {framework}; export writes torch jobs "
                                         "(torchrun, Slurm, Kubeflow, KubeRay)")
            statements = export.notebook_statements(cells, self._transform)
            plan = export.plan_script(code, self.namespace, statements, save_values=save_values,
                                      eligible=self._shippable, workers_own=self.shipper.workers_own(),
                                      injected=worker.INJECTED_NAMES)
        except SyntaxError as exc:
            raise export.ExportError(f"cannot export: the cell is not valid Python: {exc}") from None
        keeper = cellstart.keeper(self)
        plan.values, values_from, note = cellstart.choose(plan.values, self.runs, cell,
                                                          keeper.start if keeper else None, values_from)
        name = jobfiles.job_name(os.path.basename(os.path.abspath(directory)))
        shape = jobfiles.JobShape(name=name, per_node=workers // nodes, nodes=nodes, image=image or f"{name}:latest",
                                  gpus_per_node=gpus_per_node)
        # The seed the cell drew when it ran, else the one it would draw now: the notebook's RNG
        # is left as it was, so that the cell run after its export draws the export's seed.
        ran = [r for r in self.runs if cell is not None and r.execution_count == cell]
        if ran and ran[-1].seed is not None:
            seed = ran[-1].seed
        else:
            with torch.random.fork_rng(devices=[]):
                seed = _draw_seed()
        when = {"start": f"as In [{cell}] started (copied before it ran)",
                "now": f"as they were at export, after In [{cell}] ran"}.get(values_from, "as they were at export")
        done = jobfiles.write(Path(directory), plan, shape, seed=seed, automatic=not manual, cell=cell,
                              targets=tuple(targets), values_when=when)
        if note:
            print(note, file=sys.stderr, flush=True)
        done["values_from"] = values_from
        return done

    def _executed_cells(self) -> list[tuple[int | None, str]]:
        """(In [n] or None, source) of the notebook's cells run so far: those IPython's history
        kept before record_cells, then every one since (this one's magic defines nothing)."""
        if self.shell is None:
            return []
        raw = self.shell.history_manager.input_hist_raw
        if self._history_before is None:
            return [(n, raw[n]) for n in range(1, len(raw))]
        return [(n, raw[n]) for n in range(1, min(self._history_before, len(raw)))] + list(self.cells)

    def _cell_number(self, body: str) -> int | None:
        """In [n] of the cell running now, whose body is `body`. IPython 9 counts a cell it
        keeps in its history before running it, IPython 8 after: the history says which."""
        count = getattr(self.shell, "execution_count", None)
        history = getattr(getattr(self.shell, "history_manager", None), "input_hist_raw", None) or []
        if count and len(history) == count and body.strip() and history[-1].rstrip().endswith(body.strip()):
            return count - 1
        return count

    def distribute_cell(self, number: int | None = None) -> tuple[int | None, str | None, str]:
        """(In [n], its %%distribute line or None for a plain cell, its body): In [`number`],
        else the last %%distribute cell run."""
        cells = self._executed_cells()
        found = [(n, source) for n, source in cells if source.lstrip().startswith("%%distribute")]
        if number is not None:
            found = [(n, source) for n, source in cells if n == number]
            if not found:
                raise export.ExportError(f"cannot export: no cell In [{number}] ran before this one")
        if not found:
            raise export.ExportError("cannot export: no %%distribute cell ran in this notebook yet (or name one: --cell N)")
        n, source = found[-1]
        first, _, body = source.lstrip().partition("\n")
        if not first.startswith("%%distribute"):
            return n, None, source  # a plain cell exports as %%distribute would run it
        return n, first.removeprefix("%%distribute"), body

    def _done_with_frames(self, answered: bool) -> None:
        """The cell's shared-memory file may shrink or be written again once every rank
        answered (none reads it any more). Otherwise a rank that never answered may still
        read it: the kernel takes a new file and leaves that one to its readers."""
        if self._frames_out is None:
            return
        if answered:
            self._frames_out.trim()
        else:
            self._frames_out.close()  # its memory stays while a reader maps it
            self._frames_out = sharedmem.SharedFrames(self.shared_memory_keep)

    def _stop_abandoned(self, job: Job) -> bool:
        """Stop the ranks of a cell whose wait ended early; those that do not stop within
        `stop_deadline` count as lost (the next cell replaces their workers). True when
        every rank answered."""
        try:
            running = [r for r in job.ranks if not job.done(r) and r not in self._lost_workers]
            if running:
                self.backend.interrupt(running, self._run_id())
                started = time.monotonic()
                aborted = False
                while running and time.monotonic() - started < self.stop_deadline:
                    if not aborted and time.monotonic() - started > self.abort_grace:
                        self._request_abort()  # ranks blocked in a collective among themselves
                        aborted = True
                    job.wait_activity(self.poll_interval)
                    running = [r for r in running if not job.done(r)]
            stuck = sorted({*running, *(r for r in job.ranks if r in self._lost_workers)})
        except Exception:  # the engine itself failed: nothing can be known of the ranks
            log.debug("stopping an abandoned cell failed", exc_info=True)
            stuck = list(job.ranks)
        if stuck:
            self._lost_workers = sorted(set(self._lost_workers) | set(stuck))
            self._group_ready = False
        return not stuck

    def _pack_frames(self, shipment: shipping.Shipment) -> tuple[list, dict | None]:
        """The shipment's big frames into shared memory, when the workers read it; should
        that fail (out of memory), this cell's frames go through the engine instead."""
        if self.shared_memory:
            try:
                return self._frames_out.pack(shipment.frames, shipment.tensor_frames)
            except OSError as exc:
                log.warning("shared memory failed (%s); sending through %s", exc, self.backend_name)
        return shipment.frames, None

    def _end_run(self, cell: CellRun, headers: dict[int, CellReply], frames_back: dict, error: RemoteError | None,
                 lost: list, shipment: shipping.Shipment, plan: shipping.Plan, manual: bool) -> None:
        record, view = cell.record, cell.view
        record.elapsed = time.time() - record.started
        record.metrics.sort(key=lambda p: (p["time"], p["rank"]))

        if lost:
            # A worker process is gone: the next cell restarts the cluster.
            self._lost_workers = sorted(lost)
            self._group_ready = False
        if not lost and all(h.get("received") for h in headers.values()):
            self.shipper.commit(shipment)
            self._register_back = None
        else:
            self.shipper.discard()  # some rank may not hold the new values: send again
        # Names the cell bound on the workers are theirs until the notebook writes them
        # (the pull-back below makes pulled names the notebook's again).
        rebound = sorted({n for h in headers.values() for n in h.get("rebound", ()) if self._shippable(n)})
        self.shipper.workers_rebound(rebound, plan)
        for name in rebound:
            if cell.record.framework == "torch":
                self._bound_by_framework.pop(name, None)
            else:
                self._bound_by_framework[name] = cell.record.framework
        if any(not h.get("group_ready", False) for h in headers.values()):
            self._group_ready = False
        if error is not None:
            self._resync = True
            self._spent_frameworks |= self._framework_groups  # their collectives were cut
            record.status = ("timed out" if isinstance(error, CellTimeout)
                             else "interrupted" if all(f.interrupted for f in error.failures) else "failed")
            record.error, record.failed_rank = str(error), error.rank
            self._finish_run(view, record)
            if record.status == "interrupted" and cell.user_interrupted:
                ended = f"; the worker of rank(s) {sorted(lost)} ended, the next cell replaces it" if lost else ""
                if self._framework_groups:
                    ended += (f"; the next {' or '.join(sorted(self._framework_groups))} cell starts fresh workers "
                              "(the group forms once per process)")
                raise KeyboardInterrupt(f"interrupted; ranks {sorted(f.rank for f in error.failures)} stopped "
                                        f"and are ready for the next cell{ended}")
            raise error
        self._resync = self._resync and manual  # an automatic cell equalized the models
        if not manual:
            self._sync_buffers(headers)
            self._say_disagreements(headers)
        record.status = "finished"
        self._finish_run(view, record)
        if 0 in headers:
            self._apply_pulls(headers[0], frames_back.get(0, ()), record, plan)
            self._register_back = headers[0].get("returned", {}).get("back") or self._register_back

    @staticmethod
    def _say_disagreements(headers: dict[int, CellReply]) -> None:
        """Automatic mode keeps every rank's models and optimizers alike; where a cell made
        them differ (a decision taken on each rank's own shard of a metric), say so: the
        notebook gets rank 0's."""
        replicas = {r: h["replicas"] for r, h in headers.items() if h.get("replicas") is not None}
        said = statesync.disagreements(replicas) if len(replicas) == len(headers) else []
        if said:
            print(f"jupyter_scale: the ranks disagree after this cell: {'; '.join(said)}. The notebook holds rank "
                  "0's. A decision taken on each rank's own data (a scheduler stepped on a validation loss) "
                  "needs the value reduced across ranks first: dist.all_reduce(loss); loss /= world_size "
                  "(README: Per-rank decisions)", file=sys.stderr, flush=True)

    def _sync_buffers(self, headers: dict[int, CellReply]) -> None:
        """Automatic mode ends a cell with rank 0's module buffers on every rank (as DDP's
        broadcast_buffers), for the names every rank holds alike. Compared here, from the
        ranks' answers, so that a cell without buffers costs no collective."""
        signatures = [headers[r].get("buffers") for r in sorted(headers)]
        if not signatures or not signatures[0] or any(s is None for s in signatures):
            return  # no buffers on rank 0, or a rank without a process group
        common = [n for n, sig in signatures[0].items() if all(s.get(n) == sig for s in signatures)]
        if not common:
            return
        job = self._calls().submit(worker.sync_buffers, common)
        try:
            job.wait(self.start_timeout)
        except DistributeError as exc:  # the next automatic cell equalizes everything
            self._resync = True
            print(f"jupyter_scale: could not give every rank rank 0's module buffers ({exc}); "
                  "the next cell does", file=sys.stderr, flush=True)
        finally:
            job.release()

    def _end_broken_run(self, view: RunView, record: RunRecord, exc: BaseException) -> None:
        """A run that ended without every rank's answer: failed, and whatever it shipped is
        sent again by the next cell (some rank may not hold it)."""
        record.status, record.error = "failed", str(exc)
        self.shipper.discard()
        self._finish_run(view, record)

    def _finish_run(self, view: RunView, record: RunRecord) -> None:
        """Show the run's end in the cell and tell the observers (the sidebar)."""
        view.finish(record)
        self._notify("run_finished", record)

    def _sinks(self, targets: list[str], mode: str, cell: int | None, started: float,
               code: str) -> sinks.RunSinks | None:
        if not targets:
            return None
        path = os.environ.get("JPY_SESSION_NAME") or str(self.namespace.get("__session__") or "")
        notebook = Path(path).stem if path else "notebook"
        name = sinks.run_name(notebook, cell, len(self.runs) + 1, started)
        details = {"notebook": notebook, "engine": self.backend_name, "cell": str(cell) if cell is not None else "",
                   "code": code}
        try:
            return sinks.RunSinks(targets, mode, name, details)
        except sinks.SinkError as exc:
            raise DistributeError(str(exc)) from None
        except Exception as exc:  # the tracking store itself: a bad URI, a server that does not answer
            raise DistributeError(f"--log-to: {type(exc).__name__}: {' '.join(str(exc).split())}") from None

    @property
    def events_address(self) -> str:
        """Where the workers send the next cell's events (output too, over the direct channel)."""
        return self._channel.events_address if self._channel is not None else self._event_stream().address

    def _event_stream(self) -> metrics.EventQueue:
        if self.events is None:
            self.events = self._require_backend().open_events()
        return self.events

    def _transform(self, code: str) -> str:
        if self.shell is not None:
            # IPython syntax (magics, !shell) becomes plain Python, as in a normal cell.
            return self.shell.transform_cell(code)
        return code

    @staticmethod
    def _free_names(code: str) -> list[str]:
        try:
            return shipping.free_names(code)
        except SyntaxError as exc:
            raise DistributeError(f"the cell is not valid Python: {exc}") from None

    def _names_to_ship(self, free: list[str]) -> list[str]:
        """Of the names a cell reads before it binds them, the notebook's that may travel."""
        return [n for n in free if n in self.namespace and self._shippable(n)]

    @staticmethod
    def _shippable(name: str) -> bool:
        """Not a name the workers set themselves, a dunder, or IPython's own."""
        return name not in worker.INJECTED_NAMES and not name.startswith("__") and not _is_ipython_internal(name)

    def _run_id(self) -> str | None:
        return self.events.run if self.events is not None else None

    def _request_abort(self) -> None:
        if not self.group:
            return
        self._group_ready = False  # the group is cut: the next cell forms a new one
        if self.group["store"].get("addr") == rendezvous.LOOPBACK:
            return  # the loopback of the workers' host, not ours: the ranks cut each other loose
        try:
            rendezvous.request_abort(self.group["store"])
        except Exception:  # the store is gone with rank 0; its peers fail on their own
            log.debug("abort request through the store failed", exc_info=True)

    def _apply_pulls(self, header: CellReply, frames: Sequence, record: RunRecord,
                     plan: shipping.Plan | None = None) -> None:
        applying = time.perf_counter()
        pullback.Puller(self.namespace, self.shipper, self._calls(), self.pull_chunk_bytes, self.start_timeout,
                        self._abandon_pull, plan, self.bring_back_limit).apply(header, frames, record)
        record.pullback_seconds = header.get("pack_seconds", 0.0) + time.perf_counter() - applying

    def _abandon_pull(self, job: Job) -> None:
        """A pull of a sharded model failed half-way: stop its ranks, form the group anew."""
        self._stop_abandoned(job)
        self._group_ready, self._resync = False, True

    def gather(self, name: str) -> list:
        """Every rank's value of worker variable `name`, in rank order."""
        job = self._calls().submit(worker.gather_value, name)
        try:
            answers = job.wait(self.start_timeout)
        finally:
            job.release()
        missing = [a[0]["rank"] for a in answers if a[0]["missing"]]
        if missing:
            raise KeyError(f"{name!r} is not defined on ranks {missing}")
        return [shipping.loads(a[1], a[2:], namespace=self.namespace) for a in answers]

    def history(self, as_frame: bool = False):
        """The points the last run reported (all ranks, in time order): a list of dicts with
        `rank`, `step`, `time`, `epoch` (when given) and each reported name, or a pandas
        DataFrame with `as_frame=True`."""
        points = list(self.runs[-1].metrics) if self.runs else []
        return _as_frame(points) if as_frame else points


def _where(where: dict) -> str:
    return where.get("address") or ", ".join(f"{k} {v}" for k, v in where.items())


def _draw_seed() -> int:
    """Automatic mode's seed, drawn from the notebook's RNG as the cell would draw locally:
    a notebook that calls torch.manual_seed gets the same worker runs every time."""
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _is_ipython_internal(name: str) -> bool:
    # IPython's history and output caches (_, __, _i, _i3, _oh, In, Out, exit, ...)
    return name in {"_", "In", "Out", "exit", "quit", "get_ipython", "_oh", "_ih", "_dh"} or (
        name.startswith("_i") and (name[2:].isdigit() or name[2:] in {"", "i", "ii"})
    ) or (name.startswith("_") and name[1:].isdigit())


def _as_frame(points: list[dict]):
    try:
        import pandas
    except ImportError:
        raise ImportError("history(as_frame=True) needs pandas: pip install pandas") from None
    return pandas.DataFrame(points)


# The name users and the README use. The class is called ScaleSession so that its
# traitlets config section (c.ScaleSession.default_workers = 4) does not collide with
# jupyter_client's `Session`.
Session = ScaleSession
