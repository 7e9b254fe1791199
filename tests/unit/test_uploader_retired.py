"""The uploader's account of a checkpoint that local retention retires while the store keeps failing (an outage,
saves faster than the retries): an ``upload_failed`` naming the store's error, whether the directory went
between two attempts or during one (a client's own retries can hold one attempt for minutes), so that rank 0
warns that checkpoints are not reaching the store; a checkpoint retired before or during its first attempt is
an ``upload_skipped``. Driven by a stub store (no object store needed)."""
from __future__ import annotations

import json
import os
import types

from snapckpt.persister import uploader as U

URL = "s3://bucket/run"


class _Store:
    """Every upload fails with a 503; ``retire_at`` (1-based attempt) renames the local directory away while that
    attempt runs (local retention after a newer save's commit)."""

    def __init__(self, local_dir: str, retire_at: int) -> None:
        self.local_dir, self.retire_at, self.attempts, self.cleaned = local_dir, retire_at, 0, 0

    def clean_orphans(self):
        self.cleaned += 1
        return []

    def upload(self, local_dir, dirname, manifest, **kw):
        self.attempts += 1
        if self.attempts == self.retire_at:
            os.rename(self.local_dir, self.local_dir + ".retired")
        raise OSError(16, "Service Unavailable")

    def apply_retention(self, keep_last, protect=()):
        raise AssertionError("nothing was uploaded: no retention")


def _job(tmp_path):
    d = str(tmp_path / "step_00000001")
    os.makedirs(d)
    m = {"step": 1, "files": {}}
    with open(os.path.join(d, "m.json"), "w") as f:
        json.dump(m, f)
    return d, U.UploadJob("run1", URL, d, "step_00000001", m, 2, "latest", "step_00000001")


def _run(tmp_path, monkeypatch, retire_at):
    d, job = _job(tmp_path)
    monkeypatch.setattr(U, "time", types.SimpleNamespace(monotonic=U.time.monotonic, sleep=lambda s: None))
    up = U.Uploader(lambda: None)
    store = up._stores[URL] = _Store(d, retire_at)
    up.submit(job)
    up.shutdown()
    return up.notes_for("run1"), store


def test_retired_during_a_later_attempt_of_an_outage_is_a_failure(tmp_path, monkeypatch):
    notes, store = _run(tmp_path, monkeypatch, retire_at=2)
    assert [(n["kind"], n["step"]) for n in notes] == [("upload_failed", 1)], notes
    assert "Service Unavailable" in notes[0]["reason"] and URL in notes[0]["reason"], notes
    assert store.attempts == 2 and store.cleaned == 2  # the first job's clean-up, then what the attempts left


def test_retired_during_the_first_attempt_is_a_skip(tmp_path, monkeypatch):
    notes, store = _run(tmp_path, monkeypatch, retire_at=1)
    assert [(n["kind"], n["step"]) for n in notes] == [("upload_skipped", 1)], notes
    assert store.attempts == 1


class _ReplacedStore(_Store):
    """``replace_at`` (1-based attempt; 0: before the first) puts a later save of the same directory name in
    place of the job's checkpoint (a fixed tag saved again and committed: other files, another manifest); an
    upload then fails as the real store's does, on a file that no longer matches the job's manifest."""

    def __init__(self, local_dir: str, replace_at: int) -> None:
        super().__init__(local_dir, retire_at=-1)
        self.replace_at = replace_at
        if replace_at == 0:
            self.replace()

    def replace(self) -> None:
        os.makedirs(os.path.join(self.local_dir, ".snapckpt"), exist_ok=True)
        with open(os.path.join(self.local_dir, ".snapckpt", "manifest.json"), "w") as f:
            json.dump({"step": 3, "run_id": "run1", "created_unix": 3.0, "files": {}}, f)

    def upload(self, local_dir, dirname, manifest, **kw):
        self.attempts += 1
        if self.attempts == self.replace_at:
            self.replace()
        from snapckpt.errors import CheckpointCorruptError
        raise CheckpointCorruptError(f"{local_dir}/rank_00000.pt: checksum differs from the manifest")


def test_replaced_by_a_later_save_of_the_same_name_is_a_skip_not_a_failure(tmp_path, monkeypatch):
    """A fixed tag saved twice in a row (or a late commit retired once reported, then its tag saved again): by
    the time the first save's upload runs, or while it runs, its directory holds the second save's commit. The
    first upload must end as a skip at once (the second save's upload follows), not be retried against files
    that are no longer its own and end ``upload_failed`` (before: 4 attempts, ``CheckpointCorruptError``)."""
    for replace_at, attempts in ((0, 0), (1, 1)):
        d = tmp_path / f"r{replace_at}"
        d.mkdir()
        local, job = _job(d)
        job.manifest.update(run_id="run1", created_unix=1.0)
        os.makedirs(os.path.join(local, ".snapckpt"))
        with open(os.path.join(local, ".snapckpt", "manifest.json"), "w") as f:
            json.dump(job.manifest, f)
        monkeypatch.setattr(U, "time", types.SimpleNamespace(monotonic=U.time.monotonic, sleep=lambda s: None))
        up = U.Uploader(lambda: None)
        store = up._stores[URL] = _ReplacedStore(local, replace_at)
        up.submit(job)
        up.shutdown()
        notes = up.notes_for("run1")
        assert [(n["kind"], n["step"]) for n in notes] == [("upload_skipped", 1)], (replace_at, notes)
        assert store.attempts == attempts
