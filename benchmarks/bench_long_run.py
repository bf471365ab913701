"""A whole long decode run on the graphed path, per variant, in one process (not a test).

    python benchmarks/bench_long_run.py preset:glm5-4l:nvfp4 --sweep 1,8 --tokens 2000 \
        main spans1k:graph_spans=1024

`benchmarks/ab_decode.py` times the steady replays of short runs; this times what a user's long run costs end to end:
every decode step, the steps that run eagerly and capture a graph where the step's span grows (graph.span_for),
and the decode seconds in all. Variants are NAME[:KEY=VALUE,...] as in ab_decode (steps_ahead, graph_spans,
experts_pdl, mlp_pdl, linear_split, mlp_split, old_attention, old_head, old_stack; a bare NAME: the defaults), run
round after round in a rotated order (a long run heats the GPU: the variant run second would pay for it). Prints per
M and variant: the decode seconds of each round (steps 1..n-1), the median ms per step over the same windows of
steps for every variant (1-255, 256-511, ...: the positions grow with the step), the spans taken, and the ms of the
steps that ran eagerly or captured (the first two of each span, summed, mean over rounds).
"""
from __future__ import annotations

import statistics

from rocket_mpi.checkpoint.synthetic import SyntheticReader
from rocket_mpi.runtime.decode import pick_device
from rocket_mpi.runtime.engine import Engine
from rocket_mpi.runtime.prompts import default_prompts

from ab_decode import parse_variant, rotated_runs, variant_args  # beside this file


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
    dev = pick_device(a.device, None)
    eng = Engine(a.checkpoint, reader=SyntheticReader(a.checkpoint, str(dev)), device=str(dev))
    path = eng.set_decode_path("graph" if dev.type == "cuda" else "device", "local")
    wins = windows(a.tokens)
    print(f"{a.checkpoint}: {a.tokens} tokens per stream, {path} path, {a.rounds} rounds in one process")
    for m in (int(x) for x in a.sweep.split(",")):
        prompts = default_prompts(m, eng.cfg.vocab_size)
        runs: dict[str, list] = {n: [] for n, _ in variants}
        run = lambda: eng.generate(prompts, a.tokens)  # noqa: E731
        for _, name, res in rotated_runs(eng, variants, a.rounds, run, path):
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
