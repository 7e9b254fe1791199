"""CheckpointOptions (snapckpt/options.py): defaults, every validation error of ``__post_init__``,
``from_kwargs`` with unknown names; and the error hierarchy (snapckpt/errors.py): everything derives from
``SnapckptError(Exception)``, and the "every checkpoint was refused" error says what to do."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from snapckpt import errors
from snapckpt.options import CheckpointOptions


def test_defaults_are_valid_and_frozen():
    o = CheckpointOptions()
    assert (o.keep_last, o.slots_per_rank, o.on_slot_busy, o.fsync, o.weights_only) == (None, 2, "wait", True, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.keep_last = 3


@pytest.mark.parametrize("kwargs,word", [
    ({"keep_last": 0}, "keep_last"), ({"keep_last": -1}, "keep_last"), ({"keep_last": 2.0}, "keep_last"),
    ({"slots_per_rank": 0}, "slots_per_rank"), ({"slots_per_rank": 3.0}, "slots_per_rank"),
    ({"slots_per_rank": True}, "slots_per_rank"),
    ({"host_memory_budget_nbytes": 0}, "host_memory_budget_nbytes"),
    ({"host_memory_budget_nbytes": 1.5e9}, "host_memory_budget_nbytes"),
    ({"host_memory_budget_nbytes": True}, "host_memory_budget_nbytes"),
    ({"slot_headroom": 0.99}, "slot_headroom"), ({"slot_headroom": float("nan")}, "slot_headroom"),
    ({"on_slot_busy": "drop"}, "on_slot_busy"),
    ({"fsync": "yes"}, "fsync must be True or False"), ({"overlap": 1}, "overlap must be True or False"),
    ({"weights_only": None}, "weights_only"),
    ({"commit_timeout_secs": 0}, "commit_timeout_secs"), ({"request_timeout_secs": -5}, "request_timeout_secs"),
    ({"slot_wait_timeout_secs": float("nan")}, "slot_wait_timeout_secs"),
    ({"persister_idle_timeout_secs": "60"}, "persister_idle_timeout_secs"),
    ({"job_id": ""}, "job_id"), ({"job_id": "a/b"}, "job_id"), ({"job_id": "nul\x00"}, "job_id"),
    ({"remote_dir": "/a/local/path"}, "remote_dir must be an object store URL"), ({"remote_dir": 3}, "remote_dir"),
    # found by breaking it: each of these was accepted and failed later, far from the option (an
    # OverflowError from the socket or a ProtocolError at the first save) or meant something else
    ({"keep_last": True}, "keep_last"), ({"slot_headroom": float("inf")}, "slot_headroom"),
    ({"slot_headroom": True}, "slot_headroom"), ({"slot_headroom": "1.1"}, "slot_headroom"),
    ({"request_timeout_secs": float("inf")}, "request_timeout_secs"),
    ({"request_timeout_secs": 1e10}, "request_timeout_secs"),
    ({"commit_timeout_secs": float("inf")}, "commit_timeout_secs"),
    ({"slot_wait_timeout_secs": True}, "slot_wait_timeout_secs"),
    ({"peer_timeout_secs": float("inf")}, "peer_timeout_secs"),
])
def test_invalid_options_are_refused_naming_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        CheckpointOptions(**kwargs)


def test_valid_non_defaults_are_kept_unchanged():
    o = CheckpointOptions(keep_last=3, slots_per_rank=4, slot_headroom=1.0, on_slot_busy="skip",
                          commit_timeout_secs=1, job_id="job-1", fsync=False)
    assert (o.keep_last, o.slots_per_rank, o.slot_headroom, o.on_slot_busy, o.commit_timeout_secs, o.job_id,
            o.fsync) == (3, 4, 1.0, "skip", 1, "job-1", False)


def test_host_memory_budget_option_wins_over_the_environment(monkeypatch):
    """``host_memory_budget_nbytes``: option, then ``SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES``, then none; a
    malformed variable is refused naming it; ``slots_per_rank=1`` is a valid setting."""
    monkeypatch.setenv("SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES", " 68719476736 ")
    assert CheckpointOptions().resolved_host_memory_budget_nbytes == 64 << 30
    assert CheckpointOptions(host_memory_budget_nbytes=1 << 30).resolved_host_memory_budget_nbytes == 1 << 30
    for bad in ("64G", "-1", "0", "1e9"):
        monkeypatch.setenv("SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES", bad)
        with pytest.raises(ValueError, match="SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES"):
            CheckpointOptions().resolved_host_memory_budget_nbytes
    monkeypatch.delenv("SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES")
    assert CheckpointOptions().resolved_host_memory_budget_nbytes is None
    assert CheckpointOptions(slots_per_rank=1).slots_per_rank == 1


def test_remote_dir_option_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("SNAPCKPT_REMOTE_DIR", " s3://env-bucket/run ")
    assert CheckpointOptions().resolved_remote_dir == "s3://env-bucket/run"
    assert CheckpointOptions(remote_dir="s3://opt/run").resolved_remote_dir == "s3://opt/run"
    monkeypatch.delenv("SNAPCKPT_REMOTE_DIR")
    assert CheckpointOptions().resolved_remote_dir is None


def test_from_kwargs_refuses_unknown_names_listing_valid_ones():
    with pytest.raises(TypeError) as ei:
        CheckpointOptions.from_kwargs(keep_last=2, keep_lats=3, colour="red")
    msg = str(ei.value)
    assert "['colour', 'keep_lats']" in msg and "'keep_last'" in msg and "'fsync'" in msg
    assert CheckpointOptions.from_kwargs(keep_last=2, overlap=True) == CheckpointOptions(keep_last=2, overlap=True)
    with pytest.raises(ValueError, match="keep_last"):  # known names are still validated
        CheckpointOptions.from_kwargs(keep_last=0)


def test_resolved_dirs_prefer_the_option_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SNAPCKPT_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("SNAPCKPT_RUNTIME_DIR", str(tmp_path / "run"))
    assert CheckpointOptions().resolved_shm_dir == str(tmp_path / "shm")
    assert CheckpointOptions().resolved_runtime_dir == str(tmp_path / "run")
    o = CheckpointOptions(shm_dir="/mnt/shm", runtime_dir="/r")
    assert (o.resolved_shm_dir, o.resolved_runtime_dir) == ("/mnt/shm", "/r")


ERROR_CLASSES = [getattr(errors, n) for n in errors.__all__ if inspect.isclass(getattr(errors, n))]


def test_every_error_class_is_an_exception_under_snapckpt_error():
    assert len(ERROR_CLASSES) == len(errors.__all__) - 1  # all but the all_damaged_error function
    for cls in ERROR_CLASSES:
        assert issubclass(cls, errors.SnapckptError) and issubclass(cls, Exception), cls
    assert errors.SnapckptError.__bases__ == (Exception,)
    try:  # an `except Exception` in user code catches every snapckpt error
        raise errors.PersisterDiedError("gone")
    except Exception as e:  # noqa: BLE001
        assert isinstance(e, errors.PersisterError)


@pytest.mark.parametrize("child,parent", [
    ("CommitTimeoutError", "CommitError"), ("RankTimeoutError", "CoordinationError"),
    ("PersisterDiedError", "PersisterError"), ("PersisterTimeoutError", "PersisterError"),
    ("InsufficientSharedMemoryError", "PreflightError"), ("InsufficientDiskError", "PreflightError"),
    ("CheckpointDirError", "PreflightError"), ("CheckpointDirInUseError", "PreflightError"),
])
def test_hierarchy(child, parent):
    assert issubclass(getattr(errors, child), getattr(errors, parent))
    assert not issubclass(errors.CheckpointCorruptError, errors.CheckpointNotFoundError)


def test_all_damaged_error_lists_each_refusal_and_the_fix():
    e = errors.all_damaged_error("/ckpt", ["step_00000002: size mismatch", "step_00000001: bad checksum"],
                                 skipped=["step_00000003"], note=" (none was moved)")
    assert type(e) is errors.CheckpointCorruptError  # never "not found": callers would start afresh
    lines = str(e).splitlines()
    assert lines[0] == "no readable checkpoint of any step in /ckpt (none was moved); each one was refused:"
    assert lines[1:4] == ["  step_00000002: size mismatch", "  step_00000001: bad checksum",
                          "  step_00000003 (skipped as damaged)"]
    assert lines[4].startswith("Run `snapckpt verify /ckpt` to check every checkpoint there")
    assert "step 7 in /x;" in str(errors.all_damaged_error("/x", [], what="step 7"))


def test_megatron_drop_in_functions_refuse_an_unknown_keyword_like_the_functions_they_replace():
    """A typo of an option (``keep_lsat``) is a TypeError naming it, as Megatron-LM's own
    ``save_checkpoint`` would raise; keywords of other Megatron-LM versions are still accepted."""
    from snapckpt.integrations.megatron.registry import split_options

    assert split_options({"keep_last": 2, "ft_client": None, "tp_group": None}, "save") == {"keep_last": 2}
    with pytest.raises(TypeError, match=r"save_checkpoint\(\) got unexpected keyword arguments \['keep_lsat'\]"):
        split_options({"keep_lsat": 2}, "save")


def test_replicas_option_env_and_default(monkeypatch):
    """``replicas``: the option, then ``SNAPCKPT_REPLICAS``, then 1 across nodes; never more than the other
    nodes, none on one node; a malformed value names the fix."""
    from snapckpt.options import CheckpointOptions

    monkeypatch.delenv("SNAPCKPT_REPLICAS", raising=False)
    assert CheckpointOptions().resolved_replicas(2) == 1 and CheckpointOptions().resolved_replicas(1) == 0
    assert CheckpointOptions(replicas=3).resolved_replicas(3) == 2
    monkeypatch.setenv("SNAPCKPT_REPLICAS", "0")
    assert CheckpointOptions().resolved_replicas(4) == 0
    assert CheckpointOptions(replicas=1).resolved_replicas(4) == 1  # the option wins
    monkeypatch.setenv("SNAPCKPT_REPLICAS", "two")
    with pytest.raises(ValueError, match="SNAPCKPT_REPLICAS='two' must be a non-negative integer"):
        CheckpointOptions().resolved_replicas(2)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="replicas must be a non-negative int"):
            CheckpointOptions(replicas=bad)


def test_a_mistyped_storage_type_names_the_valid_ones():
    from snapckpt import StorageType

    assert StorageType("disk") is StorageType.DISK and StorageType(StorageType.MEMORY) is StorageType.MEMORY
    with pytest.raises(ValueError, match=r"StorageType.MEMORY or StorageType.DISK .*'memory', 'disk'.*got 'dsk'"):
        StorageType("dsk")


def test_largest_timeout_is_accepted_and_used_as_given():
    """The bound of the ``*_secs`` options is what a thread or socket wait can take (``threading.TIMEOUT_MAX``)."""
    import threading

    o = CheckpointOptions(request_timeout_secs=threading.TIMEOUT_MAX, commit_timeout_secs=86400.0 * 365)
    assert (o.request_timeout_secs, o.commit_timeout_secs) == (threading.TIMEOUT_MAX, 86400.0 * 365)
