"""Several "hosts" on this one machine, for multi-host tests and benchmarks, and clusters started in
them the way an operations team would start them.

A Host is a Linux network namespace with a single link (a veth pair) to a bridge in the root
namespace, plus a host name (UTS namespace), System V IPC, a PID namespace (with an init process
of its own, pid 1 there) and a mount namespace of its own with a private /tmp and /dev/shm and its
own /proc, which shows only the host's processes, by their pids in the host. Every program started
in a host joins these same namespaces, so the programs of one host share its /tmp and shared
memory as on a real machine, while programs in different hosts can only talk over the network
(one cannot, say, open another's files through /proc/<pid>/fd: its pids do not exist there).
The hosts have no default route: they reach each other and the root namespace (KERNEL_ADDRESS,
where the test's Jupyter kernel runs) on SUBNET.0/24, and nothing else. Their host names resolve
nowhere, as is common on clusters, so nothing may depend on resolving them: a library that finds
its own address through its host name falls back to 127.0.0.1 (torch's gloo does, and then cannot
connect across hosts) unless told the interface, which is eth0 in every host
(GLOO_SOCKET_IFNAME=eth0). The rest of the file system (the repository, the virtual environment,
the shared `Hosts.directory`) is common to all, like a network file system on a cluster.

Needs root, `ip` (iproute2), and `unshare`, `nsenter`, `mount`, `umount` (util-linux);
`unavailable_reason()` says why it cannot work here, or None.

Bridged traffic between the hosts passes the root namespace's iptables FORWARD chain when the
br_netfilter module is loaded (net.bridge.bridge-nf-call-iptables = 1). Without filter rules, as in
our test environment, that changes nothing, so we leave the firewall alone; `netfilter_note()`
says what to look at when a firewall drops the hosts' traffic.

Everything is named after the creating process (pid and start time), so that a crashed run's
leftovers are recognised and removed by the next run, and a live run's are never touched.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import errno
import functools
import ipaddress
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import psutil

SUBNET = "198.51.100"  # documentation range (RFC 5737): no test ever addresses a real network
KERNEL_ADDRESS = f"{SUBNET}.1"  # this (root) namespace's address on the bridge
FIRST_HOST = 10  # host i is SUBNET.(FIRST_HOST + i)
NETWORK = ipaddress.ip_network(f"{SUBNET}.0/24")

_ALIAS = "jupyter_scale-tests"  # interface alias marking our links: f"{_ALIAS} {owner}"
_NETNS = "jscale-"  # network namespace names: f"jscale-{owner}-{host name}"
_STATE = "/run/jscale-"  # f"/run/jscale-{owner}/": the files keeping each host's other namespaces
_SHARED = Path("/var/tmp")  # f"jscale-{owner}-*" directories common to all hosts (not /tmp: that is private)
_OWNER = re.compile(r"(\d+)\.(\d+)")

_open: weakref.WeakSet[Hosts] = weakref.WeakSet()

# pid 1 of a host's PID namespace, started by `Host._create` once /proc and the rest are mounted.
# It adopts the host's orphans and reaps them; when it ends (SIGTERM, or SIGKILL from outside),
# the kernel kills every other process of the host. The signals it waits for stay blocked, so
# none can slip in between reaping and waiting.
_INIT = """
import os, signal, sys
signals = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
signal.pthread_sigmask(signal.SIG_BLOCK, signals)
null = os.open(os.devnull, os.O_RDWR)
os.write(1, b"ready\\n")
for fd in (0, 1, 2):
    os.dup2(null, fd)
while True:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    if signal.sigwait(signals) != signal.SIGCHLD:
        sys.exit(0)
"""
_CLONE_NEWPID = 0x20000000


# ---------------------------------------------------------------------------------------------
# helpers


def _owner(pid: int | None = None) -> str:
    """'pid.start time' of a process: unlike a pid alone, never the same for two processes."""
    p = psutil.Process(pid)
    return f"{p.pid}.{int(p.create_time())}"


def _owner_alive(owner: str) -> bool:
    m = _OWNER.fullmatch(owner)
    try:
        return bool(m) and _owner(int(m[1])) == owner
    except psutil.Error:
        return False


def _run(argv: list[str], check: bool = True, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and r.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {(r.stderr or r.stdout).strip()}")
    return r


def _ip(*args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check, **kwargs)


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    s = ""
    while True:
        n, d = divmod(n, 36)
        s = digits[d] + s
        if not n:
            return s


def _is_namespace(st: os.stat_result) -> bool:
    return st.st_dev == os.stat("/proc/self/ns/pid").st_dev  # on nsfs, as every namespace file


def _pids_in(namespaces: list[tuple[str, str]]) -> list[int]:
    """Every process (its pid here) in any of these namespaces, each given as (kind as in
    /proc/PID/ns/KIND, a file that is that namespace: a bind mount of it), orphans included."""
    wanted = set()
    for kind, path in namespaces:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if _is_namespace(st):  # not the empty file under a bind mount that is not (or no longer) there
            wanted.add((kind, st.st_ino, st.st_dev))
    kinds = sorted({kind for kind, _, _ in wanted})
    pids = []
    for pid in psutil.pids() if wanted else []:
        for kind in kinds:
            try:
                st = os.stat(f"/proc/{pid}/ns/{kind}")
            except OSError:
                continue
            if (kind, st.st_ino, st.st_dev) in wanted:
                pids.append(pid)
                break
    return pids


def _pids_in_netns(netns: str) -> list[int]:
    """Every process in a named network namespace (what `ip netns pids` prints), orphans included."""
    return _pids_in([("net", f"/run/netns/{netns}")])


def _setns(fd: int, nstype: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12
        os.setns(fd, nstype)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


@contextlib.contextmanager
def _pid_namespace(path: str):
    """Meanwhile, the processes that this thread starts (and only those: the setting is the
    thread's) begin in the PID namespace `path`, as the children of a process that entered it
    with setns(2) do; this thread itself stays where it is. A PID namespace cannot be entered
    otherwise: nsenter --pid, too, must fork, and then a program started through it has nsenter
    in between, which waits for it but does not pass signals on. Nothing may start a thread in
    between (the kernel refuses a thread in another PID namespace than its process's)."""
    own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)  # the active one: always allowed back
    try:
        target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target, _CLONE_NEWPID)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own, _CLONE_NEWPID)
    finally:
        os.close(own)


def _running(p: psutil.Process) -> bool:
    # A zombie has finished: it only waits for a parent (possibly pid 1) to collect its status.
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _tree(popens: list[subprocess.Popen]) -> list[psutil.Process]:
    """The processes of these Popens and all their descendants that still run."""
    procs = {}
    for popen in popens:
        if popen.poll() is not None:
            continue
        try:
            p = psutil.Process(popen.pid)
            for q in [p, *p.children(recursive=True)]:
                procs[q.pid] = q
        except psutil.Error:
            pass
    return [p for p in procs.values() if _running(p)]


def _terminate(procs: list[psutil.Process], popens: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM, then SIGKILL what is left after `timeout` seconds, all by pid."""
    for sig, wait in (("terminate", timeout), ("kill", 5)):
        for p in procs:
            try:
                getattr(p, sig)()
            except psutil.Error:
                pass
        deadline = time.monotonic() + wait
        while True:
            for popen in popens:
                popen.poll()  # collect our own children's exit status, or they stay zombies
            procs = [p for p in procs if _running(p)]
            if not procs or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not procs:
            return


def _stop(popens: list[subprocess.Popen], timeout: float = 10) -> list[psutil.Process]:
    """Stop these processes and their descendants; returns what could not be stopped."""
    for _ in range(3):  # a program may start children while it is being stopped
        procs = _tree(popens)
        if not procs:
            break
        _terminate(procs, popens, timeout)
    return _tree(popens)


def _tail(path: str | Path, lines: int = 25) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        return f"({e})"
    return "\n".join(text)


def netfilter_note() -> str:
    """What to check when the hosts cannot reach each other over the bridge."""
    try:
        on = Path("/proc/sys/net/bridge/bridge-nf-call-iptables").read_text().strip() == "1"
    except OSError:
        on = False
    if not on:
        return "br_netfilter does not filter bridged traffic here (bridge-nf-call-iptables is off or absent)"
    return ("br_netfilter passes bridged traffic between the hosts through iptables' FORWARD chain "
            "(net.bridge.bridge-nf-call-iptables = 1): if a firewall drops it, accept traffic on "
            f"{SUBNET}.0/24 or set that sysctl to 0")


# ---------------------------------------------------------------------------------------------
# leftovers of earlier runs


def _our_links() -> list[tuple[str, str]]:
    """(interface name, owner) for every link of ours in the root namespace."""
    links = json.loads(_ip("-j", "link", "show").stdout or "[]")
    return [(link["ifname"], link["ifalias"].split()[1]) for link in links
            if link.get("ifalias", "").startswith(_ALIAS + " ")]


def _our_netns() -> list[tuple[str, str]]:
    try:
        names = os.listdir("/run/netns")
    except OSError:
        return []
    return [(n, m[1]) for n in names if (m := re.match(rf"{_NETNS}(\d+\.\d+)-", n))]


def _our_state_dirs() -> list[tuple[str, str]]:
    d, prefix = os.path.split(_STATE)
    return [(os.path.join(d, n), n[len(prefix):]) for n in os.listdir(d)
            if n.startswith(prefix) and _OWNER.fullmatch(n[len(prefix):])]


def _our_shared_dirs() -> list[tuple[str, str]]:
    return [(str(p), m[1]) for p in _SHARED.glob(f"{_NETNS}*")
            if (m := re.match(rf"{_NETNS}(\d+\.\d+)-", p.name))]


def _release_state_dir(path: str) -> None:
    """Unmount the namespace files in a state directory (which frees those namespaces) and remove it."""
    if not os.path.isdir(path):
        return
    for name in os.listdir(path):
        _run(["umount", os.path.join(path, name)], check=False)
    _run(["umount", path], check=False)  # our private bind mount of the directory on itself
    shutil.rmtree(path, ignore_errors=True)


def leftovers(owner: str | None = None) -> list[str]:
    """What of ours exists on this machine: everyone's, or only that of one owner (`Hosts.owner`)."""
    found = [f"{kind} {name}"
             for kind, items in (("netns", _our_netns()), ("link", _our_links()),
                                 ("state", _our_state_dirs()), ("directory", _our_shared_dirs()))
             for name, o in items if owner is None or o == owner]
    return found


def remove_leftovers(timeout: float = 10) -> list[str]:
    """Remove what runs that are no longer alive left behind (processes first: they keep namespaces
    alive; links before namespaces: deleting a namespace frees its links only eventually)."""
    removed = []
    dead_netns = [n for n, o in _our_netns() if not _owner_alive(o)]
    # Their processes: those in their hosts' network, PID or mount namespaces (the host's init
    # and the unshare waiting for it are in the mount namespace). Killing init alone would kill
    # the rest of its PID namespace, but not what left it (which only root can do).
    namespaces = [("net", f"/run/netns/{netns}") for netns in dead_netns]
    for path, o in _our_state_dirs():
        if not _owner_alive(o) and os.path.isdir(path):
            namespaces += [(kind, os.path.join(path, name)) for name in os.listdir(path)
                           if (kind := name.rpartition(".")[2]) in ("pid", "mnt")]
    killed = []
    for pid in _pids_in(namespaces):
        try:
            p = psutil.Process(pid)
            p.kill()
            killed.append(p)
            removed.append(f"process {pid}")
        except psutil.Error:
            pass
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in killed) and time.monotonic() < deadline:  # zombies count as gone
        time.sleep(0.05)
    for link, o in _our_links():
        if not _owner_alive(o):
            _ip("link", "del", link, check=False)
            removed.append(f"link {link}")
    for netns in dead_netns:
        _ip("netns", "del", netns, check=False)
        removed.append(f"netns {netns}")
    for path, o in _our_state_dirs():
        if not _owner_alive(o):
            _release_state_dir(path)
            removed.append(f"state {path}")
    for path, o in _our_shared_dirs():
        if not _owner_alive(o):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(f"directory {path}")
    return removed


_LOCK = "/run/jscale.lock"  # held by the process whose set of hosts is open (one set per machine)


class HostsBusy(RuntimeError):
    """Another process's test hosts are open (they share the subnet)."""


def _take_lock(wait: float) -> int:
    """The machine-wide lock of test hosts: another process's set is waited for up to `wait`
    seconds (a benchmark and a test run take turns), then HostsBusy."""
    import fcntl

    fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    deadline, said = time.monotonic() + wait, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise HostsBusy(f"another process's test hosts stayed open for {wait:.0f} s") from None
            if not said:
                print("hosts.py: waiting for another process's test hosts to close", file=sys.stderr, flush=True)
                said = True
            time.sleep(0.5)


def _check_subnet_free() -> None:
    aliases = {link["ifname"]: link.get("ifalias", "") for link in json.loads(_ip("-j", "link", "show").stdout)}
    for link in json.loads(_ip("-j", "addr", "show").stdout):
        for a in link.get("addr_info", []):
            if a.get("family") != "inet" or ipaddress.ip_address(a["local"]) not in NETWORK:
                continue
            alias = aliases.get(link["ifname"], "")
            if alias.startswith(_ALIAS + " "):
                owner = alias.split()[1]
                who = "this process" if owner == _owner() else f"live process {owner.split('.')[0]}"
                raise RuntimeError(f"{a['local']} is on {link['ifname']}, the bridge of test hosts that "
                                   f"{who} still has open: close those first (only one set at a time)")
            raise RuntimeError(f"{a['local']} is configured on {link['ifname']}, which is not ours: the "
                               f"test hosts need {NETWORK} to themselves")


# ---------------------------------------------------------------------------------------------
# hosts


def _needed_under_tmp() -> list[str]:
    """What every host must see that lives under this machine's /tmp (relative to it): the
    repository and the Python environment, where a checkout was made there."""
    tmp = Path("/tmp")
    found: list[Path] = []
    for path in sorted({Path(__file__).resolve().parent.parent, Path(sys.prefix).resolve(),
                        Path(os.path.realpath(sys.executable)).parent}, key=lambda p: len(p.parts)):
        if tmp in path.parents and not any(f == path or f in path.parents for f in found):
            found.append(path)
    rels = [str(p.relative_to(tmp)) for p in found]
    if any(len(rel.split()) != 1 for rel in rels):
        raise RuntimeError(f"test hosts cannot share a path with white space in it: {rels}")
    return rels


class Host:
    """One "machine": a network namespace on the bridge with its own host name, IPC, processes
    (PID namespace), /proc, /tmp and /dev/shm."""

    def __init__(self, name: str, address: str, netns: str, link: str, state_dir: str):
        self.name = name  # its host name inside; resolves nowhere
        self.address = address
        self.netns = netns  # the `ip netns` name
        self.link = link  # the root-side end of its veth pair, a port of the bridge
        self._ns = {kind: f"{state_dir}/{name}.{kind}" for kind in ("uts", "ipc", "mnt", "pid")}
        self.popens: list[subprocess.Popen] = []  # everything started with popen()
        self.init: psutil.Process | None = None  # pid 1 of the host, as seen here
        self._init: subprocess.Popen | None = None  # the `unshare` whose child init is

    def __repr__(self):
        return f"<Host {self.name} {self.address}>"

    def _create(self, bridge: str, alias: str, timeout: float = 30) -> None:
        _ip("netns", "add", self.netns)
        # The inside end is created directly in the namespace: named eth0 there, as on a machine.
        _ip("link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        _ip("link", "set", self.link, "alias", alias)
        _ip("link", "set", self.link, "master", bridge, "up")
        _ip("-n", self.netns, "-batch", "-",
            input=f"addr add {self.address}/24 dev eth0\nlink set eth0 up\nlink set lo up\n")
        # The host's UTS, IPC, mount and PID namespaces are kept by bind mounts on files (as `ip
        # netns` keeps network namespaces), so that every program started later joins the same
        # ones. A PID namespace needs its pid 1 too, alive (once it ends, nothing can start
        # there): unshare forks it, and it stays. It mounts the host's /proc (a proc file system
        # shows the PID namespace of the process that mounts it), then becomes _INIT.
        for path in self._ns.values():
            Path(path).touch()
        # The host's /tmp is its own, except what this machine keeps there that every host
        # needs (a checkout and its virtual environment under /tmp, as CI may have): bound
        # back in from the old /tmp, held open as fd 3 while the new one is mounted over it.
        setup = ('hostname "$1" && exec 3</tmp && mount -t tmpfs -o mode=1777 tmpfs /tmp'
                 ' && for rel in $4; do mkdir -p "/tmp/$rel"'
                 ' && mount --no-canonicalize --bind "/proc/self/fd/3/$rel" "/tmp/$rel"'
                 ' || exit 1; done && exec 3<&-'
                 ' && mount -t tmpfs -o mode=1777 tmpfs /dev/shm'
                 ' && umount -l /sys && mount -t sysfs sysfs /sys'  # /sys/class/net of this host, as ip netns exec does
                 ' && umount -l /proc && mount -t proc proc /proc'
                 ' && exec "$2" -I -S -c "$3"')
        self._init = subprocess.Popen(
            ["unshare", f"--pid={self._ns['pid']}", f"--uts={self._ns['uts']}", f"--ipc={self._ns['ipc']}",
             f"--mount={self._ns['mnt']}", "--propagation=private",
             "--fork", "--kill-child",  # should unshare be killed, its child (init) is too
             "nsenter", f"--net=/run/netns/{self.netns}", "sh", "-c", setup, "sh", self.name,
             sys.executable, _INIT, " ".join(_needed_under_tmp())],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + timeout
        out = b""
        with self._init.stdout as pipe:
            while not out.endswith(b"ready\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([pipe], [], [], left)[0]:
                    raise RuntimeError(f"{self.name}'s init did not start within {timeout} s: "
                                       f"{out.decode(errors='replace').strip()}")
                if not (chunk := os.read(pipe.fileno(), 4096)):
                    raise RuntimeError(f"{self.name}'s init did not start: {out.decode(errors='replace').strip()}")
                out += chunk
        # unshare's other child makes the bind mounts meanwhile: wait for them as well
        while not all(_is_namespace(os.stat(path)) for path in self._ns.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: its namespaces were not kept in {self._ns} within {timeout} s")
            time.sleep(0.01)
        init = set(_pids_in([("pid", self._ns["pid"])])) & {p.pid for p in psutil.Process(self._init.pid).children()}
        if len(init) != 1:
            raise RuntimeError(f"{self.name}: no init among unshare's children")
        self.init = psutil.Process(init.pop())

    def _end_init(self, timeout: float = 10) -> None:
        """Kill init, and with it (the kernel does it) every process left in the host."""
        if self._init is None:
            return
        try:
            if self.init is not None:
                self.init.kill()
            else:
                self._init.kill()  # --kill-child: init too, if it already runs
        except (psutil.Error, OSError):
            pass
        # init is gone only once the host's other processes are, zombies included: those that
        # popen() started are our children, to collect here.
        deadline = time.monotonic() + timeout
        while self._init.poll() is None:
            for p in self.popens:
                p.poll()
            if time.monotonic() > deadline:
                self._init.kill()
                try:
                    self._init.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                break
            time.sleep(0.02)
        for p in self.popens:
            p.poll()

    def _destroy(self) -> None:
        self._end_init()
        _ip("link", "del", self.link, check=False)  # deletes both ends now (a namespace's deletion is lazy)
        for path in self._ns.values():
            _run(["umount", path], check=False)
            Path(path).unlink(missing_ok=True)
        _ip("netns", "del", self.netns, check=False)

    def _nsenter(self, argv: list, cwd: str | None, pid: bool) -> list[str]:
        return ["nsenter", *([f"--pid={self._ns['pid']}"] if pid else []), f"--net=/run/netns/{self.netns}",
                f"--uts={self._ns['uts']}", f"--ipc={self._ns['ipc']}", f"--mount={self._ns['mnt']}",
                f"--wd={cwd or os.getcwd()}", "--", *map(str, argv)]

    def command(self, argv: list, cwd: str | None = None) -> list[str]:
        """argv run inside this host, for whoever starts it: nsenter enters the namespaces, then
        (a PID namespace applies to children only) forks, and its child execs argv. So the process
        started is nsenter: it waits for the program and ends as the program does (its exit status,
        or killed by the same signal), but it passes no signal on. popen() and run() start the
        program itself in the host instead: their pid is the program's."""
        return self._nsenter(argv, cwd, pid=True)

    @contextlib.contextmanager
    def _starting(self):
        """What this thread starts meanwhile starts in the host's PID namespace."""
        try:
            with _pid_namespace(self._ns["pid"]):
                yield
        except OSError as e:
            if e.errno == errno.ENOMEM:  # what fork(2) says once a PID namespace's init has ended
                raise RuntimeError(f"{self.name} is down: nothing can start there ({e}), as after "
                                   "its init (pid 1 there) has ended") from e
            raise

    def popen(self, argv: list, *, env: dict | None = None, log: str | None = None,
              cwd: str | None = None) -> subprocess.Popen:
        """Start argv in this host, its output (both streams) appended to the file `log`, or
        dropped. It runs in a session of its own: a Ctrl-C to the test does not reach it. The
        Popen is the program's process (its pid here; inside, it has another), nothing in between:
        its signals and exit status are the program's."""
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            with self._starting():
                p = subprocess.Popen(self._nsenter(argv, cwd, pid=False), env=env, stdin=subprocess.DEVNULL,
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log:
                out.close()
        self.popens.append(p)
        return p

    def run(self, argv: list, timeout: float = 30, *, env: dict | None = None,
            cwd: str | None = None, input: str | None = None) -> subprocess.CompletedProcess:
        """Run argv in this host until it ends; its output is captured as text."""
        with self._starting():
            p = subprocess.Popen(self._nsenter(argv, cwd, pid=False), env=env, text=True,
                                 stdin=None if input is None else subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        with p:  # as subprocess.run, once started
            try:
                out, err = p.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                raise
            except BaseException:
                p.kill()
                raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def link_down(self) -> None:
        """Unplug the host's cable: its switch port goes down, its processes keep running."""
        _ip("link", "set", "dev", self.link, "down")

    def link_up(self) -> None:
        _ip("link", "set", "dev", self.link, "up")

    def processes(self) -> list[psutil.Process]:
        """What still runs in this host, its init (`init`) aside: whatever is in its network or
        PID namespace (orphans too), and what popen() started with its descendants."""
        procs = {p.pid: p for p in _tree(self.popens)}
        for pid in _pids_in([("net", f"/run/netns/{self.netns}"), ("pid", self._ns["pid"])]):
            try:
                procs.setdefault(pid, psutil.Process(pid))
            except psutil.Error:
                pass
        return [p for p in procs.values() if _running(p) and p != self.init]

    def stop_processes(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL after `timeout` s, everything running in this host, by pid: all
        but its init, so that it can start programs again (close() ends init, and the host)."""
        for _ in range(3):  # a program may start children while it is being stopped
            procs = self.processes()
            if not procs:
                return
            _terminate(procs, self.popens, timeout)
        if procs := self.processes():
            raise RuntimeError(f"could not stop in {self.name}: {procs}")


class Hosts:
    """n hosts on one bridge: names f"{prefix}{i}", addresses SUBNET.(10 + i). Host 0 is the usual
    head (controller, scheduler). Only one set may be open on the machine at a time (they share
    the subnet): another process's set is waited for, up to `wait` s (a machine-wide lock); a
    second set in one process is an error. A context manager; close() also runs at exit if it
    was forgotten."""

    def __init__(self, n: int, prefix: str = "jsh", wait: float = 1800):
        self.owner = _owner()
        tag = _base36(os.getpid())  # interface names have at most 15 characters
        self.bridge = f"js{tag}b"
        self._alias = f"{_ALIAS} {self.owner}"
        self._state = f"{_STATE}{self.owner}"
        self.hosts: list[Host] = []
        self.directory = ""
        self._undo = []  # how to remove what was made so far, in the order made
        self._made = []  # (kind, name) of what was made
        self._closed = False
        atexit.register(self.close)
        self._lock = None
        try:
            if not _open:  # this process's own open set is an error below, not a wait
                self._lock = _take_lock(wait)
            remove_leftovers()
            _check_subnet_free()
            # Seen by all hosts and the root namespace, like a home directory on a network file system.
            self.directory = tempfile.mkdtemp(prefix=f"{_NETNS}{self.owner}-", dir=_SHARED)
            self._made.append(("directory", self.directory))
            self._undo.append(lambda: shutil.rmtree(self.directory, ignore_errors=True))
            # Bind mounts of namespaces need a directory whose mounts do not propagate (as /run/netns).
            os.makedirs(self._state)
            self._made.append(("directory", self._state))
            self._undo.append(lambda: _release_state_dir(self._state))
            _run(["mount", "--bind", self._state, self._state])
            _run(["mount", "--make-private", self._state])
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            self._undo.append(lambda: _ip("link", "del", self.bridge, check=False))
            _ip("link", "set", self.bridge, "alias", self._alias)
            _ip("addr", "add", f"{KERNEL_ADDRESS}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(n):
                name = f"{prefix}{i}"
                host = Host(name, f"{SUBNET}.{FIRST_HOST + i}", f"{_NETNS}{self.owner}-{name}",
                            f"js{tag}v{i}", self._state)
                self.hosts.append(host)
                self._made += [("netns", host.netns), ("link", host.link), ("init of", host.name)]
                self._undo.append(host._destroy)
                host._create(self.bridge, self._alias)
        except BaseException:
            self.close()
            raise
        _open.add(self)

    def __repr__(self):
        return f"<Hosts {self.hosts} on {self.bridge}{' (closed)' if self._closed else ''}>"

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self):
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def close(self) -> None:
        """Stop every process in the hosts, remove the links, namespaces and the bridge. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        _open.discard(self)
        errors = []
        for host in self.hosts:
            try:
                host.stop_processes()
            except Exception as e:  # remove the rest all the same
                errors.append(e)
        while self._undo:
            self._undo.pop()()
        if left := self.left_behind():
            errors.append(RuntimeError(f"left behind: {left}"))
        if self._lock is not None:
            os.close(self._lock)  # releases it
            self._lock = None
        if errors:
            raise errors[0]

    def left_behind(self) -> list[str]:
        """What this set made that still exists (after close(): what could not be removed). Only
        what it made: a set that failed to start must not count another's of the same names."""
        netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
        links = {link["ifname"] for link in json.loads(_ip("-j", "link", "show").stdout)}
        running = {h.name for h in self.hosts if (h.init is not None and _running(h.init))
                   or (h._init is not None and h._init.poll() is None)}
        exists = {"netns": netns.__contains__, "link": links.__contains__, "directory": os.path.exists,
                  "init of": running.__contains__}
        return [f"{kind} {name}" for kind, name in self._made if exists[kind](name)]


@functools.cache
def unavailable_reason() -> str | None:
    """Why test hosts cannot be made here, or None. Tries it for real, once."""
    if not sys.platform.startswith("linux"):
        return "test hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, bridges, mounts)"
    for tool in ("ip", "unshare", "nsenter", "mount", "umount"):
        if not shutil.which(tool):
            return f"test hosts need the `{tool}` command"
    if _open:
        return None  # some are open: it works
    try:
        with Hosts(1, prefix="probe", wait=0) as hosts:
            r = hosts[0].run(["hostname"], timeout=10)
            if r.returncode or r.stdout.strip() != "probe0":
                return f"a command in a test host did not run there: {r.stdout}{r.stderr}"
    except HostsBusy:
        return None  # another process has some open: it works here
    except Exception as e:
        return f"cannot make test hosts: {e}"
    return None


# ---------------------------------------------------------------------------------------------
# clusters


def _env(**extra: str) -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1", **extra)


def _wait(what: str, ready, popens: list[subprocess.Popen], logs: list[Path], deadline: float):
    """Poll ready() until it returns something true; fail early, with the logs, if a process ends."""
    while True:
        if result := ready():
            return result
        dead = [p for p in popens if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"{len(dead)} process(es) ended" if dead else "timed out"
            tails = "\n".join(f"--- {log}\n{_tail(log)}" for log in logs)
            raise RuntimeError(f"{what}: {why}\n{tails}")
        time.sleep(0.2)


class _Cluster:
    """A head process (controller, scheduler) and each worker host's processes, stopped by pid."""

    def _head(self) -> subprocess.Popen | None:
        raise NotImplementedError

    def _members(self) -> dict[str, list[subprocess.Popen]]:
        raise NotImplementedError

    def popens(self) -> list[subprocess.Popen]:
        return [p for p in [self._head(), *sum(self._members().values(), [])] if p]

    def stop(self, timeout: float = 10) -> None:
        """Stop the worker hosts' processes with their children, then the head, by pid."""
        left = _stop(sum(self._members().values(), []), timeout) + _stop(self.popens(), timeout)
        if left:
            raise RuntimeError(f"could not stop {left}")


class IPCluster(_Cluster):
    """ipcontroller in the head host, listening on its address, and ipengines in worker hosts."""

    def __init__(self, directory: Path, profile: Path):
        self.directory = directory
        self.profile = str(profile)
        self.client_file = str(profile / "security" / "ipcontroller-client.json")
        self.engine_file = str(profile / "security" / "ipcontroller-engine.json")
        self.controller: subprocess.Popen | None = None
        self.engines: dict[str, list[subprocess.Popen]] = {}  # by host name
        self.logs: list[Path] = []

    def engines_of(self, host: Host) -> list[subprocess.Popen]:
        return list(self.engines.get(host.name, []))

    def _head(self):
        return self.controller

    def _members(self):
        return self.engines


def start_ipcluster(head: Host, workers: list[Host], per_host: int, directory: str,
                    timeout: float = 60) -> IPCluster:
    """Start ipcontroller (CurveZMQ on) in `head` bound to its address, then `per_host` ipengines
    in each worker host, and wait until a client here sees them all. The connection files are
    in `directory`, which must be common to all hosts (not under /tmp)."""
    deadline = time.monotonic() + timeout
    directory = Path(directory)
    profile = directory / "profile"
    (profile / "security").mkdir(parents=True, exist_ok=True)
    (directory / "logs").mkdir(exist_ok=True)
    cluster = IPCluster(directory, profile)
    for f in (cluster.client_file, cluster.engine_file):  # never mistake an earlier run's for ours
        Path(f).unlink(missing_ok=True)
    try:
        log = directory / "logs" / "ipcontroller.log"
        cluster.logs.append(log)
        cluster.controller = head.popen(
            [sys.executable, "-m", "ipyparallel.controller", f"--profile-dir={profile}",
             f"--ip={head.address}",  # all its sockets, for engines and clients alike
             f"--location={head.address}",  # not its host name, which resolves nowhere
             "--IPController.enable_curve=True", "--ping=500", "--nodb"],
            env=_env(), log=str(log))

        def connection_files():  # written when the controller has bound its sockets
            try:
                return all(json.loads(Path(f).read_text()) for f in (cluster.client_file, cluster.engine_file))
            except (OSError, ValueError):  # absent, or half written
                return False
        _wait("ipcontroller did not write its connection files", connection_files,
              cluster.popens(), cluster.logs, deadline)

        for host in workers:
            for k in range(per_host):
                log = directory / "logs" / f"ipengine-{host.name}-{k}.log"
                cluster.logs.append(log)
                cluster.engines.setdefault(host.name, []).append(host.popen(
                    [sys.executable, "-m", "ipyparallel.engine", f"--profile-dir={profile}",
                     f"--file={cluster.engine_file}"], env=_env(), log=str(log)))

        import ipyparallel
        client = ipyparallel.Client(cluster.client_file, timeout=max(1.0, deadline - time.monotonic()))
        try:
            n = len(workers) * per_host
            _wait(f"{n} engines did not all register", lambda: len(client.ids) >= n,
                  cluster.popens(), cluster.logs, deadline)
        finally:
            client.close()
    except BaseException:
        cluster.stop()
        raise
    return cluster


class DaskCluster(_Cluster):
    """`dask scheduler` in the head host and `dask worker`s in worker hosts, all over mutual TLS."""

    def __init__(self, address: str, tls: dict):
        self.address = address  # tls://HEAD:PORT
        self.tls = tls  # {"ca_file", "cert", "key"}: PEM files, for clients too
        self.scheduler: subprocess.Popen | None = None
        self.workers: dict[str, list[subprocess.Popen]] = {}  # by host name
        self.logs: list[Path] = []

    def security(self):
        import distributed
        return distributed.Security(tls_ca_file=self.tls["ca_file"], tls_client_cert=self.tls["cert"],
                                    tls_client_key=self.tls["key"], require_encryption=True)

    def workers_of(self, host: Host) -> list[subprocess.Popen]:
        """The `dask worker` commands started there; each runs its worker processes as children
        (one nanny per worker in the command's process, which starts the worker's process)."""
        return list(self.workers.get(host.name, []))

    def _head(self):
        return self.scheduler

    def _members(self):
        return self.workers


def write_tls_files(directory: str) -> dict:
    """A throwaway CA and one certificate signed by it for every party (scheduler, workers,
    clients), as PEM files readable only by their owner. Returns {"ca_file", "cert", "key"}."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(common_name):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def usage(**on):
        flags = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
                 "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
        return x509.KeyUsage(**{f: on.get(f, False) for f in flags})

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())  # EC: quick to make, and TLS 1.3 takes it
    ca = (x509.CertificateBuilder()
          .subject_name(name("jupyter_scale test CA")).issuer_name(name("jupyter_scale test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(usage(key_cert_sign=True, crl_sign=True), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(name("jupyter_scale test cluster")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage(digital_signature=True, key_agreement=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            # Dask does not check host names (every party shows the same certificate), this is for show
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("jupyter-scale-test")]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = {"ca_file": ca.public_bytes(serialization.Encoding.PEM),
             "cert": cert.public_bytes(serialization.Encoding.PEM),
             "key": key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())}
    paths = {}
    for kind, data in files.items():
        path = os.path.join(directory, {"ca_file": "ca.pem", "cert": "cert.pem", "key": "key.pem"}[kind])
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # also when the file was there before
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        paths[kind] = path
    return paths


DASK_PORT = 8786  # the head has a network namespace of its own: nothing else holds Dask's usual port


def start_dask_cluster(head: Host, workers: list[Host], per_host: int, directory: str,
                       timeout: float = 60) -> DaskCluster:
    """Start `dask scheduler` in `head` on tls://head.address:8786 and `dask worker --nworkers
    per_host` in each worker host, listening on that host's address, and wait until a client here
    sees every worker. Certificates and logs go to `directory`."""
    deadline = time.monotonic() + timeout
    directory = Path(directory)
    (directory / "logs").mkdir(parents=True, exist_ok=True)
    tls = write_tls_files(str(directory))
    cluster = DaskCluster(f"tls://{head.address}:{DASK_PORT}", tls)
    tls_args = ["--tls-ca-file", tls["ca_file"], "--tls-cert", tls["cert"], "--tls-key", tls["key"]]
    env = _env(DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION="True")  # they refuse anything but TLS
    try:
        log = directory / "logs" / "dask-scheduler.log"
        cluster.logs.append(log)
        cluster.scheduler = head.popen(
            [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", head.address,
             "--port", str(DASK_PORT), "--protocol", "tls", *tls_args, "--no-dashboard"],
            env=env, log=str(log))
        # The workers start at once: they retry until the scheduler listens (within --death-timeout).
        for host in workers:
            log = directory / "logs" / f"dask-worker-{host.name}.log"
            cluster.logs.append(log)
            cluster.workers[host.name] = [host.popen(
                [sys.executable, "-m", "distributed.cli.dask_worker", cluster.address,
                 "--host", host.address,  # the nannies and workers listen there, where others reach them
                 "--protocol", "tls", *tls_args, "--nworkers", str(per_host), "--nthreads", "1",
                 "--name", host.name,  # workers jsh1-0, jsh1-1, ...
                 "--memory-limit", "0", "--no-dashboard", "--death-timeout", str(int(timeout))],
                env=env, log=str(log))]

        import distributed

        from jupyter_scale.backends.dask_cluster import workers_of
        client = _wait("the dask scheduler did not answer",
                       lambda: _dask_client(distributed, cluster), cluster.popens(), cluster.logs, deadline)
        try:
            n = len(workers) * per_host
            _wait(f"{n} dask workers did not all register",
                  lambda: len(workers_of(client)) >= n,
                  cluster.popens(), cluster.logs, deadline)
        finally:
            client.close()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _dask_client(distributed, cluster: DaskCluster):
    try:
        return distributed.Client(cluster.address, security=cluster.security(), timeout=2)
    except OSError:  # not listening yet
        return None
