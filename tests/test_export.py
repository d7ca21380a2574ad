"""%scale export: a %%distribute cell becomes a job directory whose train.py, run by the real
torchrun (and by sbatch on a real one-node Slurm), trains to the weights the cell trains to."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

import slurm
from conftest import README_DATA, README_LOOP, SETUP, wait_gone
from jupyter_scale import export, jobfiles
from kernel import Kernel

VENV_BIN = str(Path(sys.executable).parent)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    try:
        k.ok(SETUP, history=True)
        yield k
    finally:
        k.cell("%scale stop", timeout=120)
        leftovers = k.descendants()
        k.shutdown()
        assert wait_gone(leftovers) == [], "the kernel left processes behind"


def _with_venv(env):
    return dict(env, PATH=VENV_BIN + os.pathsep + os.environ["PATH"])


def run_job(argv, cwd, timeout=200, env=None):
    """Run a job's launcher as a user would; everything it started ends with it."""
    env = _with_venv(os.environ if env is None else env)
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = ""
        pytest.fail(f"{argv} still running after {timeout} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session we started, by its pid
            proc.communicate()
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{out[-5000:]}"
    assert wait_gone([p for p in psutil.process_iter() if _in_group(p, proc.pid)]) == []
    return out


def _in_group(p, pgid):
    try:
        return os.getpgid(p.pid) == pgid
    except (ProcessLookupError, PermissionError):
        return False


def losses_of(directory: Path) -> dict:
    points = {}
    for path in sorted((directory / "output").glob("metrics-rank*.jsonl")):
        for line in path.read_text().splitlines():
            p = json.loads(line)
            points[(p["rank"], p["step"])] = p["loss"]
    return points


def assert_same_weights(saved: Path, kernel, name="model"):
    kernel.ok(f"torch.save({name}.state_dict(), {str(saved) + '.notebook'!r})")
    script, notebook = torch.load(saved), torch.load(str(saved) + ".notebook")
    assert script.keys() == notebook.keys()
    for key in script:
        assert torch.allclose(script[key], notebook[key], rtol=0, atol=1e-6), f"{key} differs"


def test_the_exported_cell_trains_to_the_weights_the_cell_trains_to(kernel, tmp_path):
    job = tmp_path / "job"
    kernel.ok(README_DATA, history=True)
    # Export first, then run the same cell from the same state and seed.
    kernel.ok("torch.manual_seed(7)\nbefore = {k: v.clone() for k, v in model.state_dict().items()}", history=True)
    out = kernel.ok(f"%%distribute --workers 2 --export {job}\n" + README_LOOP, history=True)
    assert f"exported to {job}" in out.stdout and "values.pt" in out.stdout
    assert "[rank" not in out.stdout  # --export writes the job; the cell does not run
    assert sorted(p.name for p in job.iterdir()) == ["Dockerfile", "README.md", "job.sbatch", "pytorchjob.yaml",
                                                     "rayjob.yaml", "requirements.txt", "run.sh", "train.py",
                                                     "values.pt"]
    kernel.ok("torch.manual_seed(7)\nmodel.load_state_dict(before)")
    kernel.ok("%%distribute --workers 2\n" + README_LOOP, timeout=300, history=True)
    # The run knows its cell as the notebook shows it (IPython 9 counts a cell before it runs).
    assert kernel.value("jupyter_scale.get_session().runs[-1].execution_count") == kernel.value("len(In) - 1")
    notebook_losses = {(p["rank"], p["step"]): p["loss"] for p in kernel.value("jupyter_scale.history()")}

    said = run_job(["bash", "run.sh"], cwd=job)
    assert "jupyter_scale: finished" in said and "model.pt" in said
    assert_same_weights(job / "output" / "model.pt", kernel)
    script_losses = losses_of(job)
    assert script_losses.keys() == notebook_losses.keys() and len(script_losses) == 2 * 32  # 2 ranks, 2 epochs of 16 batches
    assert all(abs(script_losses[k] - notebook_losses[k]) < 1e-6 for k in script_losses)

    requirements = (job / "requirements.txt").read_text().splitlines()
    assert f"torch=={torch.__version__.split('+')[0]}" in requirements  # the build (+cpu) is the machine's choice
    assert any(line.startswith("jupyter_scale==") or line.startswith("jupyter-scale==") for line in requirements)


def test_a_job_ends_its_group_at_finish_so_no_gloo_thread_outlives_it(tmp_path):
    # A gloo thread still running as Python finalizes can abort the process ("terminate called
    # without an active exception") when it frees a tensor: torchrun then fails the whole job.
    # Here the optimizer imports torch._dynamo after the group formed, as in most scripts.
    (tmp_path / "train.py").write_text("""
import os, torch
import jupyter_scale.script
job = jupyter_scale.script.start(seed=0)
rank, world_size, local_rank, device, report = job.cell()
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
import torch.distributed.fsdp.sharded_grad_scaler  # holds the group in a default argument too
model(torch.randn(8, 4)).sum().backward()
opt.step()
def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return [n for n in names if n.startswith(("pt_gloo", "gloo_"))]
print(f"rank {rank} gloo threads before: {len(gloo_threads())}", flush=True)  # one write: ranks share stdout
job.finish(model=model)
print(f"rank {rank} gloo threads left: {gloo_threads()}", flush=True)
""")
    said = run_job(["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2", "train.py"], cwd=tmp_path)
    assert "rank 0 gloo threads before: 0" not in said and "rank 0 gloo threads before:" in said, said
    assert "rank 0 gloo threads left: []" in said and "rank 1 gloo threads left: []" in said, said
    assert "FutureWarning" not in said, said  # the job's own log says nothing of ours


def test_the_sbatch_job_trains_to_the_same_weights_on_slurm(kernel, tmp_path):
    reason = slurm.unavailable_reason()
    if reason:
        pytest.skip(reason)
    job = tmp_path / "job"
    kernel.ok("model.load_state_dict(before)", history=True)
    # The last %%distribute cell, with the seed it ran with (drawn after torch.manual_seed(7)).
    kernel.ok(f"%scale export {job} --to slurm", history=True)
    assert not (job / "run.sh").exists() and (job / "job.sbatch").exists()
    kernel.ok("model.load_state_dict(before)\ntorch.manual_seed(7)")
    kernel.ok("%%distribute --workers 2\n" + README_LOOP, timeout=300, history=True)
    with slurm.Slurm(cpus=4) as cluster:
        env = dict(cluster.env, PATH=VENV_BIN + os.pathsep + os.environ["PATH"])
        done = subprocess.run(["sbatch", "--parsable", f"--output={job}/slurm-%j.out", "job.sbatch"], cwd=job,
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.strip().split(";")[0]
        state = cluster.wait(job_id, timeout=300)
        said = (job / f"slurm-{job_id}.out").read_text()
        assert state == "COMPLETED", said[-3000:]
        assert wait_gone(cluster.processes()) == []
    assert "jupyter_scale: finished" in said
    assert_same_weights(job / "output" / "model.pt", kernel)


def _pod_template(template):
    """The pod template as the Kubernetes API's model reads it: nothing it does not know is dropped."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    model = api._ApiClient__deserialize(template, "V1PodTemplateSpec")
    assert api.sanitize_for_serialization(model) == template
    return model


def _in_image(text: str, job: Path) -> str:
    return text.replace(jobfiles.IMAGE_DIR, str(job))  # the image's job directory is this one


def test_the_kubernetes_jobs_run_as_their_operators_start_them_and_train_alike(kernel, tmp_path, ray_cli_cluster):
    import shlex

    import yaml

    cell = kernel.value("jupyter_scale.get_session().runs[-1].execution_count")  # the README loop's
    job = tmp_path / "job"
    kernel.ok("model.load_state_dict(before)", history=True)
    kernel.ok(f"%scale export {job} --cell {cell} --nodes 2 --to kubeflow,ray --image registry.example/job:1",
              history=True)  # with the seed In [cell] ran with (drawn after torch.manual_seed(7))
    assert {"pytorchjob.yaml", "rayjob.yaml", "Dockerfile"} <= {p.name for p in job.iterdir()}
    assert not (job / "run.sh").exists()
    assert "ray[default]==" in (job / "requirements.txt").read_text()
    kernel.ok("model.load_state_dict(before)\ntorch.manual_seed(7)")
    kernel.ok("%%distribute --workers 2\n" + README_LOOP, timeout=300, history=True)

    # Kubeflow: a Master and a Worker pod, each `torchrun train.py` with what the operator sets.
    pytorchjob = yaml.safe_load((job / "pytorchjob.yaml").read_text())
    assert (pytorchjob["apiVersion"], pytorchjob["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert pytorchjob["spec"]["nprocPerNode"] == "1"
    replicas = pytorchjob["spec"]["pytorchReplicaSpecs"]
    assert [(role, spec["replicas"]) for role, spec in replicas.items()] == [("Master", 1), ("Worker", 1)]
    port = _free_port()
    pods = []
    for node_rank, role in enumerate(["Master", "Worker"]):
        (container,) = _pod_template(replicas[role]["template"]).spec.containers
        assert container.name == "pytorch" and container.image == "registry.example/job:1"
        operator = {"PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                    "RANK": str(node_rank), "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
                    "PET_NNODES": "2", "PET_NODE_RANK": str(node_rank), "PET_NPROC_PER_NODE": "1"}
        env = dict(os.environ, **{e.name: _in_image(e.value, job) for e in container.env}, **operator)
        pods.append(subprocess.Popen([_in_image(part, job) for part in container.command],
                                     cwd=_in_image(container.working_dir, job), env=_with_venv(env),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True))
    try:
        for pod in pods:
            said, _ = pod.communicate(timeout=300)
            assert pod.returncode == 0, said[-3000:]
    finally:
        for pod in pods:
            if pod.poll() is None:
                os.killpg(pod.pid, signal.SIGKILL)  # the sessions we started, by pid
                pod.wait()
    assert_same_weights(job / "output" / "model.pt", kernel)

    # KubeRay: the entrypoint, as Ray's job supervisor runs it on the head (RAY_ADDRESS set).
    rayjob = yaml.safe_load((job / "rayjob.yaml").read_text())
    assert (rayjob["apiVersion"], rayjob["kind"]) == ("ray.io/v1", "RayJob")
    cluster = rayjob["spec"]["rayClusterSpec"]
    _pod_template(cluster["headGroupSpec"]["template"])
    (group,) = cluster["workerGroupSpecs"]
    assert group["replicas"] == 2 and _pod_template(group["template"]).spec.containers[0].image == "registry.example/job:1"
    shutil.rmtree(job / "output")
    gcs, _, token, _ = ray_cli_cluster
    # The fixture's head is a one-node cluster on loopback (Ray's laptop setting): its drivers say so too.
    env = dict(os.environ, RAY_ADDRESS=gcs, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token,
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    said = run_job([_in_image(part, job) for part in shlex.split(rayjob["spec"]["entrypoint"])], cwd=tmp_path, env=env)
    assert "2 ranks on 1 node(s)" in said and "jupyter_scale: finished" in said
    assert_same_weights(job / "output" / "model.pt", kernel)


def _free_port():
    # Not one the kernel picks (bind to port 0): that is in the ephemeral range, where any
    # outgoing connection (the Ray cluster's, the kernel's) may take it before the job binds it.
    from slurm import free_ports

    return free_ports(1)[0]


NOTEBOOK = [
    "import numpy as np\nimport torch.nn.functional as F\nHIDDEN = 16",
    "class Block(nn.Module):\n    def __init__(self, n):\n        super().__init__()\n        self.lin = nn.Linear(n, n)\n"
    "    def forward(self, x):\n        return x + squash(self.lin(x))",
    "def squash(x):\n    return F.relu(x) * SCALE\nSCALE = 0.5",
    "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.inp = nn.Linear(8, HIDDEN)\n"
    "        self.block = Block(HIDDEN)\n        self.out = nn.Linear(HIDDEN, 2)",
    # The class gets its forward in a later cell.
    "def forward(self, x):\n    return self.out(self.block(self.inp(x)))\nNet.forward = forward",
    "rng = np.random.default_rng(0)\narr = rng.normal(size=(256, 8)).astype('float32')\n"
    "labels = (arr.sum(axis=1) > 0).astype('int64')\n"
    "numbers = TensorDataset(torch.from_numpy(arr), torch.from_numpy(labels))\ntorch.manual_seed(3)\nnet = Net()",
    "net  # shown, not code",
    "%who_ls",
]
CELL = """
loader = DataLoader(numbers, batch_size=16, shuffle=True)
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
for x, y in loader:
    opt.zero_grad()
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    report(loss=loss)
"""


def test_a_notebook_of_many_cells_exports_with_its_code_and_runs(kernel, tmp_path):
    for cell in NOTEBOOK:
        kernel.ok(cell, history=True)
    job = tmp_path / "job"
    kernel.ok(f"%%distribute --workers 2 --export {job}\n{CELL}", history=True)
    train = (job / "train.py").read_text()
    for definition in ("class Block", "def squash", "class Net", "Net.forward = forward",
                       "import torch.nn.functional as F", "HIDDEN = 16", "SCALE = 0.5"):
        assert definition in train, definition
    # The values travel saved: the code that made them (and numpy) stays behind.
    assert "%who_ls" not in train and "net  # shown" not in train and "rng.normal" not in train
    assert "numpy" not in train
    assert "net = _saved[\"net\"]" in train and "numbers = _saved[\"numbers\"]" in train
    run_job(["bash", "run.sh"], cwd=job)
    assert {rank for rank, _ in losses_of(job)} == {0, 1} and len(losses_of(job)) == 2 * 8  # 256 samples, 16 a batch
    assert set(torch.load(job / "output" / "net.pt")) == set(kernel.value("list(net.state_dict())"))

    # Without values: the script makes them with the notebook's code (and its seeding).
    rebuilt = tmp_path / "rebuilt"
    kernel.ok(f"%scale export {rebuilt} --no-values --to torchrun", history=True)  # the last %%distribute cell
    train = (rebuilt / "train.py").read_text()
    assert not (rebuilt / "values.pt").exists()
    assert "arr = rng.normal" in train and "torch.manual_seed(3)" in train and "net = Net()" in train
    assert "import numpy as np" in train and "numpy==" in (rebuilt / "requirements.txt").read_text()
    assert "net  # shown" not in train
    run_job(["bash", "run.sh"], cwd=rebuilt)
    assert len(losses_of(rebuilt)) == 2 * 8


def test_a_cell_reading_an_open_file_is_refused_by_name(kernel, tmp_path):
    kernel.ok(f"log = open({str(tmp_path / 'log.txt')!r}, 'w')", history=True)
    job = tmp_path / "job"
    out = kernel.cell(f"%%distribute --workers 2 --export {job}\nlog.write(str(rank))\n", history=True)
    assert out.error is not None and len(out.error["traceback"]) == 1, out.error_text
    assert "log (TextIOWrapper) cannot be saved" in out.error["evalue"]
    assert not job.exists()  # nothing written
    kernel.ok("log.close()")
    # A name only the workers hold (bound by an earlier cell there) cannot come along either.
    kernel.ok("%%distribute --workers 2\nsteps_done = 3", history=True)
    out = kernel.cell(f"%%distribute --export {job}\nprint(steps_done)", history=True)
    assert "steps_done exists only on the workers" in (out.error or {}).get("evalue", ""), out.error_text
    # And IPython syntax in the cell itself.
    out = kernel.cell(f"%%distribute --export {job}\n%time x = 1", history=True)
    assert "line 1 of the cell is IPython syntax" in (out.error or {}).get("evalue", ""), out.error_text
    # And a cell of another framework: the job would run it under torchrun.
    out = kernel.cell(f"%%distribute --export {job}\nimport tensorflow as tf\nstrategy = None", history=True)
    assert "the cell uses tensorflow; export writes torch jobs" in (out.error or {}).get("evalue", ""), out.error_text
    assert not job.exists()


# ----------------------------------------------------------------------------------------
# The slicing itself, on cells as IPython hands them over
# ----------------------------------------------------------------------------------------


def _plan(cells, body, namespace, **options):
    statements = export.notebook_statements(list(enumerate(cells, 1)), lambda code: code)
    return export.plan_script(body, namespace, statements, **options)


def test_the_last_definition_wins_and_its_reads_are_followed():
    cells = ["def helper():\n    return 1", "K = 2", "def helper():\n    return K * 2", "def unrelated():\n    pass"]
    namespace = {"__name__": "__main__"}  # functions defined here are the notebook's
    for cell in cells:
        exec(cell, namespace)
    plan = _plan(cells, "print(helper())", namespace)
    assert [s.source for s in plan.statements] == ["def helper():\n    return K * 2\n"]
    assert plan.literals == {"K": "2"}


def test_a_definition_made_by_ipython_syntax_or_missing_is_refused():
    def made():
        pass

    made.__module__ = "__main__"
    with pytest.raises(export.ExportError, match=r"made \(a function of the notebook\) is made with IPython syntax "
                                                 r"in In \[1\]"):
        _plan(["made = get_ipython().user_ns['x']"], "made()", {"made": made})
    with pytest.raises(export.ExportError, match="made .a function of the notebook. is not defined by any executed"):
        _plan([], "made()", {"made": made})


def _run_exported(tmp_path, cells, body, save_values=False):
    """Export `body` from `cells` (run here as a notebook would) and run train.py as one process."""
    namespace = {"__name__": "__main__"}
    for cell in cells:
        exec(cell, namespace)
    statements = export.notebook_statements(list(enumerate(cells, 1)), lambda code: code)
    plan = export.plan_script(body, namespace, statements, save_values=save_values,
                              eligible=lambda name: not name.startswith("__"))
    job = tmp_path / "job"
    jobfiles.write(job, plan, jobfiles.JobShape("job", 1), seed=0, automatic=True, cell=None, targets=("torchrun",))
    done = subprocess.run([sys.executable, "train.py"], cwd=job, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (job / "train.py").read_text() + done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-2], (job / "train.py").read_text()  # before finish's line


def test_imports_come_first_whichever_cell_ran_them_last(tmp_path):
    cells = ["import torch\nfrom torch import nn", "class Net(nn.Module):\n    pass", "import torch\nfrom torch import nn",
             "net = Net()"]
    said, _ = _run_exported(tmp_path, cells, "print(type(net).__name__)")
    assert said == "Net"


def test_without_values_a_value_is_what_the_statements_before_its_reader_made(tmp_path):
    cells = ["import torch", "n = 5", "x = torch.zeros(n)", "x = x + 1", "n = 10"]
    said, train = _run_exported(tmp_path, cells, "print(x.shape[0], n, x.sum().item())")
    assert said == "5 10 5.0"
    assert train.index("n = 5") < train.index("torch.zeros(n)") < train.index("x = x + 1") < train.index("n = 10")


def test_without_values_the_seeding_before_them_comes_with_what_it_reads(tmp_path):
    import numpy as np

    cells = ["import numpy as np", "np.random.seed(3)", "a = np.random.rand(3)"]
    said, _ = _run_exported(tmp_path, cells, "print(round(float(a.sum()), 6))")
    assert said == str(round(float(np.random.RandomState(3).rand(3).sum()), 6))


def test_a_definition_that_reads_a_saved_value_as_it_is_made_comes_after_the_values(tmp_path):
    cells = ["import torch", "val = torch.arange(4.)", "def total(x=val):\n    return x.sum()"]
    said, train = _run_exported(tmp_path, cells, "print(total().item())", save_values=True)
    assert said == "6.0" and train.index('_job.load("values.pt")') < train.index("def total")
