"""Commit and tier semantics of DeepSpeedCheckpointer under a slowed persister (cases B1, B6 for DeepSpeed).

Usage: ds_semantics_worker.py CKPT   (run with SNAPCKPT_FAULT_WRITE_DELAY_SECS set: every write sleeps)
Prints ``RESULT {...}`` lines with what rank 0 observed.
"""
import json
import os
import sys

import ds_common
import deepspeed
import torch.distributed as dist

from snapckpt.deepspeed import DeepSpeedCheckpointer, StorageType


def snapshot_of(path):
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path)) if f.endswith(".pt")}


def main():
    ckpt = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    engine = ds_common.build(1, "fp32")
    ds_common.train_step(engine, 1)
    rank = dist.get_rank()
    out = {}
    with DeepSpeedCheckpointer(engine, ckpt, persister_idle_timeout_secs=30) as ck:
        ck.save_checkpoint(ckpt, tag="a")
        ck.wait()
        out["latest_after_a"] = open(os.path.join(ckpt, "latest")).read()
        before = snapshot_of(os.path.join(ckpt, "a"))
        ds_common.train_step(engine, 2)
        ck.save_checkpoint(ckpt, tag="b")  # returns while the slowed persister still writes
        out["latest_while_b_persists"] = open(os.path.join(ckpt, "latest")).read()
        out["b_visible_while_persisting"] = os.path.exists(os.path.join(ckpt, "b"))
        ck.wait()
        out["latest_after_b"] = open(os.path.join(ckpt, "latest")).read()
        ds_common.train_step(engine, 3)
        ck.save_checkpoint(ckpt, tag="a", storage_type=StorageType.MEMORY)  # same tag, memory only
        ck.wait()
        dist.barrier()
        out["a_unchanged_by_memory_save"] = snapshot_of(os.path.join(ckpt, "a")) == before
        out["latest_after_memory_save"] = open(os.path.join(ckpt, "latest")).read()
        for bad in ("x/y", "glob*tag", ".hidden"):
            try:
                ck.save_checkpoint(ckpt, tag=bad)
                out[f"tag {bad}"] = "accepted"
            except ValueError as e:
                out[f"tag {bad}"] = str(e)
        try:
            ck.save_checkpoint(ckpt + "_other", tag="c")
            out["other_dir"] = "accepted"
        except Exception as e:
            out["other_dir"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
