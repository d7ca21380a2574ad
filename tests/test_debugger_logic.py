"""The debugger's logic in this process: a rank's pdb answered through a real store by the
notebook's side (debugging.Line and debugger.RankPrompts meeting as they do across processes),
where a rank is, and identical lines of several ranks shown once. The real kernel, engines and
hosts: tests/test_debugging.py."""

from __future__ import annotations

import linecache
import queue
import sys
import threading
import time

import pytest
import torch.distributed as dist

from jupyter_scale import debugger, debugging, display

KEY = "k" * 32


class _Events:
    """Where the rank's debug events go: to the notebook's side, in this process."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()

    def emit(self, event):
        self.queue.put(event)

    def flush(self):
        return True


@pytest.fixture
def store(tmp_path):
    spec = {"file": str(tmp_path / "store")}
    dist.FileStore(spec["file"], -1)
    return spec


def _debugged(code: str, store: dict, rank: int, answers, world_size: int = 2, run: str = "run1"):
    """Run `code` (a cell, as a rank runs it) in a thread with its debugger answered by
    `answers(prompt)`, served by a RankPrompts here; (what the notebook showed, the cell's
    namespace, its exception)."""
    events = _Events()
    namespace: dict = {}
    linecache.cache["<distribute-cell-1>"] = (len(code), None, code.splitlines(keepends=True), "<distribute-cell-1>")
    failure: list = []

    def cell():
        line = debugging.Line(events, store, KEY, run, rank)
        try:
            with debugging.cell_running(line):
                exec(compile(code, "<distribute-cell-1>", "exec"), namespace)
        except BaseException as exc:  # noqa: B036 - the test looks at it
            failure.append(exc)
        finally:
            events.emit({"kind": "done"})

    shown: list[str] = []
    prompts = debugger.RankPrompts(store, KEY, run, world_size, ask=answers)
    thread = threading.Thread(target=cell)
    original = display.write
    display.write = lambda stream, text: shown.append(text)
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            event = events.queue.get(timeout=30)
            if event["kind"] == "done":
                break
            prompts.take(event)
            prompts.serve()
        thread.join(10)
    finally:
        display.write = original
    assert not thread.is_alive()
    return "".join(shown), namespace, failure[0] if failure else None


def test_a_breakpoint_is_answered_from_the_notebook(store):
    asked = []

    def answers(prompt):
        asked.append(prompt)
        return {1: "p x * 2", 2: "x = 7", 3: "c"}[len(asked)]

    shown, namespace, failure = _debugged("x = 21\nbreakpoint()\ny = x + 1\n", store, 1, answers)
    assert failure is None
    assert asked == ["[rank 1] (Pdb) "] * 3
    assert "[rank 1] -> y = x + 1" in shown  # the cell's own line, from linecache's copy
    assert "[rank 1] 42" in shown
    assert namespace["y"] == 8  # the assignment at the prompt took effect
    assert sys.gettrace() is None


def test_pdb_set_trace_and_quit(store):
    shown, namespace, failure = _debugged("import pdb\npdb.set_trace()\ny = 1\n", store, 0, lambda prompt: "q")
    assert type(failure).__name__ == "BdbQuit"  # as in a notebook: q ends the cell
    assert "y" not in namespace


def test_an_interrupt_at_the_prompt_ends_the_cell(store):
    def answers(prompt):
        raise KeyboardInterrupt

    shown, namespace, failure = _debugged("breakpoint()\ny = 1\n", store, 0, answers)
    assert isinstance(failure, KeyboardInterrupt)
    assert "y" not in namespace


def test_a_frontend_without_input_fails_the_cell_naming_the_rank(store):
    from IPython.core.error import StdinNotImplementedError

    def answers(prompt):
        raise StdinNotImplementedError("no stdin")

    shown, namespace, failure = _debugged("breakpoint()\ny = 1\n", store, 3, answers, world_size=4)
    assert isinstance(failure, debugging.NoPrompt)
    assert "rank 3" in str(failure) and "input requests" in str(failure)


def test_an_answer_not_signed_with_the_key_is_ignored(store):
    """Someone who reaches the store but holds no key cannot type into the debugger."""
    handle = dist.FileStore(store["file"], -1)
    where = debugging.answer_key("run1", 0, 1)

    def answers(prompt):
        handle.set(where, debugging.sign("x" * 32, where, "import os; os._exit(3)"))
        time.sleep(0.3)  # the rank looked at the forged answer and went on waiting
        return "c"

    shown, namespace, failure = _debugged("breakpoint()\ny = 1\n", store, 0, answers)
    assert failure is None and namespace["y"] == 1


def test_where_names_the_notebook_line_and_the_call():
    code = "def inner():\n    raise ValueError\nx = 1\ninner()\n"
    try:
        exec(compile(code, "<distribute-cell-3>", "exec"), {})
    except ValueError as exc:
        assert debugging.where_failed(exc, None) == "cell line 2"
        assert debugging.where_failed(exc, "all_reduce") == "all_reduce in cell line 2"


def test_where_of_a_library_call():
    code = "import json\njson.loads('{')\n"
    try:
        exec(compile(code, "<distribute-cell-3>", "exec"), {})
    except ValueError as exc:
        assert debugging.where_failed(exc, None) == "loads in cell line 2"


@pytest.mark.parametrize("answer, targets, command", [
    ("@all c", [0, 1, 2, 3], "c"), ("@1,3 p x", [1, 3], "p x"), ("@0-2 n", [0, 1, 2], "n"),
    ("p x", None, "p x"), ("@x c", None, "@x c"),
])
def test_cast_targets(answer, targets, command):
    assert debugger.cast_targets(answer, 4) == (targets, command)


def _prompt(rank, seq):
    return {"kind": "debug", "rank": rank, "seq": seq, "text": "", "prompt": f"[rank {rank}] (Pdb) ", "time": 0}


def test_a_cast_answers_the_ranks_at_a_prompt_now_and_the_others_at_their_next(store):
    answered = {}
    typed = iter(["n", "@all c"])
    prompts = debugger.RankPrompts(store, KEY, "r", 3, ask=lambda prompt: next(typed))
    prompts._answer = lambda event, answer: answered.setdefault((event["rank"], event["seq"]), answer)
    prompts.take(_prompt(1, 1))
    prompts.serve()  # rank 1 steps: in its debugger, not at a prompt
    prompts.take(_prompt(2, 1))
    prompts.serve()
    assert answered == {(1, 1): "n", (2, 1): "c"}
    prompts.take(_prompt(1, 2))  # its next prompt gets the cast's command, unasked
    assert answered == {(1, 1): "n", (2, 1): "c", (1, 2): "c"}
    assert not prompts.waiting


def test_rank_span():
    assert display.rank_span([0, 1, 2, 3]) == "0-3"
    assert display.rank_span([2, 0]) == "0,2"
    assert display.rank_span([0, 1, 2, 5]) == "0-2,5"


def _fed(labeler, pieces):
    out = []
    for rank, text in pieces:
        out.append(labeler.feed(rank, "stdout", text))
        out.extend(t for _, t in labeler.due())
    return "".join(out)


def test_identical_lines_of_every_rank_show_once():
    labeler = display.LineLabeler(world_size=4, collapse_window=60)
    shown = _fed(labeler, [(r, "epoch 1 done\n") for r in range(4)] + [(2, "only rank 2\n")])
    shown += "".join(t for _, t in labeler.flush())
    assert shown == "[rank 0-3] epoch 1 done\n[rank 2] only rank 2\n"


def test_a_rank_keeps_its_order_when_lines_collapse():
    labeler = display.LineLabeler(world_size=2, collapse_window=60)
    shown = _fed(labeler, [(0, "a\n"), (0, "b\n"), (1, "b\n"), (1, "a\n")])
    shown += "".join(t for _, t in labeler.flush())
    # rank 1's "b" came before its "a": it cannot join rank 0's "a" above rank 0's "b"
    assert shown.splitlines() == ["[rank 0] a", "[rank 0-1] b", "[rank 1] a"]


def test_a_line_not_every_rank_prints_shows_after_the_window():
    labeler = display.LineLabeler(world_size=3, collapse_window=0.05)
    assert _fed(labeler, [(0, "same\n"), (2, "same\n")]) == ""
    time.sleep(0.1)
    assert [t for _, t in labeler.due()] == ["[rank 0,2] same\n"]


@pytest.mark.parametrize("world_size, setting, collapsing", [
    (2, None, False), (3, None, True), (2, True, True), (8, False, False),
])
def test_lines_collapse_by_default_above_two_ranks(world_size, setting, collapsing):
    assert display.LineLabeler.for_cell(world_size, setting, 0.5).collapsing is collapsing


def test_without_a_window_every_line_is_labelled_at_once():
    labeler = display.LineLabeler(world_size=4)
    assert labeler.feed(0, "stdout", "x\n") == "[rank 0] x\n"


def test_which_rank_scale_debug_opens_or_why_none():
    from jupyter_scale.errors import DistributeError

    assert debugger.rank_to_debug(None, [0, 1], 2, []) == 1  # the last failed cell's
    assert debugger.rank_to_debug(0, [1], 2, []) == 0
    for rank, failed, size, lost, why in [(None, [], 2, [], "no %%distribute cell has failed"),
                                          (None, [1], 0, [], "no cluster is running"),
                                          (5, [1], 2, [], "rank 5 has no worker"),
                                          (None, [1], 2, [1], "rank 1 has no worker")]:
        with pytest.raises(DistributeError, match=why):
            debugger.rank_to_debug(rank, failed, size, lost)


def test_the_stack_starts_at_the_cell():
    """`bt` and `up` end at the cell's frame: what called it is the engine's."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        spec = {"file": f"{directory}/store"}
        typed = iter(["bt", "up", "up", "c"])
        shown, namespace, failure = _debugged("def f():\n    breakpoint()\n    return 1\nx = f()\n", spec, 0,
                                              lambda prompt: next(typed))
    assert failure is None and namespace["x"] == 1
    assert "<distribute-cell-1>(4)<module>()" in shown and "threading.py" not in shown
    assert "*** Oldest frame" in shown
