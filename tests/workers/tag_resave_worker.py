"""Worker ranks for tests/test_tag_resave.py: two ranks save step 7 under the tag ``best`` twice, each save waited
for (``save_files(...).wait()``), rank 1 slower: it waits for its first save only once rank 0 handed over its
second (marker file ``R0_SAVED``).

Usage: ``tag_resave_worker.py DIR MARKER``. Each rank prints ``RESULT {json}`` (its saves' outcomes).
"""
import json
import os
import sys
import time

import torch

from snapckpt import Checkpointer, StorageType

OPTS = dict(persister_idle_timeout_secs=5, commit_timeout_secs=20, request_timeout_secs=30,
            coordination_timeout_secs=60)


def files(rank: int, gen: int) -> dict:
    return {f"rank{rank}.pt": {"w": torch.full((1024,), float(gen * 100 + rank))}}


def main(d: str, marker: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {"rank": rank}
    with Checkpointer(d, **OPTS) as ck:
        h1 = ck.save_files(files(rank, 1), 7, StorageType.DISK, dirname="best", tracker_name="latest",
                           tracker_content="best")
        ck.fence()  # handed over
        if rank == 1:  # slower: rank 0 has committed its first save and handed over its second by now
            deadline = time.monotonic() + 60
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)
        try:
            h1.wait()
            out["first"] = "committed"
        except Exception as e:
            out["first"] = f"{type(e).__name__}: {e}"[:300]
        h2 = ck.save_files(files(rank, 2), 7, StorageType.DISK, dirname="best", tracker_name="latest",
                           tracker_content="best")
        ck.fence()
        if rank == 0:
            open(marker, "w").close()
        try:
            h2.wait()
            out["second"] = "committed"
        except Exception as e:
            out["second"] = f"{type(e).__name__}: {e}"[:300]
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
