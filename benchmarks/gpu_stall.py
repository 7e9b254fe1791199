"""GPU stall benchmark: how long a training thread is blocked by a checkpoint of CUDA state.

Run on a CUDA machine (``benchmarks/gpu_check.sh`` does). The state is ``benchmarks/_common.make_state``
moved to the GPU (model + AdamW-like tensors, fp32). Methods, each with one warm-up then ``--repeats``
timed checkpoints (medians reported; snapckpt methods warm up with two saves, one per arena slot, since a
slot is page-locked at its first use):

- ``memcpy_pinned``: one ``cudaMemcpyAsync`` (a ``copy_(non_blocking=True)`` of one flat device buffer) of all
  the state's bytes into ``cudaHostAlloc``'ed memory: the D2H bandwidth of this machine (issue 18's reference
  for "pinned-memory D2H bandwidth", target >= 80% of it);
- ``memcpy_shm_registered``: the same into a ``/dev/shm`` file mapping page-locked with ``cudaHostRegister``,
  the kind of memory the arena is;
- ``floor_pinned_copy``: ``copy_(non_blocking=True)`` of every tensor into a page-locked host buffer
  allocated once, then ``torch.cuda.synchronize()``: the PCIe lower bound for any host snapshot;
- ``floor_pageable_copy``: the same into ordinary (pageable) host memory: what a plain ``.cpu()`` costs;
- ``torch_save``: ``torch.save`` of the CUDA state + fsync (the synchronous native save);
- ``snapckpt_memory`` / ``snapckpt_disk``: ``save`` + ``fence`` with ``overlap=False`` (blocking = the
  copy into the registered arena), and ``snapckpt_memory_overlap``: ``overlap=True``, where the blocking
  time is ``save`` alone and the fence is measured after a simulated 0.3 s of GPU compute.

Output: a JSON file and a markdown table (``--out``). No assertion on any time.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GiB, git_commit, iter_tensors, make_state, write_results  # noqa: E402

from snapckpt import Checkpointer, StorageType  # noqa: E402


def _to_cuda(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cuda()
    if isinstance(obj, dict):
        return {k: _to_cuda(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cuda(v) for v in obj)
    return obj


def _busy_gpu(seconds: float) -> None:
    """Queue about ``seconds`` of matmuls on the current stream (a stand-in for forward and backward)."""
    # the compute stream only: torch.cuda.synchronize() would also wait for the side-stream snapshot copy
    compute = torch.cuda.current_stream()
    a = torch.randn(4096, 4096, device="cuda")
    compute.synchronize()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        a = (a @ a).tanh_()
        n += 1
        if n % 8 == 0:
            compute.synchronize()


def bench(state, method: str, repeats: int, scratch: str) -> dict:
    tensors = list(iter_tensors(state))
    samples = []
    if method.startswith("floor"):
        pinned = method == "floor_pinned_copy"
        bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]
        for i in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for b, t in zip(bufs, tensors):
                b.copy_(t, non_blocking=pinned)
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        b = statistics.median(samples[1:])
        total = sum(t.numel() * t.element_size() for t in tensors)
        return {"blocking_s": b, "warmup_s": samples[0], "gbps": total / b / 1e9}
    if method.startswith("memcpy"):
        # One cudaMemcpyAsync of all the bytes (one flat device buffer): the D2H bandwidth the issue's
        # "pinned-memory D2H bandwidth against cudaMemcpyAsync of the same bytes" compares with.
        total = sum(t.numel() * t.element_size() for t in tensors)
        dev = torch.empty(total, dtype=torch.uint8, device="cuda")
        dev.fill_(7)
        if method == "memcpy_pinned":  # cudaHostAlloc'ed memory
            host, cleanup = torch.empty(total, dtype=torch.uint8, pin_memory=True), None
        else:  # memcpy_shm_registered: a /dev/shm file mapping page-locked with cudaHostRegister, as the arena
            import mmap
            fd, path = tempfile.mkstemp(dir=os.environ.get("SNAPCKPT_SHM_DIR", "/dev/shm"))
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total)
            os.close(fd)
            os.unlink(path)
            host = torch.frombuffer(mm, dtype=torch.uint8)
            host.fill_(0)  # fault the pages in before registering
            err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), total, 0)
            if int(getattr(err, "value", err)) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")

            def cleanup():
                torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        for i in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        if cleanup:
            cleanup()
        del host, dev
        b = statistics.median(samples[1:])
        return {"blocking_s": b, "warmup_s": samples[0], "gbps": total / b / 1e9}
    if method == "torch_save":
        for i in range(repeats + 1):
            path = os.path.join(scratch, f"ts{i}.pt")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            samples.append(time.perf_counter() - t0)
            os.unlink(path)
        return {"blocking_s": statistics.median(samples[1:]), "durable_s": statistics.median(samples[1:]),
                "warmup_s": samples[0]}
    overlap = method.endswith("_overlap")
    tier = StorageType.DISK if "disk" in method else StorageType.MEMORY
    d = tempfile.mkdtemp(dir=scratch)
    durable, fences = [], []
    warm = 2  # one save per arena slot: a slot is page-locked (cudaHostRegister) at its first use
    with Checkpointer(d, overlap=overlap, keep_last=1) as ck:
        for i in range(repeats + warm):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = ck.save(state, i, tier)
            if not overlap:
                ck.fence()
            samples.append(time.perf_counter() - t0)
            if overlap:
                _busy_gpu(0.3)
                t1 = time.perf_counter()
                ck.fence()
                fences.append(time.perf_counter() - t1)
            h.wait()
            durable.append(time.perf_counter() - t0)
    shutil.rmtree(d, ignore_errors=True)
    total = sum(t.numel() * t.element_size() for t in tensors)
    b = statistics.median(samples[warm:])
    out = {"blocking_s": b, "warmup_s": samples[:warm], "gbps": total / b / 1e9, "samples_s": samples}
    if tier == StorageType.DISK:
        out["durable_s"] = statistics.median(durable[warm:])
    if overlap:
        out["fence_after_0.3s_compute_s"] = statistics.median(fences[warm:])
    return out


METHODS = ["memcpy_pinned", "memcpy_shm_registered", "floor_pinned_copy", "floor_pageable_copy", "torch_save", "snapckpt_memory", "snapckpt_disk",
           "snapckpt_memory_overlap"]


def markdown(data: dict) -> str:
    """The table of a ``gpu_stall.json`` (``{"machine": ..., "results": {"<GiB>/<method>": {...}}}``)."""
    info, results = data["machine"], data["results"]
    lines = [f"# GPU stall ({info['gpu']}, torch {info['torch']}, git {info['git'][:10]}, {info['date']})", "",
             "| size GiB | method | blocking s | GB/s | / pinned floor | / one cudaMemcpyAsync | durable s | "
             "fence after 0.3 s compute s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    def fmt(x, spec):
        return "" if x is None else format(x, spec)

    for key, r in results.items():
        size, m = key.split("/")
        floor = results.get(f"{size}/floor_pinned_copy", {}).get("blocking_s")
        b = r.get("blocking_s")
        rel = f"{b / floor:.2f}x" if b and floor else ""
        one = results.get(f"{size}/memcpy_pinned", {}).get("blocking_s")
        rel1 = f"{b / one:.2f}x" if b and one else ""
        err = f" error: {r['error']}" if "error" in r else ""
        lines.append(f"| {size} | {m} | {fmt(b, '.4f')} | {fmt(r.get('gbps'), '.1f')} | {rel} | {rel1} | "
                     f"{fmt(r.get('durable_s'), '.3f')} | "
                     f"{fmt(r.get('fence_after_0.3s_compute_s'), '.4f')} |{err}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-gib", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default="benchmarks/results/gpu_stall")
    ap.add_argument("--scratch-dir", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_stall.py needs a CUDA GPU", file=sys.stderr)
        return 2
    scratch = a.scratch_dir or tempfile.mkdtemp(prefix="snapckpt-gpu-")
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "git": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count()}
    results = {}
    for size in [float(x) for x in a.sizes_gib.split(",")]:
        state = _to_cuda(make_state(int(size * GiB)))
        torch.cuda.synchronize()
        for m in a.methods.split(","):
            try:
                results[f"{size:g}/{m}"] = bench(state, m, a.repeats, scratch)
            except Exception as e:  # record and go on
                results[f"{size:g}/{m}"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{size:g} GiB {m}: {results[f'{size:g}/{m}']}", flush=True)
        del state
        torch.cuda.empty_cache()
    data = {"machine": info, "results": results}
    write_results(a.out, data, markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
