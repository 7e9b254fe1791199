"""DeepSpeed: training stall per checkpoint, snapckpt against ``engine.save_checkpoint`` on the same engine.

Run under torchrun (2 ranks on the CPU here)::

    torchrun --nproc_per_node 2 benchmarks/deepspeed_stall.py --out benchmarks/results/deepspeed \\
        --d-model 1024 --layers 8 --zero-stage 2 --repeats 3

One engine (a GPT-style stack of ``--layers`` blocks of width ``--d-model``, AdamW, ZeRO ``--zero-stage``),
trained one step, then per method and repeat (after ``--warmups`` untimed saves, default 2) the seconds ``save`` blocks the training
process, as the max over ranks (the slowest rank is the stall):

* ``native``: ``engine.save_checkpoint`` with DeepSpeed's own (torch.save) checkpoint engine; it returns
  when the files are written to the page cache (DeepSpeed does not fsync);
* ``snapckpt_memory``: ``DeepSpeedCheckpointer.save_checkpoint(storage_type=MEMORY)``;
* ``snapckpt_disk``: ``storage_type=DISK``; also ``durable_s``, until the commit (fsynced, ``latest`` moved).

Modes: ``--frozen`` freezes all but the last block and saves with ``exclude_frozen_parameters`` (the LoRA
case). Writes ``deepspeed_stall.json`` and a markdown table with the ratio native / snapckpt under
``--out`` (rank 0). Numbers are for one machine at one time: compare ratios, not seconds.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import time

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))


def model(d: int, layers: int) -> torch.nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)]
    return torch.nn.Sequential(*blocks)


def gpt2(d: int, layers: int, vocab: int, seq: int) -> torch.nn.Module:
    """A GPT-2-style decoder (Hugging Face ``GPT2LMHeadModel``, tied embeddings), ``d`` wide."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=d, n_layer=layers, n_head=max(1, d // 64), vocab_size=vocab, n_positions=seq)
    return GPT2LMHeadModel(cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/deepspeed")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--frozen", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmups", type=int, default=2, help="untimed saves per method first (snapckpt's arena has "
                   "2 slots per rank: each is faulted in by its first use)")
    p.add_argument("--arch", choices=("mlp", "gpt2"), default="mlp",
                   help="mlp: Linear-GELU-Linear blocks; gpt2: a GPT-2-style decoder (transformers)")
    p.add_argument("--vocab", type=int, default=32000, help="gpt2 only")
    p.add_argument("--seq", type=int, default=64, help="gpt2 only: sequence length of the one training step")
    p.add_argument("--bf16", action="store_true",
                   help="DeepSpeed bf16 mixed precision (bf16 weights, fp32 master weights and Adam state)")
    p.add_argument("--tag", default=None, help="name of the output files (default from stage and mode)")
    args = p.parse_args()
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda *a, **k: None
    import deepspeed
    import torch.distributed as dist

    from snapckpt.deepspeed import DeepSpeedCheckpointer, StorageType

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = gpt2(args.d_model, args.layers, args.vocab, args.seq) if args.arch == "gpt2" else model(args.d_model, args.layers)
    if args.frozen:
        # LoRA-style: the base frozen; only the last block (and, for gpt2, the final norm) trains.
        last = net.transformer.h[-1] if args.arch == "gpt2" else None
        trainable = set(map(id, last.parameters())) | set(map(id, net.transformer.ln_f.parameters())) \
            if last is not None else set(map(id, list(net.parameters())[-2:]))
        for p_ in net.parameters():
            if id(p_) not in trainable:
                p_.requires_grad_(False)
    nparams = sum(p_.numel() for p_ in net.parameters())  # before ZeRO-3 partitions them
    opt = torch.optim.AdamW([p_ for p_ in net.parameters() if p_.requires_grad], lr=1e-4)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": args.zero_stage},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
    if args.arch == "gpt2":
        ids = torch.randint(0, args.vocab, (2, args.seq))
        loss = engine(input_ids=ids, labels=ids).loss
    else:
        x = torch.randn(2, args.d_model, dtype=torch.bfloat16 if args.bf16 else torch.float32)
        loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    out = os.path.abspath(args.out)
    native_dir, snap_dir = os.path.join(out, "native_ckpt"), os.path.join(out, "snap_ckpt")
    if rank == 0:
        for d in (native_dir, snap_dir):
            shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    excl = args.frozen

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    results = {"native": [], "snapckpt_memory": [], "snapckpt_disk": [], "snapckpt_disk_durable": []}
    for i in range(args.warmups + args.repeats):
        results["native"].append(timed(lambda: engine.save_checkpoint(native_dir, tag=f"t{i}",
                                                                      exclude_frozen_parameters=excl)))
    ck = DeepSpeedCheckpointer(engine, snap_dir, keep_last=2)
    for i in range(args.warmups + args.repeats):
        results["snapckpt_memory"].append(timed(lambda: ck.save_checkpoint(
            snap_dir, tag=f"m{i}", exclude_frozen_parameters=excl, storage_type=StorageType.MEMORY)))
    for i in range(args.warmups + args.repeats):
        t0 = time.perf_counter()
        results["snapckpt_disk"].append(timed(lambda: ck.save_checkpoint(
            snap_dir, tag=f"d{i}", exclude_frozen_parameters=excl, storage_type=StorageType.DISK)))
        ck.wait()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results["snapckpt_disk_durable"].append(t.item())
    ck.close()
    med = {k: statistics.median(v[args.warmups:]) for k, v in results.items()}  # warm-ups dropped
    if rank == 0:
        ckpt_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(snap_dir, f"d{args.warmups + args.repeats - 1}"))
                         for f in fs)
        mode = "LoRA-style (frozen base)" if args.frozen else "full-parameter"
        mode += ", bf16 mixed precision" if args.bf16 else ", fp32"
        report = {"zero_stage": args.zero_stage, "mode": mode, "params": nparams, "world_size": dist.get_world_size(),
                  "arch": args.arch, "d_model": args.d_model, "layers": args.layers, "bf16": args.bf16,
                  "frozen": args.frozen, "cpu_count": os.cpu_count(), "loadavg_at_end": os.getloadavg(),
                  "checkpoint_bytes": ckpt_bytes, "median_s": med, "samples_s": results,
                  "stall_ratio_native_over_memory": med["native"] / med["snapckpt_memory"],
                  "stall_ratio_native_over_disk": med["native"] / med["snapckpt_disk"],
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        os.makedirs(out, exist_ok=True)
        tag = args.tag or f"zero{args.zero_stage}{'_frozen' if args.frozen else ''}{'_bf16' if args.bf16 else ''}"
        with open(os.path.join(out, f"deepspeed_stall_{tag}.json"), "w") as f:
            json.dump(report, f, indent=1)
        table = (f"| mode | ZeRO | params | checkpoint MB | native s | snapckpt memory s | snapckpt disk s | "
                 f"disk durable s | speed-up memory | speed-up disk |\n|---|---|---|---|---|---|---|---|---|---|\n"
                 f"| {mode} | {args.zero_stage} | {nparams / 1e6:.1f} M | {ckpt_bytes / 1e6:.0f} | {med['native']:.3f} | "
                 f"{med['snapckpt_memory']:.3f} | {med['snapckpt_disk']:.3f} | {med['snapckpt_disk_durable']:.3f} | "
                 f"{report['stall_ratio_native_over_memory']:.1f}x | {report['stall_ratio_native_over_disk']:.1f}x |\n")
        with open(os.path.join(out, f"deepspeed_stall_{tag}.md"), "w") as f:
            f.write(table)
        print(table, flush=True)
        for d in (native_dir, snap_dir):
            shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
