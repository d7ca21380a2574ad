"""The shared-memory transport of large frames (jupyter_scale.sharedmem), within one machine."""

import errno
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from jupyter_scale import sharedmem, shipping
from jupyter_scale.receiving import Receiver

pytestmark = pytest.mark.skipif(not sharedmem.available(), reason="no memfd_create or /proc")


def test_small_frames_stay_in_the_message():
    out = sharedmem.SharedFrames()
    frames, descriptor = out.pack([b"x" * 100, bytearray(1000)])
    assert descriptor is None and frames == [b"x" * 100, bytearray(1000)]
    out.close()


def test_tensor_frames_are_read_in_place_others_are_copies():
    out = sharedmem.SharedFrames()
    big = np.arange(1_000_000, dtype=np.int64)  # 8 MB
    raw = memoryview(np.full(2_000_000, 7, dtype=np.uint8))
    frames, descriptor = out.pack([b"head", big, raw], [False, False, True])
    assert frames == [b"head", b"", b""]  # what the engine's message still carries
    with sharedmem.unpacked(frames, descriptor) as got:
        assert got[0] == b"head"
        assert isinstance(got[1], bytearray)  # the reader's own, writable
        assert np.array_equal(np.frombuffer(got[1], np.int64), big)
        assert isinstance(got[2], memoryview) and got[2].nbytes == 2_000_000 and got[2][5] == 7
    assert got == []  # the mapping's views end with the block
    out.close()


def test_the_file_is_written_again_and_emptied_above_keep():
    out = sharedmem.SharedFrames(keep=3 << 20)
    first, d1 = out.pack([np.ones(2 << 20, np.uint8)], [True])
    second, d2 = out.pack([np.full(4 << 20, 2, np.uint8)], [True])
    assert (d1["pid"], d1["fd"]) == (d2["pid"], d2["fd"])  # one file: memory handed out once
    with sharedmem.unpacked(second, d2) as got:
        assert bytes(got[0][:3]) == b"\x02\x02\x02" and got[0].nbytes == 4 << 20
    out.trim()  # 4 MB > keep: emptied
    assert os.fstat(d2["fd"]).st_size == 0
    out.close()
    assert not os.path.exists(f"/proc/self/fd/{d2['fd']}")


def test_a_pack_that_fails_frees_what_it_wrote():
    # A real write failure part-way: the process may hold files of 5 MB at most (memfds
    # too), and the second 3 MB frame runs past that.
    code = ("import os, resource, signal\n"
            "from jupyter_scale import sharedmem\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (5 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
            "out = sharedmem.SharedFrames()\n"
            "try:\n"
            "    out.pack([bytes(3 << 20), bytes(3 << 20)])\n"
            "except OSError as exc:\n"
            "    print('failed', exc.errno)\n"
            "print('size', os.fstat(out._fd).st_size)\n"
            "print('again', out.pack([bytes(2 << 20)])[1]['size'])  # the file still works\n")
    seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert seen.stdout.split("\n")[:3] == [f"failed {errno.EFBIG}", "size 0", f"again {2 << 20}"], seen.stdout + seen.stderr


def test_receiver_copies_tensor_frames_out_of_the_mapping():
    shipper, receiver = shipping.Shipper(), Receiver()
    model = torch.nn.Linear(1024, 512)
    out = sharedmem.SharedFrames()
    for step in range(2):
        shipment = shipper.prepare(shipper.plan({"model": model}))
        frames, descriptor = out.pack(shipment.frames, shipment.tensor_frames)
        assert descriptor is not None
        request = {"names": shipment.names, "updates": shipment.updates, "forget": shipment.forget}
        with sharedmem.unpacked(frames, descriptor) as got:
            received = receiver.receive(request, got)
        shipper.commit(shipment)
        if step == 0:
            held = received["model"]
        assert torch.equal(held.weight, model.weight)  # usable after the mapping is gone
        with torch.no_grad():
            model.weight.add_(1)  # the next round sends it again, in place
    out.close()


def test_another_process_reads_the_file_and_a_stranger_cannot():
    out = sharedmem.SharedFrames()
    descriptor, token = sharedmem.probe(out)
    assert sharedmem.check_probe(descriptor, token)
    assert not sharedmem.check_probe(descriptor, b"other token")
    code = ("import sys, ast; from jupyter_scale import sharedmem\n"
            "d, t = ast.literal_eval(sys.argv[1])\n"
            "print(sharedmem.check_probe(d, t))")
    seen = subprocess.run([sys.executable, "-c", code, repr((descriptor, token))],
                          capture_output=True, text=True, timeout=60, check=True)
    assert seen.stdout.strip() == "True"
    # A process on another machine finds no such process, or another file there.
    gone = dict(descriptor, pid=2**22 + 1)  # above any pid_max: no such process
    assert not sharedmem.check_probe(gone, token)
    out.close()
    assert not sharedmem.check_probe(descriptor, token)  # closed: its memory is gone
