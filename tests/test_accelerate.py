"""Accelerate integration (``AcceleratorCheckpointer``): ``save_state`` folders written by the persister.

A plain Accelerate loop (dropout, shuffled data, StepLR) on CPU in worker processes
(``tests/workers/accel_worker.py``); the reference is the same loop with the stock ``save_state``:

- F2: ``checkpoint_5`` holds the files ``accelerator.save_state`` writes, with equal contents and permission
  bits (safetensors files ``0600``, as ``safetensors.torch.save_file`` writes them);
- F1: the stock ``accelerator.load_state`` resumes from snapckpt's folder with bitwise-equal losses and
  learning rates (E2, E3);
- memory tier: after the process vanished, ``AcceleratorCheckpointer.load_state`` resumes from the newest
  memory snapshot (written out as its folder first, with the same permission bits).
"""
import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from _harness import REPO, assert_equal_state, run_torchrun, wait_until
from faults import kill_persisters

WORKER = os.path.join(REPO, "tests", "workers", "accel_worker.py")


def _run(cfg, env, ref=None):
    """Run the worker; return its facts. ``ref``: a config the same process runs first, to its end (one
    start fewer); then returns ``(facts, ref_facts)``."""
    def named(c):
        return dict(c, result=c["out"] + f".{c['mode']}.{c.get('exit_at', 0)}.json")

    cfg = named(cfg)
    if ref is not None:
        cfg["ref"] = named(ref)
    p = subprocess.run([sys.executable, WORKER, json.dumps(cfg)], env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    got = []
    for c in ([cfg, cfg["ref"]] if ref is not None else [cfg]):
        with open(c["result"]) as f:
            facts = json.load(f)
        facts["rows"] = {r["step"]: (r["loss"], r["lr"]) for r in facts["rows"]}
        got.append(facts)
    return tuple(got) if ref is not None else got[0]


def _same(got, ref, steps):
    assert sorted(got) == list(steps)
    for s in steps:
        assert got[s] == ref[s], f"step {s}: {got[s]} != {ref[s]}"


def _load(path):
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=False)


def _modes(d):
    return {n: stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode) for n in os.listdir(d) if n != ".snapckpt"}


def test_F1_F2_E2_E3_accelerate_folders_and_resume(snap_env, tmp_path):
    ref_dir, out = str(tmp_path / "stock"), os.path.join(snap_env.tmp, "run")
    # the stock run to its end first, in the same process as the snapckpt run that vanishes after step 8
    first, ref = _run({"out": out, "mode": "snap", "steps": 10, "save_at": 5, "mem": True, "exit_at": 8,
                       "opts": {"flush_on_crash": False}}, snap_env.env,
                      ref={"out": ref_dir, "mode": "stock", "steps": 10, "save_at": 5})
    ref = ref["rows"]
    _same(first["rows"], ref, range(1, 9))
    mine, theirs = os.path.join(out, "checkpoint_5"), os.path.join(ref_dir, "checkpoint_5")
    names = sorted(n for n in os.listdir(mine) if n != ".snapckpt")
    assert names == sorted(os.listdir(theirs)), names
    for n in names:
        assert_equal_state(_load(os.path.join(mine, n)), _load(os.path.join(theirs, n)), n)
    assert _modes(mine) == _modes(theirs)
    # The stock loader resumes from snapckpt's folder (F1), bitwise (E2/E3).
    # snapckpt's own load after it, in the same process: the newest snapshot is step 8, in memory only.
    again, stock = _run({"out": out, "mode": "snap", "steps": 10, "opts": {"flush_on_crash": False}}, snap_env.env,
                        ref={"out": out, "mode": "stock_resume", "steps": 10, "resume_from": 5})
    _same(stock["rows"], ref, range(6, 11))
    assert again["resumed"] == os.path.join(out, "checkpoint_8")
    assert _modes(os.path.join(out, "checkpoint_8")) == _modes(theirs)  # written out of memory
    _same(again["rows"], ref, range(9, 11))


def test_resume_at_another_world_size_as_stock_load_state(snap_env):
    """Folders saved by 2 processes, resumed by 1: accelerate's own ``load_state`` reads them (the model and
    optimizer files are the main process's; ``random_states_0.pkl`` is this process's). ``load_state()``
    refused (IncompatibleCheckpointError, "snapckpt does not reshard"); now it loads the same folder (not the
    2-process memory snapshots the persister still holds) and the next steps equal the stock load's."""
    out = os.path.join(snap_env.tmp, "run")
    cfg = {"out": out, "mode": "snap", "steps": 5, "save_at": 5, "mem": True, "result": out + ".ws2"}
    p = run_torchrun(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                   "--master_addr", "127.0.0.1", "--master_port", str(port), WORKER, json.dumps(cfg)],
                     env={**os.environ, **snap_env.env, "OMP_NUM_THREADS": "1"}, timeout=240)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    # the stock load first, then snapckpt's, in one process
    snap, stock = _run({"out": out, "mode": "snap", "steps": 10}, snap_env.env,
                       ref={"out": out, "mode": "stock_resume", "steps": 10, "resume_from": 5})
    assert snap["resumed"] == os.path.join(out, "checkpoint_5")
    assert sorted(snap["rows"]) == list(range(6, 11)), snap["rows"]
    _same(snap["rows"], stock["rows"], range(6, 11))


def test_B3_accelerate_only_checkpoint_damaged_raises_instead_of_starting_afresh(snap_env):
    """B3 for Accelerate. Fault: the only checkpoint, ``checkpoint_5``, was truncated after its commit (a
    power loss on a filesystem without ordered data). Wrong behaviour: ``load_state()`` found "no
    checkpoint", returned ``None`` and training started again from step 0, hours lost without a word.
    Right behaviour: the restart fails with an error naming the damaged folder and ``snapckpt verify``;
    the folder is left as it is (nothing deleted)."""
    out = os.path.join(snap_env.tmp, "run")
    _run({"out": out, "mode": "snap", "steps": 5, "save_at": 5}, snap_env.env)
    # the run's clean end lets its persister exit, but a restart that reaches it first keeps it (and step 5,
    # intact, in memory) alive and resumes from there: wait for it to go, so that only the damaged disk is left
    assert wait_until(lambda: not snap_env.persisters(), 30), "the persister outlived the clean end"
    folder = os.path.join(out, "checkpoint_5")
    victim = max((n for n in os.listdir(folder) if n != ".snapckpt"),
                 key=lambda n: os.path.getsize(os.path.join(folder, n)))
    size = os.path.getsize(os.path.join(folder, victim))
    os.truncate(os.path.join(folder, victim), size // 2)
    cfg = {"out": out, "mode": "snap", "steps": 10, "result": out + ".again.json"}
    p = subprocess.run([sys.executable, WORKER, json.dumps(cfg)], env={**os.environ, **snap_env.env,
                       "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180)
    assert p.returncode != 0, "resumed or started afresh from a damaged-only directory:\n" + p.stderr[-3000:]
    assert "CheckpointCorruptError" in p.stderr and "checkpoint_5" in p.stderr, p.stderr[-3000:]
    assert f"snapckpt verify {out}" in p.stderr, p.stderr[-3000:]
    assert not os.path.exists(cfg["result"])
    assert os.path.getsize(os.path.join(folder, victim)) == size // 2  # left for the user to inspect
    kill_persisters(snap_env)  # the failed run left its persister idling (180 s)


def test_project_configuration_automatic_naming_and_total_limit_as_stock(snap_env, tmp_path):
    """``AcceleratorCheckpointer(accelerator)`` with ``ProjectConfiguration(automatic_checkpoint_naming=True,
    total_limit=2)`` follows ``accelerator.save_state()``: folders ``<project_dir>/checkpoints/checkpoint_<i>``
    named by the accelerator's iteration (advanced per save), the same ones kept as the stock rotation
    keeps; ``load_state()`` resumes the newest and moves the iteration past it (the stock ``load_state``
    leaves it at 0); without automatic naming a directory is required, and so is a step."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from snapckpt.hf import AcceleratorCheckpointer

    def accelerator(project):
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=project, automatic_checkpoint_naming=True, total_limit=2))
        model = acc.prepare(torch.nn.Linear(4, 2))
        return acc, model

    stock, _ = accelerator(str(tmp_path / "stock"))
    for _ in range(3):
        stock.save_state()
    acc, model = accelerator(os.path.join(snap_env.tmp, "proj"))
    ck = AcceleratorCheckpointer(acc, persister_idle_timeout_secs=5)
    for i in range(3):
        with torch.no_grad():
            model.weight.fill_(float(i))
        ck.save_state().wait()
    ck.checkpointer.wait()
    mine = os.path.join(snap_env.tmp, "proj", "checkpoints")
    assert ck.checkpointer.checkpoint_dir == mine
    assert acc.save_iteration == stock.save_iteration == 3
    listed = lambda d: sorted(n for n in os.listdir(d) if not n.startswith("."))  # noqa: E731
    assert listed(mine) == listed(str(tmp_path / "stock" / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    ck.close()

    again, model2 = accelerator(os.path.join(snap_env.tmp, "proj"))
    ck2 = AcceleratorCheckpointer(again, persister_idle_timeout_secs=5)
    assert ck2.load_state() == os.path.join(mine, "checkpoint_2")
    assert torch.equal(model2.weight, torch.full((2, 4), 2.0)) and again.save_iteration == 3
    with pytest.raises(ValueError, match="automatic_checkpoint_naming"):
        AcceleratorCheckpointer(Accelerator(cpu=True))
    ck2.close()
