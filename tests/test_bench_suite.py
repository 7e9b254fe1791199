"""Smoke test of the benchmark suite (benchmarks/suite.py): a tiny state, three methods, the loop mode
with two methods and the README generator; asserts that the outputs exist with the expected fields.
No timing assertions (docs/performance.md): the numbers themselves are not checked, only their presence."""
import argparse
import importlib
import json
import math
import mmap
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _suite():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("suite")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _number(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


def test_suite_loop_and_readme_outputs(snap_env, tmp_path):
    suite = _suite()
    out = tmp_path / "res" / "suite.json"
    scratch = tmp_path / "scratch"
    common = ["--out", str(out), "--scratch-dir", str(scratch), "--persister-exit-wait", "10"]
    assert suite.main(["--sizes-gib", "0.004,100000", "--repeats", "1",
                       "--methods", "floor_copy,torch_save,snapckpt_memory", *common]) == 0

    res = json.loads(out.read_text())
    assert res["machine"]["uptime"] and res["machine"]["git_commit"]
    # the impossible size is skipped with its reason, not attempted
    assert [s["size_gib"] for s in res["skipped_sizes"]] == [100000]
    assert "GiB" in res["skipped_sizes"][0]["reason"]
    (size,) = res["sizes"]
    by = {r["method"]: r for r in size["methods"]}
    assert list(by) == ["floor_copy", "torch_save", "snapckpt_memory"]
    for name, r in by.items():
        assert r["error"] is None, (name, r.get("traceback"))
        assert _number(r["blocking_s"]) and _number(r["restore_s"]), name
        assert {"blocking_vs_floor_copy", "durable_vs_floor_write", "durable_vs_floor_odirect",
                "restore_vs_floor"} <= set(r["ratios"]), name
    assert by["torch_save"]["restore_tier"] == "disk" and _number(by["torch_save"]["durable_s"])
    assert by["snapckpt_memory"]["restore_tier"] == "memory"
    assert by["snapckpt_memory"]["restore_extra"][0]["tier"] == "memory"
    assert by["snapckpt_memory"]["durable_s"] is None
    assert by["floor_copy"]["ratios"]["blocking_vs_floor_copy"] == 1.0

    md = out.with_suffix(".md").read_text()
    for text in ("| method | blocking s | durable s | restore s (tier) |", "snapckpt / peer",
                 "| snapckpt_memory |", "Targets of the performance issue", "skipped"):
        assert text in md, text
    assert out.with_suffix(".png").stat().st_size > 0

    assert suite.main(["--loop", "--loop-size-gib", "0.004", "--step-s", "0.01", "--loop-ckpts", "1",
                       "--loop-baseline-steps", "3", "--loop-rounds", "3", "--loop-methods",
                       "floor_copy,snapckpt_memory_overlap,torch_save", *common]) == 0
    loop = json.loads((out.parent / "loop.json").read_text())
    lby = {r["method"]: r for r in loop["methods"]}
    assert set(lby) == {"floor_copy", "snapckpt_memory_overlap", "torch_save"}
    assert lby["snapckpt_memory_overlap"]["every"] == 1 and lby["torch_save"]["every"] == 10
    for name, r in lby.items():
        assert r["error"] is None, (name, r.get("traceback"))
        # every-step methods: 3 rounds, each with its paired baseline, the median round reported
        rounds = r["rounds"]
        assert len(rounds) == (3 if r["every"] == 1 else 1) and r["n_ckpt"] == len(rounds), name
        assert r["extra_per_ckpt_s"] == sorted(x["extra_per_ckpt_s"] for x in rounds)[len(rounds) // 2], name
        for x in rounds:  # each timed window starts right after a full collection: nothing owed before it
            assert x["gc"]["count_at_start"][1:] == [0, 0] and len(x["gc"]["collections"]) == 3, (name, x)
    loop_md = (out.parent / "loop.md").read_text()
    assert "| method | every | extra s per checkpoint | rounds' extra s (min to max) |" in loop_md
    assert "GC in timed rounds" in loop_md
    # the loop target: against the copy floor measured in the same loop
    assert "| extra s per memory checkpoint / copy floor's (snapckpt memory, overlap on) | <= 1.1 |" in loop_md

    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Performance\n\nintro\n\n<!-- perf:begin -->\nold\n<!-- perf:end -->\n\n## Next\n")
    assert suite.main(["--readme", "--readme-path", str(readme), "--out", str(out)]) == 0
    text = readme.read_text()
    assert "old" not in text and text.endswith("<!-- perf:end -->\n\n## Next\n") and "intro" in text
    assert res["machine"]["git_commit"][:12] in text and "Training loop" in text
    assert "| snapckpt_memory |" in text


def test_results_page_splice_replaces_one_figure_and_keeps_the_others(tmp_path, monkeypatch):
    """``results_page.py --splice commit_latency.json`` re-renders that figure alone into an existing page:
    its old section replaced in place (once), the other sections kept byte for byte, the "not measured" line
    without it, its plot written; an unknown figure or an absent results file is refused naming the cause."""
    import pytest

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        rp = importlib.import_module("results_page")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(rp, "RESULTS", results)
    recs = [{"ranks": n, "bytes_total": 1 << 20, "bytes_per_rank": (1 << 20) // n, "median_commit_s": t}
            for n, t in ((4, 0.25), (32, 0.5))]
    (results / "commit_latency.json").write_text(json.dumps({"meta": {"date": "d", "commit": "c", "cpus": 2},
                                                             "records": recs}))
    page, img = tmp_path / "benchmarks.md", tmp_path / "img"
    other = ["## Recovery time after a kill (`recovery.py`)", "", "kept as it is", ""]
    stale = ["## Commit latency against rank count (`commit_latency.py`)", "", "old figures", ""]
    page.write_text("\n".join(["# Benchmark results", "", "intro", "", *stale, *other,
                               "Not measured in this page's runs: `loop.json`, `commit_latency.json`."]) + "\n")
    rp.splice_page(["commit_latency"], page=page, img=img)
    text = page.read_text()
    assert text.count("## Commit latency against rank count") == 1 and "old figures" not in text
    assert "| 32 | 32768 | 0.500 | 2.00x |" in text
    assert "\n".join(other) in text and text.index("## Commit latency") < text.index("## Recovery time")
    assert text.endswith("Not measured in this page's runs: `loop.json`.\n")
    assert (img / "bench-commit-latency.png").stat().st_size > 0
    with pytest.raises(ValueError, match="nosuch.json: not a figure of the page; known: suite.json"):
        rp.splice_page(["nosuch"], page=page, img=img)
    with pytest.raises(ValueError, match="remote_s3.json is absent; run its benchmark first"):
        rp.splice_page(["remote_s3.json"], page=page, img=img)


def test_floor_is_the_way_with_the_lowest_median_not_each_repeats_luckiest_way():
    """``floor_odirect`` reports one way's samples (the lowest median over the repeats), like every other method
    (one write per repeat); the per-repeat minimum over the ways stays in the record as ``min_of_ways_s``."""
    suite = _suite()
    ways = [{"a": 1.0, "b": 1.6}, {"a": 1.4, "b": 0.9}, {"a": 1.2, "b": 1.5}]
    rec = {"durable_s": 1.0, "extra_samples": [{"variants_s": w} for w in ways]}
    suite.pick_floor_variant(rec)
    assert rec["floor_variant"] == "a" and rec["durable_s"] == rec["blocking_s"] == 1.2
    assert rec["durable_samples_s"] == [1.0, 1.4, 1.2] and rec["min_of_ways_s"] == 1.0
    assert rec["variant_medians_s"] == {"a": 1.2, "b": 1.5}
    failed = {"durable_s": None, "extra_samples": []}
    suite.pick_floor_variant(failed)
    assert failed == {"durable_s": None, "extra_samples": []}


def test_rounds_merge_every_rounds_samples_and_keep_each_rounds_load():
    """``--rounds``: one record per method from its interleaved rounds: all samples, their medians, the first
    round's warm-up, the last round's restore, the RSS growth of the round that grew most, and the first error."""
    suite = _suite()
    r1 = {"method": "m", "error": None, "blocking_samples_s": [1.0, 3.0], "durable_samples_s": [4.0, 6.0],
          "extra_samples": [{"x": 1}, {"x": 2}], "warmup": {"w": 1}, "loadavg_at_start": [2.0, 2.0, 2.0],
          "self_rss_start_bytes": 100, "self_peak_rss_bytes": 300, "helper_peak_rss_bytes": 50, "restore_s": 9.0}
    r2 = {**r1, "blocking_samples_s": [2.0, 5.0], "durable_samples_s": [5.0, 8.0], "extra_samples": [{"x": 3}],
          "warmup": {"w": 2}, "loadavg_at_start": [20.0, 10.0, 5.0], "self_rss_start_bytes": 200,
          "self_peak_rss_bytes": 350, "helper_peak_rss_bytes": 70, "restore_s": 7.0}
    m = suite.merge_rounds([r1, r2])
    assert m["blocking_samples_s"] == [1.0, 3.0, 2.0, 5.0] and m["blocking_s"] == 2.5 and m["durable_s"] == 5.5
    assert m["extra_samples"] == [{"x": 1}, {"x": 2}, {"x": 3}] and m["warmup"] == {"w": 1} and m["restore_s"] == 7.0
    assert m["loadavg_at_start_rounds"] == [[2.0, 2.0, 2.0], [20.0, 10.0, 5.0]] and m["rounds"] == 2
    assert (m["self_rss_start_bytes"], m["self_peak_rss_bytes"], m["helper_peak_rss_bytes"]) == (100, 300, 70)
    bad = suite.merge_rounds([r1, {**r2, "error": "RuntimeError: x", "blocking_samples_s": []}])
    assert bad["error"] == "RuntimeError: x" and bad["blocking_samples_s"] == [1.0, 3.0]
    assert suite.merge_rounds([r1]) == r1 and suite.merge_rounds([r1]) is not r1


def test_stall_waits_after_the_warm_up_and_counts_each_repeats_page_faults(tmp_path, monkeypatch):
    """``stall.run_method`` sleeps ``--settle-s-per-gib`` per GiB of state between the warm-up and the first timed
    repeat (untimed: the warm-up's background work, snapckpt's prefault of its other slot, ends there instead of
    in the first timed save), and each repeat's extras hold the minor page faults of the call (``minflt``): a
    repeat that writes fresh pages counts one per page."""
    suite = _suite()
    stall = suite.stall
    calls = []

    class Touch(stall.Method):
        durable = False

        def once(self, i):
            calls.append(("once", i))
            buf = mmap.mmap(-1, 64 * mmap.PAGESIZE)  # fresh anonymous pages: one fault each on first write
            for off in range(0, len(buf), mmap.PAGESIZE):
                buf[off] = 1
            buf.close()
            return 0.0, None, {}

    monkeypatch.setitem(stall.METHOD_CLASSES, "touch", Touch)
    monkeypatch.setattr(stall.time, "sleep", lambda s: calls.append(("sleep", s)))
    state = {"w": torch.zeros(1 << 18)}  # 1 MiB
    args = argparse.Namespace(repeats=2, method_timeout=60.0, persister_exit_wait=1.0, restore_repeats=0,
                              settle_s_per_gib=2.0)
    rec = stall.run_method("touch", state, tmp_path, args)
    assert rec["error"] is None, rec.get("traceback")
    assert calls == [("once", 0), ("sleep", 2.0 / 1024), ("once", 1), ("once", 2)]
    assert all(e["minflt"] >= 64 for e in rec["extra_samples"]), rec["extra_samples"]
    assert stall.parse_args([]).settle_s_per_gib == stall.SETTLE_S_PER_GIB > 0


def test_a_paired_method_takes_one_copy_floor_right_before_each_repeat(tmp_path, monkeypatch):
    """``paired_floor_for``: the memory save is compared repeat by repeat with a copy floor taken just before it
    (the floor moves with the host between rounds); the floor samples sit between the repeats, none inside one,
    and the target reads the median of the pairs' ratios, each floor the fastest of its ways."""
    suite = _suite()
    stall = suite.stall
    calls = []

    class Mark(stall.Method):
        durable = False
        slots = 2  # the first repeat is the first save into the second slot

        def once(self, i):
            calls.append(("once", i))
            return float(i), None, {}

    monkeypatch.setitem(stall.METHOD_CLASSES, "mark", Mark)
    sample = stall.PairedFloor.sample
    monkeypatch.setattr(stall.PairedFloor, "sample", lambda self, i: (calls.append(("floor", i)), sample(self, i)))
    args = argparse.Namespace(repeats=3, method_timeout=60.0, persister_exit_wait=1.0, restore_repeats=0,
                              settle_s_per_gib=0.0, paired_floor_for=("mark",))
    rec = stall.run_method("mark", {"w": torch.zeros(1 << 18)}, tmp_path, args)
    assert rec["error"] is None, rec.get("traceback")
    assert calls == [("once", 0), ("floor", 1), ("once", 1), ("floor", 2), ("once", 2), ("floor", 3), ("once", 3)]
    assert len(rec["paired_floor_ways_s"]) == 3
    assert rec["first_use_paired_ratios"] == [1.0 / min(rec["paired_floor_ways_s"][0].values())]
    assert all(set(w) == {"torch", "torch_1thread", "memmove_chunks"} and min(w.values()) > 0
               for w in rec["paired_floor_ways_s"])
    assert "paired_floor_ways_s" not in stall.run_method("mark", {"w": torch.zeros(8)}, tmp_path,
                                                         argparse.Namespace(**{**vars(args), "paired_floor_for": ()}))

    rec = {"blocking_samples_s": [1.0, 2.0, 3.0],
           "paired_floor_ways_s": [{"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 1.0}, {"a": 3.3, "b": 3.0}]}
    assert suite.paired_floor(rec) == {"floor_s": [1.0, 1.0, 3.0], "ratios": [1.0, 2.0, 1.0], "ratio": 1.0}
    assert suite.paired_floor({**rec, "blocking_samples_s": [1.0]}) is None  # a repeat without its floor
    merged = suite.merge_rounds([rec, {**rec, "paired_floor_ways_s": rec["paired_floor_ways_s"][:1],
                                       "blocking_samples_s": [4.0]}])
    assert len(merged["paired_floor_ways_s"]) == len(merged["blocking_samples_s"]) == 4


def test_recovery_cold_read_floor_reads_each_way_first_in_a_fresh_process(monkeypatch, tmp_path):
    """``recovery.py``'s disk floor: every way runs once per repeat in a child of its own (a restart's first read
    after a drop, not a read that reuses the pages a drop freed a moment before in the same process); the floor is
    the way with the lowest median, with its samples, and each child's recycled read is kept beside it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        recovery = importlib.import_module("recovery")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    secs = {"1thr": [0.30, 0.50, 0.40], "4thr": [0.20, 0.90, 0.45]}  # 4thr has the luckiest read, 1thr the median
    secs.update({v: [1.0, 1.0, 1.0] for v in recovery.FLOOR_VARIANTS if v not in secs})
    calls = []

    def run_child(role, a, env, extra=None):
        v = extra[extra.index("--variant") + 1]
        calls.append((role, v))
        s = secs[v][sum(1 for _, w in calls if w == v) - 1]
        return {"marks": {"start": 0.0, "imported": 1.0, "state_built": 2.0, "attached": 2.0, "read": 2.0 + s,
                          "first_step": 9.0}, "info": {"checksum": 7.0, "variant": v, "recycled_s": s / 2}}

    monkeypatch.setattr(recovery, "run_child", run_child)
    monkeypatch.setattr(recovery, "drop_cache", lambda path, everything=False: "dropped")
    a = argparse.Namespace(repeats=3, dir=str(tmp_path), drop_all=False)
    rec = recovery._floor_cold_read(a, {}, 7.0, {})
    assert calls == [("floor_cold_read", v) for _ in range(3) for v in recovery.FLOOR_VARIANTS]
    assert rec["variant"] == "1thr" and math.isclose(rec["phases"]["restore_s"], 0.40)
    assert [round(p["restore_s"], 9) for p in rec["samples"]] == [0.30, 0.50, 0.40]
    assert math.isclose(rec["variants_s"]["4thr"], 0.45) and rec["recycled_s"]["1thr"] == [0.15, 0.25, 0.20]
    # its restart counts its one read, not the recycled one
    assert rec["restored_ok"] and math.isclose(rec["phases"]["to_first_step_s"], 2.40)


def test_loop_targets_call_a_negative_extra_time_invalid_not_met():
    """A loop round faster than its paired baseline (the machine's load moved between them) gives a negative
    extra time per checkpoint; the targets table must say the figure is invalid, never "met" (a run of
    2026-12-05 under a neighbour's load printed "-6.63x | met")."""
    suite = _suite()

    def method(name, extra):
        return {"method": name, "every": 1, "error": None, "extra_per_ckpt_s": extra, "paired_baseline_step_s": 0.3,
                "median_blocked_s": 0.03, "drain_s": 0.0, "skipped": 0, "gc": {"collections": [0, 0, 0], "seconds": 0.0},
                "rounds": [{"extra_per_ckpt_s": extra}]}

    result = {"config": {"state_bytes": 1 << 29, "matmuls_per_step": 25, "update_s": 0.02, "ckpts_per_method": 3,
                         "rounds_every_step": 5},
              "machine": {"date": "d", "git_commit": "c", "cpu_count": 2, "torch": "t", "uptime": "u"},
              "base_step_s": 0.3, "baseline": [{"mean_step_s": 0.3}],
              "methods": [method("floor_copy", 0.025), method("snapckpt_memory", 0.027),
                          method("snapckpt_memory_overlap", -0.168)]}
    rows = {line.split(" | ")[0].lstrip("| "): line for line in suite.loop_markdown(result).splitlines()
            if line.startswith("| extra s per memory checkpoint")}
    assert "| met |" in rows["extra s per memory checkpoint / copy floor's (snapckpt memory, overlap off)"]
    on = rows["extra s per memory checkpoint / copy floor's (snapckpt memory, overlap on)"]
    assert "invalid" in on and "met" not in on, on


def test_headline_takes_its_port_from_the_benchmarks_shared_helper():
    """benchmarks/headline.py reserves its torchrun port with _common.free_port (one definition for every
    benchmark), not a copy of its own."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        headline, common = importlib.import_module("headline"), importlib.import_module("_common")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert headline.free_port is common.free_port
    assert 0 < headline.free_port() < 65536
