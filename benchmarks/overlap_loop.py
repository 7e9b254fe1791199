"""Training-loop cost of a memory snapshot every step, with the copy synchronous vs overlapped.

    python benchmarks/overlap_loop.py --state-mib 512 --steps 20 --out benchmarks/results/overlap

One process, one state (an MLP whose weights plus AdamW moments make about ``--state-mib`` MiB, fp32, CPU),
the same loop three times: no checkpoint; ``Checkpointer(overlap=False)`` (``save`` copies before it
returns); ``Checkpointer(overlap=True)`` (a copy thread copies during forward/backward, ``fence()`` before
the optimizer step). Reported per mode: median step time (seconds), extra seconds per step over no
checkpoint, and the median time ``save`` + ``fence`` blocked the loop. Two warm-up steps are dropped (they
allocate the arena slots). Writes ``overlap_loop.json`` and ``overlap_loop.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from snapckpt import Checkpointer, StorageType


def build(state_mib: int):
    width = 2048
    # params p: 4 bytes each, AdamW keeps two more copies: 12 bytes per parameter in all
    layers = max(1, int(state_mib * 2**20 / 12 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, width


def loop(model, opt, width, steps, ck):
    x = torch.randn(64, width)
    times, blocked = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        b = 0.0
        if ck is not None:
            tb = time.perf_counter()
            ck.save({"model": model.state_dict(), "opt": opt.state_dict()}, step, StorageType.MEMORY)
            b += time.perf_counter() - tb
        loss = model(x).pow(2).mean()
        loss.backward()
        if ck is not None:
            tb = time.perf_counter()
            ck.fence()
            b += time.perf_counter() - tb
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        blocked.append(b)
    return times[2:], blocked[2:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mib", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/overlap")
    args = p.parse_args()
    model, opt, width = build(args.state_mib)
    rows = {}
    times, _ = loop(model, opt, width, args.steps, None)
    rows["none"] = {"step_s": statistics.median(times), "blocked_s": 0.0}
    for overlap in (False, True):
        with tempfile.TemporaryDirectory() as d, Checkpointer(d, overlap=overlap, persister_idle_timeout_secs=10) as ck:
            times, blocked = loop(model, opt, width, args.steps, ck)
        rows["overlap" if overlap else "sync"] = {"step_s": statistics.median(times),
                                                  "blocked_s": statistics.median(blocked)}
    base = rows["none"]["step_s"]
    for r in rows.values():
        r["extra_s"] = r["step_s"] - base
    nbytes = sum(t.numel() * 4 for t in model.parameters()) * 3
    report = {"state_bytes": nbytes, "steps": args.steps, "threads": torch.get_num_threads(),
              "cpus": os.cpu_count(), "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overlap_loop.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = ["| mode | step s | extra s per step | save+fence blocked s |", "|---|---|---|---|"]
    for name, r in rows.items():
        md.append(f"| {name} | {r['step_s']:.3f} | {r['extra_s']:+.3f} | {r['blocked_s']:.3f} |")
    with open(os.path.join(args.out, "overlap_loop.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"state {nbytes / 2**20:.0f} MiB, {torch.get_num_threads()} torch threads")
    print("\n".join(md))


if __name__ == "__main__":
    main()
