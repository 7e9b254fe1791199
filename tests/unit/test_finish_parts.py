"""finish_parts (snapckpt/persister/writer.py) against a committer that renames the partial directory the moment
it counts the last part marker, before the writer has fsynced the marker's directory: the parts succeed and the
markers are in the renamed directory. Before, the writer fsynced the directory by its old path and each part
failed with FileNotFoundError after its step had committed (found under SCHED_BATCH, by
tests/test_resources.py::test_B4_disk_fills_during_the_write in a fresh-clone CI run)."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os

import pytest

from snapckpt.ondisk.manifest import SIDECAR, part_marker_name
from snapckpt.persister.writer import WrittenPart, finish_parts
from snapckpt.storage import PosixStorage


class _CommitOnLastMarker(PosixStorage):
    """Renames ``partial`` to ``final`` right after the marker of the last of ``ranks`` is renamed into place
    (what the committer does once its listing finds every marker)."""

    def __init__(self, partial: str, final: str, ranks, fsync: bool) -> None:
        super().__init__(fsync=fsync)
        self.partial, self.final, self.waiting = partial, final, set(ranks)

    def write_atomic(self, path: str, data: bytes, *, sync_dir: bool = True) -> None:
        super().write_atomic(path, data, sync_dir=sync_dir)
        self.waiting.discard(json.loads(data)["rank"])
        if not self.waiting:
            os.rename(self.partial, self.final)


@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "nofsync"])
@pytest.mark.parametrize("pool", [False, True], ids=["serial", "pool"])
@pytest.mark.parametrize("ranks", [[0], [0, 1]], ids=["one_part", "two_parts"])
def test_parts_succeed_when_the_commit_renames_the_directory_right_after_the_last_marker(tmp_path, fsync, pool,
                                                                                       ranks):
    partial, final = str(tmp_path / ".step_00000001.partial-r"), str(tmp_path / "step_00000001")
    os.makedirs(os.path.join(partial, SIDECAR))
    storage = _CommitOnLastMarker(partial, final, ranks, fsync)
    parts = [WrittenPart(storage, partial, r, "r", 1, None) for r in ranks]
    for r, p in zip(ranks, parts):
        p.files = {f"rank_{r:05d}.pt": {"nbytes": 0, "xxh3_64": "0", "kind": "torch"}}
    with cf.ThreadPoolExecutor(2) as ex:
        errors = finish_parts(parts, ex if pool else None)
    assert errors == [None] * len(ranks), errors
    assert not os.path.exists(partial)
    for r in ranks:
        with open(os.path.join(final, part_marker_name(r))) as f:
            assert json.load(f)["rank"] == r
    assert sorted(os.listdir(os.path.join(final, SIDECAR))) == [f"part_{r:05d}.json" for r in ranks]


def test_a_marker_directory_gone_before_the_markers_fails_each_part_naming_it(tmp_path):
    """The other order, a directory removed before any marker (a failed commit's clean-up racing a late
    writer): every part of it fails with FileNotFoundError naming the marker directory, none is marked."""
    partial = str(tmp_path / ".step_00000001.partial-r")
    parts = [WrittenPart(PosixStorage(), partial, r, "r", 1, None) for r in (0, 1)]
    errors = finish_parts(parts)
    assert all(isinstance(e, FileNotFoundError) for e in errors), errors
    assert all(os.path.join(partial, SIDECAR) in str(e) for e in errors), errors
    assert not os.path.exists(partial)
