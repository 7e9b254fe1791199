"""GPU training-loop stall: what a memory checkpoint costs a real forward/backward/optimizer loop on a GPU.

Run on a CUDA machine (``benchmarks/gpu_check.sh`` does). The model is a GPT-like stack of
``torch.nn.TransformerEncoderLayer`` (pre-norm, bf16 autocast, fused AdamW), so the state is the real thing
the loop mutates: fp32 parameters plus AdamW's ``exp_avg`` / ``exp_avg_sq`` (12 bytes per parameter).
Every step is ``forward, backward, [fence], optimizer step, zero_grad, [checkpoint]`` and ends with
``loss.item()`` (the host sync a real loop has for logging); a step's time is host wall-clock seconds.

Phases, each with the same model and data (``--steps`` timed steps after ``--warmup`` untimed ones):

- ``baseline``: no checkpoint;
- ``floor_pinned_copy``: at each checkpoint step, a synchronous copy of every state tensor into page-locked
  host buffers allocated once (``copy_(non_blocking=True)`` + ``torch.cuda.synchronize()``): the cost of a
  blocking snapshot at PCIe speed, the "copy floor";
- ``snapckpt_overlap_off``: ``Checkpointer(overlap=False).save(state, MEMORY)`` + ``fence()`` at the step end;
- ``snapckpt_overlap_on``: ``Checkpointer(overlap=True)``: ``save()`` starts the copy on a side stream (paced:
  ``cuda_copy_piece_nbytes``) and returns; ``fence()`` is called before the next optimizer step (the first
  moment the state changes); ``_queued``: ``cuda_copy_piece_nbytes=0`` (every copy queued at once);
  ``_log_first``: the step's ``loss.item()`` comes before ``save()`` (as the Trainer logs, then saves), not
  after it, so no host sync falls between ``save()`` and ``fence()``.

Reported per phase: the median step time (s) and the **extra time per checkpoint** = (mean step time of the
phase - mean of baseline) * steps / checkpoints. The issue's target (issue 18, "On a GPU"): overlap-on extra
time < 5% of the copy floor's. Output: JSON + markdown (``--out``); no assertion on any time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit, iter_tensors, write_results  # noqa: E402

from snapckpt import Checkpointer, StorageType  # noqa: E402


class GPT(torch.nn.Module):
    """Token embedding, ``layers`` pre-norm transformer blocks (``d_model``, ``d_model // 128`` heads, 4x MLP),
    a tied-free LM head. Parameters: about ``12 * layers * d_model**2 + 2 * vocab * d_model``."""

    def __init__(self, layers: int, d_model: int, vocab: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d_model)
        block = lambda: torch.nn.TransformerEncoderLayer(  # noqa: E731
            d_model, max(1, d_model // 128), 4 * d_model, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True)
        self.blocks = torch.nn.ModuleList([block() for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for b in self.blocks:
            x = b(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def run(a) -> dict:
    torch.manual_seed(0)
    model = GPT(a.layers, a.d_model, a.vocab).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), device="cuda")
    n_params = sum(p.numel() for p in model.parameters())

    def state(step: int) -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}

    def fwd_bwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    def opt_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    # the optimizer state exists after the first step: take it before sizing the state
    fwd_bwd()
    opt_step()
    torch.cuda.synchronize()
    state_nbytes = sum(t.numel() * t.element_size() for t in iter_tensors(state(0)))
    print(f"gpu_loop: {n_params / 1e6:.0f} M parameters, state {state_nbytes / 2**30:.2f} GiB, "
          f"batch {a.batch} x seq {a.seq}", flush=True)

    results = {}
    pinned = None

    def phase(name: str, every: int, ckpt=None, overlap=False, log_first=False):
        nonlocal pinned
        times, saves, step_no = [], 0, 0
        pending = False
        for i in range(a.warmup + a.steps):
            step_no += 1
            # no torch.cuda.synchronize() here: it would wait for the side-stream copy too; the last step's
            # loss.item() synchronized the compute stream
            t0 = time.perf_counter()
            loss = fwd_bwd()
            if pending:
                ckpt.fence()  # the state changes at the optimizer step
                pending = False
            opt_step()
            if log_first:
                loss.item()
            if every and step_no % every == 0:
                if name == "floor_pinned_copy":
                    src = list(iter_tensors(state(step_no)))
                    if pinned is None:
                        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in src]
                    for b, t in zip(pinned, src):
                        b.copy_(t, non_blocking=True)
                    torch.cuda.synchronize()
                else:
                    ckpt.save(state(step_no), step_no, StorageType.MEMORY)
                    if overlap:
                        pending = True
                    else:
                        ckpt.fence()
                if i >= a.warmup:
                    saves += 1
            if not log_first:
                loss.item()  # a host sync after save(): waits for whatever the copy engine serves first
            dt = time.perf_counter() - t0
            if i >= a.warmup:
                times.append(dt)
        if pending:
            ckpt.fence()
        results[name] = {"step_median_s": statistics.median(times), "step_mean_s": statistics.fmean(times),
                         "steps": len(times), "checkpoints": saves, "step_samples_s": times}
        print(f"gpu_loop {name}: median step {results[name]['step_median_s']:.4f} s, "
              f"{saves} checkpoints", flush=True)

    wanted = set(a.phases.split(",")) if a.phases else None
    phase("baseline", 0)  # always: the reference of every other phase
    if wanted is None or "floor_pinned_copy" in wanted:
        phase("floor_pinned_copy", a.every)
    pinned = None
    torch.cuda.empty_cache()
    shm = tempfile.mkdtemp(prefix="snapckpt-gpu-loop-")
    variants = [("snapckpt_overlap_off", False, None, False),
                ("snapckpt_overlap_on", True, None, False),  # paced copy (the default piece size)
                ("snapckpt_overlap_on_queued", True, 0, False),  # every copy queued at once
                ("snapckpt_overlap_on_log_first", True, None, True),
                ("snapckpt_overlap_on_queued_log_first", True, 0, True)]
    for name, overlap, piece, log_first in variants:
        if wanted is not None and name not in wanted:
            continue
        kw = {} if piece is None else {"cuda_copy_piece_nbytes": piece}
        with Checkpointer(os.path.join(shm, name), overlap=overlap, keep_last=1, expected_nbytes=state_nbytes,
                          **kw) as ck:
            phase(name, a.every, ck, overlap, log_first)
            stats = getattr(ck, "last_stats", None)
            if stats is not None:
                results[name]["last_stats"] = {k: v for k, v in vars(stats).items()
                                               if isinstance(v, (int, float, str))} if hasattr(stats, "__dict__") \
                    else str(stats)
    base = results["baseline"]["step_mean_s"]
    for name, r in results.items():
        if r["checkpoints"]:
            r["extra_per_checkpoint_s"] = (r["step_mean_s"] - base) * r["steps"] / r["checkpoints"]
    floor = results.get("floor_pinned_copy", {}).get("extra_per_checkpoint_s")
    for r in results.values():
        if floor and "extra_per_checkpoint_s" in r:
            r["extra_vs_copy_floor"] = r["extra_per_checkpoint_s"] / floor
    return {"n_params": n_params, "state_nbytes": state_nbytes, "phases": results}


def markdown(data: dict) -> str:
    """The table of a ``gpu_loop.json`` (``{"machine": {..., "args": ...}, "n_params", "state_nbytes", "phases"}``)."""
    info, args = data["machine"], data["machine"]["args"]
    lines = [f"# GPU loop ({info['gpu']}, torch {info['torch']}, git {info['git'][:10]}, {info['date']})", "",
             f"{data['n_params'] / 1e6:.0f} M parameters, state {data['state_nbytes'] / 2**30:.2f} GiB, batch "
             f"{args['batch']} x {args['seq'] - 1} tokens; a checkpoint every {args['every']} steps", "",
             "| phase | median step s | extra per checkpoint s | / copy floor |", "|---|---:|---:|---:|"]
    for name, r in data["phases"].items():
        extra = r.get("extra_per_checkpoint_s")
        rel = r.get("extra_vs_copy_floor")
        lines.append(f"| {name} | {r['step_median_s']:.4f} | {'' if extra is None else f'{extra:.4f}'} | "
                     f"{'' if rel is None else f'{rel:.3f}x'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2049, help="tokens per sample (+1 for the shifted target)")
    ap.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps per phase (>= 2 checkpoints: one per slot)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--phases", default="", help="comma-separated phases to run besides baseline (default all)")
    ap.add_argument("--out", default="benchmarks/results/gpu_loop")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_loop.py needs a CUDA GPU", file=sys.stderr)
        return 2
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "git": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(a)}
    out = run(a)
    data = {"machine": info, **out}
    write_results(a.out, data, markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
