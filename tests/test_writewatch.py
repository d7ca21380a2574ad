"""The write watch: a digest is reused only while no byte of the tensor was written.

Every way of writing a tensor's memory must count, or a changed model would be taken for
an unchanged one and not sent: in-place ops, `.data` and NumPy (which autograd's version
counters miss), another thread, the kernel writing into it (read(2)), pages never touched
before the hash, and memory freed and taken by a new tensor.
"""

import ctypes
import mmap
import os
import resource
import struct
import subprocess
import sys
import threading

import pytest
import torch

from jupyter_scale import tensorbytes, writewatch

MIB = 1 << 20
EDGE = writewatch.EDGE
CHUNK_PLUS = writewatch.CHUNK + 1


@pytest.fixture
def watch():
    w = writewatch.WriteWatch()
    if not w.watching:
        pytest.skip("this kernel has no asynchronous userfaultfd write protection")
    yield w
    w.close()


def digest(watch, tensor):
    array, _ = tensorbytes.tensor_bytes(tensor)
    with watch.digest_pass():
        return watch.digest(tensor, array)


def fresh_digest(tensor):
    array, _ = tensorbytes.tensor_bytes(tensor)
    return writewatch.digest(array)


WRITES = {
    "in place": lambda t: t[300_000:300_010].add_(1),
    "through .data": lambda t: t.data[600_000:600_001].add_(2),
    "through NumPy": lambda t: t.numpy().__setitem__(123_456, 7.0),
    "one element, last page": lambda t: t.view(-1).__setitem__(-1, 5.0),
    "from another thread": lambda t: (th := threading.Thread(target=t.view(-1)[1000:1001].fill_, args=(9.0,)),
                                      th.start(), th.join()),
    "by the kernel (readv)": lambda t: read_into(t),
}


def read_into(tensor):
    r, w = os.pipe()
    try:
        os.write(w, b"\x01" * 8)
        assert os.readv(r, [memoryview(tensor.numpy()).cast("B")[MIB: MIB + 8]]) == 8
    finally:
        os.close(r)
        os.close(w)


def hashed(watch, tensor):
    """The tensor's digest, and how many bytes were read to make it."""
    before = watch.hashed_bytes
    return digest(watch, tensor), watch.hashed_bytes - before


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
def test_every_write_is_seen(watch, write):
    tensor = torch.zeros(8 * MIB // 4)
    first, read = hashed(watch, tensor)
    assert first == fresh_digest(tensor) and read == 8 * MIB
    # Unwritten: at most its first and last bytes are hashed again (their pages hold the
    # memory next to the tensor too, which others write).
    again, read = hashed(watch, tensor)
    assert again == first and read <= 2 * EDGE
    WRITES[write](tensor)
    after, read = hashed(watch, tensor)
    assert after == fresh_digest(tensor) != first
    assert read <= 2 * MIB + 2 * EDGE, "the written page's chunk or two and the two ends, not the whole tensor"


def test_pages_never_touched_before_the_hash(watch):
    tensor = torch.empty(4 * MIB // 4)  # fresh mapping: no page behind it yet
    first = digest(watch, tensor)
    tensor[MIB // 8] = 1.5
    assert digest(watch, tensor) == fresh_digest(tensor) != first


def test_memory_freed_and_taken_again_is_hashed(watch):
    tensor = torch.ones(2 * MIB // 4)
    first = digest(watch, tensor)
    address = tensor.data_ptr()
    del tensor
    # The same size again: glibc may hand back the very same pages, or map new ones.
    again = torch.empty(2 * MIB // 4)
    again.fill_(2.0)
    assert digest(watch, again) == fresh_digest(again) != first
    if again.data_ptr() == address:
        untouched = torch.empty(0)
        untouched.set_(again.untyped_storage())
        assert digest(watch, untouched) == fresh_digest(again)


def test_a_new_storage_in_the_same_parameter(watch):
    param = torch.nn.Parameter(torch.zeros(MIB // 4 * 2))
    first = digest(watch, param)
    param.data = torch.full_like(param, 3.0)
    assert digest(watch, param) == fresh_digest(param) != first


def test_small_tensors_and_copies_are_hashed_whole_every_time(watch):
    small = torch.zeros(1000)
    strided = torch.zeros(1024, 1024).t()  # not contiguous: its bytes are a copy
    for tensor in (small, strided, small, strided):
        assert hashed(watch, tensor) == (fresh_digest(tensor), tensor.nbytes)


def test_a_digest_is_the_same_whatever_the_address():
    """The kernel and the workers compare digests of bytes held at other addresses."""
    base = torch.arange(3 * MIB + 5, dtype=torch.uint8)
    for offset in (0, 1, 4095, 4096 + 17):
        copy = torch.empty(3 * MIB + 5 + offset, dtype=torch.uint8)[offset:]
        copy.copy_(base)
        w = writewatch.WriteWatch()
        try:
            assert digest(w, copy) == digest(w, copy) == fresh_digest(base)
        finally:
            w.close()


def test_unprivileged_users_get_it(tmp_path):
    """A user without CAP_SYS_PTRACE (vm.unprivileged_userfaultfd=0): the watch works, and
    nothing needs root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to play another user")
    script = ("import torch; from jupyter_scale import writewatch, tensorbytes\n"
              "w = writewatch.WriteWatch()\n"
              "t = torch.zeros(1 << 19); a, _ = tensorbytes.tensor_bytes(t)\n"
              "with w.digest_pass(): d = w.digest(t, a)\n"
              "t[5] = 1\n"
              "with w.digest_pass(): print(w.watching, d != w.digest(t, a))\n")
    done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                           sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


def test_a_forked_child_makes_its_own(watch):
    tensor = torch.zeros(2 * MIB // 4)
    first = digest(watch, tensor)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's memory is not watched by the parent's; its own watch sees writes
        try:
            child = writewatch.WriteWatch()
            d = digest(child, tensor)
            tensor[7] = 1.0
            ok = child.watching and digest(child, tensor) == fresh_digest(tensor) != d == first
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert digest(watch, tensor) == first, "the child's write was to its own copy"


def test_a_tensor_changed_every_time_is_hashed_unprotected_until_it_rests(watch):
    """A tensor being trained would take a fault per page every cell for nothing: after
    HOT_AFTER changes in a row it is hashed whole, unprotected; once a hash finds it
    unchanged it is protected again. Every digest stays the bytes' own."""
    tensor = torch.zeros(8 * MIB // 4)
    steps = [("new", None, 8 * MIB)]
    steps += [("changed", lambda: tensor[5 * MIB // 4].add_(1), 2 * MIB + 2 * EDGE)] * watch.HOT_AFTER
    steps += [("changed, hot", lambda: tensor[5 * MIB // 4].add_(1), 8 * MIB),
              ("changed, hot", lambda: tensor.numpy().__setitem__(9, 2.0), 8 * MIB),
              ("at rest: protected, hashed again under it", None, 16 * MIB),
              ("at rest", None, 2 * EDGE),
              ("changed", lambda: tensor[MIB].add_(1), 2 * MIB + 2 * EDGE)]
    for what, write, most in steps:
        if write is not None:
            write()
        got, read = hashed(watch, tensor)
        assert got == fresh_digest(tensor), what
        assert read <= most, (what, read)
        if "hot" in what or "under" in what:
            assert read == most, (what, read)


def test_pages_unprotected_before_a_whole_write_count_as_written(watch):
    """An update received is written whole: its pages lose their protection in one call
    before it (will_write), and the next hash reads them all, written or not."""
    tensor = torch.zeros(4 * MIB // 4)
    first = digest(watch, tensor)
    watch.will_write(tensor)
    assert hashed(watch, tensor) == (first, 4 * MIB)
    watch.will_write(tensor)
    tensor.copy_(torch.full_like(tensor, 6.0))
    after, read = hashed(watch, tensor)
    assert after == fresh_digest(tensor) != first and read == 4 * MIB
    assert hashed(watch, tensor)[1] <= 2 * EDGE, "protected again"


LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
LIBC.mremap.restype = ctypes.c_void_p
LIBC.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_RW, MAP_PRIVATE_ANONYMOUS, MAP_FIXED, MREMAP_MAYMOVE_FIXED = 3, 0x22, 0x10, 3


@pytest.fixture
def mapped():
    """Tensors over memory mapped here, unmapped after the test."""
    maps = []

    def mapping(nbytes):
        address = LIBC.mmap(None, nbytes, PROT_RW, MAP_PRIVATE_ANONYMOUS, -1, 0)
        maps.append((address, nbytes))
        return address, torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)
    mapping.unmap_later = lambda address, nbytes: maps.append((address, nbytes))
    yield mapping
    for address, nbytes in maps:
        LIBC.munmap(address, nbytes)


def test_neighbours_sharing_pages_each_see_their_writes(watch):
    """Weights from the heap (as on the workers, whose malloc keeps blocks under 4 MiB off
    mmap) share their end pages; a scan reports a write once, so each must still see its own."""
    LIBC.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD
    model = torch.nn.Sequential(*[torch.nn.Linear(768, 768) for _ in range(4)])
    weights = [layer.weight for layer in model]
    for _ in range(2):
        for weight in weights:
            digest(watch, weight)
    with torch.no_grad():
        weights[2].view(-1)[0] += 1  # its first page, shared with the weight before it
        weights[1].view(-1)[-1] += 1  # its last page
    for weight in weights:  # in order, as a state dict is hashed
        assert digest(watch, weight) == fresh_digest(weight)


def test_views_of_one_buffer(watch):
    flat = torch.zeros(8 * MIB // 4)  # a flat parameter, and a parameter that is a view of it
    view = flat[MIB // 4: 5 * MIB // 4]
    digest(watch, flat)
    digest(watch, view)
    view[2 * MIB // 4] = 1.0
    assert digest(watch, flat) == fresh_digest(flat)
    assert digest(watch, view) == fresh_digest(view)


def test_memory_others_write_is_hashed_every_time(watch):
    """Shared memory, a memfd's mapping: its bytes change without a write through this
    process's page tables."""
    shared = torch.zeros(4 * MIB // 4).share_memory_()
    digest(watch, shared)
    pid = os.fork()
    if pid == 0:
        shared[12345] = 3.0
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert digest(watch, shared) == fresh_digest(shared)

    fd = os.memfd_create("bytes")
    try:
        os.ftruncate(fd, 4 * MIB)
        os.pwrite(fd, b"\x01" * 4 * MIB, 0)
        private = mmap.mmap(fd, 4 * MIB, access=mmap.ACCESS_COPY)  # as sharedmem maps frames
        copy = torch.frombuffer(private, dtype=torch.uint8)
        digest(watch, copy)
        os.pwrite(fd, b"\x07" * 100, 2 * MIB)  # pages never touched here read the file
        assert digest(watch, copy) == fresh_digest(copy)
        del copy
        private.close()
    finally:
        os.close(fd)


def test_memory_mapped_anew_under_a_tensor(watch, mapped):
    address, tensor = mapped(4 * MIB)
    tensor.fill_(1)
    digest(watch, tensor)
    source, moved = mapped(MIB)
    moved.fill_(7)
    assert LIBC.mremap(source, MIB, MIB, MREMAP_MAYMOVE_FIXED, address + MIB) == address + MIB
    assert digest(watch, tensor) == fresh_digest(tensor)
    assert LIBC.mmap(address + 3 * MIB, 4096, PROT_RW, MAP_PRIVATE_ANONYMOUS | MAP_FIXED, -1, 0) == address + 3 * MIB
    assert digest(watch, tensor) == fresh_digest(tensor)


def test_a_hash_interrupted_loses_no_write(watch, monkeypatch):
    tensor = torch.zeros(8 * MIB // 4)
    digest(watch, tensor)
    tensor[3 * MIB // 4] = 1.0

    def interrupted(array, starts, indexes):  # Ctrl-C while the pieces are hashed, after the scan took the writes
        raise KeyboardInterrupt
    with monkeypatch.context() as patch:
        patch.setattr(writewatch, "piece_digests", interrupted)
        with pytest.raises(KeyboardInterrupt):
            digest(watch, tensor)
    assert digest(watch, tensor) == fresh_digest(tensor)


class Ring:
    """An io_uring whose registered buffer is a tensor's memory: its pages pinned, as for
    RDMA, and written by the kernel past the page tables (IORING_OP_READ_FIXED)."""

    SETUP, ENTER, REGISTER = 425, 426, 427  # the same numbers on x86_64 and aarch64

    def __init__(self, mapped):
        LIBC.syscall.restype = ctypes.c_long
        params = ctypes.create_string_buffer(120)
        self.fd = LIBC.syscall(self.SETUP, 4, params)
        self.pinned = False
        if self.fd < 0:
            pytest.skip(f"io_uring: {os.strerror(ctypes.get_errno())}")
        entries, completions = struct.unpack_from("II", params, 0)
        self.sq_off, cq_off = struct.unpack_from("7I", params, 40), struct.unpack_from("7I", params, 80)
        size = max(self.sq_off[6] + entries * 4, cq_off[5] + completions * 16)
        self.rings = LIBC.mmap(None, size, PROT_RW, 0x8001, self.fd, 0)  # MAP_SHARED | MAP_POPULATE
        self.entries = LIBC.mmap(None, entries * 64, PROT_RW, 0x8001, self.fd, 0x10000000)
        mapped.unmap_later(self.rings, size)
        mapped.unmap_later(self.entries, entries * 64)

    def pin(self, address, nbytes):
        buffers = (ctypes.c_uint64 * 2)(address, nbytes)
        assert LIBC.syscall(self.REGISTER, self.fd, 0, buffers, 1) == 0, os.strerror(ctypes.get_errno())
        self.pinned = True

    def unpin(self):
        assert LIBC.syscall(self.REGISTER, self.fd, 1, None, 0) == 0  # IORING_UNREGISTER_BUFFERS
        self.pinned = False

    def read_into(self, address, path):
        fd = os.open(path, os.O_RDONLY)
        try:
            entry = bytearray(64)  # IORING_OP_READ_FIXED of 4 KiB
            struct.pack_into("BBHiQQI", entry, 0, 4, 0, 0, fd, 0, address, 4096)
            ctypes.memmove(self.entries, bytes(entry), 64)
            tail = ctypes.c_uint32.from_address(self.rings + self.sq_off[1])
            mask = ctypes.c_uint32.from_address(self.rings + self.sq_off[2]).value
            ctypes.c_uint32.from_address(self.rings + self.sq_off[6] + 4 * (tail.value & mask)).value = 0
            tail.value += 1
            assert LIBC.syscall(self.ENTER, self.fd, 1, 1, 1, None, 0) == 1
        finally:
            os.close(fd)

    def close(self):
        if self.pinned:  # at once: a closed ring lets its pages go later, in the background
            self.unpin()
        os.close(self.fd)


def pinned_kib():
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmPin:")).split()[1])


@pytest.fixture
def ring(mapped):
    r = Ring(mapped)
    yield r
    r.close()


def test_pinned_memory_is_hashed_every_time(watch, mapped, ring, tmp_path):
    """While any memory of the process is pinned, every tensor is hashed."""
    address, tensor = mapped(4 * MIB)
    tensor.fill_(1)
    ring.pin(address, 4 * MIB)
    digest(watch, tensor)
    (tmp_path / "bytes").write_bytes(b"\x09" * 4096)
    ring.read_into(address + 2 * MIB, tmp_path / "bytes")
    assert int(tensor[2 * MIB]) == 9
    assert digest(watch, tensor) == fresh_digest(tensor)


def test_memory_pinned_during_a_pass_is_not_trusted_after_it(watch, mapped, ring, tmp_path):
    """Pinned while a pass scans it (another thread), written by the device, unpinned
    before the next pass: nothing that pass stored is trusted."""
    address, tensor = mapped(4 * MIB)
    tensor.fill_(1)
    assert pinned_kib() == 0  # else nothing is trusted and this shows nothing
    digest(watch, tensor)
    array, _ = tensorbytes.tensor_bytes(tensor)
    with watch.digest_pass():
        ring.pin(address, 4 * MIB)
        watch.digest(tensor, array)  # scans and protects the pinned pages again
    (tmp_path / "bytes").write_bytes(b"\x09" * 4096)
    ring.read_into(address + 2 * MIB, tmp_path / "bytes")
    ring.unpin()
    assert digest(watch, tensor) == fresh_digest(tensor)


def test_memory_that_cannot_be_watched_is_left_unprotected(watch):
    """Shared memory is hashed every time, and its pages are not protected for nothing:
    the cell's writes to it take no fault."""
    shared = torch.zeros(8 * MIB // 4).share_memory_()
    for _ in range(3):
        digest(watch, shared)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    shared.add_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 8 * MIB // 4096 // 4, faults
    assert digest(watch, shared) == fresh_digest(shared)


def test_page_ranges_are_watched_for_one_span_each():
    import random
    rng = random.Random(3)
    owned, spans = writewatch._Owned(), {}
    alive = set()
    for step in range(3000):
        start = rng.randrange(0, 200) * 4096
        pages = (start, start + rng.randrange(1, 20) * 4096)
        span = (pages[0] + rng.randrange(0, 4096), step)
        if rng.random() < 0.3 and alive:
            gone = rng.choice(sorted(alive))
            alive.discard(gone)
        overlapping_alive = [o for o, p in spans.items() if o in alive and p[0] < pages[1] and pages[0] < p[1]]
        took = owned.claim(span, pages, lambda other: other in alive)
        assert took == (not overlapping_alive)
        if took:
            spans = {o: p for o, p in spans.items() if not (p[0] < pages[1] and pages[0] < p[1])}
            spans[span] = pages
            alive.add(span)
        # A live span keeps its pages; a dead one may have given them up to any claim.
        assert all(owned.get(o) == p for o, p in spans.items() if o in alive)
        ranges = sorted(owned.get(o) for o in spans if owned.get(o) is not None)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), "watched for two spans"


def test_the_pieces_a_written_region_touches():
    import random
    rng = random.Random(7)
    for _ in range(2000):
        length = rng.randrange(CHUNK_PLUS, 6 * MIB)
        address = rng.randrange(0, 1 << 40)
        starts = writewatch._pieces(length)
        ends = [*starts[1:], length]
        assert starts[0] == 0 and all(a < b for a, b in zip(starts, ends))
        lo = rng.randrange(0, length)
        hi = rng.randrange(lo + 1, length + 1)
        touched = [i for i in range(len(starts)) if starts[i] < hi and ends[i] > lo]
        assert writewatch._pieces_in([(address + lo, address + hi)], address, starts) == touched
