"""The persister's writer (snapckpt/persister/writer.py) writes a part's large spans straight from the slot mapping
(O_DIRECT, no bounce copy: issue 18, time to durable): the file is a torch.save archive that torch.load reads as the
state, its manifest checksum is that of the file's bytes, and every large span's aligned middle went to the device
from the slot itself. A slot that is not a page-aligned mapping (a bytearray) is copied, as before, with the
same archive as torch's writer."""
from __future__ import annotations

import io
import json
import mmap
import os
import pickle

import torch
import xxhash

from snapckpt.ondisk.manifest import SIDECAR, part_marker_name
from snapckpt.persister.writer import write_part
from snapckpt.storage import PosixStorage
from snapckpt.storage import direct


def _slot(buf, tensors):
    """Lay ``tensors`` (name -> 1-D float32) into ``buf`` at 64-byte aligned offsets after a 4 KiB header, with a
    data.pkl that torch.load turns into the state; return the slot index entry of one torch file."""
    ref = io.BytesIO()
    torch.save(tensors, ref)
    import zipfile
    with zipfile.ZipFile(io.BytesIO(ref.getvalue())) as z:
        names = {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}
    off, records = 4096 + 64 * 3, []
    for key in sorted(k[len("data/"):] for k in names if k.startswith("data/")):
        data = names[f"data/{key}"]
        buf[off:off + len(data)] = data
        records.append([key, off, len(data)])
        off = -(-(off + len(data)) // 64) * 64
    pkl = names["data.pkl"]
    buf[off:off + len(pkl)] = pkl
    return {"path": "rank_00000.pt", "kind": "torch", "pkl": [off, len(pkl)], "records": records}


def _write(tmp_path, buf, entry):
    partial = str(tmp_path / ".step_00000001.partial-r")
    os.makedirs(partial, exist_ok=True)
    files = write_part(PosixStorage(fsync=True), buf, {"step": 1, "files": [entry]}, partial, rank=0, run_id="r",
                       step=1)
    path = os.path.join(partial, entry["path"])
    with open(path, "rb") as f:
        blob = f.read()
    with open(os.path.join(partial, part_marker_name(0))) as f:
        assert json.load(f)["files"] == files
    return files[entry["path"]], path, blob


def test_large_spans_go_straight_from_the_slot_and_the_file_loads_as_the_state(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn((3 << 20) // 4 + 5, generator=g), "b": torch.randn(17, generator=g),
             "v": torch.randn((2 << 20) // 4, generator=g)}
    slot = mmap.mmap(-1, 8 << 20)
    entry = _slot(slot, state)
    straight = []
    real = direct.DirectFile._write_out

    def spy(self, v, nbytes, offset):
        if v.obj is slot:
            straight.append(nbytes)
        return real(self, v, nbytes, offset)

    monkeypatch.setattr(direct.DirectFile, "_write_out", spy)
    rec, path, blob = _write(tmp_path, slot, entry)
    assert rec["nbytes"] == len(blob) and rec["xxh3_64"] == xxhash.xxh3_64(blob).hexdigest()
    got = torch.load(path, weights_only=True)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    large = sum(n for _, _, n in entry["records"] if n >= direct.BORROW_MIN_NBYTES)
    assert sum(straight) >= large - 2 * 4096 * 2  # all but each large record's unaligned head and tail


def test_a_slot_that_is_no_mapping_is_copied_into_torchs_exact_archive(tmp_path):
    g = torch.Generator().manual_seed(4)
    state = {"w": torch.randn((2 << 20) // 4, generator=g)}
    buf = bytearray(4 << 20)
    entry = _slot(buf, state)
    _, path, blob = _write(tmp_path, buf, entry)
    from snapckpt.formats.torch_archive import write_torch_file
    view = memoryview(buf)
    plain = io.BytesIO()
    po, pn = entry["pkl"]
    write_torch_file(plain, bytes(view[po:po + pn]), [(k, view[o:o + n], n) for k, o, n in entry["records"]])
    assert blob == plain.getvalue()
    assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])
