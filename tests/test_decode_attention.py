"""GLM-4.x decode attention in fixed chunks of positions (ops.decode_attention, csrc/decode_attention.cu).

CPU tests (always run): the torch reference, decode_attention_ref, against plain softmax attention in float64 (one
chunk and several), its edges (no position, a span shorter than the cache, rows of other cache rows); a lane-level
emulation of the kernel's index arithmetic (its loads, the mma and ldmatrix fragments of common.cuh and the PTX
ISA, the warps' and chunks' partials) in float64, against the same attention.
GPU tests (skip, saying why, without a GPU or the extension):
  - the kernel against the reference within a bf16 rounding, for head dims 16-128, 1-20 query heads per kv head
    (two head tiles past 16), one chunk and several;
  - the kernel against itself, bitwise: a stream alone, in a batch of other lengths, in another row, over another
    cache row, under a larger span, with NaN past its position in its cache (never read); and a changed key at its
    last position does change it (the comparison can fail);
  - captured in a CUDA graph with the positions on the device, replays as it runs eagerly;
  - bad shapes are one error naming the op.
"""
import numpy as np
import pytest
import torch

from helpers import gpu
from rocket_mpi import ops

CHUNK = ops.ATTN_CHUNK


def _case(m, hq, hkv, d, cap, seed, streams=None, device="cpu", exact=False):
    """q, kc, vc; exact: q and k small integers, so every score is exact in fp32 whatever the order of its sum (with a
    power-of-two scale): kernel and reference then see the same scores."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        q = torch.randint(-2, 3, (m, hq, d), generator=g).bfloat16()
        kc = torch.randint(-2, 3, (streams or m, hkv, cap, d), generator=g).bfloat16()
    else:
        q = (torch.randn(m, hq, d, generator=g) * 2).bfloat16()
        kc = torch.randn(streams or m, hkv, cap, d, generator=g).bfloat16()
    vc = torch.randn(streams or m, hkv, cap, d, generator=g).bfloat16()
    return q.to(device), kc.to(device), vc.to(device)


def _plain(q, kc, vc, s, n, scale):
    """Row q [hq, d] over cache row s's positions 0..n-1, float64 softmax attention."""
    hkv = kc.shape[1]
    k, v = kc[s, :, :n].double(), vc[s, :, :n].double()
    qg = q.double().view(hkv, -1, q.shape[-1])
    p = torch.softmax(qg @ k.transpose(1, 2) * scale, dim=-1)
    return (p @ v).reshape(q.shape)


@pytest.mark.parametrize("n", [1, 5, CHUNK, CHUNK + 1, 3 * CHUNK + 7])
def test_reference_is_attention(n):
    """One chunk or several: within a bf16 rounding of each probability (2^-9 of it, moving the output by at most
    2^-8 max|v|) and of the output, of float64 attention."""
    q, kc, vc = _case(2, 8, 2, 32, 3 * CHUNK + 64, seed=n)
    pos = torch.tensor([n - 1, max(n - 2, 0)])
    out = ops.decode_attention_ref(q, kc, vc, pos, 32 ** -0.5)
    for r in range(2):
        want = _plain(q[r], kc, vc, r, int(pos[r]) + 1, 32 ** -0.5)
        err = (out[r].double() - want).abs().max()
        assert err <= 2 ** -7 * float(vc[r].abs().max()), f"row {r}: max |diff| {float(err):.3g}"


def test_reference_edges():
    """pos < 0 and an out-of-range cache row give zeros; span bounds the positions; rows pick cache rows."""
    q, kc, vc = _case(3, 4, 1, 16, 40, seed=1, streams=5)
    rows = torch.tensor([4, -1, 2])
    pos = torch.tensor([30, 3, -1])
    out = ops.decode_attention_ref(q, kc, vc, pos, 0.25, span=20, rows=rows)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[2], torch.zeros_like(out[2]))
    want = ops.decode_attention_ref(q[:1], kc[4:5], vc[4:5], torch.tensor([19]), 0.25)
    assert torch.equal(out[:1], want)


# ---- the kernel's index arithmetic, lane by lane (csrc/decode_attention.cu; float64, no rounding)
WARPS, SEG, HEADS = 8, 32, 16


def _mma(c, a, b0, b1):
    """c[lane] (4) += A B, A (16x16) and B (16x8) put together from the lanes' registers (pairs of values) as
    common.cuh's mma_bf16_16816 lays them out."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row, col:col + 2] = a[lane][reg]
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = b0[lane], b1[lane]
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += (C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1])


def _ldmatrix_x4_trans(rows):
    """ldmatrix .x4 .trans: rows[lane] the 8 values at lane's row address (matrix lane // 8); lane (g, t) receives
    elements [2t][g] and [2t + 1][g] of each matrix."""
    mats = [np.array(rows[8 * i:8 * i + 8]) for i in range(4)]
    return [[(m[2 * (lane & 3), lane >> 2], m[2 * (lane & 3) + 1, lane >> 2]) for m in mats] for lane in range(32)]


def _emulated_chunk(q, K, V, n, c, h0, scale):
    """One block of the chunk kernel: (max, sum, o) per head of the tile, from its lanes' registers."""
    d, grp = q.shape[1], q.shape[0]
    sl = 32 if d >= 32 else 16
    words = sl // 8
    gt = min(HEADS, grp - h0)
    c0 = c * CHUNK
    cnt = min(CHUNK, n - c0)
    zero = np.zeros(d)

    def run(vec, off):
        return [tuple(vec[off + 2 * k:off + 2 * k + 2]) for k in range(words)]

    red_m, red_l, red_o = np.full((WARPS, 16), -np.inf), np.zeros((WARPS, 16)), np.zeros((WARPS, 16, d))
    part = []
    for w in range(WARPS):
        vw = max(0, min(SEG, cnt - w * SEG))
        base = c0 + w * SEG
        s = np.zeros((SEG // 8, 32, 4))
        if vw:
            qa = [[run(q[h0 + (ln >> 2)] if (ln >> 2) < gt else zero, u * sl + (ln & 3) * (sl // 4))
                   for u in range(d // sl)] for ln in range(32)]
            qb = [[run(q[h0 + (ln >> 2) + 8] if (ln >> 2) + 8 < gt else zero, u * sl + (ln & 3) * (sl // 4))
                   for u in range(d // sl)] for ln in range(32)]
            for nt in range(SEG // 8):
                kw = [[run(K[base + 8 * nt + (ln >> 2)] if 8 * nt + (ln >> 2) < vw else zero,
                           u * sl + (ln & 3) * (sl // 4)) for u in range(d // sl)] for ln in range(32)]
                for u in range(d // sl):
                    for i in range(words // 2):
                        a = [(qa[ln][u][2 * i], qb[ln][u][2 * i], qa[ln][u][2 * i + 1], qb[ln][u][2 * i + 1])
                             for ln in range(32)]
                        _mma(s[nt], a, [kw[ln][u][2 * i] for ln in range(32)],
                             [kw[ln][u][2 * i + 1] for ln in range(32)])
        for ln in range(32):
            g, t = ln >> 2, ln & 3
            for nt in range(SEG // 8):
                for e in range(2):
                    ok = 8 * nt + 2 * t + e < vw
                    for col in (e, 2 + e):
                        s[nt, ln, col] = s[nt, ln, col] * scale if ok else -np.inf
            red_m[w, g] = max(red_m[w, g], s[:, ln, :2].max())
            red_m[w, g + 8] = max(red_m[w, g + 8], s[:, ln, 2:].max())
        part.append((s, vw, base))
    mx = red_m.max(axis=0)
    g = np.arange(32) >> 2
    row_max = np.stack([mx[g], mx[g], mx[g + 8], mx[g + 8]], axis=-1)   # [lane, register]: heads g, g, g + 8, g + 8
    vs = np.zeros((CHUNK, d))
    for w, (s, vw, base) in enumerate(part):
        vs[w * SEG:w * SEG + vw] = V[base:base + vw]
        p = np.where(np.isinf(s), 0.0, np.exp(s - row_max))
        for ln in range(32):
            red_l[w, ln >> 2] += p[:, ln, :2].sum()
            red_l[w, (ln >> 2) + 8] += p[:, ln, 2:].sum()
        if not vw:
            continue
        o = np.zeros((d // 8, 32, 4))
        for ks in range(SEG // 16):
            a = [(tuple(p[2 * ks, ln, :2]), tuple(p[2 * ks, ln, 2:]), tuple(p[2 * ks + 1, ln, :2]),
                  tuple(p[2 * ks + 1, ln, 2:])) for ln in range(32)]
            for dp in range(d // 16):
                rows = [vs[w * SEG + 16 * ks + (ln & 7) + 8 * ((ln >> 3) & 1), 8 * (ln >> 4) + 16 * dp:][:8]
                        for ln in range(32)]
                b = _ldmatrix_x4_trans(rows)
                _mma(o[2 * dp], a, [x[0] for x in b], [x[1] for x in b])
                _mma(o[2 * dp + 1], a, [x[2] for x in b], [x[3] for x in b])
        for ln in range(32):
            g, t = ln >> 2, ln & 3
            for dt in range(d // 8):
                red_o[w, g, 8 * dt + 2 * t:8 * dt + 2 * t + 2] = o[dt, ln, :2]
                red_o[w, g + 8, 8 * dt + 2 * t:8 * dt + 2 * t + 2] = o[dt, ln, 2:]
    nw = -(-cnt // SEG)
    return mx[:gt], red_l[:nw].sum(axis=0)[:gt], red_o[:nw].sum(axis=0)[:gt]


@pytest.mark.parametrize("d,grp,n", [(16, 2, 7), (32, 12, 40), (32, 20, 300), (128, 12, 33)])
def test_lane_emulation_is_attention(d, grp, n):
    """The kernel's arithmetic, lane by lane, without its roundings: float64 softmax attention to 1e-12 (keys and
    values past n are NaN: never read), over the chunks and head tiles the launch has."""
    rng = np.random.default_rng(n)
    q, K, V = rng.standard_normal((grp, d)), rng.standard_normal((n + 40, d)), rng.standard_normal((n + 40, d))
    K[n:], V[n:] = np.nan, np.nan
    scale = d ** -0.5
    for h0 in range(0, grp, HEADS):
        parts = [_emulated_chunk(q, K, V, n, c, h0, scale) for c in range(-(-n // CHUNK))]
        top = np.max([m for m, _, _ in parts], axis=0)
        total = sum(lc * np.exp(m - top) for m, lc, _ in parts)
        out = sum(oc * np.exp(m - top)[:, None] for m, _, oc in parts) / total[:, None]
        qt = q[h0:h0 + HEADS]
        sc = qt @ K[:n].T * scale
        p = np.exp(sc - sc.max(axis=1, keepdims=True))
        want = (p / p.sum(axis=1, keepdims=True)) @ V[:n]
        assert np.abs(out - want).max() < 1e-12, (d, grp, n, h0)


# ---- GPU
# (rows, query heads, kv heads, head dim, cache positions)
SHAPES = [(3, 8, 2, 64, 80), (2, 96, 8, 128, 600), (4, 4, 2, 16, 300), (2, 20, 1, 32, 520), (5, 12, 12, 128, 40),
          (1, 32, 2, 128, 1100)]


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_kernel_matches_reference(shape):
    """Exact scores (integer q and k, scale 1/8): every element within one bf16 rounding of the reference's (only
    the fp32 sums' order differs); random scores (scale d^-0.5): within 2^-7 in norm (a probability can round the
    other way as well)."""
    m, hq, hkv, d, cap = shape
    g = torch.Generator().manual_seed(d)
    pos = torch.randint(0, cap, (m,), generator=g)
    pos[0] = cap - 1                                               # the whole cache: the most chunks
    for exact, scale in ((True, 0.125), (False, d ** -0.5)):
        q, kc, vc = _case(m, hq, hkv, d, cap, seed=cap, device="cuda", exact=exact)
        got = ops.decode_attention(q, kc, vc, pos.cuda(), scale)
        want = ops.decode_attention_ref(q.cpu(), kc.cpu(), vc.cpu(), pos, scale).float()
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert torch.isfinite(got.float()).all()
        err = (got.float().cpu() - want).abs()
        if exact:
            bound = 2 ** -7 * want.abs() + 2 ** -12 * float(want.abs().max())
            assert (err <= bound).all(), f"{shape}: max |diff| {float(err.max()):.3g}"
        else:
            rel = float(err.norm() / want.norm())
            assert rel <= 2 ** -7, f"{shape}: relative error {rel:.3g}"


@gpu
@pytest.mark.parametrize("d,hq,hkv", [(128, 96, 8), (64, 8, 2), (16, 4, 2), (32, 40, 2)])
def test_gpu_kernel_is_batch_invariant(d, hq, hkv):
    """A stream's output alone (its own cache, span = its length) equals it in a batch (another row, another cache
    row through `rows`, other streams of other lengths, the span the whole cache, NaN past its position in its
    cache): bitwise, for lengths within one chunk, at a chunk's edge and over several chunks."""
    cap = 4 * CHUNK
    scale = d ** -0.5
    for n in (1, 37, CHUNK, CHUNK + 1, 3 * CHUNK + 5):
        q, kc, vc = _case(6, hq, hkv, d, cap, seed=n + d, device="cuda")
        alone = ops.decode_attention(q[:1], kc[:1, :, :n].contiguous(), vc[:1, :, :n].contiguous(),
                                     torch.tensor([n - 1], device="cuda"), scale)
        big_k, big_v = kc.clone(), vc.clone()
        big_k[0, :, n:], big_v[0, :, n:] = float("nan"), float("nan")  # never read
        order = torch.tensor([3, 1, 0, 4, 2, 5], device="cuda")       # the stream in row 2, cache row 0
        others = torch.tensor([cap - 1, 5, n - 1, 0, CHUNK + 3, 2 * CHUNK], device="cuda")
        batched = ops.decode_attention(q[order], big_k, big_v, others, scale, span=cap, rows=order)
        assert torch.isfinite(batched[2].float()).all(), f"n={n}: read past the stream's position"
        assert torch.equal(alone[0], batched[2]), f"d={d} n={n}: the stream alone differs from it in the batch"
        again = ops.decode_attention(q[order], big_k, big_v, others, scale, span=cap, rows=order)
        assert torch.equal(batched, again), "not deterministic"
        nudged = big_v.clone()
        nudged[0, :, n - 1] += 1e6                                    # weighed at >= 1e-6 at these scores
        moved = ops.decode_attention(q[order], big_k, nudged, others, scale, span=cap, rows=order)
        assert not torch.equal(moved[2], batched[2]), "a changed value left the output as it was"


@gpu
def test_gpu_kernel_in_a_cuda_graph():
    """Captured once with the positions on the device: replays after the positions move equal eager launches, for
    spans of one chunk and of several."""
    for span in (CHUNK, 3 * CHUNK):
        q, kc, vc = _case(4, 12, 1, 128, span, seed=span, device="cuda")
        pos = torch.tensor([0, 5, span - 1, 17], device="cuda")
        ops.decode_attention(q, kc, vc, pos, 0.1, span=span)             # warm-up: the launch's one-time setup
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.decode_attention(q, kc, vc, pos, 0.1, span=span)
        for step in range(3):
            pos.copy_(torch.tensor([step, 5 + step, span - 1 - step, 17 * step], device="cuda"))
            graph.replay()
            assert torch.equal(out, ops.decode_attention(q, kc, vc, pos, 0.1, span=span)), (span, step)


@gpu
def test_gpu_kernel_bad_input():
    q, kc, vc = _case(2, 4, 2, 48, 16, seed=0, device="cuda")
    pos = torch.zeros(2, dtype=torch.long, device="cuda")
    with pytest.raises(RuntimeError, match="decode_attention.*head dim 48"):
        ops.decode_attention(q, kc, vc, pos, 0.1)
    q, kc, vc = _case(2, 4, 2, 64, 16, seed=0, device="cuda")
    with pytest.raises(RuntimeError, match="decode_attention: span 17 of 16"):
        ops.decode_attention(q, kc, vc, pos, 0.1, span=17)
    with pytest.raises(RuntimeError, match="decode_attention: 3 rows over caches of 2"):
        ops.decode_attention(torch.cat((q, q[:1])), kc, vc, torch.zeros(3, dtype=torch.long, device="cuda"), 0.1)
    out = ops.decode_attention(q, kc, vc, torch.tensor([-1, 3], device="cuda"), 0.1)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().sum() > 0


if __name__ == "__main__":
    from helpers import run_without_pytest
    raise SystemExit(run_without_pytest(globals(), __file__))
