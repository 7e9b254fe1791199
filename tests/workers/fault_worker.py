"""Worker ranks of the fault matrix (tests/test_fault_matrix.py), one adapter per integration.

Usage: ``fault_worker.py INTEGRATION MODE CKPT [options]`` with INTEGRATION ``torch`` (Checkpointer),
``deepspeed`` (snapckpt.deepspeed, ZeRO-0), ``megatron`` (snapckpt.megatron_dist_ckpt) or ``hf`` (the
Trainer with SnapckptCallback, one process: :func:`hf_main`), MODE ``run``, ``resume`` or ``phases``
(:func:`run_phases`, plain PyTorch).

- ``run``: steps 1..``--steps``; at each step every tensor of the state (model, optimizer state) is set to
  ``value(step, rank)`` and saved, to DISK every ``--disk-every`` steps and to MEMORY otherwise, then the
  ranks meet in a barrier (the gradient all-reduce of a real step). ``SAVED <step>`` after each save
  returned; at the end ``wait()`` and close, ``DONE``. A snapckpt error prints ``ERROR {type, message}``
  and exits 3 at once (the job dies on it, as a trainer would).
- ``resume``: load the newest checkpoint and print ``RESULT {step, tier, consistent}`` (step -1 when there
  is none), where ``consistent`` says that every tensor holds the value of the loaded step and of this
  rank; then save step+1 to DISK, wait, close and print ``DONE``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the toolkit

from snapckpt import StorageType  # noqa: E402
from snapckpt.errors import CheckpointCorruptError, CheckpointNotFoundError, SnapckptError  # noqa: E402


def out(tag: str, **kw) -> None:
    print(f"{tag} " + json.dumps(kw), flush=True)


def value(step: int, rank: int) -> float:
    return float(step * 100 + rank)


def options(a) -> dict:
    return dict(keep_last=a.keep_last or None, persister_idle_timeout_secs=a.idle_secs, commit_timeout_secs=20,
                request_timeout_secs=a.request_timeout, coordination_timeout_secs=30,
                persister_startup_timeout_secs=60, job_id=a.job_id)


class TorchAdapter:
    """Plain PyTorch: a :class:`snapckpt.Checkpointer` and a state dict of model and optimizer state."""

    def __init__(self, a, rank: int) -> None:
        from snapckpt import Checkpointer

        self.rank, self.big = rank, a.big_numel
        self.ck = Checkpointer(a.ckpt, **options(a))

    def state(self, step: int) -> dict:
        v = value(step, self.rank)
        return {"model": {"w1": torch.full((32, 32), v), "w2": torch.full((self.big,), v), "b": torch.full((7,), v)},
                "opt": {"state": {0: {"exp_avg": torch.full((32, 32), v), "step": torch.tensor(float(step))}}},
                "step": step, "rank": self.rank}

    def save(self, step: int, tier: StorageType) -> None:
        self.ck.save(self.state(step), step, tier)

    def load(self):
        s = self.ck.load()
        v = value(s["step"], self.rank)
        ok = s["rank"] == self.rank and all(bool((t == v).all()) for t in
                                            (s["model"]["w1"], s["model"]["w2"], s["model"]["b"],
                                             s["opt"]["state"][0]["exp_avg"]))
        ok = ok and float(s["opt"]["state"][0]["step"]) == s["step"]
        return s["step"], self.ck.last_load.tier.value, ok

    def wait(self) -> None:
        self.ck.wait()

    def close(self) -> None:
        self.ck.close()


class DeepSpeedAdapter:
    """DeepSpeed ZeRO-0 engine with a :class:`snapckpt.deepspeed.DeepSpeedCheckpointer`: parameters are
    replicated (value ``step``), the Adam state of each rank's optimizer is filled before each save."""

    def __init__(self, a, rank: int) -> None:
        from ds_common import build, train_step  # tests/workers: a tiny engine without the shm op build

        from snapckpt.deepspeed import DeepSpeedCheckpointer

        self.rank = rank
        self.engine = build(0, "fp32")
        train_step(self.engine, 0)  # creates the Adam state
        self.ck = DeepSpeedCheckpointer(self.engine, a.ckpt, **options(a))
        self.dir = a.ckpt

    def _fill(self, step: int) -> None:
        with torch.no_grad():
            for p in self.engine.module.parameters():
                p.fill_(float(step))
                for t in getattr(self.engine.optimizer, "state", {}).get(p, {}).values():
                    if torch.is_tensor(t) and t.is_floating_point():
                        t.fill_(float(step))

    def save(self, step: int, tier: StorageType) -> None:
        self._fill(step)
        self.engine.global_steps = step  # the step snapckpt orders checkpoints by
        self.ck.save_checkpoint(self.dir, tag=f"global_step{step}", client_state={"step": step},
                                storage_type=tier)

    def load(self):
        self._fill(-1.0)
        path, client = self.ck.load_checkpoint(self.dir)
        if path is None:
            raise CheckpointNotFoundError("DeepSpeed found nothing to load")
        step = client["step"]
        ok = all(bool((p == step).all()) for p in self.engine.module.parameters())
        for p in self.engine.module.parameters():
            for t in getattr(self.engine.optimizer, "state", {}).get(p, {}).values():
                if torch.is_tensor(t) and t.is_floating_point() and t.numel() > 1:
                    ok = ok and bool((t == step).all())
        return step, self.ck.checkpointer.last_load.tier.value, ok

    def wait(self) -> None:
        self.ck.wait()

    def close(self) -> None:
        self.ck.close()


def _save_wait(ad, step: int):
    """DISK save of ``step`` and wait; the snapckpt error it raised, or ``None``."""
    try:
        ad.save(step, StorageType.DISK)
        ad.wait()
    except (SnapckptError, OSError) as e:  # a background failure keeps its type (OSError) and gains notes
        return _describe(e)
    return None


def _describe(e: BaseException) -> str:
    return " ".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])])


def _disk_view(ckpt: str) -> dict:
    from faults import committed, verify_all

    try:
        with open(os.path.join(ckpt, "latest")) as f:
            tracker = f.read().strip()
    except FileNotFoundError:
        tracker = None
    visible = sorted(n for n in os.listdir(ckpt) if not n.startswith("."))
    return {"committed": sorted(committed(ckpt)), "tracker": tracker, "visible": visible,
            "problems": verify_all(ckpt)}


def run_phases(a, ad, rank: int) -> None:
    """Storage failures by phase in one job: step 1 commits; then for each phase the plan file makes the
    next DISK save fail in that phase (part phases on rank 1), and each rank prints ``PHASE {phase, step,
    error, committed, tracker, visible, problems}`` after its ``wait()``; with ``--fsize-limit`` the
    persister's RLIMIT_FSIZE then stands in for a full disk (phase ``rlimit``); a last save must commit
    (``FINAL``)."""
    from faults import limit_file_size

    from _harness import persisters

    def plan(obj) -> None:
        if rank == 0:
            with open(a.plan + ".tmp", "w") as f:
                f.write(json.dumps(obj) if obj else "")
            os.replace(a.plan + ".tmp", a.plan)
        dist.barrier()

    err = _save_wait(ad, 1)
    out("PHASE", phase="baseline", step=1, error=err, **_disk_view(a.ckpt))
    step = 1
    phases = [p for p in a.phases.split(",") if p] + (["rlimit"] if a.fsize_limit else [])
    for ph in phases:
        step += 1
        if ph == "rlimit":
            if rank == 0:
                pids = [p.pid for p in persisters(os.path.dirname(os.environ["SNAPCKPT_RUNTIME_DIR"] + "/"))]
                for pid in pids:
                    limit_file_size(a.fsize_limit, pid)
            dist.barrier()
        else:
            part = ph in ("open", "write", "fsync", "part_marker")
            plan({"phase": ph, "step": step, "errno": 28, "after_bytes": 4096, **({"rank": 1} if part else {})})
        err = _save_wait(ad, step)
        dist.barrier()
        if ph == "rlimit":
            if rank == 0:
                for pid in pids:
                    limit_file_size(-1, pid)
        else:
            plan(None)
        out("PHASE", phase=ph, step=step, error=err, **_disk_view(a.ckpt))
        dist.barrier()
    err = _save_wait(ad, step + 1)
    out("FINAL", step=step + 1, error=err, **_disk_view(a.ckpt))
    ad.close()


class MegatronAdapter:
    """megatron-core GPT (TP=1, DP=2, a plain Adam) through ``snapckpt.megatron_dist_ckpt``: parameters are
    replicated (value ``step``; torch_dist writes each replicated tensor once), the Adam state is filled
    before each save."""

    def __init__(self, a, rank: int) -> None:
        import megatron_cpu  # tests/workers: the CPU stand-ins for CUDA

        from megatron_worker import build, train_step
        from snapckpt.megatron_dist_ckpt import get_checkpointer

        megatron_cpu.install()
        megatron_cpu.init_parallel(1)
        self.rank, self.dir = rank, a.ckpt
        self.model, self.opt, self.sched = build(1, "torch")
        train_step(self.model, self.opt, self.sched, 0)  # creates the Adam state
        self.ck = get_checkpointer(a.ckpt, **options(a))

    def _tensors(self):
        for p in self.model.parameters():
            yield p
            for t in self.opt.state.get(p, {}).values():
                if torch.is_tensor(t) and t.is_floating_point() and t.numel() > 1:
                    yield t

    def _fill(self, v: float) -> None:
        with torch.no_grad():
            for t in self._tensors():
                t.fill_(v)

    def save(self, step: int, tier: StorageType) -> None:
        from snapckpt.megatron_dist_ckpt import save_checkpoint

        self._fill(float(step))
        save_checkpoint(step, [self.model], self.opt, self.sched, 0, save_dir=self.dir, storage_type=tier)

    def load(self):
        from snapckpt.megatron_dist_ckpt import load_checkpoint

        self._fill(-1.0)
        it, _ = load_checkpoint(self.model, self.opt, self.sched, load_dir=self.dir)
        if not it:
            raise CheckpointNotFoundError("Megatron found nothing to load")
        ok = all(bool((t == it).all()) for t in self._tensors())
        return it, self.ck.last_load.tier.value, ok

    def wait(self) -> None:
        self.ck.wait()

    def close(self) -> None:
        from snapckpt.megatron_dist_ckpt import close_all

        close_all()


def hf_main(a, rank: int) -> None:
    """Hugging Face Trainer with :class:`snapckpt.hf.SnapckptCallback` (one process): the Trainer saves
    every ``--disk-every`` steps (DISK), the callback snapshots every step (MEMORY). A callback listed
    before snapckpt's sets every parameter and Adam state tensor to ``step / 64`` at each step end (the
    snapshot of the step is taken at the next step begin); ``SAVED <step>`` comes from the checkpointer's
    ``snapshot_taken`` event. ``resume``: ``RESULT`` is checked at ``on_train_begin``, after the Trainer
    restored the checkpoint that ``resume_from_checkpoint=True`` picked."""
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from hf_worker import Tokens, build_model
    from snapckpt.hf import SnapckptCallback

    def tensors(model, optimizer):
        for p in model.parameters():
            yield p
            for t in (optimizer.state.get(p, {}).values() if optimizer is not None else ()):
                if torch.is_tensor(t) and t.is_floating_point() and t.numel() > 1:
                    yield t

    class Filler(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            with torch.no_grad():
                for t in tensors(model, optimizer):
                    t.fill_(state.global_step / 64)

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if a.mode != "resume":
                return
            step = state.global_step if resumed else -1
            ok = not resumed or all(bool((t == step / 64).all()) for t in tensors(model, optimizer))
            tier = "none" if not resumed else ("memory" if snap.resumed_from else "disk")
            out("RESULT", step=step, tier=tier, consistent=ok)

    opts = options(a)
    opts.pop("keep_last")
    opts.pop("job_id")
    targs = TrainingArguments(output_dir=a.ckpt, max_steps=a.steps if a.mode == "run" else a.steps + 1,
                              save_steps=a.disk_every, save_strategy="steps", save_total_limit=a.keep_last or None,
                              per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1000, seed=7,
                              report_to="none", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    snap = SnapckptCallback(memory_interval_steps=1, **opts)
    try:
        trainer = Trainer(model=build_model(), args=targs, train_dataset=Tokens(n=64),
                          data_collator=default_data_collator, callbacks=[Filler(), snap])
    except CheckpointCorruptError as e:  # nothing intact to resume: the callback names the damage
        out("NOTFOUND", message=str(e))
        out("RESULT", step=-1, tier="none", consistent=True)
        return
    snap.checkpointer.add_listener(lambda ev: ev.kind == "snapshot_taken" and print(f"SAVED {ev.step}", flush=True))
    resumed = a.mode == "resume" and any(n.startswith("checkpoint-") for n in os.listdir(a.ckpt))
    try:
        trainer.train(resume_from_checkpoint=True if resumed else None)
    except (SnapckptError, OSError) as e:
        out("ERROR", type=type(e).__name__, message=_describe(e))
        sys.stdout.flush()
        os._exit(3)
    print("DONE", flush=True)


ADAPTERS = {"torch": TorchAdapter, "deepspeed": DeepSpeedAdapter, "megatron": MegatronAdapter}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("integration", choices=sorted(ADAPTERS) + ["hf"])
    p.add_argument("mode", choices=["run", "resume", "phases"])
    p.add_argument("ckpt")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--disk-every", type=int, default=2)
    p.add_argument("--keep-last", type=int, default=2, help="0: keep everything")
    p.add_argument("--big-numel", type=int, default=64 * 1024)
    # the memory tier of a crashed job lives this long: longer than a restart takes (Megatron's imports alone
    # take 10+ s of CPU per rank on a busy machine); the tests kill the persisters they leave behind
    p.add_argument("--idle-secs", type=float, default=120.0)
    p.add_argument("--request-timeout", type=float, default=15.0)
    p.add_argument("--job-id", default=None)
    p.add_argument("--plan", default="", help="phases: the storage fault plan file (SNAPCKPT_FAULT_STORAGE=@PLAN)")
    p.add_argument("--phases", default="", help="phases: comma-separated storage phases to fail, in order")
    p.add_argument("--fsize-limit", type=int, default=0, help="phases: RLIMIT_FSIZE of the persister at the end")
    a = p.parse_args()
    if a.integration == "hf":
        return hf_main(a, 0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        ad = ADAPTERS[a.integration](a, rank)
        if a.mode == "run":
            for step in range(1, a.steps + 1):
                ad.save(step, StorageType.DISK if step % a.disk_every == 0 else StorageType.MEMORY)
                print(f"SAVED {step}", flush=True)
                try:
                    dist.barrier()
                except RuntimeError:  # a peer rank died (of a hung persister, say): this rank's saves tell why
                    ad.wait()
                    raise
            ad.wait()
            ad.close()
        elif a.mode == "phases":
            run_phases(a, ad, rank)
        else:
            try:
                step, tier, ok = ad.load()
            except (CheckpointNotFoundError, CheckpointCorruptError) as e:  # nothing intact left to load
                step, tier, ok = -1, "none", True
                out("NOTFOUND", message=str(e))
            out("RESULT", step=step, tier=tier, consistent=ok)
            ad.save(step + 1, StorageType.DISK)
            ad.wait()
            ad.close()
    except (SnapckptError, OSError) as e:
        out("ERROR", type=type(e).__name__, message=_describe(e))
        sys.stdout.flush()
        os._exit(3)
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
