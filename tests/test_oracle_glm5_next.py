"""GLM-5.3-Flash (glm5_next) against transformers' Glm5NextForConditionalGeneration, text input only,
fp32 on the same weights (tiny random models; the one-block vision tower is never reached by text).

Tolerance, stated: at every step of 8 streams x 20 tokens our BF16 logits are within
ATOL + RTOL * max|ref| of the fp32 reference (teacher-forced on our tokens), and every greedy choice
is the reference's argmax or within MARGIN of its top logit. That is twice the GLM-4.x bound: the 4
hyper-connection streams are mixed and rounded to BF16 twice per layer. One step of the 160 may be up
to OUTLIER times the bound (any more, or further, fails): on these random weights a near-tie somewhere
(a pool, an expert) lands one step far from the rest. Measured (6 prompt seeds x nested / flat, worst
step per run): the absorbed decode attention 0.10-1.04 (one run over 1, stream 7 step 9 of the seed
here, the next worst step of that run 0.47), the expanded form (kv_b applied to every selected latent) 0.11-0.98,
median step 0.12 for both. Here: worst step 1.04 (nested; 0.47 without that step), 0.13 (flat), 0.12 / 0.22
(NVFP4 experts / all), median ~0.1; transformers' own BF16 run on the same weights is as far from its
fp32 run (worst 0.47 and 0.13, median 0.10 and 0.06).

The DSA selection is a hard top-k, so it is checked on its own: for every query of every full indexer,
our selected tokens must be transformers' exactly, except pools swapped at a near-tie, whose fp32
scores are within SELECTION_TIE (5%) of the largest |pool score| (measured: at most 2.3%; exact ties
from repeated tokens in a first layer count as 0). Logits alone barely see DSA on random weights
(attending to everything instead moves them by 0.94 of the bound).

test_oracle_is_sensitive: a routing bug, DSA off, a lost KDA conv cache and pool keys without their
per-slot bias each fail. In fp32 (DT switched to float32, dense MLPs only) the same code matches
transformers to 3e-7 relative: the arithmetic is transformers', the tolerance is BF16's.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the test oracle; pip install transformers")
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration  # noqa: E402

import rocket_mpi.model.glm5_next as glm5  # noqa: E402
from rocket_mpi.ops import nvfp4  # noqa: E402
from rocket_mpi.checkpoint.make import (exclude_patterns, make_checkpoint, quantize_tensors,  # noqa: E402
                                       write_checkpoint)
from rocket_mpi.runtime.engine import Engine  # noqa: E402
from rocket_mpi.runtime.prompts import default_prompts  # noqa: E402
from oracle import assert_logits_close  # noqa: E402
from tests.conftest import rocket  # noqa: E402

RTOL, ATOL, MARGIN = 0.04, 0.02, 0.02
OUTLIER = 1.25
SELECTION_TIE = 0.05
STREAMS, TOKENS = 8, 20

LIN, IDX = "linear_attention", "indexed_attention"
VARIANTS = {
    # model.language_model. names and a nested text_config, as transformers saves the full model.
    # KDA with the safe-gate lower bound; a full DSA indexer whose selection the next layer shares;
    # index_topk 8 in pools of 4: prompts of 3..13 tokens + 20 cross both; group-limited routing
    "nested": dict(vocab_size=397, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                   num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=12,
                   num_experts_per_tok=3, n_group=3, topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=32,
                   q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16,
                   index_n_heads=16, index_kpool=4, layer_types=[LIN, IDX, IDX, LIN, LIN, IDX],
                   indexer_types=["full", "full", "shared", "full", "full", "full"],
                   mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
                   linear_head_dim=16, linear_num_heads=2, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
                   swiglu_limit=0.5),
    # text-only: flat config and model. names (written from the same transformers tensors). MLA first,
    # attention biases, softplus forget gate (no lower bound), one expert group, tied embeddings,
    # index_topk 6 in pools of 2, a 3-wide conv, 32 experts top-4
    "flat": dict(vocab_size=256, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
                 num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=32,
                 num_experts_per_tok=4, n_group=1, topk_group=1, routed_scaling_factor=1.5, kv_lora_rank=16,
                 q_lora_rank=32, qk_nope_head_dim=32, v_head_dim=16, index_topk=6, index_head_dim=16,
                 index_n_heads=16, index_kpool=2, layer_types=[IDX, LIN, IDX, IDX, LIN],
                 indexer_types=["full", "full", "full", "shared", "full"],
                 mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"], attention_bias=True,
                 linear_head_dim=16, linear_num_heads=3, linear_conv_kernel_dim=3, linear_lower_bound=None,
                 swiglu_limit=0.4, tie_word_embeddings=True),
}
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def build_hf(variant: str, seed: int = 0) -> Glm5NextForConditionalGeneration:
    text = dict(VARIANTS[variant], max_position_embeddings=256, initializer_range=0.04, pad_token_id=None,
                norm_topk_prob=True, n_shared_experts=1, qk_rope_head_dim=0)
    cfg = Glm5NextConfig(text_config=text, vision_config=VISION,
                         tie_word_embeddings=text.get("tie_word_embeddings", False))
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    # transformers' init leaves the DSA pool gate at ones and ape at zero, which makes pool scores
    # near-ties that BF16 noise flips (its own BF16 run then misses its fp32 run by 17x the bound):
    # give every parameter a generic random value instead
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("norm.weight") or name.endswith(".scale"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn_like(p))
            elif name.endswith(("bias", "compress_ape", "A_log", ".base")):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("compress_gate"):
                p.copy_(0.1 * torch.randn_like(p))
            elif ".mlp.experts." in name:   # routed experts that move the logits: a wrong route shows
                p.mul_(2.0)
        for layer in model.model.language_model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(0.3 * torch.randn_like(bias))
    return model


def save_nested(model, path):
    model.to(torch.bfloat16).save_pretrained(path)


def save_flat(nested_dir, path, quant_all=None):
    """The text part as a flat text-only checkpoint (model.* names, text fields at the top of config.json),
    BF16 or, with quant_all True/False, NVFP4 (all Linears / routed experts only). -> tensors written."""
    from safetensors.torch import load_file
    tensors = {k.replace("model.language_model.", "model."): v
               for k, v in load_file(str(nested_dir / "model.safetensors")).items()
               if not k.startswith("model.visual.")}
    raw = json.load(open(nested_dir / "config.json"))
    cfg = {**{k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}, **raw["text_config"],
           "model_type": "glm5_next", "tie_word_embeddings": raw["tie_word_embeddings"]}
    cfg["first_k_dense_replace"] = cfg["mlp_layer_types"].index("sparse")
    quant = None
    if quant_all is not None:
        tensors = quantize_tensors(tensors, cfg, quant_all)
        quant = exclude_patterns(cfg, quant_all)
    write_checkpoint(str(path), cfg, tensors, quant, tokenizer=False)
    return tensors


def reference_logits(model, prompts, generated):
    """Teacher-forced fp32 logits at each generation position: [stream][step] -> [V]; and, for every
    full indexer, {(layer, stream, position): (tokens selected, the pool scores it chose them by)}."""
    out, chosen, hooks = [], {}, []
    stream, scores = [0], []
    topk = torch.Tensor.topk

    def spy_topk(t, *a, **k):   # the indexer's only topk is over its pool scores [1, S, P]
        scores.append(t.detach().clone())
        return topk(t, *a, **k)

    def before(mod, args, kwargs):
        scores.clear()
        torch.Tensor.topk = spy_topk

    for i, layer in enumerate(model.model.language_model.layers):
        ix = getattr(layer.self_attn, "indexer", None)
        if ix is not None:
            def after(mod, args, kwargs, sel, i=i):
                torch.Tensor.topk = topk
                for p, row in enumerate(sel[0].tolist()):
                    chosen[(i, stream[0], p)] = ({t for t in row if t >= 0}, scores[0][0, p])
            hooks += [ix.register_forward_pre_hook(before, with_kwargs=True),
                      ix.register_forward_hook(after, with_kwargs=True)]
    try:
        with torch.no_grad():
            for s, (p, g) in enumerate(zip(prompts, generated)):
                stream[0] = s
                logits = model(torch.tensor([p + g[:-1]])).logits[0].float()
                out.append(logits[len(p) - 1:])
    finally:
        torch.Tensor.topk = topk
        for h in hooks:
            h.remove()
    return out, chosen


def selection_gap(ours: set, ref: set, scores: torch.Tensor, kpool: int, pos: int) -> float:
    """How far apart, in transformers' fp32 scores relative to the largest |score|, are the pools our
    DSA selection has instead of its (0 when equal, inf when not a swap of pools at all)."""
    tail = (pos + 1) // kpool * kpool
    if {t for t in ours if t >= tail} != {t for t in ref if t >= tail}:
        return float("inf")
    mine, theirs = {t // kpool for t in ours if t < tail}, {t // kpool for t in ref if t < tail}
    if len(mine) != len(theirs):
        return float("inf")
    if mine == theirs:
        return 0.0
    gap = max(abs(scores[a] - scores[b]).item() for a in mine - theirs for b in theirs - mine)
    return gap / scores[:tail // kpool].abs().max().item()


class SelectionSpy:
    """Wraps mla_forward: our DSA selection of every full indexer, {(layer, stream, position): set}."""

    def __init__(self, engine):
        self.layer_of = {id(L.mla): i for i, L in enumerate(engine.model.layers) if L.mla is not None}
        self.chosen = {}
        self.picked_in_prefill = False  # some prefill row past a short context attended over its own pools
        self.real = glm5.mla_forward

    def __call__(self, a, h, c, starts, seqlens, args, shared):
        out, masks = self.real(a, h, c, starts, seqlens, args, shared)
        if a.indexer is not None:
            if isinstance(masks, tuple):  # a decode step (mla_decode): (cols, valid), one row per stream
                cols, valid = masks
                for s, p0 in enumerate(starts):
                    picked = cols[s][valid[s]].tolist()
                    self.chosen[(self.layer_of[id(a)], s, p0)] = set(picked)
                    assert len(set(picked)) == len(picked), f"stream {s} at {p0} gathers a position twice"
                    assert max(picked) <= p0, f"stream {s} at {p0} selects past its position"
            else:  # a prefill: per stream a PoolSelection (None: no rows)
                for s, sel in enumerate(masks):
                    if sel is None:
                        continue
                    self.picked_in_prefill |= any(b[2] is not None for b in sel.blocks)
                    m = sel.mask(args)
                    for j in range(m.shape[0]):
                        pos = m.shape[1] - m.shape[0] + j
                        self.chosen[(self.layer_of[id(a)], s, pos)] = set(m[j].nonzero().squeeze(1).tolist())
        return out, masks


def check_against(model, ckpt):
    """-> (our result, our DSA selections). Asserts the stated tolerance at every step, and that every
    query's DSA selection is transformers' (up to near-tied pools: selection_gap)."""
    eng = Engine(ckpt)
    prompts = default_prompts(STREAMS, eng.cfg.vocab_size, seed=7)
    ours = []
    spy = SelectionSpy(eng)
    glm5.mla_forward = spy
    try:
        res = eng.generate(prompts, TOKENS, on_step=lambda step, logits: ours.append(logits.clone()))
    finally:
        glm5.mla_forward = spy.real
    ref, ref_chosen = reference_logits(model, prompts, res.tokens)
    assert spy.chosen.keys() == ref_chosen.keys()
    kp = eng.model.mla_args.kpool
    gaps = {k: selection_gap(spy.chosen[k], *ref_chosen[k], kp, k[2]) for k in ref_chosen}
    differ = [k for k in gaps if spy.chosen[k] != ref_chosen[k][0]]
    print(f"DSA selections differing: {len(differ)}/{len(gaps)}, at most {max(gaps.values()):.4f} of the "
          f"largest pool score apart")
    for k, g in gaps.items():
        assert g <= SELECTION_TIE, f"DSA selection differs from transformers' at (layer, stream, position) {k}, " \
            f"pools {g:.3f} of the best score apart: ours {sorted(spy.chosen[k])}, reference {sorted(ref_chosen[k][0])}"
    assert_logits_close(ref, ours, res.tokens, RTOL, ATOL, MARGIN, outliers=1, outlier_factor=OUTLIER)
    assert spy.picked_in_prefill, "no prefill row went past a short context: the sparse prefill was not checked"
    return res, spy.chosen


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_matches_transformers(variant, tmp_path):
    model = build_hf(variant)
    save_nested(model, tmp_path / "nested")
    ckpt = tmp_path / "nested"
    if variant == "flat":
        save_flat(tmp_path / "nested", tmp_path / "flat")
        ckpt = tmp_path / "flat"
        assert "lm_head.weight" not in _names(ckpt)  # tied: the engine reads the embeddings
    ref = Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "nested", dtype=torch.float32).eval()
    _, chosen = check_against(ref, str(ckpt))
    # the contexts covered: all visible up to index_topk (+ the tail), sparse beyond, every pool phase
    v = VARIANTS[variant]
    topk, kp = v["index_topk"], v["index_kpool"]
    seen = [(pos + 1, len(sel)) for (_, _, pos), sel in chosen.items()]      # (context, tokens attended)
    assert any(n <= topk and k == n for n, k in seen)
    assert any(n > topk + kp and k < n for n, k in seen)
    assert all(k == n for n, k in seen if n < topk + kp)
    assert all(k <= topk + kp - 1 for n, k in seen)
    assert {n % kp for n, k in seen if n > topk + kp} == set(range(kp))


def _names(ckpt):
    from safetensors import safe_open
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return list(f.keys())


def _hf_param(disk_name: str) -> str:
    """Flat on-disk Linear name -> the transformers parameter holding it (minus '.weight')."""
    n = disk_name.replace("model.", "model.language_model.", 1)
    return n.replace(".self_attn.f_a_proj", ".self_attn.forget_gate.f_a_proj") \
            .replace(".self_attn.f_b_proj", ".self_attn.forget_gate.f_b_proj")


def _dequantised_reference(nested_dir, tensors):
    """fp32 transformers model whose Linears hold exactly the dequantised NVFP4 weights."""
    ref = Glm5NextForConditionalGeneration.from_pretrained(nested_dir, dtype=torch.float32).eval()
    sd = ref.state_dict()
    with torch.no_grad():
        for name in tensors:
            if not name.endswith(".weight_scale_2"):
                continue
            mod = name[: -len(".weight_scale_2")]
            w = nvfp4.dequantize(tensors[mod + ".weight"], tensors[mod + ".weight_scale"], tensors[name])
            if ".mlp.experts." in mod:
                pre, e, proj = _hf_param(mod).rsplit(".", 2)
                e = int(e)
                if proj == "down_proj":
                    sd[pre + ".down_proj"][e].copy_(w)
                else:
                    i = w.shape[0]
                    off = 0 if proj == "gate_proj" else i
                    sd[pre + ".gate_up_proj"][e, off:off + i].copy_(w)
            else:
                sd[_hf_param(mod) + ".weight"].copy_(w)
    return ref


@pytest.mark.parametrize("quant_all", [False, True], ids=["nvfp4_experts", "nvfp4_all"])
def test_nvfp4_matches_transformers_on_dequantised_weights(quant_all, tmp_path):
    model = build_hf("flat", seed=1)
    save_nested(model, tmp_path / "nested")
    q = save_flat(tmp_path / "nested", tmp_path / "q", quant_all)
    packed = [k for k, v in q.items() if v.dtype == torch.uint8]
    v = VARIANTS["flat"]
    n_moe = v["mlp_layer_types"].count("sparse")
    assert sum(".mlp.experts." in k for k in packed) == 3 * v["n_routed_experts"] * n_moe
    assert any(".self_attn." in k for k in packed) == quant_all
    check_against(_dequantised_reference(tmp_path / "nested", q), str(tmp_path / "q"))


def _router_without_bias(mp):
    from rocket_mpi import ops
    real = ops.route_ref
    mp.setattr(ops, "route_ref", lambda x, w, b, cfg: real(x, w, torch.zeros_like(b), cfg))


def _dense_attention(mp):
    from rocket_mpi.model.glm5_next_mla import PoolSelection
    mp.setattr("rocket_mpi.model.glm5_next_mla._select",
               lambda ix, c, s, p0, n, q, w, a: PoolSelection(p0, n, [(0, n, None, None)]))  # all of the past


def _kda_conv_reset(mp):
    real = glm5.kda_forward
    mp.setattr(glm5, "kda_forward", lambda a, h, conv, rec, seg, args, **kw: real(a, h, conv.zero_(), rec, seg, args,
                                                                                **kw))


def _indexer_without_ape(mp):
    real = glm5.Glm5NextModel.load

    def load(reader):
        m = real(reader)
        for L in m.layers:
            if L.mla is not None and L.mla.indexer is not None:
                L.mla.indexer.ape.zero_()
        return m
    mp.setattr(glm5.Glm5NextModel, "load", staticmethod(load))


SENSITIVITY = {
    "router_bias": _router_without_bias,       # routing without e_score_correction_bias
    "dense_attention": _dense_attention,       # DSA off: every query sees its whole causal context
    "kda_conv_reset": _kda_conv_reset,         # the KDA conv cache lost between steps
    "indexer_ape": _indexer_without_ape,       # k-pool keys without the per-slot bias
}


@pytest.mark.parametrize("bug", list(SENSITIVITY))
def test_oracle_is_sensitive(bug, tmp_path, monkeypatch):
    """The same check fails on a real bug: the tolerance is not loose."""
    model = build_hf("nested")
    save_nested(model, tmp_path)
    ref = Glm5NextForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    SENSITIVITY[bug](monkeypatch)
    with pytest.raises(AssertionError, match="logit diff|below the reference|DSA selection differs") as e:
        check_against(ref, str(tmp_path))
    print(bug, "->", str(e.value).splitlines()[0])


def test_static_fire_glm5_tiny(tmp_path):
    make_checkpoint("glm5-tiny", str(tmp_path), seed=3)
    r = rocket("static-fire", "--checkpoint", str(tmp_path), "--ranks", "2", "--sweep", "1,4", "--tokens", "6",
               "--fabric", "shm", "--prefill-chunk", "8", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STATIC FIRE PASS" in r.stdout
