"""%scale export: a %%distribute cell becomes a job directory whose train.py, run by the real
torchrun (and by sbatch on a real one-node Slurm), trains to the weights the cell trains to."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import psutil
import pytest
import torch
import yaml
from stranger import require_stranger, run_as_stranger

import slurm
from conftest import README_DATA, README_LOOP, SETUP, wait_gone
from jupyter_scale import export, jobdir, jobfiles
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


# The CRDs of the operators the manifests are for (see each file's header): their OpenAPI v3 schemas.
CRDS = Path(__file__).parent / "data" / "crds"


def _crd_schema(manifest: dict) -> dict:
    group, _, version = manifest["apiVersion"].rpartition("/")
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, manifest["kind"]):
            (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
            return served["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no CRD for {manifest['apiVersion']} {manifest['kind']} under {CRDS}")


def crd_problems(manifest: dict) -> list[str]:
    """What the API server would say of `manifest` with the CRD installed: what its schema
    refuses (types, required fields, enums, patterns), the fields it would drop without a word
    (not in the schema: pruned), and keys repeated in a list keyed by them (env by name)."""
    schema = _crd_schema(manifest)
    problems = [f"/{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in jsonschema.Draft4Validator(schema).iter_errors(manifest)]
    return problems + _pruned_or_repeated(manifest, schema, "")


def _pruned_or_repeated(value, schema: dict, where: str) -> list[str]:
    found = []
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        known, rest = schema.get("properties"), schema.get("additionalProperties")
        for key, item in value.items():
            if known is not None and key in known:
                found += _pruned_or_repeated(item, known[key], f"{where}/{key}")
            elif isinstance(rest, dict):
                found += _pruned_or_repeated(item, rest, f"{where}/{key}")
            elif known is not None:
                found.append(f"{where}/{key}: not in the schema (the API server drops it)")
    elif isinstance(value, list) and "items" in schema:
        keys = schema.get("x-kubernetes-list-map-keys")
        if keys:
            seen = [tuple(item.get(k) for k in keys) for item in value]
            found += [f"{where}: {key} repeated" for key in sorted(set(seen)) if seen.count(key) > 1]
        for i, item in enumerate(value):
            found += _pruned_or_repeated(item, schema["items"], f"{where}/{i}")
    return found


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
                                                     "trainjob.yaml", "values.pt"]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in job.iterdir() if p.suffix in (".sh", ".pt", ".py")} == {
        "run.sh": 0o700, "train.py": 0o600, "values.pt": 0o600}
    assert stat.S_IMODE(job.stat().st_mode) == 0o700
    assert "is a pickle" in (job / "README.md").read_text()
    for manifest in job.glob("*.yaml"):
        assert crd_problems(yaml.safe_load(manifest.read_text())) == [], manifest.name
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
    kernel.ok(f"%scale export {job} --cell {cell} --nodes 2 --to trainjob,kubeflow,ray --image registry.example/job:1",
              history=True)  # with the seed In [cell] ran with (drawn after torch.manual_seed(7))
    assert {"trainjob.yaml", "pytorchjob.yaml", "rayjob.yaml", "Dockerfile"} <= {p.name for p in job.iterdir()}
    for manifest in job.glob("*.yaml"):
        assert crd_problems(yaml.safe_load(manifest.read_text())) == [], manifest.name
    assert not (job / "run.sh").exists()
    assert "ray[default]==" in (job / "requirements.txt").read_text()
    kernel.ok("model.load_state_dict(before)\ntorch.manual_seed(7)")
    kernel.ok("%%distribute --workers 2\n" + README_LOOP, timeout=300, history=True)

    # Kubeflow Trainer: two nodes, each the trainer's `torchrun /job/train.py` in the image's
    # working directory, with what Trainer's torch plugin sets.
    trainjob = yaml.safe_load((job / "trainjob.yaml").read_text())
    assert (trainjob["apiVersion"], trainjob["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert trainjob["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = trainjob["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["image"]) == (2, 1, "registry.example/job:1")
    port = _free_port()
    plugin = [{"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port), "PET_NNODES": "2",
               "PET_NODE_RANK": str(node_rank), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"])}
              for node_rank in range(trainer["numNodes"])]
    _run_pods([(trainer["command"], jobfiles.IMAGE_DIR, {e["name"]: e["value"] for e in trainer["env"]}, set_by)
               for set_by in plugin], job)
    assert_same_weights(job / "output" / "model.pt", kernel)
    shutil.rmtree(job / "output")

    # The training operator: a Master and a Worker pod, each `torchrun train.py` with what the operator sets.
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
        operator = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                    "RANK": str(node_rank), "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
                    "PET_NNODES": "2", "PET_NODE_RANK": str(node_rank), "PET_NPROC_PER_NODE": "1"}
        pods.append((container.command, container.working_dir, {e.name: e.value for e in container.env}, operator))
    _run_pods(pods, job)
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


def test_an_export_after_the_cell_starts_where_the_cell_started_or_says_it_does_not(kernel, tmp_path):
    kernel.ok(README_DATA, history=True)
    kernel.ok("%config ScaleSession.export_keep_start = True")
    try:
        kernel.ok(f"start = {{k: v.clone() for k, v in model.state_dict().items()}}\n"
                  f"torch.save(start, {str(tmp_path / 'start.pt')!r})\ntorch.manual_seed(11)", history=True)
        kernel.ok("%%distribute --workers 2\n" + README_LOOP, timeout=300, history=True)
        cell = kernel.value("jupyter_scale.get_session().runs[-1].execution_count")
        notebook_losses = {(p["rank"], p["step"]): p["loss"] for p in kernel.value("jupyter_scale.history()")}
        kernel.ok(f"torch.save(model.state_dict(), {str(tmp_path / 'trained.pt')!r})")
        start, trained = torch.load(tmp_path / "start.pt"), torch.load(tmp_path / "trained.pt")
        assert not all(torch.equal(start[k], trained[k]) for k in start)

        def saved_model(job):
            return torch.load(job / "values.pt", weights_only=False)["model"].state_dict()

        def same(a, b):
            return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

        # Asked for the start: the copy kept before the cell ran, and the job repeats the run.
        job = tmp_path / "start"
        out = kernel.ok(f"%scale export {job} --to torchrun --from start", history=True)
        assert "as the cell started" in out.stdout and "jupyter_scale: the job starts" not in out.stderr, out.stderr
        assert same(saved_model(job), start)
        assert f"as In [{cell}] started" in (job / "README.md").read_text()
        run_job(["bash", "run.sh"], cwd=job)
        assert_same_weights(job / "output" / "model.pt", kernel)  # the notebook's model: the cell's trained weights
        # The same losses, rank by rank and step by step (the workers number their steps on from earlier cells).
        by_rank = [[loss for (r, _), loss in sorted(losses.items()) if r == rank]
                   for losses in (losses_of(job), notebook_losses) for rank in (0, 1)]
        assert [len(losses) for losses in by_rank] == [32] * 4  # 2 epochs of 16 batches
        assert all(abs(a - b) < 1e-6 for a, b in zip(by_rank[0] + by_rank[1], by_rank[2] + by_rank[3]))
        # Not asked, the kept start is what it saves too.
        default = tmp_path / "default"
        out = kernel.ok(f"%scale export {default} --to torchrun", history=True)
        assert "as the cell started" in out.stdout and same(saved_model(default), start)

        # Asked for now: the trained weights, and one line says so.
        now = tmp_path / "now"
        out = kernel.ok(f"%scale export {now} --to torchrun --from now", history=True)
        said = [line for line in out.stderr.splitlines() if line.strip()]
        # (Other names the cell may read and its run rebound, x and y of an earlier run of its loop, come after model.)
        assert len(said) == 1 and said[0].startswith("jupyter_scale: the job starts from model"), said
        assert f"now, written back by In [{cell}]'s run (trained), not as In [{cell}] started" in said[0], said
        assert said[0].endswith("--from start exports the start"), said
        assert "as they are now" in out.stdout and same(saved_model(now), trained)

        # Without a copy (the setting off drops it): the default saves now and says so; the start is refused.
        kernel.ok("%config ScaleSession.export_keep_start = False")
        plain = tmp_path / "plain"
        out = kernel.ok(f"%scale export {plain} --to torchrun", history=True)
        said = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(said) == 1 and said[0].startswith("jupyter_scale: the job starts from model"), said
        assert f"written back by In [{cell}]'s run (trained)" in said[0], said
        assert "%config ScaleSession.export_keep_start = True" in said[0]
        assert same(saved_model(plain), trained)
        refused = tmp_path / "refused"
        out = kernel.cell(f"%scale export {refused} --to torchrun --from start", history=True)
        assert out.error is not None and len(out.error["traceback"]) == 1, out.error_text
        assert out.error["evalue"].startswith(f"cannot export In [{cell}] as it started: its run changed model"), \
            out.error["evalue"]
        assert not refused.exists()
        out = kernel.cell(f"%scale export {refused} --to torchrun --no-values --from now", history=True)
        assert "--from picks the saved values" in (out.error or {}).get("evalue", ""), out.error_text
        assert not refused.exists()
    finally:
        kernel.ok("%config ScaleSession.export_keep_start = False")


def _run_pods(pods, job: Path):
    """Run each (command, working directory, the manifest's env, what the operator sets) as its
    pod would, the image's job directory being `job`; all must succeed."""
    started = []
    try:
        for command, workdir, env, operator in pods:
            env = dict(os.environ, PYTHONUNBUFFERED="1", **{k: _in_image(v, job) for k, v in env.items()}, **operator)
            started.append(subprocess.Popen([_in_image(part, job) for part in command], cwd=_in_image(workdir, job),
                                            env=_with_venv(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True, start_new_session=True))
        for pod in started:
            said, _ = pod.communicate(timeout=300)
            assert pod.returncode == 0, said[-3000:]
    finally:
        for pod in started:
            if pod.poll() is None:
                os.killpg(pod.pid, signal.SIGKILL)  # the sessions we started, by pid
                pod.wait()


def _free_port():
    # Not one the kernel picks (bind to port 0): that is in the ephemeral range, where any
    # outgoing connection (the Ray cluster's, the kernel's) may take it before the job binds it.
    from slurm import free_ports

    return free_ports(1)[0]


def test_which_values_an_export_after_a_run_saves():
    from jupyter_scale import cellstart
    from jupyter_scale.records import RunRecord

    model, data, trained = torch.nn.Linear(2, 2), torch.zeros(3), torch.nn.Linear(2, 2)
    now = {"model": trained, "data": data, "x": torch.ones(1)}  # x: bound by the run (it was not there before)
    run = RunRecord(index=1, workers=2, execution_count=5, shipped={"model": 100}, skipped=["data"],
                    pulled=["model", "x"])
    kept = cellstart.Start(run=1, values={"model": model, "data": data})
    values, source, note = cellstart.choose(now, [run], 5, kept)
    assert (values, source, note) == ({"model": model, "data": data}, "start", None)
    values, source, note = cellstart.choose(now, [run], 5, kept, "now")
    assert values == now and source == "now"
    assert note == ("jupyter_scale: the job starts from model as the notebook holds it now, written back by In [5]'s "
                    "run (trained), not as In [5] started; --from start exports the start")
    # A later cell's run took the copy's place: the start is refused, the default says so.
    later = RunRecord(index=2, workers=2, execution_count=6, skipped=["model"])
    with pytest.raises(export.ExportError, match=r"^cannot export In \[5\] as it started: its run changed model, of "
                                                 r"which no copy .* \(only the last cell's start is kept"):
        cellstart.choose(now, [run, later], 5, cellstart.Start(run=2, values={"model": trained}), "start")
    values, source, note = cellstart.choose(now, [run, later], 5, None)
    assert values == now and source == "now" and "ScaleSession.export_keep_start = True" in note
    # A cell that has not run starts from the values as they are.
    assert cellstart.choose(now, [run], 7, None, "start") == (now, "", None)
    with pytest.raises(export.ExportError, match="values from 'later'"):
        cellstart.choose(now, [run], 5, kept, "later")


# ----------------------------------------------------------------------------------------
# The Kubernetes manifests, against their operators' CRDs
# ----------------------------------------------------------------------------------------


def _plain_plan(**values):
    return export.ScriptPlan(body="print(rank)\n", values=dict(values))


@pytest.mark.parametrize("shape", [jobfiles.JobShape("job", 1), jobfiles.JobShape("two", 4, nodes=2, gpus_per_node=2),
                                   jobfiles.JobShape("big", 8, nodes=3, image="registry.example/x:2", cpus_per_node=16,
                                                     gpus_per_node=8, memory_per_node="64Gi")],
                         ids=["one-node", "two-nodes-gpus", "three-nodes"])
def test_every_kubernetes_manifest_fits_its_operators_crd(tmp_path, shape):
    done = jobfiles.write(tmp_path / "job", _plain_plan(), shape, seed=0, automatic=True, cell=None)
    manifests = {name: yaml.safe_load((tmp_path / "job" / name).read_text())
                 for name in done["files"] if name.endswith(".yaml")}
    assert {(m["apiVersion"], m["kind"]) for m in manifests.values()} == {
        ("trainer.kubeflow.org/v1alpha1", "TrainJob"), ("kubeflow.org/v1", "PyTorchJob"), ("ray.io/v1", "RayJob")}
    for name, manifest in manifests.items():
        assert crd_problems(manifest) == [], name
        assert manifest["metadata"]["name"] == shape.name
    trainer = manifests["trainjob.yaml"]["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (shape.nodes, shape.per_node)
    assert trainer["command"] == ["torchrun", f"{jobfiles.IMAGE_DIR}/train.py"]
    assert trainer["resourcesPerNode"]["limits"].get("nvidia.com/gpu") == (str(shape.gpus_per_node)
                                                                             if shape.gpus_per_node else None)
    entrypoint = manifests["rayjob.yaml"]["spec"]["entrypoint"]
    if shape.gpus_per_node:  # each rank's share of its node's GPUs
        assert f"--gpus-per-worker {shape.gpus_per_node / shape.per_node:g}" in entrypoint
    readme = (tmp_path / "job" / "README.md").read_text()
    assert "Kubeflow Trainer" in readme and "for clusters that still run the training operator" in readme


def test_the_crd_check_finds_what_the_api_server_would_refuse_or_drop():
    good = yaml.safe_load(jobfiles.trainjob_yaml(jobfiles.JobShape("job", 2, nodes=2)))
    assert crd_problems(good) == []

    def broken(change):
        manifest = json.loads(json.dumps(good))
        change(manifest["spec"])
        return crd_problems(manifest)

    assert any("not in the schema" in p for p in broken(lambda spec: spec["trainer"].update(numNode=2)))
    assert any("'runtimeRef' is a required property" in p for p in broken(lambda spec: spec.pop("runtimeRef")))
    assert any("is not of type 'integer'" in p for p in broken(lambda spec: spec["trainer"].update(numNodes="2")))
    assert any("less than the minimum" in p for p in broken(lambda spec: spec["trainer"].update(numNodes=0)))
    assert any("does not match" in p
               for p in broken(lambda spec: spec["trainer"]["resourcesPerNode"]["limits"].update(memory="4 GB")))
    assert any("repeated" in p for p in broken(lambda spec: spec["trainer"]["env"].append(spec["trainer"]["env"][0])))
    rayjob = yaml.safe_load(jobfiles.rayjob_yaml(jobfiles.JobShape("job", 2), "2.52.0"))
    del rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["name"]
    assert any("'name' is a required property" in p for p in crd_problems(rayjob))
    pytorchjob = yaml.safe_load(jobfiles.pytorchjob_yaml(jobfiles.JobShape("job", 2)))
    pytorchjob["spec"]["nprocPerNode"] = 2  # a string in the training operator's schema
    assert any("is not of type 'string'" in p for p in crd_problems(pytorchjob))


# ----------------------------------------------------------------------------------------
# The job directory: only the user's own, written without following what others planted
# ----------------------------------------------------------------------------------------


def _export_to(directory: Path, **values):
    return jobfiles.write(directory, _plain_plan(**values), jobfiles.JobShape("job", 1), seed=0, automatic=True,
                          cell=None, targets=("torchrun",))


def _tree(directory: Path) -> dict:
    return {p.name: (os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None)
            for p in directory.iterdir()}


@pytest.fixture
def shared_tmp():
    """A directory like /tmp (everyone may write, sticky), which the stranger can reach."""
    path = Path(tempfile.mkdtemp(prefix="jupyter_scale-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path)


def test_a_strangers_directory_with_a_forged_export_is_refused_and_its_symlink_not_followed(tmp_path, shared_tmp):
    require_stranger()
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    theirs = shared_tmp / "job"
    made = run_as_stranger(f"""
        import os
        os.mkdir({str(theirs)!r}, 0o755)
        with open({str(theirs / "train.py")!r}, "w") as f:
            f.write('\"\"\"Exported by jupyter_scale from In [1]\"\"\"\\n')
        os.symlink({str(victim)!r}, {str(theirs / "run.sh")!r})
    """)
    assert made.returncode == 0, made.stderr
    before = _tree(theirs)
    for target in (theirs, theirs / "inner"):  # the directory, and a new one inside it
        with pytest.raises(export.ExportError) as refused:
            _export_to(target, data=torch.zeros(3))
        message = str(refused.value)
        assert "belongs to another user (uid 65534)" in message and "\n" not in message, message
    assert _tree(theirs) == before and victim.read_text() == "the user's own file\n"

    # Beside it, in the sticky directory, a new export of the user's own is written, 0700:
    # the stranger can neither rename it nor write into it.
    mine = shared_tmp / "mine"
    _export_to(mine, data=torch.zeros(3))
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    tried = run_as_stranger(f"""
        import os
        for attempt in (lambda: os.rename({str(mine)!r}, {str(shared_tmp / "moved")!r}),
                        lambda: open({str(mine / "run.sh")!r}, "a")):
            try:
                attempt()
                print("done")
            except PermissionError:
                print("refused")
    """)
    assert tried.stdout.split() == ["refused", "refused"], tried.stdout + tried.stderr


@pytest.mark.parametrize("mode, who", [(0o777, "its group and other users"), (0o770, "its group"),
                                       (0o703, "other users")], ids=["everyone", "group", "others"])
def test_a_directory_others_can_write_is_refused_before_anything_is_written(tmp_path, mode, who):
    job = tmp_path / "job"
    job.mkdir()
    job.chmod(mode)
    with pytest.raises(export.ExportError, match=f"it is writable by {who}, who could change the job"):
        _export_to(job, data=torch.zeros(3))
    assert list(job.iterdir()) == []
    # And a new directory inside one that others can write (not sticky, unlike /tmp).
    with pytest.raises(export.ExportError, match=f"{job} is writable by {who}, who could replace what it holds"):
        _export_to(job / "inner")
    assert list(job.iterdir()) == []
    job.chmod(mode | stat.S_ISVTX)  # sticky: no one renames or removes another's entries
    _export_to(job / "inner")
    assert (job / "inner" / "train.py").exists()


def test_a_symlink_in_an_earlier_export_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    job = tmp_path / "job"
    old = os.umask(0)  # the modes are the export's, whatever the umask
    try:
        _export_to(job, data=torch.zeros(3))
        for name in ("run.sh", "values.pt", "README.md"):
            (job / name).unlink()
            (job / name).symlink_to(victim)
        done = _export_to(job, data=torch.ones(3))
    finally:
        os.umask(old)
    assert victim.read_text() == "the user's own file\n"
    modes = {p.name: (p.is_symlink(), stat.S_IMODE(p.lstat().st_mode)) for p in job.iterdir()}
    assert modes == {"run.sh": (False, 0o700), "train.py": (False, 0o600), "values.pt": (False, 0o600),
                     "README.md": (False, 0o600), "requirements.txt": (False, 0o600)}
    assert stat.S_IMODE(job.stat().st_mode) == 0o700
    assert torch.equal(torch.load(job / "values.pt", weights_only=False)["data"], torch.ones(3))
    assert done["total_values"] == (job / "values.pt").stat().st_size
    # An export without values removes the earlier values.pt, as a link, not what it names.
    (job / "values.pt").unlink()
    (job / "values.pt").symlink_to(victim)
    _export_to(job)
    assert not (job / "values.pt").exists() and not (job / "values.pt").is_symlink() and victim.exists()
    # A train.py that is a symlink is no earlier export of ours, whatever it names.
    (job / "train.py").unlink()
    (job / "train.py").symlink_to(tmp_path / "forged.py")
    (tmp_path / "forged.py").write_text('"""Exported by jupyter_scale"""\n')
    with pytest.raises(export.ExportError, match="is not empty .and holds no earlier export."):
        _export_to(job)
    assert victim.read_text() == "the user's own file\n"


def test_a_package_directory_planted_as_a_symlink_is_replaced(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    package = tmp_path / "helpers"
    package.mkdir()
    (package / "__init__.py").write_text("X = 1\n")
    job = tmp_path / "job"
    with jobdir.JobDirectory.open(job) as directory:
        directory.copy_in(package)
    (job / "helpers").rename(tmp_path / "old")
    (job / "helpers").symlink_to(elsewhere)
    with jobdir.JobDirectory.open(job) as directory:
        directory.copy_in(package)
    assert list(elsewhere.iterdir()) == [] and not (job / "helpers").is_symlink()
    assert (job / "helpers" / "__init__.py").read_text() == "X = 1\n"
    assert stat.S_IMODE((job / "helpers").stat().st_mode) == 0o700


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
    # A name only the workers hold (bound by an earlier cell there: each rank's own DataLoader
    # stays there) cannot come along either.
    kernel.ok("%%distribute --workers 2\nfrom torch.utils.data import DataLoader as Loader\n"
              "rank_loader = Loader(list(range(8)), batch_size=2)", history=True)
    out = kernel.cell(f"%%distribute --export {job}\nprint(len(rank_loader))", history=True)
    assert "rank_loader exists only on the workers" in (out.error or {}).get("evalue", ""), out.error_text
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
