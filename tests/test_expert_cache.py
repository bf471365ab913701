"""The expert cache (rocket_mpi/moe/cache.py): a bounded number of each layer's experts in device memory, the rest
read from the checkpoint (CPU) or from far slots in host memory (GPU). Tokens are bitwise those of the all-resident
run for every budget, on the host and fixed-shape paths, alone and split; the accounting adds up; the policy comes
close to Belady's optimum on skewed routing."""
import json

import numpy as np
import pytest
import torch

from conftest import rocket
from helpers import gpu, make_experts, segments_for
from rocket_mpi import ops
from rocket_mpi.checkpoint import specs
from rocket_mpi.checkpoint.make import make_checkpoint
from rocket_mpi.errors import RocketError
from rocket_mpi.ops import nvfp4, pack
from rocket_mpi.moe.cache import (GIB, ExpertCache, Policy, expert_bytes, first_resident, parse_budget, plan_capacity,
                                  warm_upkeep)
from rocket_mpi.runtime.engine import Engine

TOKENS = 10


@pytest.fixture(scope="module")
def skewed_ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("skewed"))
    make_checkpoint("tiny", d, seed=5, skew=1.5)
    return d


def decode(ckpt, budget, path="host", m=4, tokens=TOKENS):
    eng = Engine(ckpt, expert_cache=budget)
    eng.set_decode_path(path, "local")
    prompts = [[(7 * s + 3 * i) % eng.cfg.vocab_size for i in range(3 + s)] for s in range(m)]
    return eng, eng.generate(prompts, tokens)


def per_expert(ckpt) -> int:
    eng = Engine(ckpt)
    return expert_bytes(eng.cfg.hidden_size, eng.cfg.moe_intermediate_size, False, packed=False)


@pytest.mark.parametrize("path", ["host", "device"])
def test_tokens_identical_for_every_budget(skewed_ckpt, path):
    """0 experts resident, a few, and all: the same tokens; the bounded runs really missed and swapped."""
    ref_eng, ref = decode(skewed_ckpt, None, path)
    assert ref_eng.expert_cache is None  # all fit: no cache, as before
    n_layers = len(ref_eng.cfg.moe_layers)
    bpe = per_expert(skewed_ckpt)
    for resident in (0, 2, 5):
        eng, res = decode(skewed_ckpt, resident * n_layers * bpe / GIB + 1e-9, path)
        assert res.tokens == ref.tokens, f"{resident} experts per layer resident, {path} path"
        st = res.expert_cache
        assert st["resident_experts"] == resident * n_layers, st
        if resident == 0:
            assert st["hit_rows"] == 0 < st["miss_rows"], st
        else:
            assert st["hit_rows"] > 0 and st["swaps"] > 0, st
        if resident == 2:
            assert st["miss_rows"] > 0, st


def test_cold_cache_upkeeps_early_on_the_fixed_shape_path(skewed_ckpt, monkeypatch):
    """The fixed-shape path keeps its cache every MAINTAIN_EVERY steps, and while it is cold also after 1, 2 and 4
    decode steps (warm_upkeep): each upkeep sees the steps since the last, none is lost, the tokens stay the
    all-resident run's."""
    from rocket_mpi.runtime.engine import MAINTAIN_EVERY
    assert [d for d in range(20) if warm_upkeep(d, 8)] == [1, 2, 4]
    assert not any(warm_upkeep(d, 1) for d in range(20))
    seen = []
    real = ExpertCache.maintain

    def record(self, steps, account=True, promote=True):
        seen.append((steps, account, promote))
        return real(self, steps, account, promote)
    monkeypatch.setattr(ExpertCache, "maintain", record)
    _, ref = decode(skewed_ckpt, None, "device", tokens=20)
    n_layers = len(Engine(skewed_ckpt).cfg.moe_layers)
    _, res = decode(skewed_ckpt, 2 * n_layers * per_expert(skewed_ckpt) / GIB + 1e-9, "device", tokens=20)
    assert res.tokens == ref.tokens and res.path == "device"
    assert MAINTAIN_EVERY == 8
    # the prefill's (host path, not accounted), then after decode steps 1, 2, 4, 7 and 15, and the run's last 4
    assert seen == [(1, False, True), (1, True, True), (1, True, True), (2, True, True), (3, True, True),
                    (8, True, True), (4, True, False)], seen
    assert res.expert_cache["steps"] == 19


def test_accounting_adds_up(skewed_ckpt):
    """hit + miss rows = the rows routed to this rank's experts over the decode steps; reads <= rows."""
    bpe = per_expert(skewed_ckpt)
    eng, res = decode(skewed_ckpt, 3 * 3 * bpe / GIB + 1e-9, tokens=12)
    st = res.expert_cache
    decode_rows = sum(s.rows_owned for s in res.steps[1:])
    assert st["hit_rows"] + st["miss_rows"] == decode_rows > 0
    assert st["hit_reads"] + st["miss_reads"] <= decode_rows
    assert st["steps"] == len(res.steps) - 1
    assert st["far_bytes_per_step"] * st["steps"] == pytest.approx(st["miss_reads"] * bpe)


@pytest.mark.parametrize("path", ["host", "device"])
def test_cache_started_from_a_trace(skewed_ckpt, path):
    """--expert-cache-from: each layer starts with the trace's most fired experts resident and the policy's scores
    at their rates; on the prompts the trace was recorded on, the run misses less than a cold start from the lowest
    ids, and the tokens stay the all-resident run's."""
    from rocket_mpi.runtime.telemetry import firing_shares
    rec = Engine(skewed_ckpt, telemetry=True)   # every expert resident: records the routing only
    rec.set_decode_path("host", "local")
    prompts = [[(7 * s + 3 * i) % rec.cfg.vocab_size for i in range(3 + s)] for s in range(4)]
    ref = rec.generate(prompts, TOKENS)
    layers = list(rec.cfg.moe_layers)
    shares = firing_shares(rec.expert_cache.trace_array(), layers)
    assert all(shares[la].shape == (rec.cfg.n_routed_experts,) and shares[la].max() <= 1.0 for la in layers)
    budget = 2 * len(layers) * per_expert(skewed_ckpt) / GIB + 1e-9
    runs = {}
    for name, start in (("cold", None), ("warm", shares)):
        eng = Engine(skewed_ckpt, expert_cache=budget, cache_from=start)
        eng.set_decode_path(path, "local")
        for la in layers:
            want = first_resident(eng.experts[la].owned, 2, None if start is None else start[la])
            assert eng.experts[la].resident() == want, (name, la)
            if start is not None:
                pol = eng.expert_cache.policies[la]
                assert np.allclose(pol.scores, start[la][pol.ids] / (1 - pol.decay))
        runs[name] = eng.generate(prompts, TOKENS)
        assert runs[name].tokens == ref.tokens, name
    cold, warm = runs["cold"].expert_cache, runs["warm"].expert_cache
    assert warm["hit_rows"] + warm["miss_rows"] == cold["hit_rows"] + cold["miss_rows"]
    assert warm["miss_rows"] < cold["miss_rows"], (cold, warm)


def test_expert_cache_from_on_the_command_line(skewed_ckpt, tmp_path):
    """decode --telemetry, then decode --expert-cache-from that file: it says so and the report's JSON keeps it.
    (A bad trace: tests/test_bad_input.py.)"""
    trace = str(tmp_path / "trace.npz")
    r = rocket("decode", "--checkpoint", skewed_ckpt, "--streams", "2", "--tokens", "6", "--telemetry", trace)
    assert r.returncode == 0, r.stderr
    out = str(tmp_path / "run.json")
    r = rocket("decode", "--checkpoint", skewed_ckpt, "--streams", "2", "--tokens", "6", "--expert-cache", "0.00005",
               "--expert-cache-from", trace, "--out", out)
    assert r.returncode == 0, r.stderr
    assert f"expert cache: started from {trace}" in r.stderr, r.stderr
    doc = json.loads(open(out).read())
    assert doc["load"][0]["expert_cache_from"] == trace, doc["load"]


def test_skew_makes_hot_experts(tmp_path):
    """--skew: a few experts take most of the rows; skew 0 draws the biases as before (same bits)."""
    flat = specs.make_tensor(0, "model.layers.1.mlp.gate.e_score_correction_bias", (64,), "bias")
    assert torch.equal(flat, specs.router_bias(0, "model.layers.1.mlp.gate.e_score_correction_bias", (64,)))
    hot = specs.router_bias(0, "model.layers.1.mlp.gate.e_score_correction_bias", (64,), 1.5)
    assert float(hot.max() - hot.min()) > 1.0 > float(flat.max() - flat.min())
    d = str(tmp_path / "sk")
    make_checkpoint("tiny", d, seed=5, skew=1.5)
    _, res = decode(d, None, tokens=6)
    eng = Engine(d, telemetry=True)
    r = eng.generate([[1, 2, 3]] * 8, 6)
    rows = eng.expert_cache.trace_array().sum(axis=(0, 1))   # [E] over steps and layers
    top = np.sort(rows)[::-1]
    assert top[:4].sum() > 0.4 * rows.sum(), rows  # 4 of 16 experts take more than 40 % of the rows
    assert r.tokens[0] == r.tokens[1]


def test_policy_keeps_the_hot_experts():
    pol = Policy(list(range(8)), 2, [0, 1], promotions=8)
    active = np.zeros(8)
    active[[5, 6]] = 1
    for _ in range(3):
        pol.observe(active)
        pol.swaps()
    assert pol.resident == {5, 6}
    assert first_resident([3, 1, 2], 2) == [1, 2]
    assert first_resident([0, 1, 2], 1, prior=np.array([0.0, 0.5, 0.1])) == [1]


def test_policy_near_belady_on_a_skewed_trace(skewed_ckpt):
    """benchmarks/bench_cache.py's replay: ours within 90 % of Belady's hit rate at 25 % and 50 % resident."""
    import importlib.util
    import os
    spec = importlib.util.spec_from_file_location("bench_cache", os.path.join(os.path.dirname(__file__), "..",
                                                                              "benchmarks", "bench_cache.py"))
    bc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bc)
    eng = Engine(skewed_ckpt, telemetry=True)
    eng.generate([[(5 * s + i) % eng.cfg.vocab_size for i in range(4)] for s in range(8)], 40)
    trace = eng.expert_cache.trace_array()
    owned = list(range(eng.cfg.n_routed_experts))
    for frac in (0.25, 0.5):
        cap = int(frac * len(owned))
        ours = bel = reads = 0
        for i in range(trace.shape[1]):
            reqs = bc.requests(trace[:, i], owned)
            h, r, _ = bc.replay_ours(reqs, owned, cap)
            b, r2, _ = bc.replay_belady(reqs, owned, cap)
            assert r == r2
            ours, bel, reads = ours + h, bel + b, reads + r
        assert ours <= bel and ours >= 0.9 * bel, (frac, ours, bel, reads)
    # started from the trace's first half, the second half's first 8 steps hit more than from a cold start
    from rocket_mpi.runtime.telemetry import firing_shares
    half = trace.shape[0] // 2
    shares = firing_shares(trace[:half], list(range(trace.shape[1])))
    cap = len(owned) // 4
    cold = warm = 0
    for i in range(trace.shape[1]):
        reqs = bc.requests(trace[half:half + 8, i], owned)
        cold += bc.replay_ours(reqs, owned, cap, 8, warm=True)[0]
        warm += bc.replay_ours(reqs, owned, cap, 8, warm=True, start=shares[i])[0]
    assert warm > cold, (warm, cold)


def test_plan_capacity_and_its_errors():
    owned = {1: list(range(8)), 2: list(range(8))}
    p = plan_capacity(owned, 100, None, 10_000, 0, False, 0, "host memory")
    assert p.capacity == 8 and "every expert fits" in p.reason
    p = plan_capacity(owned, 100, None, 850, 0, False, 0, "host memory")
    assert p.capacity == 4 and p.resident_bytes == 800
    assert plan_capacity(owned, 100, 0.0, 10_000, 0, False, 0, "x").capacity == 0
    with pytest.raises(RocketError, match=r"rank 1: --expert-cache 1 GiB does not fit on GPU 0"):
        plan_capacity(owned, GIB, 1.0, GIB // 2, 100 * GIB, True, 1, "GPU 0")
    with pytest.raises(RocketError, match=r"rank 0: out of host memory for the expert cache.*not even one far slot"):
        plan_capacity(owned, GIB, 0.0, 100 * GIB, GIB, True, 0, "GPU 0")
    # host memory short: the far slots that fit (2 per layer), the other far experts in the checkpoint files
    p = plan_capacity(owned, GIB, 0.0, 100 * GIB, 4 * GIB + 1, True, 0, "GPU 0")
    assert p.far_slots == 2 and "2 far slots per layer" in p.reason and p.as_dict()["far_slots_per_layer"] == 2
    assert plan_capacity(owned, GIB, 0.0, 100 * GIB, 16 * GIB, True, 0, "GPU 0").far_slots is None
    with pytest.raises(RocketError, match=r"rank 0: out of host memory.*live rebalancing keeps every expert in a slot"):
        plan_capacity(owned, GIB, 0.0, 100 * GIB, 4 * GIB, True, 0, "GPU 0", slots=8)
    for bad in ("-1", "nan", "inf", "lots"):
        with pytest.raises(RocketError, match="--expert-cache"):
            parse_budget(bad)
    assert parse_budget("auto") is None and parse_budget("2.5") == 2.5


def test_bad_flag_is_one_line(tiny_ckpt):
    r = rocket("decode", "--checkpoint", tiny_ckpt, "--expert-cache", "-3")
    assert r.returncode == 2 and "--expert-cache" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("ranks,fabric,path,start", [(2, "shm", "host", False), (3, "mpi", "device", True)])
def test_static_fire_with_a_cache(ranks, fabric, path, start, skewed_ckpt, tmp_path):
    """The reference and the split each with a cache of a few experts per layer (3 ranks: started from a recorded
    trace, passed on to both sides): PASS, and the split's JSON carries each rank's accounting."""
    extra = []
    if start:
        trace = str(tmp_path / "trace.npz")
        r = rocket("decode", "--checkpoint", skewed_ckpt, "--streams", "4", "--tokens", "6", "--telemetry", trace)
        assert r.returncode == 0, r.stderr
        extra = ["--expert-cache-from", trace]
    r = rocket("static-fire", "--checkpoint", skewed_ckpt, "--ranks", str(ranks), "--sweep", "1,4", "--tokens", "6",
               "--fabric", fabric, "--fabric-timeout", "20", "--decode-path", path, "--expert-cache", "0.00005",
               "--workdir", str(tmp_path), *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    if start:  # both sides started from it
        for side in ("reference", "split"):
            doc = json.loads((tmp_path / f"{side}.json").read_text())
            assert all(ld["expert_cache_from"] == trace for ld in doc["load"]), (side, doc["load"])
    assert "STATIC FIRE PASS: 0/4 streams mismatched" in r.stdout, r.stdout
    assert r.stdout.count("expert cache: rank resident GiB") == 2, r.stdout  # the split's report, M=1 and M=4
    doc = json.loads((tmp_path / "split.json").read_text())
    stats = [pr["expert_cache"] for pr in doc["runs"][-1]["per_rank"]]
    assert len(stats) == ranks and sum(s["miss_rows"] for s in stats) > 0, stats


# -- GPU: far slots in host memory, read by the kernel in place --------------------------------------------------

@gpu
@pytest.mark.parametrize("bf16", [False, True])
def test_far_slots_bitwise(bf16):
    """The kernel over experts split between device and far (host) slots, and after swaps, gives the bits of the
    all-device pack."""
    h, i, ids = 256, 128, list(range(6))
    ex = make_experts(ids, h, i, seed=4)
    dev = torch.device("cuda")
    if bf16:
        dense = {e: tuple(nvfp4.dequantize(w, s, torch.tensor(s2), torch.bfloat16) for w, s, s2 in parts)
                 for e, parts in ex.items()}
        full = ops.pack_experts_bf16(dense, h, i, device=dev)
        packer = ops.ExpertPacker(ids, h, i, bf16=True, device=dev, resident=[1, 4])
        for e in ids:
            packer.add(e, *dense[e])
    else:
        full = ops.pack_experts(ex, h, i, device=dev)
        packer = ops.ExpertPacker(ids, h, i, bf16=False, device=dev, resident=[1, 4])
        for e in ids:
            packer.add(e, *ex[e])
    split = packer.done()
    assert split.near == 2 and split.far is not None and split.far_bytes > 0
    counts = {0: 3, 1: 9, 2: 1, 4: 17, 5: 40}
    x = torch.randn(sum(counts.values()), h, device=dev).to(torch.bfloat16)
    segs = segments_for(counts)
    want = ops.nvfp4_experts(x, segs, full)
    assert torch.equal(ops.nvfp4_experts(x, segs, split), want)
    split.swap(0, 1)
    split.swap(5, 4)
    torch.cuda.synchronize()
    assert split.resident() == [0, 5] or sorted(split.resident()) == [0, 5]
    assert torch.equal(ops.nvfp4_experts(x, segs, split), want)


class _Source:
    """ExpertSource's packed(): one expert packed alone, where asked (a far slot's copy: in host memory)."""

    def __init__(self, ex, h, i):
        self.ex, self.h, self.i, self.reads = ex, h, i, []

    def packed(self, e, bf16, device=None):
        self.reads.append(e)
        return pack.pack_experts({e: self.ex[e]}, self.h, self.i, device=device)


def test_experts_in_the_checkpoint_only_give_the_same_rows():
    """Host memory short (GPU ranks): a layer keeps 2 experts in device slots, 2 in far slots, and 4 in the checkpoint
    only. A step whose experts need more far slots than there are runs in several launches, each reading its
    unslotted experts into far slots first (the far experts read longest ago give theirs up): the rows are bitwise
    the all-resident launch's, the reads are counted, and a swap brings an unslotted expert straight into a device
    slot. (Here on the CPU, the packed experts through the kernel's torch reference; the GPU test below runs it on
    the engine's host path.)"""
    from rocket_mpi.moe.experts import ExpertStore
    h, i, ids = 64, 32, list(range(8))
    ex = make_experts(ids, h, i, seed=3)
    full = pack.pack_experts(ex, h, i)
    packer = ops.ExpertPacker(ids, h, i, bf16=False, resident=[0, 1], far_slots=2)
    assert packer.unslotted == [4, 5, 6, 7] and packer.n_slots == 4
    for e in ids:
        if e not in packer.unslotted:
            packer.add(e, *ex[e])
    store = ExpertStore(0, ids, {}, {}, torch.ones(8), 0)
    store.packed, store.unslotted = packer.done(), set(packer.unslotted)
    store.read_bytes_per_expert = store.packed.bytes_per_expert
    store.source = src = _Source(ex, h, i)
    counts = {0: 3, 2: 5, 3: 1, 4: 2, 5: 7, 6: 1, 7: 4}
    segs = segments_for(counts)
    n = sum(counts.values())
    x = (torch.randn(n, h, generator=torch.Generator().manual_seed(9)) * 2).to(torch.bfloat16)
    tokens = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    want = ops.nvfp4_experts(x, segs, full, 0, tokens)
    got = store.compute(x, tokens, segs, 0)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert store.file_reads == 4 and sorted(src.reads) == [4, 5, 6, 7]
    assert len(store.unslotted) == 4 and set(store.packed.slot) | store.unslotted == set(ids)
    # again: the experts now in far slots are read there, the others from the checkpoint
    assert torch.equal(store.compute(x, tokens, segs, 0).view(torch.int16), want.view(torch.int16))
    # a promotion of an unslotted expert: into the resident one's device slot, which goes to the checkpoint
    e_in = min(store.unslotted)
    store.swap(e_in, 0)
    assert store.is_resident(e_in) and 0 in store.unslotted and not store.is_resident(0)
    assert torch.equal(store.compute(x, tokens, segs, 0).view(torch.int16), want.view(torch.int16))


@gpu
def test_host_memory_short_reads_experts_from_the_checkpoint(tmp_path):
    """The engine on a GPU with a cache of a few experts and host memory for one far slot per layer: the other
    experts stay in the checkpoint files, the decode path is host (auto; graph is refused with one line), and the
    tokens are the all-resident run's."""
    d = str(tmp_path / "sk")
    make_checkpoint("tiny", d, seed=5, skew=1.5, nvfp4_experts=True)
    ref = Engine(d, device="cuda")
    ref.set_decode_path("host", "local")
    prompts = [[(3 * s + i) % ref.cfg.vocab_size for i in range(5)] for s in range(4)]
    want = ref.generate(prompts, 16).tokens
    bpe = ref.experts[next(iter(ref.experts))].packed.bytes_per_expert
    n_moe = len(ref.experts)
    del ref
    eng = Engine(d, device="cuda", expert_cache=2 * n_moe * bpe / GIB, host_memory=1.5 * n_moe * bpe / GIB)
    assert eng.cache_plan.far_slots == 1, eng.cache_plan.reason
    with pytest.raises(RocketError, match="checkpoint files only"):
        eng.set_decode_path("graph", "local")
    assert eng.set_decode_path("auto", "local") == "host"
    res = eng.generate(prompts, 16)
    assert res.tokens == want
    c = res.expert_cache
    assert c["file_reads"] > 0 and c["unslotted_experts"] > 0 and c["hit_rows"] + c["miss_rows"] > 0


@gpu
def test_graphed_step_with_a_cache_matches(tmp_path):
    """The captured step with half the experts far and swaps between steps: the all-resident tokens; and started
    from the all-resident run's trace (--expert-cache-from): the same tokens, each layer's most fired experts in its
    device slots at load, fewer misses than the cold start."""
    from rocket_mpi.runtime.telemetry import firing_shares
    d = str(tmp_path / "sk")
    make_checkpoint("tiny", d, seed=5, skew=1.5, nvfp4_experts=True)
    out = {}
    shares = None
    for budget, start in ((None, False), (0.0, False), (4e-5, False), (4e-5, True)):
        eng = Engine(d, device="cuda", expert_cache=budget, telemetry=budget is None,
                     cache_from=shares if start else None)
        eng.set_decode_path("graph", "local")
        if start:
            for la in eng.cfg.moe_layers:
                st = eng.experts[la]
                assert st.resident() == first_resident(st.owned, st.capacity, shares[la]), la
        res = eng.generate([[(3 * s + i) % eng.cfg.vocab_size for i in range(5)] for s in range(4)], 24)
        out[budget, start] = res
        assert res.path == "graph" and not res.note, res.note
        if budget is None:
            shares = firing_shares(eng.expert_cache.trace_array(), list(eng.cfg.moe_layers))
    for key in ((0.0, False), (4e-5, False), (4e-5, True)):
        assert out[key].tokens == out[None, False].tokens, key
    cold, warm = out[4e-5, False].expert_cache, out[4e-5, True].expert_cache
    assert cold["swaps"] > 0 and cold["hit_rows"] > 0
    assert warm["miss_rows"] < cold["miss_rows"], (cold, warm)


@pytest.mark.parametrize("preset", ["tiny:nvfp4-all", "dsa-tiny:nvfp4-all", "glm5-tiny:nvfp4-all",
                                    "glm5-tiny:nvfp4-head", "tiny:nvfp4"])
def test_plan_counts_the_stack_as_the_ranks_hold_it(preset):
    """plan's stack on GPU ranks: the NVFP4 linears a loaded model records as stored parts and whose shapes the kernel's
    tiles take (whole tiles of 16) count their stored bytes (codes, scales, weight_scale_2) instead of BF16's; the rest
    (MLA's kv_b, which the model keeps dense, KDA's b of 2 heads) as BF16; CPU ranks: all BF16."""
    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.cli.plan import stack_bytes, tensor_shapes
    from rocket_mpi.model import model_class
    from rocket_mpi.model.layers import _stored_owners
    reader = SyntheticReader(f"preset:{preset}")
    model = model_class(reader.config.model_type).load(reader)
    saved = []

    def walk(p):
        if isinstance(p, (list, tuple)) and p and not isinstance(p[0], torch.Tensor):
            for q in p:
                walk(q)
            return
        w, sc = (p[0], p[1]) if isinstance(p, tuple) else (p.weight, p.weight_scale)
        n, k = w.shape[0], 2 * w.shape[1]
        if n % 16 == 0 and k % 16 == 0:   # what pack_linears / pack_mlp take as stored
            saved.append(2 * n * k - (w.numel() + sc.numel() + 4))
    for owner in _stored_owners(model):
        for parts in owner.stored.values():
            walk(parts)
    shapes = tensor_shapes(reader)
    assert stack_bytes(shapes) - stack_bytes(shapes, as_stored=True) == sum(saved)
    assert bool(saved) == preset.endswith(("-all", "-head"))


def test_plan_and_decode_leave_out_what_text_decode_does_not_read(tiny_nvfp4_ckpt, tmp_path):
    """A GLM checkpoint as published also stores its MTP layer (layers.{num_hidden_layers}: attention, shared and routed
    experts, eh_proj) and, for the vision models, the vision tower: plan counts neither in the stack, and decode gives
    the same tokens with them there."""
    import shutil
    from safetensors.torch import load_file, save_file
    d = tmp_path / "with_mtp"
    shutil.copytree(tiny_nvfp4_ckpt, d)
    t = load_file(str(d / "model.safetensors"))
    last = json.load(open(d / "config.json"))["num_hidden_layers"]
    for n in [n for n in t if n.startswith(f"model.layers.{last - 1}.")]:
        t[n.replace(f"layers.{last - 1}.", f"layers.{last}.")] = t[n].clone()
    t[f"model.layers.{last}.eh_proj.weight"] = torch.ones(64, 128, dtype=torch.bfloat16)
    t["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(3 * 64, 64, dtype=torch.bfloat16)
    save_file(t, str(d / "model.safetensors"))
    from rocket_mpi.checkpoint.reader import CheckpointReader
    from rocket_mpi.cli.plan import stack_bytes, tensor_shapes
    readers = [CheckpointReader(c) for c in (tiny_nvfp4_ckpt, str(d))]
    assert len(readers[1].where) > len(readers[0].where)
    assert [tensor_shapes(r) for r in readers][0] == tensor_shapes(readers[1])
    assert stack_bytes(tensor_shapes(readers[1]), as_stored=True) == stack_bytes(tensor_shapes(readers[0]), True)
    outs, toks = [], []
    for c in (tiny_nvfp4_ckpt, str(d)):
        r = rocket("plan", "--checkpoint", c, "--ranks", "2", "--device-memory", "8", "--host-memory", "0")
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.replace(c, "DIR"))
        out = tmp_path / f"{len(toks)}.json"
        r = rocket("decode", "--checkpoint", c, "--streams", "2", "--tokens", "4", "--quiet", "--out", str(out))
        assert r.returncode == 0, r.stderr
        toks.append(json.load(open(out))["runs"][0]["tokens"])
    assert outs[0] == outs[1] and toks[0] == toks[1]


def test_plan_command():
    """plan from the headers alone: the report's model on two GB10s fits all-resident (16.6 GiB stack + half the
    experts each); on one 80 GiB GPU with 10 GiB of host memory it does not, and says why."""
    r = rocket("plan", "--checkpoint", "preset:glm5-flash:nvfp4", "--ranks", "2", "--device-memory", "128",
               "--host-memory", "0")
    assert r.returncode == 0, r.stderr
    assert "replicated stack 16.6" in r.stdout and "verdict: fits all-resident" in r.stdout, r.stdout
    r = rocket("plan", "--checkpoint", "preset:glm5-flash:nvfp4", "--ranks", "1", "--device-memory", "80",
               "--host-memory", "10")
    assert r.returncode == 0 and "verdict: fits with the expert cache and the checkpoint files" in r.stdout, r.stdout
    r = rocket("plan", "--checkpoint", "preset:glm5-flash:nvfp4", "--ranks", "1", "--device-memory", "80",
               "--host-memory", "0.1")
    assert r.returncode == 1 and "does not fit: rank 0: out of host memory for the expert cache" in r.stdout, r.stdout
    r = rocket("plan", "--checkpoint", "preset:glm5-flash:nvfp4", "--ranks", "1", "--device-memory", "139.8",
               "--host-memory", "120")
    assert r.returncode == 0 and "fits with the expert cache" in r.stdout, r.stdout
    # the stack held as stored on GPU ranks: the full-size model's NVFP4 stack in its stored bytes, BF16 on CPU ranks
    r = rocket("plan", "--checkpoint", "preset:glm5-flash:nvfp4-all", "--ranks", "2", "--device-memory", "128",
               "--host-memory", "0")
    assert r.returncode == 0 and "replicated stack 6.7" in r.stdout, r.stdout
    r = rocket("plan", "--checkpoint", "preset:glm5-flash:nvfp4-all", "--ranks", "2", "--device-memory", "128",
               "--host-memory", "0", "--cpu")
    assert r.returncode == 0 and "replicated stack 16.6" in r.stdout, r.stdout
