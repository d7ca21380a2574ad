"""The metrics stream: report() on workers -> the kernel's history and progress, live.

Only what the cell's own ranks reported, in this cell, reaches the kernel: the event port
is open to every local user (stranger.py plays one), so batches are signed with a key the
workers get from the kernel, carry their run's id, and must be well formed.
"""

import hashlib
import hmac
import json
import math
import os
import threading
import time
import uuid

import pytest
import zmq
from stranger import require_stranger, run_as_stranger

from conftest import DEFAULT_ENGINES, ENGINES, kernel_fixture, on_engines
from jupyter_scale import metrics

# The kernel tests: each engine carries the events its own way (ipyparallel's iopub, Ray's
# outbox, a TCP port for Dask), so the live history runs on every engine; what the kernel makes
# of the points is the same on all, so the rest run on the default engine.
kernel = kernel_fixture(DEFAULT_ENGINES)


def _sign(key: str, batch) -> bytes:
    """The wire format, restated: HMAC-SHA256(key, body) in hex, then the JSON body."""
    body = batch if isinstance(batch, bytes) else json.dumps(batch).encode()
    return hmac.new(key.encode(), body, hashlib.sha256).hexdigest().encode() + body


def _point(rank=0, step=0, **scalars):
    return {"rank": rank, "step": step, "time": time.time(), **(scalars or {"loss": 1.0})}


def _wait_until(condition, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _push(address: str, messages) -> None:
    """Send raw messages to the event port, as anybody on this host can."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(address)
    for m in messages:
        if isinstance(m, list):
            sock.send_multipart(m)
        else:
            sock.send(m)
    sock.close(linger=5000)


def _report_through(stream, rank: int, n: int) -> metrics.EventSink:
    """A real sink of `stream`'s current run that reports n points; returns it once they
    all arrived."""
    sink = metrics.EventSink(stream.address, rank, stream.key)
    sink.begin(stream.run)
    recorder = metrics.Recorder(rank=rank, sink=sink)
    for i in range(n):
        recorder.report(loss=float(i))
    assert sink.flush(timeout=10)
    assert _wait_until(lambda: stream.received[rank] == sink.sent), (stream.received, sink.sent, stream.rejected)
    return sink


def test_every_event_of_every_rank_arrives_in_order():
    stream = metrics.EventStream()
    sinks = [metrics.EventSink(stream.address, rank, stream.key) for rank in (0, 1)]
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


def test_a_sink_that_cannot_queue_counts_every_event_it_drops():
    # Nothing listens at this address: ZeroMQ queues batches (not events) up to the sink's
    # high-water mark of 10_000, then refuses them; the sink counts drops, never blocks.
    sink = metrics.EventSink("tcp://127.0.0.1:9", rank=0, key="k")
    sink.stats_interval = math.inf  # one memory sample, with the first batch
    try:
        t0 = time.monotonic()
        for i in range(12_000):
            sink.emit({"rank": 0, "step": i, "time": 0.0, "loss": 1.0})
            assert sink.flush(timeout=5)  # a batch each (or fewer, when the thread sent it)
        assert time.monotonic() - t0 < 60  # a generous bound: it must not block
        assert sink.dropped > 0 and sink.sent >= 10_000
        assert sink.sent + sink.dropped == 12_000 + 1  # each event counted once, the sample too
    finally:
        sink.close()


def test_a_batch_longer_than_the_kernel_takes_arrives_in_parts():
    stream = metrics.EventStream()
    stream.begin(1)
    sink = metrics.EventSink(stream.address, 0, stream.key)
    sink.begin(stream.run)
    try:
        # 8 points of 2.4 MB of JSON each, queued at once: 19 MB in one batch (a busy loop
        # reporting many values gets there between two sends).
        wide = {f"value_{i:05d}_{'x' * 200}": 0.0 for i in range(12_000)}
        for i in range(8):
            sink.emit(_point(step=i, **wide))
        assert sink.flush(timeout=30)
        assert _wait_until(lambda: stream.received[0] == sink.sent, timeout=30), stream.rejected
        assert sink.dropped == 0 and not stream.rejected
        assert [e["step"] for e in stream.drain() if "kind" not in e] == list(range(8))
        # One point longer than the kernel takes (26 MB) is counted as dropped, never sent.
        sink.emit(_point(step=99, **{f"value_{i:06d}_{'x' * 200}": 0.0 for i in range(130_000)}))
        assert sink.flush(timeout=30)
        assert sink.dropped == 1 and not stream.rejected
    finally:
        sink.close()
        stream.close()


def test_what_is_not_our_sinks_batches_is_dropped_and_the_stream_lives_on():
    stream = metrics.EventStream()
    stream.begin(2)
    forged = {"run": stream.run, "rank": 0, "events": [_point(loss=-5.0)], "sent_before": 0}
    unsigned = [
        os.urandom(4096),                                   # garbage, not UTF-8
        b"",
        json.dumps({"rank": 0, "events": [_point(loss=-5.0)]}).encode(),  # the old format
        json.dumps(forged).encode(),                        # no signature
        b"0" * 64 + json.dumps(forged).encode(),           # a made-up one
        _sign("not the key", forged),                       # signed with another key
        [b"two", b"parts"],                                 # two frames: two messages
    ]
    # Signed with the key, as a sink with a bug would send: the kernel reads none of it.
    signed_bad = [_sign(stream.key, dict(forged, **change)) for change in (
        {"events": [_point(step="x")]},                     # a step the wait loop cannot format
        {"events": [_point(loss="1.0")]},
        {"events": [_point(step=True)]},
        {"events": [_point(rank=1)]},                       # another rank's event
        {"events": [dict(_point(), kind="bogus")]},
        {"events": [{"kind": "heartbeat", "rank": 0, "time": 0.0, "collective": 3}]},
        {"events": [{"kind": "state", "rank": 0, "time": 0.0, "state": "running", "host": {"a": 1}}]},
        {"events": {"0": _point()}},
        {"rank": 2, "events": [_point(rank=2)]},            # out of range: the run has two ranks
        {"rank": True},
    )] + [_sign(stream.key, [forged]), _sign(stream.key, b'{"rank": 0,')]  # not an object; not JSON
    sinks = []
    try:
        _push(stream.address, unsigned + signed_bad)
        n_unsigned = len(unsigned) + 1  # the multipart message counts twice
        assert _wait_until(lambda: sum(stream.rejected.values()) == n_unsigned + len(signed_bad)), stream.rejected
        assert stream.rejected == {"unsigned": n_unsigned, "malformed": len(signed_bad)}
        # The Dask channel hands over whatever a client of its scheduler logged.
        for message in (None, 5, {"rank": 0}, "\ud800", "x" * (metrics.MAX_MESSAGE_BYTES + 1)):
            stream.accept(message)
        assert stream.rejected["malformed"] == len(signed_bad) + 4 and stream.rejected["oversized"] == 1
        # Longer than the cap, though signed: ZeroMQ cuts that peer off before the message
        # is read; what it sends after reconnecting is counted.
        huge = dict(forged, events=[_point(step=i, pad=float(i)) for i in range(300_000)])
        _push(stream.address, [_sign(stream.key, huge), b"after"])
        assert _wait_until(lambda: stream.rejected["unsigned"] == n_unsigned + 1)
        assert stream.rejected["oversized"] == 1  # the one handed to accept() above
        assert not stream.received and not stream.drain()
        sinks += [_report_through(stream, rank, 1000) for rank in (0, 1)]
        points = [e for e in stream.drain() if "kind" not in e]
        assert sorted((p["rank"], p["step"]) for p in points) == [(r, i) for r in (0, 1) for i in range(1000)]
        assert stream._thread.is_alive()
    finally:
        for s in sinks:
            s.close()
        stream.close()


def test_whatever_fails_while_reading_one_message_the_stream_reads_on():
    class Failing(metrics.EventStream):  # an error this code does not foresee, once
        failed = False

        def accept(self, message):
            if not self.failed:
                self.failed = True
                raise MemoryError("reading one message")
            super().accept(message)

    stream = Failing()
    try:
        _push(stream.address, [b"first"])
        assert _wait_until(lambda: stream.failed)
        sink = _report_through(stream, 0, 100)
        assert stream._thread.is_alive() and stream.received[0] == sink.sent
        sink.close()
    finally:
        stream.close()


STRANGER_FLOOD = """
    import json, os, time, zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect({address!r})
    point = {{"rank": 0, "step": 7, "time": time.time(), "loss": -5.0}}
    forged = [
        {{"run": {run!r}, "rank": 0, "events": [point], "sent_before": 0}},
        {{"rank": 0, "events": [point]}},
        {{"run": {run!r}, "rank": 0, "events": [dict(point, step="x")], "sent_before": 0}},
    ]
    messages = [os.urandom(n) for n in (1, 64, 100, 5000)] + [bytes([255]) * 70]
    messages += [prefix + json.dumps(f).encode() for f in forged for prefix in (b"", b"0" * 64, os.urandom(64))]
    for m in messages * 20:
        sock.send(m)
    sock.send_multipart([b"a", b"b", b"c"])
    sock.send(b"x" * (17 * 2**20))  # over the cap: ZeroMQ cuts this connection
    print("sent", len(messages) * 20 + 3)
    sock.close(linger=5000)
"""


def test_a_stranger_can_neither_feed_nor_stop_the_event_stream():
    require_stranger()
    stream = metrics.EventStream()
    stream.begin(1)
    try:
        result = run_as_stranger(STRANGER_FLOOD.format(address=stream.address, run=stream.run))
        assert result.returncode == 0, result.stderr
        sent = int(result.stdout.split()[-1])
        assert _wait_until(lambda: stream.rejected["unsigned"] == sent), stream.rejected
        assert set(stream.rejected) == {"unsigned"} and not stream.received
        sink = _report_through(stream, 0, 1000)
        assert [e["step"] for e in stream.drain() if "kind" not in e] == list(range(1000))
        assert stream._thread.is_alive()
        sink.close()
    finally:
        stream.close()


def test_points_of_an_abandoned_run_that_arrive_late_are_dropped():
    stream = metrics.EventStream()
    first = stream.begin(1)
    sink = metrics.EventSink(stream.address, 0, stream.key)
    try:
        sink.begin(first)
        recorder = metrics.Recorder(rank=0, sink=sink)
        recorder.report(loss=-1.0)
        assert sink.flush() and _wait_until(lambda: stream.received[0] == sink.sent)
        recorder.report(loss=-2.0)  # still queued when the kernel gives up on that run
        second = stream.begin(1)
        assert not stream.drain() and not stream.received  # what had arrived goes too
        sink.begin(second)  # the rank's next cell: the late point goes first, as the first run's
        recorder.report(loss=3.0)
        assert sink.flush() and _wait_until(lambda: stream.received[0] == sink.sent)
        assert [p["loss"] for p in stream.drain() if "kind" not in p] == [3.0]
        assert stream.rejected == {"earlier run": 1}
    finally:
        sink.close()
        stream.close()


def test_report_refuses_the_names_it_sets_itself():
    # A point whose own "rank" or "time" replaced the stamped one would be refused whole
    # by the kernel (and take the batch's other points with it).
    recorder = metrics.Recorder(rank=0)
    for name in ("rank", "time", "kind"):
        with pytest.raises(TypeError, match=repr(name)):
            recorder.report(**{name: 1.0, "loss": 0.5})
    assert recorder.drain() == []


def test_text_progress_is_one_concise_line_with_the_rate_of_training_alone():
    progress = metrics.TextProgress(interval=0)
    time.sleep(0.2)  # the cluster starting: not training
    progress.add({"rank": 0, "step": 0, "time": 100.0, "loss": 0.9})
    progress.add({"rank": 0, "step": 119, "time": 100.5, "loss": 0.4321})
    progress.add({"rank": 1, "step": 119, "time": 100.5, "loss": 0.45})
    assert progress.due()
    # From the first step to the latest, by the points' own clocks: 119 steps in 0.5 s.
    assert progress.line() == "step 120  loss r0 0.4321 r1 0.45  238 steps/s"
    assert not progress.due()  # nothing new since
    progress.add({"rank": 0, "step": 219, "time": 101.0, "loss": 0.3})
    assert progress.line().endswith("loss r0 0.3 r1 0.45  200 steps/s")  # since the last line


@on_engines(ENGINES)
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
    progress_lines = [line for line in out.stdout.splitlines() if line.startswith("jupyter_scale: step")]
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


FLOODED_CELL = """%%distribute --workers 2
import pathlib, time
if rank == 0:  # a process on the cluster without the key sends what it likes
    if events_address.startswith("tcp://"):
        import zmq
        rogue = zmq.Context.instance().socket(zmq.PUSH)
        rogue.connect(events_address)
        for m in rogue_messages:
            rogue.send(m)
        rogue.close(linger=5000)
    elif events_address.startswith("ipyparallel-iopub://"):  # the engine's own channel
        from jupyter_scale.backends.ipyparallel import _IOPubTransport
        channel = _IOPubTransport(events_address)
        for m in rogue_messages:
            channel.send(m)
    elif events_address.startswith("channel://"):  # the kernel's direct channel to the workers on its host
        from jupyter_scale.backends.channel import _EventTransport
        channel = _EventTransport(events_address)
        for m in rogue_messages:
            channel.send(m)
    elif events_address.startswith("ray-outbox://"):  # Ray: the actor's outbox, which the kernel reads
        from jupyter_scale.backends.ray import _OutboxTransport
        channel = _OutboxTransport(events_address)
        for m in rogue_messages:
            channel.send(m)
    else:  # Dask: the run's event topic
        from distributed import get_worker
        for m in rogue_messages:
            get_worker().log_event(events_address.split("://", 1)[1], m)
for i in range(100):
    report(loss=float(i))
pathlib.Path(f"{marks}.{rank}").touch()
deadline = time.time() + 120
while not pathlib.Path(f"{marks}.go").exists():  # the stranger floods the port now
    assert time.time() < deadline, "never told to go on"
    time.sleep(0.05)
for i in range(100, 200):
    report(loss=float(i))
"""


def _flood_as_stranger(address: str) -> int:
    """Garbage and forged points into the kernel's event port from another local user;
    how many messages reached it."""
    result = run_as_stranger(STRANGER_FLOOD.format(address=address, run=""))
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1])


def test_history_holds_exactly_the_ranks_points_whatever_else_arrives(kernel, tmp_path):
    kernel.ok("%%distribute --workers 2\nreport(loss=-1.0)")
    events = kernel.value("{k: getattr(jupyter_scale.get_session().events, k) for k in ('address', 'key', 'run')}")
    forged = {"run": events["run"], "rank": 0, "events": [_point(loss=-5.0)], "sent_before": 0}
    rogue = [os.urandom(1000), json.dumps(forged).encode(), b"0" * 64 + json.dumps(forged).encode(),
             _sign("another key", forged),
             # Signed as rank 0 of the first cell did, arriving in the second: late.
             _sign(events["key"], dict(forged, events=[_point(loss=-1000.0)]))]
    marks = str(tmp_path / uuid.uuid4().hex)
    address = kernel.value("jupyter_scale.get_session().events_address")  # what the cells send to
    kernel.ok(f"rogue_messages, events_address, marks = {rogue!r}, {address!r}, {marks!r}")
    flooded = events["address"].startswith("tcp://")  # the engines' channels have no port to flood
    strangers = _flood_as_stranger(events["address"]) if flooded else 0  # between cells
    results = []
    cell = threading.Thread(target=lambda: results.append(kernel.cell(FLOODED_CELL)))
    cell.start()
    try:
        assert _wait_until(lambda: all(os.path.exists(f"{marks}.{r}") for r in (0, 1)), timeout=120)
        if flooded:  # and while the cell runs
            strangers += _flood_as_stranger(events["address"])
    finally:
        open(f"{marks}.go", "w").close()
        cell.join(timeout=180)
    assert results and results[0].ok, results and results[0].error_text
    points = kernel.value("[(p['rank'], p['step'], p['loss']) for p in jupyter_scale.history()]")
    assert sorted((r, loss) for r, _, loss in points) == [(r, float(i)) for r in (0, 1) for i in range(200)]
    for r in (0, 1):
        steps = [s for rank, s, _ in points if rank == r]
        assert steps == list(range(steps[0], steps[0] + 200))
    assert kernel.value("jupyter_scale.get_session().runs[-1].lost_events") == 0
    # The next cell is whole too; by now every rogue message has arrived.
    kernel.ok("%%distribute\nreport(loss=7.0)")
    assert sorted(kernel.value("[(p['rank'], p['loss']) for p in jupyter_scale.history()]")) == [(0, 7.0), (1, 7.0)]
    rejected = kernel.value("dict(jupyter_scale.get_session().events.rejected)")
    assert rejected == {"unsigned": len(rogue) - 1 + strangers, "earlier run": 1}, (rejected, strangers)
