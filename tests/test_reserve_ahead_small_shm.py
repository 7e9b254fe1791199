"""A wrong ``expected_nbytes`` guess in a shared-memory directory that just holds the state's two slots (case D1
with the reservation ahead): "a wrong guess costs nothing but the reservation; a larger state regrows the slot
at the save, as without it" (``CheckpointOptions.expected_nbytes``)."""
from __future__ import annotations

import os

import torch

from _harness import wait_until
from faults import small_shm
from snapckpt import Checkpointer


def _save_three_steps_and_load_the_last(ck) -> None:
    """Three DISK saves of a 30 MiB state (each waited for), then the newest loads whole."""
    for step in (1, 2, 3):
        state = {"a": torch.full((30 << 18,), float(step)), "step": step}
        ck.save(state, step).wait()
    out = ck.load()
    assert out["step"] == 3 and bool((out["a"] == 3).all())


def test_D1_too_small_expected_nbytes_then_a_state_that_fits_two_slots_saves(snap_env, tmp_path):
    """A 64 MiB tmpfs; the slots are reserved ahead at a guess of 20 MiB (two 22 MiB files); the state is
    30 MiB: two 31.5 MiB slots fit in 64 MiB, as they do without the guess. Before the fix the capacity check
    counted the other slot's finished background reservation as still to be reserved in full (its size was
    taken only when that slot was handed out), so every save of the job failed with
    ``InsufficientSharedMemoryError``."""
    shm = str(tmp_path / "shm")
    with small_shm(shm, 64 << 20):
        ck = Checkpointer(snap_env.ckpt_dir, shm_dir=shm, expected_nbytes=20 << 20, persister_idle_timeout_secs=5)
        try:
            def reserved():
                files = [os.path.join(r, n) for r, _, ns in os.walk(shm) for n in ns]
                return len(files) == 2 and all(os.path.getsize(f) >= 20 << 20 for f in files)

            assert wait_until(reserved, timeout=60), "the slots were never reserved ahead"
            _save_three_steps_and_load_the_last(ck)
        finally:
            ck.close()


def test_D1_too_large_expected_nbytes_reserves_nothing_and_a_state_that_fits_two_slots_saves(snap_env, tmp_path):
    """A 64 MiB tmpfs; a guess of 40 MiB: two 43 MiB slots do not fit. Before the fix the reservation grew
    the one slot that fitted (43 MiB) anyway; the 30 MiB state's first save took it, and every later save
    failed with ``InsufficientSharedMemoryError`` (the second slot, 31.5 MiB, no longer fitted beside it), while
    without the guess both 31.5 MiB slots fit. Right: an arena of the guessed size that does not fit is not
    reserved (a warning says so), and the saves size the slots to the state."""
    shm = str(tmp_path / "shm")
    with small_shm(shm, 64 << 20):
        ck = Checkpointer(snap_env.ckpt_dir, shm_dir=shm, expected_nbytes=40 << 20, persister_idle_timeout_secs=5)
        try:
            _save_three_steps_and_load_the_last(ck)
        finally:
            ck.close()
