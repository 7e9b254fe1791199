"""DeepSpeed monitor worker: an engine with the CSV monitor enabled in its config, a DISK save at step 2, a
MEMORY save at step 3; rank 0 prints ``RESULT {...}`` with the monitor's directory and the events seen.

argv: checkpoint_dir csv_dir
"""
import json
import sys

from ds_common import build, train_step

from snapckpt.deepspeed import DeepSpeedCheckpointer
from snapckpt.metrics import event_metrics

if __name__ == "__main__":
    ckpt, csv_dir = sys.argv[1], sys.argv[2]
    engine = build(0, "fp32", csv_monitor={"enabled": True, "output_path": csv_dir, "job_name": "job"})
    seen = []
    with DeepSpeedCheckpointer(engine, ckpt, persister_idle_timeout_secs=30) as ck:
        ck.checkpointer.add_listener(lambda e: seen.append({"kind": e.kind, "step": e.step,
                                                            "metrics": event_metrics(e)}))
        for step in range(1, 4):
            train_step(engine, step)
            if step in (2, 3):
                ck.save_checkpoint(ckpt, storage_type="disk" if step == 2 else "memory")
        ck.wait()
    if engine.global_rank == 0:
        print("RESULT " + json.dumps({"seen": seen}), flush=True)
