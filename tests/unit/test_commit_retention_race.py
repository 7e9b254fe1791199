"""Two commits of one job in the same checkpoint directory, run in parallel (the persister's commit pool):
one's retention against the other's re-commit of a step directory (a save after a rewind re-saves a
dirname). Retention lists the committed directories, then retires the old ones BY NAME; a re-commit that
swaps a newer copy into that name in between must neither lose its copy to the stale listing nor fail.
The window is held open with fault point ``commit.retention_listed`` (snapckpt/persister/retention.py)."""
from __future__ import annotations

import json
import os
import threading

import pytest

from snapckpt.ondisk.manifest import MANIFEST, part_marker_name, partial_dirname
from snapckpt.persister.commit import CommitRequest, commit
from snapckpt.storage import PosixStorage

RUN = "j" * 16 + "0123456789ab"  # job key + 12 hex digits (client.job_of_run)


def _dirname(step: int) -> str:
    return f"step_{step:08d}"


def _request(ckpt: str, step: int, requested_unix: float, keep_last) -> CommitRequest:
    """A one-rank save of ``step`` whose part is written (its partial directory holds the part marker)."""
    req = CommitRequest(checkpoint_dir=ckpt, dirname=_dirname(step), step=step, run_id=RUN, world_size=1,
                        timeout_secs=10.0, keep_last=keep_last, tracker_name="", tracker_content="",
                        requested_unix=requested_unix)
    os.makedirs(os.path.join(req.partial_dir, ".snapckpt"))
    with open(os.path.join(req.partial_dir, "rank_00000.pt"), "wb"):
        pass
    marker = {"rank": 0, "run_id": RUN, "step": step,
              "files": {"rank_00000.pt": {"nbytes": 0, "xxh3_64": "0", "kind": "torch"}}}
    with open(os.path.join(req.partial_dir, part_marker_name(0)), "w") as f:
        json.dump(marker, f)
    return req


class _SeesListing(PosixStorage):
    """Sets ``listed`` when the checkpoint directory itself is listed (retention's listing)."""

    def __init__(self, ckpt: str) -> None:
        super().__init__(fsync=False)
        self.ckpt, self.listed = ckpt, threading.Event()

    def listdir(self, path: str):
        out = super().listdir(path)
        if path == self.ckpt:
            self.listed.set()
        return out


def test_retention_never_retires_a_copy_recommitted_after_its_listing(tmp_path, arm):
    ckpt = str(tmp_path)
    plain = PosixStorage(fsync=False)
    # saved in this order: 100, 200, 250; then a rewind to 100 re-saves 200 and saves 300
    for when, step in enumerate((100, 200, 250), start=1):
        commit(plain, plain, _request(ckpt, step, when, None))
    resave, newest = _request(ckpt, 200, 4, 2), _request(ckpt, 300, 5, 2)
    release = tmp_path / "release"
    arm(f"commit.retention_listed:step=300:action=wait:path={release}:secs=30")
    storage = _SeesListing(ckpt)
    retired, errors = [], []

    def run(req, **kw):
        try:
            commit(storage, storage, req, **kw)
        except BaseException as e:  # reported by the asserts below
            errors.append(e)

    a = threading.Thread(target=run, args=(newest,), kwargs={"defer_deletion": retired})
    a.start()
    assert storage.listed.wait(10)  # 300's retention listed {100, 200 (the old copy), 250, 300}
    c = threading.Thread(target=run, args=(resave,))
    c.start()
    c.join(1.0)  # the re-commit swaps its copy of 200 in (or waits for the retention to end)
    release.touch()
    a.join(10)
    c.join(10)
    assert not a.is_alive() and not c.is_alive()
    assert errors == []
    # the two newest saves are the new 200 (requested at 4) and 300; the abandoned 250 and 100 go
    with open(os.path.join(ckpt, _dirname(200), MANIFEST)) as f:
        assert json.load(f)["requested_unix"] == 4
    assert os.path.isdir(os.path.join(ckpt, _dirname(300)))
    assert not os.path.exists(os.path.join(ckpt, _dirname(250)))
    assert not os.path.exists(os.path.join(ckpt, _dirname(100)))
    assert not os.path.exists(os.path.join(ckpt, partial_dirname(_dirname(200), RUN)))


class _RenameFails(PosixStorage):
    """Fails the rename of a partial directory into place (a re-commit's second rename), as a full or failing
    filesystem would."""

    def rename(self, src: str, dst: str) -> None:
        if ".partial-" in os.path.basename(src):
            raise OSError(5, "Input/output error (injected)")
        super().rename(src, dst)


def test_a_recommit_whose_rename_into_place_fails_leaves_the_committed_copy_in_place(tmp_path):
    """A re-commit moves the committed copy aside, then renames its partial directory into place; when that
    rename fails the commit raises, and the committed copy must be back under its name (loadable by this run),
    not left hidden at ``.X.replaced-R`` until the next persister's recovery."""
    ckpt = str(tmp_path)
    plain = PosixStorage(fsync=False)
    commit(plain, plain, _request(ckpt, 200, 1, None))
    resave = _request(ckpt, 200, 2, None)
    with pytest.raises(OSError, match="injected"):
        commit(_RenameFails(fsync=False), plain, resave)
    with open(os.path.join(ckpt, _dirname(200), MANIFEST)) as f:
        assert json.load(f)["requested_unix"] == 1  # the first copy, under its own name
    assert not [n for n in os.listdir(ckpt) if ".replaced-" in n]
