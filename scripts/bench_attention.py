"""Decode attention benchmark (GPU): the fused kernel (kernels.decode_attention, csrc/decode_ops.cu) beside
the eager chain it replaces in the fixed-shape step (glm4_moe._attend over the cache capacity under a length
mask), GLM-4.5-Air's attention shape (96 query heads, 8 kv heads, head dim 128), every stream at the last
position of its cache (len = capacity). Median us per call over CUDA events; KV MB is what the kernel reads.

    python scripts/bench_attention.py [--streams 1,8] [--caps 16,64,512,4096] [--reps 50]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rocket_mpi import kernels  # noqa: E402
from rocket_mpi.model.glm4_moe import _attend  # noqa: E402


def median_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--caps", default="16,64,512,4096")
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    if not (torch.cuda.is_available() and kernels.available()):
        print("bench_attention needs a CUDA GPU and the extension:", kernels.unavailable_reason())
        return 1
    hq, hkv, d = a.heads, a.kv_heads, a.head_dim
    print(f"device: {torch.cuda.get_device_name()}; hq {hq}, hkv {hkv}, head dim {d}; median of {a.reps}")
    print("| streams | cap = len | KV MB | fused us | eager chain us | speed-up | outputs bitwise equal |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m in (int(x) for x in a.streams.split(",")):
        for cap in (int(x) for x in a.caps.split(",")):
            g = torch.Generator(device="cuda").manual_seed(cap + m)
            q = torch.randn(m, hq, d, device="cuda", generator=g).to(torch.bfloat16)
            kc, vc = (torch.randn(m, hkv, cap, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
            pos = torch.full((m,), cap - 1, device="cuda", dtype=torch.long)
            mask = (torch.arange(cap, device="cuda")[None, :] <= pos[:, None])[:, None, None, :]
            scale = d ** -0.5
            fused = lambda: kernels.decode_attention(q, kc, vc, pos, scale)  # noqa: E731
            eager = lambda: _attend(q[:, :, None, :], kc, vc, mask, scale).reshape(m, -1)  # noqa: E731
            same = float((fused().view(torch.int16) == eager().view(torch.int16)).float().mean())
            tf, te = median_us(fused, a.reps), median_us(eager, a.reps)
            mb = 2 * kc.numel() * 2 / 1e6
            print(f"| {m} | {cap} | {mb:.2f} | {tf:.1f} | {te:.1f} | {te / tf:.2f}x | {same:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
