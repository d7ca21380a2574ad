"""ipyparallel engine: an embedded local cluster (controller + N engines on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import ipyparallel as ipp
import psutil
from ipyparallel.cluster.launcher import (
    LocalControllerLauncher,
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    LocalProcessLauncher,
    MPIEngineSetLauncher,
    SlurmEngineSetLauncher,
)
from traitlets import Bool, Dict, Float, List, Unicode

from .. import forkserver, metrics, processes, programs
from ..errors import ClusterError
from ..launchers import Launcher, MPILauncher, SlurmLauncher
from . import CONNECT_TIMEOUT_S, Backend, Job, Output, WorkerCallFailed, WorkerLost, channel, describe_exit, engine_errors

log = logging.getLogger(__name__)
_quiet_cluster_log = logging.getLogger(__name__ + ".cluster")
_quiet_cluster_log.setLevel(logging.ERROR)

# The controller pings engines this often (ms), and unregisters one that missed this many in
# a row: ipyparallel's default (3 s x 10) takes 30 s to notice a dead engine; 5 s here. A new
# engine is registered at the first ping it answers: the short period makes that ~50 ms.
HEARTBEAT_MS = 100
HEARTBEAT_MISSES = 50
# How long after its process ended an engine counts as lost (its last reply may be on its way).
EXIT_GRACE_S = 0.3
# How long a start-up probe of an engine may go unanswered before it is sent again.
PROBE_AGAIN_S = 5.0


class _EngineLauncher(LocalEngineLauncher):
    """A local engine launcher that remembers how its process ended.

    ipyparallel's waiter thread reaps the engine and hands the status to an event-loop
    callback, which does not run while a cell blocks the kernel (and Popen then reads 0):
    the status is kept here, in the waiter thread, as it is read.
    """

    seen_exit_code: int | None = None

    def _start_waiting(self):
        wait = self.process.wait

        def recording_wait(timeout=None):
            code = wait(timeout)
            self.seen_exit_code = int(code) if code is not None else None
            return code

        self.process.wait = recording_wait
        super()._start_waiting()

    def get_output(self, remove=False):
        # ipyparallel reads the engine's output file as UTF-8 and raises on other bytes,
        # which a cell may write to fd 1 or 2: stop and restart then failed.
        if self._output is None and self.output_file:
            with contextlib.suppress(FileNotFoundError):
                with open(self.output_file, encoding="utf-8", errors="replace") as f:
                    self._output = f.read()
        return super().get_output(remove)


# ipyparallel's engine and controller with our changes: programs/ipp_engine.py, programs/ipp_controller.py.
_ENGINE = programs.command("ipp_engine")
_CONTROLLER = programs.command("ipp_controller")

# What the worker template imports once (forkserver): all the controller and an engine
# import to start, and the worker code an engine's first call imports.
TEMPLATE_PRELOAD = ["jupyter_scale.worker", "jupyter_scale.backends.ipyparallel", "ipyparallel.engine.app",
                    "ipyparallel.controller.app"]
# How long a start waits for a template still importing: longer than importing anew would
# take; then the process starts the usual way.
TEMPLATE_WAIT_S = 30.0


class _Forked:
    """A local launcher (mixed in before it) whose process is forked from the kernel's
    worker template instead of started anew; the template, which reaps it, says how it
    ended. Where the template cannot, the process starts the usual way. Either way the
    process is given to the cluster's watch as soon as it runs (processes.watch)."""

    fork: bool = False  # whether to ask for the kernel's template at start (a new one if it died)
    watch: processes.Watch | None = None  # the cluster's
    template: forkserver.Template | None = None
    seen_exit_code: int | None = None

    def start(self):
        self.template = forkserver.template(TEMPLATE_PRELOAD) if self.fork else None
        if self.template is None:
            return self._watched(super().start())
        env = os.environ.copy()
        env.update(self.get_env())
        argv = self.args  # [python, program, *ipyparallel's arguments]
        # Popen(cwd=) reads a relative directory against the kernel's, not the template's; and
        # ipyparallel's apps chdir to a default taken when they were imported (in the template).
        cwd = os.path.abspath(self.work_dir)
        try:
            self.pid = self.template.spawn(argv[1], [*argv[2:], f"--work-dir={cwd}"], env, cwd, self.output_file,
                                           timeout=TEMPLATE_WAIT_S)
        except forkserver.TemplateError as exc:
            log.info("%s starts as a new process: %s", self.identifier, exc)
            self.template = None
            return self._watched(super().start())
        self._watched(None)
        try:
            self.process = psutil.Process(self.pid)
        except psutil.NoSuchProcess:  # ended at once, and the template reaped it
            self.template.wait_exit(self.pid, 1.0)
            how = describe_exit(self.template.exit_code(self.pid)) or "ended"
            raise ClusterError(f"{self.identifier} {how} as it started (its output: {self.output_file})") from None
        self.notify_start(self.pid)
        LocalProcessLauncher._start_waiting(self)

    def _watched(self, result: Any) -> Any:
        if self.watch is not None and getattr(self, "pid", None):
            self.watch.add_processes([self.pid])
        return result

    def _wait(self):
        if self.template is None:
            return super()._wait()
        while not self._stop_waiting.is_set() and self.state == "running":
            if self.template.wait_exit(self.pid, 1.0):
                break
            if not self.template.alive:  # it cannot tell any more: watch the pid
                with contextlib.suppress(psutil.TimeoutExpired):
                    self.process.wait(timeout=1.0)
                    break
        self.seen_exit_code = self.template.exit_code(self.pid)
        stop_data = dict(exit_code=self.seen_exit_code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))

    def poll(self):
        if self.template is None:
            return super().poll()
        code = self.template.exit_code(self.pid)
        if code is None and self.process.is_running():
            return None
        self.notify_stop(dict(exit_code="unknown" if code is None else code, pid=self.pid, identifier=self.identifier))
        return code


def _controller(fork: bool, watch: processes.Watch) -> type:
    return type("_ControllerLauncher", (_Forked, LocalControllerLauncher), {
        "controller_cmd": List(list(_CONTROLLER)),
        "fork": fork,
        "watch": watch,
    })


class _EngineSetLauncher(LocalEngineSetLauncher):
    launcher_class = _EngineLauncher
    engine_cmd = List(list(_ENGINE))
    delay = Float(0.0, config=True, help="Seconds between engines' starts (0.1 s each in ipyparallel): ranks do "
                                             "not follow engine ids.")

    def start(self, n):
        result = super().start(n)
        # ipyparallel drops a launcher from `launchers` once its engine stops; keep them
        # all, with what they know of how their engine ended.
        self.started_launchers = dict(self.launchers)
        return result


def _local_engines(fork: bool, timeout: float, watch: processes.Watch) -> type:
    """Local engines, forked from the kernel's worker template if `fork`, each given to the
    cluster's `watch`. They start with the controller and wait (up to `timeout`) for its
    connection file."""
    return type("_LocalEngineSetLauncher", (_EngineSetLauncher,), {
        "engine_args": List([f"--IPEngine.wait_for_url_file={timeout}"]),
        "launcher_class": type("_ForkedEngineLauncher", (_Forked, _EngineLauncher), {"fork": fork, "watch": watch}),
    })


def _slurm_engines(launcher: SlurmLauncher) -> type:
    """ipyparallel's Slurm engine launcher, submitting one job of n tasks, each one of our
    engines, with the user's options; its script and output in the launcher's directory (not
    the notebook's)."""
    directory = launcher.directory()
    directives = "".join(f"#SBATCH {line}\n" for line in launcher.directives(worker_per_job=False))
    # srun is given --cpus-per-task itself: from Slurm 22.05 to 23.11 it did not take the job's.
    template = ("#!/bin/sh\n#SBATCH --job-name=jupyter_scale-{cluster_id}\n#SBATCH --ntasks={n}\n"
                "#SBATCH --output={output_file}\n" + directives.replace("{", "{{").replace("}", "}}")
                + f"srun --cpus-per-task={launcher.cpus_per_worker} {{program_and_args}}\n")
    return type("_SlurmEngines", (SlurmEngineSetLauncher,), {
        "engine_cmd": List(list(_ENGINE)),
        "batch_template": Unicode(template),
        "batch_file_name": Unicode(os.path.join(directory, "engines.sbatch")),
        "output_file": Unicode(os.path.join(directory, "engines.out")),
    })


def _mpi_engines(launcher: MPILauncher, n: int) -> type:
    """ipyparallel's MPI engine launcher: `mpiexec -n N` our engine, with Open MPI's flags."""
    mpiexec, args, env = launcher.command(n)
    return type("_MPIEngines", (MPIEngineSetLauncher,), {
        "engine_cmd": List(list(_ENGINE)),
        "mpi_cmd": List(mpiexec),
        "mpi_args": List(args),
        "environment": Dict(env),
    })


def _engine_launchers(cluster: ipp.Cluster | None) -> dict:
    found: dict = {}
    for engine_set in (cluster.engines.values() if cluster is not None else ()):
        found.update(getattr(engine_set, "started_launchers", None) or getattr(engine_set, "launchers", {}))
    return found


@contextlib.contextmanager
def _unsigned_is_expected():
    """Connecting to a cluster of ours, whose sockets CurveZMQ authenticates: ipyparallel
    then leaves the messages unsigned (a digest would be redundant), and jupyter_client
    warns "Message signing is disabled. This is insecure" in the kernel's log, which is not
    true of this connection. That warning alone is dropped, while connecting."""
    from traitlets.log import get_logger

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Message signing is disabled")

    logger = get_logger()
    logger = getattr(logger, "logger", logger)  # an application's log may be a LoggerAdapter
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _keep_private(cluster: ipp.Cluster) -> None:
    """The profile's log directory and the cluster's files in it, owner-only.

    The engines' logs hold what cells wrote to fd 1 and 2; ipyparallel leaves the directory
    and the files to the umask (readable by every user, usually). Called before the
    cluster starts (nothing is written where others can read it) and after (its files).
    """
    log_dir = os.path.join(cluster.profile_dir, "log")
    try:
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        os.chmod(log_dir, 0o700)
        for name in os.listdir(log_dir):
            if cluster.cluster_id in name:
                os.chmod(os.path.join(log_dir, name), 0o600)
    except OSError as exc:  # a profile directory of someone else's: their choice
        log.warning("could not make %s owner-only: %s", log_dir, exc)


def _watch_files(cluster: ipp.Cluster, watch: processes.Watch) -> None:
    """The cluster's files in the profile (its connection files, its processes' logs, the
    controller's list of engines), for the kernel's watcher to remove if the kernel dies: they
    are named after the cluster id, which ipyparallel makes unique (time and random letters)."""
    if not cluster.cluster_id:  # a profile's default cluster: its file names are not the cluster's alone
        return
    watch.add_files(os.path.join(cluster.profile_dir, "security"), f"ipcontroller-{cluster.cluster_id}-*")
    log_dir = os.path.join(cluster.profile_dir, "log")
    watch.add_files(log_dir, f"ip*-{cluster.cluster_id}-*.log")
    watch.add_files(log_dir, f"engines{cluster.cluster_id}.json")


def _startup_failure(cluster: ipp.Cluster) -> str:
    """What the engines that ended during start printed last (their output files)."""
    found = []
    for ident, launcher in _engine_launchers(cluster).items():
        process = getattr(launcher, "process", None)
        if process is None or process.is_running():
            continue
        lines = [line.strip() for line in (launcher.get_output() or "").splitlines() if line.strip()]
        how = describe_exit(getattr(launcher, "seen_exit_code", None)) or "ended"
        found.append(f"engine {ident} {how} while starting" + (f": {lines[-1]}" if lines else ""))
    return "; ".join(found[:2])


# --------------------------------------------------------------------------------------
# The event stream over the engines' own channel
# --------------------------------------------------------------------------------------
# Workers on other hosts cannot reach a socket on the kernel's loopback. Each engine already
# has an authenticated (and, with CurveZMQ, encrypted) channel to every client: its IOPub
# stream through the controller, which carries what the cell prints. The metrics batches
# travel on it as ipyparallel "data messages", addressed to the running call's request.

IOPUB_SCHEME = "ipyparallel-iopub"
_DATA_KEY = "jupyter_scale-events"


class _IOPubTransport:
    """metrics.EventSink transport over the engine's IOPub channel (worker side)."""

    def __init__(self, address: str):
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None or getattr(shell, "kernel", None) is None:
            raise RuntimeError("not in an ipyparallel engine")
        self._kernel = shell.kernel

    def send(self, message: str) -> bool:
        from ipyparallel.serialize import serialize_object

        kernel = self._kernel
        # The request the engine runs now (the cell's call): the kernel's client hands the
        # message to that call's future. IOPubThread sends from its own thread (thread-safe).
        kernel.session.send(kernel.iopub_socket, "data_message", content={"keys": [_DATA_KEY]},
                            parent=kernel.get_parent("shell"), buffers=serialize_object({_DATA_KEY: message}),
                            ident=b"datapub")
        return True

    def close(self) -> None:
        pass


metrics.register_transport(IOPUB_SCHEME, _IOPubTransport)


def _serve_channel(directory: str, identity: bytes, rank: int) -> int:
    """Calls over the kernel's channel run in the engine's event loop: its main thread, where
    its own calls run, so that SIGINT interrupts them alike."""
    from IPython import get_ipython

    return channel.serve(directory, identity, rank, loop=get_ipython().kernel.io_loop)


def _call(fn: Callable, *args: Any) -> Any:
    """Every call runs through here: the engine imports this module first, which registers
    the event transport above."""
    return fn(*args)


class _IOPubEventQueue(metrics.EventQueue):
    """The kernel's end: fed by the callbacks of every call's futures (client IO thread)."""

    address = f"{IOPUB_SCHEME}://"

    def take(self, client: ipp.Client, msg: dict) -> None:
        if msg["header"]["msg_type"] != "data_message" or _DATA_KEY not in msg["content"].get("keys", ()):
            return
        # ipyparallel put the message's data into the call's metadata just before this.
        data = client.metadata.get(msg["parent_header"].get("msg_id"), {}).get("data", {})
        message = data.pop(_DATA_KEY, None)
        if message is not None:
            self.accept(message)


class _IPPJob(Job):
    def __init__(self, client: ipp.Client, async_result, ranks: list[int], engine_ids: list[int],
                 events: _IOPubEventQueue | None = None, exited: Callable[[int], bool] = lambda eid: False):
        super().__init__(ranks)
        self._client = client
        self._exited = exited
        self._ar = async_result
        self._engine_ids = dict(zip(ranks, engine_ids))
        # One message future per rank, in the order the ranks were targeted.
        self._futures = dict(zip(ranks, async_result._children))
        self._seen = {r: {"stdout": 0, "stderr": 0, "outputs": 0} for r in ranks}
        # Notified from ipyparallel's IO thread on every result and output message, so the
        # kernel wakes at once instead of polling on a timer.
        for future in self._futures.values():
            future.add_done_callback(lambda _f: self.notify())
            future.output.add_done_callback(lambda _f: self.notify())
            future.iopub_callbacks.append(lambda _msg: self.notify())
            if events is not None:
                future.iopub_callbacks.append(lambda msg: events.take(client, msg))

    def _replied(self, rank: int) -> bool:
        return self._futures[rank].done()

    def _output_complete(self, rank: int) -> bool:
        # The reply (shell channel) can arrive before the last output (iopub channel).
        return self._futures[rank].output.done()

    def _worker_gone(self, rank: int) -> bool:
        return self._unregistered(rank) or self._exited(self._engine_ids[rank])

    def _unregistered(self, rank: int) -> bool:
        # The controller unregisters an engine whose heartbeats stop (killed with its nanny,
        # or its host left the network) but does not fail a broadcast call it was running:
        # that call would never end.
        return self._engine_ids[rank] not in self._client.ids

    def result(self, rank: int) -> Any:
        if not self._futures[rank].done() and self._exited(self._engine_ids[rank]):
            raise WorkerLost(rank, f"engine {self._engine_ids[rank]}'s process ended")
        if not self._futures[rank].done() and self._unregistered(rank):
            raise WorkerLost(rank, f"engine {self._engine_ids[rank]} is no longer registered with the controller "
                                   "(it stopped answering its heartbeats)")
        value = self._futures[rank].result()
        if isinstance(value, ipp.error.EngineError):
            raise WorkerLost(rank, str(value))
        if isinstance(value, ipp.error.RemoteError) and value.ename == "EngineError":
            # The controller's word for "the engine died while running this".
            raise WorkerLost(rank, "its engine died while running the cell")
        if isinstance(value, ipp.error.RemoteError):
            # Our worker functions catch everything; a RemoteError here is the engine itself
            # failing to load or run them.
            raise WorkerCallFailed(rank, f"{value.ename}: {value.evalue}")
        if isinstance(value, BaseException):
            raise WorkerLost(rank, repr(value))
        return value

    def new_output(self) -> list[Output]:
        out: list[Output] = []
        for rank, future in self._futures.items():
            md = future.output.metadata
            seen = self._seen[rank]
            for stream in ("stdout", "stderr"):
                text = md.get(stream) or ""
                if len(text) > seen[stream]:
                    out.append(Output(rank, stream, text[seen[stream]:]))
                    seen[stream] = len(text)
            outputs = md.get("outputs") or []
            for item in outputs[seen["outputs"]:]:
                out.append(Output(rank, "display", data=item.get("data", {}), metadata=item.get("metadata", {})))
            seen["outputs"] = len(outputs)
        return out

    def release(self) -> None:
        # The client keeps every result and its metadata; results may hold whole models.
        for msg_id in self._ar.msg_ids:
            self._client.results.pop(msg_id, None)
            self._client.metadata.pop(msg_id, None)
            self._client._futures.pop(msg_id, None)
            self._client._output_futures.pop(msg_id, None)


def _await_routes(client: ipp.Client, engine_ids: list[int], timeout: float) -> dict[int, int]:
    """Wait until every engine answers a call through each route the backend sends calls by:
    its own (submit_each) and the broadcast scheduler (submit).

    The controller counts an engine as registered once its heartbeats arrive, while the
    engine's connections to the schedulers may still be completing (CurveZMQ handshakes,
    slow on a loaded machine); a scheduler drops a message for an engine it has no
    connection to yet, in silence, and a cell's call lost that way never answers. A
    probe lost that way is sent again. Only for engines this backend started: those of a
    cluster it connects to registered long ago, and may be busy with others' work.
    """
    deadline = time.monotonic() + timeout
    pending = [(eid, route) for eid in engine_ids for route in ("own", "broadcast")]
    pids = {}
    while pending:
        sent = {}
        for eid, route in pending:
            view = client[eid] if route == "own" else client.broadcast_view(targets=[eid])
            sent[(eid, route)] = view.apply_async(os.getpid)
        again_at = min(deadline, time.monotonic() + PROBE_AGAIN_S)
        while not all(ar.ready() for ar in sent.values()) and time.monotonic() < again_at:
            time.sleep(0.01)
        pending = [key for key, ar in sent.items() if not ar.ready()]
        pids.update({eid: ar.get() for (eid, route), ar in sent.items()
                     if route == "own" and ar.ready() and ar.successful()})
        for ar in sent.values():
            for msg_id in ar.msg_ids:  # answered or lost: nothing of it is kept
                client.results.pop(msg_id, None)
                client.metadata.pop(msg_id, None)
        if pending and time.monotonic() >= deadline:
            raise ClusterError(f"engines {sorted({eid for eid, _ in pending})} registered but did not answer a "
                               f"call within {timeout:.0f} s")
        if pending:
            log.debug("engines %s did not answer a probe; sending again", pending)
    return pids


def _shut_engines(client: ipp.Client, engines: list) -> None:
    """Ask every engine to exit, and wait (5 s at most) until they did: `engines`, the
    processes of those started here, or else the controller's list."""
    try:
        # Engines asked to exit through the API exit cleanly (code 0); a SIGTERM'd engine
        # exits 1 and ipyparallel dumps its whole log into the notebook. Not blocking: a
        # wedged engine would never answer; it is reaped by its launcher's stop.
        client.shutdown(targets="all", hub=False, block=False)
    except Exception:  # a dead engine cannot answer; stopping its launcher still reaps it
        log.debug("engine shutdown request failed", exc_info=True)
    # The client must not close before the engines are gone: closing it at once drops the
    # queued shutdown request, and every stop then waited out the 5 s. Engines elsewhere (a
    # Slurm job's) are gone once the controller no longer lists them.
    if engines:
        processes.wait(engines, 5)
    else:
        deadline = time.monotonic() + 5
        while client.ids and time.monotonic() < deadline:
            time.sleep(0.05)


class IPyParallelBackend(Backend):
    """Workers are ipyparallel engines; rank i is the i-th engine id."""

    name = "ipyparallel"
    connect_help = "an ipyparallel --profile NAME (and --cluster-id ID), or its ipcontroller-*-client.json file"

    @classmethod
    def parse_address(cls, address: str | None, options: dict) -> dict | None:
        url_file = options.get("url_file") or (address if address and address.endswith(".json") else None)
        where = {k: v for k, v in dict(profile=options.get("profile"), cluster_id=options.get("cluster_id"),
                                        url_file=url_file).items() if v}
        if not where:
            return None
        if address and (address != url_file or options.get("profile") or options.get("cluster_id")):
            raise ValueError(f"give a cluster's address ({address}) or an ipyparallel --profile/--cluster-id, not both")
        if options.get("tls"):
            raise ValueError("TLS files go with a Dask scheduler's tls:// address; an ipyparallel controller's "
                             "connection file carries its own keys")
        return where

    fork_workers = Bool(True, config=True,
                        help="Local engines are forks of a template process that imported torch and the worker "
                             "code once, started at %load_ext and kept across restarts (Linux); False: each engine "
                             "is a new Python process.")

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._cluster: ipp.Cluster | None = None
        self._client: ipp.Client | None = None
        self._engine_ids: list[int] = []
        self._events: _IOPubEventQueue | None = None
        self._processes: dict[int, psutil.Process] = {}
        self._ended_at: dict[int, float] = {}  # engine id -> when its process was first seen ended
        self._replaceable = False  # engines of our own local launcher: replace_workers keeps the controller
        self._watch: processes.Watch | None = None  # the started cluster's (see processes)

    # -- lifecycle -----------------------------------------------------------------
    def warm_up(self) -> None:
        if self.fork_workers and not {"engines", "engine_launcher_class"} & set(self.cluster_options):
            forkserver.template(TEMPLATE_PRELOAD)

    def start(self, n: int, timeout: float, launcher: Launcher | None = None) -> None:
        if self._client is not None:
            raise ClusterError("the ipyparallel cluster is already running")
        deadline = time.monotonic() + timeout
        launcher = launcher or Launcher()
        address = launcher.listen_address()
        options = dict(
            n=n,
            controller_ip=address,
            controller_location=address,
            # --nodb: the controller would otherwise keep every result (whole models) forever.
            # CurveZMQ: every local user can reach the controller's loopback ports; without
            # the server key (in the owner-only connection files) no one completes a
            # handshake. HMAC signing alone leaves ZeroMQ's own frames open: one garbage
            # connection to the controller's iopub port unsubscribed the kernel from every
            # worker's output.
            controller_args=[f"--ping={HEARTBEAT_MS}", f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
                             "--nodb", "--IPController.enable_curve=True"],
            engine_timeout=int(timeout),
            # Engines start with the controller, not a second after it: they wait for its
            # connection file themselves (IPEngine.wait_for_url_file).
            delay=0,
            # ipyparallel logs a stopped engine's whole output as a warning when its exit
            # code is not 0, which happens now and then on a clean shutdown request; the
            # user does not need that in the notebook. Start failures are reported by us.
            log=_quiet_cluster_log,
            shutdown_atexit=True,
            # ipyparallel's cluster file (world-readable, for `ipcluster list`) is not needed:
            # this backend holds the cluster. The connection files it keeps are owner-only.
            cluster_file="",
        )
        # Local processes are forks of the kernel's worker template (see forkserver).
        fork = self.fork_workers and forkserver.supported()
        watch = self._watch = processes.watch()  # what the kernel's watcher ends and removes if the kernel dies
        if not {"controller", "controller_launcher_class"} & set(self.cluster_options):
            options["controller_launcher_class"] = _controller(fork, watch)
        if isinstance(launcher, SlurmLauncher):
            launcher.check(tasks=n, worker_per_job=False)
            options["engine_launcher_class"] = _slurm_engines(launcher)
        elif isinstance(launcher, MPILauncher):
            options["engine_launcher_class"] = _mpi_engines(launcher, n)
        elif not {"engines", "engine_launcher_class"} & set(self.cluster_options):
            options["engine_launcher_class"] = _local_engines(fork, timeout, watch)  # exit codes kept
            self._replaceable = True
            # Not once the controller wrote it: they read its connection file themselves.
            options["send_engines_connection_env"] = False
        options.update(self.cluster_options)
        cluster = ipp.Cluster(**options)
        _keep_private(cluster)
        _watch_files(cluster, watch)
        if isinstance(launcher, SlurmLauncher):
            launcher.find_jobs = lambda: [getattr(s, "job_id", "") for s in cluster.engines.values()]
        try:
            # Not start_and_connect: it waits for the engines start_timeout s, a pending Slurm job too.
            cluster.start_cluster_sync(n)
            with _unsigned_is_expected():
                client = cluster.connect_client_sync()

            def ready(seconds: float) -> bool:
                try:
                    client.wait_for_engines(n, timeout=seconds, interactive=False)  # no progress widget: ours says it
                    return True
                except TimeoutError:
                    return False

            launcher.wait_for_workers(ready, n, timeout)
            pids = _await_routes(client, sorted(client.ids)[:n], max(deadline - time.monotonic(), 2 * PROBE_AGAIN_S))
            _keep_private(cluster)
            watch.add_processes(self._local_processes(cluster))  # those of launchers other than ours (mpiexec)
        except BaseException as exc:  # not engine_errors: the engines' own output says more than ours
            detail = _startup_failure(cluster) or str(exc)
            try:
                cluster.stop_cluster_sync()
            except Exception:  # already half-down; the original error is what matters
                log.debug("cleanup after failed start", exc_info=True)
            else:
                watch.close()
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise ClusterError(f"could not start {n} ipyparallel engines: {detail}"
                               + ("; fix the engines' environment and run the cell again"
                                  if detail != str(exc) else "")) from exc
        self._cluster, self._client = cluster, client
        self._engine_ids = sorted(client.ids)[:n]
        self._track(pids)

    @property
    def replaces_workers(self) -> bool:
        controller = self._cluster.controller if self._cluster is not None else None
        process = getattr(controller, "process", None)
        return self._replaceable and self._client is not None and process is not None and process.is_running()

    def replace_workers(self, n: int, timeout: float) -> None:
        if not self.replaces_workers:
            return super().replace_workers(n, timeout)
        client, cluster = self._client, self._cluster
        assert client is not None and cluster is not None  # as replaces_workers found
        deadline = time.monotonic() + timeout
        _shut_engines(client, self.local_processes()[1:])
        cluster.stop_engines_sync()
        # A killed engine stays on the controller's list until its heartbeats are missed.
        stale = set(client.ids)
        self._engine_ids, self._processes = [], {}
        try:
            cluster.start_engines_sync(n)
            while len(set(client.ids) - stale) < n:
                failed = _startup_failure(cluster)
                if failed or time.monotonic() > deadline:
                    raise ClusterError(failed or f"{n} new engines did not register within {timeout:.0f} s")
                time.sleep(0.01)
            engine_ids = sorted(set(client.ids) - stale)[:n]
            pids = _await_routes(client, engine_ids, max(deadline - time.monotonic(), 2 * PROBE_AGAIN_S))
        except ClusterError as exc:
            raise ClusterError(f"could not start {n} new ipyparallel engines: {exc}") from exc
        self._engine_ids = engine_ids
        self._track(pids)

    def _track(self, pids: dict[int, int]) -> None:
        # The processes of engines started here, by engine id: their end is seen at once,
        # not when the controller misses their heartbeats (seconds later). A pid an engine
        # elsewhere reports (a Slurm node's) is used only if it is one of our launchers'.
        ours = {p.pid: p for p in self.local_processes()[1:]}
        self._processes = {eid: ours[pid] for eid, pid in pids.items() if pid in ours}
        self._ended_at = {}

    def connect(self, n: int | None, timeout: float, *, profile: str | None = None,
                cluster_id: str | None = None, url_file: str | None = None, **unknown: Any) -> None:
        """Attach to a running ipcluster: its profile (and cluster id), or its client JSON file."""
        if unknown:
            raise ClusterError(f"an ipyparallel cluster is found by profile, cluster id or url file, not {sorted(unknown)}")
        if self._client is not None:
            raise ClusterError("already attached to an ipyparallel cluster")
        where = url_file or f"profile {profile or 'default'}" + (f", cluster id {cluster_id}" if cluster_id else "")

        def unanswered(exc: BaseException) -> str:
            hint = (f" (no answer within {CONNECT_TIMEOUT_S:.0f} s: is the cluster still running?)"
                    if isinstance(exc, TimeoutError) else "")
            return f"{type(exc).__name__}: {' '.join(str(exc).split())}{hint}"  # ipyparallel's messages span lines

        # A controller answers at once; ZeroMQ retries a refused port in silence, so a
        # stale connection file would otherwise hold the notebook for `timeout` (120 s).
        with engine_errors(f"could not connect to the ipyparallel controller ({where})", detail=unanswered):
            if url_file:
                client = ipp.Client(url_file, timeout=CONNECT_TIMEOUT_S)
            else:
                client = ipp.Client(profile=profile or "default", cluster_id=cluster_id or "", timeout=CONNECT_TIMEOUT_S)
        with engine_errors(f"the ipyparallel cluster ({where}) did not offer {n} engines within {timeout:.0f} s",
                           cleanup=client.close, detail=str):
            if n:
                client.wait_for_engines(n, timeout=timeout, interactive=False)
        if not client.ids:
            client.close()
            raise ClusterError(f"the ipyparallel cluster ({where}) has no engines")
        self._client, self.owns_cluster = client, False
        self._engine_ids = sorted(client.ids)[:n] if n else sorted(client.ids)

    def stop(self) -> None:
        if not self.owns_cluster:  # someone else's cluster: disconnect only
            client, self._client, self._engine_ids = self._client, None, []
            if client is not None:
                client.close()
            return
        client, cluster = self._client, self._cluster
        engines = self.local_processes()[1:]
        self._client = self._cluster = None
        self._engine_ids, self._processes, self._ended_at = [], {}, {}
        if client is not None:
            _shut_engines(client, engines)
            client.close()
        if cluster is not None:
            cluster.stop_cluster_sync()
            # The controller's list of its engines outlives it (only a shutdown of the hub
            # itself removes it): one file per cluster piled up in the profile's log.
            with contextlib.suppress(OSError):
                os.remove(os.path.join(cluster.profile_dir, "log", f"engines{cluster.cluster_id}.json"))
            if self._watch is not None:
                self._watch.close()
                self._watch = None

    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def size(self) -> int:
        return len(self._engine_ids)

    def describe(self) -> dict:
        if self._cluster is None:
            return {"engine_ids": list(self._engine_ids), "connected": True} if self._client else {}
        info = {
            "cluster_id": self._cluster.cluster_id,
            "profile_dir": self._cluster.profile_dir,
            "engine_ids": list(self._engine_ids),
        }
        if self._client is not None:  # where the controller listens (registration)
            info["controller"] = getattr(self._client, "_config", {}).get("registration", "")
        return info

    def order_ranks(self, order: list[int]) -> None:
        self._engine_ids = [self._engine_ids[i] for i in order]

    def open_events(self) -> metrics.EventQueue:
        self._events = _IOPubEventQueue()
        return self._events

    def contact_address(self) -> str | None:
        if self._client is None:
            return None
        config = getattr(self._client, "_config", {})
        host = config.get("registration", "").rpartition(":")[0].split("://")[-1]
        if host in ("", "*", "0.0.0.0"):  # a controller on every interface: where clients are told to go
            host = config.get("location") or None
        return host

    def exit_code(self, pid: int) -> int | None:
        for launcher in _engine_launchers(self._cluster).values():
            if getattr(launcher, "pid", None) == pid:
                return getattr(launcher, "seen_exit_code", None)
        return None

    def local_processes(self) -> list:
        """psutil handles of the controller and engine processes this backend started."""
        return self._local_processes(self._cluster)

    @staticmethod
    def _local_processes(cluster: ipp.Cluster | None) -> list:
        if cluster is None:
            return []
        launchers = [cluster.controller]
        for engine_set in cluster.engines.values():
            launchers.extend(getattr(engine_set, "launchers", {}).values())
        return [launcher.process for launcher in launchers
                if launcher is not None and getattr(launcher, "process", None) is not None]

    # -- calls ---------------------------------------------------------------------
    def _require_client(self) -> ipp.Client:
        if self._client is None:
            raise ClusterError("no ipyparallel cluster is running")
        for rank in self.dead_ranks():
            eid = self._engine_ids[rank]
            raise WorkerLost(rank, f"engine {eid} " + ("ended" if self._exited(eid)
                                                      else "is no longer registered with the controller"))
        return self._client

    def submit(self, fn: Callable, *args: Any, ranks: list[int] | None = None) -> Job:
        client = self._require_client()
        ranks = list(range(self.size)) if ranks is None else list(ranks)
        # A broadcast view sends the message (and its buffers) once to the controller,
        # which fans it out: the kernel's cost does not grow with the number of workers.
        view = client.broadcast_view(targets=[self._engine_ids[r] for r in ranks])
        ar = view.apply_async(_call, fn, *args)
        return _IPPJob(client, ar, ranks, [self._engine_ids[r] for r in ranks], self._events, self._exited)

    def _exited(self, eid: int) -> bool:
        """Whether the process of an engine started here ended (EXIT_GRACE_S ago: a reply it
        sent as it exited may still be on its way)."""
        process = self._processes.get(eid)
        if process is None:
            return False
        if processes.alive(process):
            return False
        return time.monotonic() - self._ended_at.setdefault(eid, time.monotonic()) >= EXIT_GRACE_S

    def dead_ranks(self) -> list[int]:
        if self._client is None:
            return []
        registered = set(self._client.ids)
        return [rank for rank, eid in enumerate(self._engine_ids) if eid not in registered or self._exited(eid)]

    def channel_server(self) -> Callable[..., int] | None:
        return _serve_channel

    def submit_each(self, fn: Callable, args_per_rank: list[tuple]) -> Job:
        client = self._require_client()
        children = []
        for rank, args in enumerate(args_per_rank):
            ar = client[self._engine_ids[rank]].apply_async(_call, fn, *args)
            children.extend(ar._children)
        combined = ipp.AsyncResult(client, children, fname=getattr(fn, "__name__", "call"), targets=self._engine_ids)
        return _IPPJob(client, combined, list(range(self.size)), list(self._engine_ids), self._events, self._exited)

    def interrupt(self, ranks: list[int], run: str | None = None) -> None:
        # A signal carries no run id; an engine cut off from the controller is unregistered
        # by it and not used again, so no late SIGINT reaches a later cell.
        client = self._client
        if client is None:
            return
        registered = set(client.ids)
        targets = [self._engine_ids[r] for r in ranks if self._engine_ids[r] in registered]
        if targets:
            client.send_signal(signal.SIGINT, targets=targets, block=False)
