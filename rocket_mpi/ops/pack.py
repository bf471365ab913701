"""Packed NVFP4 layout of the expert kernel (csrc/nvfp4_experts.cu), and its exact inverse.

A matrix W [N, K] (N output features, K reduction; ModelOpt storage: `weight` [N, K/2] uint8 with
element 2j in the low nibble, `weight_scale` [N, K/16] e4m3) is padded with zeros to N % 16 == 0,
K % 64 == 0 and cut into tiles of 16 features x 64 k (four mma k-steps of 16):

    codes  uint8 [N/16, K/64, 32, 16]   lane (g, t), k-step j: one little-endian 32-bit word
    scales uint8 [N/16, K/64, 8, 8]     row group g: scales of rows g and g+8, k-steps 0..3

so a warp reads each tile as one coalesced 512 B block, 16 B per lane (cp.async 16).

Codes. mma.m16n8k16 gives lane (g, t) of k-step j the A fragment
    reg0 (row g,   k 2t, 2t+1)     reg1 (row g+8, k 2t, 2t+1)
    reg2 (row g,   k 2t+8, 2t+9)   reg3 (row g+8, k 2t+8, 2t+9)
(k relative to the step). Its word w holds those 8 codes; the kernel moves each code to bf16 bits 15
(sign), 8..7 (exponent), 6 (mantissa) of its register half (low half = the even k) with

    reg0 = w & 0x81C081C0                   reg1 = rotr(w, 4) & 0x81C081C0
    reg2 = (w << 6) & 0x81C081C0            reg3 = ((w << 2) & 0x80C080C0) | ((w >> 6) & 0x01000100)

(decode_words; CODE_SOURCE, derived from it, says which bit of w each code bit comes from). Per 8 codes
that is 9 operations, 7 of them on the integer pipe (the two left shifts may go to IMAD). No 4 shifts or
rotations of the one mask cover the word (they would have to tile Z_16 with {6, 7, 8, 15}); three of
them and one two-part register do, and this is one such cover (an exhaustive search).
A bf16 with exponent field e and mantissa m/2 is E2M1(code) * 2^-126 for every code: e >= 1
is 2^(e-127)(1 + m/2) = 2^(e-1)(1 + m/2) * 2^-126, and e = 0 is the subnormal m/2 * 2^-126.

Scales. Each e4m3 block scale is stored as the byte b = bits 4..11 of bf16(scale * 2^118). For every
finite scale > 0 that bf16 has exponent field 236..253, so bits 12..14 are 1, bit 15 is 0 and bits 0..3
are 0 (e4m3 has 3 mantissa bits): bf16 = 0x7000 | b << 4, one LOP3 in the kernel. A zero scale packs
as b = 0 (reads 2^97) and its block's codes as 0, so the block still decodes to 0. Scale words: for
k-steps 2p, 2p+1 one 32-bit word
    S_p = (lo(2p) << 4 | hi(2p) << 20) | rotl8(lo(2p+1) << 4 | hi(2p+1) << 20)
lo = row g, hi = row g+8: step 2p is (S_p & 0x0FF00FF0) | 0x70007000, step 2p+1 the same of
rotr8(S_p), giving bf16x2 (scale row g, scale row g+8) * 2^118.

One bf16 multiply of the two is exact: E2M1 * scale * 2^-8 has at most 6 significant bits and lies in
[2^-18, 10.5]. The kernel multiplies its fp32 accumulator by 2^8 (exact) in the epilogue.

Gate and up of one expert are packed as one matrix [2 * inter_pad, hidden_pad] whose tile T holds gate
rows 8T..8T+7 (rows 0..7) and up rows 8T..8T+7 (rows 8..15): mma rows g and g+8 of one lane are then
gate and up of the same intermediate feature, and SwiGLU needs no data exchange.

BF16 experts (a BF16 checkpoint) run in the same kernel without the decode: each tile's A fragments as
stored, bf16 [N/16, K/64, 4, 256] where k-step j holds lane l's 8 values (reg 0..3, each a k pair) at
j * 256 + 8 l, so a warp reads a k-step of a tile as one coalesced 512 B block (pack_bf16).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence

import math
import weakref

import torch

from rocket_mpi.ops import _ext, nvfp4

TILE_N = 16
TILE_K = 64
ROW_TILE = 8
WEIGHT_SHIFT = 8            # packed weights are E2M1 * scale * 2^-WEIGHT_SHIFT
SCALE_SHIFT = 118           # scale bytes hold bf16(scale * 2^SCALE_SHIFT) = 126 - WEIGHT_SHIFT
CODE_MASK = 0x81C081C0      # bf16x2 sign, exponent bits 0..1, mantissa bit 6 (csrc kCodeMask)
CODE_MASK_P, CODE_MASK_Q = 0x80C080C0, 0x01000100   # reg3's two parts (kCodeMaskP, kCodeMaskQ)
CODE_OUT_BITS = (6, 7, 8, 15)   # where code bit 0 (mantissa), 1, 2 (exponent), 3 (sign) lands in a half
SCALE_MASK, SCALE_HIGH = 0x0FF00FF0, 0x70007000
_U32 = 0xFFFFFFFF


def decode_words(w):
    """The kernel's code decode (decode_a in csrc/nvfp4_experts.cu): 32-bit words (ints or int64
    tensors, 0..2^32-1) -> the 4 A-fragment registers, each E2M1 codes at bf16 bits 15, 8..6 of both halves."""
    rotr4 = ((w >> 4) | (w << 28)) & _U32
    return (w & CODE_MASK, rotr4 & CODE_MASK, (w << 6) & CODE_MASK & _U32,
            ((w << 2) & CODE_MASK_P & _U32) | ((w >> 6) & CODE_MASK_Q))


def _code_source() -> tuple[tuple[tuple[int, ...], ...], ...]:
    """[reg][half][code bit] -> the bit of w it is read from, found by decoding each single bit."""
    src: dict[tuple[int, int, int], int] = {}
    for i in range(32):
        for r, reg in enumerate(decode_words(1 << i)):
            for h in range(2):
                for c, ob in enumerate(CODE_OUT_BITS):
                    if reg >> (ob + 16 * h) & 1:
                        src[r, h, c] = i
    if len(src) != 32 or len(set(src.values())) != 32:
        raise AssertionError("decode_words must read each code bit from its own bit of the word")
    return tuple(tuple(tuple(src[r, h, c] for c in range(4)) for h in range(2)) for r in range(4))


CODE_SOURCE = _code_source()


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def scale_bytes(weight_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales [...] -> the packed byte of each (bits 4..11 of bf16(scale * 2^118))."""
    s = weight_scale.float()
    v = s * 2.0 ** SCALE_SHIFT                       # exact: a power of two, no overflow (448 * 2^118 < 2^127)
    hi16 = (v.view(torch.int32) >> 16) & 0xFFFF      # bf16 bits of v; exact, e4m3 has 3 mantissa bits
    nz = v > 0
    # one read of the device for both checks (loading packs experts in batches: no wait per tensor)
    bad, off = torch.stack(((~torch.isfinite(s) | (s < 0)).any(), (((hi16 & 0xF00F) != 0x7000) & nz).any())).tolist()
    if bad:
        raise ValueError("NVFP4 block scales must be finite and >= 0 (as ModelOpt writes them)")
    if off:  # cannot happen for e4m3; guards the layout claim
        raise AssertionError("an e4m3 scale * 2^118 fell outside bf16 exponents 224..255")
    return torch.where(nz, (hi16 >> 4) & 0xFF, torch.zeros_like(hi16)).to(torch.uint8)


def scale_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """Packed scale bytes -> fp32 scale (0 for byte 0), the inverse of scale_bytes."""
    bits = (0x7000 | (b.to(torch.int32) << 4)) << 16
    v = bits.view(torch.float32) * 2.0 ** -SCALE_SHIFT
    return torch.where(b == 0, torch.zeros_like(v), v)


def padded_codes(weight: torch.Tensor, weight_scale: torch.Tensor, n_pad: int,
                 k_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt parts [..., N, K/2] and [..., N, K/16] (leading dims: a batch) -> (codes uint8 [..., n_pad, k_pad],
    scale bytes uint8 [..., n_pad, k_pad/16]), zero padded, with the codes of zero-scale blocks zeroed (they
    dequantise to 0 either way)."""
    *lead, n, k2 = weight.shape
    k = 2 * k2
    if tuple(weight_scale.shape) != (*lead, n, k // nvfp4.BLOCK):
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} does not match weight {tuple(weight.shape)}")
    if n_pad < n or k_pad < k or n_pad % TILE_N or k_pad % TILE_K:
        raise ValueError(f"padding [{n_pad}, {k_pad}] for [{n}, {k}]: need multiples of {TILE_N}, {TILE_K}")
    codes = torch.zeros(*lead, n_pad, k_pad, dtype=torch.uint8, device=weight.device)
    codes[..., :n, :k] = nvfp4.unpack_e2m1(weight)
    sb = torch.zeros(*lead, n_pad, k_pad // nvfp4.BLOCK, dtype=torch.uint8, device=weight.device)
    sb[..., :n, :k // nvfp4.BLOCK] = scale_bytes(weight_scale)
    codes.view(*lead, n_pad, -1, nvfp4.BLOCK).masked_fill_((sb == 0).unsqueeze(-1), 0)
    return codes, sb


def _lane_index(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row in tile, k in step) of lane l, register r, half h: [32, 4, 2] each."""
    lane = torch.arange(32, device=device).view(32, 1, 1)
    reg = torch.arange(4, device=device).view(1, 4, 1)
    half = torch.arange(2, device=device).view(1, 1, 2)
    g, t = lane // 4, lane % 4
    row = (g + 8 * (reg % 2)).expand(32, 4, 2)
    kk = 2 * t + 8 * (reg // 2) + half
    return row, kk


def _sources(device) -> torch.Tensor:
    return torch.tensor(CODE_SOURCE, device=device)      # [4 regs, 2 halves, 4 code bits] bit positions


def _to_u32_bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 words (0..2^32-1) [..., n] -> uint8 [..., 4n] little-endian."""
    w = words & _U32
    w = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
    return w.contiguous().view(torch.uint8)


def _from_u32_bytes(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4n] little-endian -> int64 words [..., n] in 0..2^32-1."""
    return b.contiguous().view(torch.int32).to(torch.int64) & _U32


def _rotl8(x: torch.Tensor) -> torch.Tensor:
    return ((x << 8) | (x >> 24)) & _U32


def _rotr8(x: torch.Tensor) -> torch.Tensor:
    return ((x >> 8) | (x << 24)) & _U32


def _bit_sources() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """For bit p (0..31) of a packed code word: which of a lane's 8 codes (register r, half h: 2r + h) holds it,
    and which bit of that code (CODE_SOURCE inverted)."""
    code, bit = [0] * 32, [0] * 32
    for r in range(4):
        for h in range(2):
            for c in range(4):
                code[CODE_SOURCE[r][h][c]], bit[CODE_SOURCE[r][h][c]] = 2 * r + h, c
    return tuple(code), tuple(bit)


BIT_CODE, BIT_OF_CODE = _bit_sources()


def pack_codes(codes: torch.Tensor, sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [..., N, K] (0..15), scale bytes uint8 [..., N, K/16], N % 16 == 0, K % 64 == 0 (leading dims: a
    batch) -> (codes [..., N/16, K/64, 32, 16], scales [..., N/16, K/64, 8, 8]) in the kernel's tile layout."""
    *lead, n, k = codes.shape
    if n % TILE_N or k % TILE_K or tuple(sb.shape) != (*lead, n, k // nvfp4.BLOCK):
        raise ValueError(f"pack_codes: codes {tuple(codes.shape)}, scales {tuple(sb.shape)}")
    nt, kt = n // TILE_N, k // TILE_K
    dev = codes.device
    c = codes.reshape(-1, nt, TILE_N, kt, 4, 16).permute(0, 1, 3, 4, 2, 5)   # [B, T, KT, j, row, kk]
    row, kk = _lane_index(dev)
    sel = c[:, :, :, :, row, kk].flatten(-2)                                 # [B, T, KT, j, 32, 8 codes] uint8
    # bit p of each word, from its code and that code's bit, in uint8 throughout: 8 bits per byte, summed (disjoint)
    src_code = torch.tensor(BIT_CODE, device=dev)
    src_bit = torch.tensor(BIT_OF_CODE, dtype=torch.uint8, device=dev)
    place = (torch.arange(32, device=dev) % 8).to(torch.uint8)
    bits = sel[..., src_code]                                                # [B, T, KT, j, 32, 32 bits]
    bits >>= src_bit
    bits &= 1
    bits <<= place
    words = bits.view(*bits.shape[:-1], 4, 8).sum(-1, dtype=torch.uint8)     # [B, T, KT, j, lane, 4] LE bytes
    q = words.permute(0, 1, 2, 4, 3, 5).reshape(*lead, nt, kt, 32, 16)       # [..., T, KT, lane, j * 4 + byte]

    s = sb.reshape(-1, nt, TILE_N, kt, 4).permute(0, 1, 3, 2, 4).to(torch.int64)   # [B, T, KT, row, j]
    lo, hi = s[..., :8, :], s[..., 8:, :]                                  # rows g, g+8: [B, T, KT, 8, 4]
    step = lambda j: (lo[..., j] << 4) | (hi[..., j] << 20)               # noqa: E731
    s0 = step(0) | _rotl8(step(1))
    s1 = step(2) | _rotl8(step(3))
    sc = _to_u32_bytes(torch.stack((s0, s1), dim=-1)).view(*lead, nt, kt, 8, 8)
    return q, sc


def unpack_codes(q: torch.Tensor, sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_codes: -> (codes uint8 [N, K], scale bytes uint8 [N, K/16])."""
    nt, kt = q.shape[:2]
    dev = q.device
    words = _from_u32_bytes(q.view(nt, kt, 32, 16)).permute(0, 1, 3, 2)  # [T, KT, j, lane]
    w = words[..., None, None]                                             # [T, KT, j, 32, 1, 1]
    src = _sources(dev)
    code = sum(((w >> src[..., c]) & 1) << c for c in range(4))            # [T, KT, j, 32, 4, 2]
    row, kk = _lane_index(dev)
    c = torch.zeros(nt, kt, 4, TILE_N, 16, dtype=torch.uint8, device=dev)
    c[:, :, :, row, kk] = code.to(torch.uint8)
    codes = c.permute(0, 3, 1, 2, 4).reshape(nt * TILE_N, kt * TILE_K)

    s = _from_u32_bytes(sc.view(nt, kt, 8, 8))                             # [T, KT, g, 2]
    out = torch.zeros(nt, kt, TILE_N, 4, dtype=torch.int64, device=dev)
    for p in range(2):
        for odd, v in ((0, s[..., p]), (1, _rotr8(s[..., p]))):
            out[:, :, :8, 2 * p + odd] = (v >> 4) & 0xFF
            out[:, :, 8:, 2 * p + odd] = (v >> 20) & 0xFF
    sb = out.permute(0, 2, 1, 3).reshape(nt * TILE_N, kt * 4).to(torch.uint8)
    return codes, sb


def dequant_codes(codes: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """codes [N, K], scale bytes [N, K/16] -> fp32 E2M1 * scale (exact, no weight_scale_2)."""
    n, k = codes.shape
    vals = nvfp4.E2M1_VALUES.to(codes.device)[codes.long()].view(n, k // nvfp4.BLOCK, nvfp4.BLOCK)
    return (vals * scale_from_bytes(sb).unsqueeze(-1)).view(n, k)


def dequant_packed(q: torch.Tensor, sc: torch.Tensor, direct: bool = False) -> torch.Tensor:
    """Packed tiles -> fp32 [N_pad, K_pad] = E2M1 * scale, exact; direct: tiles of pack_codes_direct, W in the input's
    column order."""
    return dequant_codes(*(unpack_codes_direct if direct else unpack_codes)(q, sc))


def pack_codes_direct(codes: torch.Tensor, sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_codes with K in direct_k_order (the dense NVFP4 launches: the stack's linears held as stored, the gate/up
    of its MLPs), so the kernel reads up to 16 rows of x itself, each lane 32 contiguous bytes per k-tile. The scale
    bytes stay in the input's 16-blocks: lane t's 16 inputs of a k-tile are its block t, whose scale the kernel
    applies in all 4 k-steps (csrc decode_scales_lane)."""
    return pack_codes(codes[..., direct_k_order(codes.shape[-1]).to(codes.device)], sb)


def unpack_codes_direct(q: torch.Tensor, sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_codes_direct: -> (codes uint8 [N, K] in the input's column order, scale bytes [N, K/16])."""
    cp, sb = unpack_codes(q, sc)
    codes = torch.empty_like(cp)
    codes[:, direct_k_order(cp.shape[1]).to(cp.device)] = cp
    return codes, sb


def emulate_decode(q: torch.Tensor, sc: torch.Tensor, direct: bool = False) -> torch.Tensor:
    """The kernel's decode, bit for bit, in torch: packed tiles -> bf16 [N_pad, K_pad] as the mma sees
    them (E2M1 * scale * 2^-8). Tests compare it with dequant_packed * 2^-8 to check the bit tricks. direct: tiles of
    pack_codes_direct, decoded as the dense launches do (lane t's one block scale t in every k-step), W in the input's
    column order."""
    nt, kt = q.shape[:2]
    dev = q.device
    w = _from_u32_bytes(q.view(nt, kt, 32, 16)).permute(0, 1, 3, 2)      # [T, KT, j, lane]
    regs = torch.stack(decode_words(w), dim=-1)                           # [T, KT, j, lane, reg]
    s = _from_u32_bytes(sc.view(nt, kt, 8, 8))                             # [T, KT, g, 2]
    sw = torch.stack((s[..., 0], _rotr8(s[..., 0]), s[..., 1], _rotr8(s[..., 1])), dim=2)   # [T, KT, j, g]
    scw = (sw & SCALE_MASK) | SCALE_HIGH
    g, t = torch.arange(32, device=dev) // 4, torch.arange(32, device=dev) % 4
    if direct:                                                             # lane t: block t's scale, every k-step
        scw = scw[:, :, t, g].unsqueeze(2).expand(-1, -1, 4, -1)
    else:
        scw = scw[:, :, :, g]                                              # [T, KT, j, lane]
    sc_lo, sc_hi = scw & 0xFFFF, scw >> 16
    scale = torch.stack((sc_lo, sc_hi, sc_lo, sc_hi), dim=-1)              # reg 0, 2: row g; 1, 3: row g+8

    def bf16_val(bits16):                                                  # bf16 bits -> fp32 value
        b = (bits16 & 0xFFFF) << 16
        return torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32).view(torch.float32)

    prod = []
    for h in range(2):                                                     # halves: even k, odd k
        a = bf16_val(regs >> (16 * h)) * bf16_val(scale)                   # exact in fp32
        prod.append(a.to(torch.bfloat16))
    vals = torch.stack(prod, dim=-1)                                       # [T, KT, j, lane, reg, half]
    row, kk = _lane_index(dev)
    out = torch.zeros(nt, kt, 4, TILE_N, 16, dtype=torch.bfloat16, device=dev)
    out[:, :, :, row, kk] = vals
    w = out.permute(0, 3, 1, 2, 4).reshape(nt * TILE_N, kt * TILE_K)
    if not direct:
        return w
    w_in = torch.empty_like(w)
    w_in[:, direct_k_order(w.shape[1]).to(dev)] = w
    return w_in


def pack_bf16(w: torch.Tensor, n_pad: int, k_pad: int) -> torch.Tensor:
    """W [N, K] -> bf16 tiles [n_pad/16, k_pad/64, 4, 256] in mma A-fragment order, zero padded: tile T,
    k-step j, lane (g, t) = 4g + t holds reg r, half h at 8 lane + 2 r + h, the element (row, k) of
    _lane_index: row g + 8 (r % 2), k 16 j + 2t + 8 (r // 2) + h."""
    n, k = w.shape
    if n_pad < n or k_pad < k or n_pad % TILE_N or k_pad % TILE_K:
        raise ValueError(f"padding [{n_pad}, {k_pad}] for [{n}, {k}]: need multiples of {TILE_N}, {TILE_K}")
    full = torch.zeros(n_pad, k_pad, dtype=torch.bfloat16, device=w.device)
    full[:n, :k] = w
    nt, kt = n_pad // TILE_N, k_pad // TILE_K
    # row = 8 rh + g, k = 64 kt + 16 j + 8 kh + 2 t + h; reg = rh + 2 kh
    v = full.view(nt, 2, 8, kt, 4, 2, 4, 2)                               # [T, rh, g, KT, j, kh, t, h]
    return v.permute(0, 3, 4, 2, 6, 5, 1, 7).reshape(nt, kt, 4, 256).contiguous()


def unpack_bf16(q: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_bf16: tiles [N/16, K/64, 4, 256] -> W [N, K] bf16 (padding included)."""
    nt, kt = q.shape[:2]
    v = q.reshape(nt, kt, 4, 8, 4, 2, 2, 2)                               # [T, KT, j, g, t, kh, rh, h]
    return v.permute(0, 6, 3, 1, 2, 5, 4, 7).reshape(nt * TILE_N, kt * TILE_K)


def direct_k_order(k_pad: int) -> torch.Tensor:
    """The K order of the dense launches' weights (the replicated stack's linears, the first GEMM of its SwiGLU
    MLPs): logical k = 64 KT + 16 j + 8 kh + 2 t + h (k-step j, lane t, register kh, half h of the mma B fragment)
    takes input column 64 KT + 16 t + 4 j + 2 kh + h, so lane t's 16 inputs of a k-tile are 32 contiguous bytes of
    the row and the kernel reads x itself (two 16-byte loads, no prep launch). A dot product over all of K either
    way; only which 16 products share an mma k-step changes. Returns order [k_pad]: W' = W[:, order]."""
    if k_pad % TILE_K:
        raise ValueError(f"direct_k_order: K {k_pad} is not a multiple of {TILE_K}")
    kt = torch.arange(k_pad // TILE_K).view(-1, 1, 1, 1, 1)
    j, kh, t, h = (torch.arange(n).view(*([1] * i), n, *([1] * (3 - i))) for i, n in enumerate((4, 2, 4, 2)))
    return (TILE_K * kt + 16 * t + 4 * j + 2 * kh + h).reshape(-1)


def pack_bf16_direct(w: torch.Tensor, n_pad: int, k_pad: int) -> torch.Tensor:
    """pack_bf16 of W with its K in direct_k_order (zero padding first)."""
    full = torch.nn.functional.pad(w, (0, k_pad - w.shape[1]))
    return pack_bf16(full[:, direct_k_order(k_pad).to(w.device)], n_pad, k_pad)


def unpack_bf16_direct(q: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_bf16_direct: W [n_pad, k_pad] in the input's column order."""
    wp = unpack_bf16(q)
    w = torch.empty_like(wp)
    w[:, direct_k_order(wp.shape[1]).to(wp.device)] = wp
    return w


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor, batched: bool = False) -> torch.Tensor:
    """[I_pad, ...] each -> [2 I_pad, ...]: tile T = gate rows 8T..8T+7, then up rows 8T..8T+7 (batched: [B, I_pad,
    ...] -> [B, 2 I_pad, ...])."""
    lead = gate.shape[:1] if batched else ()
    i = gate.shape[len(lead)]
    if i % ROW_TILE or up.shape != gate.shape:
        raise ValueError(f"interleave_gate_up: gate {tuple(gate.shape)}, up {tuple(up.shape)}")
    rest = gate.shape[len(lead) + 1:]
    return torch.stack((gate.reshape(*lead, i // 8, 8, *rest), up.reshape(*lead, i // 8, 8, *rest)),
                       dim=len(lead) + 1).reshape(*lead, 2 * i, *rest)


def deinterleave_gate_up(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = w.shape[0]
    v = w.view(n // 16, 2, 8, *w.shape[1:])
    return v[:, 0].reshape(n // 2, *w.shape[1:]), v[:, 1].reshape(n // 2, *w.shape[1:])


def split_fused_gate_up(weight: torch.Tensor, weight_scale: torch.Tensor):
    """A fused gate_up [2I, H/2] (gate first) -> (gate weight, gate scale, up weight, up scale)."""
    i = weight.shape[0] // 2
    return weight[:i], weight_scale[:i], weight[i:], weight_scale[i:]


KERNEL_PARTS = ("q_gu", "s_gu", "q_dn", "s_dn")  # what the kernel reads per slot (s2_* are small, all on the device)


def pin_host(t: torch.Tensor) -> torch.Tensor:
    """Register a CPU tensor's memory with CUDA (pinned and mapped into the device's address space) so kernels read
    it where it is and copies to and from it are asynchronous; unregistered when the tensor is freed. The exact
    size, unlike torch's pinned allocator, which rounds each allocation up to a power of two. A no-op without CUDA."""
    nbytes = t.numel() * t.element_size()
    if not torch.cuda.is_available() or nbytes == 0 or t.is_pinned():
        return t
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 3)  # cudaHostRegisterPortable | cudaHostRegisterMapped
    if int(err) != 0:
        raise MemoryError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB of host memory failed (error {int(err)})")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


@dataclass
class PackedExperts:
    """The owned experts of one layer in the kernel's layout; slot s holds the expert e with slot[e] == s.

    With an expert cache (rocket_mpi/moe/cache.py) only slots 0 .. near-1 are device memory (q_gu, s_gu, q_dn,
    s_dn); slots near .. are `far`: the same four parts in registered host memory (pin_host), which the kernel
    reads in place (csrc/nvfp4_experts.cu, far slots). swap() trades an expert between the two; a slot's bytes are
    the same wherever they are, so residency never changes a row's bits. A slot no expert maps to is spare (live
    rebalancing keeps a fixed number of slots and fills them as experts arrive: put, drop, move)."""
    experts: list[int]
    hidden: int
    inter: int
    hidden_pad: int
    inter_pad: int
    q_gu: torch.Tensor     # uint8 [E, 2 inter_pad / 16, hidden_pad / 64, 32, 16]
    s_gu: torch.Tensor     # uint8 [E, 2 inter_pad / 16, hidden_pad / 64, 8, 8]
    s2_gu: torch.Tensor    # fp32  [E, 2] weight_scale_2 of gate, up
    q_dn: torch.Tensor     # uint8 [E, hidden_pad / 16, inter_pad / 64, 32, 16]
    s_dn: torch.Tensor     # uint8 [E, hidden_pad / 16, inter_pad / 64, 8, 8]
    s2_dn: torch.Tensor    # fp32  [E] down weight_scale_2: NOT applied by the kernel (the scatter's)
    slot: dict[int, int] = field(default_factory=dict)
    far: dict[str, torch.Tensor] | None = None   # KERNEL_PARTS of slots near.. in host memory (None: all on device)

    def __post_init__(self):
        if not self.slot:
            self.slot = {e: i for i, e in enumerate(self.experts)}

    @property
    def device(self) -> torch.device:
        return self.q_gu.device

    @property
    def near(self) -> int:
        """Slots in device memory: slot s < near is there, the others are far."""
        return self.q_gu.shape[0]

    def far_args(self) -> list[torch.Tensor] | None:
        """The kernel's `far` argument: [q_gu, s_gu, q_dn, s_dn] of the far slots, or None."""
        return None if self.far is None else [self.far[k] for k in KERNEL_PARTS]

    def resident(self) -> list[int]:
        """The experts in device slots, in slot order."""
        inv = {s: e for e, s in self.slot.items()}
        return [inv[s] for s in range(self.near) if s in inv]

    @property
    def bytes_per_expert(self) -> int:
        """Bytes the kernel reads for one expert's weights (its four parts)."""
        parts = (self.q_gu, self.s_gu, self.q_dn, self.s_dn)
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in parts if t.dim() > 1)

    def part(self, name: str, slot: int) -> torch.Tensor:
        """One part (KERNEL_PARTS) of one slot, where it lives."""
        if slot < self.near:
            return getattr(self, name)[slot]
        return self.far[name][slot - self.near]

    def swap(self, e_in: int, e_out: int) -> None:
        """Bring far expert e_in into device slot of resident expert e_out, which takes e_in's far slot. Copies
        on the current stream (asynchronous: the far memory is registered), ordered before every later launch."""
        a, b = self.slot[e_in], self.slot[e_out]
        if a < self.near or b >= self.near:
            raise ValueError(f"swap: expert {e_in} must be far and {e_out} resident (slots {a}, {b}, near {self.near})")
        for name in KERNEL_PARTS:
            dev_t, host_t = getattr(self, name)[b], self.far[name][a - self.near]
            if not dev_t.numel():
                continue
            out = dev_t.clone()                       # e_out's bytes, before e_in's overwrite them
            dev_t.copy_(host_t, non_blocking=True)    # e_in into the device slot
            host_t.copy_(out, non_blocking=True)      # e_out into e_in's far slot
        self.s2_gu[[a, b]] = self.s2_gu[[b, a]]
        self.s2_dn[[a, b]] = self.s2_dn[[b, a]]
        self.slot[e_in], self.slot[e_out] = b, a

    @property
    def n_slots(self) -> int:
        """Device and far slots together."""
        return self.near + (0 if self.far is None else self.far["q_gu"].shape[0])

    def free_slots(self) -> list[int]:
        """The spare slots, device ones first."""
        used = set(self.slot.values())
        return [s for s in range(self.n_slots) if s not in used]

    def put(self, e: int, slot: int, src: "PackedExperts") -> None:
        """Expert e, the only one packed in `src` (same shapes), into spare slot `slot` (device or far): stream-ordered
        copies, before every later launch."""
        if e in self.slot or slot not in self.free_slots():
            raise ValueError(f"put: expert {e} is here already or slot {slot} is not spare")
        k = src.slot[e]
        for name in KERNEL_PARTS:
            dst = self.part(name, slot)
            if dst.numel():
                dst.copy_(src.part(name, k), non_blocking=True)
        self.s2_gu[slot] = src.s2_gu[k].to(self.s2_gu.device)
        self.s2_dn[slot] = src.s2_dn[k].to(self.s2_dn.device)
        self.slot[e] = slot
        self.experts = sorted(self.slot)

    def drop(self, e: int) -> None:
        """Expert e leaves: its slot becomes spare (its bytes stay until a put overwrites them)."""
        del self.slot[e]
        self.experts = sorted(self.slot)

    def move(self, e: int, slot: int) -> None:
        """Expert e into spare slot `slot` (a far expert into a free device slot), its own slot becoming spare."""
        a = self.slot[e]
        if slot not in self.free_slots():
            raise ValueError(f"move: slot {slot} is not spare")
        for name in KERNEL_PARTS:
            dst = self.part(name, slot)
            if dst.numel():
                dst.copy_(self.part(name, a), non_blocking=True)
        self.s2_gu[slot] = self.s2_gu[a]
        self.s2_dn[slot] = self.s2_dn[a]
        self.slot[e] = slot

    @property
    def bf16(self) -> bool:
        """BF16 experts (pack_experts_bf16): q_* hold bf16 tiles, s_* are empty, s2_* are ones."""
        return self.q_gu.dtype == torch.bfloat16

    @property
    def nbytes(self) -> int:
        """Packed bytes in device memory (codes + scales, or the BF16 tiles)."""
        return sum(t.numel() * t.element_size() for t in (self.q_gu, self.s_gu, self.q_dn, self.s_dn))

    @property
    def far_bytes(self) -> int:
        """Packed bytes of the far slots, in host memory."""
        return 0 if self.far is None else sum(t.numel() * t.element_size() for t in self.far.values())

    def to(self, device) -> "PackedExperts":
        mv = lambda t: t.to(device)  # noqa: E731
        return PackedExperts(list(self.experts), self.hidden, self.inter, self.hidden_pad, self.inter_pad,
                             mv(self.q_gu), mv(self.s_gu), mv(self.s2_gu), mv(self.q_dn), mv(self.s_dn),
                             mv(self.s2_dn), dict(self.slot), self.far)

    def dense(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 (gate [I, H], up [I, H], down [H, I]) of one slot as E2M1 * scale, no weight_scale_2
        (BF16 experts: the weights themselves)."""
        part = lambda name: self.part(name, slot).to(self.device)  # noqa: E731
        if self.bf16:
            gu, d = unpack_bf16(part("q_gu")).float(), unpack_bf16(part("q_dn")).float()
        else:
            gu = dequant_packed(part("q_gu"), part("s_gu"))
            d = dequant_packed(part("q_dn"), part("s_dn"))
        g, u = deinterleave_gate_up(gu)
        return g[:self.inter, :self.hidden], u[:self.inter, :self.hidden], d[:self.hidden, :self.inter]


def _parts(lin) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(weight, weight_scale, weight_scale_2) of an NVFP4 Linear (checkpoint.reader.Linear) or a tuple."""
    if isinstance(lin, (tuple, list)):
        w, s, s2 = lin
    else:
        if getattr(lin, "weight_scale", None) is None:
            raise ValueError(f"{getattr(lin, 'name', 'linear')}: not NVFP4 (no weight_scale); the NVFP4 "
                             f"kernel packs NVFP4 experts only")
        w, s, s2 = lin.weight, lin.weight_scale, lin.weight_scale_2
    return w, s, float(s2)


class ExpertPacker:
    """A layer's experts packed one at a time into stacks allocated once (slot = the expert id's rank among
    `ids`), so loading holds one expert's unpacked weights at a time beside the packed layer (not every
    expert's parts, then a list of packed tensors, then their stack). NVFP4 parts: (weight, weight_scale,
    weight_scale_2) or reader Linears; BF16 parts: bf16 tensors ([I, H], [I, H], [H, I] each)."""

    def __init__(self, ids: Sequence[int], hidden: int, inter: int, bf16: bool, device=None,
                 resident: Sequence[int] | None = None, slots: int | None = None, near_slots: int | None = None,
                 far_slots: int | None = None):
        """`resident`: the experts that get device slots (the expert cache's first choice); the others get far slots
        in registered host memory. None: all on the device. `slots`: slots in all (default one per expert; more
        leaves spare ones); `near_slots`: how many of them are device slots (default: the resident experts', all where
        resident is None). Resident experts take the first slots, the far ones the first far slots. `far_slots`: at
        most this many far slots (host memory short): the far experts past them get no slot and stay in the
        checkpoint (`unslotted`; never add()ed), read into a far slot when a step needs them (moe/experts.py)."""
        mult = TILE_N if bf16 else nvfp4.BLOCK
        if hidden % mult or inter % mult:
            raise ValueError(f"hidden {hidden}, moe_intermediate {inter}: "
                             f"{'the expert kernel' if bf16 else 'NVFP4'} needs multiples of {mult}")
        self.ids, self.hidden, self.inter, self.bf16 = sorted(ids), hidden, inter, bf16
        self.hp, self.ip = round_up(hidden, TILE_K), round_up(inter, TILE_K)
        near = self.ids if resident is None else sorted(set(resident))
        if not set(near) <= set(self.ids):
            raise ValueError(f"resident experts {sorted(set(near) - set(self.ids))} are not among {self.ids}")
        far = [e for e in self.ids if e not in set(near)]
        self.unslotted: list[int] = []
        if far_slots is not None and far_slots < len(far):
            if resident is None or slots is not None or near_slots not in (None, len(near)):
                raise ValueError("far_slots: only with resident experts and one slot each")
            far, self.unslotted = far[:far_slots], far[far_slots:]
        self.n_slots = max(len(self.ids) - len(self.unslotted), slots or 0)
        self.near = (self.n_slots if resident is None else len(near)) if near_slots is None else near_slots
        if not len(near) <= self.near <= self.n_slots - len(far):
            raise ValueError(f"{self.near} device slots of {self.n_slots} for {len(near)} resident and {len(far)} far "
                             f"experts")
        self.slot = {e: k for k, e in enumerate(near)}
        self.slot.update({e: self.near + k for k, e in enumerate(far)})
        self.device = torch.device(device) if device is not None else None
        self.filled: set[int] = set()
        self.t: dict[str, torch.Tensor] = {}
        self.far: dict[str, torch.Tensor] | None = None

    def _shapes(self, n: int | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n = self.near if n is None else n
        hp, ip = self.hp, self.ip
        if self.bf16:
            return {"q_gu": ((n, 2 * ip // 16, hp // 64, 4, 256), torch.bfloat16), "s_gu": ((n, 0), torch.uint8),
                    "q_dn": ((n, hp // 16, ip // 64, 4, 256), torch.bfloat16), "s_dn": ((n, 0), torch.uint8),
                    "s2_gu": ((n, 2), torch.float32), "s2_dn": ((n,), torch.float32)}
        return {"q_gu": ((n, 2 * ip // 16, hp // 64, 32, 16), torch.uint8),
                "s_gu": ((n, 2 * ip // 16, hp // 64, 8, 8), torch.uint8),
                "q_dn": ((n, hp // 16, ip // 64, 32, 16), torch.uint8), "s_dn": ((n, hp // 16, ip // 64, 8, 8), torch.uint8),
                "s2_gu": ((n, 2), torch.float32), "s2_dn": ((n,), torch.float32)}

    def _alloc(self, device) -> None:
        if not self.t:
            self.device = self.device or torch.device(device)
            n = self.n_slots
            shapes = self._shapes()
            full = self._shapes(n)  # s2_*: every slot, near and far, on the device
            self.t = {k: (torch.ones if k.startswith("s2") else torch.empty)(full[k][0] if k.startswith("s2") else
                                                                              shape, dtype=dt, device=self.device)
                      for k, (shape, dt) in shapes.items()}
            if self.near < n:
                self.far = {k: pin_host(torch.empty(sh, dtype=dt)) for k, (sh, dt) in self._shapes(n - self.near).items()
                            if k in KERNEL_PARTS}

    def _put(self, name: str, k: int, value: torch.Tensor) -> None:
        """Slot k of one part: a device slot, or a far one (copied out to host memory)."""
        if k < self.near:
            self.t[name][k] = value
        else:
            self.far[name][k - self.near].copy_(value)

    def add(self, e: int, gate, up, down) -> None:
        self.add_many([(e, gate, up, down)])

    def add_many(self, experts: Sequence) -> None:
        """[(expert id, gate, up, down), ...]: NVFP4 experts are packed together (one pass of the packing ops over
        the batch: loading a layer queues its device work without waiting on it per expert), BF16 ones one by one."""
        for e, *_ in experts:
            if e not in self.slot or e in self.filled:
                raise ValueError(f"expert {e}: not among the slotted {sorted(self.slot)} or packed twice")
        if len({e for e, *_ in experts}) != len(experts):
            raise ValueError(f"experts {[e for e, *_ in experts]}: one expert twice")
        if not experts:
            return
        if self.bf16:
            for e, gate, up, down in experts:
                self._add_bf16(e, gate, up, down)
            return
        parts = [[_parts(x) for x in (gate, up, down)] for _, gate, up, down in experts]
        for (e, *_), p in zip(experts, parts):
            for name, (w, _, _), shape in zip(("gate", "up", "down"), p, ((self.inter, self.hidden // 2),
                                              (self.inter, self.hidden // 2), (self.hidden, self.inter // 2))):
                if tuple(w.shape) != shape or w.dtype != torch.uint8:
                    raise ValueError(f"expert {e} {name}: weight {tuple(w.shape)} {w.dtype}, expected {shape} uint8")
        self._alloc(parts[0][0][0].device)
        dev = self.device
        stack = lambda i, j: torch.stack([p[i][j] for p in parts]).to(dev)  # noqa: E731  part i, piece j, batched
        gc, gsb = padded_codes(stack(0, 0), stack(0, 1), self.ip, self.hp)
        uc, usb = padded_codes(stack(1, 0), stack(1, 1), self.ip, self.hp)
        gu = pack_codes(interleave_gate_up(gc, uc, batched=True), interleave_gate_up(gsb, usb, batched=True))
        dn = pack_codes(*padded_codes(stack(2, 0), stack(2, 1), self.hp, self.ip))
        slots = [self.slot[e] for e, *_ in experts]
        s2 = torch.tensor([[p[0][2], p[1][2], p[2][2]] for p in parts], dtype=torch.float32).to(dev)
        self._put_many(slots, {"q_gu": gu[0], "s_gu": gu[1], "q_dn": dn[0], "s_dn": dn[1]})
        index = torch.tensor(slots, device=dev)
        self.t["s2_gu"][index] = s2[:, :2]
        self.t["s2_dn"][index] = s2[:, 2]
        self.filled.update(e for e, *_ in experts)

    def _put_many(self, slots: list[int], parts: dict[str, torch.Tensor]) -> None:
        """Row b of each batched part into slot slots[b]: one copy where the slots run on in device memory."""
        k0 = slots[0]
        if slots == list(range(k0, k0 + len(slots))) and k0 + len(slots) <= self.near:
            for name, v in parts.items():
                self.t[name][k0:k0 + len(slots)] = v
            return
        for b, k in enumerate(slots):
            for name, v in parts.items():
                self._put(name, k, v[b])

    def _add_bf16(self, e: int, gate, up, down) -> None:
        k = self.slot[e]
        for name, w, shape in (("gate", gate, (self.inter, self.hidden)), ("up", up, (self.inter, self.hidden)),
                               ("down", down, (self.hidden, self.inter))):
            if tuple(w.shape) != shape or w.dtype != torch.bfloat16:
                raise ValueError(f"expert {e} {name}: weight {tuple(w.shape)} {w.dtype}, expected {shape} bfloat16")
        self._alloc(gate.device)
        dev = self.device
        pad = lambda w, n, kk: torch.nn.functional.pad(w.to(dev), (0, kk - w.shape[1], 0, n - w.shape[0]))  # noqa: E731
        self._put("q_gu", k, pack_bf16(interleave_gate_up(pad(gate, self.ip, self.hp), pad(up, self.ip, self.hp)),
                                       2 * self.ip, self.hp))
        self._put("q_dn", k, pack_bf16(down.to(dev), self.hp, self.ip))
        self.filled.add(e)

    def done(self) -> PackedExperts:
        if len(self.filled) != len(self.slot):
            raise ValueError(f"experts {sorted(set(self.slot) - self.filled)} were never packed")
        self._alloc(self.device or "cpu")
        t = self.t
        return PackedExperts(sorted(self.slot), self.hidden, self.inter, self.hp, self.ip, t["q_gu"], t["s_gu"],
                             t["s2_gu"], t["q_dn"], t["s_dn"], t["s2_dn"], dict(self.slot), self.far)


def pack_experts(experts: Mapping[int, Sequence], hidden: int, inter: int, device=None) -> PackedExperts:
    """{expert id: (gate, up, down)} of NVFP4 Linears ([I, H], [I, H], [H, I]; each a reader.Linear or
    (weight, weight_scale, weight_scale_2)) -> PackedExperts, slots in ascending expert id."""
    return _pack_all(experts, hidden, inter, False, device)


def _pack_all(experts: Mapping[int, Sequence], hidden: int, inter: int, bf16: bool, device) -> PackedExperts:
    packer = ExpertPacker(list(experts), hidden, inter, bf16=bf16, device=device)
    for e in sorted(experts):
        packer.add(e, *experts[e])
    return packer.done()


def pack_experts_bf16(experts: Mapping[int, Sequence[torch.Tensor]], hidden: int, inter: int,
                      device=None) -> PackedExperts:
    """{expert id: (gate [I, H], up [I, H], down [H, I]) bf16} -> PackedExperts of BF16 tiles (pack_bf16),
    slots in ascending expert id: the same kernel as NVFP4 without the decode (s_* empty, s2_* ones)."""
    return _pack_all(experts, hidden, inter, True, device)


def dequant_packed_cuda(q: torch.Tensor, s: torch.Tensor, direct: bool = False) -> torch.Tensor:
    """The kernel's own decode of one packed matrix -> bf16 [N_pad, K_pad] (E2M1 * scale * 2^-8); direct: tiles of
    pack_codes_direct, W in the input's column order. Equal bit for bit to pack.emulate_decode (with the same
    `direct`); with direct, the prefill's dequantised weights of the stack held as stored."""
    return _ext.require().dequant_packed(q.contiguous(), s.contiguous(), direct)
