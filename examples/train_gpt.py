"""Train a small GPT on the Python standard library's source, checkpointed with snapckpt.

The main job of the project, CPU-friendly by default::

    torchrun --nproc_per_node 2 examples/train_gpt.py --checkpoint-dir runs/gpt --steps 60
    python examples/train_gpt.py --checkpoint-dir runs/gpt1 --steps 60    # one plain process

What it shows:

* a byte-level GPT (vocabulary 256, causal self-attention written with ``torch.nn``, dropout,
  embedding tied to the LM head) trained with DDP over gloo;
* real text that ships with every Python: the standard library's top-level ``*.py`` files, sorted
  and concatenated, read as bytes;
* a ``DistributedSampler``-like data order (seeded per epoch, sharded by rank) whose position is
  part of the checkpoint;
* ``HookRegistry`` snapshots into host memory every ``--memory-interval`` steps and to disk every
  ``--disk-interval`` steps; the state holds model, optimizer, LR scheduler, RNG states, the step
  and the data position, so an interrupted run resumes with bitwise the same losses (CPU), with any
  number of ranks (DDP keeps its initial gradient buckets: see ``train``), the same before and after the
  restart: the plain ``Checkpointer`` does not reshard (another number raises ``IncompatibleCheckpointError``).

On start the script asks ``ckpt.latest_step()``; when a checkpoint exists it loads it (from memory
if the node's persister survived, from disk otherwise) and prints
``resumed from step N (tier: memory|disk)``. Rank 0 prints ``step N loss X`` for every step, ``X``
being the full ``repr`` of the rank-averaged loss, and appends the same line to ``--loss-log``.
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from snapckpt import Checkpointer, HookRegistry, SnapshotPolicy, rng

VOCAB_SIZE = 256  # bytes


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model; the defaults train in tens of milliseconds a step on one CPU core."""

    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask, written out with plain ``torch.nn`` layers."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-norm transformer block: attention then a 4x MLP, each with a residual connection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model over bytes; the LM head shares its weight with the embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one storage, two state-dict keys
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the mean next-byte cross-entropy of ``idx`` against ``targets``."""
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB_SIZE), targets.reshape(-1))


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def load_stdlib_bytes(max_bytes: int) -> torch.Tensor:
    """Concatenate the standard library's top-level ``*.py`` files (sorted by name) as bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    raw = b"".join(chunks)[:max_bytes]
    if len(raw) < 1024:
        raise RuntimeError(f"found only {len(raw)} bytes of source under {stdlib}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


class ShardedBatches:
    """Deterministic, resumable batches of ``block_size + 1`` byte windows for one rank.

    Like ``DistributedSampler``: each epoch permutes the windows with a generator seeded by
    ``seed + epoch``, pads the permutation to a multiple of the world size and keeps every
    ``world_size``-th index starting at ``rank``. The position (epoch, offset into this rank's
    share) is plain data, saved in the checkpoint and restored with :meth:`load_state_dict`.
    """

    def __init__(self, tokens, block_size, batch_size, rank, world_size, seed) -> None:
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_windows = (len(tokens) - 1) // block_size
        self.epoch, self.offset = 0, 0
        self._indices = self._epoch_indices(0)

    def _epoch_indices(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_windows, generator=g)
        pad = (-len(perm)) % self.world_size
        perm = torch.cat([perm, perm[:pad]])
        return perm[self.rank :: self.world_size]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(inputs, targets)`` of shape ``(batch_size, block_size)`` and advance."""
        if self.offset + self.batch_size > len(self._indices):
            self.epoch, self.offset = self.epoch + 1, 0
            self._indices = self._epoch_indices(self.epoch)
        starts = self._indices[self.offset : self.offset + self.batch_size] * self.block_size
        self.offset += self.batch_size
        windows = torch.stack([self.tokens[s : s + self.block_size + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._indices = self._epoch_indices(self.epoch)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint-dir", required=True, help="where committed checkpoints go")
    p.add_argument("--steps", type=int, default=60, help="train until this optimizer step")
    p.add_argument("--memory-interval", type=int, default=10, help="memory snapshot every N steps")
    p.add_argument("--disk-interval", type=int, default=30, help="disk checkpoint every N steps")
    p.add_argument("--keep-last", type=int, default=3, help="committed disk checkpoints to keep")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--sleep-per-step", type=float, default=0.0, help="seconds; eases kill timing")
    p.add_argument("--loss-log", default=None, help="rank 0 appends 'step N loss X' lines here")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-bytes", type=int, default=2_000_000, help="bytes of stdlib source")
    return p.parse_args(argv)


def init_distributed() -> tuple[int, int]:
    """Join the gloo process group under torchrun; run as world size 1 without it."""
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend="gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def lr_lambda_for(total_steps: int, warmup_steps: int = 10):
    """Linear warm-up, then cosine decay to 10% of the peak learning rate."""

    def lr_lambda(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return lr_lambda


def mean_loss(loss: torch.Tensor, world_size: int) -> float:
    """The loss averaged over ranks, as a Python float (for logging only)."""
    value = loss.detach().clone()
    if world_size > 1:
        dist.all_reduce(value)
        value /= world_size
    return value.item()


class TrainState:
    """Everything needed to continue a run identically (contract 8 (docs/design/contracts.md)), as one state dict:
    model, optimizer, LR scheduler, RNG states, the step and the data position."""

    def __init__(self, args: argparse.Namespace, rank: int, world_size: int) -> None:
        cfg = GPTConfig()
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        self.model = GPT(cfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda_for(args.steps))
        self.data = ShardedBatches(load_stdlib_bytes(args.data_bytes), cfg.block_size,
                                   args.batch_size, rank, world_size, args.seed)
        torch.manual_seed(args.seed + 1 + rank)  # dropout masks differ per rank
        self.step = 0

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng.capture(),
            "step": self.step,
            "data": self.data.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.data.load_state_dict(state["data"])
        rng.restore(state["rng"])
        self.step = int(state["step"])


def tier_name(tier) -> str:
    """``StorageType.MEMORY`` -> ``"memory"``."""
    return getattr(tier, "name", str(tier)).lower()


def make_hooks(ckpt: Checkpointer, ts: TrainState, args: argparse.Namespace, say) -> HookRegistry:
    """Snapshots to memory every ``--memory-interval`` steps, to disk every ``--disk-interval``
    steps and after the last step; events are printed."""
    policy = SnapshotPolicy(memory_interval_steps=args.memory_interval,
                            disk_interval_steps=args.disk_interval, save_on_train_end=True)
    hooks = HookRegistry(ckpt, state_fn=ts.state_dict, policy=policy)
    hooks.on("snapshot_taken", lambda e: say(f"snapshot of step {e.step} taken ({tier_name(e.tier)})"))
    hooks.on("committed", lambda e: say(f"checkpoint of step {e.step} committed ({tier_name(e.tier)})"))
    hooks.on("skipped", lambda e: print(f"[rank {e.rank}] snapshot of step {e.step} skipped", flush=True))
    hooks.on("failed", lambda e: print(f"[rank {e.rank}] checkpoint of step {e.step} failed", flush=True))
    return hooks


def train(ts: TrainState, hooks: HookRegistry, args, world_size: int, log) -> None:
    """Train until ``args.steps``; ``log`` receives one ``step N loss X`` line per step."""
    # find_unused_parameters=True: DDP then never rebuilds its gradient buckets after the first iteration.
    # With a rebuild, a resumed run's first step reduces in the initial bucket order and the uninterrupted
    # run in the rebuilt one; with 3+ ranks gloo sums in another order and the losses differ in the last
    # bits. Without it a resume is bitwise equal at any rank count (every parameter is used: no error).
    ddp_model = DDP(ts.model, find_unused_parameters=True) if world_size > 1 else ts.model
    ddp_model.train()
    while ts.step < args.steps:
        inputs, targets = ts.data.next_batch()
        loss = ddp_model(inputs, targets)
        ts.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ts.model.parameters(), 1.0)
        hooks.before_optimizer_step()  # fence: the last snapshot's copy must be done
        ts.optimizer.step()
        ts.scheduler.step()
        ts.step += 1
        log(f"step {ts.step} loss {mean_loss(loss, world_size)!r}")
        hooks.step_end(ts.step)
        if args.sleep_per_step:
            time.sleep(args.sleep_per_step)
    hooks.train_end()  # the last step goes to disk too, then every commit is waited for


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world_size = init_distributed()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    log_file = None
    if rank == 0 and args.loss_log:
        Path(args.loss_log).parent.mkdir(parents=True, exist_ok=True)
        log_file = open(args.loss_log, "a")

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    def log(line: str) -> None:
        say(line)
        if log_file:
            log_file.write(line + "\n")
            log_file.flush()

    ts = TrainState(args, rank, world_size)
    with Checkpointer(args.checkpoint_dir, keep_last=args.keep_last) as ckpt:
        latest = ckpt.latest_step()  # newest step complete on every rank, memory or disk
        if latest is not None:
            # load() verifies checksums and falls back to the newest step that verifies, with a warning;
            # it raises CheckpointCorruptError (as latest_step() does) when checkpoints exist but all are damaged
            ts.load_state_dict(ckpt.load())
            say(f"resumed from step {ckpt.last_load.step} (tier: {tier_name(ckpt.last_load.tier)})")
        train(ts, make_hooks(ckpt, ts, args, say), args, world_size, log)
    if log_file:
        log_file.close()
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
