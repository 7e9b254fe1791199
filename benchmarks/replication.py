"""The peer-memory tier's channel (snapckpt/persister/replication.py) against a plain socket, on loopback.

Three figures, each for a snapshot of ``--mib`` MiB held in shared memory (``/dev/shm``):

- **throughput**: one replica ``put`` (on a kept, authenticated connection: framed header, ``sendall`` of
  the slot's mapping in 16 MiB slices with XXH3-64 on both sides, the receiver's ``recv_into`` a fresh
  tmpfs file, checksum compare, rename) against a plain TCP ``sendall`` of the same bytes into a
  ``recv_into`` of a warm, preallocated tmpfs mapping (no checksum), and into a fresh tmpfs file
  allocated and mapped for that receive (what a replica needs: its cost is the fresh pages);
- **time until replicated**: a new connection (connect + HMAC handshake) and one put, as the sender of a
  persister does for its first snapshot (later ones reuse the connection);
- **recovery**: a rank's part fetched from a peer's replica into the rank's arena slot (``Replicator.fetch``:
  handshake, ``get``, checksum verified) against reading the same bytes from a file on the checkpoint
  disk with a cold page cache and checking its XXH3-64 (what a disk load of that part reads and checks
  before unpickling).

The receiving side runs in its own process (forked), as another node's persister would.

- **host memory per node** (``--memory-mib``, 0 skips it; needs root): a real job on two simulated nodes
  with ``replicas=0`` and ``replicas=1``, the job's ``/dev/shm`` bytes (arena slots, replica slots) and the
  persister's RSS/PSS/USS per node, in bytes and as a multiple of the node's training state
  (:mod:`replica_memory`).

    .venv/bin/python benchmarks/replication.py --mib 256 --repeats 3 [--disk-dir DIR] [--memory-mib 64]

Outputs ``benchmarks/results/replication.{json,md}`` (with the date, commit and load average) and prints
the tables. Units: seconds, MB/s (10^6 bytes), bytes.
"""
from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import xxhash

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from _common import drop_page_cache, git_commit  # noqa: E402
from snapckpt.persister import channel  # noqa: E402
from snapckpt.persister.arena import SlotFiles, write_header  # noqa: E402
from snapckpt.persister.replication import Replicator, _put  # noqa: E402
from snapckpt.persister.slots import Run, SlotTable  # noqa: E402

RUN = "b" * 16 + "0123456789ab"
SECRET = os.urandom(32)
RESULTS = REPO / "benchmarks" / "results"


def _run(ckpt: str) -> Run:
    return Run(RUN, 2, [0], True, ckpt, None, 60.0, True, False)


def _holder(arena: str, q) -> None:
    """The peer persister's side: a Replicator listening on loopback (replicas land in ``arena``)."""
    lock = threading.RLock()
    table = SlotTable(SlotFiles(arena), lock)
    rep = Replicator(arena, table, lock)
    with lock:
        rep.configure(_run(arena), SECRET, [])
    q.put(rep.listen("127.0.0.1"))
    time.sleep(3600)


def _plain_receiver(path: str, nbytes: int, q) -> None:
    """A plain TCP receiver: ``recv_into`` a tmpfs mapping, then one byte back. The first byte the client
    sends picks the mapping: ``w`` the same warm one every time, ``f`` a fresh file (allocated and mapped
    for this receive, as a replica is)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    warm = mmap.mmap(fd, nbytes)
    os.close(fd)
    srv = socket.create_server(("127.0.0.1", 0))
    q.put(srv.getsockname()[1])
    while True:
        conn, _ = srv.accept()
        m = warm
        if conn.recv(1) == b"f":
            fd = os.open(path + ".fresh", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.posix_fallocate(fd, 0, nbytes)
            m = mmap.mmap(fd, nbytes)
            os.close(fd)
        view, got = memoryview(m), 0
        while got < nbytes:
            k = conn.recv_into(view[got:], min(nbytes - got, channel.CHUNK_NBYTES))
            if k == 0:
                break
            got += k
        conn.sendall(b"k")
        conn.close()
        view = None
        if m is not warm:
            m.close()


def _snapshot(path: str, nbytes: int) -> mmap.mmap:
    """A slot-like file of ``nbytes`` random-ish bytes with a valid header and index, in tmpfs."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    m = mmap.mmap(fd, nbytes)
    os.close(fd)
    block = os.urandom(1 << 20)
    for off in range(0, nbytes, len(block)):
        m[off:off + len(block)] = block[:nbytes - off]
    index = json.dumps({"step": 7, "files": []}).encode()
    m[nbytes - len(index):] = index
    write_header(m, 7, nbytes - len(index), len(index))
    return m


def _meta(nbytes: int, index_nbytes: int) -> dict:
    return {"step": 7, "run_id": RUN, "world_size": 2, "dir_id": "bench", "index_offset": nbytes - index_nbytes,
            "index_nbytes": index_nbytes, "dirname": "step_00000007", "tracker_name": "latest",
            "tracker_content": "step_00000007", "persistable": True}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disk-dir", default=str(REPO / "benchmarks" / ".replication-scratch"))
    ap.add_argument("--memory-mib", type=int, default=64, help="host memory per node: state per rank (MiB); 0: skip")
    ap.add_argument("--memory-nproc", type=int, default=1, help="host memory per node: ranks per node")
    a = ap.parse_args()
    nbytes = a.mib << 20
    shm = tempfile.mkdtemp(prefix="snapckpt-bench-", dir="/dev/shm")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    holder = ctx.Process(target=_holder, args=(os.path.join(shm, "holder"), q), daemon=True)
    plain = ctx.Process(target=_plain_receiver, args=(os.path.join(shm, "plain"), nbytes, q), daemon=True)
    holder.start()
    hport = q.get(timeout=60)
    plain.start()
    pport = q.get(timeout=60)
    snap = _snapshot(os.path.join(shm, "slot"), nbytes)
    index_nbytes = len(json.dumps({"step": 7, "files": []}).encode())
    out = {"mib": a.mib, "repeats": a.repeats, "plain_s": [], "plain_fresh_s": [], "put_s": [], "first_put_s": [], "fetch_s": [],
           "disk_s": []}
    try:
        view = memoryview(snap)
        for _ in range(a.repeats):
            for mode, key in ((b"w", "plain_s"), (b"f", "plain_fresh_s")):
                t0 = time.perf_counter()
                s = socket.create_connection(("127.0.0.1", pport))
                s.sendall(mode)
                s.sendall(view)
                s.recv(1)
                s.close()
                out[key].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sock = channel.connect("127.0.0.1", hport, RUN, SECRET)  # a new connection: the first snapshot
            _put(sock, 1, _meta(nbytes, index_nbytes), view)
            out["first_put_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _put(sock, 1, _meta(nbytes, index_nbytes), view)  # a kept connection: every later snapshot
            out["put_s"].append(time.perf_counter() - t0)
            sock.close()
        # recovery: fetch rank 1's replica into a slot of this process's arena, against a cold disk read
        lock = threading.RLock()
        table = SlotTable(SlotFiles(os.path.join(shm, "fetcher")), lock)
        rep = Replicator(table.arena.directory, table, lock)
        run = _run(a.disk_dir)
        with lock:
            rep.configure(run, SECRET, [])
            entry = table.attach(1, run, None, 2)
            table.runs[RUN] = run
        os.makedirs(a.disk_dir, exist_ok=True)
        disk_file = os.path.join(a.disk_dir, "rank1.bin")
        with open(disk_file, "wb") as f:
            f.write(view)
            f.flush()
            os.fsync(f.fileno())
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            s = rep.fetch(entry, run, 1, 7, RUN, "127.0.0.1", hport)
            out["fetch_s"].append(time.perf_counter() - t0)
            with lock:
                s.state = type(s.state).FREE  # let the next repeat fetch into a slot again
            drop_page_cache(disk_file)
            t0 = time.perf_counter()
            h = xxhash.xxh3_64()
            buf = bytearray(nbytes)
            with open(disk_file, "rb", buffering=0) as f:
                mv, got = memoryview(buf), 0
                while got < nbytes:
                    got += f.readinto(mv[got:got + (64 << 20)])
            h.update(buf)
            out["disk_s"].append(time.perf_counter() - t0)
            del buf
        table.shutdown()
    finally:
        view = None
        snap.close()
        holder.kill()
        plain.kill()
        import shutil
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(a.disk_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in out.items() if isinstance(v, list)}
    mb = nbytes / 1e6
    out["median_s"] = med
    out["mb_per_s"] = {"plain": mb / med["plain_s"], "plain_fresh": mb / med["plain_fresh_s"], "put": mb / med["put_s"], "fetch": mb / med["fetch_s"],
                       "disk_cold": mb / med["disk_s"]}
    out["put_vs_plain"] = med["put_s"] / med["plain_s"]
    out["put_vs_plain_fresh"] = med["put_s"] / med["plain_fresh_s"]
    out["fetch_vs_disk"] = med["fetch_s"] / med["disk_s"]
    out["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": git_commit(),
                   "loadavg_1_5_15": list(os.getloadavg())}
    lines = [f"{a.mib} MiB, median of {a.repeats}:",
             f"  plain socket send      {med['plain_s']:.3f} s  {out['mb_per_s']['plain']:.0f} MB/s",
             f"  plain, fresh tmpfs     {med['plain_fresh_s']:.3f} s  {out['mb_per_s']['plain_fresh']:.0f} MB/s",
             f"  replica put (kept)     {med['put_s']:.3f} s  {out['mb_per_s']['put']:.0f} MB/s  "
             f"({out['put_vs_plain']:.2f}x plain, {out['put_vs_plain_fresh']:.2f}x plain into fresh tmpfs)",
             f"  time until replicated  {med['first_put_s']:.3f} s  (new connection + handshake + put)",
             f"  recovery: fetch        {med['fetch_s']:.3f} s  {out['mb_per_s']['fetch']:.0f} MB/s",
             f"  recovery: disk (cold)  {med['disk_s']:.3f} s  {out['mb_per_s']['disk_cold']:.0f} MB/s  "
             f"(fetch {out['fetch_vs_disk']:.2f}x disk)"]
    md = "\n".join(["# Peer replicas", "", f"{out['meta']['date']}, commit {out['meta']['commit']}, load average "
                    + " ".join(f"{x:.1f}" for x in out["meta"]["loadavg_1_5_15"]), "", "```", *lines, "```", ""])
    if a.memory_mib:
        import replica_memory  # noqa: PLC0415 (the rig: only when asked)
        try:
            out["host_memory"] = replica_memory.measure(a.memory_mib, a.memory_nproc)
            md += "\n" + replica_memory.markdown(out["host_memory"])
        except RuntimeError as e:
            out["host_memory"] = {"skipped": str(e)}
            md += f"\nHost memory per node: not measured ({e}).\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replication.json").write_text(json.dumps(out, indent=1))
    (RESULTS / "replication.md").write_text(md)
    print(md)

if __name__ == "__main__":
    main()
