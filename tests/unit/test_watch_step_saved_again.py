"""A watcher node's watch of a step saved again in the same run (helper enginewait7's finding).

The step directory still holds the manifest of the step's first save, of the same run and step. The
watcher of the second save took that manifest for its own commit at once: its ranks heard "committed"
before the committer had committed anything, and kept it when the committer's commit then failed (ranks
of one save decided differently). A watcher now takes only a manifest that lists its own parts of this
save (``CommitRequest.own_parts``: their files' sizes and checksums)."""
from __future__ import annotations

import json
import os
import threading

from _harness import wait_until
from snapckpt.ondisk.manifest import CHECKSUM, MANIFEST, build_manifest
from snapckpt.persister.commit import CommitRequest, watch_commit
from snapckpt.persister.scheduler import Result, Scheduler
from snapckpt.persister.slots import SlotTable
from snapckpt.storage.posix import PosixStorage

RUN = "a" * 16 + "0123456789ab"
STEP, DIRNAME = 7, "step_00000007"


def _commit_manifest(ckpt: str, digests: dict) -> None:
    """The committer's commit of step 7: its manifest in the step directory (``digests``: rank -> checksum of
    its one 100-byte file)."""
    parts = {r: {f"rank{r}.bin": {"nbytes": 100, CHECKSUM: d, "kind": "bytes"}} for r, d in digests.items()}
    m = build_manifest(step=STEP, dirname=DIRNAME, world_size=len(digests), run_id=RUN, parts=parts)
    path = os.path.join(ckpt, DIRNAME, MANIFEST)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(m, f)
    os.replace(path + ".tmp", path)


def test_a_watcher_does_not_take_the_first_saves_manifest_for_the_commit_of_the_step_saved_again(tmp_path):
    ckpt = str(tmp_path)
    _commit_manifest(ckpt, {0: "0" * 16, 1: "1" * 16})  # the first save of step 7, committed
    mine = {1: {"rank1.bin": (100, "b" * 16)}}  # this node's part of the second save (other bytes)
    done = threading.Event()
    req = CommitRequest(checkpoint_dir=ckpt, dirname=DIRNAME, step=STEP, run_id=RUN, world_size=2,
                        timeout_secs=60, keep_last=None, tracker_name="", tracker_content="",
                        own_parts=lambda: mine if done.is_set() else None)
    got = {}
    th = threading.Thread(target=lambda: got.update(m=watch_commit(PosixStorage(fsync=False), req)), daemon=True)
    th.start()
    assert wait_until(lambda: req.stats["listings"] >= 2, timeout=30)
    done.set()  # this node's part ended; the committer has not committed yet
    req.wake.set()
    assert wait_until(lambda: req.stats["listings"] >= 4, timeout=30)
    assert th.is_alive() and "m" not in got, got  # the first save's manifest is not this commit
    _commit_manifest(ckpt, {0: "a" * 16, 1: "b" * 16})  # the committer commits the second save
    req.wake.set()
    th.join(30)
    assert not th.is_alive() and got["m"]["files"]["rank1.bin"][CHECKSUM] == "b" * 16, got


def test_own_parts_is_none_until_every_local_part_of_the_save_ended():
    lock = threading.RLock()
    sched = Scheduler(SlotTable(None, lock), lock)
    res = Result(rank_seq={2: 5, 3: 5})
    own = sched._own_parts(res)
    assert own() is None
    res.part_files[2] = {"rank2.bin": (100, "c" * 16)}
    assert own() is None  # rank 3's part has not ended
    res.part_errors[3] = {"type": "OSError", "message": "disk full"}
    assert own() == {2: {"rank2.bin": (100, "c" * 16)}}
