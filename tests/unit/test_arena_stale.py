"""A new persister's arena (snapckpt/persister/arena.py, SlotFiles): the slot files a dead persister of the job
left are set aside at once and deleted off the constructor's thread (freeing their pages took 0.1-0.2 s per GiB
before the persister could listen: a restart's constructor waited for it); growing a slot waits until they are
deleted, so the capacity check counts their pages as free. Real files in a temporary directory."""
from __future__ import annotations

import os
import threading

from snapckpt.persister import arena as arena_mod
from snapckpt.persister.arena import SlotFiles, slot_file_name

NBYTES = 1 << 20


def _stale_arena(directory: str) -> None:
    os.makedirs(directory, mode=0o700)
    for slot in range(2):
        with open(os.path.join(directory, slot_file_name(0, slot)), "wb") as f:
            f.truncate(NBYTES)
    with open(os.path.join(directory, slot_file_name(1, 0) + ".stale-12345"), "wb") as f:  # a dead persister's
        f.truncate(NBYTES)
    with open(os.path.join(directory, "unrelated"), "wb"):
        pass


def test_stale_slot_files_are_deleted_off_the_constructors_thread(tmp_path, monkeypatch):
    d = str(tmp_path / "arena")
    _stale_arena(d)
    release = threading.Event()
    unlinked = []
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        unlinked.append((os.path.basename(path), threading.current_thread().name))
        release.wait(30)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(arena_mod.os, "unlink", unlink)
    files = SlotFiles(d)  # returns while the deletion waits
    assert not files.cleared.is_set()
    names = set(os.listdir(d))
    assert slot_file_name(0, 0) not in names and slot_file_name(0, 1) not in names  # set aside at once
    grown = []
    grower = threading.Thread(target=lambda: grown.append(files.ensure_size(0, 0, NBYTES, 0)))
    grower.start()
    grower.join(0.5)
    assert grower.is_alive() and not grown  # a growth waits for the deletion
    release.set()
    grower.join(30)
    assert grown == [NBYTES] and files.cleared.is_set()
    assert {n for n, _ in unlinked} == {slot_file_name(0, 0) + f".stale-{os.getpid()}",
                                        slot_file_name(0, 1) + f".stale-{os.getpid()}",
                                        slot_file_name(1, 0) + ".stale-12345"}
    assert {t for _, t in unlinked} == {"snapckpt-arena-clear"}
    assert sorted(os.listdir(d)) == [slot_file_name(0, 0), "unrelated"]  # the new slot, and nothing else touched
    monkeypatch.undo()
    files.remove_all()
    assert os.listdir(d) == ["unrelated"]


def test_an_arena_without_stale_files_is_cleared_at_once(tmp_path):
    files = SlotFiles(str(tmp_path / "arena"))
    assert files.cleared.is_set()
    assert files.ensure_size(0, 1, NBYTES, 0) == NBYTES
