"""The metrics stream: report() on workers -> the kernel's history and progress, live."""

import threading
import time

import pytest

from jupyter_scale import metrics


def test_every_event_of_every_rank_arrives_in_order():
    stream = metrics.EventStream()
    sinks = [metrics.EventSink(stream.address, rank) for rank in (0, 1)]
    try:
        recorders = [metrics.Recorder(rank=s.rank, sink=s) for s in sinks]
        for i in range(5000):
            for r in recorders:
                r.report(loss=float(i))
        for s in sinks:
            assert s.flush(timeout=10)
        deadline = time.monotonic() + 10
        while any(stream.received[s.rank] < s.sent for s in sinks) and time.monotonic() < deadline:
            time.sleep(0.01)
        events = [e for e in stream.drain() if "kind" not in e]  # the points (not memory stats)
        for rank in (0, 1):
            steps = [e["step"] for e in events if e["rank"] == rank]
            assert steps == list(range(5000))
            assert [e["loss"] for e in events if e["rank"] == rank] == [float(i) for i in range(5000)]
        assert all(s.dropped == 0 for s in sinks)
        assert all(stream.received[s.rank] == s.sent for s in sinks)
        assert len(stream.address.split(":")) == 3 and "127.0.0.1" in stream.address
    finally:
        for s in sinks:
            s.close()
        stream.close()


def test_a_sink_without_a_reader_counts_what_it_could_not_send():
    # Nothing listens at this address: ZeroMQ queues up to the high-water mark, then the
    # sink counts drops instead of blocking the training loop.
    sink = metrics.EventSink("tcp://127.0.0.1:9", rank=0)
    try:
        t0 = time.monotonic()
        for i in range(50_000):
            sink.emit({"rank": 0, "step": i})
            if i % 1000 == 0:
                sink.flush(timeout=5)
        sink.flush(timeout=5)
        assert time.monotonic() - t0 < 60  # a generous bound: it must not block forever
        assert sink.sent + sink.dropped >= 50_000  # every point accounted for (+ memory stats)
    finally:
        sink.close()


def test_text_progress_is_one_concise_line():
    progress = metrics.TextProgress(interval=0)
    progress.add({"rank": 0, "step": 119, "time": 0, "loss": 0.4321})
    progress.add({"rank": 1, "step": 119, "time": 0, "loss": 0.45})
    assert progress.due()
    line = progress.line()
    assert line.startswith("step 120  loss r0 0.4321 r1 0.45  ") and line.endswith(" steps/s")
    assert not progress.due()  # nothing new since


def test_history_of_a_distributed_run_is_complete_and_live(kernel, tmp_path):
    flag = tmp_path / "seen-progress"

    def on_stream(name, text):
        if "jupyter_scale: step" in text:
            flag.write_text("ok")

    out = kernel.cell(f"""%%distribute --workers 2
import time, pathlib
for i in range(2000):
    report(loss=1.0 / (i + 1), epoch=i // 1000)
deadline = time.time() + 60
while not pathlib.Path({str(flag)!r}).exists():   # the kernel shows progress while we run
    assert time.time() < deadline, "no live progress line"
    report(loss=0.0, epoch=9)
    time.sleep(0.05)
""", on_stream=on_stream)
    assert out.ok, out.error_text
    progress_lines = [l for l in out.stdout.splitlines() if l.startswith("jupyter_scale: step")]
    assert 1 <= len(progress_lines) <= 40  # periodic lines, not one per report
    assert "loss r0" in progress_lines[0] and "r1" in progress_lines[0]
    kernel.ok("""
run = jupyter_scale.get_session().runs[-1]
points = jupyter_scale.history()
for r in (0, 1):
    steps = [p["step"] for p in points if p["rank"] == r]
    assert steps == list(range(len(steps))) and len(steps) >= 2000, (r, len(steps))
assert run.lost_events == 0
states = [(s["rank"], s["state"]) for s in run.states]
assert sorted(states) == [(0, "finished"), (0, "running"), (1, "finished"), (1, "running")], states
frame = jupyter_scale.history(as_frame=True)
assert len(frame) == len(points) and {"rank", "step", "loss", "epoch", "time"} <= set(frame.columns)
""")


def test_failed_rank_state_reaches_the_kernel(kernel):
    out = kernel.cell("%%distribute\nreport(loss=1.0)\nif rank == 1:\n    raise RuntimeError('x')")
    assert not out.ok
    kernel.ok("""
run = jupyter_scale.get_session().runs[-1]
assert (1, "failed") in [(s["rank"], s["state"]) for s in run.states], run.states
assert sorted(p["rank"] for p in jupyter_scale.history()) == [0, 1]
""")
