"""The test hosts of tests/hosts.py behave like separate machines on a private network, clusters
start in them as an operations team would start them, and nothing is left behind."""
import contextlib
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import hosts
from conftest import skip_module_unless
from hosts import KERNEL_ADDRESS, Hosts

pytestmark = pytest.mark.cluster

available = skip_module_unless(hosts.unavailable_reason)

PORT = 7000

# Serves its host name to every connection on (address, PORT), forever.
SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    c, _ = s.accept()
    c.sendall(socket.gethostname().encode())
    c.close()
"""

# Connects to (address, PORT) once, within a timeout; prints "ok <reply>" or "error <errno name>".
CLIENT = """
import errno, socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
        print("ok", c.recv(100).decode())
except TimeoutError:
    print("error timeout")
except OSError as e:
    print("error", errno.errorcode.get(e.errno, e))
"""


# What a process sees of /proc: its own pid (getpid and /proc/self), every pid there with the name
# of its program, and the first bytes of each file named in argv (None: cannot be opened).
PROBE = """
import json, os, sys
def name(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.path.basename(f.read().split(b"\\0")[0].decode())
    except OSError:
        return None
def read(path):
    try:
        with open(path, "rb") as f:
            return f.read(100).decode(errors="replace")
    except OSError:
        return None
print(json.dumps({"pid": os.getpid(), "self": int(os.readlink("/proc/self")),
                  "procs": {p: name(p) for p in os.listdir("/proc") if p.isdigit()},
                  "read": {path: read(path) for path in sys.argv[1:]}}))
"""


def probe(host, *paths) -> dict:
    """PROBE's findings in `host` (a Host, or None for this namespace); "procs" by int pid."""
    argv = [sys.executable, "-c", PROBE, *paths]
    r = host.run(argv) if host else subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    found["procs"] = {int(pid): name for pid, name in found["procs"].items()}
    return found


def _nspid(pid: int) -> list[int]:
    """A process's pid in each PID namespace it is in, this one's first (NSpid in its status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return [int(n) for n in re.search(r"^NSpid:\s*(.*)$", status, re.M)[1].split()]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _netns() -> list[str]:
    """The network namespaces `ip` lists (not what hosts.py believes)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    """The root namespace's links as `ip` lists them."""
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True).stdout
    return [link["ifname"] for link in json.loads(out)]


def _unshares(owner: str) -> list[psutil.Process]:
    """The unshares (one per host: each host's init is its child) of `owner`'s hosts that run."""
    state = f"{hosts._STATE}{owner}/"
    return [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0] == "unshare"
            and any(state in a for a in p.info["cmdline"]) and _running(p)]


def _assert_gone(h: Hosts, procs: list[psutil.Process]) -> None:
    procs = [*procs, *_unshares(h.owner)]
    still = [p for p in procs if _running(p)]
    for p in still:  # clean up by pid before failing
        p.kill()
    assert not still, f"processes survived: {still}"
    assert not {host.netns for host in h} & set(_netns())
    assert not {h.bridge, *(host.link for host in h)} & set(_links())
    assert hosts.leftovers(h.owner) == []
    assert not os.path.exists(h.directory)


@contextlib.contextmanager
def _hosts(n: int):
    """Hosts(n); afterwards no process that ran in them, nor any namespace, link or directory."""
    h = Hosts(n)
    procs = []
    try:
        yield h
    finally:
        procs = [p for host in h for p in [*host.processes(), host.init] if p]
        h.close()
    _assert_gone(h, procs)


@pytest.fixture
def two():
    with _hosts(2) as h:
        yield h


@pytest.fixture
def three():
    with _hosts(3) as h:
        yield h


def connect(host, address, timeout=2.0):
    """From `host` (a Host, or None for this namespace): "ok <name served>" or "error <errno name>"."""
    if host is None:
        argv = [sys.executable, "-c", CLIENT, address, str(PORT), str(timeout)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 10).stdout.strip()
    r = host.run([sys.executable, "-c", CLIENT, address, str(PORT), str(timeout)], timeout=timeout + 10)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def serve(host):
    """A server in `host` on its address; returns once it answers there."""
    host.popen([sys.executable, "-c", SERVER, host.address, str(PORT)])
    deadline = time.monotonic() + 10
    while (reply := connect(None, host.address, 1)) != f"ok {host.name}":
        assert time.monotonic() < deadline, f"server in {host.name} did not answer: {reply}"
        time.sleep(0.1)


def test_each_host_is_a_machine_of_its_own(two):
    h0, h1 = two
    for host in two:
        assert host.run(["hostname"]).stdout.strip() == host.name != socket.gethostname()
        links = json.loads(host.run(["ip", "-j", "addr", "show"]).stdout)
        addresses = {link["ifname"]: [a["local"] for a in link["addr_info"] if a["family"] == "inet"]
                     for link in links}
        assert addresses == {"lo": ["127.0.0.1"], "eth0": [host.address]}
        routes = json.loads(host.run(["ip", "-j", "route", "show"]).stdout)
        assert [r["dst"] for r in routes] == [f"{hosts.SUBNET}.0/24"], routes  # no default route
        # the usual tools work on its network namespace too
        r = subprocess.run(["ip", "netns", "exec", host.netns, "ip", "-o", "-4", "addr", "show", "eth0"],
                           capture_output=True, text=True, timeout=10)
        assert f"{host.address}/24" in r.stdout, r
    # /tmp and /dev/shm: shared by the programs of one host, private to it
    mark = f"jscale-mark-{two.owner}"
    r = h0.run(["sh", "-c", f"echo {h0.name} > /tmp/{mark} && echo {h0.name} > /dev/shm/{mark}"])
    assert r.returncode == 0, r.stderr
    assert h0.run(["cat", f"/tmp/{mark}", f"/dev/shm/{mark}"]).stdout.split() == [h0.name] * 2
    r = h1.run(["ls", "-A", "/tmp", "/dev/shm"])
    assert mark not in r.stdout and r.returncode == 0, r
    assert not os.path.exists(f"/tmp/{mark}") and not os.path.exists(f"/dev/shm/{mark}")


def test_each_host_sees_its_own_processes_only(two):
    h0, h1 = two
    sleep = h0.popen(["sleep", "600"])
    here, inside = _nspid(sleep.pid)  # its pid here and in h0
    assert here == sleep.pid != inside
    # A file that only a process of this namespace hands out: an fd (here, a memfd that a worker
    # would open through /proc/<pid>/fd/<n> to share memory), and the token in it.
    token = f"jscale-token-{os.urandom(8).hex()}"
    fd = os.memfd_create("jscale-test")
    try:
        os.write(fd, token.encode())
        ours = f"/proc/{os.getpid()}/fd/{fd}"
        theirs = f"/proc/{inside}/fd/0"  # the sleep's stdin (/dev/null), by its pid in h0
        # Here, any process of ours opens the memfd through /proc.
        assert probe(None, ours)["read"][ours] == token
        # In h0: its init, the sleep and the probe, by their pids there, nothing else; its
        # own processes' files are there for it, not ours.
        seen = probe(h0, ours, theirs)
        assert seen["pid"] == seen["self"] != 1
        assert set(seen["procs"]) == {1, inside, seen["pid"]}, seen["procs"]
        assert seen["procs"][inside] == "sleep" and seen["procs"][1] == os.path.basename(sys.executable)
        assert seen["read"][theirs] == "" and seen["read"][ours] != token
        # In h1: only its init and the probe; neither this process nor h0's sleep, by either pid.
        seen = probe(h1, ours, f"/proc/{sleep.pid}/cmdline")
        assert set(seen["procs"]) == {1, seen["pid"]} and "sleep" not in seen["procs"].values(), seen
        assert seen["read"][ours] != token
        assert not (seen["read"][f"/proc/{sleep.pid}/cmdline"] or "").startswith("sleep")
    finally:
        os.close(fd)


def test_a_popen_is_the_program_and_ends_as_it_does(two):
    h0, h1 = two
    p = h0.popen(["sleep", "600"])
    deadline = time.monotonic() + 10
    while psutil.Process(p.pid).name() != "sleep":  # nsenter, until it has entered the host: then it execs
        assert time.monotonic() < deadline, psutil.Process(p.pid)
        time.sleep(0.01)
    assert not psutil.Process(p.pid).children()  # no nsenter in between
    p.terminate()  # a signal to the Popen is a signal to the program
    assert p.wait(timeout=10) == -signal.SIGTERM
    assert h0.run(["sh", "-c", "exit 7"]).returncode == 7
    assert h0.run(["sh", "-c", "kill -KILL $$"]).returncode == -signal.SIGKILL
    assert h0.run(["cat"], input="in").stdout == "in"
    t = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        h0.run(["sleep", "600"], timeout=0.5)
    assert time.monotonic() - t < 5 and not h0.processes()  # killed, not left running
    # command(), for those who start it themselves: nsenter forks into the PID namespace and waits,
    # so its exit status, or the signal that killed it, is the program's.
    def own(argv):
        return subprocess.run(h0.command(argv), capture_output=True, text=True, timeout=30)
    assert own(["sh", "-c", "exit 7"]).returncode == 7
    assert own(["sh", "-c", "kill -TERM $$"]).returncode == -signal.SIGTERM
    r = own(["sh", "-c", "hostname; echo $$; ls /proc"])
    name, pid, *listing = r.stdout.split()
    assert name == h0.name and int(pid) < 1000 and "1" in listing and str(os.getpid()) not in listing, r
    # A host whose init ends is down: the kernel kills all its processes, and nothing starts there.
    sleep = h1.popen(["sleep", "600"])
    sh = h1.popen(["sh", "-c", "(sleep 600 &); sleep 600"])
    deadline = time.monotonic() + 10
    while len(h1.processes()) < 4:
        assert time.monotonic() < deadline, h1.processes()
        time.sleep(0.05)
    procs = h1.processes()
    h1.init.kill()
    assert sleep.wait(timeout=10) == sh.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while [p for p in procs if _running(p)] or _running(h1.init):
        assert time.monotonic() < deadline, procs
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="is down"):
        h1.popen(["true"])


def test_hosts_reach_each_other_and_nothing_else(two):
    h0, h1 = two
    serve(h0)
    assert connect(h1, h0.address) == f"ok {h0.name}", hosts.netfilter_note()
    assert connect(None, h0.address) == f"ok {h0.name}"
    # and the hosts reach this (root) namespace at KERNEL_ADDRESS
    with socket.create_server((KERNEL_ADDRESS, PORT)) as server:
        server.settimeout(10)
        answer = threading.Thread(target=lambda: server.accept()[0].sendall(b"root"), daemon=True)
        answer.start()
        assert connect(h1, KERNEL_ADDRESS) == "ok root"
        answer.join()
    # Outside the subnet there is no route: refused at once, not after a timeout.
    t = time.monotonic()
    assert connect(h1, "203.0.113.1") == "error ENETUNREACH"  # another documentation range
    assert time.monotonic() - t < 1.5


def test_link_down_takes_a_host_off_the_network(two):
    h0, h1 = two
    serve(h0)
    server = h0.processes()
    h0.link_down()
    try:
        # on a local bridge a connect takes well under a millisecond: half a second is plenty
        assert connect(h1, h0.address, timeout=0.5).startswith("error")
        assert connect(None, h0.address, timeout=0.5).startswith("error")
        assert server and all(_running(p) for p in server)  # the host itself still runs
    finally:
        h0.link_up()
    deadline = time.monotonic() + 10
    while (reply := connect(h1, h0.address, timeout=1)) != f"ok {h0.name}":
        assert time.monotonic() < deadline, reply
    assert connect(None, h0.address) == f"ok {h0.name}"


def test_close_stops_everything_and_removes_everything():
    h = Hosts(2)
    try:
        # a process, one with a child, and an orphan (whose parent has gone): all of them must stop
        sleep = h[0].popen(["sleep", "600"])
        h[1].popen(["sh", "-c", "sleep 600 & (sleep 600 &); exec sleep 601"])
        # until the shell has exec'd and its subshell has gone: before that, the count passes 3 on the way
        deadline = time.monotonic() + 10
        while (names := _names(h[1].processes())) != ["sleep"] * 3:
            assert time.monotonic() < deadline, names
            time.sleep(0.05)
        procs = [p for host in h for p in host.processes()]
        assert len(procs) == 4
        assert psutil.Process(sleep.pid).name() == "sleep"  # the pid popen() gives is the program's own
        assert h[1].init.pid in {p.ppid() for p in procs}  # the orphan: the host's init adopted it
        procs += [host.init for host in h]
    except BaseException:
        h.close()  # a failed assertion must not leave the bridge to the tests after this one
        raise
    h.close()
    h.close()  # idempotent
    _assert_gone(h, procs)


def _names(procs: list[psutil.Process]) -> list[str]:
    names = []
    for p in procs:
        try:
            names.append(p.name())
        except psutil.Error:  # gone between the listing and now
            pass
    return names


def test_a_crashed_runs_leftovers_are_removed():
    code = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).parent)!r}); import hosts;"
            "h = hosts.Hosts(2, wait=60); h[1].popen(['sleep', '600']); print(h.owner, flush=True); time.sleep(600)")
    crashed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        owner = crashed.stdout.readline().strip()  # within 60 s: it waits that long for other hosts at most
        assert owner, "the child made no hosts"
        netns = sorted(n for n in _netns() if n.startswith(f"jscale-{owner}-"))
        assert len(netns) == 2, _netns()
        deadline = time.monotonic() + 10
        while len(orphan := hosts._pids_in_netns(netns[1])) < 2:  # the host's init, and the sleep
            assert time.monotonic() < deadline, orphan
            time.sleep(0.05)
        orphan = [psutil.Process(pid) for pid in orphan]
        unshares = _unshares(owner)
    finally:
        crashed.send_signal(signal.SIGKILL)  # no close(), no atexit
        crashed.wait()
    assert len(unshares) == 2  # one per host
    orphan += unshares
    assert hosts.leftovers(owner) and all(_running(p) for p in orphan)
    with _hosts(1):  # it cleans up before it starts
        assert hosts.leftovers(owner) == []
        assert not any(_running(p) for p in orphan) and not _unshares(owner)
        assert not [n for n in _netns() if n.startswith(f"jscale-{owner}-")]


def test_only_one_set_of_hosts_at_a_time(two):
    with pytest.raises(RuntimeError, match="this process still has open"):
        Hosts(1)
    # and the failed attempt removed nothing of the open set, whose names are the same
    made = [f"link {two.bridge}", *(f"netns {h.netns}" for h in two), *(f"link {h.link}" for h in two)]
    assert set(made) <= set(two.left_behind())
    serve(two[0])


def test_ipcluster(three):
    import ipyparallel
    head, *workers = three
    cluster = hosts.start_ipcluster(head, workers, per_host=2, directory=f"{three.directory}/ipp")
    try:
        info = json.loads(Path(cluster.client_file).read_text())
        assert info["curve_serverkey"] and info["interface"] == f"tcp://{head.address}"
        assert [len(cluster.engines_of(w)) for w in workers] == [2, 2]
        client = ipyparallel.Client(cluster.client_file)
        try:
            assert len(client.ids) == 4
            names = client[:].apply_sync(socket.gethostname)
            assert sorted(names) == sorted([w.name for w in workers] * 2)
        finally:
            client.close()
    finally:
        procs = [p for host in three for p in host.processes()]
        cluster.stop()
    assert procs and not [p for p in procs if _running(p)]
    assert not [p for host in three for p in host.processes()]


def test_dask_cluster(three):
    import distributed
    head, *workers = three
    cluster = hosts.start_dask_cluster(head, workers, per_host=2, directory=f"{three.directory}/dask")
    try:
        assert cluster.address.startswith(f"tls://{head.address}:")
        for f in cluster.tls.values():
            assert os.stat(f).st_mode & 0o777 == 0o600
        assert len(cluster.workers_of(workers[0])) == 1
        client = distributed.Client(cluster.address, security=cluster.security())
        try:
            names = client.run(socket.gethostname)
            assert len(names) == 4
            by_address = {w.address: w.name for w in workers}
            for address, name in names.items():  # each worker listens on its own host's address
                assert address.startswith("tls://")
                assert by_address[address[len("tls://"):].rsplit(":", 1)[0]] == name
        finally:
            client.close()
        # mutual TLS: a client without a certificate is turned away
        context = ssl.create_default_context(cafile=cluster.tls["ca_file"])
        context.check_hostname = False
        host, port = cluster.address[len("tls://"):].rsplit(":", 1)
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with context.wrap_socket(socket.create_connection((host, int(port)), timeout=5)) as s:
                s.recv(1)  # TLS 1.3: the server's refusal arrives after the handshake
    finally:
        procs = [p for host in three for p in host.processes()]
        cluster.stop()
    assert len(procs) >= 1 + 2 * (1 + 2)  # the scheduler; per host the command and 2 workers
    assert not [p for p in procs if _running(p)]
    assert not [p for host in three for p in host.processes()]
