"""ipyparallel engine: rank i is the i-th engine of a cluster this backend starts (a controller
and N engines, locally, on Slurm or under MPI: backends.ipyparallel_cluster) or of a running one
it connects to. Calls reach the engines through the controller; what they print, and the
metrics batches, come back on each engine's IOPub stream."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import ipyparallel as ipp
import psutil
from traitlets import Bool

from .. import forkserver, metrics, processes
from ..errors import ClusterError
from ..launchers import Launcher, MPILauncher, SlurmLauncher
from . import Backend, Job, Output, WorkerCallFailed, WorkerLost, channel, engine_errors
from . import ipyparallel_cluster as launch

# How long after its process ended an engine counts as lost (its last reply may be on its way).
EXIT_GRACE_S = 0.3


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


class IPyParallelBackend(Backend):
    """Workers are ipyparallel engines; rank i is the i-th engine id."""

    name = "ipyparallel"
    launchers = (Launcher, SlurmLauncher, MPILauncher)
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
                        help="The controller and local engines are forks of multiprocessing's fork server, which "
                             "imported torch and the worker code once, started at %load_ext and kept across restarts "
                             "(Linux); False: each is a new Python process.")

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
            forkserver.multiprocessing_server(launch.FORK_PRELOAD, os.environ)

    def start(self, n: int, timeout: float, launcher: Launcher | None = None) -> None:
        if self._client is not None:
            raise ClusterError("the ipyparallel cluster is already running")
        # Local processes are forks of the kernel's fork server (see forkserver).
        started = launch.start(n, timeout, launcher or Launcher(), self.cluster_options,
                               fork=self.fork_workers and forkserver.supported())
        self._cluster, self._client, self._watch = started.cluster, started.client, started.watch
        self._replaceable, self._engine_ids = started.replaceable, started.engine_ids
        self._track(started.pids)

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
        self._engine_ids, self._processes = [], {}
        self._engine_ids, pids = launch.renew_engines(cluster, client, n, timeout)
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
        client = launch.connect(where, profile, cluster_id, url_file)
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
            launch.shut_engines(client, engines)
            client.close()
        if cluster is not None:
            launch.stop(cluster)
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
        for launcher in launch.engine_launchers(self._cluster).values():
            if getattr(launcher, "pid", None) == pid:
                return getattr(launcher, "seen_exit_code", None)
        return None

    def local_processes(self) -> list:
        """psutil handles of the controller and engine processes this backend started."""
        return launch.local_processes(self._cluster)

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
