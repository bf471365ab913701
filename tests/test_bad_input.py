"""Bad input: one clear line naming the file, tensor or flag, and a non-zero exit. Never a traceback."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rocket_mpi.cli import main


def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, d)
    return d


def edit_tensors(d, fn, nvfp4=False):
    path = os.path.join(d, "model.safetensors")
    t = load_file(path)
    fn(t)
    save_file(t, path)
    return path


def decode(capsys, d, *extra):
    return run_cli(capsys, "decode", "--checkpoint", str(d), "--streams", "2", "--tokens", "2", "--quiet", *extra)


def assert_one_line(code, err, *needles):
    assert code not in (0, None), err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    assert "Traceback" not in err


def test_truncated_file(capsys, ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    assert_one_line(*decode(capsys, ckpt), "model.safetensors", "truncated")


def test_garbled_header(capsys, ckpt):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json!!!!"
    path.write_bytes(bytes(data))
    assert_one_line(*decode(capsys, ckpt), "model.safetensors", "garbled")


def test_missing_tensor(capsys, ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    assert_one_line(*decode(capsys, ckpt), "model.layers.1.mlp.experts.3.up_proj.weight", "missing")


def test_damaged_tensor_name_names_the_file_searched(capsys, ckpt):
    """A damaged name in a header (one byte changed): the line names the tensor asked for and the file searched."""
    name = "model.layers.1.mlp.experts.15.down_proj.weight"
    edit_tensors(ckpt, lambda t: t.__setitem__(name[:-1] + "u", t.pop(name)))
    assert_one_line(*decode(capsys, ckpt), name, "missing", "(not in model.safetensors)")


def test_wrong_dtype(capsys, ckpt):
    def f(t):
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"].to(torch.int32)
    edit_tensors(ckpt, f)
    assert_one_line(*decode(capsys, ckpt), "model.layers.0.self_attn.q_proj.weight", "dtype int32")


def test_wrong_shape(capsys, ckpt):
    def f(t):
        t["model.layers.2.mlp.experts.0.down_proj.weight"] = torch.zeros(64, 31, dtype=torch.bfloat16)
    edit_tensors(ckpt, f)
    assert_one_line(*decode(capsys, ckpt), "model.layers.2.mlp.experts.0.down_proj.weight", "shape [64, 31]")


def test_unsupported_model_type(capsys, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_one_line(*decode(capsys, ckpt), "config.json", "model_type 'llama' is not supported")


def test_missing_config_field(capsys, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_one_line(*decode(capsys, ckpt), "config.json", "moe_intermediate_size")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_scale(capsys, tiny_nvfp4_ckpt, tmp_path, bad):
    d = tmp_path / "q"
    shutil.copytree(tiny_nvfp4_ckpt, d)
    name = "model.layers.1.mlp.experts.0.gate_proj.weight_scale_2"

    def f(t):
        t[name] = torch.tensor(bad, dtype=torch.float32)
    edit_tensors(d, f)
    assert_one_line(*decode(capsys, d), name, "NaN or Inf")


def test_prompt_longer_than_position_limit(capsys, ckpt, tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps([[5] * 511]))
    assert_one_line(*decode(capsys, ckpt, "--prompts", str(p)), "stream 0", "max_position_embeddings 512")


def test_token_out_of_range(capsys, ckpt, tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps([[1, 2, 3], [4, 99999]]))
    assert_one_line(*decode(capsys, ckpt, "--prompts", str(p)), "stream 1", "99999", "out of range")


def test_bad_prompts_file(capsys, ckpt, tmp_path):
    p = tmp_path / "p.json"
    p.write_text("[[1, 2")
    assert_one_line(*decode(capsys, ckpt, "--prompts", str(p)), "--prompts", "not valid JSON")


@pytest.mark.parametrize("argv,needle", [
    (["decode", "--checkpoint", "x", "--streams", "zero"], "--streams"),
    (["decode", "--checkpoint", "x", "--tokens", "-3"], "--tokens"),
    (["decode", "--checkpoint", "x", "--device", "tpu"], "--device"),
    (["decode", "--checkpoint", "x", "--prefill-chunk", "0"], "--prefill-chunk"),
    (["static-fire", "--checkpoint", "x", "--ranks", "2", "--sweep", "1,a"], "--sweep"),
    (["decode"], "--checkpoint"),
    (["make-checkpoint", "--out", "/tmp/x", "--preset", "huge"], "huge"),
    (["decode", "--checkpoint", "x", "--fabric-timeout", "inf"], "--fabric-timeout"),  # a wait with no end
    (["fabric-bench", "--timeout", "0"], "--fabric-timeout"),
    (["plan", "--checkpoint", "x", "--ranks", "0"], "--ranks"),
    (["plan", "--checkpoint", "x", "--device-memory", "-3"], "--device-memory"),
    (["plan", "--checkpoint", "x", "--host-memory", "nan"], "--host-memory"),
    (["plan", "--checkpoint", "x", "--expert-cache", "lots"], "--expert-cache"),
    (["plan", "--checkpoint", "x", "--streams", "0"], "--streams"),
])
def test_bad_flags(capsys, argv, needle):
    assert_one_line(*run_cli(capsys, *argv), needle)


def test_unknown_fabric(capsys, ckpt):
    assert_one_line(*decode(capsys, ckpt, "--fabric", "carrier-pigeon"), "carrier-pigeon")


def test_verbs_without_device_says_what_would_work(capsys, ckpt):
    # one rank resolves every fabric to local; ask make_fabric directly like a 2-rank bootstrap would
    from rocket_mpi.errors import FabricError
    from rocket_mpi.fabric import make_fabric, verbs_status
    if verbs_status() is None:
        pytest.skip("an RDMA device is present here: the no-device message cannot be shown")
    with pytest.raises(FabricError, match="fabric verbs: .*use --fabric mpi"):
        make_fabric("verbs", None, 8, 64, 1.0)


def test_missing_checkpoint_folder(capsys, tmp_path):
    assert_one_line(*decode(capsys, tmp_path / "nope"), "nope")


def test_placement_file_errors(capsys, ckpt, tmp_path):
    p = tmp_path / "pl.json"
    p.write_text(json.dumps({"default": [0] * 15}))
    assert_one_line(*decode(capsys, ckpt, "--placement", str(p)), "--placement", "16 experts")
    p.write_text(json.dumps({"default": [0] * 15 + [3]}))
    assert_one_line(*decode(capsys, ckpt, "--placement", str(p)), "expert 15 -> rank 3")


def test_decode_path_graph_on_cpu_says_why(capsys, ckpt):
    assert_one_line(*decode(capsys, ckpt, "--decode-path", "graph"), "--decode-path graph: not possible here")
    assert_one_line(*decode(capsys, ckpt, "--decode-path", "fast"), "--decode-path")


def test_ranks_sharing_a_gpu_are_named():
    """Ranks that land on one GPU (more ranks than GPUs, or a launcher that hid the others) are named in
    one warning line; ranks on distinct GPUs, on one host or several, are not. The GPU counts by host
    and UUID, not by the index each rank sees (Slurm may give every rank its own device 0)."""
    from rocket_mpi.runtime.decode import gpu_sharing
    assert gpu_sharing([("a", "GPU-0", 0), ("a", "GPU-1", 1)]) == ""
    assert gpu_sharing([("a", "GPU-0", 0), ("b", "GPU-0", 0)]) == ""          # same UUID string, two hosts
    assert gpu_sharing([("a", "GPU-x", 0), ("a", "GPU-y", 0)]) == ""          # each rank sees its GPU as 0
    line = gpu_sharing([("a", "GPU-0", 0), ("a", "GPU-1", 1), ("a", "GPU-0", 0), ("b", "GPU-9", 0),
                        ("b", "GPU-9", 0)])
    assert "ranks 0, 2 share GPU 0 of a" in line and "ranks 3, 4 share GPU 0 of b" in line
    assert "one rank per GPU" in line and "\n" not in line


@pytest.mark.parametrize("name,value", [("ROCKET_GRAPH_SPANS", "pow2"), ("ROCKET_GRAPH_SPANS", "capacity"),
                                        ("ROCKET_FAULT", "stall:rank"), ("ROCKET_FAULT", "melt:rank=1")])
def test_bad_environment_setting(capsys, ckpt, monkeypatch, name, value):
    """A variable of settings.py with a value it does not take (ROCKET_GRAPH_SPANS: a positive integer;
    ROCKET_FAULT: KIND:rank=R,step=S): one line naming it before anything loads, on any device."""
    monkeypatch.setenv(name, value)
    assert_one_line(*decode(capsys, ckpt), name, repr(value))


@pytest.mark.parametrize("key,value,needle", [
    ("rms_norm_eps", "1e-5", "rms_norm_eps"), ("routed_scaling_factor", "2.5", "routed_scaling_factor"),
    ("rms_norm_eps", -1.0, "rms_norm_eps"), ("tie_word_embeddings", "no", "tie_word_embeddings"),
    ("eos_token_id", "x", "eos_token_id"), ("eos_token_id", [1, "x"], "eos_token_id"),
    ("rope_parameters", [10000.0], "rope_parameters"), ("rope_parameters", {"rope_theta": "1e4"}, "rope_theta"),
    ("swiglu_limit", "7", "swiglu_limit")])
def test_config_value_of_the_wrong_type(capsys, ckpt, key, value, needle):
    """A config.json value of the wrong type is one line naming the file and the key, before anything loads."""
    path = os.path.join(ckpt, "config.json")
    cfg = json.load(open(path))
    cfg[key] = value
    json.dump(cfg, open(path, "w"))
    assert_one_line(*decode(capsys, ckpt), "config.json", needle)


def test_a_file_as_checkpoint(capsys, ckpt):
    assert_one_line(*decode(capsys, os.path.join(ckpt, "config.json")), "--checkpoint", "a file, not a checkpoint")


def test_out_into_a_missing_folder_fails_before_the_run(capsys, ckpt, tmp_path):
    out = tmp_path / "missing" / "out.json"
    assert_one_line(*decode(capsys, ckpt, "--out", str(out)), "--out", "does not exist")


@pytest.mark.parametrize("entry", [[], {"dtype": "BF16"}, {"data_offsets": "0,4"}, {"data_offsets": [4]},
                                   {"data_offsets": [8, 4]}, 7])
def test_mutated_header_entry_is_one_line(capsys, ckpt, entry):
    """A safetensors header whose JSON parses but whose tensor entry is malformed: one line naming the file."""
    path = os.path.join(ckpt, "model.safetensors")
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name] = entry
    new = json.dumps(header).encode()
    new += b" " * max(0, n - len(new))
    open(path, "wb").write(len(new).to_bytes(8, "little") + new + raw[8 + n:])
    assert_one_line(*decode(capsys, ckpt), "model.safetensors")


def test_nan_in_a_bf16_expert_weight(capsys, ckpt):
    """One NaN in one BF16 expert weight would turn every token into 0 with exit 0: the load names the tensor."""
    name = "model.layers.1.mlp.experts.3.down_proj.weight"

    def f(t):
        t[name][0, 0] = float("nan")
    edit_tensors(ckpt, f)
    assert_one_line(*decode(capsys, ckpt), name, "NaN or Inf")


def test_overflow_to_inf_in_the_activations_stops_the_decode(capsys, ckpt):
    """Finite weights whose activations overflow BF16 (a norm weight of 3e38): the prefill's logits hold NaN; one
    line names the step, the streams and the first MoE layer the non-finite values passed, not tokens of 0."""
    def f(t):
        t["model.layers.1.post_attention_layernorm.weight"][:] = 3e38
    edit_tensors(ckpt, f)
    assert_one_line(*decode(capsys, ckpt), "decode step 0", "stream(s) 0, 1", "NaN or Inf",
                    "entering MoE layer 1")


def test_expert_cache_from_a_bad_trace(capsys, ckpt, tmp_path):
    """--expert-cache-from: a trace of another model, a file that is not a trace, a missing file: one line each,
    naming the flag and the file."""
    trace = str(tmp_path / "trace.npz")
    code, err = decode(capsys, ckpt, "--telemetry", trace)
    assert code == 0, err
    code, err = run_cli(capsys, "decode", "--checkpoint", "preset:dsa-tiny", "--streams", "1", "--tokens", "2",
                        "--quiet", "--expert-cache-from", trace)
    assert_one_line(code, err, "--expert-cache-from", trace, "was recorded from another model")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    assert_one_line(*decode(capsys, ckpt, "--expert-cache-from", str(junk)), str(junk), "not a telemetry file")
    assert_one_line(*decode(capsys, ckpt, "--expert-cache-from", str(tmp_path / "none.npz")), "none.npz",
                    "file not found")
