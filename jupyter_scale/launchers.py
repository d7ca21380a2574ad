"""Where the workers run: this machine (the default), a Slurm job, or an `mpiexec`.

A launcher is the user's options plus what the kernel learns of the workers' allocation. The
engine submits and cancels the workers through its own launcher (ipyparallel's
SlurmEngineSetLauncher and MPIEngineSetLauncher, dask-jobqueue's SLURMCluster: see backends);
what every engine shares lives here: the options and the sbatch directives they become,
waiting for a job that is pending (with progress, and no time limit while it waits), telling
that a job ended and why (cancelled, time limit, preempted), and checking that `%scale stop`
left nothing in the queue.

Options come from the magics (`%scale start --launcher slurm --partition gpu`) or from
traitlets configuration, for a site: `c.SlurmLauncher.partition = "gpu"`.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable

from traitlets import Bool, Integer, List, Unicode
from traitlets.config import LoggingConfigurable

from . import processes, rendezvous
from .errors import ClusterError

LOOPBACK = "127.0.0.1"
# Seconds between looks at the queue while a job waits, and between progress lines.
POLL_S = 1.0
PROGRESS_EVERY_S = 10.0
# How long `scancel` may take to empty the queue of our jobs before stop() says so.
CANCEL_DEADLINE_S = 30.0


class Launcher(LoggingConfigurable):
    """The workers run on this machine, started by the engine's local launcher."""

    name = "local"

    def listen_address(self) -> str:
        """Where the cluster's controller or scheduler listens for its workers."""
        return LOOPBACK

    def wait_for_workers(self, ready: Callable[[float], bool], n: int, timeout: float) -> None:
        """Block until `ready(seconds)` (which waits up to that long) says the n workers are
        there; raise ClusterError after `timeout` s."""
        if not ready(timeout):
            raise ClusterError(f"{n} workers did not start within {timeout:.0f} s")

    def ended(self) -> str | None:
        """Why the workers' allocation is gone (a cancelled job), or None while it holds."""
        return None

    def describe(self) -> dict:
        """What `%scale status` shows of the allocation (job ids, state, nodes)."""
        return {"launcher": self.name}

    def after_stop(self) -> None:
        """Called once the engine stopped its workers: check that nothing of them remains."""


# ------------------------------------------------------------------------------------------
# Slurm
# ------------------------------------------------------------------------------------------
# Job states (squeue's %T) in which a job no longer holds, nor waits for, its nodes.
_ENDED = {
    "CANCELLED": "was cancelled",
    "TIMEOUT": "reached its time limit",
    "PREEMPTED": "was preempted",
    "NODE_FAIL": "lost a node (NODE_FAIL)",
    "BOOT_FAIL": "could not boot its node (BOOT_FAIL)",
    "DEADLINE": "reached its deadline",
    "OUT_OF_MEMORY": "ran out of memory",
    "FAILED": "failed",
    "COMPLETED": "ended",
    "REVOKED": "was revoked",
    "SPECIAL_EXIT": "ended (SPECIAL_EXIT)",
    "GONE": "ended (Slurm no longer knows it)",
}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$")


def memory_megabytes(text: str) -> int:
    """'16G' -> 16384, '512M' -> 512, '2T', '1.5G'; Slurm's units (1024-based), M by default."""
    match = _MEMORY.match(text or "")
    if not match:
        raise ValueError(f"memory takes a size such as 16G or 512M, not {text!r}")
    scale = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[match.group(2).upper()]
    return max(1, int(float(match.group(1)) * scale + 0.999))


def check_time_limit(text: str) -> str:
    """Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    if text and not _TIME.match(text):
        raise ValueError(f"a time limit is minutes, HH:MM:SS or D-HH:MM:SS, not {text!r}")
    return text


class SlurmLauncher(Launcher):
    """The workers run as a Slurm job (ipyparallel: one job of N tasks; Dask: one job per worker,
    dask-jobqueue's way). The kernel keeps the controller or scheduler, listening at the address
    this machine reaches Slurm's controller from, behind the engine's authentication (CurveZMQ
    keys, TLS certificates) handed to the job in an owner-only directory."""

    name = "slurm"

    partition = Unicode("", config=True, help="Slurm partition (sbatch --partition); default: the site's.")
    time_limit = Unicode("", config=True,
                         help="The job's time limit (sbatch --time: minutes, HH:MM:SS, D-HH:MM:SS); default: "
                              "the partition's.")
    account = Unicode("", config=True, help="Slurm account to charge (sbatch --account).")
    qos = Unicode("", config=True, help="Slurm quality of service (sbatch --qos).")
    cpus_per_worker = Integer(1, config=True, help="CPUs for each worker (sbatch --cpus-per-task).")
    gpus_per_worker = Integer(0, config=True, help="GPUs for each worker (sbatch --gpus-per-task).")
    memory = Unicode("", config=True,
                     help="Memory for each worker (16G, 512M); default: the partition's. ipyparallel's one job "
                          "asks it per CPU (--mem-per-cpu), Dask's job per worker (--mem).")
    sbatch_options = List(Unicode(), config=True,
                          help="More sbatch options, one per item, as on the command line "
                               "(['--constraint=a100', '--exclusive']).")
    listen = Unicode("", config=True,
                     help="The address of this machine where the workers reach the kernel's controller or "
                          "scheduler. Default: the one this machine reaches Slurm's controller from.")
    job_directory = Unicode("~/.jupyter_scale/jobs", config=True,
                            help="Where the job's script, output and credentials go (owner-only): a directory "
                                 "that the compute nodes see under the same path (home is, at most sites).")
    resubmit = Bool(True, config=True,
                    help="When the job ends under a cell (scancel, time limit, preemption), the next "
                         "%%distribute submits a new one; False: it fails, saying so, until %scale restart.")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.memory_megabytes = memory_megabytes(self.memory) if self.memory else None
        check_time_limit(self.time_limit)
        for flag, value in (("--cpus-per-worker", self.cpus_per_worker), ("--gpus-per-worker", self.gpus_per_worker)):
            if value < (1 if flag == "--cpus-per-worker" else 0):
                raise ValueError(f"{flag} cannot be {value}")
        missing = [tool for tool in ("sbatch", "squeue", "scancel") if shutil.which(tool) is None]
        if missing:
            raise ClusterError(f"the slurm launcher needs Slurm's {', '.join(missing)} on PATH "
                               "(run the notebook on a Slurm login node)")
        self.job_ids: list[str] = []  # every job submitted for this cluster
        # Each job and the job directory go with the kernel, even a SIGKILLed one.
        self._watch = processes.watch()
        self.find_jobs: Callable[[], list[str]] = lambda: []  # the engine's word on its jobs
        self._dir: str | None = None
        self._address: str | None = None

    # -- what gets submitted --------------------------------------------------------
    def directives(self, *, worker_per_job: bool) -> list[str]:
        """sbatch options (but --ntasks) for a job of one worker (Dask) or of all (ipyparallel)."""
        lines = [f"--cpus-per-task={self.cpus_per_worker}"]
        if self.gpus_per_worker:
            lines.append(f"--gpus-per-task={self.gpus_per_worker}")
        if self.memory_megabytes:
            if worker_per_job:
                lines.append(f"--mem={self.memory_megabytes}M")
            else:  # Slurm has no per-task memory: per CPU, so that each task gets its share
                lines.append(f"--mem-per-cpu={-(-self.memory_megabytes // self.cpus_per_worker)}M")
        for flag, value in (("partition", self.partition), ("account", self.account), ("qos", self.qos),
                            ("time", self.time_limit)):
            if value:
                lines.append(f"--{flag}={value}")
        return lines + list(self.sbatch_options)

    def check(self, *, tasks: int, worker_per_job: bool) -> None:
        """Ask Slurm whether it would take the job (sbatch --test-only submits nothing): a wrong
        partition, account or time fails here in one line, not as workers that never come."""
        argv = ["sbatch", "--test-only", f"--ntasks={tasks}", *self.directives(worker_per_job=worker_per_job),
                "--wrap=true"]
        done = _run(argv, timeout=60)
        if done is None:
            raise ClusterError("sbatch --test-only did not answer within 60 s")
        if done.returncode != 0:
            lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
            said = next((line for line in lines if "error" in line), lines[-1] if lines else f"status {done.returncode}")
            raise ClusterError(f"Slurm refuses the job ({' '.join(argv[2:-1])}): {said.removeprefix('sbatch: ')}")

    def directory(self) -> str:
        """An owner-only directory of this cluster's, named after this kernel (host, pid, start
        time): one left by a kernel of this host that is gone (killed) is removed here."""
        if self._dir is None:
            base = os.path.expanduser(self.job_directory)
            os.makedirs(base, mode=0o700, exist_ok=True)
            _remove_orphans(base)
            self._dir = tempfile.mkdtemp(prefix=f"{_owner()}-", dir=base)  # 0700
            self._watch.add_path(self._dir)
        return self._dir

    def listen_address(self) -> str:
        if self._address is None:
            self._address = self.listen or _address_toward_slurm()
        return self._address

    # -- watching the job -----------------------------------------------------------
    def jobs(self) -> list[str]:
        """The ids of the jobs submitted for this cluster so far."""
        for job in self.find_jobs():
            if job and job not in self.job_ids:
                self.job_ids.append(job)
                self._watch.add_slurm_job(job)
        self.job_ids.sort(key=lambda j: (len(j), j))  # numbers: 9 before 10
        return self.job_ids

    def jobs_text(self) -> str:
        """'Slurm job 42' or 'Slurm jobs 42, 43' (Dask: one job per worker)."""
        jobs = self.jobs()
        return f"Slurm job{'s' if len(jobs) > 1 else ''} {', '.join(jobs) or '(not submitted yet)'}"

    def states(self) -> dict[str, dict]:
        """job id -> {state, reason, nodes} for this cluster's jobs that Slurm still knows."""
        jobs = self.jobs()
        if not jobs:
            return {}
        return _squeue(jobs)

    def wait_for_workers(self, ready: Callable[[float], bool], n: int, timeout: float) -> None:
        """Wait as long as the job is pending (a busy cluster is normal), saying so every few
        seconds; `timeout` counts from when the job runs. A job that ends first fails it."""
        started = time.monotonic()
        running_since: float | None = None
        said_at = started
        while not ready(POLL_S):
            now = time.monotonic()
            states = self.states()
            jobs = self.jobs_text()
            if (why := self._ended_in(states)) is not None:
                raise ClusterError(f"{why} before its workers started{self._output_tail()}")
            if not self.job_ids and now - started > timeout:
                raise ClusterError(f"no Slurm job was submitted within {timeout:.0f} s")
            pending = {j: s for j, s in states.items() if s["state"] in ("PENDING", "CONFIGURING", "REQUEUED")}
            if states and not pending:
                running_since = running_since or now
            if running_since is not None and now - running_since > timeout:
                raise ClusterError(f"{jobs} runs but its {n} workers did not all start within "
                                   f"{timeout:.0f} s{self._output_tail()}")
            if now - said_at >= PROGRESS_EVERY_S:
                said_at = now
                if pending:
                    reasons = sorted({s["reason"] for s in pending.values()})
                    print(f"jupyter_scale: {jobs} pending ({', '.join(reasons)}) for {now - started:.0f} s; "
                          "interrupt the kernel to cancel", flush=True)
                else:
                    print(f"jupyter_scale: {jobs}: {_summary(states)}; waiting for the workers "
                          f"({now - started:.0f} s)", flush=True)

    def _ended_in(self, states: dict[str, dict]) -> str | None:
        for job, s in states.items():
            if s["state"] in _ENDED:
                return f"Slurm job {job} {_ENDED[s['state']]} ({s['state']})"
        return None

    def ended(self) -> str | None:
        return self._ended_in(self.states())

    def _output_tail(self) -> str:
        """The last line the job wrote (its output file in our directory), as ': ...'."""
        if self._dir is None:
            return ""
        lines = []
        for name in sorted(os.listdir(self._dir)):
            if name.endswith((".log", ".out", ".err")):
                try:
                    with open(os.path.join(self._dir, name), errors="replace") as f:
                        lines += [line.strip() for line in f.read().splitlines() if line.strip()]
                except OSError:
                    continue
        return f"; its output ends: {lines[-1][:300]}" if lines else ""

    def describe(self) -> dict:
        states = self.states()
        return {"launcher": self.name, "jobs": [dict(job=j, **states.get(j, {"state": "gone", "reason": "", "nodes": ""}))
                                              for j in self.job_ids],
                "job_directory": self._dir}

    def after_stop(self) -> None:
        """The engine's launcher ran scancel; wait until the queue no longer holds our jobs
        (a job lingers while its processes end), cancelling again what is still there."""
        started = time.monotonic()
        cancelled_again = False
        while True:
            active = [j for j, s in self.states().items() if s["state"] not in _ENDED]
            if not active:
                break
            waited = time.monotonic() - started
            if waited > CANCEL_DEADLINE_S:
                raise ClusterError(f"Slurm job(s) {', '.join(active)} still in the queue {CANCEL_DEADLINE_S:.0f} s "
                                   "after scancel; see squeue")
            if not cancelled_again and waited > 5:  # a cancel the engine's launcher never sent
                cancelled_again = True
                _slurm_output(["scancel", *active])
            time.sleep(0.2)
        if self._dir is not None:  # the script, the output, the workers' certificate
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._watch.close()


def _owner(pid: int | None = None) -> str:
    """'host.pid.start time' of a process of this machine (a home directory may be shared)."""
    import psutil

    process = psutil.Process(pid)
    return f"{socket.gethostname()}.{process.pid}.{int(process.create_time() * 100)}"


def _remove_orphans(base: str) -> None:
    host = socket.gethostname()
    for name in os.listdir(base):
        owner, _, started = name.rpartition("-")[0].rpartition(".")
        owner_host, _, pid = owner.rpartition(".")
        if owner_host != host or not pid.isdigit() or not started.isdigit():
            continue
        if processes.alive(int(pid), created=int(started) / 100):
            continue  # its kernel still runs
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def _summary(states: dict[str, dict]) -> str:
    counts: dict[str, int] = {}
    for s in states.values():
        counts[s["state"].lower()] = counts.get(s["state"].lower(), 0) + 1
    return ", ".join(f"{k}" if len(states) == 1 else f"{v} {k}" for k, v in counts.items()) or "not in the queue yet"


def _squeue(jobs: list[str]) -> dict[str, dict]:
    """job id -> {state, reason, nodes}, in one squeue call; state GONE for a job Slurm forgot
    (it ended MinJobAge seconds ago, 5 minutes by default); {} when squeue does not answer."""
    done = _run(["squeue", "--noheader", "--states=all", "--jobs", ",".join(jobs), "--format=%i|%T|%r|%N"])
    # squeue lists the jobs it knows of a list, but fails on a single one it does not know.
    if done is None or (done.returncode != 0 and "Invalid job id" not in done.stderr):
        return {}
    found = {job: {"state": "GONE", "reason": "", "nodes": ""} for job in jobs}
    for line in done.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0] in found:
            found[parts[0]] = {"state": parts[1], "reason": parts[2], "nodes": parts[3]}
    return found


def _run(argv: list[str], timeout: float = 15.0) -> subprocess.CompletedProcess | None:
    """A Slurm client's run (its output as text), or None when it did not run or answer."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _slurm_output(argv: list[str], timeout: float = 15.0) -> str | None:
    """A Slurm client's stdout, or None when it failed (an unknown job, a busy controller)."""
    done = _run(argv, timeout)
    return done.stdout if done is not None and done.returncode == 0 else None


def _address_toward_slurm() -> str:
    """This machine's address on the way to Slurm's controller: the compute nodes reach that
    network. Loopback when the controller is this machine and listens there (one node)."""
    config = _slurm_output(["scontrol", "show", "config"]) or ""
    hosts = re.findall(r"^(?:SlurmctldHost\[\d+\]|ControlMachine|ControlAddr)\s*=\s*(\S+)", config, re.MULTILINE)
    for host in hosts:
        name, _, address = host.partition("(")
        target = address.rstrip(")") or name
        try:
            target = str(ipaddress.ip_address(target))
        except ValueError:
            try:
                target = socket.gethostbyname(target)
            except OSError:
                continue
        if ipaddress.ip_address(target).is_loopback:
            return LOOPBACK
        found = rendezvous.source_address(target)
        if found:
            return found
    raise ClusterError("cannot tell where the compute nodes reach this machine (Slurm's controller host does not "
                       "resolve here); set it: c.SlurmLauncher.listen = '10.0.0.5' (an address of this machine)")


# ------------------------------------------------------------------------------------------
# MPI
# ------------------------------------------------------------------------------------------
class MPILauncher(Launcher):
    """The workers are the ranks of one `mpiexec` (ipyparallel's MPI launcher): rank i is MPI
    rank i, and mpi4py works in the cell."""

    name = "mpi"

    mpiexec = List(Unicode(), ["mpiexec"], config=True, help="The mpiexec command.")
    mpi_args = List(Unicode(), config=True,
                    help="More mpiexec arguments (['--hostfile', 'hosts']). Open MPI gets --oversubscribe when "
                         "there are more workers than cores here and no host is named, and, as root only, "
                         "--allow-run-as-root.")
    listen = Unicode("", config=True,
                     help="Where the ranks reach the kernel's controller: 127.0.0.1 (default) when mpiexec "
                          "starts them on this machine; an address of this machine when a hostfile names others.")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if not self.mpiexec or shutil.which(self.mpiexec[0]) is None:
            raise ClusterError(f"the mpi launcher needs {self.mpiexec[0] if self.mpiexec else 'mpiexec'} on PATH "
                               "(an MPI such as Open MPI: apt-get install openmpi-bin)")
        if importlib.util.find_spec("mpi4py") is None:  # ipyparallel's engines under mpiexec import it
            raise ClusterError("the mpi launcher needs mpi4py (pip install 'jupyter_scale[mpi]')")

    def listen_address(self) -> str:
        return self.listen or LOOPBACK

    def is_open_mpi(self) -> bool:
        out = _slurm_output([*self.mpiexec, "--version"]) or ""
        return "Open MPI" in out or "OpenRTE" in out

    def command(self, n: int) -> tuple[list[str], list[str], dict]:
        """(mpiexec, its arguments, environment) for n ranks."""
        args = list(self.mpi_args)
        env: dict[str, str] = {}
        if self.is_open_mpi():
            names_hosts = any(a.startswith(("--host", "-H", "--hostfile", "--machinefile", "-hostfile")) for a in args)
            if n > (os.cpu_count() or 1) and not names_hosts and "--oversubscribe" not in args:
                args.append("--oversubscribe")
            if os.geteuid() == 0:  # Open MPI refuses root unless told twice
                args.append("--allow-run-as-root")
                env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        return list(self.mpiexec), args, env

    def describe(self) -> dict:
        return {"launcher": self.name, "mpiexec": " ".join(self.mpiexec)}


LAUNCHERS = {"local": Launcher, "slurm": SlurmLauncher, "mpi": MPILauncher}


def create_launcher(name: str, parent=None, **options) -> Launcher:
    """A launcher configured from `parent`'s config (c.SlurmLauncher...) and `options`."""
    if name not in LAUNCHERS:
        raise ClusterError(f"unknown launcher {name!r} (available: {', '.join(LAUNCHERS)})")
    unknown = sorted(k for k, v in options.items() if v is not None and not LAUNCHERS[name].class_traits().get(k))
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        raise ClusterError(f"{flags} {'goes' if len(unknown) == 1 else 'go'} with --launcher slurm, not {name}")
    try:
        return LAUNCHERS[name](parent=parent, **{k: v for k, v in options.items() if v is not None})
    except ValueError as exc:
        raise ClusterError(str(exc)) from None

