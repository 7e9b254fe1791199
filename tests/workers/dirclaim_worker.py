"""Worker of tests/test_dir_claim.py: job "first" saving into a checkpoint directory, one rank, plain core API.

Usage: ``dirclaim_worker.py CHECKPOINT_DIR STATUS_DIR``. Saves DISK steps 1 and 2 (each committed), writes
``STATUS_DIR/saved-2``, waits for ``STATUS_DIR/go``, saves steps 3 and 4, writes ``STATUS_DIR/saved-4`` and
then stays alive (holding the directory's writer claim) until it is killed (at most 300 s).

``dirclaim_worker.py refused CHECKPOINT_DIR`` (2 ranks, gloo): a job whose directory another job holds;
every rank's first save must raise CheckpointDirInUseError; prints ``RESULT {json}`` per rank.
"""
import os
import sys
import time

import torch


def mark(status: str, name: str) -> None:
    with open(os.path.join(status, name + ".tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(status, name + ".tmp"), os.path.join(status, name))


def wait_for(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{path} never appeared")
        time.sleep(0.05)


def main() -> None:
    from snapckpt import Checkpointer, StorageType

    ckpt, status = sys.argv[1], sys.argv[2]
    ck = Checkpointer(ckpt, job_id="first", persister_idle_timeout_secs=30)
    for step in (1, 2):
        ck.save({"w": torch.full((256,), float(step))}, step, StorageType.DISK).wait()
    mark(status, "saved-2")
    wait_for(os.path.join(status, "go"), 120)
    for step in (3, 4):
        ck.save({"w": torch.full((256,), float(step))}, step, StorageType.DISK).wait()
    mark(status, "saved-4")
    time.sleep(300)  # killed by the test (kill -9: no close())
    os._exit(1)


def refused(ckpt: str) -> None:
    """Both ranks save; rank 0 finds the claim held, and every rank must raise the same error."""
    import json

    import torch.distributed as dist

    from snapckpt import Checkpointer, StorageType

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with Checkpointer(ckpt, job_id="two-ranks", persister_idle_timeout_secs=10,
                      coordination_timeout_secs=30) as ck:
        try:
            ck.save({"w": torch.ones(4)}, 5, StorageType.DISK)
            err = None
        except Exception as e:
            err = {"type": type(e).__name__, "message": str(e)}
        print("RESULT " + json.dumps({"rank": rank, "error": err}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "refused":
        refused(sys.argv[2])
    else:
        main()
