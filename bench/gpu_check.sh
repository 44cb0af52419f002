#!/usr/bin/env bash
# GPU readiness check — one prepared script for a lent CUDA machine (torch already installed there,
# no network, possibly no platformdirs: flashrt then caches under ~/.cache/flashrt). Installs flashrt
# from this checkout without touching torch, runs the CUDA tests, then the GPU benchmarks; the step
# limits sum to at most 480 s (issue #17), so the whole run stays under 8 minutes. The TensorRT steps (issue #18)
# run where `import tensorrt` works there (its wheels are too large to carry in .whl/); elsewhere they are
# logged as skipped (test_tensorrt's GPU cases run in their own step, not in cuda-tests).
#
#   bash bench/gpu_check.sh            # logs and JSON results under $OUT (default /tmp/flashrt-gpu)
#   bash bench/gpu_check.sh --dry-run  # on any machine (CI runs it): checks every step's command,
#                                        the time budget and that the CUDA tests collect; runs nothing
#   bash bench/gpu_check.sh --only cuda-tests,bench-pi0-gpu   # a rerun of some steps (install and info
#                                        always run), to spend a lease's remaining minutes on what failed
#
# Pure-Python packages the GPU machine lacks travel as wheels in .whl/ (git-ignored), installed first:
#   pip download --no-deps --only-binary=:all: -d .whl <package>
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/flashrt-gpu}"
PY="${PYTHON:-python3}"
DRY=0
ONLY=""
case "${1:-}" in
  --dry-run) DRY=1 ;;
  --only) ONLY=",${2:?--only needs step names, comma-separated},install,info," ;;
  "") ;;
  *) echo "usage: bash bench/gpu_check.sh [--dry-run | --only STEP,STEP...]"; exit 2 ;;
esac
BUDGET=480
export PYTHONUNBUFFERED=1
status=0
spent=0

step() {  # step NAME SECONDS CMD... : run with a time limit, log to $OUT/NAME.log, remember failures
  local name=$1 limit=$2; shift 2
  spent=$((spent + limit))
  if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]]; then
    echo "=== $name: not asked for (--only)"
    return
  fi
  if [ "$DRY" -eq 1 ]; then
    echo "dry-run: $name (${limit}s): $*"
    return
  fi
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=1
}

trt_step() {  # trt_step NAME SECONDS CMD...: a step that needs the tensorrt package; skipped without it
  if [ "$DRY" -eq 0 ] && ! "$PY" -c "import tensorrt" >/dev/null 2>&1; then
    spent=$((spent + $2))
    echo "=== $1: skipped (no tensorrt importable by $PY)" | tee "$OUT/$1.log"
    return
  fi
  step "$@"
}

need() {  # need FILE: a script a step runs must exist (dry-run fails otherwise)
  [ -f "$1" ] || { echo "gpu_check: $1 is missing"; status=1; }
}

mkdir -p "$OUT"
if [ "$DRY" -eq 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/flashrt-site .whl/*.whl
  export PYTHONPATH="/tmp/flashrt-site:${PYTHONPATH:-}"
fi
need bench/runtime_block.py
need bench/pi0_gpu.py
need bench/pi0_host_work.py
need bench/orpheus_streams.py
need bench/act_talk_gpu.py
step install 25 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e .
step info 15 "$PY" -m flashrt.cli info --device cuda
# measured on the first H200 run (2026-12-04): cuda-tests 47 s with the nvcc build, the Orpheus streams' load
# 21-23 s and its four levels ~4 s; the pi0 step gets what they leave (write + load ~35 s per variant)
step cuda-tests 63 "$PY" -m pytest -q -m cuda -p no:cacheprovider --ignore=tests/runtime/test_tensorrt.py tests
step bench-runtime-block 25 "$PY" bench/runtime_block.py --device cuda --out "$OUT/runtime-block"
# the bench's own budget stays 15 s inside the step's limit, so it prints its JSON line before the kill
PI0_GPU_LIMIT=115
# 2 cameras (the target's case), both variants, every module in bf16: the first run (lerobot's recipe, fp32
# SigLIP) measured 38.1 ms at 2 cameras and ~9.6 ms more per camera; the vision tower's dtype is the question.
# --kernel-profile: the eager sibling's top kernels by device time (where a replay's time goes)
step bench-pi0-gpu $PI0_GPU_LIMIT "$PY" bench/pi0_gpu.py --cameras 2 --fp32-modules none --iters 50 --kernel-profile \
  --budget-s $((PI0_GPU_LIMIT - 15)) --out "$OUT"
# host work per infer() outside the replay on the GPU (issue #17: <= 0.3 ms), tiny preset, allocations too
step bench-pi0-host-work 17 "$PY" bench/pi0_host_work.py --device cuda --preset tiny --calls 50
# TensorRT (issue #18): the backend's GPU tests verbosely (parity with eager on the buffers, the second
# capture from the engine cache, replay on a side stream and inside a CUDA graph, bf16/fp16 builds), then
# one Gemma layer at full size in bf16: CUDA graph vs a TensorRT engine (strongly typed bf16), interleaved
trt_step tensorrt-tests 25 "$PY" -m pytest -q -m cuda -rs -p no:cacheprovider tests/runtime/test_tensorrt.py
trt_step bench-runtime-block-tensorrt 25 "$PY" -m flashrt.cli bench runtime-block -p h200-bf16 --vs tensorrt --iters 30 --warmup 3 --no-progress --no-plot --out "$OUT/runtime-block-tensorrt"
# Orpheus-style TTS chain at Orpheus-3B size, random weights, bf16, CUDA graphs: TTFA (stage "ttfa"), RTF.
# The h200-bf16 profile with a 2-input trace: its quality gate decodes each input eagerly (168 tokens of a
# 3B LM, token by token), and 16 of them did not fit the step (the first GPU run was killed at 45 s)
sed 's/^trace_len = .*/trace_len = 2/' profiles/h200-bf16.toml >"$OUT/h200-bf16-tts.toml"
step bench-tts-orpheus 75 "$PY" -m flashrt.cli bench tts-orpheus -p "$OUT/h200-bf16-tts.toml" --iters 5 --warmup 1 --no-progress --out "$OUT/tts-orpheus"
# many streams (issue #29): the same Orpheus-3B-sized random LM with 1, 4, 8, 16 streams decoding together
# (slot-batched decode, one captured step per batch bucket): per-stream TTFA and RTF; budget inside the limit
step bench-orpheus-streams 40 "$PY" bench/orpheus_streams.py --device cuda --preset full --streams 1,4,8,16 --budget-s 30
# a robot that acts and talks (issue #31): full-size Pi0.5 at 50 Hz beside an Orpheus-3B-sized stream,
# naive threads vs one Runtime (control on a high-priority CUDA stream): misses, RTF, underruns
step bench-act-talk-gpu 55 "$PY" bench/act_talk_gpu.py --budget-s 40 --fp32-modules none
if [ "$spent" -gt "$BUDGET" ]; then
  echo "gpu_check: step limits sum to ${spent}s, over the ${BUDGET}s budget"
  status=1
fi
if [ "$DRY" -eq 1 ]; then
  cuda_files=$(grep -rl "mark.cuda" tests --include='test_*.py')   # only the files holding CUDA tests
  "$PY" -m pytest -q -m cuda -p no:cacheprovider --collect-only $cuda_files >"$OUT/collect.log" 2>&1 \
    || { echo "gpu_check: the CUDA tests do not collect (see $OUT/collect.log)"; status=1; }
  "$PY" bench/pi0_gpu.py --help >/dev/null || { echo "gpu_check: bench/pi0_gpu.py --help fails"; status=1; }
  "$PY" bench/runtime_block.py --help >/dev/null || { echo "gpu_check: bench/runtime_block.py --help fails"; status=1; }
  echo "gpu_check dry-run: $([ $status -eq 0 ] && echo PASS || echo FAIL) (${spent}s of ${BUDGET}s)"
  exit $status
fi
echo "gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL) (logs in $OUT)"
exit $status
