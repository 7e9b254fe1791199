"""First save against later saves: what a job pays for its first checkpoint.

Each case runs in a fresh process (a fresh persister): the constructor's time, then ``--saves`` saves of the
``stall.py`` state (memory tier, ``overlap=False``, ``--gap-s`` seconds after construction, as a loop spends on
its first steps), blocking = ``save`` + ``fence``. Cases:

- ``fresh``: a new job, nothing known about the state's size before the first save;
- ``expected_nbytes``: a new job told its state's size (``Checkpointer(expected_nbytes=...)``): the arena is
  reserved and mapped at construction, in the background;
- ``expect``: a new job that tells the Checkpointer its state once it has it (``ck.expect(state)`` right after
  construction, as the integrations do after the first optimizer step): the same reservation, started then;
- ``restart``: a restarted job (the directory holds a committed checkpoint): the size comes from it.

Outputs ``benchmarks/results/first_save.{json,md}``: the first save, the second (the first into the rank's
second arena slot, back to back with the first) and the median of the later saves (which reuse a slot), with
first / later and second / later. No test asserts these times.
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
from _common import write_results, GiB, REPO_ROOT, machine_info, make_state, rmtree_quiet, scratch_root, state_nbytes  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
CASES = ["fresh", "expected_nbytes", "expect", "restart"]


def child(a: argparse.Namespace) -> None:
    import snapckpt

    sd = make_state(int(a.size_gib * GiB))
    opts = {"keep_last": 2}
    if a.case == "expected_nbytes":
        opts["expected_nbytes"] = state_nbytes(sd)
    if a.case == "restart":  # a checkpoint of the same state exists (untimed, its own persister, closed)
        with snapckpt.Checkpointer(a.dir, **opts) as ck:
            ck.save(sd, 0, snapckpt.StorageType.DISK).wait()
        time.sleep(1.0)  # its persister exits
    t0 = time.perf_counter()
    ck = snapckpt.Checkpointer(a.dir, **opts)
    ctor = time.perf_counter() - t0
    if a.case == "expect":  # counted with the constructor: it runs on the training thread too
        ck.expect(sd)
        ctor = time.perf_counter() - t0
    time.sleep(a.gap_s)
    blocks = []
    for i in range(1, a.saves + 1):
        t0 = time.perf_counter()
        h = ck.save(sd, i, snapckpt.StorageType.MEMORY)
        ck.fence()
        blocks.append(time.perf_counter() - t0)
        h.wait()
    ck.close()
    print(json.dumps({"ctor_s": ctor, "blocking_s": blocks}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--gap-s", type=float, default=3.0, help="seconds between construction and the first save")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default=str(RESULTS / "first_save.json"))
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.saves < 3:
        p.error("--saves must be at least 3: the first, the first into the second slot, and a later one")
    if a.case:
        child(a)
        return 0
    root, _ = scratch_root(None)
    result = {"machine": machine_info(root), "config": {"size_gib": a.size_gib, "saves": a.saves, "gap_s": a.gap_s},
              "cases": {}}
    result["machine"]["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    for case in [c.strip() for c in a.cases.split(",") if c.strip()]:
        d = tempfile.mkdtemp(prefix="first-", dir=root)
        try:
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--case", case, "--dir", d + "/ck",
                                  "--size-gib", str(a.size_gib), "--saves", str(a.saves), "--gap-s", str(a.gap_s)],
                                 capture_output=True, text=True, timeout=1800,
                                 env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])})
        finally:
            rmtree_quiet(d)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode != 0 or not lines:
            result["cases"][case] = {"error": out.stderr[-2000:]}
            continue
        r = json.loads(lines[-1])
        b = r["blocking_s"]
        r["first_s"], r["second_s"], r["later_median_s"] = b[0], b[1], statistics.median(b[2:])
        r["first_vs_later"] = r["first_s"] / r["later_median_s"]
        r["second_vs_later"] = r["second_s"] / r["later_median_s"]
        result["cases"][case] = r
        print(f"{case}: {r}", file=sys.stderr, flush=True)
    write_results(a.out, result, markdown(result))
    return 0


def markdown(result: dict) -> str:
    m, c = result["machine"], result["config"]
    lines = ["# First save against later saves (memory tier, overlap off)", "",
             f"- date: {m['date']}; git: {m['git_commit']}; {m['cpu_count']} cpus; state {c['size_gib']:g} GiB; "
             f"{c['saves']} saves, the first {c['gap_s']:g} s after construction; uptime: {m.get('uptime', '')}", "",
             "| case | constructor s | first save s | second save s (first into slot 2) | later saves (median) s "
             "| first / later | second / later |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for k, r in result["cases"].items():
        if "error" in r:
            lines.append(f"| {k} | error | | | | | |")
            continue
        second = (f"{r['second_s']:.3f} | {r['later_median_s']:.3f} | {r['first_vs_later']:.2f}x "
                  f"| {r['second_vs_later']:.2f}x" if "second_s" in r  # results written before it was kept
                  else f"n/a | {r['later_median_s']:.3f} | {r['first_vs_later']:.2f}x | n/a")
        lines.append(f"| {k} | {r['ctor_s']:.3f} | {r['first_s']:.3f} | {second} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
