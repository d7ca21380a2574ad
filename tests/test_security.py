"""Another local user against everything the kernel and its workers listen on.

Loopback is open to every account on a shared machine. The neighbour here (uid 65534,
see stranger.py) connects as a Dask client, writes the group's store, and sends garbage
to every listening port of the kernel and its workers; afterwards nothing of theirs ran
anywhere and the next cell gives the right answer with every reported point delivered.
"""

import json
import os
import uuid

import psutil
import pytest
from stranger import require_stranger, run_as_stranger

from conftest import ENGINES, SETUP, _stop_and_check
from kernel import Kernel

pytestmark = pytest.mark.cluster

CHECK_CELL = """%%distribute --workers 2
t = torch.ones(1)
for i in range(50):
    dist.all_reduce(t)
    t /= 2          # stays 1.0 when exactly this cell's two ranks add into it
    report(loss=float(i))
print("sum", t.item())
"""


@pytest.fixture
def engine_kernel(request):
    require_stranger()
    k = Kernel(backend=request.param)
    k.ok(SETUP)
    yield k
    _stop_and_check(k)


def _cell_still_right(k):
    out = k.ok(CHECK_CELL)
    assert "[rank 0] sum 1.0" in out.stdout and "[rank 1] sum 1.0" in out.stdout, out.stdout
    points = json.loads(k.value("__import__('json').dumps(jupyter_scale.history())"))
    # Steps count on across cells: the reported values tell this cell's points apart.
    assert sorted((p["rank"], p["loss"]) for p in points) == [(r, float(i)) for r in (0, 1) for i in range(50)]


def _listening_ports(pids):
    """Every TCP port the given processes listen on."""
    ports = set()
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                ports.add((conn.laddr.ip, conn.laddr.port))
    return sorted(ports)


@pytest.mark.parametrize("engine_kernel", ["dask"], indirect=True)
def test_a_stranger_cannot_use_the_embedded_dask_cluster(engine_kernel, tmp_path):
    k = engine_kernel
    k.ok("%scale start --workers 2")
    addresses = json.loads(k.value("""__import__('json').dumps(
        [jupyter_scale.get_session().backend.client.scheduler.address]
        + [a for w in jupyter_scale.get_session().backend.client.run_on_scheduler(
              lambda dask_scheduler: [(ws.address, ws.nanny) for ws in dask_scheduler.workers.values()])
           for a in w])"""))
    assert len(addresses) == 5 and all(a.startswith("tls://127.0.0.1:") for a in addresses), addresses
    marker = f"/tmp/jupyter_scale-stranger-{uuid.uuid4().hex}"
    result = run_as_stranger(f"""
        import asyncio, time
        from distributed import Client
        from distributed.comm import connect
        from distributed.security import Security

        def plant():  # would run in the kernel (run_on_scheduler) or on a worker
            open({marker!r}, "w").write("ran")

        mine = Security.temporary()  # a certificate of the stranger's own
        addresses = {addresses!r}
        for security in (None, mine):
            for address in (addresses[0], addresses[0].replace("tls://", "tcp://")):
                started = time.monotonic()
                try:
                    client = Client(address, security=security, timeout=10)
                except Exception as exc:
                    print("refused", round(time.monotonic() - started, 1), type(exc).__name__)
                    continue
                print("CONNECTED", address)
                for attempt in (client.run_on_scheduler, client.run, lambda f: client.submit(f).result()):
                    try:
                        attempt(plant)
                    except Exception:
                        pass

        async def each_worker():
            for address in addresses[1:]:
                try:
                    comm = await connect(address, timeout=5, **mine.get_connection_args("client"))
                except Exception as exc:
                    print("refused", type(exc).__name__)
                    continue
                print("CONNECTED", address)
                await comm.write({{"op": "run", "function": plant}})
        asyncio.run(each_worker())
    """, timeout=180)
    assert "CONNECTED" not in result.stdout, result.stdout + result.stderr
    assert result.stdout.count("refused") == 8, result.stdout + result.stderr
    # Each client attempt gave up within its 10 s (plus the stranger's own start-up).
    assert all(float(line.split()[1]) < 15 for line in result.stdout.splitlines()
               if line.startswith("refused ") and len(line.split()) == 3), result.stdout
    assert not os.path.exists(marker)
    _cell_still_right(k)


@pytest.mark.parametrize("engine_kernel", ["ray"], indirect=True)
def test_a_stranger_cannot_use_the_embedded_ray_cluster(engine_kernel):
    """Ray's token: the stranger, with a token of its own, as a driver (GCS), a Ray client
    (ray://), and raw gRPC to the raylet and to each rank's actor (kill it)."""
    k = engine_kernel
    # A token the user holds for another cluster, which the stranger holds too: the embedded
    # cluster must use its own, not this one (Ray prefers RAY_AUTH_TOKEN to a token file).
    team_token = uuid.uuid4().hex * 2
    k.ok(f"import os\nos.environ['RAY_AUTH_TOKEN'] = {team_token!r}\n%scale start --workers 2")
    info = k.value("jupyter_scale.get_session().backend.describe()")
    workers = k.value("[w['pid'] for w in jupyter_scale.get_session().workers]")
    raylet = [p.pid for p in psutil.Process(k.pid).children(recursive=True) if p.name() == "raylet"]
    # Ray's gRPC servers listen on dual-stack sockets (::ffff:127.0.0.1); the ranks' other
    # ports are gloo's and the store's, which the test above covers.
    actor_ports = [p for p in _listening_ports(workers) if p[0].startswith("::ffff:")]
    raylet_ports = _listening_ports(raylet)  # the node manager's and the object manager's
    assert len(actor_ports) >= 2 and len(raylet_ports) >= 2
    marker = f"/tmp/jupyter_scale-stranger-{uuid.uuid4().hex}"
    result = run_as_stranger(f"""
        import os
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN={team_token!r}, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        import grpc, ray
        from ray.core.generated import core_worker_pb2, core_worker_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc

        def plant():
            open({marker!r}, "w").write("ran")

        for address in ({info["head"]!r}, {info["client"]!r}):
            try:
                ray.init(address=address, log_to_driver=False)
            except Exception as exc:
                print("refused", type(exc).__name__)
                continue
            print("CONNECTED", address)
            ray.get(ray.remote(plant).remote(), timeout=30)

        def rpc(port, call):
            try:
                call(grpc.insecure_channel(f"127.0.0.1:{{port}}"))
                print("ANSWERED", port)
            except grpc.RpcError as exc:  # UNIMPLEMENTED: not this port's service
                print("rpc", port, exc.code().name)

        for _, port in {actor_ports!r}:
            rpc(port, lambda ch: core_worker_pb2_grpc.CoreWorkerServiceStub(ch).KillActor(
                core_worker_pb2.KillActorRequest(force_kill=True), timeout=10))
        for _, port in {raylet_ports!r}:
            rpc(port, lambda ch: node_manager_pb2_grpc.NodeManagerServiceStub(ch).GetNodeStats(
                node_manager_pb2.GetNodeStatsRequest(), timeout=10))
            rpc(port, lambda ch: ch.unary_unary("/ray.rpc.ObjectManagerService/Pull",  # an empty request
                                                request_serializer=bytes, response_deserializer=bytes)(b"", timeout=10))
    """, timeout=300)
    said = result.stdout + result.stderr
    assert "CONNECTED" not in result.stdout and "ANSWERED" not in result.stdout, said
    assert result.stdout.count("refused") == 2, said
    for _, port in actor_ports + raylet_ports:  # each refused for want of the token
        assert f"rpc {port} UNAUTHENTICATED" in result.stdout, (port, said)
    assert not os.path.exists(marker)
    assert k.value("[w['pid'] for w in jupyter_scale.get_session().workers]") == workers
    _cell_still_right(k)
    k.ok("%scale stop")
    assert k.value("os.environ.get('RAY_AUTH_TOKEN')") == team_token  # the user's own, given back


# Every port at once, a thread each: one interpreter's start for them all.
# A port whose peer never answers keeps its thread; the stranger leaves without it.
PROBE_PORTS = """
    import datetime, os, socket, threading, time
    import torch.distributed as dist

    def probe(host, port):
        try:  # as a TCPStore client: the abort key, and every key it can list
            s = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=2), wait_for_workers=False)
            keys = s.list_keys()
            for key in ["jupyter_scale/abort", *keys]:
                s.set(key, "x")
            print("TCPSTORE", host, port, keys, flush=True)
        except Exception:
            pass
        try:  # garbage, lines of it, then hang up
            with socket.create_connection((host, port), timeout=2) as sock:
                sock.sendall(os.urandom(4096) + b"\\n" * 10 + os.urandom(1 << 16))
        except OSError:
            pass

    threads = [threading.Thread(target=probe, args=where, daemon=True) for where in {ports!r}]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    print("probed", len(threads), flush=True)
    os._exit(0)
"""


@pytest.mark.parametrize("engine_kernel", ENGINES, indirect=True)
def test_a_stranger_at_every_listening_port_changes_nothing(engine_kernel):
    k = engine_kernel
    _cell_still_right(k)  # the group exists: its store and gloo's sockets are there
    workers = k.value("[w['pid'] for w in jupyter_scale.get_session().workers]")
    # The kernel and everything it started: workers, controller or scheduler, nannies.
    pids = [k.pid, *(p.pid for p in psutil.Process(k.pid).children(recursive=True))]
    ports = _listening_ports(pids)
    assert ports and all(ip.removeprefix("::ffff:") == "127.0.0.1" for ip, _ in ports), ports
    store = k.value("jupyter_scale.get_session().group.store")
    result = run_as_stranger(f"""
        import os
        import torch.distributed as dist

        store = {store!r}
        try:  # the one-host group's store is a file in a directory of the kernel's user
            dist.FileStore(store["file"], -1).set("jupyter_scale/abort", "1")
            print("STORE WRITTEN")
        except Exception as exc:
            print("store refused", type(exc).__name__)
        print("directory", oct(os.stat(os.path.dirname(store["file"])).st_mode & 0o777))
    """)
    assert "store refused" in result.stdout and "directory 0o700" in result.stdout, result.stdout + result.stderr
    probe = run_as_stranger(PROBE_PORTS.format(ports=sorted(ports)), timeout=120)
    assert f"probed {len(ports)}" in probe.stdout and "TCPSTORE" not in probe.stdout, probe.stdout + probe.stderr
    # The workers are the same processes, and the next cells are right, every point delivered.
    assert k.value("[w['pid'] for w in jupyter_scale.get_session().workers]") == workers
    _cell_still_right(k)
    _cell_still_right(k)
