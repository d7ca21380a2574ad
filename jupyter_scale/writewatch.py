"""Digests of tensors' bytes, and whether the bytes were written since they were hashed.

An unchanged model should cost nothing to ship or to pull back, but hashing it to find
out reads every byte: 15-30 ms for 500 MiB here, bound by memory bandwidth. Version
counters are no answer (`p.data.add_(1)` and writes through NumPy leave them as they
were), so the page tables answer instead. A hashed tensor's pages are write-protected
with userfaultfd in its asynchronous mode (Linux 6.7+): the first write to a protected
page only clears its protection, in the kernel, with no handler thread and no signal;
PAGEMAP_SCAN then reports which pages lost it and protects them again, in one call.
Every write through this process's page tables counts, whoever makes it: Python, C,
NumPy, another thread, a read(2), another process's process_vm_writev.

What the page tables cannot see is left to the hash: memory that another process or
the page cache can change under the same pages (anything but private anonymous memory:
a file's or a memfd's mapping, `share_memory_()`, `torch.load(mmap=True)`), memory a
device writes by DMA (CUDA's pinned memory; and every tensor while any memory of the
process is pinned: see WriteWatch.digest_pass), GPU tensors, tensors whose bytes are a
copy (not contiguous), small ones (a hash costs what asking would), and kernels or
sandboxes without userfaultfd or PROCMAP_QUERY (Linux 6.11+). Two tensors sharing
memory (views) are watched as one of them; the other is hashed.

A digest is made of the digests of the bytes' pieces, counted from the tensor's first
byte (not from a page: the kernel and the workers hold the same bytes at other
addresses): its first and last 64 KiB, and 1 MiB chunks between them, so a written page
costs its pieces' hashes again, not the tensor's. A scan reports a page's writes once,
to whichever tensor asks first, so each page is watched for one tensor only: a tensor's
own pages are those wholly inside it. The bytes it has on the pages at its two ends,
which it shares with its neighbours, lie in its first and last 64 KiB, hashed every time.

A piece is taken as unchanged only when the tensor still has the storage it had when it
was hashed (the memory was never freed and taken again), its pages were protected
before its bytes were read, and none of them has been written since. What it costs: the
first write to a protected page after a hash is a minor fault (~0.3 us per 4 KiB page
here, once per cell), protecting written pages again ~16 us per MiB, and a tensor that
changes at every hash (one being trained) is left unprotected (see WriteWatch).
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import os
import platform
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
from torch.multiprocessing.reductions import StorageWeakRef

CHUNK = 1 << 20  # also the smallest tensor watched: below it a hash costs what asking would
EDGE = 64 << 10  # a tensor's first and last bytes, on pages it may share (pages are at most this)

_SYSCALL_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
# Without CAP_SYS_PTRACE (vm.unprivileged_userfaultfd=0 by default) only this mode is
# open to users; it changes nothing for asynchronous write protection, whose faults
# never reach the file descriptor.
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_UFFD_FEATURE_WP_UNPOPULATED = 1 << 13  # pages never touched are protected too
_UFFD_FEATURE_WP_ASYNC = 1 << 15
_UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
_UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)
_UFFDIO_REGISTER_MODE_WP = 1 << 1
_UFFDIO_WRITEPROTECT = 0xC018AA06  # _IOWR(0xAA, 0x06, struct uffdio_writeprotect)
_PAGEMAP_SCAN = 0xC0606610  # _IOWR('f', 16, struct pm_scan_arg)
_PM_SCAN_WP_MATCHING = 1 << 0  # protect the pages found
_PM_SCAN_CHECK_WPASYNC = 1 << 1  # fail where a page is not under asynchronous protection
_PAGE_IS_WRITTEN = 1 << 1
_PROCMAP_QUERY = 0xC0686611  # _IOWR('f', 17, struct procmap_query)
_PROCMAP_QUERY_LAYOUT = "9Q4I2Q"  # struct procmap_query, 104 bytes
_VMA_SHARED = 1 << 3
_PAGE = os.sysconf("SC_PAGE_SIZE")


def digest(array: np.ndarray) -> bytes:
    """The digest of a flat uint8 array's bytes: their xxh3-128, or past one CHUNK, the
    xxh3-128 of their pieces' (see `_pieces`)."""
    if array.nbytes <= CHUNK:
        return xxhash.xxh3_128(array.data).digest()
    starts = _pieces(array.nbytes)
    return _combine(piece_digests(array, starts, range(len(starts))))


def _pieces(length: int) -> list[int]:
    """Where the pieces of `length` (> CHUNK) bytes start: the first EDGE bytes, chunks,
    the last EDGE bytes."""
    return [0, *range(EDGE, length - EDGE, CHUNK), length - EDGE]


def piece_digests(array: np.ndarray, starts: list[int], indexes: Sequence[int]) -> list[bytes]:
    view, ends = array.data, [*starts[1:], array.nbytes]
    return [xxhash.xxh3_128(view[starts[i]: ends[i]]).digest() for i in indexes]


def _combine(pieces: list[bytes]) -> bytes:
    return xxhash.xxh3_128(b"".join(pieces)).digest()


class _PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class _Pages:
    """This process's userfaultfd (asynchronous write protection), its pagemap, and its
    maps (which mapping holds an address)."""

    def __init__(self) -> None:
        number = _SYSCALL_USERFAULTFD.get(platform.machine())
        if not sys.platform.startswith("linux") or number is None:
            raise OSError(f"no userfaultfd on {sys.platform} {platform.machine()}")
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        fd = libc.syscall(ctypes.c_long(number), ctypes.c_long(os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY))
        if fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"userfaultfd: {os.strerror(errno)}")
        self.pid = os.getpid()
        self.fd = fd
        self.pagemap = self.maps = self.status = -1
        try:
            # Fails (EINVAL) where the kernel lacks either feature.
            fcntl.ioctl(fd, _UFFDIO_API, bytearray(struct.pack(
                "QQQ", _UFFD_API, _UFFD_FEATURE_WP_ASYNC | _UFFD_FEATURE_WP_UNPOPULATED, 0)), True)
            self.pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            self.maps = os.open("/proc/self/maps", os.O_RDONLY | os.O_CLOEXEC)
            self.status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
            self._found = (_PageRegion * 256)()
            self.private_anonymous(self._found_address(), self._found_address() + 1)  # ENOTTY before 6.11
        except OSError:
            self.close()
            raise

    def _found_address(self) -> int:
        return ctypes.addressof(self._found)

    def register(self, start: int, end: int) -> None:
        fcntl.ioctl(self.fd, _UFFDIO_REGISTER,
                    bytearray(struct.pack("QQQQ", start, end - start, _UFFDIO_REGISTER_MODE_WP, 0)), True)

    def unprotect(self, start: int, end: int) -> None:
        fcntl.ioctl(self.fd, _UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", start, end - start, 0)), True)

    def written_since(self, start: int, end: int) -> list[tuple[int, int]]:
        """The regions of [start, end) written since this last asked (or since they were
        registered); every page in it is protected again when this returns. Raises where
        a page of it is not registered."""
        written: list[tuple[int, int]] = []
        while start < end:
            arg = bytearray(struct.pack(
                "12Q", 96, _PM_SCAN_WP_MATCHING | _PM_SCAN_CHECK_WPASYNC, start, end, 0,
                self._found_address(), len(self._found), 0, 0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN))
            found = fcntl.ioctl(self.pagemap, _PAGEMAP_SCAN, arg, True)
            written.extend((self._found[i].start, self._found[i].end) for i in range(found))
            walked = struct.unpack_from("Q", arg, 32)[0]  # short of `end` when the regions filled up
            if walked <= start:
                raise OSError("PAGEMAP_SCAN made no progress")
            start = walked
        return written

    def private_anonymous(self, start: int, end: int) -> bool:
        """Whether [start, end) lies in private anonymous mappings of ordinary pages: no
        file, memfd or shared memory behind it (whose bytes can change without a write
        through this process's page tables), no hugetlb pages."""
        while start < end:
            arg = bytearray(struct.pack(_PROCMAP_QUERY_LAYOUT, 104, 0, start, *[0] * 12))
            fcntl.ioctl(self.maps, _PROCMAP_QUERY, arg, True)
            _, _, _, _, vma_end, flags, page_size, _, inode, major, minor, _, _, _, _ = struct.unpack(
                _PROCMAP_QUERY_LAYOUT, arg)
            if flags & _VMA_SHARED or inode or major or minor or page_size != _PAGE:
                return False
            start = vma_end
        return True

    def pinned(self) -> bool:
        """Whether any of this process's memory is pinned (VmPin): the kernel or a device
        may then write its pages past the page tables (io_uring's registered buffers, RDMA
        memory regions)."""
        status = os.pread(self.status, 1 << 16, 0)
        at = status.find(b"VmPin:")
        return at < 0 or int(status[at + 6: status.index(b"kB", at)]) > 0

    def close(self) -> None:
        for fd in (self.status, self.maps, self.pagemap, self.fd):  # the kernel drops every protection with fd
            if fd >= 0:
                os.close(fd)
        self.status = self.maps = self.pagemap = self.fd = -1


@dataclass
class _Hashed:
    storage: StorageWeakRef  # the memory's owner when it was hashed: a freed one expires
    pieces: list[bytes]
    changes: int = 0  # how many hashes in a row found the bytes changed

    def holds(self, storage) -> bool:
        return not self.storage.expired() and self.storage.cdata == storage._cdata


class WriteWatch:
    """Digests of tensors' bytes, whose pieces are hashed again only once written.

    A tensor that every cell changes (one being trained) is left unprotected after
    `HOT_AFTER` changes in a row: each of its pages would take a fault every cell for
    nothing. It is hashed whole, as without the watch, until a hash finds it unchanged;
    then it is protected again and hashed once more, under protection.
    """

    HOT_AFTER = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: _Pages | None = None
        if _enabled:
            try:
                self._pages = _Pages()
            except OSError:
                pass
        self._hashed: dict[tuple[int, int], _Hashed] = {}  # span (address, length) -> its pieces
        self._owned = _Owned()  # the pages watched for each span
        self._trusted = False  # see digest_pass
        self.hashed_bytes = 0  # bytes read to hash them, for a look at what it saves

    @property
    def watching(self) -> bool:
        return self._pages is not None

    @contextmanager
    def digest_pass(self) -> Iterator[None]:
        """Around the digests of one pass (a plan's value, a pull-back): whether the page
        tables can be trusted for them, asked once for them all (~30 us) before and after.
        A page pinned for a device (io_uring's registered buffers, RDMA) is written past
        them; pinning it takes a write fault, so what matters is memory that stays pinned
        while it is scanned and protected again: while any is, at either end of a pass,
        nothing stored is trusted any more. Outside a pass every tensor is hashed."""
        self._check_pins(start=True)
        try:
            yield
        finally:
            self._check_pins(start=False)

    def _check_pins(self, start: bool) -> None:
        with self._lock:
            try:
                pinned = self._pages is None or self._pages.pinned()
            except OSError:
                pinned = True
            if pinned:
                self._hashed.clear()
            self._trusted = start and not pinned

    def digest(self, tensor: torch.Tensor, array: np.ndarray) -> bytes:
        """The digest of `array`, the bytes of `tensor` (tensorbytes.tensor_bytes)."""
        span = self._span(tensor, array)
        if span is None or not self._trusted:
            self.hashed_bytes += array.nbytes
            return digest(array)
        starts = _pieces(span[1])
        every = range(len(starts))
        with self._lock:
            storage = tensor.untyped_storage()
            # Out while it is hashed: a hash that raises (an interrupt) leaves nothing to trust.
            hashed = self._hashed.pop(span, None)
            if hashed is not None and not hashed.holds(storage):
                hashed = None
            if hashed is not None and hashed.changes >= self.HOT_AFTER:  # not protected
                pieces = self._hash(array, starts, every)
                if pieces != hashed.pieces:
                    hashed.pieces = pieces
                    self._hashed[span] = hashed
                    return _combine(pieces)
                hashed = None  # unchanged at last: protected below, and hashed under protection
            # Protected before the bytes are read: a write while they are hashed counts.
            written = self._protect(span)
            if written is None:
                return _combine(self._hash(array, starts, every))
            stale: Sequence[int] = every if hashed is None else _pieces_in(written, span[0], starts)
            pieces = list(hashed.pieces) if hashed is not None else [b""] * len(starts)
            changed = False
            for i, piece in zip(stale, self._hash(array, starts, stale)):
                changed |= piece != pieces[i]
                pieces[i] = piece
            changes = hashed.changes + 1 if hashed is not None and changed else 0
            self._hashed[span] = _Hashed(StorageWeakRef(storage), pieces, changes)
            return _combine(pieces)

    def will_write(self, tensor: torch.Tensor) -> None:
        """`tensor`'s bytes are about to be overwritten whole (an update received): its
        pages lose their protection now, in one call, not in a fault each (which costs
        several times more). To the next hash they are written pages, as they will be."""
        span = self._span(tensor)
        if span is None:
            return
        with self._lock:
            hashed = self._hashed.get(span)
            pages = self._owned.get(span)
            if (hashed is None or pages is None or hashed.changes >= self.HOT_AFTER
                    or not hashed.holds(tensor.untyped_storage()) or self._pages is None):
                return  # not protected for this tensor
            try:
                self._pages.unprotect(*pages)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._pages is not None:
                self._pages.close()
                self._pages = None
            self._hashed.clear()
            self._owned.clear()

    def _hash(self, array: np.ndarray, starts: list[int], indexes: Sequence[int]) -> list[bytes]:
        ends = [*starts[1:], array.nbytes]
        self.hashed_bytes += sum(ends[i] - starts[i] for i in indexes)
        return piece_digests(array, starts, indexes)

    def _span(self, tensor: torch.Tensor, array: np.ndarray | None = None) -> tuple[int, int] | None:
        """(address, length) of the tensor's bytes where they can be watched; else None."""
        if (self._pages is None or self._pages.pid != os.getpid() or tensor.device.type != "cpu"
                or tensor.layout is not torch.strided or not tensor.is_contiguous()):
            return None
        span = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if span[1] <= CHUNK or (array is not None and (array.ctypes.data, array.nbytes) != span):
            return None  # small, or the array is a copy
        if torch.cuda.is_initialized() and tensor.is_pinned():
            return None  # written by the GPU's DMA, past the page tables
        return span

    def _protect(self, span: tuple[int, int]) -> list[tuple[int, int]] | None:
        """The regions of the span written since its pages were last protected (all of
        it the first time), protecting them all; None where it cannot be watched."""
        assert self._pages is not None
        pages = self._owned.get(span)
        if pages is not None:
            try:
                return [*self._pages.written_since(*pages), *_shared_ends(span, pages)]
            except OSError:  # mapped anew since (no longer registered): claimed again below
                self._owned.release(span)
        pages = _pages_inside(span)
        # Asked first, so that memory that cannot be watched is never protected for nothing.
        if pages is None or not self._pages.private_anonymous(*pages):
            return None
        if not self._owned.claim(span, pages, self._alive):
            return None
        try:
            self._pages.register(*pages)
            self._pages.written_since(*pages)
            # Asked again once registered: a mapping that replaces this one later is not registered.
            if not self._pages.private_anonymous(*pages):
                raise OSError("not private anonymous memory")
        except OSError:
            self._owned.release(span)
            return None
        return [(span[0], span[0] + span[1])]  # all of it

    def _alive(self, span: tuple[int, int]) -> bool:
        hashed = self._hashed.get(span)
        if hashed is not None and not hashed.storage.expired():
            return True
        self._hashed.pop(span, None)  # its tensor died, or its hash was interrupted
        return False


class _Owned:
    """Which pages are watched for which span: ranges that never overlap (a scan reports
    a write once, to one of them), sorted, so that a claim looks at its neighbours only."""

    # Each watched span splits its mapping in up to three (the kernel allows 65530 per process).
    MOST = 10000

    def __init__(self) -> None:
        self._pages: dict[tuple[int, int], tuple[int, int]] = {}
        self._sorted: list[tuple[int, int, tuple[int, int]]] = []  # (start, end, span)

    def get(self, span: tuple[int, int]) -> tuple[int, int] | None:
        return self._pages.get(span)

    def claim(self, span: tuple[int, int], pages: tuple[int, int], alive: Callable[[tuple[int, int]], bool]) -> bool:
        """Watch `pages` for `span`, unless spans `alive` says live hold some of them."""
        at = bisect.bisect_left(self._sorted, (pages[1],))
        while at > 0 and self._sorted[at - 1][1] > pages[0]:  # the ranges before it that overlap
            other = self._sorted[at - 1][2]
            if alive(other):
                return False
            self.release(other)
            at -= 1
        if len(self._pages) >= self.MOST:
            return False
        self._pages[span] = pages
        bisect.insort(self._sorted, (*pages, span))
        return True

    def release(self, span: tuple[int, int]) -> None:
        pages = self._pages.pop(span, None)
        if pages is not None:
            self._sorted.pop(bisect.bisect_left(self._sorted, (*pages, span)))

    def clear(self) -> None:
        self._pages.clear()
        self._sorted.clear()


def _pages_inside(span: tuple[int, int]) -> tuple[int, int] | None:
    """The pages wholly inside the span; the others hold other memory too."""
    start, end = -(-span[0] // _PAGE) * _PAGE, (span[0] + span[1]) // _PAGE * _PAGE
    return (start, end) if start < end else None


def _shared_ends(span: tuple[int, int], pages: tuple[int, int]) -> list[tuple[int, int]]:
    """The span's bytes on pages it shares: taken as written every time."""
    return [(a, b) for a, b in ((span[0], pages[0]), (pages[1], span[0] + span[1])) if a < b]


def _pieces_in(regions: list[tuple[int, int]], address: int, starts: list[int]) -> list[int]:
    """The indexes of the pieces (`starts`, of bytes at `address`) the address regions touch."""
    return sorted({i for start, end in regions
                   for i in range(max(0, bisect.bisect_right(starts, start - address) - 1),
                                  bisect.bisect_left(starts, end - address))})


_watch: WriteWatch | None = None
_watch_made = threading.Lock()
_enabled = True  # ScaleSession.write_watch, in the kernel and (with each cell) on the workers


def enable(on: bool) -> None:
    """Turn the watch on or off in this process (off: every tensor is hashed whole)."""
    global _enabled, _watch
    if on == _enabled:
        return
    with _watch_made:
        _enabled = on
        if _watch is not None:  # made under the other setting: the next use makes one anew
            _watch.close()
            _watch = None


def watch() -> WriteWatch:
    """This process's watch (one userfaultfd for the process), made on first use."""
    global _watch
    with _watch_made:
        if _watch is None:
            _watch = WriteWatch()
        return _watch


def will_write(tensor: torch.Tensor) -> None:
    """See WriteWatch.will_write; nothing where this process never hashed."""
    if _watch is not None and isinstance(tensor, torch.Tensor):
        _watch.will_write(tensor)


def _forget_in_child() -> None:
    # A forked child's memory is not protected (its mappings left the parent's
    # userfaultfd), and its pagemap descriptor reads the parent's: it makes its own
    # watch if it hashes.
    global _watch, _watch_made
    _watch_made = threading.Lock()
    if _watch is not None and _watch._pages is not None:
        try:
            _watch._pages.close()
        except OSError:
            pass
        _watch._pages = None
        _watch._hashed.clear()
        _watch._owned.clear()
    _watch = None


os.register_at_fork(after_in_child=_forget_in_child)
