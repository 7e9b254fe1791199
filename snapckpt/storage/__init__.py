"""Storage boundary: :class:`StorageWriter` and :class:`StorageReader` (local/shared POSIX filesystem)."""
from snapckpt.storage.base import StorageReader, StorageWriter
from snapckpt.storage.posix import PosixStorage

__all__ = ["StorageReader", "StorageWriter", "PosixStorage"]
