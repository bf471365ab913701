"""Our engine against transformers' DeepseekV3ForCausalLM (fp32, same weights) on tiny random models.

DeepSeek-V3's architecture (DeepSeek-V3 / R1) is GLM-5's MLA and MoE without the DSA indexer, with YaRN's rope (its
frequencies and cos / sin factor, and the softmax temperature mscale^2): the engine runs it as glm_moe_dsa with
every position attended (model/glm_moe_dsa.DeepseekV3Model). The bound is the GLM-4.x oracle's (no indexer, so no
top-k flips): 8 streams x 20 tokens, teacher-forced on our tokens, every step within ATOL + RTOL * max|ref|, the median
of error/bound at most TYPICAL, every greedy choice the reference's argmax or within MARGIN of it. YaRN is tested
with a context past its pretraining length (original_max_position_embeddings 16 < the 22..32 positions decoded), so
the interpolated frequencies matter, and the attention projections are scaled up 3x so the attention is peaked
enough for its temperature to show; test_oracle_is_sensitive shows the check fails for an engine without YaRN
(measured: median error 1.6 of the bound, worst 3.1, against 0.17 and 0.56 with it).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the test oracle; pip install transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from rocket_mpi.config import ModelConfig  # noqa: E402
from rocket_mpi.errors import ConfigError  # noqa: E402
from rocket_mpi.runtime.engine import Engine  # noqa: E402
from rocket_mpi.runtime.prompts import default_prompts  # noqa: E402
from oracle import dequantised_reference, engine_against, like_trained, nvfp4_twin, save_bf16  # noqa: E402

from conftest import rocket  # noqa: E402

RTOL, ATOL, TYPICAL, MARGIN = 0.02, 0.01, 0.3, 0.03
STREAMS, TOKENS = 8, 20
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1}

VARIANTS = {
    # DeepSeek-V3's own settings: groups, YaRN with mscale = mscale_all_dim (cos / sin unscaled, softmax x mscale^2)
    "yarn_groups": dict(rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, n_group=4, topk_group=2,
                        attention_bias=False),
    # mscale != mscale_all_dim: cos and sin scaled too; attention biases; one group; sharded on disk
    "yarn_attention_factor_sharded": dict(rope_parameters={**YARN, "mscale": 0.8, "mscale_all_dim": 1.2},
                                          n_group=1, topk_group=1, attention_bias=True),
    # the plain rope
    "default_rope": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, n_group=2, topk_group=1,
                         attention_bias=False),
}
SHAPE = dict(vocab_size=397, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
             q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             moe_intermediate_size=48, n_routed_experts=12, num_experts_per_tok=3, first_k_dense_replace=1,
             routed_scaling_factor=2.5, max_position_embeddings=64, initializer_range=0.04, norm_topk_prob=True,
             tie_word_embeddings=False)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def build_hf(variant: str, seed: int = 0) -> DeepseekV3ForCausalLM:
    cfg = DeepseekV3Config(**SHAPE, **VARIANTS[variant])
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    like_trained(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                              "kv_b_proj.weight")):
                p.mul_(3.0)  # peaked attention: the softmax temperature and the frequencies show in the logits
    return model


def check_against(model, ckpt, patch=None):
    eng = Engine(ckpt)
    if patch:
        patch(eng)
    prompts = default_prompts(STREAMS, eng.cfg.vocab_size, seed=7)
    return engine_against(eng, model, prompts, TOKENS, RTOL, ATOL, MARGIN, TYPICAL)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_matches_transformers(variant, tmp_path):
    model = build_hf(variant)
    save_bf16(model, tmp_path, shards=variant.endswith("sharded"))
    cfg = ModelConfig.from_checkpoint(str(tmp_path))
    assert cfg.model_type == "deepseek_v3" and cfg.moe_layers == (1, 2)
    assert (cfg.raw["yarn"] is None) == (variant == "default_rope")
    ref = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    check_against(ref, str(tmp_path))


def test_nvfp4_all_matches_transformers_on_dequantised_weights(tmp_path):
    """Every Linear but lm_head and the routers NVFP4 (ModelOpt's recipe), against the same model holding exactly the
    dequantised weights."""
    model = build_hf("yarn_groups", seed=1)
    q = nvfp4_twin(model, tmp_path, True)
    assert sum(1 for v in q.values() if v.dtype == torch.uint8) >= 2 * 12 * 3
    check_against(dequantised_reference(model, q), str(tmp_path / "q"))


def test_oracle_is_sensitive(tmp_path):
    """The same check fails for an engine whose rope ignores YaRN (the plain frequencies and softmax scale)."""
    from rocket_mpi.model.layers import Rope
    model = build_hf("yarn_groups")
    save_bf16(model, tmp_path)
    ref = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    def plain(eng):
        m = eng.model
        m.rope = Rope(m.rope_dim, eng.cfg.rope_theta, torch.bfloat16)
        m.scale = (m.nope + m.rope_dim) ** -0.5
    with pytest.raises(AssertionError, match="logit|below the reference"):
        check_against(ref, str(tmp_path), patch=plain)


@pytest.mark.parametrize("edit,needle", [
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(rope_scaling={"type": "longrope", "factor": 2.0}), "rope_type 'longrope'"),
    (dict(rope_scaling={"type": "yarn", "factor": -1}), "rope 'factor' must be a positive number"),
    (dict(scoring_func="softmax"), "'scoring_func' is 'softmax'"),      # DeepSeek-V2's router
    (dict(topk_method="greedy"), "'topk_method' is 'greedy'"),
    (dict(moe_layer_freq=2), "'moe_layer_freq' is 2"),
])
def test_unsupported_settings_are_one_line(edit, needle):
    raw = {"model_type": "deepseek_v3", **SHAPE, "rope_theta": 10000.0, **edit}
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("ranks,fabric,path", [(2, "shm", "host"), (3, "mpi", "host"), (2, "mpi", "device"),
                                               (3, "shm", "device")])
def test_static_fire(ranks, fabric, path, tmp_path):
    """The split decodes the one-rank tokens (rows and checksums too) on the host path and on the fixed-shape step's
    CPU form, with YaRN and groups (the dsv3-tiny preset, its experts NVFP4)."""
    r = rocket("static-fire", "--checkpoint", "preset:dsv3-tiny:nvfp4", "--ranks", str(ranks), "--sweep", "1,8",
               "--tokens", "8", "--fabric", fabric, "--fabric-timeout", "20", "--decode-path", path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"STATIC FIRE PASS: 0/8 streams mismatched ({ranks} ranks, fabric {fabric}" in r.stdout
