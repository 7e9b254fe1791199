"""Remote tier throughput against plain clients of the same S3 server, as ratios within one run.

Starts moto's S3 server on 127.0.0.1 in its own process (``python -m moto.server``: in this process its
threads would compete with the client for the GIL; a real HTTP server, but written in Python: absolute
GB/s mean nothing, only the ratios do), writes a committed 2-rank checkpoint of ``--mib`` MiB per rank, and times:

- ``snapckpt_upload``: :meth:`snapckpt.storage.remote.RemoteStore.upload` (marker, data objects streamed
  with their checksums recomputed, sizes read back, manifest object);
- ``s3fs_put``: ``s3fs.S3FileSystem.put_file`` of the same files; ``boto3_upload_file``: boto3's transfer
  manager;
- ``snapckpt_download``: :meth:`~snapckpt.storage.remote.RemoteStore.download` (checksums verified, manifest
  written, renamed into place); ``s3fs_get`` and ``boto3_download_file`` of the same objects;
- when ``obstore`` is installed (it is no snapckpt dependency): ``obstore_put`` (multipart, parts of the same
  size) and ``obstore_get`` (streamed to a file) of the same files.

Best of ``--repeats``.

Then the **training-loop cost** (``--loop-steps``, 0 skips it): one process trains an MLP whose weights
and AdamW moments make about ``--loop-mib`` MiB, saving to DISK every ``--every`` steps without waiting
for the commit, three ways: no checkpoint, the local disk tier only, and the disk tier with
``remote_dir`` (every commit uploaded by the persister meanwhile). Reported per mode: median and mean step
time, the seconds ``save`` blocked, and the loop's total, the best of ``--loop-repeats`` interleaved runs;
``loop_remote_vs_disk`` is the ratio of the mean step times (the mean, not the median, carries the steps an upload slowed). moto runs on the same cores
as the loop and the persister, so its own CPU is charged to the remote tier here (a real object store's
is not).

Usage: ``.venv/bin/python benchmarks/remote_s3.py --mib 64 --repeats 2``; writes
``benchmarks/results/remote_s3.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid


def _loop(steps: int, every: int, state_mib: int, ckpt_dir, remote_dir) -> dict:
    """Train ``steps`` steps of an MLP (about ``state_mib`` MiB of weights and AdamW moments), a DISK save
    every ``every`` steps (``ckpt_dir`` ``None``: no checkpoint); return the step times (s)."""
    import torch

    from snapckpt import Checkpointer, StorageType
    width = 1024
    layers = max(1, int(state_mib * 2**20 / 12 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, width)
    ck = None
    if ckpt_dir is not None:
        ck = Checkpointer(ckpt_dir, persister_idle_timeout_secs=5, keep_last=2,
                          **({"remote_dir": remote_dir} if remote_dir else {}))
    times, blocked = [], []
    t_all = time.perf_counter()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ck is not None and step % every == 0:
            tb = time.perf_counter()
            ck.save({"model": model.state_dict(), "opt": opt.state_dict()}, step, StorageType.DISK)
            blocked.append(time.perf_counter() - tb)
        times.append(time.perf_counter() - t0)
    total = time.perf_counter() - t_all
    if ck is not None:
        ck.close()
    times = times[every:]  # the first save allocates the arena slots
    return {"step_median_s": statistics.median(times), "step_mean_s": statistics.mean(times),
            "save_blocked_median_s": statistics.median(blocked) if blocked else 0.0, "loop_s": total,
            "state_mib": state_mib, "steps": steps, "every": every}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB per rank file (2 ranks)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--loop-steps", type=int, default=60, help="training-loop steps per mode (0: no loop)")
    ap.add_argument("--loop-mib", type=int, default=96, help="MiB of model and optimizer state in the loop")
    ap.add_argument("--every", type=int, default=10, help="a DISK save every this many loop steps")
    ap.add_argument("--loop-repeats", type=int, default=2, help="runs of each loop mode (best mean kept)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "remote_s3.json"))
    a = ap.parse_args()

    import boto3
    import fsspec
    import xxhash
    load_before = os.getloadavg()  # shared cores: the load says how far to trust the timings
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("moto's server did not start")
            time.sleep(0.2)
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    from snapckpt.ondisk.manifest import build_manifest
    from snapckpt.storage.remote import RemoteStore

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)
    tmp = tempfile.mkdtemp(prefix="snapckpt-remote-bench-")
    try:
        src = os.path.join(tmp, "step_00000001")
        os.makedirs(os.path.join(src, ".snapckpt"))
        n = a.mib << 20
        parts = {}
        names = [f"rank_{r:05d}.pt" for r in range(2)]
        for r, name in enumerate(names):
            data = os.urandom(n)
            with open(os.path.join(src, name), "wb") as f:
                f.write(data)
            parts[r] = {name: {"nbytes": n, "xxh3_64": xxhash.xxh3_64(data).hexdigest()}}
        manifest = build_manifest(step=1, dirname="step_00000001", world_size=2, run_id="bench", parts=parts)
        store = RemoteStore(f"s3://{bucket}/snap")
        store.check_access()  # the client is made before any timing
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.ls(bucket)
        times: dict = {}

        def timed(key, fn):
            t0 = time.perf_counter()
            fn()
            times.setdefault(key, []).append(time.perf_counter() - t0)

        try:  # optional: the Rust object_store client, when installed (not a snapckpt dependency)
            import obstore
            from obstore.store import S3Store
            ostore = S3Store(bucket, endpoint=os.environ["AWS_ENDPOINT_URL"], access_key_id="bench",
                             secret_access_key="bench", region="us-east-1", client_options={"allow_http": True})
        except ImportError:
            obstore = None

        def obstore_get(key, dest):
            with open(dest, "wb") as f:
                for chunk in obstore.get(ostore, key).stream(min_chunk_size=store.block_nbytes):
                    f.write(chunk)

        for rep in range(a.repeats):
            if obstore is not None:
                timed("obstore_put", lambda: [obstore.put(ostore, f"obs/{x}", open(os.path.join(src, x), "rb"),
                                                          chunk_size=store.block_nbytes) for x in names])
            timed("snapckpt_upload", lambda: store.upload(src, "step_00000001", manifest, run_id=f"r{rep}"))
            if rep < a.repeats - 1:
                store._rm_tree(store._path("step_00000001"))
            timed("s3fs_put", lambda: [fs.put_file(os.path.join(src, x), f"{bucket}/plain/{x}") for x in names])
            timed("boto3_upload_file", lambda: [client.upload_file(os.path.join(src, x), bucket, f"boto/{x}")
                                                for x in names])
        committed = store.list_committed()[0]
        for rep in range(a.repeats):
            out = tempfile.mkdtemp(dir=tmp)
            timed("snapckpt_download", lambda: store.download(committed, out, fsync=False))
            timed("s3fs_get", lambda: [fs.get_file(f"{bucket}/plain/{x}", os.path.join(out, "p" + x)) for x in names])
            timed("boto3_download_file", lambda: [client.download_file(bucket, f"boto/{x}", os.path.join(out, "b" + x))
                                                  for x in names])
            if obstore is not None:
                timed("obstore_get", lambda: [obstore_get(f"obs/{x}", os.path.join(out, "o" + x)) for x in names])
            shutil.rmtree(out)
        best = {k: min(v) for k, v in times.items()}
        from _common import git_commit  # noqa: PLC0415

        result = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": git_commit(),
                           "cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in load_before]},
                  "mib_per_rank": a.mib, "ranks": 2, "repeats": a.repeats, "best_s": best,
                  "ratios": {"upload_vs_s3fs_put": best["snapckpt_upload"] / best["s3fs_put"],
                             "upload_vs_boto3": best["snapckpt_upload"] / best["boto3_upload_file"],
                             "download_vs_s3fs_get": best["snapckpt_download"] / best["s3fs_get"],
                             "download_vs_boto3": best["snapckpt_download"] / best["boto3_download_file"]}}
        if a.loop_steps:
            runs: dict = {}
            for rep in range(a.loop_repeats):  # the modes interleaved: a load change on shared cores hits each
                for mode, d, r in (("none", None, None), ("disk", f"loop_disk{rep}", None),
                                   ("disk+remote", f"loop_remote{rep}", f"s3://{bucket}/loop{rep}")):
                    runs.setdefault(mode, []).append(
                        _loop(a.loop_steps, a.every, a.loop_mib, d and os.path.join(tmp, d), r))
            loop = {m: min(v, key=lambda x: x["step_mean_s"]) for m, v in runs.items()}  # the least disturbed
            result["loop"] = loop
            result["ratios"]["loop_remote_vs_disk"] = loop["disk+remote"]["step_mean_s"] / loop["disk"]["step_mean_s"]
            result["ratios"]["loop_disk_vs_none"] = loop["disk"]["step_mean_s"] / loop["none"]["step_mean_s"]
            last = a.loop_steps - a.loop_steps % a.every
            t0 = time.perf_counter()
            key = f"{bucket}/loop{a.loop_repeats - 1}/step_{last:08d}/.snapckpt/manifest.json"
            while time.perf_counter() - t0 < 120:  # the persister uploads after close() too
                fs.invalidate_cache()
                if fs.exists(key):
                    break
                time.sleep(0.2)
            fs.invalidate_cache()
            result["loop_last_upload_after_close_s"] = time.perf_counter() - t0
            result["loop_uploaded"] = sorted({k.split("/")[2] for k in fs.find(f"{bucket}/loop{a.loop_repeats - 1}")
                                              if k.endswith("manifest.json")})
        if obstore is not None:
            result["ratios"]["upload_vs_obstore_put"] = best["snapckpt_upload"] / best["obstore_put"]
            result["ratios"]["download_vs_obstore_get"] = best["snapckpt_download"] / best["obstore_get"]
        else:
            result["obstore"] = "not installed (pip install obstore to add its put/get)"
        result["meta"]["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]  # after the loop too
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
