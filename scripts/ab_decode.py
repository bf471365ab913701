"""A/B of decode-step variants inside one process (not a test): one model load, variants interleaved round by round.

    python scripts/ab_decode.py preset:air8:nvfp4 --sweep 1,8,16 --tokens 40 --rounds 4 \
        base:ROCKET_STEP_FUSE=0 fused:ROCKET_STEP_FUSE=1

Each variant is NAME[:ENV=VALUE[,ENV=VALUE...]]: the environment it runs under (switches read when a step is
built or captured: ROCKET_STEP_FUSE, ROCKET_EXPERTS_PDL, ...). Per round and M, every variant decodes the same
prompts on the graphed path (a fresh capture), in an order rotated from round to round; the timed steps are
the replays after the capture (host-timed steps, as `rocket_mpi decode` times them). Separate processes differ
from each other by a few percent (clocks, copy bandwidth 4.07-4.21 TB/s on one H200), more than a small change
moves the step; inside one process the variants share the machine's state. Prints, per M, each variant's median
and best ms per step over all its rounds, its per-round medians, the ratio of medians to the first variant,
and whether its tokens equal the first variant's (switches that must not change bits).

AB_STACK=torch (read by this script, not the package): the variant runs with the model's packed stack copies
(pack_stack: the linears and MLPs in the expert kernel's BF16 tiles) set aside, so its step takes cuBLAS, as a
model loaded under ROCKET_STACK=torch would; the copies come back after the run. AB_ROPE=torch (this script too):
GLM-5's interleaved RoPE in its torch ops instead of kernels.rope_interleaved (the same bits).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rocket_mpi.checkpoint.synthetic import SyntheticReader  # noqa: E402
from rocket_mpi.engine import Engine  # noqa: E402
from rocket_mpi.prompts import default_prompts  # noqa: E402
from rocket_mpi.run import _pick_device, measure_copy_bandwidth  # noqa: E402


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition(":")
    env = {}
    for kv in filter(None, rest.split(",")):
        k, sep, v = kv.partition("=")
        if not sep:
            raise SystemExit(f"variant {spec!r}: {kv!r} is not ENV=VALUE")
        env[k] = v
    return name, env


def variant_args(doc: str, sweep: str) -> argparse.ArgumentParser:
    """The arguments every variant script takes: checkpoint, variants, --sweep."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("variants", nargs="+", help="NAME[:ENV=VALUE[,ENV=VALUE...]]")
    ap.add_argument("--sweep", default=sweep)
    return ap


def rotated_runs(variants: list[tuple[str, dict[str, str]]], rounds: int, run, path: str):
    """Yields (round, name, result of run()) for every variant in every round, the order rotated from round to
    round, each under its environment (restored after); a run off `path` or with a note ends the script."""
    base_env = dict(os.environ)
    try:
        for r in range(rounds):
            for j in range(len(variants)):
                name, env = variants[(j + r) % len(variants)]
                os.environ.clear()
                os.environ.update(base_env)
                os.environ.update(env)
                res = run()
                if res.path != path or res.note:
                    raise SystemExit(f"variant {name}: path {res.path} {res.note}")
                yield r, name, res
    finally:
        os.environ.clear()
        os.environ.update(base_env)


def without_packed_stack(model, run):
    """run() with every packed stack copy of `model` set aside (None), then put back."""
    from rocket_mpi.model.layers import packed_copies
    saved = [(obj, f, getattr(obj, f)) for obj, f in packed_copies(model)]
    for obj, f, _ in saved:
        setattr(obj, f, None)
    try:
        return run()
    finally:
        for obj, f, v in saved:
            setattr(obj, f, v)


def with_torch_rope(run):
    """run, with GLM-5's interleaved RoPE in torch ops for its duration."""
    def wrapped():
        from rocket_mpi import kernels
        from rocket_mpi.model import glm_moe_dsa
        kernel = kernels.rope_interleaved
        kernels.rope_interleaved = glm_moe_dsa.rope_interleaved_ops
        try:
            return run()
        finally:
            kernels.rope_interleaved = kernel
    return wrapped


def under_ab_switches(model, gen):
    """gen() under this script's AB_STACK / AB_ROPE switches, read from the environment rotated_runs set."""
    if os.environ.get("AB_ROPE") == "torch":
        gen = with_torch_rope(gen)
    return without_packed_stack(model, gen) if os.environ.get("AB_STACK") == "torch" else gen()


def main() -> int:
    ap = variant_args(__doc__, "1,8,16")
    ap.add_argument("--tokens", type=int, default=40, help="steps per run (the first 3 are not timed)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=0,
                    help="cache positions per stream (default: prompt + tokens); with ROCKET_GRAPH_SPANS=capacity "
                         "the graphed step's fixed shapes span all of it (a long run's step without its prefill); "
                         "by default they span the positions held, rounded up (graph.span_for)")
    ap.add_argument("--prompt-len", type=int, default=0,
                    help="every stream's prompt repeated to this many tokens (default: the short default prompts): "
                         "times the steps late in a long run, after the prefill")
    a = ap.parse_args()
    variants = [parse_variant(v) for v in a.variants]
    dev = _pick_device("cuda", None)  # as `rocket_mpi decode`: this GPU, deterministic settings
    eng = Engine(a.checkpoint, reader=SyntheticReader(a.checkpoint, str(dev)), device=str(dev))
    eng.set_decode_path("graph", "local")
    gbps = measure_copy_bandwidth(dev)
    print(f"{a.checkpoint}: {len(variants)} variants x {a.rounds} rounds, {a.tokens} steps per run"
          f"{f', cache capacity {a.capacity}' if a.capacity else ''}"
          f"{f', prompts of {a.prompt_len} tokens' if a.prompt_len else ''}; copy {gbps:.0f} GB/s")
    for m in (int(x) for x in a.sweep.split(",")):
        prompts = default_prompts(m, eng.cfg.vocab_size)
        if a.prompt_len:
            prompts = [(p * (a.prompt_len // len(p) + 1))[:a.prompt_len] for p in prompts]
        times: dict[str, list[list[float]]] = {n: [] for n, _ in variants}
        tokens: dict[str, list] = {}
        gb = 0.0
        run = lambda: under_ab_switches(eng.model, lambda: eng.generate(prompts, a.tokens, capacity=a.capacity))  # noqa: E731
        for r, name, res in rotated_runs(variants, a.rounds, run, "graph"):
            if r == 0:
                print(f"  M={m} {name}: attention spans {res.spans} ((first step, span) pairs)")
            steps = res.steps[3:]
            times[name].append([s.seconds * 1e3 for s in steps])
            gb = statistics.median(s.weight_bytes for s in steps) / 1e9
            tokens.setdefault(name, res.tokens)
        first = variants[0][0]
        ref = statistics.median(t for rr in times[first] for t in rr)
        print(f"\nM={m}: {gb:.3f} GB read per step, roofline {gb / gbps * 1e3:.3f} ms")
        print(f"{'variant':<14} {'median ms':>9} {'best':>6} {'vs ' + first:>9} {'roofline %':>10} {'tokens':>7}  "
              f"per-round medians")
        for name, _ in variants:
            flat = [t for rr in times[name] for t in rr]
            med = statistics.median(flat)
            same = "same" if tokens[name] == tokens[first] else "DIFFER"
            rounds = " ".join(f"{statistics.median(rr):.3f}" for rr in times[name])
            print(f"{name:<14} {med:>9.3f} {min(flat):>6.3f} {med / ref:>9.3f} {gb / gbps * 1e5 / med:>10.1f} "
                  f"{same:>7}  {rounds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
