"""The routed-expert GEMM: nvfp4_experts (csrc/nvfp4_experts.cu) and its torch reference nvfp4_experts_ref.

nvfp4_experts_ref is the kernel's math with torch's summation order: weights E2M1 * scale exactly
(bf16-representable), fp32 dot products, gate/up scaled by weight_scale_2 in fp32 and rounded to bf16,
then the same SwiGLU as rocket_mpi/moe/experts.py (clamp, F.silu, product, each in bf16), then the
down projection in fp32 rounded once to bf16, without down's weight_scale_2 (the scatter's).
It differs from ExpertStore.compute only where that rounds weights to bf16 after weight_scale_2,
and from the kernel only in the order of the fp32 sums.

The GPU entry points take `pdl` (how the kernel launches down after gate/up: -1 auto, 0 off, 3 each pass of down
waits for its own pass of gate/up, csrc/rocket.h kPdl*). It only moves when the weight copies and the rows start,
never the bits, so the CPU reference ignores it. The host-planned ones also take `wide` (the NVFP4 kernel instance:
-1 auto, the wide one when the passes average more than 2 row tiles, as a prefill chunk's, on warpgroup mma where the
GPU is sm_90; 0 off; 1 on; 2 the wide one on warpgroup mma, an error elsewhere; rocket.h kWide*), which never changes
the bits either.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rocket_mpi.ops import _ext
from rocket_mpi.ops.pack import PackedExperts


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


MAX_GROUPS = 65535  # grid.y of the expert kernels: weight passes (<= 32 rows of one expert) per launch

def launch_plan(segments: list[tuple[int, int, int]], base: int, slot: dict[int, int]):
    """Segments -> (plan int32 [tiles * 8 + groups * 4], tiles, groups, rows), built on the CPU.

    Each expert's rows are padded to tiles of 8 (the mma's N); plan[:tiles*8] gives the block row of
    each padded row (-1 = padding); then one (slot, first tile, tiles <= 4, 0) per weight pass."""
    prev = base
    pad_rows: list[int] = []
    groups: list[int] = []
    for e, s, t in segments:  # plain Python: a decode step calls this per layer, torch ops cost ms here
        if s != prev or t < s:
            raise ValueError(f"nvfp4_experts: segments must tile the block from base {base} contiguously; "
                             f"got {segments}")
        prev = t
        if t == s:
            continue
        if e not in slot:
            raise ValueError(f"nvfp4_experts: expert {e} has rows but is not packed on this rank "
                             f"(packed: {sorted(slot)})")
        tile0, tiles = len(pad_rows) // 8, (t - s + 7) // 8
        pad_rows.extend(range(s - base, t - base))
        pad_rows.extend([-1] * (tiles * 8 - (t - s)))
        for k in range(0, tiles, 4):
            groups.extend((slot[e], tile0 + k, min(4, tiles - k), 0))
    n_groups = len(groups) // 4
    if n_groups > MAX_GROUPS:
        raise ValueError(f"nvfp4_experts: {n_groups} weight passes exceed {MAX_GROUPS}; split the launch")
    return torch.tensor(pad_rows + groups, dtype=torch.int32), len(pad_rows) // 8, n_groups, prev - base

def nvfp4_experts(x: torch.Tensor, segments: list[tuple[int, int, int]], packed: PackedExperts, base: int = 0,
                  row_index: torch.Tensor | None = None, swiglu_limit: float | None = None, *,
                  pdl: int = -1, wide: int = -1) -> torch.Tensor:
    """This rank's expert rows: [end - base, H] bf16, without down's weight_scale_2.

    x [*, H] bf16: the block's rows in canonical order (rows of one expert contiguous), or, with
    `row_index` [end - base] int64, any rows (e.g. the tokens' hidden states) gathered through it.
    segments: (expert, start, end) in canonical row indices starting at `base`, contiguous.
    pdl, wide: the launch's scheduling and kernel instance (module docstring); the same bits whatever they are,
    ignored on the CPU."""
    if x.dim() != 2 or x.shape[1] != packed.hidden:
        raise ValueError(f"nvfp4_experts: x {tuple(x.shape)}, experts have hidden {packed.hidden}")
    if not x.is_cuda:
        return nvfp4_experts_ref(x, segments, packed, base, row_index, swiglu_limit)
    _ext.require()
    if packed.device != x.device:
        raise ValueError(f"nvfp4_experts: x on {x.device}, packed experts on {packed.device}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"nvfp4_experts: x is {x.dtype}, expected bfloat16")
    plan, n_tiles, n_groups, n_rows = launch_plan(segments, base, packed.slot)
    if row_index is not None:
        if row_index.shape != (n_rows,):
            raise ValueError(f"nvfp4_experts: row_index {tuple(row_index.shape)}, segments cover {n_rows} rows")
        row_index = row_index.to(device=x.device, dtype=torch.int64).contiguous()
    elif x.shape[0] < n_rows:
        raise ValueError(f"nvfp4_experts: segments cover {n_rows} rows, x has {x.shape[0]}")
    # pinned, so the copy is stream-ordered and async: the host never waits for the GPU here
    plan = plan.pin_memory().to(x.device, non_blocking=True) if n_tiles else plan.to(x.device)
    return nvfp4_experts_planned(x, row_index, plan, n_tiles, n_groups, n_rows, packed, swiglu_limit, pdl=pdl,
                                 wide=wide)

def nvfp4_experts_planned(x: torch.Tensor, row_index: torch.Tensor | None, plan: torch.Tensor, n_tiles: int,
                          n_groups: int, n_rows: int, packed: PackedExperts,
                          swiglu_limit: float | None = None, *, pdl: int = -1, wide: int = -1) -> torch.Tensor:
    """nvfp4_experts with the launch plan (launch_plan) already on the device: just the kernels."""
    return _ext.require().nvfp4_experts(x.contiguous(), row_index, plan, n_tiles, n_groups, n_rows, packed.q_gu,
                                        packed.s_gu, packed.s2_gu, packed.q_dn, packed.s_dn, packed.hidden,
                                        packed.inter, swiglu_limit, pdl=pdl, far=packed.far_args(), wide=wide)

def nvfp4_experts_stages(x: torch.Tensor, segments: list[tuple[int, int, int]], packed: PackedExperts, base: int = 0,
                         row_index: torch.Tensor | None = None, swiglu_limit: float | None = None, *,
                         pdl: int = -1, wide: int = -1):
    """nvfp4_experts returning (out, x_frag, h_frag): the rows and SwiGLU output in the kernels' fragment
    layout (int32 words of bf16 pairs), for the tests' stage-by-stage comparisons."""
    plan, n_tiles, n_groups, n_rows = launch_plan(segments, base, packed.slot)
    ri = None if row_index is None else row_index.to(device=x.device, dtype=torch.int64).contiguous()
    return tuple(_ext.require().nvfp4_experts_stages(
        x.contiguous(), ri, plan.to(x.device), n_tiles, n_groups, n_rows, packed.q_gu, packed.s_gu, packed.s2_gu,
        packed.q_dn, packed.s_dn, packed.hidden, packed.inter, swiglu_limit, pdl=pdl, far=packed.far_args(),
        wide=wide))
