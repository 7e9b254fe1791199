"""Commit, tracker and crash consistency (cases B1-B9, C3, C5, C8) and contract 4 (commit last).

Everything here is real: persister processes, shared-memory arenas, files on disk, SIGKILL / SIGSTOP of
ranks and of the persister, RLIMIT_FSIZE on the live persister, and a slow persister through
``SNAPCKPT_FAULT_WRITE_DELAY_SECS`` (a sleep before each write call of the persister, read when the
persister starts; a one-tensor file takes about 40 write calls). Multi-rank jobs run
``tests/workers/commit_crash_worker.py`` under gloo.
"""
from __future__ import annotations

import errno
import json
import os
import queue
import resource
import shutil
import signal
import threading
import time
from typing import List, Optional

import pytest
import torch

from _harness import finish, gone, launch, result_lines, run_ranks, wait_until
from snapckpt import Checkpointer, StorageType
from snapckpt.errors import (CheckpointCorruptError, PersisterDiedError,
                             PersisterTimeoutError)
from snapckpt.ondisk.manifest import MANIFEST, check_checksums, list_committed
from snapckpt.persister.client import job_dirs, job_key
from snapckpt.storage.posix import PosixStorage
from workers.commit_crash_worker import consistent, make_state

WORKER = "commit_crash_worker.py"
DELAY = "SNAPCKPT_FAULT_WRITE_DELAY_SECS"
OPTS = dict(persister_idle_timeout_secs=5, commit_timeout_secs=30, request_timeout_secs=30,
            coordination_timeout_secs=30)
FS = PosixStorage()


# ------------------------------------------------------------------------------------------- helpers
def tracker(d: str) -> Optional[str]:
    try:
        with open(os.path.join(d, "latest")) as f:
            return f.read()
    except FileNotFoundError:
        return None


def committed_steps(d: str) -> List[int]:
    return [c.step for c in list_committed(FS, d)]


def steps_listed(d: str) -> List[str]:
    """Every entry of ``d`` about a step: step directories and hidden partial/replaced/deleted ones."""
    return sorted(n for n in FS.listdir(d) if "step_" in n)


def partials(d: str) -> List[str]:
    return [n for n in FS.listdir(d) if ".partial-" in n]


def manifest_steps(d: str) -> List[int]:
    """Steps named by every manifest.json anywhere under ``d`` (hidden directories included)."""
    steps = []
    for root, _, files in os.walk(d):
        if os.path.basename(root) == ".snapckpt" and "manifest.json" in files:
            try:
                with open(os.path.join(root, "manifest.json")) as f:
                    steps.append(json.load(f)["step"])
            except (OSError, ValueError):
                continue
    return steps


def step_dir(d: str, step: int) -> str:
    return os.path.join(d, f"step_{step:08d}")


def persister_log(snap_env, d: str) -> str:
    rt, _ = job_dirs(snap_env.runtime_root, snap_env.shm_root, job_key(d, None))
    try:
        with open(os.path.join(rt, "persister.log"), errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""



def bounded(fn, secs: float = 60):
    """Run ``fn()``; fail the test if it is still blocked after ``secs`` (a hang), else return/raise."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised on the test thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(secs)
    assert not t.is_alive(), f"{fn} still blocked after {secs} s: a hang"
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Lines:
    """Collects a process's output lines on a thread; ``wait_for(prefix)`` blocks (bounded) for one."""

    def __init__(self, proc) -> None:
        self.proc, self.q, self.seen = proc, queue.Queue(), []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def wait_for(self, prefix: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.seen.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no {prefix!r} line from pid {self.proc.pid}; output:\n" + "\n".join(self.seen))

    def rest(self) -> str:
        while True:
            line = self.q.get(timeout=30)
            if line is None:
                return "\n".join(self.seen)
            self.seen.append(line)


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)


def results(outs) -> List[dict]:
    recs = []
    for r, out in enumerate(outs):
        lines = result_lines(out)
        assert len(lines) == 1, f"rank {r} printed {len(lines)} RESULT lines:\n{out}"
        recs.append(json.loads(lines[0]))
    return recs


def restart_and_load(snap_env, nprocs: int = 2) -> List[dict]:
    """A restarted job: new rank processes on the same checkpoint_dir load the newest step."""
    recs = results(run_ranks(WORKER, nprocs, ["load", snap_env.ckpt_dir], snap_env.env, timeout=150))
    assert all(r["consistent"] for r in recs), recs
    assert len({(r["step"], r["tier"]) for r in recs}) == 1, f"ranks disagree: {recs}"
    return recs


def wait_crash_noticed(snap_env, ranks: int) -> None:
    """Block until the persister has seen ``ranks`` clients leave without close()."""
    assert wait_until(lambda: persister_log(snap_env, snap_env.ckpt_dir).count("disconnected without close()")
                      >= ranks, timeout=30), persister_log(snap_env, snap_env.ckpt_dir)


def assert_equal_state(out: dict, step: int) -> None:
    assert out["step"] == step and consistent(out, 0), f"loaded state of step {out['step']}, wanted {step}"


# ------------------------------------------------------------------------------------- contract 4
def test_contract4_commit_last_tracker_never_ahead_of_a_committed_dir(snap_env, monkeypatch):
    """Contract 4: a slow persister commits three steps with keep_last=1 while an observer polls the
    checkpoint directory. Right: the hidden partial directory is seen while the tracker still names the
    previous step; at every observation the tracker names a directory with a valid manifest, and no
    visible directory newer than the tracker lacks its manifest (rename after manifest, tracker after
    rename); at the end only the newest step is left, with the tracker on it."""
    monkeypatch.setenv(DELAY, "0.01")
    d = snap_env.ckpt_dir
    stop = threading.Event()
    violations: List[str] = []
    seen_partial_with_old_tracker = []

    def observe():
        while not stop.is_set():
            t = tracker(d)
            names = FS.listdir(d)
            committed = {c.dirname for c in list_committed(FS, d)}
            still = tracker(d) == t  # the tracker did not move while we looked
            if t is not None and t not in committed and still:
                violations.append(f"tracker names {t!r}, which has no valid manifest")
            tstep = int(t.split("_")[1]) if t else -1
            for n in names:
                if n.startswith("step_") and int(n.split("_")[1]) > tstep and still:
                    if os.path.isdir(os.path.join(d, n)) and not os.path.exists(os.path.join(d, n, MANIFEST)):
                        violations.append(f"{n} is visible without a manifest (tracker {t!r})")
                if n.startswith(f".step_{tstep + 1:08d}.partial-") and still:
                    seen_partial_with_old_tracker.append(n)
            stop.wait(0.003)

    with Checkpointer(d, keep_last=1, **OPTS) as ck:
        th = threading.Thread(target=observe, daemon=True)
        th.start()
        try:
            for step in (1, 2, 3):
                ck.save(make_state(step, 0), step).wait()
                assert tracker(d) == f"step_{step:08d}"
        finally:
            stop.set()
            th.join(10)
    assert not violations, violations[:5]
    assert seen_partial_with_old_tracker, "never observed an in-flight partial directory"
    assert committed_steps(d) == [3] and not partials(d)
    assert sorted(n for n in os.listdir(d) if not n.startswith(".")) == ["latest", "step_00000003"]


def test_contract5_a_commit_in_flight_is_not_retired_by_a_later_saves_retention(snap_env, monkeypatch):
    """Contract 5 (retention protects every in-flight checkpoint) when commits end out of order: step 1's
    commit is held after its rename, before its tracker (a fault point), while step 2 commits with
    ``keep_last=1``. Step 2's retention must not retire step 1, still in flight: until its commit is reported
    the other nodes' watchers read its manifest (one that vanished reads as an aborted commit there). Before,
    step 1 was gone when its commit answered. Step 1 is retired by its own retention once its commit has
    answered (not left until a next commit), and the tracker stays on step 2 throughout (step 1 is behind
    it). Step 1's commit is held until step 2's has ended and been checked (fault point ``action=wait``; a fixed
    sleep had to last 8 s: 3 s was not always enough on a loaded 2-core CI host, step 1's commit then answered
    first, and its own retention had retired it)."""
    release = os.path.join(snap_env.tmp, "release-step-1")
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT",  # the persister's
                       f"commit.before_tracker:step=1:action=wait:secs=60:path={release}")
    d = snap_env.ckpt_dir
    with Checkpointer(d, keep_last=1, **OPTS) as ck:
        h1 = ck.save(make_state(1, 0), 1)
        try:
            ck.save(make_state(2, 0), 2).wait()
            assert not h1.done()
            assert committed_steps(d) == [1, 2] and tracker(d) == "step_00000002"  # in place, still in flight
        finally:
            open(release, "w").close()
        h1.wait()
        assert wait_until(lambda: committed_steps(d) == [2], timeout=20), committed_steps(d)
        assert tracker(d) == "step_00000002"
        ck.save(make_state(3, 0), 3).wait()
    assert committed_steps(d) == [3] and tracker(d) == "step_00000003"


def test_contract4_commit_that_counts_a_marker_before_its_directory_fsync_fails_no_part(snap_env, monkeypatch):
    """Contract 4, the committer and the writer of one persister: the committer counts a part as soon as its
    marker is renamed into place, and may rename the partial directory before the writer has fsynced the
    marker's directory. The writer is held there (fault point ``persist.after_part_marker``, action=wait)
    until step 1 is committed, which the committer's backstop read does within about a second. Right: the
    part succeeds, ``wait()`` returns, step 1 loads. Found by a fresh-clone CI run with the persister under
    SCHED_BATCH (tests/test_resources.py::test_B4_disk_fills_during_the_write): the writer fsynced the
    directory by its old path and failed with FileNotFoundError on ``.step_00000001.partial-<run>/.snapckpt``
    after the step had committed, and ``wait()`` raised it."""
    d = snap_env.ckpt_dir
    release = os.path.join(snap_env.tmp, "release")
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", f"persist.after_part_marker:step=1:action=wait:path={release}")
    ck = Checkpointer(d, **OPTS)
    try:
        h = ck.save(make_state(1, 0), 1)
        assert wait_until(lambda: tracker(d) == "step_00000001", timeout=30), persister_log(snap_env, d)
        assert "SNAPCKPT_FAULT_POINT hit persist.after_part_marker rank=0 step=1" in persister_log(snap_env, d)
        assert not partials(d)  # committed while the writer is still held
        open(release, "w").close()
        # the writer's end decides what wait() answers: wait for it, then ask
        assert wait_until(lambda: "rank 0 step 1: part written" in persister_log(snap_env, d)
                          or "rank 0 step 1: writing the part failed" in persister_log(snap_env, d), timeout=30)
        bounded(lambda: h.wait(timeout=60))
        assert "writing the part failed" not in persister_log(snap_env, d)
        assert_equal_state(ck.load(step=1), 1)
    finally:
        open(release, "w").close()
        ck.close()
# ------------------------------------------------------------------------------------ kill test (a)
def test_C8_rank_killed_mid_snapshot_slot_invalid_restart_loads_previous(snap_env):
    """Kill test (a), case C8: rank 1 SIGKILLs itself halfway through copying step 2 into its arena slot
    (rank 0 completed step 2). Right: the surviving rank's next collective call (load) fails within its
    bound with an error naming rank 1; the persister marks rank 1's slot INVALID; a restarted job (new
    processes, same checkpoint_dir, persister still alive) loads step 1 on both ranks, never the torn
    step 2 and never a mix (every tensor holds step 1's values)."""
    snap_env.leftover_ok = True
    procs = launch(WORKER, 2, ["kill_in_copy", snap_env.ckpt_dir], snap_env.env)
    try:
        lines = [Lines(p) for p in procs]
        lines[1].wait_for("DYING")
        assert procs[1].wait(timeout=60) == -signal.SIGKILL
        rec0 = json.loads(lines[0].wait_for("RESULT")[len("RESULT"):])
        assert procs[0].wait(timeout=60) == 0, lines[0].rest()
    finally:
        kill_all(procs)
    assert rec0["error_type"] == "RankTimeoutError" and "[1]" in rec0["error"], rec0
    wait_crash_noticed(snap_env, 1)
    plog = persister_log(snap_env, snap_env.ckpt_dir)
    assert "marked INVALID" in plog
    # the log names the job's checkpoint directory (README: how to tell which persister is whose)
    assert f"checkpoint directory {os.path.abspath(snap_env.ckpt_dir)} " in plog, plog
    recs = restart_and_load(snap_env)
    assert [r["step"] for r in recs] == [1, 1], recs
    assert all(r["state_step"] == 1 for r in recs)


def test_C8_rank_killed_in_loop_of_large_saves_restart_loads_whole_step(snap_env):
    """Kill test (a), loop form: one process snapshots a 16 MiB state to memory in a tight loop and is
    SIGKILLed at an arbitrary moment (usually mid-copy). Right: a restarted process loads from memory a
    step the loop had announced, and every element of every tensor holds that step's value (the slot
    being written when the kill came is never loaded)."""
    snap_env.leftover_ok = True
    [proc] = launch(WORKER, 1, ["save_loop", snap_env.ckpt_dir], snap_env.env)
    try:
        lines = Lines(proc)
        lines.wait_for("SAVED 4")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        announced = max(int(l.split()[1]) for l in lines.rest().splitlines() if l.startswith("SAVED"))
    finally:
        kill_all([proc])
    wait_crash_noticed(snap_env, 1)
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        out = ck.load()
        assert ck.last_load.tier == StorageType.MEMORY
        assert announced <= out["step"] <= announced + 1
        assert ck.last_load.step == out["step"]
        assert consistent(out, 0), f"torn snapshot of step {out['step']}"


# ------------------------------------------------------------------------------------ kill test (b)
@pytest.mark.parametrize("next_call", ["save", "wait"])
def test_B2_persister_killed_mid_write_no_commit_record_then_died_error(snap_env, monkeypatch, next_call):
    """Kill test (b): a slow persister is SIGKILLed while it writes step 2 (its data file is half on
    disk). Right: no manifest for step 2 exists anywhere, the tracker still names step 1 and step 1
    verifies; the trainer's next call (``save`` or ``wait``) raises PersisterDiedError naming the dead
    persister's pid; the call after that works with a new persister, and both steps 1 and 3 load."""
    snap_env.leftover_ok = True
    d = snap_env.ckpt_dir
    monkeypatch.setenv(DELAY, "0.02")
    ck = Checkpointer(d, **OPTS)
    try:
        ck.save(make_state(1, 0), 1).wait()
        ck.save(make_state(2, 0, n_small=100, big_numel=3 << 20), 2)
        pid = ck.persister_pid
        partial_file = lambda: [os.path.join(d, p, "rank_00000.pt") for p in partials(d)]
        assert wait_until(lambda: any(os.path.exists(f) and os.path.getsize(f) > 0 for f in partial_file()),
                          timeout=60), "the persister never started writing step 2"
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: gone(pid), timeout=30)
        assert not any(os.path.exists(os.path.join(d, p, ".snapckpt", "part_00000.json")) for p in partials(d))
        assert 2 not in manifest_steps(d) and not os.path.exists(step_dir(d, 2))
        assert tracker(d) == "step_00000001" and committed_steps(d) == [1]
        c = list_committed(FS, d)[0]
        check_checksums(FS, c.path, c.manifest)
        monkeypatch.delenv(DELAY)
        with pytest.raises(PersisterDiedError) as ei:
            bounded(lambda: ck.save(make_state(3, 0), 3) if next_call == "save" else ck.wait())
        msg = str(ei.value)
        assert str(pid) in msg and ("died" in msg or "lost" in msg), msg
        assert "new persister" in msg and "repeat" in msg, msg  # the fix, whichever way the death was seen
        bounded(lambda: ck.save(make_state(3, 0), 3).wait())
        assert ck.persister_pid != pid
        assert tracker(d) == "step_00000003" and committed_steps(d) == [1, 3]
        assert_equal_state(ck.load(), 3)
        assert_equal_state(ck.load(step=1), 1)
        assert ck.last_load.tier == StorageType.DISK
    finally:
        ck.close()


# ------------------------------------------------------------------------------------ kill test (c)
def test_B1_job_and_persister_killed_before_commit_previous_checkpoint_kept(snap_env):
    """Kill test (c), case B1: 2 ranks, keep_last=1, flush_on_crash=False, a slow persister. Step 1 is
    committed; step 2 is snapshotted to DISK; then every rank is SIGKILLed while step 2 is still being
    written, and then the persister too (the node died). Right: at both moments the tracker names
    step 1 and step 1 is committed and intact (retention did not delete it ahead of step 2's commit),
    step 2 is only a hidden partial directory; a restarted job loads step 1 from disk on both ranks."""
    snap_env.leftover_ok = True
    d = snap_env.ckpt_dir
    # step 2's parts are held before their markers (never released: the persister is killed there), so step 2
    # is still being written at both moments however late this process gets to look (a slow persister alone
    # left a window of a few seconds, which a loaded machine may let pass)
    never = os.path.join(snap_env.tmp, "never")
    env = {**snap_env.env, DELAY: "0.02",
           "SNAPCKPT_FAULT_POINT": f"persist.before_part_marker:step=2:action=wait:path={never}"}
    procs = launch(WORKER, 2, ["crash_after_save", d, "0", "disk", "150"], env)
    try:
        for l in [Lines(p) for p in procs]:
            l.wait_for("SAVED 2")
        kill_all(procs)
    finally:
        kill_all(procs)
    [pers] = snap_env.persisters()
    assert wait_until(lambda: partials(d), timeout=30), "step 2 is not being written"
    for moment in ("ranks killed", "persister killed"):
        assert tracker(d) == "step_00000001", moment
        assert committed_steps(d) == [1], moment
        c = list_committed(FS, d)[0]
        check_checksums(FS, c.path, c.manifest)
        assert not os.path.exists(step_dir(d, 2)) and 2 not in manifest_steps(d), moment
        assert any(p.startswith(".step_00000002.partial-") for p in partials(d)), moment
        if moment == "ranks killed":
            pers.kill()
            assert wait_until(lambda: gone(pers.pid), timeout=30)
    recs = restart_and_load(snap_env)
    assert [(r["step"], r["tier"]) for r in recs] == [(1, "disk"), (1, "disk")], recs
    assert not partials(d), "the restarted job's persister did not remove the dead run's partial"


def test_B1_another_jobs_dead_partial_is_removed_once_provably_dead(snap_env, monkeypatch):
    """B1 across jobs: job "a"'s persister is killed (kill -9) while it writes step 2, leaving its partial
    directory; the next job saving there is another job (``job_id="b"``), whose start never removed "a"'s
    leftovers. Right: while it is fresh, ``ls`` lists it as incomplete and b's start keeps it (its writer may
    live on another host); once nothing changed in it for 10 minutes (mtimes set back: real time passing)
    and no persister of "a" runs here, ``ls`` lists it as no checkpoint (a warning naming it) and the next
    start of b removes it; a partial of a job whose persister is alive is kept however old; step 1 loads."""
    import subprocess
    import sys

    snap_env.leftover_ok = True  # job a's arena outlives its killed persister
    d = snap_env.ckpt_dir

    def age(path):  # every entry's mtime an hour back
        for root, dirs, files in os.walk(path):
            for n in dirs + files:
                os.utime(os.path.join(root, n), (time.time() - 3600,) * 2)
        os.utime(path, (time.time() - 3600,) * 2)

    def ls():
        r = subprocess.run([sys.executable, "-m", "snapckpt", "ls", d], capture_output=True, text=True,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert r.returncode == 0, r.stderr
        return r.stdout

    monkeypatch.setenv(DELAY, "0.2")
    ck = Checkpointer(d, job_id="a", **OPTS)
    ck.save(make_state(1, 0), 1).wait()
    ck.save({f"t{i}": torch.ones(1000) for i in range(50)}, 2)
    assert wait_until(lambda: partials(d), timeout=30)
    pid = ck.persister_pid
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: gone(pid), timeout=30)
    with pytest.raises(PersisterDiedError):
        ck.close()
    monkeypatch.delenv(DELAY)
    [left] = partials(d)
    assert "incomplete" in ls()
    with Checkpointer(d, job_id="b", **OPTS) as ck:  # fresh: its writer might be alive elsewhere
        assert partials(d) == [left]
    age(os.path.join(d, left))
    out = ls()
    assert "incomplete" not in out and f"warning: {left}" in out and "dead save" in out, out
    live = Checkpointer(d, job_id="c", **OPTS)  # another job whose persister lives
    try:
        planted = os.path.join(d, f".step_00000009.partial-{live.run_id}")
        os.makedirs(os.path.join(planted, ".snapckpt"))
        age(planted)
        with Checkpointer(d, job_id="b", **OPTS) as ck:
            assert partials(d) == [os.path.basename(planted)]  # a's is gone, c's is kept: its persister lives
            assert ck.load()["step"] == 1 and ck.last_load.step == 1
    finally:
        live.close()


def test_save_next_to_another_world_sizes_checkpoints(snap_env, caplog):
    """A 2-rank job committed steps 4 and 5; a 1-rank job (a resume with another world size, e.g. a Trainer
    resumed at another DDP size, which goes on from an earlier step) saves into the same directory. Right:
    allowed, never silent: its first save warns once and emits a ``world_size_changed`` event naming the
    other world size and its checkpoints; step 6 commits next to them; its DISK save of step 5 replaces the
    2-rank run's step 5 (as a re-save of a step does) with a second warning and event naming the replaced
    directory, both world sizes and how to keep it; step 4 stays the 2-rank run's, step 5 loads back."""
    import logging

    d = snap_env.ckpt_dir
    run_ranks(WORKER, 2, ["save_steps", d, "4", "5"], snap_env.env)
    events = []
    with caplog.at_level(logging.WARNING, logger="snapckpt.engine.saver"):
        with Checkpointer(d, keep_last=None, **OPTS) as ck:
            ck.add_listener(events.append)
            ck.save(make_state(6, 0), 6).wait()
            ck.save(make_state(5, 0), 5).wait()
            assert ck.load(step=5)["step"] == 5 and ck.last_load.step == 5
    changed = [e.reason for e in events if e.kind == "world_size_changed"]
    assert len(changed) == 2, events
    assert "world size [2]" in changed[0] and "step_00000005" in changed[0] and "world size 1" in changed[0]
    assert f"replaces {os.path.join(d, 'step_00000005')}" in changed[1] and "world size 2" in changed[1]
    assert "another step or tag" in changed[1], changed[1]
    assert sum("world size" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 2
    assert committed_steps(d) == [4, 5, 6] and not partials(d)
    ws = {s: json.loads(open(os.path.join(step_dir(d, s), MANIFEST)).read())["world_size"] for s in (4, 5, 6)}
    assert ws == {4: 2, 5: 1, 6: 1}


def test_B1_in_flight_commit_completes_after_job_killed_tracker_moves_last(snap_env):
    """Case B1 with the node alive: 2 ranks, keep_last=1, a slow persister; SIGKILL both ranks right
    after ``save(step 2, DISK)`` returned. Right: the persister finishes step 2 on its own; while it does,
    the tracker names step 1 and step 1 exists (retention waits for the new commit); the tracker moves
    to step 2 only once step 2 has its manifest, then step 1 is rotated away and step 2 verifies."""
    snap_env.leftover_ok = True
    d = snap_env.ckpt_dir
    # step 2's parts are held before their markers until the ranks are dead and the tracker was seen naming
    # step 1 (with a slow persister alone, a loaded machine could let step 2 commit before the first look)
    release = os.path.join(snap_env.tmp, "release")
    env = {**snap_env.env, DELAY: "0.02",
           "SNAPCKPT_FAULT_POINT": f"persist.before_part_marker:step=2:action=wait:path={release}"}
    procs = launch(WORKER, 2, ["crash_after_save", d, "0", "disk", "30"], env)
    try:
        for l in [Lines(p) for p in procs]:
            l.wait_for("SAVED 2")
    finally:
        kill_all(procs)
    observed = []

    def check():
        t = tracker(d)
        observed.append(t)
        assert t in ("step_00000001", "step_00000002"), t
        if t == "step_00000001":
            assert os.path.exists(os.path.join(step_dir(d, 1), MANIFEST)) or tracker(d) != t
        else:
            assert os.path.exists(os.path.join(step_dir(d, 2), MANIFEST))
        return t == "step_00000002"

    try:
        assert not check() and observed == ["step_00000001"], "step 2 was already committed when the ranks died"
    finally:
        open(release, "w").close()
    assert wait_until(check, timeout=60, interval=0.005)
    assert wait_until(lambda: committed_steps(d) == [2], timeout=10)
    c = list_committed(FS, d)[0]
    check_checksums(FS, c.path, c.manifest)


@pytest.mark.parametrize("flush_on_crash", [False, True])
def test_B8_job_killed_after_memory_snapshot_never_loses_progress(snap_env, flush_on_crash):
    """Kill test (c), case B8: 2 ranks, keep_last=1; step 1 committed, step 2 snapshotted to MEMORY
    only, then every rank is SIGKILLed. Right with flush_on_crash=False: nothing is flushed, the tracker
    still names step 1, which retention kept. Right with the default flush_on_crash=True: the persister
    writes and commits step 2 (tracker moves, files verify). Either way a restarted job (new processes,
    same checkpoint_dir) loads step 2 from memory, since the persister is still alive."""
    snap_env.leftover_ok = True
    d = snap_env.ckpt_dir
    procs = launch(WORKER, 2, ["crash_after_save", d, "1" if flush_on_crash else "0", "memory", "0"],
                   snap_env.env)
    try:
        for l in [Lines(p) for p in procs]:
            l.wait_for("SAVED 2")
    finally:
        kill_all(procs)
    wait_crash_noticed(snap_env, 2)
    if flush_on_crash:
        assert wait_until(lambda: tracker(d) == "step_00000002", timeout=60), persister_log(snap_env, d)
        assert wait_until(lambda: committed_steps(d) == [2], timeout=10)
        c = list_committed(FS, d)[0]
        check_checksums(FS, c.path, c.manifest)
    else:
        assert "flushing" not in persister_log(snap_env, d)
        assert tracker(d) == "step_00000001" and committed_steps(d) == [1]
        assert not os.path.exists(step_dir(d, 2)) and not partials(d)
    recs = restart_and_load(snap_env)
    assert [(r["step"], r["tier"]) for r in recs] == [(2, "memory"), (2, "memory")], recs


# ----------------------------------------------------------------------------------------------- B2
def test_B2_job_killed_while_files_half_written_resume_skips_partial(snap_env):
    """B2: one process with a slow persister commits step 1, snapshots a 12 MiB step 2, and the whole
    job (trainer and persister) is SIGKILLed while step 2's file is half on disk. A visible directory
    without a manifest (a copy of step 1 named step_00000003, as a non-atomic writer would leave) is
    added. Right: auto-resume (``load()``, ``latest_step()``) picks step 1 from disk, never the partial
    directory nor the manifest-less one; the restarted persister removes the dead run's partial."""
    snap_env.leftover_ok = True
    d = snap_env.ckpt_dir
    # the persister is held in the middle of step 2's file (never released: it is killed there), so the kill
    # finds the file half written however late it comes (a slow persister alone left a few seconds)
    never = os.path.join(snap_env.tmp, "never")
    env = {**snap_env.env, DELAY: "0.02", "SNAPCKPT_FAULT_POINT": f"persist.mid_file:step=2:action=wait:path={never}"}
    [proc] = launch(WORKER, 1, ["slow_disk", d, "100"], env)
    try:
        Lines(proc).wait_for("SAVED 2")
        assert wait_until(lambda: any(os.path.exists(os.path.join(d, p, "rank_00000.pt"))
                                      and os.path.getsize(os.path.join(d, p, "rank_00000.pt")) > 0
                                      for p in partials(d)), timeout=60)
    finally:
        kill_all([proc])
        snap_env.kill_persisters(signal.SIGKILL)
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)
    [partial] = partials(d)
    assert not os.path.exists(os.path.join(d, partial, MANIFEST))
    shutil.copytree(step_dir(d, 1), step_dir(d, 3))
    os.unlink(os.path.join(step_dir(d, 3), MANIFEST))
    ck = Checkpointer(d, **OPTS)  # right after the kill: the dead persister's socket file is still there
    with ck:
        assert ck.latest_step() == 1
        assert_equal_state(ck.load(), 1)
        assert (ck.last_load.step, ck.last_load.tier) == (1, StorageType.DISK)
        assert not partials(d)


# ------------------------------------------------------------------------------- B1, replacing commit
def test_B1_persister_killed_between_the_renames_of_a_recommit_restores_the_old_step(snap_env, monkeypatch):
    """B1 while a step directory is replaced (a re-save of step 1, keep_last=1: the only checkpoint): the
    persister is SIGKILLed at ``commit.between_renames``, after moving ``step_00000001`` aside to
    ``.step_00000001.replaced-R`` and before renaming the new copy into place, so no ``step_00000001``
    exists. Right: the next persister of the job renames the old (committed) copy back, says so in its
    log, and discards the interrupted new copy; ``load()`` returns the old step 1. Then a hand-made
    ``.replaced-`` leftover whose step directory exists (a crash after the second rename) is deleted and
    the step directory kept."""
    snap_env.leftover_ok = True
    d = snap_env.ckpt_dir
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", "commit.between_renames:step=1")
    ck = Checkpointer(d, keep_last=1, **OPTS)
    try:
        ck.save(make_state(1, 0), 1).wait()
        pid = ck.persister_pid
        ck.save(make_state(2, 0), 1)  # other contents under the same step: tells the two copies apart
        assert wait_until(lambda: gone(pid), timeout=60), "the fault point did not kill the persister"
        with pytest.raises(PersisterDiedError):
            bounded(ck.wait)
    finally:
        try:
            ck.close()
        except PersisterDiedError:
            pass
    names = sorted(FS.listdir(d))
    assert "step_00000001" not in names, names
    assert any(n.startswith(".step_00000001.replaced-") for n in names), names
    assert any(n.startswith(".step_00000001.partial-") for n in names), names
    monkeypatch.delenv("SNAPCKPT_FAULT_POINT")
    moved = d + "_copied"  # the same crash state in a copied directory: another job key (found by a trial)
    shutil.copytree(d, moved, symlinks=True)
    with Checkpointer(d, keep_last=1, **OPTS) as ck:
        assert "restored" in persister_log(snap_env, d) and ".step_00000001.replaced-" in persister_log(snap_env, d)
        assert steps_listed(d) == ["step_00000001"] and tracker(d) == "step_00000001"
        assert_equal_state(ck.load(), 1)  # the old copy, not the interrupted one (step 2's contents)
        assert (ck.last_load.step, ck.last_load.tier) == (1, StorageType.DISK)
    stale = os.path.join(d, ".step_00000001.replaced-" + job_key(d, None) + "f" * 12)
    shutil.copytree(step_dir(d, 1), stale)
    with Checkpointer(d, keep_last=1, **OPTS) as ck:
        assert steps_listed(d) == ["step_00000001"] and tracker(d) == "step_00000001"
        assert_equal_state(ck.load(), 1)
    with Checkpointer(moved, keep_last=1, **OPTS) as ck:
        assert steps_listed(moved) == ["step_00000001"], sorted(FS.listdir(moved))
        assert_equal_state(ck.load(), 1)
    assert "restored" in persister_log(snap_env, moved)  # the warning keeps the log after a clean exit
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)
    rt, _ = job_dirs(snap_env.runtime_root, snap_env.shm_root, job_key(moved, None))
    assert "restored" in persister_log(snap_env, moved)  # kept after the exit too, but not a stale pid file
    assert not os.path.exists(os.path.join(rt, "persister.pid")), os.listdir(rt)


# ----------------------------------------------------------------------------------------------- B3
def _truncate(path: str, data_only: bool) -> List[str]:
    done = []
    for root, _, files in os.walk(path):
        if data_only and os.path.basename(root) == ".snapckpt":
            continue
        for f in files:
            os.truncate(os.path.join(root, f), 0)
            done.append(f)
    return done


def _flip_byte(path: str) -> None:
    f = os.path.join(path, "rank_00000.pt")
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["truncate_all", "truncate_data", "flip_byte"])
def test_B3_power_loss_damage_detected_and_falls_back(snap_env, caplog, capsys, damage):
    """B3: steps 1 and 2 are committed; then the newest is damaged as a power loss would leave it: every
    file truncated to 0 bytes (manifest included), only its data files truncated, or one byte of a data
    file flipped. Right: ``snapckpt verify`` reports step 2 as damaged naming the file; a new job's
    ``load()`` falls back to step 1 from disk with a warning naming step 2; ``load(step=2)`` never loads
    it: CheckpointCorruptError naming the damaged data file, or, when the manifest itself is gone (no
    commit record), CheckpointCorruptError saying that step 2's manifest is unreadable (damage, never "not
    found")."""
    from snapckpt.cli import main as cli_main

    d = snap_env.ckpt_dir
    with Checkpointer(d, **OPTS) as ck:
        ck.save(make_state(1, 0), 1).wait()
        ck.save(make_state(2, 0), 2).wait()
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)  # no memory tier left
    if damage == "flip_byte":
        _flip_byte(step_dir(d, 2))
    else:
        assert "rank_00000.pt" in _truncate(step_dir(d, 2), data_only=damage == "truncate_data")
    capsys.readouterr()
    assert cli_main(["verify", d]) == 1
    report = capsys.readouterr().out
    assert "step_00000002" in report and "step_00000001" in report, report
    if damage != "truncate_all":
        assert "rank_00000.pt" in report, report
    with Checkpointer(d, **OPTS) as ck:
        caplog.clear()
        with caplog.at_level("WARNING", logger="snapckpt"):
            out = ck.load()
        assert_equal_state(out, 1)
        assert (ck.last_load.step, ck.last_load.tier) == (1, StorageType.DISK)
        warned = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        assert "step_00000002" in warned or "step 2" in warned, warned
        if damage == "truncate_all":  # no readable commit record: not a checkpoint, and the error says why
            with pytest.raises(CheckpointCorruptError, match=r"step_00000002: manifest is not valid JSON"):
                ck.load(step=2)
        else:
            with pytest.raises(CheckpointCorruptError, match=r"step_00000002/rank_00000.pt (is 0 bytes|has xxh3_64)"):
                ck.load(step=2)


# ----------------------------------------------------------------------------------------------- B4
@pytest.mark.parametrize("numel", [256 << 10, 3 << 20], ids=["1MiB_buffered", "12MiB_past_buffer"])
def test_B4_full_disk_efbig_reaches_trainer_previous_intact(snap_env, numel):
    """B4: the live persister gets RLIMIT_FSIZE of 512 KiB (SIGXFSZ is ignored by Python processes, so a
    write past it fails with EFBIG, as on a full disk); its arena slots were sized before, so only the
    checkpoint write fails. A state of 1 MiB (error at the final flush) or 12 MiB (error inside the zip
    writer) is saved to DISK. Right: the trainer's next ``save`` raises OSError with errno EFBIG (the
    original type, context noted); ``wait()`` of a later failing save raises it too; the persister
    survives; no partial directory is left; small saves still commit; a new job loads the newest good
    step from disk and the older one too."""
    d = snap_env.ckpt_dir
    ck = Checkpointer(d, **OPTS)
    try:
        ck.save(make_state(1, 0), 1).wait()
        big = lambda step: make_state(step, 0, big_numel=numel)
        ck.save(big(2), 2, StorageType.MEMORY)  # size both arena slots before the limit
        ck.save(big(3), 3, StorageType.MEMORY)
        pid = ck.persister_pid
        with open(f"/proc/{pid}/status") as f:
            sigign = int(next(l for l in f if l.startswith("SigIgn:")).split()[1], 16)
        assert sigign & (1 << (signal.SIGXFSZ - 1)), "the persister does not ignore SIGXFSZ"
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (512 << 10, resource.RLIM_INFINITY))
        h4 = ck.save(big(4), 4)
        assert wait_until(h4.done, timeout=60)
        with pytest.raises(OSError) as ei:
            ck.save(make_state(5, 0), 5)
        assert type(ei.value) is OSError and ei.value.errno == errno.EFBIG, repr(ei.value)
        assert "step 4" in " ".join(getattr(ei.value, "__notes__", [])), ei.value
        # the cause and the fix: the file being written, and what to change
        assert ei.value.filename and os.path.basename(ei.value.filename) == "rank_00000.pt", repr(ei.value)
        assert "ulimit -f" in " ".join(ei.value.__notes__), ei.value.__notes__
        ck.save(make_state(5, 0), 5).wait()
        h6 = ck.save(big(6), 6)
        with pytest.raises(OSError) as ei:
            bounded(lambda: h6.wait(timeout=60))
        assert ei.value.errno == errno.EFBIG
        assert ck.persister_pid == pid and not gone(pid)
        assert wait_until(lambda: not partials(d), timeout=30), partials(d)
        assert not os.path.exists(step_dir(d, 4)) and not os.path.exists(step_dir(d, 6))
        assert committed_steps(d) == [1, 5] and tracker(d) == "step_00000005"
    finally:
        ck.close()
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)
    with Checkpointer(d, **OPTS) as ck:
        assert_equal_state(ck.load(), 5)
        assert ck.last_load.tier == StorageType.DISK
        assert_equal_state(ck.load(step=1), 1)


def test_B4_failed_partial_is_deleted_off_the_lock_and_a_resave_waits_for_it(snap_env, monkeypatch):
    """B4, then a slow filesystem: step 2's part fails (ENOSPC) and the deletion of its partial directory is
    held (fault point ``commit.remove_failed_partial``, action=wait). Right: meanwhile the persister serves
    every request (it deletes without the server lock): a MEMORY save and the DISK save of step 3 go through;
    a save of step 2 again, to the same directory, neither writes nor commits into the directory being
    deleted: it waits, then commits once the deletion ends, and loads back as the new state."""
    d = snap_env.ckpt_dir
    plan, release = os.path.join(snap_env.tmp, "plan.json"), os.path.join(snap_env.tmp, "release")
    with open(plan, "w") as f:
        json.dump({"phase": "write", "errno": errno.ENOSPC, "rank": 0, "step": 2}, f)
    monkeypatch.setenv("SNAPCKPT_FAULT_STORAGE", "@" + plan)
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", f"commit.remove_failed_partial:step=2:action=wait:path={release}")
    ck = Checkpointer(d, **OPTS)
    try:
        ck.save(make_state(1, 0), 1).wait()
        with pytest.raises(OSError) as ei:
            bounded(lambda: ck.save(make_state(2, 0), 2).wait())
        assert ei.value.errno == errno.ENOSPC, repr(ei.value)
        assert wait_until(lambda: "hit commit.remove_failed_partial" in persister_log(snap_env, d), timeout=30)
        open(plan, "w").close()  # no more storage faults
        bounded(lambda: ck.save(make_state(3, 0), 3, StorageType.MEMORY).wait(), 30)
        bounded(lambda: ck.save(make_state(4, 0), 4).wait(), 30)  # the lock is free during the deletion
        assert tracker(d) == "step_00000004" and len(partials(d)) == 1
        again = {**make_state(5, 0), "step": 2}  # step 2 again, another state
        h = ck.save(again, 2)
        time.sleep(1.5)
        assert not h.done() and not os.path.exists(step_dir(d, 2)) and len(partials(d)) == 1
        open(release, "w").close()
        bounded(lambda: h.wait(timeout=60))
        assert tracker(d) == "step_00000002" and not partials(d) and committed_steps(d) == [1, 2, 4]
        out = ck.load(step=2)
        assert out["step"] == 2 and torch.equal(out["w"], again["w"])
    finally:
        open(release, "w").close()
        ck.close()
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)  # a new job, not the exiting persister
    with Checkpointer(d, **OPTS) as ck:  # from disk, in a new job
        out = ck.load(step=2)
        assert ck.last_load.tier == StorageType.DISK and out["step"] == 2 and torch.equal(out["w"], again["w"])


def test_B4_a_tag_saved_again_as_soon_as_its_save_failed_keeps_its_files(snap_env):
    """B4 under a fixed tag, 2 ranks: rank 0's part of step 1 (``best``) fails with ENOSPC while rank 1's is
    held in the middle of its file (fault point ``persist.mid_file``); the commit fails, both ranks hear it and
    save ``best`` again at once (step 2). Right: step 2 waits for step 1's save to be over (rank 1's writer,
    then the deletion of its partial directory), then commits with each rank's step-2 values (before the fix:
    step 2 wrote into the partial directory at once, and the deletion that followed rank 1's writer took its
    files: step 2 failed with ENOENT). Step 2's commit is held before its rename (``commit.before_rename``) so
    that, before the fix, that deletion comes first whatever the timing."""
    d = snap_env.ckpt_dir
    go, release, rename = (os.path.join(snap_env.tmp, n) for n in ("go", "release", "rename"))
    env = {**snap_env.env,
           "SNAPCKPT_FAULT_STORAGE": json.dumps({"phase": "write", "errno": errno.ENOSPC, "rank": 0, "step": 1}),
           "SNAPCKPT_FAULT_POINT": f"persist.mid_file:rank=1:step=1:action=wait:path={release};"
                                   f"commit.before_rename:step=2:action=wait:path={rename}"}
    procs = launch(WORKER, 2, ["resave_tag_after_failure", d, go], env)
    try:
        def seen(text: str) -> bool:
            return text in persister_log(snap_env, d)

        # rank 1's part of step 1 is held before rank 0 saves step 1 (else the commit failed first, and rank 1's
        # part was never written: step 1's save was over at once)
        assert wait_until(lambda: seen("hit persist.mid_file rank=1 step=1"), timeout=120), persister_log(snap_env, d)
        open(go, "w").close()
        # step 2 either waits for step 1's save (right) or has written and reached its commit (the bug)
        written = "SNAPCKPT_FAULT_POINT hit commit.before_rename rank=None step=2"
        assert wait_until(lambda: seen("waits for the save of step 1 of best") or seen(written), timeout=120), \
            persister_log(snap_env, d)
        early = seen(written)
        open(release, "w").close()  # rank 1's writer of step 1 goes on: the failed save is over once it ends
        if early:  # the failed save's deletion, then step 2's rename
            assert wait_until(lambda: not partials(d), timeout=60)
        open(rename, "w").close()
        outs = finish(procs, timeout=200)
    finally:
        for path in (go, release, rename):
            open(path, "w").close()
        kill_all(procs)
    res = {r["rank"]: r for r in (json.loads(line) for o in outs for line in result_lines(o))}
    assert sorted(res) == [0, 1], outs
    assert res[0]["errors"]["1"] and res[1]["errors"]["1"], res  # rank 0: its ENOSPC, rank 1: the commit's
    assert res[0]["errors"]["2"] is None and res[1]["errors"]["2"] is None, res
    with open(os.path.join(d, "best", MANIFEST)) as f:
        assert json.load(f)["step"] == 2
    for r in (0, 1):
        w = torch.load(os.path.join(d, "best", f"rank{r}.pt"))["w"]
        assert torch.equal(w, torch.full((1 << 16,), float(200 + r)))
    assert not partials(d)


def test_a_tag_saved_again_while_its_previous_save_is_in_flight_does_not_block_the_training_thread(
        snap_env, monkeypatch):
    """A fixed tag (``best``, tracker ``latest``) saved at step 1, its commit held after the rename
    (``commit.before_tracker``, action=wait), then at step 2. Right: step 2's ``save_files`` returns while step
    1's save is still held (the persister orders the two: step 2's writer waits for step 1's save, so nothing
    of step 2 is in ``best`` yet); once released, both commit in save order, ``best`` holds step 2's bytes and
    ``latest`` names step 2 (before the fix: step 2's save waited on the training thread for step 1's commit,
    here until the release, which ``bounded`` reports as a hang)."""
    d = snap_env.ckpt_dir
    release = os.path.join(snap_env.tmp, "release")
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", f"commit.before_tracker:step=1:action=wait:path={release}")
    files = {s: {"a.pt": {"w": torch.full((1 << 12,), float(s))}} for s in (1, 2)}

    def save(step: int):
        return ck.save_files(files[step], step, StorageType.DISK, dirname="best", tracker_name="latest",
                             tracker_content=f"best@{step}")

    ck = Checkpointer(d, **OPTS)
    try:
        h1 = save(1)
        assert wait_until(lambda: "hit commit.before_tracker rank=None step=1" in persister_log(snap_env, d),
                          timeout=60), persister_log(snap_env, d)
        h2 = bounded(lambda: save(2), 60)  # returns while step 1's commit is held
        assert not h1.done() and not h2.done()
        assert wait_until(lambda: "waits for the save of step 1 of best" in persister_log(snap_env, d), timeout=60)
        with open(os.path.join(d, "best", MANIFEST)) as f:  # step 1 renamed into place, step 2 not written
            assert json.load(f)["step"] == 1
        assert torch.equal(torch.load(os.path.join(d, "best", "a.pt"))["w"], files[1]["a.pt"]["w"])
        assert tracker(d) is None and not partials(d)
        open(release, "w").close()
        bounded(lambda: h1.wait(timeout=60))
        bounded(lambda: h2.wait(timeout=60))
        ck.poll()  # no failure left to report
    finally:
        open(release, "w").close()
        ck.close()
    with open(os.path.join(d, "best", MANIFEST)) as f:
        assert json.load(f)["step"] == 2
    assert torch.equal(torch.load(os.path.join(d, "best", "a.pt"))["w"], files[2]["a.pt"]["w"])
    assert tracker(d) == "best@2" and not partials(d)


def test_a_step_saved_again_while_its_first_save_is_in_flight_each_handle_ends_with_its_own_save(
        snap_env, monkeypatch):
    """Step 1 saved, its commit held before the rename; step 1 saved again (other values): ``save`` returns at
    once, the persister starts the second save once the first is over. The first commit's rename then fails
    (ENOSPC). Right: the first handle raises that failure, the second commits the new values (each handle asks
    for its own save, by the snapshot it handed over; before, both asked for "step 1" and the first handle,
    asked after the second save had replaced the first, answered "committed": the failure was lost)."""
    d = snap_env.ckpt_dir
    plan, r1, r2 = (os.path.join(snap_env.tmp, n) for n in ("plan.json", "r1", "r2"))
    with open(plan, "w") as f:
        json.dump({"phase": "rename", "errno": errno.ENOSPC, "step": 1}, f)
    monkeypatch.setenv("SNAPCKPT_FAULT_STORAGE", "@" + plan)
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", f"commit.before_rename:step=1:action=wait:path={r1};"
                                               f"commit.remove_failed_partial:step=1:action=wait:path={r2}")
    ck = Checkpointer(d, **OPTS)
    try:
        h1 = ck.save(make_state(1, 0), 1)
        assert wait_until(lambda: "hit commit.before_rename rank=None step=1" in persister_log(snap_env, d),
                          timeout=60), persister_log(snap_env, d)
        again = {**make_state(5, 0), "step": 1}
        h2 = bounded(lambda: ck.save(again, 1), 60)  # not refused, not waited for
        open(r1, "w").close()  # the first save's rename fails; its partial directory's deletion is held
        assert wait_until(lambda: "hit commit.remove_failed_partial" in persister_log(snap_env, d), timeout=60)
        open(plan, "w").close()  # no more storage faults for the second save
        open(r2, "w").close()
        bounded(lambda: h2.wait(timeout=60))
        with pytest.raises(OSError) as ei:
            bounded(lambda: h1.wait(timeout=60))
        assert ei.value.errno == errno.ENOSPC, repr(ei.value)
        ck.poll()  # each failure is raised once
        assert tracker(d) == "step_00000001" and not partials(d)
        out = ck.load(step=1)
        assert torch.equal(out["w"], again["w"])
    finally:
        for path in (r1, r2):
            open(path, "w").close()
        ck.close()


# ----------------------------------------------------------------------------------------------- B5
def test_B5_stopped_persister_times_out_and_nothing_is_marked_complete(snap_env, monkeypatch):
    """B5: a slow persister is SIGSTOPped right after ``save(step 2)`` returned. Right: ``wait()`` ends
    with PersisterTimeoutError within the bound (request_timeout_secs=2), and so does the next ``save``
    (it cannot reconnect); meanwhile step 2 has no manifest and the tracker still names step 1. After
    SIGCONT, once the persister has read the connections the rank gave up (each ends with ``abandon``),
    it has not taken the live rank for dead, and the job goes on: a new save commits and loads (CI under
    load failed that save with PeerLostError when the ends of the given-up streams counted as a crash)."""
    d = snap_env.ckpt_dir
    monkeypatch.setenv(DELAY, "0.02")
    ck = Checkpointer(d, **{**OPTS, "request_timeout_secs": 2})
    pid = None
    try:
        ck.save(make_state(1, 0), 1).wait()
        ck.save(make_state(2, 0), 2)
        pid = ck.persister_pid
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(PersisterTimeoutError, match=str(pid)):
            bounded(ck.wait)
        assert tracker(d) == "step_00000001" and 2 not in manifest_steps(d)
        with pytest.raises(PersisterTimeoutError):
            bounded(lambda: ck.save(make_state(3, 0), 3))
        assert tracker(d) == "step_00000001" and 2 not in manifest_steps(d)
        assert not os.path.exists(step_dir(d, 2))
        os.kill(pid, signal.SIGCONT)
        assert wait_until(lambda: persister_log(snap_env, d).count("gave up a request that timed out") == 2,
                          timeout=30), persister_log(snap_env, d)
        assert "disconnected without close()" not in persister_log(snap_env, d)
        bounded(lambda: ck.save(make_state(3, 0), 3).wait())
        assert tracker(d) == "step_00000003"
        assert_equal_state(ck.load(), 3)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        ck.close()


def test_B5_rank_that_gave_up_a_hung_persister_and_exited_is_a_crash(snap_env):
    """B5, then the rank dies: step 1 committed, step 2 in memory, the persister SIGSTOPped; the rank's next
    save times out (its connection given up with ``abandon``) and the process exits without close().
    Right: after SIGCONT the persister sees that the rank's process is gone, takes it for a crash and
    flushes step 2 to disk, as for any crash; the restart loads step 2 (before: the persister waited its
    idle timeout for a reconnect that never came and exited, dropping step 2; the restart loaded step 1)."""
    d = snap_env.ckpt_dir
    [proc] = launch(WORKER, 1, ["hung_then_exit", d], snap_env.env)
    pid = None
    try:
        lines = Lines(proc)
        pid = int(lines.wait_for("STOPPED").split()[1])
        assert json.loads(result_lines(lines.wait_for("RESULT"))[0]) == {"error_type": "PersisterTimeoutError"}
        assert proc.wait(timeout=30) == 1 and tracker(d) == "step_00000001"
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        kill_all([proc])
    assert wait_until(lambda: tracker(d) == "step_00000002", timeout=30), persister_log(snap_env, d)
    assert "exited without reconnecting: taken for a crash" in persister_log(snap_env, d)
    with Checkpointer(d, **OPTS) as ck:
        assert_equal_state(ck.load(), 2)
        assert ck.last_load.step == 2  # from memory: the persister still serves it


# ----------------------------------------------------------------------------------------------- B6
def test_B6_events_distinguish_snapshot_from_commit_tracker_moves_on_commit(snap_env, monkeypatch):
    """B6: a slow persister, keep_last=1, a listener on events. Right: ``save`` emits snapshot_taken at
    once while the tracker and the directory are unchanged (the previous step is still there); only the
    later ``committed`` event coincides with the tracker naming the new step and the old step being
    rotated away; the event sequence is snapshot_taken/committed per step, in order."""
    d = snap_env.ckpt_dir
    monkeypatch.setenv(DELAY, "0.02")
    events = []
    with Checkpointer(d, keep_last=1, **OPTS) as ck:
        ck.add_listener(lambda e: events.append((e.kind, e.step, tracker(d), committed_steps(d))))
        h1 = ck.save(make_state(1, 0), 1)
        assert h1.snapshot_taken and not h1.done()
        assert tracker(d) is None and committed_steps(d) == []
        h1.wait()
        h2 = ck.save(make_state(2, 0), 2)
        assert tracker(d) == "step_00000001" and committed_steps(d) == [1]
        before = os.stat(os.path.join(d, "latest")).st_mtime_ns
        assert not h2.done()
        assert tracker(d) == "step_00000001" and os.stat(os.path.join(d, "latest")).st_mtime_ns == before
        h2.wait()
        assert h2.committed_secs is not None
    assert [(k, s) for k, s, _, _ in events] == [("snapshot_taken", 1), ("committed", 1),
                                                 ("snapshot_taken", 2), ("committed", 2)]
    assert events[0][2:] == (None, []) and events[2][2:] == ("step_00000001", [1])
    assert events[1][2:] == ("step_00000001", [1]) and events[3][2:] == ("step_00000002", [2])


# ----------------------------------------------------------------------------------------------- B7
def test_B7_load_right_after_save_waits_for_the_commit(snap_env, monkeypatch):
    """B7: a slow persister; ``save(step 2)`` then at once ``load(step=2)`` in the same process. Right:
    load returns step 2's values, and by the time it returns step 2 is committed on disk and named by
    the tracker (load waited for the commit instead of reading something incomplete)."""
    d = snap_env.ckpt_dir
    monkeypatch.setenv(DELAY, "0.02")
    with Checkpointer(d, **OPTS) as ck:
        ck.save(make_state(1, 0), 1).wait()
        h2 = ck.save(make_state(2, 0), 2)
        assert tracker(d) == "step_00000001"
        out = ck.load(step=2)
        assert tracker(d) == "step_00000002" and committed_steps(d) == [1, 2] and h2.done()
        assert_equal_state(out, 2)


# ------------------------------------------------------------------------------------------ B9 / C5
def test_B9_C5_commit_checks_exact_set_of_parts(snap_env):
    """B9 and C5, 2 ranks: (1) a stray part marker of rank 5 sits in step 1's partial directory: the
    commit fails with CommitError naming rank 5 on both ranks, nothing is committed; (2) only rank 0
    calls ``save(step 2)``: its wait ends with CommitTimeoutError naming rank 1, nothing committed;
    (3) rank 1 saves an empty state at step 3: the commit succeeds with both ranks' files listed, and
    the empty shard loads back as ``{}``. No partial directory is left behind."""
    d = snap_env.ckpt_dir
    recs = results(run_ranks(WORKER, 2, ["parts", d], snap_env.env, timeout=150))
    for r in recs:
        assert r["step1"][0] == "CommitError" and "[5]" in r["step1"][1], r
    assert recs[0]["step2"][0] == "CommitTimeoutError" and "[1]" in recs[0]["step2"][1], recs[0]
    assert "step2" not in recs[1]
    assert recs[0]["step3_loaded"] == {"step": 3, "rank": 0} and recs[1]["step3_loaded"] == {}
    assert committed_steps(d) == [3] and tracker(d) == "step_00000003" and not partials(d)
    m = list_committed(FS, d)[0].manifest
    assert {n: f["rank"] for n, f in m["files"].items()} == {"rank_00000.pt": 0, "rank_00001.pt": 1}
    assert torch.load(os.path.join(step_dir(d, 3), "rank_00001.pt"), weights_only=True) == {}


# ------------------------------------------------------------------------------------ retention / C3
@pytest.mark.parametrize("release", [(2, 3, 4), (3, 4, 2), (4, 2, 3)], ids=lambda r: "".join(map(str, r)))
def test_C3_retention_follows_save_order_when_commits_finish_out_of_order(snap_env, monkeypatch, tmp_path,
                                                                           release):
    """Five DISK saves back to back with keep_last=3; the commits of steps 2-4 are held before their rename
    (fault points waiting on files), so step 5 commits first; then they are released one by one in the
    order ``release``. Found by a new-user trial: retention ordered checkpoints by commit time, deleted
    step 5 (the one ``latest`` names) and a restart resumed from step 4. Later found by a fresh-clone run
    (release order 3, 4, 2): step 2's commit, ending last, was kept by its own retention (it protected
    every commit in flight, itself included) until a next commit that never came. Right, in every order:
    retention follows the save order, exactly steps 3, 4, 5 remain once the commits are over, ``latest``
    names 5 throughout and the load gives step 5."""
    gates = {s: str(tmp_path / f"release_{s}") for s in (2, 3, 4)}
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", ";".join(
        f"commit.before_rename:step={s}:action=wait:secs=60:path={gates[s]}" for s in (2, 3, 4)))
    d = snap_env.ckpt_dir
    with Checkpointer(d, keep_last=3, **{**OPTS, "fsync": False}) as ck:
        handles = {step: ck.save(make_state(step, 0), step) for step in range(1, 6)}
        handles[5].wait()
        handles[1].wait()
        assert tracker(d) == "step_00000005"
        for s in release:
            open(gates[s], "w").close()
            handles[s].wait()
            assert tracker(d) == "step_00000005"
        # the last commit's own retirement runs just after its answer
        assert wait_until(lambda: committed_steps(d) == [3, 4, 5], timeout=20), committed_steps(d)
        assert_equal_state(ck.load(), 5)
    assert committed_steps(d) == [3, 4, 5] and tracker(d) == "step_00000005"


def test_C3_persister_killed_between_a_late_commits_answer_and_its_retirement(snap_env, monkeypatch, tmp_path):
    """keep_last=1: step 1's commit is held before its rename until step 2 has committed, so it ends behind
    it; once its answer is out, its own retention lists the checkpoints to retire it (point
    ``commit.retention_listed``, its second hit for step 1) and the persister is SIGKILLed there. Right: step 2
    stays, ``latest`` names it throughout, step 1 is left in place (beyond keep_last, nothing half-deleted), a
    restarted job loads step 2, and its first commit retires step 1."""
    snap_env.leftover_ok = True
    gate = str(tmp_path / "release_1")
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", f"commit.before_rename:step=1:action=wait:secs=60:path={gate};"
                                               "commit.retention_listed:step=1:occurrence=2")
    d = snap_env.ckpt_dir
    ck = Checkpointer(d, keep_last=1, **OPTS)
    try:
        h1 = ck.save(make_state(1, 0), 1)
        ck.save(make_state(2, 0), 2).wait()
        pid = ck.persister_pid
        open(gate, "w").close()
        assert wait_until(lambda: gone(pid), timeout=60), "the fault point did not kill the persister"
        try:
            bounded(h1.wait)  # its answer may or may not have reached the rank before the kill
        except PersisterDiedError:
            pass
    finally:
        try:
            ck.close()
        except PersisterDiedError:
            pass
    assert committed_steps(d) == [1, 2] and tracker(d) == "step_00000002"
    monkeypatch.delenv("SNAPCKPT_FAULT_POINT")
    with Checkpointer(d, keep_last=1, **OPTS) as ck:
        assert_equal_state(ck.load(), 2)
        ck.save(make_state(3, 0), 3).wait()
    assert committed_steps(d) == [3] and tracker(d) == "step_00000003"


def test_C3_retention_keeps_newest_two_and_tolerates_dirs_deleted_by_others(snap_env):
    """Retention and C3: keep_last=2 over 8 commits, while a second "local main" thread deletes the
    same old checkpoints the persister rotates (racing it), one committed directory is removed by hand
    before the next commit, and a foreign directory without a manifest sits beside them. Right: every
    save commits without error and the persister logs no retention failure; after each commit exactly
    the newest 2 committed steps remain; the foreign directory is untouched."""
    d = snap_env.ckpt_dir
    os.makedirs(os.path.join(d, "notes"))
    stop = threading.Event()

    def other_rotator():
        while not stop.is_set():
            for c in list_committed(FS, d, quick_check=False)[:-2]:
                shutil.rmtree(c.path, ignore_errors=True)
            stop.wait(0.001)

    th = threading.Thread(target=other_rotator, daemon=True)
    th.start()
    try:
        with Checkpointer(d, keep_last=2, **{**OPTS, "fsync": False}) as ck:
            for step in range(1, 9):
                if step == 5:
                    shutil.rmtree(step_dir(d, 3))  # deleted by someone else before retention runs
                ck.save(make_state(step, 0), step).wait()
                assert committed_steps(d)[-2:] == ([step - 1, step] if step > 1 else [1])
                assert wait_until(lambda: len(committed_steps(d)) <= 2, timeout=10)
    finally:
        stop.set()
        th.join(10)
    assert committed_steps(d) == [7, 8] and tracker(d) == "step_00000008"
    assert os.path.isdir(os.path.join(d, "notes"))
    assert "retention after step" not in persister_log(snap_env, d)


def test_B4_full_disk_on_one_rank_reaches_every_rank_with_its_cause(snap_env):
    """B4 across ranks: rank 1's part fails with EFBIG (a full disk) and its failure marker may not fit
    either. Right: every rank's ``wait()`` fails with the cause (EFBIG on rank 1; a CommitError naming rank 1
    and EFBIG on rank 0), not a commit timeout blaming a dead rank; no partial directory is left; the next
    save commits and is the newest step."""
    outs = run_ranks("commit_crash_worker.py", 2, ["full_disk_one_rank", snap_env.ckpt_dir], {}, timeout=200)
    res = {r["rank"]: r for r in (json.loads(l) for o in outs for l in result_lines(o))}
    assert "File too large" in res[1]["error"] or "EFBIG" in res[1]["error"] or "[Errno 27]" in res[1]["error"], res
    assert res[0]["error"].startswith("CommitError") and "rank 1" in res[0]["error"], res
    assert "Errno 27" in res[0]["error"] or "File too large" in res[0]["error"], res
    assert "did not write their part" not in res[0]["error"]
    for r in res.values():
        assert r["latest"] == 5 and r["partials"] == []


def test_B4_preflight_refusal_on_one_rank_fails_the_others_at_once(snap_env):
    """Contract 7 across ranks: rank 0's free-space preflight refuses a step (nothing written) while rank 1's
    part is accepted. Right: rank 0 raises InsufficientDiskError; rank 1's wait() fails with a CommitError
    naming rank 0 and that cause, not a commit timeout; no partial directory is left; the next step
    commits on both ranks."""
    outs = run_ranks("commit_crash_worker.py", 2, ["preflight_fail_one_rank", snap_env.ckpt_dir], {}, timeout=200)
    res = {r["rank"]: r for r in (json.loads(l) for o in outs for l in result_lines(o))}
    assert res[0]["error"].startswith("InsufficientDiskError"), res
    assert res[1]["error"].startswith("CommitError") and "rank 0" in res[1]["error"], res
    assert "InsufficientDiskError" in res[1]["error"] and "did not write their part" not in res[1]["error"], res
    for r in res.values():
        assert r["latest"] == 3 and r["partials"] == []


def test_B4_a_step_retried_after_a_preflight_refusal_ends_at_once(snap_env):
    """Rank 0's free-space preflight refuses step 2 just after rank 1's part came; the step is retried and rank
    0's preflight refuses it again before rank 1's part comes. Right: rank 1's retry fails at
    once on rank 0's refusal, as its first save did. Before the fix rank 0's refusal went onto the first save's
    record, and rank 1's retry waited for rank 0's part until the commit timeout (40 s)."""
    outs = run_ranks("commit_crash_worker.py", 2, ["preflight_fail_then_retry", snap_env.ckpt_dir, "refused"], {},
                     timeout=200)
    res = {r["rank"]: r for r in (json.loads(l) for o in outs for l in result_lines(o))}
    for attempt in ("first", "retry"):
        assert res[0]["errors"][attempt].startswith("InsufficientDiskError"), res
        err = res[1]["errors"][attempt]
        assert err.startswith("CommitError") and "InsufficientDiskError" in err, (attempt, res)
        assert "did not write their part" not in err, (attempt, res)
    assert res[0]["latest"] == res[1]["latest"] == 1


def test_B4_a_step_retried_after_a_preflight_refusal_commits_when_the_late_rank_saves_first(snap_env):
    """Rank 0's free-space preflight refuses step 2, rank 1's part comes once that save failed (a late part: not
    written); the step is retried, rank 1 first, and rank 0 has room now. Right: the retry commits on both
    ranks. Before the fix rank 1's part of the retry was taken for another late part of the failed save and
    dropped, and the retry waited for it until the commit timeout (40 s)."""
    outs = run_ranks("commit_crash_worker.py", 2, ["preflight_fail_then_retry", snap_env.ckpt_dir, "room"], {},
                     timeout=200)
    res = {r["rank"]: r for r in (json.loads(l) for o in outs for l in result_lines(o))}
    assert res[0]["errors"]["first"].startswith("InsufficientDiskError"), res
    assert res[1]["errors"]["first"].startswith("CommitError"), res
    assert res[0]["errors"]["retry"] is None and res[1]["errors"]["retry"] is None, res
    assert res[0]["latest"] == res[1]["latest"] == 2
