"""Worker for tests/test_megatron.py: a tiny megatron-core GPT trained on the CPU under gloo.

Modes (``--mode``):
- ``train``: resume with ``load_checkpoint`` if anything is there, train to ``--steps`` with memory/disk
  saves through ``save_checkpoint``; print ``RESULT LOSS <iteration> <loss>`` per step and
  ``RESULT RESUMED <iteration> <tier>``; with ``--kill-after N`` every rank SIGKILLs itself after
  iteration N's saves (DISK ones committed first).
- ``layout``: train 2 steps, save iteration 2 with snapckpt (``--ckpt``) and with stock
  ``dist_checkpointing.save`` (``--native``, Megatron-LM's layout and tracker), then check both ways:
  stock ``dist_checkpointing.load`` of snapckpt's directory and snapckpt's ``load_checkpoint`` of the
  native one restore every tensor, the iteration and the flop count; write the reference shards
  (``--out``) for ``reshard``.
- ``reshard``: build the model at ``--tp``, load ``--ckpt`` with ``load_checkpoint`` and compare every
  local shard (model and optimizer state) with the reference written by ``layout``; with ``--damage``,
  then damage directories and check what loads (B3, a sidecar without its manifest, a tracker naming a
  missing directory; at world size 1 through the resharding path, at 2 on a copy of ``--ckpt``).
"""
import argparse
import logging
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_cpu  # noqa: E402  (stands in for the missing GPU)

VOCAB, SEQ, BATCH = 64, 16, 2


def build(tp: int, opt_kind: str):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model = megatron_cpu.tiny_gpt(tp, vocab=VOCAB, seq=SEQ)
    if opt_kind == "megatron":
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from megatron.core.distributed import DistributedDataParallelConfig

        model.ddp_config = DistributedDataParallelConfig()  # read by get_megatron_optimizer; no DDP wrapper
        with megatron_cpu.cuda_tensors_on_cpu():
            config = OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, clip_grad=0.0)
            optimizer = get_megatron_optimizer(config, [model])
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
                                    lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=20, wd_incr_style="constant")
    return model, optimizer, sched


def batch(step: int):
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(1000 * step + ps.get_data_parallel_rank())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    return tokens, pos, mask, tokens.roll(-1, dims=1)


def train_step(model, optimizer, sched, step: int, fence: bool = True) -> float:
    from megatron.core import parallel_state as ps

    tokens, pos, mask, labels = batch(step)
    optimizer.zero_grad()
    loss = model(tokens, pos, mask, labels=labels).float().mean()
    loss.backward()
    dp = ps.get_data_parallel_world_size()
    for p in model.parameters():
        if p.grad is not None and dp > 1:
            torch.distributed.all_reduce(p.grad, group=ps.get_data_parallel_group())
            p.grad /= dp
        if hasattr(optimizer, "config"):  # megatron-core optimizers read main_grad
            p.main_grad = p.grad
    if fence:  # overlap=True: the snapshot copy of the last save ends before parameters change
        from snapckpt.megatron_dist_ckpt import fence as fence_copies

        fence_copies()
    with megatron_cpu.cuda_tensors_on_cpu():
        optimizer.step()
    sched.step(1)
    return loss.item()


def shards(model, optimizer) -> dict:
    """{(key, global_offset): local data} of every ShardedTensor of the model and optimizer state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from snapckpt.integrations.megatron.state import build_state_dict

    sd = build_state_dict(None, model, optimizer, None, 0, 0, is_loading=False, with_optimizer=True, with_rng=False)
    out = {}
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor):
            out[(sh.key, tuple(sh.global_offset), sh.prepend_axis_num)] = sh.data.detach().clone()
    return out


def mode_train(a):
    from snapckpt import StorageType
    from snapckpt.megatron_dist_ckpt import close_all, get_checkpointer, load_checkpoint, save_checkpoint

    model, optimizer, sched = build(a.tp, a.opt)
    it, flops = load_checkpoint(model, optimizer, sched, load_dir=a.ckpt, overlap=a.overlap)
    ck = get_checkpointer(a.ckpt)
    assert ck.options.overlap == a.overlap
    tier = ck.last_load.tier.value if it and ck.last_load else "none"
    print(f"RESULT RESUMED {it} {tier}", flush=True)
    while it < a.steps:
        loss = train_step(model, optimizer, sched, it)
        it += 1
        flops += 10
        print(f"RESULT LOSS {it} {loss:.10f}", flush=True)
        if a.disk_interval and it % a.disk_interval == 0:
            save_checkpoint(it, [model], optimizer, sched, flops, save_dir=a.ckpt)
        elif a.mem_interval and it % a.mem_interval == 0:
            save_checkpoint(it, [model], optimizer, sched, flops, save_dir=a.ckpt, storage_type=StorageType.MEMORY)
        if it == a.kill_after:
            ck.wait()
            torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    close_all()


def _slot_sizes() -> list:
    rank = torch.distributed.get_rank()
    root = os.environ["SNAPCKPT_SHM_DIR"]
    return sorted(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
                  if f.startswith(f"r{rank:05d}-s"))


def mode_expect(a):
    """A new job: no slot before the first iteration, both of this rank's slots reserved for the checkpoint's
    sharded tensors right after ``expect_checkpoint`` (the first save, at iteration 2, fits them). Prints
    ``RESULT EXPECT {json}``."""
    import json
    import time

    from snapckpt.megatron_dist_ckpt import close_all, expect_checkpoint, load_checkpoint, save_checkpoint

    model, optimizer, sched = build(a.tp, a.opt)
    load_checkpoint(model, optimizer, sched, load_dir=a.ckpt)  # nothing there: makes the Checkpointer
    before = _slot_sizes()
    train_step(model, optimizer, sched, 0)
    started = expect_checkpoint([model], optimizer, save_dir=a.ckpt)
    need = sum(t.nbytes for t in shards(model, optimizer).values())
    deadline = time.monotonic() + 30
    # the reservation runs in the background: both slots can exist, one of them still below its final size and
    # above the need (seen once under load: 425984 and 1244128 bytes); wait for both at one size
    while time.monotonic() < deadline:
        sizes = _slot_sizes()
        if len(sizes) == 2 and sizes[0] == sizes[1] >= need:
            break
        time.sleep(0.02)
    reserved = _slot_sizes()
    train_step(model, optimizer, sched, 1)
    save_checkpoint(2, [model], optimizer, sched, 0, save_dir=a.ckpt)
    saved = _slot_sizes()
    close_all()
    print("RESULT EXPECT " + json.dumps({"before": before, "started": started, "need": need, "reserved": reserved,
                                         "saved": saved}), flush=True)


def mode_flag(a):
    """``train`` through the ``--snapckpt`` flag path: Megatron-LM's loop (the stand-in's, ``megatron_lm/``)
    after ``snapckpt.megatron.enable(args)``, memory snapshots by the ``train_step`` wrapper, disk saves by
    the loop. Prints what ``train`` prints, then on the last rank (Megatron-LM's TensorBoard writer) the
    core's stats of each snapshot (``RESULT SNAP <step> <tier> <slot bytes> <tensor bytes>``), the state's
    tensor bytes (``RESULT STATE_BYTES``) and Megatron-LM's timers (``RESULT TIMER <name> <active s>
    <logged>``). The last commit is learnt at exit (the ``atexit`` close the flag path registers)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_lm"))
    from megatron.training import get_timers, global_vars
    from megatron.training import training as mtraining

    import snapckpt.megatron

    p = argparse.ArgumentParser()
    for name in ("--save", "--load", "--tensorboard-dir"):
        p.add_argument(name)
    for name in ("--save-interval", "--train-iters", "--global-batch-size"):
        p.add_argument(name, type=int)
    p.add_argument("--timing-log-level", type=int, default=0)
    p.add_argument("--timing-log-option", default="minmax")
    snapckpt.megatron.add_arguments(p)
    args = p.parse_args(["--save", a.ckpt, "--load", a.ckpt, "--tensorboard-dir", a.tb, "--train-iters", str(a.steps),
                         "--global-batch-size", str(BATCH), "--snapckpt", "--snapckpt-memory-interval",
                         str(a.mem_interval), "--snapckpt-disk-interval", str(a.disk_interval)]
                        + (["--snapckpt-overlap"] if a.overlap else []))
    args.rank, args.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    args.consumed_train_samples = 0
    global_vars.set_global_variables(args)
    timer_log = _Caught(logging.INFO)  # Megatron-LM's timers.log lines (on the last rank)
    logging.getLogger("megatron.core.timers").addHandler(timer_log)
    logging.getLogger("megatron.core.timers").setLevel(logging.INFO)
    model, optimizer, sched = build(a.tp, a.opt)

    def lm_train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
        loss = train_step(model[0], optimizer, opt_param_scheduler, args.curr_iteration, fence=False)
        print(f"RESULT LOSS {args.curr_iteration + 1} {loss:.10f}", flush=True)
        return {}, 0, None, None

    mtraining.train_step = lm_train_step  # Megatron-LM's own, which enable wraps
    r = snapckpt.megatron.enable(args)
    assert r.enabled and "megatron.training.training.train_step" in r.routed, r
    args.iteration, args.num_floating_point_operations_so_far = mtraining.load_checkpoint([model], optimizer, sched)
    print(f"RESULT RESUMED {args.iteration} none", flush=True)
    last = args.rank == args.world_size - 1
    if last:
        from snapckpt.megatron_dist_ckpt import get_checkpointer

        get_checkpointer(a.ckpt).add_listener(
            lambda e: e.kind == "snapshot_taken" and print(
                f"RESULT SNAP {e.step} {e.tier.value} {e.stats.slot_nbytes} {e.stats.tensor_nbytes}", flush=True))
    mtraining.train(None, [model], optimizer, sched, None, None, {})
    if last:
        print(f"RESULT STATE_BYTES {sum(t.nbytes for t in shards(model, optimizer).values())}", flush=True)
        for name, timer in sorted(get_timers()._timers.items()):
            logged = sum(f"{name} ." in m for m in timer_log.lines)  # Megatron-LM pads each name with dots
            print(f"RESULT TIMER {name} {timer.active_time():.6f} {logged}", flush=True)


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ {set(a) ^ set(b)}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def mode_layout(a):
    from megatron.core import dist_checkpointing
    from snapckpt.integrations.megatron.state import build_state_dict
    from snapckpt.megatron_dist_ckpt import close_all, load_checkpoint, save_checkpoint

    rank = torch.distributed.get_rank()
    model, optimizer, sched = build(a.tp, a.opt)
    for step in range(2):
        train_step(model, optimizer, sched, step)
    ref = shards(model, optimizer)
    sched_ref = sched.state_dict()
    meta = {"singleton_local_shards": False}  # Megatron-LM's sharded_sd_metadata -> content_metadata
    save_checkpoint(2, [model], optimizer, sched, 1234, save_dir=a.ckpt, sharded_sd_metadata=meta).wait()
    # Stock megatron-core save of the same state, in Megatron-LM's layout.
    native_iter = os.path.join(a.native, "iter_0000002")
    os.makedirs(native_iter, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(build_state_dict(None, [model], optimizer, sched, 2, 1234, False, True, True, meta),
                            native_iter)
    if rank == 0:
        with open(os.path.join(a.native, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
        torch.save({k: v for k, v in ref.items()}, a.out)
    torch.distributed.barrier()

    # stock loader <- snapckpt's directory
    m2, o2, s2 = build(a.tp, a.opt)
    fresh = build_state_dict(None, [m2], o2, s2, 0, 0, True, True, True)
    loaded = dist_checkpointing.load(fresh, os.path.join(a.ckpt, "iter_0000002"))
    m2.load_state_dict(loaded["model"])
    from snapckpt.integrations.megatron.state import apply_state

    apply_state(loaded, [m2], o2, s2, True, True)
    assert loaded["iteration"] == 2 and loaded["num_floating_point_operations_so_far"] == 1234
    _equal(shards(m2, o2), ref, "stock load of snapckpt's checkpoint")
    assert s2.state_dict() == sched_ref
    got = dist_checkpointing.load_content_metadata(os.path.join(a.ckpt, "iter_0000002"))
    assert got["singleton_local_shards"] is False and "dp_cp_group" not in got, got
    print("RESULT STOCK_LOADS_SNAPCKPT ok", flush=True)

    # snapckpt's loader <- the native directory
    m3, o3, s3 = build(a.tp, a.opt)
    it, flops = load_checkpoint([m3], o3, s3, load_dir=a.native)
    assert (it, flops) == (2, 1234), (it, flops)
    _equal(shards(m3, o3), ref, "snapckpt load of megatron-core's checkpoint")
    assert s3.state_dict() == sched_ref
    print("RESULT SNAPCKPT_LOADS_NATIVE ok", flush=True)

    # --ckpt-assume-constant-structure: the third save reuses the cached plans and global metadata
    for it in (3, 4, 5):
        save_checkpoint(it, [model], optimizer, sched, 1234, save_dir=a.ckpt, assume_constant_structure=True).wait()
    m4, o4, s4 = build(a.tp, a.opt)
    loaded = dist_checkpointing.load(build_state_dict(None, [m4], o4, s4, 0, 0, True, True, True),
                                     os.path.join(a.ckpt, "iter_0000005"))
    apply_state(loaded, [m4], o4, s4, True, True)
    assert loaded["iteration"] == 5
    _equal(shards(m4, o4), ref, "stock load of a save with cached plans")
    print("RESULT CACHED_PLANS_LOAD ok", flush=True)

    # a directory where megatron-core saved natively after snapckpt: the newer native one is loaded
    mixed = os.path.join(os.path.dirname(a.out), "mixed")
    save_checkpoint(1, [model], optimizer, sched, 1, save_dir=mixed).wait()
    os.makedirs(os.path.join(mixed, "iter_0000002"), exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(build_state_dict(None, [model], optimizer, sched, 2, 1234, False, True, True),
                            os.path.join(mixed, "iter_0000002"))
    if rank == 0:
        with open(os.path.join(mixed, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
    torch.distributed.barrier()
    m5, o5, s5 = build(a.tp, a.opt)
    assert load_checkpoint([m5], o5, s5, load_dir=mixed) == (2, 1234)
    _equal(shards(m5, o5), ref, "snapckpt load of a newer native checkpoint")
    print("RESULT NEWER_NATIVE_WINS ok", flush=True)
    close_all()


def _equal_ref(model, optimizer, ref) -> int:
    """Compare every local shard with the reference (full tensors of the TP=1 save); return the count."""
    ref_by_key = {}
    for (key, off, pre), t in ref.items():
        ref_by_key.setdefault(key, []).append((off, pre, t))
    n = 0
    for (key, off, pre), t in shards(model, optimizer).items():
        cands = [(o, full) for o, p, full in ref_by_key[key] if o[:pre] == off[:pre]]
        assert len(cands) == 1, (key, off)
        o, full = cands[0]
        sl = tuple(slice(s - b, s - b + n_) for s, b, n_ in zip(off[pre:], o[pre:], t.shape))
        assert torch.equal(full[sl], t), f"{key} at {off} differs after resharding"
        n += 1
    return n


def mode_reshard(a):
    from snapckpt.megatron_dist_ckpt import close_all, get_checkpointer, load_checkpoint

    model, optimizer, sched = build(a.tp, a.opt)
    it, flops = load_checkpoint([model], optimizer, sched, load_dir=a.ckpt)
    assert (it, flops) == (5, 1234), (it, flops)
    ref = torch.load(a.out)
    n = _equal_ref(model, optimizer, ref)
    print(f"RESULT RESHARD_EQUAL {n} {get_checkpointer(a.ckpt).last_load}", flush=True)
    if a.damage:
        (_damage_other_world_size if torch.distributed.get_world_size() == 1 else _damage_same_world_size)(a, ref)
    close_all()


# ------------------------------------------------------------------ damaged directories (B3, tracker cases)
class _Caught(logging.Handler):
    """The warnings snapckpt logs during one load (or what a logger logs at ``level``)."""

    def __init__(self, level=logging.WARNING):
        super().__init__(level)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _flip(path: str) -> None:
    """Flip 4 bytes in the middle of ``path`` (damage in place: the size is unchanged)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(4)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(x ^ 0xFF for x in b))


def _write_tracker(d: str, content: str) -> None:
    with open(os.path.join(d, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(content)


def _expect(a, d: str, ref, want_it: int, want_last, warns=(), rank0_warns=()) -> None:
    """Load ``d`` afresh; the iteration, the tier/step of ``last_load`` (None: megatron-core's own
    directory), every shard equal to the reference, and the warnings that must have been logged."""
    from snapckpt.megatron_dist_ckpt import get_checkpointer, load_checkpoint

    caught = _Caught()
    logging.getLogger("snapckpt").addHandler(caught)
    try:
        model, optimizer, sched = build(a.tp, a.opt)
        got = load_checkpoint([model], optimizer, sched, load_dir=d)
    finally:
        logging.getLogger("snapckpt").removeHandler(caught)
    assert got == (want_it, 1234), (got, caught.lines)
    last = get_checkpointer(d).last_load
    assert (None if last is None else (last.tier.value, last.step)) == want_last, last
    _equal_ref(model, optimizer, ref)
    for w in list(warns) + (list(rank0_warns) if torch.distributed.get_rank() == 0 else []):
        assert any(w in line for line in caught.lines), (w, caught.lines)


def _damage_other_world_size(a, ref) -> None:
    """World size 1 on --ckpt (iterations 2-5 saved by 2 ranks: the resharding path through megatron-core's
    loader); destructive, the last use of --ckpt. Each case prints ``RESULT <case> ok``."""
    from snapckpt.errors import CheckpointCorruptError
    from snapckpt.megatron_dist_ckpt import load_checkpoint

    d = a.ckpt
    it = lambda i: os.path.join(d, f"iter_{i:07d}")  # noqa: E731
    # B3: a .distcp file of the newest is corrupted: every saving rank's files are verified before
    # megatron-core reads them; the next older one loads, with a warning naming the damaged one
    _flip(os.path.join(it(5), "__0_1.distcp"))
    _expect(a, d, ref, 4, ("disk", 4), ["iteration 5 (iter_0000005, saved by 2 ranks) is damaged", "corrupted"])
    print("RESULT B3_RESHARD_FALLBACK ok", flush=True)
    # a .snapckpt sidecar without its manifest is snapckpt's damaged directory, never megatron-core's own
    os.remove(os.path.join(it(4), ".snapckpt", "manifest.json"))
    _flip(os.path.join(it(4), "__0_0.distcp"))
    _write_tracker(d, "4")
    _expect(a, d, ref, 3, ("disk", 3), ["iter_0000004: .snapckpt/manifest.json is missing", "iter_0000005"])
    print("RESULT SIDECAR_NOT_NATIVE_RESHARD ok", flush=True)
    # the tracker names a directory that does not exist
    _write_tracker(d, "99")
    _expect(a, d, ref, 3, ("disk", 3), ["latest_checkpointed_iteration.txt names iter_0000099, which does not exist"])
    print("RESULT TRACKER_MISSING_RESHARD ok", flush=True)
    # every one damaged: CheckpointCorruptError naming each, nothing loaded
    _flip(os.path.join(it(3), "__0_1.distcp"))
    _flip(os.path.join(it(2), "common.pt"))
    model, optimizer, sched = build(a.tp, a.opt)
    try:
        load_checkpoint([model], optimizer, sched, load_dir=d)
        raise AssertionError("a directory of damaged checkpoints loaded")
    except CheckpointCorruptError as e:
        for i in (5, 4, 3, 2):
            assert f"iter_{i:07d}" in str(e), (i, str(e))
    print("RESULT ALL_DAMAGED_RESHARD ok", flush=True)
    # a tracker naming a missing directory next to megatron-core's own directories: the newest native one
    _write_tracker(a.native, "99")
    _expect(a, a.native, ref, 2, None, ["names iter_0000099, which does not exist"])
    print("RESULT TRACKER_MISSING_NATIVE ok", flush=True)
    # ... and with no checkpoint at all beside it: an error naming the tracker, not a silent fresh start
    lone = os.path.join(os.path.dirname(a.out), "lone")
    os.makedirs(lone)
    _write_tracker(lone, "99")
    try:
        load_checkpoint([model], optimizer, sched, load_dir=lone)
        raise AssertionError("a tracker naming a missing directory started afresh")
    except CheckpointCorruptError as e:
        assert "names iter_0000099, which does not exist" in str(e) and "to start afresh" in str(e), str(e)
    print("RESULT TRACKER_MISSING_ALONE ok", flush=True)


def _damage_same_world_size(a, ref) -> None:
    """The same world size (2 ranks) on a file-by-file copy of --ckpt (a copy is another directory to
    snapckpt: no extended attributes carried); each case prints ``RESULT <case> ok``."""
    import shutil

    d = a.ckpt.rstrip("/") + "_same"
    if torch.distributed.get_rank() == 0:
        for root, _, names in os.walk(a.ckpt):
            os.makedirs(os.path.join(d, os.path.relpath(root, a.ckpt)), exist_ok=True)
            for n in names:
                if not n.startswith(".snapckpt-"):  # the writer lock
                    shutil.copyfile(os.path.join(root, n), os.path.join(d, os.path.relpath(root, a.ckpt), n))
        # the newest lost its manifest (sidecar kept) and its data is damaged: snapckpt's, not native
        os.remove(os.path.join(d, "iter_0000005", ".snapckpt", "manifest.json"))
        _flip(os.path.join(d, "iter_0000005", "__0_0.distcp"))
    torch.distributed.barrier()
    _expect(a, d, ref, 4, ("disk", 4), rank0_warns=["iter_0000005: .snapckpt/manifest.json is missing"])
    print("RESULT SIDECAR_NOT_NATIVE ok", flush=True)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        _write_tracker(d, "99")
    torch.distributed.barrier()
    _expect(a, d, ref, 4, ("disk", 4),
            rank0_warns=["latest_checkpointed_iteration.txt names iter_0000099, which does not exist"])
    print("RESULT TRACKER_MISSING ok", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--opt", default="adam")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--native", default="")
    p.add_argument("--out", default="")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--mem-interval", type=int, default=0)
    p.add_argument("--disk-interval", type=int, default=0)
    p.add_argument("--kill-after", type=int, default=-1)
    p.add_argument("--damage", action="store_true", help="reshard: then the damaged-directory cases")
    p.add_argument("--overlap", action="store_true", help="Checkpointer(overlap=True): overlapped copies")
    p.add_argument("--flag", action="store_true", help="train: through the --snapckpt flag path (mode_flag)")
    p.add_argument("--tb", default="", help="--flag: Megatron-LM's --tensorboard-dir")
    a = p.parse_args()
    megatron_cpu.install(force=True)
    torch.distributed.init_process_group("gloo")
    megatron_cpu.init_parallel(a.tp)
    if a.mode == "train" and a.flag:
        a.mode = "flag"
    {"train": mode_train, "flag": mode_flag, "layout": mode_layout, "reshard": mode_reshard,
     "expect": mode_expect}[a.mode](a)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
