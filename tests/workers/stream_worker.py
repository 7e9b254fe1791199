"""Worker for tests/test_stream_persist.py (issue 18, streamed DISK saves): one rank, started by
``_harness.launch``.

Mode ``die_mid_copy CKPT``: save step 1 to disk and wait for its commit, print ``RESULT {"committed": 1}``,
then save step 2 to disk; the test arms a SIGKILL halfway through step 2's copy (fault point
``snapshot.mid_copy``), while the persister is already writing the part.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the harness
from snapckpt import Checkpointer, StorageType  # noqa: E402

QUICK = dict(commit_timeout_secs=60, request_timeout_secs=30, coordination_timeout_secs=30,
             persister_startup_timeout_secs=60)


def state(step: int) -> dict:
    """Four 24 MiB tensors and a scalar, every element ``step`` (so a loaded step is recognised)."""
    return {f"t{i}": torch.full((6 << 20,), float(step)) for i in range(4)} | {"step": step}


def die_mid_copy(ckpt: str) -> None:
    with Checkpointer(ckpt, **QUICK) as ck:
        ck.save(state(1), 1, storage_type=StorageType.DISK).wait()
        print("RESULT " + json.dumps({"committed": 1, "persister_pid": ck.persister_pid}), flush=True)
        ck.save(state(2), 2, storage_type=StorageType.DISK).wait()
    print("RESULT " + json.dumps({"survived": True}), flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"die_mid_copy": die_mid_copy}[mode](*args)
