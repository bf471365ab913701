"""GLM-5.3-Flash (glm5_next) and GLM-5 (glm_moe_dsa) decode benchmarks (not a test). Two modes:

--cpu   our decode beside transformers' on the same tiny weights (dsa-tiny and glm5-tiny written to a
        temp dir by make_checkpoint), one process, the same thread count for both: tok/s at M=1 and M=8,
        each the median over decode steps after a warm-up, in one table.

--gpu   one GPU, full-width layers: per-layer time split of a decode step at M=1 and M=8. GLM-5.3-Flash
        from `preset:glm5-flash-4l` (3 KDA + 1 MLA/DSA layer, 1 dense + 3 MoE layers of 288 experts, at
        the real width) and GLM-5 cut to two layers (`glm5-2l`, registered here: 1 dense + 1 MoE layer
        of 256 experts, hidden 6144), both drawn straight onto the GPU by SyntheticReader. Each layer's
        attention half and MLP/MoE half is bracketed with CUDA events (the models' `timers` hook), so is
        the attention kernel inside the half (KDA or MLA/DSA, without the hyper-connection mixing and
        norm) and the routed experts inside the MoE (route + row plan + experts + scatter: engine.moe).
        Weight bytes per section against the measured copy bandwidth give the roofline column.
        Runs at a short context (the default prompts, 3..13 tokens) and a long one (--contexts).

        The presets run in BF16 on the host (eager) path, where the timers can bracket each layer; the
        graphed step with NVFP4 experts is timed by benchmarks/ab_decode.py (preset:glm5-flash-4l:nvfp4,
        preset:glm5-4l:nvfp4). When the BF16 preset does not fit --max-gib (or the free GPU memory), the
        routed experts per layer are cut, and the output says so (per-step expert reads depend on the
        experts touched, at most M x top-k).

        `--device cpu --preset glm5-tiny` runs the same code on the CPU (host clocks instead of events):
        the check that the GPU path works before a GPU run.

python benchmarks/bench_glm5.py --cpu [--tokens 24] [--threads 1]
python benchmarks/bench_glm5.py --gpu [--contexts 0,4096] [--tokens 14] [--max-gib 60]
python benchmarks/bench_glm5.py --gpu --device cpu --preset glm5-tiny --dsa-preset dsa-tiny --contexts 0,40
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

import torch

from rocket_mpi.checkpoint import make, make_dsa
from rocket_mpi.runtime.prompts import default_prompts

WARMUP = 3           # decode steps not timed (step 0, the prefill, never is)


def median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


# -- --cpu: ours beside transformers -----------------------------------------------------------
def ours_cpu(ckpt: str, m: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Median ms per decode step (one loop iteration: forward, argmax, bookkeeping) and the tokens."""
    from rocket_mpi.runtime.engine import Engine
    eng = Engine(ckpt)
    prompts = default_prompts(m, eng.cfg.vocab_size)
    stamps = []
    res = eng.generate(prompts, tokens, on_step=lambda step, logits: stamps.append(time.perf_counter()))
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][WARMUP:]        # decode steps 1.. after warm-up
    return median_ms(gaps), res.tokens


class StepClock:
    """A logits processor: generate() calls it once per new token, right after that step's forward."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def hf_glm5_dir(flat_dir: str, out_dir: str) -> str:
    """A text-only glm5_next checkpoint as transformers' Glm5NextForConditionalGeneration loads it: the
    text config nested, tensors under model.language_model. (the vision tower is left to its init: text
    never reaches it)."""
    from safetensors.torch import load_file, save_file
    with open(os.path.join(flat_dir, "config.json")) as f:
        raw = json.load(f)
    text = {k: v for k, v in raw.items() if k not in ("architectures", "tie_word_embeddings", "quantization_config")}
    top = {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"],
           "tie_word_embeddings": raw.get("tie_word_embeddings", False), "text_config": text,
           "vision_config": dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32,
                                 out_hidden_size=raw["hidden_size"], projection_intermediate_size=32)}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(top, f)
    tensors = load_file(os.path.join(flat_dir, "model.safetensors"))
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def load_hf(family: str, ckpt: str):
    """transformers' model of a family, BF16, or None with the reason when this transformers lacks it."""
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    name = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "glm5_next": "Glm5NextForConditionalGeneration"}[family]
    cls = getattr(transformers, name, None)
    if cls is None:
        return None, f"transformers {transformers.__version__} has no {name}"
    model, info = cls.from_pretrained(ckpt, dtype=torch.bfloat16, output_loading_info=True)
    lost = [k for k in info["missing_keys"] if not k.startswith("model.visual.")] + list(info["unexpected_keys"])
    if lost:
        raise SystemExit(f"{ckpt}: transformers {name} did not load {len(lost)} tensors, e.g. {sorted(lost)[:3]}")
    return model.eval(), None


def hf_cpu(model, m: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Median ms per decode step of transformers' generate (greedy, its own cache), left-padded prompts."""
    from transformers import LogitsProcessorList
    prompts = default_prompts(m, model.config.get_text_config().vocab_size)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = StepClock()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=tokens,
                             min_new_tokens=tokens, pad_token_id=0, eos_token_id=None,
                             logits_processor=LogitsProcessorList([clock]))
    gaps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])][WARMUP:]
    return median_ms(gaps), out[:, width:].tolist()


def cpu_mode(a) -> None:
    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp(prefix="bench_glm5_")
    rows, notes = [], []
    for preset, family in (("dsa-tiny", "glm_moe_dsa"), ("glm5-tiny", "glm5_next")):
        ckpt = os.path.join(tmp, preset)
        make.make_checkpoint(preset, ckpt, seed=3)
        hf_ckpt = hf_glm5_dir(ckpt, ckpt + "-hf") if family == "glm5_next" else ckpt
        try:
            model, why = load_hf(family, hf_ckpt)
        except ImportError as e:
            model, why = None, f"transformers not importable ({e})"
        if why:
            notes.append(f"{preset}: transformers skipped: {why}")
        for m in (1, 8):
            ms, toks = ours_cpu(ckpt, m, a.tokens)
            hf_ms, same = None, "-"
            if model is not None:
                hf_ms, hf_toks = hf_cpu(model, m, a.tokens)
                same = f"{sum(x == y for x, y in zip(toks, hf_toks))}/{m}"
            rows.append((preset, m, ms, hf_ms, same))
    print(f"\nCPU decode, tiny random weights, {a.threads} thread(s) for both, {os.cpu_count()} cores, "
          f"{a.tokens} tokens per stream; median ms per decode step after {WARMUP} warm-up steps")
    print(f"{'checkpoint':<10} {'M':>2} {'ours ms':>8} {'ours tok/s':>10} {'HF ms':>8} {'HF tok/s':>9} "
          f"{'ours/HF':>7}  {'streams same tokens':>19}")
    for preset, m, ms, hf_ms, same in rows:
        hf = f"{hf_ms:>8.2f} {m * 1e3 / hf_ms:>9.1f} {hf_ms / ms:>6.2f}x" if hf_ms else f"{'-':>8} {'-':>9} {'-':>7}"
        print(f"{preset:<10} {m:>2} {ms:>8.2f} {m * 1e3 / ms:>10.1f} {hf}  {same:>19}")
    print("ours/HF: speed-up (HF ms / ours ms). Same tokens: greedy BF16 decodes of both, stream by stream "
          "(BF16 rounding differs, so a late divergence is not an error; the oracle tests hold the accuracy).")
    for n in notes:
        print(n)


# -- --gpu: per-layer split on full-width layers --------------------------------------------------
class Sections:
    """model.timers: brackets a sub-block with CUDA events (host clocks on a CPU), grouped per step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.current, self.steps = [], []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def span(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else 1e3 * (b - a)

    @contextmanager
    def __call__(self, key):
        start = self.mark()
        try:
            yield
        finally:
            self.current.append((key, start, self.mark()))

    def end_step(self):
        self.steps.append(self.current)
        self.current = []

    def ms(self, step: list) -> dict:
        out: dict = {}
        for key, a, b in step:
            out[key] = out.get(key, 0.0) + self.span(a, b)
        return out


def section_bytes(*objs) -> int:
    """Bytes of every tensor reachable from weights dataclasses / tuples / tensors (each once)."""
    import dataclasses
    seen, total, todo = set(), 0, list(objs)
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            if o.data_ptr() not in seen:
                seen.add(o.data_ptr())
                total += o.numel() * o.element_size()
        elif isinstance(o, (tuple, list)):
            todo += list(o)
        elif dataclasses.is_dataclass(o):
            todo += [getattr(o, f.name) for f in dataclasses.fields(o)]
    return total


def register_glm5_2l() -> str:
    """GLM-5 (make_dsa's 'glm5', as published) cut to 2 layers: 1 dense + 1 MoE, real width."""
    name = "glm5-2l"
    if name not in make_dsa.PRESETS:
        make_dsa.PRESETS[name] = {**make_dsa.PRESETS["glm5"], "num_hidden_layers": 2, "first_k_dense_replace": 1,
                                  "indexer_types": ["full", "full"], "mlp_layer_types": ["dense", "sparse"]}
    return name


def preset_bytes(preset: str) -> tuple[int, int]:
    """(bytes resident in BF16 with fp32 routers, bytes of the routed experts)."""
    cfg = make.config_dict(preset)
    fam = make._family_for_preset(preset)
    total = experts = 0
    for _, shape, kind in (fam or make).tensor_specs(cfg):
        n = 1
        for d in shape:
            n *= d
        b = n * (4 if kind in ("router", "bias") else 2)
        total += b
        if kind == "expert":
            experts += b
    return total, experts


def fit_preset(preset: str, budget: int, rows: int) -> tuple[str, str | None]:
    """The preset, or a copy with fewer routed experts per layer that fits `budget` bytes (and a note).
    At least `rows` (M x top-k) experts stay, so a step can still touch as many distinct experts."""
    total, experts = preset_bytes(preset)
    if total <= budget:
        return preset, None
    cfg = make.config_dict(preset)
    e, g = cfg["n_routed_experts"], cfg.get("n_group", 1) or 1
    per = experts / e                                          # bytes of one expert over all MoE layers
    keep = int((budget - (total - experts)) // per) // g * g
    if keep < max(min(rows, e), g):
        raise SystemExit(f"preset {preset}: {total / 2**30:.1f} GiB in BF16 does not fit {budget / 2**30:.1f} GiB "
                         f"even with {keep} experts per layer")
    name = f"{preset}-e{keep}"
    fam = make._family_for_preset(preset)
    fam.PRESETS[name] = {**fam.PRESETS[preset], "n_routed_experts": keep}
    return name, (f"NOTE: {preset} is {total / 2**30:.1f} GiB in BF16, over the {budget / 2**30:.1f} GiB budget: "
                  f"ran {name}, {keep} of {e} routed experts per MoE layer (same layer widths; per-step expert "
                  f"reads depend on the experts touched, at most M x top-k, not on how many exist)")


def make_prompts(m: int, vocab: int, context: int) -> list[list[int]]:
    """context 0: the default prompts (3..13 tokens); else stream s gets context + s tokens."""
    if not context:
        return default_prompts(m, vocab)
    g = torch.Generator().manual_seed(4321)
    return [torch.randint(2, vocab, (context + s,), generator=g).tolist() for s in range(m)]


class TimedMoE:
    """engine.moe wrapped: each call bracketed as ("routed", layer) and the expert bytes it read noted; every other
    attribute (reset(), the per-step counters crc / rows_owned / rows_total / expert_bytes) is the wrapped one's."""

    def __init__(self, real, sections, expert_bytes: dict[int, list[int]]):
        self.real, self.sections, self.layer_bytes = real, sections, expert_bytes

    def __call__(self, layer, x, L, *args, **kw):
        b0 = self.real.expert_bytes
        with self.sections(("routed", layer)):
            out = self.real(layer, x, L, *args, **kw)
        self.layer_bytes.setdefault(layer, []).append(self.real.expert_bytes - b0)
        return out

    def __getattr__(self, name):
        return getattr(self.real, name)


class Probe:
    """Hooks one engine: the model's timers, the attention kernels and engine.moe, per-step clocks."""

    def __init__(self, engine, device):
        import rocket_mpi.model.glm5_next as glm5
        self.engine, self.model, self.sec = engine, engine.model, Sections(device)
        self.model.timers = self.sec
        self.expert_bytes: dict[int, list[int]] = {}
        self.real_moe = engine.moe
        engine.moe = TimedMoE(self.real_moe, self.sec, self.expert_bytes)
        self.restore = []
        if hasattr(self.model, "kda_args"):        # glm5_next: time the KDA / MLA kernels inside the halves
            layer_of = {id(part): i for i, L in enumerate(self.model.layers) for part in (L.kda, L.mla) if part}
            for fn in ("kda_forward", "mla_forward"):
                real = getattr(glm5, fn)

                def wrapped(a, *args, real=real, **kw):
                    with self.sec(("core", layer_of[id(a)])):
                        return real(a, *args, **kw)
                setattr(glm5, fn, wrapped)
                self.restore.append((glm5, fn, real))
        real_fwd = self.model.forward

        def forward(*args, **kw):
            self.step_start = self.sec.mark()
            return real_fwd(*args, **kw)
        self.model.forward = forward

    def on_step(self, step, logits):
        self.sec.current.append((("step",), self.step_start, self.sec.mark()))
        self.sec.end_step()

    def close(self):
        for mod, fn, real in self.restore:
            setattr(mod, fn, real)
        del self.model.timers
        del self.model.forward
        self.engine.moe = self.real_moe


def layer_kinds(model) -> list[tuple[str, str]]:
    """Per layer (attention kind, MLP kind)."""
    out = []
    for L in model.layers:
        if hasattr(L, "kda"):
            attn = "KDA" if L.kda is not None else \
                ("MLA/DSA" if L.mla.indexer is not None else "MLA/DSA (shared sel.)")
        else:
            attn = "MLA/DSA" if L.attn.indexer is not None else "MLA/DSA (shared sel.)"
        out.append((attn, "dense MLP" if L.mlp is not None else "MoE"))
    return out


def weight_bytes(model, i: int) -> tuple[int, int]:
    """Bytes of layer i's attention half and MLP/MoE half (routed experts excluded: counted per step)."""
    L = model.layers[i]
    if hasattr(L, "kda"):
        attn = section_bytes(L.attn_hc, L.input_norm, L.kda, L.mla)
        ffn = section_bytes(L.ffn_hc, L.post_norm, L.mlp, L.shared, L.router_w, L.router_b)
    else:
        attn = section_bytes(L.input_norm, L.attn)
        ffn = section_bytes(L.post_norm, L.mlp, L.shared, L.router_w, L.router_b)
    return attn, ffn


def run_split(engine, device, m: int, context: int, tokens: int) -> dict:
    """Decode `tokens` steps for M streams; per section the median ms over the timed steps, and bytes."""
    probe = Probe(engine, device)
    try:
        prompts = make_prompts(m, engine.cfg.vocab_size, context)
        res = engine.generate(prompts, tokens, on_step=probe.on_step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps = [probe.sec.ms(s) for s in probe.sec.steps][1 + WARMUP:]
        keys = {k for s in steps for k in s}
        med = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys}
        outer = [k for k in keys if k[0] in ("attn", "ffn", "head")]
        med[("other",)] = statistics.median(s[("step",)] - sum(s.get(k, 0.0) for k in outer) for s in steps)
        routed = {layer: statistics.median(b[1 + WARMUP:]) for layer, b in probe.expert_bytes.items()}
        return {"ms": med, "routed_bytes": routed, "steps": len(steps), "tokens0": res.tokens[0][:8]}
    finally:
        probe.close()


W = 30   # width of the part column


def print_split(title: str, model, runs: dict, bw: float | None, clock: str) -> None:
    """One table: rows per layer half, then totals per kind; one column group per M."""
    kinds = layer_kinds(model)
    head_bytes = model.lm_head.numel() * model.lm_head.element_size() + model.norm.numel() * 2
    ms_list = sorted(runs)
    print(f"\n{title}")
    print(f"ms: median over the timed decode steps ({clock}); share: of the whole step (forward + argmax + "
          "host glue);\ninner: ms of the attention kernel inside the half (KDA or MLA/DSA, without the hc mixing "
          "and norm), or of the routed experts inside the MoE half (route + plan + experts + scatter);\nMB: "
          "weights read per step (routed: the experts touched); roof %: (MB / copy MB/s) / ms"
          + (f", copy {bw:.0f} GB/s (read + write)" if bw else " (GPU only)"))
    hdr = f"{'layer':>5} {'part':<{W}}"
    for m in ms_list:
        hdr += f" | M={m:<2} {'ms':>7} {'share':>6} {'inner':>7} {'MB':>7} {'roof %':>6}"
    print(hdr)

    def cell(r, key, nbytes, inner_key=None):
        ms = r["ms"].get(key, 0.0)
        step = r["ms"][("step",)]
        inner = f"{r['ms'][inner_key]:7.3f}" if inner_key and inner_key in r["ms"] else f"{'-':>7}"
        roof = f"{100 * (nbytes / 1e9 / bw * 1e3) / ms:6.0f}" if bw and ms and nbytes else f"{'-':>6}"
        mb = f"{nbytes / 1e6:7.1f}" if nbytes else f"{'-':>7}"
        return f" | {'':4} {ms:7.3f} {100 * ms / step:5.1f}% {inner} {mb} {roof}"

    totals: dict[str, dict[int, list[float]]] = {}
    for i, (attn, ffn) in enumerate(kinds):
        ab, fb = weight_bytes(model, i)
        for key, part, nbytes_of in ((("attn", i), f"attn {attn}", lambda r, ab=ab: ab),
                                     (("ffn", i), ffn, lambda r, i=i, fb=fb: fb + r["routed_bytes"].get(i, 0))):
            line = f"{i:>5} {part:<{W}}"
            for m in ms_list:
                r = runs[m]
                inner = ("core", i) if key[0] == "attn" else ("routed", i)
                line += cell(r, key, nbytes_of(r), inner)
                t = totals.setdefault(part, {}).setdefault(m, [0.0, 0.0])
                t[0] += r["ms"].get(key, 0.0)
                t[1] += nbytes_of(r)
            print(line)
    line = f"{'-':>5} {'final norm + lm_head':<{W}}"
    for m in ms_list:
        line += cell(runs[m], ("head",), head_bytes)
    print(line)
    line = f"{'-':>5} {'other (embed, argmax, glue)':<{W}}"
    for m in ms_list:
        line += cell(runs[m], ("other",), 0)
    print(line)
    line = f"{'':>5} {'step':<{W}}"
    for m in ms_list:
        r = runs[m]
        line += f" | {'':4} {r['ms'][('step',)]:7.3f} {'100%':>6} {'':>7} {'':>7} {'':>6}"
    print(line)
    print("totals by kind:")
    for part, per_m in totals.items():
        n = sum(1 for a, f in kinds if part in (f"attn {a}", f))
        line = f"{'':>5} {part + f' x{n}':<{W}}"
        for m in ms_list:
            ms, nbytes = per_m[m]
            step = runs[m]["ms"][("step",)]
            roof = f"{100 * (nbytes / 1e9 / bw * 1e3) / ms:6.0f}" if bw and ms else f"{'-':>6}"
            line += f" | {'':4} {ms:7.3f} {100 * ms / step:5.1f}% {'':>7} {nbytes / 1e6:7.1f} {roof}"
        print(line)
    line = f"{'':>5} {'tok/s':<{W}}"
    for m in ms_list:
        line += f" | {'':4} {m * 1e3 / runs[m]['ms'][('step',)]:7.1f} {'':>6} {'':>7} {'':>7} {'':>6}"
    print(line)
    sys.stdout.flush()


def gpu_mode(a) -> None:
    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.runtime.engine import Engine
    t_start = time.perf_counter()
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--gpu --device cuda: torch sees no CUDA device (use --device cpu --preset glm5-tiny "
                             "to check the code path on a CPU)")
        from rocket_mpi.runtime.decode import measure_copy_bandwidth, pick_device
        device = pick_device("cuda", None)       # deterministic kernels, as decode --device cuda runs
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"free {torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB", flush=True)
        bw = measure_copy_bandwidth(device)
    else:
        device, bw = torch.device("cpu"), None
        torch.set_num_threads(a.threads)
        print(f"device: cpu ({a.threads} thread(s)): checking the GPU code path, host clocks, no roofline",
              flush=True)
    contexts = [int(c) for c in a.contexts.split(",")]
    sweep = [int(m) for m in a.sweep.split(",")]
    jobs = [("GLM-5.3-Flash", a.preset)]
    dsa = a.dsa_preset or (register_glm5_2l() if device.type == "cuda" else "dsa-tiny")
    if dsa == "glm5-2l":
        register_glm5_2l()
    if dsa != "none":
        jobs.append(("GLM-5", dsa))
    for label, preset in jobs:
        note = None
        budget = int(a.max_gib * 2**30)
        if device.type == "cuda":   # headroom: prefill activations, the rows' host copies
            budget = min(budget, torch.cuda.mem_get_info(device)[0] - 12 * 2**30)
        preset, note = fit_preset(preset, budget, max(sweep) * make.config_dict(preset)["num_experts_per_tok"])
        t0 = time.perf_counter()
        reader = SyntheticReader(f"preset:{preset}", str(device))
        engine = Engine(reader.dir, 0, 1, None, reader, str(device))
        cfg = engine.cfg
        build_s = time.perf_counter() - t0
        print(f"\n{label}: preset:{preset} ({cfg.model_type}): {cfg.num_hidden_layers} layers, hidden "
              f"{cfg.hidden_size}, {cfg.n_routed_experts} routed experts top-{cfg.num_experts_per_tok}, "
              f"resident {engine.resident_bytes() / 2**30:.1f} GiB, built in {build_s:.1f} s", flush=True)
        if note:
            print(note, flush=True)
        for context in contexts:
            if time.perf_counter() - t_start > a.budget_s:
                print(f"skipped {label} context {context or 'default'}: past --budget-s {a.budget_s:.0f} s", flush=True)
                continue
            runs = {}
            for m in sweep:
                t1 = time.perf_counter()
                runs[m] = run_split(engine, device, m, context, a.tokens)
                print(f"  M={m} context {context or '3..13'}: {runs[m]['steps']} timed steps in "
                      f"{time.perf_counter() - t1:.1f} s (prefill included), stream 0 tokens {runs[m]['tokens0']}",
                      flush=True)
            ctx = f"context {context}+s tokens" if context else "default prompts (3..13 tokens)"
            print_split(f"{label} preset:{preset}, {ctx}, {a.tokens - 1 - WARMUP} timed decode steps per M, "
                        f"{device}", engine.model, runs, bw,
                        "CUDA events" if device.type == "cuda" else "host clock")
        del engine, reader
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cpu", action="store_true", help="ours beside transformers on tiny weights")
    mode.add_argument("--gpu", action="store_true", help="per-layer time split on full-width layers")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=None, help="per stream (--cpu 24, --gpu 14)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="--gpu: cpu checks the code path")
    ap.add_argument("--preset", default="glm5-flash-4l", help="--gpu: the GLM-5.3-Flash preset")
    ap.add_argument("--dsa-preset", default=None,
                    help="--gpu: the GLM-5 preset (default glm5-2l on cuda, dsa-tiny on cpu; none: skip)")
    ap.add_argument("--contexts", default="0,4096", help="--gpu: prompt lengths (0: the default 3..13 tokens)")
    ap.add_argument("--sweep", default="1,8", help="--gpu: streams M")
    ap.add_argument("--max-gib", type=float, default=60.0, help="--gpu: GPU memory the weights may take")
    ap.add_argument("--budget-s", type=float, default=200.0, help="--gpu: start no new context after this")
    a = ap.parse_args()
    if a.tokens is None:
        a.tokens = 24 if a.cpu else 14
    if a.tokens < WARMUP + 3:
        ap.error(f"--tokens must be at least {WARMUP + 3} (prefill + {WARMUP} warm-up + 2 timed)")
    if a.cpu:
        cpu_mode(a)
    else:
        gpu_mode(a)


if __name__ == "__main__":
    main()
