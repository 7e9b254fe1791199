"""A plain Accelerate training loop on a small GPT-2, checkpointed by snapckpt (CPU-friendly).

    python examples/accelerate_gpt.py --checkpoint-dir runs/acc-gpt --steps 40
    torchrun --nproc_per_node 2 examples/accelerate_gpt.py --checkpoint-dir runs/acc-gpt2
    (on the CPU, ``accelerate launch --cpu --num_processes 2`` starts only one process)

``AcceleratorCheckpointer(accelerator, dir)`` writes what ``accelerator.save_state`` would write
(``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``, ``random_states_<rank>.pkl``...) into
``dir/checkpoint_<step>/``, from the node persister, while training goes on: memory snapshots every
``--memory-interval`` steps, disk every ``--disk-interval``. On start, ``load_state()`` resumes from the
newest snapshot (memory if the node survived a ``kill -9``, disk otherwise); the folders also load with
the stock ``accelerator.load_state(path)``.
"""
from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import GPT2Config, GPT2LMHeadModel

from snapckpt import StorageType
from snapckpt.hf import AcceleratorCheckpointer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--memory-interval", type=int, default=2)
    ap.add_argument("--disk-interval", type=int, default=10)
    a = ap.parse_args()

    set_seed(0)
    acc = Accelerator(cpu=not torch.cuda.is_available())
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    tokens = torch.randint(0, 256, (512, 64), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(tokens, batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    # Accelerate's prepared scheduler steps once per process at each optimizer step (split_batches=False)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, a.steps * acc.num_processes)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)

    ckpt = AcceleratorCheckpointer(acc, a.checkpoint_dir)
    path = ckpt.load_state()
    step = int(path.rsplit("_", 1)[1]) if path else 0
    if path:
        acc.print(f"resumed from {path} (tier: {ckpt.checkpointer.last_load.tier.value})")
    while step < a.steps:
        epoch_pos = step % len(loader)
        for batch in acc.skip_first_batches(loader, epoch_pos) if epoch_pos else loader:
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            ckpt.checkpointer.fence()
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            acc.print(f"step {step} loss {loss.item():.4f}")
            if step % a.disk_interval == 0 or step == a.steps:
                ckpt.save_state(step, StorageType.DISK)
            elif step % a.memory_interval == 0:
                ckpt.save_state(step, StorageType.MEMORY)
            if step >= a.steps:
                break
    ckpt.close()
    acc.end_training()  # destroys the process group: its threads are joined before the interpreter exits


if __name__ == "__main__":
    main()
