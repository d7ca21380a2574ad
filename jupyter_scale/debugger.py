"""The notebook's side of debugging ranks (see debugging for the workers'): their pdb prompts
as the kernel's input requests, `%scale debug` (post-mortem on a rank) and `%scale stacks`.

A rank's prompt arrives as a "debug" event with what its pdb printed; the kernel shows the text,
asks the user through the kernel's ordinary stdin request (JupyterLab, Notebook 7 and VS Code
show it as they show `input()`), and writes the signed answer to the rank's mailbox in the
group's store. Prompts of several ranks are served one after another, in the order they came;
`@1,3 p x` (or `@all c`, `@0-2 n`) sends one command to every listed rank in the debugger: at
once to those at a prompt, and to the others at their next prompt.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from . import debugging, display, rendezvous
from .errors import DistributeError

log = logging.getLogger(__name__)

_CAST = re.compile(r"^@(all|[\d,\s-]+)\s+(.*)$", re.S)


def cast_targets(answer: str, world_size: int) -> tuple[list[int] | None, str]:
    """`@1,3 p x` -> ([1, 3], "p x"); `@all c` -> (every rank, "c"); else (None, answer)."""
    found = _CAST.match(answer.strip())
    if not found:
        return None, answer
    spec, command = found.groups()
    if spec == "all":
        return list(range(world_size)), command
    ranks: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return None, answer
        ranks.update(range(int(low), int(high or low) + 1))
    return sorted(ranks), command


def _labelled(rank: int, text: str) -> str:
    return "".join(f"[rank {rank}] {line}" for line in text.splitlines(keepends=True))


@contextmanager
def _interruptible() -> Iterator[None]:
    """While the kernel waits for the user's answer, an interrupt raises KeyboardInterrupt
    (a running cell notes SIGINT instead: see run.interrupts_noted)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class RankPrompts:
    """The debugger prompts of one cell's (or post-mortem call's) ranks, answered in turn."""

    def __init__(self, store: dict | None, key: str, run: str, world_size: int,
                 ask: Callable[[str], str] | None = None):
        self.store_spec, self.key, self.run, self.world_size = store, key, run, world_size
        self._ask = ask or input  # the kernel's input(): a stdin request to the frontend
        self.waiting: list[dict] = []  # "debug" events whose prompt has no answer yet, in arrival order
        self.in_debugger: set[int] = set()  # ranks stopped in their debugger (between prompts too)
        self.queued: dict[int, str] = {}  # a cast's command for a rank's next prompt
        self.spent = 0.0  # seconds spent waiting for the user's answers
        self.served_at = 0.0  # wall time the last answer was sent
        self.interrupted = False
        self._no_stdin = False
        self._store: Any = None

    def take(self, event: dict) -> None:
        rank = event["rank"]
        if event["text"]:
            display.write("stdout", _labelled(rank, event["text"]))
        if event.get("prompt") is None:  # the rank left its debugger
            self.in_debugger.discard(rank)
            self.queued.pop(rank, None)
            return
        self.in_debugger.add(rank)
        if rank in self.queued:  # a cast's command waited for this prompt
            command = self.queued.pop(rank)
            display.write("stdout", f"{event['prompt']}{command}\n")
            self._answer(event, command)
            return
        self.waiting.append(event)

    def serve(self) -> bool:
        """Ask the user for each waiting prompt; True if any was served."""
        served = False
        while self.waiting:
            served = True
            event = self.waiting.pop(0)
            if self.interrupted or self._no_stdin:
                self._answer(event, debugging.STOP if self.interrupted else debugging.NO_STDIN)
                continue
            started = time.monotonic()
            try:
                with _interruptible():
                    answer = self._ask(event["prompt"])
            except KeyboardInterrupt:
                self.interrupted = True
                self._answer(event, debugging.STOP)
                continue
            except Exception as exc:  # IPython's StdinNotImplementedError: nbclient, nbval
                if type(exc).__name__ != "StdinNotImplementedError":
                    raise
                self._no_stdin = True
                self._answer(event, debugging.NO_STDIN)
                continue
            finally:
                self.spent += time.monotonic() - started
            targets, command = cast_targets(answer, self.world_size)
            if targets is None:
                self._answer(event, answer)
                continue
            chosen = [e for e in [event, *self.waiting] if e["rank"] in targets]
            self.waiting = [e for e in self.waiting if e["rank"] not in targets]
            if event["rank"] not in targets:
                self.waiting.insert(0, event)  # asked again, after the others are answered
            at_prompt = {e["rank"] for e in chosen}
            later = sorted((set(targets) & self.in_debugger) - at_prompt)
            self.queued.update((r, command) for r in later)  # answered at their next prompt
            absent = sorted(set(targets) - self.in_debugger - at_prompt)
            if absent and not answer.strip().startswith("@all"):
                display.write("stderr", f"jupyter_scale: rank(s) {absent} are not in the debugger\n")
            for chosen_event in chosen:
                self._answer(chosen_event, command)
        if served:
            self.served_at = time.time()
        return served

    def interrupt(self) -> None:
        """The user interrupted the cell: every prompt, now and later, ends its rank's debugger."""
        self.interrupted = True
        self.serve()

    def _answer(self, event: dict, answer: str) -> None:
        where = debugging.answer_key(self.run, event["rank"], event["seq"])
        try:
            self._mailbox().set(where, debugging.sign(self.key, where, answer))
        except Exception:  # the store went with its group: the rank is being stopped anyway
            log.debug("answering rank %s's debugger failed", event["rank"], exc_info=True)

    def _mailbox(self) -> Any:
        if self._store is None:
            if self.store_spec is None:
                raise RuntimeError("no group store to answer through")
            self._store = rendezvous.group_store(self.store_spec, timeout=10)
        return self._store


# --------------------------------------------------------------------------------------
# Stacks
# --------------------------------------------------------------------------------------

def gather_stacks(store: dict, ranks: list[int], timeout: float) -> dict[int, str]:
    """Every thread's stack of each rank, through the group's store: each rank's watch
    thread answers while its cell runs or hangs (see rendezvous.AbortWatch)."""
    handle = rendezvous.group_store(store, timeout=timeout)
    asked = handle.add(rendezvous.STACKS_KEY, 1)
    keys = {r: rendezvous.stacks_key(asked, r) for r in ranks}
    found: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(found) < len(keys) and time.monotonic() < deadline:
        for rank, key in keys.items():
            if rank not in found and handle.check([key]):
                found[rank] = handle.get(key).decode()
        if len(found) < len(keys):
            time.sleep(debugging.POLL_S)
    return found


def stacks(store: dict | None, workers: list[dict], lost: list[int], idle: Callable[[list[int]], list] | None,
           timeout: float) -> str:
    """Every rank's stacks. While a cell runs (`idle` None), through the group's `store`: each
    rank's watch thread answers, in a hung collective too. Between cells, through the engine
    (`idle(ranks)`: worker.stacks's answers), but for the `lost` ranks, which did not stop when
    told: the store again (a stuck rank's watch still answers; a dead one's does not)."""
    ranks = list(range(len(workers)))
    through_store = ranks if idle is None else [r for r in ranks if r in lost]
    found: dict[int, str] = {}
    if store is not None and through_store:
        try:
            found = gather_stacks(store, through_store, timeout)
        except Exception:  # the store is gone with its group
            log.debug("asking for stacks through the store failed", exc_info=True)
    if idle is not None and (asked := [r for r in ranks if r not in lost]):
        found.update((a[0]["rank"], a[0]["stacks"]) for a in idle(asked))
    hosts = {r: w["hostname"] for r, w in enumerate(workers)} if len({w["node"] for w in workers}) > 1 else {}
    return format_stacks(found, len(workers), hosts)


def format_stacks(stacks: dict[int, str], world_size: int, hosts: dict[int, str]) -> str:
    """One section per rank, headed by where it is (debugging.stacks' first line), then its threads."""
    parts = []
    for rank in range(world_size):
        place, _, body = stacks.get(rank, "no answer\n(the process holds the interpreter, or is gone)").partition("\n")
        head = f"--- rank {rank}" + (f" on {hosts[rank]}" if rank in hosts else "") + f": {place} ---"
        parts.append(f"{head}\n{body.rstrip()}\n" if body.strip() else f"{head}\n")
    return "\n".join(parts)



# --------------------------------------------------------------------------------------
# Post-mortem
# --------------------------------------------------------------------------------------

def rank_to_debug(rank: int | None, failed: list[int], world_size: int, lost: list[int]) -> int:
    """The rank `%scale debug` opens (default: the one the last failed cell blames), or why none."""
    if rank is None and not failed:
        raise DistributeError("no %%distribute cell has failed: there is nothing to debug")
    rank = failed[-1] if rank is None else rank
    if not world_size:
        raise DistributeError("no cluster is running: its workers, and their frames, are gone")
    if not 0 <= rank < world_size or rank in lost:
        raise DistributeError(f"rank {rank} has no worker of this cluster's that holds a failure")
    return rank


def post_mortem(calls: Any, backend: Any, events: Any, events_address: str, store: dict, rank: int,
                world_size: int, poll: float, stop_deadline: float) -> dict:
    """pdb on `rank` where its last cell failed (worker.post_mortem), its prompts served here,
    until the user continues or quits; an interrupt ends it."""
    from . import worker

    run = events.begin(world_size)  # the prompts are this call's
    prompts = RankPrompts(store, events.key, run, world_size)
    job = calls.submit(worker.post_mortem, (events_address, events.key, run), store, ranks=[rank])
    labeler = display.LineLabeler()
    stopped_at: float | None = None
    events.on_prompt = job.notify
    try:
        while not job.done(rank):
            try:
                display.emit(job.new_output(), labeler)
                for event in events.drain():
                    if event.get("kind") == "debug":
                        prompts.take(event)
                prompts.serve()
                if prompts.interrupted and stopped_at is None:
                    stopped_at = time.monotonic()
                    backend.interrupt([rank], run)
                if stopped_at is not None and time.monotonic() - stopped_at > stop_deadline:
                    raise TimeoutError(f"rank {rank} did not leave the debugger within {stop_deadline:g} s of "
                                       "being interrupted")
                job.wait_activity(poll)
            except KeyboardInterrupt:
                prompts.interrupt()
        display.emit(job.new_output(), labeler)
        for stream, text in labeler.flush():
            display.write(stream, text)
        done = job.result(rank)[0]
    finally:
        events.on_prompt = None
        job.release()
    if not done.get("debugged"):
        display.write("stderr", f"jupyter_scale: rank {rank} holds no failed cell (its worker started after the "
                                "failure)\n")
    return done
