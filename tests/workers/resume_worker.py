"""Single-process trainer for cases E2/E3: dropout, a shuffled DataLoader, StepLR, snapckpt resume.

Usage: resume_worker.py CKPT_DIR STOP_AT TOTAL_STEPS SAVE_AT TIER
Trains until ``STOP_AT`` (exits there as if killed, without closing the Checkpointer when
``STOP_AT < TOTAL_STEPS``), saving step ``SAVE_AT`` to TIER (memory|disk). On start it resumes from the
newest checkpoint if any. Prints ``RESULT {"step": n, "loss": repr, "lr": repr}`` per step and
``RESUMED n tier`` when it resumed.
"""
import json
import os
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from snapckpt import Checkpointer, StorageType, rng


def main() -> None:
    ckpt_dir, stop_at, total, save_at, tier = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5]
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    gen = torch.Generator().manual_seed(42)
    loader_state = {"epoch_gen": gen.get_state(), "consumed": 0}
    ck = Checkpointer(ckpt_dir, persister_idle_timeout_secs=120, weights_only=True)
    step = 0
    if ck.latest_step() is not None:
        s = ck.load()
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        sched.load_state_dict(s["sched"])
        rng.restore(s["rng"])
        loader_state = {"epoch_gen": s["loader"]["epoch_gen"], "consumed": s["loader"]["consumed"]}
        step = s["step"]
        print(f"RESUMED {step} {ck.last_load.tier.value}", flush=True)
    while step < stop_at:
        gen.set_state(loader_state["epoch_gen"])
        loader = DataLoader(data, batch_size=8, shuffle=True, generator=gen)
        for i, (x, y) in enumerate(loader):
            if i < loader_state["consumed"]:
                continue
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            loader_state["consumed"] = i + 1
            print("RESULT " + json.dumps({"step": step, "loss": repr(loss.item()),
                                          "lr": repr(opt.param_groups[0]["lr"])}), flush=True)
            if step == save_at:
                ck.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                         "rng": rng.capture(), "step": step,
                         "loader": {"epoch_gen": loader_state["epoch_gen"],
                                    "consumed": loader_state["consumed"]}},
                        step, StorageType(tier)).wait()
            if step >= stop_at:
                break
        else:
            loader_state = {"epoch_gen": gen.get_state(), "consumed": 0}
    if stop_at < total:
        os._exit(0)  # vanish like a killed process: no close(), no bye to the persister
    ck.close()


if __name__ == "__main__":
    main()
