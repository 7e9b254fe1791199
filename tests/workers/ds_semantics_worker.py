"""Commit and tier semantics of DeepSpeedCheckpointer under a slowed persister (cases B1, B6 for DeepSpeed).

Usage: ds_semantics_worker.py CKPT   (run with SNAPCKPT_FAULT_WRITE_DELAY_SECS set: every write sleeps)
Prints ``RESULT {...}`` lines with what rank 0 observed.
"""
import json
import os
import sys

import ds_common
import deepspeed
import torch
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
        for bad in ("x/y", "..", "glob*tag", ".hidden", "latest", " lead"):
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
        # two tags at one step hold different weights; tag= picks by tag, not by step
        first = ds_common.full_params(engine)
        ck.save_checkpoint(ckpt, tag="x")
        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(1.0)
        engine.optimizer.refresh_fp32_params() if hasattr(engine.optimizer, "refresh_fp32_params") else None
        ck.save_checkpoint(ckpt, tag="y")
        ck.wait()
        path, _ = ck.load_checkpoint(ckpt, tag="x")
        got = ds_common.full_params(engine)
        out["tag_x_path"] = os.path.basename(os.path.dirname(path))
        out["tag_x_weights"] = all(torch.equal(first[k], got[k]) for k in first)
        try:
            ck.load_checkpoint(ckpt, tag="../x")
            out["load_tag ../x"] = "loaded"
        except ValueError as e:
            out["load_tag ../x"] = str(e)
        try:
            ck.load_checkpoint(ckpt, tag="nope")
            out["missing_tag"] = "loaded"
        except Exception as e:
            out["missing_tag"] = f"{type(e).__name__}: {e}"
        # an emptied `latest` (a truncated write, an edit): the newest intact tag is loaded, with a warning
        import logging

        seen = []
        catcher = logging.Handler(logging.WARNING)
        catcher.emit = lambda record: seen.append(record.getMessage())
        logging.getLogger("snapckpt").addHandler(catcher)
        if rank == 0:
            with open(os.path.join(ckpt, "latest"), "w"):
                pass
        dist.barrier()
        try:
            path, _ = ck.load_checkpoint(ckpt)
            out["empty_latest"] = os.path.basename(os.path.dirname(path))
        except Exception as e:
            out["empty_latest"] = f"{type(e).__name__}: {e}"
        finally:
            logging.getLogger("snapckpt").removeHandler(catcher)
        out["empty_latest_warned"] = [m for m in seen if "is empty or unreadable" in m] if rank == 0 else None
        # `latest` naming a tag that is not there, and no checkpoint at all: a named error, not DeepSpeed's
        # loader (which fails on it with a bare AssertionError)
        stale = ckpt + "_stale"
        if rank == 0:
            os.makedirs(stale)
            with open(os.path.join(stale, "latest"), "w") as f:
                f.write("global_step7")
        dist.barrier()
        ck2 = DeepSpeedCheckpointer(engine, stale, persister_idle_timeout_secs=30)
        try:
            ck2.load_checkpoint(stale)
            out["stale_latest"] = "loaded"
        except Exception as e:
            out["stale_latest"] = f"{type(e).__name__}: {e}"
        # the same with `latest` emptied: a named error too, not DeepSpeed's bare AssertionError
        if rank == 0:
            with open(os.path.join(stale, "latest"), "w"):
                pass
        dist.barrier()
        try:
            ck2.load_checkpoint(stale)
            out["empty_stale_latest"] = "loaded"
        except Exception as e:
            out["empty_stale_latest"] = f"{type(e).__name__}: {e}"
        finally:
            ck2.close()
        # DeepSpeed's save_16bit_model goes through the checkpoint engine: written at once, on every rank
        out["16bit_other"] = engine.save_16bit_model(ckpt + "_16bit")
        out["16bit_own"] = engine.save_16bit_model(ckpt, "weights.bin")
        dist.barrier()
        out["16bit_files"] = [os.path.exists(os.path.join(ckpt + "_16bit", "pytorch_model.bin")),
                              os.path.exists(os.path.join(ckpt, "weights.bin"))]
        engine.destroy()  # closes the checkpointer: commits waited for, the engine's own engine given back
        out["closed_by_destroy"] = ck.closed and type(engine.checkpoint_engine).__name__ != "SnapckptCheckpointEngine"
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    ds_common.exit_after_barrier()


if __name__ == "__main__":
    main()
