"""The snapshot policy and the hook registry (snapckpt/engine/hooks.py): which tier each step gets, the
validation of the intervals, and what the registry asks of its checkpointer (here a recording fake: no
persister, no arena)."""
from __future__ import annotations

import os
import re
from dataclasses import FrozenInstanceError

import pytest

from snapckpt.engine.hooks import HookRegistry, SnapshotPolicy
from snapckpt.events import EVENT_KINDS, Event, StorageType

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY


@pytest.mark.parametrize("kwargs", [
    {"memory_interval_steps": 0}, {"disk_interval_steps": -3}, {"disk_interval_steps": True},
    {"memory_interval_steps": 2.0}, {"memory_interval_steps": "5"},
    {"memory_interval_secs": 0}, {"disk_interval_secs": -1.0}, {"disk_interval_secs": float("nan")},
    {"memory_interval_secs": "60"},
])
def test_invalid_intervals_are_refused(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        SnapshotPolicy(**kwargs)


def test_policy_is_frozen():
    p = SnapshotPolicy(disk_interval_steps=10)
    with pytest.raises(FrozenInstanceError):
        p.disk_interval_steps = 5


def test_step_intervals_disk_wins_when_both_are_due():
    p = SnapshotPolicy(memory_interval_steps=2, disk_interval_steps=5)
    got = {step: p.decide(step, 0.0, 0.0) for step in range(1, 11)}
    assert got == {1: None, 2: MEMORY, 3: None, 4: MEMORY, 5: DISK, 6: MEMORY, 7: None, 8: MEMORY, 9: None,
                   10: DISK}


def test_time_intervals_use_the_elapsed_seconds_of_each_tier():
    p = SnapshotPolicy(memory_interval_secs=10, disk_interval_secs=60)
    assert p.decide(1, secs_since_snapshot=9.9, secs_since_disk=59.9) is None
    assert p.decide(1, secs_since_snapshot=10.0, secs_since_disk=59.9) is MEMORY
    assert p.decide(1, secs_since_snapshot=0.0, secs_since_disk=60.0) is DISK


def test_default_policy_never_snapshots():
    p = SnapshotPolicy()
    assert [p.decide(s, 1e9, 1e9) for s in (0, 1, 100)] == [None, None, None]


class FakeCheckpointer:
    """Records what the registry calls; ``taken`` says whether a save's snapshot was taken."""

    def __init__(self, taken: bool = True) -> None:
        self.calls: list = []
        self.listeners: list = []
        self.taken = taken

    def add_listener(self, fn) -> None:
        self.listeners.append(fn)

    def fence(self) -> None:
        self.calls.append(("fence",))

    def poll(self) -> None:
        self.calls.append(("poll",))

    def wait(self) -> None:
        self.calls.append(("wait",))

    def expect(self, state):
        self.calls.append(("expect", state))
        return True

    def save(self, state, step, storage_type):
        self.calls.append(("save", state, step, storage_type))
        return type("Handle", (), {"snapshot_taken": self.taken})()

    def emit(self, event: Event) -> None:
        for fn in self.listeners:
            fn(event)


def test_step_end_saves_the_due_tier_and_polls_otherwise():
    ck = FakeCheckpointer()
    states = iter(range(100))
    hooks = HookRegistry(ck, lambda: next(states), SnapshotPolicy(memory_interval_steps=2, disk_interval_steps=4))
    hooks.before_optimizer_step()
    for step in (1, 2, 3, 4):
        hooks.step_end(step)
    # the first step does not snapshot: its state sizes the arena ahead of the first save (Checkpointer.expect)
    assert ck.calls == [("fence",), ("expect", 0), ("poll",), ("save", 1, 2, MEMORY), ("poll",),
                        ("save", 2, 4, DISK)]


def test_state_fn_is_called_when_a_snapshot_is_due_and_once_to_size_the_arena():
    ck = FakeCheckpointer()
    called = []
    hooks = HookRegistry(ck, lambda: called.append(1) or {}, SnapshotPolicy(disk_interval_steps=3))
    for step in range(1, 7):
        hooks.step_end(step)
    assert len(called) == 3 and [c[0] for c in ck.calls].count("expect") == 1


def test_the_arena_is_sized_at_the_first_step_only_when_it_does_not_save_and_the_policy_saves():
    ck = FakeCheckpointer()
    HookRegistry(ck, lambda: "S", SnapshotPolicy(memory_interval_steps=1)).step_end(1)  # the save sizes it
    ck2 = FakeCheckpointer()
    HookRegistry(ck2, lambda: "S", SnapshotPolicy()).step_end(1)  # never saves: nothing to reserve
    assert [c[0] for c in ck.calls] == ["save"] and ck2.calls == [("poll",)]


def test_train_end_saves_the_last_step_to_disk_only_if_it_is_not_there():
    ck = FakeCheckpointer()
    hooks = HookRegistry(ck, lambda: "S", SnapshotPolicy(disk_interval_steps=2, save_on_train_end=True))
    hooks.step_end(1)
    hooks.step_end(2)  # on disk already
    hooks.train_end()
    assert [c for c in ck.calls if c[0] != "poll"] == [("expect", "S"), ("save", "S", 2, DISK), ("wait",)]
    hooks.step_end(3)
    ck.calls.clear()
    hooks.train_end()
    assert ck.calls == [("wait",), ("save", "S", 3, DISK), ("wait",)]


def test_a_skipped_snapshot_does_not_count_as_the_last_disk_save():
    ck = FakeCheckpointer(taken=False)  # e.g. on_slot_busy="skip"
    hooks = HookRegistry(ck, lambda: "S", SnapshotPolicy(disk_interval_steps=1, save_on_train_end=True))
    hooks.step_end(1)
    ck.calls.clear()
    hooks.train_end()
    assert ck.calls == [("wait",), ("save", "S", 1, DISK), ("wait",)]


def test_train_end_saves_again_when_another_rank_skipped_the_last_disk_save():
    """The last step's DISK save was taken on this rank, but another rank skipped it (``on_slot_busy="skip"``): the
    save is skipped on every rank, which this rank's handle says once it ended (after ``wait``). Right: train_end
    saves the last step again on this rank too, as the skipping rank does (before, only the skipping rank saved,
    and its lone save waited for the other ranks' parts until the commit timeout)."""
    ck = FakeCheckpointer()
    handles = []
    save = ck.save

    def save_and_keep(state, step, storage_type):
        handles.append(save(state, step, storage_type))
        return handles[-1]

    ck.save = save_and_keep
    wait = ck.wait

    def wait_and_learn_the_skip():
        for h in handles:
            h.skipped = True
        wait()

    ck.wait = wait_and_learn_the_skip
    hooks = HookRegistry(ck, lambda: "S", SnapshotPolicy(disk_interval_steps=1, save_on_train_end=True))
    hooks.step_end(1)
    ck.calls.clear()
    hooks.train_end()
    assert ck.calls == [("wait",), ("save", "S", 1, DISK), ("wait",)]


def test_train_end_without_steps_or_option_only_waits():
    ck = FakeCheckpointer()
    HookRegistry(ck, lambda: "S", SnapshotPolicy(save_on_train_end=True)).train_end()
    ck2 = FakeCheckpointer()
    h2 = HookRegistry(ck2, lambda: "S", SnapshotPolicy())
    h2.step_end(7)
    h2.train_end()
    assert ck.calls == [("wait",)] and ck2.calls == [("poll",), ("wait",)]


def test_callbacks_receive_their_kind_only_and_can_be_removed():
    ck = FakeCheckpointer()
    hooks = HookRegistry(ck, dict, SnapshotPolicy())
    got = []
    remove = hooks.on("committed", lambda e: got.append(("c", e.step)))
    hooks.on("failed", lambda e: got.append(("f", e.step)))
    ck.emit(Event("committed", 1, DISK, 0))
    ck.emit(Event("snapshot_taken", 2, MEMORY, 0))
    ck.emit(Event("failed", 3, DISK, 0, error=OSError("x")))
    remove()
    ck.emit(Event("committed", 4, DISK, 0))
    assert got == [("c", 1), ("f", 3)]
    with pytest.raises(ValueError, match="unknown event 'commited'"):
        hooks.on("commited", print)
    # every kind a Checkpointer emits can be registered (the remote and peer tiers' too: docs/remote.md names
    # upload_failed; HookRegistry.on refused it before), and the Event docstring names exactly these
    for kind in EVENT_KINDS:
        seen = []
        hooks.on(kind, seen.append)
        ck.emit(Event(kind, 9, DISK, 0, reason="r"))
        assert [e.kind for e in seen] == [kind]
    import snapckpt
    from snapckpt import events
    root = os.path.dirname(snapckpt.__file__)
    emitted = set()
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                emitted |= set(re.findall(r'Event\("([a-z_]+)"', open(os.path.join(d, f)).read()))
    assert emitted and emitted <= set(EVENT_KINDS), emitted - set(EVENT_KINDS)
    doc = " ".join(events.Event.__doc__.split("\n\n")[0].split())
    assert set(re.findall(r"``([a-z_]+)``", doc)) - {"kind"} == set(EVENT_KINDS), doc
