"""Aborting a process group cuts the group's connections and only those.

A worker's engine keeps connections of its own (a Dask worker's to its scheduler) and its
threads open new ones at any time, also while the rank joins the group. Cutting one of
those at an abort kills the worker (Dask closes a worker whose scheduler link broke), and
the next cell finds its variables gone. Two real gloo ranks here join a group while a
thread of each opens connections to an echo server; the abort must free the peer's
collective and leave every one of those connections working.
"""

import json
import os
import socket
import subprocess
import sys
import threading

RANK = r"""
import json, os, socket, sys, threading, time
import torch, torch.distributed as dist
from jupyter_scale import rendezvous

rank, store_path, echo_port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
os.environ["GLOO_SOCKET_IFNAME"] = rendezvous.loopback_interface()
store = dist.FileStore(store_path, 2)
others = []  # (inode, opened_at) of the engine-like connections
stop = threading.Event()

def connect_meanwhile():
    while not stop.is_set():
        conn = socket.create_connection(("127.0.0.1", echo_port))
        others.append((conn, os.fstat(conn.fileno()).st_ino, time.monotonic()))
        time.sleep(0.01)

thread = threading.Thread(target=connect_meanwhile)
thread.start()
if rank == 1:
    time.sleep(1.0)  # rank 0 waits in init for a second, while its thread connects
began = time.monotonic()
group = rendezvous.init_group(store, "gloo", rank, 2, torch.device("cpu"))
ended = time.monotonic()
stop.set()
thread.join()
during = [inode for _, inode, at in others if began < at < ended]
report = {"group": len(group), "during": len(during), "cut_by_mistake": len(set(during) & group)}
if rank == 0:
    store.wait(["rank1-in-collective"])
    time.sleep(0.5)
    rendezvous.abort_group(group)
    broken = 0
    for conn, _, _ in others:  # still usable?
        try:
            conn.sendall(b"ping")
            echoed = b""
            while len(echoed) < 4 and (part := conn.recv(4 - len(echoed))):  # TCP may split it
                echoed += part
            broken += echoed != b"ping"
        except OSError:
            broken += 1
    report["others_broken"] = broken
else:
    store.set("rank1-in-collective", "1")
    try:
        dist.all_reduce(torch.ones(1))  # rank 0 never joins: only the abort frees it
        report["freed"] = "returned"
    except Exception as exc:
        report["freed"] = type(exc).__name__
    for conn, _, _ in others:
        conn.close()
print(json.dumps(report), flush=True)
"""


def _echo_server():
    server = socket.create_server(("127.0.0.1", 0))
    conns = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            conns.append(conn)
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server, conns


def _echo(conn):
    try:
        while data := conn.recv(64):
            conn.sendall(data)
    except OSError:
        pass


def test_an_abort_frees_the_peer_and_leaves_the_engines_connections_alone(tmp_path):
    server, conns = _echo_server()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path / "store"),
                               str(server.getsockname()[1])], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        server.close()
        for conn in conns:
            conn.close()
    reports = []
    for p, (out, err) in zip(ranks, outputs):
        assert p.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    zero, one = reports
    assert zero["during"] > 0, "no connection was opened while rank 0 joined: the test proves nothing"
    assert zero["group"] >= 2 and one["group"] >= 2  # gloo's listener and its connection to the peer
    assert zero["cut_by_mistake"] == 0 and one["cut_by_mistake"] == 0
    assert zero["others_broken"] == 0
    assert one["freed"] == "DistBackendError" or one["freed"].endswith("Error"), one
