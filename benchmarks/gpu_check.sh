#!/usr/bin/env bash
# GPU check: the CUDA path's tests, the D2H bandwidth and stall benchmark, and the training-loop stall of a
# real forward/backward, in about 5 minutes on one GPU (each part has its own time limit; a part that fails or
# times out does not stop the next ones).
#
# Usage (repository root, on a machine with a CUDA GPU and a CUDA build of PyTorch):
#     bash benchmarks/gpu_check.sh            # results and one log under ${OUT:-benchmarks/results}
# Environment:
#     PYTHON            the interpreter with CUDA torch (default: python3)
#     SNAPCKPT_WHEELHOUSE  a directory of wheels (xxhash, pytest, psutil) for a machine without an index
#     GPU_SIZES_GIB     state sizes of gpu_stall.py (default 1,4)
#     GPU_LOOP_ARGS     extra arguments of gpu_loop.py (default: its 12-layer, d_model 2048 model)
#     SHM_MIN_GIB       /dev/shm is enlarged to this size when smaller, as root (default 64)
# Outputs: gpu_check.log, gpu_tests.xml, gpu_stall.{json,md}, gpu_loop.{json,md}.
# Exit status: non-zero when CUDA is missing or any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1

"$PY" - <<'PYEOF' || exit 2
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA GPU")
print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"Python {sys.version.split()[0]}")
PYEOF
echo "== machine"; date -u; uname -r; nproc; free -g | head -2
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
  --format=csv 2>/dev/null || true
echo "ulimit -l: $(ulimit -l)"
df -h /dev/shm /tmp | cat
shm_gib=$(( $(df -k --output=size /dev/shm | tail -1) / 1048576 ))
if (( shm_gib < ${SHM_MIN_GIB:-64} )) && [[ $(id -u) == 0 ]]; then
  mount -o remount,size="${SHM_MIN_GIB:-64}G" /dev/shm && echo "/dev/shm enlarged to ${SHM_MIN_GIB:-64}G" \
    || echo "could not enlarge /dev/shm (${shm_gib} GiB)"
fi

need=()
for mod in xxhash pytest psutil; do
  "$PY" -c "import $mod" 2>/dev/null || need+=("$mod")
done
if ((${#need[@]})); then
  if [[ -n "${SNAPCKPT_WHEELHOUSE:-}" ]]; then
    "$PY" -m pip install -q --no-index --find-links "$SNAPCKPT_WHEELHOUSE" "${need[@]}"
  else
    "$PY" -m pip install -q "${need[@]}"
  fi
fi
# The core only (no framework extras): importable from the source tree.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

failed=()
part() {  # part NAME SECONDS COMMAND...: run one part under its own time limit
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s)"; local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"; local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  ((rc == 0)) || failed+=("$name:$rc")
}
part tests "${GPU_TESTS_LIMIT:-150}" "$PY" -m pytest -q -p no:cacheprovider tests/gpu_cuda_path.py \
  --junitxml "$OUT/gpu_tests.xml"
part stall "${GPU_STALL_LIMIT:-150}" "$PY" benchmarks/gpu_stall.py --sizes-gib "${GPU_SIZES_GIB:-1,4}" \
  --repeats 3 --out "$OUT/gpu_stall"
# shellcheck disable=SC2086
part loop "${GPU_LOOP_LIMIT:-120}" "$PY" benchmarks/gpu_loop.py --out "$OUT/gpu_loop" ${GPU_LOOP_ARGS:-}

if ((${#failed[@]})); then
  echo "gpu_check: failed parts: ${failed[*]}"
  exit 1
fi
echo "gpu_check: all parts passed"
