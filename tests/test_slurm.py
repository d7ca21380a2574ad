"""%scale start --launcher slurm on a real one-node Slurm (tests/slurm.py), both engines: the
README's loop as a Slurm job of 2 and 4 workers, a job pending in the queue, a job cancelled
from outside under a running cell, a job that reaches its time limit, and an empty queue after
every stop. The kernel finds the cluster through $SLURM_CONF, as on a login node."""
import os
import re
import time

import pytest

import slurm
from conftest import CLUSTER_ENGINES, README_DATA, README_LOOP, SAME_WEIGHTS, SETUP, skip_module_unless, wait_gone
from kernel import Kernel

available = skip_module_unless(slurm.unavailable_reason)

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(300),
]

NOTEBOOK = README_DATA

# The README's loop, unchanged (automatic mode), plus where each rank ran.
TRAIN = ("%%distribute\nimport os" + README_LOOP
         + """seen = dict(job=os.environ.get("SLURM_JOB_ID"), task=os.environ.get("SLURM_PROCID"), world_size=world_size)
""")

# Trains until stopped from outside (or for 200 s), saying when it has begun.
LONG = """%%distribute
import time
opt = torch.optim.SGD(model.parameters(), lr=0.01)
until = time.time() + 200
while time.time() < until:
    opt.zero_grad()
    model(torch.randn(16, 8)).sum().backward()
    opt.step()
    if rank == 0 and not globals().get("said"):
        said = True
        print("training", flush=True)
    time.sleep(0.01)
"""


@pytest.fixture(scope="module")
def cluster():
    with slurm.Slurm(cpus=8) as s:
        yield s


@pytest.fixture(scope="module", params=CLUSTER_ENGINES)
def kernel(request, cluster):
    k = Kernel(backend=request.param)
    k.engine = request.param
    try:
        k.ok(SETUP + f"\nimport os\nos.environ['SLURM_CONF'] = {cluster.env['SLURM_CONF']!r}\n" + NOTEBOOK)
        yield k
    finally:
        k.cell("%scale stop", timeout=120)
        leftovers = k.descendants()
        k.shutdown()
        assert wait_gone(leftovers) == [], "the kernel left processes behind"
        assert cluster.jobs() == []


@pytest.fixture(autouse=True)
def empty_queue_after(cluster, kernel):
    """Every test starts with an empty queue, and leaves one, with no job process left."""
    assert cluster.jobs() == []
    yield
    kernel.ok("%scale stop", timeout=120)
    assert cluster.jobs() == [], "%scale stop left jobs in the queue"
    assert wait_gone(cluster.processes()) == [], "a job's processes outlived %scale stop"


def _jobs_per_start(kernel, workers: int) -> int:
    return 1 if kernel.engine == "ipyparallel" else workers  # dask-jobqueue: one job per worker


@pytest.mark.parametrize("workers", [2, 4])
def test_the_readmes_loop_runs_as_a_slurm_job(kernel, cluster, workers):
    k = kernel
    started = k.ok(f"%scale start --launcher slurm --workers {workers} --time 00:10:00", timeout=180).stdout
    jobs = cluster.jobs()
    assert len(jobs) == _jobs_per_start(k, workers), jobs
    assert re.search(rf"Slurm jobs? {', '.join(jobs)} on {cluster.node}; %scale stop cancels it", started), started
    status = k.ok("%scale status").stdout
    assert status.startswith(f"jupyter_scale: Slurm {k.engine} cluster, {workers} workers"), status
    for job in jobs:
        assert f"Slurm job {job}: RUNNING on {cluster.node}" in status, status

    k.ok(NOTEBOOK)
    k.ok(TRAIN, timeout=240)
    k.ok(SAME_WEIGHTS.format(n=workers))
    seen = k.value("jupyter_scale.get_session().gather('seen')")
    assert {s["job"] for s in seen} == set(jobs)  # every rank ran inside the job(s) submitted
    assert {s["world_size"] for s in seen} == {workers}
    if k.engine == "ipyparallel":  # one job of N tasks: rank i is the job's task i
        assert [int(s["task"]) for s in seen] == list(range(workers))
    counts = k.value("dict(__import__('collections').Counter(p['rank'] for p in jupyter_scale.history()))")
    assert counts == {r: 2 * 1024 // (workers * 32) for r in range(workers)}, counts

    # The same cell run again finds its cluster; other launcher options would need a new one.
    k.ok("%%distribute --launcher slurm --time 00:10:00\nagain = rank")
    other = k.cell("%%distribute --launcher slurm --time 00:20:00\nagain = rank")
    # IPython prints a UsageError as one line on stderr, with no traceback.
    assert other.stderr == f"UsageError: a slurm cluster of {workers} workers is running with other options; " \
                           "%scale stop it first\n", other.stderr

    stopped = k.ok("%scale stop", timeout=120).stdout
    assert f"stopped {workers} workers" in stopped
    assert cluster.jobs() == []  # stop returns once the queue is empty, not before


def test_a_job_cancelled_under_a_running_cell_fails_it_naming_the_job_and_the_next_cell_resubmits(kernel, cluster):
    k = kernel
    k.ok("%scale start --launcher slurm --workers 2", timeout=180)
    jobs = cluster.jobs()
    cancelled_at = []

    def cancel_once_training(stream, text):
        if "training" in text and not cancelled_at:
            cancelled_at.append(time.monotonic())
            cluster.cancel(*jobs)  # scancel, as an administrator or a preemption would

    # The cell would train for 200 s; the deadline here is the cell's 30 s after the scancel.
    out = k.cell(LONG, timeout=120, on_stream=cancel_once_training)
    assert cancelled_at, out.stdout + out.stderr
    assert not out.ok and out.error["ename"] == "WorkerDied", out.error_text
    assert f"Slurm job {jobs[0]} was cancelled (CANCELLED)" in out.error["evalue"], out.error["evalue"]
    assert "the next %%distribute submits a new one" in out.error_text.replace("\n", " ")
    assert k.value("isinstance(model, nn.Module) and isinstance(data, TensorDataset)")  # the notebook is intact

    again = k.ok("%%distribute\nimport os\njob = os.environ['SLURM_JOB_ID']", timeout=180)
    assert "submitting a new Slurm job of 2 workers" in again.stdout, again.stdout
    new_jobs = cluster.jobs()
    assert new_jobs and not set(new_jobs) & set(jobs)
    assert set(k.value("jupyter_scale.get_session().gather('job')")) == set(new_jobs)


def test_without_resubmit_the_next_cell_says_the_job_ended_until_restart(kernel, cluster):
    if kernel.engine != "ipyparallel":
        pytest.skip("the session decides for both engines alike; the engine part is in the test above")
    k = kernel
    k.ok("%config SlurmLauncher.resubmit = False")
    try:
        k.ok("%scale start --launcher slurm --workers 2 --time 00:10:00", timeout=180)
        jobs = cluster.jobs()
        out = k.cell(LONG, timeout=120, on_stream=lambda stream, text: "training" in text and cluster.cancel(*jobs))
        assert not out.ok and out.error["ename"] == "WorkerDied", out.error_text
        refused = k.cell("%%distribute\nx = 1")
        assert not refused.ok and refused.error["ename"] == "ClusterError", refused.error_text
        assert refused.error["evalue"] == (f"Slurm job {jobs[0]} was cancelled (CANCELLED); %scale restart submits "
                                           "a new job (c.SlurmLauncher.resubmit = True does it at the next cell)")
        assert cluster.jobs() == []  # nothing was submitted
        k.ok("%scale restart", timeout=180)  # the same options: two workers, ten minutes
        assert len(cluster.jobs()) == 1 and cluster.jobs() != jobs
        k.ok("%%distribute\nassert world_size == 2")
    finally:
        k.ok("%config SlurmLauncher.resubmit = True")


def test_a_pending_job_is_waited_for_with_its_state_not_timed_out(kernel, cluster):
    k = kernel
    # Held jobs wait in the queue (JobHeldUser) longer than the start timeout, which counts
    # only from when a job runs.
    k.ok("%config SlurmLauncher.sbatch_options = ['--hold']\n%config ScaleSession.start_timeout = 15.0")
    said = []

    def release_once_seen_pending_twice(stream, text):  # 20 s in the queue, more than the 15
        said.extend(line for line in text.splitlines() if "pending (JobHeldUser)" in line)
        if len(said) == 2:
            cluster.run("scontrol", "release", *cluster.jobs())

    try:
        out = k.cell("%scale start --launcher slurm --workers 2", timeout=180, on_stream=release_once_seen_pending_twice)
    finally:
        k.ok("%config SlurmLauncher.sbatch_options = []\n%config ScaleSession.start_timeout = 120.0")
    assert out.ok, out.error_text
    assert len(said) == 2 and re.search(r"jupyter_scale: Slurm jobs? [\d, ]+ pending \(JobHeldUser\) for 2\d s",
                                        said[1]), said
    assert "2 workers ready" in out.stdout


def test_interrupting_a_pending_start_cancels_the_job(kernel, cluster):
    k = kernel
    k.ok("%config SlurmLauncher.sbatch_options = ['--hold']")
    interrupted = []

    def interrupt_once_pending(stream, text):
        if "pending (JobHeldUser)" in text and not interrupted:
            interrupted.append(cluster.jobs())
            k.manager.interrupt_kernel()

    try:
        out = k.cell("%scale start --launcher slurm --workers 2", timeout=120, on_stream=interrupt_once_pending)
    finally:
        k.ok("%config SlurmLauncher.sbatch_options = []")
    assert interrupted and interrupted[0], out.stdout
    assert not out.ok and out.error["ename"] == "KeyboardInterrupt", out.error_text
    assert cluster.jobs() == []  # the held job was cancelled on the way out
    assert not k.value("jupyter_scale.get_session().running")


def test_a_job_slurm_refuses_fails_in_one_line_and_the_next_start_works(kernel, cluster):
    k = kernel
    out = k.cell("%scale start --launcher slurm --workers 2 --partition nosuch")
    assert not out.ok and out.error["ename"] == "ClusterError", out.error_text
    assert out.error["evalue"].endswith("invalid partition specified: nosuch"), out.error["evalue"]
    assert cluster.jobs() == []
    k.ok("%scale start --launcher slurm --workers 2 --partition test", timeout=180)
    assert len(cluster.jobs()) == _jobs_per_start(k, 2)


def test_a_job_that_reaches_its_time_limit_fails_the_cell_saying_so(kernel, cluster):
    if kernel.engine != "ipyparallel":
        pytest.skip("the session watches the job the same way for both engines; a minute of Slurm time once is enough")
    k = kernel
    k.ok("%scale start --launcher slurm --workers 2 --time 1", timeout=180)  # one minute
    job = cluster.jobs()[0]
    out = k.cell(LONG, timeout=240)  # Slurm ends the job 60-90 s in (it looks every 30 s)
    assert not out.ok and out.error["ename"] == "WorkerDied", out.error_text
    assert f"Slurm job {job} reached its time limit (TIMEOUT)" in out.error["evalue"], out.error["evalue"]


def test_a_kernel_killed_with_sigkill_leaves_no_job_and_no_process(kernel, cluster):
    """Nobody runs %scale stop: the kernel's watcher cancels the workers' jobs and removes their
    directory (the workers would end on their own, once they miss the controller or Dask's
    scheduler for long enough, but hold their nodes until then)."""
    k = Kernel(backend=kernel.engine)
    try:
        k.ok(SETUP + f"\nimport os\nos.environ['SLURM_CONF'] = {cluster.env['SLURM_CONF']!r}")
        k.ok("%scale start --launcher slurm --workers 2 --time 00:10:00", timeout=180)
        assert cluster.jobs()
        started = k.descendants()  # the controller and its schedulers (ipyparallel)
        jobs_processes = cluster.processes()
        assert len(jobs_processes) >= 2
        jobs = cluster.jobs()
        jobs_directory = os.path.expanduser("~/.jupyter_scale/jobs")  # the launcher's default

        def kernels_directories():  # named after the kernel: host.pid.start-...
            return [name for name in os.listdir(jobs_directory) if f".{k.pid}." in name]

        assert kernels_directories()
        psutil_kernel = __import__("psutil").Process(k.pid)
        psutil_kernel.kill()
        psutil_kernel.wait(10)
        assert {job: cluster.wait(job, timeout=60) for job in jobs} == dict.fromkeys(jobs, "CANCELLED")
        assert wait_gone(started + jobs_processes, timeout=30) == []
        assert kernels_directories() == [], "the job's directory outlived its kernel"
    finally:
        k.client.stop_channels()
        k.manager.cleanup_resources()
