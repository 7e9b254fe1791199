"""Several local ranks in one persister's slot table (snapckpt/persister/slots.py, SlotTable.acquire/reserve): a rank's
slots beyond its first grow only once every local rank of its run asked for a slot (or after
FIRST_SLOTS_WAIT_SECS), and every growth counts what the other local ranks' slots still need, each at its own size.
Real slot files (``posix_fallocate``) in a temporary directory; the host's room is the arena's
``mem_available_bytes`` made to answer a small capacity minus what the slot files hold (a small host); no persister
process (tests/test_resources.py runs the same on a real small tmpfs with two ranks)."""
from __future__ import annotations

import os
import threading

import pytest

import snapckpt.persister.arena as arena
from snapckpt.errors import InsufficientSharedMemoryError
from snapckpt.persister.arena import SlotFiles, SlotState
from snapckpt.persister.budget import fitting_node_setting
from snapckpt.persister.slots import Run, SlotTable

KiB = 1 << 10


@pytest.fixture
def table(tmp_path):
    t = SlotTable(SlotFiles(str(tmp_path / "arena")), threading.RLock())
    t.runs["run"] = Run("run", 2, [0, 1], True, str(tmp_path / "ckpt"), None, 30.0, True, False)
    yield t
    t.shutdown()


def _small_host(monkeypatch, table, capacity: int) -> None:
    """The host has ``capacity`` bytes for the arena: MemAvailable answers that minus what its slot files hold."""
    d = table.arena.directory

    def avail() -> int:
        return capacity - sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
    monkeypatch.setattr(arena, "mem_available_bytes", avail)


def _ready(t, entry, slot, step):
    t.ready(entry, slot.index, step, index_offset=64, index_nbytes=8, dirname=f"step_{step}", tracker_name="",
            tracker_content="", persistable=True)


def _sizes(entry):
    return [os.path.getsize(s.path) if os.path.exists(s.path) else 0 for s in entry.slots]


def test_a_second_slot_grows_once_every_local_rank_asked_for_its_first(table):
    run = table.runs["run"]
    a, b = table.attach(0, run, None, 2), table.attach(1, run, None, 2)
    s = table.acquire(a, 1, 64 * KiB, limit=2)
    _ready(table, a, s, 1)
    assert _sizes(a) == [64 * KiB, 0] and a.deferred == [1] and table.unasked(a) == [1]
    assert "grow once every local rank" in table.describe(a) and "rank(s) [1]" in table.describe(a)
    again = table.acquire(a, 2, 64 * KiB, limit=2)  # one slot meanwhile, reused as under a limit of one
    assert again is s and s.state == SlotState.WRITING and _sizes(a) == [64 * KiB, 0]
    _ready(table, a, s, 2)
    table.start_persist(s)  # its disk write runs: the save waits for it, as with one slot; never refused
    assert table.acquire(a, 3, 64 * KiB, limit=2) is None
    table.release(s)
    table.acquire(b, 1, 16 * KiB, limit=2)  # rank 1 asks: every local rank is known now
    assert table.unasked(a) == [] and b.deferred == []
    second = table.acquire(a, 3, 64 * KiB, limit=2)
    assert second is a.slots[1] and a.deferred == [] and _sizes(a) == [64 * KiB, 64 * KiB]
    assert s.state == SlotState.READY and s.step == 2, "the newest snapshot is kept while the next is copied"


def test_a_rank_that_never_asks_holds_the_others_back_for_a_bounded_time(table):
    run = table.runs["run"]
    a = table.attach(0, run, None, 2)  # rank 1 never even says hello
    _ready(table, a, table.acquire(a, 1, 64 * KiB, limit=2), 1)
    assert a.deferred == [1]
    run.deferred_since -= table.FIRST_SLOTS_WAIT_SECS + 1  # the wait has run out
    second = table.acquire(a, 2, 64 * KiB, limit=2)
    assert second is a.slots[1] and a.deferred == [] and run.waited_out and table.unasked(a) == []


def test_a_reservation_ahead_counts_as_asking_and_grows_only_the_first_slot_meanwhile(table):
    """``expected_nbytes`` or a restart's size (``reserve``) tells the node the rank's size before its first save."""
    run = table.runs["run"]
    a, b = table.attach(0, run, None, 2), table.attach(1, run, None, 2)
    assert [s.index for s in table.reserve(a, 64 * KiB, 2)] == [0]
    assert [s.index for s in table.reserve(b, 16 * KiB, 2)] == [0, 1]  # the last to ask: everyone is known
    for s in a.slots + b.slots:
        if s.growing is not None:
            s.growing.result(timeout=30)
    assert table.unasked(a) == [] and _sizes(b) == [16 * KiB, 16 * KiB]


def test_a_restarted_run_asks_again_but_keeps_the_slots_it_holds(table, tmp_path):
    run = table.runs["run"]
    a, b = table.attach(0, run, None, 2), table.attach(1, run, None, 2)
    table.acquire(b, 1, 16 * KiB, limit=2)
    _ready(table, a, table.acquire(a, 1, 64 * KiB, limit=2), 1)
    _ready(table, a, table.acquire(a, 2, 64 * KiB, limit=2), 2)
    assert _sizes(a) == [64 * KiB, 64 * KiB]
    run2 = table.runs["run2"] = Run("run2", 2, [0, 1], True, str(tmp_path / "ckpt"), None, 30.0, True, False)
    a, b = table.attach(0, run2, None, 2), table.attach(1, run2, None, 2)
    assert table.unasked(a) == [0, 1] and a.want == 0, "a size asked for in the earlier run is not this run's"
    s = table.acquire(a, 3, 64 * KiB, limit=2)  # slots already of that size need no growth: both are used
    assert a.deferred == [] and s.index == 0 and s.state == SlotState.WRITING
    assert a.slots[1].state == SlotState.READY and a.slots[1].step == 2


def test_ranks_of_different_sizes_are_counted_each_at_its_own(table, monkeypatch):
    """Pipeline stages: 64 and 16 KiB, two slots each (160 KiB) fit 176 KiB; once both asked, a growth that would
    leave another rank's counted slot no room is refused naming the node's setting."""
    _small_host(monkeypatch, table, 176 * KiB)
    run = table.runs["run"]
    a, b = table.attach(0, run, None, 2), table.attach(1, run, None, 2)
    _ready(table, a, table.acquire(a, 1, 64 * KiB, limit=2), 1)
    _ready(table, b, table.acquire(b, 1, 16 * KiB, limit=2), 1)
    _ready(table, b, table.acquire(b, 2, 16 * KiB, limit=2), 2)
    _ready(table, a, table.acquire(a, 2, 64 * KiB, limit=2), 2)
    assert _sizes(a) == [64 * KiB] * 2 and _sizes(b) == [16 * KiB] * 2
    # rank 1's state grows to 48 KiB: 2 x 64 + 2 x 48 KiB do not fit 176 KiB; one slot each (112 KiB) does
    with pytest.raises(InsufficientSharedMemoryError) as e:
        table.acquire(b, 3, 48 * KiB, limit=2)
    msg = str(e.value)
    assert "rank 0: 2 x 65536 bytes" in msg and "slots_per_rank=1 fits: needs 0.1 MiB (114688 bytes)" in msg, msg
    assert "each at its own size" in msg, msg


def test_even_sizes_that_do_not_fit_refuse_every_rank_alike(table, monkeypatch):
    """The node check's case: two ranks of 64 KiB, two slots each (256 KiB) on 224 KiB; one slot each fits. The
    first rank saves with one slot; the second rank's first save and the first rank's next one are refused with
    the node check's advice (before, the first rank took both slots and the second was told no slot count fits)."""
    _small_host(monkeypatch, table, 224 * KiB)
    run = table.runs["run"]
    a, b = table.attach(0, run, None, 2), table.attach(1, run, None, 2)
    _ready(table, a, table.acquire(a, 1, 64 * KiB, limit=2), 1)
    _ready(table, a, table.acquire(a, 2, 64 * KiB, limit=2), 2)
    errors = []
    for entry, step in ((b, 1), (a, 3)):
        with pytest.raises(InsufficientSharedMemoryError) as e:
            table.acquire(entry, step, 64 * KiB, limit=2)
        errors.append(str(e.value))
    advice = fitting_node_setting([(64 * KiB, 2), (64 * KiB, 2)], 224 * KiB)
    assert advice.startswith("slots_per_rank=1 fits: needs 0.1 MiB (131072 bytes) of 0.2 MiB (229376 bytes)")
    for msg in errors:
        assert advice in msg and "no slot count fits" not in msg, msg
    assert _sizes(a) == [64 * KiB, 0] and _sizes(b) == [0, 0]


def test_the_wait_for_the_other_ranks_starts_when_a_slot_is_left_ungrown_not_at_a_reservation(table, monkeypatch):
    """A rank that reserved ahead (``expected_nbytes``, a restart's size) asks long before the job's first save; a
    local rank that does not reserve (no files of its own in the newest checkpoint: the world grew) asks only at its
    first save. The bounded wait runs from the first save that used one slot because of it, not from the
    reservation. Wrong (before): the clock started at the reservation, so at the first save, minutes later, the
    wait had run out without anyone waiting: rank 0 took both slots and rank 1's first slot had no room (D1 again).
    Right: rank 0 saves with one slot, and once rank 1 asks both are refused alike with the node check's advice
    (the even-size case above), whose setting then works. Clock: the slot table's ``time.monotonic``, moved by
    hand."""
    import snapckpt.persister.slots as slots_mod

    now = [1000.0]
    monkeypatch.setattr(slots_mod, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))
    _small_host(monkeypatch, table, 224 * KiB)
    run = table.runs["run"]
    a, b = table.attach(0, run, None, 2), table.attach(1, run, None, 2)
    for s in table.reserve(a, 64 * KiB, 2):
        s.growing.result(timeout=30)
    now[0] += 600  # ten minutes of training before the first save
    _ready(table, a, table.acquire(a, 1, 64 * KiB, limit=2), 1)
    _ready(table, a, table.acquire(a, 2, 64 * KiB, limit=2), 2)
    assert a.deferred == [1] and _sizes(a) == [64 * KiB, 0], "rank 1 has not asked yet: one slot meanwhile"
    with pytest.raises(InsufficientSharedMemoryError) as e:  # as in the node check: refused alike, with its advice
        table.acquire(b, 1, 64 * KiB, limit=2)
    assert fitting_node_setting([(64 * KiB, 2), (64 * KiB, 2)], 224 * KiB) in str(e.value), str(e.value)
    assert _sizes(a) == [64 * KiB, 0], "rank 0's second slot did not take the room of rank 1's first"
    assert table.acquire(b, 1, 64 * KiB, limit=1) is b.slots[0]  # the setting named works
