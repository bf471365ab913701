"""rocket_mpi.ops.pack: the expert kernels' weight layouts and their bit decode, against torch.

CPU tests (always run):
  - packing round-trips exactly; the kernel's bit decode (emulated in torch) gives E2M1 * scale * 2^-8
    exactly, for every code and every e4m3 scale; the code layout reads every bit once, at the fewest operations;
  - the NVFP4 and BF16 expert layouts (the BF16 tile layout is the mma A-fragment layout, element by element),
    and the launch plan.
GPU tests (skip, with the reason, without a GPU or the extension):
  - the kernel's decode is bit-equal to the emulation, also of tiles with K in direct_k_order (the dense launches').
"""
from __future__ import annotations

import itertools
import sys

import torch

from helpers import gpu, make_experts, pytest, run_without_pytest  # first: it puts the tree's package on sys.path
from rocket_mpi import ops  # noqa: E402
from rocket_mpi.ops import nvfp4  # noqa: E402
from rocket_mpi.ops import pack  # noqa: E402


def test_pack_round_trip_and_dequant_exact():
    for n, k in ((48, 160), (16, 64), (40, 96)):
        w = torch.randn(n, k) * 0.1
        w[1, 16:32] = 0
        q, s, _ = nvfp4.quantize(w)
        codes, sb = pack.padded_codes(q, s, pack.round_up(n, 16), pack.round_up(k, 64))
        pq, ps = pack.pack_codes(codes, sb)
        assert pq.shape == (codes.shape[0] // 16, codes.shape[1] // 64, 32, 16) and ps.shape[-2:] == (8, 8)
        c2, sb2 = pack.unpack_codes(pq, ps)
        assert torch.equal(c2, codes) and torch.equal(sb2, sb)
        dq = pack.dequant_packed(pq, ps)
        assert torch.equal(dq[:n, :k], nvfp4.dequantize(q, s, 1.0))       # exact, no weight_scale_2
        assert not dq[n:].any() and not dq[:, k:].any()                    # padding decodes to 0
        # the dense launches' tiles (K in direct_k_order): the same codes and scale bytes back, the same weights
        dq_, ds_ = pack.pack_codes_direct(codes, sb)
        assert dq_.shape == pq.shape and torch.equal(ds_, ps)  # the scale bytes stay in their 16-blocks
        assert all(torch.equal(u, v) for u, v in zip(pack.unpack_codes_direct(dq_, ds_), (codes, sb)))
        assert torch.equal(pack.dequant_packed(dq_, ds_, direct=True), dq)


def test_kernel_decode_exact_for_every_code_and_scale():
    """The kernel's bit tricks (emulated bit for bit) give E2M1 * scale * 2^-8 exactly, for all 16 codes
    and all 127 finite non-negative e4m3 scales, subnormal ones and 0 included."""
    e4 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(pack.scale_from_bytes(pack.scale_bytes(e4)), e4.float())
    gen = torch.Generator().manual_seed(1)
    n, k = 64, 2048
    codes = torch.arange(16, dtype=torch.uint8).repeat(n * k // 16)[torch.randperm(n * k, generator=gen)].view(n, k)
    scales = e4[torch.arange(n * k // 16) % 127].view(n, k // 16)
    sb = pack.scale_bytes(scales)
    codes.view(n, -1, 16)[sb == 0] = 0
    pq, ps = pack.pack_codes(codes, sb)
    want = pack.dequant_codes(codes, sb) * 2.0 ** -pack.WEIGHT_SHIFT
    assert torch.equal(pack.emulate_decode(pq, ps).float(), want)
    # the dense launches' tiles (K in direct_k_order): each lane's one block scale in all 4 k-steps, the same weights
    dq_, ds_ = pack.pack_codes_direct(codes, sb)
    assert torch.equal(pack.emulate_decode(dq_, ds_, direct=True).float(), want)


def test_code_layout_is_a_cover_and_no_cheaper_one_exists():
    """decode_words reads each of the word's 32 bits exactly once (CODE_SOURCE is a permutation), and the
    claim behind its 9 operations: no 4 shifts or rotations of the one mask cover the word (a cover would
    be 7 operations), while three of them plus one two-part register do."""
    src = [b for reg in pack.CODE_SOURCE for half in reg for b in half]
    assert sorted(src) == list(range(32))
    mask = [b for b in range(32) if pack.CODE_MASK >> b & 1]

    def rotated(r):                         # source bits of `rotr(w, r) & mask`
        return frozenset((b + r) % 32 for b in mask)
    covers = [rs for rs in itertools.combinations(range(32), 4)
              if len(frozenset().union(*(rotated(r) for r in rs))) == 32]
    assert covers == []
    assert any(len(frozenset().union(*(rotated(r) for r in rs))) == 24 for rs in itertools.combinations(range(32), 3))


def test_pack_experts_layout():
    h, i = 96, 48
    ex = make_experts([3, 7], h, i)
    p = pack.pack_experts(ex, h, i)
    assert p.experts == [3, 7] and p.slot == {3: 0, 7: 1}
    assert (p.hidden_pad, p.inter_pad) == (128, 64)
    assert p.q_gu.shape == (2, 2 * 64 // 16, 128 // 64, 32, 16) and p.q_dn.shape == (2, 128 // 16, 64 // 64, 32, 16)
    for e, slot in p.slot.items():
        g, u, d = p.dense(slot)
        (gw, gs, g2), (uw, us, u2), (dw, ds, d2) = ex[e]
        assert torch.equal(g, nvfp4.dequantize(gw, gs, 1.0)) and torch.equal(u, nvfp4.dequantize(uw, us, 1.0))
        assert torch.equal(d, nvfp4.dequantize(dw, ds, 1.0))
        assert p.s2_gu[slot].tolist() == [g2, u2] and float(p.s2_dn[slot]) == d2
    # a checkpoint that stores gate/up fused [2I, H/2] (gate first) packs to the same bytes
    fused = {}
    for e, ((gw, gs, g2), (uw, us, u2), d) in ex.items():
        fgw, fgs, fuw, fus = pack.split_fused_gate_up(torch.cat((gw, uw)), torch.cat((gs, us)))
        fused[e] = ((fgw, fgs, g2), (fuw, fus, u2), d)
    pf = pack.pack_experts(fused, h, i)
    assert torch.equal(pf.q_gu, p.q_gu) and torch.equal(pf.s_gu, p.s_gu)


def test_pack_bf16_is_the_mma_fragment_layout():
    """pack_bf16 puts W[row, k] of tile T, k-step j where lane (g, t) register r reads it in mma.m16n8k16
    (row g + 8 (r % 2), k 16 j + 2t + 8 (r // 2) + half); unpack_bf16 is its exact inverse; padding is 0."""
    gen = torch.Generator().manual_seed(5)
    n, k = 40, 150
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    q = pack.pack_bf16(w, 48, 192)
    assert q.shape == (3, 3, 4, 256) and q.dtype == torch.bfloat16
    full = torch.zeros(48, 192, dtype=torch.bfloat16)
    full[:n, :k] = w
    assert torch.equal(pack.unpack_bf16(q), full)
    row, kk = pack._lane_index("cpu")                                   # [32 lanes, 4 regs, 2 halves]
    frag = q.view(3, 3, 4, 32, 4, 2)
    for t in range(3):
        for kt in range(3):
            for j in range(4):
                tile = full[16 * t:16 * t + 16, 64 * kt + 16 * j:64 * kt + 16 * j + 16]
                assert torch.equal(frag[t, kt, j], tile[row, kk]), (t, kt, j)


def test_pack_experts_bf16_layout():
    h, i = 80, 48
    gen = torch.Generator().manual_seed(6)
    ex = {e: tuple(torch.randn(*shape, generator=gen).to(torch.bfloat16) for shape in ((i, h), (i, h), (h, i)))
          for e in (7, 2)}
    p = pack.pack_experts_bf16(ex, h, i)
    assert p.bf16 and p.experts == [2, 7] and (p.hidden_pad, p.inter_pad) == (128, 64)
    assert p.q_gu.shape == (2, 2 * 64 // 16, 128 // 64, 4, 256) and p.q_dn.shape == (2, 128 // 16, 64 // 64, 4, 256)
    assert p.s_gu.numel() == 0 and p.s_dn.numel() == 0 and p.s2_gu.eq(1).all() and p.s2_dn.eq(1).all()
    assert p.nbytes == 2 * 2 * (2 * 64 * 128 + 128 * 64)
    for e, slot in p.slot.items():
        g, u, d = p.dense(slot)
        assert torch.equal(g, ex[e][0].float()) and torch.equal(u, ex[e][1].float())
        assert torch.equal(d, ex[e][2].float())
    with pytest.raises(ValueError):
        pack.pack_experts_bf16({0: (ex[2][0].float(), ex[2][1], ex[2][2])}, h, i)     # not bf16
    with pytest.raises(ValueError):
        pack.pack_experts_bf16(ex, 72, i)                                               # shape mismatch


def test_launch_plan():
    plan, tiles, groups, rows = ops.launch_plan([(2, 5, 8), (4, 8, 8), (9, 8, 42)], 5, {2: 0, 4: 1, 9: 2})
    assert (tiles, groups, rows) == (1 + 5, 1 + 2, 37)
    pad = plan[:tiles * 8].tolist()
    assert pad[:8] == [0, 1, 2, -1, -1, -1, -1, -1]
    assert pad[8:8 + 34] == list(range(3, 37)) and pad[8 + 34:] == [-1] * 6
    assert plan[tiles * 8:].view(-1, 4).tolist() == [[0, 0, 1, 0], [2, 1, 4, 0], [2, 5, 1, 0]]
    with pytest.raises(ValueError):
        ops.launch_plan([(2, 0, 3), (4, 4, 5)], 0, {2: 0, 4: 1})        # gap
    with pytest.raises(ValueError):
        ops.launch_plan([(5, 0, 3)], 0, {2: 0})                         # not packed here


@gpu
def test_gpu_decode_bitwise_equals_emulation():
    e4 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(3)
    for n, k in ((64, 2048), (48, 192)):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        sb = pack.scale_bytes(e4[torch.randint(0, 127, (n, k // 16), generator=gen)])
        codes.view(n, -1, 16)[sb == 0] = 0
        pq, ps = pack.pack_codes(codes, sb)
        got = ops.dequant_packed_cuda(pq.cuda(), ps.cuda()).cpu()
        want = pack.emulate_decode(pq, ps)
        bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
        assert bad.numel() == 0, f"decode differs at {bad.shape[0]} of {n * k} weights; first (row, k) " \
                                 f"{bad[0].tolist()}: kernel {got[tuple(bad[0])]} want {want[tuple(bad[0])]}"
        # K in direct_k_order (the dense launches' tiles): each lane's one block scale, written back in input order
        dq_, ds_ = pack.pack_codes_direct(codes, sb)
        got = ops.dequant_packed_cuda(dq_.cuda(), ds_.cuda(), direct=True).cpu()
        want = pack.emulate_decode(dq_, ds_, direct=True)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "direct_k_order decode differs"


if __name__ == "__main__":
    sys.exit(run_without_pytest(globals(), __file__))
