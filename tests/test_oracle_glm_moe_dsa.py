"""Our engine against transformers' GlmMoeDsaForCausalLM (fp32, same weights) on tiny random models.

Tolerance, stated. For 8 streams x 20 tokens, teacher-forced on our tokens, at every step our BF16
logits are within ATOL + RTOL * max|ref| of the fp32 reference; the median of error/bound over all
160 steps is at most TYPICAL; and every greedy choice is the reference's argmax or within MARGIN of
its top logit.

Why two bounds: BF16 has an 8-bit mantissa (relative step 2^-8 = 0.4%), and two discrete choices
flip where BF16 noise straddles a tie: the router's experts and, far more often here, the DSA
indexer's top-k tokens (index_topk 8 of 3..32 candidates with flat, untrained index scores: about 4%
of selections swap their boundary token, each moving one eighth of the attention). Those flips are
rare large steps; transformers' own BF16 forward of the same checkpoint shows the same ones (measured
on groups_bias: worst 1.12 x the GLM-4.x oracle's bound 0.01 + 0.02 max|ref|, at the same steps as
ours). So the per-step bound is 1.5x the GLM-4.x one (worst step measured over 3 seeds x 4 checkpoints:
0.75 of it), and the typical error is held tightly by the median (measured 0.11..0.13 of the bound;
an engine ignoring the indexer or the router's correction bias sits at 0.69..1.1).

index_topk is 8 and the prompts are 3..13 tokens, decoded to 22..32: streams start below index_topk
(dense attention) and cross it, others run sparse from the prefill on. test_oracle_is_sensitive shows
the check fails for an engine that ignores the indexer's selection, and one whose router ignores
e_score_correction_bias.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the test oracle; pip install transformers")
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM  # noqa: E402

from rocket_mpi.checkpoint.make import make_checkpoint  # noqa: E402
from rocket_mpi.config import ModelConfig  # noqa: E402
from rocket_mpi.runtime.engine import Engine  # noqa: E402
from rocket_mpi.errors import ConfigError  # noqa: E402
from rocket_mpi.runtime.prompts import default_prompts  # noqa: E402
from oracle import dequantised_reference, engine_against, like_trained, nvfp4_twin, save_bf16  # noqa: E402

from conftest import rocket  # noqa: E402

RTOL, ATOL, TYPICAL, MARGIN = 0.03, 0.015, 0.3, 0.03
STREAMS, TOKENS = 8, 20
INDEX_TOPK = 8

VARIANTS = {
    # n_group > 1, attention biases, every layer with its own indexer
    "groups_bias": dict(vocab_size=397, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
                        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32,
                        qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32,
                        moe_intermediate_size=48, n_routed_experts=12, num_experts_per_tok=3, n_group=3,
                        topk_group=2, first_k_dense_replace=1, attention_bias=True, routed_scaling_factor=2.5),
    # GLM-5's own settings (one group, no bias), a shared-indexer layer (index_topk_freq 2: full, full,
    # shared, full), a dense layer after a sparse one (mlp_layer_types), sharded on disk
    "shared_indexer_sharded": dict(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=24,
                                   qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=16,
                                   moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                                   topk_group=1, first_k_dense_replace=1,
                                   mlp_layer_types=["dense", "sparse", "dense", "sparse"], index_topk_freq=2,
                                   attention_bias=False, routed_scaling_factor=1.0),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def build_hf(variant: str, seed: int = 0) -> GlmMoeDsaForCausalLM:
    # initializer_range 0.04 (not 0.02) so the routed experts and the attention move the logits enough
    # for a wrong route or a wrong token selection to show up beyond the tolerance
    cfg = GlmMoeDsaConfig(**VARIANTS[variant], index_topk=INDEX_TOPK, max_position_embeddings=256,
                          initializer_range=0.04, norm_topk_prob=True, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(cfg).eval()
    like_trained(model, unit=("indexer.weights_proj.weight",))     # head weights of order 1, as trained ones are
    return model


def check_against(model, ckpt, patch=None):
    eng = Engine(ckpt)
    if patch:
        patch(eng)
    prompts = default_prompts(STREAMS, eng.cfg.vocab_size, seed=7)
    lengths = [len(p) for p in prompts]
    # above index_topk the prefill's last rows attend over their own top-k rows, gathered (_prefill_attend)
    assert min(lengths) < INDEX_TOPK < max(lengths), "prompts must start both below and above index_topk"
    return engine_against(eng, model, prompts, TOKENS, RTOL, ATOL, MARGIN, TYPICAL)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_matches_transformers(variant, tmp_path):
    model = build_hf(variant)
    sharded = variant == "shared_indexer_sharded"
    save_bf16(model, tmp_path, shards=sharded)
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").exists()
        cfg = ModelConfig.from_checkpoint(str(tmp_path))
        assert cfg.moe_layers == (1, 3) and cfg.raw["indexer_types"] == ["full", "full", "shared", "full"]
    ref = GlmMoeDsaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    check_against(ref, str(tmp_path))



@pytest.mark.parametrize("quant_all", [False, True], ids=["nvfp4_experts", "nvfp4_all"])
def test_nvfp4_matches_transformers_on_dequantised_weights(quant_all, tmp_path):
    model = build_hf("groups_bias", seed=1)
    q = nvfp4_twin(model, tmp_path, quant_all)
    packed = {k for k, v in q.items() if v.dtype == torch.uint8}
    assert len(packed) >= 2 * 12 * 3, "the routed experts must be NVFP4 on disk"
    if quant_all:
        assert "model.layers.1.self_attn.kv_b_proj.weight" in packed
        assert "model.layers.1.self_attn.indexer.weights_proj.weight" in packed
    ref = dequantised_reference(model, q)
    check_against(ref, str(tmp_path / "q"))


def _dense_attention(eng):
    eng.model.index_topk = 1 << 30      # the indexer's selection ignored: every cached token attended


def _router_without_bias(eng, monkeypatch):

    from rocket_mpi import ops
    real = ops.route_ref
    monkeypatch.setattr(ops, "route_ref", lambda x, w, b, cfg: real(x, w, torch.zeros_like(b), cfg))


@pytest.mark.parametrize("bug", ["dense_attention", "router_without_bias"])
def test_oracle_is_sensitive(bug, tmp_path, monkeypatch):
    """The same check fails on a real bug: the tolerance is not loose, and the sparse selection matters."""
    model = build_hf("groups_bias")
    save_bf16(model, tmp_path)
    ref = GlmMoeDsaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    patch = _dense_attention if bug == "dense_attention" else lambda eng: _router_without_bias(eng, monkeypatch)
    with pytest.raises(AssertionError, match="median logit error|logit diff|below the reference"):
        check_against(ref, str(tmp_path), patch)


def test_config_errors_name_the_field():
    base = {"model_type": "glm_moe_dsa", **VARIANTS["groups_bias"], "index_topk": INDEX_TOPK,
            "max_position_embeddings": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    cfg = ModelConfig.from_dict(base)
    assert cfg.moe_layers == (1, 2) and cfg.head_dim == 16 and cfg.rotary_dim == 16
    assert cfg.num_key_value_heads == 4 and cfg.raw["indexer_types"] == ["full"] * 3
    with pytest.raises(ConfigError, match="missing required field 'kv_lora_rank'"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "kv_lora_rank"})
    with pytest.raises(ConfigError, match="indexer_types\\[0\\] is 'shared'"):
        ModelConfig.from_dict({**base, "indexer_types": ["shared", "full", "full"]})
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        ModelConfig.from_dict({**base, "mlp_layer_types": ["dense", "sparse"]})


def test_static_fire_two_ranks(tmp_path):
    """The expert split holds for this family unchanged: 2 ranks over shm decode the one-rank tokens."""
    ckpt = str(tmp_path / "dsa")
    make_checkpoint("dsa-tiny", ckpt, seed=3)
    r = rocket("static-fire", "--checkpoint", ckpt, "--ranks", "2", "--sweep", "1,4", "--tokens", "6",
               "--fabric", "shm", "--prefill-chunk", "8", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STATIC FIRE PASS" in r.stdout, r.stdout + r.stderr
