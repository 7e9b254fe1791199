"""How ``load(step=N)`` tells "the checkpoint went away while it was read" (retired by the job saving there:
:class:`CheckpointNotFoundError`) from damage (:class:`CheckpointCorruptError`): by the ``vanished`` flag of the
record the ranks agree on, set when the candidate's directory is gone, never by the words of an error. Before,
an error whose text merely ended with the vanish note was taken for a vanish."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import pytest

from snapckpt.dist.coordination import LocalCoordinator
from snapckpt.dist.topology import Topology
from snapckpt.engine import loader as loader_mod
from snapckpt.engine.loader import Loader
from snapckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from snapckpt.options import CheckpointOptions
from snapckpt.storage.posix import PosixStorage

DIRNAME = "step_00000002"


class _Peer(LocalCoordinator):
    """Rank 0 of a world of two; rank 1 posts ``other`` to every round (``None``: rank 1 loads fine)."""

    def __init__(self, other: Optional[Dict[str, Any]]) -> None:
        self.other = other

    def all_gather(self, name: str, payload: Dict[str, Any], timeout_secs: float) -> List[Dict[str, Any]]:
        ok = {"ok": True, "error": "", "vanished": False}
        return super().all_gather(name, payload, timeout_secs) + [self.other or ok]


def _loader(tmp_path, monkeypatch, coord=None) -> Loader:
    world = 1 if coord is None else 2
    ld = Loader(CheckpointOptions(), str(tmp_path), Topology(0, world, tuple(range(world)), 0, 1),
                coord or LocalCoordinator(), PosixStorage(fsync=False), maps=None, session=None, dir_id="d")
    monkeypatch.setattr(ld, "candidates", lambda step=None, any_world_size=False: [(2, "disk", DIRNAME)])
    return ld


def _fails(error: Exception):
    def check(cand):
        raise error
    return check


def test_an_error_that_ends_like_a_vanish_is_still_damage(tmp_path, monkeypatch):
    (tmp_path / DIRNAME).mkdir()  # the directory is still there: whatever the text says, nothing vanished
    ld = _loader(tmp_path, monkeypatch)
    lookalike = CheckpointCorruptError("rank_00000.pt: checksum mismatch" + loader_mod._VANISHED)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        ld.load_with(lambda c: None, step=2, check=_fails(lookalike))


def test_a_directory_gone_while_it_is_read_is_not_found(tmp_path, monkeypatch):
    ld = _loader(tmp_path, monkeypatch)  # no step_00000002: retired after the listing
    gone = FileNotFoundError(os.path.join(str(tmp_path), DIRNAME, "rank_00000.pt"))
    with pytest.raises(CheckpointNotFoundError) as ei:
        ld.load_with(lambda c: None, step=2, check=_fails(gone))
    msg = str(ei.value)
    assert "step 2" in msg and "deleted or renamed while it was read" in msg and "damaged" not in msg, msg


@pytest.mark.parametrize("vanished", [True, False])
def test_every_failing_rank_must_have_vanished(tmp_path, monkeypatch, vanished):
    """Rank 0's directory is gone; rank 1's record decides, by its flag, even with the vanish words in its text."""
    other = {"ok": False, "error": "FileNotFoundError: x" + loader_mod._VANISHED, "vanished": vanished}
    ld = _loader(tmp_path, monkeypatch, _Peer(other))
    expected = CheckpointNotFoundError if vanished else CheckpointCorruptError
    with pytest.raises(expected, match="rank 1: FileNotFoundError"):
        ld.load_with(lambda c: None, step=2, check=_fails(FileNotFoundError("gone")))


def test_a_recommit_is_told_by_its_flag_not_by_the_words(tmp_path, monkeypatch):
    """The directory now holds another commit than the listed one (the job saving there committed step 2 again).
    Right: a rank's failed read gets the "committed again ... not damage" note, even when its own error's text
    quotes those words (a message about another directory); before, such a text suppressed the note."""
    (tmp_path / DIRNAME).mkdir()
    ld = _loader(tmp_path, monkeypatch)
    ld._listed[DIRNAME] = ["run-a", 1.0]
    try:
        ld._as_listed({"run_id": "run-b", "created_unix": 2.0, "step": 2}, DIRNAME, str(tmp_path / DIRNAME))
    except CheckpointCorruptError as e:
        recommit = e
    assert loader_mod._is_recommit(recommit)

    def still_listed(cand):
        raise recommit
    monkeypatch.setattr(ld, "_still_listed", still_listed)
    quoting = CheckpointCorruptError("rank_00000.pt: checksum mismatch (step_00000001 was committed again while "
                                     "it was read, said an older log line)")
    assert not loader_mod._is_recommit(quoting)
    with pytest.raises(CheckpointCorruptError) as ei:
        ld.load_with(lambda c: None, step=2, check=_fails(quoting))
    assert "the step was committed again while it was read, by the job saving there" in str(ei.value), ei.value
    wrapped = RuntimeError("reading failed")
    wrapped.__cause__ = recommit
    assert loader_mod._is_recommit(wrapped)
    during = RuntimeError("a cleanup failed while the refusal was handled")
    during.__context__ = recommit  # implicit chaining only: not raised from it
    assert not loader_mod._is_recommit(during)
