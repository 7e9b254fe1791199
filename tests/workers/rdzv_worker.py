"""The smallest job with a rendezvous (tests/test_harness_ports.py): ``init_process_group("gloo")`` (env://,
from ``_harness.launch`` or torchrun), one all-reduce of ``rank + 1``, then ``RESULT <sum>`` on every rank."""
import os

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    os.write(1, f"RESULT {int(t.item())}\n".encode())  # one write: torchrun's ranks share the stream
    dist.destroy_process_group()
