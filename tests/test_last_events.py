"""A cell's last reported points arrive after its answer and still count (the direct channel).

The channel carries answers and events on two sockets, so a rank's last batch of points can
reach the kernel after its answer. In-process: the kernel's channel and one worker end, and
a call that answers before its points are sent.
"""

import threading
import time

from jupyter_scale import metrics
from jupyter_scale.backends import channel
from jupyter_scale.display import RunView
from jupyter_scale.records import RunRecord
from jupyter_scale.run import CellRun, WaitLimits

POINTS = 5


def answer_then_report(events_address, key, run):
    sink = metrics.EventSink(events_address, 0, key)
    sink.begin(run)

    def later():
        time.sleep(0.3)  # after the answer is on its way
        for step in range(POINTS):
            sink.emit({"rank": 0, "step": step, "time": time.time(), "loss": float(step)})
        sink.flush()

    threading.Thread(target=later, daemon=True).start()
    return ({"status": "ok", "events_sent": POINTS},)


def test_points_sent_after_the_answer_are_waited_for_and_kept():
    events = metrics.EventQueue()
    kernel_end = channel.CellChannel(1, lambda: [], events)
    try:
        channel.serve(kernel_end.directory, kernel_end.identities[0], 0)
        assert kernel_end.await_workers(5.0)
        run = events.begin(1)
        job = kernel_end.submit(answer_then_report, kernel_end.events_address, events.key, run)
        record = RunRecord(index=1, workers=1)
        limits = WaitLimits(poll_interval=0.05, abort_grace=1.0, stop_deadline=5.0, silence_limit=10.0,
                            heartbeat_interval=1.0, hang_warning=0.0)
        cell = CellRun(job, record, RunView(False, 60.0, record, None), timeout=None, backend=None,
                       workers=[{"node": "here", "hostname": "here", "pid": 0}], placement=None, events=events,
                       limits=limits, run_id=run, request_abort=lambda: None, notify=lambda *args: None)
        outcome = cell.wait()
        assert outcome.error is None
        assert [p["step"] for p in record.metrics] == list(range(POINTS)) and record.lost_events == 0
    finally:
        channel.close_worker_end()
        kernel_end.close()
