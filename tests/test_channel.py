"""The direct channel: on one host a cell's calls, output and reported points go over the
kernel's own IPC sockets instead of through the engine, with the same results, and no
other local user can open them."""

import json
import os
import stat
import uuid

import pytest
from stranger import require_stranger, run_as_stranger

from conftest import SETUP, _stop_and_check, kernel_fixture
from kernel import Kernel

pytestmark = pytest.mark.cluster

# The channel is an alternative to the engine's own path, for the two engines that have one
# (tests/test_backend_protocol.py runs the protocol over it): both engines.
kernel = kernel_fixture(["ipyparallel", "dask"])

# Counts the calls the session makes through the engine (the cluster's start excepted).
COUNT_ENGINE_CALLS = """
session = jupyter_scale.get_session()
engine_calls = []
def counted(method):
    def call(fn, *args, **kwargs):
        engine_calls.append(getattr(fn, "__name__", "?"))
        return method(fn, *args, **kwargs)
    return call
session.backend.submit = counted(type(session.backend).submit.__get__(session.backend))
session.backend.submit_each = counted(type(session.backend).submit_each.__get__(session.backend))
"""

CELLS = [
    # a handler made in one cell, used in the next: it writes to the stream the cell had
    "%%distribute --workers 2\nimport logging, threading\nlog = logging.getLogger('cells')\n"
    "log.addHandler(logging.StreamHandler())\nprint('hello from', rank)",
    "%%distribute\nlog.warning('warned by %d', rank)\n"
    "t = threading.Thread(target=lambda: print('from a thread of', rank)); t.start(); t.join()\n"
    "with torch.no_grad():\n    model.weight.add_(1.0)\n"
    "for i in range(20):\n    report(loss=float(i + rank))\n"
    "from IPython.display import display, HTML\nif rank == 0: display(HTML('<b>shown</b>'))",
]


# A DataLoader whose forked worker processes print: they must not use the worker's sockets.
LOUD_LOADER = """
class Loud(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        print(f"in a loader process of rank {rank}", flush=True)
        return torch.tensor(i)
for batch in DataLoader(Loud(), batch_size=2, num_workers=2):
    pass
print("loaded by", rank)
"""


def _running(k):
    if not k.value("jupyter_scale.get_session().running"):
        k.ok("%scale start --workers 2")


def _run_cells(k):
    k.ok("torch.manual_seed(0); model = nn.Linear(3, 2)")
    outputs = [k.ok(cell) for cell in CELLS]
    stdout = "".join(o.stdout for o in outputs)
    stderr = "".join(o.stderr for o in outputs)
    html = [d["text/html"] for o in outputs for d in o.displays if "text/html" in d]
    points = json.loads(k.value("__import__('json').dumps(jupyter_scale.history())"))
    weight = k.value("round(float(model.weight.sum()), 4)")
    return stdout, stderr, html, sorted((p["rank"], p["loss"]) for p in points), weight


def test_cells_go_over_the_channel_and_give_what_the_engine_gives(kernel):
    k = kernel
    _running(k)
    k.ok(COUNT_ENGINE_CALLS)
    assert k.value("session._channel is not None")
    assert "cells go over: the kernel's direct channel" in k.ok("%scale status").stdout
    direct = _run_cells(k)
    # Nothing of the cells went through the engine: their calls, their output, their points.
    assert k.value("engine_calls") == []

    k.ok("session.direct_channel = False")
    k.ok("%scale restart")
    k.ok(COUNT_ENGINE_CALLS)
    assert k.value("session._channel is None")
    through_engine = _run_cells(k)
    assert "run_cell" in k.value("engine_calls")
    k.ok("session.direct_channel = True")
    k.ok("%scale restart")

    for got in (direct, through_engine):
        stdout, stderr, html, points, weight = got
        for rank in (0, 1):
            assert f"[rank {rank}] hello from {rank}" in stdout
            assert f"[rank {rank}] from a thread of {rank}" in stdout
            assert f"[rank {rank}] warned by {rank}" in stderr
        assert len(html) == 1 and "<b>shown</b>" in html[0]
        assert points == [(r, float(i + r)) for r in (0, 1) for i in range(20)]
    assert direct[4] == through_engine[4]  # the same weights came back


def test_a_worker_that_does_not_answer_on_the_channel_leaves_cells_to_the_engine(kernel):
    k = kernel
    _running(k)
    k.ok("import jupyter_scale.group as group_module\n"
         "session = jupyter_scale.get_session()\n"
         "hello_s, group_module.CHANNEL_HELLO_S = group_module.CHANNEL_HELLO_S, 0.5\n"
         "# a server that never opens its end (a worker of another user cannot enter the directory)\n"
         "session.backend.channel_server = lambda: (lambda directory, identity, rank: 0)")
    try:
        k.ok("%scale restart")
        assert k.value("session._channel is None")
        out = k.ok("%%distribute\nprint('through the engine', rank)")
        assert "[rank 1] through the engine 1" in out.stdout
    finally:
        k.ok("group_module.CHANNEL_HELLO_S = hello_s\ndel session.backend.channel_server\n%scale restart")
    assert k.value("session._channel is not None")


def test_what_a_cell_writes_to_the_file_descriptors_comes_with_its_output(monkeypatch):
    """An ipyparallel engine watches its descriptors 1 and 2 (not under pytest, so the kernel
    here runs without pytest's marker): C code and subprocesses print into the cell."""
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    k = Kernel(backend="ipyparallel")
    try:
        k.ok(SETUP)
        out = k.ok("%%distribute --workers 2\nimport os, subprocess\nos.write(1, b'written to fd 1 by %d\\n' % rank)\n"
                   "subprocess.run(['echo', f'echoed by {rank}'], check=True)\n"
                   "os.write(2, b'written to fd 2 by %d\\n' % rank)\n" + LOUD_LOADER)
        assert k.value("jupyter_scale.get_session()._channel is not None")
        for rank in (0, 1):
            assert f"[rank {rank}] written to fd 1 by {rank}" in out.stdout
            assert f"[rank {rank}] echoed by {rank}" in out.stdout
            assert f"[rank {rank}] written to fd 2 by {rank}" in out.stderr
            assert f"[rank {rank}] in a loader process of rank {rank}" in out.stdout
        assert "jupyter_scale;" not in out.stdout + out.stderr  # the end markers are taken out
    finally:
        _stop_and_check(k)


def test_forked_loader_processes_that_print_do_not_stall_the_cell(kernel):
    _running(k := kernel)
    out = k.ok("%%distribute\n" + LOUD_LOADER)
    assert "[rank 0] loaded by 0" in out.stdout and "[rank 1] loaded by 1" in out.stdout


def test_a_dask_cell_sees_its_worker(kernel):
    if kernel.backend != "dask":
        pytest.skip("Dask's get_worker()")
    _running(kernel)
    out = kernel.ok("%%distribute\nfrom distributed import get_worker\nprint('on', get_worker().address)")
    assert "[rank 0] on tls://127.0.0.1:" in out.stdout


def test_workers_never_connect_again_to_a_closed_channels_path(kernel):
    """Once the kernel closed a channel and removed its directory, anyone could make that path
    and bind a socket there: the workers' ends must not reconnect to it."""
    _running(kernel)
    kernel.ok("%%distribute\nx = rank")
    kernel.ok("""
import os, shutil, time, zmq
session = jupyter_scale.get_session()
old = session._channel.directory
session._channel.close()
os.mkdir(old, 0o700)  # as someone else would, once it is gone
socket = zmq.Context.instance().socket(zmq.ROUTER)
monitor = socket.get_monitor_socket(zmq.EVENT_ACCEPTED)
socket.bind(f"ipc://{old}/calls")
time.sleep(1.5)  # the workers' ends would have tried many times (every 0.1 s by default)
accepted = monitor.poll(0)
socket.disable_monitor()
monitor.close()
socket.close(0)
shutil.rmtree(old)
""")
    accepted = kernel.value("accepted")
    assert accepted == 0
    kernel.ok("%scale restart")
    assert "[rank 1] 1" in kernel.ok("%%distribute\nprint(rank)").stdout


def test_a_stranger_cannot_open_the_channel(kernel):
    require_stranger()
    k = kernel
    k.ok("%%distribute --workers 2\nx = rank")
    directory = k.value("jupyter_scale.get_session()._channel.directory")
    mode = os.stat(directory)
    assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.geteuid()
    marker = f"/tmp/jupyter_scale-stranger-{uuid.uuid4().hex}"
    result = run_as_stranger(f"""
        import pickle, socket, zmq
        for name in ("calls", "out"):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect({directory!r} + "/" + name)
                print("CONNECTED", name)
            except PermissionError:
                print("REFUSED", name)
        # As a worker would: a reply and a call's output, and a pickle that runs code.
        class Run:
            def __reduce__(self):
                return (open, ({marker!r}, "w"))
        z = zmq.Context().socket(zmq.DEALER)
        z.setsockopt(zmq.IDENTITY, b"rank0-x")
        z.connect("ipc://{directory}/calls")
        z.send_multipart([b"reply", pickle.dumps(Run())], zmq.NOBLOCK)
        z.close(linger=500)
    """)
    assert result.stdout.split() == ["REFUSED", "calls", "REFUSED", "out"], result.stdout + result.stderr
    out = k.ok("%%distribute\nprint('still', x)")
    assert "[rank 1] still 1" in out.stdout
    assert not os.path.exists(marker)
