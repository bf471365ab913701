"""The stack's launches of one decode step, each timed at every K split (GPU): which split each weight wants.

    python benchmarks/bench_stack_split.py preset:glm5-flash-4l:nvfp4-all [M] [--splits 0,1,2,4,8] [--reps 10]

Records every ops.linear and ops.swiglu_dense call of one eager decode step of the model (the stack's linears, dense
MLPs, shared experts and the packed lm_head, in step order, with the step's own rows), then, per split, captures all
of them in one CUDA graph in that order (each weight read once per replay, as the step reads it; the sequence is
larger than L2) and replays it under torch.profiler. Per call: its kernels' device time (row prep and GEMMs), median
over the replays. Split 0 is the kernel's own rule (csrc/nvfp4_experts.cu dense_split). The table gives each call's
weight bytes, output features and K, us at every split, the best split and its fraction of the copy bandwidth; the
totals compare the rule with the best split per call. Every split computes each row's sums in another order, so the
outputs differ in their last bits between splits, never between runs of one split.

    ncu --profile-from-start off -k regex:experts_gemm --section SpeedOfLight ... \
        python benchmarks/bench_stack_split.py preset:glm5-flash-4l:nvfp4-all 8 --splits 0 --ncu

--ncu: no timing; each call runs once per split between cudaProfilerStart and Stop, for Nsight Compute's counters
(ncu and torch.profiler cannot share the device's profiling interface).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from rocket_mpi import ops
from rocket_mpi.checkpoint.synthetic import SyntheticReader
from rocket_mpi.runtime.engine import Engine
from rocket_mpi.runtime.prompts import default_prompts

from bench_experts import copy_bandwidth  # beside this file
from bench_stack import graphed


def record(eng: Engine, m: int) -> list[tuple]:
    """The ops.linear / ops.swiglu_dense calls of the second decode step: (kind, x, weights, residuals, limit)."""
    calls, on = [], [False]
    lin, mlp = ops.linear, ops.swiglu_dense

    def linear(x, packs, residual=(), **kw):
        if on[0]:
            calls.append(("linear", x.clone(), packs, tuple(r.clone() for r in residual), None))
        return lin(x, packs, residual, **kw)

    def swiglu(x, p, residual=(), limit=None, **kw):
        if on[0]:
            calls.append(("mlp", x.clone(), p, tuple(r.clone() for r in residual), limit))
        return mlp(x, p, residual, limit, **kw)

    def on_step(step, logits):
        on[0] = step == 1

    ops.linear, ops.swiglu_dense = linear, swiglu
    ahead, eng.steps_ahead = eng.steps_ahead, 0  # step 2 is launched after step 1's callback
    try:
        eng.generate(default_prompts(m, eng.cfg.vocab_size), 3, on_step=on_step)
    finally:
        ops.linear, ops.swiglu_dense = lin, mlp
        eng.steps_ahead = ahead
    return calls


def run(call, split: int):
    kind, x, w, res, limit = call
    if kind == "linear":
        return ops.linear(x, w, res, split=split)
    return ops.swiglu_dense(x, w, res, limit, split=split)


def describe(call) -> tuple[str, int, str]:
    """(name, weight bytes, shape) of a recorded call."""
    kind, x, w, _, _ = call
    if kind == "linear":
        nb = sum(p.nbytes for p in w)
        fmt = "NVFP4" if w[0].nvfp4 else "BF16"
        shape = " + ".join(f"{p.n}x{p.k}" + (f" ({len(p.ends)} parts)" if len(p.ends) > 1 else "") for p in w)
        return f"linear {fmt}", nb, shape
    nb = sum(t.numel() * t.element_size() for t in (w.q_gu, w.s_gu, w.q_dn, w.s_dn) if t is not None)
    return f"MLP {'BF16' if w.bf16 else 'NVFP4'}", nb, f"{w.hidden}->{w.inter}->{w.hidden}"


def kernels_per_call(calls, split: int) -> list[int]:
    """How many kernels each call launches (eagerly, under the profiler, one call at a time)."""
    counts = []
    for c in calls:
        run(c, split)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(c, split)
            torch.cuda.synchronize()
        counts.append(sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name
                          and "Memset" not in e.name))
    if 0 in counts:  # the profiler records nothing while another CUPTI client (ncu, nsys) holds the device
        sys.exit(f"torch.profiler saw no kernel of call {counts.index(0)}: is another profiler attached (ncu, nsys)? "
                 "This benchmark times with torch.profiler and cannot run under one.")
    return counts


def time_calls(calls, split: int, reps: int) -> list[float]:
    """Median device us of each call over `reps` replays of the whole sequence captured in one graph."""
    counts = kernels_per_call(calls, split)
    replay = graphed(lambda: [run(c, split) for c in calls])
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name
                 and "Memset" not in e.name), key=lambda e: e.time_range.start)
    per = sum(counts)
    if len(ks) != per * reps:
        sys.exit(f"split {split}: {len(ks)} kernels in {reps} replays, expected {per} per replay")
    us = [[] for _ in calls]
    for r in range(reps):
        i = r * per
        for j, n in enumerate(counts):
            us[j].append(sum(e.time_range.elapsed_us() for e in ks[i:i + n]))
            i += n
    return [statistics.median(u) for u in us]


def profile_once(calls, splits: list[int]) -> int:
    """--ncu: the calls listed, then each run once per split inside the profiler range (warmed up before it)."""
    for i, c in enumerate(calls):
        name, nb, shape = describe(c)
        print(f"{i} {name} {shape} {nb / 1e6:.2f} MB")
    def every_call():
        for s in splits:
            for c in calls:
                run(c, s)
        torch.cuda.synchronize()

    every_call()  # warm-up: first launches, lazy allocations
    torch.cuda.profiler.start()
    every_call()
    torch.cuda.profiler.stop()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("m", nargs="?", type=int, default=1, help="streams (default 1)")
    ap.add_argument("--splits", default="0,1,2,4,8", help="K slices to time (0: the kernel's rule)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ncu", action="store_true", help="each call once per split inside cudaProfilerStart / Stop "
                    "(for ncu --profile-from-start off), no timing")
    a = ap.parse_args()
    if not (torch.cuda.is_available() and ops.available()):
        sys.exit(f"bench_stack_split needs a CUDA device and the extension: {ops.unavailable_reason() or 'no GPU'}")
    splits = [int(s) for s in a.splits.split(",")]
    if any(s not in (0, 1, 2, 4, 8) for s in splits):
        ap.error(f"--splits {a.splits}: each of 0, 1, 2, 4, 8")
    reader = SyntheticReader(a.checkpoint, "cuda")
    eng = Engine(a.checkpoint, reader=reader, device="cuda")
    eng.set_decode_path("device", "local")
    calls = record(eng, a.m)
    if not calls:
        sys.exit(f"{a.checkpoint}: no stack launches in a decode step")
    if a.ncu:
        return profile_once(calls, splits)
    bw = copy_bandwidth(2 << 30, 10)
    times = {s: time_calls(calls, s, a.reps) for s in splits}
    print(f"{a.checkpoint}, M={a.m}: {len(calls)} stack launches per decode step; copy {bw:.0f} GB/s; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}; device us per call, median of {a.reps} "
          "replays of the step's launches in one graph\n")
    head = " | ".join(f"split {s or 'rule'}" for s in splits)
    print(f"| # | launch | shape | MB | {head} | best | best % copy |")
    print("|--:|:--|:--|--:|" + "--:|" * len(splits) + ":--|--:|")
    best_total = 0.0
    for i, c in enumerate(calls):
        name, nb, shape = describe(c)
        row = {s: times[s][i] for s in splits}
        b = min(row, key=row.get)
        best_total += row[b]
        cells = " | ".join(f"{row[s]:.1f}" for s in splits)
        print(f"| {i} | {name} | {shape} | {nb / 1e6:.2f} | {cells} | {b or 'rule'} | "
              f"{100 * nb / row[b] / 1e3 / bw:.1f} |")
    nb = sum(describe(c)[1] for c in calls)
    tot = " | ".join(f"{sum(times[s]):.1f}" for s in splits)
    print(f"| | **all** | | {nb / 1e6:.1f} | {tot} | {best_total:.1f} | {100 * nb / best_total / 1e3 / bw:.1f} |")
    for s in splits:
        print(f"split {s or 'rule'}: {sum(times[s]):.1f} us, {100 * nb / sum(times[s]) / 1e3 / bw:.1f} % of copy")
    print(f"best split per launch: {best_total:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
