"""``snapckpt verify`` and ``snapckpt ls`` on a checkpoint directory whose job's retention renames a checkpoint
away while the command reads it (a monitoring job running them on a live directory): the retired checkpoint is
gone, not damaged. Before, ``verify`` reported it DAMAGED (exit 1) and ``ls`` listed it as damaged."""
from __future__ import annotations

import json
import os

import xxhash

from snapckpt.cli import inspect as inspect_mod
from snapckpt.cli import ls as ls_mod
from snapckpt.cli import main as cli_main
from snapckpt.cli import verify as verify_mod
from snapckpt.ondisk import manifest as M
from snapckpt.storage.posix import PosixStorage


def _write_checkpoint(root, step: int) -> str:
    dirname = f"step_{step:08d}"
    d = root / dirname
    (d / M.SIDECAR).mkdir(parents=True)
    data = bytes([step]) * 64
    (d / "rank_00000.pt").write_bytes(data)
    rec = {"nbytes": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest(), "kind": "torch"}
    m = M.build_manifest(step=step, dirname=dirname, world_size=1, run_id="r1", parts={0: {"rank_00000.pt": rec}})
    (d / M.MANIFEST).write_bytes(json.dumps(m).encode())
    return dirname


class _Retires(PosixStorage):
    """Renames ``dirname`` to its hidden trash name right after its manifest is first read (retention of the
    job saving there, persister/retention.py)."""

    def __init__(self, root, dirname: str) -> None:
        super().__init__(fsync=False)
        self.src, self.dst, self.done = str(root / dirname), str(root / f".{dirname}.deleted-r"), False

    def read_bytes(self, path: str) -> bytes:
        data = super().read_bytes(path)
        if not self.done and path == os.path.join(self.src, M.MANIFEST):
            self.done = True
            os.rename(self.src, self.dst)
        return data


def test_verify_skips_a_checkpoint_retired_while_it_is_verified(tmp_path, monkeypatch, capsys):
    old, new = _write_checkpoint(tmp_path, 1), _write_checkpoint(tmp_path, 2)
    monkeypatch.setattr(verify_mod, "open_storage", lambda: _Retires(tmp_path, old))
    assert cli_main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "DAMAGED" not in out and f"OK       step 2  {new}" in out, out
    assert f"{old}: deleted or renamed while it was verified" in out, out
    monkeypatch.setattr(verify_mod, "open_storage", lambda: _Retires(tmp_path, new))
    assert cli_main(["verify", "--json", str(tmp_path)]) == 0  # step 1 is gone for good by now
    got = json.loads(capsys.readouterr().out)
    assert (got["intact"], got["damaged"], got["checkpoints"]) == (0, 0, []), got


def test_ls_omits_a_checkpoint_retired_while_it_is_listed(tmp_path, monkeypatch):
    old, new = _write_checkpoint(tmp_path, 1), _write_checkpoint(tmp_path, 2)
    monkeypatch.setattr(ls_mod, "open_storage", lambda: _Retires(tmp_path, old))
    rows, _ = ls_mod.scan(str(tmp_path))
    assert [(r.name, r.state) for r in rows] == [(new, "committed")]


def test_inspect_says_a_step_retired_while_it_is_inspected_is_gone_not_damaged(tmp_path, monkeypatch, capsys):
    old = _write_checkpoint(tmp_path, 1)
    monkeypatch.setattr(inspect_mod, "open_storage", lambda: _Retires(tmp_path, old))
    assert cli_main(["inspect", str(tmp_path), "1"]) == 1  # the step asked for is gone
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "deleted or renamed while it was inspected" in out and "damaged" not in out, out
    monkeypatch.setattr(inspect_mod, "open_storage", lambda: _Retires(tmp_path, _write_checkpoint(tmp_path, 2)))
    assert cli_main(["inspect", "--json", str(tmp_path), "2"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert len(got["problems"]) == 1 and "deleted or renamed while it was inspected" in got["problems"][0], got
    assert got["checkpoints"][0]["files"] == [], got
