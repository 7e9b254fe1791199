"""Coordination and shared-filesystem cases (C1, C2, C4-C9), contract 6, two jobs on one host (the
persister's security boundary: tests/test_security.py). Multi-rank tests run real gloo ranks
(tests/workers/coord_worker.py).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
import torch

from _harness import finish, isolated_snap_env, launch, result_lines, run_ranks, wait_until
from snapckpt import Checkpointer, StorageType
from snapckpt.errors import PersisterTimeoutError
from snapckpt.persister.client import job_dirs, job_key

WORKER = "coord_worker.py"
OPTS = dict(persister_idle_timeout_secs=5, commit_timeout_secs=30, request_timeout_secs=30,
            coordination_timeout_secs=30, fsync=False)


def results(outs):
    """One parsed RESULT record per rank, in rank order (fails with the rank's output if missing)."""
    recs = []
    for r, out in enumerate(outs):
        lines = result_lines(out)
        assert len(lines) == 1, f"rank {r} printed {len(lines)} RESULT lines:\n{out}"
        recs.append(json.loads(lines[0]))
        assert "error" not in recs[-1], f"rank {r} failed:\n{out}"
    return recs


def persister_log(snap_env, ckpt_dir, job_id=None) -> str:
    rt, _ = job_dirs(snap_env.runtime_root, snap_env.shm_root, job_key(ckpt_dir, job_id))
    with open(os.path.join(rt, "persister.log"), errors="replace") as f:
        return f.read()


# ---------------------------------------------------------------------------------------------- C5
def test_C5_only_rank0_calls_collectives_gets_named_timeouts(snap_env):
    """C5: only rank 0 calls save (DISK), latest_step and load; rank 1 never does. Right: the save fails
    with CommitTimeoutError naming rank 1, latest_step and load with RankTimeoutError naming rank 1
    (coordination_timeout_secs=2), nothing hangs and nothing is committed."""
    outs = run_ranks(WORKER, 2, ["misuse", snap_env.ckpt_dir], snap_env.env, timeout=90)
    r0 = results(outs)[0]
    assert r0["save"]["type"] == "CommitTimeoutError", r0
    assert "ranks [1]" in r0["save"]["message"], r0
    for call in ("latest_step", "load"):
        assert r0[call]["type"] == "RankTimeoutError", r0
        assert "ranks [1]" in r0[call]["message"], r0
    assert not [n for n in r0["committed"] if n.startswith("step_")], r0
    assert not [n for n in os.listdir(snap_env.ckpt_dir) if ".partial-" in n]


# ------------------------------------------------------------------------------------- C4, C6, C7
# C4, C6 (no launcher variables) and C7 are one job: every rank of a plain gloo launch (no LOCAL_RANK or
# LOCAL_WORLD_SIZE) constructs a Checkpointer at the same moment with no persister running, on a missing
# nested directory, then saves and loads. It runs once, at 8 ranks (the largest of the three), and each
# case's checks are their own test on its result; `construct_job`'s group keeps them on one pytest-xdist
# worker so that the job is not run once per worker.
CONSTRUCT = pytest.mark.xdist_group("test_coordination_construct")


@pytest.fixture(scope="module")
def construct_job(tmp_path_factory):
    """The 8-rank ``construct`` job on a missing nested directory, in its own isolated environment (leaks
    checked when the module is done): ``(env, nested_dir, persisters_before, outputs, records)``."""
    with isolated_snap_env(str(tmp_path_factory.mktemp("construct"))) as se:
        before = se.persisters()
        nested = os.path.join(se.ckpt_dir, "a", "b", "c", "d")
        outs = run_ranks(WORKER, 8, ["construct", nested], se.env, timeout=150)
        yield se, nested, before, outs, results(outs)


@CONSTRUCT
def test_C4_racing_mkdir_of_nested_checkpoint_dir(construct_job):
    """C4: 8 ranks construct Checkpointers on the same missing nested directory at the same moment (and
    create the same runtime directories). Right: no FileExistsError, every rank gets the directory, one
    persister serves all 8, and a DISK save/load round trip works on every rank."""
    _, nested, _, outs, recs = construct_job
    assert len(recs) == 8
    assert not any("FileExistsError" in o for o in outs)
    assert os.path.isdir(os.path.join(nested, "step_00000001"))
    assert len({r["pid"] for r in recs}) == 1
    assert all(r["loaded_step"] == 1 and r["loaded_ok"] for r in recs)
    assert all(r["local_ranks"] == list(range(8)) for r in recs)


@CONSTRUCT
@pytest.mark.parametrize("launcher", ["no_local_vars", "wrong_local_vars"])
def test_C6_topology_comes_from_torch_distributed(snap_env, launcher, request):
    """C6: ranks started without LOCAL_RANK/LOCAL_WORLD_SIZE (the 8 ranks of `construct_job`), or with
    wrong ones (2 ranks, LOCAL_WORLD_SIZE=1 and LOCAL_RANK=0 on every rank, plus other launchers'
    equivalents). Right: the topology still says every rank is on this node, one persister serves them all,
    and save/load works on every rank."""
    if launcher == "wrong_local_vars":
        recs = results(run_ranks(WORKER, 2, ["construct", snap_env.ckpt_dir],
                                 {**snap_env.env, "COORD_FAKE_LAUNCHER": "1"}, timeout=90))
    else:
        recs = request.getfixturevalue("construct_job")[4]
    for r in recs:
        assert r["local_ranks"] == list(range(len(recs))) and r["num_nodes"] == 1, r
        assert r["local_rank"] == r["rank"], r
        assert r["loaded_step"] == 1 and r["loaded_ok"], r
        assert r["env_local_world_size"] == ("1" if launcher == "wrong_local_vars" else None)
    assert len({r["pid"] for r in recs}) == 1


@CONSTRUCT
def test_C7_startup_race_one_persister(construct_job):
    """C7: the ranks (8 of `construct_job`) construct at the same instant with no persister running.
    Right: exactly one persister process is started, every rank is connected to it (same pid), nobody sees
    FileNotFoundError."""
    _, _, before, outs, recs = construct_job
    assert not before
    assert len({r["pid"] for r in recs}) == 1
    assert all(r["persisters"] == 1 for r in recs), recs
    assert not any("FileNotFoundError" in o for o in outs)


# ---------------------------------------------------------------------------------------------- C8
def test_C8_killed_spawn_lock_holder_releases_the_lock(snap_env):
    """C8: a process holding the job's spawn lock (flock on spawn.lock) blocks persister start-up; it is
    SIGKILLed. Right: while it holds the lock a Checkpointer fails within its startup timeout with a
    PersisterTimeoutError naming the lock (no hang); once it is killed the kernel releases the lock and
    the next Checkpointer starts a persister and saves and loads normally."""
    rt, _ = job_dirs(snap_env.runtime_root, snap_env.shm_root, job_key(snap_env.ckpt_dir, None))
    os.makedirs(rt, mode=0o700)
    lock = os.path.join(rt, "spawn.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({lock!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(PersisterTimeoutError, match="spawn.lock"):
            Checkpointer(snap_env.ckpt_dir, **{**OPTS, "persister_startup_timeout_secs": 1})
        assert not snap_env.persisters()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    with Checkpointer(snap_env.ckpt_dir, **{**OPTS, "persister_startup_timeout_secs": 30}) as ck:
        ck.save({"w": torch.arange(10.0)}, 3, StorageType.DISK).wait()
        assert torch.equal(ck.load()["w"], torch.arange(10.0))


def test_C8_C9_rank_killed_mid_copy_restart_loads_same_step(snap_env):
    """C8 + C9: two ranks hold step 10 (memory and disk); at step 20 rank 1 SIGKILLs itself halfway
    through copying into its arena slot while rank 0 completes step 20; the job dies. Right: the
    persister marks rank 1's slot INVALID (not held), and a restarted job's ranks all load step 10 with
    their own step-10 values, never rank 0's memory step 20 mixed with rank 1's step 10."""
    snap_env.leftover_ok = True
    procs = launch(WORKER, 2, ["die_mid_copy", snap_env.ckpt_dir], snap_env.env)
    outs = finish(procs, timeout=90)
    assert procs[0].returncode == 0, outs[0]
    assert procs[1].returncode == -signal.SIGKILL, outs[1]
    first = json.loads(result_lines(outs[0])[0])
    assert first["saved"] == 20 and not result_lines(outs[1])
    survivor = psutil.Process(first["pid"])
    assert survivor.is_running()

    recs = results(run_ranks(WORKER, 2, ["restart", snap_env.ckpt_dir], snap_env.env, timeout=90))
    assert all(r["pid"] == first["pid"] for r in recs), "the restarted job must find the surviving persister"
    assert 20 in recs[0]["held"] and 20 not in recs[1]["held"], recs
    assert 10 in recs[1]["held"], recs
    assert [r["step"] for r in recs] == [10, 10], recs
    assert all(r["ok"] for r in recs), recs
    assert "left while writing step 20" in persister_log(snap_env, snap_env.ckpt_dir)
    assert wait_until(lambda: not survivor.is_running() or survivor.status() == psutil.STATUS_ZOMBIE, 20)


# ------------------------------------------------------------------------------------ C1 / contract 6
def test_C1_training_group_stays_usable_during_background_commits(snap_env):
    """C1 / contract 6: 20 iterations of train step, DISK save, all_reduce and barrier on the training
    group while commits run in the background (slow persister). Right: no hang (bounded timeouts), every
    all_reduce is correct, snapckpt issues no collective on the training group from any thread, and the
    last step is committed."""
    env = {**snap_env.env, "SNAPCKPT_FAULT_WRITE_DELAY_SECS": "0.005"}
    recs = results(run_ranks(WORKER, 2, ["busy_group", snap_env.ckpt_dir], env, timeout=120))
    for r in recs:
        assert r["sums"] == r["expected"], r
        assert r["latest"] == 19, r
        assert r["collectives"] == r["mine"], f"snapckpt issued collectives on the training group: {r}"
        assert r["threads"] == [r["main"]], r
        assert r["pending_at_collective"] > 0, "no commit overlapped the collectives"


# ---------------------------------------------------------------------------------------------- C2
def test_C2_ranks_follow_rank0_decision(snap_env):
    """C2: rank 1's view of the checkpoint directory lags (it lists nothing, os.path.exists says no) and
    its memory holds step 30 that rank 0 does not have. Right: every rank agrees on step 20 (newest held
    in memory by all ranks), loads its own step-20 state from memory, and an explicit load(step=10)
    reads the committed disk checkpoint on both ranks."""
    recs = results(run_ranks(WORKER, 2, ["disagree", snap_env.ckpt_dir], snap_env.env, timeout=90))
    for r in recs:
        assert r["latest"] == 20, r
        assert r["load"] == [20, "memory", True], r
        assert r["load10"] == [10, "disk", True], r


# ------------------------------------------------------------------------------- two jobs on one host
def test_two_jobs_on_one_host_do_not_interfere(snap_env):
    """Three 2-rank jobs at once on one host, each in its own directory (C with its own job_id too; two
    running jobs saving into one directory are refused: test_dir_claim.py). Right: three persisters, each
    job's ranks share one, and each job loads its own state from memory and from disk."""
    dir_a = os.path.join(snap_env.ckpt_dir, "first")
    dir_b = os.path.join(snap_env.ckpt_dir, "other")
    dir_c = os.path.join(snap_env.ckpt_dir, "third")
    jobs = {
        "A": launch(WORKER, 2, ["job", dir_a, "A", "-", "10"], snap_env.env),
        "B": launch(WORKER, 2, ["job", dir_b, "B", "-", "10"], snap_env.env),
        "C": launch(WORKER, 2, ["job", dir_c, "C", "second", "11"], snap_env.env),
    }
    recs = {}
    for name, procs in jobs.items():
        outs = finish(procs, timeout=150)
        for r, (p, o) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, f"job {name} rank {r} exited {p.returncode}:\n{o}"
        recs[name] = results(outs)
    pids = {name: {r["pid"] for r in rs} for name, rs in recs.items()}
    assert all(len(p) == 1 for p in pids.values()), pids
    assert len(set().union(*pids.values())) == 3, pids
    assert len({rs[0]["job"] for rs in recs.values()}) == 3
    for name, rs in recs.items():
        step = 11 if name == "C" else 10
        for r in rs:
            assert r["mem"] == [21, "memory", True], (name, r)
            assert r["disk"] == [step, "disk", True], (name, r)
    for d, step in ((dir_a, 10), (dir_b, 10), (dir_c, 11)):
        assert {n for n in os.listdir(d) if n.startswith("step_")} == {f"step_{step:08d}"}


def test_two_jobs_same_dir_in_flight_save_is_not_cleaned_up(snap_env, monkeypatch):
    """Two jobs in one directory (job A, and job C with job_id="second"). A's DISK save is in flight
    (its persister frozen with SIGSTOP mid-write) when C starts; C's persister cleans up leftovers of
    crashed runs at start. Right: A's in-flight partial directory is not C's to delete; once A's
    persister resumes, A's save commits."""
    snap_env.leftover_ok = True  # a frozen persister is killed at teardown if the test fails
    d = snap_env.ckpt_dir
    monkeypatch.setenv("SNAPCKPT_FAULT_WRITE_DELAY_SECS", "0.2")  # A's persister writes slowly
    with Checkpointer(d, **OPTS) as a:
        monkeypatch.delenv("SNAPCKPT_FAULT_WRITE_DELAY_SECS")
        h = a.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, 10, StorageType.DISK)
        pers = psutil.Process(a.persister_pid)
        in_flight = lambda: [n for n in os.listdir(d) if ".partial-" in n]
        assert wait_until(in_flight, 30), "A's save never started writing"
        pers.suspend()
        try:
            partial = in_flight()
            with Checkpointer(d, job_id="second", **OPTS) as c:
                assert c.persister_pid != a.persister_pid
                assert in_flight() == partial, "job C deleted job A's save in flight"
                c.save({"w": torch.ones(4)}, 11, StorageType.DISK).wait()
        finally:
            pers.resume()
        h.wait()
        assert torch.equal(a.load(step=10)["w"], torch.arange(1 << 16, dtype=torch.float32))
    assert {n for n in os.listdir(d) if n.startswith("step_")} == {"step_00000010", "step_00000011"}


# ------------------------------------------------------------------------------- time-based policy
def test_a_time_based_policy_is_one_decision_shared_by_every_rank(snap_env):
    """Rank 1's hooks start 0.35 s after rank 0's (ranks start at different moments and keep their own
    clocks); a memory snapshot is due every 0.5 s. Right: rank 0 decides and every rank snapshots the same
    steps (before, each rank followed its own clock and the ranks snapshotted different steps)."""
    recs = results(run_ranks(WORKER, 2, ["timed_policy", snap_env.ckpt_dir], snap_env.env, timeout=120))
    assert recs[0]["taken"], recs
    assert recs[0]["taken"] == recs[1]["taken"], recs
