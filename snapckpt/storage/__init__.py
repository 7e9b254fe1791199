"""Storage boundary: :class:`StorageWriter` and :class:`StorageReader`, built by :func:`open_storage`
(local/shared POSIX filesystem today)."""
from snapckpt.storage.base import StorageReader, StorageWriter
from snapckpt.storage.factory import open_storage
from snapckpt.storage.posix import PosixStorage

__all__ = ["StorageReader", "StorageWriter", "PosixStorage", "open_storage"]
