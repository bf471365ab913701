"""GLM-5 (glm_moe_dsa) config.json -> the common keys: MLA and DSA shapes, indexer and MoE layer schedules; and
DeepSeek-V3's (deepseek_v3: the same MLA and MoE without the DSA indexer, with YaRN rope), which the same model runs."""
from __future__ import annotations

from rocket_mpi.errors import ConfigError

# MLA / DSA shapes: no silent GLM-5 defaults, a checkpoint must say them
_REQUIRED = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "index_head_dim", "index_n_heads", "index_topk")
# transformers' GlmMoeDsaConfig defaults where they differ from ModelConfig's key map
_DEFAULTS = {"first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
             "norm_topk_prob": True, "attention_bias": False, "rms_norm_eps": 1e-5}


def normalize_config(raw: dict, source: str) -> dict:
    """config.json of GlmMoeDsaForCausalLM -> the common keys, plus moe_layer_indices and indexer_types."""
    raw = _checked(raw, _REQUIRED, _DEFAULTS, source)
    n = raw["num_hidden_layers"]
    # MLA expands one latent to every head: there are no KV-head groups (GlmMoeDsaConfig's default 64 is
    # unused by its attention), so the common key is pinned to the head count
    raw["num_key_value_heads"] = raw["num_attention_heads"]
    if raw["qk_rope_head_dim"] % 2 or raw["index_head_dim"] < raw["qk_rope_head_dim"]:
        raise ConfigError(f"{source}: qk_rope_head_dim {raw['qk_rope_head_dim']} must be even and at most "
                          f"index_head_dim {raw['index_head_dim']}")
    # transformers points head_dim at the rope slice and ropes all of it (partial_rotary_factor unused)
    raw["head_dim"] = raw["qk_rope_head_dim"]
    raw["rope_parameters"] = {**(raw.get("rope_parameters") or {}), "partial_rotary_factor": 1.0}
    raw["indexer_types"] = _indexer_types(raw, n, source)
    raw["moe_layer_indices"] = _moe_layers(raw, n, source)
    return raw


def _checked(raw: dict, required: tuple[str, ...], defaults: dict, source: str) -> dict:
    """A copy of raw whose layer and head counts and `required` shapes are positive integers (else one error naming
    the key), with the family's defaults where raw leaves a key out."""
    for key in ("num_hidden_layers", "num_attention_heads", *required):
        v = raw.get(key)
        if v is None:
            raise ConfigError(f"{source}: missing required field '{key}'")
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{source}: '{key}' must be a positive integer, got {v!r}")
    return {**raw, **{k: v for k, v in defaults.items() if raw.get(k) is None}}


def _indexer_types(raw: dict, n: int, source: str) -> list[str]:
    """Per layer "full" (own indexer) or "shared" (previous full layer's top-k), as GlmMoeDsaConfig derives it."""
    types = raw.get("indexer_types")
    if types is None:
        pattern = raw.get("index_topk_pattern")
        if pattern is not None:
            letters = {"F": "full", "S": "shared"}
            if isinstance(pattern, str) and not set(pattern) <= set(letters):
                raise ConfigError(f"{source}: index_topk_pattern '{pattern}' may hold only F and S")
            types = [letters[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq = max(raw.get("index_topk_freq", 1), 1)
            offset = raw.get("index_skip_topk_offset", 2)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    types = list(types)
    if len(types) != n or not set(types) <= {"full", "shared"}:
        raise ConfigError(f"{source}: indexer_types must list 'full' or 'shared' for each of {n} layers, got {types}")
    if types[0] != "full":
        raise ConfigError(f"{source}: indexer_types[0] is 'shared' but no earlier layer runs an indexer")
    return types


def _moe_layers(raw: dict, n: int, source: str) -> list[int]:
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        k = raw["first_k_dense_replace"]
        return list(range(min(k, n), n))
    if len(kinds) != n or not set(kinds) <= {"dense", "sparse"}:
        raise ConfigError(f"{source}: mlp_layer_types must list 'dense' or 'sparse' for each of {n} layers, "
                          f"got {kinds}")
    return [i for i, kind in enumerate(kinds) if kind == "sparse"]


# DeepSeek-V3 (DeepSeek-V3 / R1, and the models built on its architecture): MLA over every position (no indexer)
_DSV3_REQUIRED = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# transformers' DeepseekV3Config defaults where they differ from ModelConfig's key map
_DSV3_DEFAULTS = {"first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                  "norm_topk_prob": True, "attention_bias": False, "rms_norm_eps": 1e-6}


def normalize_deepseek_v3(raw: dict, source: str) -> dict:
    """config.json of DeepseekV3ForCausalLM -> the common keys, as normalize_config gives GLM-5's, with no indexer
    (indexer_types "none": every layer attends over every position) and the rope's YaRN settings in raw["yarn"]."""
    if raw.get("q_lora_rank", 0) is None:
        raise ConfigError(f"{source}: 'q_lora_rank' is null (queries without the low-rank projection, as "
                          f"DeepSeek-V2-Lite): not supported")
    if raw.get("rope_interleave", True) is not True:
        raise ConfigError(f"{source}: 'rope_interleave' false (rotate-half rope on MLA) is not supported")
    # the router GLM's kernels implement: sigmoid scores, the correction bias for the choice, group-limited top-k
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if raw.get(key, want) != want:
            raise ConfigError(f"{source}: '{key}' is {raw[key]!r}; only {want!r} (DeepSeek-V3's) is supported")
    raw = _checked(raw, _DSV3_REQUIRED, _DSV3_DEFAULTS, source)
    n = raw["num_hidden_layers"]
    raw["num_key_value_heads"] = raw["num_attention_heads"]
    if raw["qk_rope_head_dim"] % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim {raw['qk_rope_head_dim']} must be even")
    raw["head_dim"] = raw["qk_rope_head_dim"]
    raw["yarn"], theta = _yarn(raw, source)
    raw.pop("rope_scaling", None)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 1.0}
    raw["indexer_types"] = ["none"] * n
    raw.update(index_n_heads=0, index_head_dim=0, index_topk=0)
    raw["moe_layer_indices"] = _moe_layers(raw, n, source)
    return raw


def _yarn(raw: dict, source: str) -> tuple[dict | None, float]:
    """(the YaRN settings of the rope, as transformers' _compute_yarn_parameters reads them, or None for the plain
    rope; rope_theta). rope_parameters (transformers 5) or rope_scaling (the published config.json)."""
    rp, legacy = raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}
    if not isinstance(rp, dict) or not isinstance(legacy, dict):
        raise ConfigError(f"{source}: 'rope_parameters' and 'rope_scaling' must be objects")
    p = {**legacy, **rp}
    theta = p.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = p.get("rope_type", p.get("type", "default"))
    if kind == "default":
        return None, theta
    if kind != "yarn":
        raise ConfigError(f"{source}: rope_type '{kind}' is not supported here (default or yarn)")
    orig = p.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    factor = p.get("factor")
    for key, v in (("original_max_position_embeddings", orig), ("factor", factor if factor is not None else 1)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ConfigError(f"{source}: rope '{key}' must be a positive number, got {v!r}")
    return {"factor": factor, "original_max_position_embeddings": orig, "beta_fast": p.get("beta_fast"),
            "beta_slow": p.get("beta_slow"), "mscale": p.get("mscale"), "mscale_all_dim": p.get("mscale_all_dim"),
            "attention_factor": p.get("attention_factor"), "truncate": p.get("truncate", True)}, theta
