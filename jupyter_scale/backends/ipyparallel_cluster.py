"""The ipyparallel engine's cluster, below its calls: the controller and engines it starts,
locally, on Slurm or under MPI, or a running cluster it connects to (backends.ipyparallel
holds the engine).

The controller and local engines are programs of ours (programs/ipp_controller, ipp_engine)
forked from the kernel's fork server (forkserver.fork) where they can be, else started as new
processes; on Slurm the engines are one job of N tasks, under MPI `mpiexec -n N`. Each process
is given to the cluster's watch as it starts (processes.watch), and the cluster's files in the
profile are owner-only. `start` returns once every engine answers calls through both routes
the engine sends them by (`await_routes`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, NamedTuple

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
from traitlets import Dict, Float, List, Unicode

from .. import forkserver, processes, programs
from ..errors import ClusterError
from ..launchers import Launcher, MPILauncher, SlurmLauncher
from .base import CONNECT_TIMEOUT_S, describe_exit, engine_errors

log = logging.getLogger(__name__)
_quiet_cluster_log = logging.getLogger(__name__ + ".ipp")
_quiet_cluster_log.setLevel(logging.ERROR)

# The controller pings engines this often (ms), and unregisters one that missed this many in
# a row: ipyparallel's default (3 s x 10) takes 30 s to notice a dead engine; 5 s here. A new
# engine is registered at the first ping it answers: the short period makes that ~50 ms.
HEARTBEAT_MS = 100
HEARTBEAT_MISSES = 50
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

# What the fork server imports once (forkserver): all the controller and an engine import
# to start, and the worker code an engine's first call imports.
FORK_PRELOAD = ["jupyter_scale.worker", "jupyter_scale.backends.ipyparallel", "ipyparallel.engine.app",
                "ipyparallel.controller.app"]
# How long a start waits for a fork server still importing: longer than importing anew would
# take; then the process starts the usual way.
FORK_WAIT_S = 30.0


class _Forked:
    """A local launcher (mixed in before it) whose process is forked from the kernel's fork
    server instead of started anew; the server, which reaps it, says how it ended. Where it
    cannot, the process starts the usual way. Either way the process is given to the
    cluster's watch as soon as it runs (processes.watch)."""

    fork: bool = False  # whether to fork it (from the kernel's fork server, started anew if it died)
    watch: processes.Watch | None = None  # the cluster's
    program: forkserver.Program | None = None
    seen_exit_code: int | None = None

    def start(self):
        env = os.environ.copy()
        env.update(self.get_env())
        argv = self.args  # [python, program, *ipyparallel's arguments]
        # Popen(cwd=) reads a relative directory against the kernel's; and ipyparallel's apps
        # chdir to a default taken when they were imported (in the server).
        cwd = os.path.abspath(self.work_dir)
        self.program = forkserver.fork(FORK_PRELOAD, argv[1], [*argv[2:], f"--work-dir={cwd}"], env, cwd,
                                       self.output_file, wait=FORK_WAIT_S) if self.fork else None
        if self.program is None:
            return self._watched(super().start())
        self.pid = self.program.pid
        self._watched(None)
        try:
            self.process = psutil.Process(self.pid)
        except psutil.NoSuchProcess:  # ended at once, and the server reaped it
            self.program.wait(1.0)
            how = describe_exit(self.program.exit_code()) or "ended"
            raise ClusterError(f"{self.identifier} {how} as it started (its output: {self.output_file})") from None
        self.notify_start(self.pid)
        LocalProcessLauncher._start_waiting(self)

    def _watched(self, result: Any) -> Any:
        if self.watch is not None and getattr(self, "pid", None):
            self.watch.add_processes([self.pid])
        return result

    def _wait(self):
        if self.program is None:
            return super()._wait()
        while not self._stop_waiting.is_set() and self.state == "running":
            if self.program.wait(1.0):
                break
        self.seen_exit_code = self.program.exit_code()
        stop_data = dict(exit_code=self.seen_exit_code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))

    def poll(self):
        if self.program is None:
            return super().poll()
        code = self.program.exit_code()
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
    """Local engines, forked from the kernel's fork server if `fork`, each given to the
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


def engine_launchers(cluster: ipp.Cluster | None) -> dict:
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
    for ident, launcher in engine_launchers(cluster).items():
        process = getattr(launcher, "process", None)
        if process is None or process.is_running():
            continue
        lines = [line.strip() for line in (launcher.get_output() or "").splitlines() if line.strip()]
        how = describe_exit(getattr(launcher, "seen_exit_code", None)) or "ended"
        found.append(f"engine {ident} {how} while starting" + (f": {lines[-1]}" if lines else ""))
    return "; ".join(found[:2])


class Started(NamedTuple):
    """A cluster `start` started, and its engines (their ids, in order, and pids)."""

    cluster: ipp.Cluster
    client: ipp.Client
    engine_ids: list[int]
    pids: dict[int, int]  # engine id -> the pid it reported
    watch: processes.Watch  # what the kernel's watcher ends and removes if the kernel dies
    replaceable: bool  # engines of our own local launcher: `renew_engines` keeps the controller


def start(n: int, timeout: float, launcher: Launcher, cluster_options: dict, fork: bool) -> Started:
    """Start a controller on `launcher`'s listen address and `n` engines where it says (its
    options over ours: `cluster_options`); local processes forked if `fork` (see forkserver)."""
    deadline = time.monotonic() + timeout
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
        # the backend holds the cluster. The connection files it keeps are owner-only.
        cluster_file="",
    )
    watch = processes.watch()
    replaceable = False
    if not {"controller", "controller_launcher_class"} & set(cluster_options):
        options["controller_launcher_class"] = _controller(fork, watch)
    if isinstance(launcher, SlurmLauncher):
        launcher.check(tasks=n, worker_per_job=False)
        options["engine_launcher_class"] = _slurm_engines(launcher)
    elif isinstance(launcher, MPILauncher):
        options["engine_launcher_class"] = _mpi_engines(launcher, n)
    elif not {"engines", "engine_launcher_class"} & set(cluster_options):
        options["engine_launcher_class"] = _local_engines(fork, timeout, watch)  # exit codes kept
        replaceable = True
        # Not once the controller wrote it: they read its connection file themselves.
        options["send_engines_connection_env"] = False
    options.update(cluster_options)
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
        engine_ids = sorted(client.ids)[:n]
        pids = await_routes(client, engine_ids, max(deadline - time.monotonic(), 2 * PROBE_AGAIN_S))
        _keep_private(cluster)
        watch.add_processes(local_processes(cluster))  # those of launchers other than ours (mpiexec)
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
    return Started(cluster, client, engine_ids, pids, watch, replaceable)


def renew_engines(cluster: ipp.Cluster, client: ipp.Client, n: int,
                  timeout: float) -> tuple[list[int], dict[int, int]]:
    """Stop the engines of a cluster `start` started with our local launcher and start `n` new
    ones, the controller kept; their ids (in order) and pids."""
    deadline = time.monotonic() + timeout
    shut_engines(client, local_processes(cluster)[1:])
    cluster.stop_engines_sync()
    # A killed engine stays on the controller's list until its heartbeats are missed.
    stale = set(client.ids)
    try:
        cluster.start_engines_sync(n)
        while len(set(client.ids) - stale) < n:
            failed = _startup_failure(cluster)
            if failed or time.monotonic() > deadline:
                raise ClusterError(failed or f"{n} new engines did not register within {timeout:.0f} s")
            time.sleep(0.01)
        engine_ids = sorted(set(client.ids) - stale)[:n]
        pids = await_routes(client, engine_ids, max(deadline - time.monotonic(), 2 * PROBE_AGAIN_S))
    except ClusterError as exc:
        raise ClusterError(f"could not start {n} new ipyparallel engines: {exc}") from exc
    return engine_ids, pids


def connect(where: str, profile: str | None, cluster_id: str | None, url_file: str | None) -> ipp.Client:
    """A client of the running cluster of a profile (and cluster id), or of a client JSON file
    (`where` says which, in the error)."""
    def unanswered(exc: BaseException) -> str:
        hint = (f" (no answer within {CONNECT_TIMEOUT_S:.0f} s: is the cluster still running?)"
                if isinstance(exc, TimeoutError) else "")
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}{hint}"  # ipyparallel's messages span lines

    # A controller answers at once; ZeroMQ retries a refused port in silence, so a stale
    # connection file would otherwise hold the notebook for the start's timeout (120 s).
    with engine_errors(f"could not connect to the ipyparallel controller ({where})", detail=unanswered):
        if url_file:
            return ipp.Client(url_file, timeout=CONNECT_TIMEOUT_S)
        return ipp.Client(profile=profile or "default", cluster_id=cluster_id or "", timeout=CONNECT_TIMEOUT_S)


def stop(cluster: ipp.Cluster) -> None:
    """Stop a cluster `start` started (its engines asked first: `shut_engines`)."""
    cluster.stop_cluster_sync()
    # The controller's list of its engines outlives it (only a shutdown of the hub itself
    # removes it): one file per cluster piled up in the profile's log.
    with contextlib.suppress(OSError):
        os.remove(os.path.join(cluster.profile_dir, "log", f"engines{cluster.cluster_id}.json"))


def local_processes(cluster: ipp.Cluster | None) -> list:
    """psutil handles of the controller's and engines' processes started here (the controller first)."""
    if cluster is None:
        return []
    launchers = [cluster.controller]
    for engine_set in cluster.engines.values():
        launchers.extend(getattr(engine_set, "launchers", {}).values())
    return [launcher.process for launcher in launchers
            if launcher is not None and getattr(launcher, "process", None) is not None]


def await_routes(client: ipp.Client, engine_ids: list[int], timeout: float) -> dict[int, int]:
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


def shut_engines(client: ipp.Client, engines: list) -> None:
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
