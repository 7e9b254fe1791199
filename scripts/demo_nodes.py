"""The two-node part of ``scripts/demo.sh`` (``NODES=2``): the main job on two simulated nodes.

Two nodes of the test rig (``tests/multinode.py``: each its own host name, ``/dev/shm`` and persister,
sharing ``RUN_DIR/checkpoints``; needs root), one rank each under ``torchrun --nnodes 2``. Run 1 trains
until ``--kill-after-step``; then node 1 is lost whole (its trainers, persister and memory, SIGKILL) and
node 0's trainers are killed; a replacement node1 with empty memory comes up, and run 2, the same command,
resumes from memory: rank 0 from its own node's snapshot, rank 1 from the peer replica that node 0's
persister holds (the peer-memory tier, on by default across nodes), fetched into the new node's memory.
Rank 0's output goes to ``RUN_DIR/run1.out`` and ``RUN_DIR/run2.out`` for demo.sh's checks (rank 1's run 2
to ``RUN_DIR/run2-node1.out``); exits with run 2's status, or 1 when rank 1 did not resume from the replica.
"""
import argparse
import os
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from multinode import Rig, rig_available  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--memory-interval", type=int, required=True)
    p.add_argument("--disk-interval", type=int, required=True)
    p.add_argument("--sleep-per-step", type=float, required=True)
    p.add_argument("--kill-after-step", type=int, required=True)
    a = p.parse_args()
    why = rig_available()
    if why:
        print(f"demo: NODES=2: {why}", file=sys.stderr)
        return 2
    run_dir = os.path.abspath(a.run_dir)
    args = ["--checkpoint-dir", os.path.join(run_dir, "checkpoints"), "--steps", str(a.steps),
            "--memory-interval", str(a.memory_interval), "--disk-interval", str(a.disk_interval),
            "--keep-last", "2", "--seed", "1234", "--sleep-per-step", str(a.sleep_per_step),
            "--loss-log", os.path.join(run_dir, "loss.log")]
    script = os.path.join(REPO, "examples", "train_gpt.py")
    rig = Rig(run_dir, os.path.join(run_dir, "checkpoints"))
    try:
        rig.start(2)
        print("demo: nodes " + ", ".join(f"{n.name} (holder pid {n.holder.pid})" for n in rig.nodes))
        runs = rig.torchrun_all(script, args, 1)
        print(f"demo: run 1: torchrun --nnodes 2 --node-rank {{0,1}} --nproc-per-node 1 train_gpt.py "
              + " ".join(args))
        deadline = time.monotonic() + 240
        while last_step(runs[0].output()) < a.kill_after_step:
            if any(r.returncode is not None for r in runs) or time.monotonic() > deadline:
                print("demo: run 1 ended or stalled before the kill; its output:\n" + runs[0].output(),
                      file=sys.stderr)
                return 1
            time.sleep(0.1)
        step = last_step(runs[0].output())
        rig.lose_node(1)
        rig.kill_trainers(0)
        for r in runs:
            r.proc.wait(10)
        shutil.copy(runs[0].log_path, os.path.join(run_dir, "run1.out"))
        print(f"demo: node1 lost whole (trainers, persister, memory) and node0's trainers killed after step {step}; "
              f"node0's persister alive: {rig.nodes[0].persisters()}")
        rig.replace_node(1)
        print("demo: a replacement node1 is up (empty memory)")
        runs = rig.torchrun_all(script, args, 1)
        print("demo: run 2: the same command on both nodes")
        codes = [r.wait(600) for r in runs]
        shutil.copy(runs[0].log_path, os.path.join(run_dir, "run2.out"))
        shutil.copy(runs[1].log_path, os.path.join(run_dir, "run2-node1.out"))
        for n, (c, r) in enumerate(zip(codes, runs)):
            if c:
                print(f"demo: node{n} exited {c}:\n{r.output()[-4000:]}", file=sys.stderr)
        fetched = [l for l in runs[1].output().splitlines() if "fetched from node 0 (replica)" in l]
        if not max(codes) and not fetched:
            print("demo: rank 1 on the new node1 did not resume from node0's peer replica:\n"
                  + runs[1].output()[-4000:], file=sys.stderr)
            return 1
        print(f"demo: node1 (replaced): {fetched[0].strip() if fetched else '(no fetch)'}")
        return max(codes)
    finally:
        rig.close()


def last_step(text: str) -> int:
    steps = [int(l.split()[1]) for l in text.splitlines() if l.startswith("step ") and len(l.split()) == 4]
    return max(steps, default=0)


if __name__ == "__main__":
    sys.exit(main())
