"""GLM-5 (glm_moe_dsa) config.json -> the common keys: MLA and DSA shapes, indexer and MoE layer schedules."""
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
    raw = dict(raw)
    for key in ("num_hidden_layers", "num_attention_heads", *_REQUIRED):
        v = raw.get(key)
        if v is None:
            raise ConfigError(f"{source}: missing required field '{key}'")
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{source}: '{key}' must be a positive integer, got {v!r}")
    for key, v in _DEFAULTS.items():
        if raw.get(key) is None:
            raw[key] = v
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
