"""The integrations on the multi-node rig (tests/test_multinode_integrations.py), one rank per node, torchrun.

Usage: ``mn_integration_worker.py FRAMEWORK CKPT_DIR [--pause]``, FRAMEWORK one of ``deepspeed`` (ZeRO-2,
``DeepSpeedCheckpointer``), ``megatron`` (megatron-core GPT, snapckpt's ``load_checkpoint`` /
``save_checkpoint``), ``trainer`` (the Hugging Face ``Trainer`` with ``SnapckptCallback``), ``accelerate``
(``AcceleratorCheckpointer``). The tiny models and data of the single-node workers (ds_common,
megatron_worker, hf_worker, accel_worker) train ``STEPS`` steps: a DISK save at step ``DISK``, a MEMORY save
at step ``PAUSE`` (newer than the disk). Every rank prints ``LOSS <step> <repr>`` per step it trains.

``--pause`` (the first launch): every rank first trains a fresh model ``STEPS`` steps without snapckpt (the
same seeds: the uninterrupted reference, printed as ``REF <step> <repr>``); then the checkpointed run
starts, and once the MEMORY snapshot of step ``PAUSE`` is taken (and the DISK save committed) prints
``PAUSED <step>`` and sleeps until killed. Without it the run resumes (``RESUMED {"rank", "step", "tier",
"fetched_from"}``) and trains to ``STEPS``.

The persister's crash flush is off (``flush_on_crash=False``): the test restarts at once, and the flush
across a lost node is case G8 of tests/test_multinode.py.
"""
import json
import os
import sys
import tempfile
import time

STEPS, DISK, PAUSE = 5, 2, 3
OPTS = {"flush_on_crash": False}


def emit(tag: str, step: int, loss: float) -> None:
    print(f"{tag} {step} {loss!r}", flush=True)


def resumed(rank: int, info) -> None:
    print("RESUMED " + json.dumps({"rank": rank, "step": info.step, "tier": info.tier.value,
                                   "fetched_from": info.fetched_from}), flush=True)


def hold(wait) -> None:
    """The pause: wait for the outstanding commits (the DISK save), say so, sleep until killed."""
    wait()
    print(f"PAUSED {PAUSE}", flush=True)
    while True:
        time.sleep(1)


def run_deepspeed(ckpt: str, pause: bool) -> None:
    import ds_common
    import deepspeed

    from snapckpt.deepspeed import DeepSpeedCheckpointer, StorageType

    deepspeed.init_distributed(dist_backend="gloo")
    if pause:
        ref = ds_common.build(2, "fp32")
        for step in range(1, STEPS + 1):
            emit("REF", step, ds_common.train_step(ref, step))
    engine = ds_common.build(2, "fp32")
    ck = DeepSpeedCheckpointer(engine, ckpt, **OPTS)
    path, _ = ck.load_checkpoint(ckpt)
    if path is not None:
        resumed(engine.global_rank, ck.checkpointer.last_load)
    for step in range(int(engine.global_steps) + 1, STEPS + 1):
        emit("LOSS", step, ds_common.train_step(engine, step))
        if step == DISK:
            ck.save_checkpoint(ckpt)
        if step == PAUSE:
            ck.save_checkpoint(ckpt, storage_type=StorageType.MEMORY)
            if pause:
                hold(ck.wait)
    ck.close()
    ds_common.exit_after_barrier()


def run_megatron(ckpt: str, pause: bool) -> None:
    import torch

    import megatron_cpu
    import megatron_worker as mw

    megatron_cpu.install(force=True)
    torch.distributed.init_process_group("gloo")
    megatron_cpu.init_parallel(1)
    from snapckpt import StorageType
    from snapckpt.megatron_dist_ckpt import close_all, get_checkpointer, load_checkpoint, save_checkpoint

    rank = torch.distributed.get_rank()
    if pause:
        model, opt, sched = mw.build(1, "adam")
        for it in range(STEPS):
            emit("REF", it + 1, mw.train_step(model, opt, sched, it))
        megatron_cpu.seed_all()  # the checkpointed run starts from the same RNG states
    model, opt, sched = mw.build(1, "adam")
    it, flops = load_checkpoint(model, opt, sched, load_dir=ckpt, **OPTS)
    ck = get_checkpointer(ckpt)
    if it:
        resumed(rank, ck.last_load)
    while it < STEPS:
        loss = mw.train_step(model, opt, sched, it)
        it += 1
        emit("LOSS", it, loss)
        if it in (DISK, PAUSE):
            save_checkpoint(it, [model], opt, sched, flops, save_dir=ckpt,
                            storage_type=StorageType.DISK if it == DISK else StorageType.MEMORY)
        if pause and it == PAUSE:
            hold(ck.wait)
    close_all()
    torch.distributed.destroy_process_group()


def run_trainer(ckpt: str, pause: bool) -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from hf_worker import Tokens, build_model
    from snapckpt.hf import SnapckptCallback

    class Report(TrainerCallback):
        def __init__(self, tag, snap=None):
            self.tag, self.snap = tag, snap

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                emit(self.tag, state.global_step, logs["loss"])

        def on_step_begin(self, args, state, control, **kw):
            # after SnapckptCallback's on_step_begin, which took the pending snapshot of this step
            if self.snap is not None and pause and state.global_step == PAUSE:
                hold(self.snap.checkpointer.wait)

    def trainer(out, save, callbacks):
        args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
                                 lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
                                 save_strategy="steps" if save else "no", save_steps=DISK, seed=7,
                                 report_to="none", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
        return Trainer(model=build_model(), args=args, train_dataset=Tokens(), data_collator=default_data_collator,
                       callbacks=callbacks)

    if pause:
        trainer(tempfile.mkdtemp(prefix="mn-ref-"), False, [Report("REF")]).train()
    # a memory snapshot at PAUSE (a multiple of it), the Trainer's own save_steps to disk at DISK
    snap = SnapckptCallback(memory_interval_steps=PAUSE, **OPTS)
    t = trainer(ckpt, True, [snap, Report("LOSS", snap)])
    rank = torch.distributed.get_rank()
    if snap.resumed_from is not None:
        resumed(rank, snap.checkpointer.last_load)
    t.train(resume_from_checkpoint=None if pause else True)
    # as hf_worker: leave without torch's C++ teardown, which aborts now and then under torchrun
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


def run_accelerate(ckpt: str, pause: bool) -> None:
    import torch

    from accel_worker import setup
    from snapckpt.hf import AcceleratorCheckpointer

    def train(acc, model, opt, batches, sched, start, tag, step_end=None):
        step = start
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            emit(tag, step, loss.item())
            if step_end is not None:
                step_end(step)
            if step >= STEPS:
                break

    if pause:
        acc, model, opt, loader, sched = setup()
        train(acc, model, opt, loader, sched, 0, "REF")
    acc, model, opt, loader, sched = setup()
    ck = AcceleratorCheckpointer(acc, ckpt, **OPTS)
    start = 0
    path = ck.load_state()
    if path is not None:
        start = int(path.rsplit("_", 1)[1])
        resumed(acc.process_index, ck.checkpointer.last_load)

    def step_end(step):
        if step == DISK:
            ck.save_state(step)
        if step == PAUSE:
            ck.save_state(step, "memory")
            if pause:
                hold(ck.checkpointer.wait)

    train(acc, model, opt, acc.skip_first_batches(loader, start) if start else loader, sched, start, "LOSS",
          step_end)
    ck.close()
    acc.end_training()


def main() -> None:
    framework, ckpt = sys.argv[1], sys.argv[2]
    pause = "--pause" in sys.argv[3:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    {"deepspeed": run_deepspeed, "megatron": run_megatron, "trainer": run_trainer,
     "accelerate": run_accelerate}[framework](ckpt, pause)


if __name__ == "__main__":
    main()
