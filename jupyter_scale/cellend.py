"""The end of a cell: its outcome applied to what the kernel knows of its workers, and to
the notebook.

`run.CellRun` observes a cell and returns an `Outcome`. `CellEnd.apply` records what it
means in the `WorkerStanding`: ranks lost (the session replaces their workers before the
next cell), a cut group (formed anew), ranks that may stand a step apart (equalized by the
next automatic cell), what the workers now hold of the notebook's values (shipping) and
the names the cell bound there. Then it ends the run: with the error, which names its
rank; or with rank 0's module buffers on every rank (automatic mode) and the pull-back
into the notebook (pullback).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import notebooknames, pullback, shipping, statesync, worker
from .backends import Backend, Job
from .display import RunView
from .errors import CellTimeout, DistributeError
from .frameworks.rules import FrameworkGroups
from .protocol import CellReply
from .records import RunRecord
from .run import Outcome
from .settings import SessionSettings

if TYPE_CHECKING:
    from .backends.channel import CellChannel


@dataclass
class WorkerStanding:
    """What the kernel knows of the workers it has now; new workers start a new one."""

    shipper: shipping.Shipper  # what they hold of the notebook's values
    frameworks: FrameworkGroups = field(default_factory=FrameworkGroups)  # the other frameworks' groups on them
    lost: list[int] = field(default_factory=list)  # ranks whose process died: restart before reuse
    group_ready: bool = False  # False once a cell cut the group: the next cell forms it anew
    resync: bool = False  # a cell failed: the next automatic cell equalizes the workers' models
    register_back: dict | None = None  # rank 0's tokens of the last values it sent back (see worker)
    sources_sent: set[str] = field(default_factory=set)  # notebook cells' files whose lines they hold


@dataclass
class CellEnd:
    """How one cell's run ends, given what it sent."""

    standing: WorkerStanding
    record: RunRecord
    view: RunView
    shipment: shipping.Shipment
    plan: shipping.Plan
    manual: bool
    namespace: dict  # the notebook's
    settings: SessionSettings  # the session's: call_timeout, pull_chunk_bytes, bring_back_limit
    calls: Callable[[], Backend | CellChannel]  # what carries a call to the ranks now
    stop: Callable[[Job], bool]  # stops the ranks of a job whose wait ended early (see the session)
    notify: Callable[..., None]  # tells the session's observers

    def apply(self, outcome: Outcome, frames_back: dict) -> None:
        """Apply how the cell's wait ended to the workers' standing, the shipper and the notebook."""
        standing, record = self.standing, self.record
        headers, error, lost = outcome.headers, outcome.error, outcome.lost
        record.elapsed = time.time() - record.started
        record.metrics.sort(key=lambda p: (p["time"], p["rank"]))

        if lost:
            # A worker process is gone: the next cell restarts the cluster.
            standing.lost = sorted(lost)
            standing.group_ready = False
        if not lost and all(h.get("received") for h in headers.values()):
            standing.shipper.commit(self.shipment)
            standing.register_back = None
        else:
            standing.shipper.discard()  # some rank may not hold the new values: send again
        # Names the cell bound on the workers are theirs until the notebook writes them
        # (the pull-back below makes pulled names the notebook's again).
        rebound = sorted({n for h in headers.values() for n in h.get("rebound", ()) if notebooknames.shippable(n)})
        standing.shipper.workers_rebound(rebound, self.plan)
        standing.frameworks.names_bound(rebound, record.framework)
        if any(not h.get("group_ready", False) for h in headers.values()):
            standing.group_ready = False
        if error is not None:
            standing.resync = True
            standing.frameworks.group_cut()  # their collectives were cut
            record.status = ("timed out" if isinstance(error, CellTimeout)
                             else "interrupted" if all(f.interrupted for f in error.failures) else "failed")
            record.error, record.failed_rank = str(error), error.rank
            self._finish()
            if record.status == "interrupted" and outcome.user_interrupted:
                ended = f"; the worker of rank(s) {sorted(lost)} ended, the next cell replaces it" if lost else ""
                ended += standing.frameworks.after_interrupt()
                raise KeyboardInterrupt(f"interrupted; ranks {sorted(f.rank for f in error.failures)} stopped "
                                        f"and are ready for the next cell{ended}"
                                        + (f"; where they were: {error.where_ranks_were()}"
                                           if error.where_ranks_were() else ""))
            raise error
        standing.resync = standing.resync and self.manual  # an automatic cell equalized the models
        if not self.manual:
            self._sync_buffers(headers)
            statesync.say_disagreements(headers)
        record.status = "finished"
        self._finish()
        if 0 in headers:
            self._apply_pulls(headers[0], frames_back.get(0, ()))
            standing.register_back = headers[0].get("returned", {}).get("back") or standing.register_back

    def broken(self, exc: BaseException) -> None:
        """The run ended without every rank's answer: failed, and whatever it shipped is
        sent again by the next cell (some rank may not hold it)."""
        self.record.status, self.record.error = "failed", str(exc)
        self.standing.shipper.discard()
        self._finish()

    def _finish(self) -> None:
        """Show the run's end in the cell and tell the observers (the sidebar)."""
        self.view.finish(self.record)
        self.notify("run_finished", self.record)

    def _sync_buffers(self, headers: dict[int, CellReply]) -> None:
        """Automatic mode ends a cell with rank 0's module buffers on every rank (as DDP's
        broadcast_buffers), for the names every rank holds alike. Compared here, from the
        ranks' answers, so that a cell without buffers costs no collective."""
        found = [headers[r].get("buffers") for r in sorted(headers)]
        signatures = [s for s in found if s is not None]
        if not signatures or not signatures[0] or len(signatures) < len(found):
            return  # no buffers on rank 0, or a rank without a process group
        common = [n for n, sig in signatures[0].items() if all(s.get(n) == sig for s in signatures)]
        if not common:
            return
        job = self.calls().submit(worker.sync_buffers, common)
        try:
            job.wait(self.settings.call_timeout)
        except DistributeError as exc:  # the next automatic cell equalizes everything
            self.standing.resync = True
            print(f"jupyter_scale: could not give every rank rank 0's module buffers ({exc}); "
                  "the next cell does", file=sys.stderr, flush=True)
        finally:
            job.release()

    def _apply_pulls(self, header: CellReply, frames: Sequence) -> None:
        applying = time.perf_counter()
        settings = self.settings
        pullback.Puller(self.namespace, self.standing.shipper, self.calls(), settings.pull_chunk_bytes,
                        settings.call_timeout, self._abandon_pull, self.plan,
                        settings.bring_back_limit).apply(header, frames, self.record)
        self.record.pullback_seconds = header.get("pack_seconds", 0.0) + time.perf_counter() - applying

    def _abandon_pull(self, job: Job) -> None:
        """A pull of a sharded model failed half-way: stop its ranks, form the group anew."""
        self.stop(job)
        self.standing.group_ready, self.standing.resync = False, True
