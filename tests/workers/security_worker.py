"""Worker for tests/test_security.py: one rank, started by ``_harness.run_ranks``.

Mode ``ds_tags CKPT TMP``: a tiny DeepSpeed engine (ZeRO-1, fp32) saves three odd tags to disk and loads
each back by ``tag=``; bad tags are tried; then a malicious pickle (it would create ``TMP/PWNED``) replaces
the RNG sidecar of one tag (size and CRC-32 re-recorded in the manifest) and that tag is loaded. Prints one
``RESULT {...}`` line.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_common  # noqa: E402
import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import xxhash  # noqa: E402

from snapckpt.deepspeed import DeepSpeedCheckpointer, StorageType  # noqa: E402

TAGS = ["run 1: (a) {b} ]", "ünï 步 🚀", "x:y=z"]
BAD = ["../x", "/abs", "a/b", "a\x00b", ".hidden", "[x", "..", "latest"]


class Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def ds_tags(ckpt: str, tmp: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    engine = ds_common.build(1, "fp32")
    marker = os.path.join(tmp, "PWNED")
    out = {"tags": TAGS, "loaded": [], "refused": {}}
    outside_before = sorted(os.listdir(os.path.dirname(ckpt))) if os.path.isdir(os.path.dirname(ckpt)) else []
    with DeepSpeedCheckpointer(engine, ckpt, persister_idle_timeout_secs=30, fsync=False) as ck:
        want = {}
        for i, tag in enumerate(TAGS):
            ds_common.train_step(engine, i)
            ck.save_checkpoint(ckpt, tag=tag, storage_type=StorageType.DISK)
            want[tag] = ds_common.full_params(engine)
        ck.wait()
        for bad in BAD:
            try:
                ck.save_checkpoint(ckpt, tag=bad)
                out["refused"][bad] = None
            except ValueError as e:
                out["refused"][bad] = str(e)
        out["load_refused"] = {}
        for bad in ("../" + os.path.basename(ckpt), "/abs", "a/b", "a\x00b"):
            try:
                ck.load_checkpoint(ckpt, tag=bad)
                out["load_refused"][bad] = None
            except ValueError as e:
                out["load_refused"][bad] = str(e)
        for tag in TAGS:
            ds_common.train_step(engine, 9)  # change the weights, then load the tag back
            path, _ = ck.load_checkpoint(ckpt, tag=tag)
            got = ds_common.full_params(engine)
            if path and all(torch.equal(got[k], want[tag][k]) for k in got):
                out["loaded"].append(tag)
        side = os.path.join(ckpt, TAGS[0], ".snapckpt", "deepspeed_rank_00000.pt")
        torch.save({"tag": TAGS[0], "rng": Boom(marker)}, side)
        mpath = os.path.join(ckpt, TAGS[0], ".snapckpt", "manifest.json")
        with open(mpath) as f:
            m = json.load(f)
        data = open(side, "rb").read()
        m["files"][".snapckpt/deepspeed_rank_00000.pt"].update(nbytes=len(data),
                                                                xxh3_64=xxhash.xxh3_64(data).hexdigest())
        with open(mpath, "w") as f:
            json.dump(m, f)
        try:
            ck.load_checkpoint(ckpt, tag=TAGS[0])
            out["sidecar"] = {"type": None, "message": "loaded"}
        except Exception as e:  # noqa: BLE001
            out["sidecar"] = {"type": type(e).__name__, "message": str(e)}
    outside_after = sorted(os.listdir(os.path.dirname(ckpt)))
    out["outside_unchanged"] = [n for n in outside_after if n not in outside_before] in ([], [os.path.basename(ckpt)])
    out["marker_exists"] = os.path.exists(marker)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "ds_tags":
        ds_tags(*args)
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.destroy_process_group()
