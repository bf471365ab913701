"""A whole long decode run on the graphed path, per ROCKET_GRAPH_SPANS variant, in one process (not a test).

    python scripts/bench_long_run.py preset:glm5-4l:nvfp4 --sweep 1,8 --tokens 2000 \
        capacity:ROCKET_GRAPH_SPANS=capacity auto:ROCKET_GRAPH_SPANS=auto

`scripts/ab_decode.py` times the steady replays of short runs; this times what a user's long run costs end to end:
every decode step, the steps that run eagerly and capture a graph where the step's span grows (graph.span_for),
and the decode seconds in all. Variants are NAME[:ENV=VALUE,...] as in ab_decode (its AB_STACK / AB_ROPE too), run round after round in a
rotated order (a long run heats the GPU: the variant run second would pay for it). Prints per M and variant: the
decode seconds of each round (steps 1..n-1), the median ms per step over the same windows of steps for every
variant (1-255, 256-511, ...: the positions grow with the step), the spans taken, and the ms of the steps that ran
eagerly or captured (the first two of each span, summed, mean over rounds).
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ab_decode import parse_variant, rotated_runs, under_ab_switches, variant_args  # noqa: E402

from rocket_mpi.checkpoint.synthetic import SyntheticReader  # noqa: E402
from rocket_mpi.engine import Engine  # noqa: E402
from rocket_mpi.prompts import default_prompts  # noqa: E402
from rocket_mpi.run import _pick_device  # noqa: E402


def windows(n: int) -> list[tuple[int, int]]:
    """Decode steps 1..n-1 in windows [1, 256), [256, 512), [512, 1024), ...: the same steps for every variant."""
    edges, e = [1], 256
    while e < n:
        edges.append(e)
        e *= 2
    return list(zip(edges, edges[1:] + [n]))


def main() -> int:
    ap = variant_args(__doc__, "1,8")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens generated per stream")
    ap.add_argument("--rounds", type=int, default=2, help="runs per variant, the order rotated from round to round")
    ap.add_argument("--device", default="cuda", help="cuda (graphed) or cpu (the fixed-shape step uncaptured: a "
                                                      "check of the script, not a benchmark)")
    a = ap.parse_args()
    variants = [parse_variant(v) for v in a.variants]
    dev = _pick_device(a.device, None)
    eng = Engine(a.checkpoint, reader=SyntheticReader(a.checkpoint, str(dev)), device=str(dev))
    path = eng.set_decode_path("graph" if dev.type == "cuda" else "device", "local")
    wins = windows(a.tokens)
    print(f"{a.checkpoint}: {a.tokens} tokens per stream, {path} path, {a.rounds} rounds in one process")
    for m in (int(x) for x in a.sweep.split(",")):
        prompts = default_prompts(m, eng.cfg.vocab_size)
        runs: dict[str, list] = {n: [] for n, _ in variants}
        run = lambda: under_ab_switches(eng.model, lambda: eng.generate(prompts, a.tokens))  # noqa: E731
        for _, name, res in rotated_runs(variants, a.rounds, run, path):
            runs[name].append(res)
        first = runs[variants[0][0]][0].tokens
        print(f"\nM={m}: prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; median ms per step "
              f"over the same steps in every variant (all rounds)")
        print(f"{'variant':<10} {'decode s per round':>18} {'tokens':>7} "
              + " ".join(f"{f'{a0}-{b0 - 1}':>9}" for a0, b0 in wins) + "  spans (first step: span), "
              "eager + capture steps ms")
        for name, _ in variants:
            rs = runs[name]
            ms = [[s.seconds * 1e3 for s in res.steps] for res in rs]  # [0] is the prefill
            total = " ".join(f"{sum(x[1:]) / 1e3:.2f}" for x in ms)
            med = [statistics.median(t for x in ms for t in x[a0:b0]) for a0, b0 in wins]
            spans = ", ".join(f"{st}: {sp}" for st, sp in rs[0].spans)
            firsts = sum(sum(x[st:st + 2]) for x, res in zip(ms, rs) for st, _ in res.spans) / len(rs)
            same = "same" if all(res.tokens == first for res in rs) else "DIFFER"
            print(f"{name:<10} {total:>18} {same:>7} " + " ".join(f"{x:>9.3f}" for x in med)
                  + f"  {spans}; {firsts:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
