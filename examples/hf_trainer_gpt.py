"""Train a small GPT-2 with the Hugging Face ``Trainer``, checkpointed by snapckpt (CPU-friendly).

    python examples/hf_trainer_gpt.py --output-dir runs/hf-gpt --steps 60
    torchrun --nproc_per_node 2 examples/hf_trainer_gpt.py --output-dir runs/hf-gpt2 --steps 60
    python examples/hf_trainer_gpt.py --output-dir runs/hf-lora --steps 60 --lora     # adapter-only folders

What it shows:

* ``Trainer(..., callbacks=[SnapckptCallback(memory_interval_steps=...)])`` is the whole integration: at
  every ``save_steps`` the Trainer's own blocking save is replaced by a snapshot, and the node persister
  writes the usual ``checkpoint-N/`` folder (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
  ``rng_state*.pth``, ``trainer_state.json``, ``training_args.bin``, configs) in the background;
* a memory snapshot every ``--memory-interval`` steps: after ``kill -9`` of training, rerunning the same
  command resumes from the newest one (the callback writes it out as ``checkpoint-N`` first);
* ``save_total_limit`` rotation, and resume with the stock ``trainer.train(resume_from_checkpoint=True)``
  whenever a ``checkpoint-*`` folder exists;
* ``--lora``: the model is wrapped by ``peft.get_peft_model`` (LoRA r=8 on the attention's ``c_attn``) and
  the folders hold the adapter only (``adapter_model.safetensors``, ``adapter_config.json``,
  ``README.md``), as the Trainer writes them.

The model is a GPT-2 built from a small config (no download): 4 layers, width 128, byte-level vocabulary
of 256, trained on the Python standard library's source read as bytes.
"""
from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator
from transformers.trainer_utils import get_last_checkpoint

from snapckpt.hf import SnapckptCallback


class StdlibBytes(torch.utils.data.Dataset):
    """Fixed-length windows of the standard library's top-level ``*.py`` files, as bytes (tokens 0..255)."""

    def __init__(self, seq_len: int, max_bytes: int) -> None:
        src = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        data = b"".join(p.read_bytes() for p in src)[:max_bytes]
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int):
        x = self.tokens[i * self.seq_len:(i + 1) * self.seq_len]
        return {"input_ids": x, "labels": x}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-steps", type=int, default=20, help="disk checkpoints (the Trainer's save_steps)")
    ap.add_argument("--memory-interval", type=int, default=5, help="memory snapshots every N steps")
    ap.add_argument("--save-total-limit", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--data-bytes", type=int, default=2_000_000)
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of the whole model")
    a = ap.parse_args()

    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=a.batch_size,
        learning_rate=3e-4, lr_scheduler_type="cosine", warmup_steps=5, logging_steps=5,
        save_strategy="steps", save_steps=a.save_steps, save_total_limit=a.save_total_limit,
        seed=0, report_to="none", use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=a.seq_len, n_embd=128, n_layer=4, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    if a.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True))
    snap = SnapckptCallback(memory_interval_steps=a.memory_interval)
    trainer = Trainer(model=model, args=args, train_dataset=StdlibBytes(a.seq_len, a.data_bytes),
                      data_collator=default_data_collator, callbacks=[snap])
    # Constructing the Trainer already wrote a memory-only snapshot out as checkpoint-N if one was newer.
    resume = get_last_checkpoint(a.output_dir) if os.path.isdir(a.output_dir) else None
    if resume and trainer.is_world_process_zero():
        print(f"resuming from {resume}" + (" (memory tier)" if snap.resumed_from else ""), flush=True)
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        stalls = snap.stall_secs
        if stalls:
            print(f"{len(stalls)} snapshots, median stall {sorted(stalls)[len(stalls) // 2] * 1e3:.1f} ms", flush=True)
        print("checkpoints:", sorted(d for d in os.listdir(a.output_dir) if d.startswith("checkpoint-")), flush=True)
    if torch.distributed.is_initialized():
        # the Trainer leaves the process group up: tear it down explicitly. (torch's gloo teardown on this CPU
        # machine still aborts now and then at the very end, "terminate called without an active exception",
        # with or without snapckpt: the checkpoints are complete by then.)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
