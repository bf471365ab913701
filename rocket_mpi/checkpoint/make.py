"""make-checkpoint: deterministic random GLM-4.x MoE checkpoints of preset shapes (never downloads).

Each tensor is drawn from its own generator seeded by (seed, tensor name), so a tensor's values do
not depend on which other tensors exist or on how the checkpoint is sharded.
"""
from __future__ import annotations

import json
import os
import zlib

import torch
from safetensors.torch import save_file

from rocket_mpi.checkpoint import nvfp4
from rocket_mpi.errors import RocketError

PRESETS: dict[str, dict] = {
    # tests: every feature on, odd-ish sizes kept small
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                 n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                 n_shared_experts=1, use_qk_norm=True, attention_bias=True, max_position_embeddings=512,
                 routed_scaling_factor=2.5),
    # the main job: 64 experts, top-8, a few seconds to write and load on a laptop core
    "default": dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64, moe_intermediate_size=128,
                    n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=1,
                    n_shared_experts=1, use_qk_norm=False, attention_bias=True, max_position_embeddings=4096,
                    routed_scaling_factor=2.5),
    # larger: 128 experts, hidden 1024, 12 layers (about 1.3 B parameters)
    "small": dict(vocab_size=16384, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=64, moe_intermediate_size=256,
                  n_routed_experts=128, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                  n_shared_experts=1, use_qk_norm=True, attention_bias=True, max_position_embeddings=8192,
                  routed_scaling_factor=2.5),
    # GLM-4.5-Air's layer shape cut to 8 layers: weights dominate a decode step on one GPU
    "air8": dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=8,
                 num_attention_heads=96, num_key_value_heads=8, head_dim=128, moe_intermediate_size=1408,
                 n_routed_experts=128, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                 n_shared_experts=1, use_qk_norm=False, attention_bias=True, max_position_embeddings=131072,
                 routed_scaling_factor=1.0),
}

CORPUS = (
    "The expert split decodes the same tokens as one machine. Every rank runs the whole non-expert stack "
    "for all streams with the same replicated weights, then the same router, so every rank already knows "
    "the complete row set. Each rank computes the rows of the experts it owns and writes them into every "
    "peer's row buffer at the same offsets, then rings a doorbell. The scatter adds the rows of each token "
    "in ascending expert order in single precision and rounds once. Token parity is a property of the "
    "arrangement, not a tolerance that happens to hold. Hello, world! 0123456789 rocket static fire pass.\n"
)


# Other families add presets from their own modules: each defines PRESETS {name: full config.json dict}
# and tensor_specs(cfg) yielding (name, shape, kind) like the function below.
FAMILY_MODULES = ("rocket_mpi.checkpoint.make_dsa", "rocket_mpi.checkpoint.make_glm5")


def _family_for_preset(preset: str):
    import importlib
    for name in FAMILY_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        if preset in mod.PRESETS:
            return mod
    return None


def all_presets() -> list[str]:
    import importlib
    names = list(PRESETS)
    for name in FAMILY_MODULES:
        try:
            names += list(importlib.import_module(name).PRESETS)
        except ModuleNotFoundError:
            pass
    return names


def config_dict(preset: str) -> dict:
    fam = _family_for_preset(preset)
    if fam is not None:
        return dict(fam.PRESETS[preset])
    if preset not in PRESETS:
        raise RocketError(f"--preset {preset}: unknown (choose from {', '.join(all_presets())})")
    p = dict(PRESETS[preset])
    return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "norm_topk_prob": True, "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None, "initializer_range": 0.02, **p}


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


def make_tensor(seed: int, name: str, shape, kind: str) -> torch.Tensor:
    """Realistic magnitudes: linears N(0, 0.02), norms near 1, a non-zero correction bias."""
    if kind == "norm":
        return (1.0 + _randn(seed, name, shape, 0.1)).to(torch.bfloat16)
    if kind == "bias":
        return (torch.rand(shape, generator=_gen(seed, name)) - 0.5) * 0.1   # fp32, like real checkpoints
    if kind == "router":
        return _randn(seed, name, shape, 0.02)                              # fp32 router weight
    if kind == "attn_bias":
        return _randn(seed, name, shape, 0.1).to(torch.bfloat16)
    if kind == "embed":
        return _randn(seed, name, shape, 1.0).to(torch.bfloat16)
    return _randn(seed, name, shape, 0.02).to(torch.bfloat16)


def exclude_patterns(cfg: dict, quant_all: bool) -> list[str]:
    pats = ["lm_head", "*.mlp.gate"]
    if not quant_all:
        pats += ["*.self_attn.*", "*.shared_experts.*"]
        pats += [f"model.layers.{i}.mlp.*" for i in range(cfg["first_k_dense_replace"])]
    return pats


def quantize_tensors(tensors: dict[str, torch.Tensor], cfg: dict, quant_all: bool) -> dict[str, torch.Tensor]:
    """Quantise Linears the way ModelOpt's HF export does; gate and up of one expert share weight_scale_2."""
    from rocket_mpi.config import QuantConfig
    q = QuantConfig(exclude_modules=tuple(exclude_patterns(cfg, quant_all)))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        is_linear = (module is not None and t.dim() == 2 and "embed_tokens" not in name
                     and not name.endswith("mlp.gate.weight"))
        if not is_linear or q.excluded(module):
            out[name] = t
            continue
        shared_amax = None
        if module.endswith(("gate_proj", "up_proj")):
            sib = module.rsplit(".", 1)[0]
            shared_amax = max(float(tensors[f"{sib}.{p}.weight"].float().abs().max()) for p in ("gate_proj", "up_proj"))
        w, s, s2 = nvfp4.quantize(t.float(), shared_amax)
        out[name], out[module + ".weight_scale"], out[module + ".weight_scale_2"] = w, s, s2
        out[module + ".input_scale"] = torch.tensor(1.0, dtype=torch.float32)  # W4A4 only; W4A16 ignores it
    return out


def write_checkpoint(out_dir: str, cfg: dict, tensors: dict[str, torch.Tensor], quant: list[str] | None,
                     shards: int = 1, tokenizer: bool = True) -> None:
    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(cfg)
    if quant is not None:
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "ignore": quant}
        with open(os.path.join(out_dir, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "rocket_mpi make-checkpoint", "version": "0.1"},
                       "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                        "exclude_modules": quant}}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        per = -(-len(names) // shards)
        weight_map = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k * per:(k + 1) * per]}
            save_file(part, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if tokenizer:
        write_tokenizer(out_dir, cfg["vocab_size"])


def write_tokenizer(out_dir: str, vocab_size: int) -> None:
    """A byte-level BPE trained on a fixed paragraph: text in and out, ids within the model's vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<bos>", "<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))


MAX_DISK_BYTES = 64 * 2**30


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_checkpoint(preset: str, out_dir: str, seed: int = 0, nvfp4_experts: bool = False,
                    nvfp4_all: bool = False, shards: int = 1, tokenizer: bool = True) -> dict:
    cfg = config_dict(preset)
    fam = _family_for_preset(preset)
    specs = list(fam.tensor_specs(cfg) if fam is not None else tensor_specs(cfg))
    nbytes = sum(2 * _numel(shape) for _, shape, _ in specs)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if nbytes > min(MAX_DISK_BYTES, ram // 2):  # the whole state dict is built in memory before writing
        raise RocketError(f"--preset {preset}: {nbytes / 2**30:.0f} GiB in BF16 is too large to write here "
                          f"({ram / 2**30:.0f} GiB RAM); decode it straight from memory with "
                          f"--checkpoint preset:{preset}")
    tensors = {name: make_tensor(seed, name, shape, kind) for name, shape, kind in specs}
    quant = None
    if nvfp4_experts or nvfp4_all:
        tensors = quantize_tensors(tensors, cfg, nvfp4_all)
        quant = exclude_patterns(cfg, nvfp4_all)
    write_checkpoint(out_dir, cfg, tensors, quant, shards, tokenizer and cfg["vocab_size"] >= 258)
    return cfg
