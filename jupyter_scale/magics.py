"""`%%distribute` and `%scale`: argument parsing only; the work is in Session."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import frameworks, jobfiles, launchers, patches, sharding, worker
from .backends import available_backends, find_connection
from .errors import DistributeError
from .session import ScaleSession


def _positive_int_named(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{flag} takes a whole number, not {text!r}") from None
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, not {value}")
        return value

    return parse


_positive_int = _positive_int_named("--workers")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--timeout takes a number of seconds, not {text!r}") from None
    if not value > 0:
        raise UsageError(f"--timeout must be more than 0 seconds, not {text}")
    return value


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not n.isidentifier()]
    if bad or not names:
        raise UsageError(f"--pull takes comma-separated variable names, not {text!r}")
    return names


def _targets(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in jobfiles.TARGETS]
    if unknown or not names:
        raise UsageError(f"--to takes some of {','.join(jobfiles.TARGETS)}, not {text!r}")
    return names


def _checked(flag: str, check):
    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
        return text

    return parse


def _launcher_arguments(magic):
    """--launcher and the Slurm options, shared by %%distribute and %scale start/restart."""
    for flag, kwargs in reversed([
        ("--launcher", dict(default=None, choices=["local", "slurm", "mpi"],
                            help="where a new cluster's workers run: local (default), slurm (a Slurm job), "
                                 "mpi (one mpiexec; ipyparallel)")),
        ("--partition", dict(default=None, help="slurm: the partition")),
        ("--time", dict(default=None, dest="time_limit", type=_checked("--time", launchers.check_time_limit),
                        help="slurm: the job's time limit (HH:MM:SS)")),
        ("--account", dict(default=None, help="slurm: the account to charge")),
        ("--qos", dict(default=None, help="slurm: the quality of service")),
        ("--cpus-per-worker", dict(default=None, type=_positive_int_named("--cpus-per-worker"),
                                   help="slurm: CPUs per worker (default 1)")),
        ("--gpus-per-worker", dict(default=None, type=_positive_int_named("--gpus-per-worker"),
                                   help="slurm: GPUs per worker (default none)")),
        ("--mem", dict(default=None, dest="memory", type=_checked("--mem", launchers.memory_megabytes),
                       help="slurm: memory per worker (16G)")),
    ]):
        magic = argument(flag, **kwargs)(magic)
    return magic


_LAUNCHER_OPTIONS = ("partition", "time_limit", "account", "qos", "cpus_per_worker", "gpus_per_worker", "memory")


def _launch(args, configured: str) -> tuple[str | None, dict]:
    """(--launcher, the Slurm options given); `configured`: c.ScaleSession.launcher."""
    options = {k: getattr(args, k) for k in _LAUNCHER_OPTIONS if getattr(args, k) is not None}
    if options and (args.launcher or configured) != "slurm":
        flags = ", ".join("--" + {"time_limit": "time", "memory": "mem"}.get(k, k).replace("_", "-") for k in options)
        raise UsageError(f"{flags} go{'es' if len(options) == 1 else ''} with --launcher slurm")
    return args.launcher, options


def _parse(magic, line: str):
    try:
        return parse_argstring(magic, line)
    except UsageError as exc:
        # argparse's message, on one line, without the usage block.
        raise UsageError(str(exc).strip().splitlines()[-1]) from None
    except ValueError as exc:  # shlex: an unbalanced quote
        raise UsageError(f"cannot read the arguments {line.strip()!r}: {exc}") from None


@magics_class
class ScaleMagics(Magics):
    def __init__(self, shell, session: ScaleSession):
        super().__init__(shell)
        self.session = session

    def _choose_backend(self, name: str | None) -> None:
        if name is None:
            return
        if name not in available_backends():
            raise UsageError(f"unknown backend {name!r} (available: {', '.join(sorted(available_backends()))})")
        if self.session.running and name != self.session.backend_name:
            raise UsageError(f"a {self.session.backend_name} cluster is running; %scale stop it first")
        self.session.backend_name = name

    @magic_arguments()
    @argument("-n", "--workers", type=_positive_int, default=None,
              help="number of workers (default: the running cluster's size, else 2)")
    @argument("--pull", type=_names, default=[],
              help="comma-separated worker variables to copy back into the notebook (rank 0's values)")
    @argument("--timeout", type=_positive_float, default=None,
              help="fail the cell if it is still running after this many seconds (default: no limit)")
    @argument("--backend", default=None,
              help="cluster engine for a new cluster: ipyparallel or dask (default: $JUPYTER_SCALE_BACKEND "
                   "or c.ScaleSession.backend_name, else ipyparallel)")
    @argument("--steps", type=_positive_int_named("--steps"), default=None,
              help="total optimizer steps the cell will run (for progress and ETA)")
    @argument("--manual", action="store_true",
              help="no automatic sharding, gradient averaging or seeding: the cell calls "
                   "jupyter_scale.wrap/shard or torch.distributed itself")
    @argument("--shard", action="store_true",
              help="shard the models the cell trains across the ranks (FSDP2's fully_shard, block by block): each "
                   "rank keeps its part of the weights, gradients and optimizer state; a model the cell builds on "
                   "the meta device is materialized shard by shard")
    @argument("--mixed-precision", choices=sorted(sharding.PRECISIONS), default=None,
              help="with --shard: compute in this dtype, reduce gradients in float32 (FSDP2's MixedPrecisionPolicy)")
    @argument("--keep-sharded", action="store_true",
              help="leave sharded models on the workers: the notebook's model is not updated (save a checkpoint "
                   "with jupyter_scale.save_checkpoint instead)")
    @argument("--cpu-offload", action="store_true",
              help="with --shard: keep the shards in CPU memory between uses (FSDP2's CPUOffloadPolicy; GPUs only)")
    @argument("--framework", choices=list(frameworks.FRAMEWORKS), default=None,
              help="whose process group the cell uses: torch (automatic mode), or tensorflow, paddle or horovod, set "
                   "up as their launchers do (TF_CONFIG, PADDLE_*, horovodrun's gloo rendezvous); default: the one "
                   "the cell uses")
    @argument("--log-to", action="append", default=None, metavar="TARGET",
              help="also write every report() point to tensorboard[:DIR] (default DIR: runs) or "
                   "mlflow[:TRACKING_URI], from the kernel; repeat for both (default: c.ScaleSession.log_to)")
    @argument("--log-as", choices=["ranks", "mean"], default=None,
              help="what --log-to writes: each rank's points (ranks, the default) or their mean at each step")
    @argument("--export", default=None, metavar="DIR",
              help="do not run the cell: write it, with the notebook code and values it needs, as a job "
                   "directory (train.py for torchrun, job.sbatch, Kubeflow and KubeRay manifests); see %%scale export")
    @_launcher_arguments
    @cell_magic
    def distribute(self, line: str, cell: str):
        """Run this cell on every worker of a local (or connected) cluster.

        The cell runs on every rank with torch.distributed initialized; `rank`,
        `world_size`, `local_rank`, `device` and `report` are defined, and the torchrun
        variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) are set. Notebook variables the cell
        reads are sent by value (unchanged ones are not sent again). Afterwards every
        notebook nn.Module the cell used holds rank 0's weights.

        Automatic mode (the default): every rank starts from the same seed, DataLoaders
        shard their dataset across ranks (reshuffled per epoch), optimizer steps average
        gradients across ranks, and module buffers end as rank 0's. `--manual` turns all
        of it off.

        Examples
        --------
        ::

            %%distribute --workers 2
            loader = DataLoader(data, batch_size=64, shuffle=True)   # sharded per rank
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            for x, y in loader:
                ...
                opt.step()                                         # gradients averaged

            %%distribute --manual
            model = jupyter_scale.wrap(model)                      # DDP, by hand
            loader = jupyter_scale.shard(DataLoader(data, batch_size=64, shuffle=True))

            %%distribute --pull losses,accuracy
            losses = train(model)

            %%distribute --timeout 600
            train_one_epoch()

            %%distribute --launcher slurm --workers 8 --partition gpu --gpus-per-worker 1 --time 2:00:00
            train()                                                # as a Slurm job
        """
        args = _parse(self.distribute, line)
        self._choose_backend(args.backend)
        launcher, options = _launch(args, self.session.launcher)
        if not cell.strip():
            raise UsageError("%%distribute needs a cell body to run")
        if args.shard and args.manual:
            raise UsageError("--shard is automatic mode's; with --manual, call jupyter_scale.shard_model in the cell")
        shard = {}
        if args.mixed_precision:
            shard["mixed_precision"] = args.mixed_precision
        if args.cpu_offload:
            shard["offload"] = True
        if shard and not args.shard:
            raise UsageError("--mixed-precision and --cpu-offload are options of --shard")
        if args.export is not None:
            if args.framework not in (None, "torch"):
                raise UsageError(f"--export writes torch jobs; a {args.framework} cell cannot be exported yet")
            if args.shard:
                raise UsageError("--export cannot write a --shard cell yet: its script would train unsharded")
            self._report_export(self.session.export(args.export, code=cell, workers=args.workers, manual=args.manual))
            return
        self._check_launch(launcher, options)
        self.session.run(cell, workers=args.workers, pull=args.pull, timeout=args.timeout, manual=args.manual,
                         steps=args.steps, launcher=launcher, launcher_options=options,
                         shard=(shard or True) if args.shard else False, keep_sharded=args.keep_sharded,
                         framework=args.framework, log_to=args.log_to, log_as=args.log_as)

    def _check_launch(self, launcher: str | None, options: dict) -> None:
        """Launcher options describe a new cluster: with one running, they must be its own."""
        session = self.session
        if not session.running or (launcher is None and not options):
            return
        current = session.placement.name if session.placement is not None else "local"
        if session.connection is not None:
            raise UsageError("--launcher and its options start a cluster; this one is connected (%scale stop first)")
        if (launcher or current) != current or (options and options != session.launch_options()):
            raise UsageError(f"a {current} cluster of {session.size} workers is running with other options; "
                             "%scale stop it first")

    @magic_arguments()
    @argument("directory", help="where to write the job (a new or an earlier export's directory)")
    @argument("--cell", type=_positive_int_named("--cell"), default=None,
              help="the cell to export, by its In [N] (default: the last %%%%distribute cell run)")
    @argument("--to", type=_targets, default=list(jobfiles.TARGETS),
              help="comma-separated launch files to write: torchrun (run.sh), slurm (job.sbatch), trainjob (Kubeflow "
                   "Trainer's TrainJob), kubeflow (a PyTorchJob, for clusters that still run Kubeflow's training "
                   "operator), ray (a KubeRay RayJob); default: all")
    @argument("--no-values", action="store_true",
              help="save no notebook values: the script makes them with the notebook code that made them")
    @argument("--from", dest="values_from", choices=["start", "now"], default=None,
              help="for a cell that ran: save the values as it started (start: the copy kept before it ran, with "
                   "%%config ScaleSession.export_keep_start = True), so that the job repeats the run; or as they are "
                   "now, after it (now: the trained weights), so that the job trains on from there. Default: start "
                   "when a copy was kept, else now, saying so")
    @argument("-n", "--workers", type=_positive_int, default=None,
              help="processes in all (default: the cell's --workers, else the cluster's size)")
    @argument("--nodes", type=_positive_int_named("--nodes"), default=1,
              help="machines (Slurm nodes, Kubernetes pods) to spread them over (default 1)")
    @argument("--image", default=None, help="the Kubernetes manifests' container image (default: NAME:latest)")
    @argument("--gpus-per-node", type=_positive_int_named("--gpus-per-node"), default=None,
              help="GPUs each node (Slurm node, pod) asks for (default: the cell's --gpus-per-worker "
                   "times the processes per node, else none)")
    def _export_arguments(self, line: str):
        """%scale export DIR: a %%distribute cell as a job directory."""

    def _export(self, line: str) -> None:
        args = _parse(self._export_arguments, line)
        number, options, body = self.session.distribute_cell(args.cell)
        cell = _parse(self.distribute, options) if options is not None else None
        if cell is not None and cell.shard:
            raise UsageError("cannot export a --shard cell yet: its script would train unsharded")
        workers = args.workers or (cell.workers if cell else None)
        gpus = args.gpus_per_node
        if gpus is None and cell is not None and cell.gpus_per_worker:
            gpus = cell.gpus_per_worker * ((workers or self.session.size or self.session.default_workers) // args.nodes)
        self._report_export(self.session.export(
            args.directory, code=body, cell=number, targets=args.to, save_values=not args.no_values,
            workers=workers, nodes=args.nodes, image=args.image, gpus_per_node=gpus or 0,
            manual=bool(cell and cell.manual), values_from=args.values_from or "auto"))

    @staticmethod
    def _report_export(done: dict) -> None:
        print(f"jupyter_scale: exported to {done['directory']}: {', '.join(done['files'])}")
        if done["values"]:
            from .export import human_size

            sizes = ", ".join(f"{name} {human_size(n)}" for name, n in done["values"].items())
            when = {"start": ", as the cell started", "now": ", as they are now"}.get(done.get("values_from", ""), "")
            print(f"  values.pt: {human_size(done['total_values'])} ({sizes}){when}")
        if "run.sh" in done["files"]:
            print(f"  run it here: bash {done['directory']}/run.sh")

    @magic_arguments()
    @argument("action", nargs="?", default="status",
              choices=["status", "start", "stop", "restart", "connect", "export", "patches", "debug", "stacks"],
              help="what to do (default: status; patches: what jupyter_scale patched in the kernel and on rank 0; "
                   "debug: pdb where the last failed cell raised on a rank; stacks: every rank's Python stacks)")
    @argument("address", nargs="?", default=None,
              help="for connect: the cluster's address, whose form says the engine: a Dask scheduler "
                   "(tcp://10.0.0.5:8786) or an ipyparallel ipcontroller-client.json file (else say --backend)")
    @argument("-n", "--workers", type=_positive_int, default=None,
              help="workers for start/restart; for connect, how many to use (waits for them)")
    @argument("--backend", default=None,
              help="cluster engine (ipyparallel, dask, or another installed one): the one start starts; for "
                   "connect, the one the address is for")
    @argument("--rank", type=int, default=None,
              help="for debug: the rank to debug (default: the one the last failed cell's error names)")
    @argument("--profile", default=None, help="for connect: an ipyparallel profile (ipcluster start --profile P)")
    @argument("--cluster-id", default=None, help="for connect: an ipyparallel cluster id within the profile")
    @argument("--tls-ca-file", default=None,
              help="for connect to a tls:// Dask scheduler: the CA that signed the cluster's certificates "
                   "(default: Dask's distributed.comm.tls configuration)")
    @argument("--tls-cert", default=None, help="for connect over tls://: this client's certificate (PEM)")
    @argument("--tls-key", default=None, help="for connect over tls://: its private key (PEM; default: in --tls-cert)")
    @_launcher_arguments
    @argument("--rendezvous", default=None, metavar="ADDRESS",
              help="for connect to a cluster across hosts: where the ranks meet, an address of rank 0's host "
                   "or a network to take rank 0's address in (10.2.0.0/16); sets ScaleSession.rendezvous_address")
    @line_magic
    def scale(self, line: str):
        """Manage the cluster behind %%distribute.

        Examples
        --------
        ::

            %scale                      # status: engine, workers, ranks, last run
            %scale start --workers 4
            %scale start --launcher slurm --workers 8 --partition gpu --gpus-per-worker 1 --time 1:00:00
            %scale start --launcher mpi --workers 4     # ipyparallel engines under mpiexec
            %scale restart              # fresh workers, same size
            %scale stop                 # stops every process the cluster started (or disconnects)
            %scale connect tcp://10.0.0.5:8786            # a running Dask scheduler
            %scale connect tls://10.0.0.5:8786 --tls-ca-file ca.pem --tls-cert me.pem --tls-key me.key
            %scale connect --profile mpi --workers 8      # a running ipcluster
            %scale connect ipcontroller-client.json --rendezvous 10.2.0.0/16   # meet on that network
            %scale export job                           # the last %%distribute cell as a job directory
            %scale export job --cell 7 --to torchrun,slurm --nodes 2 --no-values
            %scale export job --from now                # the values as they are, not as the cell started
            %scale patches              # what is patched in torch and other libraries, kernel and rank 0
            %scale debug                # pdb where the last failed cell raised, on the rank its error names
            %scale debug --rank 1
            %scale stacks               # every rank's Python stacks, each headed by its cell's line
        """
        if line.split()[:1] == ["export"]:  # its own arguments
            return self._export(line.split(None, 1)[1] if len(line.split()) > 1 else "")
        args = _parse(self.scale, line)
        if args.rank is not None and args.action != "debug":
            raise UsageError(f"--rank goes with debug, not {args.action}")
        if args.workers is not None and args.action not in ("start", "restart", "connect"):
            raise UsageError(f"--workers goes with start, restart or connect, not {args.action}")
        where = args.address or args.profile or args.cluster_id
        if args.action != "connect" and where:
            raise UsageError(f"an address, --profile or --cluster-id goes with connect, not {args.action}")
        tls = {k: v for k, v in dict(ca_file=args.tls_ca_file, cert=args.tls_cert, key=args.tls_key).items() if v}
        if tls and args.action != "connect":
            raise UsageError(f"--tls-ca-file, --tls-cert and --tls-key go with connect, not {args.action}")
        if tls and ("ca_file" not in tls or "cert" not in tls):
            raise UsageError("TLS needs --tls-ca-file and --tls-cert (and --tls-key unless the key is in the cert file)")
        if args.rendezvous is not None and args.action != "connect":
            raise UsageError(f"--rendezvous goes with connect, not {args.action}")
        if args.rendezvous:
            import ipaddress

            try:
                ipaddress.ip_network(args.rendezvous, strict=False)
            except ValueError:
                raise UsageError(f"--rendezvous takes an IP address or a network (10.2.0.0/16), "
                                 f"not {args.rendezvous!r}") from None
        launcher, options = _launch(args, self.session.launcher)
        if (launcher or options) and args.action not in ("start", "restart"):
            raise UsageError(f"--launcher and its options go with start or restart, not {args.action}")
        session = self.session
        if args.action == "connect":
            try:  # which engine, before anything starts
                find_connection(args.address, args.backend, profile=args.profile, cluster_id=args.cluster_id,
                                tls=tls or None)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            if session.running:
                raise UsageError(f"a cluster of {session.size} workers is already running; %scale stop it first")
            if args.rendezvous is not None:
                session.rendezvous_address = args.rendezvous
            session.connect(args.address, workers=args.workers, backend=args.backend, profile=args.profile,
                            cluster_id=args.cluster_id, tls=tls or None)
            return
        self._choose_backend(args.backend)
        if args.action == "start":
            if session.running:
                raise UsageError(f"a cluster of {session.size} workers is already running "
                                 "(%scale restart --workers N to change it)")
            session.start(args.workers, launcher, **options)
        elif args.action == "stop":
            was, connected = session.size, session.connection is not None and session.running
            ours = connected and session.backend is not None and session.backend.creates_workers  # (running: it is)
            session.stop()
            if ours:
                print(f"jupyter_scale: disconnected; the {was} workers made on connect ended, the cluster keeps running")
            elif connected:
                print(f"jupyter_scale: disconnected; the cluster's {was} workers keep running")
            else:
                print(f"jupyter_scale: stopped {was} workers" if was else "jupyter_scale: no cluster was running")
        elif args.action == "restart":
            session.restart(args.workers, launcher, **options)
        elif args.action == "debug":
            try:
                session.debug(args.rank)
            except DistributeError as exc:
                raise UsageError(str(exc)) from None
        elif args.action == "stacks":
            if not session.running:
                raise UsageError("no cluster is running")
            print(session.stacks())
        elif args.action == "patches":
            print(format_patches(patches.installed(), _rank0_patches(session) if session.running else None))
        else:
            count = len(patches.installed())
            print(format_status(session.status()) + f"\n  patches: {count} in the kernel (%scale patches)")


def _rank0_patches(session) -> list[patches.Record]:
    """What is patched on rank 0's worker."""
    return session.call(worker.installed_patches, ranks=[0])[0][0]["patches"]


def format_patches(kernel: list[patches.Record], rank0: list[patches.Record] | None) -> str:
    text = f"jupyter_scale: {len(kernel)} patches in the kernel\n{patches.describe(kernel)}"
    if rank0 is not None:
        text += f"\n{len(rank0)} on rank 0\n{patches.describe(rank0)}"
    return text


def format_status(info: dict) -> str:
    if not info["running"]:
        text = f"jupyter_scale: no cluster running (backend {info['backend']})"
    else:
        group = info.get("group", {})
        launcher = {"slurm": "Slurm", "mpi": "MPI"}.get(info.get("launcher", ""), "local")
        kind = "connected" if info.get("connected") else launcher
        text = (f"jupyter_scale: {kind} {info['backend']} cluster, {info['workers']} workers; process group "
                f"{group.get('backend', '?')} at {group.get('master_addr', '?')}:{group.get('master_port', '?')}"
                f"{'' if group.get('ready') else ' (re-forms at the next cell)'}")
        if info.get("lost"):
            text += (f"\n  the worker of rank(s) {info['lost']} died: the next %%distribute "
                     "restarts the cluster (or run %scale restart)")
        for job in info.get("jobs", []):
            text += f"\n  Slurm job {job['job']}: {job['state']}" + (f" on {job['nodes']}" if job.get("nodes") else "") + (
                f" ({job['reason']})" if job.get("reason") not in (None, "", "None") else "")
        if info.get("cells_through"):
            text += f"\n  cells go over: {info['cells_through']}"
        if info.get("scheduler"):
            text += f"\n  scheduler {info['scheduler']}" + (
                f", dashboard {info['dashboard']}" if info.get("dashboard") else "")
        for r in info.get("ranks", []):
            text += f"\n  rank {r['rank']}: pid {r['pid']} on {r['hostname']}, device {r.get('device', '?')}"
    if "last_run" in info:
        last = info["last_run"]
        cell = f"In [{last['execution_count']}]" if last.get("execution_count") else f"run {last['index']}"
        text += f"\n  last run: {cell} {last['status']} in {last['elapsed']:.2f} s"
    return text
