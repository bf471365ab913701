"""A lane-level emulation of csrc/nvfp4_experts.cu in torch: the three launches (prep, gate/up + SwiGLU, down:
fragment layouts, shuffles, padding), lane by lane.

CPU tests (always run):
  - the emulation against nvfp4_experts_ref, within TOL_KERNEL (helpers.py).
GPU tests (skip, with the reason, without a GPU or the extension):
  - each launch of the kernel against the emulation: rows -> x_frag exactly, h_frag and the output within TOL_KERNEL.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from helpers import (TOL_KERNEL, assert_close, gpu, make_experts, pytest,  # first: it puts the tree's package
                     run_without_pytest, segments_for)                     # on sys.path
from rocket_mpi import ops  # noqa: E402
from rocket_mpi.ops import pack  # noqa: E402


_LANE = torch.arange(32)
_G, _T = _LANE // 4, _LANE % 4
_U32 = 0xFFFFFFFF


def _bits_bf16(b16: torch.Tensor) -> torch.Tensor:
    b = (b16.long() & 0xFFFF) << 16
    return torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32).view(torch.float32)


def _bf16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF


def _words(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.int32).long() & _U32


def _a_matrix(q_words, s_words, j):
    """A (16 x 16) of one k-step from the 32 lanes' words, placed by the PTX m16n8k16 A layout."""
    w = q_words[:, j]                                                       # [32]
    o = pack.decode_words(w)
    sw = s_words[_G, j // 2]                                                # lane's S_p
    if j % 2:
        sw = ((sw >> 8) | (sw << 24)) & _U32
    sc = (sw & pack.SCALE_MASK) | pack.SCALE_HIGH
    a = torch.zeros(16, 16)
    for reg in range(4):
        scale = _bits_bf16(sc if reg % 2 == 0 else sc >> 16)
        for half in range(2):
            v = (_bits_bf16((o[reg] & _U32) >> (16 * half)) * scale).to(torch.bfloat16).float()
            a[_G + 8 * (reg % 2), 2 * _T + 8 * (reg // 2) + half] = v
    return a


def _b_matrix(frag_words):
    """B (16 k x 8 rows) from the 32 lanes' two words b0, b1 (PTX layout)."""
    b = torch.zeros(16, 8)
    for r in range(2):
        for half in range(2):
            b[2 * _T + 8 * r + half, _G] = _bits_bf16(frag_words[:, r] >> (16 * half))
    return b


def _c_frag(d):
    return torch.stack((d[_G, 2 * _T], d[_G, 2 * _T + 1], d[_G + 8, 2 * _T], d[_G + 8, 2 * _T + 1]), dim=1)


def _mainloop(q, s, frag, tile0, rt_count, fg, nk):
    """acc[i][rt] [32 lanes, 4] of feature tiles 2 fg + i over row tiles tile0.., all K in order."""
    acc = [[torch.zeros(32, 4) for _ in range(rt_count)] for _ in range(2)]
    for kt in range(nk):
        for j in range(4):
            for i in range(2):
                T = 2 * fg + i
                a = _a_matrix(_words(q[T, kt]), _words(s[T, kt]), j)
                for rt in range(rt_count):
                    words = frag[tile0 + rt, 2 * kt + j // 2][:, 2 * (j % 2):2 * (j % 2) + 2]
                    acc[i][rt] = acc[i][rt] + _c_frag(a @ _b_matrix(words))
    return acc


def _shfl4(v):
    return v[_LANE ^ 4]


def emulate_nvfp4_experts(x, segments, p, base=0, row_index=None, limit=None):
    plan, n_tiles, _, n_rows = ops.launch_plan(segments, base, p.slot)
    pad = plan[:n_tiles * 8].long()
    groups = plan[n_tiles * 8:].view(-1, 4).tolist()
    hp, ip, h = p.hidden_pad, p.inter_pad, p.hidden
    xw = _words(x.contiguous().view(torch.uint8))                           # [rows, h/2] bf16 pairs
    # prep: rows -> x_frag [tiles, hp/32, 32, 4] words
    x_frag = torch.zeros(n_tiles, hp // 32, 32, 4, dtype=torch.long)
    for tile in range(n_tiles):
        src = pad[tile * 8 + _G]
        if row_index is not None:
            src = torch.where(src >= 0, row_index[src.clamp_min(0)], src)
        for pp in range(hp // 32):
            for e in range(4):
                k = 32 * pp + 16 * (e >> 1) + 8 * (e & 1) + 2 * _T
                ok = (src >= 0) & (k < h)
                x_frag[tile, pp, :, e] = torch.where(ok, xw[src.clamp_min(0), (k // 2).clamp_max(h // 2 - 1)], 0)
    # gate/up + SwiGLU -> h_frag
    h_frag = torch.zeros(n_tiles, ip // 32, 32, 4, dtype=torch.long)
    odd = _G % 2
    for slot, tile0, nt, _ in groups:
        sg, su = float(p.s2_gu[slot, 0]) * 256.0, float(p.s2_gu[slot, 1]) * 256.0
        for fg in range(2 * ip // 16 // 2):
            acc = _mainloop(p.q_gu[slot], p.s_gu[slot], x_frag, tile0, nt, fg, hp // 64)
            for rt in range(nt):
                pair = []
                for i in range(2):
                    c = acc[i][rt]
                    hv = []
                    for col in range(2):
                        g = (c[:, col] * torch.tensor(sg)).to(torch.bfloat16)
                        u = (c[:, 2 + col] * torch.tensor(su)).to(torch.bfloat16)
                        if limit is not None:
                            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                        hv.append(_bf16_bits(F.silu(g) * u))
                    send = torch.where(odd == 1, hv[0], hv[1])
                    recv = _shfl4(send)
                    pair.append(torch.where(odd == 1, recv | (hv[1] << 16), hv[0] | (recv << 16)))
                dst = (2 * _T + odd) * 4 + (_G >> 1)
                h_frag[tile0 + rt, fg >> 1, dst, (fg & 1) * 2] = pair[0]
                h_frag[tile0 + rt, fg >> 1, dst, (fg & 1) * 2 + 1] = pair[1]
    # down -> rows
    out = torch.full((n_rows, h), float("nan"), dtype=torch.bfloat16)
    for slot, tile0, nt, _ in groups:
        for fg in range(hp // 16 // 2):
            acc = _mainloop(p.q_dn[slot], p.s_dn[slot], h_frag, tile0, nt, fg, ip // 64)
            for rt in range(nt):
                row = pad[(tile0 + rt) * 8 + 2 * _T + odd]
                for i in range(2):
                    for half in range(2):
                        v0 = _bf16_bits(acc[i][rt][:, 2 * half] * 256.0)
                        v1 = _bf16_bits(acc[i][rt][:, 2 * half + 1] * 256.0)
                        recv = _shfl4(torch.where(odd == 1, v0, v1))
                        lo = torch.where(odd == 1, recv, v0)
                        hi = torch.where(odd == 1, v1, recv)
                        feat = (fg * 2 + i) * 16 + 8 * half + (_G & ~1)
                        for ln in range(32):
                            if row[ln] >= 0 and feat[ln] < h:
                                out[row[ln], feat[ln]] = _bits_bf16(lo[ln:ln + 1]).to(torch.bfloat16)
                                out[row[ln], feat[ln] + 1] = _bits_bf16(hi[ln:ln + 1]).to(torch.bfloat16)
    return out, x_frag, h_frag


@pytest.mark.parametrize("limit", [None, 0.05])
def test_lane_emulation_matches_reference(limit):
    """The kernel's index logic, run in torch: odd sizes (padding in K and N), 1..13 rows per expert,
    more than one weight pass is covered by the GPU tests (40 rows), here by a 4-tile group."""
    h, i = 80, 48                                         # hidden_pad 128, inter_pad 64: both padded
    ex = make_experts([1, 4, 6], h, i, seed=5)
    p = pack.pack_experts(ex, h, i)
    counts = {1: 1, 4: 13, 6: 5}
    segs = segments_for(counts, base=7)
    n = sum(counts.values())
    gen = torch.Generator().manual_seed(11)
    xs = (torch.randn(n + 4, h, generator=gen) * 3).to(torch.bfloat16)
    row_index = torch.randperm(n + 4, generator=gen)[:n]
    got, _, _ = emulate_nvfp4_experts(xs, segs, p, base=7, row_index=row_index, limit=limit)
    want = ops.nvfp4_experts_ref(xs, segs, p, base=7, row_index=row_index, swiglu_limit=limit)
    assert not torch.isnan(got.float()).any(), "the emulated down epilogue left rows unwritten"
    assert_close(got, want, TOL_KERNEL, "lane emulation vs nvfp4_experts_ref")
    # the prep's other path: the same rows pre-gathered, no row_index (same limit) -> the same bits
    got2, _, _ = emulate_nvfp4_experts(xs[row_index], segs, p, base=7, limit=limit)
    assert torch.equal(got.view(torch.int16), got2.view(torch.int16))


def _frag_values(words: torch.Tensor) -> torch.Tensor:
    """Fragment words (bf16 pairs) -> fp32 values [..., 2]."""
    w = words.long() & _U32
    return torch.stack((_bits_bf16(w), _bits_bf16(w >> 16)), dim=-1)


@gpu
def test_gpu_stages_match_emulation():
    """Each launch against the lane emulation: rows -> x_frag exactly, SwiGLU -> h_frag and the output
    within TOL_KERNEL. A failure here names the stage."""
    h, i = 80, 48
    ex = make_experts([1, 4, 6], h, i, seed=5)
    p = pack.pack_experts(ex, h, i)
    counts = {1: 1, 4: 13, 6: 5}
    segs = segments_for(counts, base=7)
    n = sum(counts.values())
    xs = (torch.randn(n + 4, h) * 3).to(torch.bfloat16)
    row_index = torch.randperm(n + 4)[:n]
    out_e, xf_e, hf_e = emulate_nvfp4_experts(xs, segs, p, base=7, row_index=row_index, limit=0.05)
    # wide=0: the mma.sync instances' fragment layout (the warpgroup-mma instance lays the rows out as core matrices)
    out_k, xf_k, hf_k = (t.cpu() for t in ops.nvfp4_experts_stages(xs.cuda(), segs, p.to("cuda"), 7,
                                                                        row_index.cuda(), 0.05, wide=0))
    # prep writes the rows' words only: padding rows (-1 in the plan) are never written (the GEMMs read their
    # tile's row 0 in their place)
    plan, n_tiles, _, _ = ops.launch_plan(segs, 7, p.slot)
    real = (plan[:n_tiles * 8].view(n_tiles, 8) >= 0)[:, torch.arange(32) // 4]      # [tile, lane]
    assert real.any() and not real.all()
    bad = (((xf_k.long() & _U32) != xf_e) & real[:, None, :, None]).nonzero()
    assert bad.numel() == 0, f"prep (rows -> x_frag): {bad.shape[0]} words differ; first [tile, pair, lane, word] " \
                             f"{bad[0].tolist()}"
    # h_frag: the real rows only (a padding row's column computes row 0 of its tile again, never read)
    keep = real[:, None, :, None]
    assert_close(_frag_values(torch.where(keep, hf_k.long(), 0)), _frag_values(torch.where(keep, hf_e.long(), 0)),
                 TOL_KERNEL, "gate/up + SwiGLU (h_frag)")
    assert_close(out_k, out_e, TOL_KERNEL, "down (output rows)")


if __name__ == "__main__":
    sys.exit(run_without_pytest(globals(), __file__))
