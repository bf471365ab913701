"""Canonical row order, derived from routing alone, so every rank lays rows out identically.

Each routed expert has one owner rank, or several (a replicated expert: owners o_0 < ... < o_{m-1}). Each row
(token, expert) gets an *effective owner* from routing alone: expert e's c rows, its tokens in ascending order,
are split in m runs as even as can be, the longer runs first: the j-th row goes to o_{(j * m) // c} (split_rows).
Rows are then ordered by (effective owner, expert id, token), so each rank's rows form one contiguous block
[offsets[r], offsets[r+1]). With one owner per expert and contiguous expert ranges this is just (expert, token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def split_rows(rows: int, owners: int) -> list[int]:
    """How a replicated expert's `rows` rows are shared by its `owners` owners, lowest rank first: owner q takes
    its rows j with (j * owners) // rows == q, the rows [ceil(q * rows / owners), ceil((q + 1) * rows / owners)).
    The counts differ by at most one, the larger ones first; with fewer rows than owners the last take none."""
    return [_ceil_div((q + 1) * rows, owners) - _ceil_div(q * rows, owners) for q in range(owners)]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Owners:
    """The owner ranks of each routed expert of one MoE layer, as the row plans take them.

    Each (expert, owner) is one *pair*; pairs are numbered expert by expert, each expert's in ascending rank:
    expert e's are pair0[e] .. pair0[e+1] - 1 and pair_owner[p] is pair p's rank. Without replicas pair p is
    expert p."""
    lists: tuple[tuple[int, ...], ...]   # [E] the sorted owner ranks of each expert
    pair0: torch.Tensor                  # [E + 1] int64
    pair_owner: torch.Tensor             # [P] int64

    @classmethod
    def of(cls, owners) -> "Owners":
        """From an Owners, a [E] tensor or list of ranks (one owner each), or a list of ints / rank lists."""
        if isinstance(owners, Owners):
            return owners
        if isinstance(owners, torch.Tensor):
            owners = owners.tolist()
        lists = tuple(tuple(sorted(o)) if isinstance(o, (list, tuple)) else (int(o),) for o in owners)
        sizes = torch.tensor([0] + [len(o) for o in lists], dtype=torch.long)
        return cls(lists, torch.cumsum(sizes, 0), torch.tensor([r for o in lists for r in o], dtype=torch.long))

    @classmethod
    def from_tables(cls, pair0: torch.Tensor, pair_owner: torch.Tensor) -> "Owners":
        """From the device plan's tables (pair_owner may be padded past pair0[-1])."""
        p0, po = pair0.cpu().long().tolist(), pair_owner.cpu().long().tolist()
        return cls.of([po[p0[e]:p0[e + 1]] for e in range(len(p0) - 1)])

    @property
    def n_experts(self) -> int:
        return len(self.lists)

    @property
    def n_pairs(self) -> int:
        return int(self.pair0[-1])

    def canonical(self) -> torch.Tensor:
        """[P] int64: the pairs in (owner rank, expert id) order, the order of the canonical rows' segments."""
        pair_expert = torch.repeat_interleave(torch.arange(self.n_experts), self.pair0.diff())
        return torch.argsort(self.pair_owner * self.n_experts + pair_expert)


@dataclass
class RowPlan:
    tokens: torch.Tensor        # [R] int64, token of each row, canonical order
    experts: torch.Tensor       # [R] int64, expert of each row
    owners: torch.Tensor        # [R] int64, effective owner of each row (rank r on [offsets[r], offsets[r+1]))
    offsets: list[int]          # [N+1] rank r owns rows offsets[r]:offsets[r+1]
    segments: list[list[tuple[int, int, int]]]  # per rank: (expert, start, end) over its block
    by_token: torch.Tensor      # [T, k] row index of each token's experts, ascending expert id
    coef: torch.Tensor          # [T, k] fp32 router weight x s2_down, matching by_token

    @property
    def rows(self) -> int:
        return self.tokens.numel()

    def block(self, rank: int) -> tuple[int, int]:
        return self.offsets[rank], self.offsets[rank + 1]


def row_owners(experts: torch.Tensor, owners: Owners) -> torch.Tensor:
    """experts [T, k] -> [T * k] int64: the effective owner of each flat (token, slot) row (module docstring)."""
    t, k = experts.shape
    n_exp = owners.n_experts
    exp = experts.reshape(-1).long()
    if owners.n_pairs == n_exp:  # one owner each: no split
        return owners.pair_owner[exp]
    tok = torch.arange(t).repeat_interleave(k)
    by_e = torch.argsort(exp * t + tok)                      # each expert's rows in token order
    cnt = torch.bincount(exp, minlength=n_exp)
    first = torch.cumsum(cnt, 0) - cnt
    j = torch.empty_like(exp)
    j[by_e] = torch.arange(t * k) - first[exp[by_e]]         # rank of the row among its expert's rows
    p0 = owners.pair0[exp]
    m = owners.pair0[exp + 1] - p0
    return owners.pair_owner[p0 + (j * m) // cnt[exp]]


def plan_rows(experts: torch.Tensor, weights: torch.Tensor, owner, s2_down: torch.Tensor,
              n_ranks: int) -> RowPlan:
    """experts/weights [T, k] from the router; owner: the owners of each expert (Owners, or a [E] tensor of one
    rank each); s2_down [E] fp32."""
    owners = Owners.of(owner)
    t, k = experts.shape
    n_exp = owners.n_experts
    tok = torch.arange(t).repeat_interleave(k)              # [T*k]
    exp = experts.reshape(-1)
    own = row_owners(experts, owners)
    order = torch.argsort((own * n_exp + exp) * t + tok)      # keys are unique: order is total
    tokens, exps, owns = tok[order], exp[order], own[order]
    counts = torch.bincount(owns, minlength=n_ranks).tolist()
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    # (expert, start, end) segments inside each rank's block: one per (owner, expert) with rows
    segments: list[list[tuple[int, int, int]]] = [[] for _ in range(n_ranks)]
    if tokens.numel():
        uniq, seg_counts = torch.unique_consecutive(owns * n_exp + exps, return_counts=True)
        start = 0
        for key, c in zip(uniq.tolist(), seg_counts.tolist()):
            segments[key // n_exp].append((key % n_exp, start, start + c))
            start += c
    # per token, its rows in ascending expert id: the scatter order, independent of placement
    row_of = torch.empty(t * k, dtype=torch.long)
    row_of[order] = torch.arange(t * k)                      # flat (token, slot) -> row index
    slot_order = torch.argsort(experts, dim=-1)              # experts of one token are distinct
    by_token = row_of.view(t, k).gather(1, slot_order)
    w_sorted = weights.gather(1, slot_order)
    e_sorted = experts.gather(1, slot_order)
    coef = w_sorted * s2_down[e_sorted]
    return RowPlan(tokens, exps, owns, offsets, segments, by_token, coef)
