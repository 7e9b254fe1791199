"""Headline table: training stall of snapckpt against the synchronous native save, for DeepSpeed and
Megatron, in three modes (full-parameter fine-tuning, LoRA fine-tuning with a frozen base,
pre-training), like the table in DLRover's flash-checkpoint documentation (speed-up x).

    .venv/bin/python benchmarks/headline.py            # all rows, about 10-15 min on 2 loaded cores
    .venv/bin/python benchmarks/headline.py --quick    # tiny models, a smoke run (under a minute each)

Each row is one ``torchrun --nproc_per_node 2`` run of ``deepspeed_stall.py`` or ``megatron_stall.py``
(gloo, CPU) on a GPT-style model; the stall is the slowest rank's blocking time, median of
``--repeats`` after warm-ups; speed-up = native stall / snapckpt stall, same run, same state.

What differs between the modes (and what does not):

* DeepSpeed (ZeRO-2, Hugging Face ``GPT2LMHeadModel``, AdamW): full FT = fp32 weights and AdamW
  state for every parameter; LoRA = the base frozen and only the last block (plus the final norm)
  trained and saved with ``exclude_frozen_parameters=True`` (a stand-in for adapters: same effect on
  the checkpoint, optimizer state and saved weights for a small trainable part only); pre-training =
  bf16 mixed precision (bf16 weights, fp32 master weights and AdamW state). The native save is
  ``engine.save_checkpoint`` (torch.save files, not fsynced by DeepSpeed).
* Megatron (megatron-core ``GPTModel``, TP=2, plain Adam, ``torch_dist`` format): full FT and
  pre-training write the same bytes here (fp32 weights + Adam state; the bf16 ``Float16Module`` with
  the distributed optimizer does not run on the CPU), so one run stands for both rows; LoRA = all but
  the final layer norm frozen (Adam state for it only; Megatron still saves every weight; a single
  trained layer fails megatron-core's sharding validation, which stacks the layers' tensors). The native
  save is ``dist_checkpointing.save`` (synchronous, fsynced).

Outputs ``benchmarks/results/headline.{json,md}`` (and each run's own files under
``benchmarks/results/headline/``). Timing on shared cores varies about 2x; read the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ for _common (run as a script)
from _common import free_port  # noqa: E402  (script-relative import)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def uptime() -> str:
    """``uptime`` output (load averages)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def torchrun(script: str, args: list[str], timeout: float, log: Path) -> tuple[int, str]:
    """Run ``script`` under ``torch.distributed.run --nproc_per_node 2``; (exit code, output tail).
    The whole output goes to ``log``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(ROOT / "benchmarks" / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    print("$ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    try:
        with open(log, "w") as f:
            p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True,
                               timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = 124
    text = log.read_text(errors="replace")
    # the first worker traceback is the cause; torchrun's own summary comes last
    i = text.find("Traceback")
    return rc, (text[i:i + 3000] if i >= 0 else text[-3000:]) + ("\ntimed out" if rc == 124 else "")


def deepspeed_row(mode: str, a: argparse.Namespace, outdir: Path) -> dict[str, Any]:
    """One DeepSpeed mode: run deepspeed_stall.py and read its JSON."""
    flags = {"full": [], "lora": ["--frozen"], "pretrain": ["--bf16"]}[mode]
    tag = f"headline_{mode}"
    t0 = time.time()
    rc, out = torchrun("deepspeed_stall.py", [
        "--out", str(outdir), "--arch", "gpt2", "--d-model", str(a.ds_d_model), "--layers", str(a.ds_layers),
        "--vocab", str(a.vocab), "--zero-stage", "2", "--repeats", str(a.repeats), "--tag", tag, *flags],
        a.timeout, outdir / f"deepspeed_{mode}.log")
    row: dict[str, Any] = {"framework": "DeepSpeed", "mode": mode, "rc": rc, "wall_s": time.time() - t0,
                           "uptime_after": uptime()}
    path = outdir / f"deepspeed_stall_{tag}.json"
    if rc != 0 or not path.exists():
        row["error"] = out
        return row
    r = json.loads(path.read_text())
    row.update({"model": f"GPT-2-style {r['params'] / 1e6:.0f} M params, d={r['d_model']}, {r['layers']} layers, "
                         f"ZeRO-2, {'bf16' if r['bf16'] else 'fp32'}",
                "checkpoint_bytes": r["checkpoint_bytes"], "native_s": r["median_s"]["native"],
                "memory_s": r["median_s"]["snapckpt_memory"], "disk_s": r["median_s"]["snapckpt_disk"],
                "disk_durable_s": r["median_s"]["snapckpt_disk_durable"], "raw": r})
    path.unlink()
    return row


def megatron_row(mode: str, a: argparse.Namespace, outdir: Path) -> dict[str, Any]:
    """One Megatron mode ("full" also stands for pre-training): run megatron_stall.py."""
    out = outdir / f"megatron_{mode}.json"
    t0 = time.time()
    rc, text = torchrun("megatron_stall.py", [
        "--tp", "2", "--hidden", str(a.mg_hidden), "--layers", str(a.mg_layers), "--vocab", str(a.vocab),
        "--repeats", str(a.repeats), "--methods", "mcore_sync,snapckpt_memory,snapckpt_disk",
        "--workdir", str(ROOT / "tmp" / f"headline_megatron_{mode}"), "--out", str(out),
        *(["--frozen"] if mode == "lora" else [])], a.timeout, outdir / f"megatron_{mode}.log")
    row: dict[str, Any] = {"framework": "Megatron", "mode": mode, "rc": rc, "wall_s": time.time() - t0,
                           "uptime_after": uptime()}
    if rc != 0 or not out.exists():
        row["error"] = text
        return row
    r = json.loads(out.read_text())
    m = r["methods"]
    row.update({"model": f"megatron-core GPTModel hidden {a.mg_hidden}, {a.mg_layers} layers, vocab {a.vocab}, "
                         "TP=2, fp32 + Adam",
                "checkpoint_bytes": int(r["state_bytes_per_rank_max"] * r["world_size"]),
                "checkpoint_bytes_note": "state bytes per rank (max) x ranks",
                "native_s": m["mcore_sync"]["blocking_s"], "memory_s": m["snapckpt_memory"]["blocking_s"],
                "disk_s": m["snapckpt_disk"]["blocking_s"], "disk_durable_s": m["snapckpt_disk"]["durable_s"],
                "native_durable_s": m["mcore_sync"]["durable_s"], "raw": r})
    return row


MODE_NAMES = {"full": "full-parameter fine-tuning", "lora": "LoRA fine-tuning (frozen base)",
              "pretrain": "pre-training"}


def markdown(result: dict[str, Any]) -> str:
    """The headline table (speed-up = native stall / snapckpt stall)."""
    lines = [
        "# snapckpt headline: training stall per checkpoint vs the synchronous native save",
        "",
        f"- date: {result['date']}; git: {result['git']}; {result['cpu_count']} CPUs, 2 ranks (gloo, CPU)",
        f"- uptime at start: {result['uptime_start']}; at end: {result.get('uptime_end', 'n/a')}",
        *([f"- rows not re-run kept from the run of {result['merged_from']['date']} (git "
           f"{result['merged_from']['git']}; uptime at its start: {result['merged_from']['uptime_start']})"]
          if result.get("merged_from") else []),
        f"- medians of {result['repeats']} after warm-ups; stall = the slowest rank's blocking time; speed-up = "
        "native / snapckpt (same run, same state)",
        "",
        "| framework | mode | model | checkpoint GB | native save stall s | snapckpt memory stall s | speed-up "
        "| snapckpt disk stall s | speed-up | snapckpt disk durable s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        mode = MODE_NAMES[r["mode"]]
        if r.get("same_as"):
            mode += f" (same bytes as {MODE_NAMES[r['same_as']]}: same run)"
        if r.get("error"):
            err = r["error"].strip().splitlines()[-1][:150].replace("|", "\\|") if r["error"].strip() else "?"
            lines.append(f"| {r['framework']} | {mode} | error (rc {r['rc']}): {err} | | | | | | | |")
            continue
        lines.append(
            f"| {r['framework']} | {mode} | {r['model']} | {r['checkpoint_bytes'] / 1e9:.2f} | {r['native_s']:.3f} "
            f"| {r['memory_s']:.3f} | **{r['native_s'] / r['memory_s']:.1f}x** | {r['disk_s']:.3f} "
            f"| **{r['native_s'] / r['disk_s']:.1f}x** | {r['disk_durable_s']:.3f} |")
    lines += ["", "DeepSpeed's native save returns when its files are in the page cache (no fsync); "
              "megatron-core's `dist_checkpointing.save` fsyncs. Megatron full fine-tuning and pre-training "
              "write the same bytes on this CPU setup (fp32 + Adam; see benchmarks/headline.py)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-d-model", type=int, default=1024)
    p.add_argument("--ds-layers", type=int, default=12)
    p.add_argument("--mg-hidden", type=int, default=1024)
    p.add_argument("--mg-layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per torchrun run")
    p.add_argument("--rows", default="ds_full,ds_lora,ds_pretrain,mg_full,mg_lora",
                   help="subset of ds_full,ds_lora,ds_pretrain,mg_full,mg_lora")
    p.add_argument("--quick", action="store_true", help="tiny models, 1 repeat (a smoke run)")
    p.add_argument("--out", default=str(RESULTS / "headline.json"))
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of an existing --out that --rows does not re-run")
    a = p.parse_args(argv)
    if a.quick:
        a.ds_d_model, a.ds_layers, a.mg_hidden, a.mg_layers, a.vocab, a.repeats = 128, 2, 128, 2, 1024, 1
    out = Path(a.out)
    outdir = out.with_suffix("")
    outdir.mkdir(parents=True, exist_ok=True)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "git": git,
                              "cpu_count": os.cpu_count(), "repeats": a.repeats, "uptime_start": uptime(),
                              "config": vars(a), "rows": []}
    keys = [k.strip() for k in a.rows.split(",") if k.strip()]
    if a.merge and out.exists():
        rerun = {("DeepSpeed" if k.startswith("ds") else "Megatron", k.split("_", 1)[1]) for k in keys}
        if ("Megatron", "full") in rerun:
            rerun.add(("Megatron", "pretrain"))
        old = json.loads(out.read_text())
        result["rows"] = [r for r in old["rows"] if (r["framework"], r["mode"]) not in rerun]
        result["merged_from"] = {"date": old["date"], "git": old["git"], "uptime_start": old["uptime_start"]}
    for key in keys:
        fw, mode = key.split("_", 1)
        row = deepspeed_row(mode, a, outdir) if fw == "ds" else megatron_row(mode, a, outdir)
        result["rows"].append(row)
        if fw == "mg" and mode == "full":  # pre-training: the same bytes on this setup
            result["rows"].append({**row, "mode": "pretrain", "same_as": "full"})
        print(f"{key}: " + (f"native {row['native_s']:.3f} s, memory {row['memory_s']:.3f} s, disk {row['disk_s']:.3f} s"
                            if not row.get("error") else f"ERROR rc {row['rc']}: {row['error'][-600:]}"),
              file=sys.stderr, flush=True)
        out.write_text(json.dumps(result, indent=1, default=str))
    order = {("DeepSpeed", "full"): 0, ("DeepSpeed", "lora"): 1, ("DeepSpeed", "pretrain"): 2,
             ("Megatron", "full"): 3, ("Megatron", "lora"): 4, ("Megatron", "pretrain"): 5}
    result["rows"].sort(key=lambda r: order.get((r["framework"], r["mode"]), 9))
    result["uptime_end"] = uptime()
    out.write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0 if all(not r.get("error") for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
