"""The persister's slot table under a slot limit (snapckpt/persister/slots.py) and the budget arithmetic
(snapckpt/persister/budget.py): one slot per rank is reused, never while the persister or a peer send reads
it; slots beyond a budget's count are emptied. Real slot files (``posix_fallocate``) in a temporary
directory; no persister process."""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time

import pytest

from snapckpt.persister.arena import SlotFiles, SlotState
from snapckpt.persister.budget import fitting_setting, slots_within
from snapckpt.persister.slots import HELD, Run, SlotTable

KiB = 1 << 10


@pytest.fixture
def table(tmp_path):
    t = SlotTable(SlotFiles(str(tmp_path / "arena")), threading.RLock())
    t.runs["run"] = Run("run", 1, [0], True, str(tmp_path / "ckpt"), None, 30.0, True, False)
    yield t
    t.shutdown()


def _ready(t, entry, slot, step):
    t.ready(entry, slot.index, step, index_offset=64, index_nbytes=8, dirname=f"step_{step}", tracker_name="",
            tracker_content="", persistable=True)


def test_one_slot_is_reused_but_never_while_persisted_or_pinned(table):
    entry = table.attach(0, table.runs["run"], None, 1)
    s = table.acquire(entry, 1, 64 * KiB)
    _ready(table, entry, s, 1)
    assert table.held(entry) == [s]
    table.start_persist(s)  # its disk write runs: the next snapshot must wait for it
    assert table.acquire(entry, 2, 64 * KiB) is None
    table.release(s)
    s.pins = 1  # a peer send reads it
    assert table.acquire(entry, 2, 64 * KiB) is None
    s.pins = 0
    again = table.acquire(entry, 2, 64 * KiB)
    assert again is s and s.state == SlotState.WRITING and s.step == 2
    assert table.held(entry) == [], "a slot being overwritten must not count as a complete snapshot"
    table.drop_writes(entry)  # the rank died mid-copy
    assert s.state == SlotState.INVALID and not table.held(entry)


def test_a_reservation_waits_while_a_rank_reads_a_checkpoint(table, monkeypatch):
    """Issue 18: a restart's reservation ahead of its first save (SlotTable.reserve) pauses between pieces
    while a rank holds it (its load reads), and completes once the hold ends; a save's acquire never waits
    for a hold (a load's fn may save): the paused growth of its slot goes on at once."""
    import snapckpt.persister.arena as arena

    monkeypatch.setattr(arena, "GROW_CHUNK", 64 * KiB)
    entry = table.attach(0, table.runs["run"], None, 2)
    table.holds.set(0, True)
    grown = table.reserve(entry, 4 * 64 * KiB)
    assert len(grown) == 2
    paths = [table.arena.path(0, s.index) for s in grown]
    size = lambda p: os.path.getsize(p) if os.path.exists(p) else 0  # noqa: E731
    time.sleep(0.3)  # the grow thread sits in the hold meanwhile: at most its first piece
    assert grown[0].growing.running() and size(paths[0]) <= 64 * KiB and size(paths[1]) == 0, \
        [size(p) for p in paths]
    table.holds.set(0, False)
    assert [s.growing.result(timeout=30) for s in grown] == [4 * 64 * KiB] * 2
    assert [size(p) for p in paths] == [4 * 64 * KiB] * 2
    for slot in grown:
        table._grown(slot)  # take the sizes, as the next acquire would
    table.holds.set(0, True)  # a save's acquire during a hold: the paused growth of its slot goes on
    assert len(table.reserve(entry, 8 * 64 * KiB)) == 2
    ex = cf.ThreadPoolExecutor(1)
    try:
        s = ex.submit(table.acquire, entry, 1, 8 * 64 * KiB).result(timeout=30)
    finally:
        table.holds.set(0, False)  # a hung acquire ends (the test fails on the timeout, not after 300 s)
        ex.shutdown(wait=True)
    assert s.nbytes == 8 * 64 * KiB and size(table.arena.path(0, s.index)) == 8 * 64 * KiB


def test_two_slots_keep_the_newest_snapshot(table):
    entry = table.attach(0, table.runs["run"], None, 2)
    a = table.acquire(entry, 1, 64 * KiB)
    _ready(table, entry, a, 1)
    b = table.acquire(entry, 2, 64 * KiB)
    assert b is not a
    _ready(table, entry, b, 2)
    table.start_persist(b)
    c = table.acquire(entry, 3, 64 * KiB)
    assert c is a, "the older snapshot's slot is reused; the newest (persisting) one is kept"


def test_a_lower_limit_empties_the_slots_beyond_it(table):
    entry = table.attach(0, table.runs["run"], None, 2)
    a = table.acquire(entry, 1, 64 * KiB)
    _ready(table, entry, a, 1)
    b = table.acquire(entry, 2, 64 * KiB)
    _ready(table, entry, b, 2)
    assert [os.path.getsize(s.path) for s in entry.slots] == [64 * KiB, 64 * KiB]
    s = table.acquire(entry, 3, 128 * KiB, limit=1)  # the state grew: the budget now holds one slot
    assert s is b, "the slot of the newest snapshot is the one kept"
    assert a.state == SlotState.FREE and a.nbytes == 0 and os.path.getsize(a.path) == 0
    assert os.path.getsize(b.path) == 128 * KiB
    assert [x for x in entry.slots if x.state in HELD] == []


def test_a_slot_count_of_0_from_an_older_rank_of_the_protocol_means_every_slot(table):
    """Ranks of PROTOCOL_VERSION 2 from before slot_limit always returned a count ask with ``slots=0`` for
    ``slots_per_rank`` (and a rank's entry holds 0 until its first acquire): every slot is usable, none emptied, so
    such a rank's saves are not all skipped (SlotTable.usable keeps the meaning until the protocol version changes)."""
    entry = table.attach(0, table.runs["run"], None, 2)
    assert table.usable(entry, entry.limit) == entry.slots
    a = table.acquire(entry, 1, 64 * KiB, limit=0)
    _ready(table, entry, a, 1)
    b = table.acquire(entry, 2, 64 * KiB, limit=0)
    assert b is not None and b is not a and a.state == SlotState.READY and a.nbytes == 64 * KiB
    assert table.usable(entry, 0) == entry.slots == table.usable(entry, 2)


def test_budget_arithmetic_and_advice():
    # 4 local ranks, 1 GiB slots: a 9 GiB budget holds 2 slots each; with one replica, 1; 3 GiB: none
    assert slots_within(9 << 30, 1 << 30, 4, 0, 2) == 2
    assert slots_within(9 << 30, 1 << 30, 4, 1, 2) == 1
    assert slots_within(3 << 30, 1 << 30, 4, 0, 2) == 0
    assert slots_within(100 << 30, 1 << 30, 4, 0, 3) == 3
    advice = fitting_setting(1 << 30, 2, 4, 0, 5 << 30)
    assert advice.startswith("slots_per_rank=1 fits: needs 4.00 GiB") and "of 5.00 GiB" in advice, advice
    none = fitting_setting(1 << 30, 2, 4, 1, 5 << 30)
    assert "no slot count fits" in none and "8.00 GiB" in none and "replicas=0" in none, none


def test_a_save_does_not_wait_for_the_reservation_of_the_ranks_other_slot(table, monkeypatch):
    """Issue 18: the first save after construction takes its slot as soon as that slot's reservation is done; the
    reservation of the rank's other slot goes on meanwhile (it used to be waited for too), and the capacity check
    still counts what that growth has yet to reserve."""
    entry = table.attach(0, table.runs["run"], None, 2)
    other_may_grow = threading.Event()
    real = table.arena.ensure_size

    def ensure_size(rank, slot, *args, **kwargs):
        if slot == 1:
            other_may_grow.wait(20)  # bounded: without the fix the acquire below waits this long, then fails
        return real(rank, slot, *args, **kwargs)

    monkeypatch.setattr(table.arena, "ensure_size", ensure_size)
    assert [s.index for s in table.reserve(entry, 64 * KiB)] == [0, 1]
    s = table.acquire(entry, 1, 64 * KiB)
    other = entry.slots[1]
    assert s.index == 0 and s.nbytes == 64 * KiB and other.growing is not None and not other.growing.done()
    other_may_grow.set()
    _ready(table, entry, s, 1)
    again = table.acquire(entry, 2, 64 * KiB)  # takes the finished growth of the other slot
    assert again is other and other.nbytes == 64 * KiB and other.growing is None
    assert os.path.getsize(table.arena.path(0, 1)) == 64 * KiB
