"""Checkpoint metrics where Trainer users look: ``SnapckptCallback.attach(trainer)`` sends each checkpoint's
``snapckpt/*`` values through ``Trainer.log``, so they are in ``trainer.state.log_history`` and in the
TensorBoard event files of ``report_to=["tensorboard"]`` (read back with TensorBoard's own reader)."""
import glob
import os
import sys

import pytest

from _harness import REPO

sys.path.insert(0, os.path.join(REPO, "tests", "workers"))


def test_checkpoint_metrics_reach_log_history_and_tensorboard(snap_env, monkeypatch):
    """A tiny GPT-2, 4 steps, a disk save every 2 steps and a memory snapshot every step, ``logging_steps=1``,
    TensorBoard reporting. Right behaviour: ``log_history`` has stall and bytes for every snapshot (4: steps
    1-4) and durable time and GB/s for each committed disk save (steps 2 and 4), all positive, GB/s equal to
    bytes over durable seconds of the same step; TensorBoard's event files hold the same values as
    ``train/snapckpt/*`` scalars; the Trainer's own loss entries are still there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import Trainer, TrainingArguments

    from hf_worker import Tokens, build_model
    from snapckpt import metrics as M
    from snapckpt.hf import SnapckptCallback

    tb_dir = os.path.join(snap_env.tmp, "tb")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", tb_dir)
    args = TrainingArguments(output_dir=snap_env.ckpt_dir, max_steps=4, save_steps=2, save_strategy="steps",
                             logging_steps=1, per_device_train_batch_size=4, report_to=["tensorboard"],
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=7)
    cb = SnapckptCallback(memory_interval_steps=1, persister_idle_timeout_secs=2, commit_timeout_secs=60)
    trainer = cb.attach(Trainer(model=build_model(), args=args, train_dataset=Tokens(n=16), callbacks=[cb]))
    with pytest.raises(ValueError, match="not among the Trainer's callbacks"):
        SnapckptCallback().attach(trainer)
    trainer.train()

    hist = trainer.state.log_history
    assert [e["step"] for e in hist if "loss" in e] == [1, 2, 3, 4]  # the Trainer's own logs are untouched
    stall = [e[M.STALL_SECS] for e in hist if M.STALL_SECS in e]
    nbytes = [e[M.BYTES] for e in hist if M.BYTES in e]
    durable = [e[M.DURABLE_SECS] for e in hist if M.DURABLE_SECS in e]
    gbps = [e[M.PERSIST_GBPS] for e in hist if M.PERSIST_GBPS in e]
    assert len(stall) == len(nbytes) == 4 and len(durable) == len(gbps) == 2, hist
    assert all(v > 0 for v in stall + nbytes + durable + gbps)
    # the callback's own record (every event of this rank) is what reached the Trainer
    assert [m for m in cb.metrics if M.DURABLE_SECS in m] == [
        {M.DURABLE_SECS: d, M.PERSIST_GBPS: g} for d, g in zip(durable, gbps)]
    assert {"checkpoint-2", "checkpoint-4"} <= set(os.listdir(snap_env.ckpt_dir))

    files = glob.glob(os.path.join(tb_dir, "**", "events.out.tfevents.*"), recursive=True)
    assert files, f"no TensorBoard event file under {tb_dir}"
    scalars = {}
    for f in files:
        acc = EventAccumulator(f)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    assert "train/loss" in scalars
    for name, values in ((M.STALL_SECS, stall), (M.BYTES, nbytes), (M.DURABLE_SECS, durable),
                         (M.PERSIST_GBPS, gbps)):
        got = scalars.get("train/" + name)
        assert got is not None, f"train/{name} not in TensorBoard's scalars {sorted(scalars)}"
        assert got == pytest.approx(values, rel=1e-6), name  # TensorBoard stores float32


def test_on_save_fires_for_every_callback_as_the_trainers_own_save_does(snap_env, monkeypatch):
    """With the callback only passed in ``Trainer(callbacks=[...])`` (no ``attach``: it finds its Trainer at
    construction), a user callback's ``on_save`` fires for the same steps as with the Trainer's own save, once ``checkpoint-N`` is complete (its ``trainer_state.json`` readable, naming step
    N), with ``state.global_step == N``. Before, the callback's take-over skipped ``on_save`` altogether
    (W&B, MLflow, Neptune, ClearML and DVCLive hook it).

    ``save_total_limit=1``, and step 2's commit is held (fault point, before its rename) until step 4's folder
    is committed, as on a loaded host: the callback learns of step 2's commit with step 4 on disk. Right:
    ``on_save`` of step 2 still fires with ``checkpoint-2`` there (before, retention deleted it first, the
    ``on_save`` raised inside the event listener, which only logged it, and step 2's ``on_save`` was lost),
    the same folders are kept, and an exception raised by a user's ``on_save`` (step 5) leaves ``train()``
    as with the Trainer's own save (before, it was logged and training went on)."""
    import json

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_worker import Tokens, build_model
    from snapckpt.hf import SnapckptCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.seen = []
            self.folders = {}  # step -> the checkpoint folders there at its on_save

        def on_save(self, args, state, control, **kwargs):
            self.folders[state.global_step] = {n for n in os.listdir(args.output_dir) if n.startswith("checkpoint-")}
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            with open(os.path.join(folder, "trainer_state.json")) as f:
                self.seen.append((state.global_step, json.load(f)["global_step"]))
            if state.global_step == 5:
                raise RuntimeError("on_save of step 5 fails")

    recs = {}

    def run(out, snap):
        args = TrainingArguments(output_dir=out, max_steps=5, save_steps=2, save_strategy="steps",
                                 save_total_limit=1, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                                 dataloader_num_workers=0, disable_tqdm=True, seed=7)
        rec = recs[snap] = Recorder()
        cbs = [rec]
        if snap:
            cb = SnapckptCallback(persister_idle_timeout_secs=2, commit_timeout_secs=60)
            cbs.append(cb)
        trainer = Trainer(model=build_model(), args=args, train_dataset=Tokens(n=24), callbacks=cbs)
        if snap:
            assert cb._found is trainer and cb._trainer is None  # found at the Trainer's construction
        with pytest.raises(RuntimeError, match="on_save of step 5 fails"):
            trainer.train()
        if snap:
            cb.close()
        return rec.seen, sorted(os.listdir(out))

    stock = run(os.path.join(snap_env.tmp, "stock"), snap=False)
    assert stock == ([(2, 2), (4, 4), (5, 5)], ["checkpoint-5"]), stock  # the Trainer saves the last step too
    gate = os.path.join(snap_env.ckpt_dir, "checkpoint-4")
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", f"commit.before_rename:step=2:action=wait:secs=60:path={gate}")
    assert run(snap_env.ckpt_dir, snap=True) == stock
    assert "checkpoint-4" in recs[True].folders[2], recs[True].folders  # the hold took effect
