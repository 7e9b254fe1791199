"""Copies of many slot spans into live tensors by preadv of the slot file (snapckpt/engine/span_read.py), and the
restarted process's restore that uses it (snapckpt/engine/plain_restore.py): bit-exact, in order, without mapping
the slot's pages; a file that is not the mapped one, spans it cannot read in one pass, or a read that comes back
short leave the rest to the mapping, each span copied once. Real slot files in a temporary directory."""
from __future__ import annotations

import os

import torch

from snapckpt.engine import plain_restore, span_read
from snapckpt.engine.slot_maps import MappedSlot
from snapckpt.engine.stager import Stager
from snapckpt.formats.plain_layout import plain_layout

NAME = "rank_00000.pt"
NBYTES = 4 << 20


def _file(path, nbytes: int = NBYTES) -> MappedSlot:
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return MappedSlot(str(path), nbytes)


def _spans(n: int, gap_every: int = 7):
    """``n`` spans laid out as the Stager lays out small tensors (64-byte aligned, from byte 64), some of sizes that
    leave a gap before the next, and their contents."""
    sizes = [4 * (1 + i % 37) + (2 if i % gap_every == 0 else 0) for i in range(n)]
    offsets, at = [], 64
    for s in sizes:
        offsets.append(at)
        at += (s + 63) // 64 * 64
    return torch.tensor(offsets), torch.tensor(sizes), at


def test_spans_are_copied_bit_exactly_in_batches_with_their_gaps(tmp_path):
    n = 3 * span_read._BATCH + 5  # several calls, the last one partial
    offsets, sizes, end = _spans(n)
    m = _file(tmp_path / "slot", end)
    m.tensor.copy_(torch.randint(0, 256, (end,), dtype=torch.uint8))
    dst = [torch.zeros(int(s), dtype=torch.uint8) for s in sizes]
    assert span_read.read_spans(m.path, m.ident, [t.data_ptr() for t in dst], offsets, sizes) == n
    for t, o, s in zip(dst, offsets.tolist(), sizes.tolist()):
        assert torch.equal(t, m.tensor[o:o + s])
    m.close()


def test_another_file_at_the_path_or_spans_out_of_order_are_not_read(tmp_path):
    offsets, sizes, end = _spans(20)
    m = _file(tmp_path / "slot", end)
    m.tensor.fill_(9)
    dst = [torch.zeros(int(s), dtype=torch.uint8) for s in sizes]
    ptrs = [t.data_ptr() for t in dst]
    other = tmp_path / "other"
    other.write_bytes(bytes([5]) * end)
    os.replace(other, m.path)  # renamed over the mapped file: the mapping still shows the old one
    assert span_read.read_spans(m.path, m.ident, ptrs, offsets, sizes) == 0
    assert span_read.read_spans(m.path, None, ptrs, offsets, sizes) == 0
    m2 = MappedSlot(m.path, end)
    swapped = offsets.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert span_read.read_spans(m2.path, m2.ident, ptrs, swapped, sizes) == 0
    far = offsets.clone()
    far[5:] += span_read._GAP_MAX
    assert span_read.read_spans(m2.path, m2.ident, ptrs, far, sizes) == 0
    assert all(not t.any() for t in dst)  # nothing written by any of them
    m.close()
    m2.close()


def _restart(tmp_path, state):
    """Save ``state`` into a slot file with a Stager, map the file anew (a restarted process) and find the restore of
    a live state of the same structure."""
    with open(tmp_path / "slot", "wb") as f:
        f.truncate(NBYTES)
    saver = MappedSlot(str(tmp_path / "slot"), NBYTES)
    p = Stager().prepare({NAME: state}, 1)
    Stager.copy_into(p, saver.tensor, saver.buf)
    m = MappedSlot(str(tmp_path / "slot"), NBYTES)
    live = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else
                {kk: torch.zeros_like(vv) for kk, vv in v.items()} if isinstance(v, dict) else v)
            for k, v in state.items()}
    found = plain_restore.find(m, NAME, 1, live)
    return saver, m, live, found


def _state(n: int = 1500) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"params": {f"p{i}": torch.rand(1 + i % 29, generator=g) for i in range(n)},
            "half": torch.rand(7, generator=g).half(), "ids": torch.arange(5), "iteration": 9}


def test_a_restart_reads_its_small_tensors_from_the_slot_file_without_mapping_its_pages(tmp_path, monkeypatch):
    state = _state()
    saver, m, live, found = _restart(tmp_path, state)
    mapped = []
    monkeypatch.setattr(MappedSlot, "map_for_reading", lambda self, upto: mapped.append(upto))
    assert isinstance(found, plain_restore.PlainCopies)
    versions = [t._version for t in plain_layout(live)[0]]
    found.run()
    assert mapped == [] and found.read_by_file == len(found.small)  # no page of the slot mapped for the copy
    for a, b in zip(plain_layout(state)[0], plain_layout(live)[0]):
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    assert all(t._version > v for t, v in zip(plain_layout(live)[0], versions))
    assert live["iteration"] == 9
    saver.close()
    m.close()


def test_a_short_read_leaves_the_rest_to_the_mapping_bit_exactly(tmp_path, monkeypatch):
    state = _state()
    saver, m, live, found = _restart(tmp_path, state)
    assert span_read._load()  # before taking the real call: it is bound on first use (alone, it was None)
    real, calls = span_read._preadv, []

    def short(fd, iov, count, pos):  # the second call comes back short
        calls.append(pos)
        got = real(fd, iov, count, pos)
        return got - 1 if len(calls) == 2 else got

    monkeypatch.setattr(span_read, "_preadv", short)
    found.run()
    assert found.read_by_file == span_read._BATCH and len(calls) == 2
    for a, b in zip(plain_layout(state)[0], plain_layout(live)[0]):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    saver.close()
    m.close()


def test_a_restart_whose_slot_file_was_replaced_copies_from_its_mapping(tmp_path):
    state = _state(40)
    saver, m, live, found = _restart(tmp_path, state)
    (tmp_path / "new").write_bytes(bytes(NBYTES))
    os.replace(tmp_path / "new", m.path)  # the mapping keeps the snapshot; the file at the path is another
    found.run()
    assert found.read_by_file == 0
    for a, b in zip(plain_layout(state)[0], plain_layout(live)[0]):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    saver.close()
    m.close()


def test_a_large_read_is_split_among_threads_bit_exactly_and_a_short_call_in_a_later_part_is_reported(tmp_path,
                                                                                                     monkeypatch):
    import threading

    n = 6 * span_read._BATCH + 5
    offsets, sizes, end = _spans(n)
    m = _file(tmp_path / "slot", end)
    m.tensor.copy_(torch.randint(0, 256, (end,), dtype=torch.uint8))
    monkeypatch.setattr(span_read, "SPLIT_NBYTES", 1)  # every call its own part's worth
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert span_read._load()
    real, seen = span_read._preadv, []

    def spy(fd, iov, count, pos):
        seen.append((threading.current_thread(), pos))  # kept alive: not an ident a later thread reuses
        return real(fd, iov, count, pos)
    monkeypatch.setattr(span_read, "_preadv", spy)
    dst = [torch.zeros(int(s), dtype=torch.uint8) for s in sizes]
    assert span_read.read_spans(m.path, m.ident, [t.data_ptr() for t in dst], offsets, sizes) == n
    assert len({t for t, _ in seen}) == 3 and sorted(p for _, p in seen) == offsets[::span_read._BATCH].tolist()
    for t, o, s in zip(dst, offsets.tolist(), sizes.tolist()):
        assert torch.equal(t, m.tensor[o:o + s])
    # the sixth call (in the last thread's part) comes back short: the spans from its first on are the caller's
    sixth = int(offsets[5 * span_read._BATCH])
    monkeypatch.setattr(span_read, "_preadv", lambda fd, iov, c, pos: real(fd, iov, c, pos) - (pos == sixth))
    assert span_read.read_spans(m.path, m.ident, [t.data_ptr() for t in dst], offsets, sizes) == 5 * span_read._BATCH
    m.close()


def test_a_part_whose_thread_cannot_start_is_read_by_the_calling_thread(tmp_path, monkeypatch):
    """A restart's read split among threads where no more threads can be started (a process or cgroup limit): the
    calling thread reads those parts too, every span bit-exact (it raised, leaving the started threads running)."""
    from faults import refuse_thread_starts

    n = 6 * span_read._BATCH + 5
    offsets, sizes, end = _spans(n)
    m = _file(tmp_path / "slot", end)
    m.tensor.copy_(torch.randint(0, 256, (end,), dtype=torch.uint8))
    monkeypatch.setattr(span_read, "SPLIT_NBYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    started = refuse_thread_starts(monkeypatch, "snapckpt-span-read")
    dst = [torch.zeros(int(s), dtype=torch.uint8) for s in sizes]
    assert span_read.read_spans(m.path, m.ident, [t.data_ptr() for t in dst], offsets, sizes) == n
    assert len(started) == 1 and not started[0].is_alive()
    for t, o, s in zip(dst, offsets.tolist(), sizes.tolist()):
        assert torch.equal(t, m.tensor[o:o + s])
    m.close()
