"""Host-memory budget: the stall a save pays against the host memory the arena holds, 2 slots vs 1 slot.

Each case runs in a fresh process (a fresh persister) with the same ``stall.py`` state and the same schedule:
``--steps`` training steps of ``--step-s`` seconds (a sleep: a GPU-bound step leaves the host cores to the
persister), a memory snapshot every step and a disk snapshot every ``--disk-every`` steps (``overlap=False``;
blocking = ``save`` + ``fence``; disk saves are not waited for, as a training loop would not). One untimed
warm-up save first (arena creation is ``first_save.py``'s subject). Cases:

- ``2 slots``: the default ``slots_per_rank=2``;
- ``1 slot``: ``slots_per_rank=1``: the only slot is reused, so the memory save after a disk save waits for
  that disk write to finish (and while it copies, memory holds no complete snapshot);
- ``budget``: ``host_memory_budget_nbytes`` of 1.5x the state (a node with less than 2x its state): the budget
  picks the slot count (one).

Per case: blocking per save by kind (memory saves right after a disk save, other memory saves, disk saves),
the saves that waited for a slot, the total blocking of the schedule, and the arena's host memory (bytes its
slot files hold in ``/dev/shm``, peak over the run). Outputs ``benchmarks/results/memory_budget.{json,md}``,
ratios against ``2 slots``. No test asserts these times.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from _common import GiB, REPO_ROOT, machine_info, make_state, rmtree_quiet, scratch_root, state_nbytes, write_results  # noqa: E402,E501

RESULTS = REPO_ROOT / "benchmarks" / "results"
CASES = ["2 slots", "1 slot", "budget"]


def _arena_nbytes(path: str) -> int:
    """Bytes of memory the files of the arena directory hold (allocated blocks)."""
    try:
        return sum(e.stat().st_blocks * 512 for e in os.scandir(path) if e.is_file())
    except OSError:
        return 0


def child(a: argparse.Namespace) -> None:
    import snapckpt
    from snapckpt.persister.client import job_dirs

    sd = make_state(int(a.size_gib * GiB))
    nbytes = state_nbytes(sd)
    opts = {"keep_last": 2}
    if a.case == "1 slot":
        opts["slots_per_rank"] = 1
    elif a.case == "budget":
        opts["host_memory_budget_nbytes"] = int(1.5 * nbytes)
    ck = snapckpt.Checkpointer(a.dir, **opts)
    arena = job_dirs(ck.options.resolved_runtime_dir, ck.options.resolved_shm_dir, ck.job)[1]
    waited = set()
    ck.add_listener(lambda e: waited.add(e.step) if e.kind == "slot_wait" else None)
    ck.save(sd, 0, snapckpt.StorageType.MEMORY)  # warm-up: the arena exists and is mapped
    saves, handles, peak = [], [], _arena_nbytes(arena)
    prev_disk = False
    for step in range(1, a.steps + 1):
        time.sleep(a.step_s)
        disk = step % a.disk_every == 0
        kind = "disk" if disk else ("memory after disk" if prev_disk else "memory")
        t0 = time.perf_counter()
        h = ck.save(sd, step, snapckpt.StorageType.DISK if disk else snapckpt.StorageType.MEMORY)
        ck.fence()
        secs = time.perf_counter() - t0
        if disk:
            handles.append(h)
        peak = max(peak, _arena_nbytes(arena))
        st = ck.last_stats
        saves.append({"step": step, "kind": kind, "blocking_s": secs, "wait_slot_s": st.wait_slot_secs,
                      "copy_s": st.copy_secs})
        prev_disk = disk
    t0 = time.perf_counter()
    for h in handles:
        h.wait()
    drain = time.perf_counter() - t0
    peak = max(peak, _arena_nbytes(arena))
    ck.close()
    for s in saves:
        s["waited"] = s["step"] in waited
    print(json.dumps({"state_nbytes": nbytes, "saves": saves, "arena_peak_nbytes": peak, "drain_s": drain,
                      "options": opts}), flush=True)


def summarise(r: dict) -> dict:
    """Medians per kind of save, total blocking and the arena's size against the state."""
    by, copy = {}, {}
    for s in r["saves"]:
        by.setdefault(s["kind"], []).append(s["blocking_s"])
        copy.setdefault(s["kind"], []).append(s["copy_s"])
    return {"median_s": {k: statistics.median(v) for k, v in by.items()},
            "median_copy_s": {k: statistics.median(v) for k, v in copy.items()},
            "total_blocking_s": sum(s["blocking_s"] for s in r["saves"]),
            "total_wait_slot_s": sum(s["wait_slot_s"] for s in r["saves"]),
            "waited_steps": [s["step"] for s in r["saves"] if s["waited"]],
            "arena_vs_state": r["arena_peak_nbytes"] / r["state_nbytes"]}


def combine(rs: list) -> dict:
    """One case's rounds as one record: the median over rounds of every figure (the rounds are kept)."""
    if len(rs) == 1:
        return rs[0]
    med = statistics.median
    out = {"rounds": rs, "state_nbytes": rs[0]["state_nbytes"], "options": rs[0]["options"],
           "arena_peak_nbytes": max(r["arena_peak_nbytes"] for r in rs),
           "waited_steps": sorted({s for r in rs for s in r["waited_steps"]}),
           "total_blocking_s": med([r["total_blocking_s"] for r in rs]),
           "total_wait_slot_s": med([r["total_wait_slot_s"] for r in rs])}
    for key in ("median_s", "median_copy_s"):
        out[key] = {k: med([r[key][k] for r in rs if k in r[key]]) for k in rs[0][key]}
    out["arena_vs_state"] = out["arena_peak_nbytes"] / out["state_nbytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step-s", type=float, default=0.5, help="seconds of a training step (a sleep)")
    p.add_argument("--disk-every", type=int, default=4)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--rounds", type=int, default=1,
                   help="run the cases this many times, interleaved; each figure is the median over rounds")
    p.add_argument("--omp-threads", type=int, default=0,
                   help="OMP_NUM_THREADS of the cases (0: torch's default); see the note in the markdown")
    p.add_argument("--out", default=str(RESULTS / "memory_budget.json"))
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.case:
        child(a)
        return 0
    root, _ = scratch_root(None)
    cfg = {"size_gib": a.size_gib, "steps": a.steps, "step_s": a.step_s, "disk_every": a.disk_every,
           "omp_threads": a.omp_threads, "rounds": a.rounds}
    result = {"machine": machine_info(root), "config": cfg, "cases": {}}
    result["machine"]["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    if a.omp_threads:
        env["OMP_NUM_THREADS"] = str(a.omp_threads)
    runs: dict = {}
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    for case in [c for _ in range(a.rounds) for c in cases]:
        d = tempfile.mkdtemp(prefix="budget-", dir=root)
        try:
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--case", case, "--dir", d + "/ck",
                                  "--size-gib", str(a.size_gib), "--steps", str(a.steps), "--step-s", str(a.step_s),
                                  "--disk-every", str(a.disk_every)], capture_output=True, text=True, timeout=1800,
                                 env=env)
        finally:
            rmtree_quiet(d)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode != 0 or not lines:
            result["cases"][case] = {"error": out.stderr[-2000:]}
            continue
        r = json.loads(lines[-1])
        r.update(summarise(r))
        runs.setdefault(case, []).append(r)
        print(f"{case}: {r['median_s']} total {r['total_blocking_s']:.3f} s, arena {r['arena_vs_state']:.2f}x",
              file=sys.stderr, flush=True)
    for case, rs in runs.items():
        result["cases"][case] = combine(rs)
    base = result["cases"].get("2 slots", {})
    for r in result["cases"].values():
        if "error" not in r and "error" not in base and base:
            r["total_blocking_vs_2_slots"] = r["total_blocking_s"] / base["total_blocking_s"]
            r["arena_vs_2_slots"] = r["arena_peak_nbytes"] / base["arena_peak_nbytes"]
    write_results(a.out, result, markdown(result))
    return 0


KINDS = ["memory", "memory after disk", "disk"]


def markdown(result: dict) -> str:
    m, c = result["machine"], result["config"]
    lines = ["# Host-memory budget: stall against arena memory (2 slots vs 1 slot)", "",
             f"- date: {m['date']}; git: {m['git_commit']}; {m['cpu_count']} cpus; state {c['size_gib']:g} GiB; "
             f"{c['steps']} steps of {c['step_s']:g} s (a sleep), memory snapshot every step, disk every "
             f"{c['disk_every']}; overlap off; OMP_NUM_THREADS {c.get('omp_threads') or 'default'}; "
             f"median of {c.get('rounds', 1)} interleaved round(s) per figure (saves that waited: any round); "
             f"uptime: {m.get('uptime', '')}", "",
             "| case | arena (peak) GiB | arena / state | memory save s (median) | memory save after a disk save s "
             "| disk save s | copy s (median, memory saves) | saves that waited | acquiring a slot s (total, waits included) "
             "| total blocking s | blocking vs 2 slots | arena vs 2 slots |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for k, r in result["cases"].items():
        if "error" in r:
            lines.append(f"| {k} | error | | | | | | | | | | |")
            continue
        med = [r["median_s"].get(kind) for kind in KINDS]
        cells = " | ".join("" if x is None else f"{x:.3f}" for x in med)
        lines.append(f"| {k} | {r['arena_peak_nbytes'] / GiB:.2f} | {r['arena_vs_state']:.2f}x | {cells} "
                     f"| {r['median_copy_s'].get('memory', 0):.3f} | {r['waited_steps'] or 'none'} "
                     f"| {r['total_wait_slot_s']:.3f} | {r['total_blocking_s']:.3f} "
                     f"| {r.get('total_blocking_vs_2_slots', 0):.2f}x | {r.get('arena_vs_2_slots', 0):.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
