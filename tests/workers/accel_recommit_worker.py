"""Worker for tests/test_accelerate_recommit_race.py: ``AcceleratorCheckpointer.load_state()`` while the job saving
into the directory commits the newest folder again (a save after a rewind swaps a new copy of ``checkpoint_2``
into place) after snapckpt verified it and before ``accelerator.load_state`` reads it by path.

Usage: ``accel_recommit_worker.py save OUT GEN`` saves ``checkpoint_1`` and ``checkpoint_2`` (DISK) with every
weight set to ``GEN * 100 + step``; ``accel_recommit_worker.py load OUT NEW_COPY`` loads, swapping
``NEW_COPY`` (another commit of ``checkpoint_2``, with a damaged byte) in just before accelerate reads. Prints
``RESULT {json}``: the folder loaded and the distinct weight values.
"""
import json
import os
import shutil
import sys

import torch
from accelerate import Accelerator

from snapckpt.hf import AcceleratorCheckpointer


def setup():
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model


def save(out: str, gen: str) -> None:
    acc, model = setup()
    ck = AcceleratorCheckpointer(acc, out, persister_idle_timeout_secs=2)
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(int(gen) * 100 + step))
        ck.save_state(step).wait()
    ck.close()


def flip_a_byte(folder: str) -> None:
    """Damage the largest file of ``folder`` in place (size kept), in its second half (tensor data)."""
    name = max((n for n in os.listdir(folder) if n != ".snapckpt"),
               key=lambda n: os.path.getsize(os.path.join(folder, n)))
    path = os.path.join(folder, name)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def load(out: str, new_copy: str) -> None:
    acc, model = setup()
    real = acc.load_state
    swapped = []

    def load_state(path, *a, **kw):  # the owner's re-commit lands after snapckpt's check, before accelerate reads
        if os.path.basename(path) == "checkpoint_2" and not swapped:
            swapped.append(True)
            tmp = os.path.join(out, ".checkpoint_2.incoming")
            shutil.copytree(new_copy, tmp)
            flip_a_byte(tmp)
            os.rename(path, os.path.join(out, ".checkpoint_2.replaced-other"))
            os.rename(tmp, path)
        return real(path, *a, **kw)

    acc.load_state = load_state
    ck = AcceleratorCheckpointer(acc, out, persister_idle_timeout_secs=2)
    try:
        path = ck.load_state()
        res = {"loaded": os.path.basename(path),
               "values": sorted({float(v) for p in model.parameters() for v in p.detach().flatten()})[:8]}
    except Exception as e:
        res = {"raised": type(e).__name__, "error": str(e)[:800]}
    res["swapped"] = bool(swapped)
    print("RESULT " + json.dumps(res), flush=True)
    ck.close()


if __name__ == "__main__":
    {"save": save, "load": load}[sys.argv[1]](*sys.argv[2:])
