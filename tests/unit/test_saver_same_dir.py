"""A DISK save of a directory whose earlier DISK save is still in flight (a fixed tag such as DeepSpeed's
``tag="best"``, or the same step again) is not waited for on the training thread (:meth:`Saver.save_files`):
the persister orders the saves of one directory (``Scheduler._wait_for_directory``, ``Scheduler.persist``).
Before, the save waited for every earlier save of the directory, blocking training for a whole save.

An earlier save's failure not yet raised to the caller is still raised once by the next save, through its
``poll()``, and never one the caller already had. Driven by a stub Saver stopped right after its poll (at the
Stager's ``prepare``)."""
from __future__ import annotations

from typing import Optional

import pytest

from snapckpt import StorageType
from snapckpt.engine import saver as S


class _Reached(BaseException):
    """The save got past its poll() (to the Stager's prepare). Not an ``Exception``: a save that fails from there on
    tells the persister (``Saver._save_failed``), which this stub does not have."""


class _Handle:
    """An earlier save of ``best`` (the SaveHandle calls that Saver.save_files and Saver.poll use): in flight
    (``error`` None), or failed with ENOSPC; ``reported``: the caller had the failure already."""

    def __init__(self, error: Optional[BaseException], reported: bool = False) -> None:
        self.dirname, self.step, self.reported, self.waits = "best", 1, reported, 0
        self.error = error

    def done(self) -> bool:
        return self.error is not None

    def exception(self) -> Optional[BaseException]:
        return self.error

    def mark_reported(self) -> None:
        self.reported = True

    def wait(self, timeout=None):  # the training thread must never block on it
        self.waits += 1
        raise AssertionError("the save waited for the earlier save of its directory")


def _saver(handle):
    sv = S.Saver.__new__(S.Saver)  # only what save_files uses up to its poll()
    sv._handles, sv._claimed, sv._other_world, sv._local = [handle], True, {}, False
    sv._checkpoint_dir = "/nonexistent/ckpt"

    class _Stager:
        def prepare(self, *a, **k):
            raise _Reached()

    sv.fence, sv._stager = (lambda: None), _Stager()
    return sv


@pytest.mark.parametrize("step", [2, 1])  # another step under the tag; the same step again
def test_a_save_of_a_directory_whose_earlier_save_is_in_flight_does_not_wait_for_it(step):
    h = _Handle(error=None)
    sv = _saver(h)
    with pytest.raises(_Reached):
        sv.save_files({"a.pt": b""}, step, StorageType.DISK, dirname="best", tracker_name=None)
    assert h.waits == 0 and sv._handles == [h]  # still in flight: a later poll() or wait() ends it


def test_a_failure_the_caller_already_had_does_not_fail_the_next_save_of_the_tag():
    h = _Handle(OSError(28, "No space left on device"), reported=True)
    with pytest.raises(_Reached):
        _saver(h).save_files({"a.pt": b""}, 2, StorageType.DISK, dirname="best", tracker_name=None)


def test_a_failure_not_yet_raised_is_raised_by_the_next_save_of_the_tag_once():
    h = _Handle(OSError(28, "No space left on device"))
    sv = _saver(h)
    with pytest.raises(OSError, match="No space left"):
        sv.save_files({"a.pt": b""}, 2, StorageType.DISK, dirname="best", tracker_name=None)
    with pytest.raises(_Reached):  # the next save goes on: it was raised once
        sv.save_files({"a.pt": b""}, 3, StorageType.DISK, dirname="best", tracker_name=None)
    assert h.waits == 0
