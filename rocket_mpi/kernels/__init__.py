"""Fast ops of rocket_mpi, each exposed once beside its pure-torch reference (refs.py).

    nvfp4_experts(x, segments, packed, ...)   this rank's routed experts (NVFP4 W4A16, batch-invariant; the
                                              same kernel runs BF16 experts packed by pack_experts_bf16)
    moe_scatter_add(rows, by_token, coef)     per token, fp32 sum of coef * row in expert order, bf16 once
                                              (optionally summing the rows' checksum as it reads them)
    route(x, weight, bias, cfg)               the router in two kernels (moe/router.py route's result)
    rms_norm / rope_ / kv_append              fused ops of the fixed-shape decode step (graph.py), CUDA only
    linear / swiglu_dense                     the replicated stack's linears and MLPs in BF16 tiles (stack.py)

CPU tensors run the reference; CUDA tensors need the extension (csrc/, built by setup.py) and raise a
RuntimeError saying why when it is missing. The package imports everywhere: the extension is looked
up only when an op needs it. `available()` says whether the fast path can run here.
"""
from __future__ import annotations

import torch

from rocket_mpi.kernels import _ext
from rocket_mpi.kernels.pack import (ExpertPacker, PackedExperts, dequant_packed, emulate_decode,  # noqa: F401
                                     pack_bf16, pack_codes, pack_experts, pack_experts_bf16, padded_codes,
                                     split_fused_gate_up, unpack_bf16, unpack_codes)
from rocket_mpi.kernels.refs import moe_scatter_add_ref, nvfp4_experts_ref  # noqa: F401
from rocket_mpi.kernels.stack import (STACK_KERNEL_MAX_ROWS, PackedLinear, add_residuals, linear,  # noqa: F401
                                      pack_linear, pack_mlp, stack_switch, swiglu_dense)
from rocket_mpi.moe.router import route as route_ref

MAX_GROUPS = 65535  # grid.y of the expert kernels: weight passes (<= 32 rows of one expert) per launch


def available() -> bool:
    """The extension is built and a CUDA device is present."""
    return _ext.reason() == ""


def unavailable_reason() -> str:
    return _ext.reason()


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
                  row_index: torch.Tensor | None = None, swiglu_limit: float | None = None) -> torch.Tensor:
    """This rank's expert rows: [end - base, H] bf16, without down's weight_scale_2.

    x [*, H] bf16: the block's rows in canonical order (rows of one expert contiguous), or, with
    `row_index` [end - base] int64, any rows (e.g. the tokens' hidden states) gathered through it.
    segments: (expert, start, end) in canonical row indices starting at `base`, contiguous."""
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
    return nvfp4_experts_planned(x, row_index, plan, n_tiles, n_groups, n_rows, packed, swiglu_limit)


def nvfp4_experts_planned(x: torch.Tensor, row_index: torch.Tensor | None, plan: torch.Tensor, n_tiles: int,
                          n_groups: int, n_rows: int, packed: PackedExperts,
                          swiglu_limit: float | None = None) -> torch.Tensor:
    """nvfp4_experts with the launch plan (launch_plan) already on the device: just the kernels."""
    return _ext.require().nvfp4_experts(x.contiguous(), row_index, plan, n_tiles, n_groups, n_rows, packed.q_gu,
                                        packed.s_gu, packed.s2_gu, packed.q_dn, packed.s_dn, packed.hidden,
                                        packed.inter, swiglu_limit)


def nvfp4_experts_stages(x: torch.Tensor, segments: list[tuple[int, int, int]], packed: PackedExperts, base: int = 0,
                         row_index: torch.Tensor | None = None, swiglu_limit: float | None = None):
    """nvfp4_experts returning (out, x_frag, h_frag): the rows and SwiGLU output in the kernels' fragment
    layout (int32 words of bf16 pairs), for the tests' stage-by-stage comparisons."""
    plan, n_tiles, n_groups, n_rows = launch_plan(segments, base, packed.slot)
    ri = None if row_index is None else row_index.to(device=x.device, dtype=torch.int64).contiguous()
    return tuple(_ext.require().nvfp4_experts_stages(
        x.contiguous(), ri, plan.to(x.device), n_tiles, n_groups, n_rows, packed.q_gu, packed.s_gu, packed.s2_gu,
        packed.q_dn, packed.s_dn, packed.hidden, packed.inter, swiglu_limit))


def moe_scatter_add(rows: torch.Tensor, by_token: torch.Tensor, coef: torch.Tensor,
                    by_canon: torch.Tensor | None = None, check: torch.Tensor | None = None,
                    residual=()) -> torch.Tensor:
    """rows [R, H] bf16; by_token [T, k] row indices (ascending expert); coef [T, k] fp32 -> [T, H] bf16,
    bitwise equal to rocket_mpi.moe.scatter.moe_scatter_add. With by_canon [T, k] (each entry's canonical
    row) and check (one int64), also check += engine.row_sum of the rows in canonical order. Then + each of
    `residual` ([T, H] bf16, at most 2) in order, as torch's r + y (the graphed step's x + (routed + shared))."""
    if not rows.is_cuda:
        if check is not None:
            order = torch.empty(by_canon.numel(), dtype=torch.long)
            order[by_canon.reshape(-1).long()] = by_token.reshape(-1).cpu()
            from rocket_mpi.engine import row_sum
            check += row_sum(rows[order])
        return add_residuals(moe_scatter_add_ref(rows, by_token, coef), residual)
    C = _ext.require()
    return C.moe_scatter_add(rows.contiguous(), by_token.to(device=rows.device, dtype=torch.int64).contiguous(),
                             coef.to(device=rows.device, dtype=torch.float32).contiguous(), by_canon, check,
                             [r.contiguous() for r in residual])


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """moe/router.py route on CUDA in two kernels (router.cu): the same experts and weights up to the
    fp32 sum order of the logits (tests/test_device_plan.py). CPU tensors take route itself."""
    if not x.is_cuda:
        return route_ref(x, weight, bias, cfg)
    C = _ext.require()
    partial = C.router_logits(x.contiguous(), weight)  # [slices of H, T, E]: moe_route sums them in order
    w, e = C.moe_route(partial, bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, bool(cfg.norm_topk_prob),
                       float(cfg.routed_scaling_factor))
    return w, e


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.rms_norm in one kernel (fp32 statistics; the sum's order is the kernel's)."""
    return _ext.require().rms_norm(x.contiguous(), w, eps)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> None:
    """layers.Rope.apply on q [T, hq, d] and k [T, hk, d] in place, bitwise torch's bf16 ops."""
    _ext.require().rope_(q, k, cos.contiguous(), sin.contiguous(), rot)


def kv_append(kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    """kc[s, :, pos[s]] = k[s] (and v) for every stream s."""
    _ext.require().kv_append(kc, vc, k.contiguous(), v.contiguous(), pos)


def rope_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int,
             kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor) -> None:
    """rope_(q, k, ...) then kv_append(kc, vc, k, v, pos) in one launch: the same bits."""
    _ext.require().rope_kv_(q, k, v.contiguous(), cos.contiguous(), sin.contiguous(), rot, kc, vc, pos)


def decode_softmax(scores: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """scores [M, heads, 1, span] bf16 (one query per stream) -> probabilities bf16: softmax in fp32 of
    bf16(scores * scale) with the keys past pos[m] hidden (exactly 0), rounded to bf16; as glm4_moe's _attend
    does it with torch ops (mul, masked_fill, softmax, cast: four kernels), but for the order of the fp32 sums."""
    return _ext.require().decode_softmax(scores.contiguous(), pos, scale)


def dequant_packed_cuda(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The kernel's own decode of one packed matrix -> bf16 [N_pad, K_pad] (E2M1 * scale * 2^-8).
    A test hook: equal bit for bit to pack.emulate_decode."""
    return _ext.require().dequant_packed(q.contiguous(), s.contiguous())
