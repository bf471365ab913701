"""rocket_mpi.ops: the routed-expert kernels (nvfp4_experts, NVFP4 and BF16 tiles) against their torch references.

CPU tests (always run):
  - the kernel path's reference math (nvfp4_experts_ref) against ExpertStore.compute on the same
    NVFP4 experts, within TOL_STORE; the package imports without the extension.
GPU tests (skip, with the reason, without a GPU or the extension):
  - nvfp4_experts against nvfp4_experts_ref within TOL_KERNEL (small odd shapes, GLM-5.3 shape);
  - batch invariance: every row's output is bitwise the same as when computed alone, with 1..64 rows
    per expert, other experts present, shuffled expert order, different launch sizes, row_index;
  - the launch's scheduling (pdl) and kernel instance (wide, the warpgroup-mma one on sm_90 too) keep the bits,
    per-pass waits across waves included;
  - BF16 experts (pack_experts_bf16, the same kernel without the decode): against the F.linear SwiGLU MLP
    of ExpertStore.compute within TOL_STORE, against nvfp4_experts_ref within TOL_KERNEL, and batch
    invariant as above.
The tolerances are stated in helpers.py. The weight layouts: test_pack.py; the lane emulation of the
launches: test_lane_emulation.py; the scatter: test_scatter.py.
"""
from __future__ import annotations

import random
import sys

import torch

from helpers import (TOL_KERNEL, TOL_STORE, assert_close, expert_store_class, gpu,  # first: it puts the tree's
                     make_experts, pytest, run_without_pytest, segments_for, store_for)  # package on sys.path
from rocket_mpi import ops  # noqa: E402
from rocket_mpi.ops import pack  # noqa: E402

# the NVFP4 kernel instances (rocket.h kWide*: auto, narrow, wide; warpgroup mma on sm_90 GPUs, an error elsewhere)
WGMMA = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
INSTANCES = (-1, 0, 1, 2) if WGMMA else (-1, 0, 1)


@pytest.mark.parametrize("limit", [None, 0.02])
def test_reference_matches_expert_store(limit):
    h, i = 128, 64
    ex = make_experts([0, 1, 2, 5], h, i, seed=2)
    p = pack.pack_experts(ex, h, i)
    store = store_for(ex, h, i, limit)
    if store is None:
        pytest.skip("rocket_mpi.moe.experts cannot be imported here (safetensors missing)")
    counts = {0: 3, 1: 9, 2: 1, 5: 17}
    segs = segments_for(counts)
    n = sum(counts.values())
    x = (torch.randn(n, h, generator=torch.Generator().manual_seed(7)) * 2).to(torch.bfloat16)
    want = store.compute(x, torch.arange(n), segs, 0)
    got = ops.nvfp4_experts_ref(x, segs, p, 0, swiglu_limit=limit)
    # The two round in different places (ExpertStore folds weight_scale_2 into bf16 weights, the kernel
    # and its reference apply it in fp32). With the clamp at 0.02 most gate/up values sit at the limit and
    # the outputs are small: over 200 random inputs the norm error was 1.1% median, 2.0% at most (0.5-0.6%
    # without the clamp), so 2^-6 failed 1 input in 18; that case is held to 2^-5.
    tol = TOL_STORE if limit is None else (2.0 ** -5, TOL_STORE[1])
    assert_close(got, want, tol, f"nvfp4_experts_ref vs ExpertStore (limit {limit})")
    if limit is not None:   # the clamp is active on this data
        g = x.float() @ store.gate_up[0][:i].float().T
        assert bool((g > limit).any())
    # CPU tensors through the public op take the reference
    assert torch.equal(ops.nvfp4_experts(x, segs, p, 0, swiglu_limit=limit), got)


def test_package_imports_without_extension():
    assert isinstance(ops.available(), bool)
    if not ops.available():
        assert ops.unavailable_reason()
        if torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="rocket_mpi.ops"):
                ops.moe_scatter_add(torch.zeros(1, 8, dtype=torch.bfloat16, device="cuda"),
                                        torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))


@gpu
@pytest.mark.parametrize("h,i,counts,limit", [
    (80, 48, {1: 1, 4: 13, 6: 5}, None),              # padded K and N, row_index gather below
    (256, 128, {0: 8, 2: 16, 3: 32, 5: 40}, 0.05),    # full tiles, 4-tile group, a second weight pass
    (4096, 2048, {0: 3, 1: 1}, 10.0),                 # GLM-5.3-Flash expert shape, its swiglu_limit
])
def test_gpu_experts_match_reference(h, i, counts, limit):
    ids = sorted(counts) + [9]                          # an expert with no rows in the launch
    ex = make_experts(ids, h, i, seed=h + i)
    p = pack.pack_experts(ex, h, i)
    pc = p.to("cuda")
    segs = segments_for(counts, base=3)
    n = sum(counts.values())
    x = (torch.randn(n + 5, h) * 2).to(torch.bfloat16)
    row_index = torch.randperm(n + 5)[:n]
    want = ops.nvfp4_experts_ref(x, segs, p, 3, row_index, limit)
    got = ops.nvfp4_experts(x.cuda(), segs, pc, 3, row_index.cuda(), limit).cpu()
    norm, mx = assert_close(got, want, TOL_KERNEL, f"kernel vs nvfp4_experts_ref h={h} i={i}")
    print(f"\n[kernel vs ref] h={h} i={i} rows={n}: rel err norm {norm:.2e} max {mx:.2e}")
    store = store_for(ex, h, i, limit) if h <= 256 else None
    if store is not None:
        tokens = torch.cat((torch.zeros(3, dtype=torch.long), row_index))   # canonical row -> row of x
        assert_close(got, store.compute(x, tokens, segs, 3), TOL_STORE, "kernel vs ExpertStore.compute")
    # the same rows given already gathered, without row_index, and the same swiglu_limit: identical bits.
    # (limit must be passed here too: without it the clamp is off and the output is a different function)
    got2 = ops.nvfp4_experts(x[row_index].cuda(), segs, pc, 3, None, limit).cpu()
    differ = got.view(torch.int16) != got2.view(torch.int16)
    assert not differ.any(), f"pre-gathered rows (no row_index) differ from row_index in {int(differ.sum())} of " \
                             f"{differ.numel()} values; first (row, col) {differ.nonzero()[0].tolist()}"


@gpu
def test_gpu_batch_invariance():
    """Every row's output bits are those of the row computed alone, whatever shares the launch."""
    h, i = 512, 256
    ids = list(range(6))
    p = pack.pack_experts(make_experts(ids, h, i, seed=11), h, i).to("cuda")
    _check_batch_invariance(p, seed=0)


def _check_batch_invariance(p, seed):
    h = p.hidden
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(96, h, generator=gen) * 2).to(torch.bfloat16).cuda()

    alone = {}
    def single(e, r):                                    # noqa: E306
        if (e, r) not in alone:
            alone[(e, r)] = ops.nvfp4_experts(pool[r:r + 1], [(e, 0, 1)], p)[0]
        return alone[(e, r)]

    scenarios = []
    for n in (1, 2, 4, 8, 16, 32, 33, 40, 64):          # rows of the probed expert
        for others in ({}, {1: 3, 4: 7}, {0: 1, 2: 9, 3: 16, 5: 31}):
            probe = next(e for e in (2, 4, 1) if e not in others)
            scenarios.append({probe: n, **others})
    checked = launches = 0
    for sc in scenarios:
        order = sorted(sc)
        base = rng.randrange(0, 50)
        segs, start, rows = [], base, []
        for e in order:
            segs.append((e, start, start + sc[e]))
            start += sc[e]
            rows += [(e, rng.randrange(0, pool.shape[0])) for _ in range(sc[e])]
        idx = torch.tensor([r for _, r in rows], device="cuda")
        use_index = rng.random() < 0.5
        out = (ops.nvfp4_experts(pool, segs, p, base, row_index=idx) if use_index
               else ops.nvfp4_experts(pool[idx], segs, p, base))
        launches += 1
        for k, (e, r) in enumerate(rows):
            ref = single(e, r)
            if not torch.equal(out[k].view(torch.int16), ref.view(torch.int16)):
                diff = (out[k].float() - ref.float()).abs().max().item()
                pytest.fail(f"row {k} (expert {e}, pool row {r}) in launch {sc} (base {base}, row_index "
                            f"{use_index}) differs from the row alone: max |diff| {diff}")
            checked += 1
    # and run-to-run: the same launch twice
    a = ops.nvfp4_experts(pool[:40], [(1, 0, 17), (4, 17, 40)], p)
    b = ops.nvfp4_experts(pool[:40], [(1, 0, 17), (4, 17, 40)], p)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    print(f"\n[batch invariance] {checked} rows in {launches} launches bitwise equal to {len(alone)} single-row runs")


@gpu
@pytest.mark.parametrize("bf16", [False, True])
def test_gpu_scheduling_switches_keep_bits(bf16):
    """Programmatic dependent launch (the launch argument pdl, csrc/nvfp4_experts.cu) only moves when the weight
    copies and the rows start (3: each pass of down waits for its own pass of gate/up; -1: by the launch's rows),
    and the NVFP4 kernel instance (wide: 0 the 3-blocks-per-SM one, 1 the 2-blocks-per-SM one with every row-tile
    count unrolled, 2 that one on warpgroup mma (sm_90 GPUs), -1 by the launch's passes; the BF16 tiles have one
    instance): every combination gives the same bits, on every row-tile path (1-4 tiles, a second weight pass), and a
    bad value is one clear error."""
    h, i = 4096, 2048
    counts = {0: 1, 1: 5, 2: 8, 3: 13, 4: 24, 5: 32, 6: 40}
    ids = sorted(counts)
    if bf16:
        p = pack.pack_experts_bf16(make_bf16_experts(ids, h, i, seed=5), h, i).to("cuda")
    else:
        p = pack.pack_experts(make_experts(ids, h, i, seed=5), h, i).to("cuda")
    segs = segments_for(counts, base=0)
    x = (torch.randn(sum(counts.values()), h, generator=torch.Generator().manual_seed(3)) * 2).to(
        torch.bfloat16).cuda()
    outs = {}
    for v in (0, 3, -1, 0, 3, -1):
        for w in INSTANCES:
            outs[(len(outs), v, w)] = ops.nvfp4_experts(x, segs, p, pdl=v, wide=w)
    torch.cuda.synchronize()
    for bad in (1, 2, 4):
        with pytest.raises(RuntimeError, match=f"pdl {bad}"):
            ops.nvfp4_experts(x, segs, p, pdl=bad)
    for bad in (3, -2):
        with pytest.raises(RuntimeError, match=f"wide {bad}"):
            ops.nvfp4_experts(x, segs, p, wide=bad)
    first = next(iter(outs))
    for k, v in outs.items():
        assert torch.equal(v.view(torch.int16), outs[first].view(torch.int16)), f"knobs {k} differ from {first}"
    print(f"\n[scheduling switches] {'BF16' if bf16 else 'NVFP4'}: {len(outs)} settings, identical bits")


@gpu
def test_gpu_per_pass_wait_across_waves():
    """pdl=3: a pass of down starts once its own gate/up warps have published h_frag (counters, not
    the whole grid). With more blocks than the GPU holds at once (several waves of both kernels, passes finishing
    out of order), launches give exactly the bits of launches with no overlap at all (mode 0), in every kernel
    instance (wide 0, 1 and, on sm_90, 2). Two inputs alternate, so the scratch a launch reuses holds the other input's h_frag: a pass read before its rows were
    complete would differ."""
    h, i, n_exp = 512, 1024, 64
    ids = list(range(n_exp))
    p = pack.pack_experts(make_experts(ids, h, i, seed=21), h, i).to("cuda")
    rng = random.Random(5)
    counts = {e: rng.choice((1, 2, 3, 7, 8, 9, 16, 24, 33, 40)) for e in ids}
    segs = segments_for(counts, base=0)
    gen = torch.Generator().manual_seed(8)
    xs = [(torch.randn(sum(counts.values()), h, generator=gen) * 2).to(torch.bfloat16).cuda() for _ in range(2)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    refs = [ops.nvfp4_experts(x, segs, p, pdl=0, wide=0) for x in xs]
    wides = [w for w in INSTANCES if w >= 0]
    outs = [ops.nvfp4_experts(xs[k % 2], segs, p, pdl=3, wide=wides[k // 2]) for k in range(2 * len(wides))]
    assert not torch.equal(refs[0], refs[1])
    passes = sum((c + 31) // 32 for c in counts.values())
    for k, out in enumerate(outs):
        differ = out.view(torch.int16) != refs[k % 2].view(torch.int16)
        assert not differ.any(), f"launch {k} with per-pass waits differs from mode 0 in {int(differ.sum())} values"
    print(f"\n[per-pass waits] {passes} passes, {passes * (2 * i // 32 // 8)} gate/up blocks for {3 * sms} slots: "
          f"{len(outs)} launches identical to mode 0")


@gpu
def test_gpu_wgmma_instance_where_it_runs():
    """The warpgroup-mma instance (wide=2) needs an sm_90 GPU and down's feature groups in whole warpgroups (the hidden
    size padded to a multiple of 128). Asked for where it cannot run, it is one clear error; auto then takes the
    mma.sync wide instance, with the bits of the narrow one."""
    h, i = 192, 128                                     # hidden_pad 192: 6 feature groups of down
    ids = [0, 1, 2]
    p = pack.pack_experts(make_experts(ids, h, i, seed=9), h, i).to("cuda")
    counts = {0: 32, 1: 29, 2: 40}                      # passes average more than 2 row tiles: auto goes wide
    segs = segments_for(counts, base=0)
    x = (torch.randn(sum(counts.values()), h, generator=torch.Generator().manual_seed(4))).to(torch.bfloat16).cuda()
    with pytest.raises(RuntimeError, match="warpgroup mma"):
        ops.nvfp4_experts(x, segs, p, wide=2)
    auto, narrow = (ops.nvfp4_experts(x, segs, p, wide=w) for w in (-1, 0))
    assert torch.equal(auto.view(torch.int16), narrow.view(torch.int16))
    if not WGMMA:
        h = 256
        p = pack.pack_experts(make_experts(ids, h, i, seed=9), h, i).to("cuda")
        with pytest.raises(RuntimeError, match="warpgroup mma"):
            ops.nvfp4_experts(torch.zeros(4, h, dtype=torch.bfloat16, device="cuda"), segments_for({0: 4}), p, wide=2)
    print(f"\n[wgmma instance] {'sm_90: runs where' if WGMMA else 'not sm_90: refused, as'} expected; hidden {192}: "
          "refused, auto falls back with the same bits")


def make_bf16_experts(ids, hidden, inter, seed=0):
    """{e: (gate [I, H], up [I, H], down [H, I]) bf16} as a BF16 checkpoint holds them."""
    gen = torch.Generator().manual_seed(seed)
    return {e: tuple((torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)
                     for shape in ((inter, hidden), (inter, hidden), (hidden, inter))) for e in ids}


@gpu
@pytest.mark.parametrize("h,i,counts,limit", [
    (80, 48, {1: 1, 4: 13, 6: 5}, None),              # padded K and N
    (256, 128, {0: 8, 2: 16, 3: 32, 5: 40}, 0.05),    # full tiles, 4-tile group, a second weight pass
    (4096, 1408, {0: 3, 1: 1}, None),                 # the GLM-4.5-Air expert shape
])
def test_gpu_bf16_experts_match_reference(h, i, counts, limit):
    """BF16 experts in the kernel's BF16 tiles: the SwiGLU MLP of ExpertStore.compute (F.linear, bf16 between
    the steps) up to sum order, the reference path exactly as nvfp4_experts_ref computes it."""
    ids = sorted(counts) + [9]
    ex = make_bf16_experts(ids, h, i, seed=h + i)
    p = pack.pack_experts_bf16(ex, h, i)
    pc = p.to("cuda")
    assert pc.bf16
    segs = segments_for(counts, base=3)
    n = sum(counts.values())
    x = (torch.randn(n + 5, h) * 2).to(torch.bfloat16)
    row_index = torch.randperm(n + 5)[:n]
    got = ops.nvfp4_experts(x.cuda(), segs, pc, 3, row_index.cuda(), limit).cpu()
    norm, mx = assert_close(got, ops.nvfp4_experts_ref(x, segs, p, 3, row_index, limit), TOL_KERNEL,
                            f"BF16 kernel vs nvfp4_experts_ref h={h} i={i}")
    store_cls = expert_store_class()
    if store_cls is not None:
        store = store_cls(0, ids, {e: torch.cat(ex[e][:2]).cuda() for e in ids}, {e: ex[e][2].cuda() for e in ids},
                          torch.ones(10), 0, limit)
        tokens = torch.cat((torch.zeros(3, dtype=torch.long), row_index)).cuda()
        assert_close(got, store.compute(x.cuda(), tokens, segs, 3).cpu(), TOL_KERNEL,
                     "BF16 kernel vs ExpertStore.compute (F.linear)")
    print(f"\n[BF16 kernel vs ref] h={h} i={i} rows={n}: rel err norm {norm:.2e} max {mx:.2e}")
    got2 = ops.nvfp4_experts(x[row_index].cuda(), segs, pc, 3, None, limit).cpu()
    assert torch.equal(got.view(torch.int16), got2.view(torch.int16)), "pre-gathered rows differ from row_index"


@gpu
def test_gpu_bf16_batch_invariance():
    """BF16 tiles: every row's output bits are those of the row computed alone, whatever shares the launch."""
    h, i = 512, 256
    p = pack.pack_experts_bf16(make_bf16_experts(range(6), h, i, seed=12), h, i).to("cuda")
    _check_batch_invariance(p, seed=1)


if __name__ == "__main__":
    sys.exit(run_without_pytest(globals(), __file__))
