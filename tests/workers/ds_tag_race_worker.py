"""Worker for tests/test_load_tag_race.py: ``engine.load_checkpoint(dir, tag=T)`` through snapckpt while the job
that owns the directory retires (retention) or re-commits tag ``T``: the directory vanishes right after the
loader's first look at the tag (its first ``stat`` of the directory or of a path in it, whatever the check).

Usage: ``ds_tag_race_worker.py CKPT WHAT`` (WHAT: ``retired`` renames the tag's directory away as retention does;
``recommitted`` moves it aside at that first look and, at the next, puts another copy in place, as the two
renames of a re-commit do; that copy has a damaged byte, so a load that skipped its manifest check shows).
Prints ``RESULT {json}``: what ``load_checkpoint`` returned or raised.
"""
import json
import os
import shutil
import struct
import sys

import ds_common
import deepspeed
import torch.distributed as dist

import snapckpt.integrations.deepspeed.load as ds_load
from snapckpt.deepspeed import DeepSpeedCheckpointer

TAG = "t2"


def flip_a_byte(d: str) -> None:
    """Damage the model states file of directory ``d`` in place (its size kept): a byte of its tensor data."""
    name = next(n for n in sorted(os.listdir(d)) if n.endswith("model_states.pt"))
    with open(os.path.join(d, name), "r+b") as f:
        import zipfile
        with zipfile.ZipFile(f) as z:
            info = max(z.infolist(), key=lambda i: i.file_size)  # the largest tensor storage
        f.seek(info.header_offset + 26)
        n, m = struct.unpack("<HH", f.read(4))  # the local header's name and extra lengths
        f.seek(info.header_offset + 30 + n + m + info.file_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def main(ckpt: str, what: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    engine = ds_common.build(1, "fp32")
    with DeepSpeedCheckpointer(engine, ckpt, persister_idle_timeout_secs=5) as ck:
        for step, tag in ((1, "t1"), (2, TAG)):
            ds_common.train_step(engine, step)
            ck.save_checkpoint(ckpt, tag=tag)
            ck.wait()
    engine = ds_common.build(1, "fp32")
    tagdir, aside = os.path.join(ckpt, TAG), os.path.join(ckpt, f".{TAG}.deleted-other")
    real_stat = os.stat
    armed, restore = [], []

    def validate(name, *a, **kw):  # the loader's first step on the tag: arm the race
        armed.append(True)
        return real_validate(name, *a, **kw)

    def stat(p, *a, **kw):  # os.path.isdir/exists/isfile all stat: the loader's first look at the tag
        mine = isinstance(p, (str, os.PathLike)) and (os.fspath(p) + os.sep).startswith(tagdir + os.sep)
        try:
            return real_stat(p, *a, **kw)
        finally:
            if mine and restore:
                restore.clear()
                os.rename(tagdir + ".incoming", tagdir)  # the re-commit's second rename: a damaged copy
            elif mine and armed:
                armed.clear()
                os.rename(tagdir, aside)  # retention, or the first rename of a re-commit, lands here
                if what == "recommitted":
                    shutil.copytree(aside, tagdir + ".incoming")
                    flip_a_byte(tagdir + ".incoming")
                    restore.append(True)

    real_validate = ds_load.validate_dirname
    ds_load.validate_dirname = validate
    os.stat = stat
    try:
        with DeepSpeedCheckpointer(engine, ckpt, persister_idle_timeout_secs=5) as ck:
            try:
                path, client = ck.load_checkpoint(ckpt, tag=TAG)
                out = {"returned": [path, client is not None]}
            except Exception as e:
                out = {"raised": type(e).__name__, "error": str(e)[:600]}
    finally:
        os.stat = real_stat
    out["rank"] = dist.get_rank()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
