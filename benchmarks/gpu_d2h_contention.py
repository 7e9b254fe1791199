"""GPU: does a snapshot's device-to-host copy on a side stream delay the training loop's own small D2H syncs?

Run on a CUDA machine (``benchmarks/gpu_check.sh`` does). A training loop synchronizes with the host every
step or so (``loss.item()`` for logging, the AMP scaler's ``found_inf``, a NaN check): a tiny device-to-host
copy on the compute stream. This measures how long such a copy takes while a large snapshot copy (``--gib`` of
``--tensor-mib`` tensors into page-locked host memory) runs on a side stream, for ways of issuing that copy:

- ``all_queued``: every tensor's ``copy_(non_blocking=True)`` queued at once (snapckpt before the pacing);
- ``chunked_<M>MiB``: the same in pieces of M MiB, all queued at once;
- ``paced_<K>x<M>MiB``: pieces of M MiB, at most K in flight, issued by a host thread that waits for the
  oldest piece's event before issuing the next (K = 1: ``Event.synchronize()``, as snapckpt's pacer; else
  ``query()`` + a short sleep). Measured on an H200: with K = 2 the side stream always has a copy queued and
  ``item()`` waited for the whole snapshot, as with everything queued at once.

Per way: ``item_s`` (median latency of ``x.item()`` issued right after the copy starts), ``copy_s`` (the whole
copy, alone), ``overlap_s`` (the copy started, then ``--compute-s`` of matmuls on the compute stream, then
``item()``: about ``max(compute, copy)`` when they overlap, their sum when the sync waits for the copy), and
``py_progress`` (iterations of a pure-Python loop in the main thread during a blocking
``Event.synchronize()`` in another thread, relative to none: whether that call holds the GIL). Output: JSON and
markdown (``--out``); no assertion on any time.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

MiB = 1 << 20


def _pieces(srcs, dsts, piece_nbytes):
    out = []
    for s, d in zip(srcs, dsts):
        n = s.numel()
        step = n if piece_nbytes is None else piece_nbytes
        for o in range(0, n, step):
            out.append((s[o:o + step], d[o:o + step]))
    return out


def _issue(pieces, stream, inflight):
    """Issue ``pieces`` on ``stream``; with ``inflight``, at most that many outstanding (polling events)."""
    events = collections.deque()
    with torch.cuda.stream(stream):
        for src, dst in pieces:
            if inflight:
                while len(events) >= inflight:
                    if inflight == 1:  # as snapckpt's pacer: a blocking wait for the previous piece
                        events[0].synchronize()
                    while not events[0].query():
                        time.sleep(50e-6)
                    events.popleft()
            dst.copy_(src, non_blocking=True)
            if inflight:
                ev = torch.cuda.Event()
                ev.record(stream)
                events.append(ev)


def _start(pieces, stream, inflight):
    start = torch.cuda.Event()
    start.record(torch.cuda.current_stream())
    stream.wait_event(start)
    if not inflight:
        _issue(pieces, stream, None)
        return None
    dev = torch.cuda.current_device()

    def run():
        torch.cuda.set_device(dev)
        _issue(pieces, stream, inflight)

    t = threading.Thread(target=run)
    t.start()
    return t


def _matmuls(seconds_hint, a):
    n = max(1, int(seconds_hint / _matmuls.per))
    for _ in range(n):
        a = (a @ a).tanh_()
    return a


def markdown(results: dict) -> str:
    """The table of a ``gpu_d2h_contention.json``."""
    a = results["args"]
    lines = [f"# D2H contention ({results['machine']['gpu']}, torch {results['machine']['torch']}, {a['gib']:g} GiB "
             f"in {a['tensor_mib']} MiB tensors, compute {results['compute_alone_s']:.3f} s alone)", "",
             "| way | pieces | item() latency s | copy s | GB/s | copy + compute, then item() s |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results["ways"].items():
        lines.append(f"| {name} | {r['pieces']} | {r['item_s']:.4f} | {r['copy_s']:.4f} | {r['gbps']:.1f} | "
                     f"{r['overlap_s']:.4f} |")
    lines += ["", f"Python progress in the main thread during `Event.synchronize()` in another thread: "
                  f"{results['py_progress_during_event_synchronize']:.2f} of idle"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--tensor-mib", type=int, default=256)
    ap.add_argument("--compute-s", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/gpu_d2h_contention")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_d2h_contention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    n = int(a.gib * 1024 / a.tensor_mib)
    srcs = [torch.rand(a.tensor_mib * MiB // 4, device="cuda").view(torch.uint8) for _ in range(n)]
    dsts = [torch.empty(s.numel(), dtype=torch.uint8, pin_memory=True) for s in srcs]
    side = torch.cuda.Stream()
    x = torch.ones(1024, device="cuda")
    m = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        m = (m @ m).tanh_()
    torch.cuda.synchronize()
    _matmuls.per = (time.perf_counter() - t0) / 20
    t0 = time.perf_counter()
    _matmuls(a.compute_s, m)
    torch.cuda.synchronize()
    compute_alone = time.perf_counter() - t0

    ways = {"all_queued": (None, None), "paced_2x64MiB": (64 * MiB, 2), "paced_1x16MiB": (16 * MiB, 1),
            "paced_1x64MiB": (64 * MiB, 1), "paced_1x256MiB": (256 * MiB, 1)}
    results = {"machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
               "args": vars(a), "compute_alone_s": compute_alone, "ways": {}}
    for name, (piece, inflight) in ways.items():
        pieces = _pieces(srcs, dsts, piece)
        item_s, copy_s, overlap_s = [], [], []
        for _ in range(a.repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            th = _start(pieces, side, inflight)
            (x * 2).sum().item()
            item_s.append(time.perf_counter() - t0)
            if th:
                th.join()
            side.synchronize()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            th = _start(pieces, side, inflight)
            if th:
                th.join()
            side.synchronize()
            copy_s.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            th = _start(pieces, side, inflight)
            _matmuls(a.compute_s, m)
            (x * 2).sum().item()
            overlap_s.append(time.perf_counter() - t0)
            if th:
                th.join()
            side.synchronize()
        total = sum(s.numel() for s in srcs)
        r = {"item_s": statistics.median(item_s[1:]), "copy_s": statistics.median(copy_s[1:]),
             "overlap_s": statistics.median(overlap_s[1:]), "gbps": total / statistics.median(copy_s[1:]) / 1e9,
             "pieces": len(pieces)}
        results["ways"][name] = r
        print(f"{name}: {r}", flush=True)

    # GIL: a pure-Python loop in this thread while another thread is inside Event.synchronize()
    def spin(seconds):
        k, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            k += 1
        return k

    base = spin(0.05)
    torch.cuda.synchronize()
    _start(_pieces(srcs, dsts, None), side, None)
    done = torch.cuda.Event()
    done.record(side)
    th = threading.Thread(target=done.synchronize)
    th.start()
    time.sleep(0.001)
    during = spin(0.05)
    th.join()
    results["py_progress_during_event_synchronize"] = during / base
    print(f"python progress during Event.synchronize in another thread: {during / base:.2f} of idle", flush=True)

    write_results(a.out, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
