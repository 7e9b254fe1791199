"""Growing a slot (snapckpt/persister/arena.py, SlotFiles.ensure_size) and mapping it in a rank
(snapckpt/engine/slot_maps.py, _populate), issue 18: for a reservation ahead of the first save the persister
writes the pages it reserves (``zero=True``), so they are up to date, and the rank's prefault maps them with read
faults, which the kernel's fault-around serves 16 pages at a time; the pages are writable afterwards (a tmpfs
tracks no dirty pages). A growth a save waits for keeps ``posix_fallocate``. Counted in the minor page faults of
this thread, not in time. Real slot files on the tmpfs ``/dev/shm``, as the arena's."""
from __future__ import annotations

import mmap
import os
import resource
import shutil

import pytest

from snapckpt.engine.slot_maps import MappedSlot, _populate
from snapckpt.persister.arena import SlotFiles

NBYTES = 16 << 20
PAGES = NBYTES // mmap.PAGESIZE


def _thread_minflt() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


@pytest.fixture
def arena_dir(tmp_path):
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)  # slots live on a tmpfs
    d = os.path.join(shm, f"snapckpt-test-growth-{os.getpid()}")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_grown_slot_is_mapped_by_few_read_faults_and_then_written_without_any(arena_dir):
    files = SlotFiles(arena_dir)
    assert files.ensure_size(0, 0, NBYTES, 0, zero=True) == NBYTES
    m = MappedSlot(files.path(0, 0), NBYTES, zeroed=True)
    try:
        before = _thread_minflt()
        assert _populate(m, 0, NBYTES)
        mapping = _thread_minflt() - before
        # a page the persister only reserved (posix_fallocate) is zeroed by its first fault: one fault per page
        assert mapping < PAGES // 4, (mapping, PAGES)
        before = _thread_minflt()
        for off in range(0, NBYTES, mmap.PAGESIZE):  # one write per page
            m.buf[off] = 1
        writes = _thread_minflt() - before
        assert writes < PAGES // 64, (writes, PAGES)
    finally:
        m.close()
    with open(files.path(0, 0), "rb") as f:
        data = f.read()
    assert len(data) == NBYTES and data.count(1) == PAGES and data.count(0) == NBYTES - PAGES


def test_growing_a_slot_keeps_its_bytes_and_zeroes_the_new_ones(arena_dir):
    files = SlotFiles(arena_dir)
    files.ensure_size(0, 0, NBYTES // 2 + 100, 0, zero=True)
    with open(files.path(0, 0), "r+b") as f:
        f.write(b"\x07" * (NBYTES // 2 + 100))
    assert files.ensure_size(0, 0, NBYTES, NBYTES // 2 + 100, zero=True) == NBYTES
    with open(files.path(0, 0), "rb") as f:
        data = f.read()
    assert data[:NBYTES // 2 + 100] == b"\x07" * (NBYTES // 2 + 100) and not any(data[NBYTES // 2 + 100:])
    # growth that pauses between pieces (a reservation ahead of the first save) ends the same way
    pauses = []
    assert files.ensure_size(0, 1, 3 * NBYTES // 2, 0, pause=lambda: pauses.append(1), zero=True) == 3 * NBYTES // 2
    assert os.path.getsize(files.path(0, 1)) == 3 * NBYTES // 2 and pauses


def test_zeros_are_written_on_a_tmpfs_only_and_when_asked(tmp_path, monkeypatch):
    """Elsewhere (an ``shm_dir`` on a disk, which works with a warning) zeros would be written out to the disk:
    ``posix_fallocate`` reserves the blocks there, as before; and it does for a growth that a save waits for
    (``zero=False``), which it makes faster."""
    from snapckpt.persister import arena

    written = []
    real = arena.write_zeros
    monkeypatch.setattr(arena, "write_zeros", lambda fd, lo, hi: (written.append((lo, hi)), real(fd, lo, hi)))
    for fstype, zero, zeroed in (("ext4", True, []), ("tmpfs", True, [(0, NBYTES)]), ("tmpfs", False, [])):
        monkeypatch.setattr(arena, "fs_type", lambda path, fstype=fstype: fstype)
        files = SlotFiles(str(tmp_path / f"{fstype}-{zero}"))
        written.clear()
        assert files.ensure_size(0, 0, NBYTES, 0, zero=zero) == NBYTES == os.path.getsize(files.path(0, 0))
        assert written == zeroed, (fstype, zero)


def test_a_save_maps_the_rest_of_a_slot_from_where_the_last_one_stopped(arena_dir):
    """A save maps the pages up to its own size (MappedSlot.populate); a later, slightly larger state maps the rest
    from where that stopped, which need not be a page boundary: it is rounded down to one (madvise refuses an
    unaligned start with EINVAL, which would read as a kernel without MADV_POPULATE_READ and turn it off)."""
    from snapckpt.engine import slot_maps

    files = SlotFiles(arena_dir)
    files.ensure_size(0, 0, NBYTES, 0, zero=True)
    m = MappedSlot(files.path(0, 0), NBYTES, zeroed=True)
    try:
        m.populate(NBYTES // 2 + 100)
        assert m.populated == NBYTES // 2 + 100
        m.populate(NBYTES)
        assert m.populated == NBYTES and slot_maps._madvise  # still in use, not turned off
        before = _thread_minflt()
        for off in range(0, NBYTES, mmap.PAGESIZE):
            m.buf[off] = 1
        assert _thread_minflt() - before < PAGES // 64
    finally:
        m.close()


def test_a_save_leaves_the_pages_of_a_slot_not_zeroed_to_its_copy(arena_dir):
    """A slot a save grew itself (``posix_fallocate``: the pages are zeroed by their first fault) is not mapped
    before the copy: the copy's faults zero them on all of torch's threads, where a populate would on one."""
    files = SlotFiles(arena_dir)
    files.ensure_size(0, 0, NBYTES, 0)
    m = MappedSlot(files.path(0, 0), NBYTES)
    try:
        before = _thread_minflt()
        m.populate(NBYTES)
        assert m.populated == 0 and _thread_minflt() - before < 16
    finally:
        m.close()


def test_reserved_slots_are_zeroed_and_prefaulted_with_read_faults_the_others_with_write_faults(arena_dir):
    """The persister's reservation ahead of the first save writes its pages (SlotTable.reserve); the rank's
    prefault of a reserved slot (SlotMaps.prefault) maps it as zeroed (read faults), that of a slot a save's
    acquire grew alongside (SlotMaps.get of another slot) as not zeroed."""
    import threading

    from snapckpt.engine.slot_maps import SlotMaps
    from snapckpt.persister.slots import Run, SlotTable

    table = SlotTable(SlotFiles(arena_dir), threading.RLock())
    table.runs["run"] = Run("run", 1, [0], True, arena_dir + "-ckpt", None, 30.0, True, False)
    maps = SlotMaps(rank=0, slots_per_rank=2, wait_timeout_secs=30.0)
    try:
        entry = table.attach(0, table.runs["run"], None, 2)
        grown = table.reserve(entry, NBYTES, 1)  # one slot: the other is left to a save
        assert [s.index for s in grown] == [0]
        assert grown[0].growing.result(timeout=60) == NBYTES
        m = MappedSlot(table.arena.path(0, 0), NBYTES, zeroed=True)
        try:
            before = _thread_minflt()
            assert _populate(m, 0, NBYTES)
            assert _thread_minflt() - before < PAGES // 4  # pages up to date: fault-around
        finally:
            m.close()
        maps.prefault(0, table.arena.path(0, 0), NBYTES)
        reserved = maps._pending[0].future.result(timeout=60)
        assert reserved is not None and reserved.zeroed and reserved.populated == NBYTES
        table.arena.ensure_size(0, 1, NBYTES, 0)
        maps.get(0, table.arena.path(0, 0), NBYTES, usable=[0, 1])  # starts slot 1's prefault
        other = maps._pending[1].future.result(timeout=60)
        assert other is not None and not other.zeroed and other.populated == NBYTES
    finally:
        maps.close()
        table.shutdown()
