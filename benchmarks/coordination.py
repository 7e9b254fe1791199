"""Coordination cost against rank count: one snapckpt agreement round (``StoreCoordinator.all_gather``)
with 8, 32 and 128 light ranks, against the per-key algorithm it replaced (every rank reads every other
rank's key: N**2 store reads per round), on the same ``TCPStore``.

Light ranks: the agreement only needs a store client, so a rank here is a thread with its own
``TCPStore`` client, spread over ``--procs`` forked processes (several ranks per core, as the issue asks;
a real rank also holds a model, which does not take part in the agreement). Each configuration runs
``--rounds`` rounds after a warm-up round; the figure is the median round time seen by rank 0 (every rank
leaves a round within one store round trip of the others).

    .venv/bin/python benchmarks/coordination.py            # 8, 32, 128 ranks; ~1 min on 2 cores
    .venv/bin/python benchmarks/coordination.py --ranks 8,32 --rounds 20

Outputs ``benchmarks/results/coordination.{json,md,png}``. Units: seconds, store operations.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List

import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from snapckpt.dist.coordination import StoreCoordinator  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


class PerKeyCoordinator:
    """The algorithm snapckpt used before: each rank sets its own key and bumps a counter, polls the
    counter, then gets every rank's key (``N`` gets per rank, ``N**2`` per round)."""

    def __init__(self, store, rank: int, world_size: int, prefix: str) -> None:
        self.store = dist.PrefixStore(prefix, store)
        self.rank, self.world_size, self.round = rank, world_size, 0

    def all_gather(self, name: str, payload: Dict[str, Any], timeout_secs: float) -> List[Dict[str, Any]]:
        self.round += 1
        base = f"{self.round}/{name}"
        self.store.set(f"{base}/{self.rank}", json.dumps(payload))
        self.store.add(f"{base}/count", 1)
        delay = 0.005
        while self.store.add(f"{base}/count", 0) < self.world_size:
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return [json.loads(self.store.get(f"{base}/{r}")) for r in range(self.world_size)]


ALGORITHMS = {"snapckpt": StoreCoordinator, "per_key_reads": PerKeyCoordinator}


def _proc(port: int, world: int, ranks: List[int], algo: str, rounds: int, out_q) -> None:
    times: List[float] = []

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=120))
        c = ALGORITHMS[algo](store, r, world, f"bench/{algo}/")
        payload = {"step": 1000, "tier": "memory", "files": ["model_states.pt"], "rank": r}
        for k in range(rounds + 1):
            t0 = time.perf_counter()
            got = c.all_gather("latest", payload, 120)
            dt = time.perf_counter() - t0
            assert len(got) == world and got[world - 1]["rank"] == world - 1
            if r == 0 and k > 0:  # round 0 is the warm-up
                times.append(dt)

    threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out_q.put(times)


def measure(world: int, algo: str, rounds: int, procs: int) -> Dict[str, Any]:
    server = dist.TCPStore("127.0.0.1", 0, world + 1, True, timedelta(seconds=120), wait_for_workers=False)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    parts = [list(range(world))[i::procs] for i in range(procs)]
    ps = [ctx.Process(target=_proc, args=(server.port, world, part, algo, rounds, q)) for part in parts if part]
    for p in ps:
        p.start()
    times = [t for _ in ps for t in q.get(timeout=600)]
    for p in ps:
        p.join()
    ops = 4 * world + 1 if algo == "snapckpt" else world * world + 3 * world  # + the counter polls
    return {"ranks": world, "algorithm": algo, "median_round_s": statistics.median(times),
            "p90_round_s": sorted(times)[int(0.9 * (len(times) - 1))], "rounds": len(times),
            "store_ops_per_round": ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="8,32,128")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--procs", type=int, default=4, help="processes the light ranks are spread over")
    args = ap.parse_args()
    recs = []
    for world in [int(x) for x in args.ranks.split(",")]:
        for algo in ALGORITHMS:
            rec = measure(world, algo, args.rounds, args.procs)
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "procs": args.procs}
    (RESULTS / "coordination.json").write_text(json.dumps({"meta": meta, "records": recs}, indent=1))
    by = {(r["ranks"], r["algorithm"]): r for r in recs}
    worlds = sorted({r["ranks"] for r in recs})
    lines = ["| ranks | snapckpt round (ms) | store ops | per-key reads round (ms) | store ops | per-key / snapckpt |",
             "|---:|---:|---:|---:|---:|---:|"]
    for w in worlds:
        a, b = by[(w, "snapckpt")], by[(w, "per_key_reads")]
        lines.append(f"| {w} | {a['median_round_s'] * 1e3:.2f} | {a['store_ops_per_round']} | "
                     f"{b['median_round_s'] * 1e3:.2f} | {b['store_ops_per_round']} | "
                     f"{b['median_round_s'] / a['median_round_s']:.1f}x |")
    base = by[(worlds[0], "snapckpt")]["median_round_s"]
    lines.append("")
    lines.append(f"snapckpt round at {worlds[-1]} ranks / at {worlds[0]} ranks: "
                 f"{by[(worlds[-1], 'snapckpt')]['median_round_s'] / base:.1f}x")
    (RESULTS / "coordination.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        for algo in ALGORITHMS:
            ax.plot(worlds, [by[(w, algo)]["median_round_s"] * 1e3 for w in worlds], marker="o", label=algo)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel("agreement round (ms, median)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "coordination.png", dpi=120)
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
