"""A streamed part's writer (snapckpt/persister/stream.py, issue 18) in process, without a persister: it never
reads a slot byte at or past the watermark, and it fails, with no part marker, when the copy is abandoned."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from snapckpt.engine.stager import STREAM_BATCH_NBYTES, Stager
from snapckpt.errors import PersisterError
from snapckpt.persister.arena import HEADER_NBYTES, map_slot, watermark_view
from snapckpt.persister.slot_index import read_index
from snapckpt.persister.stream import Stream
from snapckpt.persister.writer import finish_parts, write_part, write_part_data
from snapckpt.storage.posix import PosixStorage

POISON = 0xEE


def _state():
    """Large tensors (pieces of STREAM_BATCH_NBYTES), small ones batched together, and two views of one
    storage (a span copied as bytes)."""
    g = torch.Generator().manual_seed(18)
    base = torch.rand(3 << 20, generator=g)  # 12 MiB storage, two overlapping views of it: one span, not direct
    return {"big": torch.rand((STREAM_BATCH_NBYTES + (5 << 20)) // 4, generator=g),
            "small": [torch.rand(1000, generator=g) for _ in range(5)],
            "a": base[: 2 << 20], "b": base[1 << 20:],
            "w": torch.nn.Parameter(torch.rand(4 << 20, generator=g)), "n": 7}


class _Spy(Stream):
    """Tells what the writer waits for (everything below the watermark is written once it waits past it)."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.need = None  # the slot byte the writer waits for, while it waits

    def wait(self, offset: int, nbytes: int) -> None:
        if offset < self.data_end:
            self.need = min(offset + nbytes, self.data_end)
        try:
            super().wait(offset, nbytes)
        finally:
            self.need = None

    def blocked(self, mark) -> bool:
        """Whether the writer waits for a byte at or past watermark view ``mark`` (polled up to 60 s)."""
        for _ in range(6000):
            need = self.need
            if need is not None and need > mark[0]:
                return True
            threading.Event().wait(0.01)
        return False


def _slots(tmp_path):
    """A reference slot holding the complete snapshot (a plain copy) and a slot for the streamed one whose spans
    hold poison bytes; the prepared snapshot."""
    prepared = Stager().prepare({"rank_00000.pt": _state()}, 5)
    nbytes = -(-prepared.total_nbytes // 4096) * 4096
    bufs = []
    for name in ("ref", "slot"):
        path = tmp_path / name
        path.write_bytes(b"")
        os.truncate(path, nbytes)
        bufs.append(map_slot(str(path), nbytes))
    ref, buf = bufs
    Stager.copy_into(prepared, torch.frombuffer(ref, dtype=torch.uint8), ref)
    data_end = prepared.layout.plan.data_end
    buf[HEADER_NBYTES:data_end] = bytes([POISON]) * (data_end - HEADER_NBYTES)
    Stager.begin_stream(prepared, buf)
    return prepared, ref, buf, data_end


def _writer(buf, index, partial, stream):
    out = {}

    def run():
        try:
            out["part"] = write_part_data(PosixStorage(), buf, index, partial, rank=0, run_id="r", step=5,
                                          gate=stream.wait)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_writer_never_reads_past_the_watermark(tmp_path):
    """The spans of the streamed slot hold poison until the "copy" (from the reference slot) passes them; the
    watermark is moved in three steps, each once the writer is blocked on it: the file is byte for byte the
    file written from the complete reference slot, so no byte was read before it was final."""
    prepared, ref, buf, data_end = _slots(tmp_path)
    index = read_index(ref)
    stream = _Spy(0, 5, data_end)
    stream.attach(buf)
    mark = watermark_view(buf)
    t, out = _writer(buf, index, str(tmp_path / "streamed"), stream)
    for upto in (HEADER_NBYTES + (5 << 20), data_end // 2, data_end):
        assert stream.blocked(mark), f"the writer never waited past {mark[0]}: {out}"
        assert t.is_alive(), out
        buf[mark[0] or HEADER_NBYTES:upto] = ref[mark[0] or HEADER_NBYTES:upto]
        mark[0] = upto
    stream.set_ready(1)
    t.join(60)
    mark.release()
    stream.detach()
    assert "error" not in out, out
    [err] = finish_parts([out["part"]])
    assert err is None
    expected = write_part(PosixStorage(), ref, index, str(tmp_path / "plain"), rank=0, run_id="r", step=5)
    assert out["part"].files == expected
    got = (tmp_path / "streamed" / "rank_00000.pt").read_bytes()
    assert got == (tmp_path / "plain" / "rank_00000.pt").read_bytes()
    assert bytes([POISON]) * 64 not in got
    loaded = torch.load(tmp_path / "streamed" / "rank_00000.pt", weights_only=True)
    assert torch.equal(loaded["big"], _state()["big"]) and loaded["n"] == 7


def test_an_abandoned_copy_fails_the_writer_without_a_marker(tmp_path):
    """The rank gives up (abort, or its process died) while the writer waits for the watermark: the writer
    raises with the reason, and the part has no marker (the commit can never count it)."""
    prepared, ref, buf, data_end = _slots(tmp_path)
    stream = _Spy(0, 5, data_end)
    stream.attach(buf)
    t, out = _writer(buf, read_index(ref), str(tmp_path / "streamed"), stream)
    mark = watermark_view(buf)
    assert stream.blocked(mark), out
    mark.release()
    stream.cancel("rank 0 left while copying step 5")
    t.join(60)
    stream.detach()
    assert isinstance(out.get("error"), PersisterError) and "rank 0 left" in str(out["error"]), out
    assert not [n for n in os.listdir(tmp_path / "streamed" / ".snapckpt") if n.startswith("part")]
    with pytest.raises(PersisterError, match="rank 0 left"):
        stream.wait_ready()


def test_streamed_copy_publishes_increasing_watermarks_up_to_the_data_end(tmp_path):
    """The rank's side: the copy stores the watermark once per batch, increasing, ending at the first byte
    after the spans, and leaves the slot as the plain copy does (header last)."""
    prepared, ref, buf, data_end = _slots(tmp_path)
    seen = []
    mark = watermark_view(buf)
    real, real_foreach = torch.Tensor.copy_, torch._foreach_copy_

    def spy(self, src, *a, **k):
        seen.append(mark[0])
        return real(self, src, *a, **k)

    def spy_foreach(dst, src, *a, **k):
        seen.append(mark[0])
        return real_foreach(dst, src, *a, **k)

    torch.Tensor.copy_, torch._foreach_copy_ = spy, spy_foreach
    try:
        Stager.copy_into(prepared, torch.frombuffer(buf, dtype=torch.uint8), buf)
    finally:
        torch.Tensor.copy_, torch._foreach_copy_ = real, real_foreach
    final = mark[0]
    mark.release()
    assert final == data_end
    assert seen == sorted(seen) and len(set(seen)) > 2, seen
    for _key, off, n in read_index(ref)["files"][0]["records"]:  # the spans (never the gaps between them)
        assert bytes(buf[off:off + n]) == bytes(ref[off:off + n])
    assert bytes(buf[:36]) == bytes(ref[:36])  # the header (the watermark after it is the stream's own)
