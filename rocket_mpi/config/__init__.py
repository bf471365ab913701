"""Model configuration from a checkpoint's config.json: one dataclass, an explicit key map.

Every field names the config.json key(s) it is read from, so a missing or unsupported field is
reported by its key and file.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from dataclasses import dataclass, field

from rocket_mpi.config import glm5_next, glm_moe_dsa
from rocket_mpi.errors import ConfigError

PREFILL_CHUNK = 4096  # prompt tokens per prefill forward, all streams together (--prefill-chunk; Engine._forward)

# config.json normalisers (config/<family>.py) of the families whose config differs from the common keys below,
# e.g. lifting a nested text_config; family-only keys stay readable in ModelConfig.raw
_NORMALIZE = {"glm_moe_dsa": glm_moe_dsa.normalize_config, "glm5_next": glm5_next.normalize_config,
              "glm5_next_text": glm5_next.normalize_config,  # glm5_next_text: a config saved from the text model
              "deepseek_v3": glm_moe_dsa.normalize_deepseek_v3}
SUPPORTED_MODEL_TYPES = ("glm4_moe", "glm_moe_dsa", "glm5_next", "glm5_next_text", "deepseek_v3")

_MISSING = object()

# field -> (config.json keys tried in order, default or _MISSING when required)
_KEY_MAP: dict[str, tuple[tuple[str, ...], object]] = {
    "vocab_size": (("vocab_size",), _MISSING),
    "hidden_size": (("hidden_size",), _MISSING),
    "intermediate_size": (("intermediate_size",), _MISSING),
    "num_hidden_layers": (("num_hidden_layers",), _MISSING),
    "num_attention_heads": (("num_attention_heads",), _MISSING),
    "num_key_value_heads": (("num_key_value_heads",), _MISSING),
    "head_dim": (("head_dim",), None),
    "hidden_act": (("hidden_act",), "silu"),
    "max_position_embeddings": (("max_position_embeddings",), _MISSING),
    "rms_norm_eps": (("rms_norm_eps",), 1e-5),
    "tie_word_embeddings": (("tie_word_embeddings",), False),
    "attention_bias": (("attention_bias",), False),
    "use_qk_norm": (("use_qk_norm",), False),
    "moe_intermediate_size": (("moe_intermediate_size",), _MISSING),
    "num_experts_per_tok": (("num_experts_per_tok",), _MISSING),
    "n_routed_experts": (("n_routed_experts", "num_local_experts"), _MISSING),
    "n_shared_experts": (("n_shared_experts",), 1),
    "routed_scaling_factor": (("routed_scaling_factor",), 1.0),
    "n_group": (("n_group",), 1),
    "topk_group": (("topk_group",), 1),
    "first_k_dense_replace": (("first_k_dense_replace",), 1),
    "norm_topk_prob": (("norm_topk_prob",), True),
    "dtype": (("dtype", "torch_dtype"), "bfloat16"),
    "eos_token_id": (("eos_token_id",), None),
}


MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
FP8_BLOCK = "fp8"   # DeepSeek's and GLM's FP8 releases: quant_method "fp8", weight_scale_inv per 128 x 128 block


@dataclass(frozen=True)
class QuantConfig:
    """NVFP4 (or FP8) quantisation: which Linear modules are *not* quantised, and how the checkpoint lays the parts out.

    layout MODELOPT (NVIDIA ModelOpt's export): `weight` (uint8, two E2M1 codes a byte, the low nibble first),
    `weight_scale` (e4m3, one per 16), `weight_scale_2` (fp32, the global factor); exclude_modules are fnmatch
    patterns. layout COMPRESSED_TENSORS (llm-compressor's `nvfp4-pack-quantized`): the same codes as
    `weight_packed`, the same `weight_scale`, and `weight_global_scale` = 1 / weight_scale_2; exclude_modules are its
    `ignore` list (a module's full name, or `re:` and a regular expression matched at its start)."""

    algo: str = "NVFP4"
    group_size: int = 16
    exclude_modules: tuple[str, ...] = ()
    layout: str = MODELOPT
    # algo "FP8" or "NVFP4+FP8" (compressed-tensors groups of both: each weight's dtype says which it is): the FP8
    # weights (float8_e4m3fn, decoded to BF16 at load: ops/fp8.py) have their scale under this name beside them,
    # and the block its entries cover (layout FP8_BLOCK's weight_block_size; compressed-tensors' block strategy)
    fp8_scale: str = "weight_scale"
    fp8_block: tuple[int, int] | None = None

    @property
    def nvfp4(self) -> bool:
        return "NVFP4" in self.algo.split("+")

    @property
    def fp8(self) -> bool:
        return "FP8" in self.algo.split("+")

    def excluded(self, module: str) -> bool:
        if self.layout == COMPRESSED_TENSORS:
            return any(re.match(p[3:], module) is not None if p.startswith("re:") else p == module
                       for p in self.exclude_modules)
        return any(fnmatch.fnmatchcase(module, p) for p in self.exclude_modules)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    use_qk_norm: bool
    moe_intermediate_size: int
    num_experts_per_tok: int
    n_routed_experts: int
    n_shared_experts: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    dtype: str
    eos_token_id: tuple[int, ...]
    rope_theta: float
    partial_rotary_factor: float
    quant: QuantConfig | None = None
    swiglu_limit: float | None = None       # GLM-5.3-Flash clamps the routed experts' SwiGLU
    source: str = field(default="", compare=False)
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # the (normalised) config.json

    # -- derived ---------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """MoE layer indices: a family's normalize_config may list them as raw['moe_layer_indices']."""
        if "moe_layer_indices" in self.raw:
            return tuple(self.raw["moe_layer_indices"])
        return tuple(range(self.first_k_dense_replace, self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        d.pop("raw")
        return d

    # -- loading ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json", quant: QuantConfig | None = None) -> "ModelConfig":
        try:
            return cls._from_dict(raw, source, quant)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            # a value of a type no check above foresaw (a list where an object belongs, a string for a number in a
            # family's own keys): still one line naming the file
            raise ConfigError(f"{source}: a value of the wrong type or shape ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_dict(cls, raw: dict, source: str, quant: QuantConfig | None) -> "ModelConfig":
        mt = raw.get("model_type")
        if mt is None:
            raise ConfigError(f"{source}: missing 'model_type'")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type '{mt}' is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        norm = _NORMALIZE.get(mt)
        if norm is not None:
            raw = norm(raw, source)
        vals: dict = {"model_type": mt, "source": source, "quant": quant, "raw": raw,
                      "swiglu_limit": raw.get("swiglu_limit")}
        for name, (keys, default) in _KEY_MAP.items():
            for k in keys:
                if k in raw and raw[k] is not None:
                    vals[name] = raw[k]
                    break
            else:
                if default is _MISSING:
                    raise ConfigError(f"{source}: missing required field '{keys[0]}'")
                vals[name] = default
        if vals["head_dim"] is None:
            vals["head_dim"] = vals["hidden_size"] // vals["num_attention_heads"]
        vals["eos_token_id"] = _token_ids(vals["eos_token_id"], f"{source}: 'eos_token_id'")
        vals["rope_theta"], vals["partial_rotary_factor"] = _rope(raw, source)
        cfg = cls(**vals)
        cfg.validate()
        return cfg

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str) -> "ModelConfig":
        if os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):
            raise ConfigError(f"--checkpoint {ckpt_dir}: a file, not a checkpoint folder (the folder that holds "
                              f"config.json and the *.safetensors files)")
        path = os.path.join(ckpt_dir, "config.json")
        raw = _read_json(path)
        try:
            quant = read_quant_config(ckpt_dir, raw)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            raise ConfigError(f"{ckpt_dir}: malformed quantization settings ({type(e).__name__}: {e})") from None
        return cls.from_dict(raw, source=path, quant=quant)

    def validate(self) -> None:
        src = self.source
        ints = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts_per_tok",
                "n_routed_experts", "n_group", "topk_group", "max_position_embeddings")
        for name in ints:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{src}: '{name}' must be a positive integer, got {v!r}")
        for name in ("n_shared_experts", "first_k_dense_replace"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{src}: '{name}' must be a non-negative integer, got {v!r}")
        for name in ("rms_norm_eps", "routed_scaling_factor"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or v == float("inf"):
                raise ConfigError(f"{src}: '{name}' must be a positive number, got {v!r}")
        for name in ("tie_word_embeddings", "attention_bias", "use_qk_norm", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{src}: '{name}' must be true or false, got {getattr(self, name)!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"{src}: hidden_act '{self.hidden_act}' is not supported (only 'silu')")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{src}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_key_value_heads}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"{src}: n_routed_experts {self.n_routed_experts} is not a multiple of n_group {self.n_group}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"{src}: topk_group {self.topk_group} > n_group {self.n_group}")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError(f"{src}: num_experts_per_tok {self.num_experts_per_tok} exceeds the experts "
                              f"in topk_group groups")
        if self.n_routed_experts // self.n_group < 2:
            raise ConfigError(f"{src}: group-limited routing needs at least 2 experts per group")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"{src}: partial_rotary_factor {self.partial_rotary_factor} gives an odd or empty "
                              f"rotary dim for head_dim {self.head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(f"{src}: first_k_dense_replace {self.first_k_dense_replace} out of range")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ConfigError(f"{src}: dtype '{self.dtype}' is not supported")
        if self.swiglu_limit is not None and not _number(self.swiglu_limit, f"{src}: 'swiglu_limit'") > 0:
            raise ConfigError(f"{src}: 'swiglu_limit' must be positive, got {self.swiglu_limit!r}")


def _token_ids(v, what: str) -> tuple[int, ...]:
    """An id or a list of ids (config.json's eos_token_id) -> a tuple of non-negative ints."""
    ids = [] if v is None else v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{what} must be a token id or a list of them, got {v!r}")
    return tuple(ids)


def _number(v, what: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or v in (float("inf"), float("-inf")):
        raise ConfigError(f"{what} must be a finite number, got {v!r}")
    return float(v)


def _rope(raw: dict, source: str) -> tuple[float, float]:
    rp = raw.get("rope_parameters") or {}
    legacy_scaling = raw.get("rope_scaling") or {}
    for key, v in (("rope_parameters", rp), ("rope_scaling", legacy_scaling)):
        if not isinstance(v, dict):
            raise ConfigError(f"{source}: '{key}' must be an object, got {v!r}")
    rope_type = rp.get("rope_type", legacy_scaling.get("rope_type", legacy_scaling.get("type", "default")))
    if rope_type != "default":
        raise ConfigError(f"{source}: rope_type '{rope_type}' is not supported (only 'default')")
    theta = rp.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{source}: missing 'rope_parameters.rope_theta' (or 'rope_theta')")
    prf = rp.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))
    if not _number(theta, f"{source}: 'rope_theta'") > 0:
        raise ConfigError(f"{source}: 'rope_theta' must be positive, got {theta!r}")
    return float(theta), _number(prf, f"{source}: 'partial_rotary_factor'")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (is --checkpoint a Hugging Face checkpoint folder?)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


def read_quant_config(ckpt_dir: str, raw_config: dict) -> QuantConfig | None:
    """NVFP4 or FP8 settings from config.json's quantization_config (ModelOpt's, compressed-tensors', DeepSeek's fp8)
    or ModelOpt's hf_quant_config.json (NVFP4, FP8, or MIXED_PRECISION of the two). A compressed-tensors
    quantization_config wins over an hf_quant_config.json left beside it (as transformers and vLLM read such a folder)."""
    qc = raw_config.get("quantization_config")
    cfg_src = os.path.join(ckpt_dir, "config.json") + ":quantization_config"
    if isinstance(qc, dict) and qc.get("quant_method") == COMPRESSED_TENSORS:
        return _compressed_tensors(qc, cfg_src)
    if isinstance(qc, dict) and qc.get("quant_method") == FP8_BLOCK:
        return _fp8_block(qc, cfg_src)
    path = os.path.join(ckpt_dir, "hf_quant_config.json")
    if os.path.exists(path):
        q = _read_json(path).get("quantization", {})
        src, algo, excl = path, q.get("quant_algo"), q.get("exclude_modules") or []
        group = q.get("group_size", 16)
    elif qc:
        q = qc
        src = cfg_src
        method = q.get("quant_method", MODELOPT)
        if method != MODELOPT:
            raise ConfigError(f"{src}: quant_method '{method}' is not supported (NVFP4 as 'modelopt' or "
                              f"'{COMPRESSED_TENSORS}' writes it, FP8 as '{FP8_BLOCK}' or '{COMPRESSED_TENSORS}')")
        algo = q.get("quant_algo", "NVFP4")
        excl = q.get("ignore") or q.get("exclude_modules") or []
        group = q.get("group_size", 16)
        cg = q.get("config_groups")
        if cg:  # newer ModelOpt exports nest the settings as compressed-tensors does
            group = next(iter(cg.values())).get("weights", {}).get("group_size", group)
    else:
        return None
    if algo == "MIXED_PRECISION":  # ModelOpt's per-layer recipe: {module: {"quant_algo": ...}}
        layers = q.get("quantized_layers")
        kinds = {v.get("quant_algo") for v in layers.values()} if isinstance(layers, dict) and layers and all(
            isinstance(v, dict) for v in layers.values()) else None
        if not kinds or not kinds <= {"NVFP4", "FP8"}:
            raise ConfigError(f"{src}: MIXED_PRECISION's quantized_layers must give each layer quant_algo NVFP4 or "
                              f"FP8, got {sorted(map(str, kinds)) if kinds else layers!r}")
        other = sorted({v.get("group_size", 16) for v in layers.values() if v.get("quant_algo") == "NVFP4"} - {16})
        group = other[0] if other else 16
        algo = "+".join(k for k in ("NVFP4", "FP8") if k in kinds)
    if algo not in ("NVFP4", "FP8", "NVFP4+FP8"):
        raise ConfigError(f"{src}: quant_algo '{algo}' is not supported (NVFP4, FP8 or MIXED_PRECISION of them)")
    if "NVFP4" in algo and group != 16:
        raise ConfigError(f"{src}: group_size {group} is not supported (NVFP4 uses 16)")
    # ModelOpt's FP8: a float8_e4m3fn weight and its fp32 weight_scale (per tensor) beside it
    return QuantConfig(algo=algo, group_size=16, exclude_modules=tuple(excl), fp8_scale="weight_scale")


# compressed-tensors' NVFP4: weights of 4-bit floats in groups of 16 along K with one scale per group and one per tensor
_CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
_CT_NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
_CT_FP8_FORMAT = "float-quantized"
_CT_FP8_WEIGHTS = {"num_bits": 8, "type": "float"}


def _compressed_tensors(q: dict, src: str) -> QuantConfig:
    """A compressed-tensors quantization_config whose every group is NVFP4 as `nvfp4-pack-quantized` (llm-compressor's
    NVFP4 and NVFP4A16 schemes), or every group FP8 as `float-quantized` (its FP8 schemes: per tensor, channel, group
    or block; decoded to BF16 at load), or groups of both (each weight's dtype says which). The activations' settings
    are read past: the kernels here are weight-only; a kv_cache_scheme is read past too (the cache stays BF16). What
    would change the weights' meaning is refused: another format or weight type, zero points, sparsity, transforms
    (rotations applied online)."""
    for key, what in (("sparsity_config", "sparse weights"), ("transform_config", "online transforms (rotations)")):
        if q.get(key):
            raise ConfigError(f"{src}: '{key}' is set: {what} are not supported")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{src}: compressed-tensors config without config_groups")
    top = q.get("format")
    kinds, block = set(), None
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise ConfigError(f"{src}: config group '{name}' is not an object")
        fmt = g.get("format") or top
        if fmt not in (_CT_NVFP4_FORMAT, _CT_FP8_FORMAT):
            raise ConfigError(f"{src}: config group '{name}' has format '{fmt}'; only '{_CT_NVFP4_FORMAT}' (NVFP4) "
                              f"and '{_CT_FP8_FORMAT}' (FP8) are supported")
        kinds.add(fmt)
        w = g.get("weights")
        if not isinstance(w, dict):
            raise ConfigError(f"{src}: config group '{name}' has no weights settings")
        want = _CT_NVFP4_WEIGHTS if fmt == _CT_NVFP4_FORMAT else _CT_FP8_WEIGHTS
        for key, value in want.items():
            if w.get(key) != value:
                raise ConfigError(f"{src}: config group '{name}' weights.{key} is {w.get(key)!r}; "
                                  f"{'NVFP4' if fmt == _CT_NVFP4_FORMAT else 'FP8'} needs {value!r}")
        if w.get("symmetric") is False:
            raise ConfigError(f"{src}: config group '{name}' has asymmetric weights (zero points): not supported")
        if fmt == _CT_FP8_FORMAT:
            if w.get("strategy") not in ("tensor", "channel", "group", "block"):
                raise ConfigError(f"{src}: config group '{name}' weights.strategy is {w.get('strategy')!r}; FP8 "
                                  f"takes tensor, channel, group or block")
            if w.get("strategy") == "block":
                b = _block(w.get("block_structure"), f"{src}: config group '{name}' weights.block_structure")
                if block is not None and b != block:
                    raise ConfigError(f"{src}: FP8 config groups with blocks {block} and {b}: one block size only")
                block = b
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ConfigError(f"{src}: 'ignore' must be a list of module names or 're:' patterns")
    for p in ignore:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise ConfigError(f"{src}: 'ignore' pattern {p!r} is not a regular expression ({e})") from None
    if _CT_FP8_FORMAT in kinds:  # FP8 alone, or beside NVFP4 (e.g. NVFP4 gate/up, FP8 attention and down)
        algo = "NVFP4+FP8" if _CT_NVFP4_FORMAT in kinds else "FP8"
        return QuantConfig(algo=algo, group_size=16 if algo != "FP8" else 0, exclude_modules=tuple(ignore),
                           layout=COMPRESSED_TENSORS, fp8_scale="weight_scale", fp8_block=block)
    return QuantConfig(algo="NVFP4", group_size=16, exclude_modules=tuple(ignore), layout=COMPRESSED_TENSORS)


def _block(v, what: str) -> tuple[int, int]:
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                 and x > 0 for x in v)):
        raise ConfigError(f"{what} must be two positive integers, got {v!r}")
    return int(v[0]), int(v[1])


def _fp8_block(q: dict, src: str) -> QuantConfig:
    """DeepSeek's FP8 (and the FP8 releases of GLM): float8_e4m3fn weights, each with `weight_scale_inv` per
    weight_block_size block (a multiplier, despite its name); decoded to BF16 at load."""
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{src}: fmt '{fmt}' is not supported (only e4m3)")
    block = _block(q.get("weight_block_size", [128, 128]), f"{src}: weight_block_size")
    excl = q.get("modules_to_not_convert") or q.get("ignored_layers") or []
    if not isinstance(excl, list) or not all(isinstance(p, str) for p in excl):
        raise ConfigError(f"{src}: 'modules_to_not_convert' must be a list of module names")
    return QuantConfig(algo="FP8", group_size=0, exclude_modules=tuple(excl), layout=FP8_BLOCK,
                       fp8_scale="weight_scale_inv", fp8_block=block)
