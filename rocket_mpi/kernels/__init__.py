"""Fast ops of rocket_mpi, each exposed once beside its pure-torch reference (refs.py).

    nvfp4_experts(x, segments, packed, ...)   this rank's routed experts (NVFP4 W4A16, batch-invariant; the
                                              same kernel runs BF16 experts packed by pack_experts_bf16)
    moe_scatter_add(rows, by_token, coef)     per token, fp32 sum of coef * row in expert order, bf16 once
                                              (optionally summing the rows' checksum as it reads them)
    route(x, weight, bias, cfg)               the router in two kernels (moe/router.py route's result)
    rms_norm / rope_ / kv_append / argmax_    fused ops of the fixed-shape decode step (graph.py), CUDA only
    hc_pre / hc_post / kda_decode             GLM-5.3-Flash's hyper-connections and KDA token in that step, CUDA only
    linear / swiglu_dense                     the replicated stack's linears and MLPs in BF16 tiles (stack.py)

CPU tensors run the reference; CUDA tensors need the extension (csrc/, built by setup.py) and raise a
RuntimeError saying why when it is missing. The package imports everywhere: the extension is looked
up only when an op needs it. `available()` says whether the fast path can run here.
"""
from __future__ import annotations

import itertools

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
                    residual=(), norm: tuple[torch.Tensor, float] | None = None):
    """rows [R, H] bf16; by_token [T, k] row indices (ascending expert); coef [T, k] fp32 -> [T, H] bf16,
    bitwise equal to rocket_mpi.moe.scatter.moe_scatter_add. With by_canon [T, k] (each entry's canonical
    row) and check (one int64), also check += engine.row_sum of the rows in canonical order. Then + each of
    `residual` ([T, H] bf16, at most 2) in order, as torch's r + y (the graphed step's x + (routed + shared)).
    With norm = (weight, eps): returns (out, rms_norm(out, weight, eps)), on a GPU from the same launch where the
    shapes allow (the same bits as kernels.rms_norm after it), on a CPU through layers.rms_norm."""
    if not rows.is_cuda:
        if check is not None:
            order = torch.empty(by_canon.numel(), dtype=torch.long)
            order[by_canon.reshape(-1).long()] = by_token.reshape(-1).cpu()
            from rocket_mpi.engine import row_sum
            check += row_sum(rows[order])
        out = add_residuals(moe_scatter_add_ref(rows, by_token, coef), residual)
        if norm is None:
            return out
        from rocket_mpi.model.layers import rms_norm as rms_norm_ref
        return out, rms_norm_ref(out, norm[0], norm[1])
    C = _ext.require()
    args = (rows.contiguous(), by_token.to(device=rows.device, dtype=torch.int64).contiguous(),
            coef.to(device=rows.device, dtype=torch.float32).contiguous(), by_canon, check,
            [r.contiguous() for r in residual])
    if norm is None:
        return C.moe_scatter_add(*args)
    return C.moe_scatter_add(*args, norm_w=norm[0], eps=float(norm[1]))


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


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
           norm_eps: float, norm: tuple[torch.Tensor, float] | None = None):
    """glm5_next_hc.hc_pre in two launches (csrc/hc.cu): (post [T, N], comb [T, N, N] fp32, collapsed [T, H] bf16).
    With norm = (weight, eps): (post, comb, collapsed, rms_norm(collapsed, weight, eps)), the norm in the second
    launch where the row fits norm.cuh's layout (the bits of kernels.rms_norm after it, which runs otherwise)."""
    if norm is None:
        return _ext.require().hc_pre(streams.contiguous(), fn, base, scale, iters, eps, norm_eps)
    return _ext.require().hc_pre(streams.contiguous(), fn, base, scale, iters, eps, norm_eps, norm[0], float(norm[1]))


def hc_post(post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """glm5_next_hc.hc_post in one launch (csrc/hc.cu): the new streams [T, N, H] bf16."""
    return _ext.require().hc_post(post.contiguous(), comb.contiguous(), y.contiguous(), streams.contiguous())


def gpu_switch(name: str, device, what: str) -> bool:
    """Whether a step takes a GPU kernel that the environment variable `name` may turn off (A/B runs): on a GPU with
    the extension, unless name=0; read when a step is built, so a captured graph keeps what it had. A value other
    than 0 / 1 is one error naming it."""
    import os
    from rocket_mpi.errors import RocketError
    knob = os.environ.get(name, "1")
    if knob not in ("0", "1"):
        raise RocketError(f"{name}={knob!r}: use 1 ({what}, the default) or 0")
    return torch.device(device).type == "cuda" and available() and knob == "1"


def kda_decode(mixed: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
               gate: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, o_norm: torch.Tensor, state: torch.Tensor,
               index: torch.Tensor, heads: int, dk: int, lower_bound: float | None, eps: float,
               counts: list[int] | None = None) -> torch.Tensor:
    """glm5_next_kda's tokens from the q|k|v projection to o_proj's input in one launch (csrc/kda.cu); the conv and
    recurrent state rows at index are updated in place. Without counts: one decode token per stream (row i of mixed
    is stream index[i]'s); with counts (host ints, one per entry of index): stream index[i]'s next counts[i] tokens,
    the rows after stream index[i - 1]'s, run in order (a prefill), the same bits as one launch per token."""
    offsets = None
    if counts is not None:
        if len(counts) != index.numel() or any(n < 0 for n in counts) or sum(counts) != mixed.shape[0]:
            raise ValueError(f"kda_decode: counts {counts} for {index.numel()} streams and {mixed.shape[0]} rows")
        offsets = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int64).to(mixed.device)
    return _ext.require().kda_decode(mixed.contiguous(), conv_state, conv_w, f.contiguous(), b.contiguous(),
                                     gate.contiguous(), dt_bias, a_log, o_norm, state, index, heads, dk, dk ** -0.5,
                                     lower_bound, eps, offsets)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.rms_norm in one kernel (fp32 statistics; the sum's order is the kernel's)."""
    return _ext.require().rms_norm(x.contiguous(), w, eps)


def embed_rms_norm(table: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(table[ids], rms_norm(table[ids], w, eps)) in one launch: the decode step's embedding and first norm, the
    same bits as the gather and then kernels.rms_norm (an id outside the table reads as a zero row)."""
    return _ext.require().rms_norm(table, w, eps, index=ids)


def argmax_(logits: torch.Tensor, tokens: torch.Tensor, ticket: torch.Tensor, pos: torch.Tensor | None = None
            ) -> torch.Tensor:
    """tokens[:] = torch.argmax(logits, dim=-1) (the first maximum; a NaN counts as the largest) of bf16 logits
    [M, V] in one launch, and pos += 1 where given. ticket: one zero int32 on the device (left zero)."""
    _ext.require().argmax_(logits.contiguous(), tokens, ticket, pos)
    return tokens


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> None:
    """layers.Rope.apply on q [T, hq, d] and k [T, hk, d] in place, bitwise torch's bf16 ops."""
    _ext.require().rope_(q, k, cos.contiguous(), sin.contiguous(), rot)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """glm_moe_dsa.rope_interleaved (x [T, H, r], cos / sin [T, r]) in one launch: the same bits as its torch ops."""
    if x.stride(-1) != 1 or (x.shape[1] > 1 and x.stride(0) != x.shape[1] * x.stride(1)):
        x = x.contiguous()
    return _ext.require().rope_interleaved(x, cos.contiguous(), sin.contiguous())


def kv_append(kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    """kc[s, :, pos[s]] = k[s] (and v) for every stream s."""
    _ext.require().kv_append(kc, vc, k.contiguous(), v.contiguous(), pos)


def rope_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int,
             kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, table: bool = False) -> None:
    """rope_(q, k, ...) then kv_append(kc, vc, k, v, pos) in one launch: the same bits. table: cos / sin are
    [n, rot] tables (Rope.table's halves) read at each stream's position, instead of the step's rows."""
    _ext.require().rope_kv_(q, k, v.contiguous(), cos.contiguous(), sin.contiguous(), rot, kc, vc, pos, table)


def attention_switch() -> str:
    """ROCKET_DECODE_ATTENTION: 'auto' (default) or 'matmul': the two matmuls around decode_softmax (glm4_moe._attend;
    on the H200 the fastest at every span from 256 to 3072 positions at 1 and 8 streams once the span is a multiple
    of 64, session 27); 'fused': the one-block-per-query-head kernel (csrc/decode_ops.cu; auto's choice for steps of
    at most 4 streams before session 27) wherever it takes the step. They differ in the order of their sums, so it
    is one of the switches every rank must share (moe/experts.py BIT_SWITCHES)."""
    import os
    v = os.environ.get("ROCKET_DECODE_ATTENTION", "auto")
    if v not in ("auto", "fused", "matmul"):
        from rocket_mpi.errors import RocketError
        raise RocketError(f"ROCKET_DECODE_ATTENTION={v!r}: expected 'auto' (default), 'fused' or 'matmul'")
    return v


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor,
                     scale: float, span: int = -1) -> torch.Tensor | None:
    """Under ROCKET_DECODE_ATTENTION=fused: q [M, hq, d] (one query per stream) over the keys 0..pos[m] of its caches
    [M, hkv, capacity, d] -> [M, hq, d] bf16 in one kernel (csrc/decode_ops.cu), one block per (query head, stream)
    walking all of the stream's keys: q.k in fp32 rounded to bf16, then decode_softmax's arithmetic, then the bf16
    probabilities times v summed in fp32, rounded once; what glm4_moe's _attend does in three kernels but for the
    order of the sums (a stream's output never depends on the other streams). span (-1: the capacity) bounds the
    positions the step can hold (pos < span); keys past pos are never read. None where the caller takes the
    matmuls: 'auto' (default) and 'matmul', more than DECODE_ATTENTION_MAX_STREAMS streams, a span past
    DECODE_ATTENTION_MAX_SPAN, a head dim past 128. (Session 23, air8 at spans of ~30: 3.2 / 0.8 / 2.0 % faster
    steps than the matmuls at 1 / 2 / 4 streams; session 27, spans of 256 and more: slower at 1 and 8 streams, ~100 us
    per layer at 1024-2047 positions. A kernel split over the keys, flash-decoding style, was slower than the
    matmuls at every span measured: results/h200_s27_split_attention_not_kept.diff.)"""
    mode = attention_switch()
    if mode in ("auto", "matmul"):
        return None
    return _ext.require().decode_attention(q.contiguous(), kc, vc, pos, scale, span)


DECODE_ATTENTION_MAX_SPAN = 2048    # csrc/rocket.h kDecodeAttentionMaxSpan
DECODE_ATTENTION_MAX_STREAMS = 16   # kDecodeAttentionMaxStreams


def decode_softmax(scores: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """scores [M, heads, 1, span] bf16 (one query per stream) -> probabilities bf16: softmax in fp32 of
    bf16(scores * scale) with the keys past pos[m] hidden (exactly 0), rounded to bf16; as glm4_moe's _attend
    does it with torch ops (mul, masked_fill, softmax, cast: four kernels), but for the order of the fp32 sums."""
    return _ext.require().decode_softmax(scores.contiguous(), pos, scale)


def dequant_packed_cuda(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The kernel's own decode of one packed matrix -> bf16 [N_pad, K_pad] (E2M1 * scale * 2^-8).
    A test hook: equal bit for bit to pack.emulate_decode."""
    return _ext.require().dequant_packed(q.contiguous(), s.contiguous())
