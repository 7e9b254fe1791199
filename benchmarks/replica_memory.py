"""Host memory per node with the peer-memory tier off and on (``replicas=0`` against ``replicas=1``).

A real job on two simulated nodes of the test rig (``tests/multinode.py``: each node its own host name,
``/dev/shm`` and persister; needs root), ``--nproc`` ranks per node under ``torchrun --nnodes 2``, each rank
a state of one float32 tensor of ``--mib`` MiB and ``--saves`` memory snapshots
(``benchmarks/replica_memory_worker.py``). Once every snapshot is taken (and, with replicas, each node holds
the replica of the other node's ranks' last step), per node:

- ``/dev/shm`` bytes of the job, allocated (``st_blocks``), split into the ranks' arena slots
  (``r<rank>-s<slot>``), the replica slots (``p<rank>``) and anything else; and the node's whole tmpfs use
  (``statvfs``) as a cross-check;
- the node persister's RSS, PSS and USS (``psutil``'s ``memory_full_info``: PSS counts a shared page
  once across the processes mapping it);

each in bytes and as a multiple of the node's training state (``nproc * mib`` MiB of tensors).

Run alone: ``.venv/bin/python benchmarks/replica_memory.py --mib 64``, or through ``benchmarks/replication.py``
(``--memory-mib``), which puts the result in ``results/replication.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from multinode import Rig, rig_available  # noqa: E402

WORKER = str(REPO / "benchmarks" / "replica_memory_worker.py")
_SLOT = re.compile(r"r\d{5}-s\d+")
_REPLICA = re.compile(r"p\d{5}")


def _shm(node: Any) -> Dict[str, int]:
    """Allocated bytes of the job's files in ``node``'s shared-memory directory, by kind, and the node's
    whole ``/dev/shm`` use."""
    out = {"slots": 0, "replicas": 0, "other": 0, "slot_files": 0, "replica_files": 0}
    root = node.path(node.rig.shm_dir)
    for r, _, files in os.walk(root):
        for f in files:
            nbytes = os.stat(os.path.join(r, f)).st_blocks * 512
            kind = "slots" if _SLOT.fullmatch(f) else "replicas" if _REPLICA.fullmatch(f) else "other"
            out[kind] += nbytes
            if kind != "other":
                out[kind[:-1] + "_files"] += 1
    st = os.statvfs(node.path("/dev/shm"))
    out["tmpfs_used"] = (st.f_blocks - st.f_bfree) * st.f_frsize
    out["job_total"] = out["slots"] + out["replicas"] + out["other"]
    return out


def _persister(node: Any) -> Dict[str, int]:
    pids = node.persisters()
    assert len(pids) == 1, f"{node.name}: one persister expected, found {pids}"
    m = psutil.Process(pids[0]).memory_full_info()
    return {"rss": m.rss, "pss": m.pss, "uss": m.uss}


def _steady(rig: Rig, runs: List[Any], nproc: int, saves: int, replicas: int, timeout: float = 240) -> None:
    """Until every rank printed ``SAVED`` and, with replicas, each node holds the other's last step and no
    replica is half received."""
    deadline = time.monotonic() + timeout
    nodes = len(rig.nodes)
    while time.monotonic() < deadline:
        if any(r.returncode is not None for r in runs):
            raise RuntimeError("a node's job ended early:\n" + "\n".join(r.output()[-3000:] for r in runs))
        done = sum(r.output().count(f"SAVED {saves} ") for r in runs) == nodes * nproc
        if done and replicas:
            for i, node in enumerate(rig.nodes):
                peer = (i - 1) % nodes  # node i holds the replicas of node i-1's ranks
                log = node.persister_log()
                ranks = range(peer * nproc, (peer + 1) * nproc)
                done = done and all(f"holding a replica of rank {r} step {saves} " in log for r in ranks)
                done = done and not any(f.endswith(".part") for f in node.shm_files())
        if done:
            time.sleep(1.0)  # let the persisters settle (pages of a send just ended)
            return
        time.sleep(0.2)
    raise RuntimeError("the job did not reach its steady state in time:\n"
                       + "\n".join(r.output()[-3000:] + n.persister_log()[-3000:] for r, n in zip(runs, rig.nodes)))


def measure(mib: int, nproc: int = 1, saves: int = 3, replicas_list: tuple = (0, 1)) -> Dict[str, Any]:
    """Run the job once per ``replicas`` value on a fresh 2-node rig; return the figures (bytes) per node.

    Raises:
        RuntimeError: the rig is not available here (not root, no util-linux), or a job failed.
    """
    why = rig_available()
    if why:
        raise RuntimeError(why)
    state = nproc * (mib << 20)
    out: Dict[str, Any] = {"mib_per_rank": mib, "nproc_per_node": nproc, "nodes": 2, "saves": saves,
                           "state_bytes_per_node": state, "by_replicas": {}}
    for k in replicas_list:
        tmp = tempfile.mkdtemp(prefix="snapckpt-repmem-")
        rig = Rig(tmp, os.path.join(tmp, "ckpt"))
        os.makedirs(rig.ckpt_dir)
        try:
            rig.start(2)
            runs = rig.torchrun_all(WORKER, [rig.ckpt_dir, "--mib", str(mib), "--saves", str(saves),
                                             "--replicas", str(k)], nproc)
            _steady(rig, runs, nproc, saves, k)
            nodes = []
            for node in rig.nodes:
                shm, pers = _shm(node), _persister(node)
                nodes.append({"node": node.name, "shm": shm, "persister": pers,
                              "x_state": {"shm_job": shm["job_total"] / state, "shm_slots": shm["slots"] / state,
                                          "shm_replicas": shm["replicas"] / state,
                                          "persister_pss": pers["pss"] / state, "persister_rss": pers["rss"] / state,
                                          "shm_plus_persister_pss": (shm["job_total"] + pers["pss"]) / state}})
            out["by_replicas"][str(k)] = nodes
        finally:
            rig.close()
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def markdown(res: Dict[str, Any]) -> str:
    """A table of :func:`measure`'s result (MiB and multiples of the node's training state)."""
    mi = 1 << 20
    lines = [f"Host memory per node: 2 nodes x {res['nproc_per_node']} rank(s), {res['mib_per_rank']} MiB state per "
             f"rank ({res['state_bytes_per_node'] / mi:.0f} MiB per node), {res['saves']} memory snapshots, "
             "slots_per_rank=2; mean over the nodes.", "",
             "| replicas | /dev/shm: arena slots | replica slots | job total | persister RSS | persister PSS | "
             "persister USS | shm + persister PSS |",
             "|---|---|---|---|---|---|---|---|"]
    for k, nodes in res["by_replicas"].items():
        def avg(f):
            return sum(f(n) for n in nodes) / len(nodes)

        def cell(nbytes):
            return f"{nbytes / mi:.1f} MiB ({nbytes / res['state_bytes_per_node']:.2f}x)"
        lines.append(f"| {k} | {cell(avg(lambda n: n['shm']['slots']))} | "
                     f"{cell(avg(lambda n: n['shm']['replicas']))} | "
                     f"{cell(avg(lambda n: n['shm']['job_total']))} | {cell(avg(lambda n: n['persister']['rss']))} | "
                     f"{cell(avg(lambda n: n['persister']['pss']))} | {cell(avg(lambda n: n['persister']['uss']))} | "
                     f"{cell(avg(lambda n: n['shm']['job_total'] + n['persister']['pss']))} |")
    same = all(n["shm"]["tmpfs_used"] == n["shm"]["job_total"] for nodes in res["by_replicas"].values() for n in nodes)
    lines += ["", "Each node's whole `/dev/shm` use (statvfs) " + ("equals the job total above." if same else
              "differs from the job total: see `tmpfs_used` in the JSON.")]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="state per rank (MiB)")
    ap.add_argument("--nproc", type=int, default=1, help="ranks per node")
    ap.add_argument("--saves", type=int, default=3)
    a = ap.parse_args()
    res = measure(a.mib, a.nproc, a.saves)
    print(json.dumps(res, indent=1))
    print(markdown(res))


if __name__ == "__main__":
    main()
