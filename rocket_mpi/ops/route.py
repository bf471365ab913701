"""The router every rank runs on the same normalised hidden state, so every rank knows all rows."""
from __future__ import annotations

import torch

from rocket_mpi.config import ModelConfig
from rocket_mpi.ops import _ext
from rocket_mpi.ops.stack import linear_rows


def route_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (weights [T, k] fp32, experts [T, k] int64).

    fp32 logits, sigmoid, + e_score_correction_bias for choice only, group-limited top-k, weights are
    the unbiased scores of the chosen, normalised, times routed_scaling_factor.
    """
    return route_logits(linear_rows(x.float(), weight), bias, cfg)  # a row's logits whatever the batch


def route_logits(logits: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """route_ref() from the fp32 logits [T, E] on (what csrc/router.cu moe_route computes)."""
    t = logits.shape[0]
    e, g = cfg.n_routed_experts, cfg.n_group
    scores = logits.sigmoid()                                # [T, E]
    choice = scores + bias
    group_scores = choice.view(t, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(t, g, e // g).reshape(t, e).bool()
    choice = choice.masked_fill(~expert_mask, float("-inf"))
    experts = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """route_ref on CUDA in two kernels (router.cu): the same experts and weights up to the
    fp32 sum order of the logits (tests/test_router.py). CPU tensors take route itself."""
    if not x.is_cuda:
        return route_ref(x, weight, bias, cfg)
    C = _ext.require()
    partial = C.router_logits(x.contiguous(), weight)  # [slices of H, T, E]: moe_route sums them in order
    w, e = C.moe_route(partial, bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, bool(cfg.norm_topk_prob),
                       float(cfg.routed_scaling_factor))
    return w, e
