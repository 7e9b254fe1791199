"""Part markers name their save's generation, and a commit counts no marker of an earlier save of its step that
failed (contract 4).

A node's part may be written after the committer aborted its save and deleted the partial directory (its writer
started before the abort notice came): the part re-creates the directory, and a save of the same step again in
the run (a retry, a fixed tag) found that stale marker and counted it for its own commit. Each marker now carries
``gen`` (``Result.gen``: which save of ``(run, step, dirname)`` it is, counted alike on every node, pruned records
included: ``Scheduler.pruned_gens``) and ``flush`` for a crash flush's part; ``collect_parts`` skips a marker of a
generation known failed here. The scheduler tests use the rig of tests/unit/_sched_rig.py.
"""
from __future__ import annotations

import json
import os

import pytest
from _harness import wait_until
from _sched_rig import NBYTES, node, stub_slot_reads, write_part

from snapckpt.errors import SaveSkippedError
from snapckpt.ondisk.manifest import CHECKSUM, MANIFEST, SIDECAR, partial_dirname
from snapckpt.persister import protocol as P
from snapckpt.persister import scheduler as sched_mod
from snapckpt.persister.arena import SlotState
from snapckpt.persister.commit import CommitRequest, collect_parts
from snapckpt.persister.scheduler import KEEP_ENDED, Result
from snapckpt.persister.slots import RankEntry, Slot
from snapckpt.persister.writer import finish_parts, write_failure_marker, write_part_data
from snapckpt.storage.posix import PosixStorage

RUN = "e" * 16 + "0123456789ab"
TAG, STEP = "best", 7
KEY = (RUN, STEP, TAG)
SKIP = P.error_record(SaveSkippedError("rank 1 had no free arena slot for step 7 (on_slot_busy='skip')"))


def test_the_committer_does_not_count_a_stale_part_of_its_aborted_save(tmp_path, monkeypatch):
    """The committer's node (ranks 0 and 1 of 4): ranks 1 and 0 skipped the first save of step 7 under ``best``, which
    ended at once, and its partial directory was deleted; node 1's writers of ranks 2 and 3, started before the
    abort notice came, wrote their parts of that save afterwards (markers of save 1). The step is saved again.
    Right: the commit of save 2 waits for ranks 2 and 3's parts of save 2 and commits those. Before: it counted
    the stale parts at once and committed them beside ranks 0 and 1's new ones."""
    stub_slot_reads(monkeypatch)
    ckpt = str(tmp_path)
    sched, run = node(RUN, ckpt, world_size=4)
    run.connected = {0, 1}
    for r in (0, 1):
        sched.slots.ranks[r] = RankEntry(rank=r, slots=[], run_id=RUN)
    with sched.lock:
        sched.fail_part(1, run, STEP, TAG, SKIP)
        sched.fail_part(0, run, STEP, TAG, SKIP)  # (rank 0 too: its next save is of save 2, not late for save 1)
    first = sched.results[KEY]
    assert wait_until(lambda: first.state == "failed" and not sched.discarding, timeout=30), first
    for r in (2, 3):  # node 1's late parts of save 1, after the deletion
        write_part(ckpt, TAG, RUN, r, STEP, fill=100 + r, gen=1)
    for r in (0, 1):  # both ranks save step 7 again
        s = Slot(index=r, path=os.path.join(ckpt, f"rank{r}"), nbytes=NBYTES, state=SlotState.READY, step=STEP,
                 run_id=RUN, dirname=TAG, seq=10 + r)
        with sched.lock:
            sched.slots.ranks[r].slots.append(s)
            sched.persist(sched.slots.ranks[r], STEP, run, slot=s)
    second = sched.results[KEY]
    assert second.gen == 2
    assert wait_until(lambda: second.parts_done == {0, 1}, timeout=30), second
    # (the commit lists the markers at once on its parts' wakes: a stale part counted ends it within this wait)
    assert not wait_until(lambda: second.state != "pending", timeout=1.5), second.error
    fresh = {r: write_part(ckpt, TAG, RUN, r, STEP, fill=r, gen=2) for r in (2, 3)}  # node 1's parts of save 2
    second.part_ended.set()  # (node 1's part_done notice)
    assert wait_until(lambda: second.state != "pending", timeout=30)
    assert second.state == "committed", second.error
    with open(os.path.join(ckpt, TAG, MANIFEST)) as f:
        files = json.load(f)["files"]
    assert {r: files[f"rank{r}.bin"][CHECKSUM] for r in (2, 3)} == fresh
    sched.pool.shutdown(wait=True)
    sched.syncer.shutdown()


def _req(ckpt: str, gen: int, failed) -> CommitRequest:
    return CommitRequest(checkpoint_dir=ckpt, dirname=TAG, step=STEP, run_id=RUN, world_size=5, timeout_secs=5.0,
                         keep_last=None, tracker_name="", tracker_content="", gen=gen, failed_gens=lambda: set(failed))


def test_collect_parts_skips_the_markers_of_a_failed_generation_only(tmp_path):
    """Save 2's commit, save 1 failed here: a marker of save 2, a crash flush's marker of save 1 (the node's own
    count of a flush: it counts for any save of the step), and a marker without ``gen`` count; a part marker and
    a failure marker of save 1 do not (the failure marker would fail save 2 at once). Save 3 (save 2 not failed):
    save 2's markers count."""
    ckpt = str(tmp_path)
    write_part(ckpt, TAG, RUN, 0, STEP, fill=0, gen=2)
    write_part(ckpt, TAG, RUN, 1, STEP, fill=1, gen=1)
    write_part(ckpt, TAG, RUN, 2, STEP, fill=2, gen=1, flush=True)
    write_part(ckpt, TAG, RUN, 3, STEP, fill=3)
    partial = os.path.join(ckpt, partial_dirname(TAG, RUN))
    write_failure_marker(PosixStorage(fsync=False), partial, rank=4, run_id=RUN, step=STEP,
                         exc=OSError(5, "old failure"), gen=1)
    skipped = {}
    assert sorted(collect_parts(PosixStorage(), _req(ckpt, 2, {1}), skipped)) == [0, 2, 3]
    assert len(skipped) == 2 and all("save 1 of step 7, which failed" in why for why in skipped.values()), skipped
    with pytest.raises(Exception, match="old failure"):  # save 1's own commit: its failure marker counts
        collect_parts(PosixStorage(), _req(ckpt, 1, set()))


def test_the_writer_marks_its_parts_and_failures_with_the_generation(tmp_path):
    """A part marker and a failure marker carry ``gen``; a crash flush's part marker says ``flush``."""
    partial = str(tmp_path / "p")
    index = {"step": STEP, "files": [{"path": "r0.bin", "kind": "bytes", "chunks": [[0, NBYTES]]}]}
    parts = [write_part_data(PosixStorage(fsync=False), bytearray(NBYTES), index, partial, rank=r, run_id=RUN,
                             step=STEP, gen=3, flush=r == 1) for r in (0,)]
    index["files"][0]["path"] = "r1.bin"
    parts.append(write_part_data(PosixStorage(fsync=False), bytearray(NBYTES), index, partial, rank=1, run_id=RUN,
                                 step=STEP, gen=4, flush=True))
    assert finish_parts(parts) == [None, None]
    write_failure_marker(PosixStorage(fsync=False), partial, rank=2, run_id=RUN, step=STEP, exc=OSError(5, "x"),
                         gen=5)
    got = {}
    for name in sorted(os.listdir(os.path.join(partial, SIDECAR))):
        with open(os.path.join(partial, SIDECAR, name)) as f:
            rec = json.load(f)
        got[name] = (rec.get("gen"), rec.get("flush"))
    assert got == {"part_00000.json": (3, None), "part_00001.json": (4, True), "fail_00002.json": (5, None)}


def test_a_save_of_a_pruned_step_again_is_the_next_generation(tmp_path):
    """Node records pruned (``Scheduler._prune``): a save of a pruned step again is the generation after the pruned
    one, as on a node that still holds the record (one of its ranks was not told yet). Before: generation 1, so
    that the nodes' notices and part markers named that save differently."""
    sched, run = node(RUN, str(tmp_path))
    with sched.lock:
        sched.results[KEY] = Result(gen=3, state="committed")
        for step in range(100, 100 + 2 * KEEP_ENDED):
            sched.results[(RUN, step, TAG)] = Result(state="committed")
        sched._prune(run)
        assert KEY not in sched.results
        assert sched._record(KEY).gen == 4
        assert sched._record((RUN, 100, TAG)).gen == 2  # (pruned with generation 1)


def test_a_crash_flush_of_a_step_this_node_never_saved_marks_its_parts_as_a_flush(tmp_path, monkeypatch):
    """A crash flush of a step without a record here: its record says ``flush`` (its parts' markers too), so that no
    commit takes them for a failed save's whatever its generation on the other nodes."""
    sched, run = node(RUN, str(tmp_path))
    with sched.lock:
        sched.forget(KEY)
    assert sched.results[KEY].flush and sched.results[KEY].gen == 1
    assert sched_mod.PRUNED_GENS_KEPT > 2 * KEEP_ENDED


def test_another_node_removes_its_parts_written_after_the_committer_deleted_the_directory(tmp_path):
    """Node 1 (ranks 2 and 3 of 4): its writer of rank 2's part of save 1 started before the committer's abort came
    and wrote the part after the committer had deleted the partial directory; rank 3's failure marker came late
    too. Node 0's part of save 2 is already there. Once node 1 hears that the committer's deletion ended, it
    deletes its own parts of save 1 (files and markers) and nothing else. Before: they stayed until the next start
    of the job."""
    ckpt = str(tmp_path)
    sched, run = node(RUN, ckpt, committer=False, world_size=4, local_ranks=(2, 3))
    partial = os.path.join(ckpt, partial_dirname(TAG, RUN))
    write_part(ckpt, TAG, RUN, 2, STEP, fill=2, gen=1)
    write_failure_marker(PosixStorage(fsync=False), partial, rank=3, run_id=RUN, step=STEP, exc=OSError(5, "x"),
                         gen=1)
    write_part(ckpt, TAG, RUN, 0, STEP, fill=0, gen=2)
    with sched.lock:
        res = sched.results[KEY] = Result(state="failed", parts_done={2}, part_errors={3: {"type": "OSError",
                                                                                          "message": "x"}})
        sched.commits_started.add(KEY)
        sched._remove_failed_partial(run, res, KEY)
    sched.on_notice(*KEY, 1, aborted=True, removed=True)
    assert wait_until(lambda: not sched.discarding and not res.awaiting_removal, timeout=30)
    left = sorted(os.path.relpath(os.path.join(d, f), partial) for d, _, fs in os.walk(partial) for f in fs)
    assert left == [".snapckpt/part_00000.json", "rank0.bin"], left


def test_a_replica_stand_in_does_not_take_a_stale_marker_for_its_ranks_own_part(tmp_path):
    """A node's crash flush stands in for rank 2 of a lost node from its replica unless rank 2's own node wrote its
    part (``replica_flush._part_there``). A stale marker of the failed save 1 is not that part (the flush's commit
    skips it: the stand-in must write); a flush's marker, or one without ``gen``, is."""
    from snapckpt.persister.replica_flush import _part_there

    ckpt = str(tmp_path)
    sched, _ = node(RUN, ckpt, world_size=4)
    with sched.lock:
        sched.results[KEY] = Result(gen=1, state="failed")
        sched.forget(KEY)  # the flush: save 2
    marker = os.path.join(ckpt, partial_dirname(TAG, RUN), SIDECAR, "part_00002.json")
    assert not _part_there(marker, sched, KEY)
    write_part(ckpt, TAG, RUN, 2, STEP, fill=2, gen=1)
    assert not _part_there(marker, sched, KEY)
    write_part(ckpt, TAG, RUN, 2, STEP, fill=2, gen=1, flush=True)
    assert _part_there(marker, sched, KEY)
    write_part(ckpt, TAG, RUN, 2, STEP, fill=2)
    assert _part_there(marker, sched, KEY)
