"""The launch files of an exported job: how train.py runs without a notebook.

Each target is one file beside train.py, written from the same parameters (processes per
node, nodes, image) with defaults a user edits in place:

- `run.sh`: torchrun on this machine;
- `job.sbatch`: a Slurm batch job, one torchrun per node (srun) meeting through torchrun's
  c10d rendezvous on the first node;
- `trainjob.yaml`: a Kubeflow Trainer TrainJob (trainer.kubeflow.org/v1alpha1) on the
  `torch-distributed` ClusterTrainingRuntime: one pod per node, whose `torchrun train.py`
  gets the node count, its node rank and the master from Trainer's torch plugin
  (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, ...);
- `pytorchjob.yaml`: the same as a PyTorchJob (kubeflow.org/v1) of the training operator,
  which Kubeflow replaced by Trainer in 2025: for clusters that still run it;
- `rayjob.yaml`: a KubeRay RayJob (ray.io/v1) whose entrypoint runs train.py on the Ray
  workers, one actor a rank (`python -m jupyter_scale.ray_job`).

The Kubernetes targets come with a Dockerfile for their image (this directory on top of
Python, torch and requirements.txt), and every export with a README saying how to run each.
The directory is written as jobdir says: only into a directory no one else can write.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path

from . import export
from .export import ExportError, ScriptPlan
from .jobdir import FILE_MODE, SCRIPT_MODE, JobDirectory

# kubeflow: the training operator's PyTorchJob (the name it had before Kubeflow Trainer).
TARGETS = ("torchrun", "slurm", "trainjob", "kubeflow", "ray")
FILES = {"torchrun": "run.sh", "slurm": "job.sbatch", "trainjob": "trainjob.yaml", "kubeflow": "pytorchjob.yaml",
         "ray": "rayjob.yaml"}
# Kubeflow Trainer's runtime for torchrun jobs, installed with Trainer.
TORCH_RUNTIME = "torch-distributed"
# Where the Kubernetes targets find the job directory in their image (the Dockerfile's WORKDIR).
IMAGE_DIR = "/job"


def job_name(directory_name: str) -> str:
    """A name every target takes: a Kubernetes name (DNS-1035: lower-case letters, digits and
    dashes, from a letter; at most 47 characters for KubeRay's derived names)."""
    name = re.sub(r"[^a-z0-9-]+", "-", directory_name.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = "job-" + name
    return name[:47].rstrip("-")


@dataclass
class JobShape:
    """Where the job runs: `nodes` machines (or pods) of `per_node` processes each."""

    name: str
    per_node: int
    nodes: int = 1
    image: str = ""
    cpus_per_node: int = 0  # 0: one core per process
    gpus_per_node: int = 0
    memory_per_node: str = "4Gi"

    def __post_init__(self) -> None:
        self.image = self.image or f"{self.name}:latest"  # a manifest names some image: the Dockerfile's, built so

    @property
    def workers(self) -> int:
        return self.per_node * self.nodes

    @property
    def cpus(self) -> int:
        return self.cpus_per_node or self.per_node


def run_sh(shape: JobShape) -> str:
    return f"""#!/usr/bin/env bash
# Train on this machine: torchrun starts NPROC processes (default {shape.per_node}).
set -euo pipefail
cd "$(dirname "$0")"
NPROC=${{NPROC:-{shape.per_node}}}
# As %%distribute's workers: the machine's cores shared among the processes (torchrun
# alone gives each process one thread).
cores=$(nproc)
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-$(( cores / NPROC > 0 ? cores / NPROC : 1 ))}}
exec torchrun --standalone --nnodes=1 --nproc-per-node="$NPROC" train.py "$@"
"""


def job_sbatch(shape: JobShape) -> str:
    gpus = f"#SBATCH --gpus-per-node={shape.gpus_per_node}\n" if shape.gpus_per_node else ""
    return f"""#!/usr/bin/env bash
#SBATCH --job-name={shape.name}
#SBATCH --nodes={shape.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={shape.cpus}
{gpus}# Add --partition, --time, --account, --mem as your cluster wants them.
#
# Submit from this directory (sbatch job.sbatch), where the job starts. One torchrun per
# node, {shape.per_node} processes each; the nodes meet through torchrun's c10d rendezvous on the first node (where this
# script runs), by address: host names need not resolve between nodes.
set -euo pipefail
# The job runs in the environment it was submitted from (sbatch passes it on); activate
# the one that has requirements.txt installed here if yours does not.
NPROC=${{NPROC:-{shape.per_node}}}
export MASTER_ADDR=${{MASTER_ADDR:-$(hostname -I | cut -d' ' -f1)}}
export MASTER_PORT=${{MASTER_PORT:-$(( 20000 + SLURM_JOB_ID % 20000 ))}}
cpus=${{SLURM_CPUS_PER_TASK:-$NPROC}}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-$(( cpus / NPROC > 0 ? cpus / NPROC : 1 ))}}
export NPROC
# Each node's torchrun says itself whether it hosts the rendezvous (the first node does):
# torchrun's own guess compares host names, which need not resolve.
srun --kill-on-bad-exit=1 --cpus-per-task="$cpus" \\
    bash -c 'exec torchrun --nnodes="$SLURM_NNODES" --nproc-per-node="$NPROC" \\
    --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \\
    --rdzv-conf=is_host=$([ "$SLURM_NODEID" = 0 ] && echo true || echo false) train.py "$@"' torchrun "$@"
"""


def dockerfile(torch_version: str) -> str:
    return f"""# The image of the Kubernetes jobs: this directory on top of Python, torch and requirements.txt.
#   docker build -t IMAGE . && docker push IMAGE      (the manifests name IMAGE)
FROM python:3.11-slim
WORKDIR {IMAGE_DIR}
COPY requirements.txt .
# torch's CPU build; for GPUs start FROM a CUDA image and install torch=={torch_version} for it.
RUN pip install --no-cache-dir torch=={torch_version} --index-url https://download.pytorch.org/whl/cpu \\
 && pip install --no-cache-dir -r requirements.txt
COPY . .
"""


def _resources(shape: JobShape, cpus: int) -> list[str]:
    """A container's (or a TrainJob node's) requests and limits, as YAML lines."""
    resources = {"cpu": str(cpus), "memory": shape.memory_per_node}
    if shape.gpus_per_node:
        resources["nvidia.com/gpu"] = str(shape.gpus_per_node)
    lines = []
    for kind in ("requests", "limits"):
        lines.append(f"  {kind}:")
        lines += [f"    {k}: \"{v}\"" for k, v in resources.items()]
    return lines


def _env(env: dict) -> list[str]:
    return [f"  - name: {k}\n    value: \"{v}\"" for k, v in env.items()]


def _indented(lines: list[str], indent: int) -> str:
    return "".join(" " * indent + line.replace("\n", "\n" + " " * indent) + "\n" for line in lines)


def _container(shape: JobShape, name: str, command: list[str], indent: int, cpus: int, env: dict) -> str:
    """A pod template's one container, as YAML at `indent` spaces."""
    quoted = ", ".join(f'"{part}"' for part in command)
    lines = [f"- name: {name}", f"  image: {shape.image}", f"  workingDir: {IMAGE_DIR}"]
    if command:
        lines.append(f"  command: [{quoted}]")
    if env:
        lines += ["  env:", *("  " + line.replace("\n", "\n  ") for line in _env(env))]
    lines += ["  resources:", *("  " + line for line in _resources(shape, cpus))]
    return _indented(lines, indent)


def _job_env(shape: JobShape) -> dict:
    return {"OMP_NUM_THREADS": max(1, shape.cpus // shape.per_node), "JUPYTER_SCALE_OUTPUT": f"{IMAGE_DIR}/output"}


def trainjob_yaml(shape: JobShape) -> str:
    """Kubeflow Trainer's TrainJob: the torch-distributed runtime's pods, one per node, each
    running the trainer's command with the image's /job as the script's directory (a TrainJob
    sets no working directory: the script is named by its path)."""
    return f"""# A Kubeflow Trainer TrainJob (trainer.kubeflow.org/v1alpha1): kubectl apply -f trainjob.yaml
# Kubeflow Trainer (v2) runs it on its {TORCH_RUNTIME} ClusterTrainingRuntime: one pod per node
# ({shape.nodes}), {shape.per_node} processes each; Trainer's torch plugin gives every pod's `torchrun` the node
# count, its node rank and the first pod's address (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR,
# PET_MASTER_PORT; numProcPerNode becomes PET_NPROC_PER_NODE). For clusters that still run the
# training operator (kubeflow.org/v1), use pytorchjob.yaml instead.
# Set the image (see Dockerfile), the resources, and a volume at {IMAGE_DIR}/output to keep the weights
# (podTemplateOverrides, or the runtime's own template).
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata:
  name: {shape.name}
spec:
  runtimeRef:
    apiGroup: trainer.kubeflow.org
    kind: ClusterTrainingRuntime
    name: {TORCH_RUNTIME}
  trainer:
    image: {shape.image}
    command: ["torchrun", "{IMAGE_DIR}/train.py"]
    numNodes: {shape.nodes}
    numProcPerNode: {shape.per_node}
    env:
{_indented(_env(_job_env(shape)), 4)}    resourcesPerNode:
{_indented(_resources(shape, shape.cpus), 4)}"""


def pytorchjob_yaml(shape: JobShape) -> str:
    env = _job_env(shape)

    def replicas(role: str, count: int) -> str:
        return (f"    {role}:\n      replicas: {count}\n"
                "      # A process group cannot take back one restarted rank: a failed pod fails the job.\n"
                "      restartPolicy: Never\n      template:\n        spec:\n          containers:\n" +
                _container(shape, "pytorch", ["torchrun", "train.py"], 12, shape.cpus, env))

    workers = replicas("Worker", shape.nodes - 1) if shape.nodes > 1 else ""
    return f"""# A Kubeflow PyTorchJob (the training operator's kubeflow.org/v1): kubectl apply -f pytorchjob.yaml
# For clusters that still run the training operator, which Kubeflow replaced by Kubeflow Trainer in
# 2025 (whose TrainJob is trainjob.yaml). One pod per node ({shape.nodes}), {shape.per_node} processes each: the
# operator gives every pod's `torchrun train.py` the node count, its node rank and the master pod's
# address (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT; nprocPerNode becomes
# PET_NPROC_PER_NODE).
# Set the image (see Dockerfile), the resources, and a volume at {IMAGE_DIR}/output to keep the weights.
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: {shape.name}
spec:
  nprocPerNode: "{shape.per_node}"
  runPolicy:
    cleanPodPolicy: None  # the pods stay for their logs
  pytorchReplicaSpecs:
{replicas("Master", 1)}{workers}"""


def rayjob_yaml(shape: JobShape, ray_version: str) -> str:
    entrypoint = (f"python -m jupyter_scale.ray_job --workers {shape.workers} --cpus-per-worker "
                  f"{max(1, shape.cpus // shape.per_node)}" +
                  (f" --gpus-per-worker {shape.gpus_per_node / shape.per_node:g}" if shape.gpus_per_node else "") +
                  f" {IMAGE_DIR}/train.py")
    head = JobShape(shape.name, 1, image=shape.image, memory_per_node="2Gi")
    output = {"JUPYTER_SCALE_OUTPUT": f"{IMAGE_DIR}/output"}
    return f"""# A KubeRay RayJob (ray.io/v1): kubectl apply -f rayjob.yaml
# A Ray cluster of {shape.nodes} worker pod(s) for the job; its entrypoint runs train.py on {shape.workers}
# Ray actors, one a rank, with torchrun's variables (python -m jupyter_scale.ray_job). The head
# runs the driver only (num-cpus 0). Set the image (see Dockerfile), the resources, and a volume
# at {IMAGE_DIR}/output on the workers to keep the weights (rank 0 writes them).
apiVersion: ray.io/v1
kind: RayJob
metadata:
  name: {shape.name}
spec:
  entrypoint: {entrypoint}
  shutdownAfterJobFinishes: true
  ttlSecondsAfterFinished: 600
  rayClusterSpec:
    rayVersion: "{ray_version}"
    headGroupSpec:
      rayStartParams:
        num-cpus: "0"
      template:
        spec:
          containers:
{_container(head, "ray-head", [], 12, 1, output)}    workerGroupSpecs:
      - groupName: workers
        replicas: {shape.nodes}
        minReplicas: {shape.nodes}
        maxReplicas: {shape.nodes}
        rayStartParams: {{}}
        template:
          spec:
            containers:
{_container(shape, "ray-worker", [], 14, shape.cpus, output)}"""


def readme(shape: JobShape, files: list[str], values: dict[str, str], where: str,
           values_when: str = "as they were at export") -> str:
    sections = [f"# {shape.name}: a training job exported by jupyter_scale\n\n"
                f"`train.py` is {where} of the notebook with the notebook code it needs, run as `%%distribute` runs\n"
                f"it: {shape.workers} processes ({shape.nodes} node{'s' if shape.nodes > 1 else ''} of {shape.per_node}), "
                "one process group, automatic mode with the seed the cell ran (or would run) with. Rank 0 saves the\n"
                "trained models' weights as `output/NAME.pt` (state dicts: `model.load_state_dict(torch.load(...))`),\n"
                "and every rank writes what it reports as JSON lines, `output/metrics-rankN.jsonl`\n"
                "(`JUPYTER_SCALE_OUTPUT` moves `output/`).\n"]
    if values:
        listed = ", ".join(f"{name} ({size})" for name, size in values.items())
        sections.append(f"`values.pt` holds the notebook's values {values_when}: {listed}. It is a pickle\n"
                        "(`torch.load(..., weights_only=False)`): loading it runs whatever code it names, so load only\n"
                        "one you made yourself, and keep this directory writable by you alone.\n")
    sections.append("Install what it needs (the versions the notebook ran): `pip install -r requirements.txt`.\n")
    how = {
        "run.sh": "## On this machine\n\n    bash run.sh                 # NPROC=4 bash run.sh for 4 processes\n",
        "job.sbatch": "## On Slurm\n\n    sbatch job.sbatch           # from this directory\n\n"
                      "One `torchrun` per node under `srun`; edit the `#SBATCH` lines for your partition and time.\n",
    }
    image = "    docker build -t IMAGE . && docker push IMAGE   # then name IMAGE in the manifest\n"
    how["trainjob.yaml"] = ("## On Kubernetes, with Kubeflow Trainer\n\n" + image +
                            "    kubectl apply -f trainjob.yaml\n\n"
                            "A TrainJob (`trainer.kubeflow.org/v1alpha1`) for Kubeflow Trainer, the Kubeflow of 2025 on:\n"
                            f"it runs on Trainer's `{TORCH_RUNTIME}` ClusterTrainingRuntime, one pod per node, whose\n"
                            "torch plugin gives each pod's `torchrun` the node count, its node rank and the first pod's\n"
                            "address. Mount a volume at `/job/output` to keep the weights.\n")
    how["pytorchjob.yaml"] = ("## On Kubernetes, with the Kubeflow training operator (before Trainer)\n\n" +
                              ("" if "trainjob.yaml" in files else image) +
                              "    kubectl apply -f pytorchjob.yaml\n\n"
                              "A PyTorchJob (`kubeflow.org/v1`), for clusters that still run the training operator,\n"
                              "which Kubeflow replaced by Trainer in 2025 (`kubectl get crd pytorchjobs.kubeflow.org`\n"
                              "says whether yours does). One pod per node; the operator gives each pod's `torchrun` the\n"
                              "node count, its node rank and the master's address. Mount a volume at `/job/output` to\n"
                              "keep the weights.\n")
    how["rayjob.yaml"] = ("## On Kubernetes, with KubeRay\n\n"
                          "    kubectl apply -f rayjob.yaml                   # the same image\n\n"
                          "The entrypoint, `python -m jupyter_scale.ray_job --workers N /job/train.py`, runs train.py\n"
                          "on N Ray actors with torchrun's variables; it runs against any Ray cluster too\n"
                          "(`RAY_ADDRESS=HEAD:6379 python -m jupyter_scale.ray_job --workers N train.py`).\n")
    sections += [text for name, text in how.items() if name in files]
    sections.append("## Security\n\ntorchrun's rendezvous store and gloo's connections carry no authentication: run the\n"
                    "job on machines and networks only you (and those you trust) can reach. Whoever can write into\n"
                    "this directory can change what you run: jupyter_scale writes it only into a directory that is\n"
                    "yours and that no one else can write (its files 0600, its scripts 0700).\n")
    return "\n".join(sections)


_MARK = "Exported by jupyter_scale"


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def write(directory: Path, plan: ScriptPlan, shape: JobShape, *, seed: int, automatic: bool, cell: int | None,
          targets: tuple[str, ...] = TARGETS, root: Path | None = None,
          values_when: str = "as they were at export") -> dict:
    """Write the job directory; returns what was written (files, the values' sizes).
    A directory that holds anything but an earlier export, or that is not safe to write (see
    jobdir), is refused before anything is written. `values_when`: when the saved values
    were the notebook's, for the job's README."""
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ExportError(f"cannot export: unknown target {unknown[0]!r} (targets: {', '.join(TARGETS)})")
    local = export.local_modules(plan.modules, root or Path.cwd())
    clash = sorted(name for name, path in local.items() if path.stem in {"train", "README", "requirements", "values"})
    if clash:
        raise ExportError(f"cannot export: the notebook's module {clash[0]!r} would overwrite the job's own file "
                          f"({local[clash[0]].name}); rename the module")
    where = f"In [{cell}]" if cell else "a %%distribute cell"
    files: dict[str, str] = {
        "train.py": export.script_text(plan, seed=seed, automatic=automatic, cell=cell,
                                       title=f"{shape.name}: {where} of a notebook, as a torchrun script"),
        # The RayJob's head serves Ray's job submission: ray[default].
        "requirements.txt": "".join(line + "\n" for line in export.requirements(
            plan.modules | ({"ray"} if "ray" in targets else set()), local,
            extras={"ray": "default"} if "ray" in targets else None)),
    }
    makers = {"torchrun": lambda: run_sh(shape), "slurm": lambda: job_sbatch(shape),
              "trainjob": lambda: trainjob_yaml(shape), "kubeflow": lambda: pytorchjob_yaml(shape),
              "ray": lambda: rayjob_yaml(shape, _installed("ray") or "2.52.0")}
    for target in TARGETS:
        if target in targets:
            files[FILES[target]] = makers[target]()
    if {"trainjob", "kubeflow", "ray"} & set(targets):
        files["Dockerfile"] = dockerfile(_installed("torch").split("+")[0])
    with JobDirectory.open(directory) as job:
        if not job.created and job.names():
            earlier = job.head("train.py")
            if earlier is None or _MARK not in earlier:
                raise ExportError(f"cannot export: {directory} is not empty (and holds no earlier export); "
                                  "name a new directory")
        sizes = {}
        if plan.values:
            with job.create("values.pt") as file:
                sizes = export.save_values(plan.values, file)
        else:  # an earlier export's: this script loads none
            job.remove("values.pt")
        shown = {name: export.human_size(n) for name, n in sizes.items()}
        files["README.md"] = readme(shape, list(files), shown, where, values_when)
        scripts = {FILES["torchrun"], FILES["slurm"]}
        for name, text in files.items():
            job.write(name, text, SCRIPT_MODE if name in scripts else FILE_MODE)
        for source in local.values():  # the notebook's own modules travel with the script
            job.copy_in(source)
        total = job.size("values.pt") if plan.values else 0
    written = sorted([*files, *(["values.pt"] if plan.values else []), *(p.name for p in local.values())])
    return {"directory": str(directory), "files": written, "values": sizes, "total_values": total}
