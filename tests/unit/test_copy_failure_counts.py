"""A rank whose DISK save fails before its snapshot is handed over (its snapshot copy, no slot freed in time, the
free-space preflight...) tells the persister (``fail``, ``Saver._save_failed``): the save counts as this rank's save
of ``(step, dirname)``, so the other ranks' save of it ends at once with the cause, and the rank's next save of them
pairs with the others' next one. Before, only the slot was aborted: the persister never heard of that save from this
rank, and took the rank's next snapshot of the step for its part of the failed save (written beside the other ranks'
older snapshots while that save was in flight, or dropped as a late part of it once it was over, the others' next
save then waiting for it until the commit timeout). Driven by stub Savers and the scheduler rig
(tests/unit/_sched_rig.py).
"""
from __future__ import annotations

import concurrent.futures as cf

import pytest
from _sched_rig import node

from snapckpt import StorageType
from snapckpt.engine import saver as S
from snapckpt.errors import PersisterTimeoutError, SlotBusyError
from snapckpt.persister.scheduler import Result
from snapckpt.persister.stream import Stream

RUN = "f" * 16 + "0123456789ab"


class _Session:
    """The persister session: records each request."""

    def __init__(self) -> None:
        self.requests = []

    def request(self, op, **fields):
        self.requests.append((op, fields))
        return {}


class _Handle:
    def __init__(self) -> None:
        self.error = None

    def fail(self, e) -> None:
        self.error = e

    def mark_reported(self) -> None:
        pass


def _saver_with_failed_copy(storage_type: StorageType):
    """A Saver whose overlapped copy of step 7 under ``best`` failed on the copy thread (a device error)."""
    sv = S.Saver.__new__(S.Saver)
    sv._session, sv._rank = _Session(), 1
    future = cf.Future()
    future.set_exception(RuntimeError("CUDA error: an illegal memory access was encountered"))
    job = S._CopyJob(None, 3, None, 7, storage_type, "best", "latest", "7", 0.0, 0.0, 0.0, 0.0)
    job.future, job.handle = future, _Handle()
    sv._inflight = job
    return sv, job


def test_a_disk_saves_failed_copy_is_told_to_the_persister():
    sv, job = _saver_with_failed_copy(StorageType.DISK)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        sv.fence()
    assert sv._session.requests == [
        ("abort", {"slot": 3}),
        ("fail", {"step": 7, "dirname": "best", "type": "RuntimeError",
                  "message": "CUDA error: an illegal memory access was encountered"})]
    assert isinstance(job.handle.error, RuntimeError)


def test_a_memory_snapshots_failed_copy_tells_only_the_abort():
    """A MEMORY snapshot is this rank's alone: no ``fail``."""
    sv, _ = _saver_with_failed_copy(StorageType.MEMORY)
    with pytest.raises(RuntimeError):
        sv.fence()
    assert [op for op, _ in sv._session.requests] == ["abort"]


def _saver_failing_at_acquire(exc: BaseException):
    """A Saver whose slot request fails with ``exc`` (its preparation stubbed)."""
    sv = S.Saver.__new__(S.Saver)
    sv._session, sv._rank = _Session(), 1
    sv._handles, sv._claimed, sv._other_world, sv._local = [], True, {}, False
    sv._checkpoint_dir = "/nonexistent/ckpt"

    class _Prepared:
        total_nbytes = 64

    class _Stager:
        def prepare(self, *a, **k):
            return _Prepared()

    def acquire(*a):
        raise exc

    sv.fence, sv._stager, sv._acquire = (lambda: None), _Stager(), acquire
    return sv


@pytest.mark.parametrize("storage_type, exc, told", [
    (StorageType.DISK, SlotBusyError("rank 1: no arena slot freed within 60 s for step 7"), True),
    (StorageType.DISK, PersisterTimeoutError("the persister did not answer"), False),  # (it would not answer again)
    (StorageType.MEMORY, SlotBusyError("rank 1: no arena slot freed within 60 s for step 7"), False)],
    ids=["disk_slot_busy", "disk_persister_hung", "memory"])
def test_a_save_that_fails_before_its_copy_is_told_to_the_persister(storage_type, exc, told):
    """Rank 1 waited for a free slot in vain (``on_slot_busy="wait"``): a DISK save tells the persister, as a skip
    does; a hung persister is not asked again, and a MEMORY snapshot is the rank's alone."""
    sv = _saver_failing_at_acquire(exc)
    with pytest.raises(type(exc)):
        sv.save_files({}, 7, storage_type, dirname="best", tracker_name="latest")
    want = [("fail", {"step": 7, "dirname": "best", "type": type(exc).__name__, "message": str(exc)})] if told else []
    assert sv._session.requests == want


def test_the_fail_after_a_cancelled_streamed_part_is_that_saves_failure(tmp_path):
    """Rank 1 started streaming its part of step 7 (its writer runs), then its copy failed: the abort cancelled the
    stream and the rank sends ``fail``. Right: that ``fail`` is the streamed save's (whose writer fails the part), not
    a new save of the step. Before the rule, it started save 2 of the step, which the others' next save joined."""
    sched, run = node(RUN, str(tmp_path))
    key = (RUN, 7, "best")
    st = Stream(1, 7, 64)
    st.cancel("rank 1 gave up its snapshot copy of step 7 before it was complete")
    with sched.lock:
        res = sched.results[key] = Result(streams={1: st}, writers=1)
        sched.commits_started.add(key)
        sched.fail_part(1, run, 7, "best", {"type": "RuntimeError", "message": "CUDA error"})
        assert sched.results[key] is res and len(sched.results.records(key)) == 1
        assert 1 not in res.part_errors and not sched.over_calls  # (its writer records the part's error)
        res.writers, res.state = 0, "failed"
