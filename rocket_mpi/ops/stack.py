"""The replicated stack's linears and SwiGLU MLPs in the expert kernel's tiles: BF16, or NVFP4 held as stored.

At decode sizes (a few rows) every linear of the stack reads its whole weight for a handful of dot products,
so what counts is the fraction of copy bandwidth the weight stream reaches. The expert kernel's BF16 tiles
(pack.py pack_bf16, csrc/nvfp4_experts.cu) reach nearly all of it on the H200 at 1-16 rows, where cuBLAS's GEMMs
of the same shapes reach less and add split-K reduce kernels. So on a GPU the stack's q/k/v (fused: one launch
writes three tensors), o, dense MLP and shared-expert MLP get a packed copy that steps of at most
STACK_KERNEL_MAX_ROWS rows run (the dense weights stay for larger steps and prefill, where cuBLAS is faster;
ROCKET_STACK=torch keeps only them, the A/B switch and the memory saver).

    pack_linear([W0, W1, ...], [b0, b1, ...])   weights of one input -> PackedLinear list (fused where the part
                                                ends are multiples of 32 features)
    linear(x, packs, residual=(r0, r1), split=0)  -> one output tensor per part; one part: then + r0, + r1 (as
                                                torch's r0 + y, each rounded: the stack's x + o in the epilogue)
    pack_mlp(gate_up, down)                     a SwiGLU MLP as one BF16 "expert" (pack_experts_bf16)
    swiglu_dense(x, packed, residual=(), limit=None, pdl=-1, split=0)  its rows in order, no routing plan
                                                (residuals as linear's: x + (moe + shared) without two add
                                                kernels; limit: the clamp of GLM-5.3-Flash's swiglu_limit)

Launch tuning, keyword-only, GPU only (the CPU references ignore it): split, the K slices of each weight (0: by
the output's width, else 1, 2, 4 or 8); it sets the order of the fp32 sums, so it must be the same on every rank,
and a row's bits still depend on no other row. pdl (swiglu_dense): how down follows gate/up (-1 auto, 0 off, 3;
csrc/rocket.h kPdl*), which never changes the bits. (linear is one GEMM launched normally: it has no pdl.)

Each output row depends only on its own input row (the kernel's batch invariance), so every rank and every
stream count computes the same bits for a row. CPU tensors take the torch references, which are exactly
layers.py's F.linear / swiglu_mlp on the unpacked weights (bit for bit), so the glue is tested on any machine.
More than 32 rows (prefill) run in passes of 32 that read each weight once from DRAM and again from L2.
The weights (and gate/up of an MLP) are packed with K in pack.direct_k_order, so up to 16 rows the kernel reads x
itself instead of a prep launch writing fragments; the unpacked references undo it.

NVFP4 linears and MLPs (a checkpoint that quantises the stack: ModelOpt's all-Linears recipe, `:nvfp4-all`) are held
as stored: pack_linear and pack_mlp take their parts (weight, weight_scale, weight_scale_2; a reader.Linear or a
tuple) instead of a BF16 weight and pack the codes and block scales into the kernel's NVFP4 tiles (pack.py), 3.6x
fewer bytes than BF16 tiles, and the decode step reads those (weight-only W4A16: the rows stay BF16). The kernel
decodes each code to the exact bf16 E2M1 x scale x 2^-8 and applies 2^8 x weight_scale_2 (one per output part,
a fused q/k/v has three) to the fp32 sum in the epilogue; K split as the BF16 tiles' (`split`), so a row's bits depend
on no other row either. Their K is in direct_k_order too (pack.pack_codes_direct: the codes permuted within each
64-input k-tile, the block scales as stored, lane t's 16 inputs being one 16-input block whose scale it applies in all
4 k-steps), so up to 16 rows are read from x itself through L1 as the BF16 tiles' are, no prep launch (an MLP's gate/up
likewise; its down reads h in the fragments gate/up writes). Larger steps and
prefill dequantise on the fly (unpack_linear / unpack_mlp: a transient BF16 copy per call, the weights
checkpoint.reader.Linear.dense gives, bit for bit) and take F.linear. On the CPU the references are F.linear /
swiglu_mlp on those same dequantised weights, so they are what the BF16-dequantising loader computes, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rocket_mpi.ops import _ext
from rocket_mpi.ops.pack import (TILE_K, TILE_N, PackedExperts, _parts, deinterleave_gate_up, dequant_packed,
                                 pack_bf16_direct, pack_codes_direct, pack_experts, pack_experts_bf16, padded_codes,
                                 round_up, unpack_bf16, unpack_bf16_direct, unpack_codes)

ROW_CLASS = 4  # the CPU GEMMs round a row the same way in every launch of at least this many rows


def linear_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose rows do not depend on how many rows share the call (batch invariance): the CPU's GEMMs (MKL,
    oneDNN) sum a launch of 1, 2-3 and 4+ rows in different orders, so fewer than ROW_CLASS rows are padded to it."""
    n = x.shape[0]
    if x.is_cuda or n >= ROW_CLASS or n == 0:
        return F.linear(x, w, b)
    return F.linear(torch.cat((x, x[:1].expand(ROW_CLASS - n, *x.shape[1:]))), w, b)[:n]


FUSE_ALIGN = 2 * TILE_N  # features of one warp in the kernel: fused parts must end on these
# Steps of at most this many rows take the packed copies; larger ones (and prefill) cuBLAS on the dense weights,
# which is faster there (the graphed step on the H200 crosses over between 16 and 32 rows).
STACK_KERNEL_MAX_ROWS = 16


@dataclass
class PackedLinear:
    """W [n, k] (+ bias [n]) in BF16 tiles [n_pad / 16, k_pad / 64, 4, 256], or held as stored: NVFP4 codes `w`
    [n_pad / 16, k_pad / 64, 32, 16] and block scales `s` [.., 8, 8] (pack.pack_codes) with each part's
    weight_scale_2 in `w_scale`; `ends`: where each output part ends (features), the last being n."""
    w: torch.Tensor
    n: int
    k: int
    bias: torch.Tensor | None
    ends: tuple[int, ...]
    s: torch.Tensor | None = None
    w_scale: tuple[float, ...] = ()

    @property
    def nvfp4(self) -> bool:
        return self.s is not None

    @property
    def nbytes(self) -> int:
        ts = (self.w, self.s, self.bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float | None = None
               ) -> torch.Tensor:
    """x [T, H] @ gate_up [2I, H] -> silu(gate) * up [T, I] -> @ down [H, I] -> [T, H]. With `limit`
    (GLM-5.3-Flash's swiglu_limit): gate.clamp(max=limit) and up.clamp(-limit, limit) before the activation."""
    gate, up = linear_rows(x, gate_up).chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return linear_rows(F.silu(gate) * up, down)


def is_stored(w) -> bool:
    """Whether a pack_linear / pack_mlp weight is NVFP4 parts (a reader.Linear with block scales, or a tuple)
    rather than a BF16 tensor."""
    return not isinstance(w, torch.Tensor)


def weight_shape(w) -> tuple[int, int]:
    """[n, k] of a BF16 weight or of NVFP4 parts (codes [n, k / 2])."""
    if not is_stored(w):
        return tuple(w.shape)
    q = _parts(w)[0]
    return q.shape[0], 2 * q.shape[1]


def _pack_one(ws: list, bs: list[torch.Tensor | None], device) -> PackedLinear:
    shapes = [weight_shape(w) for w in ws]
    n, k = sum(s[0] for s in shapes), shapes[0][1]
    if n % TILE_N or k % TILE_N:
        raise ValueError(f"linear [{n}, {k}]: the kernel needs multiples of {TILE_N}")
    parts = [_parts(w) for w in ws] if is_stored(ws[0]) else None
    dev = torch.device(device) if device is not None else (parts[0][0] if parts else ws[0]).device
    bias = None
    if any(b is not None for b in bs):
        bias = torch.cat([torch.zeros(s[0], dtype=torch.bfloat16, device=dev) if b is None
                          else b.to(dev, torch.bfloat16) for s, b in zip(shapes, bs)]).contiguous()
    ends = tuple(int(e) for e in torch.tensor([s[0] for s in shapes]).cumsum(0).tolist())
    n_pad, k_pad = round_up(n, FUSE_ALIGN), round_up(k, TILE_K)
    if parts is None:
        w = (ws[0] if len(ws) == 1 else torch.cat(ws, 0)).to(dev, torch.bfloat16)
        return PackedLinear(pack_bf16_direct(w, n_pad, k_pad), n, k, bias, ends)
    q = torch.cat([p[0].to(dev) for p in parts], 0)
    sc = torch.cat([p[1].to(dev) for p in parts], 0)
    w, s = pack_codes_direct(*padded_codes(q, sc, n_pad, k_pad))
    return PackedLinear(w, n, k, bias, ends, s, tuple(p[2] for p in parts))


def pack_linear(weights: list, biases: list[torch.Tensor | None] | None = None, device=None) -> list[PackedLinear]:
    """Linears of one input ([n_i, k] each: BF16 tensors, or NVFP4 parts held as stored, is_stored) as one fused
    PackedLinear when they are of one kind and every part but the last ends on a multiple of 32 features (the kernel
    writes each part to its own tensor), else one per part. `device`: where the tiles go (default: the weights')."""
    biases = biases if biases is not None else [None] * len(weights)
    shapes = [weight_shape(w) for w in weights]
    if len(weights) != len(biases) or len({s[1] for s in shapes}) != 1:
        raise ValueError(f"pack_linear: weights {shapes}, {len(biases)} biases")
    ends = torch.tensor([s[0] for s in shapes]).cumsum(0).tolist()
    one_kind = len({is_stored(w) for w in weights}) == 1
    if one_kind and len(weights) <= 3 and all(e % FUSE_ALIGN == 0 for e in ends[:-1]):
        return [_pack_one(list(weights), list(biases), device)]
    return [_pack_one([w], [b], device) for w, b in zip(weights, biases)]


def unpack_linear(p: PackedLinear) -> list[torch.Tensor]:
    """Each part's weight [n_i, k] in BF16 on p's device: the unpacked BF16 tiles, or the NVFP4 tiles dequantised
    (a transient copy: the prefill's F.linear), bf16(E2M1 x scale x weight_scale_2) as reader.Linear.dense gives it
    (the products of E2M1 and e4m3 are exact in fp32; one rounding by weight_scale_2, then one to bf16)."""
    if not p.nvfp4:
        w = unpack_bf16_direct(p.w)[:p.n, :p.k]
        return [w[s:e] for s, e in zip((0,) + p.ends[:-1], p.ends)]
    out = []
    for s2, s, e in zip(p.w_scale, (0,) + p.ends[:-1], p.ends):
        q, sc = p.w[s // TILE_N:-(-e // TILE_N)], p.s[s // TILE_N:-(-e // TILE_N)]  # parts start on 32 features
        if q.is_cuda:  # the kernel's decode, bf16 E2M1 x scale x 2^-8 (exact), then x 2^8 (exact) x s2 in fp32
            w = (_ext.require().dequant_packed(q.contiguous(), sc.contiguous(), True).float() * (256.0 * s2))
        else:
            w = dequant_packed(q, sc, direct=True) * s2
        out.append(w[:e - s, :p.k].to(torch.bfloat16).contiguous())
    return out


def linear_ref(x: torch.Tensor, p: PackedLinear) -> list[torch.Tensor]:
    """F.linear of each part on the unpacked weight: bit for bit the unfused torch path (NVFP4: on the weights the
    dequantising loader gives)."""
    outs, start = [], 0
    for w, e in zip(unpack_linear(p), p.ends):
        b = None if p.bias is None else p.bias[start:e]
        outs.append(linear_rows(x, w, b))
        start = e
    return outs


def add_residuals(y: torch.Tensor, residual) -> torch.Tensor:
    """y + each residual in order, as the unfused torch path writes it (r + y: one bf16 rounding per add)."""
    for r in residual:
        y = r + y
    return y


def _residuals(residual, rows: int, n: int, what: str) -> list[torch.Tensor]:
    res = list(residual)
    if len(res) > 2 or any(r.shape != (rows, n) or r.dtype != torch.bfloat16 for r in res):
        raise ValueError(f"{what}: residuals {[(tuple(r.shape), r.dtype) for r in res]} for an output [{rows}, {n}] "
                         f"(at most 2, bf16)")
    return [r.contiguous() for r in res]


def linear(x: torch.Tensor, packs: list[PackedLinear], residual=(), *, split: int = 0) -> list[torch.Tensor]:
    """x [rows, k] bf16 through every PackedLinear of `packs` (pack_linear's list): one tensor per part. With
    `residual` (one part only), that part + each residual in order, added in the kernel's epilogue. split: the
    kernel's K slices (module docstring); ignored on the CPU."""
    outs: list[torch.Tensor] = []
    if residual and (len(packs) != 1 or len(packs[0].ends) != 1):
        raise ValueError(f"linear: residuals need one output part, not {sum(len(p.ends) for p in packs)}")
    for p in packs:
        if x.dim() != 2 or x.shape[1] != p.k:
            raise ValueError(f"linear: x {tuple(x.shape)} for a weight of {p.k} inputs")
        res = _residuals(residual, x.shape[0], p.n, "linear")
        if not x.is_cuda:
            outs += [add_residuals(y, res) for y in linear_ref(x, p)]
            continue
        ends = list(p.ends) if len(p.ends) > 1 else []
        if p.nvfp4:
            outs += _ext.require().nvfp4_linear(x.contiguous(), p.w, p.s, p.n, p.k, list(p.w_scale), p.bias, ends,
                                                res, split=split)
            continue
        outs += _ext.require().bf16_linear(x.contiguous(), p.w, p.n, p.k, p.bias, ends, res, split=split)
    return outs


def pack_mlp(gate_up, down, device=None) -> PackedExperts:
    """A SwiGLU MLP (swiglu_mlp's gate_up [2I, H], down [H, I]) as one BF16 expert; or, held as stored, one NVFP4
    expert from gate_up = (gate, up) and down as NVFP4 parts (is_stored), packed on `device` (default: theirs)."""
    if is_stored(down):
        (gate, up), (h, i) = gate_up, weight_shape(down)
        if weight_shape(gate) != (i, h) or weight_shape(up) != (i, h):
            raise ValueError(f"pack_mlp: gate {weight_shape(gate)}, up {weight_shape(up)}, down {(h, i)}")
        dev = device if device is not None else _parts(down)[0].device
        p = pack_experts({0: (gate, up, down)}, h, i, device=dev)
        # gate/up reads the rows itself (K in direct_k_order, as the linears'); down reads h in gate/up's fragments
        p.q_gu[0], p.s_gu[0] = pack_codes_direct(*unpack_codes(p.q_gu[0], p.s_gu[0]))
        return p
    i2, h = gate_up.shape
    i = i2 // 2
    if down.shape != (h, i):
        raise ValueError(f"pack_mlp: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
    p = pack_experts_bf16({0: (gate_up[:i], gate_up[i:], down)}, h, i, device=device or gate_up.device)
    # gate/up reads the rows itself (direct_k_order); down reads h in the fragments gate/up's epilogue writes
    p.q_gu[0] = pack_bf16_direct(unpack_bf16(p.q_gu[0]), 2 * p.inter_pad, p.hidden_pad)
    return p


def _dequant_tiles(q: torch.Tensor, sc: torch.Tensor, s2_lo, s2_hi, direct: bool = False) -> torch.Tensor:
    """NVFP4 tiles -> bf16 [N_pad, K_pad], rows 0..7 of each tile times s2_lo, rows 8..15 times s2_hi (fp32 scalars
    or device tensors: a stack MLP's gate and up share its tiles), as unpack_linear; direct: K in direct_k_order."""
    if q.is_cuda:
        w, mul = _ext.require().dequant_packed(q.contiguous(), sc.contiguous(), direct).float(), 256.0
    else:
        w, mul = dequant_packed(q, sc, direct), 1.0
    w = w.view(-1, 2, 8, w.shape[-1])
    return torch.stack((w[:, 0] * (s2_lo * mul), w[:, 1] * (s2_hi * mul)), 1).view(-1, w.shape[-1]).to(torch.bfloat16)


def unpack_mlp(p: PackedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [2I, H], down [H, I]) in BF16 on p's device, swiglu_mlp's weights: the unpacked BF16 tiles, or the
    NVFP4 tiles dequantised (a transient copy, as unpack_linear: the weights load_swiglu gives, bit for bit)."""
    if p.bf16:
        gu, down = unpack_bf16_direct(p.q_gu[0]), unpack_bf16(p.q_dn[0])
    else:
        s2g, s2u, s2d = p.s2_gu[0, 0], p.s2_gu[0, 1], p.s2_dn[0]  # device scalars: no host read
        gu, down = _dequant_tiles(p.q_gu[0], p.s_gu[0], s2g, s2u, True), _dequant_tiles(p.q_dn[0], p.s_dn[0], s2d, s2d)
    gate, up = deinterleave_gate_up(gu)
    return torch.cat((gate[:p.inter, :p.hidden], up[:p.inter, :p.hidden]), 0), down[:p.hidden, :p.inter].contiguous()


def swiglu_dense_ref(x: torch.Tensor, p: PackedExperts, limit: float | None = None) -> torch.Tensor:
    """swiglu_mlp on the unpacked weights: bit for bit the torch path."""
    return swiglu_mlp(x, *unpack_mlp(p), limit)


def swiglu_dense(x: torch.Tensor, p: PackedExperts, residual=(), limit: float | None = None, *, pdl: int = -1,
                 split: int = 0) -> torch.Tensor:
    """x [rows, H] bf16 through the SwiGLU MLP packed by pack_mlp -> [rows, H] bf16, + each residual in order.
    limit: swiglu_mlp's clamp of gate and up (GLM-5.3-Flash), in the kernel's epilogue as the routed experts'.
    pdl, split: the kernel's launch tuning (module docstring); ignored on the CPU."""
    if x.dim() != 2 or x.shape[1] != p.hidden:
        raise ValueError(f"swiglu_dense: x {tuple(x.shape)}, the MLP has hidden {p.hidden}")
    res = _residuals(residual, x.shape[0], p.hidden, "swiglu_dense")
    if not x.is_cuda:
        return add_residuals(swiglu_dense_ref(x, p, limit), res)
    if not p.bf16:
        return _ext.require().swiglu_dense_nvfp4(x.contiguous(), p.q_gu, p.s_gu, p.s2_gu, p.q_dn, p.s_dn, p.s2_dn,
                                                 p.hidden, p.inter, res, limit, pdl=pdl, split=split)
    return _ext.require().swiglu_dense(x.contiguous(), p.q_gu, p.s2_gu, p.q_dn, p.hidden, p.inter, res, limit,
                                       pdl=pdl, split=split)
