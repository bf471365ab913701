"""FP8 checkpoints, decoded to BF16 at load (ops/fp8.py): DeepSeek's layout (quant_method "fp8", `weight_scale_inv` per
block, which the FP8 releases of DeepSeek-V3 / R1 and of GLM use) and compressed-tensors' `float-quantized`.

Oracles: transformers loads the DeepSeek-layout checkpoint itself (its FP8 integration dequantises on a machine without
a GPU) and its logits are held to the oracle bound; compressed-tensors' own FP8 compressor writes the per-channel
checkpoint's tensors and its own decompression is compared with ours. Every FP8 checkpoint decodes bit for bit as
the BF16 checkpoint of its decoded weights, and the split passes the static fire."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import rocket
from helpers import gpu
from rocket_mpi.checkpoint.make import make_checkpoint
from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.ops import fp8

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] float -> (float8_e4m3fn codes, fp32 scales [ceil(n / bn), ceil(k / bk)]), each block scaled to 448 at its
    largest magnitude: what DeepSeek's FP8 checkpoints hold."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3))                                     # [nb, kb]
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nb * bn, kb * bk)[:n, :k]
    return codes.contiguous(), scale


def test_block_layout_round_trip_and_edges():
    torch.manual_seed(0)
    w = torch.randn(48, 80)
    codes, scale = quantize(w, (32, 32))
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)   # edge blocks cut short
    back = fp8.dequantize(codes, scale, (32, 32), torch.float32)
    assert ((back - w).abs() <= w.abs() * 2 ** -3 + 1e-6).all()          # e4m3: 3 mantissa bits
    assert fp8.layout((2, 3), 48, 80, (32, 32)) == "block"
    assert fp8.layout((48, 1), 48, 80, None) == "row" and fp8.layout((1,), 48, 80, None) == "tensor"
    assert fp8.layout((48, 5), 48, 80, None) == "group" and fp8.layout((3, 3), 48, 80, (32, 32)) is None
    with pytest.raises(ValueError, match="does not cover"):
        fp8.dequantize(codes, torch.ones(3, 3), (32, 32))


def _linear_names(t: dict) -> list[str]:
    """The 2-D Linear weights a FP8 release quantises: all but the embedding, the head, norms and routers."""
    return [n for n, v in t.items() if n.endswith(".weight") and v.dim() == 2 and "embed_tokens" not in n
            and not n.startswith("lm_head") and not n.endswith("mlp.gate.weight") and "norm" not in n]


def to_fp8_block(src: str, dst: str, block=(16, 16)) -> str:
    """src (BF16) -> dst in DeepSeek's FP8 layout: float8_e4m3fn weights and fp32 weight_scale_inv per block."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    for n in _linear_names(t):
        t[n], t[n[: -len(".weight")] + ".weight_scale_inv"] = quantize(t[n], block)
    save_file(t, path)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


def tiny_copy(tmp_path, name: str, nvfp4_experts: bool = False) -> tuple[str, str, dict]:
    """The tiny preset written to tmp_path/name (BF16, or its experts NVFP4) -> (folder, safetensors file, tensors)."""
    d = str(tmp_path / name)
    make_checkpoint("tiny", d, seed=3, nvfp4_experts=nvfp4_experts)
    path = os.path.join(d, "model.safetensors")
    return d, path, load_file(path)


def bf16_twin(src: str, dst: str) -> str:
    """The checkpoint's FP8 (and NVFP4, compressed-tensors' names) weights decoded, as a BF16 checkpoint (our reader's
    decoding)."""
    r = CheckpointReader(src)
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    for n in [n for n, v in t.items() if n.endswith(".weight") and v.dtype == torch.float8_e4m3fn]:
        mod = n[: -len(".weight")]
        t[n] = r.linear(mod, *t[n].shape).weight
        t.pop(mod + "." + r.config.quant.fp8_scale)
    for n in [n for n in t if n.endswith(".weight_packed")]:
        mod = n[: -len(".weight_packed")]
        rows, half = t[n].shape
        t[mod + ".weight"] = r.linear(mod, rows, 2 * half).dense()
        for part in ("weight_packed", "weight_scale", "weight_global_scale"):
            t.pop(f"{mod}.{part}")
    save_file(t, path)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg.pop("quantization_config", None)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


@pytest.fixture(scope="module")
def dsv3_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    make_checkpoint("dsv3-tiny", str(root / "bf16"), seed=3)
    return to_fp8_block(str(root / "bf16"), str(root / "fp8"), (32, 32))   # kv_a's 48 rows: an edge block


def _decode(ckpt, *extra, out):
    r = rocket("decode", "--checkpoint", ckpt, "--streams", "4", "--tokens", "6", "--quiet", "--out", str(out), *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.load(open(out))["runs"][0]["tokens"]


def test_a_block_fp8_checkpoint_decodes_as_its_bf16_decoding(dsv3_fp8, tmp_path):
    r = CheckpointReader(dsv3_fp8)
    assert r.config.quant.algo == "FP8" and r.config.quant.fp8_block == (32, 32)
    twin = bf16_twin(dsv3_fp8, str(tmp_path / "twin"))
    assert _decode(dsv3_fp8, out=tmp_path / "a.json") == _decode(twin, out=tmp_path / "b.json")


def test_static_fire_on_a_block_fp8_checkpoint(dsv3_fp8):
    r = rocket("static-fire", "--checkpoint", dsv3_fp8, "--ranks", "2", "--sweep", "1,8", "--tokens", "6",
               "--fabric", "shm", "--fabric-timeout", "20")
    assert r.returncode == 0 and "STATIC FIRE PASS: 0/8 streams mismatched (2 ranks" in r.stdout, r.stdout + r.stderr


def test_plan_counts_fp8_as_the_bf16_it_loads_as(dsv3_fp8, tmp_path):
    from rocket_mpi.cli.plan import stack_bytes, tensor_shapes
    twin = bf16_twin(dsv3_fp8, str(tmp_path / "twin"))
    a, b = CheckpointReader(dsv3_fp8), CheckpointReader(twin)
    assert stack_bytes(tensor_shapes(a), True) == stack_bytes(tensor_shapes(b), True)
    r = rocket("plan", "--checkpoint", dsv3_fp8, "--ranks", "2", "--device-memory", "8", "--host-memory", "0")
    assert r.returncode == 0 and "BF16 experts (mlp.experts); FP8 weights decoded to BF16 at load" in r.stdout, \
        r.stdout + r.stderr


def test_transformers_loads_the_same_model(tmp_path):
    """transformers' own FP8 loading of the same checkpoint (dequantised: no GPU here) is the oracle: our engine's
    logits on it within the DeepSeek-V3 oracle's bound, and transformers' decoded weights are ours."""
    pytest.importorskip("accelerate", reason="transformers' FP8 loading needs accelerate (the test extra)")
    from transformers import DeepseekV3ForCausalLM
    from test_oracle_deepseek_v3 import ATOL, MARGIN, RTOL, TYPICAL, build_hf
    from oracle import engine_against, save_bf16
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.runtime.prompts import default_prompts
    model = build_hf("yarn_groups")
    save_bf16(model, tmp_path / "bf16")
    d = to_fp8_block(str(tmp_path / "bf16"), str(tmp_path / "fp8"), (16, 16))
    ref = DeepseekV3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = CheckpointReader(d)
    sd = ref.state_dict()
    name = "model.layers.0.self_attn.q_b_proj"
    mine = ours.linear(name, *sd[name + ".weight"].shape).weight.float()
    assert torch.allclose(sd[name + ".weight"].float(), mine, rtol=2 ** -8, atol=0)
    eng = Engine(d)
    engine_against(eng, ref, default_prompts(8, eng.cfg.vocab_size, seed=7), 20, RTOL, ATOL, MARGIN, TYPICAL)


def test_compressed_tensors_fp8_per_channel(tmp_path):
    """llm-compressor's FP8_DYNAMIC layout (float-quantized, a weight_scale per output channel): tensors written by
    compressed-tensors' own FP8 compressor, our decoding equal to its decompression, and the checkpoint decoding as
    its BF16 twin."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors (the test extra) is not installed")
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    d, path, t = tiny_copy(tmp_path, "ct")
    for n in _linear_names(t):
        w = t[n].float()
        scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
        out = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        t[n] = out["weight"]
        t[n[: -len(".weight")] + ".weight_scale"] = out["weight_scale"].float()
    save_file(t, path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                  "ignore": ["lm_head", "re:.*mlp.gate$"], "quantization_status": "compressed",
                                  "config_groups": {"group_0": json.loads(scheme.model_dump_json())}}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    r = CheckpointReader(d)
    assert r.config.quant.algo == "FP8" and r.config.quant.layout == "compressed-tensors"
    stored = load_file(path)
    for n in _linear_names(stored):
        mod = n[: -len(".weight")]
        theirs = FloatQuantizationCompressor.decompress(
            {"weight": stored[n], "weight_scale": stored[mod + ".weight_scale"]}, scheme)["weight"].float()
        mine = r.linear(mod, *stored[n].shape).weight.float()
        assert torch.allclose(mine, theirs, rtol=2 ** -8, atol=0), n
    twin = bf16_twin(d, str(tmp_path / "twin"))
    assert _decode(d, out=tmp_path / "a.json") == _decode(twin, out=tmp_path / "b.json")


def test_nvfp4_and_fp8_in_one_compressed_tensors_checkpoint(tmp_path):
    """Groups of both formats, as published mixed-precision GLM checkpoints have them (NVFP4 gate and up projections,
    FP8 per channel elsewhere): each weight read as its dtype says, the checkpoint decoding as its BF16 twin, and 2
    ranks passing the static fire (an expert whose parts mix formats runs BF16)."""
    d = mixed_ct_checkpoint(tmp_path)
    assert CheckpointReader(d).config.quant.algo == "NVFP4+FP8"
    twin = bf16_twin(d, str(tmp_path / "twin"))
    assert _decode(d, out=tmp_path / "a.json") == _decode(twin, out=tmp_path / "b.json")
    r = rocket("static-fire", "--checkpoint", d, "--ranks", "2", "--sweep", "1,8", "--tokens", "6", "--fabric", "shm",
               "--fabric-timeout", "20")
    assert r.returncode == 0 and "STATIC FIRE PASS: 0/8 streams mismatched (2 ranks" in r.stdout, r.stdout + r.stderr


@gpu
def test_gpu_graphed_fire_on_a_mixed_checkpoint(tmp_path):
    """On a GPU: experts whose gate/up are NVFP4 and down FP8 go to the kernel's BF16 tiles (decoded), the dense MLP's
    NVFP4 gate/up stay held as stored; 2 ranks over cuda-ipc on the graphed step pass the static fire."""
    d = mixed_ct_checkpoint(tmp_path)
    r = rocket("static-fire", "--checkpoint", d, "--ranks", "2", "--device", "cuda", "--fabric", "cuda-ipc",
               "--decode-path", "graph", "--sweep", "1,8", "--tokens", "8", timeout=300)
    assert r.returncode == 0 and "STATIC FIRE PASS: 0/8" in r.stdout, r.stdout + r.stderr


def mixed_ct_checkpoint(tmp_path) -> str:
    """tiny with NVFP4 gate/up projections and FP8 (per channel) other Linears, in compressed-tensors' layout."""
    from rocket_mpi.ops import nvfp4
    d, path, t = tiny_copy(tmp_path, "mixed")
    for n in _linear_names(t):
        mod, w = n[: -len(".weight")], t.pop(n).float()
        if mod.endswith(("gate_proj", "up_proj")):
            t[mod + ".weight_packed"], t[mod + ".weight_scale"], s2 = nvfp4.quantize(w)
            t[mod + ".weight_global_scale"] = torch.reciprocal(s2.float().reshape(1))
        else:
            scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
            t[n], t[mod + ".weight_scale"] = (w / scale).to(torch.float8_e4m3fn), scale
    save_file(t, path)
    nv = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
    f8 = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*mlp.gate$"],
                                  "config_groups": {
                                      "group_0": {"targets": ["re:.*gate_proj$", "re:.*up_proj$"], "weights": nv,
                                                  "format": "nvfp4-pack-quantized"},
                                      "group_1": {"targets": ["Linear"], "weights": f8, "format": "float-quantized"}}}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    return d


@pytest.mark.parametrize("recipe", ["FP8", "MIXED_PRECISION"])
def test_modelopt_fp8_and_mixed_precision(recipe, tmp_path):
    """ModelOpt's FP8 (a float8_e4m3fn weight, an fp32 weight_scale per tensor, an input_scale read past) for every
    Linear, and its MIXED_PRECISION recipe (NVFP4 routed experts, FP8 attention, per layer in quantized_layers):
    each decodes as its BF16 twin; the mixed one passes a 2-rank static fire with its experts in the NVFP4 kernel."""
    d, path, t = tiny_copy(tmp_path, "q", nvfp4_experts=recipe == "MIXED_PRECISION")
    layers = {}
    for n in _linear_names(t):
        mod = n[: -len(".weight")]
        if t[n].dtype == torch.uint8:
            layers[mod] = {"quant_algo": "NVFP4", "group_size": 16}
            continue
        if recipe == "MIXED_PRECISION" and ".self_attn." not in n:
            continue
        w = t[n].float()
        scale = w.abs().amax() / 448.0
        t[n], t[mod + ".weight_scale"], t[mod + ".input_scale"] = (w / scale).to(torch.float8_e4m3fn), scale, \
            torch.tensor(1.0)
        layers[mod] = {"quant_algo": "FP8"}
    save_file(t, path)
    q = {"quant_algo": recipe, "kv_cache_quant_algo": None}
    if recipe == "MIXED_PRECISION":
        q["quantized_layers"] = layers
    json.dump({"quantization": q}, open(os.path.join(d, "hf_quant_config.json"), "w"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg.pop("quantization_config", None)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    r = CheckpointReader(d)
    assert r.config.quant.algo == ("FP8" if recipe == "FP8" else "NVFP4+FP8")
    twin = bf16_twin(d, str(tmp_path / "twin"))
    if recipe == "MIXED_PRECISION":   # the twin keeps the NVFP4 experts (its config says NVFP4 alone)
        json.dump({"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head", "*.mlp.gate"]}},
                  open(os.path.join(twin, "hf_quant_config.json"), "w"))
    else:
        os.remove(os.path.join(twin, "hf_quant_config.json"))
    assert _decode(d, out=tmp_path / "a.json") == _decode(twin, out=tmp_path / "b.json")
    if recipe == "MIXED_PRECISION":
        r = rocket("static-fire", "--checkpoint", d, "--ranks", "2", "--sweep", "1,8", "--tokens", "6", "--fabric",
                   "shm", "--fabric-timeout", "20")
        assert r.returncode == 0 and "STATIC FIRE PASS: 0/8" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("case,needle", [
    ("no config", "but the checkpoint's quantization config is missing"),
    ("scale shape", "has shape [3, 3], expected"),
    ("no scale", "missing tensor 'model.layers.1.self_attn.o_proj.weight_scale_inv'"),
    ("zero scale", "holds a scale <= 0"),
    ("e5m2", "fmt 'e5m2' is not supported"),
])
def test_bad_fp8_checkpoints_are_one_line(case, needle, dsv3_fp8, tmp_path, capsys):
    from test_bad_input import assert_one_line, decode
    d = tmp_path / "ck"
    shutil.copytree(dsv3_fp8, d)
    cfg_path, path = d / "config.json", str(d / "model.safetensors")
    cfg, t = json.load(open(cfg_path)), load_file(path)
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    if case == "no config":
        cfg.pop("quantization_config", None)
    elif case == "scale shape":
        t[name] = torch.ones(3, 3)
    elif case == "no scale":
        t.pop(name)
    elif case == "zero scale":
        t[name] = torch.zeros_like(t[name])
    elif case == "e5m2":
        cfg["quantization_config"]["fmt"] = "e5m2"
    json.dump(cfg, open(cfg_path, "w"))
    save_file(t, path)
    assert_one_line(*decode(capsys, d), needle)
