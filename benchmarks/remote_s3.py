"""Remote tier throughput against plain clients of the same S3 server, as ratios within one run.

Starts moto's S3 server on 127.0.0.1 in its own process (``python -m moto.server``: in this process its
threads would compete with the client for the GIL; a real HTTP server, but written in Python: absolute
GB/s mean nothing, only the ratios do), writes a committed 2-rank checkpoint of ``--mib`` MiB per rank, and times:

- ``snapckpt_upload``: :meth:`snapckpt.storage.remote.RemoteStore.upload` (marker, data objects streamed
  with their checksums recomputed, sizes read back, manifest object);
- ``s3fs_put``: ``s3fs.S3FileSystem.put_file`` of the same files; ``boto3_upload_file``: boto3's transfer
  manager;
- ``snapckpt_download``: :meth:`~snapckpt.storage.remote.RemoteStore.download` (checksums verified, manifest
  written, renamed into place); ``s3fs_get`` and ``boto3_download_file`` of the same objects.

Best of ``--repeats``. Usage: ``.venv/bin/python benchmarks/remote_s3.py --mib 64 --repeats 2``; writes
``benchmarks/results/remote_s3.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB per rank file (2 ranks)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "remote_s3.json"))
    a = ap.parse_args()

    import boto3
    import fsspec
    import xxhash
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

        for rep in range(a.repeats):
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
            shutil.rmtree(out)
        best = {k: min(v) for k, v in times.items()}
        result = {"mib_per_rank": a.mib, "ranks": 2, "repeats": a.repeats, "best_s": best,
                  "ratios": {"upload_vs_s3fs_put": best["snapckpt_upload"] / best["s3fs_put"],
                             "upload_vs_boto3": best["snapckpt_upload"] / best["boto3_upload_file"],
                             "download_vs_s3fs_get": best["snapckpt_download"] / best["s3fs_get"],
                             "download_vs_boto3": best["snapckpt_download"] / best["boto3_download_file"]}}
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
