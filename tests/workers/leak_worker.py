"""Worker for tests/test_leaks.py (case D2 per integration): one rank (world size 1, gloo).

``churn KIND CKPT MARKER``: 200 saves of a small state through integration KIND (``plain`` Checkpointer,
``ds`` DeepSpeedCheckpointer, ``hf`` Trainer + SnapckptCallback, ``megatron`` save_checkpoint): MEMORY, and
every 20th to DISK (keep_last / save_total_limit 2). After every save it samples the RSS and anonymous RSS
of this process and of the persister and both open-fd counts. Then it writes MARKER (JSON: the samples, the
persister pid, every child process pid, the newest step) and sleeps until the test SIGKILLs it.

``resume KIND CKPT OUT``: a restarted job: loads the newest step (from the surviving persister's memory),
saves one more step to DISK, waits, closes; writes OUT (JSON: loaded step and tier, the persister pid, this
process's fd count before the integration was created and after close, whether the persister exited).
"""
import json
import os
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the harness
from _harness import proc_status_bytes  # noqa: E402

SAVES = 200
DISK_EVERY = 20
OPTS = dict(persister_idle_timeout_secs=120, fsync=False, commit_timeout_secs=60, request_timeout_secs=60,
            coordination_timeout_secs=60, persister_startup_timeout_secs=60)
# HF: no flush after the kill, so that the restart goes through the callback's memory-tier resume (with the
# flush, the persister itself writes checkpoint-201 and the Trainer resumes it natively)
HF_OPTS = dict(OPTS, flush_on_crash=False)


class Sampler:
    """RSS, anonymous RSS and open fds of this process and of the persister, one row per save."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.rows = []
        self.persister = None

    def sample(self, persister_pid: int) -> None:
        if self.persister is None or self.persister.pid != persister_pid:
            self.persister = psutil.Process(persister_pid)
        p = self.persister
        self.rows.append({"rss": self.me.memory_info().rss, "anon": proc_status_bytes(self.me.pid, "RssAnon"),
                          "fds": self.me.num_fds(), "p_rss": p.memory_info().rss,
                          "p_anon": proc_status_bytes(p.pid, "RssAnon"), "p_fds": p.num_fds(), "p_pid": p.pid})


def _hold(marker: str, sampler: Sampler, persister_pid: int, step: int) -> None:
    kids = [c.pid for c in psutil.Process().children(recursive=True)]
    with open(marker + ".tmp", "w") as f:
        json.dump({"samples": sampler.rows, "persister_pid": persister_pid, "children": kids, "step": step}, f)
    os.replace(marker + ".tmp", marker)
    time.sleep(600)  # SIGKILLed by the test


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _tier(i: int):
    from snapckpt import StorageType

    return StorageType.DISK if i % DISK_EVERY == 0 else StorageType.MEMORY


# ------------------------------------------------------------------------------------------- plain
def _plain_state(step: int):
    import torch

    g = torch.Generator().manual_seed(7)
    model = {f"layer{k}.weight": torch.randn(256 << 10, generator=g) for k in range(4)}  # 4 MiB
    model["layer0.weight"][0] = float(step)
    return {"model": model, "step": step}


def churn_plain(ckpt: str, marker: str) -> None:
    from snapckpt import Checkpointer, StorageType

    ck = Checkpointer(ckpt, keep_last=2, **OPTS)
    state = _plain_state(0)
    s = Sampler()
    for i in range(1, SAVES + 1):
        state["model"]["layer0.weight"][0] = float(i)
        state["step"] = i
        h = ck.save(state, i, _tier(i))
        if _tier(i) == StorageType.DISK:
            h.wait()
        s.sample(ck.persister_pid)
    _hold(marker, s, ck.persister_pid, SAVES)


def resume_plain(ckpt: str) -> dict:
    from snapckpt import Checkpointer, StorageType

    fds0 = psutil.Process().num_fds()
    ck = Checkpointer(ckpt, keep_last=2, **OPTS)
    pid = ck.persister_pid
    out = ck.load()
    assert out["step"] == ck.last_load.step and float(out["model"]["layer0.weight"][0]) == out["step"]
    info = {"step": ck.last_load.step, "tier": ck.last_load.tier.value, "persister_pid": pid, "fds_before": fds0}
    ck.save(_plain_state(SAVES + 1), SAVES + 1, StorageType.DISK).wait()
    ck.close()
    return {**info, "persister_gone": _gone(pid), "fds_after_close": psutil.Process().num_fds()}


# ---------------------------------------------------------------------------------------- DeepSpeed
def _ds_engine():
    import ds_common
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return ds_common, ds_common.build(1, "fp32")


def churn_ds(ckpt: str, marker: str) -> None:
    from snapckpt.deepspeed import DeepSpeedCheckpointer, StorageType

    ds_common, engine = _ds_engine()
    ck = DeepSpeedCheckpointer(engine, ckpt, keep_last=2, **OPTS)
    s = Sampler()
    for i in range(1, SAVES + 1):
        ds_common.train_step(engine, i)
        ck.save_checkpoint(ckpt, tag=f"global_step{engine.global_steps}", storage_type=_tier(i))
        if _tier(i) == StorageType.DISK:
            ck.wait()
        s.sample(ck.checkpointer.persister_pid)
    _hold(marker, s, ck.checkpointer.persister_pid, int(engine.global_steps))


def resume_ds(ckpt: str) -> dict:
    from snapckpt.deepspeed import DeepSpeedCheckpointer, StorageType

    ds_common, engine = _ds_engine()
    fds0 = psutil.Process().num_fds()
    ck = DeepSpeedCheckpointer(engine, ckpt, keep_last=2, **OPTS)
    pid = ck.checkpointer.persister_pid
    path, _ = ck.load_checkpoint(ckpt)
    assert path is not None
    last = ck.checkpointer.last_load
    info = {"step": last.step, "tier": last.tier.value, "persister_pid": pid, "fds_before": fds0}
    ds_common.train_step(engine, SAVES + 1)
    ck.save_checkpoint(ckpt, tag="after_restart", storage_type=StorageType.DISK)
    ck.wait()
    ck.close()
    return {**info, "persister_gone": _gone(pid), "fds_after_close": psutil.Process().num_fds()}


# ------------------------------------------------------------------------------------- HF Trainer
def _trainer(ckpt: str, max_steps: int, callbacks):
    from transformers import Trainer, TrainingArguments

    import hf_worker

    args = TrainingArguments(output_dir=ckpt, max_steps=max_steps, per_device_train_batch_size=4,
                             learning_rate=1e-2, save_steps=DISK_EVERY, save_strategy="steps", save_total_limit=2,
                             seed=7, report_to="none", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                             logging_steps=10_000)
    return Trainer(model=hf_worker.build_model(), args=args, train_dataset=hf_worker.Tokens(),
                   callbacks=callbacks)


def churn_hf(ckpt: str, marker: str) -> None:
    from transformers import TrainerCallback

    from snapckpt.hf import SnapckptCallback

    snap = SnapckptCallback(memory_interval_steps=1, **HF_OPTS)
    s = Sampler()

    class Sample(TrainerCallback):
        # listed after SnapckptCallback: at on_step_begin the pending snapshot of the previous step is taken
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 0:
                return
            if state.global_step <= SAVES:
                if state.global_step % DISK_EVERY == 0:
                    snap.checkpointer.wait()
                s.sample(snap.checkpointer.persister_pid)
            else:  # step 201 is held in memory only: the restart writes it out as checkpoint-201
                _hold(marker, s, snap.checkpointer.persister_pid, state.global_step)

    _trainer(ckpt, 10 * SAVES, [snap, Sample()]).train()


def resume_hf(ckpt: str) -> dict:
    from transformers import TrainerCallback

    from snapckpt.hf import SnapckptCallback

    fds0 = psutil.Process().num_fds()
    snap = SnapckptCallback(memory_interval_steps=1, **HF_OPTS)
    begun = []

    class Begin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            begun.append(state.global_step)

    trainer = _trainer(ckpt, SAVES + 3, [Begin(), snap])
    pid = snap.checkpointer.persister_pid
    resumed = snap.resumed_from
    trainer.train(resume_from_checkpoint=True)  # resumes natively from checkpoint-201 written from memory
    assert trainer.state.global_step == SAVES + 3
    assert resumed is None or begun == [resumed[0]], (begun, resumed)
    del trainer
    return {"step": resumed[0] if resumed else None, "tier": resumed[1].value if resumed else None,
            "persister_pid": pid, "fds_before": fds0, "persister_gone": _gone(pid),
            "fds_after_close": psutil.Process().num_fds()}


# ---------------------------------------------------------------------------------------- Megatron
def _megatron():
    import megatron_cpu  # first: it imports megatron-core without compiling its fusions
    import torch

    megatron_cpu.install(force=True)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    megatron_cpu.init_parallel(1)
    import megatron_worker

    return megatron_worker


def churn_megatron(ckpt: str, marker: str) -> None:
    import megatron_cpu  # noqa: F401  (first: megatron-core imported without compiling its fusions)
    from snapckpt import StorageType
    from snapckpt.megatron_dist_ckpt import get_checkpointer, save_checkpoint

    mw = _megatron()
    model, optimizer, sched = mw.build(1, "adam")
    s = Sampler()
    for i in range(1, SAVES + 1):
        mw.train_step(model, optimizer, sched, i)
        h = save_checkpoint(i, [model], optimizer, sched, 10 * i, save_dir=ckpt, storage_type=_tier(i),
                            keep_last=2, **OPTS)
        if _tier(i) == StorageType.DISK:
            h.wait()
        s.sample(get_checkpointer(ckpt).persister_pid)
    _hold(marker, s, get_checkpointer(ckpt).persister_pid, SAVES)


def resume_megatron(ckpt: str) -> dict:
    import megatron_cpu  # noqa: F401  (first: megatron-core imported without compiling its fusions)
    from snapckpt import StorageType
    from snapckpt.megatron_dist_ckpt import close_all, get_checkpointer, load_checkpoint, save_checkpoint

    mw = _megatron()
    model, optimizer, sched = mw.build(1, "adam")
    fds0 = psutil.Process().num_fds()
    it, flops = load_checkpoint([model], optimizer, sched, load_dir=ckpt, keep_last=2, **OPTS)
    assert flops == 10 * it, (it, flops)
    ck = get_checkpointer(ckpt)
    pid = ck.persister_pid
    info = {"step": it, "tier": ck.last_load.tier.value, "persister_pid": pid, "fds_before": fds0}
    mw.train_step(model, optimizer, sched, it)
    save_checkpoint(it + 1, [model], optimizer, sched, 10 * (it + 1), save_dir=ckpt,
                    storage_type=StorageType.DISK).wait()
    close_all()
    return {**info, "persister_gone": _gone(pid), "fds_after_close": psutil.Process().num_fds()}


if __name__ == "__main__":
    mode, kind, ckpt, path = sys.argv[1:5]
    if kind == "ds":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if mode == "churn":
        {"plain": churn_plain, "ds": churn_ds, "hf": churn_hf, "megatron": churn_megatron}[kind](ckpt, path)
    elif mode == "resume":
        result = {"plain": resume_plain, "ds": resume_ds, "hf": resume_hf, "megatron": resume_megatron}[kind](ckpt)
        with open(path, "w") as f:
            json.dump(result, f)
    else:
        raise SystemExit(f"unknown mode {mode}")
