"""A minimal Megatron-style pretraining loop over megatron-core, with the ``--snapckpt`` flag.

    python -m torch.distributed.run --nproc_per_node 2 examples/megatron_gpt.py --save ckpt \\
        --train-iters 40 --save-interval 20 --snapckpt --snapckpt-memory-interval 2

Megatron-LM's shape: argparse flags (``--save``/``--load``/``--save-interval``/``--train-iters``/
``--tensor-model-parallel-size``, plus snapckpt's from ``snapckpt.megatron.add_arguments``, Megatron-LM's
``extra_args_provider``), ``load_checkpoint`` before the loop, ``save_checkpoint`` every ``--save-interval``
iterations and at the end. With ``--snapckpt`` the checkpoint functions are snapckpt's drop-ins
(``snapckpt.megatron_dist_ckpt``) and memory snapshots are taken every ``--snapckpt-memory-interval``
iterations; without it they are megatron-core's stock ``dist_checkpointing.save``/``load`` in the same
``torch_dist`` layout. Rerun the same command after ``kill -9`` to resume (from memory when the node kept
it). The model is a small GPT on synthetic tokens; the GPU is used when there is one, otherwise the CPU
(gloo) with ``tests/workers/megatron_cpu.py`` standing in for it.
"""
import argparse
import logging
import os
import sys
import time

import torch

import snapckpt.megatron


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save", required=True)
    p.add_argument("--load", default=None, help="default: --save")
    p.add_argument("--save-interval", type=int, default=20)
    p.add_argument("--train-iters", type=int, default=40)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    snapckpt.megatron.add_arguments(p)  # Megatron-LM: pretrain(..., extra_args_provider=add_arguments)
    args = p.parse_args()
    args.load = args.load or args.save
    return args


def initialize(args):
    import random

    import numpy as np

    if not torch.cuda.is_available():
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "workers"))
        import megatron_cpu  # stands in for the missing GPU

        megatron_cpu.install()
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def build(args):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=4,
                            use_cpu_initialization=True, tensor_model_parallel_size=args.tensor_model_parallel_size,
                            pipeline_dtype=torch.float32, hidden_dropout=0.1, attention_dropout=0.1)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
                     max_sequence_length=args.seq_length)
    if torch.cuda.is_available():
        model.cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10,
                                    lr_warmup_steps=2, lr_decay_steps=max(3, args.train_iters),
                                    lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=1,
                                    wd_incr_style="constant")
    return model, optimizer, sched


def train_step(args, model, optimizer, sched, iteration):
    from megatron.core import parallel_state as ps

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1000 * iteration + ps.get_data_parallel_rank())
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length), generator=g).to(dev)
    pos = torch.arange(args.seq_length, device=dev).expand_as(tokens)
    mask = torch.ones(args.seq_length, args.seq_length, dtype=torch.bool, device=dev).triu(1)[None, None]
    optimizer.zero_grad()
    loss = model(tokens, pos, mask, labels=tokens.roll(-1, dims=1)).float().mean()
    loss.backward()
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad, group=ps.get_data_parallel_group())
            p.grad /= dp
    if args.snapckpt:
        from snapckpt.megatron_dist_ckpt import fence

        fence()  # with --snapckpt-overlap: the last snapshot's copy ends before parameters change
    optimizer.step()
    sched.step(1)
    return loss.item()


def checkpoint_functions(args):
    """snapckpt's drop-ins with --snapckpt, megatron-core's stock torch_dist save/load otherwise."""
    if args.snapckpt:
        from snapckpt.megatron_dist_ckpt import load_checkpoint, save_checkpoint

        opts = snapckpt.megatron.checkpointer_options(args)
        return (lambda *a, **k: save_checkpoint(*a, save_dir=args.save, args=args, **opts, **k),
                lambda *a, **k: load_checkpoint(*a, load_dir=args.load, args=args, **opts, **k))
    from snapckpt.integrations.megatron.state import build_state_dict  # the same state dict, saved the stock way
    from megatron.core import dist_checkpointing

    def save(iteration, model, optimizer, sched, flops, storage_type=None):
        path = os.path.join(args.save, f"iter_{iteration:07d}")
        os.makedirs(path, exist_ok=True)
        dist_checkpointing.save(build_state_dict(None, model, optimizer, sched, iteration, flops, False, True, True),
                                path)
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(args.save, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))

    def load(model, optimizer, sched):
        from snapckpt.megatron_dist_ckpt import load_checkpoint  # reads stock directories natively

        return load_checkpoint(model, optimizer, sched, load_dir=args.load, args=args)

    return save, load


def routing(args) -> str:
    """One line saying who checkpoints. This is not Megatron-LM's ``pretrain()``: the loop below calls the
    checkpoint functions itself, so ``snapckpt.megatron.enable`` (which rebinds Megatron-LM's own
    functions inside ``pretrain()``) has nothing to do here and is not called."""
    if not args.snapckpt:
        return "--snapckpt is off: megatron-core's stock torch_dist save/load"
    return (f"--snapckpt is on: this loop calls snapckpt.megatron_dist_ckpt.save_checkpoint/load_checkpoint "
            f"(memory every {args.snapckpt_memory_interval or 'never'}, disk every {args.save_interval} "
            "iterations)")


def resumed_from(args, iteration: int) -> str:
    """Where the resumed state came from: snapckpt's memory or disk tier, a stock directory, or nothing."""
    if iteration == 0:
        return "fresh start: no checkpoint"
    if not args.snapckpt:
        return "resumed from disk"
    from snapckpt.megatron_dist_ckpt import get_checkpointer

    last = get_checkpointer(args.load, **snapckpt.megatron.checkpointer_options(args)).last_load
    if last is None:
        return "resumed from disk: a directory megatron-core wrote itself"
    return f"resumed from {last.tier.value}, iteration {last.step}"


def main():
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args()
    initialize(args)
    rank = torch.distributed.get_rank()
    if rank == 0:
        print(f"snapckpt: {routing(args)}", flush=True)
    if args.snapckpt_disk_interval:
        args.save_interval = args.snapckpt_disk_interval
    model, optimizer, sched = build(args)
    save, load = checkpoint_functions(args)
    iteration, flops = load([model], optimizer, sched)
    if rank == 0:
        print(f"starting at iteration {iteration} ({resumed_from(args, iteration)})", flush=True)
    from snapckpt import StorageType

    while iteration < args.train_iters:
        t0 = time.perf_counter()
        loss = train_step(args, model, optimizer, sched, iteration)
        iteration += 1
        flops += 6 * sum(p.numel() for p in model.parameters()) * args.micro_batch_size * args.seq_length
        t1 = time.perf_counter()
        what = ""
        if iteration % args.save_interval == 0 or iteration == args.train_iters:
            save(iteration, [model], optimizer, sched, flops)
            what = "disk checkpoint"
        elif args.snapckpt and args.snapckpt_memory_interval and iteration % args.snapckpt_memory_interval == 0:
            save(iteration, [model], optimizer, sched, flops, storage_type=StorageType.MEMORY)
            what = "memory snapshot"
        if rank == 0:
            stall = f", {what} stall {time.perf_counter() - t1:.3f} s" if what else ""
            print(f"iteration {iteration:5d} | loss {loss:.4f} | step {t1 - t0:.3f} s{stall}", flush=True)
    if args.snapckpt:
        from snapckpt.megatron_dist_ckpt import close_all

        close_all()  # waits for the last commit
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
