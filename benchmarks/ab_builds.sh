#!/usr/bin/env bash
# Side-by-side builds of the extension in one device session: this tree ("main") and one tree per overlay
# folder (files laid over a copy of this tree, e.g. an older csrc/nvfp4_experts.cu and its pack.py), built in
# parallel, then COMMAND run in each tree in turn, ROUNDS times (main, A, B, ..., main, A, ...), so that the
# variants share the machine's state and drift. Logs: $OUT/ab_<variant>_r<round>.log (TAG=x: ab_<variant>_x_r...).
# AB_REUSE=1 keeps the trees and builds of an earlier call (same overlays) and only runs the command.
#
#   OUT=/tmp/o benchmarks/ab_builds.sh [-n ROUNDS] ab/A ab/B -- python3 benchmarks/bench_experts.py --rows 1,8,16
set -u
OUT=${OUT:-runs/ab}; mkdir -p "$OUT"
rounds=1
if [ "${1:-}" = -n ]; then rounds=$2; shift 2; fi
overlays=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do overlays+=("$1"); shift; done
[ "${1:-}" = -- ] || { echo "usage: $0 [-n ROUNDS] OVERLAY... -- COMMAND..." >&2; exit 2; }
shift
[ $# -gt 0 ] || { echo "$0: no command" >&2; exit 2; }
root=$PWD
names=(main); dirs=("$root")
for o in "${overlays[@]}"; do
  [ -d "$o" ] || { echo "$0: overlay $o is not a folder" >&2; exit 2; }
  n=$(basename "$o"); d=/tmp/ab_$n
  names+=("$n"); dirs+=("$d")
  [ "${AB_REUSE:-0}" = 1 ] && continue
  rm -rf "$d"; mkdir -p "$d"
  tar -C "$root" --exclude=./ab --exclude=./runs --exclude=./build --exclude=./.venv --exclude='*.so' -cf - . | tar -C "$d" -xf -
  cp -r "$o"/. "$d"/
done
if [ "${AB_REUSE:-0}" != 1 ]; then
  jobs=$(( $(nproc) / ${#dirs[@]} )); [ "$jobs" -ge 1 ] || jobs=1
  t0=$SECONDS
  for i in "${!dirs[@]}"; do
    (cd "${dirs[$i]}" && ROCKET_CUDA_ARCHS=${ROCKET_CUDA_ARCHS:-90} MAX_JOBS=$jobs python3 setup.py build_ext --inplace \
       > "$OUT/ab_${names[$i]}_build.log" 2>&1; echo "build ${names[$i]}: rc=$?") &
  done
  wait
  echo "builds: $((SECONDS - t0)) s"
fi
tag=${TAG:+_$TAG}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
for r in $(seq 1 "$rounds"); do
  for i in "${!dirs[@]}"; do
    t1=$SECONDS
    (cd "${dirs[$i]}" && PYTHONPATH=${dirs[$i]} timeout "${T:-300}" "$@" > "$OUT/ab_${names[$i]}${tag}_r$r.log" 2>&1)
    echo "${names[$i]} round $r: rc=$? ($((SECONDS - t1)) s)"
  done
done
