"""Train the small GPT of ``train_gpt.py`` with DeepSpeed, checkpointed by snapckpt's config entry.

CPU-friendly by default (``DS_ACCELERATOR=cpu`` is set for you when no GPU is present)::

    torchrun --nproc_per_node 2 examples/deepspeed_gpt.py --checkpoint-dir runs/ds --steps 40 --zero-stage 2

The only snapckpt lines are ``snapckpt.deepspeed.initialize`` in place of ``deepspeed.initialize`` and the
``"snapckpt"`` section of the DeepSpeed config: memory snapshots every ``--memory-interval`` steps, a disk
checkpoint in DeepSpeed's own layout (``<dir>/global_stepN/...``, ``<dir>/latest``) every ``--disk-interval``
steps, retention of the newest ``--keep-last``. ``engine.load_checkpoint(dir)`` resumes from the newest
step every rank holds, in memory if the node's persister survived, else from disk, and the script prints
``resumed from step N (tier: memory|disk)``. The data position is derived from ``engine.global_steps``;
dropout continues identically because snapckpt saves each rank's RNG states beside DeepSpeed's files.

Kill it (``kill -9`` every rank) and start it again with the same command to see the resume. The
checkpoint loads without snapckpt too: ``engine.load_checkpoint(dir)`` with stock DeepSpeed, or
``python <dir>/zero_to_fp32.py <dir> out/`` for a consolidated fp32 state dict.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, GPTConfig, ShardedBatches, load_stdlib_bytes, lr_lambda_for  # noqa: E402

import snapckpt.deepspeed  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (ZeRO 2/3 on the CPU)")
    p.add_argument("--memory-interval", type=int, default=5)
    p.add_argument("--disk-interval", type=int, default=20)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--sleep-per-step", type=float, default=0.0, help="seconds; eases kill timing")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        # DeepSpeed JIT-compiles a shared-memory allreduce for the CPU on first use (about a minute);
        # gloo's own allreduce is enough for this example.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda *a, **k: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if os.environ.get("DS_ACCELERATOR") == "cpu" else "nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(args.seed)
    cfg = GPTConfig()
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_for(args.steps))
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": args.bf16},
        "steps_per_print": 10_000,
        "snapckpt": {
            "checkpoint_dir": args.checkpoint_dir,
            "memory_interval_steps": args.memory_interval,
            "disk_interval_steps": args.disk_interval,
            "keep_last": args.keep_last,
        },
    }
    engine, _, _, _ = snapckpt.deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                    config=config)
    path, _ = engine.load_checkpoint(args.checkpoint_dir)
    if path is not None and rank == 0:
        info = engine.snapckpt.checkpointer.last_load
        print(f"resumed from step {engine.global_steps} (tier: {info.tier.value})", flush=True)
    batches = ShardedBatches(load_stdlib_bytes(2_000_000), cfg.block_size, args.batch_size, rank, world, args.seed)
    for _ in range(int(engine.global_steps)):  # the data position follows from the step
        batches.next_batch()
    while engine.global_steps < args.steps:
        x, y = batches.next_batch()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        value = loss.detach().clone()
        torch.distributed.all_reduce(value)
        if rank == 0:
            print(f"step {engine.global_steps} loss {(value / world).item()!r}", flush=True)
        time.sleep(args.sleep_per_step)
    engine.snapckpt.close()  # saves the last step if the policy asks for it, waits for the last commit
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
