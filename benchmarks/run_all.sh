#!/usr/bin/env bash
# Every benchmark that feeds docs/benchmarks.md, one after the other, then the page itself.
#
#   bash benchmarks/run_all.sh            # from anywhere; about 20 min on an idle 2-core machine
#   SKIP=remote_s3,commit_latency bash benchmarks/run_all.sh
#   PYTHON=/path/to/python bash benchmarks/run_all.sh      # default: the repo's .venv/bin/python
#
# A step that fails is reported and the next one runs (the page shows what exists in
# benchmarks/results/). Each step's wall time and exit status are printed, and a summary at the end;
# the exit status is 1 when any step failed. Run it on an idle machine: the page quotes ratios within
# one run, but every figure shares the cores with whatever else runs.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SKIP=${SKIP:-}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary=()
failed=0
total_start=$(date +%s)

step() {  # step NAME COMMAND...
    local name=$1
    shift
    if [[ ",$SKIP," == *",$name,"* ]]; then
        summary+=("$(printf '%-15s skipped' "$name")")
        return
    fi
    echo "=== $name: $* ($(date -u +%H:%M:%S) UTC; $(cut -d' ' -f1-3 /proc/loadavg) load)" >&2
    local t0 rc dt
    t0=$(date +%s)
    "$@"
    rc=$?
    dt=$(( $(date +%s) - t0 ))
    echo "=== $name: exit $rc after $dt s" >&2
    summary+=("$(printf '%-15s %5d s  exit %d' "$name" "$dt" "$rc")")
    [[ $rc -eq 0 ]] || failed=1
}

step suite          "$PY" benchmarks/suite.py --sizes-gib 0.5 --rounds 2
step loop           "$PY" benchmarks/suite.py --loop --loop-size-gib 0.5
step recovery       "$PY" benchmarks/recovery.py --size-gib 0.5 --repeats 3
step many_tensors   "$PY" benchmarks/many_tensors.py --total-mib 256
step first_save     "$PY" benchmarks/first_save.py --size-gib 0.5
step memory_budget  "$PY" benchmarks/memory_budget.py --size-gib 0.5
step commit_latency "$PY" benchmarks/commit_latency.py
step remote_s3      "$PY" benchmarks/remote_s3.py --mib 64 --repeats 2 --loop-steps 40 --loop-mib 96 --every 5
step results_page   "$PY" benchmarks/results_page.py
step perf_section   "$PY" benchmarks/suite.py --readme  # docs/performance.md "Results" from the same run

echo "--- run_all: $(( $(date +%s) - total_start )) s in all; load now $(cut -d' ' -f1-3 /proc/loadavg)" >&2
printf '%s\n' "${summary[@]}" >&2
exit $failed
