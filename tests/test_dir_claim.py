"""One writer job per checkpoint directory (case P2 of a new-user trial; ``snapckpt.ondisk.dirclaim``).

Two jobs (different ``job_id``, or two hosts on a shared filesystem) saving into one directory would rotate
each other's checkpoints and could load each other's state: the second one's ``save`` is refused with
``CheckpointDirInUseError`` naming the first; loading from the directory stays allowed; a restart after
``kill -9`` of the first just works; a filesystem without ``flock`` saves without a claim, with a warning. The claim is an ``flock`` on the
directory itself (no entry added), with a lock file only where a directory cannot be locked (NFS).
"""
import errno
import json
import logging
import os
import signal
import subprocess
import sys

import pytest
import torch

from _harness import WORKERS, result_lines, run_ranks, wait_until
from snapckpt import Checkpointer, StorageType
from snapckpt.ondisk import dirclaim
from snapckpt.cli import main as cli_main
from snapckpt.errors import CheckpointDirInUseError


def _steps(d: str) -> list:
    return sorted(n for n in os.listdir(d) if n.startswith("step_"))


def test_P2_second_job_refused_first_keeps_saving_restart_after_kill9(snap_env, tmp_path):
    """Job "first" (another process) holds the directory: job "second" may load from it, but its save is
    refused naming the first's pid and job id, and nothing changes on disk; the first keeps saving and every
    checkpoint verifies; after kill -9 of the first, the second saves into the directory."""
    snap_env.leftover_ok = True  # the killed job's persister stays until teardown
    d, status = snap_env.ckpt_dir, str(tmp_path / "status")
    os.makedirs(status)
    env = {**os.environ, **snap_env.env, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "first.log", "w") as logf:
        first = subprocess.Popen([sys.executable, os.path.join(WORKERS, "dirclaim_worker.py"), d, status],
                                 env=env, stdout=logf, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: os.path.exists(os.path.join(status, "saved-2")), 120), \
            (tmp_path / "first.log").read_text()
        with Checkpointer(d, job_id="second", persister_idle_timeout_secs=30) as second:
            assert second.latest_step() == 2  # an eval job may read while training writes
            assert torch.equal(second.load()["w"], torch.full((256,), 2.0))
            before = (_steps(d), open(os.path.join(d, "latest")).read())
            for _ in range(2):  # refused again on a retry, the same way
                with pytest.raises(CheckpointDirInUseError) as ei:
                    second.save({"w": torch.zeros(4)}, 9, StorageType.DISK)
                msg = str(ei.value)
                assert f"pid {first.pid} on host" in msg and "job_id 'first'" in msg and "saving since" in msg, msg
                assert "its own checkpoint directory" in msg and "stop the other job" in msg, msg
            with pytest.raises(CheckpointDirInUseError):  # the memory tier is refused too
                second.save({"w": torch.zeros(4)}, 9, StorageType.MEMORY)
            assert (_steps(d), open(os.path.join(d, "latest")).read()) == before
            open(os.path.join(status, "go"), "w").close()
            assert wait_until(lambda: os.path.exists(os.path.join(status, "saved-4")), 120), \
                (tmp_path / "first.log").read_text()
            assert _steps(d) == [f"step_{s:08d}" for s in (1, 2, 3, 4)]
            assert cli_main(["verify", d]) == 0  # every checkpoint of the first job verifies
            first.send_signal(signal.SIGKILL)
            first.wait(30)
            second.save({"w": torch.full((4,), 9.0)}, 9, StorageType.DISK).wait()
            assert torch.equal(second.load(step=9)["w"], torch.full((4,), 9.0))
            holder = dirclaim.read_holder(d)
            assert holder["pid"] == os.getpid() and holder["job_id"] == "second", holder
        assert not os.path.exists(os.path.join(d, dirclaim.LOCK_NAME))  # the claim added no entry to d
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_P2_one_process_shares_its_claim_two_ranks_refused_and_no_flock_saves_without_one(
        snap_env, monkeypatch, caplog):
    """Two Checkpointers of one process on one directory share the claim (closing one keeps it); a 2-rank
    job saving into it meanwhile is refused on both ranks (rank 1 learns it from rank 0, no hang); on a
    filesystem whose directories cannot be locked (NFS: EBADF) the claim is a lock file holding the record;
    on one without flock (ENOLCK) a save goes ahead without a claim and a one-line warning says so."""
    d = snap_env.ckpt_dir
    with Checkpointer(d, persister_idle_timeout_secs=5) as a, Checkpointer(d, job_id="b",
                                                                          persister_idle_timeout_secs=5) as b:
        a.save({"w": torch.ones(2)}, 1).wait()
        b.save({"w": torch.ones(2)}, 2).wait()
        real = os.path.realpath(d)
        assert dirclaim._held[real][1] == 2
        b.close()
        assert dirclaim._held[real][1] == 1
        outs = run_ranks("dirclaim_worker.py", 2, ["refused", d], snap_env.env, timeout=120)
        recs = sorted((json.loads(line) for o in outs for line in result_lines(o)), key=lambda r: r["rank"])
        assert [r["rank"] for r in recs] == [0, 1], outs
        for r in recs:
            assert r["error"]["type"] == "CheckpointDirInUseError", r
            assert f"pid {os.getpid()} on host" in r["error"]["message"], r
        a.save({"w": torch.ones(2)}, 3).wait()
        assert _steps(d) == [f"step_{s:08d}" for s in (1, 2, 3)]
    assert os.path.realpath(d) not in dirclaim._held

    real_flock = dirclaim.fcntl.flock

    def nfs_flock(fd, op):  # NFS: flock is a byte-range lock, refused on a descriptor not open for writing
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real_flock(fd, op)

    monkeypatch.setattr(dirclaim.fcntl, "flock", nfs_flock)
    with Checkpointer(d, persister_idle_timeout_secs=5) as c:
        c.save({"w": torch.full((2,), 4.0)}, 4).wait()
        # the claim fell back to a lock file holding the record, and it still excludes another job
        assert json.load(open(os.path.join(d, dirclaim.LOCK_NAME)))["pid"] == os.getpid()
        assert dirclaim.read_holder(d)["pid"] == os.getpid()
        other = os.open(os.path.join(d, dirclaim.LOCK_NAME), os.O_RDWR)  # another open file description
        try:
            with pytest.raises(BlockingIOError):
                real_flock(other, dirclaim.fcntl.LOCK_EX | dirclaim.fcntl.LOCK_NB)
        finally:
            os.close(other)

    def no_flock(fd, op):  # the checkpoint directory's filesystem has no flock (the runtime dir's has)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(dirclaim.LOCK_NAME) or path == os.path.realpath(d):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return real_flock(fd, op)

    monkeypatch.setattr(dirclaim.fcntl, "flock", no_flock)
    with caplog.at_level(logging.WARNING, logger="snapckpt.ondisk.dirclaim"):
        with Checkpointer(d, persister_idle_timeout_secs=5) as c:
            c.save({"w": torch.full((2,), 5.0)}, 5).wait()
            assert torch.equal(c.load()["w"], torch.full((2,), 5.0))
    assert any("does not support flock" in r.getMessage() for r in caplog.records), caplog.text
