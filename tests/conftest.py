import multiprocessing.util
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kernel import Kernel  # noqa: E402

# A small seeded model and dataset, and the README's loop on them (automatic mode, unchanged),
# ending with the flat weights each rank holds: the tests of where workers run (other hosts,
# Slurm, MPI) append what each rank saw of its place.
README_DATA = """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(1024, 8, generator=g), torch.randint(0, 2, (1024,), generator=g))
"""
README_LOOP = """
loader = DataLoader(data, batch_size=32, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        report(loss=loss)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
"""
# Run in the kernel after README_LOOP on `n` workers: every rank and the notebook hold the same weights.
SAME_WEIGHTS = """
ws = jupyter_scale.get_session().gather("weights")
local = torch.cat([p.detach().flatten() for p in model.parameters()])
assert len(ws) == {n} and all(torch.equal(w, local) for w in ws), "weights differ across ranks or the notebook"
"""

# Run on the workers first (in a %%distribute cell): `with averaging_counted() as averaged:`
# around training counts the parameter gradients automatic mode averaged (`averaged.count`).
COUNT_AVERAGING = """
import jupyter_scale.training as training

class averaging_counted:
    def __enter__(self):
        self.count, self.original = 0, training._average_gradients
        def counted(params, skip, *args, **kwargs):
            self.count += sum(1 for p in params if id(p) not in skip and p.grad is not None)
            return self.original(params, skip, *args, **kwargs)
        training._average_gradients = counted
        return self
    def __exit__(self, *exc):
        training._average_gradients = self.original
"""

SETUP = """
%load_ext jupyter_scale
import torch, torch.nn as nn
import torch.distributed as dist
from torch.utils.data import TensorDataset, DataLoader
import jupyter_scale
"""


def wait_gone(processes, timeout=15.0):
    """Processes still alive after `timeout` (zombies count as gone)."""
    gone, alive = psutil.wait_procs(processes, timeout=timeout)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


ENGINES = ["ipyparallel", "dask", "ray"]
# The engine a test module's kernel runs on when the behaviour does not depend on the engine: the
# default engine. Modules and tests whose subject is an engine's own run on ENGINES (see below).
DEFAULT_ENGINES = ["ipyparallel"]
# The engines whose clusters the tests start across hosts and on Slurm (a Ray cluster there is
# started with Ray's own tools, then connected to).
CLUSTER_ENGINES = ["ipyparallel", "dask"]


def _started_kernel(backend=None):
    k = Kernel(backend=backend)
    k.ok(SETUP)
    return k


def _stop_and_check(k):
    """%scale stop, shut the kernel down, and fail if anything it started survives."""
    k.cell("%scale stop", timeout=60)
    leftovers = psutil.Process(k.pid).children(recursive=True)  # the resource tracker too
    k.shutdown()
    still = wait_gone(leftovers)
    for p in still:  # clean up what we started, by pid, before failing
        p.kill()
    assert not still, f"processes left behind by the kernel: {still}"


def kernel_fixture(engines):
    """A module-scoped `kernel` fixture over `engines`: a real kernel with jupyter_scale loaded,
    once per engine (picked the way users do, with $JUPYTER_SCALE_BACKEND); afterwards nothing
    it started may remain. A test module that assigns `kernel = kernel_fixture([...])` runs its
    tests on those engines only."""
    @pytest.fixture(scope="module", params=engines)
    def kernel(request):
        k = _started_kernel(request.param)
        yield k
        _stop_and_check(k)

    return kernel


def on_engines(engines):
    """A mark for one test of a module whose `kernel` (or a fixture built on it) runs on fewer
    engines: this test runs on `engines` (one module-scoped kernel per engine, shared with the
    module's other tests on that engine). `@on_engines(ENGINES)` for a behaviour of the engine's own."""
    return pytest.mark.parametrize("kernel", engines, indirect=True)


kernel = kernel_fixture(DEFAULT_ENGINES)


@pytest.fixture
def fresh_kernel():
    k = _started_kernel()
    yield k
    _stop_and_check(k)


def ranks_of(label: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5]: the ranks of an output line's label ([rank 0-2,5] ...)."""
    ranks = []
    for part in label.split(","):
        low, _, high = part.partition("-")
        ranks.extend(range(int(low), int(high or low) + 1))
    return ranks


def per_rank_lines(text: str) -> list[str]:
    """The lines of `text`, each line that several ranks printed alike ([rank 0-2] x) as one line
    per rank ([rank 0] x, ...): what was said, whichever lines the timing collapsed."""
    out = []
    for line in text.splitlines():
        found = re.match(r"\[rank ([\d,-]+)\] (.*)$", line)
        out.extend([f"[rank {r}] {found.group(2)}" for r in ranks_of(found.group(1))] if found else [line])
    return out


def skip_module_unless(unavailable_reason):
    """A module-scoped autouse fixture (assign it to a name of the module): its tests skip,
    with the reason, where `unavailable_reason()` (a probe that tries for real) gives one. At
    run time, not at import: every worker of `pytest -n` collects the same tests, and only the
    one that runs the module probes."""
    @pytest.fixture(scope="module", autouse=True)
    def available():
        if (reason := unavailable_reason()) is not None:
            pytest.skip(reason)

    return available


@pytest.fixture(scope="module")
def ray_cli_cluster():
    """A Ray head of 2 CPUs from the `ray` CLI, as a user or KubeRay starts one: on loopback
    only (Ray's one-node setting) and with a token of its own, which the kernel is given as a
    user gives it (RAY_AUTH_TOKEN_PATH). One per module: a cluster outlives its users' sessions."""
    import secrets
    import tempfile

    temp = tempfile.mkdtemp(prefix="rayt-", dir="/tmp")  # short: Ray's socket paths
    token = os.path.join(temp, "token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        client_port = s.getsockname()[1]
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    ray = Path(sys.executable).parent / "ray"
    head = subprocess.Popen([ray, "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--port=0",
                             f"--ray-client-server-port={client_port}", "--include-dashboard=false",
                             "--disable-usage-stats", f"--temp-dir={temp}", "--num-cpus=2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    found = Path(temp) / "ray_current_cluster"
    tree = []
    try:
        deadline = time.monotonic() + 60
        while not (found.exists() and found.read_text().strip()):
            assert time.monotonic() < deadline and head.poll() is None, "no Ray head within 60 s"
            time.sleep(0.2)
        tree = [psutil.Process(head.pid), *psutil.Process(head.pid).children(recursive=True)]
        yield found.read_text().strip(), client_port, token, head
    finally:
        if head.poll() is None:  # and what it started since
            tree += [p for p in psutil.Process(head.pid).children(recursive=True) if p not in tree]
        if head.poll() is None:
            head.terminate()
        try:
            head.wait(timeout=20)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=10)
        for p in wait_gone(tree, timeout=10):  # what `ray start` did not stop, by pid
            p.kill()
        import shutil

        shutil.rmtree(temp, ignore_errors=True)


# -- The `cluster` tier ---------------------------------------------------------------------
# `pytest -m "not cluster"` is the fast tier: tests that run in this process (and, at most,
# short-lived helper processes such as ruff, mypy, or a `python -c` that ends). A test that
# starts a real cluster, a Jupyter kernel, a browser, Slurm, MPI, the hosts of tests/hosts.py,
# or a notebook through nbval carries the `cluster` mark: by the fixtures it uses (below), by
# `pytestmark = pytest.mark.cluster` in modules that start such things inline, and for every
# nbval cell. An unmarked test that starts one anyway, or leaves a child process of pytest
# behind, fails (pytest_runtest_setup/pytest_runtest_teardown below).

# Fixtures that start (or hold) a kernel, a cluster, a browser, Slurm or network-namespace hosts.
CLUSTER_FIXTURES = frozenset({
    "kernel", "fresh_kernel", "ray_cli_cluster",   # here
    "engine",                                       # test_backend_protocol: a real backend per engine
    "engine_kernel",                                # test_security
    "dask_cli_cluster", "dask_tls_cluster",        # test_connect
    "local", "dist",                                # test_differential
    "lab", "notebook7",                             # test_browser: Jupyter server and Chromium
    "sidebar",                                      # test_sidebar
    "kernel_for_usage",                             # test_magics
    "session", "dask_session",                      # test_forkserver: real ipyparallel / Dask sessions
    "two", "three", "multihost",                    # tests/hosts.py's hosts (test_hosts, test_multihost)
    "cluster",                                      # tests/slurm.py's Slurm (test_slurm, test_slurm_cluster)
})


def _uses_cluster_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name in item.fixturenames:
        if name not in CLUSTER_FIXTURES:
            continue
        defs = info.name2fixturedefs.get(name, ())
        # A real fixture of that name, not an argument of @pytest.mark.parametrize (`engine` is
        # both in the tests; a parametrize argument has a pseudo fixture with no module of its own).
        if any(getattr(d.func, "__module__", "") not in ("_pytest.fixtures", "_pytest.python") for d in defs):
            return True
    return False


def _is_notebook_cell(item) -> bool:
    return type(item).__name__ == "IPyNbCell" or "examples" in Path(str(item.path)).parts


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("cluster") is None and (_is_notebook_cell(item) or _uses_cluster_fixture(item)):
            item.add_marker(pytest.mark.cluster)


# What an unmarked test may not start at all, even if it ends it: a kernel, an engine or its
# controller/scheduler/head, a Jupyter server, a browser, Slurm, MPI, the hosts' namespaces, or
# multiprocessing's fork server (Dask's workers). Judged on every process started through
# subprocess.Popen (asyncio's and jupyter_client's starts included) or by multiprocessing:
# a program by its name, a Python by the module or script it runs, or the code it is given.
_FORBIDDEN_PROGRAM = re.compile(
    r"ipengine|ipcontroller|ipcluster|jupyter(?![_-]scale).*|dask(?:-\w+)?|ray|raylet|gcs_server|slurm\w*|sbatch|srun"
    r"|salloc|munged|mpiexec|mpirun|orterun|prterun|orted|chrom(?:e|ium)\S*|headless_shell|nsenter")
_FORBIDDEN_PYTHON = re.compile(
    r"ipykernel|ipyparallel\.(?:engine|controller|cluster|apps)|distributed\.cli|ray\.scripts|jupyter(?:lab|_server|_client)"
    r"|nbconvert|nbclient|multiprocessing\.forkserver import main|playwright"
    r"|jupyter_scale/programs/(?:ipp_engine|ipp_controller|ray_head)\.py")


def _forbidden(args) -> bool:
    import shlex

    if isinstance(args, (list, tuple)):
        argv = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in args]
    else:
        try:
            argv = shlex.split(os.fsdecode(args) if isinstance(args, bytes) else str(args))
        except ValueError:
            argv = str(args).split()
    if not argv or "--version" in argv:
        return False
    name = os.path.basename(argv[0])
    if name == "ip" and "netns" in argv:
        return True
    if not re.match(r"python[\d.]*$", name):
        return bool(_FORBIDDEN_PROGRAM.fullmatch(name))
    rest = [a for a in argv[1:] if a not in ("-u", "-P", "-E", "-I", "-s", "-S", "-B")]
    for flag in ("-m", "-c"):
        if flag in rest and rest.index(flag) + 1 < len(rest):
            return bool(_FORBIDDEN_PYTHON.search(rest[rest.index(flag) + 1]))
    script = next((a for a in rest if not a.startswith("-")), "")
    return bool(_FORBIDDEN_PYTHON.search(script) or _FORBIDDEN_PROGRAM.fullmatch(os.path.basename(script)))


_started: list[str] | None = None  # forbidden command lines started during the unmarked test now running


def _record(args) -> None:
    if _started is not None:
        try:
            if _forbidden(args):
                _started.append(" ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args))
        except Exception:  # never break a start for the record's sake
            pass


_popen_init = subprocess.Popen.__init__


def _recording_popen_init(self, args, *a, **kw):
    _record(args)
    _popen_init(self, args, *a, **kw)


subprocess.Popen.__init__ = _recording_popen_init
_spawnv_passfds = multiprocessing.util.spawnv_passfds


def _recording_spawnv_passfds(path, args, passfds):
    _record(args)
    return _spawnv_passfds(path, args, passfds)


multiprocessing.util.spawnv_passfds = _recording_spawnv_passfds


def _refusing_kernel(*args, **kwargs):
    raise AssertionError("this test starts a real Jupyter kernel (tests/kernel.py's Kernel): "
                         "mark it `cluster` (pytestmark, or a fixture in conftest.CLUSTER_FIXTURES)")


def _long_lived_helper(p: psutil.Process) -> bool:
    """Python's own resource tracker (started once on first use of shared memory) and the
    kernel's watcher (jupyter_scale/processes.py, started once a process is registered): each
    lives as long as pytest."""
    try:
        return any("multiprocessing.resource_tracker" in part or part.endswith("jupyter_scale/processes.py")
                   for part in p.cmdline())
    except psutil.Error:
        return True  # gone meanwhile


def _children() -> set[psutil.Process]:
    return set(psutil.Process().children(recursive=False))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    global _started
    if item.get_closest_marker("cluster") is None:
        item._children_before = _children()
        item._kernel_init = Kernel.__init__
        Kernel.__init__ = _refusing_kernel
        _started = []
    yield


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    global _started
    yield
    if not hasattr(item, "_children_before"):
        return
    started, _started = _started or [], None
    Kernel.__init__ = item._kernel_init
    new = [p for p in _children() - item._children_before if not _long_lived_helper(p)]
    left = wait_gone(new, timeout=10) if new else []
    left = [p for p in left if not _long_lived_helper(p)]
    problems = []
    if started:
        problems.append("started a kernel, engine or cluster program: " + "; ".join(c[:200] for c in started))
    if left:
        for p in left:  # ours: started by this test; clean up by pid before failing
            try:
                problems.append(f"left a child process behind: pid {p.pid} {' '.join(p.cmdline())[:200]}")
                p.kill()
            except psutil.Error:
                pass
    if problems:
        pytest.fail(f"{item.nodeid} is not marked `cluster` but it " + "\n".join(problems)
                    + "\n(mark it `cluster`, or make it stay in this process)", pytrace=False)


# -- Two at a time ---------------------------------------------------------------------------
# The README's test command is `pytest -n 2` (pytest-xdist): two worker processes, each given
# whole modules and whole notebooks, so that a module's kernel and cluster serve all its tests
# and a notebook's cells run in order in one kernel. What uses something of the machine's own
# runs in one scope, a module at a time: the test hosts (a machine-wide lock, one subnet, and a
# sweep of a crashed run's leftovers), the test Slurm (whose start sweeps leftovers too), and
# Ray heads started by `ray start` with its default worker ports (each head hands out the same
# ports in the same order; the embedded head lets the system pick).
MACHINE_WIDE = frozenset({
    "tests/test_hosts.py", "tests/test_multihost.py", "examples/multihost.ipynb",
    "tests/test_slurm.py", "tests/test_slurm_cluster.py", "examples/slurm.ipynb",
    "tests/test_export.py", "tests/test_connect.py", "examples/ray.ipynb",
})


def xdist_scope(nodeid: str) -> str:
    """The unit a worker of `pytest -n` runs whole: a module or notebook, or MACHINE_WIDE's."""
    path = nodeid.split("::", 1)[0]
    return "machine-wide" if path in MACHINE_WIDE else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return xdist_scope(nodeid)

    return ByModule(config, log)
