"""The "closed during a failure: not a clean end" warning of a ``with Checkpointer(...)`` block left by an
exception says that the persister keeps this rank's memory snapshots and flushes the newest to disk. It is
said only when something of this Checkpointer is not known to be on disk. Before, a ``load()`` that failed in
a fresh job (nothing saved yet) warned too, which read as if checkpoints were at risk."""
from __future__ import annotations

import logging
import os

import pytest

from snapckpt import Checkpointer, StorageType
from snapckpt.errors import CheckpointNotFoundError
from workers.commit_crash_worker import make_state

OPTS = dict(persister_idle_timeout_secs=3, commit_timeout_secs=30, request_timeout_secs=30,
            coordination_timeout_secs=30)
WARNING = "not a clean end"


def _warned(caplog) -> list:
    return [r for r in caplog.records if WARNING in r.getMessage() and r.levelno >= logging.WARNING]


def test_a_failed_load_before_any_save_does_not_warn(snap_env, caplog):
    os.makedirs(snap_env.ckpt_dir)
    with caplog.at_level(logging.INFO, logger="snapckpt.engine.checkpointer"):
        with pytest.raises(CheckpointNotFoundError):
            with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
                ck.load()
    assert not _warned(caplog), caplog.text
    assert "none of its snapshots awaits the disk" in caplog.text, caplog.text  # still said, at INFO


class _Boom(Exception):
    pass


@pytest.mark.parametrize("how, warns", [("memory", True), ("disk_in_flight", True), ("disk_committed", False)])
def test_a_failure_after_a_save_warns_while_a_snapshot_is_not_known_on_disk(snap_env, caplog, how, warns):
    with caplog.at_level(logging.INFO, logger="snapckpt.engine.checkpointer"):
        with pytest.raises(_Boom):
            with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
                tier = StorageType.MEMORY if how == "memory" else StorageType.DISK
                h = ck.save(make_state(1, 0), 1, tier)
                if how == "disk_committed":
                    h.wait()
                raise _Boom("the training loop failed")
    assert bool(_warned(caplog)) == warns, caplog.text
