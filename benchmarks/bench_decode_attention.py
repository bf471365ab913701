"""GLM-4.x decode attention alone on a GPU: ops.decode_attention (fixed chunks, batch-invariant) beside the two matmuls
around ops.decode_softmax it replaced (not a test).

    python benchmarks/bench_decode_attention.py [--streams 1,8,16,64] [--positions 32,255,1000,3000,8000]

air8's attention shape by default (96 query heads over 8 kv heads, head dim 128) and `--layers` layers, each with
its own cache (so a replay reads them from DRAM, as a decode step does). Every stream holds the same number of
positions; each form runs over the span a graphed step would take for them (graph.span_for, 256 x 2^k). Both forms
are captured in one CUDA graph of all layers, and the median of `--reps` replays is reported per layer: us, the
bytes of keys and values the streams' positions hold (what a form must read at least), and those bytes / us against
the copy bandwidth measured in the same process. Also: the largest difference between the two forms' outputs (they
round differently: bf16 scores and probabilities against fp32 scores and unnormalised bf16 probabilities).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from rocket_mpi import ops
from rocket_mpi.runtime.decode import measure_copy_bandwidth, pick_device
from rocket_mpi.runtime.graph import span_for

from ab_decode import matmul_attention  # beside this file


class _Scale:
    """What matmul_attention reads off the model."""

    def __init__(self, scale: float):
        self.scale = scale


def timed(fn, reps: int) -> float:
    """Median ms of a replay of fn captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,8,16,64")
    ap.add_argument("--positions", default="32,255,1000,3000,8000")
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    dev = pick_device("cuda", None)
    gbps = measure_copy_bandwidth(dev)
    hq, hkv, d = a.heads, a.kv_heads, a.head_dim
    scale = d ** -0.5
    print(f"decode attention, {hq} query heads over {hkv} kv heads, head dim {d}, {a.layers} layers (caches of their "
          f"own); copy {gbps:.0f} GB/s; us per layer, median of {a.reps} graph replays")
    print(f"{'M':>3} {'positions':>9} {'span':>6} {'KV MB':>8} {'matmuls us':>11} {'kernel us':>10} {'kernel/old':>10} "
          f"{'matmuls GB/s':>12} {'kernel GB/s':>11} {'max |diff|':>10}")
    g = torch.Generator(device=dev).manual_seed(0)
    for m in (int(x) for x in a.streams.split(",")):
        for n in (int(x) for x in a.positions.split(",")):
            span = span_for(n - 1, 1 << 30, 256)
            cap = -(-span // 64) * 64
            caches = [(torch.randn(m, hkv, cap, d, generator=g, device=dev).bfloat16(),
                       torch.randn(m, hkv, cap, d, generator=g, device=dev).bfloat16()) for _ in range(a.layers)]
            q = (torch.randn(m, hq, d, generator=g, device=dev) * 2).bfloat16()
            pos = torch.full((m,), n - 1, dtype=torch.long, device=dev)
            outs = {}

            def old():
                outs["old"] = [matmul_attention(_Scale(scale), q, k, v, pos, span, None) for k, v in caches]

            def new():
                outs["new"] = [ops.decode_attention(q, k, v, pos, scale, span).reshape(m, -1) for k, v in caches]

            t_old, t_new = timed(old, a.reps) / a.layers * 1e3, timed(new, a.reps) / a.layers * 1e3
            kv = 2 * m * hkv * n * d * 2
            diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(outs["old"], outs["new"]))
            print(f"{m:>3} {n:>9} {span:>6} {kv / 1e6:>8.2f} {t_old:>11.2f} {t_new:>10.2f} {t_new / t_old:>10.3f} "
                  f"{kv / t_old / 1e3:>12.0f} {kv / t_new / 1e3:>11.0f} {diff:>10.4f}")
            del caches
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
