"""The one place storage is built: every reader and writer of checkpoints gets its storage here.

``open_storage(location)`` returns the :class:`~snapckpt.storage.base.StorageWriter` /
:class:`~snapckpt.storage.base.StorageReader` for a checkpoint location. Today that is a local or shared
POSIX directory (:class:`~snapckpt.storage.posix.PosixStorage`); a location with a URL scheme
(``s3://``, ``gs://``, ``file://``...) is refused with :class:`~snapckpt.errors.CheckpointDirError`
instead of silently creating a local folder named ``s3:`` (case H5). The core's Checkpointer recognises a
URL first (:func:`remote_only_url`): remote-only mode, through :class:`~snapckpt.storage.remote.RemoteStore`.

The persister's writes of one part (or of a commit) pass ``part=(rank, step)``: only those storages can be
swapped for the test toolkit's failing storage when ``SNAPCKPT_FAULT_STORAGE`` is set
(:mod:`snapckpt._testing.faulty_storage`, imported only then).
"""
from __future__ import annotations

import importlib
import os
from typing import Optional, Tuple

from snapckpt._internal import env as _env
from snapckpt.errors import CheckpointDirError
from snapckpt.storage.posix import PosixStorage
from snapckpt.storage.urls import is_remote_url, shown_url, url_scheme

__all__ = ["open_storage", "check_location", "remote_only_url"]


def check_location(location: "str | os.PathLike[str]") -> str:
    """Return ``location`` as a path string, or refuse a URL.

    Raises:
        CheckpointDirError: ``location`` has a URL scheme (``s3://bucket/run``...): object storage is not
            supported yet; the message names the scheme and what to pass instead.
    """
    text = os.fspath(location)
    scheme = url_scheme(text)
    if scheme:
        raise CheckpointDirError(
            f"{shown_url(text)!r} is a URL ({scheme}://, also when a pathlib.Path made it {scheme}:/); this needs a "
            "local or shared filesystem path: pass a directory path (for file://, the path after the scheme); an "
            "object store is a remote tier next to a local directory: remote_dir=\"s3://bucket/run1\" (the "
            "core's Checkpointer also takes the URL itself, as a str: remote-only mode, one node, no local copy)")
    return text


def remote_only_url(location: "str | os.PathLike[str]") -> Optional[str]:
    """The URL of a remote-only checkpoint location (``"s3://bucket/run1"``, a ``str`` with ``scheme://``),
    without trailing slashes; ``None`` for a filesystem path. A URL that ``pathlib`` mangled (``s3:/b/r``)
    is not one: :func:`check_location` refuses it, naming the cause."""
    text = os.fspath(location)
    if not isinstance(text, str) or not isinstance(location, str):
        return None
    text = text.strip()
    return text.rstrip("/") if is_remote_url(text) else None


def open_storage(location: "Optional[str | os.PathLike[str]]" = None, *, fsync: bool = True,
                 part: Optional[Tuple[Optional[int], int]] = None) -> PosixStorage:
    """The storage for checkpoints under ``location`` (``None``: any local path, e.g. a reader of the CLI).

    Args:
        location: the checkpoint directory; checked by :func:`check_location`.
        fsync: ``False`` skips fsync (throwaway tests only).
        part: ``(rank, step)`` of the persister write this storage serves (``rank`` ``None`` for a
            commit); only such storages honour ``SNAPCKPT_FAULT_STORAGE``.

    Raises:
        CheckpointDirError: ``location`` is a URL.
        ValueError: ``SNAPCKPT_FAULT_STORAGE`` is malformed (tests only).
    """
    if location is not None:
        check_location(location)
    if part is not None and _env.fault_storage():
        faulty = importlib.import_module("snapckpt._testing.faulty_storage")
        return faulty.storage(fsync=fsync, rank=part[0], step=part[1])
    return PosixStorage(fsync=fsync)
