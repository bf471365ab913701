"""The fixed-shape decode step (runtime/graph.py, moe/step.py DeviceMoE) and the CUDA graph it is captured in.

CPU tests (always run):
  - glm4_moe forward_static (attends over the whole cache capacity) against forward, teacher-forced (and the
    GLM-5 families' fixed-shape step);
  - the fixed-shape step in its CPU reference mode decodes the host path's tokens; its spans
    (graph.span_for, ROCKET_GRAPH_SPANS): the rule, and a run crossing spans; steps launched ahead
    (Engine.steps_ahead) change nothing; --decode-path auto takes the graph only for families checked on a GPU;
    ROCKET_GRAPH_SPANS, each bad value one error.
GPU tests (skip, saying why, without a GPU or the extension):
  - a graphed decode gives the same tokens and row checksums as the same step run eagerly (NVFP4 and BF16
    experts, spans crossed, steps launched ahead).
"""
from __future__ import annotations


import pytest
import torch

from helpers import gpu


@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "dsa_ckpt", "glm5_ckpt", "dsv3_ckpt"])
def test_forward_static_matches_forward(ckpt_name, request):
    """The fixed-shape step (whole-capacity attention, device positions; for glm_moe_dsa and glm5_next the
    indexer over the whole capacity) against the eager step, with the same tokens fed to both: logits
    agree to rounding."""
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.runtime.prompts import default_prompts
    torch.set_num_threads(1)
    eng = Engine(request.getfixturevalue(ckpt_name))
    prompts = default_prompts(4, eng.cfg.vocab_size)
    steps = 6
    res = eng.generate(prompts, steps)
    model = eng.model
    with torch.inference_mode():
        cache = model.new_cache(len(prompts), max(len(p) for p in prompts) + steps)
        tokens = torch.tensor([t for p in prompts for t in p])
        logits = model.forward(tokens, cache, [len(p) for p in prompts], eng.moe)
        worst = 0.0
        for step in range(1, steps):
            fed = torch.tensor([toks[step - 1] for toks in res.tokens])
            got = model.forward_static(fed, cache.lengths.clone(), cache, eng.moe)
            cache.lengths += 1
            assert got.shape == logits.shape
            assert torch.equal(got.argmax(-1), torch.tensor([toks[step] for toks in res.tokens]))
            worst = max(worst, float((got - _eager_logits(eng, res, prompts, step)).abs().max()))
        assert worst < 0.02, f"forward_static differs from forward by {worst}"


def test_auto_takes_the_graph_only_for_families_checked_on_a_gpu(tiny_ckpt, dsa_ckpt, glm5_ckpt, dsv3_ckpt,
                                                                 monkeypatch):
    """Where the graphed step could run, --decode-path auto takes it for a family whose capture has been
    checked on a GPU (glm4_moe, the two GLM-5 families, deepseek_v3) and keeps the host path for one that has not
    (GLM-5 made unchecked); graph asked for explicitly runs either way."""
    import rocket_mpi.runtime.engine as engine_mod
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.model.glm_moe_dsa import GlmMoeDsaModel
    monkeypatch.setattr(engine_mod, "unsupported", lambda *a, **k: "")   # as on a GPU with the extension
    for ckpt in (tiny_ckpt, dsa_ckpt, glm5_ckpt, dsv3_ckpt):
        assert Engine(ckpt).set_decode_path("auto", "local") == "graph"
    monkeypatch.setattr(GlmMoeDsaModel, "GRAPH_CHECKED", False)     # a family not yet checked
    assert Engine(dsa_ckpt).set_decode_path("auto", "local") == "host"
    assert Engine(dsa_ckpt).set_decode_path("graph", "local") == "graph"


@pytest.mark.parametrize("spans", ["auto", "4"])
@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "tiny_nvfp4_ckpt", "dsa_ckpt", "glm5_ckpt", "dsv3_ckpt"])
def test_cpu_device_path_matches_host_path(ckpt_name, spans, request, monkeypatch):
    """The fixed-shape step on a CPU (graph.py's reference mode: device plan by its reference, the block by
    ExpertStore.compute over the rows the plan gives, slot-space scatter) decodes the host path's tokens; with
    ROCKET_GRAPH_SPANS=4 it crosses spans 16 -> 32 mid-run, taking them where the rule says."""
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.runtime.prompts import default_prompts
    torch.set_num_threads(1)
    monkeypatch.setenv("ROCKET_GRAPH_SPANS", spans)
    ckpt = request.getfixturevalue(ckpt_name)
    out, n = {}, 8
    for path in ("host", "device"):
        eng = Engine(ckpt)
        assert eng.set_decode_path(path, "local") == path
        prompts = default_prompts(8, eng.cfg.vocab_size)
        r = eng.generate(prompts, n)
        assert r.path == path
        out[path] = r.tokens
    longest = max(len(p) for p in prompts)
    cap = -(-(longest + n) // 64) * 64  # Engine.generate: positions rounded up to a multiple of 64
    want = []  # (first step, span): at step s the longest stream's new token goes to position longest + s - 1
    for step in range(1, n):
        span = 4 if spans == "4" else 256
        while span < longest + step:
            span *= 2
        if not want or want[-1][1] != min(span, cap):
            want.append((step, min(span, cap)))
    assert r.spans == want and (spans == "auto" or len(want) == 2), (r.spans, want)
    assert out["device"] == out["host"]


def _ahead_runs(ckpt, path, streams, n, monkeypatch, device="cpu", reader=None):
    """generate() with 0, 1, 2 steps launched ahead (Engine.steps_ahead) -> per setting (tokens, per-step counters, spans, logits) and
    the steps in flight each launch found (GraphStep.launch wrapped)."""
    import rocket_mpi.runtime.graph as graph
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.runtime.prompts import default_prompts
    seen: list[int] = []
    real = graph.GraphStep.launch

    def launch(self, step, longest):
        seen.append(len(self.pending))
        return real(self, step, longest)

    monkeypatch.setattr(graph.GraphStep, "launch", launch)
    runs, in_flight = {}, {}
    for ahead in ("0", "1", "2"):
        eng = Engine(ckpt, reader=reader(ckpt) if reader else None, device=device)
        eng.steps_ahead = int(ahead)
        assert eng.set_decode_path(path, "local") == path
        logits: list[torch.Tensor] = []
        seen.clear()
        r = eng.generate(default_prompts(streams, eng.cfg.vocab_size), n,
                         on_step=lambda step, lg: logits.append(lg.cpu().view(torch.int32)))
        assert r.path == path and not r.note, r.note
        runs[ahead] = (r.tokens, [(s.row_crc, s.rows_owned, s.weight_bytes) for s in r.steps], r.spans,
                       torch.stack(logits))
        in_flight[ahead] = list(seen)
    return runs, in_flight


@pytest.mark.parametrize("ckpt_name", ["tiny_nvfp4_ckpt", "glm5_ckpt"])
def test_steps_launched_ahead_change_nothing_cpu(ckpt_name, request, monkeypatch):
    """1 or 2 steps launched ahead (the host launches the next steps before reading one back) decodes the same tokens,
    counters and logits as 0, in the CPU reference mode of the fixed-shape step; the spans cross mid-run
    (ROCKET_GRAPH_SPANS=4), where no step may be in flight, and steps are launched ahead elsewhere."""
    torch.set_num_threads(1)
    monkeypatch.setenv("ROCKET_GRAPH_SPANS", "4")
    runs, in_flight = _ahead_runs(request.getfixturevalue(ckpt_name), "device", 8, 9, monkeypatch)
    assert runs["1"][2] == runs["0"][2] and len(runs["0"][2]) == 2, runs["0"][2]
    for ahead in ("1", "2"):
        assert runs[ahead][:3] == runs["0"][:3]
        assert torch.equal(runs[ahead][3], runs["0"][3])
    assert max(in_flight["0"]) == 0 and max(in_flight["1"]) == 1 and max(in_flight["2"]) == 2, in_flight
    # a new span starts with nothing in flight
    first_steps = [s for s, _ in runs["0"][2]]
    assert all(in_flight[a][s - 1] == 0 for a in ("1", "2") for s in first_steps), (in_flight, first_steps)


def _check_switch(monkeypatch, name, read, values: dict, bad: tuple):
    """read() under each of `values` (None: unset) gives its value; each of `bad` is one error naming it."""
    from rocket_mpi.errors import RocketError
    for v, want in values.items():
        if v is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, v)
        assert read() == want, (name, v)
    for b in bad:
        monkeypatch.setenv(name, b)
        with pytest.raises(RocketError, match=f"{name}={b!r}"):
            read()


def test_graph_spans_rule_and_switch(monkeypatch):
    import rocket_mpi.runtime.graph as graph
    from rocket_mpi.errors import RocketError
    assert [graph.span_for(n, 1000, 256) for n in (0, 255, 256, 511, 512, 999)] == [256, 256, 512, 512, 1000, 1000]
    assert graph.span_for(3, 4, 4) == 4 and graph.span_for(4, 9, 4) == 8
    with pytest.raises(RocketError, match="position 9 past the cache's 9 positions"):
        graph.span_for(9, 9, 4)
    from rocket_mpi.settings import SPAN_MIN, Settings
    assert SPAN_MIN == 256
    _check_switch(monkeypatch, "ROCKET_GRAPH_SPANS", lambda: Settings.from_env().graph_span_min,
                  {None: 256, "": 256, "12": 12}, ("0", "-4", "pow2", "capacity"))


def _eager_logits(eng, res, prompts, step):
    """Logits of decode step `step` from a fresh eager run fed the same tokens."""
    model = eng.model
    cache = model.new_cache(len(prompts), max(len(p) for p in prompts) + step + 1)
    tokens = torch.tensor([t for p in prompts for t in p])
    seqlens = [len(p) for p in prompts]
    for s in range(step + 1):
        logits = model.forward(tokens, cache, seqlens, eng.moe)
        tokens, seqlens = torch.tensor([toks[s] for toks in res.tokens]), [1] * len(prompts)
    return logits


@gpu
@pytest.mark.parametrize("streams,preset,spans", [(1, "default", "auto"), (8, "default", "auto"),
                                                  (8, "dsa-tiny", "auto"), (8, "glm5-tiny", "auto"),
                                                  (1, "default", "4"), (8, "default", "4"), (8, "dsa-tiny", "4"),
                                                  (8, "glm5-tiny", "4"), (8, "dsv3-tiny", "auto"),
                                                  (8, "dsv3-tiny", "4")])
def test_gpu_graph_decode_equals_eager_device_step(streams, preset, spans, monkeypatch):
    """The captured step replays exactly what the same step computes when launched eagerly (dsa-tiny:
    GLM-5's architecture, MLA + DSA indexer; glm5-tiny: GLM-5.3-Flash's, KDA + MLA; dsv3-tiny: DeepSeek-V3's, MLA
    without the indexer, YaRN); with ROCKET_GRAPH_SPANS=4 the run crosses spans, each captured anew."""
    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.runtime.prompts import default_prompts
    monkeypatch.setenv("ROCKET_GRAPH_SPANS", spans)
    runs = {}
    ckpt = f"preset:{preset}:nvfp4"
    for path in ("device", "graph"):
        reader = SyntheticReader(ckpt, "cuda")
        eng = Engine(ckpt, reader=reader, device="cuda")
        assert eng.set_decode_path(path, "local") == path
        prompts = default_prompts(streams, eng.cfg.vocab_size)
        r = eng.generate(prompts, 10)
        assert r.path == path and not r.note, r.note
        assert len(r.spans) == (1 if spans == "auto" else 2 if streams == 8 else 3), r.spans
        runs[path] = (r.tokens, [s.row_crc for s in r.steps])
    assert runs["graph"] == runs["device"]


@gpu
@pytest.mark.parametrize("streams,preset", [(1, "default"), (8, "default"), (8, "glm5-tiny")])
def test_gpu_graph_steps_launched_ahead_change_nothing(streams, preset, monkeypatch):
    """Replays launched ahead of the host's reads (1 or 2 steps) decode the same tokens, counters and
    logits (bit for bit) as one step at a time, across a span change (ROCKET_GRAPH_SPANS=4)."""
    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    monkeypatch.setenv("ROCKET_GRAPH_SPANS", "4")
    runs, in_flight = _ahead_runs(f"preset:{preset}:nvfp4", "graph", streams, 12, monkeypatch, "cuda",
                                  lambda c: SyntheticReader(c, "cuda"))
    for ahead in ("1", "2"):
        assert runs[ahead][:3] == runs["0"][:3]
        assert torch.equal(runs[ahead][3], runs["0"][3])
    assert max(in_flight["0"]) == 0 and max(in_flight["2"]) == 2, in_flight


def _held_runs(preset: str, base: str, mode: str, check):
    """preset:{preset}:{base} loaded (for its stack bytes), then :{mode} decoded on the eager device step and on the
    graph; check(engine, mode) on each engine. -> ({mode: stack bytes read}, {path: (tokens, row checksums)})."""
    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.runtime.prompts import default_prompts
    runs, stack = {}, {}
    for m, path in ((base, None), (mode, "device"), (mode, "graph")):
        ckpt = f"preset:{preset}:{m}"
        eng = Engine(ckpt, reader=SyntheticReader(ckpt, "cuda"), device="cuda")
        stack[m] = eng.stack_read_bytes()
        check(eng, m)
        if path is None:
            continue
        assert eng.set_decode_path(path, "local") == path
        r = eng.generate(default_prompts(8, eng.cfg.vocab_size), 10)
        assert r.path == path and not r.note, r.note
        runs[path] = (r.tokens, [s.row_crc for s in r.steps])
    return stack, runs


@gpu
@pytest.mark.parametrize("preset", ["default", "dsa-tiny", "glm5-tiny"])
def test_gpu_graph_decode_nvfp4_all_equals_eager_device_step(preset):
    """`:nvfp4-all`: the stack held as stored on the GPU (NVFP4 attention projections, dense MLPs and shared experts
    in the expert kernel's NVFP4 tiles, their dense copies released) in the captured step: the graph replays the
    eager step's tokens and row checksums, and the report's stack bytes are the packed ones (fewer than :nvfp4's,
    whose stack is BF16)."""
    def check(eng, mode):
        attn = next(L.attn if hasattr(L, "attn") else L.mla for L in eng.model.layers   # GLM-5.3-Flash: its first
                    if getattr(L, "attn", None) is not None or getattr(L, "mla", None) is not None)  # MLA layer
        assert all(getattr(attn, k) is None for k in attn.stored) and bool(attn.stored) == (mode == "nvfp4-all")

    stack, runs = _held_runs(preset, "nvfp4", "nvfp4-all", check)
    assert runs["graph"] == runs["device"]
    assert stack["nvfp4-all"] < stack["nvfp4"], stack


@gpu
@pytest.mark.parametrize("preset", ["default", "dsa-tiny", "glm5-tiny"])
def test_gpu_graph_decode_nvfp4_head_equals_eager_device_step(preset):
    """`:nvfp4-head`: the lm_head NVFP4 too, held as stored (its packed copy alone, the dense head released): the
    graph replays the eager step's tokens and row checksums, and the stack reads fewer bytes than `:nvfp4-all`'s."""
    def check(eng, mode):
        assert (eng.model.lm_head is None) == (mode == "nvfp4-head")

    stack, runs = _held_runs(preset, "nvfp4-all", "nvfp4-head", check)
    assert runs["graph"] == runs["device"]
    assert stack["nvfp4-head"] < stack["nvfp4-all"], stack


@gpu
@pytest.mark.parametrize("streams", [8])
def test_gpu_graph_decode_bf16_equals_eager_device_step(streams):
    """BF16 experts, in the expert kernel's BF16 tiles: the graphed step decodes the eager step's tokens."""
    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.runtime.prompts import default_prompts
    runs = {}
    for path in ("device", "graph"):
        eng = Engine("preset:default", reader=SyntheticReader("preset:default", "cuda"), device="cuda")
        packed = [st.packed is not None for st in eng.experts.values() if st.owned]
        assert packed and all(packed)
        assert eng.set_decode_path(path, "local") == path
        r = eng.generate(default_prompts(streams, eng.cfg.vocab_size), 10)
        assert r.path == path and not r.note, r.note
        runs[path] = (r.tokens, [s.row_crc for s in r.steps])
    assert runs["graph"] == runs["device"]
