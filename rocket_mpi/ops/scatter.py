"""moe_scatter_add: the one place expert rows become a token's MoE output.

For each token, fp32 accumulation of (w[t,e] * s2_down[e]) * row[t,e] over its experts in ascending
expert id, one rounding to BF16. Every rank holds the same rows and runs this same code, so the
result is bit-identical whichever rank computed which row.
"""
from __future__ import annotations

import zlib

import torch

from rocket_mpi.ops import _ext
from rocket_mpi.ops.norm import rms_norm_ref
from rocket_mpi.ops.stack import add_residuals


def moe_scatter_add_ref(rows: torch.Tensor, by_token: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """rows [R, H] bf16; by_token [T, k] row indices (ascending expert); coef [T, k] fp32 -> [T, H] bf16."""
    t, k = by_token.shape
    acc = torch.zeros(t, rows.shape[1], dtype=torch.float32, device=rows.device)
    for j in range(k):  # fixed order: ((r0 + r1) + r2) + ...
        acc += coef[:, j:j + 1] * rows[by_token[:, j]].float()
    return acc.to(torch.bfloat16)


def moe_scatter_add(rows: torch.Tensor, by_token: torch.Tensor, coef: torch.Tensor,
                    by_canon: torch.Tensor | None = None, check: torch.Tensor | None = None,
                    residual=(), norm: tuple[torch.Tensor, float] | None = None):
    """rows [R, H] bf16; by_token [T, k] row indices (ascending expert); coef [T, k] fp32 -> [T, H] bf16,
    bitwise equal to moe_scatter_add_ref. With by_canon [T, k] (each entry's canonical
    row) and check (one int64), also check += row_sum of the rows in canonical order. Then + each of
    `residual` ([T, H] bf16, at most 2) in order, as torch's r + y (the graphed step's x + (routed + shared)).
    With norm = (weight, eps): returns (out, rms_norm(out, weight, eps)), on a GPU from the same launch where the
    shapes allow (the same bits as ops.rms_norm after it), on a CPU through rms_norm_ref."""
    if not rows.is_cuda:
        if check is not None:
            order = torch.empty(by_canon.numel(), dtype=torch.long)
            order[by_canon.reshape(-1).long()] = by_token.reshape(-1).cpu()
            check += row_sum(rows[order])
        out = add_residuals(moe_scatter_add_ref(rows, by_token, coef), residual)
        if norm is None:
            return out
        return out, rms_norm_ref(out, norm[0], norm[1])
    C = _ext.require()
    args = (rows.contiguous(), by_token.to(device=rows.device, dtype=torch.int64).contiguous(),
            coef.to(device=rows.device, dtype=torch.float32).contiguous(), by_canon, check,
            [r.contiguous() for r in residual])
    if norm is None:
        return C.moe_scatter_add(*args)
    return C.moe_scatter_add(*args, norm_w=norm[0], eps=float(norm[1]))


def row_checksum(rows: torch.Tensor, acc):
    """Checksum of a layer's full row set, chained over a step's layers (the static fire shows it at a
    divergence). CPU: crc32 of the bytes. GPU: row_sum (kept on the device, so the per-layer path gains no
    device-to-host copy; read once per step) chained as fold_row_sums does."""
    if rows.device.type == "cpu":
        return zlib.crc32(rows.contiguous().view(torch.uint8).numpy(), int(acc))
    return (acc * 1_000_003 + row_sum(rows)) & 0xFFFFFFFF


def row_sum(rows: torch.Tensor) -> torch.Tensor:
    """Position-weighted sum of the rows' 16-bit words (int64; the graphed step's moe_scatter_add sums the same)."""
    words = rows.reshape(-1).view(torch.int16).to(torch.int64)
    return (words * _checksum_weights(words.numel(), rows.device)).sum()


def fold_row_sums(sums: list[int]) -> int:
    """The GPU checksum chain of row_checksum over per-layer row_sum values."""
    acc = 0
    for v in sums:
        acc = (acc * 1_000_003 + v) & 0xFFFFFFFF
    return acc


_WEIGHTS: dict = {}


def _checksum_weights(n: int, device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None or w.numel() < n:
        w = _WEIGHTS[device] = torch.arange(1, max(n, 1 << 16) + 1, device=device) % 65521 + 1
    return w[:n]
