"""`report(**scalars)` and the event stream from workers to the kernel.

On a worker, `report` stamps each point with rank, step (counted per rank unless given),
epoch and time, and hands it to an `EventSink`: appending to a queue is all the training
loop pays. A sender thread ships the queue in batches every 100 ms over a ZeroMQ PUSH
socket to the kernel's `EventStream` (PULL, bound to 127.0.0.1). The same stream carries
the workers' state changes. Nothing is dropped silently: a batch that cannot be sent is
counted, and the kernel compares what arrived with what each rank says it sent.

Loopback is not a trust boundary: any local user can connect to that port. So each batch
is signed with a key the kernel's queue draws and the workers get in the cell's request
(over the engine's authenticated channel), carries the id of the run (cell) it belongs
to, and must have the shape a sink sends; anything else is counted and dropped.

In the notebook itself (no %%distribute) `report` records locally, so the same cell runs.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import numbers
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import zmq

if TYPE_CHECKING:
    import psutil

log = logging.getLogger(__name__)


def _scalar(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        try:
            return float(value.item())  # also of a tensor that requires grad
        except RuntimeError:
            raise ValueError(f"report({name}=...) takes a scalar; got a tensor of shape {tuple(value.shape)}") from None
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        # numbers.Number declares no __float__; the numbers reported (int, float, numpy's) have one.
        return float(value)  # type: ignore[arg-type]
    if isinstance(value, bool):
        return float(value)
    raise TypeError(f"report({name}=...) takes numbers or one-element tensors, not {type(value).__name__}")


_STAMPED = frozenset(("rank", "time", "kind"))  # set by report itself (a point with its own would be refused)


class Recorder:
    """Collects the points one process reports (and streams them when it has a sink)."""

    def __init__(self, rank: int = 0, sink: EventSink | None = None):
        self.rank = rank
        self.sink = sink
        self.points: list[dict] = []
        self._step = 0

    def report(self, step: int | None = None, epoch: int | None = None, **scalars: Any) -> None:
        if not scalars:
            raise TypeError("report() needs at least one named value, e.g. report(loss=loss)")
        if not _STAMPED.isdisjoint(scalars):
            raise TypeError(f"report() sets {sorted(_STAMPED.intersection(scalars))[0]!r} itself; "
                            "name the value otherwise")
        if step is None:
            step = self._step
        self._step = int(step) + 1
        point = {"rank": self.rank, "step": int(step), "time": time.time()}
        if epoch is not None:
            point["epoch"] = int(epoch)
        for name, value in scalars.items():
            point[name] = _scalar(name, value)
        if self.sink is not None:
            self.sink.emit(point)
        else:
            self.points.append(point)

    def drain(self) -> list[dict]:
        points, self.points = self.points, []
        return points


local_recorder = Recorder(rank=0)


def report(step: int | None = None, epoch: int | None = None, **scalars: Any) -> None:
    """Record metrics, e.g. ``report(loss=loss)``; in the notebook this records locally."""
    local_recorder.report(step=step, epoch=epoch, **scalars)


# --------------------------------------------------------------------------------------
# Worker to kernel
# --------------------------------------------------------------------------------------

# Each batch costs the sending thread a few hundred microseconds of CPU (JSON, its MAC, the
# send, with caches cold after training's work), taken from the training thread's GIL:
# at 100 ms a batch that is under 0.5 % of a step whatever the rate of report(); the
# dashboard draws at 10 Hz.
SEND_INTERVAL_S = 0.1
# The kernel refuses longer messages (ZeroMQ cuts off the peer that sends one), so that a
# stranger cannot make it buffer without bound; sinks split their batches to stay below.
# A busy loop reporting three values at 260k points/s fills about 4 MB per batch.
MAX_MESSAGE_BYTES = 16 * 2**20

# Each message is HMAC-SHA256(key, body) in hex, then the JSON body. A MAC rather than the
# key itself in every batch: on Dask the batches pass through the scheduler's event log,
# which every client of that scheduler can read, and a MAC gives away nothing that would
# sign another batch (nor a changed copy of this one).
_MAC_SIZE = 64


def _mac(key: str, body: bytes) -> bytes:
    return hmac.new(key.encode(), body, hashlib.sha256).hexdigest().encode()


class _ZmqTransport:
    """Batches to the kernel's EventStream over a ZeroMQ PUSH socket (never blocks)."""

    def __init__(self, address: str):
        # cast: pyzmq types Context.instance() as Context[Never], and so its sockets.
        self._socket = cast("zmq.Socket[bytes]", zmq.Context.instance().socket(zmq.PUSH))
        self._socket.setsockopt(zmq.SNDHWM, 10_000)  # batches, not events
        self._socket.setsockopt(zmq.LINGER, 2000)
        self._socket.connect(address)

    def send(self, message: str) -> bool:
        try:
            self._socket.send_string(message, zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # the kernel is not reading (or gone)
            return False

    def close(self) -> None:
        self._socket.close()


# Address scheme -> transport factory. An engine with its own channel to the kernel (Dask's
# event topics) registers one, so workers that cannot reach the kernel's loopback port
# still stream their points.
_TRANSPORTS: dict[str, Callable[[str], Any]] = {"tcp": _ZmqTransport}


def register_transport(scheme: str, factory: Callable[[str], Any]) -> None:
    """`factory(address)` -> an object with `send(message: str) -> bool` and `close()`."""
    _TRANSPORTS[scheme] = factory


class EventSink:
    """Worker side: a queue and a thread that sends it in batches, never blocking training."""

    def __init__(self, address: str, rank: int, key: str):
        self.address, self.rank, self.key = address, rank, key
        self.run = ""  # the id of the run (cell) whose events it sends now; see begin()
        # Every `heartbeat_interval` s the thread sends a heartbeat with `heartbeat_status()`
        # merged in (e.g. which collective the rank waits in): proof of life, and the
        # kernel's way to tell a rank that waits from one that never comes.
        self.heartbeat_interval: float = 0.0
        self.heartbeat_status: Callable[[], dict] = dict
        self._beat_at = 0.0
        self.stats_interval: float = 1.0  # s between memory samples (the first batch has one)
        self.sent = 0  # events handed to the transport in this run
        self.dropped = 0  # events that could not be (counted, reported, never silent)
        self._queue: collections.deque = collections.deque()
        scheme = address.split("://", 1)[0]
        if scheme not in _TRANSPORTS:
            raise ValueError(f"no event transport for {address!r}")
        # Created here, in the caller's thread: some transports need that thread's context.
        self._transport = _TRANSPORTS[scheme](address)
        self._wake = threading.Event()
        self._send_lock = threading.Lock()  # one sender at a time: the thread, or a flush
        self._closed = False
        self._stats_at: float | None = None
        self._process: psutil.Process | None = None
        self._thread = threading.Thread(target=self._run, name="jupyter_scale-events", daemon=True)
        self._thread.start()

    def begin(self, run: str) -> None:
        """A new run (cell): what is queued goes out as the last run's; then the batches
        carry `run`, and the counts start again, as the kernel's do."""
        with self._send_lock:
            self._send_queued()
            self.run, self.sent, self.dropped = run, 0, 0

    def emit(self, event: dict) -> None:
        self._queue.append(event)  # deque.append is atomic: no lock on the training path

    def state(self, state: str, **details: Any) -> None:
        self.emit({"kind": "state", "rank": self.rank, "state": state, "time": time.time(), **details})

    def flush(self, timeout: float = 5.0) -> bool:
        """Send everything queued so far, from the calling thread; True when it could.

        The caller sends, rather than waking the thread and waiting for it: a hand-off
        between threads can cost a GIL switch interval (5 ms) on a busy worker.
        """
        if not self._send_lock.acquire(timeout=timeout):
            return False
        try:
            self._send_queued()
        finally:
            self._send_lock.release()
        return True

    def close(self) -> None:
        self.flush(timeout=2.0)
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=2.0)

    def _send_queued(self) -> None:
        now = time.monotonic()
        if self.heartbeat_interval and now - self._beat_at >= self.heartbeat_interval:
            self._beat_at = now
            self._queue.append({"kind": "heartbeat", "rank": self.rank, "time": time.time(),
                                **self.heartbeat_status()})
        if self._queue and (self._stats_at is None or time.monotonic() - self._stats_at >= self.stats_interval):
            # Every `stats_interval` s while the rank reports: its memory, for the worker table.
            import psutil

            self._process = self._process or psutil.Process()
            self._stats_at = time.monotonic()
            self._queue.append({"kind": "stats", "rank": self.rank, "time": time.time(),
                                "rss": self._process.memory_info().rss})
        batch = []
        while self._queue:
            batch.append(self._queue.popleft())
        if batch:
            self._send_batch(batch)

    def _send_batch(self, batch: list[dict]) -> None:
        body = json.dumps({"run": self.run, "rank": self.rank, "events": batch, "sent_before": self.sent})
        if _MAC_SIZE + len(body) > MAX_MESSAGE_BYTES:  # JSON is ASCII: characters are bytes
            if len(batch) == 1:  # one point longer than the kernel takes: counted, never sent
                self.dropped += 1
                return
            half = len(batch) // 2
            self._send_batch(batch[:half])
            self._send_batch(batch[half:])
            return
        if self._transport.send(_mac(self.key, body.encode()).decode() + body):
            self.sent += len(batch)
        else:
            self.dropped += len(batch)

    def _run(self) -> None:
        while True:
            self._wake.wait(SEND_INTERVAL_S)
            self._wake.clear()
            with self._send_lock:
                if self._closed:
                    self._send_queued()
                    self._transport.close()
                    return
                self._send_queued()


# What JSON decodes to is exactly one of dict, list, str, int, float, bool, None: `type(x)
# is int` is the check (a bool is not a rank or a step).
_NUMBERS = (int, float)
_STATES = ("running", "finished", "failed")


def _well_formed(batch: Any, ranks: int | None) -> bool:
    """A batch as EventSink sends it: a rank in range, and events of that rank with the
    fields, of the types, that the kernel reads."""
    if not (type(batch) is dict and type(batch.get("run")) is str and type(batch.get("rank")) is int
            and type(batch.get("sent_before")) is int and type(batch.get("events")) is list):
        return False
    rank = batch["rank"]
    if rank < 0 or (ranks is not None and rank >= ranks):
        return False
    return all(_well_formed_event(e, rank) for e in batch["events"])


def _well_formed_event(event: Any, rank: int) -> bool:
    if not (type(event) is dict and type(event.get("rank")) is int and event["rank"] == rank
            and type(event.get("time")) in _NUMBERS):
        return False
    kind = event.get("kind")
    if kind is None:  # a report() point: int step (and epoch), every value a number
        return (type(event.get("step")) is int and type(event.get("epoch", 0)) is int
                and all(type(v) in _NUMBERS for v in event.values()))
    plain = all(v is None or type(v) in (str, int, float) for v in event.values())
    if kind == "state":
        return plain and event.get("state") in _STATES
    if kind == "stats":
        return plain and type(event.get("rss")) is int
    if kind == "heartbeat":  # waiting in a collective: its name and since when
        return plain and (event.get("collective") is None
                          or (type(event["collective"]) is str and type(event.get("since")) in _NUMBERS))
    if kind == "debug":  # what the rank's debugger printed, and its prompt (None: no answer wanted)
        return plain and type(event.get("seq")) is int and type(event.get("text")) is str
    return False


class EventQueue:
    """Kernel side: the batches every worker's sink sent; `drain()` hands over what arrived.

    `accept` is called by whatever carries the batches: the ZeroMQ stream below, or an
    engine's own channel. Only batches signed with `key`, well formed, and of the run
    `begin` started get through; `rejected` counts the others (reason -> messages).
    """

    address = ""

    def __init__(self) -> None:
        self.key = secrets.token_hex(16)  # the workers get it in each cell's request
        self.run = ""  # the running cell's id (begin); its ranks are 0 .. ranks - 1
        self.ranks: int | None = None
        self.rejected: collections.Counter = collections.Counter()  # why -> messages dropped
        self._events: collections.deque = collections.deque()
        self.received: collections.Counter = collections.Counter()  # rank -> events of this run
        # Seconds from report() on a worker to arrival here, for the latest events (the
        # clocks agree on one host; across hosts this includes their offset).
        self.latencies: collections.deque = collections.deque(maxlen=100_000)
        self._arrived = threading.Condition()
        self.on_prompt: Callable[[], None] | None = None  # told when a rank's debugger asks (wakes a wait)

    def begin(self, ranks: int) -> str:
        """Start a run of `ranks` ranks; returns its id, for the cell's request. What is left
        of earlier runs, here or still on its way, is dropped: an abandoned (interrupted,
        failed) cell's points never show in the next one."""
        with self._arrived:
            self.run, self.ranks = secrets.token_hex(8), ranks
            self.received.clear()
            self._events.clear()
        return self.run

    def accept(self, message: Any) -> None:
        """Take one message a sink sent (from any thread). Never raises: whatever a
        stranger sends is counted in `rejected` and dropped."""
        try:
            reason, batch = self._open(message)
        except Exception:  # e.g. not JSON (ours always is): the reader must live on
            reason, batch = "malformed", None
        with self._arrived:
            if batch is not None and batch["run"] != self.run:
                reason = "earlier run"
            if reason is not None:
                self.rejected[reason] += 1
                log.debug("dropped an event message: %s", reason)
                return
            assert batch is not None  # _open gives a batch exactly when it gives no reason
            arrived = time.time()
            self.latencies.extend(arrived - e["time"] for e in batch["events"])
            self._events.extend(batch["events"])
            self.received[batch["rank"]] += len(batch["events"])
            self._arrived.notify_all()
        if self.on_prompt is not None and any(e.get("kind") == "debug" for e in batch["events"]):
            self.on_prompt()

    def _open(self, message: Any) -> tuple[str | None, dict | None]:
        """(None, batch) for a well-formed batch signed with our key, else (why not, None)."""
        if isinstance(message, str):  # the Dask channel carries text
            message = message.encode()
        if not isinstance(message, bytes):
            return "malformed", None
        if len(message) > MAX_MESSAGE_BYTES:
            return "oversized", None
        if not hmac.compare_digest(message[:_MAC_SIZE], _mac(self.key, message[_MAC_SIZE:])):
            return "unsigned", None
        batch = json.loads(message[_MAC_SIZE:])
        return (None, batch) if _well_formed(batch, self.ranks) else ("malformed", None)

    def wait_for(self, expected: dict[int, int], timeout: float) -> bool:
        """Block until each rank's count of received events reaches `expected[rank]`."""
        with self._arrived:
            return self._arrived.wait_for(
                lambda: all(self.received[r] >= n for r, n in expected.items()), timeout)

    def drain(self) -> list[dict]:
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events

    def close(self) -> None:
        pass


class EventStream(EventQueue):
    """The ZeroMQ PULL end, bound to loopback (workers on the kernel's host)."""

    def __init__(self, host: str = "127.0.0.1"):
        super().__init__()
        self._socket = cast("zmq.Socket[bytes]", zmq.Context.instance().socket(zmq.PULL))  # as _ZmqTransport's
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jupyter_scale-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                if poller.poll(100):
                    self.accept(self._socket.recv(zmq.NOBLOCK))
            except Exception:  # one bad message must not end the stream for every later cell
                log.debug("event stream: receiving failed", exc_info=True)
        self._socket.close()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2.0)


class TextProgress:
    """The plain-text view of a run, for where no widget frontend is attached.

    One concise line every few seconds, e.g. ``step 120  loss r0 0.431 r1 0.452  210 steps/s``,
    not one line per report.
    """

    def __init__(self, interval: float = 2.0):
        self.interval = interval
        self.last: dict[int, dict] = {}  # rank -> latest metric point
        self._printed_at = time.monotonic()
        # rank -> the point the next rate counts from: its first, then the last one printed.
        # The rate is the points' own steps over their own times: the cluster's start before
        # the first step (or a wait for the kernel) is not counted as training.
        self._rate_from: dict[int, dict] = {}
        self._fresh = False

    def add(self, point: dict) -> None:
        self.last[point["rank"]] = point
        self._rate_from.setdefault(point["rank"], point)
        self._fresh = True

    def due(self) -> bool:
        return self._fresh and time.monotonic() - self._printed_at >= self.interval

    def line(self) -> str:
        now = time.monotonic()
        ranks = sorted(self.last)
        step = max(self.last[r]["step"] for r in ranks) + 1
        names = [k for k in self.last[ranks[0]] if k not in ("rank", "step", "time", "epoch", "kind")]
        parts = [f"step {step}"]
        epoch = self.last[ranks[0]].get("epoch")
        if epoch is not None:
            parts.append(f"epoch {epoch}")
        for name in names[:3]:
            values = " ".join(f"r{r} {self.last[r][name]:.4g}" for r in ranks if name in self.last[r])
            parts.append(f"{name} {values}")
        since, latest = self._rate_from[ranks[0]], self.last[ranks[0]]
        seconds = latest["time"] - since["time"]
        if seconds > 0 and latest["step"] > since["step"]:
            parts.append(f"{(latest['step'] - since['step']) / seconds:.0f} steps/s")
        self._rate_from[ranks[0]] = latest
        self._printed_at, self._fresh = now, False
        return "  ".join(parts)
