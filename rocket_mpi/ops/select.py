"""topk_first: the k largest scores of each row, exact ties broken toward the lower index.

The DSA indexers pick each query's keys (or pools) by a top-k over a row of scores. A decode step's rows are as long
as the batch's longest stream (or the fixed-shape step's span), the positions past a stream's own masked. The scores
are weighted sums of ReLUs, so exact ties are common (many are exactly 0), and torch.topk breaks them in whatever
order its algorithm meets them, which changes with the row's length: a stream chose other keys alone than beside a
longer one, and decoded other tokens. Here the order is total: the larger value first, of equal values the lower
index first. The choice depends only on the row's values, and masked padding (-inf, finfo.min) past the real
positions never changes it among them. -0.0 counts as +0.0, and every NaN as +inf (torch.topk ranks NaN first).

Two ways to the same indices, each the faster where it runs (measured on an H200 inside a CUDA graph and on one CPU
core, rows of 256 to 200k scores, k 64 to 2048):
  - CUDA: a stable descending sort (equal values keep their index order), cut to k. torch.topk over int64 keys
    (below) costs about twice torch.topk there, the sort about torch.topk's own time or less.
  - CPU: each fp32 value as an int32 of the same order (its bits b where b >= 0, else b ^ 0x7FFFFFFF), widened to an
    int64 key whose low 32 bits are 2**32 - 1 - index. The keys are all distinct, so torch.topk over them has no tie
    to break. The CPU's stable sort is several times slower than this at long rows.
Both are elementwise ops and one sort or topk: no host sync, safe in CUDA graph capture. The tests check both
against a stable sort (tests/test_batch_invariance.py).
"""
from __future__ import annotations

import torch

_LOW = 1 << 32
_INF = float("inf")


def topk_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., n] (fp32, or bf16 / fp16: exact in fp32) -> (values [..., k] in scores' dtype, indices [..., k]
    int64): the k largest along the last dim, sorted descending, of equal values the lower index first. n < 2**32."""
    if not 0 <= k <= scores.shape[-1]:
        raise ValueError(f"topk_first: k {k} of {scores.shape[-1]} scores")
    x = _canonical(scores)
    idx = by_sort(x, k) if x.is_cuda else by_key(x, k)
    return scores.gather(-1, idx), idx


def _canonical(scores: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 copy with NaN -> +inf and -0.0 -> +0.0 (-0.0 + 0.0 is +0.0): equal values, equal bits."""
    if not scores.is_floating_point() or scores.element_size() > 4:
        raise TypeError(f"topk_first: scores of {scores.dtype}; fp32, bf16 or fp16 only")
    return torch.nan_to_num(scores.float(), nan=_INF, posinf=_INF, neginf=-_INF).add_(0.0)


def by_sort(x: torch.Tensor, k: int) -> torch.Tensor:
    """topk_first's indices of canonical scores x (the CUDA way): a stable descending sort, cut to k."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def by_key(x: torch.Tensor, k: int) -> torch.Tensor:
    """topk_first's indices of canonical scores x (the CPU way; x is overwritten): torch.topk over distinct int64
    keys, (the value's order) * 2**32 + (2**32 - 1 - index)."""
    b = x.view(torch.int32)
    b.bitwise_xor_((b >> 31) & 0x7FFFFFFF)                     # negatives' magnitude bits flipped: the floats' order
    low = (_LOW - 1) - torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    return torch.add(low, b, alpha=_LOW).topk(k, dim=-1).indices
