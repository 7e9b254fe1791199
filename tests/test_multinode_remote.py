"""Multi-node jobs with the remote tier (``$SNAPCKPT_REMOTE_DIR``, an S3 URL on the test server of
tests/s3server.py) on the rig of tests/multinode.py: only the committer node's persister (rank 0's node)
uploads. Failure orders: the committer node lost during its upload; every node and the shared checkpoint
directory lost (only the remote tier survives); the committer moved to another node on a restart while the
previous committer's persister still uploads; the store failing while the job commits."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from _harness import REPO, WORKERS, result_lines, wait_until
from multinode import loss_lines

# one worker runs the multi-node tests (scripts/test.sh's --dist loadgroup), as tests/test_multinode.py's
pytestmark = pytest.mark.xdist_group("test_multinode")

WORKER = os.path.join(WORKERS, "mn_worker.py")
# memory every 3 steps, disk every 6: the pause at step 9 holds step 9 in memory and step 6 on disk
STEPS, MEM, DISK, PAUSE = 12, 3, 6, 9


def _args(ckpt_dir, log, *extra):
    return [ckpt_dir, "--steps", str(STEPS), "--memory-interval", str(MEM), "--disk-interval", str(DISK),
            "--loss-log", log, *extra]


def _start(rig, args, env, node_ranks=None, node_env=None):
    """One torchrun agent per node (1 rank each) on a fresh port; node ``i`` is node rank ``node_ranks[i]``
    and gets ``env`` plus ``node_env[i]``."""
    return rig.torchrun_all(WORKER, args, 1, env=env, node_ranks=node_ranks, node_env=node_env)


def _paused(runs):
    return sum(r.output().count(f"PAUSED {PAUSE}") for r in runs) >= len(runs)


def _latest(bucket):
    """The remote tracker object's content, None when there is none."""
    return bucket.get("run/latest").decode() if "run/latest" in bucket.keys("run/") else None


def _verify(where):
    """``snapckpt verify`` of a local directory or a URL: (exit status, output)."""
    cp = subprocess.run([sys.executable, "-m", "snapckpt", "verify", where], capture_output=True, text=True,
                        cwd=REPO)
    return cp.returncode, cp.stdout + cp.stderr


def _resumed(runs):
    """Sorted ``(rank, step, tier)`` of every rank's ``RESUMED`` line."""
    return sorted((r["rank"], r["step"], r["tier"]) for run in runs
                  for r in map(json.loads, result_lines(run.output(), "RESUMED")))


def _paused_with_upload_held(rig, s3_bucket, release):
    """Start 2 nodes with the bucket's ``run/`` as remote_dir, paused at step PAUSE, with node 0's upload of step
    6 held before its manifest until file ``release`` exists; return ``(url, loss log, env, runs)``."""
    rig.start(2)
    url, log = s3_bucket.url("run"), os.path.join(rig.tmp, "losses.log")
    env = {"SNAPCKPT_REMOTE_DIR": url}
    runs = _start(rig, _args(rig.ckpt_dir, log, "--pause-at", str(PAUSE)), env, node_env={0: {
        "SNAPCKPT_FAULT_POINT": f"remote.before_manifest:step=6:action=wait:path={release}"}})
    assert wait_until(lambda: _paused(runs), 120, 0.2), "\n".join(r.output() for r in runs)
    assert wait_until(lambda: "hit remote.before_manifest" in rig.nodes[0].persister_log(), 60, 0.2)
    return url, log, env, runs


def test_committer_node_lost_during_its_upload_the_fresh_node_catches_up(rig, s3_bucket):
    """Node 0 (the committer) commits step 6 locally and is lost whole during its upload (held before the
    manifest object); node 1's trainers die; a fresh node 0 joins. The restart resumes from memory (rank 0
    from node 1's replica), the fresh node 0's persister removes the interrupted upload and uploads step 6
    (committed locally, never uploaded), then step 12: the remote tier ends complete, ``latest`` at step 12."""
    rig.leftover_ok = True  # node 1's persister keeps the crashed run's memory for its idle timeout
    never = os.path.join(rig.tmp, "never")
    url, log, env, runs = _paused_with_upload_held(rig, s3_bucket, never)
    assert _latest(s3_bucket) is None
    rig.lose_node(0)
    rig.kill_trainers(1)
    rig.replace_node(0)
    runs = _start(rig, _args(rig.ckpt_dir, log), env)
    assert rig.wait_all(runs, 180) == [0, 0]
    assert _resumed(runs) == [(0, PAUSE, "memory"), (1, PAUSE, "memory")]
    assert wait_until(lambda: not rig.nodes[0].persisters(), 60), rig.nodes[0].persister_log()[-3000:]
    node0 = rig.nodes[0].persister_log()
    assert "step 6 (step_00000006) was committed locally but never uploaded" in node0, node0[-3000:]
    assert _latest(s3_bucket) == "step_00000012"
    rc, out = _verify(url)
    assert rc == 0 and "step 6 " in out and "step 12 " in out, out


def test_every_node_and_the_shared_directory_lost_resumes_from_the_remote_tier(rig, s3_bucket):
    """Both nodes lost whole after step 6 reached the remote tier, and the shared checkpoint directory deleted:
    fresh nodes resume from the remote tier (rank 0 downloads step 6), and the steps both runs trained (7-9)
    have bitwise-equal losses."""
    rig.start(2)
    rig.leftover_ok = True
    url, log = s3_bucket.url("run"), os.path.join(rig.tmp, "losses.log")
    env = {"SNAPCKPT_REMOTE_DIR": url}
    runs = _start(rig, _args(rig.ckpt_dir, log, "--pause-at", str(PAUSE)), env)
    assert wait_until(lambda: _paused(runs), 120, 0.2), "\n".join(r.output() for r in runs)
    assert wait_until(lambda: _latest(s3_bucket) == "step_00000006", 60, 0.2)
    with open(log) as f:
        first = loss_lines(f.read())
    rig.lose_node(0)
    rig.lose_node(1)
    shutil.rmtree(rig.ckpt_dir)
    rig.replace_node(0)
    rig.replace_node(1)
    os.remove(log)
    runs = _start(rig, _args(rig.ckpt_dir, log), env)
    assert rig.wait_all(runs, 180) == [0, 0]
    assert _resumed(runs) == [(0, DISK, "disk"), (1, DISK, "disk")]
    with open(log) as f:
        second = loss_lines(f.read())
    assert sorted(second) == list(range(DISK + 1, STEPS + 1))
    assert {s: second[s] for s in range(DISK + 1, PAUSE + 1)} == {s: first[s] for s in range(DISK + 1, PAUSE + 1)}
    assert wait_until(lambda: _latest(s3_bucket) == "step_00000012", 60, 0.5)


def test_committer_moves_to_another_node_while_the_previous_committer_still_uploads(rig, s3_bucket):
    """Node 1 lost while node 0's persister uploads step 6 (held before its manifest object); node 0's
    trainers die; a fresh node 1 joins and the restart swaps the node ranks: rank 0 on node 1, whose new
    persister is the committer and uploads (cleaning up what it takes for an interrupted upload, catching
    up, then step 12) while node 0's persister still uploads the previous run's queue. Once node 0's upload
    goes on, the remote tier must stay complete (no manifest over objects the other persister removed) and
    ``latest`` at step 12 (on main it moved back to the older step that node 0 uploaded last)."""
    rig.leftover_ok = True
    release = os.path.join(rig.tmp, "release")
    url, log, env, runs = _paused_with_upload_held(rig, s3_bucket, release)
    rig.lose_node(1)
    rig.kill_trainers(0)
    rig.replace_node(1)
    runs = _start(rig, _args(rig.ckpt_dir, log), env, node_ranks=[1, 0])
    assert rig.wait_all(runs, 180) == [0, 0]
    assert _resumed(runs) == [(0, PAUSE, "memory"), (1, PAUSE, "memory")]
    assert wait_until(lambda: _latest(s3_bucket) == "step_00000012", 60, 0.5)
    assert wait_until(lambda: not rig.nodes[1].persisters(), 60)  # the new committer's uploads are done
    open(release, "w").close()  # node 0's upload of step 6 goes on
    # its end (the tracker object is written before this line; node 0's persister may stay on: its crash flush
    # of step 9 commits once the lost node's lease aged, or is abandoned if node 1's new committer removed its
    # leftovers first: tests/test_multinode.py's G8 with the committer moved)
    assert wait_until(lambda: "uploaded step 6 " in rig.nodes[0].persister_log()
                      or "upload of step 6 " in rig.nodes[0].persister_log(), 60, 0.2), \
        rig.nodes[0].persister_log()[-3000:]
    assert _latest(s3_bucket) == "step_00000012", rig.nodes[0].persister_log()[-3000:]
    rc, out = _verify(url)
    assert rc == 0 and "step 12 " in out, out


def test_a_store_outage_during_multinode_commits_never_blocks_and_is_told(rig, s3_bucket, monkeypatch):
    """The store answers every request ``503 Slow Down`` (the fault proxy) from the job's start on, while
    2 nodes save to disk every 6 steps (keep_last=2, saves faster than the upload's retries): training never
    waits for it and ends; rank 0 hears of the outage (an ``upload_failed`` event and its WARNING: on main
    each failing upload whose checkpoint local retention retired was told as an ``upload_skipped`` "deleted
    before its upload began", and the warning never came); the local tier stays intact, and once the store
    answers again the remote tier catches up with the newest step."""
    import s3server
    proxy = s3server.FaultProxy(s3_bucket.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's attempts per request: the uploader's retries remain
    rig.start(2)
    rig.leftover_ok = True
    url, log = s3_bucket.url("run"), os.path.join(rig.tmp, "losses.log")
    try:
        runs = _start(rig, [rig.ckpt_dir, "--steps", "40", "--memory-interval", "3", "--disk-interval", "6",
                            "--loss-log", log, "--step-secs", "0.4"], {"SNAPCKPT_REMOTE_DIR": url})
        assert wait_until(lambda: sum(r.output().count("RESULT") for r in runs) >= 2, 120, 0.2)  # started
        proxy.fail("503")
        assert wait_until(lambda: '"upload_failed"' in runs[0].output() or any(r.returncode is not None
                                                                                for r in runs), 120, 0.2)
        proxy.fail("pass")
        assert rig.wait_all(runs, 180) == [0, 0]
        out0 = runs[0].output()
        assert '"upload_failed"' in out0 and "Service Unavailable" in out0, out0[-3000:]
        assert "to the remote tier failed" in out0 and "NOT reaching object storage" in out0, out0[-3000:]
        with open(log) as f:
            assert sorted(loss_lines(f.read()))[-1] == 40
        rc, out = _verify(rig.ckpt_dir)
        assert rc == 0, out
        assert wait_until(lambda: _latest(s3_bucket) == "step_00000040", 90, 0.5), \
            rig.nodes[0].persister_log()[-3000:]
    finally:
        proxy.close()
