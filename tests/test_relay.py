"""The one relay: what workers send besides their answers reaches the right job or queue.

Every engine that carries output as capture's messages (Dask's topics, Ray's outboxes, the
direct channel) hands them to a `Relay`; these are its rules, in-process.
"""

from jupyter_scale.backends.relay import Relay, RelayedJob
from jupyter_scale.metrics import EventQueue


class Call(RelayedJob):
    """A job whose answers do not matter here."""

    def _replied(self, rank):
        return False

    def _worker_gone(self, rank):
        return False

    def result(self, rank):
        raise AssertionError("not asked")


def output(job_id, rank, *parts, end=False):
    return {"job": job_id, "rank": rank, "parts": list(parts), "end": end}


def test_output_reaches_its_own_job_in_order_and_a_rank_is_complete_at_its_end_marker():
    relay = Relay()
    first, second = (Call(relay, relay.new_id(print), [0, 1]) for _ in range(2))
    relay.add(first)
    relay.add(second)
    assert first.job_id != second.job_id
    relay.output(output(first.job_id, 1, ("stdout", "a\n")))
    relay.output(output(second.job_id, 0, ("stderr", "other job\n")))
    relay.output(output(first.job_id, 1, ("stdout", "b\n"), ("display", {"text/plain": "x"}, {}), end=True))
    got = first.new_output()
    assert [(o.rank, o.stream, o.text) for o in got] == [(1, "stdout", "a\n"), (1, "stdout", "b\n"), (1, "display", "")]
    assert got[2].data == {"text/plain": "x"}
    assert first._output_complete(1) and not first._output_complete(0)
    assert [o.text for o in second.new_output()] == ["other job\n"]


def test_a_released_jobs_late_output_is_dropped_and_events_go_to_the_queue():
    queue = EventQueue()
    relay = Relay(queue)
    job = Call(relay, relay.new_id(print), [0])
    relay.add(job)
    job.release()
    relay.output(output(job.job_id, 0, ("stdout", "late\n"), end=True))  # an abandoned cell's
    assert job.new_output() == [] and relay.jobs() == []
    relay.event(b"not signed")
    assert queue.rejected["unsigned"] == 1  # the queue checks what the relay hands it
