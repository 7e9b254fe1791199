"""A Checkpointer's memory save of many small tensors writes them into its slot by pwritev of the slot file
(snapckpt/engine/span_write.py) and loads back bit for bit, with and without the copy thread (``overlap``); the
in-place load after it reads what pwritev wrote through the mapping."""
from __future__ import annotations

import pytest
import torch

from snapckpt import Checkpointer, StorageType
from snapckpt.engine import stager as stager_mod


@pytest.mark.parametrize("overlap", [False, True])
def test_a_memory_save_of_many_small_tensors_is_written_by_pwritev_and_loads_back(snap_env, monkeypatch, overlap):
    written = []
    real = stager_mod.write_spans
    monkeypatch.setattr(stager_mod, "write_spans", lambda *a: written.append(real(*a)) or written[-1])
    state = {f"p{i}": torch.rand(1 + i % 300) for i in range(2000)}
    state["big"] = torch.rand(1 << 16)
    with Checkpointer(snap_env.ckpt_dir, overlap=overlap, persister_idle_timeout_secs=5) as ck:
        for step in (1, 2):
            for v in state.values():
                v.add_(1)
            want = {k: v.clone() for k, v in state.items()}
            ck.save(state, step, StorageType.MEMORY).wait()
            for v in state.values():
                v.mul_(-1)  # changed after the save: the snapshot holds the values at save time
            assert written and written[-1] == 2000
            got = ck.load()
            assert ck.last_load.tier == StorageType.MEMORY and got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)
            ck.load(state)  # in place, from the slot's mapping
            assert all(torch.equal(state[k], want[k]) for k in want)
