"""Workers on other hosts: clusters across network-namespace hosts, attached with %scale connect.

Each host (tests/hosts.py) has its own network stack, host name, /tmp and /dev/shm; the
kernel runs in this machine's own namespace and reaches them over a bridge. The clusters are
started as an operations team would: `ipcontroller` on the head host's bridge address and
`ipengine`s on the worker hosts; `dask scheduler` and `dask worker`s with mutual TLS.
"""

import re
import threading
import time
import uuid
from pathlib import Path

import pytest

import hosts
from conftest import CLUSTER_ENGINES, README_DATA, README_LOOP, SAME_WEIGHTS, SETUP, skip_module_unless, wait_gone
from kernel import Kernel

pytestmark = pytest.mark.cluster
available = skip_module_unless(hosts.unavailable_reason)

PER_HOST = 2

NOTEBOOK = "import os, socket" + README_DATA

# The README's loop, unchanged (automatic mode), plus what each rank saw of its host.
TRAIN = "%%distribute" + README_LOOP + """seen = dict(host=socket.gethostname(), local_rank=int(os.environ["LOCAL_RANK"]),
            local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]), master=os.environ["MASTER_ADDR"],
            gloo=os.environ["GLOO_SOCKET_IFNAME"], world_size=world_size)
"""


def _connect_line(engine: str, cluster) -> str:
    if engine == "ipyparallel":
        return f"%scale connect {cluster.client_file}"
    tls = cluster.tls
    return f"%scale connect {cluster.address} --tls-ca-file {tls['ca_file']} --tls-cert {tls['cert']} --tls-key {tls['key']}"


def _start_cluster(engine: str, net, directory: Path):
    head, workers = net[0], list(net)[1:]
    start = hosts.start_ipcluster if engine == "ipyparallel" else hosts.start_dask_cluster
    return start(head, workers, PER_HOST, str(directory))


class Multihost:
    """Three hosts (a head with the controller or scheduler, two with two workers each), a
    cluster across them, and a kernel attached to it."""

    def __init__(self, engine: str):
        self.engine = engine
        self.net = hosts.Hosts(3)
        self.directory = Path(self.net.directory)  # seen by every host, like a shared home
        self.cluster = self.kernel = None
        try:
            self.kernel = Kernel(backend=engine)
            self.kernel.ok(SETUP)
            self.fresh_cluster()
        except BaseException:
            self.close()
            raise

    @property
    def worker_hosts(self):
        return list(self.net)[1:]

    def fresh_cluster(self) -> None:
        """A new cluster across the hosts (the last one stopped), the kernel attached to it."""
        if self.cluster is not None:
            self.kernel.ok("%scale stop", timeout=60)
            self.cluster.stop()
        for host in self.net:
            host.link_up()
        self.cluster = _start_cluster(self.engine, self.net, self.directory / uuid.uuid4().hex[:8])
        self.connected = self.kernel.ok(_connect_line(self.engine, self.cluster), timeout=120)

    def close(self) -> None:
        try:
            if self.kernel is not None:
                self.kernel.cell("%scale stop", timeout=60)  # disconnects: the cluster is not the kernel's
                leftovers = self.kernel.descendants()
                self.kernel.shutdown()
                assert wait_gone(leftovers) == [], "the kernel left processes behind"
        finally:
            try:
                if self.cluster is not None:
                    self.cluster.stop()
            finally:
                self.net.close()
        assert not hosts.leftovers(self.net.owner), hosts.leftovers(self.net.owner)


@pytest.fixture(scope="module", params=CLUSTER_ENGINES)
def multihost(request):
    setup = Multihost(request.param)
    yield setup
    setup.close()


def test_a_group_of_two_hosts_trains_the_readmes_loop_like_one(multihost):
    k = multihost.kernel
    assert "span 2 hosts" in multihost.connected.stderr and "unencrypted" in multihost.connected.stderr
    k.ok(NOTEBOOK + "\njupyter_scale.get_session().heartbeat_interval = 0.2  # a few beats in a short cell")
    out = k.ok(TRAIN, timeout=300)
    assert "points did not reach" not in out.stderr, out.stderr
    # Each rank's states and heartbeats came from its host too.
    states = k.value("sorted((s['rank'], s['state'], s.get('host')) for s in jupyter_scale.get_session().runs[-1].states)")
    beats = k.value("sorted(jupyter_scale.get_session().beats)")
    k.ok("jupyter_scale.get_session().heartbeat_interval = 5.0")
    k.ok(SAME_WEIGHTS.format(n=4))
    # Each host has its own /dev/shm: values went through the engine.
    assert k.value("jupyter_scale.get_session().shared_memory") is False
    seen = k.value("jupyter_scale.get_session().gather('seen')")
    names = [h.name for h in multihost.worker_hosts]
    assert sorted(s["host"] for s in seen) == sorted(names * PER_HOST)
    ordered = [s["host"] for s in seen]  # each host's ranks together, as torchrun numbers them
    assert ordered[0] == ordered[1] != ordered[2] == ordered[3], ordered
    for host in names:  # torchrun's per-host numbering
        mine = [s for s in seen if s["host"] == host]
        assert sorted(s["local_rank"] for s in mine) == [0, 1] and {s["local_world_size"] for s in mine} == {2}
    rank0 = next(h for h in multihost.worker_hosts if h.name == seen[0]["host"])
    assert {s["master"] for s in seen} == {rank0.address}  # an address, not a host name that resolves nowhere
    assert {s["gloo"] for s in seen} == {"eth0"}  # each host's interface toward it (its only link)
    assert {s["world_size"] for s in seen} == {4}
    assert [(r, st) for r, st, _ in states] == [(r, st) for r in range(4) for st in ("finished", "running")], states
    assert {(r, h) for r, st, h in states if st == "running"} == {(r, s["host"]) for r, s in enumerate(seen)}, states
    assert beats == [0, 1, 2, 3], beats
    # Every point of every rank reached the kernel: 2 epochs of 1024 / (4 x 32) steps each.
    counts = k.value("dict(__import__('collections').Counter(p['rank'] for p in jupyter_scale.history()))")
    assert counts == {r: 16 for r in range(4)}, counts
    assert k.value("jupyter_scale.get_session().runs[-1].lost_events") == 0
    # The status and the sidebar name each rank's host.
    status = k.ok("%scale status").stdout
    for rank, s in enumerate(seen):
        assert re.search(rf"rank {rank}: pid \d+ on {s['host']}\b", status), status
    _, answer = k.comm_open("jupyter_scale")
    state = [c["data"] for c in answer.comms if (c.get("data") or {}).get("type") == "state"][-1]
    assert [(r["rank"], r["host"]) for r in state["ranks"]] == [(r, s["host"]) for r, s in enumerate(seen)]


def test_a_100_mb_model_ships_once_and_comes_back_through_the_engine(multihost):
    k = multihost.kernel
    k.ok("big = nn.Linear(5000, 5000)  # 100 MB of parameters\nbig_before = big.weight.detach().clone()")
    k.ok("%%distribute\nbig.weight.data += rank + 1  # each rank its own change; rank 0's comes back", timeout=300)
    k.ok("""
record = jupyter_scale.get_session().runs[-1]
assert record.shipped.get("big", 0) >= 100e6, record.shipped
assert "big" in record.pulled, record.pulled
assert torch.equal(big.weight, big_before + 1)  # rank 0's
""")
    k.ok("%%distribute\nn = sum(p.numel() for p in big.parameters())", timeout=300)
    k.ok("""
record = jupyter_scale.get_session().runs[-1]
assert "big" not in record.shipped and record.bytes_shipped < 1e6, record.shipped  # unchanged: not sent again
""")
    k.ok("del big, big_before")


def test_a_rank_on_another_host_is_debugged_from_the_notebook(multihost):
    """Its debugger's answers come through the group's store on rank 0's host (a TCPStore)."""
    k = multihost.kernel
    rank3_host = k.value("jupyter_scale.get_session().workers[3]['hostname']")
    typed = ["p socket.gethostname()", "c"]
    out = k.cell("%%distribute\nimport socket, torch\nimport torch.distributed as dist\nif rank == 3:\n"
                 "    breakpoint()\nt = torch.ones(1)\ndist.all_reduce(t)\n", stdin=lambda prompt: typed.pop(0),
                 timeout=120)
    assert out.ok, out.error_text
    assert out.prompts == ["[rank 3] (Pdb) "] * 2 and f"[rank 3] '{rank3_host}'" in out.stdout
    out = k.cell("%%distribute\nif rank == 2:\n    where = socket.gethostname()\n    raise RuntimeError(where)\n",
                 timeout=120)
    assert "rank 2 failed: RuntimeError" in out.error_text
    typed[:] = ["p where", "c"]
    out = k.cell("%scale debug", stdin=lambda prompt: typed.pop(0), timeout=120)
    assert out.ok and out.prompts == ["[rank 2] (Pdb) "] * 2, out.error_text
    rank2_host = k.value("jupyter_scale.get_session().workers[2]['hostname']")
    assert f"[rank 2] '{rank2_host}'" in out.stdout


def test_the_ranks_meet_where_the_user_says_or_connecting_says_why_not(multihost):
    k = multihost.kernel
    line = _connect_line(multihost.engine, multihost.cluster)
    k.ok("%scale stop")
    out = k.cell(f"{line} --rendezvous 10.77.0.0/16")  # a network rank 0's host is not on
    assert not out.ok and out.error["ename"] == "ClusterError", out.error_text
    assert re.search(r"rendezvous network 10.77.0.0/16: rank 0 \(host jsh\d\) has 198\.51\.100\.1\d, none in it",
                     out.error["evalue"]), out.error["evalue"]
    assert k.value("isinstance(model, nn.Module) and not jupyter_scale.get_session().running")
    k.ok(f"{line} --rendezvous 198.51.100.0/24")
    k.ok("%%distribute\nmet_at = os.environ['MASTER_ADDR']")
    met = k.value("jupyter_scale.get_session().gather('met_at')")
    rank0 = k.value("jupyter_scale.get_session().workers[0]['hostname']")
    assert set(met) == {next(h.address for h in multihost.worker_hosts if h.name == rank0)}
    k.ok('%config ScaleSession.rendezvous_address = ""')  # back to the default, as %config sets it
    assert k.value("jupyter_scale.get_session().rendezvous_address") == ""


FAULT_CELL = """%%distribute
import pathlib, time
pathlib.Path(f"{marks}.{rank}").touch()
t = torch.zeros(1)
for i in range(100000):  # a training loop: a collective every step
    dist.all_reduce(t)
    time.sleep(0.01)
"""


def _fault(setup, harm) -> tuple[object, float]:
    """Run FAULT_CELL; once every rank runs it, `harm()`; the cell's result and how long
    after the harm it ended."""
    k = setup.kernel
    marks = str(setup.directory / uuid.uuid4().hex)
    k.ok(f"marks = {marks!r}")
    results = []
    cell = threading.Thread(target=lambda: results.append(k.cell(FAULT_CELL, timeout=180)))
    cell.start()
    try:
        deadline = time.monotonic() + 120
        while not all(Path(f"{marks}.{r}").exists() for r in range(4)):
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        time.sleep(1)
        harmed = time.monotonic()
        harm()
    finally:
        cell.join(timeout=200)
    assert results, "the cell never ended"
    return results[0], time.monotonic() - harmed


@pytest.mark.parametrize("fault", ["workers killed", "link down"])
def test_a_host_lost_mid_training_fails_the_cell_naming_its_ranks_and_host(multihost, fault):
    setup = multihost
    setup.fresh_cluster()
    k = setup.kernel
    k.ok(NOTEBOOK)
    k.ok("%%distribute\nwhere = socket.gethostname()")
    where = k.value("jupyter_scale.get_session().gather('where')")
    # Link down: rank 0's host (where the group's store is: the hard case); killed: the other one.
    victim = next(h for h in setup.worker_hosts if (h.name == where[0]) == (fault == "link down"))
    ranks = [r for r, h in enumerate(where) if h == victim.name]
    harm = victim.link_down if fault == "link down" else lambda: victim.stop_processes(timeout=0)  # SIGKILL
    try:
        out, took = _fault(setup, harm)
    finally:
        victim.link_up()
    assert not out.ok
    said = out.error_text
    print(f"{setup.engine}, {fault}: the cell failed {took:.1f} s after the fault: {out.error['evalue']}")
    assert f"rank {ranks[0]}" in said and victim.name in said, said
    assert "WorkerDied" in said, said
    # The notebook keeps its objects; the next cell runs on the workers that remain (or are back).
    assert k.value("isinstance(model, nn.Module) and len(data) == 1024")
    k.ok(TRAIN, timeout=300)
    k.ok("""
ws = jupyter_scale.get_session().gather("weights")
local = torch.cat([p.detach().flatten() for p in model.parameters()])
assert len(ws) in (2, 4) and all(torch.equal(w, local) for w in ws)
""")
