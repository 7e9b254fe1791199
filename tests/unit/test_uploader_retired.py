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
