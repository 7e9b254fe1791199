"""Megatron integration: torch_dist layout, round trips with stock megatron-core, resharding, resume.

A tiny megatron-core ``GPTModel`` on 2 ranks under gloo (``tests/workers/megatron_worker.py``; the CUDA
calls megatron-core makes are redirected to the CPU by ``tests/workers/megatron_cpu.py``, which only
stands in for the missing GPU). Cases: F1 (stock ``dist_checkpointing.load`` reads snapckpt's directory,
snapckpt's ``load_checkpoint`` reads megatron-core's), F2 (the same file set as a stock save), F4 (saved at
TP=1/DP=2, loaded at TP=2/DP=1: every shard equals the original), E2 (per-step losses after ``kill -9`` and
resume equal the uninterrupted run's, from memory and from disk), B8 (memory-only snapshots survive the
death of every rank).

Optimizers: a plain ``torch.optim.Adam`` (TP=1/DP=2) and megatron-core's ``get_megatron_optimizer``
(``FP32Optimizer``, TP=2). megatron-core's *distributed* optimizer is not covered: it does not run on the
CPU (``DistributedOptimizer`` checks ``param.type()`` against ``torch.cuda.FloatTensor`` /
``torch.cuda.HalfTensor`` / ``torch.cuda.BFloat16Tensor`` and raises for CPU tensors, PLATFORM.md), so its
flattened-range shards are saved by the same code path (megatron-core's planner) but untested here.
"""
import json
import os
import pickle
import shutil
import signal

import pytest

from _harness import finish, finish_ok, launch, result_lines, run_ranks, wait_until

WORKER = "megatron_worker.py"


def _rank_results(outs, tag):
    return [[l.split(None, 1)[1] if " " in l else "" for l in result_lines(o) if l.split()[0] == tag]
            for o in outs]


def _files(path):
    return sorted(n for n in os.listdir(path) if n != ".snapckpt")


def test_F1_F2_F4_B3_layout_round_trips_reshard_and_damage(snap_env):
    """F1/F2: snapckpt's iter_0000002 has exactly the files of a stock torch_dist save (the same
    ``.distcp`` sizes), loads with stock ``dist_checkpointing.load``; snapckpt loads a stock directory.
    Saves 3-5 with ``assume_constant_structure`` (cached DCP plans) load the same way; in a directory where
    megatron-core saved (natively) after snapckpt, the newer native checkpoint is the one loaded.
    F4: the newest (TP=1, DP=2) loads at TP=2, DP=1 (2 ranks) and at world size 1 with every model and
    optimizer shard equal.
    B3 and tracker cases (the damaged-resharding and tracker cases of a user trial), on the same launches: at world size 1 (megatron-core
    reshards) a corrupted file of the newest, even one only rank 1 wrote, is found by its checksum before
    megatron-core reads it and the next older loads, with a warning naming the damaged one; when every
    directory is damaged CheckpointCorruptError names each. A directory with a ``.snapckpt`` sidecar but no
    manifest is snapckpt's damaged one, never megatron-core's own (at world size 1 and 2). A tracker
    naming a missing directory is named in a warning and the newest intact checkpoint loads (snapckpt's,
    or megatron-core's own in a native directory); with no checkpoint beside it, CheckpointCorruptError
    names the tracker (never a silent start from iteration 0)."""
    ck, native, ref = snap_env.ckpt_dir, os.path.join(snap_env.tmp, "native"), os.path.join(snap_env.tmp, "ref.pt")
    outs = run_ranks(WORKER, 2, ["--mode", "layout", "--tp", "1", "--ckpt", ck, "--native", native, "--out", ref],
                     snap_env.env, timeout=240)
    for o in outs:
        want = {"STOCK_LOADS_SNAPCKPT ok", "SNAPCKPT_LOADS_NATIVE ok", "CACHED_PLANS_LOAD ok",
                "NEWER_NATIVE_WINS ok"}
        assert want <= set(result_lines(o)), o
    mine, theirs = os.path.join(ck, "iter_0000002"), os.path.join(native, "iter_0000002")
    assert _files(mine) == _files(theirs) == [".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt",
                                              "metadata.json"]
    for name in ("__0_0.distcp", "__0_1.distcp", "metadata.json"):
        assert os.path.getsize(os.path.join(mine, name)) == os.path.getsize(os.path.join(theirs, name)), name
    assert open(os.path.join(mine, "metadata.json")).read() == open(os.path.join(theirs, "metadata.json")).read()
    # .metadata: the same tensors and objects, every item at the same (file, offset, length)
    with open(os.path.join(mine, ".metadata"), "rb") as f:
        a = pickle.load(f)
    with open(os.path.join(theirs, ".metadata"), "rb") as f:
        b = pickle.load(f)
    assert a.state_dict_metadata == b.state_dict_metadata
    assert getattr(a, "mcore_data", None) == getattr(b, "mcore_data", None)
    assert {k: (v.relative_path, v.offset, v.length) for k, v in a.storage_data.items()} == \
        {k: (v.relative_path, v.offset, v.length) for k, v in b.storage_data.items()}
    assert a.storage_meta.checkpoint_id == mine
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read() == "5"
    assert sorted(os.listdir(ck)) == [f"iter_000000{i}" for i in range(2, 6)] + \
        ["latest_checkpointed_iteration.txt"]

    outs = run_ranks(WORKER, 2, ["--mode", "reshard", "--tp", "2", "--ckpt", ck, "--out", ref, "--damage"],
                     snap_env.env, timeout=240)
    for o in outs:  # same world size: a snapckpt disk candidate, loaded by the stock loader
        got = [l for l in result_lines(o) if l.startswith("RESHARD_EQUAL")]
        assert got and int(got[0].split()[1]) > 20 and "DISK" in got[0], o
        assert {"SIDECAR_NOT_NATIVE ok", "TRACKER_MISSING ok"} <= set(result_lines(o)), o
    (o,) = run_ranks(WORKER, 1, ["--mode", "reshard", "--tp", "1", "--ckpt", ck, "--out", ref, "--native", native,
                                 "--damage"], snap_env.env, timeout=240)
    got = [l for l in result_lines(o) if l.startswith("RESHARD_EQUAL")]  # world size 1: snapckpt's, resharded
    assert got and int(got[0].split()[1]) > 20 and "step=5" in got[0] and "DISK" in got[0], o
    assert {"B3_RESHARD_FALLBACK ok", "SIDECAR_NOT_NATIVE_RESHARD ok", "TRACKER_MISSING_RESHARD ok",
            "ALL_DAMAGED_RESHARD ok", "TRACKER_MISSING_NATIVE ok", "TRACKER_MISSING_ALONE ok"} <= set(result_lines(o)), o


@pytest.mark.parametrize("tp,opt,overlap,remote", [(1, "adam", False, True), (2, "megatron", True, False)],
                         ids=["tp1dp2-adam-remote", "tp2dp1-mcore-opt-overlap-flag"])
def test_E2_B8_resume_after_kill9_from_memory_then_disk(snap_env, tp, opt, overlap, remote, request):
    """Uninterrupted 8 iterations vs: memory snapshots every iteration and disk every 4; every rank is
    SIGKILLed after iteration 6, restarted (resumes from memory at 6), SIGKILLed after 7; then the persister
    is killed too (the node lost its memory) and the restart resumes from disk at 4. Every rank's loss of
    every iteration after a resume equals the uninterrupted run's, bit for bit. The second configuration
    copies snapshots on the core's copy thread (``overlap=True``, fenced before each optimizer step).

    The first has the remote tier (``SNAPCKPT_REMOTE_DIR``, the S3 server): iteration 4 is on the server in
    the torch_dist layout (the local directory's files, sizes and checksums) with the tracker
    ``latest_checkpointed_iteration.txt``; the whole node is lost (persister killed, local directory
    deleted), and the last restart downloads iteration 4 before ``load_checkpoint`` reads it.

    In the second, the uninterrupted run goes through the ``--snapckpt`` flag path instead (Megatron-LM's
    loop, from the stand-in ``tests/workers/megatron_lm``, after ``enable(args)``; see
    :func:`_check_flag_metrics`): the same losses, bit for bit."""
    env = dict(snap_env.env)
    if remote:
        bucket = request.getfixturevalue("s3_bucket")
        env["SNAPCKPT_REMOTE_DIR"] = bucket.url("mg")
    base = ["--mode", "train", "--tp", str(tp), "--opt", opt, "--steps", "8", "--mem-interval", "1",
            "--disk-interval", "4"] + (["--overlap"] if overlap else [])
    # the uninterrupted run beside the first killed one (its own directory and persister): independent
    tb = os.path.join(snap_env.tmp, "tb")
    straight = launch(WORKER, 2, base + ["--ckpt", os.path.join(snap_env.tmp, "straight")]
                      + (["--flag", "--tb", tb] if overlap else []), snap_env.env)

    def run(kill_after):
        procs = launch(WORKER, 2, base + ["--ckpt", snap_env.ckpt_dir, "--kill-after", str(kill_after)], env)
        outs = finish(procs, timeout=240)
        want = -signal.SIGKILL if kill_after > 0 else 0
        assert [p.returncode for p in procs] == [want, want], outs
        return outs

    outs = run(6)
    assert all("LOSS 6" in " ".join(result_lines(o)) and "LOSS 7" not in " ".join(result_lines(o)) for o in outs)
    straight_outs = finish_ok(straight, timeout=240)
    ref = [dict(l.split() for l in r) for r in _rank_results(straight_outs, "LOSS")]
    assert all(len(r) == 8 for r in ref)
    if overlap:
        _check_flag_metrics(straight_outs, tb)
    outs = run(7)  # persister alive: every rank holds iteration 6 in memory
    for r, o in enumerate(outs):
        assert "RESUMED 6 memory" in result_lines(o), o
        assert dict(l.split() for l in _rank_results([o], "LOSS")[0]) == {"7": ref[r]["7"]}
    if remote:
        tracker = "mg/latest_checkpointed_iteration.txt"
        assert wait_until(lambda: bucket.keys(tracker) and bucket.get(tracker) == b"4", 60)
        local = json.load(open(os.path.join(snap_env.ckpt_dir, "iter_0000004", ".snapckpt", "manifest.json")))
        assert json.loads(bucket.get("mg/iter_0000004/.snapckpt/manifest.json"))["files"] == local["files"]
        assert sorted(k[len("mg/iter_0000004/"):] for k in bucket.keys("mg/iter_0000004/") if "/.snapckpt/" not in k) \
            == _files(os.path.join(snap_env.ckpt_dir, "iter_0000004")) == \
            [".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "metadata.json"]
    snap_env.kill_persisters()
    assert wait_until(lambda: not snap_env.persisters(), 10)
    if remote:
        shutil.rmtree(snap_env.ckpt_dir)  # the node lost whole: the remote tier alone holds iteration 4
    outs = run(-1)  # memory lost: the newest committed directory is iter_0000004
    for r, o in enumerate(outs):
        assert "RESUMED 4 disk" in result_lines(o), o
        got = dict(l.split() for l in _rank_results([o], "LOSS")[0])
        assert got == {k: ref[r][k] for k in ("5", "6", "7", "8")}, (r, got, ref[r])
    assert open(os.path.join(snap_env.ckpt_dir, "latest_checkpointed_iteration.txt")).read() == "8"
    assert os.path.exists(os.path.join(snap_env.ckpt_dir, "iter_0000008", ".metadata"))
    if remote:  # the resumed run's save is uploaded too (its persister exits once it is)
        assert wait_until(lambda: bucket.get(tracker) == b"8", 60)
        assert wait_until(lambda: not snap_env.persisters(), 60)


def _check_flag_metrics(outs, tb):
    """The flag path's metrics (8 iterations, a memory snapshot by the ``train_step`` wrapper at every
    iteration but 4 and 8, where Megatron-LM's loop saves to disk): Megatron-LM's TensorBoard writer (the
    last rank's only) holds ``snapckpt/stall_secs`` and ``snapckpt/bytes`` at every iteration 1-8 and
    ``snapckpt/durable_secs`` and ``snapckpt/persist_gbps`` at 4 and 8 (8's learnt at exit, by the close
    the flag path leaves to ``atexit``), read back with TensorBoard's own reader; bytes equal the core's
    stats of each snapshot, which hold at least the state's tensors; GB/s is bytes over durable seconds.
    Megatron-LM's timer ``save-checkpoint-non-persistent`` timed and logged the 6 wrapper snapshots (at
    least their stall); ``save-checkpoint`` is only the loop's own (logged once per disk save: not timed twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from snapckpt import metrics as M

    assert not any(l.startswith(("SNAP", "TIMER")) for l in result_lines(outs[0])), "rank 0 has no writer"
    last = result_lines(outs[1])
    snaps = {int(l.split()[1]): (l.split()[2], int(l.split()[3]), int(l.split()[4])) for l in last
             if l.startswith("SNAP ")}
    state_bytes = int(next(l.split()[1] for l in last if l.startswith("STATE_BYTES")))
    timers = {l.split()[1]: (float(l.split()[2]), int(l.split()[3])) for l in last if l.startswith("TIMER ")}
    assert {s: t for s, (t, _, _) in snaps.items()} == {s: "disk" if s % 4 == 0 else "memory" for s in range(1, 9)}
    assert all(tensor >= state_bytes for _, _, tensor in snaps.values()), (snaps, state_bytes)

    (events,) = [os.path.join(tb, f) for f in os.listdir(tb) if f.startswith("events.out.tfevents.")]
    acc = EventAccumulator(events)
    acc.Reload()
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert set(got) == {M.STALL_SECS, M.BYTES, M.DURABLE_SECS, M.PERSIST_GBPS}, got
    assert got[M.BYTES] == {s: slot for s, (_, slot, _) in snaps.items()}
    assert sorted(got[M.STALL_SECS]) == list(range(1, 9)) and all(v > 0 for v in got[M.STALL_SECS].values())
    assert sorted(got[M.DURABLE_SECS]) == sorted(got[M.PERSIST_GBPS]) == [4, 8]
    for s, secs in got[M.DURABLE_SECS].items():
        assert secs > 0 and got[M.PERSIST_GBPS][s] == pytest.approx(got[M.BYTES][s] / secs / 1e9, rel=1e-5)

    secs, logged = timers["save-checkpoint-non-persistent"]
    # Not compared with the stall: with overlap (always on the flag path) snapckpt's stall also counts the fence's
    # wait before the next step, outside Megatron-LM's save timer (seen once: timer 0.078 s, stall 0.174 s)
    assert logged == 6 and secs > 0, timers
    assert set(timers) == {"save-checkpoint", "save-checkpoint-non-persistent"} and timers["save-checkpoint"][1] == 2


@pytest.mark.parametrize("opt", ["adam", "megatron"])
def test_the_arena_is_reserved_after_the_first_iteration(snap_env, opt):
    """Issue 18, target 4, for a new megatron-core job (no ``expected_nbytes``): ``expect_checkpoint`` after the
    first iteration (what the ``--snapckpt`` flag path's ``train_step`` wrapper calls) has each rank's two slots
    reserved for the checkpoint's sharded tensors before any save. Right: no slot before, two slots of at least
    the state's tensor bytes after, and the first save (iteration 2) fits them (no regrowth)."""
    tp = "2" if opt == "megatron" else "1"
    outs = run_ranks(WORKER, 2, ["--mode", "expect", "--tp", tp, "--opt", opt, "--ckpt", snap_env.ckpt_dir],
                     snap_env.env, timeout=300)
    res = [json.loads(r) for out in outs for r in result_lines(out) if r.startswith("EXPECT ")
           for r in [r[len("EXPECT "):]]]
    assert len(res) == 2, outs
    for r in res:
        assert r["before"] == [] and r["started"] is True, r
        assert len(r["reserved"]) == 2 and r["reserved"][0] == r["reserved"][1] >= r["need"] > 0, r
        assert r["saved"] == r["reserved"], r
    assert os.path.isdir(os.path.join(snap_env.ckpt_dir, "iter_0000002"))


def test_flag_add_arguments_and_enable_says_what_it_did(caplog):
    """``add_arguments`` works as Megatron-LM's ``extra_args_provider``; ``enable`` does nothing with the
    flag off, and with it on says that Megatron-LM (``megatron.training``) is not importable here."""
    import argparse
    import logging

    import snapckpt.megatron as sm

    parser = sm.add_arguments(argparse.ArgumentParser())
    off = parser.parse_args([])
    assert (off.snapckpt, off.snapckpt_memory_interval, off.snapckpt_disk_interval) == (False, 0, 0)
    on = parser.parse_args(["--snapckpt", "--snapckpt-memory-interval", "5", "--snapckpt-disk-interval", "50",
                            "--snapckpt-keep-last", "2", "--snapckpt-on-slot-busy", "skip", "--snapckpt-overlap",
                            "--snapckpt-remote-dir", "s3://bucket/run1"])
    assert sm.checkpointer_options(on) == {"on_slot_busy": "skip", "keep_last": 2, "overlap": True,
                                           "remote_dir": "s3://bucket/run1"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--snapckpt-memory-interval", "-1"])
    r = sm.enable(off)
    assert not r.enabled and "off" in r.reason and r.routed == ()
    with caplog.at_level(logging.WARNING):
        r = sm.enable(on)
    assert not r.enabled and "Megatron-LM is not importable" in r.reason and r.routed == ()
    assert "not importable" in caplog.text


def test_flag_megatron_lm_own_flags_map_onto_the_tiers():
    """Megatron-LM's ``--non-persistent-save-interval`` (any ``--non-persistent-ckpt-type``) is the memory
    tier, taken by Megatron-LM's own loop (no ``train_step`` wrapper, so no snapshot twice);
    ``--snapckpt-memory-interval`` is its alias (the wrapper takes them); both with different values are
    refused naming both; ``--async-save`` is named as served by the disk tier."""
    import argparse

    from snapckpt.megatron import resolve_flags

    ns = argparse.Namespace
    assert resolve_flags(ns(snapckpt_memory_interval=0)) == (0, False, "")
    assert resolve_flags(ns(snapckpt_memory_interval=5)) == (5, True, "")
    interval, wrap, said = resolve_flags(ns(snapckpt_memory_interval=0, non_persistent_save_interval=10,
                                            non_persistent_ckpt_type="local", async_save=True))
    assert (interval, wrap) == (10, False)
    assert "--non-persistent-ckpt-type local" in said and "memory tier" in said and "--async-save" in said, said
    assert resolve_flags(ns(snapckpt_memory_interval=10, non_persistent_save_interval=10))[:2] == (10, False)
    with pytest.raises(ValueError, match=r"--snapckpt-memory-interval 5 and --non-persistent-save-interval 10"):
        resolve_flags(ns(snapckpt_memory_interval=5, non_persistent_save_interval=10))


def test_flag_memory_snapshot_schedule():
    """The ``train_step`` wrapper ``enable`` installs: a MEMORY snapshot after every
    ``--snapckpt-memory-interval``-th iteration except where Megatron-LM's own disk save falls, recording
    the consumed samples as Megatron-LM's loop will have them after the iteration (one global batch on).
    ``train_step`` here is a plain function with Megatron-LM's signature (Megatron-LM is not installable)."""
    import argparse

    from snapckpt import StorageType
    from snapckpt.integrations.megatron.args import _with_memory_snapshots

    args = argparse.Namespace(snapckpt_memory_interval=2, save_interval=4, consumed_train_samples=0,
                              global_batch_size=8, num_floating_point_operations_so_far=0)
    saves = []
    step = _with_memory_snapshots(lambda f, d, m, o, s, *rest: ("loss", m),
                                  args, lambda it, m, o, s, fl, storage_type, args: saves.append(
                                      (it, m, storage_type, args.consumed_train_samples)))
    for it in range(6):
        args.curr_iteration = it
        assert step(None, None, "model", "opt", "sched", "config") == ("loss", "model")
        args.consumed_train_samples += 8  # what Megatron-LM's loop does after train_step
    assert saves == [(2, "model", StorageType.MEMORY, 16), (6, "model", StorageType.MEMORY, 48)]


def test_bad_input_names_the_fix():
    """Without Megatron-LM's args a directory must be given; a bad iteration, or a TensorBoard writer that
    is a path rather than a writer, is refused before any collective or file is touched."""
    from snapckpt.megatron_dist_ckpt import load_checkpoint, save_checkpoint

    with pytest.raises(ValueError, match="save_dir="):
        save_checkpoint(1, [], None, None, 0)
    with pytest.raises(ValueError, match="load_dir="):
        load_checkpoint([], None, None)
    for bad in (-1, 2**63, 3.0):  # P6a: the range is named
        with pytest.raises(ValueError, match=r"iteration must be an int in \[0, 2\*\*63 - 1\]"):
            save_checkpoint(bad, [], None, None, 0, save_dir="/nonexistent/never-created")
    with pytest.raises(TypeError, match=r"tensorboard_writer must be a TensorBoard SummaryWriter .* got str"):
        save_checkpoint(1, [], None, None, 0, save_dir="/nonexistent/never-created", tensorboard_writer="runs/")
    assert not os.path.exists("/nonexistent/never-created")
