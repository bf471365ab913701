"""The device decode path (rocket_mpi/graph.py): the device row plan, the fixed-shape decode step, the
cuda-ipc push/wait kernels and the CUDA graph.

CPU tests (always run):
  - the plan's reference (kernels/plan.py) against the host plan: rows placed in slot space and
    scattered through its by_token give the host plan's scatter bit for bit; each rank's padded rows
    and weight passes cover exactly its block; sets alternate with seq;
  - glm4_moe forward_static (attends over the whole cache capacity) against forward, teacher-forced;
  - the fixed-shape step's spans (graph.span_for, ROCKET_GRAPH_SPANS): the rule, and a run crossing spans.
GPU tests (skip, saying why, without a GPU or the extension):
  - the router kernels (router_logits, moe_route) against moe/router.py: logits within 2^-20 and
    row-invariant, the same experts chosen from the same logits (with and without group limits), weights
    within 2^-18 (the sum order of up to 32 picks), ties to the lower id;
  - moe_scatter_add's row checksum equal to engine.row_sum over the rows in canonical order;
  - moe_plan (the kernel) bitwise equal to its reference, 1 to 3 ranks, one or two sets;
  - nvfp4_experts_into through the device plan bitwise equal to nvfp4_experts through the host plan;
  - ipc_push / ipc_wait / ipc_exchange in one process (two buffers stand for two ranks), and the wait's
    timeout record;
  - a graphed decode gives the same tokens and row checksums as the same step run eagerly.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rocket_mpi import kernels
from rocket_mpi.kernels import plan as kplan
from rocket_mpi.moe.rows import plan_rows
from rocket_mpi.moe.scatter import moe_scatter_add


def random_routing(tokens, topk, n_exp, seed):
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, generator=gen)
    return experts, weights


def placement(n_exp, ranks, scrambled, seed):
    owner = torch.arange(n_exp) * ranks // n_exp
    if scrambled:
        owner = owner[torch.randperm(n_exp, generator=torch.Generator().manual_seed(seed))]
    return owner


CASES = [(1, 8, 16, 1, False), (5, 4, 16, 2, False), (8, 8, 32, 3, True), (3, 2, 16, 2, True), (16, 8, 64, 3, False)]


@pytest.mark.parametrize("tokens,topk,n_exp,ranks,scrambled", CASES)
def test_plan_reference_matches_host_plan(tokens, topk, n_exp, ranks, scrambled):
    experts, weights = random_routing(tokens, topk, n_exp, seed=tokens)
    owner = placement(n_exp, ranks, scrambled, seed=7)
    s2 = torch.rand(n_exp) + 0.5
    host = plan_rows(experts, weights, owner, s2, ranks)
    cap, h = tokens * topk, 24
    canon_rows = torch.randn(host.rows, h).to(torch.bfloat16)
    want = moe_scatter_add(canon_rows, host.by_token, host.coef)
    for n_sets in (1, 2):
        stride = ranks * cap + 3                          # a set need not be packed tight
        for seq in (4, 5):
            for rank in range(ranks):
                mine = {e: i for i, e in enumerate(e for e in range(n_exp) if int(owner[e]) == rank)}
                ref = kplan.moe_plan_ref(experts, weights, owner, mine, s2, rank, ranks, n_sets, stride, seq)
                set_ = (seq + 1) % n_sets if n_sets > 1 else 0
                assert int(ref["meta"][kplan.META_SEQ]) == seq + 1 and int(ref["meta"][kplan.META_SET]) == set_
                assert ref["canon_slot"].min() >= set_ * stride and ref["canon_slot"].max() < (set_ + 1) * stride
                buf = torch.full((n_sets * stride, h), float("nan")).to(torch.bfloat16)  # unused rows poison
                buf[ref["canon_slot"]] = canon_rows
                got = moe_scatter_add(buf, ref["by_token"], ref["coef"])
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))
                lo, hi = host.block(rank)
                meta = ref["meta"].tolist()
                assert meta[kplan.META_ROWS] == hi - lo
                assert meta[kplan.META_HEAD:] == [host.offsets[r + 1] - host.offsets[r] for r in range(ranks)]
                pad = ref["pad_rows"]
                used = sorted(int(p) for p in pad if p >= 0)
                assert used == list(range(hi - lo))          # every block row once, nothing else
                assert torch.equal(ref["row_index"][:hi - lo], host.tokens[lo:hi])
                # every weight pass runs an expert of this rank over its rows only
                inv = {s: e for e, s in mine.items()}
                for slot, tile0, ntiles, _ in ref["groups"].tolist():
                    if ntiles == 0:
                        continue
                    e = inv[slot]
                    rows = [int(p) for p in pad[tile0 * 8:(tile0 + ntiles) * 8] if p >= 0]
                    assert rows and all(int(host.experts[lo + r]) == e for r in rows)
                assert meta[kplan.META_EXPERTS] == sum(1 for _, a, b in host.segments[rank] if b > a)


def test_prefill_blocks_cover_the_rows(monkeypatch):
    from rocket_mpi.model import layers
    assert layers.prefill_blocks(0) == [] and layers.prefill_blocks(5) == [(0, 5)]
    monkeypatch.setattr(layers, "PREFILL_ROWS", 4)
    assert layers.prefill_blocks(10) == [(0, 4), (4, 8), (8, 10)] and layers.prefill_blocks(8) == [(0, 4), (4, 8)]
    monkeypatch.setattr(layers, "PREFILL_ROWS", 512)
    # fewer rows where a block's scores would pass PREFILL_SCORES, never fewer than PREFILL_MIN_ROWS
    assert layers.prefill_blocks(1000, 96 * 1000) == [(0, 512), (512, 1000)]               # 96 heads, 1000 keys
    assert layers.prefill_blocks(400, 96 * 16384) == [(0, 170), (170, 340), (340, 400)]   # 16384 keys: 170 rows
    assert layers.prefill_blocks(100, 96 * 2 ** 20)[:2] == [(0, 16), (16, 32)]            # 1M keys: the floor
    assert layers.prefill_blocks(100, 96 * 1000) == [(0, 100)]


def _cache_tensors(c) -> list[torch.Tensor]:
    """Every state tensor of a model's cache (KVCache, LatentCache, Glm5NextCache)."""
    if hasattr(c, "mla"):
        return list(c.conv.values()) + list(c.rec.values()) + [t for m in c.mla.values() for t in m.tensors()]
    if hasattr(c, "kv"):
        return c.kv + [t for t in c.index_k if t is not None]
    return c.k + c.v


@pytest.mark.parametrize("cut", ["rows", "scores"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", id="gpu", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason=f"the GPU form needs a CUDA device (torch {torch.__version__})"))])
@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "dsa_ckpt", "glm5_ckpt"])
def test_prefill_in_row_blocks_matches_one_block(ckpt_name, device, cut, request, monkeypatch):
    """A prefill in blocks of 4 query rows (layers.PREFILL_ROWS; 512 in use) against the same prefill in one block:
    prompts of 13, 7 and 22 tokens after the streams already hold 1, 5 and 1 positions; logits within 2^-8 of their
    scale (a bf16 rounding: the CPU gives the same bits for glm4_moe and GLM-5.3-Flash, one ulp for GLM-5, whose
    top-k runs over a block's width), the same next tokens, every cache state within 2^-7 of its scale (GLM-5's
    indexer keys, GLM-5.3-Flash's pools and KDA states too). Planted by hand, each fails it: glm4_moe's blocks all
    taking the first block's queries (logits off by 2^-6, states by 2^-5.7), GLM-5.3-Flash's selection taking the
    first block's positions (2^-6), GLM-5's blocks seeing one key too many (a shape error). On a GPU (gpu) the
    same bounds, with the extension's kernels where the engine takes them. cut=scores: the blocks' rows set by
    PREFILL_SCORES (heads x rows x keys) instead."""
    from rocket_mpi.engine import Engine
    from rocket_mpi.model import layers
    torch.set_num_threads(1)
    eng = Engine(request.getfixturevalue(ckpt_name), device=device)
    gen = torch.Generator().manual_seed(7)
    first = [torch.randint(2, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 5, 1)]
    prompts = [torch.randint(2, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (13, 7, 22)]

    def prefill():
        with torch.inference_mode():
            cache = eng.model.new_cache(3, 40)
            for ps in (first, prompts):
                logits = eng.model.forward(torch.tensor([t for p in ps for t in p], device=eng.device), cache,
                                           [len(p) for p in ps], eng.moe)
            return logits, _cache_tensors(cache)

    want, states_w = prefill()
    if cut == "rows":
        monkeypatch.setattr(layers, "PREFILL_ROWS", 4)
    else:  # blocks cut by their scores' size (a long context's rule): 1-7 rows here, by layer and stream
        monkeypatch.setattr(layers, "PREFILL_MIN_ROWS", 1)
        monkeypatch.setattr(layers, "PREFILL_SCORES", 400)
    got, states_g = prefill()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    err = float((got - want).abs().max())
    assert err <= 2.0 ** -8 * float(want.abs().max()), f"max |diff| {err:.3e} of {float(want.abs().max()):.3e}"
    assert len(states_w) == len(states_g) > 0
    for a, b in zip(states_w, states_g):
        scale = max(float(a.float().abs().max()), 1.0)
        assert float((a.float() - b.float()).abs().max()) <= 2.0 ** -7 * scale


def test_prefill_chunks_cut_the_packed_prompts():
    from rocket_mpi.engine import prefill_chunks
    assert prefill_chunks([3, 5, 2], 4) == [[3, 1, 0], [0, 4, 0], [0, 0, 2]]
    assert prefill_chunks([10], 4) == [[4], [4], [2]] and prefill_chunks([1, 1, 1], 8) == [[1, 1, 1]]
    assert prefill_chunks([4, 4], 4) == [[4, 0], [0, 4]]
    for lens, c in (([7, 1, 12, 3], 5), ([1] * 9, 2), ([30], 7)):
        chunks = prefill_chunks(lens, c)
        assert [sum(col) for col in zip(*chunks)] == lens and all(0 < sum(ch) <= c for ch in chunks)
        assert len(chunks) == -(-sum(lens) // c)
    with pytest.raises(ValueError, match="at least 1"):
        prefill_chunks([3], 0)


@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "dsa_ckpt", "glm5_ckpt"])
def test_chunked_prefill_matches_one_forward(ckpt_name, request, monkeypatch):
    """Engine._forward with prefill_chunk 9 on prompts of 13, 4 and 22 tokens (after 1, 5 and 1 positions held):
    5 forwards, each stream's logits from the chunk where its prompt ends, within 2^-7 of one forward's (a bf16
    rounding: GEMMs of other shapes), the same next tokens, every cache state within 2^-6 of its scale. Logits
    taken from the last chunk for every stream (a planted bug) are off by far more than that."""
    from rocket_mpi.engine import Engine
    torch.set_num_threads(1)
    eng = Engine(request.getfixturevalue(ckpt_name))
    gen = torch.Generator().manual_seed(9)
    first = [torch.randint(2, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 5, 1)]
    prompts = [torch.randint(2, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (13, 4, 22)]
    calls = []
    forward = eng.model.forward
    monkeypatch.setattr(eng.model, "forward", lambda *a: calls.append(a[2]) or forward(*a))

    def prefill(chunk):
        eng.prefill_chunk = chunk
        with torch.inference_mode():
            cache = eng.model.new_cache(3, 48)
            for ps in (first, prompts):
                logits = eng._forward(torch.tensor([t for p in ps for t in p]), cache, [len(p) for p in ps])[0]
            return logits, _cache_tensors(cache)

    want, states_w = prefill(4096)
    assert len(calls) == 2
    got, states_g = prefill(9)
    assert len(calls) == 2 + 1 + 5 and calls[3:] == [[9, 0, 0], [4, 4, 1], [0, 0, 9], [0, 0, 9], [0, 0, 3]]
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    err = float((got - want).abs().max())
    assert err <= 2.0 ** -7 * float(want.abs().max()), f"max |diff| {err:.3e} of {float(want.abs().max()):.3e}"
    for a, b in zip(states_w, states_g):
        scale = max(float(a.float().abs().max()), 1.0)
        assert float((a.float() - b.float()).abs().max()) <= 2.0 ** -6 * scale


@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "dsa_ckpt", "glm5_ckpt"])
def test_forward_static_matches_forward(ckpt_name, request):
    """The fixed-shape step (whole-capacity attention, device positions; for glm_moe_dsa and glm5_next the
    indexer over the whole capacity) against the eager step, with the same tokens fed to both: logits
    agree to rounding."""
    from rocket_mpi.engine import Engine
    from rocket_mpi.prompts import default_prompts
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


def test_auto_takes_the_graph_only_for_families_checked_on_a_gpu(tiny_ckpt, dsa_ckpt, glm5_ckpt, monkeypatch):
    """Where the graphed step could run, --decode-path auto takes it for a family whose capture has been
    checked on a GPU (all three now: glm4_moe since session 7, the GLM-5 families since session 10) and
    keeps the host path for one that has not; graph asked for explicitly runs either way."""
    import rocket_mpi.graph as graph
    from rocket_mpi.engine import Engine
    from rocket_mpi.model.glm_moe_dsa import GlmMoeDsaModel
    monkeypatch.setattr(graph, "unsupported", lambda *a, **k: "")   # as on a GPU with the extension
    for ckpt in (tiny_ckpt, dsa_ckpt, glm5_ckpt):
        assert Engine(ckpt).set_decode_path("auto", "local") == "graph"
    monkeypatch.setattr(GlmMoeDsaModel, "GRAPH_CHECKED", False)     # a family not yet checked
    assert Engine(dsa_ckpt).set_decode_path("auto", "local") == "host"
    assert Engine(dsa_ckpt).set_decode_path("graph", "local") == "graph"


def test_plan_limits_match_the_kernels():
    """kernels/plan.py's limits are the ones csrc/rocket.h compiles in."""
    import re
    src = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "rocket.h")).read()
    c = {k: int(v) for k, v in re.findall(r"constexpr int (k\w+) = (\d+);", src)}
    assert (c["kPlanMaxExperts"], c["kRouteMaxExperts"]) == (kplan.PLAN_MAX_EXPERTS,) * 2
    assert (c["kPlanMaxRows"], c["kPlanMaxRanks"], c["kPlanMaxTopk"]) == (kplan.PLAN_MAX_ROWS, kplan.PLAN_MAX_RANKS,
                                                                           kplan.PLAN_MAX_TOPK)
    assert c["kDecodeAttentionMaxSpan"] == kernels.DECODE_ATTENTION_MAX_SPAN
    assert c["kDecodeAttentionMaxStreams"] == kernels.DECODE_ATTENTION_MAX_STREAMS


def test_model_and_stream_limits_of_the_fixed_shape_step(tiny_ckpt, monkeypatch):
    """A model or a step the device kernels cannot take is refused up front with the limit named (auto
    stays on the host path), never a kernel launch error mid-run."""
    import rocket_mpi.graph as graph
    from types import SimpleNamespace
    from rocket_mpi.engine import Engine
    from rocket_mpi.errors import RocketError
    from rocket_mpi.prompts import default_prompts
    cfg = SimpleNamespace(n_routed_experts=2048, num_experts_per_tok=8, n_group=1)
    assert "2048 routed experts" in kplan.model_limit(cfg, 2)
    assert "top-40" in kplan.model_limit(SimpleNamespace(n_routed_experts=256, num_experts_per_tok=40, n_group=1), 2)
    assert "65 ranks" in kplan.model_limit(SimpleNamespace(n_routed_experts=256, num_experts_per_tok=8, n_group=1), 65)
    assert kplan.model_limit(SimpleNamespace(n_routed_experts=256, num_experts_per_tok=8, n_group=8), 64) == ""
    assert "at most 256 streams" in kplan.stream_limit(257, SimpleNamespace(num_experts_per_tok=8))
    assert kplan.stream_limit(256, SimpleNamespace(num_experts_per_tok=8)) == ""

    torch.set_num_threads(1)
    eng = Engine(tiny_ckpt)
    k = eng.cfg.num_experts_per_tok
    monkeypatch.setattr(kplan, "PLAN_MAX_ROWS", 2 * k)   # 3 streams: over
    assert eng.set_decode_path("device", "local") == "device"
    with pytest.raises(RocketError, match=f"3 streams x top-{k} = {3 * k} rows .*at most 2 streams"):
        eng.generate(default_prompts(3, eng.cfg.vocab_size), 3)
    assert eng.generate(default_prompts(2, eng.cfg.vocab_size), 3).path == "device"
    monkeypatch.setattr(graph, "unsupported", lambda *a, **k: "")  # as on a GPU: auto takes the graph...
    eng = Engine(tiny_ckpt)
    assert eng.set_decode_path("auto", "local") == "graph"
    assert eng.generate(default_prompts(3, eng.cfg.vocab_size), 3).path == "host"  # ...but not for this step


@pytest.mark.parametrize("spans", ["auto", "4"])
@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "tiny_nvfp4_ckpt", "dsa_ckpt", "glm5_ckpt"])
def test_cpu_device_path_matches_host_path(ckpt_name, spans, request, monkeypatch):
    """The fixed-shape step on a CPU (graph.py's reference mode: device plan by its reference, the block by
    ExpertStore.compute over the rows the plan gives, slot-space scatter) decodes the host path's tokens; with
    ROCKET_GRAPH_SPANS=4 it crosses spans 16 -> 32 mid-run, taking them where the rule says."""
    from rocket_mpi.engine import Engine
    from rocket_mpi.prompts import default_prompts
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
    """generate() under ROCKET_STEPS_AHEAD = 0, 1, 2 -> per setting (tokens, per-step counters, spans, logits) and
    the steps in flight each launch found (GraphStep.launch wrapped)."""
    import rocket_mpi.graph as graph
    from rocket_mpi.engine import Engine
    from rocket_mpi.prompts import default_prompts
    seen: list[int] = []
    real = graph.GraphStep.launch

    def launch(self, step, longest):
        seen.append(len(self.pending))
        return real(self, step, longest)

    monkeypatch.setattr(graph.GraphStep, "launch", launch)
    runs, in_flight = {}, {}
    for ahead in ("0", "1", "2"):
        monkeypatch.setenv("ROCKET_STEPS_AHEAD", ahead)
        eng = Engine(ckpt, reader=reader(ckpt) if reader else None, device=device)
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
    """ROCKET_STEPS_AHEAD=1 / 2 (the host launches the next steps before reading one back) decodes the same tokens,
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


def test_steps_ahead_switch(monkeypatch):
    import rocket_mpi.graph as graph
    _check_switch(monkeypatch, "ROCKET_STEPS_AHEAD", graph.steps_ahead, {None: 1, "0": 0, "2": 2},
                  ("3", "-1", "yes", ""))


def test_graph_spans_rule_and_switch(monkeypatch):
    import rocket_mpi.graph as graph
    from rocket_mpi.errors import RocketError
    assert [graph.span_for(n, 1000, 256) for n in (0, 255, 256, 511, 512, 999)] == [256, 256, 512, 512, 1000, 1000]
    assert graph.span_for(5, 4096, 0) == 4096 and graph.span_for(3, 4, 4) == 4 and graph.span_for(4, 9, 4) == 8
    with pytest.raises(RocketError, match="position 9 past the cache's 9 positions"):
        graph.span_for(9, 9, 4)
    assert graph.SPAN_MIN == 256
    _check_switch(monkeypatch, "ROCKET_GRAPH_SPANS", graph.span_switch, {None: 256, "capacity": 0, "12": 12},
                  ("0", "-4", "pow2", ""))


def test_step_fuse_knob_bad_value_is_one_error(monkeypatch):
    import rocket_mpi.graph as graph
    from rocket_mpi.errors import RocketError
    monkeypatch.setenv("ROCKET_STEP_FUSE", "yes")
    with pytest.raises(RocketError, match="ROCKET_STEP_FUSE='yes'"):
        graph.step_fused("cpu")
    monkeypatch.setenv("ROCKET_STEP_FUSE", "1")
    assert graph.step_fused("cpu") is False   # fused glue kernels are GPU kernels


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


# ----------------------------------------------------------------------------------------------------
# GPU

def _skip_reason():
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__})"
    if not kernels.available():
        return kernels.unavailable_reason()
    return None


_SKIP = _skip_reason()
if _SKIP:
    print(f"\n[test_device_plan] GPU tests skipped: {_SKIP}")
gpu = pytest.mark.skipif(_SKIP is not None, reason=f"GPU tests need a CUDA device and the extension: {_SKIP}")


@gpu
@pytest.mark.parametrize("tokens,topk,n_exp,ranks,scrambled", CASES + [(64, 8, 288, 2, False), (1, 8, 288, 3, True)])
def test_gpu_moe_plan_matches_reference(tokens, topk, n_exp, ranks, scrambled):
    dev = torch.device("cuda")
    experts, weights = random_routing(tokens, topk, n_exp, seed=tokens + 1)
    owner = placement(n_exp, ranks, scrambled, seed=3)
    s2 = torch.rand(n_exp) + 0.5
    canon = kplan.canonical_experts(owner).to(dev)
    for n_sets, stride in ((1, ranks * tokens * topk), (2, ranks * tokens * topk + 5)):
        for rank in range(ranks):
            mine = {e: i for i, e in enumerate(e for e in range(n_exp) if int(owner[e]) == rank)}
            seq = torch.tensor([11], device=dev)
            got = kplan.moe_plan(experts.to(dev), weights.to(dev), owner.to(dev, torch.int32),
                                 kplan.slot_table(n_exp, mine).to(dev), canon, s2.to(dev), rank, ranks, n_sets,
                                 stride, seq)
            ref = kplan.moe_plan_ref(experts, weights, owner, mine, s2, rank, ranks, n_sets, stride, 11)
            assert int(seq) == 12
            for k in kplan.PLAN_KEYS:
                g, r = got[k].cpu(), ref[k]
                assert g.dtype == r.dtype and torch.equal(g.view(-1), r.view(-1)), f"{k} (rank {rank}, sets {n_sets})"


def _packed_random(n_exp, hidden, inter, dev):
    from test_kernels import make_experts
    return kernels.pack_experts(make_experts(range(n_exp), hidden, inter, seed=5), hidden, inter, device=dev)


@gpu
@pytest.mark.parametrize("tokens", [1, 8, 40])
def test_gpu_experts_into_matches_host_plan(tokens):
    dev = torch.device("cuda")
    n_exp, hidden, inter, topk = 12, 256, 192, 4
    packed = _packed_random(n_exp, hidden, inter, dev)
    experts, weights = random_routing(tokens, topk, n_exp, seed=9)
    owner = torch.zeros(n_exp, dtype=torch.long)
    x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    host = plan_rows(experts, weights, owner, torch.ones(n_exp), 1)
    want = kernels.nvfp4_experts(x, host.segments[0], packed, 0, host.tokens, 0.5)
    p = kplan.moe_plan(experts.to(dev), weights.to(dev), owner.to(dev, torch.int32),
                       kplan.slot_table(n_exp, packed.slot).to(dev), kplan.canonical_experts(owner).to(dev),
                       torch.ones(n_exp, device=dev), 0, 1, 1, tokens * topk, torch.zeros(1, dtype=torch.long,
                                                                                           device=dev))
    out = torch.full((tokens * topk, hidden), float("nan"), device=dev).to(torch.bfloat16)
    kernels._ext.require().nvfp4_experts_into(x, p["row_index"], p["pad_rows"], p["groups"], out, packed.q_gu,
                                              packed.s_gu, packed.s2_gu, packed.q_dn, packed.s_dn, hidden, inter, 0.5)
    assert torch.equal(out[:host.rows].view(torch.int16), want.view(torch.int16))


@gpu
def test_gpu_launcher_check_raises_not_crashes():
    """A bad argument caught by the extension, in bindings.cpp or inside a launcher (csrc/*.cu), reaches
    Python as one RuntimeError naming the problem. Run in a child process so that a crash is reported as
    one: on the H200 image the first version died here (SIGSEGV in the message's ostringstream, see
    rocket.h)."""
    code = ("import torch\nfrom rocket_mpi.kernels import _ext\nC = _ext.require()\nd = torch.device('cuda')\n"
            "try:\n    C.rms_norm(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16), 1e-5)\n"
            "except RuntimeError as e:\n    print('RAISED1', e)\n"
            "n = 8\ntry:\n"
            "    C.moe_plan(torch.zeros(300, 8, dtype=torch.long, device=d), torch.ones(300, 8, device=d),\n"
            "               torch.zeros(n, dtype=torch.int32, device=d), torch.arange(n, dtype=torch.int32, device=d),\n"
            "               torch.arange(n, dtype=torch.int32, device=d), torch.ones(n, device=d), 0, 1, 1, 2400,\n"
            "               torch.zeros(1, dtype=torch.long, device=d))\n"
            "except RuntimeError as e:\n    print('RAISED2', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    why = f"rc {r.returncode}\nstdout {r.stdout[-2000:]}\nstderr {r.stderr[-2000:]}"
    assert r.returncode == 0, why
    assert "RAISED1" in r.stdout and "on a GPU" in r.stdout, why
    assert "RAISED2" in r.stdout and "2048" in r.stdout, why


@gpu
def test_gpu_ipc_push_and_wait_one_process():
    """Two row buffers of one GPU stand for two ranks: rank 0 pushes, rank 1's wait passes; a wait on a
    doorbell nobody rings records (1, peer, seq, layer) after its timeout instead of hanging."""
    dev = torch.device("cuda")
    C = kernels._ext.require()
    cap, h, ranks, stride = 6, 64, 2, 16
    bufs = [torch.zeros(2 * stride, h, dtype=torch.bfloat16, device=dev) for _ in range(ranks)]
    bells = [torch.zeros(ranks, dtype=torch.long, device=dev) for _ in range(ranks)]
    src = torch.randn(cap, h, device=dev).to(torch.bfloat16)
    meta = torch.tensor([0, 0, 4, 1, 7, 0, 4, 2], device=dev)   # 4 rows of rank 0, set 1, seq 7
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    C.ipc_push(src, meta, [b.data_ptr() for b in bufs], [bells[r].data_ptr() + 8 * 0 for r in range(ranks)],
               counter, cap, stride, 0, 8)
    err = torch.zeros(4, dtype=torch.long, device=dev)
    C.ipc_wait(bells[1], meta, err, 5.0, 1, 3)
    torch.cuda.synchronize()
    assert err.tolist() == [0, 0, 0, 0]
    assert bells[1].tolist() == [7, 0] and int(counter) == 0
    for b in bufs:
        assert torch.equal(b[stride:stride + 4], src[:4])
        assert not b[:stride].any() and not b[stride + 4:].any()
    C.ipc_wait(bells[0], meta, err, 0.05, 0, 5)                 # rank 1 never rang rank 0
    torch.cuda.synchronize()
    assert err.tolist() == [1, 1, 7, 5]

    # ipc_exchange: the same push with the wait in the same kernel. Rank 1 has rung rank 0 (seq 8): it
    # returns with the rows delivered; then a seq nobody rang: it records the timeout instead of hanging.
    err.zero_()
    for b in bufs:
        b.zero_()
    meta8 = meta.clone()
    meta8[4] = 8
    bells[0][1] = 8
    C.ipc_exchange(src, meta8, [b.data_ptr() for b in bufs], [bells[r].data_ptr() for r in range(ranks)], counter,
                   cap, stride, 0, 8, bells[0], err, 5.0, 2)
    torch.cuda.synchronize()
    assert err.tolist() == [0, 0, 0, 0] and int(counter) == 0 and bells[1].tolist() == [8, 0]
    for b in bufs:
        assert torch.equal(b[stride:stride + 4], src[:4])
    meta8[4] = 9
    C.ipc_exchange(src, meta8, [b.data_ptr() for b in bufs], [bells[r].data_ptr() for r in range(ranks)], counter,
                   cap, stride, 0, 8, bells[0], err, 0.05, 6)
    torch.cuda.synchronize()
    assert err.tolist() == [1, 1, 9, 6] and int(counter) == 0


@gpu
@pytest.mark.parametrize("blocks", [1, 3, 32])
def test_gpu_ipc_exchange_flags_one_process(blocks):
    """The graphed step's exchange (a flag word per sender and block): rank 0 of 3 stores its rows into
    every buffer and writes its flag words, block b's into word b, on ranks 1 and 2; it returns once ranks
    1 and 2 have written all of theirs for this seq, and records (1, peer, seq, layer) when one block's word
    is missing instead of hanging."""
    dev = torch.device("cuda")
    C = kernels._ext.require()
    cap, h, ranks, stride, nmax = 40, 64, 3, 128, 32
    bufs = [torch.zeros(2 * stride, h, dtype=torch.bfloat16, device=dev) for _ in range(ranks)]
    flags = [torch.zeros(ranks, nmax, dtype=torch.long, device=dev) for _ in range(ranks)]
    src = torch.randn(cap, h, device=dev).to(torch.bfloat16)
    meta = torch.tensor([0, 0, 37, 1, 11, 0, 37, 2, 1], device=dev)    # 37 rows of rank 0, set 1, seq 11
    err = torch.zeros(4, dtype=torch.long, device=dev)
    peer_flags = [flags[r][0].data_ptr() for r in range(ranks)]        # each rank's words for sender 0
    flags[0][1:, :blocks] = 11                                          # ranks 1 and 2 have sent seq 11
    C.ipc_exchange_flags(src, meta, [b.data_ptr() for b in bufs], peer_flags, cap, stride, 0, blocks, flags[0], err,
                         5.0, 4)
    torch.cuda.synchronize()
    assert err.tolist() == [0, 0, 0, 0]
    for r in range(ranks):
        assert torch.equal(bufs[r][stride:stride + 37], src[:37])
        assert not bufs[r][:stride].any() and not bufs[r][stride + 37:].any()
        if r:
            assert flags[r][0, :blocks].tolist() == [11] * blocks and not flags[r][0, blocks:].any()
            assert not flags[r][1:].any()
    assert not flags[0][0].any()                                        # no flags to ourselves
    meta[4] = 12
    flags[0][1:, :blocks] = 12
    flags[0][2, blocks - 1] = 11                                        # rank 2's last block has not arrived
    C.ipc_exchange_flags(src, meta, [b.data_ptr() for b in bufs], peer_flags, cap, stride, 0, blocks, flags[0], err,
                         0.05, 6)
    torch.cuda.synchronize()
    assert err.tolist() == [1, 2, 12, 6]
    with pytest.raises(RuntimeError, match="blocks 33"):
        C.ipc_exchange_flags(src, meta, [b.data_ptr() for b in bufs], peer_flags, cap, stride, 0, 33, flags[0], err,
                             0.05, 6)


@gpu
@pytest.mark.parametrize("streams,preset,spans", [(1, "default", "auto"), (8, "default", "auto"),
                                                  (8, "dsa-tiny", "auto"), (8, "glm5-tiny", "auto"),
                                                  (1, "default", "4"), (8, "default", "4"), (8, "dsa-tiny", "4"),
                                                  (8, "glm5-tiny", "4")])
def test_gpu_graph_decode_equals_eager_device_step(streams, preset, spans, monkeypatch):
    """The captured step replays exactly what the same step computes when launched eagerly (dsa-tiny:
    GLM-5's architecture, MLA + DSA indexer; glm5-tiny: GLM-5.3-Flash's, KDA + MLA); with ROCKET_GRAPH_SPANS=4
    the run crosses spans, each captured anew."""
    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.engine import Engine
    from rocket_mpi.prompts import default_prompts
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
    """Replays launched ahead of the host's reads (ROCKET_STEPS_AHEAD=1, 2) decode the same tokens, counters and
    logits (bit for bit) as one step at a time, across a span change (ROCKET_GRAPH_SPANS=4)."""
    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    monkeypatch.setenv("ROCKET_GRAPH_SPANS", "4")
    runs, in_flight = _ahead_runs(f"preset:{preset}:nvfp4", "graph", streams, 12, monkeypatch, "cuda",
                                  lambda c: SyntheticReader(c, "cuda"))
    for ahead in ("1", "2"):
        assert runs[ahead][:3] == runs["0"][:3]
        assert torch.equal(runs[ahead][3], runs["0"][3])
    assert max(in_flight["0"]) == 0 and max(in_flight["2"]) == 2, in_flight


@gpu
@pytest.mark.parametrize("rows,n", [(8, 4096), (64, 128), (5, 80), (96, 128), (3, 36), (2, 12288)])
def test_gpu_fused_rms_norm(rows, n):
    from rocket_mpi.model.layers import rms_norm
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, n, generator=gen) * 3).to(torch.bfloat16).cuda()
    w = (torch.rand(n, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    got, ref = kernels.rms_norm(x, w, 1e-5).float(), rms_norm(x, w, 1e-5).float()
    # only the fp32 sum's order differs: at most one bf16 rounding step apart, in each of the two roundings
    assert ((got - ref).abs() <= ref.abs() * 2.0 ** -6 + 1e-30).all(), float((got - ref).abs().max())


@gpu
@pytest.mark.parametrize("tokens,hq,hk,d,rot", [(8, 12, 2, 128, 64), (1, 4, 4, 64, 64), (3, 6, 1, 80, 40)])
def test_gpu_fused_rope_bitwise(tokens, hq, hk, d, rot):
    from rocket_mpi.model.layers import Rope
    rope = Rope(rot, 10000.0, torch.bfloat16)
    rope.inv_freq = rope.inv_freq.cuda()
    gen = torch.Generator().manual_seed(d)
    q = torch.randn(tokens, hq, d, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(tokens, hk, d, generator=gen).to(torch.bfloat16).cuda()
    cos, sin = rope.cos_sin(torch.tensor([5, 900, 17, 3, 0, 1, 2, 33][:tokens], device="cuda"))
    want_q, want_k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    kernels.rope_(q, k, cos, sin, rot)
    assert torch.equal(q.view(torch.int16), want_q.view(torch.int16))
    assert torch.equal(k.view(torch.int16), want_k.view(torch.int16))


@gpu
@pytest.mark.parametrize("rot,theta", [(64, 10000.0), (40, 1e6), (128, 5e5)])
def test_gpu_rope_table_rows_are_cos_sin_bitwise(rot, theta):
    """Rope.table (the fixed-shape GPU step gathers its rows) holds, for every position, the bits cos_sin computes
    for that position alone or in any batch."""
    from rocket_mpi.model.layers import Rope
    rope = Rope(rot, theta, torch.bfloat16)
    rope.inv_freq = rope.inv_freq.cuda()
    n = 4097
    tab = rope.table(n, torch.device("cuda"))
    assert tab.shape == (2, n, rot) and rope.table(n, torch.device("cuda")) is tab   # made once
    gen = torch.Generator().manual_seed(rot)
    for pos in (torch.arange(n), torch.randint(0, n, (1,), generator=gen), torch.randint(0, n, (37,), generator=gen),
                torch.tensor([n - 1, 0, 5])):
        pos = pos.cuda()
        cos, sin = tab[:, pos]
        want_cos, want_sin = rope.cos_sin(pos)
        assert cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(cos.view(torch.int16), want_cos.view(torch.int16))
        assert torch.equal(sin.view(torch.int16), want_sin.view(torch.int16))


@gpu
@pytest.mark.parametrize("t", [1, 5, 37])
def test_gpu_rope_interleaved_bitwise(t):
    """GLM-5's interleaved RoPE in one launch (kernels.rope_interleaved) gives the bits of its torch ops on the GPU,
    on the views the model passes: q's rope channels (a head's rows one stride apart), the latent key's [T, 1, r]
    slice, the indexer's q and k; the input is left as it was."""
    from rocket_mpi.model import glm_moe_dsa
    from rocket_mpi.model.layers import Rope
    rope = Rope(64, 10000.0, torch.bfloat16)
    rope.inv_freq = rope.inv_freq.cuda()
    gen = torch.Generator().manual_seed(t)
    cos, sin = rope.cos_sin(torch.randint(0, 4000, (t,), generator=gen).cuda())
    q = torch.randn(t, 16, 192 + 64, generator=gen).bfloat16().cuda()
    kv = torch.randn(t, 512 + 64, generator=gen).bfloat16().cuda()
    iq = torch.randn(t, 32, 128, generator=gen).bfloat16().cuda()
    views = {"q rope": q.split([192, 64], dim=-1)[1], "latent key": kv[:, None, 512:], "indexer q": iq[..., :64],
             "indexer k": iq[:, 0, None, :64], "contiguous": iq[:, :3, 64:].contiguous()}
    for name, x in views.items():
        before = x.clone()
        got = glm_moe_dsa.rope_interleaved(x, cos, sin)
        want = glm_moe_dsa.rope_interleaved_ops(x, cos, sin)   # the torch ops on the same GPU tensors
        assert got.shape == want.shape and got.is_contiguous(), name
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
        assert torch.equal(x, before), name


@gpu
@pytest.mark.parametrize("m,hq,hk,d,rot,cap", [(8, 12, 2, 128, 64, 40), (1, 4, 4, 64, 64, 3), (3, 6, 1, 80, 40, 9)])
def test_gpu_rope_kv_bitwise(m, hq, hk, d, rot, cap):
    """rope_kv_ (one launch) gives the bits of rope_ then kv_append: q and k rotated, k and v in the caches at
    pos, nothing written for a position past the cache."""
    from rocket_mpi.model.layers import Rope
    rope = Rope(rot, 10000.0, torch.bfloat16)
    rope.inv_freq = rope.inv_freq.cuda()
    gen = torch.Generator().manual_seed(m + d)
    q, k, v = (torch.randn(m, h, d, generator=gen).to(torch.bfloat16).cuda() for h in (hq, hk, hk))
    kc, vc = (torch.randn(m, hk, cap, d, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    pos = torch.tensor([0, cap - 1, cap, 2, 5, 1, 7, 3][:m], device="cuda").clamp(max=cap)   # cap: past the end
    cos, sin = rope.cos_sin(pos)
    want = [t.clone() for t in (q, k, kc, vc)]
    kernels.rope_(want[0], want[1], cos, sin, rot)
    kernels.kv_append(want[2], want[3], want[1], v, pos)
    kernels.rope_kv_(q, k, v, cos, sin, rot, kc, vc, pos)
    for name, got, w in zip(("q", "k", "k cache", "v cache"), (q, k, kc, vc), want):
        assert torch.equal(got.view(torch.int16), w.view(torch.int16)), name


@gpu
@pytest.mark.parametrize("m,heads,span", [(1, 96, 16), (8, 12, 40), (3, 4, 300), (2, 2, 1000), (1, 1, 1)])
def test_gpu_decode_softmax(m, heads, span):
    """decode_softmax against glm4_moe's torch ops (scale, mask past pos, fp32 softmax, bf16): hidden keys exactly
    0; the rest within one bf16 rounding of torch's (only the fp32 sums' order differs)."""
    gen = torch.Generator().manual_seed(span)
    scores = (torch.randn(m, heads, 1, span, generator=gen) * 8).to(torch.bfloat16).cuda()
    pos = torch.randint(0, span, (m,), generator=gen).cuda()
    pos[0] = span - 1
    scale = 128 ** -0.5
    hide = (torch.arange(span, device="cuda")[None, :] > pos[:, None])[:, None, None, :]
    want = torch.softmax((scores * scale).masked_fill(hide, float("-inf")), dim=-1, dtype=torch.float32)
    want = want.to(torch.bfloat16).float()
    got = kernels.decode_softmax(scores, pos, scale).float()
    assert (got[hide.expand_as(got)] == 0).all(), "a hidden key got a non-zero probability"
    err = (got - want).abs()
    assert (err <= want.abs() * 2.0 ** -7 + 1e-30).all(), f"max |diff| {float(err.max()):.3e}"
    sums = got.sum(-1)
    assert ((sums - 1).abs() < 2e-2).all(), sums


ATTN_CASES = [(2, 96, 8, 128, 40), (8, 8, 2, 64, 100), (3, 4, 2, 16, 7), (1, 12, 1, 128, 1000), (2, 4, 4, 128, 2048),
              (5, 16, 1, 24, 33), (16, 96, 8, 128, 24)]


@gpu
@pytest.mark.parametrize("m,hq,hkv,d,span", ATTN_CASES)
def test_gpu_decode_attention(m, hq, hkv, d, span, monkeypatch):
    """The fused decode attention against glm4_moe's torch path (two matmuls around scale, mask, fp32 softmax):
    within a bf16 rounding or two of the output scale (the sums' order differs); a stream's output the same bits
    alone as beside the others; keys past pos never read (NaN there changes nothing); the same keys inside caches
    of a longer capacity, the span given, the same bits; a span past the kernel's gives None (the caller takes the
    matmuls)."""
    from rocket_mpi.model.glm4_moe import _attend
    monkeypatch.setenv("ROCKET_DECODE_ATTENTION", "fused")  # every stream count the kernel takes
    gen = torch.Generator().manual_seed(span + d)
    q = torch.randn(m, hq, d, generator=gen).to(torch.bfloat16).cuda()
    kc, vc = (torch.randn(m, hkv, span, d, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    pos = torch.randint(0, span, (m,), generator=gen).cuda()
    pos[0] = span - 1
    scale = d ** -0.5
    hide = (torch.arange(span, device="cuda")[None, :] > pos[:, None])[:, None, None, :]
    want = _attend(q[:, :, None, :], kc, vc, hide, scale).view(m, hq, d).float()
    got = kernels.decode_attention(q, kc, vc, pos, scale)
    assert got is not None and got.shape == (m, hq, d)
    err = float((got.float() - want).abs().max())
    assert err <= 2.0 ** -6 * float(want.abs().max()), f"max |diff| {err:.3e} of {float(want.abs().max()):.3e}"
    last = m - 1
    alone = kernels.decode_attention(q[last:].contiguous(), kc[last:].contiguous(), vc[last:].contiguous(),
                                     pos[last:].contiguous(), scale)
    assert torch.equal(alone, got[last:])
    if int(pos[last]) + 1 < span:
        kn, vn = kc.clone(), vc.clone()
        kn[last, :, int(pos[last]) + 1:] = float("nan")
        vn[last, :, int(pos[last]) + 1:] = float("nan")
        assert torch.equal(kernels.decode_attention(q, kn, vn, pos, scale), got)
    long = torch.zeros(1, hkv, kernels.DECODE_ATTENTION_MAX_SPAN + 1, d, dtype=torch.bfloat16, device="cuda")
    assert kernels.decode_attention(q[:1], long, long, pos[:1], scale) is None
    # the same keys inside caches of a longer capacity (NaN past the span), the step's span given: the same bits,
    # also where the capacity is past what the fused kernel takes as a span
    for cap in (span + 37, max(span, kernels.DECODE_ATTENTION_MAX_SPAN) + 64):
        kl, vl = (torch.full((m, hkv, cap, d), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2))
        kl[:, :, :span], vl[:, :, :span] = kc, vc
        assert torch.equal(kernels.decode_attention(q, kl, vl, pos, scale, span), got)


@gpu
def test_gpu_decode_attention_switch(monkeypatch):
    """ROCKET_DECODE_ATTENTION: 'fused' takes the one-block-per-head kernel up to what it takes, 'auto' (default)
    and 'matmul' never (None: the caller's matmuls); a bad value is one error."""
    from rocket_mpi.errors import RocketError
    kc = torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16, device="cuda")

    def takes(m, hq=2, span=4):
        q = torch.zeros(m, hq, 16, dtype=torch.bfloat16, device="cuda")
        kv = torch.zeros(m, 1, span, 16, dtype=torch.bfloat16, device="cuda")
        return kernels.decode_attention(q, kv, kv, torch.zeros(m, dtype=torch.long, device="cuda"), 0.25) is not None

    big = kernels.DECODE_ATTENTION_MAX_SPAN + 1
    monkeypatch.setenv("ROCKET_DECODE_ATTENTION", "fused")
    assert takes(1) and takes(kernels.DECODE_ATTENTION_MAX_STREAMS) and takes(1, hq=17)
    assert not takes(kernels.DECODE_ATTENTION_MAX_STREAMS + 1)  # more streams than the kernel takes: the matmuls
    assert not takes(1, span=big)
    q = torch.zeros(1, 2, 16, dtype=torch.bfloat16, device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    for mode in ("matmul", "auto"):
        monkeypatch.setenv("ROCKET_DECODE_ATTENTION", mode)
        assert kernels.decode_attention(q, kc, kc, pos, 0.25) is None
    monkeypatch.delenv("ROCKET_DECODE_ATTENTION", raising=False)
    assert kernels.decode_attention(q, kc, kc, pos, 0.25) is None
    monkeypatch.setenv("ROCKET_DECODE_ATTENTION", "flash")
    with pytest.raises(RocketError, match="ROCKET_DECODE_ATTENTION='flash'"):
        kernels.decode_attention(q, kc, kc, pos, 0.25)


def _router_cfg(e, k, n_group=1, topk_group=1, norm=True, scale=2.5):
    from types import SimpleNamespace
    return SimpleNamespace(n_routed_experts=e, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                           norm_topk_prob=norm, routed_scaling_factor=scale)


@gpu
@pytest.mark.parametrize("tokens,hidden,e", [(1, 256, 16), (11, 4096, 128), (40, 1600, 260), (130, 512, 64)])
def test_gpu_router_logits(tokens, hidden, e):
    """Logits (partials over slices of hidden, summed) within 2^-20 of F.linear (only the sum order
    differs); each token's partials the same bits whatever other tokens share the launch (the engine's
    streams come and go); and the two kernels end to end choose route()'s experts."""
    import torch.nn.functional as F
    from rocket_mpi.moe.router import route
    C = kernels._ext.require()
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(e, hidden, generator=gen) / hidden ** 0.5).cuda()
    part = C.router_logits(x, w)
    assert part.shape == ((hidden + 511) // 512, tokens, e)
    got = part[0].clone()
    for s_ in range(1, part.shape[0]):
        got += part[s_]
    want = F.linear(x.float(), w)
    scale = x.float().abs() @ w.abs().T  # bound of the sum's rounding, per (t, e)
    assert float(((got - want).abs() / scale).max()) < 2 ** -20
    for lo, hi in ((0, 1), (tokens // 2, tokens), (tokens - 1, tokens)):
        assert torch.equal(C.router_logits(x[lo:hi].contiguous(), w), part[:, lo:hi])
    bias = (torch.randn(e, generator=gen) * 0.1).cuda()
    cfg = _router_cfg(e, 8)
    ex = kernels.route(x, w, bias, cfg)[1].sort(dim=-1).values
    assert torch.equal(ex, route(x, w, bias, cfg)[1].sort(dim=-1).values)


@gpu
@pytest.mark.parametrize("tokens,e,k,n_group,topk_group,norm", [(1, 16, 4, 1, 1, True), (9, 128, 8, 1, 1, True),
                                                               (33, 256, 8, 8, 4, True), (7, 64, 6, 4, 1, False),
                                                               (5, 1024, 32, 32, 5, True)])
def test_gpu_moe_route_matches_router(tokens, e, k, n_group, topk_group, norm):
    from rocket_mpi.moe.router import route_logits
    C = kernels._ext.require()
    cfg = _router_cfg(e, k, n_group, topk_group, norm)
    gen = torch.Generator().manual_seed(e + tokens)
    logits = (torch.randn(tokens, e, generator=gen) * 3).cuda()
    bias = (torch.randn(e, generator=gen) * 0.1).cuda()
    w, ex = C.moe_route(logits[None], bias, n_group, topk_group, k, norm, 2.5)
    want_w, want_ex = route_logits(logits, bias, cfg)
    ex_sorted, order = ex.sort(dim=-1)
    want_sorted, want_order = want_ex.sort(dim=-1)
    assert torch.equal(ex_sorted, want_sorted)
    got_w, ref_w = w.gather(1, order), want_w.gather(1, want_order)
    assert float(((got_w - ref_w).abs() / ref_w.abs()).max()) < 2 ** -18
    if n_group > 1:  # every choice inside at most topk_group groups
        assert all(len(set(r)) <= topk_group for r in (ex // (e // n_group)).tolist())


@gpu
def test_gpu_moe_route_ties_and_nan():
    """Equal choices go to the lower expert id; a NaN logit is never chosen while numbers are left."""
    C = kernels._ext.require()
    logits = torch.zeros(2, 32, device="cuda")
    logits[1, 3] = float("nan")
    bias = torch.zeros(32, device="cuda")
    w, ex = C.moe_route(logits[None], bias, 1, 1, 4, True, 1.0)
    assert ex.tolist() == [[0, 1, 2, 3], [0, 1, 2, 4]]
    assert torch.equal(w, torch.full((2, 4), 0.25, device="cuda"))


@gpu
def test_gpu_kv_append():
    m, h, cap, d = 4, 2, 9, 16
    kc, vc = (torch.randn(m, h, cap, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    want_k, want_v = kc.clone(), vc.clone()
    k, v = (torch.randn(m, h, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    pos = torch.tensor([0, 8, 3, 3], device="cuda")
    want_k[torch.arange(m), :, pos] = k
    want_v[torch.arange(m), :, pos] = v
    kernels.kv_append(kc, vc, k, v, pos)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_scatter_sums_row_checksum_cpu():
    """CPU mode of the graphed step: moe_scatter_add's checksum is engine.row_sum of the rows in canonical
    order, whatever slots they sit in, and leaves the scatter's result as it is."""
    from rocket_mpi.engine import row_sum
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(30, 16, generator=gen).to(torch.bfloat16)
    slot_of_canon = torch.randperm(30, generator=gen)[:12]
    by_canon = torch.randperm(12, generator=gen).view(3, 4).to(torch.int32)
    by_token = slot_of_canon[by_canon.long()]
    coef = torch.rand(3, 4, generator=gen)
    check = torch.zeros((), dtype=torch.long)
    got = kernels.moe_scatter_add(rows, by_token, coef, by_canon, check)
    assert torch.equal(got, moe_scatter_add(rows, by_token, coef))
    assert int(check) == int(row_sum(rows[slot_of_canon])) != int(row_sum(rows[slot_of_canon.flip(0)]))


@gpu
@pytest.mark.parametrize("hidden", [96, 100])  # the 16-byte path and the scalar one
def test_gpu_scatter_sums_row_checksum(hidden):
    """The graphed step's row checksum comes from moe_scatter_add (it reads every canonical row once):
    same scatter bits as without it, and the sum engine.row_sum gives over the rows in canonical order;
    the CPU path of the same call (graph.py's CPU mode) agrees."""
    from rocket_mpi.engine import row_sum
    t, k = 5, 4
    rows = torch.randn(40, hidden, device="cuda").to(torch.bfloat16)
    slot_of_canon = torch.randperm(40, device="cuda")[:t * k]        # canonical row i lives at slot_of_canon[i]
    by_canon = torch.randperm(t * k).view(t, k).to(torch.int32).cuda()
    by_token = slot_of_canon[by_canon.long()]
    coef = torch.rand(t, k, device="cuda")
    check = torch.zeros(2, dtype=torch.long, device="cuda")
    got = kernels.moe_scatter_add(rows, by_token, coef, by_canon, check[1])
    assert torch.equal(got, kernels.moe_scatter_add(rows, by_token, coef))
    assert int(check[0]) == 0 and int(check[1]) == int(row_sum(rows[slot_of_canon]))
    cpu = torch.zeros((), dtype=torch.long)
    got_cpu = kernels.moe_scatter_add(rows.cpu(), by_token.cpu(), coef.cpu(), by_canon.cpu(), cpu)
    assert torch.equal(got_cpu, got.cpu()) and int(cpu) == int(check[1])


@gpu
@pytest.mark.parametrize("hidden,t,n_res", [(4096, 1, 2), (4096, 9, 2), (96, 5, 0), (100, 5, 1), (12288, 2, 1)])
def test_gpu_scatter_with_next_norm_bitwise(hidden, t, n_res):
    """moe_scatter_add with norm (the graphed step's scatter making the next layer's input norm in its launch) gives
    the bits of the scatter and then kernels.rms_norm: out, normed and the rows' checksum (4096 and 96: one fused
    launch; 100 and 12288: the scalar or too-long rows take the two launches)."""
    from rocket_mpi.model.layers import rms_norm as rms_norm_ref
    k = 8
    gen = torch.Generator().manual_seed(hidden + t)
    rows = (torch.randn(3 * t * k, hidden, generator=gen) * 2).to(torch.bfloat16).cuda()
    slot_of_canon = torch.randperm(3 * t * k, generator=gen)[:t * k].cuda()
    by_canon = torch.randperm(t * k, generator=gen).view(t, k).to(torch.int32).cuda()
    by_token = slot_of_canon[by_canon.long()]
    coef = torch.rand(t, k, generator=gen).cuda()
    res = tuple((torch.randn(t, hidden, generator=gen) * 4).to(torch.bfloat16).cuda() for _ in range(n_res))
    w = (torch.rand(hidden, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    check = torch.zeros(2, dtype=torch.long, device="cuda")
    out, normed = kernels.moe_scatter_add(rows, by_token, coef, by_canon, check[0], res, norm=(w, 1e-5))
    want = kernels.moe_scatter_add(rows, by_token, coef, by_canon, check[1], res)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.equal(normed.view(torch.int16), kernels.rms_norm(want, w, 1e-5).view(torch.int16))
    assert int(check[0]) == int(check[1])
    cpu = kernels.moe_scatter_add(rows.cpu(), by_token.cpu(), coef.cpu(), residual=tuple(r.cpu() for r in res),
                                  norm=(w.cpu(), 1e-5))
    assert torch.equal(cpu[0], out.cpu())
    assert torch.equal(cpu[1], rms_norm_ref(out.cpu(), w.cpu(), 1e-5))


@gpu
@pytest.mark.parametrize("n,ids", [(4096, [5, 0, 77, 5]), (80, [3]), (36, [1, 2]), (4096, [2, 1000, -1])])
def test_gpu_embed_rms_norm_bitwise(n, ids):
    """embed_rms_norm (the step's embedding and first norm in one launch) = table[ids] and kernels.rms_norm, bit for
    bit; an id outside the table reads as a zero row (the step's ids come from its argmax, always inside)."""
    gen = torch.Generator().manual_seed(n)
    table = (torch.randn(100, n, generator=gen) * 2).to(torch.bfloat16).cuda()
    w = (torch.rand(n, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    ids_t = torch.tensor(ids, device="cuda")
    x, h = kernels.embed_rms_norm(table, ids_t, w, 1e-6)
    inside = (ids_t >= 0) & (ids_t < 100)
    want = torch.where(inside[:, None], table[ids_t.clamp(0, 99)], torch.zeros((), dtype=table.dtype, device="cuda"))
    assert torch.equal(x.view(torch.int16), want.view(torch.int16))
    assert torch.equal(h.view(torch.int16), kernels.rms_norm(want, w, 1e-6).view(torch.int16))


@gpu
@pytest.mark.parametrize("m,vocab", [(1, 151552), (8, 151552), (3, 1000), (2, 5), (70, 4099)])
def test_gpu_argmax_is_torch_argmax(m, vocab):
    """argmax_ (the step's next tokens and pos += 1 in one launch) picks torch.argmax's token: the first of equal
    maxima (+0 and -0 equal), a NaN before any number, a row of -inf its first entry; twice in a row (the ticket
    left zero for the next launch)."""
    gen = torch.Generator().manual_seed(m * vocab)
    logits = torch.randn(m, vocab, generator=gen).to(torch.bfloat16)
    r = list(range(m))
    if m > 1:
        i, j = sorted(torch.randint(0, vocab, (2,), generator=gen).tolist())
        logits[r[1], i] = logits[r[1], j] = 100.0                       # a tie: the lower index
    if m > 2:
        logits[r[2]] = float("-inf")                                   # nothing but -inf: index 0
        logits[r[2], vocab - 1] = float("nan")                         # ... but a NaN comes first
        logits[r[2], vocab // 2] = float("nan")
    if m > 3:
        logits[r[3]] = -1.0
        logits[r[3], vocab - 2], logits[r[3], vocab - 3] = 0.0, -0.0   # -0 == +0: the lower index
    if m > 4:
        logits[r[4]] = float("-inf")
    logits = logits.cuda()
    want = torch.argmax(logits, dim=-1)
    tokens = torch.full((m,), -7, dtype=torch.long, device="cuda")
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda")
    pos = torch.arange(m, device="cuda") * 3
    for rep in range(2):
        tokens.fill_(-7)
        kernels.argmax_(logits, tokens, ticket, pos)
        assert tokens.tolist() == want.tolist(), rep
        assert pos.tolist() == [3 * i + rep + 1 for i in range(m)] and int(ticket) == 0


@gpu
@pytest.mark.parametrize("m,cap", [(8, 40), (1, 3), (3, 9)])
def test_gpu_rope_kv_reads_table_at_pos(m, cap):
    """rope_kv_ with table=True (cos / sin read at pos from Rope.table's halves) = the gathered rows, bit for bit,
    a position at the table's last row (pos = cap: nothing written) included."""
    from rocket_mpi.model.layers import Rope
    rot, d, hq, hk = 64, 128, 12, 2
    rope = Rope(rot, 10000.0, torch.bfloat16)
    rope.inv_freq = rope.inv_freq.cuda()
    tab = rope.table(cap + 1, torch.device("cuda"))
    gen = torch.Generator().manual_seed(m + cap)
    q, k, v = (torch.randn(m, h, d, generator=gen).to(torch.bfloat16).cuda() for h in (hq, hk, hk))
    kc, vc = (torch.randn(m, hk, cap, d, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    pos = torch.tensor([0, cap - 1, cap, 2, 5, 1, 7, 3][:m], device="cuda").clamp(max=cap)
    want = [t.clone() for t in (q, k, kc, vc)]
    cos, sin = tab[:, pos]
    kernels.rope_kv_(want[0], want[1], v, cos, sin, rot, want[2], want[3], pos)
    kernels.rope_kv_(q, k, v, tab[0], tab[1], rot, kc, vc, pos, table=True)
    for name, got, w in zip(("q", "k", "k cache", "v cache"), (q, k, kc, vc), want):
        assert torch.equal(got.view(torch.int16), w.view(torch.int16)), name


@gpu
def test_gpu_moe_plan_meta_out_and_zero():
    """moe_plan writes its meta into the step's report row it is given (the same words as its own tensor) and
    zeroes the layer's checksum word."""
    gen = torch.Generator().manual_seed(3)
    t, k, e, ranks = 5, 4, 16, 2
    experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).cuda()
    weights = torch.rand(t, k, generator=gen).cuda()
    owner = (torch.arange(e) * ranks // e).to(torch.int32)
    slot = kplan.slot_table(e, {i: i for i in range(e // 2)}).cuda()
    args = (experts, weights, owner.cuda(), slot, kplan.canonical_experts(owner).cuda(), torch.rand(e).cuda(), 0,
            ranks, 2, 4 * t * k)
    base = kplan.moe_plan(*args, torch.tensor([6], device="cuda"))
    report = torch.full((3 + kplan.META_HEAD + ranks,), 99, dtype=torch.long, device="cuda")
    got = kplan.moe_plan(*args, torch.tensor([6], device="cuda"), report[3:], report[1:2])
    assert got["meta"].data_ptr() == report[3:].data_ptr()
    assert report.tolist() == [99, 0, 99] + base["meta"].tolist()
    for key in kplan.PLAN_KEYS:
        assert torch.equal(got[key], base[key]), key


@gpu
@pytest.mark.parametrize("streams", [1, 8])
def test_gpu_step_fuse_knob_same_tokens(streams, monkeypatch):
    """The graphed step with its glue fused (the default) and with ROCKET_STEP_FUSE=0 (the separate ops) decodes the
    same tokens with the same row checksums."""
    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.engine import Engine
    from rocket_mpi.prompts import default_prompts
    runs = {}
    ckpt = "preset:default:nvfp4"
    for knob in ("1", "0"):
        monkeypatch.setenv("ROCKET_STEP_FUSE", knob)
        eng = Engine(ckpt, reader=SyntheticReader(ckpt, "cuda"), device="cuda")
        assert eng.set_decode_path("graph", "local") == "graph"
        r = eng.generate(default_prompts(streams, eng.cfg.vocab_size), 10)
        assert r.path == "graph" and not r.note, r.note
        runs[knob] = (r.tokens, [s.row_crc for s in r.steps])
    assert runs["1"] == runs["0"]


@gpu
def test_gpu_grouped_bf16_rows_are_batch_invariant():
    """BF16 experts in the graphed step go through torch._grouped_mm: a row's output must be the same bits
    alone, beside other groups' rows, and with a different number of experts in the stack (ranks own
    different counts), or the split would not decode the single rank's tokens."""
    from rocket_mpi.moe.experts import ExpertStore
    h, i, n_exp = 256, 192, 6
    gen = torch.Generator().manual_seed(11)
    gu = {e: (torch.randn(2 * i, h, generator=gen) * 0.05).to(torch.bfloat16).cuda() for e in range(n_exp)}
    dn = {e: (torch.randn(h, i, generator=gen) * 0.05).to(torch.bfloat16).cuda() for e in range(n_exp)}

    def store(ids):
        s = ExpertStore(0, ids, {e: gu[e] for e in ids}, {e: dn[e] for e in ids}, torch.ones(n_exp), 0, None)
        s.stack()
        return s

    x = torch.randn(10, h, generator=gen).to(torch.bfloat16).cuda()
    cuda = {"device": "cuda"}
    # all six experts: counts e0 2, e1 1, e2 3, e3 1, e4 1; expert 2's rows (tokens 1, 3, 7) are block rows 3..5
    full = store(list(range(n_exp))).grouped(x, torch.tensor([0, 6, 8, 1, 3, 7, 2, 5], **cuda),
                                              torch.tensor([0, 0, 1, 2, 2, 2, 3, 4], **cuda).view(4, 2))
    # a rank owning experts 2 and 4: expert 2's rows first
    part = store([2, 4]).grouped(x, torch.tensor([1, 3, 7, 5], **cuda), torch.tensor([2, 2, 2, 4], **cuda).view(2, 2))
    alone = store([2]).grouped(x, torch.tensor([1, 3, 7], **cuda), torch.tensor([2, 2, 2], **cuda).view(3, 1))
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    assert torch.equal(bits(full[3:6]), bits(alone)) and torch.equal(bits(part[:3]), bits(alone))
    # and it is the expert's SwiGLU MLP (bf16 between the steps, as ExpertStore.compute): only sum orders differ
    ref = _swiglu_ref(x[[1, 3, 7]], gu[2], dn[2])
    err = (alone.float() - ref).norm() / ref.norm()
    assert err < 2.0 ** -7, f"grouped BF16 experts vs F.linear: relative error {float(err):.3g}"


def _swiglu_ref(xt, gu, dn):
    import torch.nn.functional as F
    gate, up = F.linear(xt, gu).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, dn).float()


@gpu
@pytest.mark.parametrize("streams,experts", [(8, "kernel"), (8, "grouped")])
def test_gpu_graph_decode_bf16_equals_eager_device_step(streams, experts):
    """BF16 experts, in the expert kernel's BF16 tiles (the default) or kept dense (ROCKET_BF16_EXPERTS=grouped:
    F.linear eagerly, torch._grouped_mm in the graph): the graphed step decodes the eager step's tokens."""
    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.engine import Engine
    from rocket_mpi.prompts import default_prompts
    runs = {}
    old = os.environ.get("ROCKET_BF16_EXPERTS")
    os.environ["ROCKET_BF16_EXPERTS"] = experts
    try:
        for path in ("device", "graph"):
            eng = Engine("preset:default", reader=SyntheticReader("preset:default", "cuda"), device="cuda")
            packed = [st.packed is not None for st in eng.experts.values() if st.owned]
            assert packed and all(packed) == (experts == "kernel") and any(packed) == all(packed)
            assert eng.set_decode_path(path, "local") == path
            r = eng.generate(default_prompts(streams, eng.cfg.vocab_size), 10)
            assert r.path == path and not r.note, r.note
            runs[path] = (r.tokens, [s.row_crc for s in r.steps])
    finally:
        if old is None:
            os.environ.pop("ROCKET_BF16_EXPERTS", None)
        else:
            os.environ["ROCKET_BF16_EXPERTS"] = old
    assert runs["graph"] == runs["device"]


def _hc_case(t, n, h, seed):
    from rocket_mpi.model.glm5_next_hc import HcArgs, HyperConnection
    gen = torch.Generator().manual_seed(seed)
    j = (2 + n) * n
    hc = HyperConnection(fn=(torch.randn(j, n * h, generator=gen) * 0.02).to(torch.bfloat16).float(),
                         base=torch.randn(j, generator=gen) * 0.5, scale=torch.rand(3, generator=gen) + 0.5)
    streams = (torch.randn(t, n, h, generator=gen) * 2).to(torch.bfloat16)
    y = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    return hc, HcArgs(mult=n, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-5), streams, y


def test_hc_pre_with_norm_cpu():
    """hc_pre(..., norm=(w, eps)) on the CPU: post and comb as without it, the collapsed row through layers.rms_norm."""
    from rocket_mpi.model.glm5_next_hc import hc_pre
    from rocket_mpi.model.layers import rms_norm
    hc, a, streams, _ = _hc_case(3, 4, 64, seed=5)
    w = (torch.randn(64, generator=torch.Generator().manual_seed(6)) + 1).bfloat16()
    post, comb, collapsed = hc_pre(hc, streams, a)
    got = hc_pre(hc, streams, a, norm=(w, 1e-5))
    assert torch.equal(got[0], post) and torch.equal(got[1], comb)
    assert torch.equal(got[2], rms_norm(collapsed, w, 1e-5)) and not torch.equal(got[2], collapsed)


@gpu
@pytest.mark.parametrize("t,n,h", [(1, 4, 4096), (8, 4, 4096), (37, 4, 64), (3, 2, 520), (5, 3, 96), (2, 1, 128),
                                   (2, 2, 100)])   # 100: the norm does not fuse (not whole 16-byte chunks)
def test_gpu_hc_kernels_match_torch(t, n, h):
    """csrc/hc.cu against glm5_next_hc's torch ops on the same inputs: post / comb within fp32 rounding of the
    different sum order, the collapse and the new streams within one bf16 rounding; and a token alone gets the same
    bits as inside the launch (no token depends on another)."""
    from dataclasses import replace
    from rocket_mpi.model.glm5_next_hc import hc_post, hc_pre
    hc, a, streams, y = _hc_case(t, n, h, seed=t * 31 + n * 7 + h)
    hc_c = replace(hc, fn=hc.fn.cuda(), base=hc.base.cuda(), scale=hc.scale.cuda())
    sc, yc = streams.cuda(), y.cuda()
    ref = [x.cuda() for x in hc_pre(hc_c, sc, a)]
    got = hc_pre(hc_c, sc, a, fuse=True)
    for name, g, r, tol in (("post", got[0], ref[0], 1e-5), ("comb", got[1], ref[1], 1e-5)):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert torch.allclose(g, r, rtol=tol, atol=tol), (name, float((g - r).abs().max()))
    # bf16 results: within a couple of roundings of the size of the terms they sum (cancellation makes a result
    # small, not its error)
    xs = sc.float().abs()
    c, cr = got[2].float(), ref[2].float()
    size = (xs * 2).sum(dim=1)  # every pre weight is below 1 + eps
    assert ((c - cr).abs() <= size * 2.0 ** -7 + 1e-6).all(), float((c - cr).abs().max())
    out = hc_post(got[0], got[1], yc, sc, fuse=True).float()
    out_ref = hc_post(got[0], got[1], yc, sc).float()
    size = got[0][:, :, None] * yc.float().abs()[:, None, :] + torch.einsum("tij,tih->tjh", got[1], xs)
    assert ((out - out_ref).abs() <= size * 2.0 ** -6 + 1e-6).all(), float((out - out_ref).abs().max())
    # row invariance: the last token alone
    alone = hc_pre(hc_c, sc[-1:].contiguous(), a, fuse=True)
    for g, al in zip(got, alone):
        assert torch.equal(g[-1:], al)
    assert torch.equal(hc_post(got[0][-1:], got[1][-1:], yc[-1:], sc[-1:], fuse=True),
                       hc_post(got[0], got[1], yc, sc, fuse=True)[-1:])
    # with the block's input norm in hc_finish's launch (or after it where the row does not fit norm.cuh's layout):
    # the bits of kernels.rms_norm on the collapsed row; post / comb / collapse unchanged
    w = (torch.randn(h, generator=torch.Generator().manual_seed(h)) + 1).bfloat16().cuda()
    four = kernels.hc_pre(sc, hc_c.fn, hc_c.base, hc_c.scale, a.sinkhorn_iters, a.eps, a.norm_eps, (w, 1e-5))
    for g, r in zip(four[:3], got):
        assert torch.equal(g, r)
    assert torch.equal(four[3].view(torch.int16), kernels.rms_norm(got[2], w, 1e-5).view(torch.int16))
    assert torch.equal(hc_pre(hc_c, sc, a, fuse=True, norm=(w, 1e-5))[2], four[3])


def test_hc_fuse_knob(monkeypatch):
    from rocket_mpi.errors import RocketError
    from rocket_mpi.model.glm5_next_hc import fused
    monkeypatch.setenv("ROCKET_HC_FUSE", "on")
    with pytest.raises(RocketError, match="ROCKET_HC_FUSE='on'"):
        fused("cpu")
    monkeypatch.setenv("ROCKET_HC_FUSE", "1")
    assert fused("cpu") is False   # GPU kernels only: the CPU step keeps the torch ops


def _kda_case(heads, dk, hidden, streams, seed, lower_bound):
    from rocket_mpi.model.glm5_next_kda import KDA, KdaArgs
    gen = torch.Generator().manual_seed(seed)
    d = heads * dk

    def w(*shape, std=0.05):
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)
    a = KDA(qkv=w(3 * d, hidden), conv=torch.randn(3 * d, 4, generator=gen) * 0.3, f_a=w(dk, hidden, std=0.2),
            f_b=w(d, dk, std=0.2), dt_bias=torch.randn(d, generator=gen) * 0.5, A_log=torch.randn(heads, generator=gen) * 0.5,
            b=w(heads, hidden, std=0.2), g_a=w(dk, hidden, std=0.2), g_b=w(d, dk, std=0.2),
            o_norm=(torch.rand(dk, generator=gen) + 0.5).to(torch.bfloat16).float(), o=w(hidden, d))
    args = KdaArgs(heads=heads, head_dim=dk, conv_kernel=4, lower_bound=lower_bound, eps=1e-5)
    conv = (torch.randn(streams, 3 * d, 4, generator=gen)).to(torch.bfloat16)   # the last K = 4 inputs
    rec = torch.randn(streams, heads, dk, dk, generator=gen) * 0.1
    return a, args, conv, rec


@gpu
@pytest.mark.parametrize("heads,dk,lb", [(4, 16, -5.0), (2, 128, -5.0), (3, 64, None), (2, 32, -5.0)])
def test_gpu_kda_decode_matches_torch(heads, dk, lb):
    """csrc/kda.cu against glm5_next_kda's torch ops for decode tokens of 3 of 5 streams, three steps in a row: the
    layer output within a few bf16 roundings of its size, the recurrent state within fp32 rounding of the other sum
    orders, the conv state bit for bit (both take the same torch ops there); a token alone gets the same bits."""
    from dataclasses import fields
    from rocket_mpi.model.glm5_next_kda import kda_forward
    hidden = 64
    a, args, conv, rec = _kda_case(heads, dk, hidden, 5, seed=heads * 100 + dk, lower_bound=lb)
    a = type(a)(**{f.name: getattr(a, f.name).cuda() for f in fields(a) if f.name != "packed"})
    idx = torch.tensor([4, 0, 2], device="cuda")
    gen = torch.Generator().manual_seed(dk)
    state = {name: (conv.cuda(), rec.cuda()) for name in ("torch", "kernel")}
    for step in range(3):
        h = (torch.randn(3, hidden, generator=gen)).to(torch.bfloat16).cuda()
        ref = kda_forward(a, h, *state["torch"], [], args, idx=idx)
        got = kda_forward(a, h, *state["kernel"], [], args, idx=idx, fuse=True)
        size = ref.float().abs().amax(dim=-1, keepdim=True)
        assert ((got.float() - ref.float()).abs() <= size * 2.0 ** -5).all(), (step, float((got - ref).abs().max()))
        assert torch.equal(state["kernel"][0], state["torch"][0])
        s_got, s_ref = state["kernel"][1], state["torch"][1]
        assert torch.allclose(s_got, s_ref, rtol=1e-4, atol=1e-5), (step, float((s_got - s_ref).abs().max()))
    # a token alone: the same output and state row as inside the launch
    conv2, rec2 = state["kernel"][0].clone(), state["kernel"][1].clone()
    h = (torch.randn(3, hidden, generator=gen)).to(torch.bfloat16).cuda()
    both = kda_forward(a, h, *state["kernel"], [], args, idx=idx, fuse=True)
    alone = kda_forward(a, h[1:2].contiguous(), conv2, rec2, [], args, idx=idx[1:2].contiguous(), fuse=True)
    assert torch.equal(both[1:2], alone) and torch.equal(state["kernel"][1][0], rec2[0])


@gpu
@pytest.mark.parametrize("heads,dk,lb", [(4, 16, -5.0), (2, 128, -5.0), (3, 64, None)])
def test_gpu_kda_prefill_in_one_launch(heads, dk, lb):
    """A prefill's KDA tokens in one launch of csrc/kda.cu (each stream's tokens in order, the state in registers):
    the same bits as one launch per token (outputs, conv state, recurrent state), for 4 of 5 streams with 1, 11, 2
    and 37 tokens (fewer and more than the conv's window); and within the decode test's bounds of glm5_next_kda's
    torch loop. Streams not in the launch keep their states bit for bit."""
    from dataclasses import fields

    import torch.nn.functional as F

    from rocket_mpi.model.glm5_next_kda import kda_forward
    hidden, counts, streams = 64, [1, 11, 2, 37], [3, 0, 4, 1]
    a, args, conv, rec = _kda_case(heads, dk, hidden, 5, seed=heads * 10 + dk, lower_bound=lb)
    a = type(a)(**{f.name: getattr(a, f.name).cuda() for f in fields(a) if f.name != "packed"})
    offs = [sum(counts[:i]) for i in range(len(counts))]
    segments = list(zip(streams, offs, counts))
    h = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(dk)).to(torch.bfloat16).cuda()
    state = {name: (conv.cuda(), rec.cuda()) for name in ("torch", "one", "tokens", "layer")}
    # the kernel's inputs once (a GEMM of 1 row need not give a GEMM of 52 rows' bits), then the segments in one
    # launch against the same tokens one launch (one token of one stream) each
    lin = (F.linear(h, a.qkv), F.linear(F.linear(h, a.f_a), a.f_b), F.linear(h, a.b), F.linear(F.linear(h, a.g_a), a.g_b))
    tail = (a.dt_bias, a.A_log, a.o_norm)
    one = kernels.kda_decode(lin[0], state["one"][0], a.conv, *lin[1:], *tail, state["one"][1],
                             torch.tensor(streams, device="cuda"), heads, dk, lb, args.eps, counts)
    steps = torch.empty_like(one)
    for s, off, n in segments:
        for j in range(off, off + n):
            steps[j] = kernels.kda_decode(*(x[j:j + 1] for x in lin[:1]), state["tokens"][0], a.conv,
                                          *(x[j:j + 1] for x in lin[1:]), *tail, state["tokens"][1],
                                          torch.tensor([s], device="cuda"), heads, dk, lb, args.eps)[0]
    assert torch.equal(one, steps)
    assert torch.equal(state["one"][0], state["tokens"][0]) and torch.equal(state["one"][1], state["tokens"][1])
    # the layer (kda_forward with fuse: the kernel, then o_proj) against the torch loop
    ref = kda_forward(a, h, *state["torch"], segments, args)
    got = kda_forward(a, h, *state["layer"], segments, args, fuse=True)
    assert torch.equal(state["layer"][1], state["one"][1])
    size = ref.float().abs().amax(dim=-1, keepdim=True)
    assert ((got.float() - ref.float()).abs() <= size * 2.0 ** -5).all(), float((got - ref).abs().max())
    assert torch.equal(state["layer"][0], state["torch"][0])
    s_got, s_ref = state["layer"][1], state["torch"][1]
    assert torch.allclose(s_got, s_ref, rtol=1e-3, atol=1e-4), float((s_got - s_ref).abs().max())
    assert torch.equal(state["one"][1][2], rec[2].cuda()) and torch.equal(state["one"][0][2], conv[2].cuda())
    with pytest.raises(ValueError, match="not packed one after another"):
        kda_forward(a, h, *state["one"], [(s, off + 1, n) for s, off, n in segments], args, fuse=True)
    with pytest.raises(ValueError, match="counts"):
        kernels.kda_decode(lin[0], state["one"][0], a.conv, *lin[1:], *tail, state["one"][1],
                           torch.tensor(streams, device="cuda"), heads, dk, lb, args.eps, [1, 11, 2, 36])


def test_kda_fuse_knob(monkeypatch):
    from rocket_mpi.errors import RocketError
    from rocket_mpi.model.glm5_next_kda import fused
    monkeypatch.setenv("ROCKET_KDA_FUSE", "2")
    with pytest.raises(RocketError, match="ROCKET_KDA_FUSE='2'"):
        fused("cpu")
    monkeypatch.delenv("ROCKET_KDA_FUSE")
    assert fused("cpu") is False


def test_mla_latent_knob(monkeypatch):
    """ROCKET_MLA_LATENT: a bad value is one error naming it; 0 (GLM-5.3-Flash's selected latents expanded through
    kv_b) and 1 (the absorbed form, the default) attend to the same tokens with the same weights, so their
    outputs agree within bf16 rounding on random weights (a wrong half of kv_b, or heads mixed up, would not)."""
    from rocket_mpi.errors import RocketError
    from rocket_mpi.model.glm5_next_mla import MLA, MlaArgs, MlaCache, mla_decode
    from rocket_mpi.model.layers import latent_decode
    monkeypatch.setenv("ROCKET_MLA_LATENT", "yes")
    with pytest.raises(RocketError, match="ROCKET_MLA_LATENT='yes'"):
        latent_decode()
    gen = torch.Generator().manual_seed(5)
    heads, dq, dv, kl, ql, hid, m, cap = 4, 16, 24, 32, 48, 64, 3, 20

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)
    a = MLA(w(ql, hid), None, torch.ones(ql, dtype=torch.bfloat16), w(heads * dq, ql), w(kl, hid), None,
            torch.ones(kl, dtype=torch.bfloat16), w(heads * (dq + dv), kl), w(hid, heads * dv), None, None)
    args = MlaArgs(heads, dq, dv, kl, 1e-6, 2, 8, 8, 4, True)
    cache = MlaCache(m, cap, args, False)
    cache.latent.copy_(torch.randn(m, cap, kl, generator=gen).to(torch.bfloat16))
    pos = torch.tensor([5, 11, 17])
    visible = (torch.rand(m, cap, generator=gen) < 0.6) & (torch.arange(cap)[None, :] <= pos[:, None])
    visible[torch.arange(m), pos] = True
    visible = (torch.arange(cap).expand(m, cap), visible)  # a selection as mla_decode takes it: (cols, valid)
    h = torch.randn(m, hid, generator=gen).to(torch.bfloat16)
    outs = {}
    for knob in ("0", "1"):
        monkeypatch.setenv("ROCKET_MLA_LATENT", knob)
        outs[knob] = mla_decode(a, h, cache, pos, cap, args, visible)[0].float()
    torch.testing.assert_close(outs["1"], outs["0"], rtol=2e-2, atol=2e-2 * outs["0"].abs().max().item())
    assert not torch.equal(outs["1"], outs["0"])  # two forms indeed ran


def test_glm5_next_sparse_prefill_matches_dense():
    """GLM-5.3-Flash's prefill past a short context (_prefill_attention): each row over its own chosen pools and
    tail, gathered, in the absorbed form, against the same selection as a dense mask (PoolSelection.mask) over
    every latent expanded through kv_b (SDPA), on random weights: three streams' prompts after positions already
    held, blocks of 3 rows, pools picked by _pick from random indexer scores (early rows with fewer candidate
    pools than picks, rows whose tail is empty). The mask is, row by row, the best index_topk // kpool complete
    pools ending at or before the row by index score, and the tail; the outputs agree within bf16 rounding and are
    not the same bits (two forms ran). kv_b's halves swapped, or each block taking the first block's selection,
    fail it."""
    import torch.nn.functional as F
    from rocket_mpi.model.glm5_next_mla import MLA, MlaArgs, PoolSelection, _pick, _prefill_attention
    gen = torch.Generator().manual_seed(17)
    heads, dq, dv, kl, ql, hid, cap = 4, 16, 16, 32, 48, 64, 40

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)
    a = MLA(w(ql, hid), None, torch.ones(ql, dtype=torch.bfloat16), w(heads * dq, ql), w(kl, hid), None,
            torch.ones(kl, dtype=torch.bfloat16), w(heads * (dq + dv), kl), w(hid, heads * dv), None, None)
    args = MlaArgs(heads, dq, dv, kl, 1e-6, 2, 8, 8, 4, True)       # index_topk 8 in pools of 4: 2 picks per row
    for p0, n in ((9, 6), (13, 11), (2, 16)):
        end, pools = p0 + n, (p0 + n) // args.kpool
        latents = torch.randn(cap, kl, generator=gen).to(torch.bfloat16)
        q = torch.randn(n, heads, dq, generator=gen).to(torch.bfloat16)
        iq, iw = torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, generator=gen)
        keys_t = torch.randn(8, pools, generator=gen)
        pos = torch.arange(p0, end)
        blocks = [(r0, min(r0 + 3, n), *_pick(iq[r0:r0 + 3], iw[r0:r0 + 3], keys_t, pos[r0:r0 + 3], pools, args))
                  for r0 in range(0, n, 3)]
        sel = PoolSelection(p0, n, blocks)
        mask = sel.mask(args)                                                                  # [n, end]
        score = (iw[:, :, None] * F.relu(iq @ keys_t * 8 ** -0.5)).sum(1)                   # [n, pools]
        kp = args.kpool
        for j, p in enumerate(pos.tolist()):
            cand = [i for i in range(pools) if (i + 1) * kp - 1 <= p]
            best = sorted(cand, key=lambda i: -float(score[j, i]))[:args.index_topk // kp]
            want = {t for i in best for t in range(i * kp, (i + 1) * kp)} | set(range((p + 1) // kp * kp, p + 1))
            assert set(mask[j].nonzero().squeeze(1).tolist()) == want, f"stream at {p0}, row {j}"
        got = torch.cat(_prefill_attention(a, q, latents, sel, args)).float()
        kv = F.linear(latents[:end], a.kv_b).view(end, heads, dq + dv)
        k, v = (x.transpose(0, 1)[None] for x in kv.split([dq, dv], dim=-1))
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=dq ** -0.5)
        want = o[0].transpose(0, 1).reshape(n, -1).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
        assert not torch.equal(got, want)


def test_dsa_sparse_prefill_matches_dense(dsa_ckpt, monkeypatch):
    """GLM-5's prefill (_prefill_selection, _prefill_attend) in blocks of 4 rows after 2 positions held: blocks
    whose rows see at most index_topk keys attend over their prefix, later blocks each row over its own top-k rows,
    gathered. The selection (PrefillSelection.mask) is each row's index_topk best keys at or before it, computed
    here row by row; the attention agrees within bf16 rounding with a dense block over the whole prefix under
    that mask (_prefill_block), the prefix blocks bit for bit. A gathered block taking the first block's
    columns fails it."""
    from rocket_mpi.engine import Engine
    from rocket_mpi.model import layers
    model = Engine(dsa_ckpt).model
    monkeypatch.setattr(layers, "PREFILL_ROWS", 4)
    gen = torch.Generator().manual_seed(13)
    k, p0, n, d = model.index_topk, 2, 14, model.latent + model.rope_dim
    end = p0 + n
    iq = torch.randn(n, model.index_heads, model.index_dim, generator=gen).to(torch.bfloat16)
    iw = torch.randn(n, model.index_heads, generator=gen)
    keys = torch.randn(end + 3, model.index_dim, generator=gen).to(torch.bfloat16)
    sel = model._prefill_selection(iq, iw, keys, p0, n)
    assert [c is None for _, _, c, _ in sel.blocks] == [True, False, False, False] and k == 8
    scores = model._index_scores(iq, iw, keys[None, :end])                                    # [n, end]
    mask = sel.mask()
    for j in range(n):
        p = p0 + j
        want = set(scores[j, :p + 1].topk(min(k, p + 1)).indices.tolist())
        assert set(mask[j].nonzero().squeeze(1).tolist()) == want, f"row {j}"
    q = torch.randn(n, model.heads, d, generator=gen).to(torch.bfloat16)
    rows = torch.randn(end + 3, d, generator=gen).to(torch.bfloat16)
    got = model._prefill_attend(q, rows, sel)
    for (r0, r1, cols, _), g in zip(sel.blocks, got):
        want = model._prefill_block(q[r0:r1], rows[:p0 + r1], mask[r0:r1, :p0 + r1])
        if cols is None:
            assert torch.equal(g, want)
        else:
            torch.testing.assert_close(g.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_dsa_prefill_block_forms_agree(dsa_ckpt, monkeypatch):
    """GLM-5's prefill block: latent_attention over the stream's latent rows with one mask per query row (default)
    against SDPA with enable_gqa (ROCKET_MLA_LATENT=0): within bf16 rounding on random rows and a random causal
    selection (a row's mask applied to another row's heads, or heads mixed up, would not agree), and not the same
    bits (both forms ran)."""
    from rocket_mpi.engine import Engine
    model = Engine(dsa_ckpt).model
    gen = torch.Generator().manual_seed(11)
    r, p0, nh, d = 6, 9, model.heads, model.latent + model.rope_dim
    w = p0 + r
    q = torch.randn(r, nh, d, generator=gen).to(torch.bfloat16)
    rows = torch.randn(w, d, generator=gen).to(torch.bfloat16)
    mask = (torch.rand(r, w, generator=gen) < 0.5) & (torch.arange(w)[None, :] <= torch.arange(p0, w)[:, None])
    mask[torch.arange(r), torch.arange(p0, w)] = True
    outs = {}
    for knob in ("0", "1"):
        monkeypatch.setenv("ROCKET_MLA_LATENT", knob)
        outs[knob] = model._prefill_block(q, rows, mask).float()
    assert outs["1"].shape == (r, nh, model.latent)
    torch.testing.assert_close(outs["1"], outs["0"], rtol=2e-2, atol=2e-2 * outs["0"].abs().max().item())
    assert not torch.equal(outs["1"], outs["0"])


@gpu
def test_gpu_matmul_fp32_matches_cpu():
    """layers.matmul_fp32 on the GPU (bf16 tensor cores, fp32 sums: the indexers' scores, latent_attention) against
    the CPU's fp32 GEMM on the same bf16 values, for a b per batch and one b for every batch (GLM-5's prefill
    scores against its stream's keys): fp32 results within 2^-16 of each element's sum of |products|."""
    from rocket_mpi.model.layers import matmul_fp32
    gen = torch.Generator().manual_seed(29)
    a = torch.randn(6, 32, 128, generator=gen).to(torch.bfloat16)
    for b in (torch.randn(6, 128, 700, generator=gen), torch.randn(128, 700, generator=gen)):
        b = b.to(torch.bfloat16)
        cpu = matmul_fp32(a, b)
        got = matmul_fp32(a.cuda(), b.cuda())
        assert got.dtype == torch.float32 and got.shape == cpu.shape == (6, 32, 700)
        bound = matmul_fp32(a.abs(), b.abs()) * 2.0 ** -16
        assert bool(((got.cpu() - cpu).abs() <= bound).all())


@gpu
@pytest.mark.parametrize("m,heads,d,dv,n", [(1, 64, 512, 512, 2064), (8, 64, 576, 512, 2064), (5, 4, 48, 32, 37)])
def test_gpu_latent_attention_matches_cpu(m, heads, d, dv, n):
    """layers.latent_attention (MLA decode over the latent rows) on the GPU, bf16 GEMMs with fp32 scores, against
    its CPU form (fp32 copies) on the same inputs: within a bf16 rounding of the output (both round the
    probabilities to bf16; the scores' sums differ in order). Masked rows add nothing: other values there leave
    every bit as it was."""
    from rocket_mpi.model.layers import latent_attention
    gen = torch.Generator().manual_seed(m * 131 + d)
    q = torch.randn(m, heads, d, generator=gen).to(torch.bfloat16)
    rows = torch.randn(m, n, d, generator=gen).to(torch.bfloat16)
    valid = torch.rand(m, n, generator=gen) < 0.8
    valid[:, 0] = True
    scale = 256 ** -0.5
    cpu = latent_attention(q, rows, rows[..., :dv], valid, scale)
    dev = torch.device("cuda")
    qg, rg, vg = q.to(dev), rows.to(dev), valid.to(dev)
    out = latent_attention(qg, rg, rg[..., :dv], vg, scale)
    assert out.shape == (m, heads, dv) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), cpu.float(), rtol=1.6e-2, atol=1e-2)
    noisy = torch.where(vg[..., None], rg, torch.full_like(rg, 1e4))
    assert torch.equal(latent_attention(qg, noisy, noisy[..., :dv], vg, scale), out)


def test_distinct_writes_restores_the_mode():
    """layers.distinct_writes turns torch's deterministic mode off inside only, and back as it was (warn_only too),
    also when the block raises."""
    from rocket_mpi.model.layers import distinct_writes
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.raises(KeyError):
            with distinct_writes():
                assert not torch.are_deterministic_algorithms_enabled()
                raise KeyError("inside")
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


@gpu
def test_gpu_distinct_writes_same_bits():
    """A cache write with one row per stream (distinct indices) gives the same bits through the plain kernel
    (layers.distinct_writes) as through torch's deterministic, sorted one."""
    from rocket_mpi.model.layers import distinct_writes
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    cache = torch.randn(8, 300, 576, device=dev, generator=gen).to(torch.bfloat16)
    pos = torch.randperm(300, device=dev, generator=gen)[:8]
    idx = torch.arange(8, device=dev)
    x = torch.randn(8, 576, device=dev, generator=gen).to(torch.bfloat16)
    a, b = cache.clone(), cache.clone()
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        a[idx, pos] = x
        with distinct_writes():
            b[idx, pos] = x
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)
    assert torch.equal(a, b) and torch.equal(a[idx, pos], x) and not torch.equal(a, cache)
