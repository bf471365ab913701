"""A/B of decode-step variants inside one process (not a test): one model load, variants interleaved round by round.

    python benchmarks/ab_decode.py preset:air8:nvfp4 --sweep 1,8,16 --tokens 40 --rounds 4 \
        main ahead0:steps_ahead=0 ahead2:steps_ahead=2

Each variant is NAME[:KEY=VALUE[,KEY=VALUE...]], set in code for its runs (and undone after), with KEY one of

    steps_ahead   graphed steps launched before the oldest is read back (Engine.steps_ahead, default 1)
    graph_spans   the smallest attention span of the fixed-shape step (Settings.graph_span_min, as ROCKET_GRAPH_SPANS;
                  default 256); graph_spans=C with --capacity C: every step spans the whole cache
    experts_pdl   the routed-expert kernel's pdl (-1 auto, 0 off, 3: ops.nvfp4_experts), on every launch of it
    mlp_pdl       swiglu_dense's pdl (the dense MLPs and shared experts in the kernel's BF16 tiles)
    linear_split  ops.linear's split (0: by shape, or 1, 2, 4, 8 K slices), BF16 and NVFP4 tiles
    mlp_split     swiglu_dense's split, BF16 and NVFP4 tiles
    old_attention =1: GLM-4.x decode attention as before ops.decode_attention (two matmuls over the span around
                  ops.decode_softmax; not batch-invariant: cuBLAS picks its sums by the span and the streams)
    old_head      =1: the lm_head in cuBLAS (F.linear) instead of its packed copy (any family)
    old_stack     =1: GLM-4.x steps of more than 16 rows through cuBLAS instead of the packed linears

A bare NAME runs the defaults (e.g. `main`); `old:old_attention=1,old_head=1,old_stack=1` is the GLM-4.x step before
it was batch-invariant. The launch arguments (the *_pdl and *_split keys) are forced on the
extension's entry points while a variant runs, since the engine passes none. Per round and M, every variant decodes
the same prompts on the graphed path (a fresh capture), in an order rotated from round to round; the timed steps are
the replays after the capture (host-timed steps, as `rocket_mpi decode` times them). Separate processes differ from
each other by a few percent (clocks, copy bandwidth 4.07-4.21 TB/s on one H200), more than a small change moves the
step; inside one process the variants share the machine's state. Prints, per M, each variant's median and best ms
per step over all its rounds, its per-round medians, the ratio of medians to the first variant, and whether its
tokens equal the first variant's (steps_ahead and pdl never change the bits; split and graph_spans may).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import statistics
import types
from contextlib import contextmanager

import torch

from rocket_mpi import ops
from rocket_mpi.model import glm4_moe
from rocket_mpi.checkpoint.synthetic import SyntheticReader
from rocket_mpi.runtime.decode import measure_copy_bandwidth, pick_device
from rocket_mpi.runtime.engine import Engine
from rocket_mpi.runtime.prompts import default_prompts

PDL = (-1, 0, 3)
SPLIT = (0, 1, 2, 4, 8)
# key -> (allowed values or None for any positive / non-negative int, minimum)
KNOBS = {"steps_ahead": (None, 0), "graph_spans": (None, 1), "experts_pdl": (PDL, None), "mlp_pdl": (PDL, None),
         "linear_split": (SPLIT, None), "mlp_split": (SPLIT, None), "old_attention": ((0, 1), None),
         "old_head": ((0, 1), None), "old_stack": ((0, 1), None)}
GLM4_ONLY = ("old_attention", "old_stack")
# the extension's entry points each launch-argument key is forced on: (function, its keyword)
FORCED = {"experts_pdl": (("nvfp4_experts", "pdl"), ("nvfp4_experts_into", "pdl")),
          "mlp_pdl": (("swiglu_dense", "pdl"),),
          "linear_split": (("bf16_linear", "split"), ("nvfp4_linear", "split")),
          "mlp_split": (("swiglu_dense", "split"), ("swiglu_dense_nvfp4", "split"))}


def parse_variant(spec: str) -> tuple[str, dict[str, int]]:
    name, _, rest = spec.partition(":")
    knobs = {}
    for kv in filter(None, rest.split(",")):
        k, sep, v = kv.partition("=")
        if not sep or k not in KNOBS:
            raise SystemExit(f"variant {spec!r}: {kv!r} is not KEY=VALUE with KEY one of {', '.join(KNOBS)}")
        allowed, least = KNOBS[k]
        try:
            n = int(v)
        except ValueError:
            n = None
        if n is None or (allowed is not None and n not in allowed) or (least is not None and n < least):
            want = ", ".join(map(str, allowed)) if allowed else f"an integer >= {least}"
            raise SystemExit(f"variant {spec!r}: {k}={v!r}: expected {want}")
        knobs[k] = n
    return name, knobs


def matmul_attention(model, q, kc, vc, pos, span, rows):
    """Glm4MoeModel.decode_attention as it was before ops.decode_attention: q [M, hq, d] against the span's keys in a
    batched matmul (bf16 scores), ops.decode_softmax (scale, keys past pos hidden, fp32 softmax, bf16), then the
    probabilities times the values in a second matmul -> [M, hq * d]."""
    keys, vals = (kc[rows], vc[rows]) if rows is not None else (kc, vc)
    keys, vals = keys[:, :, :span], vals[:, :, :span]
    m, hq, d = q.shape
    hkv = keys.shape[1]
    scores = torch.matmul(q.reshape(m, hkv, hq // hkv, d), keys.transpose(-1, -2)).view(m, hq, 1, -1)
    probs = ops.decode_softmax(scores, pos, model.scale)
    return torch.matmul(probs.view(m, hkv, hq // hkv, -1), vals).reshape(m, -1)


def cublas_above_16(fn, packed: str):
    """layers.stack_linears / stack_mlp as glm4_moe took them before: a step of more than 16 rows (not a prefill's
    row groups) on the dense weights (cuBLAS), its packed copy (the argument `packed`) left out."""
    sig = inspect.signature(fn)

    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        if bound.arguments.get("rows") is None and bound.arguments["x"].shape[0] > ops.STACK_KERNEL_MAX_ROWS:
            bound.arguments[packed] = None
        return fn(*bound.args, **bound.kwargs)
    return call


def forcing(fn, kw: dict[str, int]):
    """fn with the keywords `kw` on every call, whatever the caller passes for them."""
    def call(*args, **kwargs):
        return fn(*args, **{**kwargs, **kw})
    return call


@contextmanager
def applied(eng: Engine, knobs: dict[str, int]):
    """The engine (and the extension's launches) set as the variant says for the duration; undone after."""
    undo = []
    try:
        if "steps_ahead" in knobs:
            undo.append((setattr, eng, "steps_ahead", eng.steps_ahead))
            eng.steps_ahead = knobs["steps_ahead"]
        if "graph_spans" in knobs:  # read when the step is built (GraphStep), so a fresh run takes it
            undo.append((setattr, eng, "settings", eng.settings))
            eng.settings = dataclasses.replace(eng.settings, graph_span_min=knobs["graph_spans"])
        if any(knobs.get(k) for k in GLM4_ONLY):
            model = eng.model
            if not isinstance(model, glm4_moe.Glm4MoeModel):
                raise SystemExit(f"{', '.join(GLM4_ONLY)}: GLM-4.x (glm4_moe) only, not {eng.cfg.model_type}")
            if knobs.get("old_attention"):
                undo.append((delattr, model, "decode_attention"))
                model.decode_attention = types.MethodType(matmul_attention, model)
            if knobs.get("old_stack"):
                for name, packed in (("stack_linears", "packs"), ("stack_mlp", "packed")):
                    undo.append((setattr, glm4_moe, name, getattr(glm4_moe, name)))
                    setattr(glm4_moe, name, cublas_above_16(getattr(glm4_moe, name), packed))
        if knobs.get("old_head"):  # layers.head_logits falls back to F.linear
            undo.append((setattr, eng.model, "head_packed", eng.model.head_packed))
            eng.model.head_packed = None
        per_fn: dict[str, dict[str, int]] = {}
        for key, targets in FORCED.items():
            if key in knobs:
                for fn, kw in targets:
                    per_fn.setdefault(fn, {})[kw] = knobs[key]
        if per_fn:
            ext = ops._ext.load()
            if ext is None or not ops.on_gpu(eng.device):
                raise SystemExit(f"{', '.join(k for k in knobs if k in FORCED)}: launch arguments of the CUDA "
                                 f"kernels; this run has none ({ops.unavailable_reason() or eng.device})")
            for fn, kw in per_fn.items():
                undo.append((setattr, ext, fn, getattr(ext, fn)))
                setattr(ext, fn, forcing(getattr(ext, fn), kw))
        yield
    finally:
        for f, *args in reversed(undo):
            f(*args)


def variant_args(doc: str, sweep: str) -> argparse.ArgumentParser:
    """The arguments every variant script takes: checkpoint, variants, --sweep."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("variants", nargs="+", help="NAME[:KEY=VALUE[,KEY=VALUE...]], KEY one of " + ", ".join(KNOBS))
    ap.add_argument("--sweep", default=sweep)
    return ap


def rotated_runs(eng: Engine, variants: list[tuple[str, dict[str, int]]], rounds: int, run, path: str):
    """Yields (round, name, result of run()) for every variant in every round, the order rotated from round to
    round, each with its settings applied (undone after); a run off `path` or with a note ends the script."""
    for r in range(rounds):
        for j in range(len(variants)):
            name, knobs = variants[(j + r) % len(variants)]
            with applied(eng, knobs):
                res = run()
            if res.path != path or res.note:
                raise SystemExit(f"variant {name}: path {res.path} {res.note}")
            yield r, name, res


def main() -> int:
    ap = variant_args(__doc__, "1,8,16")
    ap.add_argument("--tokens", type=int, default=40, help="steps per run (the first 3 are not timed)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=0,
                    help="cache positions per stream (default: prompt + tokens); the graphed step's fixed shapes "
                         "span the positions held, rounded up (graph.span_for), up to it; a variant with "
                         "graph_spans=CAPACITY spans all of it (a long run's step without its prefill)")
    ap.add_argument("--prompt-len", type=int, default=0,
                    help="every stream's prompt repeated to this many tokens (default: the short default prompts): "
                         "times the steps late in a long run, after the prefill")
    a = ap.parse_args()
    variants = [parse_variant(v) for v in a.variants]
    dev = pick_device("cuda", None)  # as `rocket_mpi decode`: this GPU, deterministic settings
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
        run = lambda: eng.generate(prompts, a.tokens, capacity=a.capacity)  # noqa: E731
        for r, name, res in rotated_runs(eng, variants, a.rounds, run, "graph"):
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
