"""Dead peers (snapckpt.persister.peers): the committer's and the watchers' wait ends in seconds when a
part can never come, driven here with real record files in a real checkpoint directory.

Each commit below is given a commit timeout of 600 s: ending with ``PeerLostError`` proves the detection,
not the timeout. The same logic runs in the node persister (tests/test_dead_peers.py kills real ranks).
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from snapckpt.errors import CommitTimeoutError, PeerLostError
from snapckpt.ondisk.manifest import partial_dirname
from snapckpt.persister import peers
from snapckpt.persister.commit import CommitRequest, commit, watch_commit
from snapckpt.storage.posix import PosixStorage

RUN = "a" * 16 + "0123456789ab"


def _req(ckpt: str, watch: peers.PeerWatch, step: int = 7, world: int = 4, timeout: float = 600.0) -> CommitRequest:
    return CommitRequest(checkpoint_dir=ckpt, dirname=f"step_{step:08d}", step=step, run_id=RUN, world_size=world,
                         timeout_secs=timeout, keep_last=None, tracker_name="latest", tracker_content=str(step),
                         peer_check=watch.check, peer_tick_secs=watch.tick_secs)


def _lease(ckpt: str, ranks, seq: int, create: bool = True) -> None:
    peers.write_lease(PosixStorage(fsync=False), ckpt, RUN, list(ranks), seq, create=create)


def _part(ckpt: str, req: CommitRequest, rank: int) -> None:
    """Rank ``rank``'s part of the save: one small file and its part marker, as the writer leaves them."""
    from snapckpt.ondisk.manifest import CHECKSUM, ChecksumWriter, SIDECAR

    d = os.path.join(ckpt, partial_dirname(req.dirname, RUN))
    os.makedirs(os.path.join(d, SIDECAR), exist_ok=True)
    name = f"rank{rank}.bin"
    with open(os.path.join(d, name), "wb") as f:
        cw = ChecksumWriter(f)
        cw.write(bytes([rank]) * 100)
    marker = {"rank": rank, "run_id": RUN, "step": req.step,
              "files": {name: {"nbytes": cw.nbytes, CHECKSUM: cw.hexdigest, "kind": "bytes"}}}
    with open(os.path.join(d, SIDECAR, f"part_{rank:05d}.json"), "w") as f:
        json.dump(marker, f)


def _beat(ckpt: str, ranks, stop: threading.Event) -> threading.Thread:
    """A live node persister's lease: refreshed every 0.1 s until ``stop``."""
    def run():
        seq = 0
        while not stop.wait(0.1):
            seq += 1
            _lease(ckpt, ranks, seq)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_stale_node_lease_abandons_the_commit_naming_that_nodes_ranks(tmp_path):
    ckpt = str(tmp_path)
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=0.5)
    req = _req(ckpt, watch)
    for r in (0, 1):
        _part(ckpt, req, r)
    stop = threading.Event()
    _beat(ckpt, [0, 1], stop)  # node 0 (the committer's) stays alive
    _lease(ckpt, [2, 3], seq=1)  # node 1 wrote its lease once, then was lost
    try:
        with pytest.raises(PeerLostError) as ei:
            commit(PosixStorage(fsync=False), PosixStorage(), req)
    finally:
        stop.set()
    msg = str(ei.value)
    assert "step 7" in msg and "ranks [2, 3]" in msg and f"pid {os.getpid()}" in msg and "lease" in msg, msg
    assert "peer_timeout_secs=0.5" in msg, msg
    # nothing a loader looks at: no step directory, no tracker, the partial directory removed
    assert not os.path.exists(os.path.join(ckpt, "step_00000007"))
    assert not os.path.exists(os.path.join(ckpt, "latest"))
    assert not os.path.exists(req.partial_dir)


def test_live_leases_keep_the_commit_waiting_until_the_parts_arrive(tmp_path):
    ckpt = str(tmp_path)
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=1.0)
    req = _req(ckpt, watch)
    stop = threading.Event()
    _beat(ckpt, [0, 1], stop)
    _beat(ckpt, [2, 3], stop)
    for r in (0, 1, 2):
        _part(ckpt, req, r)
    # rank 3's part comes after two peer timeouts: its node is alive (its lease moves), so it is awaited
    timer = threading.Timer(2.0, _part, (ckpt, req, 3))
    timer.start()
    try:
        manifest = commit(PosixStorage(fsync=False), PosixStorage(), req)
    finally:
        stop.set()
        timer.join()
    assert manifest["step"] == 7 and len(manifest["files"]) == 4
    assert open(os.path.join(ckpt, "latest")).read() == "7"


def test_a_gone_rank_abandons_at_once_unless_its_persister_still_writes_that_part(tmp_path):
    ckpt = str(tmp_path)
    storage = PosixStorage(fsync=False)
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=600)  # leases play no part here
    # rank 2 died after handing over its part of step 7 (the persister writes it from memory)
    peers.write_gone(storage, ckpt, peers.gone_record(rank=2, run_id=RUN, pid=4242, host="node1", since_unix=0.0,
                                                      pending=[(7, "step_00000007")], final=True))
    req = _req(ckpt, watch, step=7, timeout=1.0)
    with pytest.raises(CommitTimeoutError):  # awaited (here nobody writes it: the timeout ends it)
        commit(storage, PosixStorage(), req)
    # step 8 was never handed over by rank 2: abandoned at once, with a 600 s timeout
    req = _req(ckpt, watch, step=8)
    with pytest.raises(PeerLostError) as ei:  # (the pytest timeout, 300 s, is below the commit timeout)
        commit(storage, PosixStorage(), req)
    msg = str(ei.value)
    assert "step 8" in msg and "rank 2 (pid 4242 on host node1)" in msg and "abandoned" in msg, msg
    # the rank came back (connected again): its record is removed and step 8 is awaited again
    peers.remove_gone(ckpt, RUN, 2)
    watch2 = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=600)
    with pytest.raises(CommitTimeoutError):
        commit(storage, PosixStorage(), _req(ckpt, watch2, step=8, timeout=0.5))


def test_a_watcher_stops_waiting_when_the_committers_node_is_lost(tmp_path):
    ckpt = str(tmp_path)
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=0.5)
    req = _req(ckpt, watch)
    for r in range(4):  # every part is there: only the committer is missing
        _part(ckpt, req, r)
    stop = threading.Event()
    _beat(ckpt, [2, 3], stop)  # this watcher's own node
    _lease(ckpt, [0, 1], seq=1)  # the committer's node, lost
    try:
        with pytest.raises(PeerLostError) as ei:
            watch_commit(PosixStorage(), req)
    finally:
        stop.set()
    msg = str(ei.value)
    assert "ranks [0, 1]" in msg and "committer" in msg and "step 7" in msg, msg


def test_a_pause_of_the_waiting_persister_itself_is_not_taken_for_lost_peers(tmp_path):
    ckpt = str(tmp_path)
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=0.4)
    _lease(ckpt, [2, 3], seq=1)
    watch.check(7, "step_00000007", [2])  # first sight of the lease
    time.sleep(0.6)  # this process did not run (a stall): longer than the peer timeout
    watch.check(7, "step_00000007", [2])  # no verdict on that pause
    _lease(ckpt, [2, 3], seq=2)  # the node beats again
    time.sleep(0.3)
    watch.check(7, "step_00000007", [2])
    # and a lease that really stops is still judged afterwards
    deadline = time.monotonic() + 5
    with pytest.raises(PeerLostError, match=r"ranks \[2, 3\]"):
        while time.monotonic() < deadline:
            watch.check(7, "step_00000007", [2])
            time.sleep(0.05)


def test_a_watchers_own_lease_is_never_judged(tmp_path):
    """A persister never declares its own node lost (its lease thread may lag behind its commit thread)."""
    ckpt = str(tmp_path)
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=0.3, own_lease=peers.lease_name(0))
    _lease(ckpt, [0, 1], seq=1)  # its own, never refreshed here
    _lease(ckpt, [2, 3], seq=1)
    with pytest.raises(PeerLostError, match=r"ranks \[2, 3\]"):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            watch.check(7, "step_00000007", [1])  # only its own rank missing: no verdict
            watch.check(7, "step_00000007", [1, 2])
            time.sleep(0.05)


def test_a_lease_removed_at_a_clean_exit_is_not_a_lost_node(tmp_path):
    ckpt = str(tmp_path)
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=0.3)
    _lease(ckpt, [2, 3], seq=1)
    watch.check(7, "step_00000007", [2])
    peers.remove_lease(ckpt, RUN, [2, 3])
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # three peer timeouts: no verdict without a lease
        watch.check(7, "step_00000007", [2])
        time.sleep(0.05)


def test_peer_timeout_option_and_environment(monkeypatch):
    from snapckpt.options import CheckpointOptions

    monkeypatch.delenv("SNAPCKPT_PEER_TIMEOUT_SECS", raising=False)
    assert CheckpointOptions().resolved_peer_timeout_secs == 10.0
    monkeypatch.setenv("SNAPCKPT_PEER_TIMEOUT_SECS", "3.5")
    assert CheckpointOptions().resolved_peer_timeout_secs == 3.5
    assert CheckpointOptions(peer_timeout_secs=2).resolved_peer_timeout_secs == 2.0  # the option wins
    for bad in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv("SNAPCKPT_PEER_TIMEOUT_SECS", bad)
        with pytest.raises(ValueError, match="SNAPCKPT_PEER_TIMEOUT_SECS"):
            CheckpointOptions().resolved_peer_timeout_secs
    with pytest.raises(ValueError, match="peer_timeout_secs"):
        CheckpointOptions(peer_timeout_secs=0)


def test_a_claimed_part_is_awaited_through_its_replica_holder_not_its_lost_node(tmp_path):
    """Node 1 (ranks 2, 3) is lost, but a replica holder on node 0 claimed rank 2's and 3's parts of step 7
    (``replica_<rank>``, persister/replica_flush.py): the commit does not abandon the step; ``lost()`` tells
    the holder that node 1 will never write them, and once it wrote them the step commits. A claim of
    another step does not count, and the holder's node lost abandons the commit."""
    ckpt = str(tmp_path)
    storage = PosixStorage(fsync=False)
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=0.5)
    req = _req(ckpt, watch)
    for r in (0, 1):
        _part(ckpt, req, r)
    stop = threading.Event()
    _beat(ckpt, [0, 1], stop)  # node 0: the committer and the replica holder, alive
    _lease(ckpt, [2, 3], seq=1)  # node 1, lost
    for r in (2, 3):
        storage.write_atomic(os.path.join(peers.peers_dir(ckpt, RUN), peers.claim_name(r)), json.dumps(
            {"rank": r, "run_id": RUN, "pending": [[7, "step_00000007"]], "holder_ranks": [0, 1]}).encode())
    holder = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=0.5)
    assert holder.lost(2, 7, "step_00000007") is None  # not judged yet: first sight of the lease

    why = []

    def stand_in():
        while not why or why[-1] is None:
            why.append(holder.lost(2, 7, "step_00000007"))
            time.sleep(0.05)
        for r in (2, 3):
            _part(ckpt, req, r)
        req.wake.set()  # the holder's part_done notice (persister/commit_notices.py)

    t = threading.Thread(target=stand_in)
    t.start()
    try:
        manifest = commit(storage, PosixStorage(), req)
    finally:
        stop.set()
        t.join()
    assert manifest["step"] == 7 and len(manifest["files"]) == 4
    # the reason the holder acted on (asked again later, a pause longer than half the peer timeout under
    # load would make it decline to judge: PeerWatch._refresh)
    assert "lease of rank 2's node" in why[-1]
    # step 8 was not claimed: node 1's stale lease abandons it as before
    with pytest.raises(PeerLostError, match="ranks \\[2, 3\\]"):
        commit(storage, PosixStorage(), _req(ckpt, watch, step=8))


def test_a_watcher_ends_on_the_committers_abort_notice_though_a_late_part_recreated_the_directory(tmp_path):
    """The committer failed the commit and removed the partial directory, then a late part of this node
    re-created it: the directory alone would keep the watcher waiting until the commit timeout. The
    committer's ``commit_ended`` "failed" notice (:meth:`Scheduler.on_notice` with ``aborted``) ends the
    watch at once; the abort notice of an earlier save of the step (generation 1; this save is its generation
    2) does not count. Found by breaking the multi-node commit path (a stopped peer persister)."""
    from snapckpt.errors import CommitError
    from snapckpt.persister.scheduler import Result, Scheduler
    from snapckpt.persister.slots import SlotTable

    ckpt = str(tmp_path)
    lock = threading.RLock()
    sched = Scheduler(SlotTable(None, lock), lock)
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=30)
    key = (RUN, 7, "step_00000007")
    sched.results[key] = Result()
    sched.on_notice(*key, 1, aborted=True)  # the earlier save's abort
    res = Result(gen=2)
    sched.results.push(key, res)  # the step saved again
    req = _req(ckpt, watch)
    req.wake, req.local_failure = res.part_ended, sched._local_failure(key)
    _part(ckpt, req, 2)  # the late part: the partial directory is back
    stop = threading.Event()
    _beat(ckpt, [0, 1], stop)
    _beat(ckpt, [2, 3], stop)
    out: list = []

    def run() -> None:
        try:
            watch_commit(PosixStorage(), req)
        except BaseException as e:  # noqa: BLE001 (handed to the test thread)
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        t.join(1.5)
        assert t.is_alive() and not out  # the earlier abort does not end this watch
        sched.on_notice(*key, 2, aborted=True)
        t.join(20)
        assert not t.is_alive() and out and isinstance(out[0], CommitError), out
        assert "reports that the commit of step_00000007 failed" in str(out[0])
    finally:
        stop.set()


def test_a_watcher_waits_past_the_commit_timeout_for_a_committer_that_commits_late(tmp_path, monkeypatch):
    """The committer's deadline bounds its wait for the parts and starts at its own rank's request; its tail
    (manifest, fsyncs, rename, tracker) comes after. A watcher that gave up at the same deadline failed its
    ranks while the committer committed (issue 15: node 1 raised CommitTimeoutError, node 0 committed, and
    node 0's torchrun agent waited 300 s in its exit barrier). Here every part is there, both nodes live,
    and the committer commits 1.5 s past the watcher's 1 s timeout: the watcher returns the manifest. A
    committer that neither commits nor aborts still ends the watch, at the timeout plus the grace."""
    from snapckpt.persister import commit as commit_mod

    ckpt = str(tmp_path)
    watch = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=30)
    req = _req(ckpt, watch, world=2, timeout=1.0)
    for r in range(2):
        _part(ckpt, req, r)
    stop = threading.Event()
    _beat(ckpt, [0], stop)
    _beat(ckpt, [1], stop)
    late = threading.Timer(2.5, lambda: commit(PosixStorage(), PosixStorage(), _req(ckpt, watch, world=2)))
    late.start()
    try:
        t0 = time.monotonic()
        m = watch_commit(PosixStorage(), req)
        assert m["step"] == 7 and m["run_id"] == RUN and time.monotonic() - t0 >= 2.0
        monkeypatch.setattr(commit_mod, "WATCH_GRACE_SECS", 0.5)
        never = _req(ckpt, watch, step=8, world=2, timeout=0.5)
        _part(ckpt, never, 0)
        t0 = time.monotonic()
        with pytest.raises(CommitTimeoutError, match=r"step 8: no commit record from the committer .* within 1 s"):
            watch_commit(PosixStorage(), never)
        assert 0.9 <= time.monotonic() - t0 < 10
    finally:
        late.cancel()
        stop.set()


def test_a_watcher_takes_the_committed_notice_when_retention_retired_the_step_before_it_read_it(tmp_path):
    """Commits end out of order: the committer renamed step 7 into place and a later save's retention
    (``keep_last=1``) retired it before this watcher read its manifest. The partial directory and the manifest
    are both gone: with the committer's ``committed`` notice the watch ends committed (returns ``None``),
    not "the committer aborted" (what a watcher without the notice concluded: its node's ranks raised
    while rank 0's commit had succeeded). Without a notice, a vanished partial directory is still an abort,
    after ``NOTICE_GRACE_SECS``."""
    from snapckpt.errors import CommitError
    from snapckpt.ondisk.manifest import MANIFEST

    def watch(req, out):
        try:
            out["m"] = watch_commit(PosixStorage(), req)
        except Exception as e:
            out["e"] = e

    for notice in (True, False):
        ckpt = str(tmp_path / str(notice))
        said = threading.Event()
        req = CommitRequest(checkpoint_dir=ckpt, dirname="step_00000007", step=7, run_id=RUN, world_size=2,
                            timeout_secs=30, keep_last=1, tracker_name="", tracker_content="",
                            committed_notice=said.is_set)
        os.makedirs(os.path.join(req.partial_dir, ".snapckpt"))
        out = {}
        th = threading.Thread(target=watch, args=(req, out))
        th.start()
        assert wait_until_seen(req)  # the watch saw the partial directory
        with open(os.path.join(req.partial_dir, MANIFEST), "w") as f:
            json.dump({"step": 7, "run_id": RUN}, f)
        os.rename(req.partial_dir, req.final_dir)
        os.rename(req.final_dir, os.path.join(ckpt, f".step_00000007.deleted-{RUN}"))  # the later save's retention
        req.wake.set()  # a backstop read, before the notice came
        time.sleep(0.3)
        assert th.is_alive()  # it waits for the notice
        if notice:
            said.set()
            req.wake.set()
        t0 = time.monotonic()
        th.join(15)
        if notice:
            assert out == {"m": None}
        else:
            assert isinstance(out.get("e"), CommitError) and "aborted" in str(out["e"])
            assert time.monotonic() - t0 < 5


def wait_until_seen(req, timeout=10.0):
    """Until the watch of ``req`` listed the partial directory (one read of it counts)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if req.stats["listings"] >= 1:
            time.sleep(0.1)
            return True
        time.sleep(0.01)
    return False


def test_a_commit_whose_run_records_a_later_run_removed_is_abandoned_and_the_holder_writes_nothing(tmp_path):
    """Node 1 (rank 1) is lost; node 0's crash flush of step 9 wrote rank 0's part and claimed rank 1's (its
    replica), awaiting node 1's lease to age. The job restarts with rank 0 on a fresh node whose persister, the
    new committer, does not serve this run: it removes this run's leftovers, the peer records and the partial
    directory included. Nothing the commit awaits can come any more: it is abandoned at its next check (it
    waited ``commit_timeout_secs`` before: found by the multi-node remote test with node ranks swapped on
    restart), and the holder never writes rank 1's part into a re-created partial directory."""
    from snapckpt.persister.commit import recover_interrupted_commits

    ckpt = str(tmp_path)
    storage = PosixStorage(fsync=False)
    req = _req(ckpt, peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=30,
                                     own_lease=peers.lease_name(0)), step=9, world=2)
    _lease(ckpt, [0], seq=1)  # node 0: the committer and the replica holder (its own lease is never judged)
    _lease(ckpt, [1], seq=1)  # node 1: lost, its lease not yet stale
    storage.write_atomic(os.path.join(peers.peers_dir(ckpt, RUN), peers.claim_name(1)), json.dumps(
        {"rank": 1, "run_id": RUN, "pending": [[9, "step_00000009"]], "holder_ranks": [0]}).encode())
    _part(ckpt, req, 0)
    holder = peers.PeerWatch(PosixStorage(), ckpt, RUN, peer_timeout_secs=30, own_lease=peers.lease_name(0))
    assert holder.lost(1, 9, "step_00000009") is None
    out: list = []

    def run() -> None:
        try:
            out.append(commit(storage, PosixStorage(), req))
        except BaseException as e:  # noqa: BLE001 (handed to the test thread)
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(1.0)
    assert t.is_alive() and not out  # awaiting rank 1's claimed part
    recover_interrupted_commits(storage, ckpt, job=RUN[:16], known_runs={RUN[:16] + "fedcba987654"})
    assert not os.path.exists(req.partial_dir) and not os.path.exists(peers.peers_dir(ckpt, RUN))
    t.join(20)
    assert not t.is_alive() and out and isinstance(out[0], PeerLostError), out
    assert "a later run of this job has started" in str(out[0]) and "step 9" in str(out[0]), out[0]
    assert holder.lost(1, 9, "step_00000009") is None and holder.removed
    assert not os.path.exists(req.partial_dir)
