"""The export's job directory, safe from the machine's other users.

A job directory holds code its user will run (`bash job/run.sh`, `sbatch`, an image built
from it) and a pickle its script loads (`values.pt`: loading it runs code). Whoever can
write into the directory, or replace it, can make the user run their code. So:

- the directory must be the user's own and writable by no one else (its group and others:
  no `w`), and so must each directory above it up to the nearest one the user owns (one
  writable by others is accepted only with the sticky bit, as /tmp has it, where nobody can
  rename or remove another's entries). Anything else is refused in one line, before
  anything is written;
- a directory it creates is 0700, a file 0600, a script 0700;
- every file is written under a fresh name and renamed over the old one, by the
  directory's descriptor: a symlink planted in place of run.sh or train.py is replaced,
  never followed, and a half-written file never stands under the real name;
- an earlier export is recognised by its train.py only when that is a regular file (read
  without following a symlink).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .export import ExportError

_OPEN_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_MODE, SCRIPT_MODE, DIRECTORY_MODE = 0o600, 0o700, 0o700


def _writers(mode: int) -> str:
    """Who besides the owner can write, from a directory's mode ('' when no one)."""
    return " and ".join(who for who, bit in (("its group", stat.S_IWGRP), ("other users", stat.S_IWOTH)) if mode & bit)


def _check_above(path: Path) -> None:
    """Each directory above `path` (a resolved path), nearest first, up to the first the
    user owns: none may let another user rename or replace what it holds."""
    me = os.geteuid()
    for parent in path.parents:
        info = os.stat(parent)
        if info.st_uid not in (me, 0):
            raise ExportError(f"cannot export to {path}: {parent} belongs to another user (uid {info.st_uid}), who "
                              "could replace what it holds; export under a directory of your own")
        writers = _writers(info.st_mode)
        if writers and not info.st_mode & stat.S_ISVTX:
            raise ExportError(f"cannot export to {path}: {parent} is writable by {writers}, who could replace "
                              f"what it holds; export under a directory only you can write (or chmod go-w {parent})")
        if info.st_uid == me:
            return


def _check_own(path: str | os.PathLike, fd: int) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        raise ExportError(f"cannot export to {path}: it belongs to another user (uid {info.st_uid}), who could change "
                          "the job before you run it; name a directory of your own")
    writers = _writers(info.st_mode)
    if writers:
        raise ExportError(f"cannot export to {path}: it is writable by {writers}, who could change the job before "
                          f"you run it; chmod go-w {path} first, or name a new directory")


class JobDirectory:
    """An export's directory, open by descriptor; see the module's docstring."""

    def __init__(self, path: Path, fd: int, created: bool):
        self.path, self.fd, self.created = path, fd, created

    @classmethod
    def open(cls, directory: str | os.PathLike) -> JobDirectory:
        """The directory, checked, and made (with any missing parents) when it does not exist.
        Raises ExportError, having written nothing, when it is not safe to write."""
        path = Path(os.path.realpath(directory))  # a symlink the user made is followed, and the target checked
        missing = []
        existing = path
        while not os.path.lexists(existing):
            missing.append(existing.name)
            existing = existing.parent
        if not existing.is_dir():
            raise ExportError(f"cannot export to {directory}: {existing} is not a directory")
        if missing:
            _check_above(existing / "_")  # the nearest existing directory and those above it
        try:
            fd = os.open(existing, _OPEN_DIRECTORY)
        except OSError as exc:
            raise ExportError(f"cannot export to {directory}: {exc.strerror}") from None
        try:
            if not missing:
                _check_own(directory, fd)
                _check_above(path)
            for name in reversed(missing):
                try:
                    os.mkdir(name, DIRECTORY_MODE, dir_fd=fd)
                except FileExistsError:  # made by someone else meanwhile: checked as any other
                    pass
                inner = os.open(name, _OPEN_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = inner
                _check_own(directory, fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, created=bool(missing))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> JobDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def head(self, name: str, size: int = 2000) -> str | None:
        """The first `size` bytes of the regular file `name` as text; None for anything else
        (missing, a symlink, a directory)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.fd)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return file.read(size).decode(errors="replace")

    @contextlib.contextmanager
    def create(self, name: str, mode: int = FILE_MODE) -> Iterator[BinaryIO]:
        """A new file `name` to write: it replaces what stood under the name (file or symlink)
        once written whole."""
        temporary = f".{name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(temporary, _NEW_FILE, mode, dir_fd=self.fd)
        try:
            os.fchmod(fd, mode)  # whatever the umask
            with os.fdopen(fd, "wb") as file:
                yield file
            try:
                os.rename(temporary, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except IsADirectoryError:
                raise ExportError(f"cannot export: {self.path / name} is a directory; move it away") from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary, dir_fd=self.fd)
            raise

    def write(self, name: str, data: bytes | str, mode: int = FILE_MODE) -> None:
        with self.create(name, mode) as file:
            file.write(data.encode() if isinstance(data, str) else data)

    def remove(self, name: str) -> None:
        """Remove the file (or symlink) `name`, if there is one; never what a symlink points to."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def size(self, name: str) -> int:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_size

    def subdirectory(self, name: str) -> JobDirectory:
        """The directory `name` in this one, made 0700 when missing; a symlink or a file in its
        place is removed first."""
        try:
            fd = os.open(name, _OPEN_DIRECTORY, dir_fd=self.fd)
        except FileNotFoundError:
            fd = -1
        except OSError:  # a symlink (ELOOP) or a file (ENOTDIR) stands there
            os.unlink(name, dir_fd=self.fd)
            fd = -1
        if fd < 0:
            os.mkdir(name, DIRECTORY_MODE, dir_fd=self.fd)
            fd = os.open(name, _OPEN_DIRECTORY, dir_fd=self.fd)
        try:
            _check_own(self.path / name, fd)
        except BaseException:
            os.close(fd)
            raise
        return JobDirectory(self.path / name, fd, created=False)

    def copy_in(self, source: Path, skip: tuple[str, ...] = ("__pycache__",)) -> None:
        """Copy the file or the directory tree `source` (the notebook's own module) in, under
        its name."""
        if source.is_dir():
            with self.subdirectory(source.name) as inner:
                for entry in sorted(source.iterdir()):
                    if entry.name not in skip and (entry.is_dir() or entry.is_file()):
                        inner.copy_in(entry, skip)
        else:
            self.write(source.name, source.read_bytes())
