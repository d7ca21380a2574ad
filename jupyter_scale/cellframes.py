"""The kernel's shared-memory file for the large frames of its cells (see sharedmem).

Taken with the first group whose workers may read it, and kept across cells and groups:
each cell writes its shipment's large frames into it again. Once every rank of the cell
answered, none reads it any more and it may shrink; a rank that never answered may still
read it, so the kernel then leaves that file to its readers and takes a new one. It goes
with the cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from . import sharedmem

log = logging.getLogger(__name__)


class KernelFrames:
    def __init__(self) -> None:
        self.file: sharedmem.SharedFrames | None = None

    def open(self, keep: int) -> None:
        """Take a file (unless one is held), where this machine has them; a file larger than
        `keep` bytes is emptied once its readers are done."""
        if self.file is None and sharedmem.available():
            self.file = sharedmem.SharedFrames(keep)

    def pack(self, frames: list, tensor_frames: Sequence[bool], instead: str) -> tuple[list, dict | None]:
        """The frames with the large ones moved into the file, and where they lie; should
        that fail (out of memory), this cell's frames go through `instead`, the engine."""
        if self.file is not None:
            try:
                return self.file.pack(frames, tensor_frames)
            except OSError as exc:
                log.warning("shared memory failed (%s); sending through %s", exc, instead)
        return frames, None

    def done(self, answered: bool, keep: int) -> None:
        """The cell's wait ended: `answered` when every rank answered (`keep`: as for `open`)."""
        if self.file is None:
            return
        if answered:
            self.file.trim()
        else:
            self.file.close()  # its memory stays while a reader maps it
            self.file = sharedmem.SharedFrames(keep)

    def close(self) -> None:
        if self.file is not None:  # its memory goes with it
            self.file.close()
            self.file = None
