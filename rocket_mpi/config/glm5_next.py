"""GLM-5.3-Flash (glm5_next) config.json -> the common keys: the text model's fields, per-layer schedules, checks."""
from __future__ import annotations

from rocket_mpi.errors import ConfigError

# transformers' Glm5NextTextConfig defaults: a key missing from config.json means this value.
TEXT_DEFAULTS = dict(
    vocab_size=154880, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=45,
    num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=288,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=0, v_head_dim=256,
    qk_nope_head_dim=256, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu",
    max_position_embeddings=1048576, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
    index_topk=2048, index_head_dim=128, index_n_heads=32, swiglu_limit=10.0, linear_head_dim=128,
    linear_num_heads=64, linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6,
    hc_sinkhorn_iters=20, index_kpool=16, index_kpool_always_select_tail=True,
)


def normalize_config(raw: dict, source: str) -> dict:
    """Lift a nested text_config, fill transformers' defaults and per-layer schedules, check them."""
    top = dict(raw)
    text = top.pop("text_config", None)
    top.pop("vision_config", None)
    if text is not None and not isinstance(text, dict):
        raise ConfigError(f"{source}: 'text_config' must be an object")
    cfg = {**top, **(text or {})}
    if text is not None:  # lm_head belongs to the outer model; eos usually lives there too
        for k in ("tie_word_embeddings", "eos_token_id"):
            if top.get(k) is not None:
                cfg[k] = top[k]
    cfg["model_type"] = raw["model_type"]
    if "num_local_experts" in cfg and "n_routed_experts" not in cfg:
        cfg["n_routed_experts"] = cfg["num_local_experts"]
    lin = cfg.pop("linear_attn_config", None)
    if lin:
        for key, sub in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                         ("linear_conv_kernel_dim", "short_conv_kernel_size"),
                         ("linear_lower_bound", "gate_lower_bound")):
            if sub in lin:
                cfg[key] = lin[sub]
        if lin.get("safe_gate", True) and cfg.get("linear_lower_bound", -5.0) is None:
            cfg["linear_lower_bound"] = -5.0
    for k, v in TEXT_DEFAULTS.items():
        cfg.setdefault(k, v)
    if cfg.get("num_key_value_heads") is None:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    n = cfg["num_hidden_layers"]
    if cfg.get("mlp_layer_types") is None:
        cfg["mlp_layer_types"] = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
    if cfg.get("layer_types") is None:
        cfg["layer_types"] = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    cfg["layer_types"] = ["indexed_attention" if t == "full_attention" else t for t in cfg["layer_types"]]
    if cfg.get("indexer_types") is None:
        pattern = cfg.get("index_topk_pattern")
        if pattern is not None:
            cfg["indexer_types"] = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) \
                else list(pattern)
        else:
            freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
            cfg["indexer_types"] = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    _check(cfg, source)
    cfg["moe_layer_indices"] = [i for i, t in enumerate(cfg["mlp_layer_types"]) if t == "sparse"]
    if "first_k_dense_replace" not in cfg:
        cfg["first_k_dense_replace"] = next((i for i, t in enumerate(cfg["mlp_layer_types"]) if t == "sparse"), n)
    # NoPE: MLA carries no rotary part (qk_rope_head_dim 0). head_dim and the rope entry only satisfy
    # ModelConfig's common fields; nothing here reads them.
    cfg["head_dim"] = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    return cfg


def _check(cfg: dict, src: str) -> None:
    n = cfg["num_hidden_layers"]
    for key, allowed in (("layer_types", ("linear_attention", "indexed_attention")),
                         ("mlp_layer_types", ("dense", "sparse")), ("indexer_types", ("full", "shared"))):
        v = cfg[key]
        if len(v) != n:
            raise ConfigError(f"{src}: '{key}' has {len(v)} entries for {n} layers")
        bad = [x for x in v if x not in allowed]
        if bad:
            raise ConfigError(f"{src}: '{key}' value {bad[0]!r} is not one of {', '.join(allowed)}")
    if cfg["qk_rope_head_dim"]:
        raise ConfigError(f"{src}: qk_rope_head_dim {cfg['qk_rope_head_dim']}: GLM-5.3-Flash MLA is NoPE (0)")
    if cfg["num_attention_heads"] != cfg["num_key_value_heads"]:
        raise ConfigError(f"{src}: num_key_value_heads must equal num_attention_heads for MLA")
    if cfg["index_kpool"] < 1 or cfg["index_topk"] % cfg["index_kpool"]:
        raise ConfigError(f"{src}: index_topk {cfg['index_topk']} is not a multiple of index_kpool "
                          f"{cfg['index_kpool']}")
    if cfg["q_lora_rank"] is None:
        raise ConfigError(f"{src}: q_lora_rank is required (the DSA indexer reads the q LoRA)")
    types, idx = cfg["layer_types"], cfg["indexer_types"]
    for i in range(n):
        if types[i] == "indexed_attention" and idx[i] == "shared":
            if i == 0 or types[i - 1] != "indexed_attention" or idx[i - 1] != "full":
                raise ConfigError(f"{src}: layer {i} shares the DSA selection, but layer {i - 1} is not an "
                                  f"indexed_attention layer with its own ('full') indexer")
