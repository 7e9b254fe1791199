"""Rank 0's warning about failing uploads (:meth:`Saver.status` turning the persister's remote-tier notes into
log lines and events), driven by a stub session: the first failure warns with the fix, later ones within
``UPLOAD_FAILED_REMINDER_SECS`` only emit their event, one after it warns again with the count, and the first
upload that succeeds afterwards is one INFO; other ranks stay quiet, credentials never appear."""
from __future__ import annotations

import logging

from snapckpt.engine import saver as S

URL = "s3://KEY:SECRET@bucket/run"


class _Session:
    def __init__(self) -> None:
        self.notes: list = []

    def status(self, step, dirname, wait_secs, seq=-1):
        return {"state": "committed", "remote": list(self.notes)}


def _saver(rank: int):
    sv = S.Saver.__new__(S.Saver)  # only what status() uses
    sv._session, sv._rank, sv._checkpoint_dir = _Session(), rank, "/local/ckpt"
    sv._remote_seen, sv._remote_failures, sv._remote_warned_at = 0, 0, None
    sv.events = []
    sv._emit = sv.events.append
    return sv


def _fail(sv, step):
    sv._session.notes.append({"kind": "upload_failed", "step": step, "reason": f"{URL}: PermissionError: denied"})
    sv.status(step + 1, "d", 0.0)


def test_first_failure_warns_reminders_are_rate_limited_and_the_catch_up_is_one_info(caplog, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(S.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.DEBUG, logger="snapckpt")
    sv = _saver(0)

    def lines(level):
        return [r.getMessage() for r in caplog.records if r.levelno == level]

    _fail(sv, 1)
    (w,) = lines(logging.WARNING)
    assert "step 1 " in w and "s3://***@bucket/run" in w and "PermissionError: denied" in w, w
    assert "credentials" in w and "/local/ckpt" in w and "SECRET" not in w and "KEY" not in w, w
    clock[0] += S.UPLOAD_FAILED_REMINDER_SECS - 1
    _fail(sv, 2)
    assert len(lines(logging.WARNING)) == 1
    clock[0] += 2
    _fail(sv, 3)
    assert len(lines(logging.WARNING)) == 2 and "step 3 " in lines(logging.WARNING)[1]
    assert "3 failed uploads" in lines(logging.WARNING)[1]
    assert [(e.kind, e.step) for e in sv.events] == [("upload_failed", 1), ("upload_failed", 2),
                                                     ("upload_failed", 3)]
    sv._session.notes.append({"kind": "uploaded", "step": 4, "reason": URL})
    sv.status(5, "d", 0.0)
    (info,) = [m for m in lines(logging.INFO) if "caught up" in m]
    assert "step 4 " in info and "after 3 failed" in info and "SECRET" not in info, info
    assert len(sv.events) == 3  # no event for the catch-up
    _fail(sv, 5)  # failing again after the catch-up: a first failure again
    assert len(lines(logging.WARNING)) == 3 and "failed uploads" not in lines(logging.WARNING)[2]


def test_other_ranks_emit_the_event_without_a_warning(caplog):
    caplog.set_level(logging.DEBUG, logger="snapckpt")
    sv = _saver(1)
    _fail(sv, 1)
    sv._session.notes.append({"kind": "uploaded", "step": 2, "reason": URL})
    sv.status(3, "d", 0.0)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO], caplog.text
    assert [(e.kind, e.step) for e in sv.events] == [("upload_failed", 1)]


def test_the_persister_keeps_the_newest_notes_and_a_rank_reads_each_new_one_once():
    """Uploads failing for days must not grow every status reply: the uploader keeps the newest
    :data:`NOTES_KEPT` notes of a run and says how many it dropped; a rank reading the window emits each note
    once, the dropped ones it had seen included, and none twice after the window slid."""
    from types import SimpleNamespace

    from snapckpt.persister.uploader import NOTES_KEPT, Uploader

    up = Uploader(on_done=lambda: None)
    sv = _saver(1)

    def reply(step, dirname, wait_secs, seq=-1):
        base, notes = up.notes_window("run1")
        return {"state": "committed", "remote": notes, "remote_base": base}

    sv._session.status = reply
    total = NOTES_KEPT + 100
    for step in range(total):
        up._note(SimpleNamespace(run_id="run1", manifest={"step": step}), "upload_failed", f"{URL}: OSError: x")
        if step % 10 == 0:  # the rank asks at each of its DISK saves (each one queues one upload)
            sv.status(step, "d", 0.0)
    base, notes = up.notes_window("run1")
    assert len(notes) == NOTES_KEPT and base == total - NOTES_KEPT
    assert notes[0]["step"] == base and notes[-1]["step"] == total - 1
    assert up.notes_for("run1") == notes
    sv.status(total, "d", 0.0)
    assert [e.step for e in sv.events] == list(range(total))  # each note once, in order
    sv.status(total + 1, "d", 0.0)
    assert len(sv.events) == total


def test_a_queue_full_drop_names_the_upload_it_waits_behind(monkeypatch):
    """A store that stops answering shows first as drops of a full queue: the drop's note names the upload in
    flight and how long it has run, so that the warning says the store may be slow or not answering."""
    import threading

    from snapckpt.persister import uploader as U

    monkeypatch.setattr(U, "QUEUE_DEPTH", 1)
    taken, release = threading.Event(), threading.Event()

    def stuck(self, job):  # the upload of the first job never ends until released (a hung store)
        taken.set()
        release.wait(30)

    monkeypatch.setattr(U.Uploader, "_do", stuck)
    up = U.Uploader(lambda: None)

    def job(step):
        return U.UploadJob("run1", "s3://b/run", "/nowhere", f"step_{step}", {"step": step}, None, order=step)

    up.submit(job(1))
    assert taken.wait(10)
    up.submit(job(2))
    up.submit(job(3))  # queue full: 2 dropped behind the upload of step 1
    release.set()
    up.shutdown()
    (note,) = up.notes_for("run1")
    assert (note["kind"], note["step"]) == ("upload_skipped", 2), note
    assert "waiting behind the upload of step 1, running for 0 s: the store may be slow or not answering" in \
        note["reason"] and "step 3 will be uploaded instead" in note["reason"], note
