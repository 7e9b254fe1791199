"""A torchrun worker for the restart-attempt test (contract 12, case G5).

Attempt 0: every rank opens a Checkpointer, asks ``latest_step()`` (nothing yet), saves step 5 to disk and
waits for the commit; then rank 1 exits with an error, so torchrun (``--max_restarts 1``) restarts every
worker. Attempt 1: every rank opens a Checkpointer again in the same rendezvous store, asks
``latest_step()`` (rank 0 late, so that a stale record would be read before rank 0 posts its own) and
loads. Each rank writes what it saw to ``<out>/attempt<A>_rank<R>.json``.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    ckpt_dir, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_rank()
    from snapckpt import Checkpointer, StorageType

    seen = {"attempt": attempt, "rank": rank}
    with Checkpointer(ckpt_dir) as ck:
        if attempt > 0 and rank == 0:
            # rank 0 answers late: a rank 1 that took attempt 0's records for this round's would not wait
            time.sleep(3)
        seen["latest"] = ck.latest_step()
        if attempt == 0:
            ck.save({"w": torch.full((4,), 5.0), "step": 5}, 5, StorageType.DISK).wait()
        else:
            state = ck.load()
            seen["loaded_step"], seen["w"] = state["step"], state["w"].tolist()
        ck.coordinator.gather("done", {})  # nobody leaves before every rank has its answers
    with open(os.path.join(out, f"attempt{attempt}_rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()  # every rank's answers are written before rank 1 fails (torchrun then stops the others)
    if attempt == 0 and rank == 1:
        os._exit(3)  # a worker failure: torchrun restarts the whole group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
