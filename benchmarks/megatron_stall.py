"""Megatron stall benchmark: how long a torch_dist checkpoint blocks training, snapckpt vs megatron-core.

Run under torchrun (every rank takes part in every checkpoint)::

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 benchmarks/megatron_stall.py --tp 2

One megatron-core ``GPTModel`` (``--hidden``, ``--layers``, ``--vocab``) with a plain Adam whose state is
initialized by one training step; the same state for every method. Per method: ``--warmups`` untimed
checkpoints (default 2), then ``--repeats`` timed ones; the table shows medians of the slowest rank:

* ``blocking_s``: seconds the training loop is blocked by the call (building the sharded state dict
  included, as in Megatron-LM's ``save_checkpoint``);
* ``durable_s``: seconds from the call until the checkpoint is complete on disk (files, ``.metadata``,
  tracker).

Methods:

* ``mcore_sync``: ``megatron.core.dist_checkpointing.save`` (torch_dist, synchronous: fsynced files).
* ``mcore_async``: the same with ``async_sharded_save=True`` scheduled on an
  ``AsyncCallsQueue(persistent=False)`` (megatron-core's own async save: a forked writer process);
  blocking = until ``schedule_async_request`` returns, durable = until
  ``maybe_finalize_async_calls(blocking=True)`` returns.
* ``snapckpt_disk``: ``snapckpt.megatron_dist_ckpt.save_checkpoint`` (DISK); durable = ``handle.wait()``.
* ``snapckpt_disk_const``: the same with ``assume_constant_structure=True`` (Megatron-LM's
  ``--ckpt-assume-constant-structure``: sharding validated once, DCP plans reused).
* ``snapckpt_memory``: the same with ``storage_type=MEMORY`` (no disk).

Results: ``benchmarks/results/megatron_stall.{json,md}`` (git-ignored). On a machine without a GPU the
CUDA calls megatron-core makes are redirected to the CPU by ``tests/workers/megatron_cpu.py``.
Timing on shared cores varies about 2x between runs; read the ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "workers"))


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _build(a):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=8,
                            use_cpu_initialization=True, tensor_model_parallel_size=a.tp,
                            pipeline_dtype=torch.float32)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=a.vocab,
                     max_sequence_length=a.seq)
    if a.frozen:
        # LoRA-style: the base frozen, a small part trains. Not one layer: megatron-core stacks the
        # layers' tensors along a layer axis in torch_dist, and an optimizer state for some layers
        # only fails its sharding validation; the final layer norm stands in for the adapters.
        last = set(map(id, model.decoder.final_layernorm.parameters()))
        for p in model.parameters():
            if id(p) not in last:
                p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.randint(0, a.vocab, (1, a.seq))
    mask = torch.ones(a.seq, a.seq, dtype=torch.bool).triu(1)[None, None]
    model(tokens, torch.arange(a.seq)[None], mask, labels=tokens).float().mean().backward()
    opt.step()
    return model, opt


class Methods:
    def __init__(self, a, model, opt, workdir: Path):
        self.a, self.model, self.opt, self.workdir = a, model, opt, workdir
        self.queue = None

    def _sd(self, i):
        from snapckpt.integrations.megatron.state import build_state_dict

        return build_state_dict(None, [self.model], self.opt, None, i, 0, False, True, True)

    def _dir(self, method, i):
        d = self.workdir / method / f"iter_{i:07d}"
        if torch.distributed.get_rank() == 0:
            d.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        return d

    def _tracker(self, method, i):
        if torch.distributed.get_rank() == 0:
            (self.workdir / method / "latest_checkpointed_iteration.txt").write_text(str(i))

    def mcore_sync(self, i):
        from megatron.core import dist_checkpointing

        d = self._dir("mcore_sync", i)
        t0 = time.perf_counter()
        dist_checkpointing.save(self._sd(i), str(d))
        self._tracker("mcore_sync", i)
        t = time.perf_counter() - t0
        return t, t

    def mcore_async(self, i):
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if self.queue is None:
            self.queue = AsyncCallsQueue(persistent=False)
        d = self._dir("mcore_async", i)
        t0 = time.perf_counter()
        req = dist_checkpointing.save(self._sd(i), str(d), async_sharded_save=True)
        req.add_finalize_fn(lambda: self._tracker("mcore_async", i))
        self.queue.schedule_async_request(req)
        blocking = time.perf_counter() - t0
        self.queue.maybe_finalize_async_calls(blocking=True)
        return blocking, time.perf_counter() - t0

    def _snapckpt(self, i, storage_type, constant=False):
        from snapckpt.megatron_dist_ckpt import save_checkpoint

        t0 = time.perf_counter()
        h = save_checkpoint(i, [self.model], self.opt, None, 0, save_dir=str(self.workdir / "snapckpt"),
                            storage_type=storage_type, keep_last=2, assume_constant_structure=constant)
        blocking = time.perf_counter() - t0
        h.wait()
        return blocking, time.perf_counter() - t0

    def snapckpt_disk(self, i):
        from snapckpt import StorageType

        return self._snapckpt(i, StorageType.DISK)

    def snapckpt_disk_const(self, i):
        from snapckpt import StorageType

        return self._snapckpt(i, StorageType.DISK, constant=True)

    def snapckpt_memory(self, i):
        from snapckpt import StorageType

        b, _ = self._snapckpt(i, StorageType.MEMORY)
        return b, None

    def cleanup(self, method, i):
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0 and method.startswith("mcore"):
            shutil.rmtree(self.workdir / method / f"iter_{i:07d}", ignore_errors=True)
        torch.distributed.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--frozen", action="store_true", help="LoRA-style: freeze all but the final layer norm (Adam "
                   "state for it only; the checkpoint still holds every weight, as Megatron saves it)")
    p.add_argument("--warmups", type=int, default=2, help="untimed checkpoints first (snapckpt's arena has 2 "
                   "slots per rank: each is faulted in by its first use)")
    p.add_argument("--methods", default="mcore_sync,mcore_async,snapckpt_disk,snapckpt_disk_const,snapckpt_memory")
    p.add_argument("--workdir", default=str(ROOT / "tmp" / "megatron_stall"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "megatron_stall.json"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        import megatron_cpu  # stands in for the missing GPU

        megatron_cpu.install()
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=a.tp)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    rank = torch.distributed.get_rank()
    workdir = Path(a.workdir)
    if rank == 0:
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
    torch.distributed.barrier()
    model, opt = _build(a)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values() if torch.is_tensor(t))
    nbytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    total = _max_over_ranks(float(nbytes))
    m = Methods(a, model, opt, workdir)
    results = {"world_size": torch.distributed.get_world_size(), "tp": a.tp, "state_bytes_per_rank_max": total,
               "model": {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab}, "frozen": a.frozen,
               "loadavg_at_start": os.getloadavg(),
               "cpu_count": os.cpu_count(), "methods": {}}
    for k, name in enumerate(a.methods.split(",")):
        samples = []
        for i in range(a.warmups + a.repeats):
            os.sync()
            torch.distributed.barrier()
            it = 100 * k + i + 1  # distinct iterations per method (one snapckpt directory for all)
            blocking, durable = getattr(m, name)(it)
            blocking = _max_over_ranks(blocking)
            durable = None if durable is None else _max_over_ranks(durable)
            if i >= a.warmups:
                samples.append((blocking, durable))
            m.cleanup(name, it)
        med_b = statistics.median(s[0] for s in samples)
        med_d = None if samples[0][1] is None else statistics.median(s[1] for s in samples)
        results["methods"][name] = {"blocking_s": med_b, "durable_s": med_d, "samples": samples}
        if rank == 0:
            print(f"{name:16s} blocking {med_b:.3f} s  durable {med_d if med_d is None else round(med_d, 3)} s",
                  flush=True)
    from snapckpt.megatron_dist_ckpt import close_all

    close_all()
    if rank == 0:
        base = results["methods"].get("mcore_sync", {}).get("blocking_s")
        lines = [f"state per rank (max): {total / 2**20:.0f} MiB, world size {results['world_size']}, TP={a.tp}, "
                 f"{os.cpu_count()} CPUs", "", "| method | blocking s | durable s | stall vs mcore_sync |",
                 "|---|---|---|---|"]
        for name, r in results["methods"].items():
            d = "n/a" if r["durable_s"] is None else f"{r['durable_s']:.3f}"
            ratio = f"{r['blocking_s'] / base:.3f}" if base else "n/a"
            lines.append(f"| {name} | {r['blocking_s']:.3f} | {d} | {ratio} |")
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
