"""Commit latency against rank count, with real ranks and a real persister (issue 15, target: the commit at
32 ranks within 2x that at 4 ranks of the same total bytes).

Each configuration launches ``torchrun --standalone --nproc-per-node N`` (gloo, one node, so one persister
serves every rank) of this file as the worker. Every rank holds ``total / N`` bytes (one fp32 tensor) and
makes ``--saves`` DISK saves, waiting for each to commit; the figure is the median over ranks and saves
(the first save excluded: it creates the arena) of ``SaveHandle.durable_secs``: seconds from the save call
to the rank knowing the step committed (snapshot, every rank's part written and fsynced, manifest,
rename, tracker). The per-rank state shrinks as N grows, so what grows with N is the coordination: the
agreement rounds, N part markers listed by the committer, N connections to the persister.

    .venv/bin/python benchmarks/commit_latency.py                  # 4, 8, 16, 32 ranks, 64 MiB in all
    .venv/bin/python benchmarks/commit_latency.py --ranks 4,32 --total-mib 16 --saves 4
    .venv/bin/python benchmarks/commit_latency.py --ranks 8,32,128 --total-mib 8 --saves 4   # many light ranks
    sudo .venv/bin/python benchmarks/commit_latency.py --nodes 2 --ranks 8,32   # 2 simulated nodes (root)

``--nodes K`` runs the ranks on K simulated nodes of the multi-node test rig (``tests/multinode.py``: own
host name, ``/dev/shm`` and persister per node, one shared checkpoint directory; needs root), ``N / K``
ranks per node: the commit then crosses nodes (node 0's persister commits, the others watch for it).

Memory: every rank is a full Python + torch + gloo process, about 150 MiB of private memory (PSS, measured
by each rank with psutil and recorded as ``rank_pss_mib``) even with a tiny state. Before each rank count
the benchmark compares ``ranks x`` the PSS per rank measured so far (150 MiB before any run) with the memory
available (``psutil.virtual_memory().available``, times ``--mem-fraction``); a count that does not fit is
recorded as skipped with the figures, rather than launched into the OOM killer.

Outputs ``benchmarks/results/commit_latency.{json,md,png}`` (``commit_latency_<K>nodes.*`` with
``--nodes``). Units: seconds, bytes. On 2 cores, 32 ranks are 16 processes per core: the absolute times
include that oversubscription (every rank's Python runs between the persister's steps); the ratio is the
figure.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))


def worker(ckpt_dir: str, total_bytes: int, saves: int) -> None:
    """One rank: ``saves`` DISK saves of ``total_bytes / world`` bytes, each waited for; rank 0 prints
    ``RESULT {"world": N, "durable_secs": [[rank's secs per save] per rank]}``."""
    import torch
    import torch.distributed as dist

    from snapckpt import Checkpointer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"w": torch.rand(max(1, total_bytes // world // 4), generator=torch.Generator().manual_seed(rank))}
    secs = []
    fsync = os.environ.get("SNAPCKPT_BENCH_FSYNC", "1") == "1"  # --no-fsync: what the fsyncs cost
    with Checkpointer(ckpt_dir, keep_last=2, expected_nbytes=state["w"].nbytes + (1 << 20), fsync=fsync) as ck:
        for step in range(1, saves + 1):
            state["w"][0] = step
            h = ck.save(state, step)
            h.wait()
            secs.append(h.durable_secs)
    import psutil

    got = [None] * world
    dist.all_gather_object(got, (secs, psutil.Process().memory_full_info().pss))
    if rank == 0:
        print("RESULT " + json.dumps({"world": world, "durable_secs": [g[0] for g in got],
                                      "pss": [g[1] for g in got]}), flush=True)
    dist.destroy_process_group()


def _on_rig(nodes: int, world: int, argv: list, scratch: str) -> tuple:
    """Run the worker on ``nodes`` simulated nodes of the test rig; ``(exit status, node 0's output)``."""
    sys.path.insert(0, str(REPO / "tests"))
    from multinode import Rig

    rig = Rig(tempfile.mkdtemp(dir=scratch), argv[1])
    try:
        rig.start(nodes)
        runs = rig.torchrun_all(__file__, argv, world // nodes)
        codes = [r.wait(1800) for r in runs]
        return max(codes, key=abs), "\n".join(r.output() for r in runs)
    finally:
        rig.close()


def measure(world: int, total_bytes: int, saves: int, scratch: str, nodes: int = 1) -> dict:
    ckpt = tempfile.mkdtemp(prefix=f"commit-{world}-", dir=scratch)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = ["--worker", ckpt, str(total_bytes), str(saves)]
    t0 = time.perf_counter()
    if nodes > 1:
        code, out = _on_rig(nodes, world, argv, scratch)
        err = ""
    else:
        cp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(world), __file__, *argv], capture_output=True, text=True, env=env, timeout=1800)
        code, out, err = cp.returncode, cp.stdout, cp.stderr
    wall = time.perf_counter() - t0
    shutil.rmtree(ckpt, ignore_errors=True)
    lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
    if code != 0 or not lines:
        raise RuntimeError(f"{world} ranks: exit {code}\n{out[-3000:]}\n{err[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    per_rank = res["durable_secs"]
    later = [s for r in per_rank for s in r[1:]]  # save 1 creates the arena
    return {"ranks": world, "nodes": nodes, "bytes_total": total_bytes, "bytes_per_rank": total_bytes // world,
            "median_commit_s": statistics.median(later), "max_commit_s": max(later),
            "first_save_median_s": statistics.median(r[0] for r in per_rank), "saves": saves,
            "launch_wall_s": wall, "rank_pss_mib": round(statistics.median(res["pss"]) / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="4,8,16,32")
    ap.add_argument("--total-mib", type=int, default=64)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--scratch", default=None, help="checkpoint directory parent (default: a temp dir)")
    ap.add_argument("--no-fsync", action="store_true", help="diagnostic: skip fsync (what the fsyncs cost)")
    ap.add_argument("--nodes", type=int, default=1, help="simulated nodes of the multi-node test rig (root)")
    ap.add_argument("--mem-fraction", type=float, default=0.7,
                    help="launch a rank count only if ranks x PSS per rank fits this share of available memory")
    ap.add_argument("--worker", nargs=3, metavar=("DIR", "BYTES", "SAVES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
        return
    from _common import git_commit, write_results

    scratch = args.scratch or tempfile.mkdtemp(prefix="snapckpt-commit-lat-")
    if args.no_fsync:
        os.environ["SNAPCKPT_BENCH_FSYNC"] = "0"
    total = args.total_mib << 20
    import psutil

    recs, skipped = [], []
    pss_mib = 150.0  # a torch + gloo rank with a tiny state (2 cores, torch 2.x); replaced by the measured one
    for world in [int(x) for x in args.ranks.split(",")]:
        avail_mib = psutil.virtual_memory().available / 2**20
        if world * pss_mib > args.mem_fraction * avail_mib:
            skip = {"ranks": world, "skipped": f"needs about {world * pss_mib / 1024:.1f} GiB ({pss_mib:.0f} MiB PSS "
                    f"per rank), {avail_mib / 1024:.1f} GiB available (--mem-fraction {args.mem_fraction:g})"}
            print(json.dumps(skip), flush=True)
            skipped.append(skip)
            continue
        rec = measure(world, total, args.saves, scratch, args.nodes)
        pss_mib = max(pss_mib, rec["rank_pss_mib"])
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    base = recs[0]["median_commit_s"]
    where = "one node" if args.nodes == 1 else f"{args.nodes} simulated nodes"
    lines = [f"Commit latency (save call to commit known on the rank), {args.total_mib} MiB in all, {where}, "
             f"{os.cpu_count()} cores, median of saves 2..{args.saves} over every rank:", "",
             "| ranks | bytes per rank | median commit (s) | max (s) | vs the fewest ranks |",
             "|---:|---:|---:|---:|---:|"]
    for r in recs:
        lines.append(f"| {r['ranks']} | {r['bytes_per_rank']} | {r['median_commit_s']:.3f} | "
                     f"{r['max_commit_s']:.3f} | {r['median_commit_s'] / base:.2f}x |")
    lines += [f"\nNot run: {s['ranks']} ranks: {s['skipped']}." for s in skipped]
    result = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": git_commit(),
                       "cpus": os.cpu_count(), "mem_total_gib": round(psutil.virtual_memory().total / 2**30, 1)},
              "records": recs, "skipped": skipped}
    stem = "commit_latency" if args.nodes == 1 else f"commit_latency_{args.nodes}nodes"
    write_results(RESULTS / f"{stem}.json", result, "\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([r["ranks"] for r in recs], [r["median_commit_s"] for r in recs], marker="o", label="median")
        ax.plot([r["ranks"] for r in recs], [r["max_commit_s"] for r in recs], marker="x", ls=":", label="max")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (same total bytes)")
        ax.set_ylabel("commit latency (s)")
        ax.set_title("Commit latency vs rank count")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / f"{stem}.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
