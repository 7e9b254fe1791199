"""Resources and preflight: cases D1 (tiny shared memory), D2 (flat memory, no leaks) and design contracts
7 (fail fast: shared memory, checkpoint directory, free disk, options, persister startup) and 10
(no shared-memory segment, process or file descriptor outlives the job).

Real tmpfs mounts (the tests run as root), real persister processes, real SIGKILL.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess

import psutil
import pytest
import torch

from _harness import finish, finish_ok, launch, result_lines, tree, used_bytes, wait_until
from faults import point_env
from snapckpt import Checkpointer, StorageType
from snapckpt.errors import (CheckpointDirError, DiskFullError, InsufficientDiskError, PersisterError,
                             PersisterTimeoutError)

MiB = 1 << 20
WORKER = "resources_worker.py"
QUICK = dict(commit_timeout_secs=30, request_timeout_secs=30, coordination_timeout_secs=30,
             persister_startup_timeout_secs=30)


@contextlib.contextmanager
def tmpfs(path: str, size: str, *opts: str):
    """Mount a fresh tmpfs of ``size`` at ``path`` for the block (root only); always unmounted."""
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join((f"size={size}",) + opts), "tmpfs", path],
                   check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", path]).returncode != 0:
            subprocess.run(["umount", "-l", path])


def results(out: str) -> list:
    return [json.loads(line) for line in result_lines(out)]


def run_worker(snap_env, *args: str, timeout: float = 120):
    procs = launch(WORKER, 1, list(args), snap_env.env)
    (out,) = finish(procs, timeout)
    return procs[0].returncode, out


# ------------------------------------------------------------------------------------------ D1
def test_D1_tiny_shm_fails_fast_without_sigbus(snap_env):
    """D1: a 16 MiB tmpfs as ``shm_dir`` and a 32 MiB state. tmpfs allocates lazily, so a naive arena dies
    of SIGBUS on first touch. Right: ``save`` raises InsufficientSharedMemoryError naming the bytes needed
    and the option to change, before any copy (no stats, the tmpfs gains nothing, nothing is written to
    the checkpoint directory); the same Checkpointer then saves, commits and loads a 1 MiB state."""
    shm = os.path.join(snap_env.tmp, "tiny-shm")
    with tmpfs(shm, "16m"):
        rc, out = run_worker(snap_env, "tiny_shm", snap_env.ckpt_dir, shm)
        assert rc != -signal.SIGBUS, f"the saving process died of SIGBUS:\n{out}"
        assert rc == 0, f"worker exited {rc}:\n{out}"
        big, small, closed = results(out)
        err = big["error"]
        assert err is not None and err["type"] == "InsufficientSharedMemoryError", out
        needed = [int(n) for n in re.findall(r"\d+", err["message"])]
        assert any(n >= 32 * MiB for n in needed), f"the message does not name the size needed: {err}"
        assert "shm_dir=" in err["message"] and "SNAPCKPT_SHM_DIR" in err["message"], \
            f"the message does not name the option and the environment variable to change: {err}"
        assert big["last_stats"] is None, "a copy happened before the error"
        assert big["shm_used_after"] - big["shm_used_before"] < MiB, "the failed save kept shared memory"
        # the writer claim (snapckpt.ondisk.dirclaim) locks the directory itself: nothing may be in it
        assert big["ckpt_tree"] == [], f"the failed save wrote to the checkpoint dir: {big['ckpt_tree']}"
        assert small["step"] == 2 and small["equal"], small
        assert small["ckpt_tree"] and not any(n.startswith("step_00000001") for n in small["ckpt_tree"])
        assert closed["persister_gone"]
        assert wait_until(lambda: not os.listdir(shm), timeout=15), f"arena left in {shm}: {tree(shm)}"


def test_D1_second_slot_does_not_fit(snap_env):
    """D1, partial fit: a 10 MiB state's first slot (10.5 MiB with the default 1.05 headroom) fits the 16 MiB
    tmpfs, its second does not,
    so the arena (two slots) cannot hold it. Right: never SIGBUS; the very first save already raises
    InsufficientSharedMemoryError naming the bytes of both slots (not a save that works and a later one
    that fails) and the setting that fits (``slots_per_rank=1``, with the bytes it needs and those available),
    every retry does too; a 4 MiB state then works and loads from memory. Host-memory budget (issue 18,
    target 6): the first save's preflight warning names that setting too; the same 10 MiB state snapshots
    with a 12 MiB ``host_memory_budget_nbytes`` (which picks one slot of the default two: the
    ``slots_per_rank=1`` path); the newest snapshot loads, the tmpfs holds one slot, and a state that
    outgrows the budget is refused naming it, before any copy."""
    shm = os.path.join(snap_env.tmp, "tiny-shm")
    with tmpfs(shm, "16m"):
        rc, out = run_worker(snap_env, "one_slot", snap_env.ckpt_dir, shm)
        assert rc != -signal.SIGBUS, f"the saving process died of SIGBUS:\n{out}"
        assert rc == 0, f"worker exited {rc}:\n{out}"
        res, closed, budget = results(out)
        assert re.search(r"host memory: this node's snapshot arena needs 21.0 MiB .* slots_per_rank=1 fits", out), out
        errors = res["errors"]
        assert all(errors), f"two 10.5 MiB slots cannot fit a 16 MiB tmpfs, yet a save passed: {errors}"
        for e in errors:  # names what both slots need (>= 2 x 10 MiB), and what fits
            assert "shm_dir" in e and any(int(n) >= 20 * MiB for n in re.findall(r"\d+", e)), e
            fits = re.search(r"slots_per_rank=1 fits: needs [\d.]+ MiB \((\d+) bytes\) of [\d.]+ MiB "
                             r"\((\d+) bytes\)", e)
            assert fits and 10 * MiB < int(fits[1]) < int(fits[2]) <= 16 * MiB, e
        assert res["loaded_step"] == 5 and res["loaded_fill"] == 5.0, res
        assert closed["persister_gone"]
        assert (budget["loaded_step"], budget["loaded_fill"]) == (9, 9.0), budget
        assert 10 * MiB < budget["shm_used"] < 12 * MiB, f"more than one slot held: {budget}"
        assert "host_memory_budget_nbytes=12582912" in budget["outgrown"], budget
        assert budget["last_stats"] == 9, "the refused save copied its state"
        assert wait_until(lambda: not os.listdir(shm), timeout=15), f"arena left in {shm}: {tree(shm)}"


def test_D1_two_local_ranks_a_second_slot_never_takes_another_ranks_first(snap_env):
    """D1 with 2 local ranks on a 36 MiB tmpfs, one launch, three Checkpointers.

    ``even``: 12 MiB states (12.6 MiB slots), two slots each: four slots (50.4 MiB) do not fit, two (25.2 MiB) do,
    as the node check warns. Rank 0 saves steps 1 and 2, then rank 1 its first. Wrong (before): rank 0 took both
    its slots and rank 1, whose one slot would fit, was refused with "no slot count fits", contradicting the node
    check. Right: rank 0's second slot waits until rank 1 has asked for its first (rank 0 saves with one slot
    meanwhile); then every rank's slots are counted, and both ranks are refused alike naming ``slots_per_rank=1``,
    as the node check does. ``one``: that setting works for both. ``uneven`` (pipeline stages): 12 and 2 MiB, two
    slots each (29.4 MiB) fit and are all used, and the newest step loads from memory: a rank of another size is
    counted at its own size."""
    shm = os.path.join(snap_env.tmp, "small-shm")
    with tmpfs(shm, "36m"):
        outs = finish_ok(launch(WORKER, 2, ["local_ranks", snap_env.ckpt_dir, shm], snap_env.env), 180)
        res = {(r["phase"], r["rank"]): r for out in outs for r in results(out)}
        assert len(res) == 6, outs
        assert re.search(r"host memory: this node's snapshot arena needs 50.4 MiB .* slots_per_rank=1 fits: "
                         r"needs 25.2 MiB", outs[0]), outs[0]
        even0, even1 = res["even", 0]["errors"], res["even", 1]["errors"]
        assert even0["1"] is None and even0["2"] is None, even0  # one slot, reused, while rank 1 had not asked
        for e in (even1["1"], even1["3"], even0["3"]):
            assert e is not None and "no slot count fits" not in e, (even0, even1)
            assert re.search(r"slots_per_rank=1 fits: needs 25.2 MiB", e), e
        for rank in (0, 1):
            assert not any(res["one", rank]["errors"].values()), res["one", rank]
            uneven = res["uneven", rank]
            assert not any(uneven["errors"].values()), uneven
            assert uneven["loaded"] == [3, "MEMORY", 3.0], uneven
        # all four slots (2 x 12.6 + 2 x 2.1 MiB) held: the second slots grew once both ranks had asked
        assert res["uneven", 1]["shm_used"] > 28 * MiB, res["uneven", 1]
        assert wait_until(lambda: not os.listdir(shm), timeout=15), f"arena left in {shm}: {tree(shm)}"


def test_D1_the_setting_the_error_names_works_while_the_failed_runs_persister_lives(snap_env):
    """D1, retried as the error says: a 10 MiB state on a 16 MiB tmpfs fails with two slots per rank, naming
    ``slots_per_rank=1``; the rank dies without closing (a crash: its persister stays for a restart). The job,
    restarted with ``slots_per_rank=1``, is served by that same persister, which had made two slot records
    for the rank: the rank's own setting bounds the slots it uses (before, the persister counted every record
    it held and refused again, naming the same two slots), the snapshot is taken and loads from memory."""
    snap_env.leftover_ok = True
    shm = os.path.join(snap_env.tmp, "tiny-shm")
    with tmpfs(shm, "16m"):
        rc, out = run_worker(snap_env, "fewer_slots", snap_env.ckpt_dir, shm, "2")
        assert rc == 0, f"worker exited {rc}:\n{out}"
        (first,) = results(out)
        assert first["error"] and "slots_per_rank=1 fits" in first["error"], first
        rc, out = run_worker(snap_env, "fewer_slots", snap_env.ckpt_dir, shm, "1")
        assert rc == 0, f"worker exited {rc}:\n{out}"
        (second,) = results(out)
        assert second["persister_pid"] == first["persister_pid"], "not served by the surviving persister"
        assert second["error"] is None and second["loaded"] == [1, "MEMORY", 3.0], second
        assert 10 * MiB < second["shm_used"] < 12 * MiB, f"more than one slot held: {second}"
        subprocess.run([os.path.join(os.path.dirname(os.sys.executable), "snapckpt"), "stop", snap_env.ckpt_dir],
                       env=snap_env.env, capture_output=True, timeout=60)
        assert wait_until(lambda: not os.listdir(shm), timeout=30), f"arena left in {shm}: {tree(shm)}"


def test_single_slot_killed_mid_copy_never_loads_a_torn_snapshot(snap_env):
    """Issue 18, target 6: ``slots_per_rank=1``. Step 1 is saved to disk and step 2 at once to memory: the
    only slot is being written to disk, so step 2 waits for it (``slot_wait``), then takes the slot. Step 3
    is copied into that same slot and the rank is SIGKILLed halfway (a real fault point): memory then holds
    no complete snapshot (step 2 was overwritten). Right: the restarted job (same persister) loads step 1
    from disk, never the torn step 3 nor the overwritten step 2, the crash flush wrote nothing, and a warning
    names the interrupted step; it snapshots step 4 into the slot and is SIGKILLed after the snapshot
    completed: the next restart loads step 4 from memory."""
    snap_env.leftover_ok = True
    env = {**snap_env.env, **point_env("snapshot.mid_copy", step=3), "SNAPCKPT_FAULT_WRITE_DELAY_SECS": "0.02"}
    procs = launch(WORKER, 1, ["single_slot", snap_env.ckpt_dir], env)
    (out,) = finish(procs, 120)
    assert procs[0].returncode == -signal.SIGKILL, f"the fault point did not fire:\n{out}"
    (saved,) = results(out)
    assert saved["waited"] == [2] and saved["committed"] == [1], saved
    rc, out = run_worker(snap_env, "single_slot_resume", snap_env.ckpt_dir, "1")
    assert rc == -signal.SIGKILL, f"worker exited {rc}:\n{out}"
    loaded, _ = results(out)
    assert loaded["persister_pid"] == saved["persister_pid"], "the restart did not find the surviving persister"
    assert (loaded["step"], loaded["tier"], loaded["fill"]) == (1, "disk", 1.0), loaded
    assert loaded["on_disk"] == ["step_00000001"], loaded
    assert re.search(r"memory snapshot of step\(s\) \[3\] is incomplete.*single arena slot.*loading step 1 \(disk\)",
                     out), out
    rc, out = run_worker(snap_env, "single_slot_resume", snap_env.ckpt_dir, "0")
    assert rc == 0, f"worker exited {rc}:\n{out}"
    loaded, closed = results(out)
    assert (loaded["step"], loaded["tier"], loaded["fill"]) == (4, "memory", 4.0), loaded
    assert closed["persister_gone"]


# ------------------------------------------------------------------------------------------ D2
def _flat(samples: list, key: str, slack_bytes: int = 16 * MiB, frac: float = 0.10) -> None:
    base = samples[20][key]
    late = max(s[key] for s in samples[150:200])
    allowed = base + max(slack_bytes, int(frac * base))
    assert late <= allowed, (f"{key} grew after warm-up: {base / MiB:.1f} MiB at save 20, "
                             f"max {late / MiB:.1f} MiB over saves 150-199")


def test_D2_memory_and_fds_flat_over_200_saves(snap_env):
    """D2 / contract 10: 200 saves of a 64 MiB state (MEMORY, every 20th DISK with keep_last=2; fsync off,
    this is about memory). Right: RSS (and private anonymous RSS) of the trainer and of the persister stay
    flat after warm-up, so do their open-fd counts; one persister serves every save; retention keeps two
    checkpoints; after close() the persister exits, the trainer's fd count is back to its baseline and no
    shared-memory file is left (fixture)."""
    rc, out = run_worker(snap_env, "churn", snap_env.ckpt_dir, timeout=170)
    assert rc == 0, f"worker exited {rc}:\n{out[-3000:]}"
    (res,) = results(out)
    s = res["samples"]
    assert len(s) == 200
    for key in ("rss", "anon", "p_rss", "p_anon"):
        _flat(s, key)
    for key in ("fds", "p_fds"):
        assert max(x[key] for x in s[150:200]) <= s[20][key] + 2, f"{key}: {[x[key] for x in s]}"
    assert len(res["persister_pids"]) == 1, f"the persister was restarted: {res['persister_pids']}"
    assert res["on_disk"] == ["step_00000179", "step_00000199"], res["on_disk"]
    assert res["persister_gone"], "the persister outlived close()"
    assert abs(res["fds_after_close"] - res["fds_before"]) <= 2, \
        f"fd leak: {res['fds_before']} before the Checkpointer, {res['fds_after_close']} after close()"


def _hold(snap_env, idle_secs: float):
    """Start a job that commits step 1, keeps step 2 in memory and waits; return (proc, persister pid)."""
    marker = os.path.join(snap_env.tmp, "held.json")
    procs = launch(WORKER, 1, ["hold", snap_env.ckpt_dir, marker, str(idle_secs)], snap_env.env)
    if not wait_until(lambda: os.path.exists(marker) or procs[0].poll() is not None, timeout=90):
        procs[0].kill()
        raise AssertionError(f"the job never got ready: {procs[0].communicate()[0]}")
    assert os.path.exists(marker), f"the job died: {procs[0].communicate()[0]}"
    with open(marker) as f:
        return procs[0], json.load(f)["persister_pid"]


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _persister_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_D2_sigkilled_job_then_restart_leaves_nothing(snap_env):
    """D2 / contract 10: the job is SIGKILLed with a snapshot in memory; a new job on the same checkpoint
    dir attaches to the surviving persister, resumes at step 2 (nothing lost), commits step 3 and closes.
    Right: afterwards no persister process, no shared-memory file and no socket/token is left, and the new
    job's fd count is back to its baseline."""
    proc, pid = _hold(snap_env, idle_secs=120)
    _kill(proc)
    assert _persister_alive(pid), "the persister died with the job (it must outlive it)"
    rc, out = run_worker(snap_env, "resume", snap_env.ckpt_dir)
    assert rc == 0, f"restarted job exited {rc}:\n{out}"
    loaded, closed = results(out)
    assert loaded["persister_pid"] == pid, "the restarted job did not find the surviving persister"
    assert loaded["step"] == 2 and loaded["fill"] == 2.0, loaded
    assert closed["persister_gone"], "the persister outlived the clean close of the restarted job"
    assert abs(closed["fds_after_close"] - closed["fds_before"]) <= 2, closed
    assert not snap_env.persisters()
    assert wait_until(lambda: not snap_env.shm_files() and not os.listdir(snap_env.shm_root), timeout=10), \
        f"arena left after restart + close: {tree(snap_env.shm_root)}"
    left = [n for n in tree(snap_env.runtime_root) if n.endswith(("persister.sock", "token"))]
    assert not left, f"socket/token left: {left}"


def test_D2_orphaned_persister_exits_after_idle_timeout(snap_env):
    """D2 / contract 10: the job is SIGKILLed and nobody comes back. Right: the persister exits by itself
    once ``persister_idle_timeout_secs`` (2 s) pass without a client, and removes its arena directory,
    socket and token."""
    proc, pid = _hold(snap_env, idle_secs=2)
    _kill(proc)
    assert wait_until(lambda: not _persister_alive(pid), timeout=60), \
        "the orphaned persister did not exit after its idle timeout"
    assert wait_until(lambda: not os.listdir(snap_env.shm_root), timeout=10), \
        f"arena left by the orphaned persister: {tree(snap_env.shm_root)}"
    left = [n for n in tree(snap_env.runtime_root) if n.endswith(("persister.sock", "token"))]
    assert not left, f"socket/token left: {left}"


def test_D2_polling_snapckpt_ps_does_not_keep_an_orphaned_persister_alive(snap_env):
    """D2: the job is SIGKILLed and nobody comes back, while an operator polls ``snapckpt ps`` (a ``watch``
    loop). Right: ``ps`` answers, but an operator's connection does not restart the idle timeout (a new user
    saw a crashed job's persister and its shared memory kept 6 minutes by a few ``ps`` calls), so the
    persister exits about ``persister_idle_timeout_secs`` (2 s) after the kill."""
    import sys

    proc, pid = _hold(snap_env, idle_secs=2)
    _kill(proc)
    seen, gone = 0, False
    for _ in range(60):  # one ps every ~0.5 s for up to ~30 s: before the fix each one restarted the 2 s timer
        r = subprocess.run([sys.executable, "-m", "snapckpt", "ps", "--json"], env=snap_env.env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        pids = [p["pid"] for p in json.loads(r.stdout)["persisters"]]
        seen += pid in pids
        if not _persister_alive(pid):
            gone = True
            break
        subprocess.run(["sleep", "0.5"])
    assert seen >= 1, "ps never listed the orphaned persister"
    assert gone, "polling `snapckpt ps` kept the orphaned persister alive past its idle timeout"
    assert wait_until(lambda: not os.listdir(snap_env.shm_root), timeout=10), tree(snap_env.shm_root)


# -------------------------------------------------------------------------- contract 7: preflight
@pytest.mark.parametrize("how", ["under_a_file", "is_a_file", "read_only_fs"])
def test_contract7_checkpoint_dir_not_writable(snap_env, how):
    """Contract 7: a checkpoint dir that cannot be created or written (its path goes through a regular
    file, it is a regular file, or it lies on a read-only filesystem; root ignores mode bits). Right:
    the constructor raises CheckpointDirError naming the path; no persister is started."""
    blocker = os.path.join(snap_env.tmp, "a-file")
    with open(blocker, "w") as f:
        f.write("not a directory")
    ro = os.path.join(snap_env.tmp, "ro")
    with contextlib.ExitStack() as stack:
        if how == "under_a_file":
            target = os.path.join(blocker, "ckpt")
        elif how == "is_a_file":
            target = blocker
        else:
            stack.enter_context(tmpfs(ro, "1m", "ro"))
            target = ro
        with pytest.raises(CheckpointDirError) as ei:
            Checkpointer(target, **QUICK)
        assert target in str(ei.value)
        assert not snap_env.persisters()


def test_contract7_disk_too_small_for_checkpoint(snap_env):
    """Contract 7: the checkpoint dir is an 8 MiB tmpfs holding a committed 1 MiB checkpoint; a DISK save
    of a 16 MiB state cannot fit. Right: save raises InsufficientDiskError naming free and needed bytes,
    before anything is copied or written (same files, same usage, no new stats); the Checkpointer stays
    usable (a MEMORY save of the big state and a DISK save of a small one work); the previous checkpoint
    still loads from disk in a new job."""
    d = os.path.join(snap_env.tmp, "small-disk")
    with tmpfs(d, "8m"):
        first = {"w": torch.arange(256 * 1024, dtype=torch.float32)}
        with Checkpointer(d, keep_last=3, **QUICK) as ck:
            ck.save(first, 1, StorageType.DISK).wait()
            before, used0 = tree(d), used_bytes(d)
            with pytest.raises(InsufficientDiskError) as ei:
                ck.save({"w": torch.ones(4 * MiB)}, 2, StorageType.DISK)
            msg = str(ei.value)
            assert d in msg and any(int(n) >= 16 * MiB for n in re.findall(r"\d+", msg)), msg
            assert tree(d) == before and used_bytes(d) == used0
            assert ck.last_stats.step == 1, "the refused save copied its state"
            ck.save({"w": torch.ones(4 * MiB)}, 3, StorageType.MEMORY)
            ck.save({"w": torch.full((1024,), 4.0)}, 4, StorageType.DISK).wait()
        assert wait_until(lambda: not snap_env.persisters(), timeout=15)
        with Checkpointer(d, **QUICK) as ck:
            out = ck.load(step=1)
            assert ck.last_load.tier == StorageType.DISK
            assert torch.equal(out["w"], first["w"])
            assert torch.equal(ck.load()["w"], torch.full((1024,), 4.0)) and ck.last_load.step == 4
        assert wait_until(lambda: not snap_env.persisters(), timeout=15)


def test_B4_disk_fills_during_the_write(snap_env, monkeypatch):
    """B4 with a real full disk: an 8 MiB tmpfs holds committed step 1; the DISK save of a 4 MiB step 2 passes
    the preflight, then another process fills the disk while the (slowed) persister writes. Right: ``wait()``
    raises DiskFullError (an OSError, errno ENOSPC) naming the checkpoint directory, the bytes the part needs
    and those free, and the fix; the partial directory is removed; once the other file is gone a new job
    loads step 1 from disk."""
    monkeypatch.setenv("SNAPCKPT_FAULT_WRITE_DELAY_SECS", "0.05")  # 64 records: about 3 s of writing
    d = os.path.join(snap_env.tmp, "filling-disk")
    with tmpfs(d, "8m"):
        ck_dir = os.path.join(d, "ck")
        with Checkpointer(ck_dir, **QUICK) as ck:
            ck.save({"w": torch.ones(1024)}, 1, StorageType.DISK).wait()
            h = ck.save({f"t{i}": torch.full((16384,), float(i)) for i in range(64)}, 2, StorageType.DISK)
            with open(os.path.join(d, "ballast"), "wb") as f, pytest.raises(OSError):
                while True:  # another program fills the disk meanwhile
                    f.write(bytes(1 << 16))
                    f.flush()
            with pytest.raises(DiskFullError) as ei:
                h.wait()
            msg = str(ei.value)
            assert ei.value.errno == errno.ENOSPC and isinstance(ei.value, OSError), repr(ei.value)
            assert f"checkpoint directory {ck_dir}:" in msg and re.search(r"needs about \d{7} bytes, \d+ bytes "
                                                                           r"are free", msg), msg
            assert "free space there or keep fewer checkpoints" in msg and "previous checkpoint is intact" in msg
            assert wait_until(lambda: sorted(os.listdir(ck_dir)) == ["latest", "step_00000001"], timeout=30), \
                os.listdir(ck_dir)
        os.remove(os.path.join(d, "ballast"))
        assert wait_until(lambda: not snap_env.persisters(), timeout=15)
        with Checkpointer(ck_dir, **QUICK) as ck:
            assert torch.equal(ck.load()["w"], torch.ones(1024)) and ck.last_load.step == 1
            assert ck.last_load.tier == StorageType.DISK
        assert wait_until(lambda: not snap_env.persisters(), timeout=15)


# ----------------------------------------------------------------------------- options validation
@pytest.mark.parametrize("kwargs, error, names", [
    ({"keep_last": 0}, ValueError, ["keep_last"]),
    ({"keep_last": -3}, ValueError, ["keep_last"]),
    ({"slots_per_rank": 0}, ValueError, ["slots_per_rank"]),
    ({"slot_headroom": 0.5}, ValueError, ["slot_headroom"]),
    ({"on_slot_busy": "drop"}, ValueError, ["on_slot_busy"]),
    ({"request_timeout_secs": 0}, ValueError, ["request_timeout_secs"]),
    ({"commit_timeout_secs": float("nan")}, ValueError, ["commit_timeout_secs"]),
    ({"job_id": "a/b"}, ValueError, ["job_id"]),
    ({"keep_lsat": 2}, TypeError, ["keep_lsat", "keep_last", "slots_per_rank", "shm_dir"]),
])
def test_contract7_invalid_options(snap_env, kwargs, error, names):
    """Contract 7: a bad option value or an unknown option name. Right: the constructor raises a
    ValueError naming the option (an unknown name: a TypeError listing it and the valid names) before
    it creates the checkpoint dir or starts a persister."""
    with pytest.raises(error) as ei:
        Checkpointer(snap_env.ckpt_dir, **kwargs)
    for n in names:
        assert n in str(ei.value), f"{n!r} not in {ei.value}"
    assert not os.path.exists(snap_env.ckpt_dir)
    assert not snap_env.persisters()


# ---------------------------------------------------------------------------- persister startup
@pytest.mark.parametrize("via", ["env", "option"])
def test_contract7_persister_startup_failure_reports_log(snap_env, monkeypatch, via):
    """Contract 7: the persister cannot start (a regular file sits where its arena directory must be
    created inside the shared-memory directory). Right: the constructor raises PersisterError, not a
    timeout and not a hang, within persister_startup_timeout_secs, with the tail of the persister's log
    (the real cause) in the message; no persister is left. (A shared-memory directory that does not
    exist at all is refused earlier by the preflight: tests/test_user_errors.py.) With a newest checkpoint
    named by ``latest`` (a restart), the read-ahead of its file started with the persister
    (engine/prefetch.py) changes nothing of that error and does not outlive the constructor."""
    import threading

    from snapckpt.persister.client import job_key

    if via == "option":  # a restart's directory: a tracker and a manifest naming this rank's 256 MiB file
        step = os.path.join(snap_env.ckpt_dir, "step_00000001")
        os.makedirs(os.path.join(step, ".snapckpt"))
        with open(os.path.join(step, "rank_00000.pt"), "wb") as f:
            f.truncate(256 << 20)  # sparse: read at memory speed, long enough to be running at the error
        with open(os.path.join(step, ".snapckpt", "manifest.json"), "w") as f:
            json.dump({"files": {"rank_00000.pt": {"rank": 0, "nbytes": 256 << 20}}}, f)
        with open(os.path.join(snap_env.ckpt_dir, "latest"), "w") as f:
            f.write("step_00000001")

    shm = os.path.join(snap_env.tmp, "shm")
    os.makedirs(shm)
    bad = os.path.join(shm, f"snapckpt-{os.getuid()}-{job_key(snap_env.ckpt_dir, None)}")
    with open(bad, "w") as f:
        f.write("not a directory")
    opts = dict(QUICK, persister_startup_timeout_secs=60)
    if via == "env":
        monkeypatch.setenv("SNAPCKPT_SHM_DIR", shm)
    else:
        opts["shm_dir"] = shm
    with pytest.raises(PersisterError) as ei:
        Checkpointer(snap_env.ckpt_dir, **opts)
    assert not isinstance(ei.value, PersisterTimeoutError), f"a timeout instead of the cause: {ei.value}"
    msg = str(ei.value)
    assert "persister.log" in msg and "Error" in msg and bad in msg, msg
    assert not [t for t in threading.enumerate() if t.name == "snapckpt-prefetch"]
    assert wait_until(lambda: not snap_env.persisters(), timeout=10)
