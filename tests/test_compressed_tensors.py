"""NVFP4 checkpoints in compressed-tensors' layout (llm-compressor's `nvfp4-pack-quantized`): read as ModelOpt's.

The checkpoints here are written by compressed-tensors itself: make-checkpoint's ModelOpt export converted with the
library's own ModelOpt-to-compressed-tensors converter (`weight` -> `weight_packed`, `weight_scale_2` -> its reciprocal
`weight_global_scale`, the config as the library writes it), so the layout is the library's, not this project's idea
of it. The library's own decompression is the oracle for what the parts mean."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import rocket, rocket_mpi
from helpers import gpu
from rocket_mpi.checkpoint.make import make_checkpoint
from rocket_mpi.checkpoint.reader import CheckpointReader

try:
    import compressed_tensors  # noqa: F401
    NO_LIBRARY = None
except ImportError:
    NO_LIBRARY = "compressed-tensors (the test extra) is not installed: pip install -e .[test]"
library = pytest.mark.skipif(NO_LIBRARY is not None, reason=str(NO_LIBRARY))

IGNORE = {"glm4_moe": ["re:.*mlp.gate$"], "glm5_next": ["lm_head", "re:.*mlp.gate$"]}


def convert(src: str, dst: str, ignore: list[str]) -> str:
    """The library's own conversion, or, where it is not installed (the GPU machine), the same renames by hand (the
    layout the library's conversion is checked to give, test_the_reader_hands_out_modelopt_parts)."""
    if NO_LIBRARY:
        return convert_by_hand(src, dst, ignore)
    from compressed_tensors.entrypoints.convert.convert_checkpoint import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    convert_checkpoint(src, dst, ModelOptNvfp4Converter(ignore=ignore, targets=["Linear"]), device="cpu",
                       max_workers=1)
    os.remove(os.path.join(dst, "hf_quant_config.json"))  # copied over from the source; not part of the layout
    return dst


def convert_by_hand(src: str, dst: str, ignore: list[str]) -> str:
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "hf_quant_config.json"))
    path = os.path.join(dst, "model.safetensors")
    t, out = load_file(path), {}
    for n, v in t.items():
        if n.endswith(".weight") and v.dtype == torch.uint8:
            out[n + "_packed"] = v
        elif n.endswith(".weight_scale_2"):
            out[n[: -len("_scale_2")] + "_global_scale"] = torch.reciprocal(v)
        elif n.endswith(".input_scale"):
            out[n[: -len("_scale")] + "_global_scale"] = torch.reciprocal(v)
        else:
            out[n] = v
    save_file(out, path)
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
               "dynamic": False}
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                  "quantization_status": "compressed", "ignore": ignore, "config_groups": {
                                      "group_0": {"targets": ["Linear"], "weights": weights,
                                                  "format": "nvfp4-pack-quantized"}}}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ModelOpt checkpoint, the same converted by compressed-tensors): preset tiny, every Linear NVFP4, lm_head too."""
    root = tmp_path_factory.mktemp("ct")
    mo = str(root / "modelopt")
    make_checkpoint("tiny", mo, seed=3, nvfp4_head=True)
    return mo, convert(mo, str(root / "ct"), IGNORE["glm4_moe"])


@library
def test_the_hand_conversion_is_the_librarys(pair, tmp_path):
    """What the GPU machine (no compressed-tensors there) converts by hand: the library's tensors, bit for bit, and a
    config the reader takes the same way."""
    mo, ctd = pair
    hand = convert_by_hand(mo, str(tmp_path / "hand"), IGNORE["glm4_moe"])
    a, b = load_file(os.path.join(ctd, "model.safetensors")), load_file(os.path.join(hand, "model.safetensors"))
    assert a.keys() == b.keys()
    def raw(t):
        return t.reshape(-1).view(torch.uint8)
    assert all(a[n].dtype == b[n].dtype and torch.equal(raw(a[n]), raw(b[n])) for n in a)
    assert CheckpointReader(hand).config.quant == CheckpointReader(ctd).config.quant


def nvfp4_modules(reader):
    return sorted(n[: -len(".weight_scale_2")] for n in reader.where if n.endswith(".weight_scale_2"))


@library
def test_the_converted_checkpoint_is_compressed_tensors(pair):
    _, ctd = pair
    q = json.load(open(os.path.join(ctd, "config.json")))["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "nvfp4-pack-quantized"
    names = load_file(os.path.join(ctd, "model.safetensors")).keys()
    assert "lm_head.weight_packed" in names and "lm_head.weight" not in names
    assert any(n.endswith(".weight_global_scale") for n in names)
    assert not any(n.endswith(".weight_scale_2") for n in names)


@library
def test_the_reader_hands_out_modelopt_parts(pair):
    """Every NVFP4 module: the same codes and block scales as the ModelOpt source, weight_scale_2 = 1 / the global
    scale rounded once in fp32 (within an ulp of the source's: the converter stored its reciprocal), the same set of
    names handed out (input scales aside) and the same config but for the layout."""
    mo, ctd = pair
    a, b = CheckpointReader(mo), CheckpointReader(ctd)
    assert b.config.quant.layout == "compressed-tensors" and a.config.quant.layout == "modelopt"
    mods = nvfp4_modules(a)
    assert nvfp4_modules(b) == mods and "lm_head" in mods and len(mods) > 100
    ulps = 0
    for m in mods:
        n, k2 = a.get(m + ".weight").shape
        la, lb = a.linear(m, n, 2 * k2), b.linear(m, n, 2 * k2)
        assert torch.equal(la.weight, lb.weight), m
        assert torch.equal(la.weight_scale.view(torch.uint8), lb.weight_scale.view(torch.uint8)), m
        g = load_file(b.where[m + ".weight"])[m + ".weight_global_scale"]
        assert lb.weight_scale_2.dtype == torch.float32 and float(lb.weight_scale_2) == float(torch.reciprocal(g))
        assert torch.allclose(la.weight_scale_2, lb.weight_scale_2, rtol=2 ** -23, atol=0), m
        ulps += int(float(la.weight_scale_2) != float(lb.weight_scale_2))
    print(f"{len(mods)} NVFP4 modules, {ulps} weight_scale_2 an ulp off the source's")
    strip = {n for n in a.where if n.endswith(".input_scale")} | \
        {n for n in b.where if n.endswith(".input_global_scale")}
    assert set(a.where) - strip == set(b.where) - strip


@library
def test_dense_weights_match_compressed_tensors_own_decompression(pair):
    """Linear.dense() (E2M1 x block scale x weight_scale_2, fp32) against the library's NVFP4PackedCompressor:
    zeros in the same places, every element within 2^-7 of the library's, relatively: the library computes in bf16
    (the global scale rounded to bf16, the block scale divided by it, the product: each a rounding of 2^-9 at most)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    _, ctd = pair
    q = QuantizationConfig.model_validate(json.load(open(os.path.join(ctd, "config.json")))["quantization_config"])
    scheme = next(iter(q.config_groups.values()))
    r = CheckpointReader(ctd)
    stored = load_file(os.path.join(ctd, "model.safetensors"))
    worst = 0.0
    for m in nvfp4_modules(r):
        parts = {p: stored[f"{m}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale")}
        theirs = NVFP4PackedCompressor.decompress(parts, scheme)["weight"].float()
        n, k2 = parts["weight_packed"].shape
        ours = r.linear(m, n, 2 * k2).dense(torch.float32)
        assert torch.equal(ours == 0, theirs == 0), m
        nz = theirs != 0
        rel = ((ours - theirs).abs()[nz] / theirs.abs()[nz]).max().item()
        assert rel <= 2 ** -7, f"{m}: relative difference {rel}"
        worst = max(worst, rel)
    print(f"worst relative difference from compressed-tensors' decompression: {worst:.2e}")


def modelopt_twin(mo: str, ctd: str, out: str) -> str:
    """The ModelOpt checkpoint with each weight_scale_2 set to 1 / the compressed-tensors global scale: the same
    numbers in ModelOpt's layout."""
    shutil.copytree(mo, out)
    path = os.path.join(out, "model.safetensors")
    t = load_file(path)
    g = load_file(os.path.join(ctd, "model.safetensors"))
    for n in [n for n in t if n.endswith(".weight_scale_2")]:
        t[n] = torch.reciprocal(g[n[: -len("_scale_2")] + "_global_scale"]).reshape(t[n].shape)
    save_file(t, path)
    return out


def test_decode_is_bitwise_the_modelopt_twins(pair, tmp_path):
    """The whole model through the engine (CPU): the compressed-tensors checkpoint decodes the tokens, and every step's
    logits bit for bit, of its ModelOpt twin."""
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.runtime.prompts import default_prompts
    mo, ctd = pair
    twin = modelopt_twin(mo, ctd, str(tmp_path / "twin"))
    out = []
    for d in (ctd, twin):
        e = Engine(d)
        logits = []
        res = e.generate(default_prompts(4, e.cfg.vocab_size, seed=11), 6,
                         on_step=lambda s, lg: logits.append(lg.clone()))
        out.append((res.tokens, logits))
    assert out[0][0] == out[1][0]
    assert all(torch.equal(x, y) for x, y in zip(out[0][1], out[1][1]))


@pytest.mark.parametrize("ranks,fabric", [(2, "shm"), (3, "mpi")])
def test_static_fire_on_a_compressed_tensors_checkpoint(pair, ranks, fabric):
    _, ctd = pair
    r = rocket("static-fire", "--checkpoint", ctd, "--ranks", str(ranks), "--sweep", "1,8", "--tokens", "6",
               "--fabric", fabric, "--fabric-timeout", "20")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"STATIC FIRE PASS: 0/8 streams mismatched ({ranks} ranks, fabric {fabric}" in r.stdout


def test_glm5_flash_layout_decodes_as_its_twin(tmp_path):
    """GLM-5.3-Flash's family (KDA, MLA, hyper-connections; `model.language_model.` names) converted the same way:
    2 ranks decode its ModelOpt twin's tokens."""
    mo = str(tmp_path / "mo")
    make_checkpoint("glm5-tiny", mo, seed=3, nvfp4_all=True)
    ctd = convert(mo, str(tmp_path / "ct"), IGNORE["glm5_next"])
    twin = modelopt_twin(mo, ctd, str(tmp_path / "twin"))
    toks = []
    for d, n in ((twin, 1), (ctd, 2)):
        out = tmp_path / f"run{n}.json"
        r = rocket_mpi(n, "decode", "--checkpoint", d, "--streams", "4", "--tokens", "6", "--fabric",
                       "shm" if n > 1 else "local", "--quiet", "--out", str(out))
        assert r.returncode == 0, r.stdout + r.stderr
        toks.append(json.load(open(out))["runs"][0]["tokens"])
    assert toks[0] == toks[1]


def test_plan_reads_the_same_bytes_from_either_layout(pair, capsys):
    from rocket_mpi.cli import main
    mo, ctd = pair
    outs = []
    for d in (mo, ctd):
        assert main(["plan", "--checkpoint", d, "--ranks", "2", "--device-memory", "80", "--host-memory", "0"]) == 0
        outs.append(capsys.readouterr().out.replace(d, "DIR"))
    assert outs[0] == outs[1]
    assert "NVFP4" in outs[0] or "nvfp4" in outs[0]


def edit_config(d, fn):
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    fn(cfg["quantization_config"])
    json.dump(cfg, open(path, "w"))


def group(q):
    return next(iter(q["config_groups"].values()))


CONFIG_CASES = {
    "int4 format": (lambda q: group(q).update(format="pack-quantized"), "format 'pack-quantized'"),
    "8-bit weights": (lambda q: group(q)["weights"].update(num_bits=8), "weights.num_bits is 8"),
    "int weights": (lambda q: group(q)["weights"].update(type="int"), "weights.type is 'int'"),
    "groups of 32": (lambda q: group(q)["weights"].update(group_size=32), "weights.group_size is 32"),
    "zero points": (lambda q: group(q)["weights"].update(symmetric=False), "asymmetric"),
    "rotations": (lambda q: q.update(transform_config={"config_groups": {"u": {}}}), "transform_config"),
    "sparse": (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
    "bad pattern": (lambda q: q.update(ignore=["re:(unclosed"]), "re:(unclosed"),
    "a quantised module ignored": (lambda q: q.update(ignore=["re:.*mlp.gate$", "re:.*shared_experts.*"]),
                                   "excludes 'model.layers.1.mlp.shared_experts"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_unsupported_or_inconsistent_settings_are_one_line(case, pair, tmp_path, capsys):
    from test_bad_input import assert_one_line, decode
    d = tmp_path / "ck"
    shutil.copytree(pair[1], d)
    fn, needle = CONFIG_CASES[case]
    edit_config(d, fn)
    assert_one_line(*decode(capsys, d), needle)


TENSOR_CASES = {
    "a zero global scale": (lambda t: t["model.layers.1.mlp.experts.2.up_proj.weight_global_scale"].zero_(),
                            "'model.layers.1.mlp.experts.2.up_proj.weight_global_scale' is [0.0]"),
    "a missing global scale": (lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_global_scale"),
                               "missing tensor 'model.layers.0.self_attn.o_proj.weight_global_scale'"),
    "a missing weight": (lambda t: t.pop("model.layers.2.mlp.experts.5.down_proj.weight_packed"),
                         "missing tensor 'model.layers.2.mlp.experts.5.down_proj.weight_packed' or"),
    "both layouts": (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight",
                                             t["model.layers.0.mlp.up_proj.weight_packed"].clone()),
                     "both 'model.layers.0.mlp.up_proj.weight_packed' and 'model.layers.0.mlp.up_proj.weight'"),
    "zero points": (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight_zero_point", torch.zeros(1)),
                    "'model.layers.0.mlp.up_proj.weight_zero_point': zero points"),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_broken_parts_are_one_line_naming_the_stored_tensor(case, pair, tmp_path, capsys):
    from test_bad_input import assert_one_line, decode
    d = tmp_path / "ck"
    shutil.copytree(pair[1], d)
    fn, needle = TENSOR_CASES[case]
    path = os.path.join(d, "model.safetensors")
    t = load_file(path)
    fn(t)
    save_file(t, path)
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):  # the converter's index would name the old tensors
        os.remove(index)
    assert_one_line(*decode(capsys, d), needle, "model.safetensors")


@gpu
def test_gpu_graphed_decode_and_fire_on_a_compressed_tensors_checkpoint(tmp_path):
    """On a GPU, the stack held as stored and the experts packed for the kernel: glm5-tiny with every Linear NVFP4,
    in compressed-tensors' layout, decodes its ModelOpt twin's tokens on the graphed step, and 2 ranks over cuda-ipc
    pass the static fire."""
    mo = str(tmp_path / "mo")
    make_checkpoint("glm5-tiny", mo, seed=3, nvfp4_all=True)
    ctd = convert(mo, str(tmp_path / "ct"), IGNORE["glm5_next"])
    twin = modelopt_twin(mo, ctd, str(tmp_path / "twin"))
    toks = []
    for d in (twin, ctd):
        out = tmp_path / f"{len(toks)}.json"
        r = rocket("decode", "--checkpoint", d, "--device", "cuda", "--decode-path", "graph", "--streams", "4",
                   "--tokens", "8", "--quiet", "--out", str(out), timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        toks.append(json.load(open(out))["runs"][0]["tokens"])
    assert toks[0] == toks[1]
    r = rocket("static-fire", "--checkpoint", ctd, "--ranks", "2", "--device", "cuda", "--fabric", "cuda-ipc",
               "--decode-path", "graph", "--sweep", "1,8", "--tokens", "8", timeout=300)
    assert r.returncode == 0 and "STATIC FIRE PASS: 0/8" in r.stdout, r.stdout + r.stderr
