"""Debugging a distributed cell from the notebook, on every engine, through a real kernel whose
input requests the test answers as a frontend does: a breakpoint on rank 1, two ranks at one
breakpoint, post-mortem after rank 1 raised, an interrupt at the prompt, where every rank is
when a cell times out or hangs, and identical lines of the ranks shown once."""

from __future__ import annotations

import re
import threading
import time

import pytest

from conftest import DEFAULT_ENGINES, ENGINES, kernel_fixture, on_engines, per_rank_lines

pytestmark = pytest.mark.cluster

kernel = kernel_fixture(ENGINES)


def _answers(*typed):
    """A frontend that types `typed`, one per prompt, and records the prompts."""
    pending = list(typed)
    asked: list[str] = []

    def answer(prompt):
        asked.append(prompt)
        return pending.pop(0)

    answer.asked = asked
    answer.left = pending
    return answer


def test_a_breakpoint_on_rank_1_is_inspected_and_continued(kernel):
    answer = _answers("p x * 2", "x = 5", "c")
    out = kernel.cell("%%distribute\nx = 20 + rank\nif rank == 1:\n    breakpoint()\ny = x + 1\nprint('y is', y)\n",
                      stdin=answer, timeout=120)
    assert out.ok, out.error_text
    assert answer.asked == ["[rank 1] (Pdb) "] * 3 and not answer.left
    assert "[rank 1] -> y = x + 1" in out.stdout  # the cell's own line
    assert "[rank 1] 42" in out.stdout
    assert "[rank 0] y is 21" in out.stdout and "[rank 1] y is 6" in out.stdout  # x = 5 took effect
    assert kernel.ok("%%distribute\nprint('next', rank)\n").ok  # the cluster goes on


def test_two_ranks_at_one_breakpoint_are_served_and_cast_to(kernel):
    inspected, casts = set(), []

    def answer(prompt):
        # Each rank inspected on its own (whichever stops first), then one command to both.
        rank = int(prompt.split()[1].rstrip("]"))
        if rank not in inspected:
            inspected.add(rank)
            return "p rank * 100"
        if inspected != {0, 1}:
            return "p 'the other rank is on its way'"
        casts.append(prompt)
        return "@all c"

    out = kernel.cell("%%distribute\nbreakpoint()\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n"
                      "print('sum', t.item())\n", stdin=answer, timeout=120)
    assert out.ok, out.error_text
    assert inspected == {0, 1} and len(casts) == 1  # @all answered the other rank too, now or at its next prompt
    assert "[rank 0] 0" in out.stdout and "[rank 1] 100" in out.stdout
    assert "[rank 0] sum 3.0" in out.stdout and "[rank 1] sum 3.0" in out.stdout


def test_time_at_a_prompt_does_not_count_toward_the_timeout(kernel):
    def slow(prompt):
        time.sleep(10)  # the user reads the code for a while
        return "c"

    out = kernel.cell("%%distribute --timeout 6\nif rank == 1:\n    breakpoint()\nt = torch.ones(1)\ndist.all_reduce(t)\n",
                      stdin=slow, timeout=120)
    assert out.ok, out.error_text


def test_an_interrupt_at_the_prompt_stops_every_rank_cleanly(kernel):
    def interrupt(prompt):
        threading.Timer(0.5, kernel.manager.interrupt_kernel).start()
        return None  # the user presses stop instead of answering

    started = time.monotonic()
    out = kernel.cell("%%distribute\nif rank == 0:\n    breakpoint()\nt = torch.ones(1)\ndist.all_reduce(t)\n",
                      stdin=interrupt, timeout=120)
    assert out.error is not None and out.error["ename"] == "KeyboardInterrupt", out.error_text
    assert "ranks [0, 1] stopped" in out.error_text
    assert "where they were: rank 0: cell line 3; rank 1: all_reduce in cell line 4" in out.error_text
    assert time.monotonic() - started < 30
    assert "[rank 0] ok" in kernel.ok("%%distribute\nprint('ok')\n").stdout


def test_a_frontend_that_answers_no_input_fails_the_cell_naming_the_rank(kernel):
    out = kernel.cell("%%distribute\nif rank == 1:\n    breakpoint()\n", timeout=120)
    assert out.error is not None and "rank 1 stopped in the debugger" in out.error_text
    assert "input requests" in out.error_text


def test_post_mortem_opens_pdb_where_rank_1_raised(kernel):
    """In a function the notebook defined (its cell's lines come with it) called by the cell."""
    kernel.ok("def step(v):\n    scale = v * 3\n    raise ValueError(f'bad {scale}')\n")
    out = kernel.cell("%%distribute\nif rank == 1:\n    step(7)\n", timeout=120)
    assert out.error is not None and "rank 1 failed: ValueError: bad 21" in out.error_text
    assert "raise ValueError(f'bad {scale}')" in out.error_text  # the traceback shows the notebook's line
    answer = _answers("p scale", "up", "p rank", "q")
    out = kernel.cell("%scale debug", stdin=answer, timeout=120)
    assert out.ok, out.error_text
    assert answer.asked == ["[rank 1] (Pdb) "] * 4
    assert "[rank 1] 21" in out.stdout
    assert "[rank 1] -> raise ValueError(f'bad {scale}')" in out.stdout  # the notebook's source lines
    assert "[rank 1] -> step(7)" in out.stdout and "[rank 1] 1" in out.stdout
    assert kernel.ok("%%distribute\nprint('after', rank)\n").ok


def test_a_timeout_names_where_each_rank_was(kernel):
    out = kernel.cell("%%distribute --timeout 3\nt = torch.ones(1)\nif rank == 1:\n    time.sleep(60)\n"
                      "dist.all_reduce(t)\n", timeout=120)
    assert out.error is not None and out.error["ename"] == "CellTimeout", out.error_text
    assert "Where the ranks were: rank 0: all_reduce in cell line 4; rank 1: cell line 3" in out.error_text


def test_stacks_name_the_collective_a_hung_rank_waits_in(kernel):
    """`%scale stacks` while a cell hangs (run from another thread, as a background job is)."""
    kernel.ok("import threading\ns = jupyter_scale.get_session()\ns.heartbeat_interval = 0.5\nbefore = len(s.runs)\n"
              "hung = threading.Thread(target=lambda: s.run("
              "'t = torch.ones(1)\\nif rank == 1:\\n    time.sleep(10)\\ndist.all_reduce(t)\\n'), daemon=True)\n"
              "hung.start()\n"
              "deadline = time.monotonic() + 30\n"
              "while time.monotonic() < deadline and not (len(s.runs) > before and s.runs[-1].status == 'running'\n"
              "                                          and (s.beats.get(0) or {}).get('collective')):\n"
              "    time.sleep(0.1)\n")
    out = kernel.ok("print(s.stacks())\nhung.join(60)\nprint('joined', not hung.is_alive())\n"
                    "s.heartbeat_interval = 5.0\n", timeout=120)
    assert "--- rank 0: all_reduce in cell line 4 ---" in out.stdout, out.stdout
    assert re.search(r"--- rank 1: (\w+ in )?cell line 3 ---", out.stdout), out.stdout
    assert "Thread the cell's:" in out.stdout and "time.sleep(10)" in out.stdout  # rank 1's own line
    assert "joined True" in out.stdout
    idle = kernel.ok("%scale stacks").stdout
    assert "--- rank 0: idle: no cell is running ---" in idle and "--- rank 1: idle: no cell is running ---" in idle


def test_identical_lines_of_the_ranks_show_once(kernel):
    """(On by default above 2 ranks: tests/test_debugger_logic.py.)"""
    # A window long enough that a loaded machine's delay between the ranks cannot split the line.
    kernel.ok("%config ScaleSession.collapse_output = True\n%config ScaleSession.collapse_window = 30.0")
    out = kernel.ok("%%distribute\nprint('epoch 1 done')\nif rank == 1:\n    print('only rank 1')\n"
                    "print('loss', rank)\n")
    kernel.ok("%config ScaleSession.collapse_output = None\n%config ScaleSession.collapse_window = 0.5")
    assert out.stdout.count("epoch 1 done") == 1 and "[rank 0-1] epoch 1 done" in out.stdout
    assert "[rank 1] only rank 1" in out.stdout
    assert "[rank 0] loss 0" in out.stdout and "[rank 1] loss 1" in out.stdout


@on_engines(DEFAULT_ENGINES)
def test_stacks_of_a_rank_that_would_not_stop(kernel):
    """A rank that ignores the interrupt is given up on; `%scale stacks` still shows where it is
    (its group watch answers after the group was cut), then the next cell replaces it."""
    kernel.ok("jupyter_scale.get_session().stop_deadline = 3.0")
    interrupted = []

    def interrupt_once_deaf(name, text):  # once rank 1 ignores SIGINT
        if "[rank 1] deaf" in text and not interrupted:
            interrupted.append(True)
            kernel.manager.interrupt_kernel()

    out = kernel.cell("%%distribute\nimport signal\nif rank == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                      "    print('deaf', flush=True)\n    time.sleep(60)\n", timeout=120, on_stream=interrupt_once_deaf)
    assert out.error is not None and "ranks [1] did not stop within 3 s" in out.error_text, out.error_text
    stacks = kernel.ok("%scale stacks", timeout=60).stdout
    assert "--- rank 1: cell line 5 ---" in stacks and "time.sleep(60)" in stacks, stacks
    assert "--- rank 0: idle: no cell is running ---" in stacks
    kernel.ok("jupyter_scale.get_session().stop_deadline = 15.0")
    out = kernel.ok("%%distribute\nimport time, torch\nimport torch.distributed as dist\n")  # fresh workers
    assert "restarting" in out.stdout + out.stderr


@pytest.fixture(autouse=True)
def _imports(request):
    """The module's kernel, with what its cells use (once per kernel)."""
    if "kernel" not in request.fixturenames:
        return
    kernel = request.getfixturevalue("kernel")
    if getattr(kernel, "debugging_ready", False):
        return
    kernel.debugging_ready = True
    kernel.ok("import time, torch, jupyter_scale\nimport torch.distributed as dist")
    kernel.ok("%%distribute --workers 2\nimport time, torch\nimport torch.distributed as dist\n")


def test_the_debugging_notebook_runs_live_with_its_answers(fresh_kernel):
    """examples/debugging.ipynb's prompts are answered here with the answers its cells keep
    (nbval runs its other cells): the same prompts, and what the cells showed, as stored."""
    import json
    from pathlib import Path

    notebook = json.loads((Path(__file__).parent.parent / "examples" / "debugging.ipynb").read_text())
    for cell in (c for c in notebook["cells"] if c["cell_type"] == "code"):
        source = "".join(cell["source"])
        answers = list(cell["metadata"].get("jupyter_scale", {}).get("answers", []))
        if not answers:
            fresh_kernel.cell(source, timeout=300, history=True)
            continue
        out = fresh_kernel.cell(source, timeout=300, history=True, stdin=lambda prompt, typed=answers: typed.pop(0))
        assert out.ok and not answers, out.error_text
        stored = "".join("".join(o["text"]) for o in cell["outputs"] if o.get("name") == "stdout")
        shown = "".join(f"{prompt}{answer}\n" for prompt, answer in out.answered)
        typed = [line for line in stored.splitlines() if "(Pdb) " in line]
        assert shown.splitlines() == typed

        def fixed(text):  # a loss's digits, and which alike lines collapsed, vary between runs
            return {re.sub(r"\d+\.\d+", "#", line) for line in per_rank_lines(text) if "(Pdb) " not in line}

        assert fixed(stored) <= fixed(out.stdout), (stored, out.stdout)
