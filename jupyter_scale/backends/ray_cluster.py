"""The Ray engine's cluster, below its calls: the embedded one-node cluster, the kernel as
Ray's driver, and the ranks' actors placed together (backends.ray holds the engine).

The embedded cluster is `ray start --head --block` (programs/ray_head) on 127.0.0.1 in a
session of its own (a kernel interrupt signals the kernel's process group), tied to the kernel
(processes.watch), with token authentication: every gRPC port of Ray's answers only peers
that hold this cluster's token. The kernel joins it, or any running cluster, with `init_driver`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from typing import Any

import psutil
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .. import patches, processes, programs, rendezvous
from ..errors import ClusterError
from ..processes import descendants

log = logging.getLogger(__name__)

# Ray's variables for authentication, which the embedded cluster sets in the kernel while it runs.
_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


class EmbeddedHead:
    """The embedded cluster's head: its process, and its directory (the token, Ray's logs and
    sockets, spilled objects), registered with the kernel's watcher `watch`."""

    def __init__(self, watch: processes.Watch):
        self._watch = watch
        self.process: subprocess.Popen | None = None
        self.scratch: str | None = None
        self.client_port = 0
        self._environ: dict[str, str | None] = {}  # the kernel's variables before ours

    @property
    def token_file(self) -> str:
        return os.path.join(self.scratch or "", "token")

    def start(self, deadline: float, flags: dict[str, Any]) -> str:
        """Start the head (`flags`: more `ray start` options) and have this process's Ray use
        its token; the head's GCS address."""
        # Ray's socket paths live under its temp directory and must stay under 108 bytes.
        base = tempfile.gettempdir() if len(tempfile.gettempdir()) < 20 else "/tmp"
        self.scratch = tempfile.mkdtemp(prefix="jsray-", dir=base)  # owner-only
        # If the kernel dies, its watcher ends `ray start` and every process of Ray's, and
        # removes this directory.
        self._watch.add_path(self.scratch)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        environ = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.token_file,
                       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                       # As Dask's memory_limit=0: no monitor killing a rank that trains a big model.
                       RAY_memory_monitor_refresh_ms="0")
        environ.pop("RAY_AUTH_TOKEN", None)  # it would win over our token file
        self.client_port = rendezvous.free_port(rendezvous.LOOPBACK)
        # Worker ports the system picks (0, 0): Ray's default range hands the same ports out, in
        # the same order, to every head of the machine (another user's too), and a worker whose
        # port is taken fails.
        command = [*programs.command("ray_head"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                   "--port=0", f"--ray-client-server-port={self.client_port}",
                   "--min-worker-port=0", "--max-worker-port=0",
                   "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={os.path.join(self.scratch, 'r')}",
                   *(f"--{key.replace('_', '-')}={value}" for key, value in flags.items())]
        log_path = os.path.join(self.scratch, "head.log")
        with open(log_path, "w") as out:
            self.process = subprocess.Popen(command, env=environ, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self._watch.add_processes([self.process.pid])
        # Ray opens its own temp directory to everyone (0777): ours around it is owner-only.
        found = os.path.join(self.scratch, "r", "ray_current_cluster")
        while not (os.path.exists(found) and open(found).read().strip()):
            if self.process.poll() is not None:
                with open(log_path, errors="replace") as f:
                    said = [line.strip() for line in f if line.strip()]
                raise ClusterError(f"ray start exited with status {self.process.returncode}: "
                                   f"{said[-1] if said else 'no output'}")
            if time.monotonic() > deadline:
                raise ClusterError("the Ray head did not come up within the start timeout")
            time.sleep(0.1)
        # A token in RAY_AUTH_TOKEN (another cluster's) would win over our file: unset while ours runs.
        self._environ = {k: os.environ.get(k) for k in _AUTH_VARIABLES}
        set_environ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": None, "RAY_AUTH_TOKEN_PATH": self.token_file})
        with open(found) as f:
            return f.read().strip()

    @contextlib.contextmanager
    def stopping(self):
        """Around the driver's ray.shutdown: after it, the kernel's own Ray variables back; and
        whatever Ray raised, the head and every process of Ray's ended, the directory removed."""
        # Ray's processes, found while the head still holds them (they are orphans once it exits).
        tree = _tree(self.process.pid) if self.process is not None else []
        head, self.process = self.process, None
        try:
            yield
            if self._environ:
                set_environ(self._environ)
        finally:
            self._environ = {}
            if head is not None:
                processes.end([head.pid], grace=20)  # ray start --block stops what it started
                head.poll()
                processes.end(tree, grace=5)  # by pid, what did not stop
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)
                self.scratch = None

    def describe(self) -> dict:
        if self.scratch is None:
            return {}
        return {"temp_dir": self.scratch, "client": f"ray://127.0.0.1:{self.client_port}"}


# --------------------------------------------------------------------------------------
# The kernel as Ray's driver
# --------------------------------------------------------------------------------------
def refuse_second_ray() -> None:
    if ray.is_initialized():
        raise ClusterError("this kernel is already connected to Ray (ray.init): call ray.shutdown() first, "
                           "or %scale connect to that cluster")


def init_driver(address: str, runtime_env: dict | None = None) -> None:
    """ray.init into the cluster at `address` (a GCS address, or ray:// for Ray Client), in a
    namespace of this session's, with the cluster's logs and errors kept out of the cells."""
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    # A head on loopback is a one-node cluster of this machine's (see _one_node); any
    # other is reached as Ray reaches it.
    one_node = _one_node() if not address.startswith("ray://") and _is_loopback(host) else contextlib.nullcontext()
    with one_node, _as_kernel_driver():
        for attempt in (1, 2):
            try:
                ray.init(address=address, namespace=f"jupyter_scale-{uuid.uuid4().hex[:12]}", log_to_driver=False,
                         logging_level=logging.ERROR, configure_logging=False, runtime_env=runtime_env)
                return
            except ConnectionAbortedError as exc:
                # Ray Client's head starts a server process per client, which now and then
                # exits as it starts ("Starting Ray client server failed", or an
                # "Initialization failure from server" when the head finds it a zombie): a
                # second client gets another.
                if attempt == 2 or not any(said in str(exc) for said in (
                        "client server failed", "Initialization failure from server")):
                    raise
                log.info("Ray Client's server did not start; connecting again", exc_info=True)


def place_actors(actor_class: Any, n: int, cpus: float, gpus: float, timeout: float) -> tuple[Any, list, list[int]]:
    """`n` actors of `actor_class` (a ray.remote class, given its whole CPUs), each in its bundle
    of one placement group (all of them or none), started: (the group, the actors, their pids).
    What it placed goes again when they do not start within `timeout` s."""
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    group = placement_group([bundle] * n, strategy="PACK")
    actors: list = []
    try:
        if not ray.wait([group.ready()], timeout=timeout)[0]:
            raise ClusterError(f"the Ray cluster has no room for {n} workers of {bundle} within {timeout:.0f} s "
                               f"(free now: {ray.available_resources()})")
        actors = [actor_class.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=i)).remote(max(1, int(cpus))) for i in range(n)]
        pings = [actor.pid.remote() for actor in actors]
        if len(ray.wait(pings, num_returns=n, timeout=timeout)[0]) < n:
            raise ClusterError(f"Ray did not start {n} actors within {timeout:.0f} s")
        return group, actors, ray.get(pings)
    except BaseException:
        remove_actors(actors, group)
        raise


def remove_actors(actors: list, group: Any) -> None:
    """End the actors and free their placement group, as far as Ray still can."""
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)
    if group is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(group)


_ONE_NODE = patches.Patch("ray._private.ray_constants.ENABLE_RAY_CLUSTER", "while ray.init runs: the embedded "
                         "cluster's ports stay on loopback", "engine ray")


@contextlib.contextmanager
def _one_node():
    """Ray takes 127.0.0.1 for the machine's network address unless it runs a cluster of one
    node (its setting for laptops): then every port of the embedded cluster, and the
    kernel's, stays on loopback. The head gets it as RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0;
    the kernel, whose Ray may have read the environment already, for its ray.init."""
    with _ONE_NODE.during(lambda _: False):
        yield


_NO_ERROR_LISTENER = patches.Patch("ray._private.worker.listen_error_messages", "while ray.init runs: no thread "
                                  "printing the cluster's errors into whatever cell runs", "engine ray")


@contextlib.contextmanager
def _as_kernel_driver():
    """ray.init makes SIGTERM raise SystemExit, which IPython catches: the kernel would outlive
    its manager's SIGTERM. The kernel keeps its own handler. And the driver's thread that
    prints the cluster's error messages is not started: it prints into whatever cell runs
    then, and what it says of our ranks (a worker died) the session says itself."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        with _NO_ERROR_LISTENER.during(lambda _: lambda *args: None):
            yield
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, before)


def set_environ(values: dict[str, str | None]) -> None:
    """Set (None: unset) Ray's variables in the kernel, and have its Ray read them again: it
    reads the authentication mode and token once, and keeps them (C++'s RayConfig and token
    loader), so the embedded cluster's token would otherwise not reach a Ray imported before."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _tree(pid: int) -> list:
    """psutil handles of a process and every process it started."""
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(pid)
        return [process, *descendants([process])]
    return []
