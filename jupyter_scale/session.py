"""One Session per kernel: what `%%distribute` and `%scale` do, as methods.

The session holds the settings (traitlets: `%config ScaleSession.x = ...`) and decides;
each concern is a module of its own that it composes: the workers' processes (cluster),
the process group formed over them (group), the notebook names a cell sends (notebooknames)
and the request that carries them (cellrequest), one cell's wait (run, which observes and
returns an outcome), what that outcome changes (cellend), what travels each way (shipping,
sendback, pullback, cellframes), the frameworks' restart rules (frameworks.rules), the cells
and their export (cellexport). Tests and UIs drive the same methods as the magics.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from traitlets import observe

from . import (
    byvalue,
    cellexport,
    cellrequest,
    cellstart,
    debugger,
    jobfiles,
    metrics,
    notebooknames,
    patches,
    pullback,
    rendezvous,
    sharedmem,
    shipping,
    sinks,
    worker,
    writewatch,
)
from . import group as groups
from .backends import Backend, Job
from .backends.channel import CellChannel
from .cellend import CellEnd, WorkerStanding
from .cellframes import KernelFrames
from .cluster import Cluster
from .debugger import RankPrompts
from .display import LineLabeler, RunView, StatusLine, wants_widget
from .errors import ClusterError
from .protocol import CellRequest
from .records import RunRecord, draw_seed, points_frame
from .run import CellRun, Interrupts, Outcome, RanksStuck, WaitLimits, interrupts_noted, stop_ranks
from .settings import SessionSettings

log = logging.getLogger(__name__)


class ScaleSession(SessionSettings):
    """The kernel's handle on its cluster and the cells it distributes (its settings: see
    SessionSettings, configured as `c.ScaleSession.<name>`)."""

    def __init__(self, namespace: dict | None = None, shell: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.shell = shell
        self.namespace = namespace if namespace is not None else (shell.user_ns if shell else {})
        self.cluster = Cluster(self, lambda live: StatusLine(live and self._widgets()))
        self.group: groups.Group | None = None  # formed over the cluster's workers (None between clusters)
        self.runs: list[RunRecord] = []
        self.standing = self._new_standing()  # what the kernel knows of its workers
        self._frames_out = KernelFrames()  # the kernel's shared-memory file, for large frames
        self._network_noted = False  # said once per cluster that gloo across hosts is unencrypted
        self._cell: CellRun | None = None  # the running (or last) cell's wait
        self.events: metrics.EventQueue | None = None  # workers -> kernel, one per session
        # Objects told of runs and cluster changes (the JupyterLab sidebar's channel): any of
        # run_started(record, total_steps), event(event), tick(), run_finished(record),
        # cluster_changed().
        self.observers: list[Any] = []
        self.cell_history = cellexport.CellHistory(shell)  # what export slices
        writewatch.enable(self.write_watch)

    def record_cells(self) -> None:
        """From now on, note every cell the shell runs (what %scale export slices)."""
        self.cell_history.record()

    def _notify(self, what: str, *args: Any) -> None:
        for observer in list(self.observers):
            handler = getattr(observer, what, None)
            if handler is None:
                continue
            try:
                handler(*args)
            except Exception:  # a display must never break a run
                log.warning("observer %r failed in %s", observer, what, exc_info=True)

    def _widgets(self) -> bool:
        return wants_widget(self.display, self.shell)

    # ------------------------------------------------------------------------------
    # Cluster
    # ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.cluster.running

    @property
    def size(self) -> int:
        return self.cluster.size

    @property
    def backend(self) -> Backend | None:
        """The engine of the running (or last) cluster."""
        return self.cluster.backend

    @property
    def placement(self) -> Any:
        """Where the workers of the cluster we started run (a launcher), else None."""
        return self.cluster.placement

    @property
    def connection(self) -> tuple[str, dict] | None:
        """(engine, where) of the cluster connect() attached to, else None."""
        return self.cluster.connection

    @property
    def workers(self) -> list[dict]:
        """describe() of each rank (host, pid, device, ...), in rank order."""
        return list(self.group.workers) if self.group is not None else []

    @property
    def shared_memory(self) -> bool:
        """Whether large frames go through shared memory (every worker reads the kernel's)."""
        return self.group is not None and self.group.shared_memory

    @property
    def beats(self) -> dict[int, dict]:
        """Each rank's latest heartbeat in the running (or last) cell: where it is, e.g. in which collective."""
        return self._cell.beats if self._cell is not None else {}

    def start(self, workers: int | None = None, launcher: str | None = None, **launcher_options: Any) -> None:
        """Start the embedded cluster (or attach to the connected one) and form the group.

        `launcher`: where the workers run ('local', 'slurm', 'mpi'; default: the `launcher`
        setting, or what the cluster being restarted used), with its options (partition,
        time_limit, account, qos, cpus_per_worker, gpus_per_worker, memory: see launchers)."""
        if self.running:
            raise ClusterError(f"a cluster of {self.size} workers is already running; "
                               "use %scale restart --workers N to change it")
        started = time.monotonic()
        line = self.cluster.start(workers, launcher, launcher_options)
        self._welcome_workers(started, line)

    def _welcome_workers(self, started: float, line: StatusLine | None = None) -> None:
        """New workers (a new cluster's, or replacements): the group, the tie to this kernel."""
        try:
            self.cluster.reset_attached()
            self._form_group()
            self.cluster.welcome(self.group.workers if self.group is not None else ())
        except BaseException:
            self._shutdown()
            raise
        group = self.group.backend if self.group is not None else ""
        (line or StatusLine(self._widgets())).say(f"jupyter_scale: {self.size} workers ready ({group}) in "
                                                  f"{time.monotonic() - started:.1f} s")
        self._notify("cluster_changed")

    def warm_up(self) -> None:
        """Let the engine prepare a faster first start (its fork server); nothing fails here."""
        self.cluster.warm_up()

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
        self._network_noted = False
        started = time.monotonic()
        line = self.cluster.connect(address, workers, backend, profile=profile, cluster_id=cluster_id,
                                    url_file=url_file, tls=tls)
        try:
            self._welcome_workers(started, line)
        except BaseException:
            self.cluster.connection = None
            raise
        self.backend_name = self.cluster.connection[0] if self.cluster.connection else self.backend_name

    def stop(self) -> None:
        """Stop the embedded cluster (every process it started), or disconnect from a connected one;
        the fork server goes too (restarts keep it), and what the kernel patched for the
        cluster (see patches: how the notebook's library objects are built stays recorded)."""
        try:
            self._shutdown()
        finally:
            self.cluster.forget()
            patches.remove_all(keep=(patches.LIBRARIES,))
        self._notify("cluster_changed")

    def _shutdown(self) -> None:
        self._forget_workers()
        if self.events is not None:  # frees its port; the next run binds a new one
            self.events.close()
            self.events = None
        try:
            self.cluster.shut_down()
        finally:
            self._frames_out.close()

    def restart(self, workers: int | None = None, launcher: str | None = None, **launcher_options: Any) -> None:
        """Fresh workers (a connected cluster: attach again, to the workers it has now); a
        cluster of a launcher's: submitted again, with its options unless new ones are given."""
        n = workers or (None if self.connection else self.size or self.default_workers)
        if self.cluster.can_replace(launcher, launcher_options):
            self._replace_workers(n or self.default_workers)
            return
        self._shutdown()
        self.start(n, launcher, **launcher_options)

    def _replace_workers(self, n: int) -> None:
        """New workers for the running cluster, whose controller or scheduler the engine keeps."""
        started = time.monotonic()
        line = StatusLine(self._widgets())
        line.say(f"jupyter_scale: starting {n} new workers in the running {self.backend_name} cluster ...")
        self.cluster.dismiss_workers()
        self._forget_workers()
        try:
            self.cluster.replace_workers(n)
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
        return dict(self.cluster.launch[1]) if self.cluster.launch else {}

    def ensure(self, workers: int | None = None, launcher: str | None = None,
               launcher_options: dict | None = None) -> None:
        """A running cluster of `workers` (default: the current size, else the default)."""
        if self.running and not self.standing.lost:
            self.standing.lost = self.cluster.require_backend().dead_ranks()  # died between cells
        if not self.running:
            self.start(workers, launcher, **(launcher_options or {}))
        elif self.standing.lost:
            # A connected cluster: the workers it has now (the lost ones may never come back).
            n = workers or (None if self.connection else self.size)
            ended = self.cluster.ended()
            if ended and not getattr(self.placement, "resubmit", True):
                raise ClusterError(f"{ended}; %scale restart submits a new job (c.SlurmLauncher.resubmit "
                                   "= True does it at the next cell)")
            how = ("attaching again to the cluster's workers" if self.connection
                   else f"submitting a new Slurm job of {n} workers" if ended
                   else f"restarting the cluster with {n} workers")
            print(f"jupyter_scale: the worker of rank(s) {self.standing.lost} is gone; {how} "
                  "(worker variables are lost)", flush=True)
            self.restart(n)
        elif workers and workers != self.size:
            how = "attaches again to the cluster" if self.connection else "restarts the workers"
            print(f"jupyter_scale: resizing from {self.size} to {workers} workers "
                  f"({how}: their variables are lost)", flush=True)
            self.restart(workers)
        elif not self.standing.group_ready:
            self._form_group()

    def status(self) -> dict:
        info = {"running": self.running, "backend": self.backend_name, "workers": self.size,
                "connected": self.connection is not None}
        info.update(self.cluster.describe())
        if self.running:
            info["group"] = dict(self.group.describe() if self.group is not None else {},
                                 ready=self.standing.group_ready)
            if self.standing.group_ready:
                info["cells_through"] = ("the kernel's direct channel" if self._channel is not None
                                         else f"the {self.backend_name} engine")
            info["lost"] = list(self.standing.lost)
            info["ranks"] = [dict(rank=r, **w) for r, w in enumerate(self.workers)]
        if self.runs:
            last = self.runs[-1]
            info["last_run"] = {"index": last.index, "execution_count": last.execution_count,
                                "status": last.status, "elapsed": round(last.elapsed, 3)}
        return info

    def _forget_workers(self) -> None:
        self._close_group()
        self.standing = self._new_standing()

    def _new_standing(self) -> WorkerStanding:
        return WorkerStanding(shipping.Shipper(self.namespace, notebooknames.shippable))

    def _form_group(self) -> None:
        """Lay out ranks (host, local rank, device) and initialize torch.distributed."""
        backend = self.cluster.require_backend()
        self.standing.frameworks.group_cut()  # their sockets go with torch's group
        self._close_group()
        if self.shared_memory_enabled:
            self._frames_out.open(self.shared_memory_keep)
        self.group = groups.form(backend, timeout=self.start_timeout, frames=self._frames_out.file,
                                 rendezvous_address=self.rendezvous_address, direct_channel=self.direct_channel,
                                 events=self._event_stream)
        self.standing.group_ready = True
        if self.group.hosts > 1 and not self._network_noted:
            self._network_noted = True
            print(f"jupyter_scale: the ranks span {self.group.hosts} hosts and exchange tensors (gloo) and the "
                  f"group's store ({self.group.master_addr}) unencrypted and unauthenticated: keep these hosts on "
                  "a network you trust (see README, Security)", file=sys.stderr, flush=True)

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    @property
    def _channel(self) -> CellChannel | None:
        return self.group.channel if self.group is not None else None

    def _calls(self) -> Backend | CellChannel:
        """What carries a cell's calls: the direct channel when it is open, else the engine."""
        return self._channel if self._channel is not None else self.cluster.require_backend()

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
        number = self.cell_history.number_of(code)
        code = self._transform(code)
        framework, names, plan = cellrequest.plan(code, self.namespace, self.standing, framework, shard,
                                                  self.connection is not None, self.allow_unauthenticated_servers)
        manual = manual or framework != "torch"  # another framework's cell uses that framework's own API
        if self.running and not self.standing.lost:
            why = self.standing.frameworks.restart_reason(framework, self.standing.group_ready)
            if why:
                print(f"jupyter_scale: {why}; restarting the workers (their variables are lost)", file=sys.stderr,
                      flush=True)
                self.restart(workers)
        started = time.time()
        # Opened before a worker starts: a target that cannot work fails the cell first.
        run_sinks = sinks.for_run(self.log_to if log_to is None else list(log_to), log_as or self.log_as,
                                  notebook=sinks.notebook_name(self.namespace), cell=number, index=len(self.runs) + 1,
                                  started=started, engine=self.backend_name, code=code)
        self.ensure(workers, launcher, launcher_options)
        seed = draw_seed()
        record = RunRecord(index=len(self.runs) + 1, workers=self.size, execution_count=number, seed=seed,
                           framework=framework, started=started)
        self.runs.append(record)
        shipment = self.standing.shipper.prepare(plan)
        record.shipped, record.skipped = dict(shipment.nbytes), list(shipment.skipped)
        if shipment.replaced:
            print(f"jupyter_scale: the notebook's {pullback.listed(shipment.replaced)} replace"
                  f"{'s' if len(shipment.replaced) == 1 else ''} the workers' own (set by an earlier "
                  "%%distribute cell; the notebook changed it since)", file=sys.stderr, flush=True)
        events = self._event_stream()
        run_id = events.begin(record.workers)  # from here on, late points of earlier runs are dropped
        request = cellrequest.build(code, record, names, plan, shipment, namespace=self.namespace, standing=self.standing,
                                    settings=self, events=(self.events_address, events.key, run_id), pull=list(pull),
                                    manual=manual, shard=shard, keep_sharded=keep_sharded, seed=seed,
                                    shared_memory=self.shared_memory,
                                    mailbox=self.group.store if self.group is not None else None)
        self.standing.frameworks.cell_started(framework)
        view = RunView(self._widgets(), self.progress_interval, record, steps)
        end = CellEnd(self.standing, record, view, shipment, plan, manual, namespace=self.namespace, settings=self,
                      calls=self._calls, stop=self._stop_abandoned, notify=self._notify)
        if run_sinks is not None:
            self.observers.append(run_sinks)
        self._notify("run_started", record, steps)
        try:
            with interrupts_noted() as interrupts:
                frames, request["shared_frames"] = (
                    self._frames_out.pack(shipment.frames, shipment.tensor_frames, self.backend_name)
                    if self.shared_memory else (shipment.frames, None))
                outcome, frames_back = self._wait(end, timeout, interrupts, request, frames)
                # Pull-back and buffer sync are not cut half-way by an interrupt either.
                rank0 = outcome.headers[0].get("shared_frames") if 0 in outcome.headers else None
                with sharedmem.unpacked(frames_back.get(0, ()), rank0) as frames_back[0]:
                    end.apply(outcome, frames_back)
        finally:
            if run_sinks is not None:  # closed by run_finished, or here where the run broke before it
                run_sinks.close(record.status if record.status != "running" else "failed")
                self.observers.remove(run_sinks)
        if interrupts.count > interrupts.handled:
            raise KeyboardInterrupt("interrupted as the cell ended: it had finished on every rank, "
                                    "and the notebook holds its results")
        return record

    def _wait(self, end: CellEnd, timeout: float | None, interrupts: Interrupts, request: CellRequest,
              frames: list) -> tuple[Outcome, dict]:
        """Send the cell and wait for every rank (see run.CellRun); whatever ends the wait
        early stops the ranks first, and fails the run."""
        try:
            job = self._calls().submit(worker.run_cell, request, *frames)
        except BaseException as exc:  # nothing runs: the run ends here, as after a broken wait
            end.broken(exc)
            raise
        self._cell = cell = CellRun(
            job, end.record, end.view, timeout, interrupts, backend=self.cluster.require_backend(),
            workers=self.workers, placement=self.placement, events=self.events, limits=self._wait_limits(),
            run_id=self._run_id(), request_abort=self._request_abort, notify=self._notify,
            prompts=RankPrompts(request.get("mailbox"), request.get("events_key", ""), request["run"], self.size),
            labeler=LineLabeler.for_cell(self.size, self.collapse_output, self.collapse_window, end.view.line))
        answered = False
        try:
            outcome = cell.wait()
            answered = True
            return outcome, dict(outcome.frames_back)
        except BaseException as exc:
            if isinstance(exc, RanksStuck):  # the next cell replaces their workers
                self.standing.lost, self.standing.group_ready = exc.ranks, False
            # Whatever ended the wait early (an engine's error, a bug): no rank may run
            # on unseen, reading frames the next cell writes.
            answered = self._stop_abandoned(job)
            end.broken(exc)
            raise
        finally:
            job.release()
            cell.forget_answers()  # the session keeps the run's heartbeats, not what it sent back
            self._frames_out.done(answered, self.shared_memory_keep)


    @observe("write_watch")
    def _write_watch_changed(self, change: Any) -> None:
        writewatch.enable(change["new"])  # the kernel's; the workers' with the next cell

    @observe("export_keep_start")
    def _keep_start_changed(self, change: Any) -> None:
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
        if code is None:
            cell, _, code = self.distribute_cell(cell)
        elif cell is None:
            cell = self.cell_history.number_of(code)
        return cellexport.export_cell(
            directory, code, cell, history=self.cell_history, namespace=self.namespace, runs=self.runs,
            transform=self._transform,
            names_read=lambda c: notebooknames.to_ship(self.namespace, notebooknames.free_names(c)),
            shippable=notebooknames.shippable, workers_own=self.standing.shipper.workers_own(),
            injected=worker.INJECTED_NAMES,
            keeper=cellstart.keeper(self), workers=workers or (self.size if self.running else self.default_workers),
            targets=targets, save_values=save_values, nodes=nodes, image=image, gpus_per_node=gpus_per_node,
            manual=manual, values_from=values_from)

    def distribute_cell(self, number: int | None = None) -> tuple[int | None, str | None, str]:
        """(In [n], its %%distribute line or None for a plain cell, its body): In [`number`],
        else the last %%distribute cell run."""
        return self.cell_history.distribute_cell(number)

    def _stop_abandoned(self, job: Job) -> bool:
        """Stop the ranks of a cell whose wait ended early; those that do not stop within
        `stop_deadline` count as lost (the next cell replaces their workers). True when
        every rank answered."""
        stuck = stop_ranks(job, self.cluster.require_backend(), self.standing.lost, self._wait_limits(),
                           self._run_id(), self._request_abort)
        if stuck:
            self.standing.lost = sorted(set(self.standing.lost) | set(stuck))
            self.standing.group_ready = False
        return not stuck

    def _wait_limits(self) -> WaitLimits:
        return WaitLimits(poll_interval=self.poll_interval, abort_grace=self.abort_grace,
                          stop_deadline=self.stop_deadline, silence_limit=self.silence_limit,
                          heartbeat_interval=self.heartbeat_interval, hang_warning=self.hang_warning)

    @property
    def events_address(self) -> str:
        """Where the workers send the next cell's events (output too, over the direct channel)."""
        return self._channel.events_address if self._channel is not None else self._event_stream().address

    def _event_stream(self) -> metrics.EventQueue:
        if self.events is None:
            self.events = self.cluster.require_backend().open_events()
        return self.events

    def _transform(self, code: str) -> str:
        if self.shell is not None:
            # IPython syntax (magics, !shell) becomes plain Python, as in a normal cell.
            return self.shell.transform_cell(code)
        return code

    def _run_id(self) -> str | None:
        return self.events.run if self.events is not None else None

    def _request_abort(self) -> None:
        if self.group is None:
            return
        self.standing.group_ready = False  # the group is cut: the next cell forms a new one
        if self.group.store.get("addr") == rendezvous.LOOPBACK:
            return  # the loopback of the workers' host, not ours: the ranks cut each other loose
        try:
            rendezvous.request_abort(self.group.store)
        except Exception:  # the store is gone with rank 0; its peers fail on their own
            log.debug("abort request through the store failed", exc_info=True)

    def call(self, fn: Callable, *args: Any, ranks: list[int] | None = None) -> list:
        """`fn(*args)` on each rank of `ranks` (default: every rank), outside a cell; their
        answers in rank order, within call_timeout. `fn` must be importable on the workers."""
        job = self._calls().submit(fn, *args, ranks=ranks)
        try:
            return job.wait(self.call_timeout)
        finally:
            job.release()

    def gather(self, name: str) -> list:
        """Every rank's value of worker variable `name`, in rank order."""
        answers = self.call(worker.gather_value, name)
        missing = [a[0]["rank"] for a in answers if a[0]["missing"]]
        if missing:
            raise KeyError(f"{name!r} is not defined on ranks {missing}")
        return [byvalue.loads(a[1], a[2:], namespace=self.namespace) for a in answers]

    def debug(self, rank: int | None = None) -> None:
        """pdb on `rank` (default: the rank the last failed cell blames) in the frames where its
        last cell raised, as IPython's %debug does in the kernel's (see debugger)."""
        rank = debugger.rank_to_debug(rank, [r.failed_rank for r in self.runs if r.failed_rank is not None],
                                      self.size if self.running and self.group else 0, self.standing.lost)
        assert self.group is not None
        debugger.post_mortem(self._calls(), self.cluster.require_backend(), self._event_stream(), self.events_address,
                             self.group.store, rank, self.size, self.poll_interval, self.stop_deadline)

    def stacks(self, timeout: float = 5.0) -> str:
        """Every rank's Python stacks (all threads), each headed by where its cell is; also
        while a cell runs or hangs (from another thread)."""
        cell = self._cell if self._cell is not None and self._cell.job is not None else None
        store = self.group.store if self.group is not None else None
        idle = None if cell is not None else lambda ranks: self.call(worker.stacks, ranks=ranks)
        return debugger.stacks(store, self.workers, self.standing.lost, idle, timeout)

    def history(self, as_frame: bool = False):
        """The points the last run reported (all ranks, in time order): a list of dicts with
        `rank`, `step`, `time`, `epoch` (when given) and each reported name, or a pandas
        DataFrame with `as_frame=True`."""
        points = list(self.runs[-1].metrics) if self.runs else []
        return points_frame(points) if as_frame else points


# The name users and the README use. The class is called ScaleSession so that its
# traitlets config section (c.ScaleSession.default_workers = 4) does not collide with
# jupyter_client's `Session`.
Session = ScaleSession
