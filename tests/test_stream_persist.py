"""Streamed DISK saves (issue 18): the persister writes a rank's part while the rank still copies into its
slot (snapckpt/persister/stream.py). A streamed save round-trips whole, with ``overlap`` off and on; a rank
killed halfway through its copy leaves no committed step and no partial directory, and the previous
checkpoint loads. The writer's own rule (never a byte past the watermark) is tests/unit/test_stream_write.py."""
from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch

from _harness import finish, launch, result_lines, wait_until
from faults import point_env, verify_all
from snapckpt import Checkpointer, StorageType
from snapckpt.ondisk.manifest import list_committed
from snapckpt.storage import PosixStorage

MiB = 1 << 20


def _state(seed: int) -> dict:
    """A large tensor (copied and written in pieces), small ones (batched), two views of one storage (a span
    copied as bytes), a Parameter, an optimizer-like nesting and plain values."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(1 << 20, generator=g)
    return {"big": torch.rand(45 * MiB // 4, generator=g), "views": [base[:3000], base[1000:]],
            "w": torch.nn.Parameter(torch.rand(256, 1024, generator=g)),
            "opt": {i: {"exp_avg": torch.rand(3000, generator=g), "step": torch.tensor(float(i))} for i in range(20)},
            "epoch": seed, "name": "s"}


def _log(ck: Checkpointer) -> str:
    with open(ck._session.client.log_path) as f:
        return f.read()


@pytest.fixture(autouse=True)
def _streamed(monkeypatch):
    """Streaming is opt-in (``SNAPCKPT_STREAM_PERSIST=1``); launched workers inherit it through os.environ."""
    monkeypatch.setenv("SNAPCKPT_STREAM_PERSIST", "1")


@pytest.mark.parametrize("overlap", [False, True])
def test_streamed_disk_save_round_trips(snap_env, overlap):
    """Three DISK saves of changing states: each is streamed (the persister's log says so), commits, verifies
    (sizes and checksums of the manifest), loads with plain ``torch.load`` and through the Checkpointer from disk
    equal to the state saved, views still sharing their storage."""
    with Checkpointer(snap_env.ckpt_dir, overlap=overlap, keep_last=3) as ck:
        for step in (1, 2, 3):
            ck.save(_state(step), step, storage_type=StorageType.DISK)
            ck.fence()
        ck.wait()
        log = _log(ck)
    streamed = re.findall(r"rank 0 step (\d+): part written.*streamed, copy done at", log)
    assert streamed == ["1", "2", "3"], log
    assert [c.step for c in list_committed(PosixStorage(), snap_env.ckpt_dir)] == [1, 2, 3]
    assert verify_all(snap_env.ckpt_dir) == [], "a committed checkpoint does not verify"
    for step in (1, 2, 3):
        plain = torch.load(os.path.join(snap_env.ckpt_dir, f"step_{step:08d}", "rank_00000.pt"), weights_only=True)
        expected = _state(step)
        assert torch.equal(plain["big"], expected["big"]) and torch.equal(plain["w"], expected["w"])
        assert all(torch.equal(a, b) for a, b in zip(plain["views"], expected["views"]))
        assert plain["views"][0].untyped_storage().data_ptr() == plain["views"][1].untyped_storage().data_ptr()
        assert all(torch.equal(plain["opt"][i]["exp_avg"], expected["opt"][i]["exp_avg"]) for i in range(20))
        assert (plain["epoch"], plain["name"]) == (step, "s")
    target = _state(0)
    # the old persister exits once its last client closed; until then a new Checkpointer would find its memory tier
    assert wait_until(lambda: not snap_env.persisters(), timeout=60), "the persister did not exit after close()"
    with Checkpointer(snap_env.ckpt_dir) as ck:  # a new persister: the disk tier
        ck.load(target)
        assert (ck.last_load.step, ck.last_load.tier.name) == (3, "DISK")
    assert torch.equal(target["big"], _state(3)["big"]) and target["epoch"] == 3


def test_rank_killed_mid_streamed_copy_leaves_no_commit(snap_env):
    """Step 1 is committed; the rank is SIGKILLed halfway through copying step 2 while the persister writes
    step 2's part. Right: the persister's writer stops (it names the rank that died mid-copy), step 2 is never
    committed and its partial directory is removed, the tracker still names step 1, and a new job loads step
    1 (from the surviving persister's memory, and from disk once that persister is gone)."""
    snap_env.leftover_ok = True
    env = {**snap_env.env, **point_env("snapshot.mid_copy", step=2), "SNAPCKPT_FAULT_WRITE_DELAY_SECS": "0.001"}
    procs = launch("stream_worker.py", 1, ["die_mid_copy", snap_env.ckpt_dir], env)
    (out,) = finish(procs, 120)
    assert procs[0].returncode == -signal.SIGKILL, f"the fault point did not fire:\n{out}"
    first = json.loads(result_lines(out)[0])
    assert first["committed"] == 1
    ckpt = snap_env.ckpt_dir

    def settled() -> bool:
        names = os.listdir(ckpt)
        return not [n for n in names if n.startswith(".") and "step_00000002" in n] and "step_00000002" not in names

    log_path = os.path.join(snap_env.runtime_root, f"snapckpt-{os.getuid()}")
    logs = lambda: "".join(open(os.path.join(r, f)).read() for r, _, fs in os.walk(log_path)  # noqa: E731
                           for f in fs if f == "persister.log")
    assert wait_until(lambda: "rank 0 step 2: writing the part failed" in logs(), timeout=60), logs()
    assert re.search(r"rank 0 step 2: writing the part failed: rank 0 left \(its process died\) while copying "
                     r"its snapshot of step 2", logs()), logs()
    assert wait_until(settled, timeout=60), sorted(os.listdir(ckpt))
    assert [c.step for c in list_committed(PosixStorage(), ckpt)] == [1]
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == "step_00000001"
    assert verify_all(ckpt) == []
    target = {f"t{i}": torch.zeros(6 << 20) for i in range(4)} | {"step": 0}
    with Checkpointer(ckpt) as ck:
        ck.load(target)
        assert ck.last_load.step == 1, ck.last_load
    assert all(torch.equal(target[f"t{i}"], torch.full((6 << 20,), 1.0)) for i in range(4)) and target["step"] == 1
