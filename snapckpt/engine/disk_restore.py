"""Disk restore into live tensors: one pass over a rank's file, read straight into the destination tensors,
the checksum computed on the way.

``Checkpointer.load(state_dict)`` from the disk tier used to read each file twice and copy it once more: a
checksum pass, then ``torch.load(mmap=True)`` and a copy into the live tensors. :func:`read_into` reads it
once:

1. the zip directory and ``data.pkl`` of the ``torch.save`` archive (small reads) give every storage
   record's offset and size, and the object with tensors viewing a private memory map of the file (no
   data read yet);
2. each live tensor is paired with the loaded tensor at the same key (:func:`~snapckpt.engine.restore.pairs`);
   a record that exactly one contiguous live tensor of the same dtype takes whole is read with ``preadv``
   straight into that tensor's memory ("direct"); every other byte (the zip headers, small records,
   records that need a cast or feed several tensors) is read into a bounce buffer;
3. the file is read in order, by the calling thread, in pieces of at most 64 MiB (``POSIX_FADV_SEQUENTIAL``:
   the same reads as the cold-read floor of ``benchmarks/recovery.py``), while one more thread folds each
   piece into the checksum as soon as it is read (XXH3-64 releases the GIL), so the hash costs no second pass;
4. when the checksum matches, the remaining tensors are copied from the memory map (whose pages the pass
   has just brought into the page cache) and the other values replaced.

On a checksum or size mismatch :class:`~snapckpt.errors.CheckpointCorruptError` is raised after the pass: the
direct tensors then hold bytes of the refused file. ``load`` goes on with the next candidate, which overwrites
every one of them; if none loads it raises, and the state must not be trained from (as after any failed
load).
"""
from __future__ import annotations

import concurrent.futures as cf
import mmap
import os
import struct
import zipfile
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from snapckpt.errors import CheckpointCorruptError, IncompatibleCheckpointError
from snapckpt.formats.torch_zip import unpickle_skeleton
from snapckpt.ondisk.manifest import CHECKSUMS, record_checksum

__all__ = ["read_into", "DIRECT_MIN_NBYTES"]

CHUNK = 64 << 20  # bytes per read: large enough to keep the disk busy, small enough to hash while reading
BOUNCE = 8 << 20  # most bytes of each of the two bounce buffers (zip headers and small records only: kept small,
#                  since fresh memory costs a page fault per 4 KiB)
DIRECT_MIN_NBYTES = 1 << 20  # smaller records go through the bounce buffer (a direct read saves little)
# One reader in file order with SEQUENTIAL advice only, as the floor: cold 0.5 GiB on the 2-core VM, 12 rounds
# alternating, median 2.6 s against 4.0 s with WILLNEED of a 128 MiB window ahead of each piece on a reader
# thread, the floor 2.2 s (load 8-10; WILLNEED, or several readers, queue more I/O than this disk serves
# faster: issue 18).
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip local file header (30 bytes)


def _records(path: str, fd: int) -> Tuple[bytes, Dict[str, Tuple[int, int]]]:
    """``(data.pkl bytes, {storage key: (file offset, nbytes)})`` of a ``torch.save`` archive."""
    records: Dict[str, Tuple[int, int]] = {}
    pkl: Optional[Tuple[int, int]] = None
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{path} is not a readable torch.save archive ({e})") from e
    for info in infos:
        head = os.pread(fd, _LOCAL_HEADER.size, info.header_offset)
        if len(head) != _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
            raise CheckpointCorruptError(f"{path}: damaged zip header of {info.filename}")
        name_len, extra_len = _LOCAL_HEADER.unpack(head)[-2:]
        start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        parts = info.filename.split("/")
        if len(parts) == 2 and parts[1] == "data.pkl":
            pkl = (start, info.file_size)
        elif len(parts) == 3 and parts[1] == "data":
            records[parts[2]] = (start, info.file_size)
    if pkl is None:
        raise CheckpointCorruptError(f"{path} holds no data.pkl: not a torch.save archive")
    return os.pread(fd, pkl[1], pkl[0]), records


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _direct(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> bool:
    """Whether ``src``'s whole record can be read straight into ``dst`` (same bytes, same layout). Not into a tensor
    made under ``torch.inference_mode()`` outside it: a read by address would pass torch's refusal of the update,
    which the caller's ``copy_`` raises."""
    return (dst.device.type == "cpu" and dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous()
            and src.storage_offset() == 0 and src.numel() * src.element_size() == nbytes
            and nbytes >= DIRECT_MIN_NBYTES and not dst.is_conj() and not dst.is_neg()
            and not (dst.is_inference() and not torch.is_inference_mode_enabled()))


def read_into(path: str, nbytes: int, record: Dict[str, Any], dst: Any, *, weights_only: bool,
              verify: bool) -> Tuple[Any, Set[int]]:
    """Read the ``torch.save`` file ``path`` (this rank's part of a committed checkpoint) into ``dst``.

    Args:
        path: the file.
        nbytes: its size in bytes, from the manifest.
        record: its manifest record (its checksum).
        dst: the live state (nested dicts holding CPU or CUDA tensors); the tensors that take a whole record
            of the file are filled here.
        weights_only: unpickle with PyTorch's restricted unpickler.
        verify: compute the checksum and compare it with ``record``'s.

    Returns:
        ``(loaded object, ids of the dst tensors already filled)`` (none when some tensor's shape differs from
        ``dst``'s: the caller's ``copy_into`` then raises, before anything is copied): the object's tensors view a private memory
        map of the file; the caller copies the rest (``copy_into(dst, obj, own=True, skip=ids)``) and drops it.

    Raises:
        CheckpointCorruptError: the file's size or checksum differs from the manifest, or it is not a
            ``torch.save`` archive.
        UnsafeCheckpointError: ``weights_only`` met pickled objects.
    """
    from snapckpt.engine.restore import check_shapes, pairs

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise CheckpointCorruptError(f"{path} is {size} bytes, the manifest says {nbytes} (damaged or truncated)")
        hasher = None
        if verify:
            known = record_checksum(record)
            if known is None:
                raise CheckpointCorruptError(f"the manifest record of {path} holds none of the checksums "
                                             f"{sorted(CHECKSUMS)}")
            algo, want = known
            hasher = CHECKSUMS[algo]()
        pkl, records = _records(path, fd)
        mm = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE) if size else None
        storages = {}
        by_ptr: Dict[int, str] = {}
        for key, (off, n) in records.items():
            if n:
                st = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=off).untyped_storage()
                by_ptr[st.data_ptr()] = key
            else:
                st = torch.UntypedStorage(0)
            storages[key] = st
        obj = unpickle_skeleton(pkl, storages, weights_only=weights_only)
        try:
            check_shapes(dst, obj)
        except IncompatibleCheckpointError:
            return obj, set()  # nothing read into dst: the caller's copy_into raises it, naming every key
        users: Dict[str, int] = {}
        cands = []
        for d, s in pairs(dst, obj):
            key = by_ptr.get(s.untyped_storage().data_ptr()) if s.numel() else None
            if key is None:
                continue
            users[key] = users.get(key, 0) + 1
            cands.append((key, d, s))
        direct: Dict[int, Tuple[str, torch.Tensor]] = {}  # file offset -> (key, dst tensor)
        seen_dst: Set[int] = set()
        for key, d, s in cands:
            off, n = records[key]
            if users[key] == 1 and id(d) not in seen_dst and _direct(d, s, n):
                direct[off] = (key, d)
                seen_dst.add(id(d))
        if direct:  # bumped as an in-place copy bumps them: autograd must see the tensors written
            torch.autograd.graph.increment_version([d for _, d in direct.values()])
        with torch.no_grad():
            _stream(fd, size, records, direct, hasher)
        if hasher is not None and hasher.hexdigest() != want:
            raise CheckpointCorruptError(f"{path} has {algo} {hasher.hexdigest()}, the manifest says {want} "
                                         "(corrupted)")
        return obj, {id(d) for _, d in direct.values()}
    finally:
        os.close(fd)


def _stream(fd: int, size: int, records: Dict[str, Tuple[int, int]], direct: Dict[int, Tuple[str, torch.Tensor]],
            hasher) -> None:
    """Read ``[0, size)`` of ``fd`` in file order on this thread: direct records into their tensors in pieces
    of at most ``CHUNK`` bytes, the rest into two bounce buffers in turn (through the page cache, where the
    memory map finds them afterwards); fold every piece into ``hasher`` on one more thread, in file order, as
    soon as it has been read (a bounce buffer is reused once its previous piece is hashed)."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead window
    except OSError:
        pass

    def read_exact(view: memoryview, off: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], off + got)
            if n <= 0:
                raise CheckpointCorruptError(f"unexpected end of file at byte {off + got} of {size}")
            got += n

    # The file in order: ("bounce", lo, hi) gaps and ("direct", view, offset) pieces.
    segments: List[tuple] = []
    pos = 0
    for off in sorted(direct):
        key, d = direct[off]
        n = records[key][1]
        if off > pos:
            segments.append(("bounce", pos, off))
        view = _byte_view(d)
        segments += [("direct", view[lo:min(n, lo + CHUNK)], off + lo) for lo in range(0, n, CHUNK)]
        pos = off + n
    if size > pos:
        segments.append(("bounce", pos, size))

    # no larger than the largest gap: fresh memory costs a page fault per 4 KiB (a state of large tensors has
    # gaps of a few KiB, the zip headers and small records: 16 MiB of bounce buffers cost 4096 faults)
    gap = max((seg[2] - seg[1] for seg in segments if seg[0] == "bounce"), default=0)
    bounce = [bytearray(min(BOUNCE, gap)), bytearray(min(BOUNCE, gap))]
    last_use: List[Optional[cf.Future]] = [None, None]
    turn = 0
    pending: List[cf.Future] = []
    hash_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapckpt-hash") if hasher else None

    def fold(view: memoryview) -> Optional[cf.Future]:
        if hash_pool is None:
            return None
        fut = hash_pool.submit(hasher.update, view)
        pending.append(fut)
        return fut

    try:
        for seg in segments:
            if seg[0] == "direct":
                read_exact(seg[1], seg[2])
                fold(seg[1])
                continue
            lo, hi = seg[1], seg[2]
            while lo < hi:
                n = min(len(bounce[turn]), hi - lo)
                if last_use[turn] is not None:
                    last_use[turn].result()  # its previous piece is hashed: the buffer may be reused
                view = memoryview(bounce[turn])[:n]
                read_exact(view, lo)
                last_use[turn] = fold(view)
                turn ^= 1
                lo += n
        for fut in pending:
            fut.result()
    finally:
        if hash_pool is not None:
            hash_pool.shutdown(wait=True)
