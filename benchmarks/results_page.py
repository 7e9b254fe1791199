"""The benchmark results page: ``docs/benchmarks.md`` and one plot per figure, from the latest results.

Reads what the benchmarks left in ``benchmarks/results/`` (each part is skipped when its JSON is absent):
``suite.json`` (stall, durable, restore per method and size), ``loop.json`` (training-loop cost),
``recovery.json`` (restart to first step), ``many_tensors.json``, ``first_save.json``, ``memory_budget.json``
(stall against arena memory, 2 slots vs 1), ``commit_latency.json`` (commit latency against rank count),
``remote_s3.json`` (the remote tier against plain S3 clients, and its training-loop cost), and from a GPU
machine (``benchmarks/gpu_check.sh``) ``gpu_stall.json``, ``gpu_loop.json``, ``gpu_loop_b16.json`` and
``gpu_d2h_contention.json``. Writes the page
``docs/benchmarks.md`` (each figure's table, its run's date, commit and load, and its plot) and the plots
``docs/img/bench-*.png`` (matplotlib, from the ``bench`` extra). Like the generated part of
``docs/performance.md``, the page and its plots are committed after a run (``benchmarks/results/`` itself is
git-ignored); ``suite.py --results-page`` runs this.

Run from the repo root: ``.venv/bin/python benchmarks/results_page.py``; with ``--splice remote_s3.json``
(repeatable) only that figure is re-rendered and spliced into the committed page, the others kept as they
are (for a run on a machine that does not hold the other figures' results).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GiB, REPO_ROOT  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
PAGE = REPO_ROOT / "docs" / "benchmarks.md"
IMG = REPO_ROOT / "docs" / "img"


def _load(name: str) -> Any:
    p = RESULTS / name
    return json.loads(p.read_text()) if p.exists() else None


def _when(m: dict) -> str:
    return (f"run {m.get('date', '?')[:16].replace('T', ' ')}, commit `{str(m.get('git_commit', '?'))[:12]}`, "
            f"{m.get('cpu_count')} CPUs; `{m.get('uptime', '')}`")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(path: Path, title: str, labels: list, series: dict, ylabel: str, log: bool = False) -> None:
    """A grouped bar chart: one group per label, one bar per series."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(labels) * max(1, len(series))), 3.6))
    width = 0.8 / max(1, len(series))
    for i, (name, ys) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [y if y is not None else 0 for y in ys], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _stacked(path: Path, title: str, labels: list, parts: dict, ylabel: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 3.6))
    bottom = [0.0] * len(labels)
    for name, ys in parts.items():
        ys = [y or 0.0 for y in ys]
        ax.bar(labels, ys, bottom=bottom, label=name)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def suite_part(s: dict, img: Path) -> list:
    import suite  # noqa: PLC0415 (its ratio tables)

    out = ["## Stall, time to durable and restore (`suite.py`)", "", _when(s["machine"]), ""]
    for size in s["sizes"]:
        recs = [r for r in size["methods"]]
        label = f"{size['size_gib']:g}"
        name = f"bench-stall-{label.replace('.', '_')}gib.png"
        _bars(img / name, f"{size['state_bytes'] / GiB:.2f} GiB state: blocking and durable seconds (log)",
              [r["method"] for r in recs],
              {"blocking s": [r.get("blocking_s") for r in recs], "durable s": [r.get("durable_s") for r in recs],
               "restore s": [r.get("restore_s") for r in recs]}, "seconds", log=True)
        out += [f"**State {size['state_bytes'] / GiB:.2f} GiB** ({size['n_tensors']} tensors)", "",
                *suite.ratio_tables(size), "", f"![stall, durable and restore, {label} GiB](img/{name})", ""]
    return out


def loop_part(lp: dict, img: Path) -> list:
    import suite  # noqa: PLC0415

    recs = [r for r in lp["methods"] if not r.get("error")]
    _bars(img / "bench-loop.png", "training loop: extra seconds per checkpoint", [r["method"] for r in recs],
          {"extra s per checkpoint": [r.get("extra_per_ckpt_s") for r in recs],
           "median blocked s": [r.get("median_blocked_s") for r in recs]}, "seconds")
    body = suite.loop_markdown(lp).split("\n", 2)[2]
    return ["## Training-loop cost (`suite.py --loop`)", "", body.strip(), "",
            "![loop cost](img/bench-loop.png)", ""]


def recovery_part(rc: dict, img: Path) -> list:
    import recovery  # noqa: PLC0415

    names = [n for n in recovery.METHODS if n in rc["methods"]]
    ph = [rc["methods"][n]["phases"] for n in names]
    _stacked(img / "bench-recovery.png", "restart to first step, by phase (seconds)", names,
             {"imports": [p["start_to_imported_s"] for p in ph], "build state": [p["build_state_s"] for p in ph],
              "attach": [p["attach_s"] for p in ph], "agree": [p["agree_s"] for p in ph],
              "read": [p["read_s"] for p in ph], "copy-in": [p["copy_s"] for p in ph]}, "seconds")
    body = recovery.markdown(rc).split("\n", 2)[2]
    return ["## Recovery time after a kill (`recovery.py`)", "", body.strip(), "",
            "![recovery](img/bench-recovery.png)", ""]


def many_part(mt: dict, img: Path) -> list:
    import many_tensors  # noqa: PLC0415

    st = mt["states"]
    _bars(img / "bench-many-tensors.png", "many tensors: seconds (log)", [r["state"] for r in st],
          {"floor copy": [r["floor_copy_s"] for r in st], "first save": [r["first_save_s"] for r in st],
           "later save": [r["save_s"] for r in st], "restore": [r["restore_s"] for r in st]}, "seconds", log=True)
    body = many_tensors.markdown(mt).split("\n", 2)[2]
    return ["## States with many tensors (`many_tensors.py`)", "", body.strip(), "",
            "![many tensors](img/bench-many-tensors.png)", ""]


def first_part(fs: dict, img: Path) -> list:
    import first_save  # noqa: PLC0415

    cases = {k: v for k, v in fs["cases"].items() if "error" not in v}
    bars = {"constructor": [v["ctor_s"] for v in cases.values()], "first save": [v["first_s"] for v in cases.values()]}
    if all("second_s" in v for v in cases.values()):  # the first save into the second slot
        bars["second save"] = [v["second_s"] for v in cases.values()]
    bars["later saves"] = [v["later_median_s"] for v in cases.values()]
    _bars(img / "bench-first-save.png", "first save against later saves (seconds)", list(cases), bars, "seconds")
    body = first_save.markdown(fs).split("\n", 2)[2]
    return ["## First save (`first_save.py`)", "", body.strip(), "", "![first save](img/bench-first-save.png)", ""]


def budget_part(mb: dict, img: Path) -> list:
    import memory_budget  # noqa: PLC0415

    cases = {k: v for k, v in mb["cases"].items() if "error" not in v}
    _bars(img / "bench-memory-budget.png", "host-memory budget: blocking per save (seconds)", list(cases),
          {kind: [v["median_s"].get(kind) for v in cases.values()] for kind in memory_budget.KINDS}, "seconds")
    body = memory_budget.markdown(mb).split("\n", 2)[2]
    return ["## Host-memory budget: 2 slots vs 1 slot (`memory_budget.py`)", "", body.strip(), "",
            "![memory budget](img/bench-memory-budget.png)", ""]


def commit_latency_part(cl: dict, img: Path) -> list:
    recs = sorted(cl["records"], key=lambda r: r["ranks"])
    base = recs[0]["median_commit_s"]
    _bars(img / "bench-commit-latency.png", "median commit latency against ranks (seconds)",
          [str(r["ranks"]) for r in recs], {"median commit": [r["median_commit_s"] for r in recs]}, "seconds")
    m = cl.get("meta", {})
    rows = ["| ranks | bytes per rank | median commit (s) | vs the fewest ranks |", "|---:|---:|---:|---:|"]
    rows += [f"| {r['ranks']} | {r['bytes_per_rank']} | {r['median_commit_s']:.3f} | "
             f"{r['median_commit_s'] / base:.2f}x |" for r in recs]
    return ["## Commit latency against rank count (`commit_latency.py`)", "",
            f"Run {m.get('date', '?')}, commit `{str(m.get('commit', '?'))[:12]}`, {m.get('cpus')} CPUs; the same "
            f"{recs[0]['bytes_total']} bytes in all at every rank count (target: 32 ranks within 2x of 4).", "",
            *rows, "", "![commit latency](img/bench-commit-latency.png)", ""]


def remote_part(rs: dict, img: Path) -> list:
    best, r = rs["best_s"], rs["ratios"]
    _bars(img / "bench-remote-s3.png", f"remote tier: {rs['ranks']} files of {rs['mib_per_rank']} MiB (seconds)",
          list(best), {"best of runs": list(best.values())}, "seconds")
    m = rs.get("meta", {})
    rows = ["| figure | ratio |", "|---|---:|"] + [f"| {k.replace('_', ' ')} | {v:.2f}x |" for k, v in r.items()]
    lines = ["## Remote tier against plain S3 clients (`remote_s3.py`)", "",
             (f"Run {m.get('date', '?')}, commit `{str(m.get('commit', '?'))[:12]}`, {m.get('cpus')} CPUs"
              + (f", load average {m['load_avg_before'][0]:.1f} before and {m['load_avg_after'][0]:.1f} after"
                 if "load_avg_before" in m else "") + ". " if m else "")
             + f"{rs['ranks']} files of {rs['mib_per_rank']} MiB, best of {rs.get('repeats', '?')}"
             + (f"; loop: {rs['loop']['disk']['state_mib']} MiB of model and AdamW state, "
                f"{rs['loop']['disk']['steps']} steps, a DISK save every {rs['loop']['disk']['every']}, modes "
                "interleaved, the best run of each kept"
                if "loop" in rs else "") + ". "
             "moto's server on 127.0.0.1 (Python, on the same cores): only ratios within the run mean anything. "
             "Upload: snapckpt's verified multipart upload against `s3fs.put_file` and boto3's `upload_file` of the "
             "same files; download: snapckpt's verified, ranged download against `s3fs.get_file` and boto3. Loop: "
             "mean step time of a training loop with DISK saves plus the remote tier against the disk tier alone.",
             "", *rows, ""]
    if "loop" in rs:
        lines += ["| loop mode | mean step (s) |", "|---|---:|"]
        lines += [f"| {mode} | {v['step_mean_s']:.4f} |" for mode, v in rs["loop"].items()] + [""]
    return lines + ["![remote tier](img/bench-remote-s3.png)", ""]


def _gpu_when(m: dict) -> str:
    return (f"Measured on {m['gpu']} (torch {m['torch']}), {m['date']}, commit `{m['git']}`, with "
            "`benchmarks/gpu_check.sh` on a device machine lent to the session (CI has no GPU; these results are "
            "spliced into this page with `--splice`).")


def gpu_stall_part(gs: dict, img: Path) -> list:
    import gpu_stall  # noqa: PLC0415

    keys = [k for k, r in gs["results"].items() if r.get("gbps") and k.split("/")[1] != "snapckpt_memory_overlap"]
    _bars(img / "bench-gpu-d2h.png", "GPU state to host: GB/s (one cudaMemcpyAsync = the floor)", keys,
          {"GB/s": [gs["results"][k]["gbps"] for k in keys]}, "GB/s")
    body = gpu_stall.markdown(gs).split("\n", 2)[2]
    return ["## GPU: device-to-host snapshot bandwidth and stall (`gpu_stall.py`)", "", _gpu_when(gs["machine"]), "",
            body.strip(), "", "![GPU D2H bandwidth](img/bench-gpu-d2h.png)", ""]


def _gpu_loop(name: str, title: str):
    def part(gl: dict, img: Path) -> list:
        import gpu_loop  # noqa: PLC0415

        ph = {k: r for k, r in gl["phases"].items() if r.get("extra_per_checkpoint_s") is not None}
        _bars(img / f"bench-{name}.png", "GPU training loop: extra seconds per checkpoint", list(ph),
              {"extra s per checkpoint": [r["extra_per_checkpoint_s"] for r in ph.values()]}, "seconds")
        body = gpu_loop.markdown(gl).split("\n", 2)[2]
        return [f"## {title}", "", _gpu_when(gl["machine"]), "", body.strip(), "",
                f"![GPU loop](img/bench-{name}.png)", ""]
    return part


def gpu_d2h_part(gd: dict, img: Path) -> list:
    import gpu_d2h_contention  # noqa: PLC0415

    ways = list(gd["ways"])
    _bars(img / "bench-gpu-d2h-contention.png", "a loop's item() while the snapshot copies (seconds, log)", ways,
          {"item() latency s": [gd["ways"][w]["item_s"] for w in ways],
           "whole copy s": [gd["ways"][w]["copy_s"] for w in ways]}, "seconds", log=True)
    body = gpu_d2h_contention.markdown(gd).split("\n", 2)[2]
    return ["## GPU: a loop's host sync during the snapshot copy (`gpu_d2h_contention.py`)", "",
            _gpu_when(gd["machine"]), "", body.strip(), "",
            "![D2H contention](img/bench-gpu-d2h-contention.png)", ""]


PARTS = [("suite.json", suite_part), ("loop.json", loop_part), ("recovery.json", recovery_part),
         ("many_tensors.json", many_part), ("first_save.json", first_part), ("memory_budget.json", budget_part),
         ("commit_latency.json", commit_latency_part), ("remote_s3.json", remote_part),
         ("gpu_stall.json", gpu_stall_part),
         ("gpu_loop.json", _gpu_loop("gpu-loop", "GPU: training-loop cost, copy about as long as forward and backward "
                                                 "(`gpu_loop.py`)")),
         ("gpu_loop_b16.json", _gpu_loop("gpu-loop-b16", "GPU: training-loop cost, forward and backward longer than "
                                                         "the copy (`gpu_loop.py --batch 16`)")),
         ("gpu_d2h_contention.json", gpu_d2h_part)]
NOT_MEASURED = "Not measured in this page's runs: "


def _not_measured(missing: list) -> list:
    return [NOT_MEASURED + ", ".join(f"`{m}`" for m in missing) + "."] if missing else []


#: sections measured on another machine (the GPU device): kept from the existing page when their results are not here
KEPT_PREFIX = "## GPU:"


def _kept_sections(page: Path) -> list:
    """The existing page's sections whose heading starts with :data:`KEPT_PREFIX`, as lines (each to the next
    ``## `` heading or the "not measured" line)."""
    if not page.exists():
        return []
    out, keep = [], False
    for line in page.read_text().splitlines():
        if line.startswith("## ") or line.startswith(NOT_MEASURED):
            keep = line.startswith(KEPT_PREFIX)
        if keep:
            out.append(line)
    return out


def write_page(page: Path = PAGE, img: Path = IMG) -> Path:
    """Write the page and its plots from whatever results exist; return the page's path. The GPU sections, whose
    results come from a device machine, are kept from the existing page when their results are not here (their
    plots stay in ``img``); each keeps the date and commit of its own run."""
    lines = ["# Benchmark results", "",
             "<!-- generated by benchmarks/results_page.py from benchmarks/results/*.json; do not edit by hand -->",
             "",
             "Every figure below was measured by the benchmark named in its heading, all methods of a figure in one "
             "run on the machine and at the commit it names; the load average is given because these figures come "
             "from shared 2-core machines, where timings vary about 2x between runs: read the ratios within a "
             "figure. How each method is measured: [Performance](performance.md) and `benchmarks/README.md`. No "
             "test asserts any of these times.", ""]
    missing = []
    for name, fn in PARTS:
        data = _load(name)
        if data is None:
            missing.append(name)
            continue
        lines += fn(data, img)
    if any(n.startswith("gpu_") for n in missing):
        kept = _kept_sections(page)
        if kept:
            lines += kept
            missing = [n for n in missing if not n.startswith("gpu_")]
    page.write_text("\n".join(lines + _not_measured(missing)) + "\n")
    return page


def splice_page(names: list, page: Path = PAGE, img: Path = IMG) -> Path:
    """Render only the figures ``names`` (result files, ``remote_s3.json`` or ``remote_s3``) and splice them into
    the existing page: a section with the same heading is replaced, a new one goes after the last section;
    the other sections stay as they are (their results need not be on this machine); the "not measured"
    line loses the names spliced. Return the page's path.

    Raises:
        ValueError: a name is no figure of the page, or its results file is absent.
    """
    known = dict(PARTS)
    files = [n if n.endswith(".json") else n + ".json" for n in names]
    for f in files:
        if f not in known:
            raise ValueError(f"--splice {f}: not a figure of the page; known: {', '.join(known)}")
        if _load(f) is None:
            raise ValueError(f"--splice {f}: {RESULTS / f} is absent; run its benchmark first")
    text = page.read_text().rstrip("\n").split("\n")
    missing = []
    if text and text[-1].startswith(NOT_MEASURED):
        missing = [m for m in text.pop()[len(NOT_MEASURED):].rstrip(".").replace("`", "").split(", ") if m]
    heads = [i for i, line in enumerate(text) if line.startswith("## ")]
    head, sections = text[:heads[0]] if heads else text, []
    for a, b in zip(heads, heads[1:] + [len(text)]):
        sections.append(text[a:b])
    for f in files:
        new = known[f](_load(f), img)
        at = [i for i, sec in enumerate(sections) if sec[0] == new[0]]
        if at:
            sections[at[0]] = new
        else:
            if sections and sections[-1][-1] != "":  # the page's last section lost its blank line to rstrip
                sections[-1].append("")
            sections.append(new)
        missing = [m for m in missing if m != f]
    page.write_text("\n".join(head + [line for sec in sections for line in sec] + _not_measured(missing)) + "\n")
    return page


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--splice", action="append", metavar="NAME", default=[],
                   help="only re-render this figure (its results file, e.g. remote_s3.json; repeatable) and splice it "
                        "into the committed page, keeping the other figures (whose results may be elsewhere)")
    a = p.parse_args(argv)
    try:
        print(f"wrote {splice_page(a.splice) if a.splice else write_page()}")
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
