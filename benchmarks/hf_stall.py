"""Stall per checkpoint of the Hugging Face ``Trainer``: its own save vs ``SnapckptCallback``.

One process, the same GPT-2 (built from a config, no download), the same data and the same
``TrainingArguments`` for three runs, in this order:

* ``trainer``  -- the stock Trainer: per save, the seconds ``Trainer._save_checkpoint`` blocks training
  (measured by a ``Trainer`` subclass that times the call; benchmark code only);
* ``snapckpt`` -- ``SnapckptCallback``: per save, the seconds the snapshot blocks training
  (``SnapckptCallback.stall_secs``: building the file specs and copying the tensors into shared memory);
  ``durable_s`` is the extra wait at the end of training for the last commit;
* ``none``     -- no checkpoints at all (``save_strategy="no"``), for the step-time overhead.

Reported: median stall per checkpoint and the ratio trainer/snapckpt, and ``train_runtime`` of each run
(overhead over ``none``). fsync is on for both (the Trainer's ``torch.save``/safetensors do not fsync;
snapckpt does, in the persister, off the training path).

``--lora`` wraps the model with ``peft.get_peft_model`` (LoRA of rank ``--lora-r`` on every attention
``c_attn``): both save the adapter only (and the optimizer state of the adapter's parameters).

Usage (from the repo root)::

    .venv/bin/python benchmarks/hf_stall.py --layers 8 --width 512 --steps 20 --save-steps 5
    .venv/bin/python benchmarks/hf_stall.py --layers 12 --width 768 --lora --out benchmarks/results/hf_stall_lora.json

Timing on shared cores varies about 2x between runs; read the ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

from snapckpt.hf import SnapckptCallback

RESULTS = Path(__file__).resolve().parent / "results"


class TimedTrainer(Trainer):
    """The stock Trainer, timing each ``_save_checkpoint`` call (its blocking save)."""

    save_secs: list

    def _save_checkpoint(self, model, trial):
        t0 = time.perf_counter()
        super()._save_checkpoint(model, trial)
        self.save_secs.append(time.perf_counter() - t0)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run(kind: str, a: argparse.Namespace, scratch: str) -> dict:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=a.vocab, n_positions=a.seq, n_embd=a.width, n_layer=a.layers, n_head=8)
    model = GPT2LMHeadModel(cfg)
    if a.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules=["c_attn"],
                                                 fan_in_fan_out=True))
    args = TrainingArguments(
        output_dir=os.path.join(scratch, kind), max_steps=a.steps, per_device_train_batch_size=a.batch,
        save_strategy="no" if kind == "none" else "steps", save_steps=a.save_steps, logging_steps=a.save_steps,
        report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
    cb = SnapckptCallback() if kind == "snapckpt" else None
    cls = TimedTrainer if kind == "trainer" else Trainer
    trainer = cls(model=model, args=args, train_dataset=Tokens(a.batch * a.steps, a.seq, a.vocab),
                  data_collator=default_data_collator, callbacks=[cb] if cb else None)
    trainer.save_secs = []
    snaps = []
    if cb is not None:
        cb.checkpointer.add_listener(lambda e: snaps.append(e.stats) if e.kind == "snapshot_taken" else None)
    out = trainer.train()
    stalls = trainer.save_secs if kind == "trainer" else (cb.stall_secs if cb else [])
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row = {"kind": kind, "train_runtime_s": out.metrics["train_runtime"], "stalls_s": stalls,
           "median_stall_s": statistics.median(stalls) if stalls else None, "params": n_params,
           "trainable_params": n_trainable}
    if snaps:  # where the snapshot's time goes: building the files, snapckpt's prepare, slot wait, copy
        row["copy_s"] = [s.copy_secs for s in snaps]
        row["wait_slot_s"] = [s.wait_slot_secs for s in snaps]
        row["build_s"] = [st - s.blocking_secs for st, s in zip(stalls, snaps)]
        row["copy_gb_per_s"] = statistics.median(s.tensor_nbytes / s.copy_secs / 1e9 for s in snaps)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-steps", type=int, default=5)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="intra-op threads of training; leave a core to the persister (it runs off the GPU path "
                         "on a real node, on spare cores)")
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) on c_attn; adapter-only saves")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--scratch-dir", default=None)
    ap.add_argument("--out", default=str(RESULTS / "hf_stall.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.torch_threads)
    with tempfile.TemporaryDirectory(dir=a.scratch_dir, prefix="hf-stall-") as scratch:
        rows = [run(k, a, scratch) for k in ("trainer", "snapckpt", "none")]
    by = {r["kind"]: r for r in rows}
    ratio = by["trainer"]["median_stall_s"] / by["snapckpt"]["median_stall_s"]
    if a.lora:  # the adapter in fp32 + AdamW's two moments of it
        what = (f"LoRA r={a.lora_r} on c_attn, {by['trainer']['trainable_params'] / 1e6:.2f} M adapter params, "
                f"~{by['trainer']['trainable_params'] * 4 * 3 / 1e6:.1f} MB of adapter + optimizer state saved")
    else:  # fp32 weights + AdamW's two moments
        what = f"~{by['trainer']['params'] * 4 * 3 / 1e6:.0f} MB of model + optimizer state"
    lines = [f"GPT-2 {a.layers} layers x {a.width}, {by['trainer']['params'] / 1e6:.1f} M params, "
             f"{what}; {a.steps} steps, a checkpoint every {a.save_steps}; "
             f"{a.torch_threads} torch thread(s), {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}",
             "", "| run | median stall per checkpoint (s) | train_runtime (s) |", "| --- | --- | --- |"]
    for r in rows:
        ms = "n/a" if r["median_stall_s"] is None else f"{r['median_stall_s']:.3f}"
        lines.append(f"| {r['kind']} | {ms} | {r['train_runtime_s']:.1f} |")
    sn = by["snapckpt"]
    lines += ["", f"stall ratio trainer / snapckpt: {ratio:.1f}x",
              f"snapckpt stall breakdown (medians): copy into shared memory {statistics.median(sn['copy_s']):.3f} s "
              f"({sn['copy_gb_per_s']:.2f} GB/s), slot wait {statistics.median(sn['wait_slot_s']):.3f} s, "
              f"building the file specs {statistics.median(sn['build_s']):.3f} s"]
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "runs": rows, "ratio": ratio}, f, indent=2)
    with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
