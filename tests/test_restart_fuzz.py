"""A restarted rank's memory load (a new Checkpointer: its Stager fresh, so the slot is recognised by its plain
digest, snapckpt.engine.plain_restore) into live states whose structure was changed in one of many ways from the
saved one (tests/unit/test_plain_restore_fuzz.py's changes): when the load goes by the digest, the live state is
the saved one bit for bit; otherwise the general path decides (its values, or a clear error). Seeded."""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from snapckpt import Checkpointer, StorageType
from snapckpt.engine import plain_restore
from snapckpt.errors import SnapckptError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "unit"))
import test_plain_restore_fuzz as fz  # noqa: E402 - the states and changes of the unit property test


def test_a_restarted_load_by_the_digest_never_gives_other_values(snap_env, monkeypatch):
    ran = []
    real_run = plain_restore.PlainCopies.run

    def run(self):
        ran.append(True)
        real_run(self)

    monkeypatch.setattr(plain_restore.PlainCopies, "run", run)
    by_digest = 0
    for seed in range(24):
        rng, saved = fz._case(1000 + seed)
        mseed = rng.getrandbits(32)
        live = fz._relive(saved)
        change = fz._mutate(live, random.Random(mseed)) if seed % 4 else ""  # every 4th: the saved structure
        path = os.path.join(snap_env.ckpt_dir, str(seed))
        ck = Checkpointer(path, keep_last=2)
        ck.save(saved, 1, StorageType.MEMORY).wait()
        ck.close(clean=False)  # a crashed rank: the persister keeps the snapshot
        ran.clear()
        with Checkpointer(path, keep_last=2) as ck2:
            try:
                ck2.load(live)
            except SnapckptError:
                assert not ran  # a refusal of the general path, after no copy by the digest
                continue
        if ran:
            by_digest += 1
            if change != "overlap":
                assert fz._equal(saved, live), (change, saved, live)
        else:
            assert change, f"the saved structure was not restored by the digest: {saved}"
    assert by_digest >= 6
