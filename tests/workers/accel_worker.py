"""A small MLP with dropout trained by a plain Accelerate loop on CPU (shuffled data, StepLR).

Usage: accel_worker.py '<json config>'. Keys: out (checkpoint dir), steps, save_at, mode:
    "stock": ``accelerator.save_state(out/checkpoint_<save_at>)``;
    "snap": ``AcceleratorCheckpointer(...).save_state(save_at)`` (DISK), plus a MEMORY snapshot every step
        when ``mem``; on start ``load_state()`` resumes from the newest snapshot (memory or disk);
    "stock_resume": ``accelerator.load_state(out/checkpoint_<resume_from>)`` (stock loader), then train.
exit_at: after that step, ``os._exit(0)`` (no close). Writes ``result`` (json: per-step losses and lrs,
``resumed`` folder; ``result.<process index>`` under torchrun with several processes).
ref: a whole config (its own result) run first in the same process, to its end (a stock run of the same
test: one process start fewer; ``setup`` gives the same initial state again).
"""
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


def setup():
    """A fresh ``Accelerator(cpu=True)`` (seed 0) and its prepared model, optimizer, loader and scheduler:
    the same initial state on every call (also several in one process)."""
    set_seed(0)
    acc = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(42))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, loader, sched


def main():
    cfg = json.loads(sys.argv[1])
    if cfg.get("ref"):
        train(cfg["ref"])
    train(cfg)


def train(cfg):
    """One run of ``cfg`` (the keys above); writes its facts to ``cfg["result"]``."""
    acc, model, opt, loader, sched = setup()
    ck = None
    start, resumed = 0, None
    if cfg["mode"] == "snap":
        from snapckpt.hf import AcceleratorCheckpointer

        ck = AcceleratorCheckpointer(acc, cfg["out"], persister_idle_timeout_secs=180, **cfg.get("opts", {}))
        resumed = ck.load_state()
    elif cfg["mode"] == "stock_resume":
        resumed = os.path.join(cfg["out"], f"checkpoint_{cfg['resume_from']}")
        acc.load_state(resumed)
    if resumed:
        start = int(resumed.rsplit("_", 1)[1])
    rows = []
    batches = acc.skip_first_batches(loader, start) if start else loader
    step = start
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        if ck is not None:
            ck.checkpointer.fence()
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        rows.append({"step": step, "loss": repr(loss.item()), "lr": repr(sched.get_last_lr()[0])})
        if step == cfg.get("save_at"):
            if cfg["mode"] == "stock":
                acc.save_state(os.path.join(cfg["out"], f"checkpoint_{step}"))
            elif ck is not None:
                ck.save_state(step).wait()
        elif ck is not None and cfg.get("mem"):
            ck.save_state(step, "memory")
        if step == cfg.get("exit_at"):
            break
        if step >= cfg["steps"]:
            break
    result = cfg["result"] if acc.num_processes == 1 else f"{cfg['result']}.{acc.process_index}"
    with open(result, "w") as f:
        json.dump({"rows": rows, "resumed": resumed}, f)
    if step == cfg.get("exit_at"):
        os._exit(0)
    if ck is not None:
        ck.close()
    acc.end_training()


if __name__ == "__main__":
    main()
