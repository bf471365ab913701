"""The replicated stack's linears (GPU): cuBLAS through F.linear (what the stack's dense weights run: prefill and
steps of more than ops.STACK_KERNEL_MAX_ROWS rows) beside the expert kernel's BF16 tiles (ops.linear / swiglu_dense,
what decode steps run), on the air8 preset's shapes (GLM-4.5-Air cut to 8 layers: hidden 4096, 96 q heads and 8 kv
heads of 128 with biases, dense MLP 10944, shared expert 1408).

    python benchmarks/bench_stack.py [--rows 1,8,32,64] [--reps 20] [--layers 8] [--split 0] [--pdl -1]

--split sets the kernel's K slices (ops.linear and swiglu_dense's split: 0 by shape, or 1, 2, 4, 8), --pdl
swiglu_dense's pdl (-1 auto, 0 off, 3): the launch arguments, to compare their values run against run.

Every layer gets its own random weights, and each kind is timed over all layers in sequence (one CUDA graph
replay, as the decode step runs; CUDA events, median of --reps), so no call finds its weight in L2 (as in the decode step). Per kind and rows: the bytes
read (weights and biases), each side's us, GB/s and % of the copy bandwidth measured in the same run, and the
speed-up. Checks first: every output within 2^-6 of the other side's (relative to its largest value).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from rocket_mpi import ops
from rocket_mpi.model.layers import swiglu_mlp

from bench_experts import copy_bandwidth, median_us  # beside this file

H, NQ, NKV, D, DENSE_I, SHARED_I = 4096, 96, 8, 128, 10944, 1408


def rand(*shape, g, scale=None):
    t = torch.randn(*shape, generator=g, device="cuda")
    return (t * (scale if scale is not None else shape[-1] ** -0.5)).bfloat16()


def build(layers: int, g, split: int = 0, pdl: int = -1):
    """Per kind: (torch callables per layer, kernel callables per layer, bytes per layer, inputs); the kernel's
    launches with `split` and (swiglu_dense) `pdl`."""
    kinds = {}
    qkv_t, qkv_k, o_t, o_k, sh_t, sh_k = [], [], [], [], [], []
    for _ in range(layers):
        ws = [rand(NQ * D, H, g=g), rand(NKV * D, H, g=g), rand(NKV * D, H, g=g)]
        bs = [rand(w.shape[0], g=g, scale=0.1) for w in ws]
        qkv_t.append(lambda x, ws=ws, bs=bs: [F.linear(x, w, b) for w, b in zip(ws, bs)])
        p = ops.pack_linear(ws, bs)
        qkv_k.append(lambda x, p=p: ops.linear(x, p, split=split))
        wo = rand(H, NQ * D, g=g)
        po = ops.pack_linear([wo])
        o_t.append(lambda x, wo=wo: [F.linear(x, wo)])
        o_k.append(lambda x, po=po: ops.linear(x, po, split=split))
        gu, dn = rand(2 * SHARED_I, H, g=g), rand(H, SHARED_I, g=g)
        pm = ops.pack_mlp(gu, dn)
        sh_t.append(lambda x, gu=gu, dn=dn: [swiglu_mlp(x, gu, dn)])
        sh_k.append(lambda x, pm=pm: [ops.swiglu_dense(x, pm, pdl=pdl, split=split)])
    kinds["q/k/v + bias"] = (qkv_t, qkv_k, (NQ + 2 * NKV) * D * (H + 1) * 2, H)
    kinds["o"] = (o_t, o_k, H * NQ * D * 2, NQ * D)
    kinds["shared MLP"] = (sh_t, sh_k, 3 * SHARED_I * H * 2, H)
    gu, dn = rand(2 * DENSE_I, H, g=g), rand(H, DENSE_I, g=g)
    pm = ops.pack_mlp(gu, dn)
    kinds["dense MLP (1 layer)"] = ([lambda x: [swiglu_mlp(x, gu, dn)]],
                                    [lambda x: [ops.swiglu_dense(x, pm, pdl=pdl, split=split)]], 3 * DENSE_I * H * 2, H)
    return kinds


def graphed(fn):
    """fn captured in a CUDA graph (as the decode step runs): the replay, without Python's launch overhead."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def finish_checks(bad: list[str], passed: str) -> None:
    """The checks' verdict after the tables: each failure and exit 1, or the line saying what passed."""
    if bad:
        print("CHECKS FAILED:\n  " + "\n  ".join(bad))
        sys.exit(1)
    print(passed)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--split", type=int, default=0, choices=(0, 1, 2, 4, 8), help="the kernel's K slices (0: by shape)")
    ap.add_argument("--pdl", type=int, default=-1, choices=(-1, 0, 3), help="swiglu_dense's pdl (-1: auto)")
    a = ap.parse_args()
    if not (torch.cuda.is_available() and ops.available()):
        sys.exit(f"bench_stack needs a CUDA device and the extension: {ops.unavailable_reason() or 'no GPU'}")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    g = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(2 << 30, 10)
    kinds = build(a.layers, g, a.split, a.pdl)
    rows = [int(r) for r in a.rows.split(",")]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; copy BW {bw:.0f} GB/s (read + write); "
          f"{a.layers} layers of air8 shapes, each kind timed over its layers in sequence; kernel split {a.split}, "
          f"pdl {a.pdl}")
    print("\n| kind | rows | MB read | cuBLAS us | GB/s | % copy | ours us | GB/s | % copy | speed-up |")
    print("|:--|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals = {m: [0.0, 0.0, 0] for m in rows}
    bad = []
    for name, (tor, ker, nbytes, k_in) in kinds.items():
        for m in rows:
            x = rand(m, k_in, g=g, scale=1.0)
            for lt, lk in zip(tor[:2], ker[:2]):  # checks: the two sides agree
                for yt, yk in zip(lt(x), lk(x)):
                    err = float((yt.float() - yk.float()).abs().max() / yt.float().abs().max().clamp_min(1e-30))
                    if not err < 2 ** -6:
                        bad.append(f"{name} rows {m}: rel diff {err:.2e}")
            ut = median_us(graphed(lambda: [f(x) for f in tor]), a.reps)
            uk = median_us(graphed(lambda: [f(x) for f in ker]), a.reps)
            nb = nbytes * len(tor)
            gt, gk = nb / ut / 1e3, nb / uk / 1e3
            totals[m][0] += ut
            totals[m][1] += uk
            totals[m][2] += nb
            print(f"| {name} | {m} | {nb / 1e6:.0f} | {ut:.1f} | {gt:.0f} | {100 * gt / bw:.1f} | {uk:.1f} | {gk:.0f} | "
                  f"{100 * gk / bw:.1f} | {ut / uk:.2f}x |")
    for m, (ut, uk, nb) in totals.items():
        print(f"| **all** | {m} | {nb / 1e6:.0f} | {ut:.1f} | {nb / ut / 1e3:.0f} | {100 * nb / ut / 1e3 / bw:.1f} | "
              f"{uk:.1f} | {nb / uk / 1e3:.0f} | {100 * nb / uk / 1e3 / bw:.1f} | {ut / uk:.2f}x |")
    finish_checks(bad, "checks: every output within 2^-6 of cuBLAS's")


if __name__ == "__main__":
    main()
