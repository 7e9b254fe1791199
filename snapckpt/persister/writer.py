"""Persister side: write one rank's part of a checkpoint from its arena slot into the partial directory.

For each file listed in the slot's index (``MemoryOnly`` files excepted): create it under the partial
directory, write it straight from the arena (a ``torch.save`` archive through :func:`write_torch_file`,
or raw chunks back to back for ``RawBytes``/``Concat`` files), computing the checksum (:data:`~snapckpt.ondisk.manifest.CHECKSUM`) on the way, fsync, close. Then the rank's part marker (sizes and checksums) is written atomically: from that
moment the committer may count the part. On any error the rank's files are left for the committer to
remove with the partial directory, and a failure marker carries the error record to the committer.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, Optional

from snapckpt._internal import env as _env
from snapckpt._internal import faultpoints as faults
from snapckpt.formats.torch_archive import write_torch_file
from snapckpt.ondisk.manifest import CHECKSUM, ChecksumWriter, SIDECAR, fail_marker_name, part_marker_name, validate_file_name
from snapckpt.storage.base import StorageWriter
from snapckpt.persister.protocol import error_record

__all__ = ["write_part", "write_failure_marker", "encode_file"]


def write_part(storage: StorageWriter, buf, index: Dict[str, Any], partial_dir: str, *, rank: int,
               run_id: str, step: int,
               on_data_read: Optional[Callable[[], None]] = None) -> Dict[str, Dict[str, Any]]:
    """Write rank ``rank``'s files of ``step`` from slot mapping ``buf``; return ``{file: {nbytes, xxh3_64, kind}}``.

    Args:
        storage: where to write.
        buf: the slot's ``mmap`` (read only here).
        index: the slot's index (:func:`snapckpt.persister.slot_index.read_index`).
        partial_dir: the step's in-flight directory (absolute path).
        on_data_read: called once every file is written and fsynced, before the part marker: from then
            on the slot is not read any more and may be released before the commit can count the part.

    Raises:
        OSError: from the filesystem (ENOSPC, EFBIG, EACCES...), with the errno unchanged and the path of
            the file being written when the error did not name one.
        ValueError: the index names a file outside the partial directory.
    """
    storage.makedirs(os.path.join(partial_dir, SIDECAR))
    delay = _env.fault_write_delay_secs()
    files: Dict[str, Dict[str, Any]] = {}
    mid_file = faults.armed()  # fault point persist.mid_file: in the middle of each file written
    for f in index["files"]:
        if not f.get("persist", True):
            continue  # a MemoryOnly file: part of the memory snapshot, not of the checkpoint on disk
        rel = validate_file_name(f["path"])  # the index comes from the trainer: never write outside the directory
        path = os.path.join(partial_dir, rel)
        storage.makedirs(os.path.dirname(path))
        kind = f.get("kind", "torch")
        try:
            files[rel] = _write_file(storage, buf, f, path, kind, delay, mid_file, rank, step)
        except OSError as e:
            if e.filename is None and e.errno is not None:  # write(2)/fsync(2) errors name no file
                raise OSError(e.errno, e.strerror or str(e), path) from e
            raise
    if on_data_read is not None:
        on_data_read()
    faults.point("persist.before_part_marker", step=step, rank=rank)
    marker = {"rank": rank, "run_id": run_id, "step": step, "files": files}
    storage.write_atomic(os.path.join(partial_dir, part_marker_name(rank)), json.dumps(marker).encode())
    return files


def _write_file(storage: StorageWriter, buf, f: Dict[str, Any], path: str, kind: str, delay: float, mid_file: bool,
                rank: int, step: int) -> Dict[str, Any]:
    """Write one file of a part from the slot, fsync it; return its manifest record."""
    with storage.open_write(path) as raw:
        sink = raw if not delay else _SlowWriter(raw, delay)
        if mid_file:
            sink = _MidFilePoint(sink, rank, step)
        cw = ChecksumWriter(sink)
        encode_file(cw, buf, f, kind, coalesce=sink is raw)  # fault injection counts torch's write calls
        storage.fsync_file(raw)
    return {"nbytes": cw.nbytes, CHECKSUM: cw.hexdigest, "kind": kind}


def encode_file(sink, buf, f: Dict[str, Any], kind: str, *, coalesce: bool = True) -> None:
    """Write one file of a part, as its slot index entry ``f`` describes it, from slot mapping ``buf`` into
    ``sink`` (anything with ``write``): raw chunks back to back for ``kind`` ``"bytes"``, otherwise a
    ``torch.save`` archive whose records are memoryviews of the slot (no copy but of records under 64 KiB with
    ``coalesce``, which joins small writes: see :class:`~snapckpt.formats.torch_archive.TorchArchiveWriter`;
    torch is not imported)."""
    if kind == "bytes":
        for off, n in f["chunks"]:
            sink.write(memoryview(buf)[off:off + n])
        return
    po, pn = f["pkl"]
    view = memoryview(buf)
    write_torch_file(sink, bytes(view[po:po + pn]), [(key, view[off:off + n], n) for key, off, n in f["records"]],
                     coalesce=coalesce)


def write_failure_marker(storage: StorageWriter, partial_dir: str, *, rank: int, run_id: str, step: int,
                         exc: BaseException) -> None:
    """Tell the committer that rank ``rank``'s part failed (best effort: the disk may be full)."""
    marker = {"rank": rank, "run_id": run_id, "step": step, "error": error_record(exc)}
    try:
        storage.makedirs(os.path.join(partial_dir, SIDECAR))
        storage.write_atomic(os.path.join(partial_dir, fail_marker_name(rank)), json.dumps(marker).encode())
    except OSError:
        pass


class _SlowWriter:
    """Fault injection: sleeps before each write (see ``SNAPCKPT_FAULT_WRITE_DELAY_SECS``) and pushes each
    write to the file at once, so that a slow persister's file grows record by record on disk as a slow
    device would show it (the direct-I/O writer otherwise holds up to 16 MiB in its bounce buffer)."""

    def __init__(self, fileobj, delay_secs: float) -> None:
        self.fileobj, self.delay_secs = fileobj, delay_secs

    def write(self, data) -> int:
        time.sleep(self.delay_secs)
        n = self.fileobj.write(data)
        self.fileobj.flush()
        return n

    def flush(self) -> None:
        self.fileobj.flush()


class _MidFilePoint:
    """Fault point ``persist.mid_file``: reached on the second write into the file (after the first one
    was flushed to it), so a SIGKILL there leaves a half-written file."""

    def __init__(self, fileobj, rank: int, step: int) -> None:
        self.fileobj, self.rank, self.step, self.writes = fileobj, rank, step, 0

    def write(self, data) -> int:
        self.writes += 1
        if self.writes == 2:
            self.fileobj.flush()
            faults.point("persist.mid_file", step=self.step, rank=self.rank)
        return self.fileobj.write(data)

    def flush(self) -> None:
        self.fileobj.flush()
