"""The restart's read-ahead (snapckpt/engine/prefetch.py): it fills the page cache with the newest checkpoint's
file while the persister starts, without copying the bytes into this process (the load's own read copies them
once); a real file in a temporary directory."""
from __future__ import annotations

import os
import struct
import zipfile

import torch

from _harness import wait_until
from snapckpt.engine import prefetch as prefetch_mod
from snapckpt.engine.prefetch import Prefetch

NBYTES = 24 << 20


def _cached(path: str) -> bool:
    """Whether every byte of ``path`` is in the page cache (a read that may not wait for the disk succeeds);
    True where the file system cannot tell (RWF_NOWAIT unsupported: the read-ahead is then a hint only)."""
    buf = bytearray(1 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in range(0, os.fstat(fd).st_size, len(buf)):
            try:
                if os.preadv(fd, [buf], off, os.RWF_NOWAIT) <= 0:
                    return False
            except BlockingIOError:
                return False
            except OSError:  # EOPNOTSUPP and the like
                return True
        return True
    finally:
        os.close(fd)


def test_prefetch_fills_the_page_cache_without_reading_into_the_process(tmp_path, monkeypatch):
    path = str(tmp_path / "rank_00000.pt")
    with open(path, "wb") as f:
        f.write(os.urandom(NBYTES))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    reads = []
    real_preadv, real_read, real_pread = os.preadv, os.read, os.pread
    monkeypatch.setattr(prefetch_mod.os, "preadv", lambda *a, **k: reads.append("preadv") or real_preadv(*a, **k))
    monkeypatch.setattr(prefetch_mod.os, "read", lambda *a, **k: reads.append("read") or real_read(*a, **k))
    monkeypatch.setattr(prefetch_mod.os, "pread", lambda fd, n, off: reads.append(n) or real_pread(fd, n, off))
    p = Prefetch([(path, NBYTES)])
    assert p.done.wait(30)
    p.stop(5)
    # no byte of the data copied into this process (the kernel reads ahead on its own): only the file's tail,
    # where a zip archive's directory would be (this file is none)
    assert reads == [prefetch_mod._TAIL]
    monkeypatch.undo()
    assert wait_until(lambda: _cached(path), timeout=30)




def _torch_file(path: str) -> None:
    """A ``torch.save`` archive of records of several MiB (the headers spread through the file) and small ones."""
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.rand(1 << 20, generator=g) for i in range(6)}  # 4 MiB each
    state.update({f"b{i}": torch.rand(64, generator=g) for i in range(5)})
    torch.save(state, path)


def test_prefetch_asks_for_the_archive_metadata_before_the_bulk(tmp_path, monkeypatch):
    # The load parses the zip directory (the file's end) and reads every record's local header before its pass
    # in file order; asked for in file order only, the last headers arrive only once the whole file is read.
    path = str(tmp_path / "rank_00000.pt")
    _torch_file(path)
    size = os.path.getsize(path)
    with zipfile.ZipFile(path) as z:
        heads = {i.filename: i.header_offset for i in z.infolist()}
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(prefetch_mod.os, "posix_fadvise",
                        lambda fd, off, n, advice: calls.append((off, n, advice)) or real(fd, off, n, advice))
    monkeypatch.setattr(prefetch_mod, "CHUNK", 2 << 20)  # several bulk pieces, each holding a header or none
    p = Prefetch([(path, size)])
    assert p.done.wait(30)
    p.stop(5)
    assert all(a == os.POSIX_FADV_WILLNEED for _, _, a in calls)

    def first_covering(off: int) -> int:
        return next(i for i, (lo, n, _) in enumerate(calls) if lo <= off < lo + n)

    bulk = [i for i, (lo, n, _) in enumerate(calls) if lo == 0 and n == prefetch_mod.CHUNK]  # its first piece
    for name, off in heads.items():
        assert first_covering(off) < bulk[0], f"{name}'s header (offset {off}) is asked for only with the bulk"
    # data.pkl whole, ahead of the bulk too
    with zipfile.ZipFile(path) as z:
        pkl = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    assert first_covering(pkl.header_offset + pkl.file_size) < bulk[0]
    # then every byte, in order
    covered = sorted((lo, lo + n) for lo, n, _ in calls[bulk[0]:])
    assert covered[0][0] == 0 and covered[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


def test_header_ranges_of_files_that_are_no_usable_archive(tmp_path):
    # a hint only: anything that is not a readable zip archive gets no header pass (the load reports it)
    def ranges(data: bytes):
        path = str(tmp_path / "f")
        with open(path, "wb") as f:
            f.write(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            return prefetch_mod.header_ranges(path, fd, len(data))
        finally:
            os.close(fd)

    assert ranges(b"") == []
    assert ranges(os.urandom(1 << 16)) == []
    # an end record naming a directory that is not there
    assert ranges(b"x" * 100 + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 3, 3, 50, 10, 0)) == []
    # a zip64 locator pointing past the end of the file
    assert ranges(struct.pack("<4sLQL", b"PK\x06\x07", 0, 1 << 40, 1)
                  + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)) == []


def test_header_ranges_skip_archives_with_many_records(tmp_path, monkeypatch):
    # a directory of many records costs more to parse than the header pass saves: the bulk alone then
    path = str(tmp_path / "rank_00000.pt")
    _torch_file(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        assert prefetch_mod.header_ranges(path, fd, size)
        monkeypatch.setattr(prefetch_mod, "MAX_HEADS", 3)
        assert prefetch_mod.header_ranges(path, fd, size) == []
    finally:
        os.close(fd)
