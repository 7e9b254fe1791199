"""A small DDP training loop for the multi-node rig (tests/test_multinode.py), run under torchrun.

``mn_worker.py CKPT_DIR --steps S [--memory-interval M] [--disk-interval D] [--pause-at K] [--hold-ranks R,..]
[--loss-log FILE] [--commit-timeout SECS] [--replicas N] [--step-secs SECS]``

A tiny MLP with dropout (its masks come from the RNG, part of the checkpoint), AdamW, data drawn per
(rank, step) from a seeded generator; ``HookRegistry`` snapshots to memory every M steps and to disk every D.
On start: ``RESULT {"host", "rank", "num_nodes", "node_index", "local_ranks"}`` per rank, and when a
checkpoint exists ``RESUMED {"step", "tier", "rank", "fetched_from"}``; each peer-replica event, remote-tier event
(``upload_skipped``, ``upload_failed``; the remote tier comes from ``$SNAPCKPT_REMOTE_DIR``) and a
``steps_lost`` event as ``EVENT {"kind", "step", "rank", "reason"}``. Rank 0 prints and appends ``step N loss X`` (the
rank-averaged loss, full repr).

``--pause-at K``: after step K's snapshot every rank prints ``PAUSED K`` and then: ranks listed in
``--hold-ranks`` sleep until killed; the others block in a barrier those ranks never join (when a held
rank is killed they die of the gloo error, leaving ``with Checkpointer`` by exception). Without
``--hold-ranks`` every rank sleeps (the test kills them all at once).

DDP runs with ``find_unused_parameters=True``: then it never rebuilds its gradient buckets after the first
iteration, so a resumed run reduces in the same bucket order as an uninterrupted one and gloo's sums are
bitwise equal at any rank count (with a rebuild, 3+ ranks differ in the last bits after a resume).
"""
import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt_dir")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--memory-interval", type=int, default=3)
    p.add_argument("--disk-interval", type=int, default=6)
    p.add_argument("--pause-at", type=int, default=None)
    p.add_argument("--hold-ranks", default="")
    p.add_argument("--loss-log", default=None)
    p.add_argument("--commit-timeout", type=float, default=600.0, help="commit_timeout_secs, seconds")
    p.add_argument("--replicas", type=int, default=None, help="the replicas option (default: snapckpt's)")
    p.add_argument("--step-secs", type=float, default=0.0, help="seconds each step sleeps (a slower loop)")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    from snapckpt import Checkpointer, HookRegistry, SnapshotPolicy, rng

    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(99 + rank)  # dropout masks differ per rank
    ts = {"step": 0}

    def state():
        return {"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng.capture(), "step": ts["step"]}

    log = open(args.loss_log, "a") if rank == 0 and args.loss_log else None
    with Checkpointer(args.ckpt_dir, keep_last=2, commit_timeout_secs=args.commit_timeout,
                      replicas=args.replicas) as ck:
        ck.add_listener(lambda e: (e.kind.startswith(("replica", "upload")) or e.kind == "steps_lost") and print(
            "EVENT " + json.dumps({"kind": e.kind, "step": e.step, "rank": e.rank, "reason": e.reason}), flush=True))
        topo = ck.topology
        print("RESULT " + json.dumps({"host": socket.gethostname(), "rank": rank, "num_nodes": topo.num_nodes,
                                      "node_index": topo.node_index, "local_ranks": list(topo.local_ranks)}),
              flush=True)
        if ck.latest_step() is not None:
            st = ck.load()
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["opt"])
            rng.restore(st["rng"])
            ts["step"] = int(st["step"])
            print("RESUMED " + json.dumps({"step": ck.last_load.step, "tier": ck.last_load.tier.name.lower(),
                                           "rank": rank, "fetched_from": ck.last_load.fetched_from}), flush=True)
        hooks = HookRegistry(ck, state_fn=state, policy=SnapshotPolicy(
            memory_interval_steps=args.memory_interval, disk_interval_steps=args.disk_interval,
            save_on_train_end=True))
        ddp = DDP(model, find_unused_parameters=True)  # no bucket rebuild: bitwise resumes at any rank count
        while ts["step"] < args.steps:
            g = torch.Generator().manual_seed(ts["step"] * 1000 + rank)
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            hooks.before_optimizer_step()
            opt.step()
            ts["step"] += 1
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            line = f"step {ts['step']} loss {(mean / world).item()!r}"
            if rank == 0:
                print(line, flush=True)
                if log:
                    log.write(line + "\n")
                    log.flush()
            hooks.step_end(ts["step"])
            time.sleep(args.step_secs)
            if ts["step"] == args.pause_at:
                print(f"PAUSED {ts['step']}", flush=True)
                held = {int(r) for r in args.hold_ranks.split(",") if r}
                if not held or rank in held:
                    while True:
                        time.sleep(1)
                dist.barrier()  # a held rank never joins: this raises once it is killed
                raise AssertionError("the barrier with a held rank returned")
        hooks.train_end()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
