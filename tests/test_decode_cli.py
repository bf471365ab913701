"""The decode and make-checkpoint commands end to end (one rank; the split ceiling with two)."""
import hashlib
import json

from conftest import rocket, rocket_mpi
from rocket_mpi.checkpoint.make import make_checkpoint


def _decode(ckpt, out, *extra):
    r = rocket("decode", "--checkpoint", str(ckpt), "--streams", "3", "--tokens", "5", "--out", str(out), *extra)
    assert r.returncode == 0, r.stderr
    return r, json.loads(out.read_text())


def test_out_holds_generated_tokens_only(tiny_ckpt, tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps([[7, 8, 9, 10, 11, 12, 13], [5], [300, 301]]))
    r, doc = _decode(tiny_ckpt, tmp_path / "o.json", "--prompts", str(p))
    assert [len(t) for t in doc["tokens"]] == [5, 5, 5]
    assert doc["ranks"] == 1 and doc["runs"][0]["streams"] == 3
    assert "rank   M   ms/step" in r.stdout  # the per-rank table


def test_long_run_reports_its_whole_time(tiny_ckpt, tmp_path):
    """A run longer than the timed window (3 warm-up + 10 timed decode steps) also reports all its decode steps:
    their count, seconds and rate, consistent with the per-rank summary in --out; a short run does not."""
    import re
    r, doc = _decode(tiny_ckpt, tmp_path / "o.json", "--tokens", "20")
    s = doc["runs"][0]["per_rank"][0]
    assert s["steps"] == 10 and s["decode_steps"] == 19 and s["decode_s"] > 0 and s["prefill_s"] > 0
    m = re.search(r"whole run \(rank 0\): prefill [0-9.]+ s, (\d+) decode steps in ([0-9.]+) s \(([0-9.]+) ms per step, "
                  r"([0-9.]+) tok/s\)", r.stdout)
    assert m, r.stdout
    assert int(m[1]) == 19 and abs(float(m[2]) - s["decode_s"]) < 0.01
    assert abs(float(m[4]) - 3 * 19 / s["decode_s"]) / float(m[4]) < 0.01
    r, _ = _decode(tiny_ckpt, tmp_path / "o2.json")  # 5 tokens: no decode step past the timed window
    assert "whole run" not in r.stdout


def test_wall_time_parts_add_up(tiny_ckpt, tmp_path):
    """Where the process's time went until the results were gathered: the parts in --out (load[rank].wall_s) and on
    one report line; the load is Engine's own load time, the steps the prefill and decode steps the runs timed, and
    the process's start (interpreter, imports) is a part of its own."""
    import re
    r, doc = _decode(tiny_ckpt, tmp_path / "o.json", "--sweep", "1,2", "--tokens", "6")
    wall = doc["load"][0]["wall_s"]
    assert list(wall) == ["start", "set-up", "load", "fabric", "bandwidth probes", "prefill and decode steps",
                          "captures and the rest"]
    assert all(v >= 0 for v in wall.values()) and wall["start"] > 0.1   # at least the import of torch
    assert abs(wall["load"] - doc["load"][0]["load_s"]) < 0.05
    steps = sum(pr["prefill_s"] + pr["decode_s"] for run in doc["runs"] for pr in run["per_rank"])
    assert abs(wall["prefill and decode steps"] - steps) < 1e-6
    m = re.search(r"wall time of rank 0, s: (.*); in all ([0-9.]+)", r.stdout)
    assert m, r.stdout
    assert abs(float(m[2]) - sum(wall.values())) < 0.02 and m[1].startswith("start ")


def test_text_prompts_and_text_output(tiny_ckpt, tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(["The expert split", "Hello, world!"]))
    _, doc = _decode(tiny_ckpt, tmp_path / "o.json", "--prompts", str(p))
    assert len(doc["text"]) == 3 and all(isinstance(t, str) for t in doc["text"])
    # the tokenizer round-trips what it wrote
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(f"{tiny_ckpt}/tokenizer.json")
    assert tok.decode(tok.encode("Hello, world!").ids) == "Hello, world!"


def test_sharded_checkpoint_decodes_the_same_tokens(tiny_ckpt, tmp_path):
    make_checkpoint("tiny", str(tmp_path / "sh"), seed=3, shards=3)
    assert (tmp_path / "sh" / "model.safetensors.index.json").exists()
    _, a = _decode(tiny_ckpt, tmp_path / "a.json")
    _, b = _decode(tmp_path / "sh", tmp_path / "b.json")
    assert a["tokens"] == b["tokens"]


def _digest(d):
    return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()


def test_make_checkpoint_is_deterministic(tmp_path):
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        make_checkpoint("tiny", str(tmp_path / name), seed=seed, tokenizer=False)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b") != _digest(tmp_path / "c")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe"


def test_nvfp4_checkpoint_layout(tiny_nvfp4_ckpt):
    from safetensors import safe_open
    q = json.loads(open(f"{tiny_nvfp4_ckpt}/hf_quant_config.json").read())["quantization"]
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16
    with safe_open(f"{tiny_nvfp4_ckpt}/model.safetensors", "pt") as f:
        pre = "model.layers.1.mlp.experts.0.gate_proj"
        assert str(f.get_slice(pre + ".weight").get_dtype()) == "U8"
        assert f.get_slice(pre + ".weight").get_shape() == [32, 32]      # [N, K/2]
        assert f.get_slice(pre + ".weight_scale").get_shape() == [32, 4]   # [N, K/16]
        assert f.get_slice(pre + ".weight_scale_2").get_shape() == []
        assert str(f.get_slice("model.layers.1.self_attn.q_proj.weight").get_dtype()) == "BF16"  # excluded
        assert float(f.get_tensor(pre + ".weight_scale_2")) == float(
            f.get_tensor("model.layers.1.mlp.experts.0.up_proj.weight_scale_2"))  # gate and up share it


def test_synthetic_preset_decodes_from_memory(tmp_path):
    r = rocket("decode", "--checkpoint", "preset:tiny:nvfp4", "--streams", "2", "--tokens", "3", "--quiet",
               "--out", str(tmp_path / "o.json"))
    assert r.returncode == 0, r.stderr
    assert len(json.loads((tmp_path / "o.json").read_text())["tokens"][0]) == 3


def test_split_ceiling_counts_what_one_rank_would_read(tiny_ckpt, tmp_path):
    """Two ranks report what one rank alone would read per step (the stack once plus every expert any rank
    ran) and the ceiling it puts on the split; it is what the one-rank run of the same prompts does read
    (the same tokens, so the same routing)."""
    args = ["decode", "--checkpoint", str(tiny_ckpt), "--streams", "4", "--tokens", "6", "--sweep", "1,4"]
    r2 = rocket_mpi(2, *args, "--out", str(tmp_path / "two.json"))
    assert r2.returncode == 0, r2.stderr
    r1 = rocket(*args, "--out", str(tmp_path / "one.json"))
    assert r1.returncode == 0, r1.stderr
    two, one = (json.loads((tmp_path / f).read_text()) for f in ("two.json", "one.json"))
    assert "split_ceiling" not in one["runs"][0] and "split ceiling" not in r1.stdout
    for run2, run1 in zip(two["runs"], one["runs"]):
        assert run2["tokens"] == run1["tokens"]
        assert abs(run2["one_rank_bytes_per_step"] - run1["per_rank"][0]["weight_bytes_per_step"]) <= 1e-9 * run2["one_rank_bytes_per_step"]
        busiest = max(s["weight_bytes_per_step"] for s in run2["per_rank"])
        assert run2["busiest_rank_bytes_per_step"] == busiest
        assert 1.0 < run2["split_ceiling"] <= 2.0
        assert abs(run2["split_ceiling"] - run2["one_rank_bytes_per_step"] / busiest) < 1e-12
    assert r2.stdout.count("split ceiling") == 2
