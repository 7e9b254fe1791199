"""A save's copy plan (snapckpt/engine/copy_plan.py ``CopyPlan``): made once per layout from one size partition of the
direct tensors, its steps cover every tensor exactly once in the expected ways, the mid-copy fault point fires once,
in the middle, for every mix of ways (torch, mover, pwritev, pwritev falling back, span copies); the slot file's
descriptor is opened once across saves (close-on-exec), kept with the mapping and closed with it, or when forgotten,
when collected; a slot file replaced at the path gets no write by file and the bytes are still right.
Real slot files in a temporary directory."""
from __future__ import annotations

import fcntl
import gc
import os

import pytest
import torch

from _harness import SlotOnFile
from snapckpt.engine import mover, span_write, stager as stager_mod
from snapckpt.engine.copy_plan import Ways, copy_plan, layout_sizes
from snapckpt.engine.stager import Stager

NAME = "rank_00000.pt"
SMALL = span_write.SMALL_NBYTES // 4 // 8  # floats of a small tensor (1 KiB)
MID = span_write.SMALL_NBYTES // 4 * 2  # floats of a tensor neither small nor large (16 KiB)
LARGE = mover.MIN_TENSOR_NBYTES // 4 + 16  # floats of a large tensor


def _state(spans: int = 0, small: int = 0, mid: int = 0, large: int = 0) -> dict:
    """Tensors of distinct constant values (never the slot's old bytes, :class:`SlotOnFile`): ``spans`` transposed
    views (span copies), runs of ``small`` small tensors with ``mid`` and ``large`` ones after them."""
    state, v = {}, 1.0
    for kind, n, k in (("s", small, SMALL), ("m", mid, MID), ("l", large, LARGE)):
        for i in range(n):
            state[f"{kind}{i}"] = torch.full((k,), v)
            v += 1
    for i in range(spans):
        state[f"v{i}"] = torch.full((8, 5), v).t()
        v += 1
    return state


class _Slot(SlotOnFile):
    """A slot of at least ``nbytes`` whole pages."""

    def __init__(self, path, nbytes: int) -> None:
        super().__init__(path, (nbytes + 4095) // 4096 * 4096 + 4096)

    def copied(self, p, state: dict) -> int:
        """How many of ``state``'s tensors (in ``p``'s plan) the slot holds now."""
        got = 0
        for t, (off, _d, _s, _st) in zip(p.direct, p.layout.direct_dst):
            got += bool(torch.equal(self.m.tensor[off:off + t.nbytes], t.reshape(-1).view(torch.uint8)))
        for t, off in p.span_copies:
            got += bool(torch.equal(self.m.tensor[off:off + t.numel()], t))
        return got


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _items(step, layout, writes) -> list:
    """The direct positions (or ``("span", k)``) a step copies."""
    n = len(layout.direct_dst)
    if step.kind == "spans":
        return [("span", k) for k in range(len(layout.spans))[step.pick]]
    if step.kind == "write":
        return list(writes.pos)
    if step.kind == "fault":
        return []
    return list(step.pick(list(range(n))))


def test_the_plan_of_a_mixed_layout_has_its_steps_from_one_partition(tmp_path):
    state = _state(spans=3, small=span_write.MIN_SPANS + 40, mid=5, large=3)
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    layout = p.layout
    sizes = layout_sizes(layout)
    n = len(layout.direct_dst)
    assert n == len(state) - 3 and len(layout.spans) == 3
    assert list(sizes.small) == list(range(span_write.MIN_SPANS + 40))
    assert list(sizes.large) == list(range(n - 3, n))
    plan = copy_plan(layout, True)
    assert copy_plan(layout, True) is plan and layout_sizes(layout) is sizes  # made once
    writes = layout.span_writes
    assert plan.writes is writes and sorted(writes.pos) == list(sizes.small) and writes.rest == list(range(
        len(sizes.small), n))
    kinds = [s.kind for s in plan.steps]
    assert kinds == ["spans", "torch", "write", "large"]  # half of 3 + n tensors falls among the writes
    write = plan.steps[2]
    assert write.at is not None and write.mid == writes.batches[write.at][0]
    items = [i for s in plan.steps for i in _items(s, layout, writes)]
    assert sorted(i for i in items if isinstance(i, int)) == list(range(n)) and len(items) == n + 3  # each once
    assert list(plan.steps[1].pick(list(range(n)))) == list(range(len(sizes.small), n - 3))  # the mid-sized ones
    assert plan.steps[3].offsets == tuple(layout.direct_dst[j][0] for j in sizes.large)
    # through the mapping only: no writes, the small ones by torch, the fault point its own step in the middle
    plain = copy_plan(layout, False)
    kinds = [s.kind for s in plain.steps]
    assert plain.writes is None and kinds == ["spans", "torch", "fault", "torch", "large"]
    items = [i for s in plain.steps for i in (_items(s, layout, None) if s.kind != "fault" else ["fault"])]
    assert len(items) == n + 4 and items.index("fault") == (n + 3) // 2  # after half the tensors


def test_a_layout_saved_through_the_mapping_only_makes_no_writes_and_opens_nothing(tmp_path):
    state = _state(small=span_write.MIN_SPANS + 1)
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    s = _Slot(tmp_path / "slot", p.total_nbytes)
    p = s.save(st, state, 1, by_file=False)
    assert p.layout.span_writes is None and p.layout.copy_plans[True] is None and not s.m.file.is_open
    assert s.copied(p, state) == len(state)
    s.m.close()


WRITES = 2 * span_write._BATCH + 100  # small tensors: three pwritev calls, the fault point before the second
MIXES = {  # name: (state, way of the large tensors, slot file replaced before the save)
    "spans": (dict(spans=9), None, False),
    "torch": (dict(mid=9), None, False),
    "spans+torch": (dict(spans=3, mid=6), None, False),
    "write": (dict(small=WRITES), None, False),
    "write, file replaced": (dict(small=WRITES), None, True),
    "large by torch": (dict(mid=1, large=4), "torch", False),
    "large by mover": (dict(mid=1, large=4), "mover", False),
    "all, by torch": (dict(spans=2, small=WRITES, mid=3, large=3), "torch", False),
    "all, by mover": (dict(spans=2, small=WRITES, mid=3, large=3), "mover", False),
    "all but writes, by mover": (dict(spans=2, small=5, mid=1, large=6), "mover", False),
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_the_mid_copy_fault_point_fires_once_in_the_middle_for_every_mix_of_ways(tmp_path, monkeypatch, mix):
    spec, way, replaced = MIXES[mix]
    if way is not None:
        monkeypatch.setattr(Ways, "pick", lambda self: way)
    moved, real_copy = [], mover.copy_chunks
    monkeypatch.setattr(mover, "copy_chunks", lambda chunks, threads=None: moved.append(len(chunks)) or real_copy(chunks))
    written, real_write = [], stager_mod.write_spans
    monkeypatch.setattr(stager_mod, "write_spans", lambda *a: written.append(real_write(*a)) or written[-1])
    state = _state(**spec)
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    s = _Slot(tmp_path / "slot", p.total_nbytes)
    if replaced:
        other = tmp_path / "other"
        other.write_bytes(bytes(s.m.nbytes))
        os.replace(other, s.m.path)
    hits = []
    monkeypatch.setattr(stager_mod.faults, "point", lambda name, **kw: hits.append((name, kw, s.copied(p, state))))
    p = s.save(st, state, 7)
    total = len(state)
    assert [h[:2] for h in hits] == [("snapshot.mid_copy", {"step": 7})]
    assert 0 < hits[0][2] < total and abs(hits[0][2] - total / 2) <= total / 4, hits[0][2]  # in the middle
    assert s.copied(p, state) == total  # and every tensor copied in the end
    assert bool(moved) == (way == "mover")
    writes = p.layout.span_writes
    assert bool(writes) == (spec.get("small", 0) == WRITES)
    assert written == ([0 if replaced else len(writes.pos)] if writes else [])
    s.m.close()


def test_the_slot_files_descriptor_is_opened_once_across_saves_and_closed_with_the_mapping(tmp_path, monkeypatch):
    opened, real_open = [], span_write.open_slot_file
    monkeypatch.setattr(span_write, "open_slot_file", lambda *a: opened.append(real_open(*a)) or opened[-1])
    written, real_write = [], stager_mod.write_spans
    monkeypatch.setattr(stager_mod, "write_spans", lambda *a: written.append(real_write(*a)) or written[-1])
    state = _state(small=span_write.MIN_SPANS + 50, mid=2)
    st = Stager()
    s = _Slot(tmp_path / "slot", st.prepare({NAME: state}, 1).total_nbytes)
    gc.collect()
    before = _fds()  # the mapping's own (mmap keeps a duplicate) among them
    assert not s.m.file.is_open
    for step in range(1, 6):
        for v in state.values():
            v.add_(1)
        p = s.save(st, state, step)
        assert written[-1] == len(p.layout.span_writes.pos) and s.copied(p, state) == len(state)
        assert _fds() == before + 1
    assert len(opened) == 1 and opened[0] is not None
    fd = opened[0]
    assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC and not os.get_inheritable(fd)
    assert os.readlink(f"/proc/self/fd/{fd}") == s.m.path
    s.m.close()
    assert not s.m.file.is_open and _fds() == before - 1  # the slot file's and the mapping's closed
    s.m.close()  # again: nothing left to close
    assert _fds() == before - 1


def test_a_slot_file_forgotten_without_close_is_closed_when_collected(tmp_path):
    path = tmp_path / "slot"
    path.write_bytes(bytes(8192))
    st = os.stat(path)
    gc.collect()
    before = _fds()
    f = span_write.SlotFile(str(path), (st.st_dev, st.st_ino))
    assert f.descriptor(8192) is not None and f.descriptor(8192) == f.descriptor(8192) and _fds() == before + 1
    assert f.descriptor(8193) is None  # shorter than the spans' end
    del f
    gc.collect()
    assert _fds() == before


def test_a_replaced_slot_file_gets_no_write_by_file_and_the_slot_still_gets_the_bytes(tmp_path, monkeypatch):
    written, real_write = [], stager_mod.write_spans
    monkeypatch.setattr(stager_mod, "write_spans", lambda *a: written.append(real_write(*a)) or written[-1])
    state = _state(small=span_write.MIN_SPANS + 50, mid=3)
    st = Stager()
    s = _Slot(tmp_path / "slot", st.prepare({NAME: state}, 1).total_nbytes)
    s.save(st, state, 1)
    assert written == [span_write.MIN_SPANS + 50] and s.m.file.is_open  # opened by the first save
    other = tmp_path / "other"
    other.write_bytes(bytes([5]) * s.m.nbytes)
    os.replace(other, s.m.path)
    for v in state.values():
        v.mul_(-1)
    p = s.save(st, state, 2)
    assert written[-1] == 0 and s.copied(p, state) == len(state)  # all through the mapping
    with open(s.m.path, "rb") as f:
        assert f.read() == bytes([5]) * s.m.nbytes  # the file now at the path untouched
    s.m.close()
    assert not s.m.file.is_open


@pytest.mark.parametrize("on_caller", [False, True])
def test_a_copy_on_the_saving_thread_moves_the_torch_steps_tensors_by_memmove_from_this_saves_pointers(
        tmp_path, monkeypatch, on_caller):
    """A copy on the thread that saves (no copy thread: ``Prepared.on_caller``) copies the direct tensors of the
    ``"torch"`` steps by ``memmove`` from the data pointers its check read (cached per step while the slot and the
    pointers stay), a copy thread by ``torch._foreach_copy_``; either way every byte is this save's, the fault point
    fires once in the middle, and a tensor replaced between saves (a new data pointer) is read from its new place."""
    moved, real_move = [], mover.move_each
    monkeypatch.setattr(mover, "move_each", lambda moves: moved.append(len(moves)) or real_move(moves))
    state = _state(small=5, mid=9)  # no pwritev: every tensor in the "torch" steps
    st = Stager()
    s = _Slot(tmp_path / "slot", st.prepare({NAME: state}, 1).total_nbytes)
    for step in range(1, 5):
        for v in state.values():
            v.add_(1)
        if step == 3:
            state["m4"] = state["m4"].clone().add_(100)  # another allocation of the same layout
        hits = []
        monkeypatch.setattr(stager_mod.faults, "point", lambda name, **kw: hits.append(s.copied(p, state)))
        p = st.prepare({NAME: state}, step)
        p.views, p.slot_file, p.on_caller = s.m.views, s.m.file, on_caller
        assert p.ptrs is not None and st.plan_builds == 1
        Stager.copy_into(p, s.m.tensor, s.m.buf)
        assert s.copied(p, state) == len(state), step
        assert len(hits) == 1 and 0 < hits[0] < len(state), step  # the fault point, between the two steps
        assert moved == ([7, 7] if on_caller else []), step  # the two steps around the fault point
        moved.clear()
    s.m.close()
