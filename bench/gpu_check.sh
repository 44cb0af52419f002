#!/usr/bin/env bash
# GPU readiness check — one prepared script for a lent CUDA machine (torch already installed there,
# no network). Installs flashrt from this checkout without touching torch, runs the CUDA tests, then
# the GPU benchmarks; the whole run stays under 8 minutes (each step has its own time limit).
#
#   bash bench/gpu_check.sh            # writes logs and JSON results under $OUT (default /tmp/flashrt-gpu)
#
# Pure-Python packages that machine lacks (platformdirs) travel as wheels in .whl/ (git-ignored):
#   pip download --no-deps --only-binary=:all: -d .whl platformdirs
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/flashrt-gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS CMD... : run with a time limit, log to $OUT/NAME.log, remember failures
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=1
}

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/flashrt-site .whl/*.whl
  export PYTHONPATH="/tmp/flashrt-site:${PYTHONPATH:-}"
fi
if ! "$PY" -c "import platformdirs" 2>/dev/null; then
  echo "gpu_check: platformdirs is missing and no wheel was carried; here, before the run:"
  echo "  pip download --no-deps --only-binary=:all: -d .whl platformdirs   (and carry .whl)"
  exit 2
fi
step install 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e .
step info 60 "$PY" -m flashrt.cli info --device cuda
step cuda-tests 240 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
[ -f bench/runtime_block.py ] && step bench-runtime-block 90 "$PY" bench/runtime_block.py --device cuda --out "$OUT/runtime-block"
[ -f bench/pi0_gpu.py ] && step bench-pi0-gpu 200 "$PY" bench/pi0_gpu.py --out "$OUT"
# Orpheus-style TTS chain at Orpheus-3B size, random weights, bf16, CUDA graphs: TTFA (stage "ttfa"), RTF
step bench-tts-orpheus 150 "$PY" -m flashrt.cli bench tts-orpheus -p h200-bf16 --iters 5 --warmup 1 --no-progress --out "$OUT/tts-orpheus"
echo "gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL) (logs in $OUT)"
exit $status
