"""DeepSpeed arena reservation worker: a ``DeepSpeedCheckpointer`` without ``expected_nbytes``; after the first
optimizer step the next forward has the arena reserved for the engine's state (``Checkpointer.expect``), before
the first save. Each rank prints ``RESULT {...}`` with its slot file sizes before step 1, after the forward of
step 2 (waited for), the estimate, and what the save of step 2 left.

argv: checkpoint_dir zero_stage
"""
import json
import os
import sys
import time

from ds_common import build, train_step

from snapckpt.deepspeed import DeepSpeedCheckpointer
from snapckpt.engine.preflight import tensor_nbytes


def slot_sizes(rank: int) -> list:
    root = os.environ["SNAPCKPT_SHM_DIR"]
    return sorted(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
                  if f.startswith(f"r{rank:05d}-s"))


if __name__ == "__main__":
    ckpt, stage = sys.argv[1], int(sys.argv[2])
    engine = build(stage, "fp32")
    rank = engine.global_rank
    with DeepSpeedCheckpointer(engine, ckpt, persister_idle_timeout_secs=30) as ck:
        before = slot_sizes(rank)
        train_step(engine, 1)
        after_step1 = slot_sizes(rank)  # no forward since the optimizer step: nothing asked yet
        need = tensor_nbytes({"module": engine.module, "optimizer": engine.optimizer})
        want = int(need * ck.checkpointer.options.slot_headroom) + (1 << 20)
        train_step(engine, 2)  # its forward reserves
        deadline = time.monotonic() + 30
        while slot_sizes(rank) != [want, want] and time.monotonic() < deadline:
            time.sleep(0.02)
        reserved = slot_sizes(rank)
        ck.save_checkpoint(ckpt, storage_type="disk")
        ck.wait()
        saved = slot_sizes(rank)
    print("RESULT " + json.dumps({"rank": rank, "before": before, "after_step1": after_step1, "need": need,
                                  "want": want, "reserved": reserved, "saved": saved,
                                  "files": sorted(os.listdir(os.path.join(ckpt, "global_step2")))}), flush=True)
