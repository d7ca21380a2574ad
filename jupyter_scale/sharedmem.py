"""Large frames through shared memory, when the workers share the kernel's machine.

The engines carry a cell's frames in their own messages: ipyparallel through its
controller, Dask from rank 0's worker to the others, at a few hundred MB/s per worker here.
When every worker can read the kernel's memory files (the embedded cluster, or any
cluster on this machine), a frame of a megabyte or more goes through one instead: the
sender writes it once whatever the number of readers, each reader copies it once out of
a private mapping, and the engine's message carries only where it lies.

The file is a memfd: anonymous memory with a file descriptor, which readers open through
`/proc/<sender pid>/fd/<fd>` (the same user on the same machine only). It has no name,
so nothing can be left behind: its memory goes when the sender closes it or dies, even by
SIGKILL, and `/dev/shm`'s size limit (64 MB in a default Docker container) does not apply.
Each sender keeps its file and writes every cell's frames into it again: memory already
handed out is written several times faster than fresh memory on a VM. A file larger than
`keep` bytes is emptied once its readers are done.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

MIN_FRAME = 1 << 20  # smaller frames ride the engine's message: a file would cost more
_WRITE_CHUNK = 1 << 30  # Linux writes at most ~2 GiB per call


def available() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class SharedFrames:
    """One sender's memory file of frames, written again by every `pack`."""

    def __init__(self, keep: int = 1 << 30):
        self.keep = keep
        self._fd = os.memfd_create("jupyter_scale-frames", os.MFD_CLOEXEC)
        self._size = 0
        self._close = weakref.finalize(self, os.close, self._fd)

    def pack(self, frames: Sequence, tensor_frames: Sequence[bool] = (),
             min_frame: int = MIN_FRAME) -> tuple[list, dict | None]:
        """Write every frame of `min_frame` bytes or more into the file.

        Returns the frames with those replaced by empty bytes, and the descriptor the
        readers need (None when no frame was large enough). `tensor_frames[i]` marks a
        tensor's bytes, which the receiver copies into its tensors itself; a reader gets a
        copy of its own of any other frame.
        """
        views = [memoryview(f).cast("B") for f in frames]
        moved = [i for i, v in enumerate(views) if v.nbytes >= min_frame]
        if not moved:
            return list(frames), None
        layout, offset = [], 0
        try:
            for i in moved:
                view = views[i]
                for start in range(0, view.nbytes, _WRITE_CHUNK):
                    chunk = view[start:start + _WRITE_CHUNK]
                    written = 0
                    while written < chunk.nbytes:
                        written += os.pwrite(self._fd, chunk[written:], offset + start + written)
                is_tensor = i < len(tensor_frames) and tensor_frames[i]
                layout.append((i, offset, view.nbytes, not is_tensor))
                offset += view.nbytes
        except OSError:
            # Out of memory, most likely: what was written is of no use (the frames go
            # through the engine), and no reader maps the file while it is written.
            os.ftruncate(self._fd, 0)
            self._size = 0
            raise
        self._size = max(self._size, offset)
        out = list(frames)
        for i in moved:
            out[i] = b""
        return out, {"pid": os.getpid(), "fd": self._fd, "size": offset, "frames": layout}

    def trim(self) -> None:
        """The readers are done: give the memory back if the file is larger than `keep`."""
        if self._close.alive and self._size > self.keep:
            os.ftruncate(self._fd, 0)
            self._size = 0

    def close(self) -> None:
        self._close()


@contextmanager
def unpacked(frames: Sequence, descriptor: dict | None) -> Iterator[list]:
    """The frames with the moved ones read back from the sender's file, for the block.

    Frames marked for copying are the reader's own bytearrays; the others are views of a
    private (copy-on-write) mapping, valid inside the block only: the receiver copies them
    into its tensors.
    """
    if not descriptor:
        yield list(frames)
        return
    with open(f"/proc/{descriptor['pid']}/fd/{descriptor['fd']}", "rb") as file:
        mapping = mmap.mmap(file.fileno(), descriptor["size"], access=mmap.ACCESS_COPY)
    out, views = list(frames), []
    try:
        whole = memoryview(mapping)
        views.append(whole)
        for i, offset, size, copy in descriptor["frames"]:
            view = whole[offset:offset + size]
            views.append(view)
            out[i] = bytearray(view) if copy else view
        yield out
    finally:
        out.clear()
        try:
            for view in reversed(views):
                view.release()
            mapping.close()
        except BufferError:  # something still holds a view: the mapping goes with it
            pass


def probe(frames_out: SharedFrames) -> tuple[dict, bytes]:
    """A token in `frames_out`'s file, for `check_probe` in another process."""
    token = os.urandom(16)
    descriptor = frames_out.pack([token], min_frame=0)[1]
    assert descriptor is not None  # min_frame=0 moves every frame: there is a descriptor
    return descriptor, token


def check_probe(descriptor: dict, token: bytes) -> bool:
    """Does this process read the sender's file (same machine, same user, /proc visible)?"""
    try:
        with unpacked([b""], descriptor) as frames:
            return bytes(frames[0]) == token
    except (OSError, ValueError):  # another machine (no such process, or another one's fd)
        return False
