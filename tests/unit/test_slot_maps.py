"""A rank's slot mappings and their background prefault (snapckpt/engine/slot_maps.py): a save that does not wait
for a prefault still running (``overlap=True``) gets a working mapping of its own, and the prefault's mapping is
unmapped, never leaked; a save that waits gets the prefaulted mapping. Real slot files in a temporary directory;
no persister process."""
from __future__ import annotations

import mmap
import os
import resource
import threading
import time

from snapckpt.engine.slot_maps import SlotMaps

NBYTES = 4 << 20


def _grow_after_prefault_polls(path: str) -> None:
    """Create the slot file at full size once the prefault, polling for it, has backed off to 0.2 s waits."""
    time.sleep(1.0)
    with open(path, "wb") as f:
        f.truncate(NBYTES)


def test_save_that_does_not_wait_maps_the_slot_itself_and_the_prefault_mapping_is_dropped(tmp_path):
    path = str(tmp_path / "slot0")
    maps = SlotMaps(rank=0, slots_per_rank=2, wait_timeout_secs=30.0)
    try:
        maps.prefault(0, path, NBYTES)  # waits for the persister to grow the file
        pending = maps._pending[0]
        _grow_after_prefault_polls(path)
        m = maps.get(0, path, NBYTES, usable=[0], wait_prefault=False)
        m.tensor[:8] = 7  # the save's copy writes through its mapping into the file
        with open(path, "rb") as f:
            assert f.read(8) == bytes([7] * 8)
        made = pending.future.result(timeout=30)
        if made is not m:  # the usual case: stopped while waiting (None), or unmapped once it ended
            assert made is None or made.tensor is None
        assert maps.get(0, path, NBYTES, usable=[0]) is m  # kept for the next save of this slot
    finally:
        maps.close()


def test_save_that_waits_gets_the_prefaulted_mapping(tmp_path):
    path = str(tmp_path / "slot0")
    maps = SlotMaps(rank=0, slots_per_rank=2, wait_timeout_secs=30.0)
    try:
        maps.prefault(0, path, NBYTES)
        pending = maps._pending[0]
        _grow_after_prefault_polls(path)
        m = maps.get(0, path, NBYTES, usable=[0])
        assert m is pending.future.result(timeout=0) and m.tensor is not None
        assert os.path.getsize(path) == NBYTES
    finally:
        maps.close()


def _thread_minflt() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_prefault_maps_every_page_writable_and_leaves_the_data(tmp_path):
    """The prefault (``MADV_POPULATE_READ``) maps the slot so that writes into it take no page fault, and it
    never changes what the slot holds (an older snapshot a load may still need). Counted in minor faults of
    this thread, not in time."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)  # slots live on a tmpfs
    path = os.path.join(shm, f"snapckpt-test-prefault-{os.getpid()}")
    nbytes, page = 16 << 20, mmap.PAGESIZE
    pattern = bytes(range(256)) * (nbytes // 512)
    with open(path, "wb") as f:  # as the persister makes a slot; its first half holds an older snapshot
        os.posix_fallocate(f.fileno(), 0, nbytes)
        f.write(pattern)
    maps = SlotMaps(rank=0, slots_per_rank=2, wait_timeout_secs=30.0)
    try:
        maps.prefault(0, path, nbytes)
        assert maps._pending[0].future.result(timeout=60) is not None
        m = maps.get(0, path, nbytes, usable=[0])
        before = _thread_minflt()
        for off in range(0, nbytes, page):  # one write per page, on this thread only
            m.buf[off] = m.buf[off]
        faults = _thread_minflt() - before
        assert faults < nbytes // page // 64, (faults, nbytes // page)
        assert bytes(m.buf[:len(pattern)]) == pattern and not any(m.buf[len(pattern):])
    finally:
        maps.close()
        os.unlink(path)


def _prefault_blocked_after_its_first_chunk(monkeypatch, tmp_path):
    """A slot file on a tmpfs holding data, a prefault of it whose first 1 MiB chunk is mapped and which then blocks
    (until ``release``): a save comes while the prefault still runs."""
    import snapckpt.engine.slot_maps as sm

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(shm, f"snapckpt-test-takeover-{os.getpid()}")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * (NBYTES // 256))
    chunk, release, blocked = 1 << 20, threading.Event(), threading.Event()
    populate = sm._populate

    def first_chunk_then_block(m, lo, n):
        ok = populate(m, lo, n)
        if lo == 0:
            blocked.set()
            release.wait(60)
        return ok

    monkeypatch.setattr(sm, "_PREFAULT_CHUNK", chunk)
    monkeypatch.setattr(sm, "_populate", first_chunk_then_block)
    maps = SlotMaps(rank=0, slots_per_rank=2, wait_timeout_secs=30.0)
    maps.prefault(0, path, NBYTES)
    assert blocked.wait(60)
    return maps, path, chunk, release


def test_save_that_does_not_wait_takes_over_the_mapping_the_prefault_made_so_far(monkeypatch, tmp_path):
    """``overlap=True``: a save that comes while its slot's prefault runs gets the prefault's mapping, as far as
    it got, instead of a new mapping of the slot, whose every page would fault again: writes into the part
    mapped already take no page fault (minor faults of this thread, not time). The prefault stops and leaves the
    mapping open; it is unmapped once, with the rest."""
    maps, path, chunk, release = _prefault_blocked_after_its_first_chunk(monkeypatch, tmp_path)
    pending = maps._pending[0]
    try:
        m = maps.get(0, path, NBYTES, usable=[0], wait_prefault=False)
        before = _thread_minflt()
        for off in range(0, chunk, mmap.PAGESIZE):
            m.buf[off] = 7
        faults = _thread_minflt() - before
        assert faults < chunk // mmap.PAGESIZE // 16, (faults, chunk // mmap.PAGESIZE)  # a new mapping: 256
        release.set()
        assert pending.future.result(timeout=60) is m and m.tensor is not None  # not closed by the prefault
        assert maps.get(0, path, NBYTES, usable=[0]) is m
        m.buf[chunk:chunk + 1] = b"\x07"  # the rest is writable through it too
        with open(path, "rb") as f:
            assert f.read(1) == b"\x07"
    finally:
        release.set()
        maps.close()
        os.unlink(path)


def test_save_that_waits_takes_over_the_mapping_without_waiting_for_the_prefaults_chunk(monkeypatch, tmp_path):
    """``overlap=False``: a save that needs its slot while the prefault maps it takes the mapping over at once, not
    after the chunk the prefault is in (16 MiB by default); the prefault ends on its own later."""
    maps, path, chunk, release = _prefault_blocked_after_its_first_chunk(monkeypatch, tmp_path)
    pending = maps._pending[0]
    got = []
    try:
        t = threading.Thread(target=lambda: got.append(maps.get(0, path, NBYTES, usable=[0])))
        t.start()
        t.join(timeout=30)
        assert got and not release.is_set(), "the save waited for the prefault's chunk"
        release.set()
        assert pending.future.result(timeout=60) is got[0] and got[0].tensor is not None
    finally:
        release.set()
        t.join(timeout=60)
        maps.close()
        os.unlink(path)


def test_a_mapping_taken_over_is_not_unmapped_while_the_prefault_reads_a_chunk_of_it(monkeypatch, tmp_path):
    """A kernel without ``MADV_POPULATE_*`` (before 5.14): the prefault reads a byte per page of its chunk. A save
    that took its mapping over and then unmaps it (``drop()``: a persister restart; ``close()``; a slot that grew)
    while that chunk is read waits for the chunk: a read of an unmapped page kills the process (SIGSEGV)."""
    import snapckpt.engine.slot_maps as sm

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(shm, f"snapckpt-test-unmap-{os.getpid()}")
    with open(path, "wb") as f:
        f.truncate(NBYTES)
    chunk, inside, dropping = 1 << 20, threading.Event(), threading.Event()
    closed_under: list = []
    populate = sm._populate

    def second_chunk_read_slowly(m, lo, n):
        if lo == chunk:
            inside.set()
            dropping.wait(30)
            time.sleep(0.2)  # drop() runs meanwhile
            closed_under.append(m.buf.closed)
            if m.buf.closed:
                return False  # the read would fault on an unmapped page here
        return populate(m, lo, n)

    monkeypatch.setattr(sm, "_madvise", False)
    monkeypatch.setattr(sm, "_PREFAULT_CHUNK", chunk)
    monkeypatch.setattr(sm, "_populate", second_chunk_read_slowly)
    maps = SlotMaps(rank=0, slots_per_rank=2, wait_timeout_secs=30.0)
    try:
        maps.prefault(0, path, NBYTES)
        pending = maps._pending[0]
        assert inside.wait(30)
        m = maps.get(0, path, NBYTES, usable=[0], wait_prefault=False)  # taken over inside the chunk
        dropping.set()
        maps.drop()
        assert pending.future.result(timeout=30) is m and m.tensor is None
        assert closed_under == [False]
    finally:
        dropping.set()
        maps.close()
        os.unlink(path)


def test_a_save_that_waits_for_a_prefault_of_a_file_that_is_not_the_grown_one_fails_at_once(tmp_path):
    """The persister grew the slot before its acquire answered; a file at the path that is still short then (replaced
    or truncated by someone else, or removed) never grows: the save maps it itself, and fails naming the cause, rather
    than waiting out the prefault's timeout (``slot_wait_timeout_secs``, 10 minutes by default)."""
    import concurrent.futures as cf

    import pytest

    from snapckpt.errors import SnapshotError

    short, gone = str(tmp_path / "slot0"), str(tmp_path / "slot1")
    with open(short, "wb") as f:
        f.truncate(NBYTES // 2)
    maps = SlotMaps(rank=0, slots_per_rank=2, wait_timeout_secs=60.0)
    pool = cf.ThreadPoolExecutor(1)
    try:
        for slot, path, error in ((0, short, SnapshotError), (1, gone, FileNotFoundError)):
            maps.prefault(slot, path, NBYTES)
            time.sleep(0.1)  # the prefault polls the file's size
            save = pool.submit(maps.get, slot, path, NBYTES, usable=[slot])
            with pytest.raises(error):
                save.result(timeout=20)  # a hang: the prefault's 60 s
    finally:
        maps.close()
        pool.shutdown()
