"""The pure-Python torch.save archive writer against torch's own (``torch._C.PyTorchFileWriter``, CRC-32 off,
64-byte alignment): identical bytes, and write calls, for the shapes of records the persister writes; then
``torch.load`` of the result."""
from __future__ import annotations

import io
import mmap
import sys
import zipfile

import pytest
import torch

from snapckpt._internal.compat import torch_file_writer
from snapckpt.formats.torch_archive import TorchArchiveWriter, unordered_set_order, write_torch_file

BIG = 4 << 20  # writes larger than this are compared by size and first bytes (never read whole)


class _Recorder:
    """A non-seekable sink that keeps every write (large ones as (size, first 8 bytes))."""

    def __init__(self) -> None:
        self.writes: list = []

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.writes.append(("big", n, bytes(data[:8])) if n > BIG else bytes(data))
        return n


def _joined(writes: list) -> list:
    """``writes`` with consecutive small writes joined: the stream, whatever the write calls."""
    out: list = []
    for w in writes:
        if isinstance(w, bytes) and out and isinstance(out[-1], bytearray):
            out[-1] += w
        else:
            out.append(bytearray(w) if isinstance(w, bytes) else w)
    return out


def _both(records):
    """Write ``records`` (name, bytes-like, nbytes) with torch's writer and ours; return both write lists
    (after checking that ours with ``coalesce=True`` writes the same stream in fewer calls)."""
    theirs, ours, coalesced = _Recorder(), _Recorder(), _Recorder()
    tw, ow, cw = torch_file_writer(theirs, 64), TorchArchiveWriter(ours), TorchArchiveWriter(coalesced, coalesce=True)
    for name, data, n in records:
        tw.write_record(name, torch.frombuffer(data, dtype=torch.uint8).untyped_storage() if n else b"", n)
        ow.write_record(name, data, n)
        cw.write_record(name, data, n)
    for w in (tw, ow, cw):
        w.write_end_of_file()
    assert _joined(coalesced.writes) == _joined(theirs.writes)
    assert len(coalesced.writes) < len(theirs.writes)
    return theirs.writes, ours.writes


def _anonymous(nbytes: int) -> mmap.mmap:
    """Zero pages that cost no memory until written (MAP_NORESERVE), for records of more than 4 GiB."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000))


CASES = {
    "empty_storages": [("data.pkl", bytearray(b"\x80\x02}q\x00."), 6), ("data/0", bytearray(), 0),
                       ("data/1", bytearray(), 0)],
    "odd_sizes": [("data.pkl", bytearray(b"p" * 101), 101)]
                 + [(f"data/{i}", bytearray(bytes(range(256)) * 2)[:n], n)
                    for i, n in enumerate((1, 3, 63, 64, 65, 127, 500))],
    "unicode_keys": [("data.pkl", bytearray(b"x"), 1), ("data/ключ é", bytearray(9), 9),
                     ("data/😀 ", bytearray(), 0), ("data/a/b c", bytearray(70), 70)],
    # data that starts like a zip data descriptor: torch folds its "CRC" into the serialization id
    "descriptor_lookalike": [("data.pkl", bytearray(b"x"), 1),
                             ("data/0", bytearray(b"PK\x07\x08\x01\x02\x03\x04z"), 9)],
    "torch_save_layout": [("data.pkl", bytearray(b"q" * 300), 300), (".format_version", bytearray(b"1"), 1),
                          (".storage_alignment", bytearray(b"64"), 2),
                          ("byteorder", bytearray(sys.byteorder.encode()), 6)]
                         + [(f"data/{i}", bytearray(i * 7 + 1), i * 7 + 1) for i in range(40)],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_bytes_as_torch_writer(case):
    theirs, ours = _both(CASES[case])
    assert ours == theirs


def test_same_bytes_with_more_than_65535_records():
    """zip64 entry counts (the 200,000-tensor state of issue 18 writes past 0xFFFF records)."""
    one = bytearray(b"ab")
    theirs, ours = _both([("data.pkl", bytearray(b"x"), 1)] + [(f"data/{i}", one, 2 if i % 3 else 0)
                                                              for i in range(70_000)])
    assert ours == theirs
    assert ours[-1][8:12] == b"\xff\xff\xff\xff"  # end of central directory: counts capped, zip64 record has them


@pytest.mark.parametrize("size", [0xFFFFFFFE, 0xFFFFFFFF, 0x100000064])
def test_same_bytes_with_zip64_sizes_and_offsets(size):
    """A record of about 4 GiB (never touched: zero pages) and records after it at offsets past 4 GiB."""
    big = _anonymous(size)
    try:
        theirs, ours = _both([("data.pkl", bytearray(b"abc"), 3), ("data/0", big, size), ("data/1", bytearray(15), 15),
                              ("data/2", bytearray(), 0)])
    finally:
        big.close()
    assert ours == theirs
    assert ("big", size, bytes(8)) in ours  # the record went out as one write, not copied into a header


def test_unordered_set_order_matches_libstdcxx_growth():
    """Small sets iterate in reverse insertion order when no two codes share a bucket; a collision groups them
    (the byte comparisons above check the order against torch's, rehashes included)."""
    assert unordered_set_order([1, 2, 3]) == [2, 1, 0]
    assert unordered_set_order([1, 2, 14]) == [1, 2, 0]  # 14 % 13 == 1: first in bucket 1's run, after 2


def test_torch_load_reads_the_archive(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(3, 5, generator=g), "i": torch.arange(7, dtype=torch.int16), "e": torch.empty(0)}
    ref = io.BytesIO()
    torch.save(state, ref)
    # the same data.pkl and storages, written by our writer from memoryviews
    with zipfile.ZipFile(io.BytesIO(ref.getvalue())) as z:
        names = {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}
    keys = sorted(k[len("data/"):] for k in names if k.startswith("data/"))
    out = io.BytesIO()
    write_torch_file(out, names["data.pkl"], [(k, memoryview(names[f"data/{k}"]), len(names[f"data/{k}"]))
                                              for k in keys])
    path = tmp_path / "ours.pt"
    path.write_bytes(out.getvalue())
    for got in (torch.load(io.BytesIO(out.getvalue()), weights_only=True),
                torch.load(path, weights_only=True, mmap=True)):
        assert got.keys() == state.keys()
        for k in state:
            assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k])


def test_bad_records_are_refused():
    w = TorchArchiveWriter(io.BytesIO())
    w.write_record("data/0", b"abc", 3)
    with pytest.raises(ValueError, match="written twice"):
        w.write_record("data/0", b"abc", 3)
    with pytest.raises(ValueError, match="NUL"):
        w.write_record("data/\0", b"", 0)
    with pytest.raises(ValueError, match="requested from a buffer of 2"):
        w.write_record("data/1", b"ab", 3)


def test_no_persister_module_imports_torch():
    """Every path of the persister (start, disk save, crash flush, replication, upload, stop flush) lives in these
    modules; none imports torch at import time (tests/test_smoke.py checks a running persister's mappings)."""
    import pkgutil
    import subprocess

    import snapckpt.persister

    mods = [f"snapckpt.persister.{m.name}" for m in pkgutil.iter_modules(snapckpt.persister.__path__)]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
            + "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_records_with_a_phase_start_there_and_load_as_torch_saved_them(tmp_path):
    """A record written with a ``phase`` starts its data at a file offset of that remainder modulo PHASE_MODULUS
    (still 64-byte aligned), whatever comes before it (a pickle of odd length, zip64 offsets aside); torch.load,
    plain and with mmap, reads the same tensors as from torch.save's own file; a zero phase and records without one
    keep torch's padding."""
    from snapckpt.formats.torch_archive import PHASE_MODULUS

    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(300, 70, generator=g), "b": torch.arange(33, dtype=torch.int64),
             "c": torch.randn(2049, generator=g).double()}
    ref = io.BytesIO()
    torch.save(state, ref)
    with zipfile.ZipFile(io.BytesIO(ref.getvalue())) as z:
        names = {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}
    keys = sorted(k[len("data/"):] for k in names if k.startswith("data/"))
    phases = [64 * 37, None, 4032][:len(keys)]
    out = io.BytesIO()
    write_torch_file(out, names["data.pkl"], [(k, memoryview(names[f"data/{k}"]), len(names[f"data/{k}"]))
                                              for k in keys], phases=phases)
    blob = out.getvalue()
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        for k, phase in zip(keys, phases):
            info = z.getinfo(f"archive/data/{k}")
            name_len, extra_len = int.from_bytes(blob[info.header_offset + 26:info.header_offset + 28], "little"), \
                int.from_bytes(blob[info.header_offset + 28:info.header_offset + 30], "little")
            start = info.header_offset + 30 + name_len + extra_len
            assert start % 64 == 0
            if phase is not None:
                assert start % PHASE_MODULUS == phase
            assert blob[start:start + info.file_size] == names[f"data/{k}"]
    path = tmp_path / "phased.pt"
    path.write_bytes(blob)
    for got in (torch.load(io.BytesIO(blob), weights_only=True), torch.load(path, weights_only=True, mmap=True)):
        assert got.keys() == state.keys()
        for k in state:
            assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k])
    with pytest.raises(ValueError, match="phase"):
        TorchArchiveWriter(io.BytesIO()).write_record("data/x", b"abcd", 4, phase=65)


def test_a_phased_record_goes_to_write_borrowed_whole_and_the_rest_to_write():
    """With a sink that has ``write_borrowed``, a phased record's data (and only it) is handed over there, as a
    view of the caller's buffer with its phase, after the coalesced bytes before it; the stream is the same."""
    big = mmap.mmap(-1, 3 << 20)
    big.write(bytes(range(256)) * (len(big) // 256))
    calls = []

    class Sink(io.BytesIO):
        def write(self, data) -> int:
            calls.append(("write", memoryview(data).nbytes))
            return super().write(data)

        def write_borrowed(self, data, phase) -> int:
            assert isinstance(data, memoryview) and data.obj is big
            calls.append(("borrowed", data.nbytes, phase))
            return super().write(data)

    plain, borrowed = io.BytesIO(), Sink()
    recs = [("0", memoryview(big)[4096:4096 + (2 << 20)], 2 << 20), ("1", b"small", 5)]
    write_torch_file(plain, b"pickle!", recs, phases=[0, None], coalesce=True)
    write_torch_file(borrowed, b"pickle!", recs, phases=[0, None], coalesce=True)
    assert borrowed.getvalue() == plain.getvalue()
    assert [c for c in calls if c[0] == "borrowed"] == [("borrowed", 2 << 20, 0)]


def test_records_with_a_phase_past_4_gib_start_there_and_torch_loads_them(tmp_path):
    """The zip64 headers of :meth:`TorchArchiveWriter._record64` with a ``phase`` (a rank's file past 4 GiB, or one
    tensor of 4 GiB or more, as the persister writes them with direct I/O): a phased record of more than 4 GiB, then
    two small ones at offsets past 4 GiB, start at their phases and load with torch (a sparse file: the large record's
    zero pages are skipped, never written nor read)."""
    import os

    from snapckpt.formats.torch_archive import PHASE_MODULUS
    from snapckpt.formats.torch_zip import TensorRef, pickle_skeleton

    size = 0x100000064
    big = _anonymous(size)
    small = bytearray(torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8).numpy().tobytes())
    spans = {"0": (big, size), "1": (memoryview(small), 2 * 4096 + 7), "2": (memoryview(small)[4096:], 100)}
    obj = {k: torch.empty(0, dtype=torch.uint8) for k in spans}
    pkl, _ = pickle_skeleton(obj, {id(t): TensorRef(k, 0, (spans[k][1],), (1,), torch.uint8, "cpu", spans[k][1])
                                   for k, t in obj.items()})

    class Sparse:  # the large record as a hole: the same zeros as its untouched pages
        def __init__(self, f) -> None:
            self.f = f

        def write(self, data) -> int:
            if isinstance(data, memoryview) and data.obj is big:
                self.f.seek(data.nbytes, os.SEEK_CUR)
            else:
                self.f.write(data)
            return len(data)

    phases = [64 * 3, 64 * 5, 4032]
    path = tmp_path / "past4g.pt"
    try:
        with open(path, "wb") as f:
            write_torch_file(Sparse(f), pkl, [(k, v, n) for k, (v, n) in spans.items()], phases=phases)
    finally:
        big.close()
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for k, phase in zip(spans, phases):
            info = z.getinfo(f"archive/data/{k}")
            f.seek(info.header_offset + 26)
            name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
            start = info.header_offset + 30 + name_len + extra_len
            assert start % PHASE_MODULUS == phase and (k == "0" or start > 0xFFFFFFFF)
    got = torch.load(path, weights_only=True, mmap=True)
    assert got["0"].shape == (size,) and not got["0"][-64:].any()
    assert bytes(got["1"].numpy()) == bytes(small[:2 * 4096 + 7]) and bytes(got["2"].numpy()) == bytes(small[4096:4196])
