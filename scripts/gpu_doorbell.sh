#!/usr/bin/env bash
# The shm / verbs graphed exchange on one GPU (ranks sharing it), in stages; each step bounded by a timeout:
#   bash scripts/gpu_doorbell.sh [build] [tests] [fault] [fires] [tokens] [mps] [proxy]     (default: all)
#   build   the extension in place (setup.py build_ext --inplace, as scripts/gpu_check.sh)
#   tests   tests/test_doorbell_gpu.py (kernels in one process; 2 and 3 ranks in a graph against cuda-ipc) and
#           tests/test_ipc_exchange.py
#   fault   ROCKET_FAULT=stall:rank=1,step=3 over shm, graphed, --fabric-timeout 3: one error line, exit != 0
#   fires   static fires over shm, graphed: default NVFP4, default BF16, glm5-tiny NVFP4, at 2 and 3 ranks
#   tokens  decode over shm and over cuda-ipc (graphed, 2 ranks): the same tokens; the step tables of both
#   mps     under MPS: fabric-bench --graph over shm beside cuda-ipc, and decode step times over both
#   proxy   benchmarks/bench_proxy.py (CPU only): where the proxy runs
# Logs under $OUT (default runs/gpu_doorbell); the summary, one line per step, is printed at the end.
# Env: PYTHON (default: the first python with torch), MPIRUN (default: mpirun, with --allow-run-as-root as root).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_doorbell}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3 python .venv/bin/python; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then PY="$c"; break; fi
  done
fi
PY="${PY:-python3}"
export ROCKET_CUDA_ARCHS="${ROCKET_CUDA_ARCHS:-90}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RUN=(${MPIRUN:-mpirun})   # local ranks inherit this environment (PYTHONPATH, ROCKET_FAULT, the MPS pipe)
if "${RUN[0]}" --version 2>/dev/null | grep -q "Open MPI"; then
  RUN+=(--oversubscribe --bind-to none)   # the proxy thread needs a core beside the rank's waiting thread
  [ "$(id -u)" = 0 ] && RUN+=(--allow-run-as-root)
fi
export ROCKET_MPIEXEC="${RUN[*]}"   # static-fire starts its runs with the same launcher
SUMMARY="$OUT/summary.log"
: > "$SUMMARY"
say() { echo "== $*" | tee -a "$SUMMARY"; }
step() {  # step NAME SECONDS CMD...: run with a timeout, log to $OUT/NAME.log, one summary line
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  say "$name: exit $rc in $((SECONDS - t0)) s"
  return $rc
}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build tests fault fires tokens mps proxy)
want() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

if want build; then
  rm -f rocket_mpi/_C*.so
  step build 400 env MAX_JOBS=8 "$PY" setup.py build_ext --inplace
  "$PY" -c "import rocket_mpi._C" >> "$OUT/build.log" 2>&1 && say "build ok" || { say "BUILD FAILED"; tail -30 "$OUT/build.log"; }
fi

if want tests; then
  step tests 400 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_doorbell_gpu.py tests/test_ipc_exchange.py
  tail -4 "$OUT/tests.log" | tee -a "$SUMMARY"
fi

if want fault; then
  export ROCKET_FAULT=stall:rank=1,step=3
  step fault 150 "${RUN[@]}" -np 2 "$PY" -m rocket_mpi decode --checkpoint preset:default:nvfp4 --device cuda \
    --fabric shm --decode-path graph --streams 4 --tokens 8 --fabric-timeout 3 --quiet
  unset ROCKET_FAULT
  grep -E "rocket_mpi: error|ROCKET_FAULT" "$OUT/fault.log" | tee -a "$SUMMARY"
fi

if want fires; then
  for ck in preset:default:nvfp4 preset:default preset:glm5-tiny:nvfp4; do
    for n in 2 3; do
      name="fire_${ck//[:]/_}_$n"
      step "$name" 240 "$PY" -m rocket_mpi static-fire --checkpoint "$ck" --ranks "$n" --device cuda --fabric shm \
        --decode-path graph --sweep 1,8 --tokens 12
      grep -E "STATIC FIRE" "$OUT/$name.log" | tail -1 | sed "s|^|   $ck, $n ranks: |" | tee -a "$SUMMARY"
    done
  done
fi

decode_pair() {  # decode_pair TAG: default NVFP4, 2 ranks, graphed, over shm then cuda-ipc
  for fab in shm cuda-ipc; do
    step "decode_$1_$fab" 200 "${RUN[@]}" -np 2 "$PY" -m rocket_mpi decode --checkpoint preset:default:nvfp4 \
      --device cuda --fabric "$fab" --decode-path graph --streams 8 --tokens 20 --out "$OUT/decode_$1_$fab.json"
    grep -A2 "ms/step" "$OUT/decode_$1_$fab.log" | sed "s|^|   $fab: |" | tee -a "$SUMMARY"
  done
}

if want tokens; then
  decode_pair timesliced
  "$PY" - "$OUT/decode_timesliced_shm.json" "$OUT/decode_timesliced_cuda-ipc.json" <<'EOF' | tee -a "$SUMMARY"
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
print("   tokens: SAME over shm and cuda-ipc" if a["tokens"] == b["tokens"] else "   tokens: DIFFERENT")
EOF
fi

if want mps; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && say "MPS daemon started"
  trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
  step bench_mps 400 "${RUN[@]}" -np 2 "$PY" -m rocket_mpi fabric-bench --device cuda --graph --fabric shm \
    --versus cuda-ipc --sizes 2K,8K,32K,64K,128K,512K --reps 5
  grep -A12 "fabric-bench --graph" "$OUT/bench_mps.log" | tee -a "$SUMMARY"
  decode_pair mps
  echo quit | nvidia-cuda-mps-control && say "MPS daemon stopped"
  trap - EXIT
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

if want proxy; then
  step proxy 200 "${RUN[@]}" -np 2 "$PY" benchmarks/bench_proxy.py --iters 300 --reps 5
  tail -5 "$OUT/proxy.log" | tee -a "$SUMMARY"
fi

echo
echo "==== summary ($OUT/summary.log)"
cat "$SUMMARY"
