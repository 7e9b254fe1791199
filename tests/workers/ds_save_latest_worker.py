"""``save_latest=False`` under retention: the tag ``latest`` names survives ``keep_last=1``.

Usage: ds_save_latest_worker.py CKPT NATIVE_DIR   (1 rank)
The same three saves (tag a with save_latest, then b and c without) go through snapckpt with keep_last=1 into
CKPT and through DeepSpeed's own engine into NATIVE_DIR; stock ``engine.load_checkpoint(dir)`` (tag None:
DeepSpeed reads ``latest``) of a fresh engine then loads each directory. Prints one ``RESULT {...}`` line.
"""
import json
import os
import sys

import ds_common
import deepspeed

from snapckpt.deepspeed import DeepSpeedCheckpointer


def three_saves(engine, save) -> None:
    for step, (tag, latest) in enumerate([("a", True), ("b", False), ("c", False)], start=1):
        ds_common.train_step(engine, step)
        save(tag, latest)


def stock_load(path: str):
    """What a fresh engine's own ``load_checkpoint(path)`` loads: the tag's basename, or the error."""
    engine = ds_common.build(1, "fp32")
    try:
        load_path, _ = engine.load_checkpoint(path)
    except Exception as e:  # stock DeepSpeed fails on a tag that is gone with a bare AssertionError
        return f"{type(e).__name__}: {e}"
    return None if load_path is None else os.path.basename(os.path.dirname(load_path) or load_path)


def main():
    ckpt, native = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    engine = ds_common.build(1, "fp32")
    with DeepSpeedCheckpointer(engine, ckpt, keep_last=1, persister_idle_timeout_secs=30) as ck:
        def save(tag, latest):
            ck.save_checkpoint(ckpt, tag=tag, save_latest=latest)
            ck.wait()
        three_saves(engine, save)
    engine = ds_common.build(1, "fp32")
    three_saves(engine, lambda tag, latest: engine.save_checkpoint(native, tag=tag, save_latest=latest))
    for name, path in (("snapckpt", ckpt), ("native", native)):
        out[f"{name}_latest"] = open(os.path.join(path, "latest")).read().strip()
        out[f"{name}_tags"] = sorted(t for t in "abc" if os.path.isdir(os.path.join(path, t)))
        out[f"{name}_stock_load"] = stock_load(path)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
