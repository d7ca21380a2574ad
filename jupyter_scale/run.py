"""One %%distribute cell on the workers, from the kernel's side: the wait for every rank's
answer while their output and reports stream in, and what failed and why.

A `CellRun` is a small state machine. Each turn of its loop takes what arrived (output,
events, answers), then decides: a rank that failed makes the others stop after
`abort_grace`; the user's interrupt, a `--timeout` or a silent rank does too; ranks that
do not stop within `stop_deadline` are given up. It observes and stops ranks, nothing
more: it ends with an `Outcome` (or `RanksStuck`), and the session applies that to the
cluster and the notebook.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from . import display, worker
from .backends import Backend, Job, describe_exit
from .debugger import RankPrompts
from .errors import CellTimeout, ClusterError, RankFailure, RemoteError, WorkerCallFailed, WorkerDied, WorkerLost
from .launchers import Launcher
from .metrics import EventQueue
from .protocol import CellReply
from .records import RunRecord

log = logging.getLogger(__name__)
# Seconds between looks at a Slurm job under a running cell (one squeue call each).
ALLOCATION_CHECK_S = 2.0


@dataclass(frozen=True)
class WaitLimits:
    """The session's settings that time a cell's wait (see ScaleSession for each)."""

    poll_interval: float
    abort_grace: float
    stop_deadline: float
    silence_limit: float
    heartbeat_interval: float
    hang_warning: float


@dataclass(frozen=True)
class Outcome:
    """How a cell's wait ended: each answered rank's header and frames, the cell's error
    (None if every rank succeeded; else RemoteError, WorkerDied or CellTimeout) and the ranks
    whose worker was lost."""

    headers: dict[int, CellReply]
    frames_back: dict[int, Sequence]
    error: RemoteError | None
    lost: list[int]
    user_interrupted: bool


class RanksStuck(ClusterError):
    """Ranks that did not stop within stop_deadline of being interrupted: the next cell replaces them."""

    def __init__(self, ranks: list[int], said: str):
        super().__init__(f"ranks {ranks} {said}; the next %%distribute restarts the workers")
        self.ranks = ranks


class Interrupts:
    """SIGINTs noted while a cell runs, and how many the wait loop has acted on."""

    def __init__(self) -> None:
        self.count = 0
        self.handled = 0


@contextmanager
def interrupts_noted() -> Iterator[Interrupts]:
    """While a cell runs, the notebook's interrupt (SIGINT) is noted, not raised.

    A KeyboardInterrupt can leave the kernel's code at any line: two interrupts 0.3 ms
    apart escaped the wait loop's handler, and the ranks ran on unseen while the next cell
    wrote the frames they read. Noted, the wait loop stops every rank for it, and pulls
    are applied whole. Off the main thread no signal arrives, and nothing changes.
    """
    interrupts = Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield interrupts
        return

    def note(signum, frame) -> None:
        interrupts.count += 1

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


class CellRun:
    """The kernel's wait for one cell's ranks, and how it ended."""

    def __init__(self, job: Job, record: RunRecord, view: display.RunView, timeout: float | None,
                 interrupts: Interrupts | None = None, *, backend: Backend, workers: Sequence[dict],
                 placement: Launcher | None, events: EventQueue | None, limits: WaitLimits, run_id: str | None,
                 request_abort: Callable[[], None], notify: Callable[..., None], prompts: RankPrompts | None = None,
                 labeler: display.LineLabeler | None = None):
        self.job, self.record, self.view, self.timeout = job, record, view, timeout
        self.backend, self.workers, self.placement, self.events = backend, workers, placement, events
        self.limits, self.run_id, self.request_abort, self.notify = limits, run_id, request_abort, notify
        self.interrupts = interrupts or Interrupts()
        self.prompts = prompts  # the ranks' debugger prompts (see debugger)
        self.labeler = labeler or display.LineLabeler()
        self.headers: dict[int, CellReply] = {}  # each answered rank's header
        self.frames_back: dict[int, Sequence] = {}  # and the frames that came with it
        self.failures: list[RankFailure] = []
        self.lost: list[int] = []  # ranks whose worker is gone
        self.started = time.monotonic()
        self.first_failure: float | None = None
        self.interrupted_at: float | None = None  # when the ranks still running were told to stop
        self.abort_requested = False
        self.user_interrupted = False
        self.interrupt_sent = 0.0  # wall time of the user's interrupt
        self.timed_out = False
        self.beats: dict[int, dict] = {}  # each rank's last heartbeat
        self.heard: dict[int, float] = {}  # when each rank last said anything
        self.warned_at = time.monotonic()
        self.allocation_checked = time.monotonic()

    def forget_answers(self) -> None:
        """Once the wait is over: drop the job and the ranks' answers (a pulled model can be
        gigabytes); the heartbeats stay, for whoever shows where the ranks were."""
        self.job, self.headers, self.frames_back = None, {}, {}  # type: ignore[assignment]

    def running(self) -> list[int]:
        return [r for r in self.job.ranks if r not in self.headers and r not in self.lost]

    def wait(self) -> Outcome:
        """Stream output until every rank answered; stop the others after a failure.
        Raises RanksStuck for ranks that ignored being stopped."""
        if self.events is not None:
            self.events.on_prompt = self.job.notify  # a rank's debugger is answered at once
        try:
            return self._wait()
        finally:
            if self.events is not None:
                self.events.on_prompt = None

    def _wait(self) -> Outcome:
        while True:
            try:
                if self.interrupts.count > self.interrupts.handled:
                    self._pass_on_interrupt()
                display.emit(self.job.new_output(), self.labeler)
                self.take_events()
                self.view.tick()
                self.notify("tick")
                self._collect_answers()
                if len(self.headers) + len(self.lost) == len(self.job.ranks):
                    break
                now = time.monotonic()
                self._check_allocation(now)
                self._check_silence(now)
                if self.first_failure is None and self.interrupted_at is None:
                    self._warn_if_waiting()
                if self._escalate(now):
                    break
                self.job.wait_activity(self.limits.poll_interval)
            except KeyboardInterrupt:  # off the main thread, where SIGINT is not noted
                self.interrupts.count += 1
        display.emit(self.job.new_output(), self.labeler)
        for stream, text in self.labeler.flush():
            display.write(stream, text)
        self.collect_last_events()
        if self.record.lost_events:
            display.write("stderr", f"jupyter_scale: {self.record.lost_events} reported points did not reach the "
                                    "kernel\n")
        return Outcome(self.headers, self.frames_back, self._classify(), self.lost, self.user_interrupted)

    # -- one turn's transitions ----------------------------------------------------------
    def _fail(self, failure: RankFailure, now: float | None = None) -> None:
        self.failures.append(failure)
        self.first_failure = self.first_failure or now or time.monotonic()

    def _lose(self, rank: int, exc: WorkerLost, now: float | None = None) -> None:
        self.lost.append(rank)
        self._fail(RankFailure(rank, "WorkerLost", str(exc), "", time.time(), lost=True, cause=exc), now)

    def _collect_answers(self) -> None:
        for rank in self.job.ranks:
            if rank in self.headers or rank in self.lost or not self.job.done(rank):
                continue
            try:
                header, *rest = self.job.result(rank)
            except WorkerLost as exc:
                self.lost.append(rank)
                how = self._how_it_died(rank) if not isinstance(exc, WorkerCallFailed) else ""
                if len({w["node"] for w in self.workers}) > 1:  # which host, where there are several
                    how += f" (host {self.workers[rank]['hostname']})"
                self._fail(RankFailure(rank, type(exc).__name__, f"{exc}{how}", "", time.time(), lost=True,
                                       cause=exc))
                continue
            self.headers[rank], self.frames_back[rank] = header, tuple(rest)
            if header["status"] == "error":
                self._fail(RankFailure(**header["failure"]))

    def _check_allocation(self, now: float) -> None:
        """A cancelled or timed-out Slurm job: its workers may take Slurm's KillWait to die."""
        placement = self.placement
        if placement is None or now - self.allocation_checked <= ALLOCATION_CHECK_S:
            return
        self.allocation_checked = now
        ended = placement.ended()
        if not ended:
            return
        for rank in self.running():
            self._lose(rank, WorkerLost(rank, ended), now)

    def _check_silence(self, now: float) -> None:
        """Running ranks that said nothing (no heartbeat, point or state) for silence_limit s.

        The engine's own word on a host that left the network can take minutes (a Dask
        scheduler waits for its worker's TTL, TCP for its retries); each rank's heartbeat
        says within seconds. Counted from a rank's first word: before it, the rank may still
        be receiving the cell's values.
        """
        if not self.limits.silence_limit:
            return
        silent = [r for r in self.running() if r in self.heard and now - self.heard[r] > self.silence_s()
                  and not self.job.done(r)]
        for rank in silent:
            self._lose(rank, WorkerLost(rank, f"nothing heard from it (host {self.workers[rank]['hostname']}) "
                                              f"for {self.silence_s():g} s: its host left the network, or the "
                                              "process hangs"), now)

    def silence_s(self) -> float:
        # Never less than two heartbeats and then some, whatever the two are set to.
        return max(self.limits.silence_limit, 2 * self.limits.heartbeat_interval + 2)

    def _escalate(self, now: float) -> bool:
        """Stop the ranks still running when that is due; True when the wait gives up on them."""
        limits = self.limits
        if self.first_failure is not None and now - self.first_failure > limits.abort_grace:
            self._stop_running("another rank failed")
        if self.timeout is not None and self.running_for(now) > self.timeout and self.interrupted_at is None:
            self.timed_out = True
            print(f"jupyter_scale: --timeout {self.timeout:g} s reached; stopping ranks {self.running()}",
                  file=sys.stderr, flush=True)
            self._stop_running("timeout")
        if self.interrupted_at is None:
            return False
        if not self.abort_requested and now - self.interrupted_at > limits.abort_grace:
            # Still running after SIGINT: ranks blocked in a collective among
            # themselves. Their watch threads cut the group when asked.
            self.abort_requested = True
            self.request_abort()
        if now - self.interrupted_at <= limits.stop_deadline:
            return False
        stuck = self.running()
        said = f"did not stop within {limits.stop_deadline:g} s of being interrupted"
        places = [f"rank {r}: {self.beats[r]['where']}" for r in stuck if (self.beats.get(r) or {}).get("where")]
        if places:
            said += f" ({'; '.join(places)})"
        if not self.lost:
            raise RanksStuck(stuck, said)
        # Stuck with the lost workers (e.g. in a collective with a host that left
        # the network): the lost ones are the cause; the next cell replaces both.
        for rank in stuck:
            self.lost.append(rank)
            self.failures.append(RankFailure(rank, "WorkerLost", said, "", time.time(), lost=True, interrupted=True))
        return True

    def running_for(self, now: float) -> float:
        """Seconds the cell has run, less those the ranks' debuggers waited for the user."""
        return now - self.started - (self.prompts.spent if self.prompts is not None else 0.0)

    def _stop_running(self, reason: str) -> None:
        running = self.running()
        if self.prompts is not None and not self.prompts.interrupted:
            self.prompts.interrupt()  # a rank at a prompt (now or later) stops too
        if not running or self.interrupted_at is not None:
            return
        log.info("interrupting ranks %s: %s", running, reason)
        self.backend.interrupt(running, self.run_id)
        # A rank blocked inside a collective does not see SIGINT until it returns: ranks
        # that already finished cut their connections, which makes that collective fail.
        finished = [r for r in self.headers if r not in self.lost]
        if finished:  # fire and forget: the reply is tiny
            self.backend.submit(worker.leave_group, ranks=finished)
        self.interrupted_at = time.monotonic()

    def _pass_on_interrupt(self) -> None:
        # The user interrupted the kernel: pass it on to every rank, keep waiting
        # (bounded by stop_deadline) so they are reusable afterwards.
        self.interrupts.handled = self.interrupts.count
        if not self.user_interrupted:
            self.user_interrupted = True
            self.interrupt_sent = time.time()
            print("jupyter_scale: interrupting the workers ...", file=sys.stderr, flush=True)
        self._stop_running("kernel interrupt")

    def _classify(self) -> RemoteError | None:
        if self.record.framework == "paddle":
            # Paddle ends a process whose group connections a failed or interrupted peer cut:
            # a death after a rank's own error, or after the interrupt, is not the cause.
            own = min((f.time for f in self.failures if not f.lost), default=float("inf"))
            since = min(own, self.interrupt_sent if self.user_interrupted else float("inf"))
            for f in self.failures:
                f.interrupted = f.interrupted or (f.lost and f.time > since)
        if self.user_interrupted and (not self.lost or self.record.framework == "paddle"):
            for f in self.failures:
                # The interrupt stopped every rank; a rank freed from a collective by a peer
                # that stopped first fails with gloo's "connection closed" instead of a
                # KeyboardInterrupt. Only an error raised before the interrupt, outside a
                # collective, is the cell's own.
                if f.collective is not None or f.time >= self.interrupt_sent - 0.05:
                    f.interrupted = True
        if not self.failures:
            return None
        if self.timed_out and self.timeout is not None:  # timed out: there was a timeout
            return CellTimeout(self.failures, timeout=self.timeout,
                               finished=[r for r, h in self.headers.items() if h["status"] == "ok"])
        if self.lost:
            error = WorkerDied(self.failures)
            if self.placement is not None and self.placement.name == "slurm":
                error.hint = ("The workers' Slurm job is gone: the next %%distribute submits a new one (worker "
                              "variables are lost; notebook variables are intact), or run %scale restart.")
            return error
        return RemoteError(self.failures)

    # -- what the ranks say ----------------------------------------------------------------
    def take_events(self) -> None:
        events = self.events
        heard = time.monotonic()
        for event in events.drain() if events is not None else ():
            kind = event.get("kind")
            self.heard[event["rank"]] = heard
            if kind == "debug":
                if self.prompts is not None:
                    self.prompts.take(event)
                continue
            self.notify("event", event)
            if kind == "heartbeat":
                self.beats[event["rank"]] = event
                continue
            if kind == "state":
                self.record.states.append(event)
            elif kind is None:  # a report() point
                self.record.metrics.append(event)
            self.view.add(event)
        if self.prompts is not None and self.prompts.waiting and self._serve_prompts():
            # Nothing was read while the user answered: no rank is silent, none waited on its own.
            heard = time.monotonic()
            self.heard.update((r, heard) for r in self.heard)
            self.warned_at = heard

    def _serve_prompts(self) -> bool:
        assert self.prompts is not None
        display.emit(self.job.new_output(), self.labeler)  # what the ranks printed before they stopped
        interrupted = self.prompts.interrupted
        served = self.prompts.serve()
        if self.prompts.interrupted and not interrupted:  # the user interrupted at the prompt
            self.interrupts.count += 1
        return served

    def collect_last_events(self) -> None:
        """Wait until every event each rank says it sent has arrived, as long as a rank may go
        silent (silence_s); count the rest.

        The answers and the events travel apart (the direct channel's two sockets, an
        engine's two streams), so the last events can come after the last answer. The wait
        keeps reading what carries them: the direct channel is read only in this thread.
        """
        events = self.events
        expected = {r: h.get("events_sent", 0) for r, h in self.headers.items()}
        if events is not None:
            deadline = time.monotonic() + self.silence_s()
            while not events.wait_for(expected, self.limits.poll_interval) and time.monotonic() < deadline:
                self.job.wait_activity(0)
        self.take_events()
        missing = sum(max(0, n - events.received[r]) for r, n in expected.items()) if events else 0
        self.record.lost_events = missing + sum(h.get("events_dropped", 0) for h in self.headers.values())

    def _how_it_died(self, rank: int, wait: float = 2.0) -> str:
        """' (its process was killed by SIGKILL)', when the engine can tell.

        The engine may notice the lost worker before the process's status is read, so
        this waits a little for it.
        """
        pid = self.workers[rank].get("pid") if rank < len(self.workers) else None
        ended = self.placement.ended() if self.placement is not None else None
        if ended:
            return f" ({ended})"
        if pid is None or not self.backend.owns_cluster or not self.backend.knows_exit_codes:
            return ""  # another host's process, or an engine that cannot tell
        deadline = time.monotonic() + wait
        while (code := self.backend.exit_code(pid)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        how = describe_exit(code)
        return f" (its process {pid} {how})" if how else ""

    def _warn_if_waiting(self) -> None:
        """Name the ranks others wait for, every hang_warning s while they do."""
        limits = self.limits
        if not limits.hang_warning or time.monotonic() - self.warned_at < limits.hang_warning:
            return
        now = time.time()
        beats = {r: self.beats.get(r) for r in self.running()}
        answered = self.prompts.served_at if self.prompts is not None else 0.0  # time at a prompt is not a hang
        waiting = {r: b for r, b in beats.items() if b and b.get("collective")
                   and now - max(b["since"], answered) >= limits.hang_warning}
        if not waiting:
            return
        absent = [r for r, b in beats.items() if not (b and b.get("collective"))]
        silent = [r for r, b in beats.items() if b is None or now - b["time"] > 3 * limits.heartbeat_interval + 2]
        if not absent and not silent:
            return  # everyone is in a collective: slow, not stuck on one rank
        longest = max(now - max(b["since"], answered) for b in waiting.values())
        where = ", ".join(sorted({b["collective"] for b in waiting.values()}))
        line = (f"jupyter_scale: rank(s) {sorted(waiting)} have waited {longest:.0f} s in {where}; "
                f"rank(s) {sorted(set(absent) | set(silent))} are not in it")
        if silent:
            line += f" (no heartbeat from rank(s) {sorted(silent)}: hung or overloaded)"
        places = [f"rank {r}: {b['where']}" for r, b in sorted(beats.items()) if b and b.get("where")]
        if places:
            line += f"; {'; '.join(places)}"
        display.write("stderr", line + ". Interrupt the kernel to stop every rank, or use --timeout.\n")
        self.warned_at = time.monotonic()


def stop_ranks(job: Job, backend: Backend, lost: list[int], limits: WaitLimits, run_id: str | None,
               request_abort: Callable[[], None]) -> list[int]:
    """Stop the ranks of a cell whose wait ended early (interrupt, then the group's abort
    after `abort_grace`); returns those that did not stop within `stop_deadline`, with the
    ranks already `lost` among the job's."""
    try:
        running = [r for r in job.ranks if not job.done(r) and r not in lost]
        if running:
            backend.interrupt(running, run_id)
            started = time.monotonic()
            aborted = False
            while running and time.monotonic() - started < limits.stop_deadline:
                if not aborted and time.monotonic() - started > limits.abort_grace:
                    request_abort()  # ranks blocked in a collective among themselves
                    aborted = True
                job.wait_activity(limits.poll_interval)
                running = [r for r in running if not job.done(r)]
        return sorted({*running, *(r for r in job.ranks if r in lost)})
    except Exception:  # the engine itself failed: nothing can be known of the ranks
        log.debug("stopping an abandoned cell failed", exc_info=True)
        return list(job.ranks)
