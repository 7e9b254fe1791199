"""The storage seams the persister and the loader talk to.

A DISK save calls, in order, on the persister of each node:

1. ``makedirs(partial_dir)`` (every rank's persister; racing creators are fine);
2. per file of the rank: ``open_write(path)`` -> write -> ``fsync_file`` -> close;
3. ``open_dir(marker_dir)``, ``write_atomic(part_marker, sync_dir=False)`` (the rank's part is complete:
   the committer may count it and rename the partial directory at once), then the handle's ``fsync``
   (durable whatever the directory's name by then);
4. committer only: ``write_atomic(manifest)``, ``fsync_dir(partial_dir)``, ``rename(partial_dir, final)``,
   ``fsync_dir(checkpoint_dir)``, ``write_atomic(tracker)``, then retention's ``remove_tree`` calls.

A load calls ``listdir``/``read_bytes``/``open_read`` only. Paths are plain strings joined with ``/``.
Implementations raise ``OSError`` subclasses with ``errno`` set; ``remove_tree`` of a path already gone
is not an error.
"""
from __future__ import annotations

import abc
from typing import BinaryIO, List


class DirHandle(abc.ABC):
    """An open directory (:meth:`StorageWriter.open_dir`), fsynced through the handle: a rename of the
    directory (or of a parent) after it was opened does not change which directory is synced."""

    @abc.abstractmethod
    def fsync(self) -> None:
        """Make the directory's entries durable.

        Raises:
            OSError: from fsync(2), ``errno`` unchanged (no file name: the caller adds the path).
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the handle (idempotent)."""

    def __enter__(self) -> "DirHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StorageWriter(abc.ABC):
    """Write side of the storage boundary (see the module docstring for the call sequence)."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents; an existing directory is fine."""

    @abc.abstractmethod
    def open_write(self, path: str) -> BinaryIO:
        """Open a new file for writing (truncating); the caller closes it."""

    @abc.abstractmethod
    def fsync_file(self, fileobj: BinaryIO) -> None:
        """Make the file's data durable."""

    @abc.abstractmethod
    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries durable."""

    @abc.abstractmethod
    def open_dir(self, path: str) -> DirHandle:
        """Open directory ``path`` for a later fsync of its entries through the handle: for entries made
        visible to another thread or process that may rename the directory before the fsync (a part marker:
        the committer renames the partial directory once it counts every part).

        Raises:
            OSError: ``path`` cannot be opened (``FileNotFoundError``, names ``path``).
        """

    @abc.abstractmethod
    def write_atomic(self, path: str, data: bytes, *, sync_dir: bool = True) -> None:
        """Replace ``path`` with ``data`` atomically (temporary file, fsync, rename, directory fsync;
        ``sync_dir=False``: no directory fsync, the caller fsyncs the directory once for several files)."""

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` atomically."""

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None:
        """Delete a directory tree; a path already gone is not an error."""

    @abc.abstractmethod
    def free_bytes(self, path: str) -> int:
        """Free bytes on the filesystem holding ``path``."""


class StorageReader(abc.ABC):
    """Read side of the storage boundary."""

    @abc.abstractmethod
    def listdir(self, path: str) -> List[str]:
        """Names in a directory (``[]`` if it does not exist)."""

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """Whole content of a small file."""

    @abc.abstractmethod
    def open_read(self, path: str) -> BinaryIO:
        """Open a file for reading."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size of a file in bytes (``FileNotFoundError`` if missing)."""

    @abc.abstractmethod
    def isdir(self, path: str) -> bool:
        """Whether ``path`` is a directory."""
