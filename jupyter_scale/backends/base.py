"""The protocol every engine implements: a Backend starts (or attaches to) workers and runs
calls on them; a Job is one call on every rank, its replies and the output it printed.

Rules an engine keeps:
- results come in rank order; rank i is the same worker until `order_ranks` renumbers;
- a call's output reaches `new_output()` before the rank is `done()`, or within
  OUTPUT_GRACE_S of its reply;
- `interrupt` raises KeyboardInterrupt in the cell of the named run only, never in a
  later cell or between cells;
- `stop()` leaves no process that `start()` started; a cluster it attached to lives on;
- an engine module imports its engine's package when it is loaded (entry points load
  only the engine asked for).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import pickle
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, SupportsIndex

from traitlets import Dict
from traitlets.config import LoggingConfigurable
from traitlets.traitlets import MetaHasTraits

from .. import processes
from ..errors import ClusterError
from ..launchers import Launcher
from ..processes import descendants as descendants  # re-exported (the session's import)
from ..processes import end
from ..protocol import Output

log = logging.getLogger(__name__)
# How long `connect` waits for a scheduler or controller to answer. One that is there
# answers in milliseconds; a wrong address (a refused port, a stale connection file) fails
# within 10 s instead of the start timeout (120 s). Workers then get the start timeout.
CONNECT_TIMEOUT_S = 8.0
# How long a rank's output may trail its reply before the rank counts as done anyway.
OUTPUT_GRACE_S = 2.0


class Job(abc.ABC):
    """One function running on every worker (or on some ranks).

    An engine says whether a rank's reply has arrived (`_replied`), whether all the output
    the call printed has (`_output_complete`: a reply can overtake its last output on
    engines that carry them apart), and whether the rank's worker is gone (`_worker_gone`);
    this class makes `done` of those, with one grace for late output. Output is queued with
    `accept_output` (from any thread) and each arrival wakes `wait_activity`.
    """

    ranks: list[int]

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)
        self._outputs: deque[Output] = deque()
        self._activity = threading.Event()
        self._replied_at: dict[int, float] = {}

    @abc.abstractmethod
    def _replied(self, rank: int) -> bool:
        """The engine holds `rank`'s reply: a return value or the call's error."""

    def _output_complete(self, rank: int) -> bool:
        """Everything the call printed on `rank` has arrived (asked once it replied)."""
        return True

    @abc.abstractmethod
    def _worker_gone(self, rank: int) -> bool:
        """The worker of `rank` is known to be gone: its reply will never come."""

    @abc.abstractmethod
    def result(self, rank: int) -> Any:
        """The return value of a finished rank; raises WorkerLost if its worker died, and
        WorkerCallFailed if the engine could not run the call at all."""

    def done(self, rank: int) -> bool:
        """Whether `rank` has finished (returned, raised, or its worker was lost)."""
        if not self._replied(rank):
            return self._worker_gone(rank)
        if self._output_complete(rank):
            return True
        # The last output may never come (a worker that died as it answered): not long.
        first_seen = self._replied_at.setdefault(rank, time.monotonic())
        return time.monotonic() - first_seen > OUTPUT_GRACE_S

    def accept_output(self, outputs: Iterable[Output]) -> None:
        self._outputs.extend(outputs)
        self.notify()

    def new_output(self) -> list[Output]:
        """Output produced since the last call, in arrival order per rank."""
        out = []
        while self._outputs:
            out.append(self._outputs.popleft())
        return out

    def notify(self) -> None:
        """A reply or output arrived (any thread): wakes `wait_activity`."""
        self._activity.set()

    def wait_activity(self, timeout: float) -> None:
        """Block until a result or output may have arrived, or `timeout` passed."""
        self._activity.wait(timeout)
        self._activity.clear()

    # A no-op by default, not abstract: only engines that keep something override it.
    def release(self) -> None:  # noqa: B027
        """Drop whatever the engine keeps of this job (results can be large). Called again,
        it does nothing."""

    def wait(self, timeout: float, poll: float = 0.1) -> list[Any]:
        """Block until every rank finished; the results in rank order, and the job released
        (what an engine keeps of a call can come back: Dask computes a result still wanted
        again when its worker dies). When the wait fails the job is the caller's to stop
        or release."""
        deadline = time.monotonic() + timeout
        while not all(self.done(r) for r in self.ranks):
            if time.monotonic() > deadline:
                pending = [r for r in self.ranks if not self.done(r)]
                raise ClusterError(f"ranks {pending} did not answer within {timeout:.0f} s")
            self.wait_activity(poll)
        try:
            return [self.result(r) for r in self.ranks]
        finally:
            self.release()


class _Configurable(MetaHasTraits, abc.ABCMeta):
    """traitlets' metaclass with abstract methods."""


class Backend(LoggingConfigurable, metaclass=_Configurable):
    """The engine-specific part: workers, calls, signals.

    A child of the session in traitlets' sense: `c.DaskBackend.cluster_options = {...}` in a
    Jupyter config file (or the session's config) reaches the engine the session makes.
    """

    name: str = ""
    hub: str = "controller"  # what the engine calls the process its workers report to
    # True for a cluster this backend started (stop() ends its processes); False for one
    # it connected to (stop() only disconnects: the cluster is someone else's).
    owns_cluster: bool = True
    # Connecting makes the workers in the cluster (Ray's actors), so stop() ends them; the
    # cluster lives on. Otherwise the workers are the cluster's and outlive the connection.
    creates_workers: bool = False
    # Connecting (see parse_address): asked last, for a host:port no other engine claims.
    fallback: bool = False
    connect_help: str = ""  # how a cluster of this engine is named to %scale connect
    # The launchers (classes of launchers.LAUNCHERS) this engine starts workers with; `start`
    # gets no other (see check_launcher). A new launcher is refused until an engine names it.
    launchers: tuple[type[Launcher], ...] = (Launcher,)
    # What a user does instead where this engine refuses a launcher (the rest of the error).
    instead_of_launcher: str = "start the cluster yourself and %scale connect to it"

    cluster_options = Dict(config=True, help="Keyword arguments for the engine's own cluster when it starts one "
                                             "(ipyparallel.Cluster; Dask's LocalCluster or SLURMCluster), over "
                                             "jupyter_scale's own.")

    @classmethod
    def parse_address(cls, address: str | None, options: dict) -> dict | None:
        """The keyword arguments of `connect` for what the user connects to: `address` and
        the options given (profile, cluster_id, url_file, tls), or None when they do not
        name a cluster of this engine. Raises ValueError for an address of this engine
        with options it cannot take."""
        return None

    def warm_up(self) -> None:  # noqa: B027
        """Prepare what would make a later local `start` faster (its fork server), in the
        background; called when the extension loads."""

    def check_launcher(self, launcher: Launcher) -> None:
        """Raise ClusterError, one line, unless this engine starts workers with `launcher`."""
        # By exact class: every launcher is a Launcher (the local one) too.
        if type(launcher) not in self.launchers:
            raise ClusterError(f"{self.name} cannot start its workers with the {launcher.name} launcher; "
                               f"{self.instead_of_launcher}")

    @abc.abstractmethod
    def start(self, n: int, timeout: float, launcher: Launcher | None = None) -> None:
        """Start a cluster of `n` workers and wait for them: local (loopback only), or where
        `launcher` (one of `launchers`) says, through the engine's own launcher for it."""

    @property
    def replaces_workers(self) -> bool:
        """Whether `replace_workers` can renew this cluster's workers (else the session
        restarts the whole cluster)."""
        return False

    def replace_workers(self, n: int, timeout: float) -> None:
        """Stop the workers and start `n` new ones, keeping the rest of the cluster (its
        controller or scheduler). Raises ClusterError when the new workers do not start."""
        raise ClusterError(f"the {self.name} backend cannot replace its workers")

    def connect(self, n: int | None, timeout: float, **where: Any) -> None:
        """Attach to a running cluster; use `n` of its workers (default: all it has)."""
        raise ClusterError(f"the {self.name} backend cannot connect to a running cluster")

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop what `start` started (none of its processes remain), or disconnect."""

    @property
    @abc.abstractmethod
    def running(self) -> bool: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @abc.abstractmethod
    def submit(self, fn: Callable, *args: Any, ranks: list[int] | None = None) -> Job:
        """Run fn(*args) on every worker (or on `ranks`); the same arguments everywhere, sent once."""

    @abc.abstractmethod
    def submit_each(self, fn: Callable, args_per_rank: list[tuple]) -> Job:
        """Run fn(*args_per_rank[rank]) on each worker."""

    @abc.abstractmethod
    def interrupt(self, ranks: list[int], run: str | None = None) -> None:
        """Deliver SIGINT (KeyboardInterrupt) to the given ranks' workers; where the engine
        can, only while they run the cell of `run` (the request's run id)."""

    def dead_ranks(self) -> list[int]:
        """Ranks whose worker process is known to be gone."""
        return []

    def gone_ranks(self) -> list[int]:
        """Ranks whose worker is gone, as a waiting job asks at every turn: from what the
        engine last heard where dead_ranks would ask a server (Dask)."""
        return self.dead_ranks()

    def channel_server(self) -> Callable[..., int] | None:
        """A worker-side function, `fn(directory, identity, rank) -> pid`, that serves the
        kernel's direct channel (channel.serve) where this engine runs its calls; None
        where the engine has no way to. The session uses it for workers on its host."""
        return None

    # Whether exit_code can tell how a worker ended (Ray reaps its workers and cannot).
    knows_exit_codes: bool = True

    def exit_code(self, pid: int) -> int | None:
        """How a worker process this backend started ended: its exit status, or minus the
        signal that killed it; None while it runs or where the engine cannot tell."""
        return None

    def order_ranks(self, order: list[int]) -> None:
        """Renumber the workers: rank i becomes the worker that was rank order[i] (the session
        puts each host's ranks together, as torchrun numbers them)."""
        if order != list(range(self.size)):
            raise ClusterError(f"the {self.name} backend cannot renumber its workers")

    def contact_address(self) -> str | None:
        """The IP address at which the workers reach the cluster (its controller or
        scheduler): each worker says which of its addresses it reaches it from, which is
        where the process group meets (see rendezvous.choose_rendezvous_address)."""
        return None

    def describe(self) -> dict:
        """Engine-specific facts for `%scale status` (addresses, ids)."""
        return {}

    def local_processes(self) -> list:
        """psutil handles of the processes `start` started (workers first where it can tell)."""
        return []

    # What the kernel's watcher ends and removes if the kernel dies before `stop` (see
    # processes): an engine registers its cluster's processes and files as it makes them, and
    # closes it in `stop`.
    _watch: processes.Watch | None = None

    def tie_to_kernel(self, pids: list[int]) -> None:
        """Have the kernel's watcher end these processes of this host (workers the engine does
        not know as its own: a Slurm job's on this node), and what they started, if the kernel
        dies before stopping the cluster."""
        if self._watch is None:
            self._watch = processes.watch()
        self._watch.add_processes(pids)

    def open_events(self):
        """The kernel's end of the workers' event stream (metrics.EventQueue).

        By default a ZeroMQ socket on the kernel's loopback; an engine whose workers may run
        elsewhere returns a queue fed by its own channel.
        """
        from ..metrics import EventStream

        return EventStream()


class Frames:
    """Values, some of them big buffers, that travel as one object of the engine's.

    Buffers go out of band where the link pickles with protocol 5 (Dask worker to worker and
    client to worker, Ray's object store); where it pickles with protocol 4 they are copied in.
    """

    def __init__(self, frames: list, in_band: bool = False):
        self.frames = frames
        self.in_band = in_band  # copied in even at protocol 5 (Ray Client never delivers a PickleBuffer)

    def __reduce_ex__(self, protocol: SupportsIndex):
        if int(protocol) >= 5 and not self.in_band:  # a PickleBuffer travels as a separate frame, uncopied
            frames = [pickle.PickleBuffer(f) if isinstance(f, memoryview) else f for f in self.frames]
        else:  # a memoryview cannot be pickled at all
            frames = [bytes(f) if isinstance(f, (memoryview, pickle.PickleBuffer)) else f for f in self.frames]
        return (Frames, (frames, self.in_band))


def split_frames(args: tuple) -> tuple[tuple, list]:
    """A call's arguments as (the leading ones, the trailing buffers): the shipped frames,
    which an engine sends once for every rank rather than with each rank's call."""
    split = len(args)
    while split > 0 and isinstance(args[split - 1], (bytes, bytearray, memoryview)):
        split -= 1
    return args[:split], list(args[split:])


def end_processes(found: list, timeout: float) -> None:
    """processes.end (SIGTERM, `timeout` s, SIGKILL), under the name the session imports."""
    end(found, grace=timeout)


def describe_exit(code: int | None) -> str:
    """'killed by SIGKILL', 'exited with status 1', or '' when unknown."""
    if code is None:
        return ""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


@contextlib.contextmanager
def engine_errors(what: str, cleanup: Callable[[], Any] | None = None,
                  detail: Callable[[BaseException], str | None] | None = None) -> Iterator[None]:
    """Whatever the engine raises inside becomes one line, "{what}: {detail}", with the
    engine's exception as its cause. `cleanup` first stops what was half started (its own
    failure is logged, not raised); `detail(exc)` says more where it can (None: the default,
    the exception's type and message). An interrupt, and an error already ours, pass as
    they are."""
    try:
        yield
    except BaseException as exc:
        if cleanup is not None:
            try:
                cleanup()
            except Exception:  # already half down: the original error is what matters
                log.debug("cleaning up after %s failed", what, exc_info=True)
        if isinstance(exc, (KeyboardInterrupt, ClusterError)):
            raise
        said = (detail(exc) if detail is not None else None) or f"{type(exc).__name__}: {exc}"
        raise ClusterError(f"{what}: {said}") from exc
