#!/usr/bin/env bash
# The GPU steps in one command: build the CUDA extension, run the kernel tests, run the benchmark.
#   bash scripts/gpu_check.sh            (from anywhere; logs under $OUT, default runs/gpu_check)
# Env: PYTHON (default python3), ROCKET_CUDA_ARCHS (default 90: the H200), BENCH_ARGS (extra flags).
# Exit status: 0 only when the build and every kernel test passed (the benchmark only reports).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then  # the first interpreter that has torch
  for c in python3 python .venv/bin/python; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then PY="$c"; break; fi
  done
fi
PY="${PY:-python3}"
export ROCKET_CUDA_ARCHS="${ROCKET_CUDA_ARCHS:-90}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the in-place build is found without an install
log() { echo "== $*" | tee -a "$OUT/summary.log"; }
: > "$OUT/summary.log"

log "environment"
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  nvcc --version | tail -2; } 2>&1 | tee "$OUT/env.log"

log "build (ptxas report of sm_90 and sm_121 in build.log)"
build_ok=0
{
  make -C csrc clean && make -C csrc ARCHS="90 121"           # the CI compile check, with registers/spills
  rm -f rocket_mpi/_C*.so
  ROCKET_PTXAS_VERBOSE=1 MAX_JOBS=4 "$PY" setup.py build_ext --inplace \
    || ROCKET_PTXAS_VERBOSE=1 MAX_JOBS=4 "$PY" -m pip install --no-deps --no-build-isolation -e .
} > "$OUT/build.log" 2>&1
if "$PY" -c "import torch, rocket_mpi._C" >> "$OUT/build.log" 2>&1; then
  build_ok=1
  log "build ok: $(ls rocket_mpi/_C*.so 2>/dev/null | head -1)"
  grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | head -20 | tee -a "$OUT/summary.log"
else
  log "BUILD FAILED: tail of $OUT/build.log"
  tail -40 "$OUT/build.log" | tee -a "$OUT/summary.log"
fi

# the kernel tests: the expert kernels, their weight layouts, the lane emulation of their launches, the scatter
# (each file also runs as a script, without pytest); with pytest and safetensors (tests/conftest.py writes the tiny
# checkpoints with it) also the stack's linears and MLPs in the same kernel's BF16 tiles
tests="tests/test_pack.py tests/test_lane_emulation.py tests/test_expert_kernels.py tests/test_scatter.py"
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  noconf=""
  if "$PY" -c "import safetensors" >/dev/null 2>&1; then
    tests="$tests tests/test_stack.py"
  else
    noconf="--noconftest"  # the files above need no checkpoint
    log "no safetensors: tests/test_stack.py skipped"
  fi
  log "tests: $tests"
  # shellcheck disable=SC2086
  "$PY" -m pytest -v -s -rs -p no:cacheprovider $noconf $tests 2>&1 | tee "$OUT/test.log"
  test_rc=${PIPESTATUS[0]}
else
  log "tests (no pytest: each file as a script; tests/test_stack.py skipped): $tests"
  : > "$OUT/test.log"
  test_rc=0
  for t in $tests; do  # each file has its own runner: no pytest here
    "$PY" "$t" 2>&1 | tee -a "$OUT/test.log"
    rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || test_rc=$rc
  done
fi
log "tests exit status $test_rc: $(tail -1 "$OUT/test.log")"

if [ "$build_ok" = 1 ]; then
  log "benchmark: benchmarks/bench_experts.py --profile ${BENCH_ARGS:-}"
  # shellcheck disable=SC2086
  "$PY" benchmarks/bench_experts.py --profile ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  log "benchmark exit status ${PIPESTATUS[0]}"
fi

log "logs in $OUT: summary.log env.log build.log test.log bench.log"
[ "$build_ok" = 1 ] && [ "$test_rc" = 0 ]
