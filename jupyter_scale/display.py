"""What a running cell shows: the ranks' output labelled by rank, and its progress (the
live dashboard in a notebook, periodic text lines elsewhere)."""

from __future__ import annotations

import io
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any

from . import metrics
from .backends import Output

if TYPE_CHECKING:
    from .records import RunRecord

_LINE_END = re.compile(r"[\r\n]")  # what ends a segment of a rank's output


class LineLabeler:
    """Prefixes each line a rank prints with `[rank N]`; keeps partial lines.

    A carriage return ends a segment too, so progress bars that redraw their line with
    `\r` (tqdm) show while they run, not only when their line is done. Each piece of text
    is scanned once: 20k one-character writes used to take 14 s, each re-scanning the
    line so far. A line that reaches `max_partial` characters without ending is shown
    as it is (a process that never prints a newline still shows, in bounded memory).
    """

    def __init__(self, max_partial: int = 64 * 1024) -> None:
        self.max_partial = max_partial
        self._partial: dict[tuple[int, str], io.StringIO] = {}
        self._after_cr: set[tuple[int, str]] = set()  # streams whose last character was \r

    def feed(self, rank: int, stream: str, text: str) -> str:
        key = (rank, stream)
        out, start = [], 0
        for end in _LINE_END.finditer(text):
            i, ch = end.start(), end.group()
            segment = text[start:i]
            if start == 0 and key in self._partial:
                segment = self._partial.pop(key).getvalue() + segment
            after_cr = text[i - 1] == "\r" if i else key in self._after_cr
            if segment or (ch == "\n" and not after_cr):  # a blank line, not the \n of a \r\n
                out.append(f"[rank {rank}] {segment}{ch}")
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
                out.append(f"[rank {rank}] {self._partial.pop(key).getvalue()}\n")
        return "".join(out)

    def flush(self) -> list[tuple[str, str]]:
        rest = [(stream, f"[rank {rank}] {text.getvalue()}\n") for (rank, stream), text in sorted(self._partial.items())]
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


def write(stream: str, text: str) -> None:
    target = sys.stderr if stream == "stderr" else sys.stdout
    target.write(text)
    target.flush()
