"""contract 8 (docs/design/contracts.md): an interrupted and resumed run produces the same losses as one that was not.

Cases E2 (dropout and a shuffled DataLoader: bitwise-equal per-step losses on CPU) and E3 (StepLR: the
learning rate after resume equals the uninterrupted run's), from the memory tier and from the disk tier;
and the main job (``examples/train_gpt.py``, DDP on 2 ranks under ``torchrun``) killed with ``kill -9``
mid-run and resumed from memory, and from disk when the persister died too.
"""
import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from _harness import REPO, result_lines, start_torchrun, wait_until

# scripts/test.sh hands out tests one by one (--dist loadgroup); these share the reference run in `_REFERENCE`:
# one worker runs them all, so it is made once
pytestmark = pytest.mark.xdist_group("test_resume_fidelity")

WORKER = os.path.join(REPO, "tests", "workers", "resume_worker.py")
# The uninterrupted reference run does not depend on the tier under test: it is run once per session.
_REFERENCE = {}


def _run(args, env):
    out = subprocess.run([sys.executable, WORKER, *map(str, args)], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _losses(out):
    return {r["step"]: (r["loss"], r["lr"]) for r in map(json.loads, result_lines(out))}


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_E2_E3_resume_is_bitwise_identical(snap_env, tier):
    """E2/E3: 10 steps straight vs 5 steps + save + process exit without close + resume to 10."""
    if "straight" not in _REFERENCE:  # no save (save_at 0): the tier argument does not matter
        _REFERENCE["straight"] = _losses(_run([snap_env.tmp + "/straight", 10, 10, 0, tier], snap_env.env))
    straight = _REFERENCE["straight"]
    _run([snap_env.ckpt_dir, 5, 10, 5, tier], snap_env.env)
    if tier == "disk":  # the node lost its memory too
        snap_env.kill_persisters()
        assert wait_until(lambda: not snap_env.persisters(), 10)
    out = _run([snap_env.ckpt_dir, 10, 10, 0, tier], snap_env.env)
    assert f"RESUMED 5 {tier}" in out
    resumed = _losses(out)
    assert sorted(resumed) == list(range(6, 11))
    for step in range(6, 11):
        assert resumed[step] == straight[step], f"step {step}: {resumed[step]} != {straight[step]}"
    assert resumed[6][1] == straight[6][1] == repr(0.1 * 0.1 * 0.1)  # lr 0.1, decayed twice by step 6
    snap_env.leftover_ok = tier == "disk"


def _torchrun(ckpt, log, steps, env, extra=(), nproc=2):
    return start_torchrun(lambda port: [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
        os.path.join(REPO, "examples", "train_gpt.py"), "--checkpoint-dir", ckpt, "--steps", str(steps),
        "--memory-interval", "4", "--disk-interval", "4", "--loss-log", log, "--data-bytes", "200000", *extra],
        env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def _log(path):
    if not os.path.exists(path):
        return {}
    out = {}
    for line in open(path):
        parts = line.split()
        if len(parts) == 4 and parts[0] == "step":
            out[int(parts[1])] = parts[3]
    return out


def _kill_job(proc):
    """kill -9 torchrun and its ranks; the persister (own session) is left alive."""
    victims = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)
                            if "snapckpt.persister" not in " ".join(c.cmdline())]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate(timeout=30)


def test_E2_main_job_kill9_persister_lost_resume_from_disk(snap_env):
    """The main job under torchrun (2 ranks): kill -9 after step 6, the persister killed too (the node lost
    its memory), resume from disk at step 4, identical losses to step 10. (The memory-tier resume of the
    main job is test_E2_main_job_four_ranks_resume_is_bitwise, at 4 ranks; it was also run here at 2 ranks,
    the same path, and was merged into it to save three launches.)"""
    ref_log = os.path.join(snap_env.tmp, "ref.log")  # the uninterrupted run, beside the job (own persister)
    ref = _torchrun(os.path.join(snap_env.tmp, "ref"), ref_log, 10, snap_env.env)
    log = os.path.join(snap_env.tmp, "run.log")
    job = _torchrun(snap_env.ckpt_dir, log, 10, snap_env.env, ["--sleep-per-step", "0.5"])
    assert wait_until(lambda: max(_log(log), default=0) >= 6 or job.poll() is not None, 240)
    assert job.poll() is None, "the job ended before it could be killed"
    _kill_job(job)
    out = ref.communicate(timeout=300)[0]  # before any persister is killed: the reference has its own
    assert ref.returncode == 0, out
    snap_env.kill_persisters()
    assert wait_until(lambda: not snap_env.persisters(), 10)
    os.unlink(log)
    again = _torchrun(snap_env.ckpt_dir, log, 10, snap_env.env)
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out
    assert "resumed from step 4 (tier: disk)" in out, out
    expected, got = _log(ref_log), _log(log)
    assert sorted(got) == list(range(5, 11))
    for step in got:
        assert got[step] == expected[step], f"step {step}: {got[step]} != {expected[step]}"


def test_E2_main_job_four_ranks_resume_is_bitwise(snap_env):
    """The main job with 4 ranks on one node: kill -9 after step 6, resume from memory at step 4, losses
    bitwise equal to an uninterrupted 4-rank run (the main job's memory-tier resume; the disk tier is
    test_E2_main_job_kill9_persister_lost_resume_from_disk). examples/train_gpt.py keeps DDP's initial gradient
    buckets (find_unused_parameters=True) so that a resumed run reduces in the same order at 3+ ranks.
    (Measured 2026-12-02 with torch 2.13: this model's losses stayed bitwise with a bucket rebuild too, so
    this test guards the 4-rank resume, not the rebuild itself.)"""
    small = ["--batch-size", "2"]
    ref_log, log = os.path.join(snap_env.tmp, "ref4.log"), os.path.join(snap_env.tmp, "run4.log")
    ref = _torchrun(os.path.join(snap_env.tmp, "ref4"), ref_log, 8, snap_env.env, small, nproc=4)
    job = _torchrun(snap_env.ckpt_dir, log, 8, snap_env.env, small + ["--sleep-per-step", "0.5"], nproc=4)
    assert wait_until(lambda: max(_log(log), default=0) >= 6 or job.poll() is not None, 240)
    assert job.poll() is None, "the job ended before it could be killed"
    _kill_job(job)
    out = ref.communicate(timeout=300)[0]  # the uninterrupted run, beside the job (own persister)
    assert ref.returncode == 0, out
    os.unlink(log)
    again = _torchrun(snap_env.ckpt_dir, log, 8, snap_env.env, small, nproc=4)
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out
    assert "resumed from step 4 (tier: memory)" in out, out
    expected, got = _log(ref_log), _log(log)
    assert sorted(got) == list(range(5, 9))
    for step in got:
        assert got[step] == expected[step], f"step {step}: {got[step]} != {expected[step]}"
