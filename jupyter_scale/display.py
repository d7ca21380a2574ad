"""What a running cell shows: the ranks' output labelled by rank, and its progress (the
live dashboard in a notebook, periodic text lines elsewhere)."""

from __future__ import annotations

import collections
import io
import itertools
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import metrics
from .backends import Output

if TYPE_CHECKING:
    from .records import RunRecord

_LINE_END = re.compile(r"[\r\n]")  # what ends a segment of a rank's output


def rank_span(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> "0-3"; [0, 2] -> "0,2"; [0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


@dataclass
class _Held:
    """A line waiting for other ranks to print it too."""

    id: int
    stream: str
    text: str
    ranks: list[int]
    since: float


class LineLabeler:
    """Prefixes each line a rank prints with `[rank N]`; keeps partial lines.

    A carriage return ends a segment too, so progress bars that redraw their line with
    `\r` (tqdm) show while they run, not only when their line is done. Each piece of text
    is scanned once: 20k one-character writes used to take 14 s, each re-scanning the
    line so far. A line that reaches `max_partial` characters without ending is shown
    as it is (a process that never prints a newline still shows, in bounded memory).

    With a `collapse_window`, a line that several of the `world_size` ranks print alike
    within that many seconds shows once, `[rank 0-3] epoch 1 done`: each finished line
    waits until every rank printed it or the window passed (`due`), and the lines show
    in the order they came, each rank's in its own order.
    """

    def __init__(self, max_partial: int = 64 * 1024, world_size: int = 1, collapse_window: float = 0.0,
                 on_line: Callable[[list[int], str, str], None] | None = None) -> None:
        self.max_partial = max_partial
        self.world_size, self.collapse_window = world_size, collapse_window
        self.on_line = on_line  # told of each finished line: (ranks, stream, text)
        self._partial: dict[tuple[int, str], io.StringIO] = {}
        self._after_cr: set[tuple[int, str]] = set()  # streams whose last character was \r
        self._held: collections.deque[_Held] = collections.deque()
        self._held_by_text: dict[tuple[str, str], list[_Held]] = {}
        self._last_held: dict[int, int] = {}  # each rank's latest held line (id)
        self._ids = itertools.count()

    @classmethod
    def for_cell(cls, world_size: int, collapse: bool | None, window: float,
                 on_line: Callable[[list[int], str, str], None] | None = None) -> LineLabeler:
        """A cell's labeler: lines collapse if `collapse`, or where it is None, above 2 ranks."""
        collapse = world_size > 2 if collapse is None else collapse
        return cls(world_size=world_size, collapse_window=window if collapse else 0.0, on_line=on_line)

    def _labelled(self, ranks: list[int], stream: str, text: str, ending: str) -> str:
        if self.on_line is not None and ending == "\n":
            self.on_line(ranks, stream, text)
        return f"[rank {rank_span(ranks)}] {text}{ending}"

    @property
    def collapsing(self) -> bool:
        return self.collapse_window > 0 and self.world_size > 1

    def _hold(self, rank: int, stream: str, text: str) -> None:
        after = self._last_held.get(rank, -1)
        for held in self._held_by_text.get((stream, text), ()):
            if held.id > after and rank not in held.ranks:  # joins it, keeping this rank's order
                held.ranks.append(rank)
                self._last_held[rank] = held.id
                return
        held = _Held(next(self._ids), stream, text, [rank], time.monotonic())
        self._held.append(held)
        self._held_by_text.setdefault((stream, text), []).append(held)
        self._last_held[rank] = held.id

    def due(self, everything: bool = False) -> list[tuple[str, str]]:
        """The held lines to show now: (stream, text) in order."""
        out = []
        now = time.monotonic()
        while self._held and (everything or len(self._held[0].ranks) >= self.world_size
                              or now - self._held[0].since >= self.collapse_window):
            held = self._held.popleft()
            self._held_by_text[(held.stream, held.text)].remove(held)
            if not self._held_by_text[(held.stream, held.text)]:
                del self._held_by_text[(held.stream, held.text)]
            out.append((held.stream, self._labelled(held.ranks, held.stream, held.text, "\n")))
        return out

    def feed(self, rank: int, stream: str, text: str) -> str:
        key = (rank, stream)
        out, start = [], 0
        for end in _LINE_END.finditer(text):
            i, ch = end.start(), end.group()
            segment = text[start:i]
            if start == 0 and key in self._partial:
                segment = self._partial.pop(key).getvalue() + segment
            after_cr = text[i - 1] == "\r" if i else key in self._after_cr
            if self.collapsing and ch == "\n" and (segment or not after_cr):
                self._hold(rank, stream, segment)
            elif segment or (ch == "\n" and not after_cr):  # a blank line, not the \n of a \r\n
                out.append(self._labelled([rank], stream, segment, ch))
            else:
                out.append(ch)
            start = i + 1
        if text.endswith("\r"):
            self._after_cr.add(key)
        elif text:
            self._after_cr.discard(key)
        if start < len(text):
            partial = self._partial.get(key)
            if partial is None:
                partial = self._partial[key] = io.StringIO()
            partial.write(text[start:])
            if partial.tell() >= self.max_partial:
                out.append(self._labelled([rank], stream, self._partial.pop(key).getvalue(), "\n"))
        return "".join(out)

    def flush(self) -> list[tuple[str, str]]:
        rest = self.due(everything=True)
        rest += [(stream, self._labelled([rank], stream, text.getvalue(), "\n"))
                 for (rank, stream), text in sorted(self._partial.items())]
        self._partial.clear()
        self._after_cr.clear()
        return rest



class RunView:
    """What the user sees of a running cell: the live dashboard or periodic text lines."""

    MAX_RATE = 10.0  # dashboard updates per second at most, whatever the report rate

    def __init__(self, widget: bool, progress_interval: float, record: RunRecord, total_steps: int | None):
        self.text = metrics.TextProgress(progress_interval)
        self.feed = None
        self.widget = self.handle = None
        self._pushed_at, self._dirty = 0.0, False
        self._started = time.monotonic()
        if widget:
            from IPython.display import display

            from .widgets import Dashboard, DashboardFeed

            self.feed = DashboardFeed(record.workers, total_steps)
            self.widget = Dashboard()
            self.feed.push(self.widget)
            self.handle = display(self.widget, display_id=True)

    def add(self, event: dict) -> None:
        if self.feed is not None:
            self.feed.add(event)
            self._dirty = True
        elif "kind" not in event:
            self.text.add(event)

    def line(self, ranks: list[int], stream: str, text: str) -> None:
        """A line the ranks printed (for the dashboard's output, which filters by rank)."""
        if self.feed is not None:
            self.feed.add_output(ranks, stream, text)
            self._dirty = True

    def tick(self) -> None:
        now = time.monotonic()
        if self.feed is not None:
            if self._dirty and now - self._pushed_at >= 1.0 / self.MAX_RATE:
                assert self.widget is not None  # made with the feed
                self.feed.push(self.widget)
                self._pushed_at, self._dirty = now, False
        elif self.text.due():
            write("stdout", f"jupyter_scale: {self.text.line()}\n")

    def finish(self, record: RunRecord) -> None:
        if self.feed is None:
            if self.text.last:
                write("stdout", f"jupyter_scale: {self.text.line()}  ({time.monotonic() - self._started:.1f} s)\n")
            return
        assert self.widget is not None  # made with the feed
        self.feed.finish(record.status, record.error, record.lost_events)
        self.feed.push(self.widget)
        if self.handle is None:  # not in a kernel: nothing to update
            return
        # Keep a static picture next to the live view: it is what a reopened notebook shows.
        from .widgets import snapshot_html

        shown: tuple[dict, dict] | dict = self.widget._repr_mimebundle_() or {}
        bundle = dict(shown[0] if isinstance(shown, tuple) else shown)  # (data, metadata) or data
        bundle["text/html"] = snapshot_html(self.feed)
        self.handle.update(bundle, raw=True)


class StatusLine:
    """What the cluster is doing, in one line: updated in place where the frontend shows
    displays (JupyterLab, Notebook 7, VS Code: see wants_widget), printed line by line
    elsewhere (nbconvert, a terminal), where a line cannot change."""

    def __init__(self, widget: bool):
        self._live = widget
        self._handle = None

    def say(self, text: str) -> None:
        if not self._live:
            print(text, flush=True)
            return
        bundle = {"text/plain": text}
        if self._handle is None:
            from IPython.display import display

            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)


def wants_widget(setting: str, shell: Any) -> bool:
    """The live widget where a frontend shows it (JupyterLab, VS Code); else text lines.
    `setting`: ScaleSession.display ('widget', 'text' or 'auto')."""
    if setting != "auto":
        return setting == "widget"
    in_kernel = shell is not None and getattr(shell, "kernel", None) is not None
    frontend = "JPY_SESSION_NAME" in os.environ or "VSCODE_PID" in os.environ
    return in_kernel and frontend


def emit(outputs: list[Output], labeler: LineLabeler) -> None:
    """Show the ranks' output in the cell: text labelled by rank, rich output once (rank 0's)."""
    for out in outputs:
        if out.stream == "display":
            if out.rank == 0:  # rich output is shown once, from rank 0
                from IPython.display import publish_display_data

                publish_display_data(out.data, out.metadata)
            continue
        text = labeler.feed(out.rank, out.stream, out.text)
        if text:
            write(out.stream, text)
    for stream, text in labeler.due():
        write(stream, text)


def write(stream: str, text: str) -> None:
    target = sys.stderr if stream == "stderr" else sys.stdout
    target.write(text)
    target.flush()
