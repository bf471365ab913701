"""The replicated stack's linears and SwiGLU MLPs in the expert kernel's BF16 tiles (rocket_mpi/kernels/stack.py).

CPU: the packed forms run torch's own ops on the unpacked weights, so a packed model gives the torch path's
logits bit for bit (the glue: fusing q/k/v, the output parts, the biases, the MLP's gate/up interleave).
GPU: the kernel against an fp32 reference within a stated tolerance, each output row bitwise independent of
the other rows in the launch (1 row alone vs inside 8, 33, 70-row launches: one and several weight passes; up to
16 rows the kernel reads x itself, more go through a prep launch: the same bits), and a packed model's logits
beside the cuBLAS path's.
"""
import pytest
import torch
import torch.nn.functional as F

from rocket_mpi import kernels
from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.model.glm4_moe import Glm4MoeModel
from rocket_mpi.model.layers import swiglu_mlp

# bf16 output of an fp32-accumulated dot product: within a few bf16 steps (2^-8 relative) of the fp32 value
TOL = 2 ** -7


def _rel(out, ref):
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def _lin_ref(x, w, b):
    y = x.float() @ w.float().t()
    return y + b.float() if b is not None else y


def test_pack_linear_fuses_parts_on_32_features():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, 48, generator=g).bfloat16() for n in (64, 32, 32)]
    bs = [torch.randn(n, generator=g).bfloat16() for n in (64, 32, 32)]
    packs = kernels.pack_linear(ws, bs)
    assert len(packs) == 1 and packs[0].ends == (64, 96, 128) and packs[0].w.shape == (8, 1, 4, 256)
    odd = kernels.pack_linear([torch.randn(48, 48).bfloat16(), torch.randn(16, 48).bfloat16()])
    assert [p.ends for p in odd] == [(48,), (16,)]          # 48 is not a multiple of 32: one launch per part
    x = torch.randn(5, 48, generator=g).bfloat16()
    for got, w, b in zip(kernels.linear(x, packs), ws, bs):
        assert torch.equal(got, F.linear(x, w, b))
    with pytest.raises(ValueError, match="multiples of 16"):
        kernels.pack_linear([torch.randn(40, 48).bfloat16()])


def test_direct_k_order_puts_each_lanes_inputs_together():
    """direct_k_order: a permutation of each 64-wide k-tile in which mma lane t's B-fragment inputs (k-step j,
    register kh, half h: logical 16 j + 8 kh + 2 t + h) are columns 16 t .. 16 t + 15 of the row, in (j, kh, h)
    order; pack_bf16_direct / unpack_bf16_direct round-trip exactly."""
    from rocket_mpi.kernels.pack import direct_k_order, pack_bf16_direct, unpack_bf16_direct
    order = direct_k_order(128)
    assert sorted(order.tolist()) == list(range(128)) and (order[64:] >= 64).all()
    for t in range(4):
        cols = [int(order[16 * j + 8 * kh + 2 * t + h]) for j in range(4) for kh in range(2) for h in range(2)]
        assert cols == list(range(16 * t, 16 * t + 16)), (t, cols)
    w = torch.randn(48, 80).bfloat16()
    assert torch.equal(unpack_bf16_direct(pack_bf16_direct(w, 64, 128))[:48, :80], w)


def test_pack_mlp_cpu_is_swiglu_mlp():
    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(64, 48, generator=g).bfloat16()
    x = torch.randn(7, 64, generator=g).bfloat16()
    assert torch.equal(kernels.swiglu_dense(x, kernels.pack_mlp(gate_up, down)), swiglu_mlp(x, gate_up, down))


def test_residuals_cpu_are_the_torch_adds():
    """linear / swiglu_dense with residuals: the unfused `r + y` adds in order, bit for bit; misuse is an error."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 48, generator=g).bfloat16()
    x, r = torch.randn(5, 48, generator=g).bfloat16(), torch.randn(5, 64, generator=g).bfloat16()
    packs = kernels.pack_linear([w])
    assert torch.equal(kernels.linear(x, packs, residual=(r,))[0], r + F.linear(x, w))
    gate_up, down = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(64, 48, generator=g).bfloat16()
    xm, a, b = (torch.randn(5, 64, generator=g).bfloat16() for _ in range(3))
    got = kernels.swiglu_dense(xm, kernels.pack_mlp(gate_up, down), residual=(a, b))
    assert torch.equal(got, b + (a + swiglu_mlp(xm, gate_up, down)))
    with pytest.raises(ValueError, match="one output part"):
        kernels.linear(x, kernels.pack_linear([w, w]), residual=(r,))
    with pytest.raises(ValueError, match="residuals"):
        kernels.linear(x, packs, residual=(r[:4],))


def _logits(model, tokens, device="cpu"):
    """Two streams: a prefill of 3 and 1 tokens, then two decode steps; last-position logits of each."""
    cache = model.new_cache(2, 16)
    moe = lambda i, h, L: torch.zeros_like(h)  # noqa: E731  (the stack alone: the experts are tested elsewhere)
    t = torch.tensor(tokens, device=device)
    out = [model.forward(t, cache, [3, 1], moe)]
    for step in range(2):
        out.append(model.forward(t[step:step + 2], cache, [1, 1], moe))
    return torch.cat(out)


def test_packed_stack_cpu_same_logits(tiny_ckpt, one_thread):
    """pack_stack on the CPU: q/k/v fused with their biases and qk-norm after, o, the dense MLP and the shared
    experts; prefill-shaped and decode steps give the torch path's logits bit for bit."""
    model = Glm4MoeModel.load(CheckpointReader(tiny_ckpt))
    ref = _logits(model, [3, 17, 255, 4])
    model.pack_stack()
    L0, L1 = model.layers[0], model.layers[1]
    assert len(L0.attn.qkv) == 1 and L0.attn.qkv[0].bias is not None and L0.attn.q is not None  # both forms kept
    assert isinstance(L0.mlp_packed, kernels.PackedExperts) and isinstance(L1.shared_packed, kernels.PackedExperts)
    assert torch.equal(_logits(model, [3, 17, 255, 4]), ref)
    assert model.nbytes() > 0


def _count_calls(monkeypatch) -> dict:
    calls = {"linear": 0, "swiglu_dense": 0}
    for name in calls:
        fn = getattr(kernels, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(kernels, name, counted)
    return calls


def test_stack_rows_pick_the_path(tiny_ckpt, one_thread, monkeypatch):
    """Steps of at most STACK_KERNEL_MAX_ROWS rows take the packed copies (every layer's q/k/v and o, its dense
    MLP or shared expert), larger steps the dense weights: counted calls, 3 layers."""
    model = Glm4MoeModel.load(CheckpointReader(tiny_ckpt))
    model.pack_stack()
    calls = _count_calls(monkeypatch)
    moe = lambda i, h, L: torch.zeros_like(h)  # noqa: E731
    rows = kernels.STACK_KERNEL_MAX_ROWS
    for n, used in ((rows, True), (rows + 1, False)):
        calls.update(linear=0, swiglu_dense=0)
        model.forward(torch.arange(n) + 1, model.new_cache(1, n + 1), [n], moe)
        assert calls == ({"linear": 6, "swiglu_dense": 3} if used else {"linear": 0, "swiglu_dense": 0}), (n, calls)


def test_bad_stack_switch(monkeypatch):
    from rocket_mpi.errors import RocketError
    monkeypatch.setenv("ROCKET_STACK", "cublas")
    with pytest.raises(RocketError, match="ROCKET_STACK='cublas'"):
        kernels.stack_switch()


# ---- GPU (skipped, with the reason printed, where there is no CUDA device or no extension)
from test_kernels import gpu  # noqa: E402


@gpu
@pytest.mark.parametrize("split", ["", "1", "2", "4"])   # ROCKET_STACK_SPLIT: K slices per feature group (unset: 8)
@pytest.mark.parametrize("n,k,parts,bias", [((96, 32, 32), 96, 3, True), ((4096,), 1408, 1, False),
                                            ((1024, 1024), 4096, 2, True), ((48,), 80, 1, True)])
def test_gpu_linear_matches_reference_and_rows_are_independent(n, k, parts, bias, split, monkeypatch):
    monkeypatch.setenv("ROCKET_STACK_SPLIT", split)
    g = torch.Generator().manual_seed(sum(n) + k)
    ws = [(torch.randn(m, k, generator=g) / k ** 0.5).bfloat16().cuda() for m in n]
    bs = [torch.randn(m, generator=g).bfloat16().cuda() if bias else None for m in n]
    packs = kernels.pack_linear(ws, bs)
    x = torch.randn(70, k, generator=g).bfloat16().cuda()
    alone = [kernels.linear(x[r:r + 1], packs) for r in range(0, 70, 9)]
    for rows in (1, 8, 33, 70):
        outs = kernels.linear(x[:rows], packs)
        assert len(outs) == len(n)
        for j, (o, w, b) in enumerate(zip(outs, ws, bs)):
            assert o.shape == (rows, w.shape[0]) and o.is_contiguous()
            err = _rel(o, _lin_ref(x[:rows], w, b))
            assert err < TOL, f"rows {rows}, part {j}: rel err {err:.2e}"
            for a, r in zip(alone, range(0, 70, 9)):
                if r < rows:
                    assert torch.equal(o[r], a[j][0]), f"rows {rows}, part {j}: row {r} differs from it alone"


@gpu
@pytest.mark.parametrize("split", ["", "2"])
@pytest.mark.parametrize("h,i", [(64, 48), (4096, 1408)])
def test_gpu_swiglu_dense_matches_reference_and_rows_are_independent(h, i, split, monkeypatch):
    monkeypatch.setenv("ROCKET_STACK_SPLIT", split)
    g = torch.Generator().manual_seed(h + i)
    gate_up = (torch.randn(2 * i, h, generator=g) / h ** 0.5).bfloat16().cuda()
    down = (torch.randn(h, i, generator=g) / i ** 0.5).bfloat16().cuda()
    p = kernels.pack_mlp(gate_up, down)
    x = torch.randn(70, h, generator=g).bfloat16().cuda()
    alone = {r: kernels.swiglu_dense(x[r:r + 1], p)[0] for r in (0, 9, 40, 69)}
    for rows in (1, 8, 33, 70):
        out = kernels.swiglu_dense(x[:rows], p)
        gt, up = (x[:rows].float() @ gate_up.float().t()).chunk(2, dim=-1)
        ref = (F.silu(gt) * up) @ down.float().t()
        err = _rel(out, ref)
        assert err < 4 * TOL, f"rows {rows}: rel err {err:.2e}"  # gate, up and h rounded to bf16 on the way
        for r, a in alone.items():
            if r < rows:
                assert torch.equal(out[r], a), f"rows {rows}: row {r} differs from it alone"


@gpu
def test_gpu_stack_split_default_by_shape(monkeypatch):
    """ROCKET_STACK_SPLIT unset: 8 K slices for outputs under 8192 features, 4 from there (bit for bit the explicit
    values); another split is another sum order (close, and here not the same bits); a value the kernel does not take
    is one error."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1024, generator=g).bfloat16().cuda()
    for n, default in ((4096, "8"), (8192, "4")):
        packs = kernels.pack_linear([(torch.randn(n, 1024, generator=g) / 32).bfloat16().cuda()], [None])
        out = {}
        for split in ("", "8", "4"):
            monkeypatch.setenv("ROCKET_STACK_SPLIT", split)
            out[split] = kernels.linear(x, packs)[0]
        other = "4" if default == "8" else "8"
        assert torch.equal(out[""], out[default]), n
        assert not torch.equal(out[""], out[other]) and _rel(out[other], out[""]) < TOL, n
    monkeypatch.setenv("ROCKET_STACK_SPLIT", "3")
    with pytest.raises(RuntimeError, match="ROCKET_STACK_SPLIT=3"):
        kernels.linear(x, packs)


@gpu
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_gpu_residuals_in_the_epilogue_are_the_torch_adds(rows):
    """The adds in the kernel's epilogue give exactly the bits of torch's adds after the launch (x + o; x + (moe +
    shared)): one fp32 sum of two bf16 values, one rounding, in the same order."""
    g = torch.Generator().manual_seed(rows)
    h, i = 4096, 1408
    w = (torch.randn(h, h, generator=g) / h ** 0.5).bfloat16().cuda()
    gate_up = (torch.randn(2 * i, h, generator=g) / h ** 0.5).bfloat16().cuda()
    down = (torch.randn(h, i, generator=g) / i ** 0.5).bfloat16().cuda()
    x, a, b = ((torch.randn(rows, h, generator=g) * s).bfloat16().cuda() for s in (1.0, 0.1, 30.0))
    packs, mlp = kernels.pack_linear([w]), kernels.pack_mlp(gate_up, down)
    got = kernels.linear(x, packs, residual=(b,))[0]
    assert torch.equal(got.view(torch.int16), (b + kernels.linear(x, packs)[0]).view(torch.int16))
    got = kernels.swiglu_dense(x, mlp, residual=(a, b))
    assert torch.equal(got.view(torch.int16), (b + (a + kernels.swiglu_dense(x, mlp))).view(torch.int16))


@gpu
def test_gpu_packed_stack_logits_close(tiny_ckpt, monkeypatch):
    """The tiny model's stack on the GPU, cuBLAS vs the packed kernels (counted: they ran): logits within the
    oracle's bound (at hidden 64 they are mostly the same bits)."""
    from rocket_mpi.model.layers import move_stack
    ref_model, model = (Glm4MoeModel.load(CheckpointReader(tiny_ckpt)) for _ in range(2))
    move_stack(ref_model, "cuda")
    move_stack(model, "cuda")
    model.pack_stack()
    ref = _logits(ref_model, [3, 17, 255, 4], "cuda")
    calls = _count_calls(monkeypatch)
    out = _logits(model, [3, 17, 255, 4], "cuda")
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < 0.02, f"packed stack logits rel err {err:.2e} against cuBLAS"
    assert calls["linear"] == 3 * 2 * 3 and calls["swiglu_dense"] == 3 * 3, calls
