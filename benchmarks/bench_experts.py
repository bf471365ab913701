"""Routed-expert kernel benchmark (GPU): 64 NVFP4 experts of the GLM-5.3-Flash shape (hidden 4096,
moe_intermediate 2048, swiglu_limit 10), R rows per expert, against the device copy bandwidth and
torch's BF16 grouped GEMM on the same experts (dequantised to bf16); and the same BF16 weights in our
kernel's BF16 tiles (pack.pack_bf16: a BF16 checkpoint's experts), against its copy-bandwidth bar and
against grouped_mm.

    python benchmarks/bench_experts.py [--experts 64] [--rows 1,2,4,8,16,32] [--topk 8] [--reps 20] [--profile]
                                       [--decode 8,64 --decode-experts 128 --decode-inter 1408] [--pdl -1|0|3]
                                       [--far 1,8]

--far R,...: the expert cache's misses. The same experts moved to far slots (registered host memory that the kernel
reads in place, moe/cache.py), R rows per expert: the kernel's time and GB/s against the same launch with the experts
in device memory, and against a pinned host-to-device copy (the copy engine) of the same bytes. Tells whether a miss
costs its bytes at the host link's speed.

--decode M adds rows routed as a decode step routes them: M tokens, each to topk of --decode-experts
experts at random (most experts get 0-2 rows), the GLM-4.5-Air expert shape (--decode-inter 1408); its
GB/s counts the packed bytes of the experts that got rows.

The kernel is called as the engine calls it (rocket_mpi/moe/step.py HostMoE -> ExpertStore.compute ->
ops.nvfp4_experts): x is the tokens' hidden states [T, H], T = experts * R / topk, each token routed
to topk distinct experts so that every expert gets R rows; rocket_mpi.ops.rows.plan_rows gives the
canonical rows, and the kernel gathers them through row_index = tokens[lo:hi] of this (single) rank's block.

Checks first (ours against the bf16 path on the same weights and the same gathered rows; NaN/inf on
either side is reported by side), then one table: rows/expert, ours us (median, CUDA events: the three
kernels, plan and row_index already on the device), ours GB/s (packed weight bytes / time), % of copy BW,
grouped_mm us (including its x[tokens] gather, as ExpertStore's torch path gathers too), speed-up;
plus the whole engine call with its host plan and upload ("op us"), and each of the NVFP4 kernel's two instances
forced (narrow: 3 blocks per SM; wide: 2, for 17-32 rows of one expert; wgmma: the wide shape on warpgroup mma, on
sm_90 GPUs; "auto" picks by the launch, rocket.h kWide*;
their outputs are checked bitwise against auto's); then a second table for BF16 weights:
ours (BF16 tiles) us, GB/s of its bf16 bytes, % of copy BW, grouped_mm us, speed-up. Copy BW is a torch
device-to-device copy of a few GB, counting read + write. torch's grouped GEMM is the baseline only: the
engine runs every expert in this kernel on a GPU.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch
import torch.nn.functional as F

from rocket_mpi import ops
from rocket_mpi.ops import pack
from rocket_mpi.ops.pack import PackedExperts
from rocket_mpi.ops.rows import plan_rows

HIDDEN, INTER, LIMIT = 4096, 2048, 10.0
TARGET_PCT, TARGET_SPEEDUP, TARGET_MAX_ROWS = 85.0, 4.0, 32
INSTANCES = {0: "narrow", 1: "wide", 2: "wgmma"}  # the `wide` values forced beside auto


def median_us(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
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


def copy_bandwidth(nbytes: int, reps: int) -> float:
    """GB/s of dst.copy_(src), counting bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), reps)
    return 2 * nbytes / (us * 1e-6) / 1e9


def random_packed(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One random NVFP4 matrix [n, k] in the kernel's layout: uniform 4-bit codes and e4m3 block scales
    2^-4..1.875 (e4m3 bytes 24..63), packed by pack.pack_codes. The packed scale words must come from
    pack_codes: their bytes are not the scale bytes (nibble-shifted, rotated), and random bytes there
    decode to bf16 exponent 255, i.e. inf/NaN weights."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda", generator=g)
    e4m3 = torch.randint(24, 64, (n, k // 16), dtype=torch.uint8, device="cuda", generator=g)
    return pack.pack_codes(codes, pack.scale_bytes(e4m3.view(torch.float8_e4m3fn)))


def random_experts(n: int, seed: int, inter: int = INTER) -> PackedExperts:
    """Random packed experts (valid codes and scales, see random_packed); weight_scale_2 = 1 so the bf16
    baseline multiplies the very same weights."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hp, ip = HIDDEN, (inter + 63) // 64 * 64
    gu = [random_packed(2 * ip, hp, g) for _ in range(n)]
    dn = [random_packed(hp, ip, g) for _ in range(n)]
    return PackedExperts(list(range(n)), HIDDEN, inter, hp, ip,
                         torch.stack([q for q, _ in gu]), torch.stack([s for _, s in gu]),
                         torch.ones(n, 2, device="cuda"),
                         torch.stack([q for q, _ in dn]), torch.stack([s for _, s in dn]),
                         torch.ones(n, device="cuda"))


def routing(n_exp: int, rows: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router output (experts [T, topk] int64, weights [T, topk] fp32) on the CPU, as HostMoE has it:
    every token picks topk distinct experts, every expert gets exactly `rows` tokens, tokens shuffled."""
    total = n_exp * rows
    if topk > n_exp or total % topk:
        raise ValueError(f"--topk {topk}: needs topk <= experts ({n_exp}) and experts * rows ({total}) % topk == 0")
    t = total // topk
    gen = torch.Generator().manual_seed(seed)
    q = torch.arange(total)
    tok = torch.randperm(t, generator=gen)[q // topk]    # q and q + n_exp (same expert) are different tokens
    experts = torch.empty(t, topk, dtype=torch.long)
    experts[tok, q % topk] = q % n_exp                   # topk consecutive q: topk distinct experts
    weights = torch.rand(t, topk, generator=gen)
    return experts, weights / weights.sum(-1, keepdim=True)


def engine_call(p: PackedExperts):
    """fn(x, tokens, segments, lo) -> this rank's block, the engine's exact call: ExpertStore.compute
    with the experts packed (-> ops.nvfp4_experts(x, segments, packed, lo, tokens[lo:lo + n], limit));
    where rocket_mpi.moe.experts cannot be imported (safetensors missing), that same line."""
    try:
        from rocket_mpi.moe.experts import ExpertStore
    except ImportError as e:
        print(f"note: ExpertStore unavailable ({e}); calling ops.nvfp4_experts as ExpertStore.compute does")

        def call(x, tokens, segs, lo):
            n = (segs[-1][2] - lo) if segs else 0
            return ops.nvfp4_experts(x, segs, p, lo, tokens[lo:lo + n], LIMIT)
        return call
    store = ExpertStore(0, list(p.experts), {}, {}, torch.ones(len(p.experts)), p.nbytes, LIMIT)
    store.packed = p
    return store.compute


def nonfinite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum())


def bf16_packed(w_gu: torch.Tensor, w_dn: torch.Tensor, inter: int) -> PackedExperts:
    """The bf16 weights [E, 2I, H] (gate/up interleaved by 8, as packed) and [E, H, I] in the kernel's BF16
    tiles: what ExpertStore.load packs for a BF16 checkpoint (pack_experts_bf16 interleaves first)."""
    n, hp, ip = w_gu.shape[0], w_gu.shape[2], w_dn.shape[2]
    return PackedExperts(list(range(n)), HIDDEN, inter, hp, ip,
                         torch.stack([pack.pack_bf16(w_gu[e], w_gu.shape[1], hp) for e in range(n)]),
                         torch.zeros(n, 0, dtype=torch.uint8, device="cuda"), torch.ones(n, 2, device="cuda"),
                         torch.stack([pack.pack_bf16(w_dn[e], hp, ip) for e in range(n)]),
                         torch.zeros(n, 0, dtype=torch.uint8, device="cuda"), torch.ones(n, device="cuda"))


def bf16_weights(p: PackedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, 2I, H] (gate/up interleaved by 8 as packed) and [E, H, I] bf16, the exact E2M1 * scale."""
    n = len(p.experts)
    w_gu = torch.empty(n, 2 * p.inter_pad, HIDDEN, dtype=torch.bfloat16, device="cuda")
    w_dn = torch.empty(n, HIDDEN, p.inter_pad, dtype=torch.bfloat16, device="cuda")
    for e in range(n):  # the kernel's decode gives E2M1 * scale * 2^-8; * 256 is exact
        w_gu[e] = ops.dequant_packed_cuda(p.q_gu[e], p.s_gu[e]) * 256
        w_dn[e] = ops.dequant_packed_cuda(p.q_dn[e], p.s_dn[e]) * 256
    return w_gu, w_dn


def make_bf16_path(w_gu, w_dn, rows: int):
    """torch's BF16 grouped GEMM (torch._grouped_mm), SwiGLU as rocket_mpi/moe/experts.py; falls back to a
    per-expert F.linear loop where _grouped_mm is missing."""
    n = w_gu.shape[0]
    offs = torch.arange(rows, rows * n + 1, rows, dtype=torch.int32, device="cuda")
    gu_t, dn_t = w_gu.transpose(-2, -1), w_dn.transpose(-2, -1)

    def swiglu(gu):
        v = gu.view(gu.shape[0], INTER // 8, 2, 8)
        gate = v[:, :, 0].reshape(-1, INTER).clamp(max=LIMIT)
        up = v[:, :, 1].reshape(-1, INTER).clamp(-LIMIT, LIMIT)
        return F.silu(gate) * up

    def grouped(x):
        h = swiglu(torch._grouped_mm(x, gu_t, offs=offs, out_dtype=torch.bfloat16))
        return torch._grouped_mm(h, dn_t, offs=offs, out_dtype=torch.bfloat16)

    def loop(x):
        out = torch.empty(x.shape[0], HIDDEN, dtype=torch.bfloat16, device="cuda")
        for e in range(n):
            xe = x[e * rows:(e + 1) * rows]
            out[e * rows:(e + 1) * rows] = F.linear(swiglu(F.linear(xe, w_gu[e])), w_dn[e])
        return out

    try:
        grouped(torch.zeros(rows * n, HIDDEN, dtype=torch.bfloat16, device="cuda"))
        return grouped, "torch._grouped_mm"
    except (AttributeError, RuntimeError) as e:
        print(f"note: torch._grouped_mm unavailable ({str(e).splitlines()[0]}); baseline is a per-expert F.linear loop")
        return loop, "F.linear loop"


def decode_case(m: int, n_exp: int, inter: int, topk: int, reps: int, seed: int, pdl: int = -1):
    """M tokens routed to topk of n_exp random experts (Air-shaped), one rank: (label, us, bytes, BF16 tiles
    us, BF16 bytes) for the same weights in NVFP4 and in BF16 tiles."""
    p = random_experts(n_exp, seed=100 + m, inter=inter)
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(m)])
    weights = torch.rand(m, topk, generator=gen)
    plan = plan_rows(experts, weights / weights.sum(-1, keepdim=True), torch.zeros(n_exp, dtype=torch.long),
                     torch.ones(n_exp), 1)
    segs = plan.segments[0]
    lo, hi = plan.block(0)
    tokens = plan.tokens.cuda()
    x = (torch.randn(m, HIDDEN, device="cuda") * 0.5).to(torch.bfloat16)
    lp, tiles, groups, _ = ops.launch_plan(segs, lo, p.slot)
    launch = (x, tokens[lo:hi].contiguous(), lp.cuda(), tiles, groups, hi - lo, p, LIMIT)
    touched = len({e for e, s0, s1 in segs if s1 > s0})
    nbytes = p.nbytes * touched / n_exp
    us = median_us(functools.partial(ops.nvfp4_experts_planned, *launch, pdl=pdl), reps)
    pb = bf16_packed(*bf16_weights(p), inter)
    del p
    launch_b = launch[:6] + (pb, LIMIT)
    us_b = median_us(functools.partial(ops.nvfp4_experts_planned, *launch_b, pdl=pdl), reps)
    nbytes_b = touched * 3 * HIDDEN * inter * 2
    del pb
    return f"decode M={m} ({touched} of {n_exp} experts, inter {inter})", us, nbytes, us_b, nbytes_b


def far_experts(p: PackedExperts) -> PackedExperts:
    """The same experts with every slot far: empty device stacks, the four parts in registered host memory."""
    far = {k: pack.pin_host(getattr(p, k).cpu()) for k in pack.KERNEL_PARTS}
    empty = {k: getattr(p, k)[:0] for k in pack.KERNEL_PARTS}
    return PackedExperts(list(p.experts), p.hidden, p.inter, p.hidden_pad, p.inter_pad, empty["q_gu"], empty["s_gu"],
                         p.s2_gu, empty["q_dn"], empty["s_dn"], p.s2_dn, dict(p.slot), far)


def far_case(p: PackedExperts, rows: int, topk: int, reps: int) -> tuple[float, float, float, int]:
    """(near us, far us, pinned H2D copy us, bytes): R rows per expert, every expert read once."""
    n = len(p.experts)
    experts, weights = routing(n, rows, topk, seed=rows)
    plan = plan_rows(experts, weights, torch.zeros(n, dtype=torch.long), torch.ones(n), 1)
    segs, (lo, hi) = plan.segments[0], plan.block(0)
    tokens = plan.tokens.cuda()
    x = (torch.randn(experts.shape[0], HIDDEN, device="cuda") * 0.5).to(torch.bfloat16)
    lp, tiles, groups, n_rows = ops.launch_plan(segs, lo, p.slot)
    args = (x, tokens[lo:hi].contiguous(), lp.cuda(), tiles, groups, n_rows)
    pf = far_experts(p)
    a = ops.nvfp4_experts_planned(*args, p, LIMIT)
    b = ops.nvfp4_experts_planned(*args, pf, LIMIT)
    if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
        print(f"far rows/expert {rows}: far slots and device slots DIFFER bitwise")
    t_near = median_us(functools.partial(ops.nvfp4_experts_planned, *args, p, LIMIT), reps)
    t_far = median_us(functools.partial(ops.nvfp4_experts_planned, *args, pf, LIMIT), reps)
    dst = {k: torch.empty_like(pf.far[k], device="cuda") for k in pack.KERNEL_PARTS}
    t_copy = median_us(lambda: [dst[k].copy_(pf.far[k], non_blocking=True) for k in pack.KERNEL_PARTS], reps)
    nbytes = sum(t.numel() * t.element_size() for t in pf.far.values())
    del pf, dst
    return t_near, t_far, t_copy, nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--topk", type=int, default=8, help="experts per token (T = experts * rows / topk tokens)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copy-gb", type=float, default=2.0, help="size of each copy buffer")
    ap.add_argument("--decode", default="", help="decode cases: tokens per step, e.g. 1,8,64")
    ap.add_argument("--decode-experts", type=int, default=128)
    ap.add_argument("--decode-inter", type=int, default=1408)
    ap.add_argument("--profile", action="store_true", help="per-kernel times of ours at 8 rows (torch.profiler)")
    ap.add_argument("--pdl", type=int, default=-1, choices=(-1, 0, 3),
                    help="the planned launches' pdl: how down follows gate/up (-1 auto, 0 off, 3; the same bits); the "
                         "engine call ('op us', --profile) keeps the engine's auto")
    ap.add_argument("--far", default="", help="expert-cache misses: rows per expert with the experts in host memory")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not ops.available():
        sys.exit(f"bench_experts: needs a GPU and the extension: {ops.unavailable_reason()}")

    prop = torch.cuda.get_device_properties(0)
    print(f"device: {prop.name}, {prop.multi_processor_count} SMs, {prop.total_memory / 2**30:.0f} GiB; "
          f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    copy_bw = copy_bandwidth(int(args.copy_gb * 2**30), args.reps)
    # the kernel instances forced beside auto (rocket.h kWide*): the warpgroup-mma one runs on sm_90 only
    instances = (0, 1, 2) if torch.cuda.get_device_capability(0) == (9, 0) else (0, 1)
    p = random_experts(args.experts, seed=0)
    wbytes = p.nbytes
    roof_us = wbytes / (copy_bw * 1e9) * 1e6
    print(f"{args.experts} NVFP4 experts of hidden {HIDDEN}, moe_intermediate {INTER}: {wbytes / 1e6:.0f} MB packed "
          f"(bf16: {args.experts * 3 * HIDDEN * INTER * 2 / 1e6:.0f} MB); copy BW {copy_bw:.0f} GB/s (read + write) "
          f"-> roofline {roof_us:.0f} us")
    w_gu, w_dn = bf16_weights(p)

    bad_w = nonfinite(w_gu) + nonfinite(w_dn)
    if bad_w:
        print(f"WARNING: {bad_w} non-finite bf16 weights (the packed experts decode to inf/NaN)")
    compute = engine_call(p)
    pb = bf16_packed(w_gu, w_dn, INTER)
    bbytes = pb.nbytes

    rows_list = [int(r) for r in args.rows.split(",")] if args.rows else []
    results = []
    for rows in rows_list:
        n = args.experts
        experts, weights = routing(n, rows, args.topk, seed=rows)
        plan = plan_rows(experts, weights, torch.zeros(n, dtype=torch.long), torch.ones(n), 1)
        segs = plan.segments[0]
        lo, hi = plan.block(0)
        tokens = plan.tokens.cuda()                      # HostMoE moves plan.tokens to x's device
        x = (torch.randn(experts.shape[0], HIDDEN, device="cuda") * 0.5).to(torch.bfloat16)   # [T, H]
        if segs != [(e, lo + e * rows, lo + (e + 1) * rows) for e in range(n)]:
            raise AssertionError(f"routing: expected {rows} canonical rows per expert in expert order, got {segs}")
        lp, tiles, groups, n_rows = ops.launch_plan(segs, lo, p.slot)
        row_index = tokens[lo:hi].contiguous()
        launch = (x, row_index, lp.cuda(), tiles, groups, n_rows, p, LIMIT)
        base_fn, base_name = make_bf16_path(w_gu, w_dn, rows)
        # correctness first: the same weights, the same SwiGLU, the same rows (canonical order: expert,
        # token); only the fp32 summation order differs
        a = ops.nvfp4_experts_planned(*launch, pdl=args.pdl)
        a_bits = a.view(torch.int16)
        a_op = compute(x, tokens, segs, lo)
        if not torch.equal(a.view(torch.int16), a_op.view(torch.int16)):
            print(f"rows/expert {rows}: the engine call and the planned launch DIFFER bitwise")
        xb = x[tokens[lo:hi]]
        b = base_fn(xb)
        a, b = a.float(), b.float()
        bad_a, bad_b = nonfinite(a), nonfinite(b)
        if bad_a or bad_b:
            err = float("nan")
            print(f"rows/expert {rows}: non-finite outputs: ours {bad_a} ({int(torch.isnan(a).sum())} NaN), "
                  f"{base_name} {bad_b} ({int(torch.isnan(b).sum())} NaN) of {a.numel()}; "
                  f"inputs: x {nonfinite(xb)} non-finite")
        else:
            err = float((a - b).norm() / b.norm().clamp_min(1e-30))
            if not err < 2.0 ** -6:
                print(f"rows/expert {rows}: ours vs {base_name}: relative error {err:.2e} EXCEEDS {2.0 ** -6:.2e}")
        t_ours = median_us(functools.partial(ops.nvfp4_experts_planned, *launch, pdl=args.pdl), args.reps)
        # both kernel instances (rocket.h kWide*): the same bits, each one's time
        t_inst = []
        for wide in instances:
            w = ops.nvfp4_experts_planned(*launch, pdl=args.pdl, wide=wide)
            if not torch.equal(w.view(torch.int16), a_bits):
                print(f"rows/expert {rows}: wide={wide} and the auto instance DIFFER bitwise")
            t_inst.append(median_us(functools.partial(ops.nvfp4_experts_planned, *launch, pdl=args.pdl, wide=wide),
                                    args.reps))
        t_op = median_us(functools.partial(compute, x, tokens, segs, lo), args.reps)
        t_base = median_us(lambda: base_fn(x[tokens[lo:hi]]), args.reps)
        # the same bf16 weights in our kernel's BF16 tiles
        c = ops.nvfp4_experts_planned(*launch[:6], pb, LIMIT, pdl=args.pdl).float()
        err_b = float((c - b).norm() / b.norm().clamp_min(1e-30)) if not (nonfinite(c) or bad_b) else float("nan")
        if not err_b < 2.0 ** -6:
            print(f"rows/expert {rows}: ours (BF16 tiles) vs {base_name}: relative error {err_b:.2e} EXCEEDS "
                  f"{2.0 ** -6:.2e}")
        t_bf16 = median_us(functools.partial(ops.nvfp4_experts_planned, *launch[:6], pb, LIMIT, pdl=args.pdl),
                           args.reps)
        results.append((rows, t_ours, t_op, t_base, err, t_bf16, err_b, t_inst))
        del x, xb, a, b, a_op

    print()
    print(f"| rows/expert | ours us | ours GB/s | % of copy BW | {base_name if rows_list else 'bf16'} us | speed-up | "
          "op us | rel err | " + " | ".join(f"{INSTANCES[w]} us (%)" for w in instances) + " |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows, t_ours, t_op, t_base, err, _, _, t_inst in results:
        gbs = wbytes / (t_ours * 1e-6) / 1e9
        inst = " | ".join(f"{t:.1f} ({100 * wbytes / (t * 1e-6) / 1e9 / copy_bw:.1f})" for t in t_inst)
        print(f"| {rows} | {t_ours:.1f} | {gbs:.0f} | {100 * gbs / copy_bw:.1f} | {t_base:.1f} | "
              f"{t_base / t_ours:.2f}x | {t_op:.1f} | {err:.1e} | {inst} |")
    if rows_list:
        print(f"\ncopy BW {copy_bw:.0f} GB/s; roofline {roof_us:.0f} us for {wbytes / 1e6:.0f} MB. Targets: >= "
              f"{TARGET_PCT:.0f}% of copy BW up to {TARGET_MAX_ROWS} rows/expert, >= {TARGET_SPEEDUP:.0f}x {base_name}.")
    if rows_list:
        print(f"\nBF16 weights ({bbytes / 1e6:.0f} MB, the same values) in our kernel's BF16 tiles vs {base_name}:")
        print(f"| rows/expert | ours BF16 us | GB/s | % of copy BW | {base_name} us | speed-up | rel err |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for rows, _, _, t_base, _, t_bf16, err_b, _ in results:
            gbs = bbytes / (t_bf16 * 1e-6) / 1e9
            print(f"| {rows} | {t_bf16:.1f} | {gbs:.0f} | {100 * gbs / copy_bw:.1f} | {t_base:.1f} | "
                  f"{t_base / t_bf16:.2f}x | {err_b:.1e} |")
    for rows, t_ours, _, t_base, _, _, _, _ in results:
        pct = 100 * wbytes / (t_ours * 1e-6) / 1e9 / copy_bw
        if rows > TARGET_MAX_ROWS:
            print(f"  rows/expert {rows:>3}: no target ({pct:.1f}% of copy BW, {t_base / t_ours:.2f}x)")
            continue
        print(f"  rows/expert {rows:>3}: BW {'met' if pct >= TARGET_PCT else 'MISSED'} ({pct:.1f}%), speed-up "
              f"{'met' if t_base / t_ours >= TARGET_SPEEDUP else 'MISSED'} ({t_base / t_ours:.2f}x)")

    if args.decode:
        del w_gu, w_dn, pb
        print("\n| decode case | packed MB | ours us | ours GB/s | % of copy BW | BF16 MB | ours BF16 us | GB/s | % |")
        print("|:--|---:|---:|---:|---:|---:|---:|---:|---:|")
        for m in [int(v) for v in args.decode.split(",")]:
            label, us, nbytes, us_b, nbytes_b = decode_case(m, args.decode_experts, args.decode_inter, args.topk,
                                                            args.reps, seed=m, pdl=args.pdl)
            gbs, gbs_b = nbytes / (us * 1e-6) / 1e9, nbytes_b / (us_b * 1e-6) / 1e9
            print(f"| {label} | {nbytes / 1e6:.0f} | {us:.1f} | {gbs:.0f} | {100 * gbs / copy_bw:.1f} | "
                  f"{nbytes_b / 1e6:.0f} | {us_b:.1f} | {gbs_b:.0f} | {100 * gbs_b / copy_bw:.1f} |")

    if args.far:
        q = random_experts(args.experts, seed=1)
        print(f"\nfar slots: {args.experts} experts in registered host memory, read in place by the kernel")
        print("| rows/expert | MB | device slots us | far slots us | far GB/s | pinned H2D copy us | copy GB/s | "
              "far / copy |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for rows in [int(v) for v in args.far.split(",")]:
            t_near, t_far, t_copy, nbytes = far_case(q, rows, args.topk, args.reps)
            print(f"| {rows} | {nbytes / 1e6:.0f} | {t_near:.1f} | {t_far:.1f} | {nbytes / t_far / 1e3:.1f} | "
                  f"{t_copy:.1f} | {nbytes / t_copy / 1e3:.1f} | {t_far / t_copy:.2f} |")
        del q

    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        rows = 8
        experts, weights = routing(args.experts, rows, args.topk, seed=rows)
        plan = plan_rows(experts, weights, torch.zeros(args.experts, dtype=torch.long), torch.ones(args.experts), 1)
        segs, (lo, _) = plan.segments[0], plan.block(0)
        tokens = plan.tokens.cuda()
        x = (torch.randn(experts.shape[0], HIDDEN, device="cuda") * 0.5).to(torch.bfloat16)
        for _ in range(3):
            compute(x, tokens, segs, lo)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                compute(x, tokens, segs, lo)
            torch.cuda.synchronize()
        print(f"\nper-kernel times at {rows} rows/expert (10 calls):")
        stage_bytes = {"experts_gemm_kernel<true>": p.q_gu.numel() + p.s_gu.numel(),
                       "experts_gemm_kernel<false>": p.q_dn.numel() + p.s_dn.numel(), "prep_rows_kernel": 0}
        for evt in prof.key_averages():
            us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
            if not evt.count or not us:
                continue
            us /= evt.count
            stage = next((k for k in stage_bytes if k in evt.key), None)
            extra = ""
            if stage and stage_bytes[stage]:
                gbs = stage_bytes[stage] / (us * 1e-6) / 1e9
                extra = f"  {stage_bytes[stage] / 1e6:.0f} MB -> {gbs:.0f} GB/s = {100 * gbs / copy_bw:.1f}% of copy BW"
            print(f"  {us:9.1f} us x{evt.count:<4} {evt.key[:90]}{extra}")


if __name__ == "__main__":
    main()
