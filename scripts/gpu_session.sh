#!/usr/bin/env bash
# One device session on a host with 2 GPUs: environment check, GPU static fires, decode benchmark beside
# transformers. Logs go to $OUT (or runs/gpu). Usage: scripts/gpu_session.sh [STEP...] (the names of the case
# below; default: check build kernels fire decode hf; x2: the two-GPU set)
set -u
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
steps=${*:-check build kernels fire decode hf}
PRESET=${PRESET:-air8}
# the kernel tests (the expert kernels, their layouts, the scatter, the stack's linears in the same kernel's BF16
# tiles) and the device decode path's GPU tests (the plan, router, step kernels, exchange, graphed step, models)
KERNEL_TESTS="tests/test_pack.py tests/test_lane_emulation.py tests/test_expert_kernels.py tests/test_scatter.py tests/test_stack.py"
DEVICE_TESTS="tests/test_plan.py tests/test_prefill.py tests/test_graph_step.py tests/test_ipc_exchange.py tests/test_router.py"
DEVICE_TESTS="$DEVICE_TESTS tests/test_step_kernels.py tests/test_attention.py tests/test_glm5_next_kernels.py tests/test_glm5_device.py"
run() { local name=$1 t0=$SECONDS rc; shift; echo "=== $name: $*"; timeout "${T:-300}" "$@" > "$OUT/$name.log" 2>&1; rc=$?; echo "rc=$rc ($((SECONDS - t0)) s)"; tail -n "${TAIL:-25}" "$OUT/$name.log"; }
# x2: the two-GPU steps in one call (about 8-9 minutes with the build): NVFP4 and BF16 experts (the kernel's tiles)
# on 1 and 2 GPUs; BF16 at M=64 is where the split has the most bytes to divide (there it gains most: about 1.5x)
[ "$steps" = x2 ] && steps="check build fire_graph fire_long fire_bf16 paths paths2 bf16 fabgraph" && PATHS=${PATHS:-graph} \
  && LONG_FABRICS=${LONG_FABRICS:-nccl} && SWEEP=${SWEEP:-1,8,16,64}
for s in $steps; do case $s in
check)
  nvidia-smi -L; nvidia-smi topo -m | head -5
  python3 -c "import torch, mpi4py, transformers, safetensors, tokenizers; from cuda.bindings import driver; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'mpi4py', mpi4py.__version__, 'transformers', transformers.__version__)"
  mpirun --version | head -1 ;;
build)
  T=300 run build env ROCKET_CUDA_ARCHS=90 MAX_JOBS=8 python3 setup.py build_ext --inplace
  python3 -c "import torch, rocket_mpi.ops as k; print('kernels available:', k.available(), k.unavailable_reason() if not k.available() else '')" ;;
kernels)
  T=120 run kernels python3 -m pytest -q -rs -p no:cacheprovider $KERNEL_TESTS ;;
devtests)
  T=200 run devtests python3 -m pytest -q -rs -p no:cacheprovider $DEVICE_TESTS $KERNEL_TESTS ;;
fire_graph)
  for f in cuda-ipc nccl; do
    T=240 run "fire_graph_$f" python3 -m rocket_mpi static-fire --checkpoint preset:default:nvfp4 --ranks 2 --device cuda --fabric $f --decode-path graph --sweep 1,8 --tokens 12
  done
  T=240 run fire_graph_ipc3 python3 -m rocket_mpi static-fire --checkpoint preset:default:nvfp4 --ranks 3 --device cuda --fabric cuda-ipc --decode-path graph --sweep 1,8 --tokens 12 ;;
fire_long)  # prompts of 700-1300 tokens: prefill in attention blocks and chunks (--prefill-chunk 1024), then graphed decode
  python3 -c "import json, random; r = random.Random(5); json.dump([[r.randrange(2, 400) for _ in range(n)] for n in (1100, 700, 1300)], open('$OUT/long_prompts.json', 'w'))"
  for f in ${LONG_FABRICS:-cuda-ipc nccl}; do  # x2: nccl only (cuda-ipc needs no second GPU: run it on one)
    T=240 run "fire_long_$f" python3 -m rocket_mpi static-fire --checkpoint preset:default:nvfp4 --ranks 2 --device cuda --fabric $f --decode-path graph --prompts "$OUT/long_prompts.json" --tokens 12 --prefill-chunk 1024
  done ;;
fire_bf16)
  for f in cuda-ipc nccl; do
    T=240 run "fire_graph_bf16_$f" python3 -m rocket_mpi static-fire --checkpoint preset:default --ranks 2 --device cuda --fabric $f --decode-path graph --sweep 1,8 --tokens 12
  done ;;
bf16)  # BF16 experts (the kernel's BF16 tiles), one GPU; then two
  T=300 run "decode1_${PRESET}_bf16_graph" python3 -m rocket_mpi decode --checkpoint "preset:$PRESET" --device cuda --decode-path graph --sweep ${SWEEP:-1,8} --tokens 16
  for f in ${FABRICS:-cuda-ipc}; do
    T=300 run "decode2_${PRESET}_bf16_graph_$f" mpirun --allow-run-as-root --bind-to none -n 2 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED python3 -m rocket_mpi decode --checkpoint "preset:$PRESET" --device cuda --fabric $f --decode-path graph --sweep ${SWEEP:-1,8} --tokens 16
  done ;;
fire_bf16_glm5)  # BF16 experts (the kernel's BF16 tiles) in the GLM-5 families' graphed step, split vs one rank
  for p in dsa-tiny glm5-tiny; do
    T=240 run "fire_graph_bf16_$p" python3 -m rocket_mpi static-fire --checkpoint preset:$p --ranks 2 --device cuda --fabric cuda-ipc --decode-path graph --sweep 1,8 --tokens 12
  done ;;
fire_glm5)  # the GLM-5 families' fixed-shape step captured (not yet under auto: model GRAPH_CHECKED)
  for p in dsa-tiny glm5-tiny; do
    T=240 run "fire_graph_$p" python3 -m rocket_mpi static-fire --checkpoint preset:$p:nvfp4 --ranks ${RANKS:-2} --device cuda --fabric cuda-ipc --decode-path graph --sweep 1,8 --tokens 12
    T=240 run "decode1_${p}_paths" bash -c "for d in host graph; do python3 -m rocket_mpi decode --checkpoint preset:$p:nvfp4 --device cuda --decode-path \$d --sweep 8 --tokens 16; done"
  done ;;
fire_host)
  T=240 run fire_host_ipc python3 -m rocket_mpi static-fire --checkpoint preset:default:nvfp4 --ranks 2 --device cuda --fabric cuda-ipc --decode-path host --sweep 1,8 --tokens 12 ;;
paths)
  for p in ${PATHS:-host device graph}; do
    T=300 run "decode1_${PRESET}_$p" python3 -m rocket_mpi decode --checkpoint "preset:$PRESET:nvfp4" --device cuda --decode-path $p --sweep ${SWEEP:-1,8} --tokens 16
  done ;;
paths2)
  for f in ${FABRICS:-cuda-ipc nccl}; do
    T=300 run "decode2_${PRESET}_graph_$f" mpirun --allow-run-as-root --bind-to none -n 2 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED python3 -m rocket_mpi decode --checkpoint "preset:$PRESET:nvfp4" --device cuda --fabric $f --decode-path graph --sweep ${SWEEP:-1,8} --tokens 16
  done ;;
fire_big)  # static fire on $PRESET (BF16 experts, the kernel's tiles), 2 ranks one per GPU, at the large M of SWEEP
  T=400 run "fire_graph_${PRESET}_bf16" python3 -m rocket_mpi static-fire --checkpoint "preset:$PRESET" --ranks 2 --device cuda --fabric cuda-ipc --decode-path graph --sweep ${SWEEP:-64} --tokens 8 ;;
profile)
  T=200 run "profile_${PRESET}" python3 benchmarks/profile_gpu_step.py "preset:$PRESET:nvfp4" 8 ;;
long)  # whole long runs: ms per step by window of steps as the step's span follows the positions, capture costs
  T=300 run "long_${PRESET}" python3 benchmarks/bench_long_run.py "preset:$PRESET:nvfp4" --sweep 1,8 --tokens ${LONG_TOKENS:-3000} --rounds 1 main ;;
prefill)  # one long prompt's prefill: one block, blocks (rows and score size), blocks + chunks: GPU memory, seconds
  for p in ${PREFILL_PRESETS:-air8 glm5-4l glm5-flash-4l}; do
    T=300 run "prefill_$p" python3 benchmarks/bench_prefill_memory.py "preset:$p:nvfp4" --device cuda --lengths ${PREFILL_LENGTHS:-8192,16384}
  done ;;
fabgraph)
  for f in ${FABRICS:-cuda-ipc nccl}; do
    T=200 run "fabgraph_$f" mpirun --allow-run-as-root --bind-to none -n 2 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED python3 -m rocket_mpi fabric-bench --fabric $f --device cuda --graph --sizes 2K..4M --reps 5
  done ;;
faults)  # a stalled / dead rank on the graphed cuda-ipc step (after capture): non-zero exit naming it, no hang
  for f in stall die; do
    T=120 run "fault_graph_$f" env ROCKET_FAULT=$f:rank=1,step=3 mpirun --allow-run-as-root --bind-to none -n 2 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x ROCKET_FAULT python3 -m rocket_mpi decode --checkpoint preset:default:nvfp4 --device cuda --fabric cuda-ipc --decode-path graph --streams 4 --tokens 8 --fabric-timeout 3
  done ;;
fire_kernel)
  T=240 run fire_ipc_nvfp4_kernel python3 -m rocket_mpi static-fire --checkpoint preset:default:nvfp4 --ranks 2 --device cuda --fabric cuda-ipc --sweep 1,8 --tokens 12
  T=240 run fire_nccl_nvfp4_kernel python3 -m rocket_mpi static-fire --checkpoint preset:default:nvfp4 --ranks 2 --device cuda --fabric nccl --sweep 1,8 --tokens 12 ;;
fire)
  T=240 run fire_nccl python3 -m rocket_mpi static-fire --checkpoint preset:default --ranks 2 --device cuda --fabric nccl --sweep 1,8 --tokens 12
  T=240 run fire_ipc python3 -m rocket_mpi static-fire --checkpoint preset:default --ranks 2 --device cuda --fabric cuda-ipc --sweep 1,8 --tokens 12
  T=240 run fire_ipc_nvfp4 python3 -m rocket_mpi static-fire --checkpoint preset:default:nvfp4 --ranks 2 --device cuda --fabric cuda-ipc --sweep 1,8 --tokens 12 ;;
decode)
  for q in ${VARIANTS:-:nvfp4 bf16}; do
    [ "$q" = bf16 ] && q=""
    T=300 run "decode1${q#:}" python3 -m rocket_mpi decode --checkpoint "preset:$PRESET$q" --device cuda --sweep 1,8 --tokens 16
    T=300 run "decode2${q#:}" mpirun --allow-run-as-root --bind-to none -n 2 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED python3 -m rocket_mpi decode --checkpoint "preset:$PRESET$q" --device cuda --fabric cuda-ipc --sweep 1,8 --tokens 16
  done ;;
fabbench)
  for f in cuda-ipc nccl; do
    T=200 run "fabbench_$f" mpirun --allow-run-as-root --bind-to none -n 2 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED python3 -m rocket_mpi fabric-bench --fabric $f --device cuda --sizes 2K..4M --reps 3 --iters 200
  done ;;
experts)
  T=240 run bench_experts python3 benchmarks/bench_experts.py --decode 1,8,32 ;;
stack)  # the stack held as NVFP4: its launches one kind at a time, then glm5-flash-4l's and air8's graphed step with the
        # stack NVFP4 (:nvfp4-all) and BF16 (:nvfp4), and the first's step kernel by kernel
  T=200 run bench_stack_nvfp4 python3 benchmarks/bench_stack_nvfp4.py --rows 1,8,16
  for p in glm5-flash-4l air8; do for q in nvfp4-all nvfp4; do
    T=200 run "decode_${p}_$q" python3 -m rocket_mpi decode --checkpoint "preset:$p:$q" --device cuda --decode-path graph --sweep 1,8,16 --tokens 40
  done; done
  T=200 run profile_sequence python3 benchmarks/profile_gpu_step.py preset:glm5-flash-4l:nvfp4-all 1 --sequence --rows 40 ;;
fire1)  # static fires with every rank on the one GPU of this host (cuda-ipc between processes, graphed step)
  for n in 2 3; do
    T=240 run "fire1gpu_graph_ipc$n" python3 -m rocket_mpi static-fire --checkpoint preset:default:nvfp4 --ranks $n --device cuda --fabric cuda-ipc --decode-path graph --sweep 1,8 --tokens 12
  done ;;
files)  # the expert cache with host memory short: experts read from the checkpoint files into far slots (host path),
  # its GPU test, then a static fire whose one-rank reference keeps one far slot per layer against 2 ranks sharing
  # this GPU; and the NVFP4 lm_head held as stored (graphed step against the eager one, every family)
  T=200 run files_tests python3 -m pytest -q -rs -p no:cacheprovider tests/test_expert_cache.py tests/test_graph_step.py -k "host_memory_short or nvfp4_head"
  T=300 run fire_files python3 -m rocket_mpi static-fire --checkpoint preset:default:nvfp4:skew=1.5 --ranks 2 --device cuda --fabric cuda-ipc --decode-path host --sweep 1,8 --tokens 16 --expert-cache 0.003 --host-memory 0.002 ;;
replicas)  # replicated experts and live rebalancing on one GPU: the device plan with replicas against its reference and
  # expert moves bitwise (GPU tests), then graphed static fires with every rank on this GPU (cuda-ipc) under a replica
  # placement and under --rebalance-every (tokens and every step's row checksums), then the cost of one rebalance
  T=200 run replicas_tests python3 -m pytest -q -rs -p no:cacheprovider tests/test_plan.py tests/test_replicas.py -k "gpu or cuda"
  python3 -c "import json; json.dump({'default': [[0, 1], [0, 1], 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, [0, 1], 1, 1]}, open('$OUT/replicas_2.json', 'w')); json.dump({'default': [[0, 1, 2], [0, 2], 0, 0, 0, [0, 1], 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]}, open('$OUT/replicas_3.json', 'w'))"
  for n in 2 3; do
    T=240 run "fire_replicas_$n" python3 -m rocket_mpi static-fire --checkpoint preset:tiny:nvfp4:skew=1.5 --ranks $n --device cuda --fabric cuda-ipc --decode-path graph --sweep 1,8 --tokens 16 --placement "$OUT/replicas_$n.json"
    T=240 run "fire_rebalance_$n" python3 -m rocket_mpi static-fire --checkpoint preset:default:nvfp4:skew=1.5 --ranks $n --device cuda --fabric cuda-ipc --decode-path graph --sweep 1,8 --tokens 24 --rebalance-every 4 --replicas 2
  done
  T=400 run bench_rebalance python3 benchmarks/bench_rebalance.py preset:air8:nvfp4:skew=1.5 --ranks 2 --replicas 2 ;;
ncu)  # hardware counters of the expert GEMMs (persistent schedule) at 1 and 8 rows per expert
  for r in 1 8; do
    T=150 run "ncu_experts_r$r" ncu --clock-control none -k regex:experts_ -c 2 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
      --section ComputeWorkloadAnalysis --section LaunchStats python3 benchmarks/bench_experts.py --rows $r --reps 1
  done ;;
hf)
  T=400 run hf python3 benchmarks/bench_gpu.py --preset "$PRESET" --sweep ${SWEEP:-1,8} --tokens 16 ;;
llamacpp_build)  # llama.cpp's tools built and archived into $OUT, in a call of their own (carry .llamacpp): bring the
  # parts back into .llamacpp/build; the step below runs both sides in the next call (a fresh machine cannot build
  # and run them in one, and the machine is given back between calls). Cheaper: benchmarks/llamacpp_build_cuda.sh
  # builds the same archive on a machine without a GPU
  T=590 run llamacpp_build python3 benchmarks/bench_llamacpp.py --llama .llamacpp/llama.cpp --work .llamacpp/work \
    --build --steps "" --archive "$OUT" ;;
llamacpp)  # rocket_mpi beside llama.cpp in one call on the archived build (carry .llamacpp/conv, .llamacpp/build and
  # .llamacpp/wheels; the build step after the extension's)
  T=560 run llamacpp python3 benchmarks/bench_llamacpp.py --llama .llamacpp/conv --work .llamacpp/work \
    --layers ${LAYERS:-2} --unpack .llamacpp/build --out "$OUT/llamacpp.json" ;;
verify)  # the GPU checks of the NVFP4 stack and of the server on this tree: the stack kernels and layouts against their
  # references (the direct dequant against pack.emulate_decode), the graphed server, a 3-rank graphed fire
  T=300 run verify_tests python3 -m pytest -q -rs -p no:cacheprovider tests/test_pack.py tests/test_stack.py tests/test_serve.py tests/test_compressed_tensors.py tests/test_fp8.py -k "gpu or GPU"
  T=240 run verify_fire python3 -m rocket_mpi static-fire --checkpoint preset:glm5-tiny:nvfp4-all --ranks 3 --device cuda --fabric cuda-ipc --decode-path graph --sweep 1,8 --tokens 12
  # DeepSeek-V3's architecture: its graphed step against the eager one, then a graphed 2-rank fire (both passed on
  # 2026-12-05: auto takes its graph)
  T=240 run verify_dsv3 python3 -m pytest -q -rs -p no:cacheprovider tests/test_graph_step.py -k "gpu and dsv3"
  T=240 run verify_dsv3_fire python3 -m rocket_mpi static-fire --checkpoint preset:dsv3-tiny:nvfp4-all --ranks 2 --device cuda --fabric cuda-ipc --decode-path graph --sweep 1,8 --tokens 12
  T=240 run verify_experts python3 benchmarks/bench_experts.py --rows 1,8,16,24,32 --reps 15 ;;
cache_from)  # the full-size GLM-5.3-Flash's cache started from a trace recorded on other prompts, against a cold start
  # (three loads of about 2 minutes each, 7 minutes with the build: give this step a call of its own)
  python3 -c "import json, random; r = random.Random(11); json.dump([[r.randrange(2, 150000) for _ in range(12)] for _ in range(8)], open('$OUT/prompts_a.json', 'w'))"
  T=280 run cache_trace python3 -m rocket_mpi decode --checkpoint preset:glm5-flash:nvfp4:skew=1.5 --device cuda --streams 8 --tokens 48 --ignore-eos --prompts "$OUT/prompts_a.json" --telemetry "$OUT/trace_a.npz"
  T=300 run cache_from python3 benchmarks/bench_expert_cache.py preset:glm5-flash:nvfp4:skew=1.5 --budgets auto --sweep 1,8 --tokens 48 --start "$OUT/trace_a.npz"
  T=300 run cache_cold python3 benchmarks/bench_expert_cache.py preset:glm5-flash:nvfp4:skew=1.5 --budgets auto --sweep 1,8 --tokens 48 ;;
rebalance_bg)  # live rebalancing at once and in the background on a written checkpoint (a preset drawn on the GPU
  # is drawn at the move either way), one rank's share of 2: `small` (12 layers of 128 experts; writing air8 with its
  # experts NVFP4 took more than 200 s on the GPU machine's CPUs, 2026-12-05)
  T=300 run rebalance_ckpt python3 -m rocket_mpi make-checkpoint --preset ${REBALANCE_PRESET:-small} --nvfp4 --skew 1.5 --out /tmp/rb_skew
  T=300 run rebalance_bg python3 benchmarks/bench_rebalance.py /tmp/rb_skew --ranks 2 --replicas 2 --no-capture ;;
alone)  # batch invariance at a real width: the graphed decode of M = 1, 8 and 16 streams (stream s's prompt is the same
  # at every M), each stream's tokens against its tokens at the smallest M that holds it (GLM-5.3-Flash's width by
  # default; at 2026-12-05 stream 0 differed between M=1 and 8 from its first token: DESIGN, batch invariance)
  T=200 run "alone_${ALONE_PRESET:-glm5-flash-4l}" python3 -m rocket_mpi decode --checkpoint "preset:${ALONE_PRESET:-glm5-flash-4l}:nvfp4-all" --device cuda --decode-path graph --sweep 1,8,16 --tokens 40 --out "$OUT/alone.json"
  python3 -c "
import json, sys
first, same, differ = {}, 0, []
for run in json.load(open(sys.argv[1]))['runs']:
    for s, t in enumerate(run['tokens']):
        m0, t0 = first.setdefault(s, (run['streams'], t))
        d = next((i for i, (x, y) in enumerate(zip(t0, t)) if x != y), None)
        if m0 != run['streams']:
            same += d is None
            if d is not None:
                differ.append(f'stream {s}: M={run[\"streams\"]} differs from M={m0} at token {d}')
print(*differ, f'{same} of {same + len(differ)} streams decode the tokens they decode at a smaller M', sep='\\n')" "$OUT/alone.json" ;;
stack_split)  # each stack launch of one decode step at every K split (GLM-5.3-Flash's NVFP4 stack by default)
  T=200 run stack_split python3 benchmarks/bench_stack_split.py "preset:${STACK_PRESET:-glm5-flash-4l:nvfp4-all}" ${M:-1} ;;
esac; done
