"""Worker for tests/test_multinode.py's out-of-order commit test, run under torchrun on every node of the rig.

``mn_out_of_order_worker.py CKPT_DIR``: a ``Checkpointer(keep_last=1)`` saves steps 1 and 2 to disk back to back
(the test holds their commits on the committer node with fault points), waits for both and prints
``RESULT {"rank", "1", "2"}``: ``committed`` or the error each save's ``wait()`` raised.

``mn_out_of_order_worker.py CKPT_DIR tag SIGNAL_DIR``: the same under a fixed tag (``save_files(dirname="best")``,
tracker ``latest`` naming ``best@<step>``, ``w`` = 10 * step + rank), no ``keep_last``; once the save of step 2
has returned, the rank writes ``SIGNAL_DIR/saved2-<rank>`` and the RESULT adds ``first_done``: whether step
1's save had ended by then.
"""
import json
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    import sys

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    from snapckpt import Checkpointer, StorageType

    res = {}
    tag = sys.argv[2:3] == ["tag"]
    with Checkpointer(sys.argv[1], keep_last=None if tag else 1, commit_timeout_secs=120) as ck:
        st = {"w": torch.full((64,), float(rank))}
        if tag:
            handles = {s: ck.save_files({f"rank{rank}.pt": {"w": torch.full((64,), float(10 * s + rank))}}, s,
                                        StorageType.DISK, dirname="best", tracker_name="latest",
                                        tracker_content=f"best@{s}") for s in (1,)}
            handles[2] = ck.save_files({f"rank{rank}.pt": {"w": torch.full((64,), float(20 + rank))}}, 2,
                                       StorageType.DISK, dirname="best", tracker_name="latest",
                                       tracker_content="best@2")
            res["first_done"] = handles[1].done()
            open(f"{sys.argv[3]}/saved2-{rank}", "w").close()
        else:
            handles = {s: ck.save(st, s, StorageType.DISK) for s in (1, 2)}
        for s, h in handles.items():
            try:
                h.wait(timeout=150)
                res[str(s)] = "committed"
            except Exception as e:
                res[str(s)] = f"{type(e).__name__}: {e}"[:300]
        print("RESULT " + json.dumps({"rank": rank, **res}), flush=True)
        dist.barrier()


if __name__ == "__main__":
    main()
