"""DeepSpeed native layout, both directions (cases F1, F2), per ZeRO stage and dtype.

Usage: ds_layout_worker.py ROOT CONFIG[,CONFIG...]   with CONFIG = STAGE:DTYPE[:frozen]

Per config: train 2 steps; save natively (stock checkpoint engine) into ROOT/<cfg>/native and through
snapckpt into ROOT/<cfg>/snap (tag ``global_step2`` and the string tag ``TAG2``); then
- rank 0 compares the two trees file for file, tensor for tensor and mode for mode (RESULT ``files``);
- a fresh engine loads snapckpt's tag with stock ``engine.load_checkpoint`` and one more step gives the same
  loss as the original engine (RESULT ``stock_load``);
- a fresh engine loads the native directory through ``DeepSpeedCheckpointer.load_checkpoint`` (RESULT
  ``snap_load_native``);
- with ZeRO, ``zero_to_fp32`` converts both directories to equal fp32 state dicts (RESULT ``zero_to_fp32``).
"""
import json
import os
import stat
import sys

import ds_common  # noqa: F401  (sets up DeepSpeed for the CPU)
import deepspeed
import torch
import torch.distributed as dist

from snapckpt.deepspeed import DeepSpeedCheckpointer, StorageType

TAG2 = "tag with space:ü"


def tree(root):
    """Files below ``root`` without snapckpt's own ``.snapckpt`` sidecars."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != ".snapckpt"]
        out += [os.path.relpath(os.path.join(d, f), root) for f in files]
    return sorted(out)


def step_loss(engine, step):
    torch.manual_seed(77)
    return ds_common.train_step(engine, step)


def run(root, cfg):
    parts = cfg.split(":")
    stage, dtype, frozen = int(parts[0]), parts[1], "frozen" in parts[2:]
    base = os.path.join(root, cfg.replace(":", "_"))
    native, snap = os.path.join(base, "native"), os.path.join(base, "snap")
    rank = dist.get_rank()

    engine = ds_common.build(stage, dtype, frozen=frozen)
    for s in (1, 2):
        ds_common.train_step(engine, s)
    engine.save_checkpoint(native, tag="global_step2", exclude_frozen_parameters=frozen)
    engine.save_checkpoint(native, tag=TAG2, exclude_frozen_parameters=frozen)
    ck = DeepSpeedCheckpointer(engine, snap, persister_idle_timeout_secs=30)
    ck.save_checkpoint(snap, tag="global_step2", exclude_frozen_parameters=frozen)
    ck.save_checkpoint(snap, tag=TAG2, exclude_frozen_parameters=frozen, storage_type=StorageType.DISK)
    ck.wait()
    ck.close()
    assert type(engine.checkpoint_engine).__name__ != "SnapckptCheckpointEngine"  # given back on close
    ref_loss = step_loss(engine, 3)
    dist.barrier()

    if rank == 0:
        diffs = []
        if tree(native) != tree(snap):
            diffs.append(f"file sets differ: native {tree(native)} snapckpt {tree(snap)}")
        else:
            for rel in tree(native):
                ma, mb = (stat.S_IMODE(os.stat(os.path.join(d, rel)).st_mode) for d in (native, snap))
                if ma != mb:  # DeepSpeed makes zero_to_fp32.py executable
                    diffs.append(f"{rel}: mode native {ma:o} snapckpt {mb:o}")
                if rel.endswith(".pt"):
                    a = torch.load(os.path.join(native, rel), weights_only=False)
                    b = torch.load(os.path.join(snap, rel), weights_only=False)
                    d = ds_common.same(a, b, rel)
                    if d:
                        diffs.append(d)
                elif rel != "latest":
                    if open(os.path.join(native, rel), "rb").read() != open(os.path.join(snap, rel), "rb").read():
                        diffs.append(f"{rel} differs")
        latest = open(os.path.join(snap, "latest")).read()
        module_keys = sorted(torch.load(os.path.join(snap, "global_step2", ds_common.model_file(stage)),
                                        weights_only=False)["module"])
        print("RESULT " + json.dumps({"cfg": cfg, "check": "files", "diffs": diffs, "files": tree(snap),
                                      "latest": latest, "module_keys": module_keys}), flush=True)

    # snapckpt -> stock DeepSpeed
    e2 = ds_common.build(stage, dtype, frozen=frozen)
    path, client = e2.load_checkpoint(snap, tag="global_step2", load_module_strict=not frozen)
    loss2 = step_loss(e2, 3)
    print("RESULT " + json.dumps({"cfg": cfg, "check": "stock_load", "rank": rank, "ok": path is not None,
                                  "equal": loss2 == ref_loss, "losses": [ref_loss, loss2]}), flush=True)

    # native -> snapckpt (no manifest: DeepSpeed's own latest names the tag)
    e3 = ds_common.build(stage, dtype, frozen=frozen)
    with DeepSpeedCheckpointer(e3, native, persister_idle_timeout_secs=30) as ck3:
        path3, _ = ck3.load_checkpoint(native, load_module_strict=not frozen)
        loss3 = step_loss(e3, 3)
    print("RESULT " + json.dumps({"cfg": cfg, "check": "snap_load_native", "rank": rank, "path": path3,
                                  "equal": loss3 == ref_loss, "losses": [ref_loss, loss3]}), flush=True)

    if stage == 3 and not frozen and dtype == "fp32":
        # one flipped byte in rank 1's file of TAG2: under ZeRO-3 DeepSpeed's loader runs collectives, so
        # rank 0 must not enter it alone (a hang); every rank refuses the tag with the cause
        dist.barrier()
        if rank == 1:
            victim = os.path.join(snap, TAG2, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
            with open(victim, "r+b") as f:
                f.seek(os.path.getsize(victim) // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0xFF]))
        dist.barrier()
        e4 = ds_common.build(stage, dtype)
        with DeepSpeedCheckpointer(e4, snap, persister_idle_timeout_secs=30) as ck4:
            try:
                ck4.load_checkpoint(snap, tag=TAG2)
                err = None
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
            path4, _ = ck4.load_checkpoint(snap, tag="global_step2")
            loss4 = step_loss(e4, 3)
        print("RESULT " + json.dumps({"cfg": cfg, "check": "zero3_damaged_tag", "rank": rank, "error": err,
                                      "equal": loss4 == ref_loss}), flush=True)

    if stage > 0 and rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        a = get_fp32_state_dict_from_zero_checkpoint(native, tag="global_step2")
        b = get_fp32_state_dict_from_zero_checkpoint(snap, tag="global_step2")
        print("RESULT " + json.dumps({"cfg": cfg, "check": "zero_to_fp32", "keys": sorted(b),
                                      "diff": ds_common.same(dict(a), dict(b))}), flush=True)
    dist.barrier()


def main():
    root, cfgs = sys.argv[1], sys.argv[2].split(",")
    deepspeed.init_distributed(dist_backend="gloo")
    for cfg in cfgs:
        run(root, cfg)
    ds_common.exit_after_barrier()


if __name__ == "__main__":
    main()
