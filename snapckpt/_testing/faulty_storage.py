"""Storage that fails on purpose: the storage half of the fault-injection toolkit.

Armed by ``SNAPCKPT_FAULT_STORAGE`` (syntax in :mod:`snapckpt._internal.faultpoints`); the storage factory
(:func:`snapckpt.storage.factory.open_storage`) imports this module only when that knob is set, so production
code never depends on it.
"""
from __future__ import annotations

import errno as _errno
import json
import os
from typing import BinaryIO, Optional

from snapckpt._internal import env as _env
from snapckpt._internal.faultpoints import PHASES
from snapckpt.storage.posix import PosixStorage

__all__ = ["storage", "FaultyStorage"]


def storage(*, fsync: bool, rank: Optional[int], step: int) -> PosixStorage:
    """The persister's storage for rank ``rank``'s part (``None``: the commit) of ``step``: a
    :class:`FaultyStorage` when ``SNAPCKPT_FAULT_STORAGE`` selects it, else a plain ``PosixStorage``.

    Raises:
        ValueError: the plan is not valid JSON or names an unknown phase.
    """
    raw = _env.fault_storage()
    if raw.startswith("@"):
        try:
            with open(raw[1:]) as f:
                raw = f.read().strip()
        except FileNotFoundError:
            raw = ""
    if not raw:
        return PosixStorage(fsync=fsync)
    try:
        plan = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"SNAPCKPT_FAULT_STORAGE is not JSON: {raw!r}") from e
    if plan.get("phase") not in PHASES:
        raise ValueError(f"SNAPCKPT_FAULT_STORAGE: phase must be one of {PHASES}, not {plan.get('phase')!r}")
    if plan.get("step", step) != step or ("rank" in plan and plan["rank"] != rank):
        return PosixStorage(fsync=fsync)
    return FaultyStorage(plan["phase"], int(plan.get("errno", _errno.ENOSPC)),
                         int(plan.get("after_bytes", 0)), fsync=fsync)


class FaultyStorage(PosixStorage):
    """A :class:`PosixStorage` whose every call of one phase raises ``OSError(errno)``.

    Args:
        phase: one of :data:`PHASES` (see the module docstring).
        errno: the ``errno`` of the raised ``OSError`` (``ENOSPC``, ``EFBIG``, ``EIO``...).
        after_bytes: phase ``write``: bytes of each file written before the failure.
    """

    def __init__(self, phase: str, errno: int, after_bytes: int = 0, *, fsync: bool = True) -> None:
        super().__init__(fsync=fsync)
        self.phase, self.errno, self.after_bytes = phase, errno, after_bytes

    def _fail(self, path: str) -> None:
        raise OSError(self.errno, f"{os.strerror(self.errno)} (injected: {self.phase})", path)

    def open_write(self, path: str) -> BinaryIO:
        if self.phase == "open":
            self._fail(path)
        f = super().open_write(path)
        return _FailingFile(f, self, path) if self.phase == "write" else f

    def fsync_file(self, fileobj: BinaryIO) -> None:
        if self.phase == "fsync":
            self._fail(getattr(fileobj, "name", "?"))
        super().fsync_file(getattr(fileobj, "raw_file", fileobj))

    def write_atomic(self, path: str, data: bytes, *, sync_dir: bool = True) -> None:
        base = os.path.basename(path)
        is_sidecar = os.path.basename(os.path.dirname(path)) == ".snapckpt"
        if (self.phase == "part_marker" and is_sidecar and base.startswith("part_")) or \
                (self.phase == "manifest" and is_sidecar and base == "manifest.json") or \
                (self.phase == "tracker" and not is_sidecar):
            self._fail(path)
        super().write_atomic(path, data, sync_dir=sync_dir)

    def rename(self, src: str, dst: str) -> None:
        if self.phase == "rename":
            self._fail(src)
        super().rename(src, dst)


class _FailingFile:
    """A file that raises on the write that would pass ``after_bytes``."""

    def __init__(self, raw_file: BinaryIO, owner: FaultyStorage, path: str) -> None:
        self.raw_file, self.owner, self.path, self.written = raw_file, owner, path, 0

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if self.written + n > self.owner.after_bytes:
            self.owner._fail(self.path)
        self.written += n
        return self.raw_file.write(data)

    def flush(self) -> None:
        self.raw_file.flush()

    def fileno(self) -> int:
        return self.raw_file.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.raw_file.close()

    def close(self) -> None:
        self.raw_file.close()
