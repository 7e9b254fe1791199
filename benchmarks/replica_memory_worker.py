"""Rank process of ``benchmarks/replica_memory.py``, run under torchrun on a node of the test rig.

``replica_memory_worker.py CKPT_DIR --mib M --saves K --replicas R``: a state of one float32 tensor of ``M``
MiB, ``K`` memory snapshots (steps 1..K, the tensor changed between them), then ``SAVED K rank R`` and sleep
until killed (the parent measures the node's memory meanwhile).
"""
import argparse
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt_dir")
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--saves", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from snapckpt import Checkpointer, StorageType

    state = {"w": torch.randn(a.mib << 18, generator=torch.Generator().manual_seed(dist.get_rank()))}
    ck = Checkpointer(a.ckpt_dir, replicas=a.replicas)
    for step in range(1, a.saves + 1):
        state["w"].add_(1.0)
        ck.save(state, step, StorageType.MEMORY)
    print(f"SAVED {a.saves} rank {dist.get_rank()}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
