"""The replicated BF16 stack's linears and SwiGLU MLPs in the expert kernel's BF16 tiles.

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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rocket_mpi.ops import _ext
from rocket_mpi.ops.pack import (TILE_K, TILE_N, PackedExperts, deinterleave_gate_up, pack_bf16_direct,
                                     pack_experts_bf16, round_up, unpack_bf16, unpack_bf16_direct)

FUSE_ALIGN = 2 * TILE_N  # features of one warp in the kernel: fused parts must end on these
# Steps of at most this many rows take the packed copies; larger ones (and prefill) cuBLAS on the dense weights,
# which is faster there (the graphed step on the H200 crosses over between 16 and 32 rows).
STACK_KERNEL_MAX_ROWS = 16


@dataclass
class PackedLinear:
    """W [n, k] (+ bias [n]) in BF16 tiles [n_pad / 16, k_pad / 64, 4, 256]; `ends`: where each output part
    ends (features), the last being n."""
    w: torch.Tensor
    n: int
    k: int
    bias: torch.Tensor | None
    ends: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.w.numel() * self.w.element_size() + b


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float | None = None
               ) -> torch.Tensor:
    """x [T, H] @ gate_up [2I, H] -> silu(gate) * up [T, I] -> @ down [H, I] -> [T, H]. With `limit`
    (GLM-5.3-Flash's swiglu_limit): gate.clamp(max=limit) and up.clamp(-limit, limit) before the activation."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.linear(F.silu(gate) * up, down)


def _pack_one(ws: list[torch.Tensor], bs: list[torch.Tensor | None]) -> PackedLinear:
    w = ws[0] if len(ws) == 1 else torch.cat(ws, 0)
    n, k = w.shape
    if n % TILE_N or k % TILE_N:
        raise ValueError(f"linear [{n}, {k}]: the kernel needs multiples of {TILE_N}")
    bias = None
    if any(b is not None for b in bs):
        bias = torch.cat([torch.zeros(x.shape[0], dtype=torch.bfloat16, device=w.device) if b is None
                          else b.to(torch.bfloat16) for x, b in zip(ws, bs)]).contiguous()
    ends = tuple(int(e) for e in torch.tensor([x.shape[0] for x in ws]).cumsum(0).tolist())
    return PackedLinear(pack_bf16_direct(w.to(torch.bfloat16), round_up(n, FUSE_ALIGN), round_up(k, TILE_K)), n, k,
                        bias, ends)


def pack_linear(weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None) -> list[PackedLinear]:
    """Linears of one input ([n_i, k] each) as one fused PackedLinear when every part but the last ends on a
    multiple of 32 features (the kernel writes each part to its own tensor), else one per part."""
    biases = biases if biases is not None else [None] * len(weights)
    if len(weights) != len(biases) or len({w.shape[1] for w in weights}) != 1:
        raise ValueError(f"pack_linear: weights {[tuple(w.shape) for w in weights]}, {len(biases)} biases")
    ends = torch.tensor([w.shape[0] for w in weights]).cumsum(0).tolist()
    if len(weights) <= 3 and all(e % FUSE_ALIGN == 0 for e in ends[:-1]):
        return [_pack_one(list(weights), list(biases))]
    return [_pack_one([w], [b]) for w, b in zip(weights, biases)]


def linear_ref(x: torch.Tensor, p: PackedLinear) -> list[torch.Tensor]:
    """F.linear of each part on the unpacked weight: bit for bit the unfused torch path."""
    w = unpack_bf16_direct(p.w)[:p.n, :p.k]
    outs, start = [], 0
    for e in p.ends:
        b = None if p.bias is None else p.bias[start:e]
        outs.append(F.linear(x, w[start:e], b))
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
        outs += _ext.require().bf16_linear(x.contiguous(), p.w, p.n, p.k, p.bias, ends, res, split=split)
    return outs


def pack_mlp(gate_up: torch.Tensor, down: torch.Tensor) -> PackedExperts:
    """A SwiGLU MLP (swiglu_mlp's gate_up [2I, H], down [H, I]) as one BF16 expert."""
    i2, h = gate_up.shape
    i = i2 // 2
    if down.shape != (h, i):
        raise ValueError(f"pack_mlp: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
    p = pack_experts_bf16({0: (gate_up[:i], gate_up[i:], down)}, h, i, device=gate_up.device)
    # gate/up reads the rows itself (direct_k_order); down reads h in the fragments gate/up's epilogue writes
    p.q_gu[0] = pack_bf16_direct(unpack_bf16(p.q_gu[0]), 2 * p.inter_pad, p.hidden_pad)
    return p


def swiglu_dense_ref(x: torch.Tensor, p: PackedExperts, limit: float | None = None) -> torch.Tensor:
    """swiglu_mlp on the unpacked weights: bit for bit the torch path."""
    gate, up = deinterleave_gate_up(unpack_bf16_direct(p.q_gu[0]))
    gate_up = torch.cat((gate[:p.inter, :p.hidden], up[:p.inter, :p.hidden]), 0)
    return swiglu_mlp(x, gate_up, unpack_bf16(p.q_dn[0])[:p.hidden, :p.inter], limit)


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
    return _ext.require().swiglu_dense(x.contiguous(), p.q_gu, p.s2_gu, p.q_dn, p.hidden, p.inter, res, limit,
                                       pdl=pdl, split=split)
