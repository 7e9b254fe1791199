"""``snapckpt inspect`` of files a manifest records as raw bytes. Found by a new-user trial: on a Hugging Face
Trainer checkpoint written by the callback, ``scheduler.pt``, ``rng_state_*.pth`` and ``training_args.bin`` (torch.save
archives the callback hands over as bytes) were shown as "not a torch.save archive: not inspected", so their keys were
never listed and ``training_args.bin`` was never refused as the operations page says. A DCP ``.distcp`` shard, which
only embeds zip records, must stay unopened (tests/test_cli.py::test_cli_inspect_other_formats_and_usage_errors)."""
from __future__ import annotations

import argparse
import io
import os

import torch

from snapckpt.cli.inspect import _inspect_file


class TrainingArguments:
    """A pickled object of the test's own class, as transformers' TrainingArguments in training_args.bin: never
    among torch's safe globals (``argparse.Namespace`` was: another test in the same worker registered it)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def _rec(path: str) -> dict:
    return {"name": os.path.basename(path), "rank": 0, "bytes": os.path.getsize(path), "kind": None,
            "status": "ok", "error": None, "keys": []}


def test_raw_bytes_torch_archives_are_inspected_and_other_raw_files_are_not(tmp_path):
    args = argparse.Namespace(trust=False, progress=False)
    sched = tmp_path / "scheduler.pt"
    torch.save({"last_epoch": 3, "base_lrs": [0.1], "t": torch.zeros(2, 3)}, sched)
    targs = tmp_path / "training_args.bin"
    torch.save(TrainingArguments(lr=0.5), targs)
    buf = io.BytesIO()
    torch.save({"x": torch.ones(3)}, buf)
    distcp = tmp_path / "__0_0.distcp"
    distcp.write_bytes(b"DCP" + buf.getvalue() + b"tail")
    distcp2 = tmp_path / "__0_1.distcp"  # as DCP writes them: torch.save records, raw tensor bytes, a record last
    distcp2.write_bytes(buf.getvalue() + bytes(range(256)) * 4 + buf.getvalue())

    rec = _rec(str(sched))
    _inspect_file(args, str(sched), rec, "bytes")
    assert (rec["kind"], rec["status"]) == ("torch", "ok"), rec
    keys = {k["key"]: k for k in rec["keys"]}
    assert keys["t"]["shape"] == [2, 3] and keys["last_epoch"]["value"] == "3", keys

    rec = _rec(str(targs))
    _inspect_file(args, str(targs), rec, "bytes")
    assert (rec["kind"], rec["status"]) == ("torch", "refused"), rec

    for raw in (distcp, distcp2):
        rec = _rec(str(raw))
        _inspect_file(args, str(raw), rec, "bytes")
        assert (rec["kind"], rec["status"], rec["keys"]) == ("other", "not inspected", []), rec
