"""Tensor specs of a preset checkpoint, and each tensor's deterministic random values.

A spec is (name, shape, kind); make_tensor(seed, name, shape, kind) draws a tensor from its own generator seeded by
(seed, name), so its values do not depend on which other tensors exist or on the sharding. tensor_specs is the
GLM-4.x family's; make_dsa.py and make_glm5.py hold the other families' and reuse the helpers here.
"""
from __future__ import annotations

import math
import zlib

import torch


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF)


def _randn(seed, name, shape, std):
    return torch.randn(shape, generator=_gen(seed, name)) * std


def tensor_specs(cfg: dict):
    """(name, shape, kind) of every tensor, kind in {linear, expert, norm, embed, router, bias, attn_bias}."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    yield "model.embed_tokens.weight", (cfg["vocab_size"], h), "embed"
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), "norm"
        yield f"{p}.post_attention_layernorm.weight", (h,), "norm"
        for proj, n in (("q_proj", nq * d), ("k_proj", nkv * d), ("v_proj", nkv * d)):
            yield f"{p}.self_attn.{proj}.weight", (n, h), "linear"
            if cfg["attention_bias"]:
                yield f"{p}.self_attn.{proj}.bias", (n,), "attn_bias"
        yield f"{p}.self_attn.o_proj.weight", (h, nq * d), "linear"
        if cfg["use_qk_norm"]:
            yield f"{p}.self_attn.q_norm.weight", (d,), "norm"
            yield f"{p}.self_attn.k_norm.weight", (d,), "norm"
        yield from mlp_specs(p, cfg, dense=i < cfg["first_k_dense_replace"])
    yield from head_specs(cfg)


def swiglu_specs(prefix: str, hidden: int, inter: int, kind: str = "linear"):
    for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
        yield f"{prefix}.{proj}.weight", shape, kind


def mlp_specs(p: str, cfg: dict, dense: bool):
    """Layer p's MLP: a dense SwiGLU, or the MoE block (router, correction bias, shared and routed experts)
    every family here stores the same way."""
    h, e, mi = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    if dense:
        yield from swiglu_specs(f"{p}.mlp", h, cfg["intermediate_size"])
        return
    yield f"{p}.mlp.gate.weight", (e, h), "router"
    yield f"{p}.mlp.gate.e_score_correction_bias", (e,), "bias"
    yield from swiglu_specs(f"{p}.mlp.shared_experts", h, mi * cfg["n_shared_experts"])
    for x in range(e):
        yield from swiglu_specs(f"{p}.mlp.experts.{x}", h, mi, "expert")


def head_specs(cfg: dict):
    yield "model.norm.weight", (cfg["hidden_size"],), "norm"
    yield "lm_head.weight", (cfg["vocab_size"], cfg["hidden_size"]), "linear"


def router_bias(seed: int, name: str, shape, skew: float = 0.0, device=None) -> torch.Tensor:
    """A router's e_score_correction_bias [E] fp32: small noise, and with skew S > 0 a Zipf-like popularity: the
    experts ranked by a permutation drawn from (seed, name) get -S * log(1 + rank) / log(E), so a few experts win
    the top-k far more often than the rest, as real routing does (a different ranking in every layer)."""
    g = _gen(seed, name) if device is None else torch.Generator(device=device).manual_seed(
        _gen(seed, name).initial_seed())
    noise = (torch.rand(shape, generator=g, device=device) - 0.5) * 0.1
    if not skew:
        return noise
    n = shape[0]
    rank = torch.randperm(n, generator=_gen(seed + 1, name)).to(noise.device).float()
    return noise - skew * torch.log1p(rank) / math.log(max(n, 2))


def make_tensor(seed: int, name: str, shape, kind: str, skew: float = 0.0) -> torch.Tensor:
    """Realistic magnitudes: linears N(0, 0.02), norms near 1, a non-zero correction bias (skewed: router_bias)."""
    if kind == "norm":
        return (1.0 + _randn(seed, name, shape, 0.1)).to(torch.bfloat16)
    if kind == "bias":
        return router_bias(seed, name, shape, skew)   # fp32, like real checkpoints
    if kind == "router":
        return _randn(seed, name, shape, 0.02)                              # fp32 router weight
    if kind == "attn_bias":
        return _randn(seed, name, shape, 0.1).to(torch.bfloat16)
    if kind == "embed":
        return _randn(seed, name, shape, 1.0).to(torch.bfloat16)
    return _randn(seed, name, shape, 0.02).to(torch.bfloat16)
