"""Hugging Face Trainer integration (``SnapckptCallback``): native ``checkpoint-N`` folders and resume.

A tiny GPT-2 built from a config (dropout on, shuffled data, linear LR schedule with warm-up), trained by
the stock ``Trainer`` on CPU in worker processes (``tests/workers/hf_worker.py``), single process and
2-rank DDP under ``torchrun``. The reference is always the stock Trainer without the callback:

- F2: the callback's ``checkpoint-5`` holds the same files as the Trainer's, with byte-identical
  ``model.safetensors``/``trainer_state.json``/configs and equal optimizer, scheduler and RNG states;
- E2/E3: killed and resumed runs log bitwise-equal per-step losses and learning rates;
- kill -9 of the whole node (training and persister) during the persist of ``checkpoint-10``: the folder
  is not there and auto-resume takes ``checkpoint-5``;
- memory tier: kill -9 of training only; the new Trainer writes the memory snapshot out and resumes from it;
- F1 both ways: stock resume reads snapckpt's folders; with the callback attached, a Trainer-written
  folder is resumed and the callback's next folder equals the Trainer's;
- F3/E1: ``from_pretrained`` loads the safetensors (sharded with an index when asked), tied embeddings
  tied again, no missing keys; E5: a ``TrainingArguments`` subclass from the user's script;
- rotation under ``save_total_limit`` with a best model kept, the same folders as the Trainer keeps;
- B3: a damaged newest folder is set aside (same or another process count); all damaged: every start raises;
  a folder the user changed in place (re-sharded weights) is not damage: it is left to the Trainer.
"""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from _harness import REPO, assert_equal_state, run_torchrun, wait_until

# scripts/test.sh hands out tests one by one (--dist loadgroup); these share the module-scoped `stock` run:
# one worker runs them all, so it is made once
pytestmark = pytest.mark.xdist_group("test_hf")

WORKER = os.path.join(REPO, "tests", "workers", "hf_worker.py")
STEPS = 12


def _run(cfg, env, nprocs=1, expect_rc=0, timeout=240, log=None, ref=None):
    """Run the worker (``nprocs`` > 1: under torchrun); return rank 0's facts (all ranks' for DDP). ``log``:
    a list that gets the run's stderr. ``ref``: a config the same processes run first, to its end (a stock
    reference: one start fewer); then returns ``(facts, ref_facts)``."""
    cfg = dict(cfg, result=cfg["out"] + ".result")
    if ref is not None:
        cfg["ref"] = dict(ref, result=ref["out"] + ".result")
    base = [WORKER, json.dumps(cfg)]
    run_env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if nprocs > 1:
        p = run_torchrun(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                       str(nprocs), "--master_addr", "127.0.0.1", "--master_port", str(port), *base],
                         env=run_env, timeout=timeout)
    else:
        p = subprocess.run([sys.executable, *base], env=run_env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == expect_rc, f"rc {p.returncode} != {expect_rc}:\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    if log is not None:
        log.append(p.stderr)
    got = []
    for c in ([cfg, cfg["ref"]] if ref is not None else [cfg]):
        facts = []
        for r in range(nprocs):
            with open(f"{c['result']}.{r}") as f:
                facts.append(json.load(f))
        got.append(facts if nprocs > 1 else facts[0])
    return tuple(got) if ref is not None else got[0]


def _rows(facts):
    return {r["step"]: (r["loss"], r["lr"]) for r in facts["rows"]}


def _same_steps(got, ref, steps):
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        assert got[s] == ref[s], f"step {s}: {got[s]} != {ref[s]}"


def _files(d):
    return sorted(n for n in os.listdir(d) if n != ".snapckpt")


def _assert_same_folder(mine, theirs):
    """F2: same file set; identical bytes for safetensors/json/README.md; equal contents of the torch files."""
    assert _files(mine) == _files(theirs)
    for name in _files(theirs):
        a, b = os.path.join(mine, name), os.path.join(theirs, name)
        if name.endswith((".safetensors", ".json", ".md")):
            assert open(a, "rb").read() == open(b, "rb").read(), name
        elif name == "training_args.bin":
            x, y = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
            dx, dy = x.to_dict(), y.to_dict()
            for d in (dx, dy):
                d.pop("output_dir"), d.pop("logging_dir", None)
            assert type(x) is type(y) and dx == dy
        else:
            assert_equal_state(torch.load(a, weights_only=False), torch.load(b, weights_only=False), name)


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """The stock Trainer, no callback: 12 steps, saves at 5 and 10 (and 12, the end)."""
    out = str(tmp_path_factory.mktemp("stock") / "run")
    facts = _run({"out": out, "steps": STEPS}, {})
    return out, _rows(facts)


def test_E2_E3_F1_F2_F3_kill9_node_during_persist(snap_env, stock):
    ref_dir, ref = stock
    out = os.path.join(snap_env.tmp, "run")
    # 1. Train to step 7 (checkpoint-5 committed) and vanish without close().
    first = _run({"out": out, "steps": STEPS, "snap": True, "kill_at": 7, "die": "exit",
                  "wait_for": "checkpoint-5"}, snap_env.env)
    _same_steps(_rows(first), ref, range(1, 8))
    _assert_same_folder(os.path.join(out, "checkpoint-5"), os.path.join(ref_dir, "checkpoint-5"))  # F2
    snap_env.kill_persisters()
    assert wait_until(lambda: not snap_env.persisters(), 10)
    # 2. Stock-style resume (F1) to step 10, then kill -9 the node while checkpoint-10 is being persisted.
    slow = {**snap_env.env, "SNAPCKPT_FAULT_WRITE_DELAY_SECS": "0.05"}
    second = _run({"out": out, "steps": STEPS, "snap": True, "resume": True, "kill_at": 10, "die": "kill_node"},
                  slow, expect_rc=-signal.SIGKILL)
    _same_steps(_rows(second), ref, range(6, 11))  # E2/E3
    assert not os.path.exists(os.path.join(out, "checkpoint-10"))
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(out) == os.path.join(out, "checkpoint-5")  # partial folders are ignored
    assert wait_until(lambda: not snap_env.persisters(), 10)
    # 3. Resume again: from checkpoint-5, bitwise equal to the uninterrupted run to the end.
    third = _run({"out": out, "steps": STEPS, "snap": True, "resume": True}, snap_env.env)
    _same_steps(_rows(third), ref, range(6, STEPS + 1))
    assert sorted(os.listdir(out)) == ["checkpoint-10", "checkpoint-12", "checkpoint-5"]  # partials cleaned
    for step in (10, 12):
        _assert_same_folder(os.path.join(out, f"checkpoint-{step}"), os.path.join(ref_dir, f"checkpoint-{step}"))
    # F3/E1: from_pretrained loads snapckpt's safetensors, tied again, nothing missing.
    from transformers import GPT2LMHeadModel

    model, info = GPT2LMHeadModel.from_pretrained(os.path.join(out, "checkpoint-12"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    saved = load_file(os.path.join(out, "checkpoint-12", "model.safetensors"))
    assert "lm_head.weight" not in saved
    for k, v in saved.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_F1_callback_resumes_a_trainer_written_folder(snap_env, stock):
    ref_dir, ref = stock
    out = os.path.join(snap_env.tmp, "run")
    shutil.copytree(ref_dir, out)
    for step in (10, 12):
        shutil.rmtree(os.path.join(out, f"checkpoint-{step}"))
    facts = _run({"out": out, "steps": STEPS, "snap": True, "resume": True}, snap_env.env)
    assert "materialized" not in facts
    _same_steps(_rows(facts), ref, range(6, STEPS + 1))
    _assert_same_folder(os.path.join(out, "checkpoint-10"), os.path.join(ref_dir, "checkpoint-10"))
    assert not os.path.exists(os.path.join(out, "checkpoint-5", ".snapckpt"))  # the Trainer's folder untouched


def test_memory_tier_resume_after_kill9_then_B3_damaged_folder_of_the_newest_memory_step(snap_env, stock):
    """A memory snapshot every step with the copy overlapped (``overlap=True``: it runs during the next
    forward and backward, fenced in ``on_pre_optimizer_step``); kill -9 at the end of step 8, before step
    8's snapshot was fenced: that snapshot is lost (as documented) and the newest held one is step 7's,
    copied while step 8 computed. The next Trainer writes step 7 out of memory and the stock resume
    continues with bitwise-equal losses from step 8 on, so the overlapped snapshot held exactly step 7's
    state (A1 with overlap on). No "rewind" warning: memory holding a newer step than the disk is the
    ordinary case.

    Then B3 against the memory tier (in the same runs: one start fewer). Fault: that resumed training is
    killed -9 at the end of step 11, the persister lives on and commits ``checkpoint-10``, then a byte of its
    ``model.safetensors`` flips; memory still holds step 10, intact. Wrong behaviour (found by a trial): the
    folder was set aside and the Trainer resumed from ``checkpoint-5``, five steps lost although a complete
    step 10 was held. Right behaviour: the damaged folder is moved aside (kept), step 10 is written out of
    memory in its place and the stock resume continues from it with bitwise-equal losses from step 11 on."""
    from faults import verify_all

    _, ref = stock
    out = os.path.join(snap_env.tmp, "run")
    cfg = {"out": out, "steps": STEPS, "snap": True, "mem": 1, "opts": {"flush_on_crash": False, "overlap": True}}
    first = _run({**cfg, "kill_at": 8, "die": "kill"}, snap_env.env, expect_rc=-signal.SIGKILL)
    _same_steps(_rows(first), ref, range(1, 9))
    assert wait_until(lambda: os.path.isdir(os.path.join(out, "checkpoint-5")), 30)  # the persister lives on
    assert not os.path.exists(os.path.join(out, "checkpoint-8"))
    log = []
    second = _run({**cfg, "resume": True, "kill_at": 11, "die": "kill", "wait_for": "checkpoint-10"}, snap_env.env,
                  expect_rc=-signal.SIGKILL, log=log)
    assert second["materialized"] == [7, "memory"]
    _same_steps(_rows(second), ref, range(8, 12))
    # the ordinary resume from memory is no rewind: checkpoint-5, older and saved earlier, was reported as
    # "saved after" step 7 (found by a review helper)
    assert "a rewind?" not in log[0], log[0][-3000:]

    # B3: checkpoint-10 committed by the persister that outlived the second kill, then damaged
    assert snap_env.persisters(), "the persister (and its memory tier) must outlive the killed training"
    _flip(os.path.join(out, "checkpoint-10", "model.safetensors"))
    third = _run({**cfg, "resume": True}, snap_env.env)
    assert third["materialized"] == [10, "memory"], third.get("materialized")
    _same_steps(_rows(third), ref, range(11, STEPS + 1))
    assert any(n.startswith(".checkpoint-10.damaged-") for n in os.listdir(out)), os.listdir(out)
    assert verify_all(out) == [], verify_all(out)


def _timeless_state(folder, out):
    """trainer_state.json without wall-clock values, with the run's output_dir as "OUT"."""
    text = open(os.path.join(folder, "trainer_state.json")).read().replace(out, "OUT")
    state = json.loads(text)
    state["log_history"] = [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
                            for e in state["log_history"]]
    return state


def test_rotation_best_model_E5_sharded(snap_env, tmp_path):
    cfg = {"steps": 8, "save_steps": 2, "eval_best": True, "limit": 2, "tok": True}
    stock_out, out = str(tmp_path / "stock"), os.path.join(snap_env.tmp, "run")
    # the stock run first, in the same process (the Trainer seeds model and data again)
    mine, ref = _run({**cfg, "out": out, "snap": True, "subclass_args": True, "shard": "40KB"}, snap_env.env,
                     ref={**cfg, "out": stock_out})
    _same_steps(_rows(mine), _rows(ref), range(1, 9))
    assert sorted(os.listdir(out)) == sorted(os.listdir(stock_out))  # same folders rotated away and kept
    assert ref["best"] and os.path.basename(mine["best"]) == os.path.basename(ref["best"])
    assert os.path.basename(ref["best"]) != "checkpoint-8"  # the best is kept although older
    assert mine["final_wte"] == ref["final_wte"]  # load_best_model_at_end found the committed folder
    assert mine["args_class"] == "MyArgs" and mine["my_flag"] == "hello"  # E5
    best = os.path.join(out, os.path.basename(mine["best"]))
    names = _files(best)
    shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
    index = json.load(open(os.path.join(best, "model.safetensors.index.json")))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards, names
    from transformers import GPT2LMHeadModel

    ref_best = os.path.join(stock_out, os.path.basename(ref["best"]))
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert open(os.path.join(best, name), "rb").read() == open(os.path.join(ref_best, name), "rb").read(), name
    assert _timeless_state(best, out) == _timeless_state(ref_best, stock_out)
    a = GPT2LMHeadModel.from_pretrained(best).state_dict()
    b = GPT2LMHeadModel.from_pretrained(os.path.join(stock_out, os.path.basename(ref["best"]))).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ddp_two_ranks_native_folder_and_memory_resume(snap_env, tmp_path):
    ref_out, out = str(tmp_path / "stock"), os.path.join(snap_env.tmp, "run")
    cfg = {"out": out, "steps": STEPS, "snap": True, "mem": 1, "opts": {"flush_on_crash": False}}
    # the stock run to the end first, in the same two ranks (the Trainer seeds model and data again)
    first, ref = _run({**cfg, "kill_at": 8, "die": "exit", "wait_for": "checkpoint-5"}, snap_env.env, nprocs=2,
                      ref={"out": ref_out, "steps": STEPS})
    for r in range(2):
        _same_steps(_rows(first[r]), _rows(ref[0]), range(1, 9))
    mine, theirs = os.path.join(out, "checkpoint-5"), os.path.join(ref_out, "checkpoint-5")
    assert "rng_state_1.pth" in _files(mine)
    _assert_same_folder(mine, theirs)
    second = _run({**cfg, "resume": True}, snap_env.env, nprocs=2)
    for r in range(2):
        assert second[r]["materialized"] == [8, "memory"]
        _same_steps(_rows(second[r]), _rows(ref[0]), range(9, STEPS + 1))
    _assert_same_folder(os.path.join(out, "checkpoint-10"), os.path.join(ref_out, "checkpoint-10"))


def _concat_bytes(spec):
    return b"".join(p if isinstance(p, bytes) else p.contiguous().view(torch.uint8).flatten().numpy().tobytes()
                    for p in spec.parts)


def test_E1_tied_and_untied_embeddings_in_model_files():
    """E1 without a Trainer: tied -> one tensor (``lm_head.weight`` dropped, as ``save_pretrained``); a
    config that claims tying but separate tensors at runtime -> both saved with their own values."""
    from safetensors.torch import load as st_load

    sys.path.insert(0, os.path.dirname(WORKER))
    from hf_worker import build_model

    from snapckpt.integrations.transformers.files import model_files

    tied = build_model(tie=True)
    files = model_files(tied)
    got = st_load(_concat_bytes(files["model.safetensors"]))
    assert "lm_head.weight" not in got and torch.equal(got["transformer.wte.weight"], tied.transformer.wte.weight)
    assert json.loads(files["config.json"].data)["tie_word_embeddings"] is True

    untied = build_model(tie=True)
    untied.lm_head.weight = torch.nn.Parameter(untied.transformer.wte.weight.detach() * 2)  # untie at runtime
    got = st_load(_concat_bytes(model_files(untied)["model.safetensors"]))
    assert torch.equal(got["lm_head.weight"], untied.lm_head.weight)
    assert torch.equal(got["transformer.wte.weight"], untied.transformer.wte.weight)


def test_bad_input_is_refused_with_the_fix(snap_env):
    from snapckpt.hf import SnapckptCallback

    with pytest.raises(ValueError, match="save_total_limit"):
        SnapckptCallback(keep_last=2)
    with pytest.raises(ValueError, match="memory_interval_steps"):
        SnapckptCallback(memory_interval_steps=0)
    with pytest.raises(TypeError, match="unknown snapckpt option") as ei:
        SnapckptCallback(keep_lats=2)
    with pytest.raises(TypeError, match="unknown snapckpt option") as ei:
        SnapckptCallback(memory_interval=5)  # the list names the callback's own parameters, not keep_last
    assert "'memory_interval_steps'" in str(ei.value) and "'keep_last'" not in str(ei.value)
    with pytest.raises(ValueError, match=r"does not take disk_interval_steps: set TrainingArguments\(save_steps"):
        SnapckptCallback(disk_interval_steps=10)


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 10)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def _tree(top):
    """{relative path: (size in bytes, sha256 hex)} of every file under ``top`` (and every directory: None)."""
    import hashlib

    got = {}
    for root, dirs, files in os.walk(top):
        for d in dirs:
            got[os.path.relpath(os.path.join(root, d), top)] = None
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                got[os.path.relpath(path, top)] = (os.path.getsize(path), hashlib.sha256(f.read()).hexdigest())
    return got


def _start_raises(cfg, env):
    """Start the worker once; it must fail at Trainer construction. Returns its stderr."""
    cmd = [sys.executable, WORKER, json.dumps(dict(cfg, result=cfg["out"] + ".result"))]
    p = subprocess.run(cmd, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode != 0, p.stderr[-4000:]
    return p.stderr


def test_B3_damaged_newest_set_aside_at_any_process_count_all_damaged_raises_every_start(snap_env, stock):
    """B3 with the Trainer's own auto-resume, the persister gone: the newest committed checkpoint-12 was
    truncated (every file 0 bytes: power loss; its sizes no longer match the manifest, so it is no load
    candidate, yet ``get_last_checkpoint`` would pick it: found by the fault matrix), and checkpoint-10's
    model.safetensors has one flipped byte (found by its manifest checksum). Right: the callback moves both
    aside to hidden ``.checkpoint-N.damaged-*`` folders (kept, not deleted), so ``get_last_checkpoint`` and
    the stock resume take checkpoint-5, and steps 6-12 are bitwise those of the uninterrupted run.

    Resumed by another process count (2 DDP ranks; snapckpt's own candidates are then of another world
    size and never probed), the folder the Trainer would pick is still verified, set aside with a warning
    naming the damaged file, and the run resumes from checkpoint-10.

    Every folder damaged: each start raises ``CheckpointCorruptError`` naming every folder and ``snapckpt
    verify``, and moves nothing aside and writes nothing, so that the next start meets the same files and raises too
    instead of training from step 0 (the folder's every file, byte for byte, is the same after the start).

    Changed in place is not damage: checkpoint-5's weights were re-sharded by the user (``save_pretrained``
    with a small ``max_shard_size``, then ``model.safetensors`` deleted), so its set of files is no longer its
    manifest's. Before, it was moved aside as damaged although the Trainer resumes from it; now a warning
    names it and the files, it stays, and the resume from it is the one above. A flipped byte in a listed
    file of a changed folder is still damage (checkpoint-12 of 2 ranks below: optimizer.pt deleted too;
    checkpoint-5 in the all-damaged start: its optimizer.pt flipped)."""
    from transformers import GPT2LMHeadModel

    _, ref = stock
    out = os.path.join(snap_env.tmp, "run")
    _run({"out": out, "steps": STEPS, "snap": True}, snap_env.env)
    other = os.path.join(snap_env.tmp, "other")
    shutil.copytree(out, other)
    for root, _, files in os.walk(os.path.join(out, "checkpoint-12")):
        for name in files:
            if ".snapckpt" not in root:
                os.truncate(os.path.join(root, name), 0)
    _flip(os.path.join(out, "checkpoint-10", "model.safetensors"))
    five = os.path.join(out, "checkpoint-5")
    GPT2LMHeadModel.from_pretrained(five).save_pretrained(five, max_shard_size="40KB")
    os.remove(os.path.join(five, "model.safetensors"))
    log = []
    facts = _run({"out": out, "steps": STEPS, "snap": True, "resume": True}, snap_env.env, log=log)
    _same_steps(_rows(facts), ref, range(6, STEPS + 1))
    names = os.listdir(out)
    for s in (12, 10):
        assert any(n.startswith(f".checkpoint-{s}.damaged-") for n in names), names
    assert {"checkpoint-10", "checkpoint-12"} <= set(names)  # written again by the resumed run
    assert not any(n.startswith(".checkpoint-5.damaged-") for n in names), names
    assert "model.safetensors.index.json" in os.listdir(five)  # the user's folder, as the user left it
    changed = [line for line in log[0].splitlines() if five in line and "changed since snapckpt committed" in line]
    assert changed and "gone: model.safetensors" in changed[0] and "model-00001-of-" in changed[0], log[0][-4000:]

    # Another process count: checkpoints of 1 process, resumed by 2.
    _flip(os.path.join(other, "checkpoint-12", "model.safetensors"))
    os.remove(os.path.join(other, "checkpoint-12", "optimizer.pt"))
    cfg = {"out": other, "steps": STEPS, "snap": True, "resume": True}
    log = []
    ddp = _run(cfg, snap_env.env, nprocs=2, log=log)
    assert sorted(_rows(ddp[0])) == [11, 12]  # resumed from checkpoint-10, not the damaged 12
    victim = os.path.join(other, "checkpoint-12", "model.safetensors")
    assert any(victim in line and "moved aside" in line for line in log[0].splitlines()), log[0][-4000:]
    assert any(n.startswith(".checkpoint-12.damaged-") for n in os.listdir(other)), os.listdir(other)

    # Every folder damaged: raise at every start, nothing moved aside.
    victims = {s: os.path.join(out, f"checkpoint-{s}", "model.safetensors") for s in (10, 12)}
    victims[5] = os.path.join(five, "optimizer.pt")
    for path in victims.values():
        _flip(path)
    before = _tree(out)
    err = _start_raises({"out": out, "steps": STEPS, "snap": True, "resume": True}, snap_env.env)
    assert "CheckpointCorruptError" in err and "snapckpt verify" in err, err[-4000:]
    for path in victims.values():
        assert path in err, err[-4000:]
    # nothing moved aside, nothing written: the next start meets the very same files, so it raises too
    assert _tree(out) == before


def test_H4_fresh_node_resumes_a_trainer_from_the_remote_tier(snap_env, stock, s3_bucket):
    """The callback with ``remote_dir`` (a Checkpointer option it forwards): the Trainer's checkpoint-5 is
    uploaded by the persister in the native folder layout; the run dies at step 7, the node is lost
    (persister killed, output_dir deleted). A new Trainer with the same callback finds checkpoint-5 on the
    remote tier, downloaded (checksums verified) before the stock resume reads it, and continues with
    losses bitwise equal to the uninterrupted run from step 6 on."""
    _, ref = stock
    snap_env.leftover_ok = True  # the lost node's persister is killed
    out = os.path.join(snap_env.tmp, "run")
    url = s3_bucket.url("hf")
    cfg = {"out": out, "steps": STEPS, "snap": True, "opts": {"flush_on_crash": False, "remote_dir": url}}
    first = _run({**cfg, "kill_at": 7, "die": "exit"}, snap_env.env)
    _same_steps(_rows(first), ref, range(1, 8))
    manifest = "hf/checkpoint-5/.snapckpt/manifest.json"
    assert wait_until(lambda: manifest in s3_bucket.keys("hf/"), 60)
    local = sorted(os.listdir(os.path.join(out, "checkpoint-5")))
    assert sorted({k.split("/")[2] for k in s3_bucket.keys("hf/checkpoint-5/")}) == local
    snap_env.kill_persisters()
    assert wait_until(lambda: not snap_env.persisters(), 15)
    shutil.rmtree(out)
    second = _run({**cfg, "resume": True}, snap_env.env)
    _same_steps(_rows(second), ref, range(6, STEPS + 1))
    assert sorted(os.listdir(os.path.join(out, "checkpoint-5"))) == local
