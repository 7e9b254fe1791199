"""Storage boundary: :class:`StorageWriter` and :class:`StorageReader` (local/shared POSIX filesystem)."""
from .base import StorageReader, StorageWriter
from .posix import PosixStorage

__all__ = ["StorageReader", "StorageWriter", "PosixStorage"]
