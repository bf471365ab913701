"""make-checkpoint: deterministic random GLM-4.x MoE checkpoints of preset shapes (never downloads).

Each tensor is drawn from its own generator seeded by (seed, tensor name), so a tensor's values do
not depend on which other tensors exist or on how the checkpoint is sharded.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from rocket_mpi.checkpoint import make_dsa, make_glm5
from rocket_mpi.checkpoint.specs import make_tensor, tensor_specs
from rocket_mpi.config import QuantConfig
from rocket_mpi.errors import RocketError
from rocket_mpi.ops import nvfp4

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


# The other families' presets and tensor specs (each module: PRESETS {name: full config.json dict}, tensor_specs)
FAMILY_MODULES = (make_dsa, make_glm5)


def _family_for_preset(preset: str):
    return next((mod for mod in FAMILY_MODULES if preset in mod.PRESETS), None)


def all_presets() -> list[str]:
    return list(PRESETS) + [name for mod in FAMILY_MODULES for name in mod.PRESETS]


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


def exclude_patterns(cfg: dict, quant_all: bool, head: bool = False) -> list[str]:
    """The modules left BF16: the routers always; lm_head unless `head` (with quant_all: every Linear, lm_head too, as
    llama.cpp's Q4_K_M quantises it); without quant_all everything but the routed experts."""
    pats = (["lm_head"] if not (quant_all and head) else []) + ["*.mlp.gate"]
    if not quant_all:
        pats += ["*.self_attn.*", "*.shared_experts.*"]
        pats += [f"model.layers.{i}.mlp.*" for i in range(cfg["first_k_dense_replace"])]
    return pats


def quantize_tensors(tensors: dict[str, torch.Tensor], cfg: dict, quant_all: bool,
                     head: bool = False) -> dict[str, torch.Tensor]:
    """Quantise Linears the way ModelOpt's HF export does; gate and up of one expert share weight_scale_2."""
    q = QuantConfig(exclude_modules=tuple(exclude_patterns(cfg, quant_all, head)))
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
        _readable(os.path.join(out_dir, "model.safetensors"))
    else:
        per = -(-len(names) // shards)
        weight_map = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k * per:(k + 1) * per]}
            save_file(part, os.path.join(out_dir, fname), metadata={"format": "pt"})
            _readable(os.path.join(out_dir, fname))
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if tokenizer:
        write_tokenizer(out_dir, cfg["vocab_size"])
        write_chat_files(out_dir, cfg)


def _readable(path: str) -> None:
    """The mode a file written with open() gets (safetensors writes 0600): the checkpoint's files alike."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_tokenizer(out_dir: str, vocab_size: int) -> None:
    """A byte-level BPE trained on a fixed paragraph: text in and out, ids within the model's vocab."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<bos>", "<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    # The chat markers become special tokens appended after the trained ids (which they leave unchanged), but only
    # where they fit below vocab_size (the embedding's rows); else the chat template's markers stay plain text.
    if tok.get_vocab_size() + len(CHAT_SPECIAL_TOKENS) <= vocab_size:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIAL_TOKENS])
    tok.save(os.path.join(out_dir, "tokenizer.json"))


# GLM-4.5's chat format in spirit: "[gMASK]<sop>", then "<|role|>\n" + content per message, then "<|assistant|>\n"
CHAT_SPECIAL_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role ' ~ message['role'] ~ ' is not one of system, user, assistant') }}"
    "{% endif %}"
    "{{ '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def write_chat_files(out_dir: str, cfg: dict) -> None:
    """tokenizer_config.json (the chat template, bos/eos tokens) and generation_config.json, as HF stores them."""
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}, f, indent=2)
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    gen = {"eos_token_id": eos}
    if cfg.get("bos_token_id") is not None:
        gen["bos_token_id"] = cfg["bos_token_id"]
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)


MAX_DISK_BYTES = 64 * 2**30


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_checkpoint(preset: str, out_dir: str, seed: int = 0, nvfp4_experts: bool = False,
                    nvfp4_all: bool = False, shards: int = 1, tokenizer: bool = True, skew: float = 0.0,
                    nvfp4_head: bool = False) -> dict:
    """skew: the routers' expert popularity (specs.router_bias; 0: uniform). nvfp4_head: every Linear NVFP4, lm_head
    too (nvfp4_all leaves it BF16, as ModelOpt does)."""
    cfg = config_dict(preset)
    fam = _family_for_preset(preset)
    specs = list(fam.tensor_specs(cfg) if fam is not None else tensor_specs(cfg))
    nbytes = sum(2 * _numel(shape) for _, shape, _ in specs)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if nbytes > min(MAX_DISK_BYTES, ram // 2):  # the whole state dict is built in memory before writing
        raise RocketError(f"--preset {preset}: {nbytes / 2**30:.0f} GiB in BF16 is too large to write here "
                          f"({ram / 2**30:.0f} GiB RAM); decode it straight from memory with "
                          f"--checkpoint preset:{preset}")
    tensors = {name: make_tensor(seed, name, shape, kind, skew) for name, shape, kind in specs}
    quant = None
    if nvfp4_experts or nvfp4_all or nvfp4_head:
        tensors = quantize_tensors(tensors, cfg, nvfp4_all or nvfp4_head, nvfp4_head)
        quant = exclude_patterns(cfg, nvfp4_all or nvfp4_head, nvfp4_head)
    write_checkpoint(out_dir, cfg, tensors, quant, shards, tokenizer and cfg["vocab_size"] >= 258)
    return cfg
