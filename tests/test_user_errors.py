"""Misuse a new user hits first: each gets a precise error naming the fix, and nothing is lost.

Found by a first-use trial of the README: bad steps, unsupported tensors, two jobs writing one
directory, a rewound run and retention, paths the persister cannot use.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from _harness import wait_until

from snapckpt import Checkpointer, StorageType
from snapckpt.errors import CheckpointDirError, CommitError, PersisterError, PreflightError, SnapshotError


BAD_STEPS = ["5", 3.0, None, -1, True, 2**63, -(2**63) - 1]


def test_P6a_bad_step_is_a_clear_value_error(snap_env):
    """A step that is not an int in [0, 2**63 - 1] (a string, a float, None, a bool, negative, 2**63) is a
    ValueError naming the value and the range, from save and load(step=), never a bare struct.error; the
    largest step is fine."""
    with Checkpointer(snap_env.ckpt_dir) as ck:
        for step in BAD_STEPS:
            with pytest.raises(ValueError, match=r"step must be an int in \[0, 2\*\*63 - 1\], got ") as ei:
                ck.save({"a": torch.ones(2)}, step)
            assert repr(step) in str(ei.value)
            with pytest.raises(ValueError, match=r"step must be an int in \[0, 2\*\*63 - 1\]"):
                ck.load(step=step if step is not None else "x")
        assert not [n for n in os.listdir(snap_env.ckpt_dir) if n.startswith("step_")]
        ck.save({"a": torch.ones(2)}, 2**63 - 1, StorageType.MEMORY)
        assert ck.latest_step() == 2**63 - 1


def test_a_closed_checkpointer_names_its_state_and_the_fix(snap_env):
    """save, load and latest_step on a closed Checkpointer raise CheckpointerClosedError (never a bare
    SnapckptError, docs/troubleshooting.md) whose message says what to do."""
    from snapckpt.errors import CheckpointerClosedError

    ck = Checkpointer(snap_env.ckpt_dir)
    ck.save({"w": torch.ones(4)}, 1, StorageType.DISK).wait()
    ck.close()
    for call in (lambda: ck.save({"w": torch.ones(4)}, 2), ck.load, ck.latest_step):
        with pytest.raises(CheckpointerClosedError, match="create a new Checkpointer"):
            call()
    with Checkpointer(snap_env.ckpt_dir) as again:  # the fix the message names
        assert again.latest_step() == 1


def test_a_malformed_replicas_variable_fails_the_constructor_before_a_persister_starts(snap_env, monkeypatch):
    """docs/operations.md: SNAPCKPT_REPLICAS that is not a non-negative integer is a ValueError when the
    Checkpointer starts, not at its first save (by then a persister was started for nothing)."""
    monkeypatch.setenv("SNAPCKPT_REPLICAS", "-1")
    with pytest.raises(ValueError, match="SNAPCKPT_REPLICAS='-1' must be a non-negative integer"):
        Checkpointer(snap_env.ckpt_dir)
    assert snap_env.persisters() == []  # none was started


def test_unsupported_tensors_name_the_conversion(snap_env):
    with Checkpointer(snap_env.ckpt_dir) as ck:
        with pytest.raises(SnapshotError, match=r"to_dense\(\)"):
            ck.save({"s": torch.eye(3).to_sparse()}, 1)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        with pytest.raises(SnapshotError, match="nested tensor"):
            ck.save({"n": nested}, 1)
        ck.save({"ok": torch.ones(2)}, 1).wait()  # still usable
        assert torch.equal(ck.load()["ok"], torch.ones(2))


def test_bad_state_and_dir_caught_at_save_with_the_key_path_and_fix(snap_env, caplog):
    """A lambda or a lock in the state: save raises SnapshotError naming its key path and the fix (not a
    bare pickling error), nothing is saved. ``Checkpointer(None)``: CheckpointDirError naming the argument.
    A numpy array (saves, but load() with weights_only=True refuses it): ONE warning at the first save of
    that layout naming the global and the fixes, none at the next save; none with weights_only=False."""
    import logging
    import threading

    import numpy as np

    with pytest.raises(CheckpointDirError, match=r"checkpoint_dir must be a non-empty path .*not None"):
        Checkpointer(None)
    with Checkpointer(snap_env.ckpt_dir) as ck:
        with pytest.raises(SnapshotError, match=r"state\['f'\] cannot be pickled \(function: .*remove that value"):
            ck.save({"w": torch.ones(2), "f": lambda: 1}, 1)
        with pytest.raises(SnapshotError, match=r"state\['opt'\]\['hooks'\]\[1\] cannot be pickled \(lock"):
            ck.save({"opt": {"hooks": [1, threading.Lock()]}}, 1)
        assert ck.latest_step() is None
        with caplog.at_level(logging.WARNING, logger="snapckpt.engine.stager"):
            for step in (2, 3):
                ck.save({"w": torch.ones(3), "a": np.ones(3)}, step, StorageType.MEMORY)
        warned = [r.getMessage() for r in caplog.records if "load() will refuse it" in r.getMessage()]
        assert len(warned) == 1, caplog.text
        assert "numpy" in warned[0] and "torch.from_numpy" in warned[0] and "weights_only=False" in warned[0]
        assert "add_safe_globals" in warned[0], warned[0]
    caplog.clear()
    with Checkpointer(snap_env.ckpt_dir, weights_only=False) as ck:
        with caplog.at_level(logging.WARNING, logger="snapckpt.engine.stager"):
            ck.save({"w": torch.ones(3), "a": np.ones(3)}, 4, StorageType.MEMORY)
            assert float(ck.load(step=4)["a"][0]) == 1.0
    assert not [r for r in caplog.records if "load() will refuse it" in r.getMessage()], caplog.text


def test_two_jobs_in_one_dir_never_overwrite_each_other(snap_env):
    """A second job (other job_id) saving the same step into the same directory is refused at commit;
    the first job's checkpoint stays as it was."""
    with Checkpointer(snap_env.ckpt_dir, job_id="a") as a, Checkpointer(snap_env.ckpt_dir, job_id="b") as b:
        a.save({"w": torch.full((4,), 1.0)}, 9).wait()
        with pytest.raises(CommitError, match="committed by another job"):
            b.save({"w": torch.full((4,), 2.0)}, 9).wait()
    on_disk = torch.load(os.path.join(snap_env.ckpt_dir, "step_00000009", "rank_00000.pt"), weights_only=True)
    assert torch.equal(on_disk["w"], torch.full((4,), 1.0))


def test_a_second_job_without_job_id_on_the_same_dir_is_refused_naming_the_first(snap_env):
    """Found by a new-user trial: a second plain job (another process, no ``job_id``) on the directory a
    running job saves into shares the first one's job key, so its persister; it was refused with a bare
    PersisterError ("rank 0 of this job is already connected") although the docs promise
    CheckpointDirInUseError. Right: CheckpointDirInUseError at construction naming the first process and the
    fix, and the first job's saves go on."""
    d = snap_env.ckpt_dir
    with Checkpointer(d) as first:
        first.save({"w": torch.ones(4)}, 1).wait()
        code = ("import sys\nfrom snapckpt import Checkpointer\ntry:\n    Checkpointer(sys.argv[1])\n"
                "except Exception as e:\n    print(type(e).__name__, e)\n")
        cp = subprocess.run([sys.executable, "-c", code, d], env={**os.environ, **snap_env.env},
                            capture_output=True, text=True, timeout=120)
        assert cp.stdout.startswith("CheckpointDirInUseError "), cp.stdout + cp.stderr
        assert f"pid {os.getpid()}" in cp.stdout and "own checkpoint_dir" in cp.stdout, cp.stdout
        # a new-user trial followed the hint "(or its own job_id=)": the directory claim refused that job too
        assert "job_id= of its own does not help" in cp.stdout, cp.stdout
        first.save({"w": torch.full((4,), 2.0)}, 2).wait()
        assert torch.equal(first.load()["w"], torch.full((4,), 2.0))


def test_B3_a_damaged_step_of_another_job_is_replaced_by_a_resave(snap_env):
    """Found by a new-user trial (Megatron, a moved directory). Fault: the checkpoint directory was moved
    (so its job key, which hashes the real path, changed), its newest step was damaged (a flipped byte), the
    job resumed from the step before and trained on; its save of the damaged step was refused as "committed
    by another job" and the job died, although nothing loadable was there. Right behaviour: a damaged
    directory of another job is replaced (the persister logs a warning naming the damage); an intact one is
    still refused (the test above); the replacement loads."""
    d = snap_env.ckpt_dir
    with Checkpointer(d, job_id="a") as a:
        a.save({"w": torch.full((1024,), 1.0)}, 9).wait()
    path = os.path.join(d, "step_00000009", "rank_00000.pt")
    with open(path, "r+b") as f:
        f.seek(-200, 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with Checkpointer(d, job_id="b") as b:
        b.save({"w": torch.full((1024,), 2.0)}, 9).wait()
        assert torch.equal(b.load(step=9)["w"], torch.full((1024,), 2.0))
    on_disk = torch.load(path, weights_only=True)
    assert torch.equal(on_disk["w"], torch.full((1024,), 2.0))


def test_retention_keeps_the_most_recent_commits_after_a_rewind(snap_env):
    """Steps 100, 200, then a rewind to 5, 6, 7 with keep_last=2: the rewound run's newest two survive,
    the abandoned higher steps rotate away, and the tracker names step 7."""
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        for step in (100, 200, 5, 6, 7):
            ck.save({"w": step}, step, StorageType.DISK).wait()
    names = sorted(n for n in os.listdir(snap_env.ckpt_dir) if n.startswith("step_"))
    assert names == ["step_00000006", "step_00000007"]
    assert open(os.path.join(snap_env.ckpt_dir, "latest")).read() == "step_00000007"
    # a step that is not there: the error lists the steps that are (memory and disk)
    from snapckpt.errors import CheckpointNotFoundError
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        ck.save({"w": 8}, 8, StorageType.MEMORY).wait()
        with pytest.raises(CheckpointNotFoundError, match=r"no complete checkpoint of step 999 .*"
                                                          r"\(loadable steps: \[6, 7, 8\]\)"):
            ck.load(step=999)


def test_paths_the_persister_cannot_use(snap_env, tmp_path, monkeypatch):
    with pytest.raises(PersisterError, match="too long for a unix socket"):
        Checkpointer(snap_env.ckpt_dir, runtime_dir=str(tmp_path / ("x" * 120)))
    with pytest.raises(PreflightError, match="does not exist"):
        Checkpointer(snap_env.ckpt_dir, shm_dir=str(tmp_path / "no" / "such" / "shm"))
    assert not (tmp_path / "no").exists()
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    with pytest.raises(CheckpointDirError, match="not a directory"):
        Checkpointer(str(a_file))
    # a directory that cannot be created (here: under a file) names mkdir, not permissions
    with pytest.raises(CheckpointDirError, match=r"cannot be created by rank 0 \(mkdir: Not a directory\); "
                                                 r"create it first"):
        Checkpointer(str(a_file / "ckpt"))
    # found by a break-it trial: the persister crashed at startup on it (a PersisterError with a traceback)
    monkeypatch.setenv("SNAPCKPT_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="SNAPCKPT_LOG_LEVEL='LOUD' must be one of DEBUG, INFO"):
        Checkpointer(snap_env.ckpt_dir)


def test_saving_a_committed_step_again_replaces_it(snap_env, monkeypatch):
    """A step saved to disk, committed, then saved again (a rewind, or the same iteration re-run): the
    second save is written and committed, not answered "committed" from the first one; loads see the new
    values. A second save of a step whose first save is still being persisted (its commit held here) returns
    at once, neither refused nor waited for on the training thread: the persister starts it once the first
    has committed (every rank of the step joins it), and it replaces the first."""
    with Checkpointer(snap_env.ckpt_dir, persister_idle_timeout_secs=5) as ck:
        ck.save({"w": torch.zeros(8)}, 1, StorageType.DISK).wait()
        ck.save({"w": torch.ones(8)}, 1, StorageType.DISK).wait()
        on_disk = torch.load(os.path.join(snap_env.ckpt_dir, "step_00000001", "rank_00000.pt"))
        assert torch.equal(on_disk["w"], torch.ones(8))
    d2, release = snap_env.ckpt_dir + "2", os.path.join(snap_env.tmp, "release")
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", f"commit.before_tracker:step=2:action=wait:secs=60:path={release}")
    try:
        with Checkpointer(d2, persister_idle_timeout_secs=5) as ck:
            h = ck.save({"w": torch.zeros(8)}, 2, StorageType.DISK)
            assert wait_until(lambda: os.path.isdir(os.path.join(d2, "step_00000002")), timeout=60)
            h2 = ck.save({"w": torch.ones(8)}, 2, StorageType.DISK)  # the first is held: not waited for here
            assert not h.done() and not h2.done()
            open(release, "w").close()
            h2.wait()
            h.wait()
            on_disk = torch.load(os.path.join(d2, "step_00000002", "rank_00000.pt"))
            assert torch.equal(on_disk["w"], torch.ones(8))
    finally:
        open(release, "w").close()


def test_saves_of_other_steps_under_one_tag_in_flight_at_once_commit_one_after_the_other(snap_env):
    """A fixed tag (``save_files(dirname="best")``, a DeepSpeed ``tag``) saved at steps 1, 2 and 3 back to back,
    none waited for: each save waits for the previous one of that directory. Before, the three shared one
    partial directory: step 1's commit took step 3's file under step 1's manifest, steps 2 and 3 failed with
    ``FileNotFoundError``. Each save now commits; the directory ends with step 3's manifest and values."""
    files = [{"a.pt": {"w": torch.full((1 << 16,), float(s))}} for s in (1, 2, 3)]
    with Checkpointer(snap_env.ckpt_dir, persister_idle_timeout_secs=5) as ck:
        hs = [ck.save_files(files[s - 1], s, StorageType.DISK, dirname="best", tracker_name="latest",
                            tracker_content="best") for s in (1, 2, 3)]
        for h in hs:
            h.wait()
    m = json.load(open(os.path.join(snap_env.ckpt_dir, "best", ".snapckpt", "manifest.json")))
    assert m["step"] == 3
    assert torch.equal(torch.load(os.path.join(snap_env.ckpt_dir, "best", "a.pt"))["w"], files[2]["a.pt"]["w"])
    assert sorted(os.listdir(snap_env.ckpt_dir)) == ["best", "latest"]


def test_a_handled_failure_of_a_tags_earlier_save_does_not_fail_the_next_save_of_that_tag(snap_env, monkeypatch):
    """A fixed tag: step 1's DISK save to ``best`` fails (ENOSPC while its part is written) and the caller handles
    it through the handle (``h.wait()`` raised it). The next save to ``best`` (step 2, the disk has room again)
    waits for step 1's save, which is over, and commits. Before, that wait raised step 1's failure again, step
    2 was never saved, and so was every later save to ``best`` until a ``poll()``/``wait()`` of the
    Checkpointer dropped the handle."""
    import errno

    plan = os.path.join(snap_env.tmp, "plan.json")
    with open(plan, "w") as f:
        json.dump({"phase": "write", "errno": errno.ENOSPC, "rank": 0, "step": 1}, f)
    monkeypatch.setenv("SNAPCKPT_FAULT_STORAGE", "@" + plan)
    with Checkpointer(snap_env.ckpt_dir, persister_idle_timeout_secs=5) as ck:
        h1 = ck.save_files({"a.pt": {"w": torch.ones(8)}}, 1, StorageType.DISK, dirname="best", tracker_name=None)
        with pytest.raises(OSError) as ei:
            h1.wait(timeout=60)
        assert ei.value.errno == errno.ENOSPC, repr(ei.value)
        open(plan, "w").close()  # no more storage faults (the next save of the tag goes on at once: its writer
        # waits for the failed save's partial directory to be deleted, tests/unit/test_resave_after_failure.py)
        for step in (2, 3):
            ck.save_files({"a.pt": {"w": torch.full((8,), float(step))}}, step, StorageType.DISK,
                          dirname="best", tracker_name=None).wait(timeout=60)
    m = json.load(open(os.path.join(snap_env.ckpt_dir, "best", ".snapckpt", "manifest.json")))
    assert m["step"] == 3


def test_a_step_saved_again_after_its_free_space_check_failed_commits(snap_env):
    """B4, "free space, then save again": the free-space check refuses step 2 (the rank sees 0 bytes free:
    ``InsufficientDiskError``, nothing written; the persister records the rank's failure, ``fail_part``),
    then the disk has room and the same step is saved again. Right: it commits and loads back (before: the
    retry joined the recorded failure and failed at once with the same stale ``InsufficientDiskError``)."""
    from snapckpt.errors import InsufficientDiskError

    with Checkpointer(snap_env.ckpt_dir, persister_idle_timeout_secs=5) as ck:
        ck.save({"w": torch.ones(8)}, 1).wait(timeout=60)
        real = ck.storage.free_bytes
        ck.storage.free_bytes = lambda path: 0
        with pytest.raises(InsufficientDiskError):
            ck.save({"w": torch.full((8,), 2.0)}, 2).wait(timeout=60)
        ck.storage.free_bytes = real
        ck.save({"w": torch.full((8,), 2.0)}, 2).wait(timeout=60)
        assert ck.latest_step() == 2
        assert torch.equal(ck.load(step=2)["w"], torch.full((8,), 2.0))


def test_memory_tier_of_a_deleted_and_recreated_dir_is_not_resurrected(snap_env):
    """A run crashes (no close) with a memory snapshot; the user deletes the checkpoint directory and starts
    afresh in the same path while the persister still holds the snapshot. Right: the new job finds nothing
    to load (the snapshot belongs to the deleted directory), while a restart in the untouched directory
    would load it from memory."""
    snap_env.leftover_ok = True  # the crashed job's persister idles out
    ck = Checkpointer(snap_env.ckpt_dir, persister_idle_timeout_secs=30)
    ck.save({"w": torch.ones(4)}, 7, StorageType.MEMORY)
    ck._client.close(bye=False)  # the process "dies": no close()
    again = Checkpointer(snap_env.ckpt_dir, persister_idle_timeout_secs=30)
    assert again.latest_step() == 7  # same directory: the memory tier is the crash's rescue
    again._client.close(bye=False)
    import shutil

    # the persister flushes the crashed run's snapshot to disk (its commit ends with the tracker); the user
    # deletes everything after that
    def tracker() -> str:
        try:
            with open(os.path.join(snap_env.ckpt_dir, "latest")) as f:
                return f.read().strip()
        except OSError:
            return ""

    assert wait_until(lambda: tracker() == "step_00000007", 30)

    def removed() -> bool:  # retention may still be listing the directory: retry as a user would
        shutil.rmtree(snap_env.ckpt_dir, ignore_errors=True)
        return not os.path.exists(snap_env.ckpt_dir)

    assert wait_until(removed, 30)
    with Checkpointer(snap_env.ckpt_dir, persister_idle_timeout_secs=30) as fresh:
        assert fresh.latest_step() is None


def test_P5_file_size_limit_below_the_arena_slot_names_ulimit(snap_env):
    """The job starts under ``ulimit -f`` of 64 KiB (RLIMIT_FSIZE, inherited by the persister) and saves a
    1 MiB state. Right: a PreflightError that names the limit, the slot size and ``ulimit -f``, not a
    shared-memory error; nothing is saved."""
    import resource

    from faults import limit_file_size

    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    limit_file_size(64 * 1024)  # this process and the persister it starts
    try:
        ck = Checkpointer(snap_env.ckpt_dir, persister_idle_timeout_secs=5)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    with ck:
        with pytest.raises(PreflightError) as ei:
            ck.save({"w": torch.ones(1 << 18)}, 1, StorageType.MEMORY)
        msg = str(ei.value)
        assert "ulimit -f" in msg and "65536 bytes" in msg and "unlimited" in msg, msg
        slot = int(re.search(r"slot size of rank 0 \((\d+) bytes\)", msg).group(1))
        assert slot >= 1 << 20 and "shared-memory" not in msg, msg
        assert ck.latest_step() is None


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-100, 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def test_P6b_P6c_damaged_checkpoints_each_named_and_the_loaded_step_is_known(snap_env, caplog):
    """Steps 1-4 on disk, the persister gone (no memory tier). A flipped byte in step 4: latest_step()
    still names 4 (it checks completeness, not checksums); load() refuses 4, loads 3, warns naming step 4
    and the cause, and last_load says step 3 with step 4 among the skipped. Then every checkpoint damaged
    (1 and 3 flipped, 2 truncated): the error lists each step tried and why, one line each, the truncated
    one as skipped, and names `snapckpt verify`."""
    import logging

    from snapckpt.errors import CheckpointCorruptError

    d = snap_env.ckpt_dir
    with Checkpointer(d, persister_idle_timeout_secs=5) as ck:
        for step in (1, 2, 3, 4):
            ck.save({"w": torch.full((1024,), float(step))}, step).wait()
    # The persister exits after the last clean close, but a client arriving first keeps it (and its intact
    # memory copy of step 4) alive: wait for it to go, as the scenario says (CI caught the race).
    assert wait_until(lambda: not snap_env.persisters(), 30)
    rank_file = lambda step: os.path.join(d, f"step_{step:08d}", "rank_00000.pt")
    _flip(rank_file(4))
    with Checkpointer(d, persister_idle_timeout_secs=5) as ck:
        assert ck.latest_step() == 4
        with caplog.at_level(logging.WARNING, logger="snapckpt.engine.checkpointer"):
            out = ck.load()
        assert torch.equal(out["w"], torch.full((1024,), 3.0))
        assert ck.last_load.step == 3 and ck.last_load.tier == StorageType.DISK
        assert len(ck.last_load.skipped) == 1 and "step 4 (disk, step_00000004)" in ck.last_load.skipped[0]
        warned = [r.getMessage() for r in caplog.records if "loaded step 3" in r.getMessage()]
        assert warned and "step 4" in warned[0] and "corrupted" in warned[0], caplog.text
        _flip(rank_file(3))
        _flip(rank_file(1))
        with open(rank_file(2), "r+b") as f:
            f.truncate(10)
        with pytest.raises(CheckpointCorruptError) as ei:
            ck.load()
    lines = str(ei.value).splitlines()
    assert "each one was refused" in lines[0], lines
    for step in (4, 3, 1):
        (line,) = [l for l in lines if f"step {step} (disk, step_{step:08d})" in l]
        assert "corrupted" in line and f"step_{step:08d}/rank_00000.pt" in line, line
    (line,) = [l for l in lines if "step_00000002" in l]
    assert "skipped as damaged" in line and "10 bytes" in line, line
    assert f"snapckpt verify {d}" in lines[-1], lines


def test_tracker_that_is_a_directory_is_refused_before_anything_is_written(snap_env):
    """Found by a review helper (DeepSpeed's ``latest``, the core's own is the same file). Fault: the tracker
    path is a directory (a mistaken ``mkdir``, an unpacked archive). Wrong behaviour: every commit wrote its
    step directory, then failed at its last step with ``IsADirectoryError`` naming a temporary file, and the
    tracker never moved again. Right behaviour: a DISK save raises ``CheckpointDirError`` naming the tracker
    and the fix before anything is written; a MEMORY save still works; once the directory is gone, DISK
    saves commit and the tracker names them."""
    d = snap_env.ckpt_dir
    tracker = os.path.join(d, "latest")
    os.makedirs(tracker)
    with Checkpointer(d, persister_idle_timeout_secs=5) as ck:
        with pytest.raises(CheckpointDirError) as ei:
            ck.save({"w": torch.ones(8)}, 1, StorageType.DISK)
        assert tracker in str(ei.value) and "is a directory" in str(ei.value), ei.value
        assert not [n for n in os.listdir(d) if "step_" in n], os.listdir(d)  # no step dir, no partial one
        ck.save({"w": torch.ones(8)}, 2, StorageType.MEMORY).wait()
        os.rmdir(tracker)
        ck.save({"w": torch.ones(8)}, 3, StorageType.DISK).wait()
        assert open(tracker).read() == "step_00000003"
        # found by a break-it trial: a tag naming the tracker file (DeepSpeed's tag="latest") or another plain
        # file wrote the whole step, then failed its commit with a bare NotADirectoryError naming a partial dir
        open(os.path.join(d, "notes.txt"), "w").close()
        for tag, words in (("latest", "the tracker file's name"), ("notes.txt", "which is not a directory")):
            with pytest.raises(CheckpointDirError, match=f"checkpoint tag '{tag}' names .*{words}: pick another tag"):
                ck.save_files({"f.pt": {"w": torch.ones(8)}}, 4, StorageType.DISK, dirname=tag, tracker_name="latest")
        assert not [n for n in os.listdir(d) if ".partial" in n], os.listdir(d)
        assert open(tracker).read() == "step_00000003" and ck.load()["w"].shape == (8,)


def test_rewind_then_crash_loads_the_highest_step_and_warns(snap_env, caplog):
    """Steps 100, 200, then a rewind to 5 (keep_last=3 keeps all three) and a restart. Right, as documented:
    load() picks the highest step, 200 (as the frameworks' own resume does), and warns that step 5 was
    saved after it and how to load it; load(step=5) loads it."""
    import logging

    with Checkpointer(snap_env.ckpt_dir, keep_last=3, persister_idle_timeout_secs=5) as ck:
        for step in (100, 200, 5):
            ck.save({"w": step}, step, StorageType.DISK).wait()
    with Checkpointer(snap_env.ckpt_dir, persister_idle_timeout_secs=5) as ck:
        with caplog.at_level(logging.WARNING, logger="snapckpt.engine.checkpointer"):
            assert ck.load()["w"] == 200
        assert any("step 5 (step_00000005) was saved after it" in r.getMessage() and "load(step=5)"
                   in r.getMessage() for r in caplog.records), caplog.text
        assert ck.load(step=5)["w"] == 5


def test_B3_latest_step_and_load_raise_corrupt_not_not_found_when_all_are_damaged(snap_env):
    """B3, the class behind a silent restart. Fault: the only checkpoints on disk are damaged in ways the
    quick check sees (one truncated, one whose manifest was deleted) and the persister is gone. Wrong
    behaviour: ``latest_step()`` said ``None`` and ``load()`` raised ``CheckpointNotFoundError``, which the
    README's loop, the Accelerate integration and Megatron's read as "no checkpoint: start at step 0".
    Right behaviour: both raise ``CheckpointCorruptError`` naming each damaged directory and ``snapckpt
    verify``; the files are left as they are; an empty directory still means ``None`` / not found."""
    from snapckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
    from snapckpt.ondisk.manifest import MANIFEST

    d = snap_env.ckpt_dir
    with Checkpointer(d, persister_idle_timeout_secs=1) as ck:
        with pytest.raises(CheckpointNotFoundError):
            ck.load()
        assert ck.latest_step() is None
        for step in (1, 2):
            ck.save({"w": torch.full((1024,), float(step))}, step).wait()
    data = os.path.join(d, "step_00000001", "rank_00000.pt")
    os.truncate(data, 100)
    os.remove(os.path.join(d, "step_00000002", MANIFEST))
    assert wait_until(lambda: not snap_env.persisters(), 30)  # no memory tier left
    with Checkpointer(d, persister_idle_timeout_secs=1) as ck:
        for call in (ck.latest_step, ck.load):
            with pytest.raises(CheckpointCorruptError) as ei:
                call()
            msg = str(ei.value)
            assert "step_00000001" in msg and "100 bytes" in msg and "step_00000002" in msg, msg
            assert f"snapckpt verify {d}" in msg, msg
    assert os.path.getsize(data) == 100


def test_a_rank_of_another_snapckpt_version_than_the_live_persister_is_refused_naming_the_fix(snap_env,
                                                                                            monkeypatch):
    """snapckpt upgraded while the job's persister lives on: a rank process died (here it exits without
    closing), its persister stays for persister_idle_timeout_secs so that a restarted rank finds its
    snapshots, and the restarted rank runs the new version, whose requests differ from what the persister
    accepts (a field error at some later request would name no cause). Here the restarted rank's protocol
    version differs from the real persister's. Right: ProtocolVersionError when it connects, naming both
    versions, the persister's pid and ``snapckpt stop``; a rank of the persister's version then restarts
    through the same persister, and the step the dead rank committed loads."""
    from snapckpt.errors import ProtocolVersionError
    from snapckpt.persister import protocol as P

    d = snap_env.ckpt_dir
    script = ("import os, torch; from snapckpt import Checkpointer; "
              f"ck = Checkpointer({d!r}, persister_idle_timeout_secs=60); "
              "ck.save({'w': torch.ones(4)}, 1).wait(); print(ck.persister_pid, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    version = P.PROTOCOL_VERSION
    monkeypatch.setattr(P, "PROTOCOL_VERSION", version + 1)
    with pytest.raises(ProtocolVersionError, match="snapckpt stop") as info:
        with Checkpointer(d, persister_idle_timeout_secs=60) as ck:
            ck.save({"w": torch.zeros(4)}, 2).wait()
    msg = str(info.value)
    assert f"runs protocol version {P.PROTOCOL_VERSION}, the job's persister (pid {pid}) protocol version " \
           f"{P.PROTOCOL_VERSION - 1}" in msg, msg
    monkeypatch.setattr(P, "PROTOCOL_VERSION", version)  # (not undo(): snap_env's settings would go too)
    with Checkpointer(d, persister_idle_timeout_secs=60) as ck:
        assert ck.persister_pid == pid  # the same live persister
        assert torch.equal(ck.load()["w"], torch.ones(4))
        ck.save({"w": torch.full((4,), 3.0)}, 3).wait()
        assert torch.equal(ck.load()["w"], torch.full((4,), 3.0))
