"""make-checkpoint presets for GLM-5.3-Flash (glm5_next): text-only, flat `model.` tensor names.

Shapes follow transformers' Glm5NextTextConfig; tensor names are the ones transformers writes
(per-expert projections, q/k/v_conv1d, hc_{attn,ffn}_{fn,base,scale}, self_attn.f_a_proj ...).
Values come from specs.py's make_tensor kinds, so a tensor does not depend on which others exist.
"""
from __future__ import annotations

from rocket_mpi.checkpoint import specs

from rocket_mpi.config.glm5_next import TEXT_DEFAULTS, normalize_config

_COMMON = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "dtype": "bfloat16",
           "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None, "initializer_range": 0.02,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "hidden_act": "silu", "norm_topk_prob": True}

# GLM-5.3-Flash: transformers' defaults with the layer schedules written out (KDA x3 then one MLA/DSA
# layer, 3 dense layers then MoE); 45 layers, 288 experts top-8, hidden 4096, vocab 154880.
_FLASH = {**_COMMON, **TEXT_DEFAULTS, "first_k_dense_replace": 3,
          "layer_types": ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(45)],
          "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 42, "indexer_types": ["full"] * 45}

PRESETS: dict[str, dict] = {
    # tests: every feature on and small; KDA, a full indexer whose selection the next (shared) layer
    # reuses, contexts past index_topk (8) within a few tokens, pools of 4
    "glm5-tiny": {**_COMMON, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "num_hidden_layers": 6, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
                  "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 2,
                  "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 0, "qk_nope_head_dim": 16,
                  "v_head_dim": 16, "index_topk": 8, "index_head_dim": 16, "index_n_heads": 8, "index_kpool": 4,
                  "index_kpool_always_select_tail": True,
                  "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                                  "linear_attention", "indexed_attention"],
                  "indexer_types": ["full", "full", "shared", "full", "full", "full"],
                  "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
                  "linear_head_dim": 16, "linear_num_heads": 2, "linear_conv_kernel_dim": 4,
                  "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
                  "swiglu_limit": 10.0, "attention_bias": False, "max_position_embeddings": 512},
    "glm5-flash": _FLASH,
    # the Flash layer shape cut to 4 layers (3 KDA + 1 MLA/DSA; 1 dense + 3 MoE): 3 x 288 experts are
    # 43.5 GB in BF16 (12 GB NVFP4) beside 2.5 GB of embeddings, one GPU
    "glm5-flash-4l": {**_FLASH, "num_hidden_layers": 4, "first_k_dense_replace": 1,
                      "layer_types": ["linear_attention"] * 3 + ["indexed_attention"],
                      "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "indexer_types": ["full"] * 4},
}


def tensor_specs(cfg: dict):
    """(name, shape, kind) of every tensor of a text-only glm5_next checkpoint."""
    c = normalize_config(cfg, "preset")
    h, n = c["hidden_size"], c["hc_mult"]
    yield "model.embed_tokens.weight", (c["vocab_size"], h), "embed"
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), "norm"
        yield f"{p}.post_attention_layernorm.weight", (h,), "norm"
        for kind in ("attn", "ffn"):
            yield f"{p}.hc_{kind}_fn", ((2 + n) * n, n * h), "linear"
            yield f"{p}.hc_{kind}_base", ((2 + n) * n,), "bias"
            yield f"{p}.hc_{kind}_scale", (3,), "norm"
        a = f"{p}.self_attn"
        if c["layer_types"][i] == "linear_attention":
            yield from _kda_specs(a, c)
        else:
            yield from _mla_specs(a, c, c["indexer_types"][i] == "full")
        yield from specs.mlp_specs(p, c, dense=c["mlp_layer_types"][i] == "dense")
    yield from specs.head_specs(c)


def _kda_specs(a: str, c: dict):
    h, nh, dk, k = c["hidden_size"], c["linear_num_heads"], c["linear_head_dim"], c["linear_conv_kernel_dim"]
    d = nh * dk
    for x in "qkv":
        yield f"{a}.{x}_proj.weight", (d, h), "linear"
        yield f"{a}.{x}_conv1d.weight", (d, 1, k), "norm"     # ~1: a moving sum, so q/k/v keep their scale
    yield f"{a}.f_a_proj.weight", (dk, h), "linear"
    yield f"{a}.f_b_proj.weight", (d, dk), "linear"
    yield f"{a}.dt_bias", (d,), "bias"
    yield f"{a}.A_log", (nh,), "bias"
    yield f"{a}.b_proj.weight", (nh, h), "linear"
    yield f"{a}.g_a_proj.weight", (dk, h), "linear"
    yield f"{a}.g_b_proj.weight", (d, dk), "linear"
    yield f"{a}.o_norm.weight", (dk,), "norm"
    yield f"{a}.o_proj.weight", (h, d), "linear"


def _mla_specs(a: str, c: dict, full: bool):
    h, heads, bias = c["hidden_size"], c["num_attention_heads"], c["attention_bias"]
    ql, kl, dq, dv = c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["v_head_dim"]
    for name, shape in (("q_a_proj", (ql, h)), ("kv_a_proj_with_mqa", (kl, h))):
        yield f"{a}.{name}.weight", shape, "linear"
        if bias:
            yield f"{a}.{name}.bias", shape[:1], "attn_bias"
    yield f"{a}.q_a_layernorm.weight", (ql,), "norm"
    yield f"{a}.q_b_proj.weight", (heads * dq, ql), "linear"
    yield f"{a}.kv_a_layernorm.weight", (kl,), "norm"
    yield f"{a}.kv_b_proj.weight", (heads * (dq + dv), kl), "linear"
    yield f"{a}.o_proj.weight", (h, heads * dv), "linear"
    if bias:
        yield f"{a}.o_proj.bias", (h,), "attn_bias"
    if full:
        ih, d, kp = c["index_n_heads"], c["index_head_dim"], c["index_kpool"]
        yield f"{a}.indexer.wq_b.weight", (ih * d, ql), "linear"
        yield f"{a}.indexer.wk.weight", (d, h), "linear"
        yield f"{a}.indexer.k_norm.weight", (d,), "norm"
        yield f"{a}.indexer.k_norm.bias", (d,), "attn_bias"
        yield f"{a}.indexer.weights_proj.weight", (ih, h), "linear"
        yield f"{a}.indexer.index_kpool_compress_ape", (kp, d), "attn_bias"
        yield f"{a}.indexer.index_kpool_compress_gate", (d, h), "linear"
