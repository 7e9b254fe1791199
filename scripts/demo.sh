#!/usr/bin/env bash
# The main job: train a small GPT with 2 ranks, kill -9 it mid-run, rerun it, and show that it
# resumed from the in-memory snapshot and continued exactly where it stopped.
#
#   1. scripts/setup.sh (the venv, quiet when already done);
#   2. torchrun --nproc_per_node 2 examples/train_gpt.py ... in the background, into runs/demo-*/;
#   3. once the log shows a step past the first memory snapshot (and before the first disk
#      checkpoint), kill -9 torchrun and its worker processes. The node's persister is not a
#      worker: it survives, as it would when only the training processes crash;
#   4. the same command again: it must print "resumed from step N (tier: memory)" and reach the
#      last step;
#   5. the two loss curves side by side; the steps both runs trained must agree bitwise.
#
# Exits non-zero when the resume did not happen, came from another tier, did not finish, or
# produced different losses. Knobs (environment): STEPS, MEMORY_INTERVAL, DISK_INTERVAL,
# SLEEP_PER_STEP, RUN_DIR, NODES.
#
# NODES=2 (needs root): the same job on two simulated nodes of the test rig (tests/multinode.py: own
# host name, /dev/shm and persister each, one shared checkpoint directory), one rank each under
# torchrun --nnodes 2; steps 2-3 lose node 1 whole (processes and memory) and kill node 0's trainers, bring
# up a replacement node 1 and resume from memory, node 1's rank from node 0's peer replica
# (scripts/demo_nodes.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh

STEPS=${STEPS:-60}
MEMORY_INTERVAL=${MEMORY_INTERVAL:-10}
DISK_INTERVAL=${DISK_INTERVAL:-30}
SLEEP_PER_STEP=${SLEEP_PER_STEP:-0.2}
NODES=${NODES:-1}
KILL_AFTER_STEP=$((MEMORY_INTERVAL + MEMORY_INTERVAL / 2))
RUN_DIR=${RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)-$$}
PY=.venv/bin/python
export OMP_NUM_THREADS=1 # what torchrun would set anyway, minus its warning

if [ "$NODES" != 1 ] && [ "$NODES" != 2 ]; then
    echo "demo: NODES must be 1 or 2" >&2
    exit 2
fi
if [ "$KILL_AFTER_STEP" -ge "$DISK_INTERVAL" ] || [ "$KILL_AFTER_STEP" -ge "$STEPS" ]; then
    echo "demo: need MEMORY_INTERVAL * 1.5 < DISK_INTERVAL and < STEPS" >&2
    exit 2
fi
mkdir -p "$RUN_DIR"

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The training command; only the rendezvous port differs between the two runs.
train_cmd() {
    TRAIN=(.venv/bin/torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$1"
        examples/train_gpt.py --checkpoint-dir "$RUN_DIR/checkpoints" --steps "$STEPS"
        --memory-interval "$MEMORY_INTERVAL" --disk-interval "$DISK_INTERVAL" --keep-last 2
        --seed 1234 --sleep-per-step "$SLEEP_PER_STEP" --loss-log "$RUN_DIR/loss.log")
}

last_step() { # the newest "step N loss X" line of a run's output, or 0
    { grep -soE '^step [0-9]+ ' "$1" || true; } | awk '{ n = $2 } END { print n + 0 }'
}

TORCHRUN=""
cleanup() { # never leave our own torchrun or its workers behind
    if [ -n "$TORCHRUN" ] && kill -0 "$TORCHRUN" 2> /dev/null; then
        kill -9 "$TORCHRUN" $(pgrep -P "$TORCHRUN" || true) 2> /dev/null || true
    fi
}
trap cleanup EXIT

one_node() { # runs 1 and 2 on this machine; sets status
    # ---- run 1: train, then kill -9 past the first memory snapshot --------------------------------
    train_cmd "$(free_port)"
    echo "demo: run 1: ${TRAIN[*]}"
    "${TRAIN[@]}" > "$RUN_DIR/run1.out" 2>&1 &
    TORCHRUN=$!

    deadline=$((SECONDS + 180))
    while [ "$(last_step "$RUN_DIR/run1.out")" -lt "$KILL_AFTER_STEP" ]; do
        if ! kill -0 "$TORCHRUN" 2> /dev/null; then
            echo "demo: run 1 ended before step $KILL_AFTER_STEP; its output:" >&2
            cat "$RUN_DIR/run1.out" >&2
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "demo: run 1 did not reach step $KILL_AFTER_STEP in time" >&2
            exit 1
        fi
        sleep 0.1
    done

    WORKERS=$(pgrep -P "$TORCHRUN" | paste -sd ' ' || true)
    kill -9 "$TORCHRUN" $WORKERS
    { wait "$TORCHRUN" || true; } 2> /dev/null
    alive() { # running, not merely a zombie waiting to be reaped
        local state
        state=$(ps -o stat= -p "$1" 2> /dev/null || true)
        [ -n "$state" ] && [ "${state:0:1}" != Z ]
    }
    for pid in $WORKERS; do
        while alive "$pid"; do sleep 0.05; done
    done
    grep -E '^(snapshot of|checkpoint of)' "$RUN_DIR/run1.out" | sed 's/^/  | /' || true
    echo "demo: kill -9 torchrun ($TORCHRUN) and workers ($WORKERS) after step $(last_step "$RUN_DIR/run1.out")"
    TORCHRUN=""

    # ---- run 2: the same command resumes ----------------------------------------------------------
    train_cmd "$(free_port)"
    echo "demo: run 2: ${TRAIN[*]}"
    "${TRAIN[@]}" > "$RUN_DIR/run2.out" 2>&1 || status=$?
}

status=0
if [ "$NODES" = 2 ]; then
    "$PY" scripts/demo_nodes.py --run-dir "$RUN_DIR" --steps "$STEPS" --memory-interval "$MEMORY_INTERVAL" \
        --disk-interval "$DISK_INTERVAL" --sleep-per-step "$SLEEP_PER_STEP" \
        --kill-after-step "$KILL_AFTER_STEP" || status=$?
    [ -f "$RUN_DIR/run2.out" ] || { echo "demo: FAILED: no run 2 (status $status)" >&2; exit 1; }
else
    one_node
fi
grep -E '^(resumed from|snapshot of|checkpoint of)' "$RUN_DIR/run2.out" | sed 's/^/  | /' || true

fail() {
    echo "demo: FAILED: $*; output of run 2 (in $RUN_DIR/run2.out):" >&2
    tail -n 40 "$RUN_DIR/run2.out" >&2
    exit 1
}
[ "$status" -eq 0 ] || fail "run 2 exited with status $status"
grep -qE '^resumed from step [0-9]+ \(tier: memory\)$' "$RUN_DIR/run2.out" ||
    fail "run 2 did not print 'resumed from step N (tier: memory)'"
[ "$(last_step "$RUN_DIR/run2.out")" -eq "$STEPS" ] || fail "run 2 did not reach step $STEPS"

# ---- the two loss curves side by side ---------------------------------------------------------
"$PY" - "$RUN_DIR/run1.out" "$RUN_DIR/run2.out" << 'EOF'
"""Print both runs' losses per step; steps trained by both runs must agree bitwise."""
import re
import sys

def losses(path):
    found = re.findall(r"^step (\d+) loss (\S+)$", open(path).read(), flags=re.M)
    return {int(step): loss for step, loss in found}

killed, resumed = losses(sys.argv[1]), losses(sys.argv[2])
top = max(float(x) for x in list(killed.values()) + list(resumed.values()))
print(f"\n{'step':>4}  {'run 1 (killed)':<20}  {'run 2 (resumed)':<20}  loss")
for step in sorted(set(killed) | set(resumed)):
    a, b = killed.get(step, ""), resumed.get(step, "")
    mark = ("=" if a == b else "DIFFERENT") if a and b else ""
    bar = "#" * round(30 * float(b or a) / top)
    print(f"{step:>4}  {a:<20}  {b:<20}  {bar} {mark}")
both = sorted(set(killed) & set(resumed))
same = all(killed[s] == resumed[s] for s in both)
span = f"steps {both[0]}..{both[-1]}" if both else "no step"
print(f"\n{span} trained by both runs: {'bitwise equal' if same else 'DIFFERENT'}")
sys.exit(0 if both and same else 1)
EOF
echo "demo: OK: run 2 $(grep -E '^resumed from' "$RUN_DIR/run2.out") and finished step $STEPS; files in $RUN_DIR"
