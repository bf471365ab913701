"""make-checkpoint presets of the GLM-5 family (glm_moe_dsa): MLA + DSA indexer, 256-expert MoE; and of DeepSeek-V3's
(deepseek_v3: the same MLA and MoE without the indexer, YaRN rope).

make.py lists this module in FAMILY_MODULES; PRESETS holds full config.json dicts and
tensor_specs(cfg) names every tensor as GlmMoeDsaForCausalLM.save_pretrained writes it.
"""
from __future__ import annotations

from rocket_mpi.checkpoint import specs


def _config(**kw) -> dict:
    base = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "norm_topk_prob": True, "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "attention_bias": False,
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None, "initializer_range": 0.02,
            "n_shared_experts": 1, "routed_scaling_factor": 2.5}
    base.update(kw)
    n = base["num_hidden_layers"]
    base.setdefault("num_key_value_heads", base["num_attention_heads"])
    base.setdefault("head_dim", base["qk_rope_head_dim"])
    base.setdefault("indexer_types", ["full"] * n)
    base.setdefault("mlp_layer_types", ["dense"] * base["first_k_dense_replace"]
                    + ["sparse"] * (n - base["first_k_dense_replace"]))
    return base


PRESETS: dict[str, dict] = {
    # tests: every feature on (attention bias, a shared-indexer layer, groups); index_topk 8 so the
    # default prompts (3..13 tokens) plus a few decoded ones run both below and above it
    "dsa-tiny": _config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=16, v_head_dim=16, index_n_heads=2, index_head_dim=32, index_topk=8,
                        indexer_types=["full", "full", "shared"], moe_intermediate_size=32, n_routed_experts=16,
                        num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                        attention_bias=True, max_position_embeddings=512),
    # the main job: 64 experts, top-8, GLM-5's proportions scaled down; index_topk 64 < long prompts
    "dsa-default": _config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                           num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
                           qk_rope_head_dim=32, v_head_dim=64, index_n_heads=8, index_head_dim=64, index_topk=64,
                           moe_intermediate_size=128, n_routed_experts=64, num_experts_per_tok=8, n_group=8,
                           topk_group=4, first_k_dense_replace=1, max_position_embeddings=4096),
    # GLM-5 (zai-org/GLM-5) as published: 78 layers, 3 dense, 256 experts (about 744 B parameters, 1.5 TB
    # in BF16): a reference shape for byte counts, not something to write to disk
    "glm5": _config(vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_hidden_layers=78,
                    num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
                    qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048,
                    moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_group=1,
                    topk_group=1, first_k_dense_replace=3, max_position_embeddings=202752,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    eos_token_id=[154820, 154827, 154829]),
}


def _dsv3_config(**kw) -> dict:
    base = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "norm_topk_prob": True, "dtype": "bfloat16",
            "rope_theta": 10000.0, "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
            "pad_token_id": None, "initializer_range": 0.02, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
            "rope_interleave": True}
    base.update(kw)
    base.setdefault("num_key_value_heads", base["num_attention_heads"])
    return base


PRESETS.update({
    # tests: DeepSeek-V3's architecture, tiny, with YaRN (factor 4 over 128 pretraining positions: the ramp falls inside
    # the rope's 8 frequencies) and group-limited routing
    "dsv3-tiny": _dsv3_config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                              qk_rope_head_dim=16, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=16,
                              num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                              max_position_embeddings=512,
                              rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # DeepSeek-V3 / R1 as published (61 layers, 3 dense, 256 experts, about 671 B parameters): a reference shape for
    # plan's byte counts
    "deepseek-v3": _dsv3_config(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                                num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=2048,
                                n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                                first_k_dense_replace=3, max_position_embeddings=163840,
                                rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                              "mscale_all_dim": 1.0}),
})

# GLM-5's layer shape cut to 4 layers (1 dense + 3 MoE of 256 experts, every indexer full): 3 x 256 experts are
# 58 GB in BF16 (16 GB NVFP4) beside 3.8 GB of embeddings and head, one GPU
PRESETS["glm5-4l"] = {**PRESETS["glm5"], "num_hidden_layers": 4, "first_k_dense_replace": 1,
                      "indexer_types": ["full"] * 4, "mlp_layer_types": ["dense"] + ["sparse"] * 3}


def tensor_specs(cfg: dict):
    """(name, shape, kind) of every tensor, kind as specs.make_tensor takes it."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    ql, c = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, r, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ih, idim = cfg.get("index_n_heads", 0), cfg.get("index_head_dim", 0)
    bias = cfg.get("attention_bias", False)
    n = cfg["num_hidden_layers"]
    indexer_types = cfg.get("indexer_types") or ["none" if cfg.get("model_type") == "deepseek_v3" else "full"] * n
    mlp_types = cfg.get("mlp_layer_types") or (["dense"] * cfg["first_k_dense_replace"]
                                               + ["sparse"] * (n - cfg["first_k_dense_replace"]))
    yield "model.embed_tokens.weight", (cfg["vocab_size"], h), "embed"
    for i in range(n):
        p = f"model.layers.{i}"
        a = p + ".self_attn"
        yield f"{p}.input_layernorm.weight", (h,), "norm"
        yield f"{p}.post_attention_layernorm.weight", (h,), "norm"
        for proj, shape, has_bias in (("q_a_proj", (ql, h), bias), ("q_b_proj", (nh * (nope + r), ql), False),
                                      ("kv_a_proj_with_mqa", (c + r, h), bias),
                                      ("kv_b_proj", (nh * (nope + v), c), False), ("o_proj", (h, nh * v), bias)):
            yield f"{a}.{proj}.weight", shape, "linear"
            if has_bias:
                yield f"{a}.{proj}.bias", (shape[0],), "attn_bias"
        yield f"{a}.q_a_layernorm.weight", (ql,), "norm"
        yield f"{a}.kv_a_layernorm.weight", (c,), "norm"
        if indexer_types[i] == "full":
            yield f"{a}.indexer.wq_b.weight", (ih * idim, ql), "linear"
            yield f"{a}.indexer.wk.weight", (idim, h), "linear"
            yield f"{a}.indexer.k_norm.weight", (idim,), "norm"
            yield f"{a}.indexer.k_norm.bias", (idim,), "attn_bias"
            yield f"{a}.indexer.weights_proj.weight", (ih, h), "linear"
        yield from specs.mlp_specs(p, cfg, dense=mlp_types[i] == "dense")
    yield from specs.head_specs(cfg)
