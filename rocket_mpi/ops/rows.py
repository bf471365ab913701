"""Canonical row order, derived from routing alone, so every rank lays rows out identically.

Rows are ordered by (owner rank, expert id, token). With contiguous expert ranges this is just
(expert, token). Each rank's rows form one contiguous block [offsets[r], offsets[r+1]).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowPlan:
    tokens: torch.Tensor        # [R] int64, token of each row, canonical order
    experts: torch.Tensor       # [R] int64, expert of each row
    offsets: list[int]          # [N+1] rank r owns rows offsets[r]:offsets[r+1]
    segments: list[list[tuple[int, int, int]]]  # per rank: (expert, start, end) over its block
    by_token: torch.Tensor      # [T, k] row index of each token's experts, ascending expert id
    coef: torch.Tensor          # [T, k] fp32 router weight x s2_down, matching by_token

    @property
    def rows(self) -> int:
        return self.tokens.numel()

    def block(self, rank: int) -> tuple[int, int]:
        return self.offsets[rank], self.offsets[rank + 1]


def plan_rows(experts: torch.Tensor, weights: torch.Tensor, owner: torch.Tensor, s2_down: torch.Tensor,
              n_ranks: int) -> RowPlan:
    """experts/weights [T, k] from the router; owner [E] rank of each expert; s2_down [E] fp32."""
    t, k = experts.shape
    n_exp = owner.numel()
    tok = torch.arange(t).repeat_interleave(k)              # [T*k]
    exp = experts.reshape(-1)
    own = owner[exp]
    order = torch.argsort((own * n_exp + exp) * t + tok)      # keys are unique: order is total
    tokens, exps, owners = tok[order], exp[order], own[order]
    counts = torch.bincount(owners, minlength=n_ranks).tolist()
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    # expert segments inside each rank's block
    segments: list[list[tuple[int, int, int]]] = [[] for _ in range(n_ranks)]
    if tokens.numel():
        uniq, seg_counts = torch.unique_consecutive(exps, return_counts=True)
        start = 0
        for e, c in zip(uniq.tolist(), seg_counts.tolist()):
            segments[int(owner[e])].append((e, start, start + c))
            start += c
    # per token, its rows in ascending expert id: the scatter order, independent of placement
    row_of = torch.empty(t * k, dtype=torch.long)
    row_of[order] = torch.arange(t * k)                      # flat (token, slot) -> row index
    slot_order = torch.argsort(experts, dim=-1)              # experts of one token are distinct
    by_token = row_of.view(t, k).gather(1, slot_order)
    w_sorted = weights.gather(1, slot_order)
    e_sorted = experts.gather(1, slot_order)
    coef = w_sorted * s2_down[e_sorted]
    return RowPlan(tokens, exps, offsets, segments, by_token, coef)
