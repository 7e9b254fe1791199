"""The restart's read-ahead (snapckpt/engine/prefetch.py): it fills the page cache with the newest checkpoint's
file while the persister starts, without copying the bytes into this process (the load's own read copies them
once); a real file in a temporary directory."""
from __future__ import annotations

import os

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
    real_preadv, real_read = os.preadv, os.read
    monkeypatch.setattr(prefetch_mod.os, "preadv", lambda *a, **k: reads.append("preadv") or real_preadv(*a, **k))
    monkeypatch.setattr(prefetch_mod.os, "read", lambda *a, **k: reads.append("read") or real_read(*a, **k))
    p = Prefetch([(path, NBYTES)])
    assert p.done.wait(30)
    p.stop(5)
    assert reads == []  # no byte copied into this process: the kernel reads ahead on its own
    monkeypatch.undo()
    assert wait_until(lambda: _cached(path), timeout=30)


