"""The Hugging Face ``Trainer`` with DeepSpeed (``TrainingArguments(deepspeed=...)``) and ``SnapckptCallback``,
on every rank of a 2-rank gloo group (DS_ACCELERATOR=cpu), a tiny GPT-2 with dropout.

Usage: hf_ds_worker.py ROOT STAGES MEM_STAGE PHASE   (a stage: 0-3, or 3g: ZeRO-3 with gathered weights)

PHASE ``main``, per ZeRO stage of STAGES (comma-separated), in one process group:

- ``stock``: the Trainer alone, 6 steps, a save and an evaluation every 2 steps, ``save_total_limit=2``, the
  best model (least eval loss: step 2's) kept and loaded at the end;
- ``snap``: the same with ``SnapckptCallback`` attached (DeepSpeed config with a ``"snapckpt"`` section);
- rank 0 compares the two output directories folder for folder and file for file (RESULT ``folders``);
- ``resume``: a new Trainer with the callback, ``resume_from_checkpoint=<snap>/checkpoint-N`` (the
  newest kept before the last step; the stock
  resume: DeepSpeed's ``load_checkpoint`` of the folder), into another output directory;

then for MEM_STAGE a run with memory snapshots every step (from the config's ``"snapckpt"`` section, copy
overlapped) that every rank leaves with ``os._exit`` at the start of step 6 (the persister lives on).
PHASE ``memresume``: a new Trainer with the callback in that directory writes the memory snapshot of step 5
out as ``checkpoint-5`` and ``resume_from_checkpoint=True`` resumes from it.

RESULT lines (JSON): per-step losses (``rows``), final evaluation loss and best checkpoint of each run.
"""
import json
import os
import stat
import sys
import time

import ds_common  # noqa: F401  (DeepSpeed on the CPU, without the shared-memory op build)
import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, \
    default_data_collator

STEPS = 6
SNAP = {"options": {"overlap": False}}  # the DeepSpeed config's "snapckpt" section of the disk-tier runs


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=48, seq=16, vocab=96, seed=1234):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(TrainerCallback):
    """Per-step losses; ``die_at``: every rank leaves with ``os._exit`` at the ``on_step_begin`` after that
    global step (after the callback listed before it took its pending snapshot)."""

    def __init__(self, die_at=None):
        self.rows, self.die_at = [], die_at

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.rows.append([state.global_step, repr(logs["loss"])])

    def on_step_begin(self, args, state, control, **kw):
        if self.die_at is not None and state.global_step == self.die_at:
            print("RESULT " + json.dumps({"run": "died", "rank": dist.get_rank(), "rows": self.rows}), flush=True)
            os._exit(0)


def distributed_state():
    """accelerate 1.15 on a machine without an accelerator: ``PartialState`` built for DeepSpeed with no
    backend counts one process per rank (state.py: ``if self.backend is None: num_processes = 1``), so every
    rank would act as rank 0 of 1. Built here with gloo, the Trainer uses it (``use_configured_state``)."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def ds_config(stage, section=None):
    """``stage``: 0-3, or ``"3g"``: ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save`` (weights in the
    folder)."""
    zero = {"stage": int(str(stage)[0])}
    if str(stage).endswith("g"):
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "zero_optimization": zero, "steps_per_print": 100000}
    if section is not None:
        cfg["snapckpt"] = section
    return cfg


def train(out, stage, *, snap=False, section=None, resume=None, die_at=None):
    """One Trainer run; returns (facts, trainer)."""
    from snapckpt.hf import SnapckptCallback

    AcceleratorState._reset_state(reset_partial_state=False)  # a fresh DeepSpeed plugin per Trainer
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2))
    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="linear",
        warmup_steps=2, logging_steps=1, save_steps=2, save_strategy="steps", seed=7, report_to="none",
        dataloader_num_workers=0, disable_tqdm=True, save_total_limit=2, eval_strategy="steps", eval_steps=2,
        metric_for_best_model="eval_loss", greater_is_better=False, load_best_model_at_end=True,
        deepspeed=ds_config(stage, section), accelerator_config={"use_configured_state": True})
    rec = Recorder(die_at)
    snap_cb = SnapckptCallback(persister_idle_timeout_secs=120) if snap else None
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(n=8, seed=99),
                      data_collator=default_data_collator,
                      callbacks=[c for c in (snap_cb, rec) if c is not None])
    facts = {"materialized": list(snap_cb.resumed_from) if snap_cb and snap_cb.resumed_from else None}
    if facts["materialized"]:
        facts["materialized"][1] = facts["materialized"][1].value
    trainer.train(resume_from_checkpoint=resume)
    best = trainer.state.best_model_checkpoint
    facts.update(rows=rec.rows, best=os.path.basename(best) if best else None,
                 eval=repr(trainer.evaluate()["eval_loss"]),  # of the best model, loaded at the end
                 stall=snap_cb.stall_secs if snap_cb else None, world=trainer.args.world_size)
    return facts


def tree(root):
    """Files below ``root`` without snapckpt's ``.snapckpt`` sidecar, relative, sorted."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != ".snapckpt"]
        out += [os.path.relpath(os.path.join(d, n), root) for n in files]
    return sorted(out)


def compare_dirs(stock, snap):
    """Differences between two output directories: the same ``checkpoint-*`` folders, the same files in each,
    equal bytes (safetensors, JSON, scripts, ``latest``) or equal loaded contents (torch files), the same
    permission bits (DeepSpeed makes ``zero_to_fp32.py`` executable, safetensors writes ``0o600``)."""
    diffs = []
    folders = sorted(n for n in os.listdir(stock) if n.startswith("checkpoint-"))
    mine = sorted(n for n in os.listdir(snap) if n.startswith("checkpoint-"))
    if folders != mine:
        return [f"folders differ: stock {folders} snapckpt {mine}"], folders
    for folder in folders:
        a_root, b_root = os.path.join(stock, folder), os.path.join(snap, folder)
        if tree(a_root) != tree(b_root):
            diffs.append(f"{folder}: files differ: stock {tree(a_root)} snapckpt {tree(b_root)}")
            continue
        for rel in tree(a_root):
            a, b = os.path.join(a_root, rel), os.path.join(b_root, rel)
            ma, mb = (stat.S_IMODE(os.stat(p).st_mode) for p in (a, b))
            if ma != mb:
                diffs.append(f"{folder}/{rel}: mode stock {ma:o} snapckpt {mb:o}")
            if rel == "training_args.bin":
                x, y = (torch.load(p, weights_only=False).to_dict() for p in (a, b))
                for d in (x, y):
                    d.pop("output_dir")
                d = ds_common.same(x, y, f"{folder}/{rel}")
            elif rel.endswith((".pt", ".pth")):
                d = ds_common.same(torch.load(a, weights_only=False), torch.load(b, weights_only=False),
                                   f"{folder}/{rel}")
            elif rel == "trainer_state.json":  # but the run's own directory and the evaluation's timings
                x, y = (json.load(open(p)) for p in (a, b))
                for s, root in ((x, stock), (y, snap)):
                    if s.get("best_model_checkpoint"):
                        s["best_model_checkpoint"] = os.path.relpath(s["best_model_checkpoint"], root)
                    s["log_history"] = [{k: v for k, v in h.items() if not k.endswith(("_runtime", "_per_second"))}
                                        for h in s["log_history"]]
                d = ds_common.same(x, y, f"{folder}/{rel}")
            else:
                d = None if open(a, "rb").read() == open(b, "rb").read() else f"{folder}/{rel}: bytes differ"
            if d:
                diffs.append(d)
    return diffs, folders


def result(**kw):
    print("RESULT " + json.dumps({"rank": dist.get_rank(), **kw}), flush=True)


def main():
    root, stages, mem_stage, phase = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    distributed_state()
    rank = dist.get_rank()
    section = {"memory_interval_steps": 1, "options": {"flush_on_crash": False, "overlap": True,
                                                       "persister_idle_timeout_secs": 120}}
    mem_out = os.path.join(root, f"z{mem_stage}", "mem")
    if phase == "memresume":
        facts = train(mem_out, mem_stage, snap=True, section=section, resume=True)
        result(stage=mem_stage, run="memresume", **facts)
        ds_common.exit_after_barrier()
    for stage in stages.split(","):
        base = os.path.join(root, f"z{stage}")
        t0 = time.perf_counter()
        stock = train(os.path.join(base, "stock"), stage, section=SNAP)  # DeepSpeed ignores the section
        result(stage=stage, run="stock", **stock)
        snap = train(os.path.join(base, "snap"), stage, snap=True, section=SNAP)
        result(stage=stage, run="snap", **snap)
        dist.barrier()
        if rank == 0:
            diffs, folders = compare_dirs(os.path.join(base, "stock"), os.path.join(base, "snap"))
            result(stage=stage, run="folders", diffs=diffs, folders=folders,
                   files=tree(os.path.join(base, "snap", folders[-1])) if folders else [])
        kept = sorted((n for n in os.listdir(os.path.join(base, "snap")) if n.startswith("checkpoint-")),
                      key=lambda n: int(n.split("-")[1]))
        older = [n for n in kept if int(n.split("-")[1]) < STEPS][-1]  # rotation keeps the best and the newest
        resumed = train(os.path.join(base, "resume"), stage, snap=True, section=SNAP,
                        resume=os.path.join(base, "snap", older))
        result(stage=stage, run="resume", secs=time.perf_counter() - t0, resumed_from=older, **resumed)
    train(mem_out, mem_stage, snap=True, section=section, die_at=5)


if __name__ == "__main__":
    main()
