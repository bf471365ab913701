"""moe_scatter_add: the one place expert rows become a token's MoE output.

For each token, fp32 accumulation of (w[t,e] * s2_down[e]) * row[t,e] over its experts in ascending
expert id, one rounding to BF16. Every rank holds the same rows and runs this same code, so the
result is bit-identical whichever rank computed which row.
"""
from __future__ import annotations

import torch


def moe_scatter_add(rows: torch.Tensor, by_token: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """rows [R, H] bf16; by_token [T, k] row indices (ascending expert); coef [T, k] fp32 -> [T, H] bf16."""
    t, k = by_token.shape
    acc = torch.zeros(t, rows.shape[1], dtype=torch.float32, device=rows.device)
    for j in range(k):  # fixed order: ((r0 + r1) + r2) + ...
        acc += coef[:, j:j + 1] * rows[by_token[:, j]].float()
    return acc.to(torch.bfloat16)
