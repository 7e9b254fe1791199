"""Shared set-up of the DeepSpeed test workers: CPU accelerator, gloo, a tiny model, deterministic data."""
import importlib
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def skip_shm_op_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory allreduce extension on first init (50-90 s, PLATFORM.md); the
    tests run gloo collectives without it."""
    mod = importlib.import_module("deepspeed.comm.torch")
    mod.build_shm_op = lambda *a, **k: None


skip_shm_op_build()

import deepspeed  # noqa: E402


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(32, 16)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.embed(x)))) * self.scale


def ds_config(stage: int, dtype: str, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "checkpoint": {"tag_validation": "FAIL"},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


def build(stage: int, dtype: str, *, frozen: bool = False, initialize=None, **extra):
    """A fresh engine (same initial weights on every call), its client AdamW and StepLR."""
    torch.manual_seed(1234)
    model = TinyNet()
    if frozen:
        for p in model.embed.parameters():
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    init = initialize or deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config(stage, dtype, **extra))
    return engine


def batch(step: int, rank: int, dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 16, generator=g).to(dtype)
    y = torch.randn(4, 16, generator=g).to(dtype)
    return x, y


def train_step(engine, step: int) -> float:
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    x, y = batch(step, engine.global_rank, dtype)
    loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
    engine.backward(loss)
    engine.step()
    return loss.item()


def full_params(engine):
    """{name: fp32 clone} of the module's parameters (gathered under ZeRO-3)."""
    out = {}
    for name, p in engine.module.named_parameters():
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().float().clone()
        else:
            out[name] = p.detach().float().clone()
    return out


def same(a, b, path=""):
    """First difference between two loaded checkpoint objects, or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: tensor vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            return f"{path}: tensors differ ({a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)})"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys differ {sorted(map(str, set(a) ^ set(b)))}"
        for k in a:
            d = same(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            d = same(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if type(a).__module__ == "numpy" and type(a) is type(b):  # numpy's RNG state in rng_state_R.pth
        return None if a.shape == b.shape and (a == b).all() else f"{path}: arrays differ"
    if type(a).__module__.startswith("deepspeed") and type(a) is type(b):  # config objects, loss scalers
        return same(vars(a), vars(b), path) if hasattr(a, "__dict__") else None
    if a != b:
        return f"{path}: {a!r} != {b!r}"
    return None


def model_file(stage: int, rank: int = 0) -> str:
    """DeepSpeed's model-states file name of ``rank`` (ZeRO-3 writes one per rank)."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"


def exit_after_barrier() -> None:
    """End a DeepSpeed worker once every rank printed its results: a barrier, then ``os._exit(0)``. The
    gloo/DeepSpeed teardown at interpreter exit aborts now and then ("terminate called without an active
    exception", SIGABRT: seen in CI on the stock DeepSpeed run after its last step), which would fail a
    run whose results are complete."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
