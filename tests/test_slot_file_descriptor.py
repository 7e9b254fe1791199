"""The slot file's descriptor that a save's pwritev uses (snapckpt/engine/span_write.py ``SlotFile``, kept with its
mapping): a Checkpointer's saves keep the count of descriptors flat, a program it starts gets none of them, and none
is left after close (contract 10); a forked child that closes its copy of a mapping leaves the parent's descriptor
open and writing. Starts processes: not a unit test."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from _harness import SlotOnFile
from snapckpt import Checkpointer, StorageType
from snapckpt.engine import stager as stager_mod
from snapckpt.engine.stager import Stager

def _slot_fds(shm_root: str) -> list:
    """The targets of this process's descriptors that are files under ``shm_root`` (the slot files)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed meanwhile
            continue
        if target.startswith(shm_root):
            out.append(target)
    return out


def test_a_checkpointers_slot_file_descriptors_stay_flat_reach_no_child_and_close_with_it(snap_env, monkeypatch):
    written = []
    real = stager_mod.write_spans
    monkeypatch.setattr(stager_mod, "write_spans", lambda *a: written.append(real(*a)) or written[-1])
    state = {f"p{i}": torch.rand(1 + i % 300) for i in range(2000)}
    counts = []
    with Checkpointer(snap_env.ckpt_dir, persister_idle_timeout_secs=5) as ck:
        for step in range(1, 9):
            ck.save(state, step, StorageType.MEMORY).wait()
            counts.append(len(_slot_fds(snap_env.shm_root)))
        assert written == [2000] * 8  # every save wrote its small tensors by file
        assert counts[-1] > 0 and counts[-4:] == [counts[-1]] * 4, counts  # each slot's once, then no more
        child = subprocess.run([sys.executable, __file__, snap_env.shm_root], close_fds=False, capture_output=True,
                               text=True, check=True).stdout.split()
        assert child == [] and len(_slot_fds(snap_env.shm_root)) == counts[-1]
    assert _slot_fds(snap_env.shm_root) == []


def test_a_forked_childs_close_of_a_mapping_leaves_the_parents_descriptor(tmp_path, monkeypatch):
    written = []
    real = stager_mod.write_spans
    monkeypatch.setattr(stager_mod, "write_spans", lambda *a: written.append(real(*a)) or written[-1])
    state = {f"p{i}": torch.rand(1 + i % 40) for i in range(600)}
    st = Stager()
    s = SlotOnFile(tmp_path / "slot", (st.prepare({"r.pt": state}, 1).total_nbytes // 4096 + 2) * 4096)
    m = s.m
    s.save(st, state, 1)
    assert m.file.is_open and written == [600]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        m.close()
        os._exit(0 if not m.file.is_open else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    for v in state.values():
        v.add_(1)
    p = s.save(st, state, 2)
    assert m.file.is_open and written == [600, 600]
    for t, (off, _d, _s, _st) in zip(p.direct, p.layout.direct_dst):
        assert torch.equal(m.tensor[off:off + t.nbytes], t.view(torch.uint8))
    m.close()
    assert not m.file.is_open


if __name__ == "__main__":  # the child of the first test: its own descriptors of slot files, one a line
    print("\n".join(_slot_fds(sys.argv[1])))
