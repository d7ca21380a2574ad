"""The test Slurm of tests/slurm.py: a real one-node Slurm that runs jobs, shows them in squeue,
cancels them with their processes, runs more one-CPU jobs at once than there are cores, and leaves
nothing behind, not even after a crash."""
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import slurm
from conftest import skip_module_unless

available = skip_module_unless(slurm.unavailable_reason)

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(120),
]


def until(what, condition, timeout=30.0):
    """Poll condition() until it returns something true (returned); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return result


def gone(processes, timeout=15.0):
    """Those of `processes` still alive after `timeout` s (zombies count as gone)."""
    return slurm._wait_gone(list(processes), timeout)


@pytest.fixture(scope="module")
def cluster():
    with slurm.Slurm(cpus=8) as s:
        yield s


@pytest.fixture(autouse=True)
def no_jobs_left(request):
    """Each test that uses the shared cluster starts with an empty queue and leaves one."""
    if "cluster" not in request.fixturenames:
        yield
        return
    s = request.getfixturevalue("cluster")
    assert s.jobs() == []
    yield
    s.cancel()
    until("the queue to empty", lambda: not s.jobs(), 20)


def test_node_declares_more_cpus_than_the_machine_has(cluster):
    node = cluster.run("scontrol", "show", "node", cluster.node).stdout
    assert "CPUTot=8" in node and "State=IDLE" in node
    assert cluster.run("sinfo", "-h", "-o", "%P %a %D %T").stdout.split() == ["test*", "up", "1", "idle"]


def test_batch_job_of_four_tasks(cluster):
    job = cluster.submit("srun hostname", ntasks=4)
    assert cluster.wait(job) == "COMPLETED", cluster.log("slurmd")
    assert cluster.output(job).read_text().splitlines() == [cluster.node] * 4


def test_squeue_shows_a_job_pending_running_then_gone(cluster):
    go = cluster.directory / "go"
    job = cluster.submit(f"while [ ! -e {go} ]; do sleep 0.05; done", hold=True, job_name="gate")
    assert cluster.state(job) == "PENDING"
    out = cluster.run("squeue", "-h", "-o", "%i %j %T").stdout.split()
    assert out == [job, "gate", "PENDING"]
    cluster.run("scontrol", "release", job)
    until("the job to run", lambda: cluster.state(job) == "RUNNING")
    assert cluster.jobs() == [job]
    go.touch()
    until("the job to leave the queue", lambda: job not in cluster.jobs())
    assert cluster.run("squeue", "-h").stdout == ""
    assert cluster.state(job) == "COMPLETED"  # squeue --states=all still knows it (MinJobAge)


def test_scancel_removes_a_job_and_its_processes(cluster):
    job = cluster.submit("sleep 300 & sleep 301; wait")
    sleeps = until("the job's sleeps", lambda: [p for p in cluster.processes(job) if p.name() == "sleep"]
                   if len(cluster.processes(job)) >= 3 else None)
    assert sorted(p.cmdline()[-1] for p in sleeps) == ["300", "301"]
    t0 = time.monotonic()
    cluster.run("scancel", job)
    assert not gone(sleeps, 15), "scancel left the job's processes"
    until("the cancelled job to leave the queue", lambda: job not in cluster.jobs(), 15)
    assert cluster.state(job) == "CANCELLED"
    assert cluster.processes(job) == []
    assert time.monotonic() - t0 < 10


def test_eight_declared_cpus_run_four_one_cpu_jobs_at_once(cluster):
    """Each job waits (up to 30 s) until all four have started: they can only all complete when
    they ran at the same time (here on a machine with 2 cores)."""
    marks = cluster.directory / "marks"
    marks.mkdir()
    script = textwrap.dedent(f"""\
        touch {marks}/$SLURM_JOB_ID
        for i in $(seq 600); do
            [ $(ls {marks} | wc -l) -ge 4 ] && exit 0
            sleep 0.05
        done
        exit 1
        """)
    jobs = [cluster.submit(script, ntasks=1, cpus_per_task=1) for _ in range(4)]
    states = [cluster.wait(job, 45) for job in jobs]
    assert states == ["COMPLETED"] * 4, [cluster.output(j).read_text() for j in jobs]


def test_close_leaves_no_process_and_no_directory():
    """Including a job process that escaped scancel (setsid and double fork: proctrack/linuxproc
    loses it) and a job still running at close()."""
    s = slurm.Slurm(cpus=2)
    try:
        escapee = s.directory / "escapee.pid"
        job = s.submit(f"setsid sh -c 'sleep 302 & echo $! > {escapee}' ; sleep 303")
        until("the escaped sleep", escapee.exists)
        until("both sleeps", lambda: len([p for p in s.processes(job) if p.name() == "sleep"]) == 2)
        processes = list(s.daemons().values()) + s.processes()
        assert {p.name() for p in s.daemons().values()} == {"munged", "slurmctld", "slurmd"}
        pids = {p.pid for p in processes}
        assert int(escapee.read_text()) in pids
        stepds = [p for p in psutil.process_iter() if slurm._ours(p, str(s.directory))
                  and p.name().startswith("slurmstepd")]
        assert stepds
        processes += stepds
    finally:
        directory = s.directory
        t0 = time.monotonic()
        s.close()
    assert time.monotonic() - t0 < 15
    assert not gone(processes, 5), "close() left processes"
    assert not directory.exists()
    assert slurm._processes_of(str(directory)) == []
    s.close()  # idempotent


CRASH = """
import os, sys
sys.path.insert(0, {tests!r})
import slurm
s = slurm.Slurm(cpus=1)
s.submit("sleep 304")
import time  # the job runs; now crash, with neither close() nor atexit
for _ in range(300):
    if s.processes():
        break
    time.sleep(0.05)
print(s.directory, flush=True)
os._exit(0)
"""


def test_leftovers_of_a_crashed_run_are_removed_by_the_next_start():
    tests = str(Path(__file__).parent)
    r = subprocess.run([sys.executable, "-c", CRASH.format(tests=tests)], capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == 0, r.stderr
    stale = Path(r.stdout.strip())
    left = slurm._processes_of(str(stale))
    assert stale.is_dir() and {p.name() for p in left} >= {"munged", "slurmctld", "slurmd", "sleep"}
    try:
        with slurm.Slurm(cpus=1) as s:
            assert not stale.exists()
            assert not gone(left, 5)
            assert s.directory.exists()
    finally:
        slurm.remove_leftovers()
        for p in slurm._processes_of(str(stale)):
            p.kill()
