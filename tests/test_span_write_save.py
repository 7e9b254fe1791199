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


def test_an_in_process_load_split_among_threads_reads_a_part_whose_thread_cannot_start_on_the_calling_one(
        snap_env, monkeypatch):
    """A read-back split among threads (snapckpt.engine.span_read.vectored_calls) where a thread cannot be started
    (a process or cgroup limit on threads): the calling thread reads that part, the load is bit-exact and raises
    nothing (it raised, with the started threads left writing into the live tensors)."""
    from faults import refuse_thread_starts

    from snapckpt.engine import slot_restore, span_read

    read = []
    real_back = slot_restore.read_back
    monkeypatch.setattr(slot_restore, "read_back", lambda fd, w: read.append((real_back(fd, w), len(w.pos)))
                        or read[-1][0])
    state = {f"p{i}": torch.rand(1 + i % 300) for i in range(4000)}
    with Checkpointer(snap_env.ckpt_dir, persister_idle_timeout_secs=5) as ck:
        ck.save(state, 1, StorageType.MEMORY).wait()
        want = {k: v.clone() for k, v in state.items()}
        for v in state.values():
            v.view(torch.uint8).fill_(0x5A)
        monkeypatch.setattr(span_read, "SPLIT_NBYTES", 1)  # every call its own part's worth: three parts
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
        started = refuse_thread_starts(monkeypatch, "snapckpt-span-read")
        ck.load(state)
        assert read and read[-1][0] == read[-1][1]  # every span by preadv: one part on the thread that started
        assert len(started) == 1 and not started[0].is_alive()
        for k, v in want.items():
            assert torch.equal(state[k].view(torch.uint8), v.view(torch.uint8)), k
