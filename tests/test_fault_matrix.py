"""The fault matrix (issue 7): seeded random fault points per integration, plus the fixed fault scenarios.

Each random point (``tests/faults.py`` :class:`FaultPoint`: a named point x rank x step, sometimes a
damage) runs a 2-rank gloo job (one process for the HF Trainer) that saves every step (MEMORY and DISK tiers mixed, ``keep_last=2``) with
the point armed; the process that reaches it SIGKILLs itself (a rank, or the node persister), the other
ranks are killed as an elastic launcher would, or die of the error they get. Then, optionally, the newest
committed checkpoint is damaged (and the persister killed, so the disk must be read), and the job is
restarted. After every fault the checks of :func:`check_after_fault`:

- no torn or mixed-step checkpoint is loaded: every tensor of every rank holds ``step * 100 + rank`` of
  the one step all ranks loaded;
- resume lands on the newest complete step: the newest step held in memory by every rank when the
  persister survived, else the newest committed on disk (damaged ones excepted);
- no committed checkpoint is lost: every one committed after the crash is still committed after the
  restart unless retention (``keep_last``) removed it after newer commits; every committed checkpoint
  passes its size and checksum checks;
- the error the job saw names the cause (key phrases).

``--fault-points N`` (default 1 per integration: the CI budget) and ``--fault-seed S`` (default: random, printed)
control the random part.
"""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import time
from typing import Dict, List, Optional

import pytest

import faults as F
from _harness import finish, launch, result_lines, wait_until

# integration -> (ranks, extra environment); the HF Trainer runs one process (two cost twice the time)
INTEGRATIONS = {"torch": (2, {}), "deepspeed": (2, {"DS_ACCELERATOR": "cpu"}), "megatron": (2, {}), "hf": (1, {})}
STEPS, DISK_EVERY, KEEP_LAST = 6, 2, 2


def _saved(out: str) -> int:
    steps = [int(l.split()[1]) for l in out.splitlines() if l.startswith("SAVED ")]
    return max(steps, default=0)


def _errors(outs: List[str]) -> List[Dict[str, str]]:
    return [json.loads(x) for o in outs for x in result_lines(o, "ERROR")]


def run_job(snap_env, integration: str, extra_env: Dict[str, str], args: List[str] = (), *,
            timeout: float = 180):
    """Run the ``run`` mode of the fault worker with ``extra_env``; when a rank is SIGKILLed, kill the
    others (as torchrun does). Returns ``(procs, outs)``."""
    nprocs, ienv = INTEGRATIONS[integration]
    env = {**snap_env.env, **ienv, **extra_env}
    procs = launch("fault_worker.py", nprocs, [integration, "run", snap_env.ckpt_dir, "--steps", str(STEPS),
                                          "--disk-every", str(DISK_EVERY), "--keep-last", str(KEEP_LAST),
                                          *args], env)
    first = F.wait_first_exit(procs, timeout)
    if first is not None and first.returncode == -signal.SIGKILL:
        F.kill_job(procs)
    outs = finish(procs, timeout)
    return procs, outs


def resume_job(snap_env, integration: str, args: List[str] = (), timeout: float = 180) -> List[dict]:
    """Restart the job; return each rank's ``RESULT`` (its loaded step, tier, consistency)."""
    nprocs, ienv = INTEGRATIONS[integration]
    env = {**snap_env.env, **ienv}
    procs = launch("fault_worker.py", nprocs, [integration, "resume", snap_env.ckpt_dir, "--keep-last",
                                          str(KEEP_LAST), *args], env)
    outs = finish(procs, timeout)
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"resume: rank {r} exited {p.returncode}:\n{o}"
    return [json.loads(result_lines(o)[0]) for o in outs]


def check_after_fault(snap_env, integration: str, outs: List[str], *, persister_alive: bool,
                      damaged: Optional[tuple] = None, what: str = "") -> dict:
    """``damaged``: ``(step, dirname)`` of the checkpoint the test damaged on purpose."""
    dstep, dname = damaged or (None, None)
    """Restart after a fault and assert the matrix's invariants (module docstring); return a summary."""
    before = F.committed(snap_env.ckpt_dir)
    disk = max((s for s in before if s != dstep), default=-1)
    memory = min(_saved(o) for o in outs) if persister_alive else -1
    expected = max(disk, memory)
    # the premise of ``memory``: the crashed job's persister still holds its memory tier (the workers' idle
    # timeout outlasts any restart; with 6 s a Megatron restart found it gone, seed 269359519)
    assert not persister_alive or snap_env.persisters(), f"{what}: the persister exited before the restart"
    results = resume_job(snap_env, integration)
    steps = {r["step"] for r in results}
    assert len(steps) == 1, f"{what}: ranks loaded different steps {results}"
    assert all(r["consistent"] for r in results), f"{what}: a torn or mixed-step checkpoint was loaded: {results}"
    loaded = steps.pop()
    assert loaded == expected, (f"{what}: resumed step {loaded} ({results[0]['tier']}), expected the newest "
                                f"complete {expected} (disk {disk}, memory {memory}); committed {sorted(before)}")
    after = F.committed(snap_env.ckpt_dir)
    kept = sorted(after)[-KEEP_LAST:]
    lost = [s for s in before if s != dstep and s not in after and (not kept or s > kept[0])]
    assert not lost, f"{what}: committed checkpoints {lost} were lost (before {sorted(before)}, after {sorted(after)})"
    problems = [p for p in F.verify_all(snap_env.ckpt_dir)
                if not p.startswith(f"{dname}:")]
    assert not problems, f"{what}: committed checkpoints fail their checks: {problems}"
    return {"loaded": loaded, "tier": results[0]["tier"], "committed_before": sorted(before)}


def assert_names_cause(outs: List[str], *phrases: str, what: str = "") -> None:
    """Every ``ERROR`` a rank printed matches one of ``phrases`` (regular expressions, case-insensitive);
    at least one rank printed one."""
    errs = _errors(outs)
    assert errs, f"{what}: no rank reported an error: {outs}"
    for e in errs:
        text = f"{e['type']}: {e['message']}"
        assert any(re.search(p, text, re.I) for p in phrases), f"{what}: error does not name the cause: {text}"


# ---------------------------------------------------------------------------------------- random points
def pytest_generate_tests(metafunc):
    """One test item per random fault point: ``--fault-points`` per integration, drawn from
    ``--fault-seed`` (plus the integration's index)."""
    if "fault_point" not in metafunc.fixturenames:
        return
    n, seed = metafunc.config.getoption("--fault-points"), metafunc.config.fault_seed
    params, ids = [], []
    for k, integration in enumerate(sorted(INTEGRATIONS)):
        ranks = INTEGRATIONS[integration][0]
        for i, fp in enumerate(F.draw_points(seed + k, n, steps=STEPS, disk_every=DISK_EVERY, world_size=ranks)):
            params.append((integration, fp))
            ids.append(f"{integration}-{i}-{fp.point}-r{fp.rank}-s{fp.step}-{fp.damage}")
    metafunc.parametrize("integration,fault_point", params, ids=ids)


def test_random_fault_point(snap_env, request, integration, fault_point):
    """One seeded random fault point (point x rank x step x damage) of one integration; see the module
    docstring for what is checked after it. Prints a ``FAULT {json}`` summary line."""
    snap_env.leftover_ok = True  # a crashed job's persister holds its arena until it is killed
    print(f"fault seed {request.config.fault_seed}")
    print("FAULT " + json.dumps(_run_point(snap_env, integration, fault_point)), flush=True)


def _run_point(snap_env, integration: str, fp: F.FaultPoint) -> dict:
    t0 = time.monotonic()
    procs, outs = run_job(snap_env, integration, fp.env())
    fired = any(p.returncode != 0 for p in procs)
    alive = fired and fp.point in F.RANK_POINTS  # a rank died: the persister and its memory tier live on
    if fp.point not in F.RANK_POINTS and fired:
        # the persister SIGKILLed itself; the ranks' client starts a fresh one on its next request, whose
        # memory holds only what came after: kill it too, so that the restart must resume from the disk
        assert_names_cause(outs, r"persister.*(died|no longer|lost|restarted)", what=str(fp))
        F.kill_persisters(snap_env)
    damaged = None
    if fp.damage != "none":
        before = F.committed(snap_env.ckpt_dir)
        if before:
            F.kill_persisters(snap_env)
            alive = False
            damaged = (max(before), before[max(before)])
            F.damage(os.path.join(snap_env.ckpt_dir, damaged[1]), fp.damage)
    if not fired:
        alive = False  # a clean close: the persister is gone
        assert wait_until(lambda: not snap_env.persisters(), 15), f"{fp}: the persister outlived the clean close"
    t1 = time.monotonic()
    summary = check_after_fault(snap_env, integration, outs, persister_alive=alive, damaged=damaged, what=str(fp))
    F.kill_persisters(snap_env)
    summary["secs"] = [round(t1 - t0, 1), round(time.monotonic() - t1, 1)]
    return {"point": str(fp), "fired": fired, "damaged": damaged and damaged[0], **summary}


# ------------------------------------------------------------------------------------ fixed scenarios
PHASES = ["open", "write", "fsync", "part_marker", "manifest", "rename", "tracker"]
CAUSE = {"rlimit": r"File too large|EFBIG|Errno 27"}


def test_B4_storage_fails_by_phase_and_full_disk(snap_env):
    """B4 for every storage phase in one 2-rank job: step 1 commits; then each DISK save fails in one phase
    (ENOSPC injected by the persister's storage, the part phases on rank 1 only), and last the persister's
    RLIMIT_FSIZE (EFBIG) stands in for a full disk. After each: both ranks get an error naming the errno's
    text and the step, the previous checkpoint is still committed, intact and named by ``latest``, nothing
    but committed step directories is visible; then a last save commits (the job can go on)."""
    plan = os.path.join(snap_env.tmp, "plan.json")
    env = {**snap_env.env, "SNAPCKPT_FAULT_STORAGE": "@" + plan}
    procs = launch("fault_worker.py", 2, ["torch", "phases", snap_env.ckpt_dir, "--keep-last", "0",
                                          "--plan", plan, "--phases", ",".join(PHASES),
                                          "--fsize-limit", str(64 * 1024)], env)
    outs = finish(procs, 240)
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{o}"
    for r, o in enumerate(outs):
        rows = [json.loads(x) for x in result_lines(o, "PHASE")]
        assert [x["phase"] for x in rows] == ["baseline"] + PHASES + ["rlimit"], o
        assert rows[0]["error"] is None and rows[0]["committed"] == [1], rows[0]
        good, tracked = [1], 1
        for row in rows[1:]:
            what = f"rank {r} phase {row['phase']}"
            if row["phase"] == "tracker":
                # the directory was renamed (committed) before the tracker write failed: the save reports the
                # failure, the checkpoint itself is complete and loadable, ``latest`` still names the older one
                assert row["error"] and re.search(r"No space left on device", row["error"]), (what, row)
                assert row["tracker"] == f"step_{tracked:08d}", (what, row)
                good.append(row["step"])
                continue
            assert row["error"], f"{what}: the failed save raised nothing: {row}"
            assert re.search(CAUSE.get(row["phase"], r"No space left on device"), row["error"]), (what, row)
            assert re.search(rf"step {row['step']}\b", row["error"]), (what, row)
            assert row["committed"] == good, f"{what}: committed checkpoints changed: {row}"
            assert row["tracker"] == f"step_{tracked:08d}", (what, row)
            assert row["visible"] == sorted([f"step_{s:08d}" for s in good] + ["latest"]), (what, row)
            assert not row["problems"], (what, row)
        final = json.loads(result_lines(o, "FINAL")[0])
        assert final["error"] is None and final["committed"][-1] == final["step"], final


def test_B5_hung_persister_times_out_then_resume(snap_env):
    """B5: the persister stops (SIGSTOP at ``commit.before_rename`` of step 2, after the manifest was written
    into the partial directory). The ranks' next request ends with PersisterTimeoutError naming the
    timeout, never a hang, and the job dies of it; a restart resumes from the newest complete step. (When
    the ranks exit, the stopped persister's process group is orphaned and the kernel sends it SIGHUP and
    SIGCONT: it may then finish step 2's commit, legitimately, before the test kills it.)"""
    snap_env.leftover_ok = True
    procs, outs = run_job(snap_env, "torch", F.point_env("commit.before_rename", step=2, action="stop"),
                          ["--request-timeout", "4"])
    # The rank whose request timed out exits 3 naming the timeout; a rank that was then waiting for it in
    # a collective may instead die of gloo's "connection closed by peer" when it exits first (under load).
    codes = [p.returncode for p in procs]
    assert 3 in codes and 0 not in codes, (codes, outs)
    for code, out in zip(codes, outs):
        assert code == 3 or re.search(r"Connection closed by peer|Connection reset|PersisterTimeout", out), (code, out)
    assert_names_cause(outs, r"PersisterTimeout.*(did not answer|timed out|within)", what="hung persister")
    F.kill_persisters(snap_env)  # SIGKILL ends a stopped process too
    check_after_fault(snap_env, "torch", outs, persister_alive=False, what="hung persister")
    F.kill_persisters(snap_env)


def test_B3_damaged_checkpoints_are_skipped(snap_env):
    """B3 and a missing rank: six committed steps; the newest is truncated to 0 bytes (power loss), the
    next has one corrupted byte, the next lost rank 1's file. The persister is killed (no memory tier), so
    the restart must read the disk: every rank loads step 3, whole, and the output names each damaged
    directory; the damaged ones are never loaded."""
    snap_env.leftover_ok = True
    procs = launch("fault_worker.py", 2, ["torch", "run", snap_env.ckpt_dir, "--steps", "6", "--disk-every", "1",
                                          "--keep-last", "0"], snap_env.env)
    outs = finish(procs, 180)
    assert all(p.returncode == 0 for p in procs), outs
    F.kill_persisters(snap_env)
    names = F.committed(snap_env.ckpt_dir)
    assert sorted(names) == [1, 2, 3, 4, 5, 6]
    for step, how in ((6, "truncate"), (5, "corrupt_byte"), (4, "missing_rank")):
        F.damage(os.path.join(snap_env.ckpt_dir, names[step]), how)
    env = {**snap_env.env}
    procs = launch("fault_worker.py", 2, ["torch", "resume", snap_env.ckpt_dir, "--keep-last", "0"], env)
    outs = finish(procs, 180)
    assert all(p.returncode == 0 for p in procs), outs
    results = [json.loads(result_lines(o)[0]) for o in outs]
    assert all(r["step"] == 3 and r["tier"] == "disk" and r["consistent"] for r in results), results
    text = "\n".join(outs)
    for step in (5, 4):  # 6 is not even listed as committed (its sizes are wrong)
        assert names[step] in text, f"the damaged {names[step]} was skipped without a word: {text}"
    F.kill_persisters(snap_env)


def test_two_jobs_on_one_host_fault_in_one_leaves_the_other_alone(snap_env, tmp_path):
    """Two 2-rank jobs at once on one host, each with its own checkpoint directory, sharing the runtime
    and shared-memory roots: job A's persister SIGKILLs itself in a commit; job B is untouched (runs to
    the end, every DISK step committed, its own persister), and job A resumes from its newest complete
    step."""
    snap_env.leftover_ok = True
    b_dir = str(tmp_path / "job_b")
    env_b = {**snap_env.env}
    procs_b = launch("fault_worker.py", 2, ["torch", "run", b_dir, "--steps", str(STEPS), "--disk-every",
                                            str(DISK_EVERY), "--keep-last", "0"], env_b)
    procs_a, outs_a = run_job(snap_env, "torch", F.point_env("commit.before_tracker", step=2))
    outs_b = finish(procs_b, 180)
    assert all(p.returncode == 0 for p in procs_b), f"job B was disturbed by job A's fault: {outs_b}"
    assert sorted(F.committed(b_dir)) == [2, 4, 6] and not F.verify_all(b_dir)
    assert_names_cause(outs_a, r"persister.*(died|no longer|lost|restarted)", what="job A")
    F.kill_persisters(snap_env)
    check_after_fault(snap_env, "torch", outs_a, persister_alive=False, what="job A")
    F.kill_persisters(snap_env)


def test_B3_megatron_only_checkpoint_damaged(snap_env):
    """B3 through the Megatron integration, found by the fault matrix: the only committed iteration lost a
    file and the persister is gone. ``load_checkpoint`` used to hand the directory named by
    ``latest_checkpointed_iteration.txt`` to megatron-core's loader anyway, which died with a bare
    FileNotFoundError; now every rank gets CheckpointCorruptError naming the damaged directory and the
    missing file, and nothing is loaded."""
    snap_env.leftover_ok = True
    procs = launch("fault_worker.py", 2, ["megatron", "run", snap_env.ckpt_dir, "--steps", "1", "--disk-every",
                                          "1", "--keep-last", "0"], snap_env.env)
    outs = finish(procs, 240)
    assert all(p.returncode == 0 for p in procs), outs
    F.kill_persisters(snap_env)
    (name,) = F.committed(snap_env.ckpt_dir).values()
    (gone,) = F.damage(os.path.join(snap_env.ckpt_dir, name), "missing_rank", rank=1)[:1]
    procs = launch("fault_worker.py", 2, ["megatron", "resume", snap_env.ckpt_dir, "--keep-last", "0"],
                   snap_env.env)
    outs = finish(procs, 240)
    for o in outs:
        (nf,) = [json.loads(x) for x in result_lines(o, "NOTFOUND")] or [None]
        assert nf and name in nf["message"] and os.path.basename(gone) in nf["message"], o
    F.kill_persisters(snap_env)


# ------------------------------------------------------------------------------------- the toolkit itself
def test_fault_seams_fail_the_chosen_phase_only(tmp_path, monkeypatch):
    """The storage seam fails exactly its phase (with the errno, for the selected rank and step only) and
    a fault-point spec is parsed strictly; with no knob set the persister gets a plain PosixStorage."""
    import snapckpt._internal.faultpoints as SF
    import snapckpt._testing.faulty_storage as FS
    from snapckpt.storage import PosixStorage

    monkeypatch.delenv("SNAPCKPT_FAULT_STORAGE", raising=False)
    assert type(FS.storage(fsync=False, rank=0, step=1)) is PosixStorage
    d = str(tmp_path)
    calls = {"open": lambda s: s.open_write(f"{d}/a").close(),
             "write": lambda s: s.open_write(f"{d}/b").write(b"x" * 10),
             "fsync": lambda s: s.fsync_file(open(f"{d}/c", "wb")),
             "part_marker": lambda s: s.write_atomic(f"{d}/.snapckpt/part_00001.json", b"{}"),
             "manifest": lambda s: s.write_atomic(f"{d}/.snapckpt/manifest.json", b"{}"),
             "rename": lambda s: s.rename(f"{d}/a", f"{d}/a2"),
             "tracker": lambda s: s.write_atomic(f"{d}/latest", b"x")}
    os.makedirs(f"{d}/.snapckpt")
    for phase in PHASES:
        monkeypatch.setenv("SNAPCKPT_FAULT_STORAGE", F.storage_env(phase, errno.EIO, rank=1, step=3,
                                                                   after_bytes=4)["SNAPCKPT_FAULT_STORAGE"])
        assert type(FS.storage(fsync=False, rank=0, step=3)) is PosixStorage  # another rank
        assert type(FS.storage(fsync=False, rank=1, step=2)) is PosixStorage  # another step
        s = FS.storage(fsync=False, rank=1, step=3)
        for other, call in calls.items():
            open(f"{d}/a", "wb").close()
            also = {"open": {"write"}, "fsync": {"part_marker", "manifest", "tracker"}}.get(phase, set())
            if other == phase or other in also:  # writing opens first; small atomic files are fsynced too
                with pytest.raises(OSError) as ei:
                    call(s)
                assert ei.value.errno == errno.EIO and f"injected: {phase}" in str(ei.value)
            else:
                call(s)
    monkeypatch.setenv("SNAPCKPT_FAULT_STORAGE", "@" + f"{d}/no-plan-yet")
    assert type(FS.storage(fsync=False, rank=1, step=3)) is PosixStorage
    for bad in ("persist.nowhere", "commit.before_rename:rank=x", "commit.before_rename:when=1"):
        with pytest.raises(ValueError, match="SNAPCKPT_FAULT_POINT"):
            SF._parse(bad)
    assert SF._parse("persist.mid_file:rank=1:step=4:occurrence=2:action=stop") == [
        {"name": "persist.mid_file", "rank": 1, "step": 4, "occurrence": 2, "action": "stop"}]


_BATCH_CHILD = """
import concurrent.futures as cf, mmap, sys
from snapckpt.persister.writer import finish_parts, write_part_data
from snapckpt.storage.posix import PosixStorage
d, n = sys.argv[1], int(sys.argv[2])
buf = mmap.mmap(-1, 3 * n)
for r in range(3):
    buf[r * n:(r + 1) * n] = bytes([r + 1]) * n
parts = [write_part_data(PosixStorage(), buf, {"files": [{"path": f"rank_{r}.bin", "kind": "bytes",
         "chunks": [[r * n, n]]}]}, d, rank=r, run_id="run", step=1) for r in range(3)]
print("ERRORS", [e is not None for e in finish_parts(parts, cf.ThreadPoolExecutor(4))], flush=True)
"""


def test_batched_parts_get_a_marker_only_once_their_data_is_durable(tmp_path, monkeypatch):
    """Issue 15's group commit (``writer.finish_parts``, run by the persister's ``PartSyncer``) keeps the
    ordering of contract 4 for every part of a batch: (1) a real process SIGKILLed at
    ``persist.before_part_marker`` (every file of the batch fsynced, no marker yet) leaves no part marker
    (nor a temporary one) for any part of the batch, and every data file whole; (2) when one part's fsync
    fails (storage seam, EIO), that part gets no marker and names its file, while the other parts of the
    same batch get theirs."""
    import concurrent.futures as cf
    import mmap
    import subprocess
    import sys

    import snapckpt._testing.faulty_storage as FS
    from snapckpt.persister.writer import finish_parts, write_part_data

    n = 64 << 10
    d = str(tmp_path / "killed")
    env = {**os.environ, **F.point_env("persist.before_part_marker", rank=0, step=1)}
    cp = subprocess.run([sys.executable, "-c", _BATCH_CHILD, d, str(n)], env=env, capture_output=True, text=True,
                        timeout=120)
    assert cp.returncode == -signal.SIGKILL, (cp.returncode, cp.stdout, cp.stderr)
    assert "SNAPCKPT_FAULT_POINT hit persist.before_part_marker rank=0 step=1" in cp.stderr, cp.stderr
    assert os.listdir(os.path.join(d, ".snapckpt")) == [], "a marker was written before the batch's kill point"
    for r in range(3):
        with open(os.path.join(d, f"rank_{r}.bin"), "rb") as f:
            assert f.read() == bytes([r + 1]) * n, r

    d = str(tmp_path / "fsync_fails")
    monkeypatch.setenv("SNAPCKPT_FAULT_STORAGE",
                       F.storage_env("fsync", errno.EIO, rank=1, step=1)["SNAPCKPT_FAULT_STORAGE"])
    buf = mmap.mmap(-1, 3 * n)
    parts = [write_part_data(FS.storage(fsync=True, rank=r, step=1), buf,
                             {"files": [{"path": f"rank_{r}.bin", "kind": "bytes", "chunks": [[r * n, n]]}]},
                             d, rank=r, run_id="run", step=1) for r in range(3)]
    with cf.ThreadPoolExecutor(4) as pool:
        errors = finish_parts(parts, pool)
    assert errors[0] is None and errors[2] is None, errors
    assert isinstance(errors[1], OSError) and errors[1].errno == errno.EIO, errors
    assert "rank_1.bin" in str(errors[1]) and "injected: fsync" in str(errors[1]), errors[1]
    assert sorted(os.listdir(os.path.join(d, ".snapckpt"))) == ["part_00000.json", "part_00002.json"]
    assert all(not p.handles for p in parts), "descriptors left open"


def test_D1_small_shm_dir_from_the_toolkit(snap_env, tmp_path):
    """The toolkit's small shared-memory directory (a 16 MiB tmpfs as root) as ``shm_dir``: a 32 MiB state
    is refused up front with InsufficientSharedMemoryError naming the directory and the option, never a
    SIGBUS; a 1 MiB state then saves and loads."""
    import torch

    from snapckpt import Checkpointer, StorageType
    from snapckpt.errors import InsufficientSharedMemoryError

    if os.geteuid() != 0:
        pytest.fail("this check mounts a tmpfs and needs root, as tests/test_resources.py does")
    with F.small_shm(str(tmp_path / "shm"), 16 << 20) as shm:
        with Checkpointer(snap_env.ckpt_dir, shm_dir=shm, persister_idle_timeout_secs=5) as ck:
            with pytest.raises(InsufficientSharedMemoryError) as ei:
                ck.save({"w": torch.zeros(8 << 20)}, 1, StorageType.MEMORY)
            assert shm in str(ei.value) and "shm_dir" in str(ei.value), str(ei.value)
            ck.save({"w": torch.ones(256 << 10)}, 2, StorageType.MEMORY)
            assert bool((ck.load()["w"] == 1).all()) and ck.last_load.step == 2
        assert wait_until(lambda: not snap_env.persisters(), 15)


def test_A4_slot_reused_while_its_part_is_finishing_commits_every_step(snap_env, monkeypatch):
    """A4/B9, found by the fault matrix (DeepSpeed, every-step saves): the persister releases a slot once
    its data is written, before the part marker; the rank may then fill that slot with a newer snapshot.
    The persister's writer task used to read the slot's directory name again after that, found the new
    one, and failed the older step's commit with a KeyError. The part marker of step 1 is held up (fault
    point ``persist.before_part_marker`` sleeping) while steps 2, 3 and 4 are saved, step 4 into step 1's
    slot (the newest READY slot is never reused, so three slots): every step must commit, and every
    committed checkpoint holds its own step."""
    import torch

    from snapckpt import Checkpointer, StorageType

    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", "persist.before_part_marker:step=1:action=sleep:secs=2")
    with Checkpointer(snap_env.ckpt_dir, slots_per_rank=3, persister_idle_timeout_secs=5) as ck:
        handles = [ck.save({"w": torch.full((1024,), float(s)), "step": s}, s, StorageType.DISK)
                   for s in (1, 2, 3, 4)]
        for h in handles:
            h.wait()
    assert sorted(F.committed(snap_env.ckpt_dir)) == [1, 2, 3, 4] and not F.verify_all(snap_env.ckpt_dir)
    for s, name in F.committed(snap_env.ckpt_dir).items():
        got = torch.load(os.path.join(snap_env.ckpt_dir, name, "rank_00000.pt"), weights_only=True)
        assert got["step"] == s and bool((got["w"] == s).all()), (s, name)


def test_a_part_whose_partial_directory_was_removed_leaves_no_stale_failure_marker(tmp_path):
    """A node's part fails because the committer removed the partial directory once the commit failed (a
    peer persister held past peer_timeout_secs, then resumed: seen on the multi-node rig): no failure marker
    recreates the directory (it failed the crash flush of the same step at once with the old error, and
    stayed on disk). Any other failure still gets its marker, creating the directory."""
    from snapckpt.persister.writer import write_failure_marker
    from snapckpt.storage.posix import PosixStorage

    gone, other = str(tmp_path / ".step_6.partial-run"), str(tmp_path / ".step_7.partial-run")
    write_failure_marker(PosixStorage(), gone, rank=1, run_id="run", step=6,
                         exc=FileNotFoundError(2, "No such file or directory", gone + "/.snapckpt/x.tmp"))
    assert not os.path.exists(gone)
    write_failure_marker(PosixStorage(), other, rank=1, run_id="run", step=7, exc=OSError(28, "No space left"))
    assert os.listdir(os.path.join(other, ".snapckpt")) == ["fail_00001.json"]
