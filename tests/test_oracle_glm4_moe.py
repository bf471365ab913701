"""Our engine against transformers' Glm4MoeForCausalLM (fp32, same weights) on tiny random models.

Tolerance, stated: at every step of 8 streams x 20 tokens our BF16 logits are within
ATOL + RTOL * max|ref| of the fp32 reference (teacher-forced on our tokens), and every greedy choice
is the reference's argmax or within MARGIN of its top logit. BF16 has an 8-bit mantissa (relative
step 2^-8 = 0.4%); the typical step here is at 0.2 of this bound. The headroom is for the rare
token whose router scores sit within BF16 noise of a tie, where BF16 and fp32 pick different experts
(seen once in 640 steps, at 0.9 of the bound). test_oracle_is_sensitive shows the bound still
catches a real routing bug.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the test oracle; pip install transformers")
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM  # noqa: E402

from rocket_mpi.runtime.engine import Engine  # noqa: E402
from rocket_mpi.runtime.prompts import default_prompts  # noqa: E402
from oracle import (assert_logits_close, dequantised_reference, like_trained, nvfp4_twin,  # noqa: E402
                    reference_logits, save_bf16)

RTOL, ATOL, MARGIN = 0.02, 0.01, 0.02
STREAMS, TOKENS = 8, 20

VARIANTS = {
    # n_group > 1, qk-norm, attention bias, partial rotary 0.5, odd head count / vocab
    "groups_qknorm_bias": dict(vocab_size=397, hidden_size=96, intermediate_size=80, num_hidden_layers=3,
                               num_attention_heads=3, num_key_value_heads=1, head_dim=32, moe_intermediate_size=48,
                               n_routed_experts=12, num_experts_per_tok=3, n_group=3, topk_group=2,
                               first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
                               routed_scaling_factor=2.5, partial_rotary_factor=0.5),
    # plain: one group, no qk-norm, no bias, two dense layers, sharded on disk
    "plain_sharded": dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, head_dim=16, moe_intermediate_size=32,
                          n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                          first_k_dense_replace=2, use_qk_norm=False, attention_bias=False,
                          routed_scaling_factor=1.0, partial_rotary_factor=0.5),
}


def build_hf(variant: str, seed: int = 0) -> Glm4MoeForCausalLM:
    kw = dict(VARIANTS[variant])
    prf = kw.pop("partial_rotary_factor")
    # initializer_range 0.04 (not 0.02) so the routed experts move the logits enough for a wrong route
    # or a wrong expert to show up beyond the tolerance
    cfg = Glm4MoeConfig(**kw, max_position_embeddings=256, initializer_range=0.04, norm_topk_prob=True, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": prf})
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(cfg).eval()
    like_trained(model)
    return model


def check_against(model, ckpt):
    eng = Engine(ckpt)
    prompts = default_prompts(STREAMS, eng.cfg.vocab_size, seed=7)
    ours = []
    res = eng.generate(prompts, TOKENS, on_step=lambda step, logits: ours.append(logits.clone()))
    ref = reference_logits(model, prompts, res.tokens)
    assert_logits_close(ref, ours, res.tokens, RTOL, ATOL, MARGIN)
    return res


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_matches_transformers(variant, tmp_path):
    model = build_hf(variant)
    save_bf16(model, tmp_path, shards=(variant == "plain_sharded"))
    if variant == "plain_sharded":
        assert (tmp_path / "model.safetensors.index.json").exists()
    ref = Glm4MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    check_against(ref, str(tmp_path))



@pytest.mark.parametrize("quant_all", [False, True], ids=["nvfp4_experts", "nvfp4_all"])
def test_nvfp4_matches_transformers_on_dequantised_weights(quant_all, tmp_path):
    model = build_hf("groups_qknorm_bias", seed=1)
    q = nvfp4_twin(model, tmp_path, quant_all)
    n_packed = sum(1 for k, v in q.items() if v.dtype == torch.uint8)
    assert n_packed >= 2 * 12 * 3, "the routed experts must be NVFP4 on disk"
    ref = dequantised_reference(model, q)
    check_against(ref, str(tmp_path / "q"))


def test_oracle_is_sensitive(tmp_path, monkeypatch):
    """The same check fails when our router ignores e_score_correction_bias: the tolerance is not loose."""

    from rocket_mpi import ops
    model = build_hf("groups_qknorm_bias")
    save_bf16(model, tmp_path)
    ref = Glm4MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    real = ops.route_ref
    monkeypatch.setattr(ops, "route_ref", lambda x, w, b, cfg: real(x, w, torch.zeros_like(b), cfg))
    with pytest.raises(AssertionError, match="logit diff|below the reference"):
        check_against(ref, str(tmp_path))
