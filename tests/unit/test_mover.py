"""The slot copy of large tensors (snapckpt/engine/mover.py): libc memmove in chunks that the calling thread and the
helper threads take in turn, so that a helper that is not running holds up only the chunk it has taken (torch's copy
waits for every intra-op thread at each tensor); the Stager copies tensors of at least MIN_TENSOR_NBYTES that way and
the slot reads back bit-exact."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from snapckpt.engine import mover
from snapckpt.engine.copy_plan import Ways


def _chunks_into(buf: bytearray, srcs):
    """Chunks copying ``srcs`` back to back into ``buf`` (a gap of 8 bytes after each), and the offsets."""
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    offs, off = [], 0
    for t in srcs:
        offs.append(off)
        off += t.numel() * t.element_size() + 8
    return mover.chunks_of([base + o for o in offs], srcs), offs


def test_copy_chunks_copies_every_byte_and_nothing_else_on_any_thread_count(monkeypatch):
    monkeypatch.setattr(mover, "CHUNK_NBYTES", 4096 + 12)  # chunks that split tensors at odd places
    g = torch.Generator().manual_seed(0)
    srcs = [torch.rand(n, generator=g) for n in (1, 1000, 7777, 40000)] + [torch.randint(0, 255, (9999,), dtype=torch.uint8)]
    for threads in (1, 2, 4):
        buf = bytearray(b"\xab" * (sum(t.nbytes + 8 for t in srcs)))
        chunks, offs = _chunks_into(buf, srcs)
        assert len(chunks) > 40 and max(c[2] for c in chunks) == mover.CHUNK_NBYTES
        mover.copy_chunks(chunks, threads=threads)
        whole = torch.frombuffer(buf, dtype=torch.uint8)
        for t, o in zip(srcs, offs):
            n = t.nbytes
            assert torch.equal(whole[o:o + n], t.view(-1).view(torch.uint8)), threads
            assert bytes(buf[o + n:o + n + 8]) == b"\xab" * 8  # the gap is untouched


def test_a_stalled_helper_holds_up_only_its_own_chunk(monkeypatch):
    """The helper takes one chunk and stalls (as a thread the scheduler does not run); the calling thread copies every
    other chunk meanwhile and the copy ends once the helper's chunk is done."""
    monkeypatch.setattr(mover, "CHUNK_NBYTES", 1 << 12)
    src = torch.rand(64 << 10)  # 256 KiB: 64 chunks
    buf = bytearray(src.nbytes + 8)
    chunks, _ = _chunks_into(buf, [src])
    by_thread = {}
    real = mover._memmove

    def memmove(dst, s, n):
        me = threading.current_thread().name
        if me.startswith("snapckpt-mover") and not by_thread.get(me):
            time.sleep(0.3)  # stalled while holding its first chunk
        by_thread[me] = by_thread.get(me, 0) + 1
        return real(dst, s, n)

    monkeypatch.setattr(mover, "_memmove", memmove)
    mover.copy_chunks(chunks, threads=2)
    helpers = {k: v for k, v in by_thread.items() if k.startswith("snapckpt-mover")}
    assert sum(by_thread.values()) == len(chunks) and sum(helpers.values()) <= 2, by_thread
    assert by_thread[threading.current_thread().name] >= len(chunks) - 2
    assert torch.equal(torch.frombuffer(buf, dtype=torch.uint8)[:src.nbytes], src.view(torch.uint8))


@pytest.mark.parametrize("way", ["torch", "mover"])
def test_the_stager_copies_large_tensors_either_way_and_the_slot_reads_back_exactly(monkeypatch, way):
    from snapckpt.engine.stager import Stager
    from snapckpt.persister.slot_index import read_slot

    moved = []
    real = mover.copy_chunks
    monkeypatch.setattr(mover, "copy_chunks", lambda chunks, threads=None: moved.append(len(chunks)) or real(chunks))
    monkeypatch.setattr(Ways, "pick", lambda self: way)
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.rand(1024, 700, generator=g), "b": torch.rand(16, generator=g),
             "p": torch.nn.Parameter(torch.rand(600, 600, generator=g)), "t": torch.rand(700, 500, generator=g).t(),
             "h": torch.rand(1 << 20, generator=g).half(), "step": 3}
    stager, buf, views = Stager(), bytearray(16 << 20), {}
    slot = torch.frombuffer(buf, dtype=torch.uint8)
    for step in (1, 2):
        p = stager.prepare({"s.pt": state}, step)
        p.views = views
        Stager.copy_into(p, slot, buf)
        got, files = read_slot(buf, slot, weights_only=True)
        back = files["s.pt"]
        assert got == step and back["step"] == 3
        for k in ("w", "b", "p", "t", "h"):
            assert torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype, k
        assert type(back["p"]) is torch.nn.Parameter and not state["p"].grad_fn
        with torch.no_grad():
            state["w"].add_(1.0)
    # mover: w (2.7 MiB), p (1.4 MiB) and h (2 MiB) by chunks; b is small, t is not contiguous (a span copy)
    chunks = sum(-(-n // mover.CHUNK_NBYTES) for n in (1024 * 700 * 4, 600 * 600 * 4, 2 << 20))
    assert sum(moved) == (2 * chunks if way == "mover" else 0)


def test_the_way_of_a_layout_is_the_faster_one_lately_and_the_other_is_tried_again_now_and_then():

    w = Ways()
    assert w.pick() == "torch"  # nothing timed yet (an untimed first copy into a mapping picks too)
    w.record("torch", 0.10)
    assert w.pick() == "mover"
    w.record("mover", 0.03)
    picks = []
    for _ in range(2 * Ways.TRY_EVERY):
        picks.append(w.pick())
        w.record(picks[-1], 0.10 if picks[-1] == "torch" else 0.03)
    assert picks.count("torch") == 2 and picks.count("mover") == 2 * Ways.TRY_EVERY - 2
    for _ in range(Ways.KEPT):  # the cores got idle: torch's copies are now the faster ones
        w.record("mover", 0.2)
    assert w.pick() == "torch" and len(w.secs["mover"]) == Ways.KEPT


def test_move_each_copies_every_range_in_order_keeping_the_gil():
    """``move_each`` (the many small tensors of a copy on the saving thread): every ``(dst, src, nbytes)`` in order, a
    later range over an earlier one's bytes wins; by a libc call that keeps the GIL (``ctypes.PyDLL``: 20,000 releases
    would let a busy Python thread of the training process take the GIL at each one)."""
    import ctypes

    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    d, s = dst.data_ptr(), src.data_ptr()
    mover.move_each([(d, s, 16), (d + 16, s + 40, 8), (d + 20, s, 4), (d + 60, s + 60, 4)])
    want = torch.zeros(64, dtype=torch.uint8)
    want[:16] = src[:16]
    want[16:24] = src[40:48]
    want[20:24] = src[:4]
    want[60:] = src[60:]
    assert torch.equal(dst, want)
    assert mover._memmove_gil._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # noqa: SLF001


def test_foreach_copy_splits_the_small_tensors_among_threads_and_copies_as_torch_does(monkeypatch):
    """``mover.foreach_copy`` (the in-process memory restore's copy): the tensors under MIN_TENSOR_NBYTES are cut
    into parts of about equal bytes that the calling thread and a helper take (each under no_grad: grad mode is per
    thread, and a Parameter that requires grad refuses an in-place copy in grad mode); the large ones go in one call
    first; every tensor ends equal to its source with its version bumped, as ``Tensor.copy_`` leaves it."""
    monkeypatch.setattr(mover, "SPLIT_NBYTES", 1 << 15)
    monkeypatch.setattr(mover, "MIN_TENSOR_NBYTES", 1 << 14)  # 5 of the 12 are large
    g = torch.Generator().manual_seed(1)
    sizes = [100, 3000, 5000, 1 << 13, 777, 4000, 6000, 2500, 3333, 4444, 1 << 13, 999]
    srcs = [torch.rand(n, generator=g) for n in sizes]
    dsts = [torch.nn.Parameter(torch.zeros(n)) if i % 3 == 0 else torch.zeros(n) for i, n in enumerate(sizes)]
    versions = [t._version for t in dsts]
    nbytes = [n * 4 for n in sizes]
    calls = []
    run = mover._pool.run
    monkeypatch.setattr(mover._pool, "run", lambda items, helpers, fn: (calls.append((len(items), helpers)),
                                                                        run(items, helpers, fn)))
    threads, helper_in, me, mine = set(), threading.Event(), threading.get_ident(), []
    copy = mover._foreach_copy_no_grad

    def part(d, s, *inference):  # the calling thread waits in its first part (after the large ones) until the
        threads.add(threading.get_ident())  # helper took one
        if threading.get_ident() != me:
            helper_in.set()
        else:
            mine.append(len(d))
            if len(mine) == 2:
                assert helper_in.wait(30)
        copy(d, s, *inference)

    monkeypatch.setattr(mover, "_foreach_copy_no_grad", part)
    mover.foreach_copy(dsts, srcs, mover.split_of(nbytes, threads=2))
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert all(t._version > v for t, v in zip(dsts, versions))
    assert calls == [(4, 1)] and len(threads) == 2  # 4 parts (2 per thread) of the 7 small ones
    assert mine[0] == 5  # the large ones first, in one call on the calling thread
    assert torch.is_grad_enabled()

    calls.clear()
    for t in dsts:
        with torch.no_grad():
            t.zero_()
    mover.foreach_copy(dsts, srcs, mover.split_of(nbytes, threads=1))  # one thread: one call, no pool
    assert calls == [] and all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_foreach_copy_raises_a_parts_error_on_the_calling_thread_and_the_pool_goes_on(monkeypatch):
    """An error in a part copied by a helper (here a shape that differs) is raised by ``foreach_copy`` itself, not
    lost on the helper thread; the pool takes the next job."""
    monkeypatch.setattr(mover, "SPLIT_NBYTES", 1)
    srcs = [torch.rand(1000) for _ in range(8)]
    dsts = [torch.zeros(1000) for _ in range(7)] + [torch.zeros(999)]
    with pytest.raises(RuntimeError):
        mover.foreach_copy(dsts, srcs, mover.split_of([4000] * 8, threads=2))
    dsts[-1] = torch.zeros(1000)
    mover.foreach_copy(dsts, srcs, mover.split_of([4000] * 8, threads=2))
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_foreach_copy_under_inference_mode_copies_into_inference_tensors_on_every_thread(monkeypatch):
    """Inference tensors (made under ``torch.inference_mode``) take an in-place copy only under it, and inference
    mode is per thread: called under it, ``foreach_copy``'s helpers copy under it too (before the fix the parts a
    helper took raised "Inplace update to inference tensor outside InferenceMode", some tensors copied)."""
    monkeypatch.setattr(mover, "SPLIT_NBYTES", 1)
    helper_in, me, took = threading.Event(), threading.get_ident(), []
    copy = mover._foreach_copy_no_grad

    def part(d, s, *inference):  # the calling thread waits in its part until the helper took one
        if threading.get_ident() != me:
            took.append(len(d))
            helper_in.set()
        else:
            assert helper_in.wait(30)
        copy(d, s, *inference)

    monkeypatch.setattr(mover, "_foreach_copy_no_grad", part)
    with torch.inference_mode():
        dsts = [torch.zeros(1000) for _ in range(8)]
    srcs = [torch.full((1000,), float(i)) for i in range(8)]
    with torch.inference_mode():
        mover.foreach_copy(dsts, srcs, mover.split_of([4000] * 8, threads=2))
    assert took and all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
