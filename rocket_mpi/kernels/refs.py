"""Pure-torch references of the fast ops, computing what the kernels compute (DeepEP utils/refs style).

nvfp4_experts_ref is the kernel's math with torch's summation order: weights E2M1 * scale exactly
(bf16-representable), fp32 dot products, gate/up scaled by weight_scale_2 in fp32 and rounded to bf16,
then the same SwiGLU as rocket_mpi/moe/experts.py (clamp, F.silu, product, each in bf16), then the
down projection in fp32 rounded once to bf16, without down's weight_scale_2 (the scatter's).
It differs from ExpertStore.compute only where that rounds weights to bf16 after weight_scale_2,
and from the kernel only in the order of the fp32 sums.

moe_scatter_add_ref is rocket_mpi/moe/scatter.py itself: the kernel must match it bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rocket_mpi.kernels.pack import PackedExperts
from rocket_mpi.moe.scatter import moe_scatter_add as moe_scatter_add_ref  # noqa: F401  (re-export)


def block_rows(x: torch.Tensor, segments: list[tuple[int, int, int]], base: int,
               row_index: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The rows of this rank's block: x itself, or x gathered through row_index; and their count."""
    n = (segments[-1][2] - base) if segments else 0
    rows = x if row_index is None else x[row_index.to(x.device)]
    if rows.shape[0] < n:
        raise ValueError(f"nvfp4_experts: segments cover {n} rows from {base} but there are {rows.shape[0]}")
    return rows, n


def nvfp4_experts_ref(x: torch.Tensor, segments: list[tuple[int, int, int]], packed: PackedExperts, base: int = 0,
                      row_index: torch.Tensor | None = None, swiglu_limit: float | None = None) -> torch.Tensor:
    """x [*, H] bf16; segments (expert, start, end) over canonical rows from `base` -> [end - base, H] bf16."""
    rows, n = block_rows(x, segments, base, row_index)
    out = torch.empty(n, packed.hidden, dtype=torch.bfloat16, device=x.device)
    dev = packed.device
    for e, start, end in segments:
        if end == start:
            continue
        s = packed.slot[e]
        g, u, d = packed.dense(s)                                             # fp32, exact
        xe = rows[start - base:end - base].to(dev).float()                    # [n_e, H]
        gate = ((xe @ g.T) * packed.s2_gu[s, 0]).to(torch.bfloat16)
        up = ((xe @ u.T) * packed.s2_gu[s, 1]).to(torch.bfloat16)
        if swiglu_limit is not None:
            gate = gate.clamp(max=swiglu_limit)
            up = up.clamp(-swiglu_limit, swiglu_limit)
        h = F.silu(gate) * up                                                 # bf16, as experts.py
        out[start - base:end - base] = (h.float() @ d.T).to(torch.bfloat16).to(out.device)
    return out
