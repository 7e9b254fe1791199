"""A save's copy of many small CPU tensors by pwritev of the slot file (snapckpt/engine/span_write.py): bit-exact with
the copy through the mapping across several calls, runs broken by large tensors and alignment gaps (written as
zeros); the iovec table reused while the data pointers stay and refilled when they change; a file that is not the
mapped one or a short write leaves the rest to the mapping; a tensor changed after the save returned does not
change the slot. Real slot files in a temporary directory."""
from __future__ import annotations

import os

import pytest
import torch

from _harness import SlotOnFile as _Slot
from snapckpt.engine import mover, slot_restore, span_write, stager as stager_mod
from snapckpt.engine.stager import Stager

NAME = "rank_00000.pt"


def _state(n: int = 3 * span_write._BATCH + 5, seed: int = 0, big: int = span_write.SMALL_NBYTES) -> dict:
    """``n`` small tensors of sizes that leave alignment gaps or none (multiples of 64 bytes), a large tensor among
    them (a run of spans ends there) and two views of one storage (a span copied as bytes)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(n):
        k = 16 * (1 + i % 5) if i % 3 == 0 else 1 + i % 41  # floats: 64-byte multiples, or not
        state[f"t{i}"] = torch.rand(k, generator=g) if i % 4 else torch.randint(0, 1 << 30, (k,), generator=g)
        if i == n // 2:
            state["big"] = torch.rand(big // 4 + 3, generator=g)
    base = torch.rand(100, generator=g)
    state["va"], state["vb"] = base[:10], base[50:]
    return state


def _gaps(p) -> list:
    """``(start, end, written)`` of the byte ranges between consecutive spans of ``p``'s plan (alignment); ``written``:
    both spans around it were written by pwritev (a gap inside a call's bytes)."""
    spans = sorted((s.arena_offset, s.arena_offset + s.nbytes) for s in p.layout.plan.spans)
    w = p.layout.span_writes
    by_file = {p.layout.direct_dst[j][0] for j in w.pos} if w else set()
    return [(a_end, b, a in by_file and b in by_file) for (a, a_end), (b, _) in zip(spans, spans[1:]) if b > a_end]


def _spied(monkeypatch) -> list:
    calls = []
    real = stager_mod.write_spans

    def spy(*a):
        calls.append(real(*a))
        return calls[-1]
    monkeypatch.setattr(stager_mod, "write_spans", spy)
    return calls


@pytest.mark.parametrize("big", [span_write.SMALL_NBYTES, mover.MIN_TENSOR_NBYTES])  # by torch; by torch or mover
def test_pwritev_save_is_bit_exact_with_the_mapping_copy_across_calls_and_gaps(tmp_path, monkeypatch, big):
    calls = _spied(monkeypatch)
    state = _state(big=big)
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    nbytes = (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20)
    new, old = _Slot(tmp_path / "new", nbytes), _Slot(tmp_path / "old", nbytes)
    for step in (1, 2, 3):  # later saves reuse the table (and try the other way of the large tensor)
        p = new.save(st, state, step)
        old.save(st, state, step, by_file=False)
        w = p.layout.span_writes
        assert w and calls[-1] == len(w.pos) == 3 * span_write._BATCH + 5 + 1  # every small whole tensor ("va")
        # several calls, a run broken where the large tensor lies (copied by torch)
        assert len(w.batches) == 4 and w.rest and w.batches[2][2] > sum(w.batches[1][2:]) + 64
        gaps = _gaps(p)
        assert sum(g[2] for g in gaps) > len(w.pos) // 2
        a, b = new.m.tensor.clone(), old.m.tensor.clone()
        for lo, hi, written in gaps:
            if written:
                assert not a[lo:hi].any()  # zeros where the old bytes were (nothing reads them)
                a[lo:hi] = b[lo:hi]
        assert torch.equal(a, b)  # every other byte as the copy through the mapping leaves it
    table = p.layout.span_writes.iov
    base = torch.rand(100)
    state = {k: v.clone() for k, v in state.items()}  # fresh tensors of the same layout: new addresses
    state["va"], state["vb"] = base[:10], base[50:]
    p = new.save(st, state, 4)
    old.save(st, state, 4, by_file=False)
    assert p.layout.span_writes.iov is table and p.layout.span_writes.ptrs is p.ptrs
    assert calls[-1] == len(p.layout.span_writes.pos)
    a, b = new.m.tensor.clone(), old.m.tensor.clone()
    for lo, hi, _ in _gaps(p):
        a[lo:hi] = b[lo:hi]
    assert torch.equal(a, b)
    new.m.close()
    old.m.close()


def test_a_short_write_or_another_file_at_the_path_leaves_the_rest_to_the_mapping(tmp_path, monkeypatch):
    calls = _spied(monkeypatch)
    state = _state()
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    nbytes = (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20)
    ref = _Slot(tmp_path / "ref", nbytes)
    ref.save(st, state, 1, by_file=False)
    real = span_write._load() and span_write._pwritev
    seen = []

    def short(fd, iov, cnt, off):  # the second call writes one byte less
        seen.append(off)
        got = real(fd, iov, cnt, off)
        return got - 1 if len(seen) == 2 else got
    monkeypatch.setattr(span_write, "_pwritev", short)
    s = _Slot(tmp_path / "short", nbytes)
    p = s.save(st, state, 1)
    assert len(seen) == 2 and calls[-1] == span_write._BATCH  # stopped after the first call's spans
    monkeypatch.setattr(span_write, "_pwritev", real)
    for spans in p.layout.plan.spans:
        lo, hi = spans.arena_offset, spans.arena_offset + spans.nbytes
        assert torch.equal(s.m.tensor[lo:hi], ref.m.tensor[lo:hi])
    # another file renamed over the mapped one: nothing written by file, all through the mapping
    other = tmp_path / "other"
    other.write_bytes(bytes([5]) * nbytes)
    os.replace(other, s.m.path)
    state2 = {k: v + 1 for k, v in state.items()}
    p = s.save(st, state2, 2)
    ref.save(st, state2, 2, by_file=False)
    assert calls[-1] == 0
    for spans in p.layout.plan.spans:
        lo, hi = spans.arena_offset, spans.arena_offset + spans.nbytes
        assert torch.equal(s.m.tensor[lo:hi], ref.m.tensor[lo:hi])
    with open(s.m.path, "rb") as f:
        assert f.read() == bytes([5]) * nbytes  # the file at the path untouched
    s.m.close()
    ref.m.close()


def test_a_tensor_changed_after_the_save_returned_does_not_change_the_slot(tmp_path, monkeypatch):
    calls = _spied(monkeypatch)
    state = _state()
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    nbytes = (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20)
    s = _Slot(tmp_path / "slot", nbytes)
    p = s.save(st, state, 1)
    assert calls[-1] == len(p.layout.span_writes.pos)
    before = s.m.tensor.clone()
    with open(s.m.path, "rb") as f:  # the file's pages are the mapping's
        assert torch.equal(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8), before)
    for v in state.values():
        v.add_(1)
    assert torch.equal(s.m.tensor, before)
    s.m.close()


def test_few_small_tensors_or_no_slot_file_keep_the_torch_copy(tmp_path, monkeypatch):
    calls = _spied(monkeypatch)
    st = Stager()
    few = {f"t{i}": torch.rand(7) for i in range(span_write.MIN_SPANS - 1)}
    s = _Slot(tmp_path / "slot", 1 << 20)
    p = s.save(st, few, 1)
    assert p.layout.span_writes is False and not calls
    many = _state(400)
    p = s.save(st, many, 2, by_file=False)
    assert not calls and p.layout.span_writes is None
    s.m.close()


def test_short_runs_of_small_tensors_between_large_ones_stay_on_the_torch_copy(tmp_path, monkeypatch):
    calls = _spied(monkeypatch)
    g = torch.Generator().manual_seed(1)
    state = {f"s{i}": torch.rand(1 + i % 50, generator=g) for i in range(span_write.MIN_SPANS + 10)}
    for i in range(20):  # a layer's few small tensors between large ones (GPT): runs of 2
        state[f"l{i}a"], state[f"l{i}b"] = torch.rand(3, generator=g), torch.rand(5, generator=g)
        state[f"l{i}w"] = torch.rand(span_write.SMALL_NBYTES // 4, generator=g)
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    nbytes = (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20)
    new, old = _Slot(tmp_path / "new", nbytes), _Slot(tmp_path / "old", nbytes)
    p = new.save(st, state, 1)
    old.save(st, state, 1, by_file=False)
    w = p.layout.span_writes
    # the long run goes on into the first layer's two small tensors; the other layers' stay on torch's copy
    assert calls == [span_write.MIN_SPANS + 12] and len(w.pos) == span_write.MIN_SPANS + 12 and len(w.rest) == 58
    a, b = new.m.tensor.clone(), old.m.tensor.clone()
    for lo, hi, written in _gaps(p):
        if written:
            assert not a[lo:hi].any()
            a[lo:hi] = b[lo:hi]
    assert torch.equal(a, b)
    new.m.close()
    old.m.close()


def test_the_mid_copy_fault_point_is_passed_once_among_the_writes(tmp_path, monkeypatch):
    calls = _spied(monkeypatch)
    hits = []
    monkeypatch.setattr(stager_mod.faults, "point", lambda name, **kw: hits.append((name, calls[:])))
    state = _state()
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    s = _Slot(tmp_path / "slot", (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20))
    s.save(st, state, 1)
    assert [h[0] for h in hits] == ["snapshot.mid_copy"] and hits[0][1] == []  # during the writes, not after
    assert calls == [len(p.layout.span_writes.pos)]
    s.m.close()


@pytest.mark.parametrize("lazy", ["conj of a small complex", "neg view of a small", "neg view of a large"])
def test_a_lazy_conj_or_neg_view_in_a_cached_layout_is_refused_as_at_the_first_save(tmp_path, lazy):
    # pwritev and memmove copy a tensor's raw bytes (not its lazy conjugate or negation); a first save refuses such a
    # view, and so must a save that finds the plan cached (by its quick check or by its signature)
    state = _state(big=mover.MIN_TENSOR_NBYTES)
    state["c"] = torch.rand(4, dtype=torch.complex64)
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    s = _Slot(tmp_path / "slot", (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20))
    for step in (1, 2, 3):  # the plan built, then found by its quick check (which a lazy bit misses: the signature)
        s.save(st, state, step)
    key = {"conj of a small complex": "c", "neg view of a small": "t1", "neg view of a large": "big"}[lazy]
    view = state[key].conj() if key == "c" else torch._neg_view(state[key])
    with pytest.raises(stager_mod.SnapshotError, match="conj/neg"):
        st.prepare({NAME: {**state, key: view}}, 4)
    st = Stager()  # a fresh plan cache: the first save refuses it
    with pytest.raises(stager_mod.SnapshotError, match="conj/neg"):
        st.prepare({NAME: {**state, key: view}}, 1)
    s.m.close()


@pytest.mark.parametrize("where", ["small", "large", "view at an offset"])
def test_a_tensor_whose_storage_was_freed_in_place_is_refused_not_copied_from_address_0(tmp_path, where):
    # untyped_storage().resize_(0) (FSDP frees resharded parameters so) leaves the shape: a copy from the null
    # storage (pwritev's fallback, memmove, torch's own copy_) killed the process with SIGSEGV
    state = _state(big=mover.MIN_TENSOR_NBYTES)
    state["view"] = torch.rand(50)[10:30]
    state["empty"] = torch.empty(0)  # no storage either, and nothing to copy: fine
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    s = _Slot(tmp_path / "slot", (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20))
    for step in (1, 2):
        s.save(st, state, step)
    state[{"small": "t1", "large": "big", "view at an offset": "view"}[where]].untyped_storage().resize_(0)
    with pytest.raises(stager_mod.SnapshotError, match="storage holds no memory"):
        st.prepare({NAME: state}, 3)  # the plan's quick check
    with pytest.raises(stager_mod.SnapshotError, match="storage holds no memory"):
        Stager().prepare({NAME: state}, 1)  # a plan built
    s.m.close()


def _restorable(n: int = 3 * span_write._BATCH + 5) -> dict:
    """:func:`_state` without its two views of one storage: every tensor its own span (what the in-process restore
    of :mod:`snapckpt.engine.slot_restore` takes)."""
    state = _state(n)
    del state["va"], state["vb"]
    return state


def test_an_in_process_restore_reads_the_written_spans_back_by_preadv_bit_exact(tmp_path, monkeypatch):
    state = _restorable()
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    s = _Slot(tmp_path / "slot", (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20))
    for step in (1, 2, 3):  # the plan, its quick check, the table filled
        p = s.save(st, state, step)
    saved = {k: v.clone() for k, v in state.items()}
    w = p.layout.span_writes
    assert w and w.rest and len(w.pos) == len(state) - 1  # the large tensor is copied by torch
    for v in state.values():
        v.add_(1)  # training went on
    versions = [v._version for v in state.values()]
    reads = []
    real = span_write._load_read() and span_write._preadv
    monkeypatch.setattr(span_write, "_preadv", lambda *a: reads.append(a[3]) or real(*a))
    found = slot_restore.find(st, s.m, NAME, 3, state)
    assert found is not None and found.back is not None
    gaps = bytes(span_write._ZEROS)
    found.run()
    assert found.read_by_file == len(w.pos) and len(reads) == len(w.batches)
    for k, v in state.items():
        assert torch.equal(v, saved[k]), k
    # bumped as an in-place copy bumps them (autograd's check of tensors saved for backward)
    assert all(v._version > b for v, b in zip(state.values(), versions))
    assert bytes(span_write._ZEROS) == gaps  # the gaps were read into a scratch buffer, not the save's zeros
    # a short read: what it did not read is copied by torch
    for v in state.values():
        v.add_(1)
    monkeypatch.setattr(span_write, "_preadv", lambda *a: real(*a) - (1 if a[3] == w.batches[1][2] else 0))
    found = slot_restore.find(st, s.m, NAME, 3, state)
    found.run()
    assert found.read_by_file == span_write._BATCH
    for k, v in state.items():
        assert torch.equal(v, saved[k]), k
    s.m.close()


@pytest.mark.parametrize("large", [False, True])  # small tensors only (all by file), or one copied by torch too
def test_an_in_process_restore_into_inference_tensors_is_refused_as_torch_refuses_it(tmp_path, large):
    """Tensors made under torch.inference_mode(), restored outside it: torch's refusal of their copy_ ("Inplace
    update to inference tensor outside InferenceMode"), before anything is written (preadv bypassed torch's
    check); inside inference mode they are restored, by file."""
    with torch.inference_mode():
        state = _restorable()
        if not large:
            del state["big"]
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    s = _Slot(tmp_path / "slot", (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20))
    for step in (1, 2, 3):
        s.save(st, state, step)
    with torch.inference_mode():
        saved = {k: v.clone() for k, v in state.items()}
        for v in state.values():
            v.add_(1)  # training went on
        changed = {k: v.clone() for k, v in state.items()}
    found = slot_restore.find(st, s.m, NAME, 3, state)
    assert found is not None and found.back is not None
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        found.run()
    for k, v in state.items():
        assert torch.equal(v, changed[k]), k
    found = slot_restore.find(st, s.m, NAME, 3, state)
    with torch.inference_mode():
        found.run()
    assert found.read_by_file == len(found.back[1].pos)
    for k, v in state.items():
        assert torch.equal(v, saved[k]), k
    s.m.close()


def test_an_in_process_restore_into_tensors_with_other_memory_or_shapes_is_not_read_by_file(tmp_path):
    state = _restorable()
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    s = _Slot(tmp_path / "slot", (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20))
    for step in (1, 2, 3):
        s.save(st, state, step)
    saved = {k: v.clone() for k, v in state.items()}
    # fresh tensors of the same layout since the save (new addresses): the table's are not theirs; torch copies
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    found = slot_restore.find(st, s.m, NAME, 3, fresh)
    assert found is not None and found.back is None
    found.run()
    for k, v in fresh.items():
        assert torch.equal(v, saved[k]), k
    # a tensor of another shape at the same address (resized in place) is refused: the general path names it
    state["t1"].resize_(state["t1"].numel() - 1)
    assert slot_restore.find(st, s.m, NAME, 3, state) is None
    s.m.close()
