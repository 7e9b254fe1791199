"""Local or shared POSIX filesystem storage."""
from __future__ import annotations

import errno
import os
import shutil
import uuid
from typing import BinaryIO, List

from snapckpt.storage.direct import open_direct
from snapckpt.storage.base import DirHandle, StorageReader, StorageWriter

__all__ = ["PosixStorage"]


class _PosixDir(DirHandle):
    """A directory descriptor (``fd`` -1: ``fsync`` disabled, nothing was opened)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fsync(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PosixStorage(StorageWriter, StorageReader):
    """:class:`StorageWriter` and :class:`StorageReader` over ``os`` calls.

    Args:
        fsync: when false, ``fsync_file``/``fsync_dir`` do nothing (throwaway tests only).
    """

    def __init__(self, fsync: bool = True) -> None:
        self.fsync = fsync

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def open_write(self, path: str) -> BinaryIO:
        # Direct I/O (bounce buffer, aligned writes, no page cache) where the filesystem supports it.
        return open_direct(path)

    def fsync_file(self, fileobj: BinaryIO) -> None:
        fileobj.flush()
        if self.fsync:
            os.fsync(fileobj.fileno())

    def fsync_dir(self, path: str) -> None:
        if not self.fsync:
            return
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def open_dir(self, path: str) -> DirHandle:
        if not self.fsync:
            return _PosixDir(-1)
        return _PosixDir(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))

    def write_atomic(self, path: str, data: bytes, *, sync_dir: bool = True) -> None:
        parent = os.path.dirname(path) or "."
        tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                self.fsync_file(f)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if sync_dir:
            self.fsync_dir(parent)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def remove_tree(self, path: str) -> None:
        """Delete a directory tree; a symbolic link is removed itself, never followed (a link planted
        where a checkpoint directory is expected must not make snapckpt delete files elsewhere)."""
        if os.path.islink(path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return

        def onexc(func, p, exc):
            if isinstance(exc, FileNotFoundError):
                return
            raise exc

        try:
            shutil.rmtree(path, onerror=lambda f, p, ei: onexc(f, p, ei[1]))
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise

    def free_bytes(self, path: str) -> int:
        return shutil.disk_usage(path).free

    def listdir(self, path: str) -> List[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)
