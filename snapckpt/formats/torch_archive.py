"""The ``torch.save`` zip archive, written in pure Python (no torch): what the persister writes.

The output is byte for byte (and, unless ``coalesce``, write call for write call) what
``torch._C.PyTorchFileWriter(f, compute_crc32=False, storage_alignment=64)`` writes into a file object ``f``
(read from ``caffe2/serialize/inline_container.cc`` and PyTorch's miniz fork; checked against the installed
torch, 2.13 on Linux when written, by ``tests/unit/test_torch_archive.py``), so the persister need not import
torch (about 2 s of CPU) to write:

- every record ``<name>`` is a stored (uncompressed) entry ``archive/<name>`` (UTF-8, general purpose flag
  bit 11), with time, date and CRC-32 fields 0;
- its local header carries an extra field ``FB`` of ``Z`` bytes that puts the record's data at a multiple of
  :data:`ALIGNMENT` in the file, after a zip64 extra field (``0x0001``: the size and 0 when the size is
  ``>= 0xFFFFFFFF``, then the header's offset when it is) when either is that large, written separately;
- a non-empty record has general purpose flag bit 3 and a data descriptor (``PK\\x07\\x08``, CRC 0, sizes: 4
  bytes each, 8 with the zip64 field) after its data, with 0 for the sizes in the local header; an empty
  record has neither;
- at the end, ``version`` (``"3\\n"``) and ``byteorder`` when the caller wrote neither, then
  ``.data/serialization_id``, the central directory (zip64 field as in the local header, without the
  padding), a zip64 end of central directory record and locator (always), and the end of central directory
  record (counts capped at 0xFFFF, sizes and offsets at 0xFFFFFFFF).

``.data/serialization_id`` is deterministic: 20 decimal digits of a hash of the record names, then 20 of a
hash of the CRC-32s of the data descriptors written (0 here, one per non-empty record). The name hash folds
libstdc++'s ``std::hash<std::string>`` of each name (the murmur-based ``_Hash_bytes``, seed ``0xc70f6907``)
with ``c10::hash_combine``, in the iteration order of the ``std::unordered_set`` torch keeps them in, which
:func:`unordered_set_order` reproduces: the value torch writes on Linux, where its builds use libstdc++ (a
torch built with another C++ library writes another id). ``torch.load`` does not read it.

The sink needs only ``write`` (it is never seeked, told or flushed): the persister streams parts to S3 through
it. Record data are written as memoryviews of the caller's buffers, without a copy (with ``coalesce``, records
under 64 KiB are copied into the joined writes).

A record written with a ``phase`` (:meth:`TorchArchiveWriter.write_record`) is the one departure from torch's
bytes: its ``FB`` padding is longer (under :data:`PHASE_MODULUS` bytes), so that its data's file offset has the
same remainder modulo :data:`PHASE_MODULUS` as its address in the caller's page-aligned buffer; the data stays
64-byte aligned, and ``torch.load`` reads a record where its local header says. A direct-I/O sink can then
write the record's data straight from the caller's buffer (:meth:`~snapckpt.storage.direct.DirectFile.write_borrowed`).
"""
from __future__ import annotations

import struct
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["ALIGNMENT", "ARCHIVE_PREFIX", "PHASE_MODULUS", "READY_PIECE_NBYTES", "TorchArchiveWriter",
           "write_torch_file"]

ALIGNMENT = 64  # bytes: where each record's data starts (torch.serialization._get_storage_alignment() default)
ARCHIVE_PREFIX = "archive/"  # PyTorchFileWriter's folder for a file object (a path would give its basename)
FILE_FORMAT_VERSION = b"3\n"  # caffe2 kMinProducedFileFormatVersion: torch.save raises it for no tensor we write
SERIALIZATION_ID = ".data/serialization_id"

_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_FLAG_UTF8 = 0x0800
_FLAG_DESCRIPTOR = 0x0008

_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # signature ... name length, extra length
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_DESCRIPTOR32 = struct.Struct("<4sIII")
_DESCRIPTOR64 = struct.Struct("<4sIQQ")
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_LOCATOR = struct.Struct("<4sIQI")
_EOCD = struct.Struct("<4sHHHHIIH")
_U16X2 = struct.Struct("<HH")
_DESCRIPTOR_SIG = b"PK\x07\x08"
_PREFIX = ARCHIVE_PREFIX.encode()
_FLAGS_DATA = _FLAG_UTF8 | _FLAG_DESCRIPTOR
#: With a ``ready`` callback (:meth:`TorchArchiveWriter.write_record`), record data is read in pieces of this many
#: bytes, each once ``ready`` has returned for it.
READY_PIECE_NBYTES = 8 << 20
_SMALL_WRITE = 64 << 10  # with coalesce: pieces under this are copied into the pending buffer
_COALESCED_WRITE = 1 << 20  # with coalesce: the pending buffer goes out once it holds this much
_PADDING = [_U16X2.pack(0x4246, pad) + b"Z" * pad for pad in range(ALIGNMENT)]  # "FB" extra field of pad bytes
#: A record with a ``phase`` starts its data at a file offset of that remainder modulo this (bytes: a page, and a
#: multiple of every logical block size direct I/O needs).
PHASE_MODULUS = 4096


def _padding(pad: int) -> bytes:
    """The ``FB`` extra field of ``pad`` bytes (``0 <= pad < 65532``)."""
    return _PADDING[pad] if pad < ALIGNMENT else _U16X2.pack(0x4246, pad) + b"Z" * pad


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def cxx_string_hash(data: bytes) -> int:
    """libstdc++'s ``std::hash<std::string>`` on 64-bit Linux (``_Hash_bytes(data, len, 0xc70f6907)``)."""
    n = len(data)
    h = (0xC70F6907 ^ (n * _MUL)) & _U64
    aligned = n & ~7
    for (word,) in struct.iter_unpack("<Q", data[:aligned]):
        h = ((h ^ ((_shift_mix((word * _MUL) & _U64) * _MUL) & _U64)) * _MUL) & _U64
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * _MUL) & _U64
    return _shift_mix((_shift_mix(h) * _MUL) & _U64)


# The bucket counts a libstdc++ std::unordered_set goes through as it grows one insertion at a time (max load
# factor 1): 13 at the first insertion, then the next one before the insertion that would exceed the count
# (from the prime table and growth policy of libstdc++'s _Prime_rehash_policy, up to 2**32 elements).
_BUCKET_COUNTS = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933, 351061,
                  712697, 1447153, 2938679, 5967347, 12117689, 24607243, 49969847, 101473717, 206062531,
                  418451333, 849749479, 1725587117, 3504151727, 6442450933)


def unordered_set_order(codes: List[int]) -> List[int]:
    """The order in which a libstdc++ ``std::unordered_set`` (hash codes cached) filled with keys of hash codes
    ``codes``, inserted in that order, all distinct, iterates them: indices into ``codes``.

    Each key goes to bucket ``code % bucket_count``; the elements form one singly linked list in which a new
    element goes first in its bucket's run, or first in the list when its bucket was empty; a rehash walks
    the list and rebuilds it the same way.
    """
    end = -1
    nxt = [end] * (len(codes) + 1)  # node i + 1 holds codes[i]; node 0 is the list head ("before begin")
    buckets: List[int] = []
    nb_index = -1
    for i, code in enumerate(codes):
        if nb_index < 0 or i + 1 > _BUCKET_COUNTS[nb_index]:
            nb_index += 1
            buckets = _rehash(nxt, codes, _BUCKET_COUNTS[nb_index])
        nb = len(buckets)
        node, b = i + 1, code % nb
        before = buckets[b]
        if before >= 0:
            nxt[node] = nxt[before]
            nxt[before] = node
        else:
            nxt[node] = nxt[0]
            nxt[0] = node
            if nxt[node] != end:
                buckets[codes[nxt[node] - 1] % nb] = node
            buckets[b] = 0
    order, p = [], nxt[0]
    while p != end:
        order.append(p - 1)
        p = nxt[p]
    return order


def _rehash(nxt: List[int], codes: List[int], nb: int) -> List[int]:
    buckets = [-1] * nb
    p, nxt[0], first_bucket = nxt[0], -1, 0
    while p != -1:
        following, b = nxt[p], codes[p - 1] % nb
        if buckets[b] < 0:
            nxt[p] = nxt[0]
            nxt[0] = p
            buckets[b] = 0
            if nxt[p] != -1:
                buckets[first_bucket] = p
            first_bucket = b
        else:
            nxt[p] = nxt[buckets[b]]
            nxt[buckets[b]] = p
        p = following
    return buckets


def hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _U64)) & _U64


_NAMES_HASHES: Dict[Tuple[bytes, ...], int] = {}  # a few recent name lists: a job writes the same ones each save


def _names_hash(names: Tuple[bytes, ...]) -> int:
    """torch's combined hash of the record names ``names`` (in the order written)."""
    h = _NAMES_HASHES.get(names)
    if h is None:
        codes = [cxx_string_hash(raw) for raw in names]
        h = 0
        for i in unordered_set_order(codes):
            h = hash_combine(h, codes[i])
        if len(_NAMES_HASHES) >= 8:
            _NAMES_HASHES.pop(next(iter(_NAMES_HASHES)))
        _NAMES_HASHES[names] = h
    return h


def _zip64_extra(fields: List[int]) -> bytes:
    return _U16X2.pack(0x0001, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields)


class TorchArchiveWriter:
    """Writes one ``torch.save`` archive into ``sink``, as ``PyTorchFileWriter(sink, False, 64)`` does.

    Args:
        sink: anything with ``write(bytes-like)`` that writes all it is given.
        coalesce: join the small writes (headers, descriptors, records under 64 KiB: copied) into writes of
            about 1 MiB, a bytearray never touched again once given to ``sink``; larger records are still
            written as views of the caller's buffer. Same bytes; far fewer ``write`` calls for many small
            records (200,000 tensors). ``False``: exactly torch's calls (5 per record: header, name, extra,
            data, descriptor), which fault injection that acts per write call relies on.

    Use :meth:`write_record` for each record, then :meth:`write_end_of_file` once.
    """

    def __init__(self, sink, coalesce: bool = False) -> None:
        self._sink_write = sink.write
        self._borrow = getattr(sink, "write_borrowed", None)
        self._pending = bytearray()
        self._write = self._pend if coalesce else self._sink_write
        self._pos = 0  # bytes written so far: the next local header's offset
        self._names: Dict[bytes, None] = {}  # written so far, in order
        self._entries: List[Tuple[bytes, int, int, int]] = []  # (full name, flags, size, local header offset)
        self._descriptor_hash = 0  # combined CRC-32s of the data descriptors, as torch sees its writes
        self._finished = False

    def _pend(self, data) -> None:
        """Coalescing ``write``: small pieces are appended to the pending buffer, large ones go out as they are."""
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        if n < _SMALL_WRITE:
            self._pending += data
            if len(self._pending) < _COALESCED_WRITE:
                return
            data, n = b"", 0
        if self._pending:
            self._sink_write(self._pending)
            self._pending = bytearray()
        if n:
            self._sink_write(data)

    def _out(self, data, size: int) -> None:
        """Write ``size`` bytes ``data`` into the sink (as torch, whatever ``write`` returns)."""
        self._write(data)
        self._pos += size
        if size >= 8 and data[:4] == _DESCRIPTOR_SIG:
            # torch folds the CRC of every write that starts like a data descriptor (also record data doing so)
            self._descriptor_hash = hash_combine(self._descriptor_hash, int.from_bytes(data[4:8], "little"))

    def write_record(self, name: str, data, nbytes: int, ready: Optional[Callable[[int], None]] = None,
                     phase: Optional[int] = None) -> None:
        """Write record ``archive/<name>`` holding the first ``nbytes`` bytes of ``data``.

        Args:
            name: the record name (``data.pkl``, ``data/<key>``...): any ``str`` without NUL characters.
            data: a bytes-like object (``bytes``, ``memoryview``, ``mmap``...) of at least ``nbytes`` bytes;
                written as a memoryview slice, not copied.
            nbytes: how many bytes of ``data`` the record holds (``>= 0``).
            ready: ``ready(k)`` returns once the first ``k`` bytes of ``data`` are final (a buffer still being
                filled: a streamed save); the data is then read in pieces of :data:`READY_PIECE_NBYTES`, none
                before ``ready`` returned for it. Same bytes in the archive.
            phase: the data's address modulo :data:`PHASE_MODULUS` (bytes, a multiple of :data:`ALIGNMENT`), or
                ``None``. Given, the data is placed at a file offset of that remainder (a longer padding than
                torch's; see the module docstring) and, when the sink has ``write_borrowed(view, phase)``, handed to
                it that way: the sink may then keep referring to ``data`` until it is flushed, so ``data`` must not
                change before.

        Raises:
            ValueError: ``name`` was written already, holds a NUL or is longer than 65535 bytes encoded
                (with the prefix), ``data`` is shorter than ``nbytes``, or ``phase`` is not a multiple of
                :data:`ALIGNMENT` in ``[0, PHASE_MODULUS)``.
            OSError: from the sink.
        """
        if nbytes < 0:
            raise ValueError(f"record {name!r}: negative size {nbytes}")
        if self._finished:
            raise ValueError(f"torch.save archive already finished: cannot add record {name!r}")
        raw = name.encode("utf-8")
        if raw in self._names:
            raise ValueError(f"record {name!r} written twice into one torch.save archive")
        if name == SERIALIZATION_ID:
            return  # as torch: the id is computed at the end, a copied one is dropped
        if b"\0" in raw or len(raw) + len(ARCHIVE_PREFIX) > 0xFFFF:
            raise ValueError(f"invalid torch.save record name {name!r}: it must hold no NUL character and "
                             "encode to at most 65527 bytes of UTF-8")
        view = memoryview(data).cast("B") if nbytes else None
        if view is not None and view.nbytes < nbytes:
            raise ValueError(f"record {name!r}: {nbytes} bytes requested from a buffer of {view.nbytes}")
        if phase is not None and (phase % ALIGNMENT or not 0 <= phase < PHASE_MODULUS):
            raise ValueError(f"record {name!r}: phase {phase} is not a multiple of {ALIGNMENT} in [0, {PHASE_MODULUS})")
        if phase is not None and not nbytes:
            phase = None
        if (ready is None and phase is None) or not nbytes:
            self._record(raw, view, nbytes)
            return
        write = self._write
        try:
            # only the record data's write is a view of that buffer: the wrappers act on it alone
            if phase is not None and self._borrow is not None:
                self._write = _Borrow(self, write, view, phase)
            if ready is not None:
                self._write = _Pieces(self._write, view, nbytes, ready)
            self._record(raw, view, nbytes, phase)
        finally:
            self._write = write

    def _flush_pending(self) -> None:
        """Hand the coalesced pending bytes to the sink (before a borrowed write, which bypasses them)."""
        if self._pending:
            self._sink_write(self._pending)
            self._pending = bytearray()

    def _record(self, raw: bytes, view, nbytes: int, phase: Optional[int] = None) -> None:
        """Write record ``archive/<raw>``: the first ``nbytes`` bytes of memoryview ``view`` (its data at a file
        offset of remainder ``phase`` modulo :data:`PHASE_MODULUS` when given)."""
        full = _PREFIX + raw
        offset = self._pos
        if nbytes >= _U32 or offset >= _U32:
            self._record64(full, view, nbytes, offset, phase)
            return
        # the common case, in as few Python operations as possible (200,000 records per file happen)
        write, n = self._write, len(full)
        if phase is None:
            pad = -(offset + _LOCAL.size + n + 4) % ALIGNMENT
        else:
            pad = (phase - (offset + _LOCAL.size + n + 4)) % PHASE_MODULUS
        if nbytes:
            write(_LOCAL.pack(b"PK\x03\x04", 0, _FLAGS_DATA, 0, 0, 0, 0, 0, 0, n, pad + 4))
            write(full)
            write(_padding(pad))
            if view.nbytes != nbytes:
                view = view[:nbytes]
            write(view)
            h = self._descriptor_hash
            if nbytes >= 8 and view[:4] == _DESCRIPTOR_SIG:
                h = hash_combine(h, int.from_bytes(view[4:8], "little"))
            write(_DESCRIPTOR32.pack(_DESCRIPTOR_SIG, 0, nbytes, nbytes))
            self._descriptor_hash = hash_combine(h, 0)
            self._pos = offset + _LOCAL.size + n + pad + 4 + nbytes + _DESCRIPTOR32.size
            self._entries.append((full, _FLAGS_DATA, nbytes, offset))
        else:
            write(_LOCAL.pack(b"PK\x03\x04", 0, _FLAG_UTF8, 0, 0, 0, 0, 0, 0, n, pad + 4))
            write(full)
            write(_PADDING[pad])
            self._pos = offset + _LOCAL.size + n + pad + 4
            self._entries.append((full, _FLAG_UTF8, 0, offset))
        self._names[raw] = None

    def _record64(self, full: bytes, view, nbytes: int, offset: int, phase: Optional[int] = None) -> None:
        """:meth:`_record` for a record with a zip64 extra field: of 4 GiB or more, or starting past 4 GiB."""
        zip64: List[int] = []
        if nbytes >= _U32:
            zip64 += [nbytes, 0]  # uncompressed, compressed size (0 here: the data descriptor has it)
        zip64 += [offset] if offset >= _U32 else []
        extra64 = _zip64_extra(zip64)
        start = offset + _LOCAL.size + len(full) + len(extra64) + 4
        pad = -start % ALIGNMENT if phase is None else (phase - start) % PHASE_MODULUS
        flags = _FLAGS_DATA if nbytes else _FLAG_UTF8
        header = _LOCAL.pack(b"PK\x03\x04", 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra64) + pad + 4)
        for part in (header, full, extra64, _padding(pad)):
            self._out(part, len(part))
        if nbytes:
            self._out(view[:nbytes] if view.nbytes != nbytes else view, nbytes)
            descriptor = _DESCRIPTOR64.pack(_DESCRIPTOR_SIG, 0, nbytes, nbytes)
            self._out(descriptor, len(descriptor))
        self._names[full[len(_PREFIX):]] = None
        self._entries.append((full, flags, nbytes, offset))

    def write_end_of_file(self) -> None:
        """Write the records torch adds at the end, the central directory and the end records.

        Raises:
            OSError: from the sink.
        """
        if self._finished:
            return
        self._finished = True  # also on failure: as torch's writer, never finish twice
        if b"version" not in self._names and b".data/version" not in self._names:
            self._record(b"version", memoryview(FILE_FORMAT_VERSION), len(FILE_FORMAT_VERSION))
        if b"byteorder" not in self._names:
            order = sys.byteorder.encode()
            self._record(b"byteorder", memoryview(order), len(order))
        names_hash = _names_hash(tuple(self._names))
        sid = f"{names_hash:020d}{self._descriptor_hash:020d}".encode()
        self._record(SERIALIZATION_ID.encode(), memoryview(sid), len(sid))
        cd_offset = self._pos
        central = bytearray()
        for full, flags, size, offset in self._entries:
            zip64: List[int] = []
            if size >= _U32:
                zip64 += [size, size]
            if offset >= _U32:
                zip64.append(offset)
            extra = _zip64_extra(zip64) if zip64 else b""
            small = min(size, _U32)
            central += _CENTRAL.pack(b"PK\x01\x02", 0, 0, flags, 0, 0, 0, 0, small, small, len(full), len(extra),
                                     0, 0, 0, 0, min(offset, _U32))
            central += full
            central += extra
        self._out(central, len(central))
        n = len(self._entries)
        eocd64_offset = self._pos
        for end in (_EOCD64.pack(b"PK\x06\x06", _EOCD64.size - 12, 0x031E, 0x002D, 0, 0, n, n, len(central),
                                 cd_offset),
                    _LOCATOR.pack(b"PK\x06\x07", 0, eocd64_offset, 1),
                    _EOCD.pack(b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), min(len(central), _U32),
                               min(cd_offset, _U32), 0)):
            self._out(end, len(end))
        if self._pending:
            self._sink_write(self._pending)
            self._pending = bytearray()


class _Borrow:
    """A ``write`` that hands the record data ``view`` (and its pieces) to the sink's ``write_borrowed`` with their
    address phase, after the pending coalesced bytes; every other piece of the record goes to ``write``."""

    def __init__(self, writer: TorchArchiveWriter, write, view: memoryview, phase: int) -> None:
        self.writer, self.write, self.obj, self.phase = writer, write, view.obj, phase
        self.done = 0  # record data bytes handed over so far

    def __call__(self, data) -> None:
        if not isinstance(data, memoryview) or data.obj is not self.obj:
            self.write(data)
            return
        self.writer._flush_pending()
        self.writer._borrow(data, (self.phase + self.done) % PHASE_MODULUS)
        self.done += data.nbytes


class _Pieces:
    """A ``write`` that hands the record data ``view`` (its first ``nbytes`` bytes) to ``write`` in pieces, each after
    ``ready`` said it is final; every other piece of the record (header, descriptor) goes through unchanged."""

    def __init__(self, write, view: memoryview, nbytes: int, ready: Callable[[int], None]) -> None:
        self.write, self.view, self.nbytes, self.ready = write, view, nbytes, ready

    def __call__(self, data) -> None:
        if not isinstance(data, memoryview) or data.obj is not self.view.obj or data.nbytes != self.nbytes:
            self.write(data)
            return
        for a in range(0, self.nbytes, READY_PIECE_NBYTES):
            b = min(self.nbytes, a + READY_PIECE_NBYTES)
            self.ready(b)
            self.write(data[a:b])


def write_torch_file(fileobj, data_pkl: bytes, records: Sequence[Tuple[str, Any, int]], *,
                     coalesce: bool = False, ready: Optional[Callable[[int, int], None]] = None,
                     phases: Optional[Sequence[Optional[int]]] = None) -> None:
    """Write a ``torch.save``-format archive into ``fileobj``, as ``torch.save`` does under
    ``torch.serialization.set_crc32_options(False)`` (the zip's CRC-32 fields are 0: see the "Checksums"
    note of :mod:`snapckpt.formats.torch_zip`).

    Args:
        fileobj: binary file object with ``write`` (need not be seekable); the caller flushes/fsyncs/closes it.
        data_pkl: the pickle bytes (``data.pkl``).
        records: ``(key, data, nbytes)`` per span: ``data`` is a bytes-like object (in the persister, a
            memoryview of the arena span) whose first ``nbytes`` bytes are written as ``data/<key>``
            without an intermediate copy (with ``coalesce``, records under 64 KiB are copied).
        coalesce: see :class:`TorchArchiveWriter`.
        ready: ``ready(i, k)`` returns once the first ``k`` bytes of record ``i``'s data are final (see
            :meth:`TorchArchiveWriter.write_record`); ``None``: they all are.
        phases: per record, its ``phase`` (:meth:`TorchArchiveWriter.write_record`: the data's address modulo
            :data:`PHASE_MODULUS`, or ``None``); ``None``: torch's bytes exactly.

    Raises:
        OSError: from ``fileobj``.
        ValueError: a key written twice or unusable as a record name, or a buffer shorter than its ``nbytes``.
    """
    w = TorchArchiveWriter(fileobj, coalesce=coalesce)
    w.write_record("data.pkl", data_pkl, len(data_pkl))
    w.write_record(".format_version", b"1", 1)
    alignment = str(ALIGNMENT).encode()
    w.write_record(".storage_alignment", alignment, len(alignment))
    order = sys.byteorder.encode()
    w.write_record("byteorder", order, len(order))
    if ready is None and phases is None:
        for key, data, nbytes in records:
            w.write_record(f"data/{key}", data, nbytes)
    else:
        for i, (key, data, nbytes) in enumerate(records):
            w.write_record(f"data/{key}", data, nbytes, None if ready is None else (lambda k, i=i: ready(i, k)),
                           None if phases is None else phases[i])
    w.write_end_of_file()
