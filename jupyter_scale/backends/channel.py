"""A direct channel from the kernel to the workers on its host, for the calls of every cell.

An engine's own way to run a call costs milliseconds: ipyparallel's goes kernel ->
controller's scheduler -> engine and back (~3.5 ms for a no-op on two engines here), Dask's
through the scheduler's batches (~10 ms). When every worker runs on the kernel's host, the
kernel instead sends each call over ZeroMQ sockets of its own (~0.2 ms round trip), and the
workers answer, print and report over them. The engine still starts, signals, watches and
stops its workers; workers elsewhere, and engines without a way to serve the channel, keep
the engine's path.

The sockets are IPC sockets in a directory only this user can enter: the file system keeps
other local users out, where a TCP port on loopback would let any of them connect. What
travels is what the engine would carry: pickles, which only our own processes can send or
read. Report batches stay signed (metrics), as on every transport.

Kernel side: `CellChannel` (one per group of workers), `submit` / `submit_each` as an
engine's, and its jobs are read by the thread that waits for them (the kernel's own thread:
no thread of the channel's). Worker side: `serve(directory, identity, rank, loop)`: on the
engine's event loop (ipyparallel, whose engines run cells in their main thread), or in a
thread of its own (Dask, whose tasks run in a thread too).
"""

from __future__ import annotations

import contextvars
import logging
import os
import pickle
import secrets
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle
import zmq

from .. import capture, metrics, processes, worker
from ..errors import WorkerCallFailed, WorkerLost
from .base import split_frames
from .relay import Relay, RelayedJob

log = logging.getLogger(__name__)

SCHEME = "channel"  # channel://<directory>: the events address of a cell whose calls come over one
_HELLO, _REPLY, _OUTPUT, _EVENTS = b"hello", b"reply", b"o", b"e"


def _private_directory() -> str:
    """A directory only this user can enter (mkdtemp makes it 0700), short enough for the
    socket paths in it (107 bytes on Linux): a long $TMPDIR gives way to /tmp."""
    for parent in (None, "/tmp"):
        directory = tempfile.mkdtemp(prefix="jupyter_scale-", dir=parent)
        if len(f"{directory}/calls") <= zmq.IPC_PATH_MAX_LEN:
            return directory
        os.rmdir(directory)
    raise OSError(f"no temporary directory short enough for a socket path (under {zmq.IPC_PATH_MAX_LEN} bytes)")


def _remove(directory: str, watch: processes.Watch) -> None:
    shutil.rmtree(directory, True)
    watch.close()


def _socket(kind: int) -> zmq.Socket:
    socket: zmq.Socket = zmq.Context.instance().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    # No high-water mark: a peer that is not reading must not make a sender block (a worker
    # that blocks printing would hang its cell) or drop a reply. What waits is at most a
    # cell's answers and output: the kernel reads them while the cell runs.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    return socket


def _dumps(value: Any) -> bytes:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):  # a lambda or a notebook function
        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _send(socket: zmq.Socket, parts: list) -> None:
    for part in parts[:-1]:
        socket.send(part, zmq.SNDMORE)
    socket.send(parts[-1])


# --------------------------------------------------------------------------------------
# Kernel side
# --------------------------------------------------------------------------------------

class CellChannel:
    """The kernel's end: sockets in a private directory, the workers that said hello, and
    the jobs whose answers are on their way."""

    def __init__(self, ranks: int, gone_ranks: Callable[[], list[int]], events: metrics.EventQueue | None):
        self.ranks = ranks
        self._gone_ranks = gone_ranks
        self.directory = _private_directory()
        # Removed at close, or when the kernel exits without closing it, or by the kernel's
        # watcher when the kernel dies (SIGKILL).
        self._watch = processes.watch()
        self._watch.add_path(self.directory)
        self._remove = weakref.finalize(self, _remove, self.directory, self._watch)
        self._calls = _socket(zmq.ROUTER)
        self._out = _socket(zmq.PULL)
        try:
            self._calls.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a call to a worker that is not there fails
            self._calls.bind(f"ipc://{self.directory}/calls")
            self._out.bind(f"ipc://{self.directory}/out")
        except zmq.ZMQError:
            self._calls.close()
            self._out.close()
            self._remove()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._calls, zmq.POLLIN)
        self._poller.register(self._out, zmq.POLLIN)
        tag = secrets.token_hex(4)
        self.identities = [f"rank{rank}-{tag}".encode() for rank in range(ranks)]
        self._rank_of = {identity: rank for rank, identity in enumerate(self.identities)}
        self._heard: set[int] = set()
        self.relay = Relay(events)  # the calls' answers and output to their jobs, events to the queue
        self.closed = False

    @property
    def events_address(self) -> str:
        return f"{SCHEME}://{self.directory}"

    def worker_arguments(self) -> list[tuple]:
        """The arguments of the engine's opener, per rank (see serve)."""
        return [(self.directory, identity, rank) for rank, identity in enumerate(self.identities)]

    def await_workers(self, timeout: float) -> bool:
        """Whether every worker said hello within `timeout` s (they connect at once on this host)."""
        deadline = time.monotonic() + timeout
        while len(self._heard) < self.ranks and time.monotonic() < deadline:
            self.poll(0.05)
        return len(self._heard) == self.ranks

    # -- calls, as an engine's -------------------------------------------------------------
    def submit(self, fn: Callable, *args: Any, ranks: list[int] | None = None) -> ChannelJob:
        job = self._new_job(fn, list(range(self.ranks)) if ranks is None else list(ranks))
        message = self._encode(job, fn, args)  # pickled once for every rank
        for rank in job.ranks:
            self._send_call(job, rank, message)
        return job

    def submit_each(self, fn: Callable, args_per_rank: list[tuple]) -> ChannelJob:
        job = self._new_job(fn, list(range(len(args_per_rank))))
        for rank, args in enumerate(args_per_rank):
            self._send_call(job, rank, self._encode(job, fn, args))
        return job

    def _new_job(self, fn: Callable, ranks: list[int]) -> ChannelJob:
        self.poll(0)  # what came since the last job (late output of an abandoned cell) goes first
        job = ChannelJob(self, self.relay.new_id(fn), ranks)
        job.unreachable.update(set(self._gone_ranks()) & set(ranks))  # lost, as the job's wait says
        self.relay.add(job)
        return job

    @staticmethod
    def _encode(job: ChannelJob, fn: Callable, args: tuple) -> list:
        head, frames = split_frames(args)  # big buffers as frames of their own, not pickled
        return [_dumps((job.job_id, fn, head)), *frames]

    def _send_call(self, job: ChannelJob, rank: int, message: list) -> None:
        if rank in job.unreachable:
            return
        try:
            _send(self._calls, [self.identities[rank], *message])
        except zmq.ZMQError as exc:  # EHOSTUNREACH: its socket is gone
            job.unreachable.add(rank)
            log.debug("the channel could not reach rank %d: %s", rank, exc)

    # -- reading -----------------------------------------------------------------------------
    def poll(self, timeout: float) -> None:
        """Wait up to `timeout` s for anything from the workers; hand out all that came."""
        if self.closed:  # a wait on a closed channel still waits: its caller loops on it
            time.sleep(timeout)
            return
        if not self._poller.poll(max(0, int(timeout * 1000))):
            return
        for _ in range(10_000):  # whatever is there now, not what keeps coming
            got = False
            for socket, take in ((self._calls, self._take_call), (self._out, self._take_out)):
                try:
                    parts = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                got = True
                try:
                    take(parts)
                except Exception:  # only our processes reach these sockets; still, the reader lives on
                    log.warning("the channel dropped a message it could not read", exc_info=True)
            if not got:
                break

    def _take_call(self, parts: list) -> None:
        rank = self._rank_of.get(parts[0].bytes)
        if rank is None or len(parts) < 2:
            return
        kind = parts[1].bytes
        if kind == _HELLO:
            self._heard.add(rank)
        elif kind == _REPLY and len(parts) >= 3:
            job_id, ok, value, split = pickle.loads(parts[2].buffer)
            job = self.relay.job(job_id)
            if isinstance(job, ChannelJob):
                job.answer(rank, ok, (*value, *(part.buffer for part in parts[3:])) if split else value)

    def _take_out(self, parts: list) -> None:
        kind = parts[0].bytes
        if kind == _EVENTS:
            self.relay.event(parts[1].bytes)
        elif kind == _OUTPUT:
            self.relay.output(pickle.loads(parts[1].buffer))

    def gone_ranks(self) -> list[int]:
        return self._gone_ranks()

    def close(self) -> None:
        """Close the sockets and remove their directory. The workers' ends never connect
        again (see _WorkerEnd), even to a socket someone else binds at the same path."""
        if self.closed:
            return
        self.closed = True
        self.relay.clear()
        self._calls.close()
        self._out.close()
        self._remove()


class ChannelJob(RelayedJob):
    """One call over the channel: each rank's answer, and its output until the end marker."""

    def __init__(self, channel: CellChannel, job_id: str, ranks: list[int]):
        super().__init__(channel.relay, job_id, ranks)
        self._channel = channel
        self._answers: dict[int, tuple[bool, Any]] = {}
        self.unreachable: set[int] = set()  # ranks the call could not be sent to

    def answer(self, rank: int, ok: bool, value: Any) -> None:
        self._answers[rank] = (ok, value)

    def _replied(self, rank: int) -> bool:
        return rank in self._answers

    def _worker_gone(self, rank: int) -> bool:
        return rank in self.unreachable or rank in self._channel.gone_ranks()

    def result(self, rank: int) -> Any:
        if rank not in self._answers:
            raise WorkerLost(rank, "its worker process ended")
        ok, value = self._answers[rank]
        if not ok:
            raise WorkerCallFailed(rank, value)
        return value

    def wait_activity(self, timeout: float) -> None:
        if self._activity.is_set():  # output queued by this thread since the last turn
            self._activity.clear()
            timeout = 0
        self._channel.poll(timeout)

    def release(self) -> None:
        self._answers.clear()
        super().release()


# --------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------

class _WorkerEnd:
    """A worker's end: calls in and answers out on one socket (the thread that serves it
    runs the calls), output and report batches on another, which any thread may use."""

    def __init__(self, directory: str, identity: bytes, rank: int):
        self.directory, self.rank = directory, rank
        self._calls = _socket(zmq.DEALER)
        self._calls.setsockopt(zmq.IDENTITY, identity)
        self._out = _socket(zmq.PUSH)
        for socket, name in ((self._calls, "calls"), (self._out, "out")):
            # Connected once, to the kernel's socket, which is bound before the worker hears of
            # it. Never again: once the kernel closed it and removed its directory, someone
            # else could make that path and bind a socket of their own there.
            socket.setsockopt(zmq.RECONNECT_IVL, -1)
            socket.connect(f"ipc://{directory}/{name}")
        self._out_lock = threading.Lock()
        self._stream: Any = None  # a ZMQStream, when served on an event loop
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def send_out(self, kind: bytes, payload: bytes) -> None:
        with self._out_lock:
            if not self._closed.is_set():
                self._out.send_multipart([kind, payload])

    def send_output(self, message: dict) -> None:
        self.send_out(_OUTPUT, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def handle(self, parts: list) -> None:
        """Run one call and answer it (the serving thread)."""
        job_id = "?"
        # In the main thread, SIGINT raises KeyboardInterrupt in the call, as ipykernel makes
        # it do around the engine's own calls (run_cell narrows it to the cell's code).
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.default_int_handler) if main else None
        try:
            job_id, fn, head = pickle.loads(parts[0].buffer)
            frames = [part.buffer for part in parts[1:]]
            value = capture.call_captured(fn, (*head, *frames), self.send_output, job_id, self.rank)
            if isinstance(value, tuple):  # (header, *buffers): the buffers as frames of their own
                head, frames_back = split_frames(value)
                answer = [_dumps((job_id, True, head, True)), *frames_back]
            else:
                answer = [_dumps((job_id, True, value, False))]
        except BaseException as exc:  # noqa: B036 - an answer, whatever happened (our functions catch their own)
            answer = [_dumps((job_id, False, f"{type(exc).__name__}: {exc}", False))]
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        _send(self._calls, [_REPLY, *answer])

    def serve_on(self, loop: Any) -> None:
        """Calls run in `loop`'s thread (a tornado IOLoop: an ipyparallel engine's main thread)."""
        from zmq.eventloop.zmqstream import ZMQStream

        self._stream = ZMQStream(self._calls, loop)
        self._stream.on_recv(self.handle, copy=False)
        self._calls.send_multipart([_HELLO, str(os.getpid()).encode()])

    def serve_in_thread(self) -> None:
        """Calls run in a thread of the channel's own."""
        self._calls.send_multipart([_HELLO, str(os.getpid()).encode()])

        def run() -> None:
            poller = zmq.Poller()
            poller.register(self._calls, zmq.POLLIN)
            while not self._closed.is_set():
                if poller.poll(100):
                    self.handle(self._calls.recv_multipart(copy=False))
            self._calls.close()

        # In the context of the call that opened it: on a Dask worker, the cells see their
        # worker (distributed.get_worker, get_client) as in a task.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(run,), name="jupyter_scale-channel", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._out_lock:
            self._closed.set()
            self._out.close()
        if self._stream is not None:
            self._stream.close()
        elif self._thread is None:
            self._calls.close()


class _EventTransport:
    """metrics.EventSink transport: report batches over the worker's channel."""

    def __init__(self, address: str):
        # A sink lives across cells while its address holds: a channel opened anew has another.
        if _worker_end is None or address != f"{SCHEME}://{_worker_end.directory}":
            raise RuntimeError(f"this worker's end of {address} is closed")
        self._end = _worker_end

    def send(self, message: str | bytes) -> bool:
        self._end.send_out(_EVENTS, message.encode() if isinstance(message, str) else message)
        return True

    def close(self) -> None:
        pass


metrics.register_transport(SCHEME, _EventTransport)

_worker_end: _WorkerEnd | None = None


def serve(directory: str, identity: bytes, rank: int, loop: Any = None) -> int:
    """Worker side: open this worker's end of the kernel's channel (closing an earlier one)
    and serve its calls on `loop` (an IOLoop) or, without one, in a thread. Returns the pid."""
    global _worker_end
    close_worker_end()
    end = _WorkerEnd(directory, identity, rank)
    if loop is not None:
        end.serve_on(loop)
    else:
        end.serve_in_thread()
    _worker_end = end
    return os.getpid()


def _forget_in_child() -> None:
    global _worker_end
    _worker_end = None  # a forked child must not use the parent's sockets (nor close them)


os.register_at_fork(after_in_child=_forget_in_child)


def close_worker_end() -> None:
    global _worker_end
    end, _worker_end = _worker_end, None
    if end is not None:
        end.close()


worker.when_reset(close_worker_end)  # the kernel that opened it is done with this worker
