"""The replicated stack's linears and SwiGLU MLPs in the expert kernel's tiles (rocket_mpi/ops/stack.py): BF16, and
NVFP4 held as stored (a checkpoint that quantises the stack, `:nvfp4-all`).

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

from rocket_mpi import ops
from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.ops import nvfp4
from rocket_mpi.model import model_class
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
    packs = ops.pack_linear(ws, bs)
    assert len(packs) == 1 and packs[0].ends == (64, 96, 128) and packs[0].w.shape == (8, 1, 4, 256)
    odd = ops.pack_linear([torch.randn(48, 48).bfloat16(), torch.randn(16, 48).bfloat16()])
    assert [p.ends for p in odd] == [(48,), (16,)]          # 48 is not a multiple of 32: one launch per part
    x = torch.randn(5, 48, generator=g).bfloat16()
    for got, w, b in zip(ops.linear(x, packs), ws, bs):
        assert torch.equal(got, F.linear(x, w, b))
    with pytest.raises(ValueError, match="multiples of 16"):
        ops.pack_linear([torch.randn(40, 48).bfloat16()])


def test_direct_k_order_puts_each_lanes_inputs_together():
    """direct_k_order: a permutation of each 64-wide k-tile in which mma lane t's B-fragment inputs (k-step j,
    register kh, half h: logical 16 j + 8 kh + 2 t + h) are columns 16 t .. 16 t + 15 of the row, in (j, kh, h)
    order; pack_bf16_direct / unpack_bf16_direct round-trip exactly."""
    from rocket_mpi.ops.pack import direct_k_order, pack_bf16_direct, unpack_bf16_direct
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
    assert torch.equal(ops.swiglu_dense(x, ops.pack_mlp(gate_up, down)), swiglu_mlp(x, gate_up, down))


def test_residuals_cpu_are_the_torch_adds():
    """linear / swiglu_dense with residuals: the unfused `r + y` adds in order, bit for bit; misuse is an error."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 48, generator=g).bfloat16()
    x, r = torch.randn(5, 48, generator=g).bfloat16(), torch.randn(5, 64, generator=g).bfloat16()
    packs = ops.pack_linear([w])
    assert torch.equal(ops.linear(x, packs, residual=(r,))[0], r + F.linear(x, w))
    gate_up, down = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(64, 48, generator=g).bfloat16()
    xm, a, b = (torch.randn(5, 64, generator=g).bfloat16() for _ in range(3))
    got = ops.swiglu_dense(xm, ops.pack_mlp(gate_up, down), residual=(a, b))
    assert torch.equal(got, b + (a + swiglu_mlp(xm, gate_up, down)))
    with pytest.raises(ValueError, match="one output part"):
        ops.linear(x, ops.pack_linear([w, w]), residual=(r,))
    with pytest.raises(ValueError, match="residuals"):
        ops.linear(x, packs, residual=(r[:4],))


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
    assert isinstance(L0.mlp_packed, ops.PackedExperts) and isinstance(L1.shared_packed, ops.PackedExperts)
    assert torch.equal(_logits(model, [3, 17, 255, 4]), ref)
    assert model.nbytes() > 0


def _stub_moe(i, h, L, shared=None, residual=None, next_norm=None):
    """Routed experts stood in by h / 2 (the experts are tested elsewhere), with moe/step.py DeviceMoE's contract for the
    fixed-shape step: residual + (routed + shared), or routed + shared without a residual; with next_norm (the
    step's fused glue on a GPU) also that norm of the result."""
    from rocket_mpi.model.layers import norm_of
    routed = h * 0.5
    if shared is None:
        return routed
    out = ops.add_residuals(routed, (shared(),) if residual is None else (shared(), residual))
    return out if next_norm is None else (out, norm_of(out.is_cuda)(out, *next_norm))


def _family_logits(model, device="cpu") -> torch.Tensor:
    """Two streams: a prefill of 3 and 1 tokens, a decode step through forward, two through forward_static (the
    indexers past index_topk: they score, and wq_b / the head weights run); every step's logits."""
    cache = model.new_cache(2, 16)
    out = [model.forward(torch.tensor([3, 17, 255, 4]), cache, [3, 1], _stub_moe).float()]
    out.append(model.forward(torch.tensor([9, 40]), cache, [1, 1], _stub_moe).float())
    for step in range(2):
        out.append(model.forward_static(torch.tensor([7 + step, 80], device=device), cache.lengths.to(device),
                                        cache, _stub_moe).float())
        cache.lengths += 1
    return torch.cat(out)


@pytest.mark.parametrize("ckpt_name", ["dsa_ckpt", "glm5_ckpt"])
def test_packed_stack_cpu_same_logits_glm5_families(ckpt_name, request, one_thread, monkeypatch):
    """GLM-5 (q_a | kv_a | indexer wk fused, q_b, wq_b, o with x + o in its epilogue, the MLPs) and GLM-5.3-Flash
    (KDA's qkv | f_a | g_a, b, f_b, g_b, o; MLA's and its indexer's linears; the MLPs with swiglu_limit's clamp)
    packed on the CPU: prefill, host decode and fixed-shape steps give the torch path's logits bit for bit, and
    the packed copies ran (counted). Linears whose shape is not whole tiles of 16 (the tiny presets' 2-head b
    and index weights) keep F.linear."""
    reader = CheckpointReader(request.getfixturevalue(ckpt_name))
    model = model_class(reader.config.model_type).load(reader)
    ref = _family_logits(model)
    model.pack_stack()
    packed = [p for L in model.layers for part in (getattr(L, "attn", None), getattr(L, "kda", None),
                                                   getattr(L, "mla", None))
              if part is not None and part.packed for p in part.packed.values() if p is not None]
    assert len(packed) >= 3 * len(model.layers), len(packed)
    assert all(L.mlp_packed is not None or L.shared_packed is not None for L in model.layers)
    calls = _count_calls(monkeypatch)
    assert torch.equal(_family_logits(model), ref)
    assert calls["linear"] > 0 and calls["swiglu_dense"] > 0, calls
    from rocket_mpi.model.layers import packed_copies
    assert len(packed_copies(model)) >= 2 * len(model.layers)   # each layer: its attention's dict and an MLP
    model.to("cpu")  # the copies belong to the device they were packed on: a move drops them (no kernels here)
    assert packed_copies(model) == []


def test_swiglu_dense_limit_cpu_is_the_clamped_mlp():
    """swiglu_dense with a limit: gate.clamp(max=L), up.clamp(-L, L) before the activation (GLM-5.3-Flash's dense and
    shared experts), as written out here; the clamp changes the output where gate / up pass L."""
    g = torch.Generator().manual_seed(4)
    gate_up, down = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(64, 48, generator=g).bfloat16()
    x = (torch.randn(7, 64, generator=g) * 4).bfloat16()
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    want = F.linear(F.silu(gate.clamp(max=3.0)) * up.clamp(-3.0, 3.0), down)
    p = ops.pack_mlp(gate_up, down)
    assert torch.equal(ops.swiglu_dense(x, p, limit=3.0), want)
    assert not torch.equal(ops.swiglu_dense(x, p), want)


def _count_calls(monkeypatch) -> dict:
    calls = {"linear": 0, "swiglu_dense": 0}
    for name in calls:
        fn = getattr(ops, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(ops, name, counted)
    return calls


def test_stack_rows_pick_the_path(tiny_ckpt, one_thread, monkeypatch):
    """A stream of at most STACK_KERNEL_MAX_ROWS rows in a forward takes the packed copies (every layer's q/k/v and
    o, its dense MLP or shared expert), a longer one the dense weights; lm_head always its packed copy. Counted
    calls and their rows, 3 layers: one stream of 16 and of 17 rows; a decode step of 20 streams (every row packed,
    one launch each); a prefill of 20, 3 and 2 rows (the 5 short rows in one launch each), whose logits match the
    unpacked model's (the rows put back in order)."""
    model = Glm4MoeModel.load(CheckpointReader(tiny_ckpt))
    ref = Glm4MoeModel.load(CheckpointReader(tiny_ckpt))
    model.pack_stack()
    rows_seen = {"linear": [], "swiglu_dense": []}
    for name, seen in rows_seen.items():
        def counted(x, *a, _fn=getattr(ops, name), _seen=seen, **k):
            _seen.append(x.shape[0])
            return _fn(x, *a, **k)
        monkeypatch.setattr(ops, name, counted)
    moe = lambda i, h, L: torch.zeros_like(h)  # noqa: E731
    limit = ops.STACK_KERNEL_MAX_ROWS
    for n, used in ((limit, True), (limit + 1, False)):
        model.forward(torch.arange(n) + 1, model.new_cache(1, n + 1), [n], moe)
        want = {"linear": [n] * 6 + [1], "swiglu_dense": [n] * 3} if used else {"linear": [1], "swiglu_dense": []}
        assert rows_seen == want, (n, rows_seen)
        rows_seen["linear"].clear(), rows_seen["swiglu_dense"].clear()
    model.forward(torch.arange(20) + 1, model.new_cache(20, 4), [1] * 20, moe)
    assert rows_seen == {"linear": [20] * 7, "swiglu_dense": [20] * 3}, rows_seen
    rows_seen["linear"].clear(), rows_seen["swiglu_dense"].clear()
    lens = [20, 3, 2]
    tokens = torch.randint(1, model.cfg.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(5))
    got = model.forward(tokens, model.new_cache(3, 32), lens, moe)
    assert rows_seen == {"linear": [5] * 6 + [3], "swiglu_dense": [5] * 3}, rows_seen
    want = ref.forward(tokens, ref.new_cache(3, 32), lens, moe)
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max()), "a row's output went to another row"


# ---- NVFP4 held as stored (CPU: the references are the BF16-dequantising loader's arithmetic, bit for bit)

def _quant(n, k, g):
    """(weight, weight_scale, weight_scale_2) of a random [n, k] matrix, as ModelOpt writes them."""
    return nvfp4.quantize(torch.randn(n, k, generator=g) / k ** 0.5)


def _dq(parts, dtype=torch.bfloat16):
    return nvfp4.dequantize(*parts, dtype=dtype)


def test_pack_linear_nvfp4_unpacks_to_the_dequantised_weights():
    """Fused NVFP4 parts (each its own weight_scale_2; K padded from 96 to 128, features from 144 to 160) unpack to
    the loader's BF16 weights bit for bit, and linear on the CPU is F.linear on them (with biases, a residual);
    reader.Linear parts pack the same; a BF16 weight beside NVFP4 ones packs on its own."""
    from rocket_mpi.checkpoint.reader import Linear
    g = torch.Generator().manual_seed(11)
    parts = [_quant(n, 96, g) for n in (64, 32, 48)]
    bs = [torch.randn(n, generator=g).bfloat16() for n in (64, 32, 48)]
    packs = ops.pack_linear(parts, bs)
    p = packs[0]
    assert len(packs) == 1 and p.nvfp4 and p.ends == (64, 96, 144) and p.w.shape == (10, 2, 32, 16)
    assert p.w_scale == tuple(float(q[2]) for q in parts)
    assert 3 * p.nbytes < ops.pack_linear([_dq(q) for q in parts], bs)[0].nbytes   # codes + scales: 4.5 bits each
    for w, q in zip(ops.unpack_linear(p), parts):
        assert torch.equal(w, _dq(q))
    x = torch.randn(5, 96, generator=g).bfloat16()
    for got, q, b in zip(ops.linear(x, packs), parts, bs):
        assert torch.equal(got, F.linear(x, _dq(q), b))
    one = ops.pack_linear([Linear("o", *parts[0])])
    r = torch.randn(5, 64, generator=g).bfloat16()
    assert torch.equal(one[0].w, ops.pack_linear([parts[0]])[0].w)
    assert torch.equal(ops.linear(x, one, residual=(r,))[0], r + F.linear(x, _dq(parts[0])))
    mixed = ops.pack_linear([parts[0], torch.randn(32, 96, generator=g).bfloat16()])
    assert [m.nvfp4 for m in mixed] == [True, False]


def test_pack_mlp_nvfp4_is_the_dequantised_mlp():
    """A SwiGLU MLP held as stored (gate, up, down NVFP4, three weight_scale_2): unpack_mlp gives load_swiglu's BF16
    weights and swiglu_dense on the CPU swiglu_mlp on them, with residuals and swiglu_limit's clamp."""
    g = torch.Generator().manual_seed(12)
    gate, up, down = _quant(48, 64, g), _quant(48, 64, g), _quant(64, 48, g)
    p = ops.pack_mlp((gate, up), down)
    assert not p.bf16
    gate_up, dn = ops.unpack_mlp(p)
    assert torch.equal(gate_up, torch.cat((_dq(gate), _dq(up)))) and torch.equal(dn, _dq(down))
    x, a, b = ((torch.randn(7, 64, generator=g) * 4).bfloat16() for _ in range(3))
    assert torch.equal(ops.swiglu_dense(x, p, residual=(a, b)), b + (a + swiglu_mlp(x, gate_up, dn)))
    assert torch.equal(ops.swiglu_dense(x, p, limit=0.5), swiglu_mlp(x, gate_up, dn, 0.5))


@pytest.fixture(scope="module")
def all_ckpts(tmp_path_factory):
    """tiny (glm4_moe), dsa-tiny (GLM-5's MLA) and glm5-tiny (GLM-5.3-Flash: KDA and MLA) with every Linear NVFP4
    as ModelOpt's all-Linears recipe does (lm_head and the routers excluded)."""
    from rocket_mpi.checkpoint.make import make_checkpoint
    out = {}
    for preset in ("tiny", "dsa-tiny", "glm5-tiny"):
        out[preset] = str(tmp_path_factory.mktemp(preset + "_all"))
        make_checkpoint(preset, out[preset], seed=3, nvfp4_all=True)
    return out


@pytest.mark.parametrize("preset", ["tiny", "dsa-tiny", "glm5-tiny"])
def test_nvfp4_lm_head_held_as_stored_cpu_same_logits(preset, tmp_path, one_thread, monkeypatch):
    """A checkpoint that quantises the lm_head too (`make-checkpoint --nvfp4-head`, `:nvfp4-head`; Q4_K_M-like):
    every family keeps the head's NVFP4 parts (model.stored), its packed copy is NVFP4, and where the device holds it
    as stored (emulated: layers.holds_stored) the dense head is released, the model's bytes count the packed copy
    instead, and the logits are the loader's, bit for bit; a move rebuilds the dense head exactly."""
    from rocket_mpi.checkpoint.make import make_checkpoint
    from rocket_mpi.model import layers
    d = str(tmp_path / preset)
    make_checkpoint(preset, d, seed=3, nvfp4_head=True)
    reader = CheckpointReader(d)
    assert "lm_head.weight_scale" in reader
    model = model_class(reader.config.model_type).load(reader)
    assert set(model.stored) == {"lm_head"}
    head, ref, dense_bytes = model.lm_head.clone(), _family_logits(model), model.nbytes()
    monkeypatch.setattr(layers, "holds_stored", lambda device: True)
    model.pack_stack()
    assert model.lm_head is None and all(isinstance(p, ops.PackedLinear) and p.nvfp4 for p in model.head_packed)
    assert model.nbytes() < dense_bytes - head.numel()     # the packed head (about 0.56 B a weight) in its place
    assert torch.equal(_family_logits(model), ref)
    monkeypatch.undo()
    model.to("cpu")
    assert torch.equal(model.lm_head, head) and torch.equal(_family_logits(model), ref)


def _long_logits(model, device="cpu"):
    """A prefill of a 20-row stream (past STACK_KERNEL_MAX_ROWS: the dense weights, or the packed ones dequantised)
    beside a 2-row one, then a decode step; last-position logits of each."""
    cache = model.new_cache(2, 32)
    t = (torch.arange(24) * 7 + 3) % model.cfg.vocab_size
    out = [model.forward(t[:22], cache, [20, 2], _stub_moe).float()]
    out.append(model.forward(t[22:], cache, [1, 1], _stub_moe).float())
    return torch.cat(out)


def _attention(model):
    """The first layer's attention that holds NVFP4 linears as stored (glm4_moe's, GLM-5's MLA; GLM-5.3-Flash:
    its first MLA layer, whose indexer too)."""
    return next(L.attn if hasattr(L, "attn") else L.mla for L in model.layers
                if getattr(L, "attn", None) is not None or getattr(L, "mla", None) is not None)


@pytest.mark.parametrize("preset", ["tiny", "dsa-tiny", "glm5-tiny"])
def test_packed_stack_nvfp4_held_as_stored_cpu_same_logits(preset, all_ckpts, one_thread, monkeypatch):
    """An `:nvfp4-all` stack packed as stored: the NVFP4 linears (glm4_moe's q/k/v/o; MLA's q_a | kv_a, q_b, o and
    the indexer's wk, wq_b; KDA's q | k | v, f_a | g_a, b, f_b, g_b, o) and MLPs in NVFP4 tiles. On the CPU the
    dense weights stay (bit for bit the loader's logits); where the device holds them as stored (emulated here:
    layers.holds_stored) the dense fields are released, nbytes counts the packed bytes instead, steps of more than
    16 rows dequantise the packed copy, and the logits are still the same bits; a move rebuilds the released fields
    exactly."""
    from rocket_mpi.model import layers
    reader = CheckpointReader(all_ckpts[preset])
    model = model_class(reader.config.model_type).load(reader)
    attn = _attention(model)
    assert attn.stored and any(L.stored for L in model.layers)
    dense = {k: getattr(attn, k).clone() for k in attn.stored}
    ref, ref_long, bf16_bytes = _family_logits(model), _long_logits(model), model.nbytes()
    model.pack_stack()
    packs = [p for obj, f in layers.packed_copies(model) for v in [getattr(obj, f)]
             for item in (v.values() if isinstance(v, dict) else [v]) for p in (item if isinstance(item, list) else
                                                                               [item]) if p is not None]
    assert any(isinstance(p, ops.PackedLinear) and p.nvfp4 for p in packs)
    assert any(isinstance(p, ops.PackedExperts) and not p.bf16 for p in packs)
    assert getattr(attn, next(iter(attn.stored))) is not None              # the CPU keeps its dense weights
    assert torch.equal(_family_logits(model), ref) and torch.equal(_long_logits(model), ref_long)

    model = model_class(reader.config.model_type).load(reader)
    monkeypatch.setattr(layers, "holds_stored", lambda device: True)
    model.pack_stack()
    attn = _attention(model)
    assert all(getattr(attn, k) is None for k in attn.stored)
    ix = getattr(attn, "indexer", None)
    assert ix is None or (ix.stored and all(getattr(ix, k) is None for k in ix.stored))
    for kda in [L.kda for L in model.layers if getattr(L, "kda", None) is not None]:  # GLM-5.3-Flash's KDA layers
        assert set(kda.stored) == {"qkv", "f_a", "f_b", "b", "g_a", "g_b", "o"}
        h = kda.packed["h"]  # q | k | v in one launch, then f_a | g_a | b (apart where f_a does not end on 32
        parts = sum(len(p.ends) for p in h)  # features; b only where it is whole tiles of 16: not glm5-tiny's)
        assert len(h[0].ends) == 3 and parts == 5
        for name in kda.stored:  # released where packed (tiny shapes not whole tiles of 16 keep F.linear)
            packed = kda.packed["h" if name in ("qkv", "f_a", "g_a") else name] is not None
            assert (getattr(kda, name) is None) == packed, name
    assert all(getattr(L, n) == (None, None) for L in model.layers for n in L.stored)
    assert model.nbytes() < bf16_bytes
    assert torch.equal(_family_logits(model), ref) and torch.equal(_long_logits(model), ref_long)
    monkeypatch.undo()
    model.to("cpu")
    assert all(torch.equal(getattr(attn, k), w) for k, w in dense.items())
    assert torch.equal(_family_logits(model), ref) and model.nbytes() == bf16_bytes


def _all_or_head_reader(preset: str, head: bool, all_ckpts, tmp_path) -> CheckpointReader:
    """The preset's all-Linears NVFP4 checkpoint, or (head) one written with its lm_head NVFP4 too."""
    from rocket_mpi.checkpoint.make import make_checkpoint
    if not head:
        return CheckpointReader(all_ckpts[preset])
    d = str(tmp_path / preset)
    make_checkpoint(preset, d, seed=3, nvfp4_head=True)
    return CheckpointReader(d)


@pytest.mark.parametrize("preset,head", [("tiny", False), ("tiny", True), ("dsa-tiny", True), ("glm5-tiny", True)])
def test_loading_for_a_stored_device_never_dequantises(preset, head, all_ckpts, tmp_path, one_thread, monkeypatch):
    """Loaded for a device that holds NVFP4 weights as stored (layers.loading_for; emulated: layers.holds_stored),
    the fields pack_stack would release (glm4_moe's q/k/v/o and MLPs; every family's lm_head) are never dequantised:
    empty from the load, nbytes counts their stored parts until they are packed, a move keeps them empty, and once
    packed the model is the one a full load packs, logits bit for bit."""
    from rocket_mpi.checkpoint import reader as reader_mod
    from rocket_mpi.model import layers
    reader = _all_or_head_reader(preset, head, all_ckpts, tmp_path)
    cls = model_class(reader.config.model_type)
    monkeypatch.setattr(layers, "holds_stored", lambda device: True)
    full = cls.load(reader)
    full.pack_stack()
    ref, packed_bytes = _family_logits(full), full.nbytes()
    dense = []
    real = reader_mod.Linear.dense
    monkeypatch.setattr(reader_mod.Linear, "dense",  # the NVFP4 ones dequantised
                        lambda self, *a, **k: (self.nvfp4 and dense.append(self.name)) or real(self, *a, **k))
    with layers.loading_for("cpu"):
        lazy = cls.load(reader)
    assert "lm_head" not in dense and (lazy.lm_head is None) == head
    if preset == "tiny":  # every glm4_moe stack linear (tiny's shapes are whole tiles)
        assert not [n for n in dense if "self_attn" in n or ".mlp." in n], dense
        assert all(getattr(L.attn, k) is None for L in lazy.layers for k in L.attn.stored)
        assert all(getattr(L, k) == (None, None) for L in lazy.layers for k in L.stored)
    # the plan's stack bytes before packing: the empty fields' stored parts (the packed copy pads them to whole tiles)
    assert layers.stored_nbytes(lazy) > 0 and packed_bytes >= lazy.nbytes() >= 0.8 * packed_bytes if preset == "tiny" \
        else lazy.nbytes() >= packed_bytes
    lazy.to("cpu")                      # a move to such a device keeps the empty fields empty
    assert (lazy.lm_head is None) == head
    lazy.pack_stack()
    assert lazy.nbytes() == packed_bytes and torch.equal(_family_logits(lazy), ref)


# ---- GPU (skipped, with the reason printed, where there is no CUDA device or no extension)
from helpers import gpu  # noqa: E402


@gpu
@pytest.mark.parametrize("split", [0, 1, 2, 4])   # K slices per feature group (0: by the output's width)
@pytest.mark.parametrize("n,k,parts,bias", [((96, 32, 32), 96, 3, True), ((4096,), 1408, 1, False),
                                            ((1024, 1024), 4096, 2, True), ((48,), 80, 1, True)])
def test_gpu_linear_matches_reference_and_rows_are_independent(n, k, parts, bias, split):
    g = torch.Generator().manual_seed(sum(n) + k)
    ws = [(torch.randn(m, k, generator=g) / k ** 0.5).bfloat16().cuda() for m in n]
    bs = [torch.randn(m, generator=g).bfloat16().cuda() if bias else None for m in n]
    packs = ops.pack_linear(ws, bs)
    x = torch.randn(70, k, generator=g).bfloat16().cuda()
    alone = [ops.linear(x[r:r + 1], packs, split=split) for r in range(0, 70, 9)]
    for rows in (1, 8, 33, 70):
        outs = ops.linear(x[:rows], packs, split=split)
        assert len(outs) == len(n)
        for j, (o, w, b) in enumerate(zip(outs, ws, bs)):
            assert o.shape == (rows, w.shape[0]) and o.is_contiguous()
            err = _rel(o, _lin_ref(x[:rows], w, b))
            assert err < TOL, f"rows {rows}, part {j}: rel err {err:.2e}"
            for a, r in zip(alone, range(0, 70, 9)):
                if r < rows:
                    assert torch.equal(o[r], a[j][0]), f"rows {rows}, part {j}: row {r} differs from it alone"


@gpu
@pytest.mark.parametrize("split", [0, 2])
@pytest.mark.parametrize("h,i", [(64, 48), (4096, 1408)])
def test_gpu_swiglu_dense_matches_reference_and_rows_are_independent(h, i, split):
    g = torch.Generator().manual_seed(h + i)
    gate_up = (torch.randn(2 * i, h, generator=g) / h ** 0.5).bfloat16().cuda()
    down = (torch.randn(h, i, generator=g) / i ** 0.5).bfloat16().cuda()
    p = ops.pack_mlp(gate_up, down)
    x = torch.randn(70, h, generator=g).bfloat16().cuda()
    alone = {r: ops.swiglu_dense(x[r:r + 1], p, split=split)[0] for r in (0, 9, 40, 69)}
    for rows in (1, 8, 33, 70):
        out = ops.swiglu_dense(x[:rows], p, split=split)
        gt, up = (x[:rows].float() @ gate_up.float().t()).chunk(2, dim=-1)
        ref = (F.silu(gt) * up) @ down.float().t()
        err = _rel(out, ref)
        assert err < 4 * TOL, f"rows {rows}: rel err {err:.2e}"  # gate, up and h rounded to bf16 on the way
        for r, a in alone.items():
            if r < rows:
                assert torch.equal(out[r], a), f"rows {rows}: row {r} differs from it alone"


@gpu
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_gpu_swiglu_dense_limit(rows):
    """swiglu_dense with GLM-5.3-Flash's swiglu_limit on the GPU: the kernel's epilogue clamps gate and up as the
    CPU form does (within the same bound as without; inputs scaled so that about a third of them pass the limit,
    where the unclamped MLP is far off), a row's bits independent of the others."""
    g = torch.Generator().manual_seed(10 + rows)
    h, i, limit = 1024, 512, 0.5
    gate_up = (torch.randn(2 * i, h, generator=g) / h ** 0.5).bfloat16().cuda()
    down = (torch.randn(h, i, generator=g) / i ** 0.5).bfloat16().cuda()
    x = torch.randn(rows, h, generator=g).bfloat16().cuda()
    p = ops.pack_mlp(gate_up, down)
    out = ops.swiglu_dense(x, p, limit=limit)
    gt, up = (x.float() @ gate_up.float().t()).chunk(2, dim=-1)
    assert 0.2 < float((up.abs() > limit).float().mean()) < 0.8
    ref = (F.silu(gt.clamp(max=limit)) * up.clamp(-limit, limit)) @ down.float().t()
    assert _rel(out, ref) < 4 * TOL, _rel(out, ref)
    assert _rel(ops.swiglu_dense(x, p), ref) > 0.1
    assert torch.equal(ops.swiglu_dense(x[-1:], p, limit=limit)[0], out[-1])


@gpu
def test_gpu_stack_split_default_by_shape():
    """split 0 (the default): 8 K slices for outputs under 8192 features, 4 from there (bit for bit the explicit
    values); another split is another sum order (close, and here not the same bits); a value the kernel does not take
    is one error."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1024, generator=g).bfloat16().cuda()
    for n, default in ((4096, "8"), (8192, "4")):
        packs = ops.pack_linear([(torch.randn(n, 1024, generator=g) / 32).bfloat16().cuda()], [None])
        out = {}
        for split in (0, 8, 4):
            out[split] = ops.linear(x, packs, split=split)[0]
        other = 4 if default == "8" else 8
        assert torch.equal(out[0], out[int(default)]), n
        assert not torch.equal(out[0], out[other]) and _rel(out[other], out[0]) < TOL, n
    with pytest.raises(RuntimeError, match="split 3"):
        ops.linear(x, packs, split=3)


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
    packs, mlp = ops.pack_linear([w]), ops.pack_mlp(gate_up, down)
    got = ops.linear(x, packs, residual=(b,))[0]
    assert torch.equal(got.view(torch.int16), (b + ops.linear(x, packs)[0]).view(torch.int16))
    got = ops.swiglu_dense(x, mlp, residual=(a, b))
    assert torch.equal(got.view(torch.int16), (b + (a + ops.swiglu_dense(x, mlp))).view(torch.int16))


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
    assert calls["linear"] == 3 * (2 * 3 + 1) and calls["swiglu_dense"] == 3 * 3, calls  # + lm_head per forward


@gpu
@pytest.mark.parametrize("ckpt_name", ["dsa_ckpt", "glm5_ckpt"])
def test_gpu_packed_stack_glm5_families_close(ckpt_name, request, monkeypatch):
    """GLM-5 and GLM-5.3-Flash tiny stacks on the GPU, cuBLAS vs the packed kernels (counted: they ran), through
    prefill, host decode and the fixed-shape step (its RMSNorms in ops.rms_norm in both): logits within the
    oracle's bound."""
    from rocket_mpi.model.layers import move_stack
    reader = CheckpointReader(request.getfixturevalue(ckpt_name))
    ref_model, model = (model_class(reader.config.model_type).load(reader) for _ in range(2))
    move_stack(ref_model, "cuda")
    move_stack(model, "cuda")
    model.pack_stack()
    ref = _family_logits(ref_model, "cuda")
    calls = _count_calls(monkeypatch)
    out = _family_logits(model, "cuda")
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < 0.02, f"packed stack logits rel err {err:.2e} against cuBLAS"
    assert calls["linear"] > 0 and calls["swiglu_dense"] > 0, calls


@gpu
@pytest.mark.parametrize("split", [0, 1, 2, 4])   # K slices per feature group (0: by the output's width)
@pytest.mark.parametrize("n,k,bias", [((96, 32, 32), 96, True), ((4096,), 1408, False), ((1024, 1024), 4096, True),
                                      ((48,), 80, True)])
def test_gpu_nvfp4_linear_matches_reference_and_rows_are_independent(n, k, bias, split):
    """NVFP4 linears held as stored (W4A16, each part its own weight_scale_2) against dequantise + fp32 matmul at
    decode sizes and prefill-sized launches (several weight passes); each row bitwise what it is alone; with one
    part, the residual in the epilogue is torch's add; unpack_linear (the prefill's weights) is the CPU's bit for
    bit."""
    g = torch.Generator().manual_seed(sum(n) + k)
    parts = [_quant(m, k, g) for m in n]
    bs = [torch.randn(m, generator=g).bfloat16().cuda() if bias else None for m in n]
    packs = ops.pack_linear(parts, bs, device="cuda")
    assert all(p.nvfp4 for p in packs)
    x = torch.randn(70, k, generator=g).bfloat16().cuda()
    alone = [ops.linear(x[r:r + 1], packs, split=split) for r in range(0, 70, 9)]
    for rows in (1, 3, 8, 16, 33, 70):
        outs = ops.linear(x[:rows], packs, split=split)
        for j, (o, q, b) in enumerate(zip(outs, parts, bs)):
            assert o.shape == (rows, q[0].shape[0]) and o.is_contiguous()
            err = _rel(o, _lin_ref(x[:rows], _dq(q, torch.float32).cuda(), b))
            assert err < TOL, f"rows {rows}, part {j}: rel err {err:.2e}"
            for a, r in zip(alone, range(0, 70, 9)):
                if r < rows:
                    assert torch.equal(o[r], a[j][0]), f"rows {rows}, part {j}: row {r} differs from it alone"
    cpu = [w for p in ops.pack_linear(parts, [None] * len(n)) for w in ops.unpack_linear(p)]
    assert all(torch.equal(w.cpu(), c) for w, c in zip((w for p in packs for w in ops.unpack_linear(p)), cpu))
    if len(n) == 1:
        r = torch.randn(8, n[0], generator=g).bfloat16().cuda()
        got = ops.linear(x[:8], packs, residual=(r,), split=split)[0]
        assert torch.equal(got.view(torch.int16), (r + ops.linear(x[:8], packs, split=split)[0]).view(torch.int16))


@gpu
@pytest.mark.parametrize("split", [0, 2])
@pytest.mark.parametrize("h,i", [(64, 48), (4096, 1408)])
def test_gpu_nvfp4_swiglu_dense_matches_reference_and_rows_are_independent(h, i, split):
    """A SwiGLU MLP held as stored (one NVFP4 expert over dense rows, down's weight_scale_2 in its epilogue) against
    dequantise + fp32, rows bitwise as alone, residuals as torch's adds, swiglu_limit's clamp; unpack_mlp is the
    CPU's bit for bit."""
    g = torch.Generator().manual_seed(h + i)
    gate, up, down = _quant(i, h, g), _quant(i, h, g), _quant(h, i, g)
    p = ops.pack_mlp((gate, up), down, device="cuda")
    gu = torch.cat((_dq(gate, torch.float32), _dq(up, torch.float32))).cuda()
    dn = _dq(down, torch.float32).cuda()
    x = torch.randn(70, h, generator=g).bfloat16().cuda()
    alone = {r: ops.swiglu_dense(x[r:r + 1], p, split=split)[0] for r in (0, 9, 40, 69)}
    for rows in (1, 3, 8, 16, 33, 70):
        out = ops.swiglu_dense(x[:rows], p, split=split)
        gt, u = (x[:rows].float() @ gu.t()).chunk(2, dim=-1)
        err = _rel(out, (F.silu(gt) * u) @ dn.t())
        assert err < 4 * TOL, f"rows {rows}: rel err {err:.2e}"
        for r, a in alone.items():
            if r < rows:
                assert torch.equal(out[r], a), f"rows {rows}: row {r} differs from it alone"
    a, b = (torch.randn(8, h, generator=g).bfloat16().cuda() for _ in range(2))
    got = ops.swiglu_dense(x[:8], p, residual=(a, b), split=split)
    assert torch.equal(got.view(torch.int16), (b + (a + ops.swiglu_dense(x[:8], p, split=split))).view(torch.int16))
    xl = x[:8] * 8
    gt, u = (xl.float() @ gu.t()).chunk(2, dim=-1)
    ref = (F.silu(gt.clamp(max=0.5)) * u.clamp(-0.5, 0.5)) @ dn.t()
    assert _rel(ops.swiglu_dense(xl, p, limit=0.5, split=split), ref) < 4 * TOL
    want = ops.unpack_mlp(ops.pack_mlp((gate, up), down))
    assert all(torch.equal(w.cpu(), c) for w, c in zip(ops.unpack_mlp(p), want))


@gpu
@pytest.mark.parametrize("preset", ["tiny", "dsa-tiny", "glm5-tiny"])
def test_gpu_nvfp4_stack_held_as_stored(preset, all_ckpts, monkeypatch):
    """An `:nvfp4-all` model moved to the GPU holds its NVFP4 stack weights as stored (dense fields released, nbytes
    the packed bytes), its decode steps in the NVFP4 kernels (counted) and a 20-row prefill dequantising on the fly:
    logits within the oracle's bound of the CPU model's; a move back to the CPU rebuilds the loader's weights, so
    its logits are the CPU model's bit for bit."""
    reader = CheckpointReader(all_ckpts[preset])
    ref_model, model = (model_class(reader.config.model_type).load(reader) for _ in range(2))
    ref, ref_long, cpu_bytes = _family_logits(ref_model), _long_logits(ref_model), ref_model.nbytes()
    model.to("cuda")
    attn = _attention(model)
    assert attn.stored and all(getattr(attn, k) is None for k in attn.stored)
    assert model.nbytes() < cpu_bytes
    calls = _count_calls(monkeypatch)
    out, out_long = _family_logits(model, "cuda").cpu(), _long_logits(model, "cuda").cpu()
    assert calls["linear"] > 0 and calls["swiglu_dense"] > 0, calls
    for o, r in ((out, ref), (out_long, ref_long)):
        err = float((o - r).abs().max() / r.abs().max())
        assert err < 0.02, f"NVFP4 stack logits rel err {err:.2e} against the CPU's"
    monkeypatch.undo()
    model.to("cpu")
    assert torch.equal(_family_logits(model), ref) and model.nbytes() == cpu_bytes


@gpu
@pytest.mark.parametrize("preset,head", [("tiny", True), ("dsa-tiny", True), ("glm5-tiny", False)])
def test_gpu_loading_for_cuda_is_the_full_load_packed(preset, head, all_ckpts, tmp_path):
    """A model loaded for the GPU (layers.loading_for("cuda"), as the Engine loads) and moved there is the model a
    full CPU load moved to the GPU gives: the same bytes held, logits bit for bit on the decode steps and a 20-row
    prefill."""
    from rocket_mpi.model import layers
    reader = _all_or_head_reader(preset, head, all_ckpts, tmp_path)
    cls = model_class(reader.config.model_type)
    full = cls.load(reader)
    full.to("cuda")
    with layers.loading_for("cuda"):
        lazy = cls.load(reader)
    assert (lazy.lm_head is None) == head
    lazy.to("cuda")
    assert lazy.nbytes() == full.nbytes()
    assert torch.equal(_family_logits(lazy, "cuda"), _family_logits(full, "cuda"))
    assert torch.equal(_long_logits(lazy, "cuda"), _long_logits(full, "cuda"))
