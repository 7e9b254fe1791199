"""Resume fidelity through the config entry (``snapckpt.deepspeed.initialize`` + a "snapckpt" section).

Usage: ds_resume_worker.py CKPT STAGE DTYPE TOTAL KILL_AT MEM_EVERY DISK_EVERY WAIT [REMOTE_DIR]
With memory snapshots (MEM_EVERY > 0) the copy is overlapped (``overlap``: it runs during forward and
backward, and DeepSpeed's pre-optimizer-step call fences it). ``CKPT=-`` trains without snapckpt (the uninterrupted reference); ``CKPT=stock:<dir>`` loads ``<dir>`` with DeepSpeed's own ``load_checkpoint`` (no snapckpt), then trains. Otherwise the engine resumes with
``engine.load_checkpoint(CKPT)`` (memory tier first) and trains to TOTAL; with ``KILL_AT > 0`` every rank
SIGKILLs itself at the end of step KILL_AT+1 (the policy snapshot of step KILL_AT was taken at that step's
forward and fenced by its ``engine.step()``; with WAIT=1 after waiting for its commit). Prints ``RESULT {"step", "loss"}``
per step and ``RESUMED <step> <tier>``. REMOTE_DIR (an ``s3://`` URL) goes into the section as ``remote_dir``.
``DS_REF_TOTAL=N`` in the environment: first train a stock engine (as ``CKPT=-``) N steps in the same process,
printing ``REFLOSS {"step", "loss"}`` per step (the uninterrupted reference without a launch of its own; every
engine is built from the same seed and every batch is a function of its step and rank).
"""
import json
import os
import signal
import sys

import ds_common
import deepspeed
import torch.distributed as dist

import snapckpt.deepspeed as sd


def main():
    ckpt, stage, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    total, kill_at, mem, disk, wait = (int(a) for a in sys.argv[4:9])
    deepspeed.init_distributed(dist_backend="gloo")
    if os.environ.get("DS_REF_TOTAL"):
        ref = ds_common.build(stage, dtype)
        for step in range(1, int(os.environ["DS_REF_TOTAL"]) + 1):
            print("REFLOSS " + json.dumps({"step": step, "loss": ds_common.train_step(ref, step)}), flush=True)
        ref.destroy()
        del ref
    stock = ckpt.startswith("stock:")
    if ckpt == "-":
        engine = ds_common.build(stage, dtype)
    elif stock:  # DeepSpeed's own engine.load_checkpoint of the directory, no snapckpt
        ckpt = ckpt[len("stock:"):]
        engine = ds_common.build(stage, dtype)
        path, _ = engine.load_checkpoint(ckpt)
        if path is not None:
            print(f"RESUMED {engine.global_steps} stock", flush=True)
    else:
        section = {"checkpoint_dir": ckpt, "memory_interval_steps": mem or None,
                   "disk_interval_steps": disk or None, "keep_last": 2,
                   "options": {"persister_idle_timeout_secs": 30, "overlap": mem > 0}}
        if len(sys.argv) > 9:
            section["remote_dir"] = sys.argv[9]
        engine = ds_common.build(stage, dtype, initialize=sd.initialize, snapckpt=section)
        path, _ = engine.load_checkpoint(ckpt)
        if path is not None:
            print(f"RESUMED {engine.global_steps} {engine.snapckpt.checkpointer.last_load.tier.value}", flush=True)
    if ckpt != "-" and stage == 0 and engine.global_steps:  # what was loaded: sums (float64) of the
        # parameters and optimizer moments, the learning rate (ZeRO 1-3 optimizers have other state dicts)
        opt = engine.optimizer.state_dict()["state"]
        print("LOADED " + json.dumps({"params": [float(p.double().sum()) for p in engine.module.parameters()],
                                      "exp_avg": [float(v["exp_avg"].double().sum()) for _, v in sorted(opt.items())
                                                  if "exp_avg" in v],
                                      "lr": engine.lr_scheduler.get_last_lr()}), flush=True)
    for step in range(int(engine.global_steps) + 1, total + 1):
        loss = ds_common.train_step(engine, step)
        print("RESULT " + json.dumps({"step": step, "loss": loss}), flush=True)
        if kill_at and step == kill_at + 1:
            # the policy snapshot of step kill_at was taken at this step's forward and fenced by its
            # engine.step(); the one of this step would be taken at the next forward
            if wait:
                engine.snapckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    if ckpt != "-" and not stock:
        engine.snapckpt.close()
    ds_common.exit_after_barrier()


if __name__ == "__main__":
    main()
