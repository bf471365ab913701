"""GLM-5.3-Flash's stack held as NVFP4 (`:nvfp4-all`), linear by linear, in the expert kernel's NVFP4 tiles (GPU).

    python benchmarks/bench_stack_nvfp4.py [--rows 1,8,16] [--splits 0] [--reps 20]

The shapes of one GLM-5.3-Flash layer (hidden 4096): KDA's q | k | v and its low-rank gates, f_b, g_b and o; MLA's
q_a | kv_a | indexer k, q_b and o; the dense MLP (12288) and the shared expert (2048) as swiglu_dense. Each kind runs
over enough layers of its own random weights that the weights do not stay in L2 (as in the decode step), captured
in one CUDA graph (CUDA events, median of --reps). Per kind, rows and split (ops.linear / swiglu_dense's K slices,
0: by shape): us per launch, GB/s and % of the copy bandwidth measured in the same run. Checked first: every output
within 2^-6 of dequantise + F.linear (relative to its largest value). --splits 0,1,2,4,8 sets the slices side by
side.
"""
from __future__ import annotations

import argparse
import sys

import torch

from rocket_mpi import ops

from bench_experts import copy_bandwidth, median_us  # beside this file
from bench_stack import finish_checks, graphed

H = 4096
DEV = "cuda"
# kind -> (linear parts [(n, k)...] or ("mlp", inter))
KINDS = {
    "KDA q|k|v": [(8192, H)] * 3,
    "KDA f_a|g_a|b": [(128, H), (128, H), (64, H)],
    "KDA f_b": [(8192, 128)],
    "KDA o": [(H, 8192)],
    "MLA q_a|kv_a|ix k": [(1536, H), (512, H), (128, H)],
    "MLA q_b": [(16384, 1536)],
    "MLA o": [(H, 16384)],
    "dense MLP": ("mlp", 12288),
    "shared expert": ("mlp", 2048),
}
L2_MULT = 256 << 20  # each kind reads at least this many weight bytes per replay (H200 L2: 60 MiB)


def random_parts(n: int, k: int, g: torch.Generator):
    """NVFP4 parts (weight [n, k/2] uint8, weight_scale [n, k/16] e4m3 2^-4..1.875, weight_scale_2) on the GPU."""
    w = torch.randint(0, 256, (n, k // 2), generator=g, device=DEV, dtype=torch.uint8)
    s = torch.randint(24, 64, (n, k // 16), generator=g, device=DEV, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return w, s, 2.0 ** -6


def build(name, spec, g, split):
    """(callables per layer, reference per layer, weight bytes per layer, input width)."""
    if spec[0] == "mlp":
        inter = spec[1]
        one = lambda: ops.pack_mlp((random_parts(inter, H, g), random_parts(inter, H, g)), random_parts(H, inter, g),
                                   device=DEV)
        p0 = one()
        nbytes = sum(t.numel() * t.element_size() for t in (p0.q_gu, p0.s_gu, p0.q_dn, p0.s_dn))
        packs = [p0] + [one() for _ in range(max(1, -(-L2_MULT // nbytes)) - 1)]
        fns = [lambda x, p=p: [ops.swiglu_dense(x, p, split=split)] for p in packs]
        refs = [lambda x, p=p: [ops.stack.swiglu_dense_ref(x, p)] for p in packs]
        return fns, refs, nbytes, H
    one = lambda: ops.pack_linear([random_parts(n, k, g) for n, k in spec], device=DEV)
    p0 = one()
    nbytes = sum(p.nbytes for p in p0)
    packs = [p0] + [one() for _ in range(max(1, -(-L2_MULT // nbytes)) - 1)]
    fns = [lambda x, p=p: ops.linear(x, p, split=split) for p in packs]
    refs = [lambda x, p=p: [y for q in p for y in ops.stack.linear_ref(x, q)] for p in packs]
    return fns, refs, nbytes, spec[0][1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--splits", default="0", help="the kernel's K slices, comma-separated (0: by shape)")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not (torch.cuda.is_available() and ops.available()):
        sys.exit(f"bench_stack_nvfp4 needs a CUDA device and the extension: {ops.unavailable_reason() or 'no GPU'}")
    rows = [int(r) for r in a.rows.split(",")]
    splits = [int(s) for s in a.splits.split(",")]
    g = torch.Generator(device=DEV).manual_seed(0)
    bw = copy_bandwidth(2 << 30, 10)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; copy BW {bw:.0f} GB/s (read + write); "
          f"GLM-5.3-Flash's stack shapes, NVFP4 held as stored, each kind over its layers in one graph")
    head = " | ".join(f"split {s}: us / % copy" for s in splits)
    print(f"\n| kind | launches | MB per launch | rows | {head} |")
    print("|:--|--:|--:|--:|" + "--:|" * len(splits))
    bad, totals = [], {m: [0.0] * len(splits) for m in rows}
    total_mb = 0.0
    for name, spec in KINDS.items():
        built = {s: build(name, spec, g, s) for s in splits}
        fns0, _, nbytes, k_in = built[splits[0]]
        total_mb += nbytes / 1e6
        for m in rows:
            x = (torch.randn(m, k_in, generator=g, device=DEV)).bfloat16()
            cells = []
            for j, s in enumerate(splits):
                fns, refs = built[s][:2]
                for y, r in zip(fns[0](x), refs[0](x)):
                    err = float((y.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30))
                    if not err < 2 ** -6:
                        bad.append(f"{name} rows {m} split {s}: rel diff {err:.2e}")
                us = median_us(graphed(lambda: [f(x) for f in fns]), a.reps) / len(fns)
                totals[m][j] += us
                cells.append(f"{us:.1f} / {100 * nbytes / us / 1e3 / bw:.0f} %")
            print(f"| {name} | {len(fns0)} | {nbytes / 1e6:.1f} | {m} | " + " | ".join(cells) + " |")
    for m in rows:
        cells = [f"{t:.1f} / {100 * total_mb / t * 1e3 / bw:.0f} %" for t in totals[m]]
        print(f"| **one of each** | | {total_mb:.1f} | {m} | " + " | ".join(cells) + " |")
    finish_checks(bad, "checks: every output within 2^-6 of dequantise + F.linear")


if __name__ == "__main__":
    main()
