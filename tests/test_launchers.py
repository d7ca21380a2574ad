"""The launchers' logic: options, the sbatch directives they become, mpiexec's flags, and the
magics' one-line errors for bad launcher options (the real Slurm and MPI runs are in
test_slurm.py and test_mpi.py)."""
import os
import shutil

import pytest
from IPython.core.error import UsageError
from traitlets.config import Config

from jupyter_scale import launchers
from jupyter_scale.errors import ClusterError
from jupyter_scale.magics import ScaleMagics
from jupyter_scale.session import ScaleSession

needs_slurm_tools = pytest.mark.skipif(shutil.which("sbatch") is None, reason="needs Slurm's client tools")
needs_mpiexec = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")


@pytest.mark.parametrize("text, megabytes", [("16G", 16384), ("512M", 512), ("512", 512), ("1.5G", 1536),
                                             ("2T", 2 * 1024 * 1024), ("100k", 1), ("4GB", 4096)])
def test_memory_sizes_in_slurms_units(text, megabytes):
    assert launchers.memory_megabytes(text) == megabytes


@pytest.mark.parametrize("text", ["", "lots", "16 GiB", "-1G", "G"])
def test_a_memory_that_is_not_a_size_is_refused(text):
    with pytest.raises(ValueError, match="memory takes a size"):
        launchers.memory_megabytes(text)


@pytest.mark.parametrize("text", ["30", "10:00", "01:00:00", "2-00", "2-12:00", "1-00:00:00"])
def test_slurms_time_formats(text):
    assert launchers.check_time_limit(text) == text


@pytest.mark.parametrize("text", ["1h", "10:00:00:00", "soon", "1:2:3:4"])
def test_a_time_limit_slurm_would_refuse_is_refused_first(text):
    with pytest.raises(ValueError, match="time limit"):
        launchers.check_time_limit(text)


@needs_slurm_tools
def test_slurm_directives_per_job_and_per_worker():
    slurm = launchers.SlurmLauncher(partition="gpu", account="proj", qos="high", time_limit="1:00:00",
                                    cpus_per_worker=4, gpus_per_worker=1, memory="16G",
                                    sbatch_options=["--constraint=a100"])
    # ipyparallel: one job of all workers, memory per CPU so that each task gets its share.
    assert slurm.directives(worker_per_job=False) == [
        "--cpus-per-task=4", "--gpus-per-task=1", "--mem-per-cpu=4096M", "--partition=gpu", "--account=proj",
        "--qos=high", "--time=1:00:00", "--constraint=a100"]
    # Dask: one job per worker, its memory whole.
    assert "--mem=16384M" in slurm.directives(worker_per_job=True)
    # Nothing asked, nothing added: the partition's defaults apply.
    assert launchers.SlurmLauncher().directives(worker_per_job=False) == ["--cpus-per-task=1"]


@needs_slurm_tools
def test_site_configuration_reaches_the_launcher_and_options_override_it():
    config = Config()
    config.SlurmLauncher.partition = "site-default"
    config.SlurmLauncher.account = "lab"
    session = ScaleSession(namespace={}, config=config)
    slurm = launchers.create_launcher("slurm", parent=session, partition="big")
    assert (slurm.partition, slurm.account) == ("big", "lab")


def test_options_for_another_launcher_are_named_in_the_error():
    with pytest.raises(ClusterError, match="--partition goes with --launcher slurm, not local"):
        launchers.create_launcher("local", partition="gpu")
    with pytest.raises(ClusterError, match="unknown launcher 'pbs'"):
        launchers.create_launcher("pbs")


@needs_mpiexec
def test_open_mpi_gets_its_root_flags_only_as_root(monkeypatch):
    mpi = launchers.MPILauncher()
    assert mpi.is_open_mpi()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    _, args, env = mpi.command(2)
    assert "--allow-run-as-root" in args
    assert env == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    _, args, env = mpi.command(2)
    assert "--allow-run-as-root" not in args and env == {}


@needs_mpiexec
def test_open_mpi_oversubscribes_this_machine_only_when_asked_for_more_ranks_than_cores():
    cores = os.cpu_count()
    mpi = launchers.MPILauncher()
    assert "--oversubscribe" not in mpi.command(cores)[1]
    assert "--oversubscribe" in mpi.command(cores + 1)[1]
    # A hostfile names the slots: mpiexec decides.
    assert "--oversubscribe" not in launchers.MPILauncher(mpi_args=["--hostfile", "h"]).command(cores + 1)[1]


def test_a_missing_mpiexec_says_what_to_install():
    with pytest.raises(ClusterError, match="needs no-such-mpiexec on PATH"):
        launchers.MPILauncher(mpiexec=["no-such-mpiexec"])


@pytest.mark.parametrize("line, message", [
    ("start --launcher pbs", "argument --launcher: invalid choice: 'pbs'"),
    ("start --partition gpu", "--partition goes with --launcher slurm"),
    ("start --launcher mpi --mem 4G", "--mem goes with --launcher slurm"),
    ("status --launcher slurm", "--launcher and its options go with start or restart, not status"),
    ("start --launcher slurm --cpus-per-worker 0", "--cpus-per-worker must be at least 1"),
    ("start --launcher slurm --time 1h", "--time: a time limit is minutes, HH:MM:SS or D-HH:MM:SS, not '1h'"),
    ("start --launcher slurm --mem lots", "--mem: memory takes a size such as 16G or 512M, not 'lots'"),
])
def test_bad_launcher_options_are_one_line_errors(line, message):
    magics = ScaleMagics(None, ScaleSession(namespace={}))
    with pytest.raises(UsageError) as caught:
        magics.scale(line)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_launchers_extras_are_imported_only_when_used():
    import subprocess
    import sys

    code = ("import sys, jupyter_scale, jupyter_scale.session, jupyter_scale.magics, jupyter_scale.launchers, "
            "jupyter_scale.backends.ipyparallel, jupyter_scale.backends.dask\n"
            "print(sorted(m for m in ('dask_jobqueue', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_job_directory_left_by_a_killed_kernel_of_this_host_is_removed_at_the_next_start(tmp_path):
    import socket
    import subprocess
    import sys

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine, gone = launchers._owner(alive.pid), launchers._owner(killed.pid)
        killed.kill()
        killed.wait()
        for name in (f"{mine}-abc", f"{gone}-def", "another-host.example.1.123-ghi", "someone-elses"):
            (tmp_path / name).mkdir()
        launchers._remove_orphans(str(tmp_path))
        # A live kernel's stays; so do another host's (a shared home) and names not ours.
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [f"{mine}-abc", "another-host.example.1.123-ghi", "someone-elses"])
        assert socket.gethostname() in mine
    finally:
        alive.kill()
        alive.wait()
