"""Persister side: write one rank's part of a checkpoint from its arena slot into the partial directory.

For each file listed in the slot's index (``MemoryOnly`` files excepted): create it under the partial
directory, write it straight from the arena (a ``torch.save`` archive through :func:`write_torch_file`,
or raw chunks back to back for ``RawBytes``/``Concat`` files), computing the checksum
(:data:`~snapckpt.ondisk.manifest.CHECKSUM`) on the way (:func:`write_part_data`). Then
(:func:`finish_parts`) every file is fsynced, and only then the rank's part marker (sizes and checksums)
is written atomically: from that moment the committer may count the part. The node's persister hands
:func:`finish_parts` every part it has written meanwhile, so the fsyncs of its ranks' parts are grouped
(:mod:`snapckpt.persister.part_sync`). On any error the rank's files are left for the committer to
remove with the partial directory, and a failure marker carries the error record to the committer.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import json
import mmap
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from snapckpt._internal import env as _env
from snapckpt._internal import faultpoints as faults
from snapckpt.formats.torch_archive import ALIGNMENT, PHASE_MODULUS, READY_PIECE_NBYTES, write_torch_file
from snapckpt.ondisk.manifest import CHECKSUM, ChecksumWriter, SIDECAR, fail_marker_name, part_marker_name, validate_file_name
from snapckpt.storage.base import DirHandle, StorageWriter
from snapckpt.storage.direct import BORROW_MIN_NBYTES
from snapckpt.persister.protocol import error_record

__all__ = ["write_part", "write_part_data", "finish_parts", "WrittenPart", "write_failure_marker", "encode_file",
           "file_record"]


def write_part(storage: StorageWriter, buf, index: Dict[str, Any], partial_dir: str, *, rank: int,
               run_id: str, step: int,
               on_data_read: Optional[Callable[[], None]] = None) -> Dict[str, Dict[str, Any]]:
    """Write rank ``rank``'s files of ``step`` from slot mapping ``buf``, fsync them, then its part marker;
    return ``{file: {nbytes, xxh3_64, kind}}`` (:func:`write_part_data` then :func:`finish_parts`).

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
    part = write_part_data(storage, buf, index, partial_dir, rank=rank, run_id=run_id, step=step,
                           on_data_read=on_data_read)
    [err] = finish_parts([part])
    if err is not None:
        raise err
    return part.files


class WrittenPart:
    """A part whose files are written but not yet fsynced, and whose part marker is not yet written
    (:func:`write_part_data`); :func:`finish_parts` makes it durable. ``files`` is the marker's file
    records; ``handles`` the files' descriptors, open until they are fsynced."""

    def __init__(self, storage: StorageWriter, partial_dir: str, rank: int, run_id: str, step: int,
                 on_data_read: Optional[Callable[[], None]], gen: Optional[int] = None, flush: bool = False) -> None:
        self.storage, self.partial_dir, self.rank, self.run_id, self.step = storage, partial_dir, rank, run_id, step
        self.on_data_read = on_data_read
        self.gen, self.flush = gen, flush  # which save of the step the part is of (its marker's "gen", "flush")
        self.files: Dict[str, Dict[str, Any]] = {}
        self.handles: List[_SyncHandle] = []

    def close(self) -> None:
        """Close the descriptors still open (idempotent)."""
        while self.handles:
            self.handles.pop().close()


def write_part_data(storage: StorageWriter, buf, index: Dict[str, Any], partial_dir: str, *, rank: int,
                    run_id: str, step: int,
                    on_data_read: Optional[Callable[[], None]] = None,
                    gate: Optional[Callable[[int, int], None]] = None,
                    gen: Optional[int] = None, flush: bool = False) -> WrittenPart:
    """Write rank ``rank``'s files of ``step`` from slot mapping ``buf`` (arguments as :func:`write_part`),
    without fsync and without part marker: those are :func:`finish_parts`' job, so that a node's persister
    fsyncs the parts it has ready together instead of one after another.

    ``gen``: the save's generation (``Result.gen`` of :mod:`~snapckpt.persister.scheduler`: which save of
    ``(run_id, step, dirname)`` it is), written into the part marker with ``flush`` (a crash flush's part): the
    commit counts no marker of an earlier failed save of the step (:func:`~snapckpt.persister.commit.collect_parts`).
    ``None``: the marker names none (counted by any save of the step).

    ``gate(offset, nbytes)``: a streamed save (:class:`~snapckpt.persister.stream.Stream`): returns once slot
    bytes ``[offset, offset + nbytes)`` are final, raises when they never will be; no slot byte is read before.

    Raises:
        OSError, ValueError: as :func:`write_part` (the files written so far are closed).
    """
    storage.makedirs(os.path.join(partial_dir, SIDECAR))
    delay = _env.fault_write_delay_secs()
    part = WrittenPart(storage, partial_dir, rank, run_id, step, on_data_read, gen, flush)
    mid_file = faults.armed()  # fault point persist.mid_file: in the middle of each file written
    try:
        for f in index["files"]:
            if not f.get("persist", True):
                continue  # a MemoryOnly file: part of the memory snapshot, not of the checkpoint on disk
            rel = validate_file_name(f["path"])  # the index comes from the trainer: never write outside the directory
            path = os.path.join(partial_dir, rel)
            storage.makedirs(os.path.dirname(path))
            kind = f.get("kind", "torch")
            try:
                part.files[rel] = _write_file(storage, buf, f, path, kind, delay, mid_file, rank, step, part, gate)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise _disk_full(e, path, partial_dir, index, rank, step)
                raise _with_path(e, path)
    except BaseException:
        part.close()
        raise
    return part


def finish_parts(parts: Sequence[WrittenPart], pool: Optional[cf.Executor] = None) -> List[Optional[BaseException]]:
    """Make written parts durable and visible, in the order the commit protocol needs: every file of
    every part fsynced, then (``on_data_read``, fault point ``persist.before_part_marker``) the parts'
    markers written (each temporary file fsynced, then renamed), then each marker directory fsynced once,
    through a descriptor opened before its markers were renamed into it (the committer may rename the
    partial directory as soon as it counts the last marker). A part's marker is never written before its
    own files are durable. With ``pool``, the fsyncs of the parts run concurrently, so the filesystem
    commits its journal once for the batch instead of once per part. Returns each part's error (``None``: its marker is written and durable); the descriptors are
    closed either way.
    """
    run = pool.map if pool is not None else map
    errors: List[Optional[BaseException]] = list(run(_sync_files, parts))
    by_dir: Dict[str, List[int]] = {}
    for i, p in enumerate(parts):
        if errors[i] is None:
            if p.on_data_read is not None:
                p.on_data_read()
            faults.point("persist.before_part_marker", step=p.step, rank=p.rank)
            by_dir.setdefault(os.path.join(p.partial_dir, SIDECAR), []).append(i)
    # Each marker directory is opened before its markers are renamed into it, and fsynced through that
    # descriptor: once the last marker is there the committer may rename the partial directory at once,
    # so its old path can be gone by the time of the fsync.
    dirs: Dict[str, DirHandle] = {}
    try:
        for side, idx in by_dir.items():
            try:
                dirs[side] = parts[idx[0]].storage.open_dir(side)
            except OSError as e:
                for i in idx:
                    errors[i] = _with_path(e, side)
        marked = sorted(i for idx in by_dir.values() for i in idx if errors[i] is None)
        for i, err in zip(marked, run(_write_marker, [parts[i] for i in marked])):
            errors[i] = err
            if err is None:
                faults.point("persist.after_part_marker", step=parts[i].step, rank=parts[i].rank)
        for side, d in dirs.items():  # one directory fsync makes every marker renamed into it durable
            idx = [i for i in by_dir[side] if errors[i] is None]
            if not idx:
                continue
            try:
                d.fsync()
            except OSError as e:
                for i in idx:
                    errors[i] = _with_path(e, side)
    finally:
        for d in dirs.values():
            d.close()
    return errors


def _sync_files(part: WrittenPart) -> Optional[BaseException]:
    """fsync every file of ``part`` and close it; return the error instead of raising it."""
    try:
        for h in part.handles:
            try:
                part.storage.fsync_file(h)
            except OSError as e:
                raise _with_path(e, h.name)
        return None
    except BaseException as e:
        return e
    finally:
        part.close()


def _write_marker(part: WrittenPart) -> Optional[BaseException]:
    """Write ``part``'s marker (temporary file fsynced, renamed; the directory fsync is the caller's)."""
    marker = _marker_fields(part.rank, part.run_id, part.step, part.gen, part.flush)
    marker["files"] = part.files
    try:
        part.storage.write_atomic(os.path.join(part.partial_dir, part_marker_name(part.rank)),
                                  json.dumps(marker).encode(), sync_dir=False)
        return None
    except BaseException as e:
        return e


def _marker_fields(rank: int, run_id: str, step: int, gen: Optional[int], flush: bool = False) -> Dict[str, Any]:
    """The fields a part or failure marker starts with: ``gen`` only when known, ``flush`` only when true."""
    marker: Dict[str, Any] = {"rank": rank, "run_id": run_id, "step": step}
    if gen is not None:
        marker["gen"] = gen
    if flush:
        marker["flush"] = True
    return marker


def _with_path(e: OSError, path: str) -> OSError:
    """``e``, or a copy naming ``path`` when it names no file (write(2)/fsync(2) errors do not)."""
    if e.filename is None and e.errno is not None:
        new = OSError(e.errno, e.strerror or str(e), path)
        new.__cause__ = e
        return new
    return e


def _disk_full(e: OSError, path: str, partial_dir: str, index: Dict[str, Any], rank: int, step: int) -> OSError:
    """``e`` (ENOSPC/EDQUOT) as an ``OSError`` of the same errno whose text names the checkpoint directory, the
    bytes rank ``rank``'s part of ``step`` needs (its spans and skeletons, without archive headers) and the bytes
    free now; the trainer gets it as :class:`~snapckpt.errors.DiskFullError` with the fix added."""
    need = 0
    for f in index["files"]:
        if f.get("persist", True):
            need += sum(r[-1] for r in f.get("records", ())) + sum(c[-1] for c in f.get("chunks", ()))
            need += f.get("pkl", (0, 0))[1]
    try:
        st = os.statvfs(partial_dir)
        free = f"{st.f_bavail * st.f_frsize} bytes are free there now"
    except OSError:
        free = "the free space there cannot be read"
    new = OSError(e.errno, f"{e.strerror or os.strerror(e.errno)} writing step {step} into checkpoint directory "
                  f"{os.path.dirname(partial_dir)}: rank {rank}'s part needs about {need} bytes, {free}", path)
    new.__cause__ = e
    return new


def _write_file(storage: StorageWriter, buf, f: Dict[str, Any], path: str, kind: str, delay: float, mid_file: bool,
                rank: int, step: int, part: WrittenPart,
                gate: Optional[Callable[[int, int], None]] = None) -> Dict[str, Any]:
    """Write one file of a part from the slot (its descriptor, duplicated, joins ``part.handles`` for the
    fsync); return its manifest record."""
    with storage.open_write(path) as raw:
        sink = raw if not delay else _SlowWriter(raw, delay)
        if mid_file:
            sink = _MidFilePoint(sink, rank, step)
        cw = ChecksumWriter(sink)
        # fault injection counts torch's write calls; a slot (page-aligned mapping, unchanged until the fsync) may be
        # written straight from where the direct-I/O file can
        borrow = sink is raw and hasattr(raw, "write_borrowed") and isinstance(buf, mmap.mmap)
        encode_file(cw, buf, f, kind, coalesce=sink is raw, gate=gate, borrow=borrow)
        raw.flush()
        if f.get("mode") is not None:  # the spec's permission bits, before the fsync makes the file durable
            os.fchmod(raw.fileno(), f["mode"] & 0o777)  # never setuid/setgid/sticky from a spec
        part.handles.append(_SyncHandle(os.dup(raw.fileno()), path))
    return file_record(cw, kind, f)


def file_record(cw: ChecksumWriter, kind: str, f: Dict[str, Any]) -> Dict[str, Any]:
    """The manifest record of a file written through ``cw`` from slot index entry ``f``: size, checksum,
    kind, and its permission bits when the spec set them."""
    rec: Dict[str, Any] = {"nbytes": cw.nbytes, CHECKSUM: cw.hexdigest, "kind": kind}
    if f.get("mode") is not None:
        rec["mode"] = f["mode"]
    return rec


class _SyncHandle:
    """A written file's descriptor kept (duplicated) past its file object's close, for a later fsync: the
    file object's buffers are freed at once, and the fsync reports write-back errors on the same open file."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd, self.name = fd, name

    def fileno(self) -> int:
        return self.fd

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def encode_file(sink, buf, f: Dict[str, Any], kind: str, *, coalesce: bool = True,
                gate: Optional[Callable[[int, int], None]] = None, borrow: bool = False) -> None:
    """Write one file of a part, as its slot index entry ``f`` describes it, from slot mapping ``buf`` into
    ``sink`` (anything with ``write``): raw chunks back to back for ``kind`` ``"bytes"``, otherwise a
    ``torch.save`` archive whose records are memoryviews of the slot (no copy but of records under 64 KiB with
    ``coalesce``, which joins small writes: see :class:`~snapckpt.formats.torch_archive.TorchArchiveWriter`;
    torch is not imported). ``gate``: see :func:`write_part_data` (slot bytes are then read in pieces of
    :data:`~snapckpt.formats.torch_archive.READY_PIECE_NBYTES`, each once it is final).

    ``borrow``: ``buf`` is page-aligned (an ``mmap``) and unchanged until the file is flushed, and ``sink`` has
    ``write_borrowed`` (:meth:`~snapckpt.ondisk.manifest.ChecksumWriter.write_borrowed` over a
    :class:`~snapckpt.storage.direct.DirectFile`): spans of at least
    :data:`~snapckpt.storage.direct.BORROW_MIN_NBYTES` are then handed over with their address phase, and a
    ``torch.save`` archive places their records where they can be written straight from the slot (see
    :mod:`snapckpt.formats.torch_archive`: longer padding than torch's, the same archive to ``torch.load``)."""
    if kind == "bytes":
        for off, n in f["chunks"]:
            write = sink.write_borrowed if borrow and n >= BORROW_MIN_NBYTES else None
            if gate is None:
                if write is not None:
                    write(memoryview(buf)[off:off + n], off % PHASE_MODULUS)
                else:
                    sink.write(memoryview(buf)[off:off + n])
                continue
            for a in range(0, n, READY_PIECE_NBYTES):
                b = min(n, a + READY_PIECE_NBYTES)
                gate(off + a, b - a)
                if write is not None:
                    write(memoryview(buf)[off + a:off + b], (off + a) % PHASE_MODULUS)
                else:
                    sink.write(memoryview(buf)[off + a:off + b])
        return
    po, pn = f["pkl"]
    view = memoryview(buf)
    records = f["records"]
    ready = None if gate is None else (lambda i, k: gate(records[i][1], k))
    phases = None
    if borrow:  # a record of a 64-byte aligned span keeps torch's alignment at its phase
        phases = [off % PHASE_MODULUS if n >= BORROW_MIN_NBYTES and off % ALIGNMENT == 0 else None for _, off, n in records]
    write_torch_file(sink, bytes(view[po:po + pn]), [(key, view[off:off + n], n) for key, off, n in records],
                     coalesce=coalesce, ready=ready, phases=phases)


def write_failure_marker(storage: StorageWriter, partial_dir: str, *, rank: int, run_id: str, step: int,
                         exc: BaseException, gen: Optional[int] = None) -> None:
    """Tell the committer that rank ``rank``'s part failed (best effort: the disk may be full). A part that
    failed because its partial directory is gone (``FileNotFoundError``: the committer removed it once the
    commit failed) gets no marker: recreating the directory would leave a stale failure marker that fails
    the next save of the same step at once (a crash flush of that step). ``gen``: as :func:`write_part_data`'s."""
    marker = _marker_fields(rank, run_id, step, gen)
    marker["error"] = error_record(exc)
    try:
        if not isinstance(exc, FileNotFoundError):
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
