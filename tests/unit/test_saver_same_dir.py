"""A DISK save waits for the earlier DISK saves to the same directory (any step: a fixed tag) before it starts
(:meth:`Saver.save_files`). That wait raises an earlier save's failure not yet raised to the caller (as the
save's own ``poll()`` would), and never one the caller already had (its handle's ``wait()`` raised it): before,
it raised it again, so that no save to that tag went through until a ``poll()``/``wait()`` of the Checkpointer
dropped the handle. Driven by a stub Saver stopped right after the wait (its ``poll``)."""
from __future__ import annotations

import pytest

from snapckpt import StorageType
from snapckpt.engine import saver as S


class _Reached(Exception):
    """The save got past the wait (to its poll())."""


class _FailedHandle:
    """An earlier save of ``best`` that failed (ENOSPC); ``reported``: the caller had the failure already."""

    def __init__(self, reported: bool) -> None:
        self.dirname, self.step, self.reported, self.waits = "best", 1, reported, 0

    def wait(self, timeout=None):
        self.waits += 1
        self.reported = True
        raise OSError(28, "No space left on device")


def _saver(handle):
    sv = S.Saver.__new__(S.Saver)  # only what save_files uses up to its poll()
    sv._handles, sv._claimed, sv._other_world, sv._local = [handle], True, {}, False
    sv._checkpoint_dir = "/nonexistent/ckpt"

    def stop():
        raise _Reached()

    sv.fence, sv.poll = (lambda: None), stop
    return sv


def test_a_failure_the_caller_already_had_does_not_fail_the_next_save_of_the_tag():
    h = _FailedHandle(reported=True)
    with pytest.raises(_Reached):
        _saver(h).save_files({"a.pt": b""}, 2, StorageType.DISK, dirname="best", tracker_name=None)
    assert h.waits == 1  # it was waited for (over already)


def test_a_failure_not_yet_raised_is_raised_by_the_next_save_of_the_tag_once():
    h = _FailedHandle(reported=False)
    sv = _saver(h)
    with pytest.raises(OSError, match="No space left"):
        sv.save_files({"a.pt": b""}, 2, StorageType.DISK, dirname="best", tracker_name=None)
    with pytest.raises(_Reached):  # the next save goes on: it was raised once
        sv.save_files({"a.pt": b""}, 3, StorageType.DISK, dirname="best", tracker_name=None)
