"""The Hugging Face ``Trainer`` with DeepSpeed (``TrainingArguments(deepspeed=...)``) and ``SnapckptCallback``:
2 gloo ranks, DS_ACCELERATOR=cpu, a tiny GPT-2 with dropout (``tests/workers/hf_ds_worker.py``). The reference
is always the Trainer's own DeepSpeed save, in the same process group."""
import json
import os

import pytest

from _harness import result_lines, run_ranks

pytest.importorskip("deepspeed", reason="the DeepSpeed extra is part of the test install (scripts/setup.sh)")

ENV = {"DS_ACCELERATOR": "cpu"}
# ZeRO-0 (model states + weights) and ZeRO-3 (per-rank model and optimizer states, recovery scripts) cover every
# kind of file; ZeRO-1 and 2 take ZeRO-0's code path with ZeRO-3's optimizer files and are left out to keep the
# suite in its time budget (each stage costs 25-50 s here). By hand: hf_ds_worker.py ROOT 0,1,2,3,3g 3 main
STAGES = ["0", "3"]  # the worker also takes "3g": ZeRO-3 with gathered 16-bit weights
MEM_STAGE = "3"


def _results(outs):
    return [json.loads(line) for out in outs for line in result_lines(out)]


def _pick(res, **kw):
    return [r for r in res if all(r.get(k) == v for k, v in kw.items())]


def test_trainer_deepspeed_zero_stages_folders_resume_rotation_best_and_memory_tier(snap_env):
    """Per ZeRO stage 0 and 3, 6 steps, a save and an evaluation every 2 steps, ``save_total_limit=2`` and the best
    model (step 2) kept and loaded at the end, the Trainer's own DeepSpeed save vs ``SnapckptCallback``:

    - the same ``checkpoint-N`` folders survive rotation, each with the same files (``global_stepN/`` with
      every rank's DeepSpeed states, ``latest``, ``zero_to_fp32.py``, weights as the Trainer writes them
      under that stage, ``trainer_state.json``, ``rng_state_{0,1}.pth``...) with equal bytes or contents;
    - the same per-step losses, best checkpoint and evaluation loss of the best model loaded at the end;
    - the stock ``resume_from_checkpoint=<snapckpt's folder>`` continues with bitwise-equal losses;
    - memory tier (ZeRO-3, memory snapshots every step from the DeepSpeed config's ``"snapckpt"`` section,
      copy overlapped): every rank leaves at the start of step 6; the next Trainer writes step 5 out of
      memory as ``checkpoint-5`` (without rotating the best folder away: it did before) and the stock
      auto-resume continues with the uninterrupted loss and loads the same best model at the end."""
    root = os.path.join(snap_env.tmp, "hfds")
    args = [root, ",".join(STAGES), MEM_STAGE]
    res = _results(run_ranks("hf_ds_worker.py", 2, args + ["main"], ENV, timeout=900))
    for stage in STAGES:
        stock = _pick(res, stage=stage, run="stock")
        assert len(stock) == 2 and all(r["world"] == 2 for r in stock), stock
        ref = dict(map(tuple, stock[0]["rows"]))
        assert sorted(ref) == list(range(1, 7)), ref
        for snap in _pick(res, stage=stage, run="snap"):
            assert snap["rows"] == stock[0]["rows"], (stage, snap["rows"], stock[0]["rows"])
            assert (snap["best"], snap["eval"]) == (stock[0]["best"], stock[0]["eval"]), (stage, snap, stock[0])
        (folders,) = _pick(res, stage=stage, run="folders")
        assert folders["diffs"] == [], (stage, folders["diffs"])
        # rotation with save_total_limit=2 keeps the newest and the best (step 2), not step 4
        assert folders["folders"] == ["checkpoint-2", "checkpoint-6"] and stock[0]["best"] == "checkpoint-2", folders
        files = set(folders["files"])
        tag = "global_step6/"
        expected = {"latest", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "config.json"}
        if stage == "3":
            expected |= {f"{tag}zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in (0, 1) for k in ("model", "optim")}
            assert "model.safetensors" not in files  # ZeRO-3 without gathered 16-bit weights: zero_to_fp32.py
        else:
            expected |= {f"{tag}mp_rank_00_model_states.pt", "model.safetensors"}
        if stage != "0":
            expected |= {f"{tag}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} | {"zero_to_fp32.py"}
        assert expected <= files, (stage, sorted(expected - files))
        resumed = _pick(res, stage=stage, run="resume")
        assert len(resumed) == 2, resumed
        start = int(resumed[0]["resumed_from"].split("-")[1])
        for r in resumed:
            got = dict(map(tuple, r["rows"]))
            assert {s: got[s] for s in range(start + 1, 7)} == {s: ref[s] for s in range(start + 1, 7)}, (stage, r)
    died = _pick(res, run="died")
    assert len(died) == 2 and all(max(s for s, _ in r["rows"]) == 5 for r in died), died
    ref_mem = dict(map(tuple, _pick(res, stage=MEM_STAGE, run="stock")[0]["rows"]))

    res_main, res = res, _results(run_ranks("hf_ds_worker.py", 2, args + ["memresume"], ENV, timeout=300))
    mem = _pick(res, run="memresume")
    assert len(mem) == 2 and all(r["materialized"] == [5, "memory"] for r in mem), mem
    kept = sorted(n for n in os.listdir(os.path.join(root, f"z{MEM_STAGE}", "mem")) if n.startswith("checkpoint-"))
    assert kept == ["checkpoint-2", "checkpoint-6"], kept  # as the uninterrupted run: the best and the newest
    best = _pick(res_main, stage=MEM_STAGE, run="stock")[0]
    for r in mem:
        assert dict(map(tuple, r["rows"]))[6] == ref_mem[6], (r["rows"], ref_mem)
        # the write-out of step 5 did not rotate the best folder (step 2) away: it is loaded at the end
        assert (r["best"], r["eval"]) == (best["best"], best["eval"]), (r, best)


def _args(tmp_path, section, **kw):
    """What ``section_options`` reads of ``TrainingArguments`` under DeepSpeed."""
    from types import SimpleNamespace

    return SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config={"zero_optimization": {"stage": 2},
                                                                       "snapckpt": section}),
                           output_dir=str(tmp_path), **kw)


def test_snapckpt_section_of_the_trainers_deepspeed_config(tmp_path):
    """The DeepSpeed config's "snapckpt" section under the Trainer: memory interval, remote tier and options are
    the callback's; what the Trainer's own arguments decide, another directory, or a value given both ways
    differently is refused naming the fix; "enabled": false leaves the saves to the Trainer. FSDP is refused
    at Trainer construction, naming why."""
    from snapckpt.hf import SnapckptCallback
    from snapckpt.integrations.transformers.deepspeed_files import section_options

    got = section_options(_args(tmp_path, {"memory_interval_steps": 2, "remote_dir": "s3://bkt/run",
                                           "checkpoint_dir": str(tmp_path), "options": {"overlap": True}}), {})
    assert got == {"memory_interval_steps": 2, "options": {"overlap": True, "remote_dir": "s3://bkt/run"}}
    assert section_options(_args(tmp_path, {"enabled": False}), {}) is None
    for section, given, match in [({"disk_interval_steps": 5}, {}, "save_steps"),
                                  ({"keep_last": 2}, {}, "save_total_limit"),
                                  ({"checkpoint_dir": str(tmp_path / "other")}, {}, "output_dir"),
                                  ({"memory_intervals": 2}, {}, "unknown key"),
                                  ({"memory_interval_steps": 0}, {}, "positive integer"),
                                  ({"memory_interval_steps": 3}, {"memory_interval_steps": 5}, "one place"),
                                  ({"options": {"overlap": True}}, {"overlap": False}, "one place"),
                                  ("true", {}, "must be an object, got str"),
                                  ([["enabled", True]], {}, "must be an object, got list"),
                                  ({"checkpoint_dir": 5}, {}, "checkpoint_dir.*directory path")]:
        with pytest.raises(ValueError, match=match):
            section_options(_args(tmp_path, section), given)
    with pytest.raises(NotImplementedError, match="torch.distributed.checkpoint"):
        SnapckptCallback().on_init_end(_args(tmp_path, {}, fsdp="full_shard", save_on_each_node=False), None, None)
