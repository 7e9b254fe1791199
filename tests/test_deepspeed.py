"""DeepSpeed integration on 2 CPU ranks (DS_ACCELERATOR=cpu, gloo): native layout for ZeRO 0-3 in fp32 and
bf16 (F1, F2), LoRA-style frozen layers, string tags, the config entry, resume fidelity after kill -9 from
memory and from disk, latest-after-commit under a slow persister (B1, B6), and a changed data-parallel size."""
import json
import os
import shutil
import signal
import subprocess

import pytest

from _harness import result_lines, run_ranks, wait_until

pytest.importorskip("deepspeed", reason="the DeepSpeed extra is part of the test install (scripts/setup.sh)")

ENV = {"DS_ACCELERATOR": "cpu"}
CONFIGS = ["0:fp32", "0:bf16", "1:fp32", "1:bf16", "2:fp32", "2:bf16", "3:fp32", "3:bf16", "2:fp32:frozen"]


def _results(outs):
    return [json.loads(line) for out in outs for line in result_lines(out)]


def test_F1_F2_native_layout_every_zero_stage(snap_env):
    """Per ZeRO stage 0-3, fp32 and bf16, and a frozen-layer (LoRA) model saved with
    exclude_frozen_parameters: the files snapckpt writes equal, file for file and tensor for tensor, what
    engine.save_checkpoint writes with its own checkpoint engine (recovery scripts and latest included);
    stock engine.load_checkpoint loads snapckpt's tag and the next step's loss equals the original engine's;
    snapckpt loads the natively written directory; zero_to_fp32 converts both to equal state dicts; a
    string tag with a space, a colon and non-ASCII round-trips. ZeRO-3 with one damaged file on rank 1:
    every rank refuses that tag with the cause (DeepSpeed's loader, whose collectives would hang a rank
    left alone in them, is entered by no rank), and the other tag still loads."""
    outs = run_ranks("ds_layout_worker.py", 2, [snap_env.tmp + "/ds", ",".join(CONFIGS)], ENV, timeout=600)
    res = _results(outs)
    for cfg in CONFIGS:
        stage = int(cfg.split(":")[0])
        mine = [r for r in res if r["cfg"] == cfg]
        files = [r for r in mine if r["check"] == "files"]
        assert len(files) == 1 and files[0]["diffs"] == [], (cfg, files)
        assert files[0]["latest"] == "tag with space:ü"
        expected = {"latest", "global_step2/" + ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3
                                                 else "mp_rank_00_model_states.pt")}
        if stage > 0:
            prefix = "bf16_" if "bf16" in cfg else ""
            expected |= {f"global_step2/{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)}
            expected |= {"zero_to_fp32.py"}
        assert expected <= set(files[0]["files"]), (cfg, files[0]["files"])
        if "frozen" in cfg:
            assert not any(k.startswith("embed.") for k in files[0]["module_keys"]), files[0]["module_keys"]
        for check in ("stock_load", "snap_load_native"):
            got = [r for r in mine if r["check"] == check]
            assert len(got) == 2 and all(r["equal"] for r in got), (cfg, check, got)
        if cfg == "3:fp32":
            dmg = [r for r in mine if r["check"] == "zero3_damaged_tag"]
            assert len(dmg) == 2 and all(r["equal"] for r in dmg), dmg
            assert all(r["error"].startswith("CheckpointCorruptError") for r in dmg), dmg
            assert all("rank 1" in r["error"] and "zero_pp_rank_1" in r["error"] for r in dmg), dmg
        if stage > 0:
            conv = [r for r in mine if r["check"] == "zero_to_fp32"]
            assert len(conv) == 1 and conv[0]["diff"] is None and "head.weight" in conv[0]["keys"], (cfg, conv)


def _losses(outs, rank, tag="RESULT"):
    return {r["step"]: r["loss"] for r in map(json.loads, result_lines(outs[rank], tag))}


def _resumed(out):
    return [line.split()[1:] for line in out.splitlines() if line.startswith("RESUMED")]


def _persister_logs(snap_env) -> str:
    """Every persister log of the test's runtime directory (for an assertion's message)."""
    out = []
    for root, _, files in os.walk(snap_env.runtime_root):
        out += [open(os.path.join(root, f), errors="replace").read()[-6000:] for f in files if f == "persister.log"]
    return "\n----\n".join(out)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_resume_fidelity_after_kill9_config_entry(snap_env, tier, request):
    """The config entry ("snapckpt" section, no further code change): 8 steps straight vs 5 steps, kill -9 of
    every rank at the end of step 5, restart, engine.load_checkpoint, steps 5-8: identical per-step losses on every
    rank (dropout on, so the RNG states round-trip too). memory: memory snapshots every step, the persister
    survives, the restart loads step 4 from memory; the snapshot copy is overlapped with forward and
    backward (overlap=True), fenced by engine.step() before the optimizer step. disk: disk saves every 2 steps (ZeRO-3), the persister
    is killed too (node lost), the directory is copied with ``cp -a`` (another path: another job key) and
    its ``latest`` edited to name a missing tag; the restart from the copy loads the committed step 4 from
    disk with a warning naming ``latest`` and never saves step 4 again (a user trial found the config entry re-saved
    the loaded tag, which the copy refuses as another job's checkpoint), and the original is untouched.
    disk also has the config section's ``remote_dir`` (the S3 server): the tags are on the server in
    DeepSpeed's layout (the local files, sizes and checksums) with ``latest``; then the original's node is
    lost whole (its directory deleted) and a restart there downloads global_step4 before the stock
    ``engine.load_checkpoint`` reads it: steps 5-8 again equal the uninterrupted run's."""
    stage = "2" if tier == "memory" else "3"
    ckpt = snap_env.ckpt_dir
    mem, disk, wait = ("1", "0", "0") if tier == "memory" else ("0", "2", "1")
    snap_env.leftover_ok = tier == "disk"
    remote = []
    if tier == "disk":
        bucket = request.getfixturevalue("s3_bucket")
        remote = [bucket.url("ds")]
    # the uninterrupted 8 steps (stock engine) first, in the same processes as the run killed after step 5
    killed = run_ranks("ds_resume_worker.py", 2, [ckpt, stage, "fp32", "8", "4", mem, disk, wait] + remote,
                       {**ENV, "DS_REF_TOTAL": "8"}, timeout=300, check=False)
    assert all("RESULT" in o for o in killed) and max(_losses(killed, 0)) == 5, killed
    ref = [_losses(killed, r, "REFLOSS") for r in (0, 1)]
    assert all(sorted(ref[r]) == list(range(1, 9)) for r in (0, 1)), killed
    for rank in (0, 1):  # the killed run's own steps 1-5 are the reference's
        assert all(_losses(killed, rank)[s] == ref[rank][s] for s in range(1, 6)), rank
    if tier == "disk":
        # (commits run in parallel: step 2's may end after step 4's, and its upload then follows step 4's)
        manifests = [f"ds/{tag}/.snapckpt/manifest.json" for tag in ("global_step2", "global_step4")]
        assert wait_until(lambda: all(m in bucket.keys("ds/") for m in manifests) and bucket.get("ds/latest") ==
                          b"global_step4", 60), _persister_logs(snap_env)
        keys = bucket.keys("ds/")
        for tag in ("global_step2", "global_step4"):
            local = json.load(open(os.path.join(ckpt, tag, ".snapckpt", "manifest.json")))
            assert json.loads(bucket.get(f"ds/{tag}/.snapckpt/manifest.json"))["files"] == local["files"]
            native = {n: os.path.getsize(os.path.join(ckpt, tag, n)) for n in os.listdir(os.path.join(ckpt, tag))
                      if n != ".snapckpt"}
            assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in native, native
            assert {k[len(f"ds/{tag}/"):]: v for k, v in keys.items()
                    if k.startswith(f"ds/{tag}/") and "/.snapckpt/" not in k} == native
        snap_env.kill_persisters(signal.SIGKILL)
        assert wait_until(lambda: not snap_env.persisters(), 10)
        assert open(os.path.join(ckpt, "latest")).read() == "global_step4"
        original = sorted(os.listdir(ckpt))
        subprocess.run(["cp", "-a", ckpt, ckpt + "_copy"], check=True)
        ckpt += "_copy"
        with open(os.path.join(ckpt, "latest"), "w") as f:
            f.write("global_step99")
    resumed = run_ranks("ds_resume_worker.py", 2, [ckpt, stage, "fp32", "8", "0", mem, disk, "0"], ENV, timeout=300)
    if tier == "disk":
        assert "names tag 'global_step99', which is not in" in resumed[0], resumed[0][-3000:]
        assert os.path.join(ckpt, "latest") in resumed[0]
        assert "was committed by another job" not in resumed[0] + resumed[1]
        assert sorted(os.listdir(snap_env.ckpt_dir)) == original
    for rank in (0, 1):
        assert _resumed(resumed[rank]) == [["4", tier]], resumed[rank]
        got, want = _losses(resumed, rank), ref[rank]
        assert sorted(got) == [5, 6, 7, 8]
        assert all(got[s] == want[s] for s in got), (rank, got, want)
    if tier == "disk":
        # keep_last=2: the newest two committed tags remain, latest names the newest
        tags = sorted(n for n in os.listdir(ckpt) if n.startswith("global_step"))
        assert tags == ["global_step6", "global_step8"], tags
        assert open(os.path.join(ckpt, "latest")).read() == "global_step8"
        shutil.rmtree(snap_env.ckpt_dir)  # the original's node lost whole: the server alone holds its tags
        fresh = run_ranks("ds_resume_worker.py", 2, [snap_env.ckpt_dir, stage, "fp32", "8", "0", mem, disk, "0"]
                          + remote, ENV, timeout=300)
        for rank in (0, 1):
            assert _resumed(fresh[rank]) == [["4", "disk"]], fresh[rank][-3000:]
            got, want = _losses(fresh, rank), ref[rank]
            assert sorted(got) == [5, 6, 7, 8] and all(got[s] == want[s] for s in got), (rank, got, want)


def test_B1_B6_latest_after_commit_memory_save_and_bad_tags(snap_env):
    """With a slowed persister: save_checkpoint returns while tag b is still being written, and neither
    latest nor the directory b moves before the commit (B1, B6); after wait() latest names b. A MEMORY save
    under an already persisted tag leaves its files and latest untouched. Tags that are not one path
    component, that DeepSpeed's glob-based loader could not find, that DeepSpeed strips or that name its own
    files are refused up front; so is a save to another directory through the checkpointer. Two tags at
    one step: tag= loads that tag. An emptied ``latest`` loads the newest tag with a warning naming it. A
    missing tag is CheckpointNotFoundError; so is a ``latest`` naming a
    missing tag, or an empty ``latest``, in a directory without any checkpoint (naming ``latest``;
    DeepSpeed's own loader would fail on it with a bare AssertionError). save_16bit_model (into
    another directory and into the checkpoint directory) still works on every rank; engine.destroy()
    closes the checkpointer."""
    env = dict(ENV, SNAPCKPT_FAULT_WRITE_DELAY_SECS="0.05")
    outs = run_ranks("ds_semantics_worker.py", 2, [snap_env.ckpt_dir], env, timeout=300)
    (r,) = _results(outs)
    assert r["latest_after_a"] == "a"
    assert r["latest_while_b_persists"] == "a" and r["b_visible_while_persisting"] is False
    assert r["latest_after_b"] == "b"
    assert r["a_unchanged_by_memory_save"] is True and r["latest_after_memory_save"] == "b"
    for bad in ("x/y", "..", ".hidden"):  # the core's message, naming DeepSpeed's argument and the fix
        assert f"DeepSpeed tag (the tag= argument of engine.save_checkpoint) {bad!r} must be a single directory " \
            "name" in r[f"tag {bad}"] and "choose a plain name" in r[f"tag {bad}"], r[f"tag {bad}"]
    assert "tag= argument of engine.load_checkpoint" in r["load_tag ../x"] and "'../x'" in r["load_tag ../x"]
    assert "glob" in r["tag glob*tag"]
    assert "file DeepSpeed keeps" in r["tag latest"] and "whitespace" in r["tag  lead"]
    assert "one DeepSpeedCheckpointer per checkpoint directory" in r["other_dir"]
    assert r["tag_x_path"] == "x" and r["tag_x_weights"] is True
    assert r["missing_tag"].startswith("CheckpointNotFoundError") and "nope" in r["missing_tag"]
    assert "tags there: 'a', 'b', 'x', 'y'" in r["missing_tag"], r["missing_tag"]  # what can be loaded instead
    assert r["empty_latest"] in ("x", "y"), r["empty_latest"]  # an emptied latest: the newest intact tag
    (warned,) = r["empty_latest_warned"]
    assert os.path.join(snap_env.ckpt_dir, "latest") in warned and "newest intact checkpoint" in warned, warned
    assert r["stale_latest"].startswith("CheckpointNotFoundError"), r["stale_latest"]
    assert "latest names tag 'global_step7'" in r["stale_latest"] and "delete latest" in r["stale_latest"]
    assert r["empty_stale_latest"].startswith("CheckpointNotFoundError"), r["empty_stale_latest"]
    assert "is empty or unreadable" in r["empty_stale_latest"] and "delete latest" in r["empty_stale_latest"]
    assert r["16bit_other"] is True and r["16bit_own"] is True and r["16bit_files"] == [True, True]
    assert r["closed_by_destroy"] is True


def test_keep_last_never_retires_the_tag_latest_names(snap_env, tmp_path):
    """Tag a saved with save_latest, then b and c without, under keep_last=1: as with DeepSpeed's own engine
    (which has no retention), latest still names a, a is still there and stock engine.load_checkpoint(dir)
    loads it; b, beyond keep_last and not named by latest, is retired."""
    native = str(tmp_path / "native")
    (r,) = _results(run_ranks("ds_save_latest_worker.py", 1, [snap_env.ckpt_dir, native], ENV, timeout=300))
    assert r["native_latest"] == "a" and r["native_tags"] == ["a", "b", "c"] and r["native_stock_load"] == "a", r
    assert r["snapckpt_latest"] == "a" and r["snapckpt_tags"] == ["a", "c"], r
    assert r["snapckpt_stock_load"] == "a", r


def test_changed_data_parallel_size_names_universal_checkpoint(snap_env):
    """A ZeRO checkpoint written by 2 ranks, loaded by 1: a clear error that names DeepSpeed's universal
    checkpoint route (ds_to_universal, load_universal), not a shape error deep inside the optimizer."""
    ckpt = snap_env.ckpt_dir
    snap_env.leftover_ok = True  # the 1-rank job dies of the error without close(): its persister idles out
    run_ranks("ds_resume_worker.py", 2, [ckpt, "1", "fp32", "2", "0", "0", "2", "0"], ENV, timeout=300)
    outs = run_ranks("ds_resume_worker.py", 1, [ckpt, "1", "fp32", "4", "0", "0", "2", "0"], ENV, timeout=300,
                     check=False)
    assert "IncompatibleCheckpointError" in outs[0], outs[0][-3000:]
    assert "ds_to_universal" in outs[0] and "load_universal" in outs[0]
    # a new-user trial: the tool refuses a checkpoint without this client state, which plain DeepSpeed omits
    assert "client_state={\"universal_checkpoint_info\": {}}" in outs[0], outs[0][-3000:]
    assert "ZeRO stage 1-3" in outs[0], outs[0][-3000:]


def test_changed_data_parallel_size_zero0_loads_as_deepspeed_does(snap_env):
    """ZeRO stage 0 keeps model, optimizer and scheduler whole in mp_rank_00_model_states.pt: DeepSpeed's own
    load_checkpoint resumes a 2-rank tag with 1 rank. snapckpt loaded by the same engine call did refuse it
    (IncompatibleCheckpointError, "ZeRO checkpoints cannot be loaded at another data-parallel size"); now it
    loads the same tag from disk (the 2-rank memory snapshots left in the persister are not used) into the
    same parameters, optimizer moments and learning rate as the stock load. (The next losses differ: snapckpt
    also restores rank 0's RNG state, for the dropout; DeepSpeed's checkpoint holds none.)"""
    ckpt = snap_env.ckpt_dir
    run_ranks("ds_resume_worker.py", 2, [ckpt, "0", "fp32", "2", "0", "0", "2", "0"], ENV, timeout=300)
    stock = run_ranks("ds_resume_worker.py", 1, ["stock:" + ckpt, "0", "fp32", "4", "0", "0", "0", "0"], ENV,
                      timeout=300)
    snap = run_ranks("ds_resume_worker.py", 1, [ckpt, "0", "fp32", "4", "0", "0", "0", "0"], ENV, timeout=300)
    assert _resumed(stock[0]) == [["2", "stock"]], stock[0][-3000:]
    assert _resumed(snap[0]) == [["2", "disk"]], snap[0][-3000:]
    assert "saved by world size 2; this job has 1" in snap[0], snap[0][-3000:]
    loaded = [[json.loads(line.split(" ", 1)[1]) for line in out[0].splitlines() if line.startswith("LOADED ")]
              for out in (stock, snap)]
    assert len(loaded[0]) == 1 and loaded[0][0]["exp_avg"] and loaded[0] == loaded[1], loaded
    assert sorted(_losses(snap, 0)) == [3, 4]


def test_config_section_validation(tmp_path):
    """The "snapckpt" section of the DeepSpeed config (a dict or a JSON file): unknown keys and bad values
    are clear errors; DeepSpeed gets the config without the section."""
    from snapckpt.deepspeed import DeepSpeedSnapckptConfig
    from snapckpt.integrations.deepspeed.config import _split_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "snapckpt": {"checkpoint_dir": "/x", "keep_last": 2}}))
    rest, section = _split_config(str(path))
    assert rest == {"train_batch_size": 8} and section.keep_last == 2 and section.checkpoint_dir == "/x"
    assert _split_config({"train_batch_size": 8}) == ({"train_batch_size": 8}, None)

    ok = DeepSpeedSnapckptConfig.from_dict({"checkpoint_dir": "/x", "memory_interval_steps": 10,
                                            "disk_interval_steps": 100, "keep_last": 3})
    assert ok.enabled and ok.memory_interval_steps == 10
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['memory_interval'\]"):
        DeepSpeedSnapckptConfig.from_dict({"checkpoint_dir": "/x", "memory_interval": 10})
    with pytest.raises(ValueError, match="disk_interval_steps.*positive integer"):
        DeepSpeedSnapckptConfig.from_dict({"checkpoint_dir": "/x", "disk_interval_steps": 0})
    with pytest.raises(ValueError, match="keep_last.*positive integer"):
        DeepSpeedSnapckptConfig.from_dict({"checkpoint_dir": "/x", "keep_last": "3"})
    with pytest.raises(ValueError, match="checkpoint_dir.*required"):
        DeepSpeedSnapckptConfig.from_dict({"memory_interval_steps": 1})
    assert not DeepSpeedSnapckptConfig.from_dict({"enabled": False}).enabled
    assert DeepSpeedSnapckptConfig.from_dict({"checkpoint_dir": "/x", "remote_dir": "s3://b/run"}).remote_dir == "s3://b/run"
    with pytest.raises(ValueError, match="remote_dir.*object store URL"):
        DeepSpeedSnapckptConfig.from_dict({"checkpoint_dir": "/x", "remote_dir": "/not/a/url"})
    from snapckpt.errors import RemoteURLError  # the type the remote_dir option raises for the same URL
    for url, words in [("/not/a/url", "is not a URL"), ("s3://b", "names no prefix")]:
        with pytest.raises(RemoteURLError, match=words):
            DeepSpeedSnapckptConfig.from_dict({"checkpoint_dir": "/x", "remote_dir": url})
    with pytest.raises(ValueError, match="options.remote_dir.*is not an option"):
        DeepSpeedSnapckptConfig.from_dict({"checkpoint_dir": "/x", "options": {"remote_dir": "s3://b/run"}})


def test_a_module_instead_of_the_engine_is_a_clear_type_error(tmp_path):
    """``DeepSpeedCheckpointer(model, dir)`` with the plain module (not the engine ``deepspeed.initialize``
    returns) is a TypeError that says what to pass, raised before anything is created."""
    import torch

    from snapckpt.deepspeed import DeepSpeedCheckpointer

    with pytest.raises(TypeError, match=r"needs the engine that deepspeed.initialize returns.*torch.nn.modules"
                                        r".linear.Linear"):
        DeepSpeedCheckpointer(torch.nn.Linear(2, 2), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_checkpoint_metrics_reach_deepspeeds_csv_monitor(snap_env):
    """A DeepSpeed config with ``csv_monitor`` enabled; a DISK save at step 2 and a MEMORY save at step 3.
    Right behaviour: DeepSpeed's own CSV monitor files hold every metric snapckpt emitted, under the shared
    names (``snapckpt_stall_secs.csv``...), at the step saved, with the values of the events: stall and bytes
    for both saves, durable time and GB/s for the committed one only."""
    import csv

    from snapckpt import metrics as M

    csv_dir = os.path.join(snap_env.tmp, "csv")
    outs = run_ranks("ds_metrics_worker.py", 1, [snap_env.ckpt_dir, csv_dir], ENV, timeout=240)
    (r,) = _results(outs)
    expected = {}
    for e in r["seen"]:
        for name, value in e["metrics"].items():
            expected.setdefault(name, []).append((e["step"], value))
    assert sorted(expected) == sorted([M.STALL_SECS, M.BYTES, M.DURABLE_SECS, M.PERSIST_GBPS]), expected
    assert [s for s, _ in expected[M.STALL_SECS]] == [2, 3] and [s for s, _ in expected[M.DURABLE_SECS]] == [2]
    for name, rows in expected.items():
        path = os.path.join(csv_dir, "job", name.replace("/", "_") + ".csv")
        with open(path) as f:
            got = list(csv.reader(f))
        assert got[0] == ["step", name.split("/")[-1]], got
        assert [(int(s), float(v)) for s, v in got[1:]] == rows, (name, got)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_arena_is_reserved_after_the_first_optimizer_step(snap_env, stage):
    """Issue 18, target 4, for DeepSpeed users who pass no ``expected_nbytes``: the first forward after the first
    optimizer step (the optimizer's state exists then) has the persister reserve each rank's two slots for the
    engine's module and optimizer tensors, before any save. Right: no slot before that forward, both slots at
    that size after it, and the save of step 2 fits them (no regrowth) and writes DeepSpeed's files."""
    outs = run_ranks("ds_expect_worker.py", 2, [snap_env.ckpt_dir, str(stage)], ENV, timeout=240)
    res = _results(outs)
    assert sorted(r["rank"] for r in res) == [0, 1], res
    for r in res:
        assert r["before"] == [] and r["after_step1"] == [], r
        assert r["need"] > 0 and r["reserved"] == [r["want"], r["want"]], r
        assert r["saved"] == r["reserved"], r
        assert any(f.endswith("mp_rank_00_model_states.pt") for f in r["files"]), r  # ZeRO-3: zero_pp_rank_*
