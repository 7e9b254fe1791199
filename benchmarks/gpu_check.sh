#!/usr/bin/env bash
# GPU check: the CUDA path's tests and the GPU stall benchmark, in under 5 minutes on one GPU.
#
# Usage (repository root, on a machine with a CUDA GPU and a CUDA build of PyTorch):
#     bash benchmarks/gpu_check.sh            # results under ${OUT:-benchmarks/results}
# Environment:
#     PYTHON            the interpreter with CUDA torch (default: python3)
#     SNAPCKPT_WHEELHOUSE  a directory of wheels (xxhash, pytest, psutil) for a machine without an index
#     GPU_SIZES_GIB     state sizes for the benchmark (default 1,4)
# Exit status: non-zero when a test fails or CUDA is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"

"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA GPU")
print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PYEOF

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

"$PY" -m pytest -q -p no:cacheprovider tests/gpu_cuda_path.py --junitxml "$OUT/gpu_tests.xml"
"$PY" benchmarks/gpu_stall.py --sizes-gib "${GPU_SIZES_GIB:-1,4}" --repeats 3 --out "$OUT/gpu_stall"
