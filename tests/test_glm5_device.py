"""GLM-5 (glm_moe_dsa) and GLM-5.3-Flash (glm5_next) models off the CPU: `to(device)` moves every weight,
the cache and every tensor forward creates follow the weights, and moving changes no bit.

Without a GPU the device-following is checked on torch's 'meta' device, which has shapes but no data:
an op that mixes a meta tensor with one created on the host raises, so a forward that runs end to end
on meta created nothing on the wrong device. Meta cannot answer data-dependent questions; the one the
MLA layers ask (`nonzero`, which latents a query attends) is answered as "all of them".
The CUDA tests skip, saying why, where there is no CUDA device.
"""
import ast
import copy
import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rocket_mpi.checkpoint.make import make_checkpoint
from rocket_mpi.runtime.engine import Engine
from rocket_mpi.runtime.prompts import default_prompts

PRESETS = ["dsa-tiny", "glm5-tiny"]
MODEL_FILES = ["glm_moe_dsa.py", "glm5_next.py", "glm5_next_hc.py", "glm5_next_kda.py", "glm5_next_mla.py"]
CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device here (torch " + torch.__version__ + "): GPU part skipped"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for preset in PRESETS:
        d = str(tmp_path_factory.mktemp(preset))
        make_checkpoint(preset, d, seed=11)
        out[preset] = d
    return out


def tensors_of(obj, path="model", seen=None):
    """(path, tensor) of every tensor reachable from a model: attributes, layers, weights dataclasses."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            yield from tensors_of(x, f"{path}[{i}]", seen)
    elif isinstance(obj, dict):
        for k, x in obj.items():
            yield from tensors_of(x, f"{path}[{k!r}]", seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("rocket_mpi"):
        for k, x in vars(obj).items():
            yield from tensors_of(x, f"{path}.{k}", seen)


def decode(engine, m=8, tokens=12):
    logits = []
    res = engine.generate(default_prompts(m, engine.cfg.vocab_size, seed=5), tokens,
                          on_step=lambda step, lg: logits.append(lg.clone()))
    return res.tokens, torch.stack(logits)


@pytest.mark.parametrize("preset", PRESETS)
def test_to_moves_every_weight_and_the_cache_follows(preset, ckpts):
    model = copy.deepcopy(Engine(ckpts[preset]).model)
    model.lm_head = model.embed                      # tied embeddings must stay one tensor
    assert model.to("meta") is model
    left = [p for p, t in tensors_of(model) if not t.is_meta]
    assert not left, f"to('meta') left these on the host: {left}"
    assert model.lm_head is model.embed
    cache = model.new_cache(3, 16)
    held = {p: t for p, t in tensors_of(cache, "cache") if p != "cache.lengths"}
    assert held and all(t.is_meta for t in held.values()), [p for p, t in held.items() if not t.is_meta]
    assert not cache.lengths.is_meta, "lengths are host bookkeeping: .tolist() every step"


class MetaNonzero(TorchFunctionMode):
    """On meta, `nonzero` cannot know its output size: answer as if every entry were set."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.nonzero, torch.Tensor.nonzero) and args[0].is_meta:
            x = args[0]
            return torch.empty(x.numel(), x.dim(), dtype=torch.long, device="meta")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("preset", PRESETS)
def test_forward_on_meta_creates_nothing_on_the_host(preset, ckpts):
    """Prefill (streams of different lengths, past index_topk) and decode steps with weights and cache on
    meta: any tensor forward made on the host would meet a meta one and raise."""
    model = copy.deepcopy(Engine(ckpts[preset]).model).to("meta")
    prompts = [list(range(2, 2 + n)) for n in (3, 17, 9)]
    cache = model.new_cache(len(prompts), 40)
    tokens, seqlens = torch.tensor([t for p in prompts for t in p]), [len(p) for p in prompts]
    with torch.inference_mode(), MetaNonzero():
        for _ in range(4):
            logits = model.forward(tokens, cache, seqlens, lambda i, x, L: torch.zeros_like(x))
            assert logits.is_meta and logits.shape == (len(prompts), model.cfg.vocab_size)
            tokens, seqlens = torch.tensor([5, 6, 7]), [1, 1, 1]
    assert cache.lengths.tolist() == [len(p) + 3 for p in prompts]


@pytest.mark.parametrize("preset", PRESETS)
def test_to_cpu_is_bitwise_identical(preset, ckpts):
    ref = decode(Engine(ckpts[preset]))
    eng = Engine(ckpts[preset])
    before = {p: t for p, t in tensors_of(eng.model)}
    assert eng.model.to(torch.device("cpu")) is eng.model
    assert all(t is before[p] for p, t in tensors_of(eng.model)), "to(cpu) on CPU weights must not copy"
    tokens, logits = decode(eng)
    assert tokens == ref[0] and torch.equal(logits, ref[1])


def test_no_factory_call_without_a_device():
    """Every torch.arange/zeros/ones/empty/full/tensor/rand* in the model files names its device, moves
    the result (`.to(dev)`), or is marked `# host` (cache lengths, stream offsets: Python bookkeeping)."""
    factories = {"arange", "zeros", "ones", "empty", "full", "tensor", "rand", "randn", "randint"}
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rocket_mpi", "model")
    bad = []
    for name in MODEL_FILES:
        with open(os.path.join(root, name)) as f:
            src = f.read()
        lines = src.splitlines()
        for node in ast.walk(ast.parse(src)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in factories and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch"):
                continue
            if any(k.arg == "device" for k in node.keywords):
                continue
            line = lines[node.lineno - 1]
            if "# host" in line or ".to(dev" in line:
                continue
            bad.append(f"{name}:{node.lineno}: {line.strip()}")
    assert not bad, "tensors created without a device:\n" + "\n".join(bad)


# -- on a GPU -------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_cuda_decode_follows_the_weights(preset, ckpts):
    if not CUDA:
        print(NO_CUDA)
        pytest.skip(NO_CUDA)
    ref_tokens, ref_logits = decode(Engine(ckpts[preset]))
    eng = Engine(ckpts[preset], device="cuda")
    assert all(t.is_cuda for _, t in tensors_of(eng.model))
    cache = eng.model.new_cache(2, 8)
    assert all(t.is_cuda for p, t in tensors_of(cache, "cache") if p != "cache.lengths")
    tokens, logits = decode(eng)
    assert logits.is_cuda
    # other kernels, other BF16 rounding: close, not equal (parity holds within one device kind). Each
    # stream is compared while it has decoded the CPU's tokens so far (a near-tie may flip one).
    for s, (ours, ref) in enumerate(zip(tokens, ref_tokens)):
        same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
        for step in range(min(same + 1, len(ref))):
            r, o = ref_logits[step, s], logits[step, s].cpu()
            err = (o - r).abs().max().item()
            assert err <= 0.05 + 0.05 * r.abs().max().item(), f"stream {s} step {step}: CUDA logits {err:.4f} " \
                "away from the CPU ones"


@pytest.mark.parametrize("preset", PRESETS)
def test_cuda_round_trip_is_bitwise(preset, ckpts):
    if not CUDA:
        print(NO_CUDA)
        pytest.skip(NO_CUDA)
    ref = decode(Engine(ckpts[preset]))
    eng = Engine(ckpts[preset])
    eng.model.to("cuda").to("cpu")
    assert all(not t.is_cuda for _, t in tensors_of(eng.model))
    tokens, logits = decode(eng)
    assert tokens == ref[0] and torch.equal(logits, ref[1])


def test_dsa_decode_within_topk_skips_the_scores(ckpts):
    """GLM-5: a decode step whose span fits index_topk takes every position <= pos without scoring them; that is
    the scored top-k's choice (the same rows; the attention within bf16 rounding: the rows' order differs)."""
    model = Engine(ckpts["dsa-tiny"]).model
    i = next(j for j, L in enumerate(model.layers) if L.attn.indexer is not None)
    a, m, span = model.layers[i].attn, 3, model.index_topk
    gen = torch.Generator().manual_seed(2)
    cache = model.new_cache(m, span)
    cache.kv[i].copy_(torch.randn(cache.kv[i].shape, generator=gen).to(torch.bfloat16))
    cache.index_k[i].copy_(torch.randn(cache.index_k[i].shape, generator=gen).to(torch.bfloat16))
    pos = torch.tensor([2, 5, span - 1])
    width = cache.kv[i].shape[-1]
    q_cat = torch.randn(m, model.heads, width, generator=gen).to(torch.bfloat16)
    kv_new = torch.randn(m, width, generator=gen).to(torch.bfloat16)
    ik = torch.randn(m, model.index_dim, generator=gen).to(torch.bfloat16)
    iq = torch.randn(m, model.index_heads, model.index_dim, generator=gen).to(torch.bfloat16)
    iw = torch.rand(m, model.index_heads, generator=gen)
    every, (sel_e, val_e) = model._decode_attention(i, a, q_cat, kv_new, ik, None, None, cache, pos, span, None)
    scored, (sel_s, val_s) = model._decode_attention(i, a, q_cat, kv_new, ik, iq, iw, cache, pos, span, None)
    for s in range(m):
        want = set(range(int(pos[s]) + 1))
        assert set(sel_e[s][val_e[s]].tolist()) == want == set(sel_s[s][val_s[s]].tolist())
    torch.testing.assert_close(every.float(), scored.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tail", [True, False])
def test_glm5_next_selection_within_topk_skips_the_scores(tail):
    """GLM-5.3-Flash: while the span holds at most index_topk // kpool pools the top-k takes every complete pool,
    so mla_decode answers without scores (_chosen_all): the positions the scored picks (_pick, _pool_cols) would
    gather, on any scores."""
    from rocket_mpi.model.glm5_next_mla import MlaArgs, _chosen_all, _pick, _pool_cols
    a = MlaArgs(4, 16, 16, 32, 1e-6, 3, 8, 16, 4, tail)
    gen = torch.Generator().manual_seed(4)
    span, m = 17, 5                                       # 4 pools <= 16 // 4, and an incomplete one
    pos = torch.tensor([0, 3, 6, 15, 16])
    pools = span // a.kpool
    q = torch.randn(m, a.index_heads, a.index_dim, generator=gen).to(torch.bfloat16)
    w = torch.rand(m, a.index_heads, generator=gen)
    keys_t = torch.randn(m, a.index_dim, pools, generator=gen).to(torch.bfloat16)
    cols, valid = _pool_cols(*_pick(q, w, keys_t, pos, pools, a), pos, a)
    picked = torch.zeros(m, span, dtype=torch.bool)
    picked[torch.arange(m)[:, None].expand_as(cols)[valid], cols[valid]] = True
    assert torch.equal(_chosen_all(pos, span, a), picked)
