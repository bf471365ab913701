"""The device row plan (rocket_mpi/ops/plan.py and its kernel, moe_plan) against the host plan (ops/rows.py).

CPU tests (always run):
  - the host plan's canonical order against a brute-force one, with replicated experts: each replicated expert's
    rows split among its owners by the rule (j * m) // c, then (owner, expert, token);
  - the plan's reference (ops/plan.py) against the host plan: rows placed in slot space and
    scattered through its by_token give the host plan's scatter bit for bit; each rank's padded rows
    and weight passes cover exactly its block; sets alternate with seq; with and without replicas, with pair tables
    padded past the placement's pairs (as live rebalancing keeps them);
  - the plan's limits are those csrc/rocket.h compiles in, and a model or a step past them is refused up front.
GPU tests (skip, saying why, without a GPU or the extension):
  - moe_plan (the kernel) bitwise equal to its reference, 1 to 4 ranks, one or two sets, with and without replicas
    and padded pair tables; its meta written into the step's report row;
  - nvfp4_experts_into through the device plan bitwise equal to nvfp4_experts through the host plan;
  - a bad argument caught by the extension is one RuntimeError, not a crash.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import gpu
from rocket_mpi import ops
from rocket_mpi.ops import plan as kplan
from rocket_mpi.ops.rows import Owners, plan_rows, split_rows
from rocket_mpi.ops.scatter import moe_scatter_add_ref as moe_scatter_add


def random_routing(tokens, topk, n_exp, seed):
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, generator=gen)
    return experts, weights


def placement(n_exp, ranks, scrambled, seed, replicas=0):
    """Owners of each expert: contiguous ranges (or shuffled), then `replicas` extra copies of the lowest experts
    (the hot ones of a routing that favours low ids), each on ranks it is not on yet. -> Owners."""
    owner = torch.arange(n_exp) * ranks // n_exp
    if scrambled:
        owner = owner[torch.randperm(n_exp, generator=torch.Generator().manual_seed(seed))]
    lists = [[int(o)] for o in owner]
    for k in range(replicas):
        e = k % n_exp
        lists[e].append(next(r for r in range(ranks) if r not in lists[e]))
    return Owners.of(lists)


def mine_of(owners, rank):
    """This rank's experts and their slots (ascending expert id)."""
    return {e: i for i, e in enumerate(e for e, o in enumerate(owners.lists) if rank in o)}


# tokens, topk, experts, ranks, scrambled, replicas
CASES = [(1, 8, 16, 1, False, 0), (5, 4, 16, 2, False, 0), (8, 8, 32, 3, True, 0), (3, 2, 16, 2, True, 0),
         (16, 8, 64, 3, False, 0), (5, 4, 16, 2, False, 3), (8, 8, 32, 3, True, 6), (16, 8, 64, 4, False, 9),
         (3, 8, 8, 4, True, 12)]


def brute_force_order(experts, owners):
    """(owner, expert, token) of every row in canonical order, straight from the rule: expert e's rows in token
    order, the j-th of c to owner lists[e][(j * m) // c], then sorted by (owner, expert, token)."""
    rows = []
    for e, o in enumerate(owners.lists):
        toks = sorted(t for t in range(experts.shape[0]) if e in experts[t].tolist())
        rows += [(o[j * len(o) // len(toks)], e, t) for j, t in enumerate(toks)]
    return sorted(rows)


@pytest.mark.parametrize("tokens,topk,n_exp,ranks,scrambled,replicas", CASES)
def test_host_plan_splits_replicated_rows_by_the_rule(tokens, topk, n_exp, ranks, scrambled, replicas):
    experts, weights = random_routing(tokens, topk, n_exp, seed=tokens + replicas)
    owners = placement(n_exp, ranks, scrambled, 7, replicas)
    plan = plan_rows(experts, weights, owners, torch.ones(n_exp), ranks)
    got = list(zip(plan.owners.tolist(), plan.experts.tolist(), plan.tokens.tolist()))
    assert got == brute_force_order(experts, owners)
    for r in range(ranks):
        lo, hi = plan.block(r)
        assert set(plan.owners[lo:hi].tolist()) <= {r}
        assert [(e, b - a) for e, a, b in plan.segments[r]] == [
            (e, sum(1 for o, x, _ in got[lo:hi] if x == e)) for e in sorted(set(plan.experts[lo:hi].tolist()))]
    # each replicated expert's rows as split_rows says, and no rank owns rows of an expert it does not hold
    for e, o in enumerate(owners.lists):
        c = sum(1 for _, x, _ in got if x == e)
        assert [sum(1 for w, x, _ in got if x == e and w == r) for r in o] == split_rows(c, len(o))
    assert all(w in owners.lists[x] for w, x, _ in got)


def test_split_rows_rule():
    assert split_rows(5, 2) == [3, 2] and split_rows(1, 3) == [1, 0, 0] and split_rows(7, 3) == [3, 2, 2]
    for c in range(12):
        for m in (1, 2, 3, 5):
            assert split_rows(c, m) == [sum(1 for j in range(c) if j * m // c == q) for q in range(m)]


@pytest.mark.parametrize("tokens,topk,n_exp,ranks,scrambled,replicas", CASES)
def test_plan_reference_matches_host_plan(tokens, topk, n_exp, ranks, scrambled, replicas):
    experts, weights = random_routing(tokens, topk, n_exp, seed=tokens)
    owner = placement(n_exp, ranks, scrambled, 7, replicas)
    s2 = torch.rand(n_exp) + 0.5
    host = plan_rows(experts, weights, owner, s2, ranks)
    cap, h = tokens * topk, 24
    canon_rows = torch.randn(host.rows, h).to(torch.bfloat16)
    want = moe_scatter_add(canon_rows, host.by_token, host.coef)
    # a set need not be packed tight; blocks may lie further apart than cap (a step sharing a larger exchange)
    for n_sets, block in ((1, 0), (2, 0), (2, cap + 5)):
        stride = ranks * (block or cap) + 3
        for seq in (4, 5):
            for rank in range(ranks):
                mine = mine_of(owner, rank)
                ref = kplan.moe_plan_ref(experts, weights, owner, mine, s2, rank, ranks, n_sets, stride, seq, block)
                # moe_plan's CPU mode from the device tables, padded past the placement's pairs
                pair0, pair_owner, canon = kplan.device_tables(owner, owner.n_pairs + 4)
                cpu = kplan.moe_plan(experts, weights, pair0, pair_owner, kplan.slot_table(n_exp, mine), canon, s2,
                                     rank, ranks, n_sets, stride, torch.tensor([seq]), stride=block)
                assert all(torch.equal(cpu[k], ref[k]) for k in kplan.PLAN_KEYS)
                set_ = (seq + 1) % n_sets if n_sets > 1 else 0
                assert int(ref["meta"][kplan.META_SEQ]) == seq + 1 and int(ref["meta"][kplan.META_SET]) == set_
                assert ref["canon_slot"].min() >= set_ * stride and ref["canon_slot"].max() < (set_ + 1) * stride
                own = (ref["canon_slot"] - set_ * stride) // (block or cap)   # each row inside its owner's block
                assert torch.equal(own, host.owners)
                buf = torch.full((n_sets * stride, h), float("nan")).to(torch.bfloat16)  # unused rows poison
                buf[ref["canon_slot"]] = canon_rows
                got = moe_scatter_add(buf, ref["by_token"], ref["coef"])
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))
                lo, hi = host.block(rank)
                meta = ref["meta"].tolist()
                assert meta[kplan.META_ROWS] == hi - lo
                assert meta[kplan.META_HEAD:] == [host.offsets[r + 1] - host.offsets[r] for r in range(ranks)]
                pad = ref["pad_rows"]
                used = sorted(int(p) for p in pad if p >= 0)
                assert used == list(range(hi - lo))          # every block row once, nothing else
                assert torch.equal(ref["row_index"][:hi - lo], host.tokens[lo:hi])
                # every weight pass runs an expert of this rank over its rows only
                inv = {s: e for e, s in mine.items()}
                for slot, tile0, ntiles, _ in ref["groups"].tolist():
                    if ntiles == 0:
                        continue
                    e = inv[slot]
                    rows = [int(p) for p in pad[tile0 * 8:(tile0 + ntiles) * 8] if p >= 0]
                    assert rows and all(int(host.experts[lo + r]) == e for r in rows)
                assert meta[kplan.META_EXPERTS] == sum(1 for _, a, b in host.segments[rank] if b > a)


def test_plan_limits_match_the_kernels():
    """ops/plan.py's limits are the ones csrc/rocket.h compiles in."""
    import re
    src = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "rocket.h")).read()
    c = {k: int(v) for k, v in re.findall(r"constexpr int (k\w+) = (\d+);", src)}
    assert (c["kPlanMaxExperts"], c["kRouteMaxExperts"]) == (kplan.PLAN_MAX_EXPERTS,) * 2
    assert (c["kPlanMaxRows"], c["kPlanMaxRanks"], c["kPlanMaxTopk"]) == (kplan.PLAN_MAX_ROWS, kplan.PLAN_MAX_RANKS,
                                                                           kplan.PLAN_MAX_TOPK)
    assert c["kPlanMaxPairs"] == kplan.PLAN_MAX_PAIRS
    assert "1025 (expert, owner) pairs" in kplan.pairs_limit(1025) and kplan.pairs_limit(1024) == ""


def test_model_and_stream_limits_of_the_fixed_shape_step(tiny_ckpt, monkeypatch):
    """A model or a step the device kernels cannot take is refused up front with the limit named (auto
    stays on the host path), never a kernel launch error mid-run."""
    import rocket_mpi.runtime.engine as engine_mod
    from types import SimpleNamespace
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.errors import RocketError
    from rocket_mpi.runtime.prompts import default_prompts
    cfg = SimpleNamespace(n_routed_experts=2048, num_experts_per_tok=8, n_group=1)
    assert "2048 routed experts" in kplan.model_limit(cfg, 2)
    assert "top-40" in kplan.model_limit(SimpleNamespace(n_routed_experts=256, num_experts_per_tok=40, n_group=1), 2)
    assert "65 ranks" in kplan.model_limit(SimpleNamespace(n_routed_experts=256, num_experts_per_tok=8, n_group=1), 65)
    assert kplan.model_limit(SimpleNamespace(n_routed_experts=256, num_experts_per_tok=8, n_group=8), 64) == ""
    assert "at most 256 streams" in kplan.stream_limit(257, SimpleNamespace(num_experts_per_tok=8))
    assert kplan.stream_limit(256, SimpleNamespace(num_experts_per_tok=8)) == ""

    torch.set_num_threads(1)
    eng = Engine(tiny_ckpt)
    k = eng.cfg.num_experts_per_tok
    monkeypatch.setattr(kplan, "PLAN_MAX_ROWS", 2 * k)   # 3 streams: over
    assert eng.set_decode_path("device", "local") == "device"
    with pytest.raises(RocketError, match=f"3 streams x top-{k} = {3 * k} rows .*at most 2 streams"):
        eng.generate(default_prompts(3, eng.cfg.vocab_size), 3)
    assert eng.generate(default_prompts(2, eng.cfg.vocab_size), 3).path == "device"
    monkeypatch.setattr(engine_mod, "unsupported", lambda *a, **k: "")  # as on a GPU: auto takes the graph...
    eng = Engine(tiny_ckpt)
    assert eng.set_decode_path("auto", "local") == "graph"
    assert eng.generate(default_prompts(3, eng.cfg.vocab_size), 3).path == "host"  # ...but not for this step


GPU_CASES = CASES + [(64, 8, 288, 2, False, 0), (1, 8, 288, 3, True, 0), (64, 8, 288, 2, False, 2),
                     (256, 8, 288, 3, True, 16), (40, 8, 256, 4, False, 300)]


@gpu
@pytest.mark.parametrize("tokens,topk,n_exp,ranks,scrambled,replicas", GPU_CASES)
def test_gpu_moe_plan_matches_reference(tokens, topk, n_exp, ranks, scrambled, replicas):
    """The kernel against its reference, the pair tables exact and padded (live rebalancing's fixed length)."""
    dev = torch.device("cuda")
    experts, weights = random_routing(tokens, topk, n_exp, seed=tokens + 1)
    owner = placement(n_exp, ranks, scrambled, 3, replicas)
    s2 = torch.rand(n_exp) + 0.5
    cap = tokens * topk
    for n_sets, stride, pad, block in ((1, ranks * cap, 0, 0), (2, ranks * cap + 5, 7, 0),
                                       (2, ranks * (cap + 9) + 1, 0, cap + 9)):
        pair0, pair_owner, canon = (t.to(dev) for t in kplan.device_tables(owner, owner.n_pairs + pad))
        for rank in range(ranks):
            mine = mine_of(owner, rank)
            seq = torch.tensor([11], device=dev)
            fires = torch.zeros(2, n_exp, dtype=torch.int32, device=dev)
            got = kplan.moe_plan(experts.to(dev), weights.to(dev), pair0, pair_owner,
                                 kplan.slot_table(n_exp, mine).to(dev), canon, s2.to(dev), rank, ranks, n_sets,
                                 stride, seq, fires=fires, stride=block)
            ref = kplan.moe_plan_ref(experts, weights, owner, mine, s2, rank, ranks, n_sets, stride, 11, block)
            assert int(seq) == 12
            for k in kplan.PLAN_KEYS:
                g, r = got[k].cpu(), ref[k]
                assert g.dtype == r.dtype and torch.equal(g.view(-1), r.view(-1)), (f"{k} (rank {rank}, sets "
                                                                                    f"{n_sets}, replicas {replicas})")
            assert torch.equal(fires.cpu(), kplan.count_fires(experts, n_exp)), "fires: once per expert"


def _packed_random(n_exp, hidden, inter, dev):
    from helpers import make_experts
    return ops.pack_experts(make_experts(range(n_exp), hidden, inter, seed=5), hidden, inter, device=dev)


@gpu
@pytest.mark.parametrize("tokens", [1, 8, 40])
def test_gpu_experts_into_matches_host_plan(tokens):
    dev = torch.device("cuda")
    n_exp, hidden, inter, topk = 12, 256, 192, 4
    packed = _packed_random(n_exp, hidden, inter, dev)
    experts, weights = random_routing(tokens, topk, n_exp, seed=9)
    owner = torch.zeros(n_exp, dtype=torch.long)
    x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    host = plan_rows(experts, weights, owner, torch.ones(n_exp), 1)
    want = ops.nvfp4_experts(x, host.segments[0], packed, 0, host.tokens, 0.5)
    pair0, pair_owner, canon = (t.to(dev) for t in kplan.device_tables(owner))
    p = kplan.moe_plan(experts.to(dev), weights.to(dev), pair0, pair_owner,
                       kplan.slot_table(n_exp, packed.slot).to(dev), canon,
                       torch.ones(n_exp, device=dev), 0, 1, 1, tokens * topk, torch.zeros(1, dtype=torch.long,
                                                                                           device=dev))
    out = torch.full((tokens * topk, hidden), float("nan"), device=dev).to(torch.bfloat16)
    ops._ext.require().nvfp4_experts_into(x, p["row_index"], p["pad_rows"], p["groups"], out, packed.q_gu,
                                              packed.s_gu, packed.s2_gu, packed.q_dn, packed.s_dn, hidden, inter, 0.5)
    assert torch.equal(out[:host.rows].view(torch.int16), want.view(torch.int16))


@gpu
def test_gpu_launcher_check_raises_not_crashes():
    """A bad argument caught by the extension, in bindings.cpp or inside a launcher (csrc/*.cu), reaches
    Python as one RuntimeError naming the problem. Run in a child process so that a crash is reported as
    one: on the H200 image the first version died here (SIGSEGV in the message's ostringstream, see
    rocket.h)."""
    code = ("import torch\nfrom rocket_mpi.ops import _ext\nC = _ext.require()\nd = torch.device('cuda')\n"
            "try:\n    C.rms_norm(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16), 1e-5)\n"
            "except RuntimeError as e:\n    print('RAISED1', e)\n"
            "n = 8\ntry:\n"
            "    C.moe_plan(torch.zeros(300, 8, dtype=torch.long, device=d), torch.ones(300, 8, device=d),\n"
            "               torch.arange(n + 1, dtype=torch.int32, device=d), torch.zeros(n, dtype=torch.int32, device=d),\n"
            "               torch.arange(n, dtype=torch.int32, device=d),\n"
            "               torch.arange(n, dtype=torch.int32, device=d), torch.ones(n, device=d), 0, 1, 1, 2400,\n"
            "               torch.zeros(1, dtype=torch.long, device=d))\n"
            "except RuntimeError as e:\n    print('RAISED2', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    why = f"rc {r.returncode}\nstdout {r.stdout[-2000:]}\nstderr {r.stderr[-2000:]}"
    assert r.returncode == 0, why
    assert "RAISED1" in r.stdout and "on a GPU" in r.stdout, why
    assert "RAISED2" in r.stdout and "2048" in r.stdout, why


@gpu
def test_gpu_moe_plan_meta_out_and_zero():
    """moe_plan writes its meta into the step's report row it is given (the same words as its own tensor) and
    zeroes the layer's checksum word."""
    gen = torch.Generator().manual_seed(3)
    t, k, e, ranks = 5, 4, 16, 2
    experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).cuda()
    weights = torch.rand(t, k, generator=gen).cuda()
    owner = (torch.arange(e) * ranks // e).to(torch.int32)
    slot = kplan.slot_table(e, {i: i for i in range(e // 2)}).cuda()
    pair0, pair_owner, canon = (x.cuda() for x in kplan.device_tables(owner))
    args = (experts, weights, pair0, pair_owner, slot, canon, torch.rand(e).cuda(), 0, ranks, 2, 4 * t * k)
    base = kplan.moe_plan(*args, torch.tensor([6], device="cuda"))
    report = torch.full((3 + kplan.META_HEAD + ranks,), 99, dtype=torch.long, device="cuda")
    got = kplan.moe_plan(*args, torch.tensor([6], device="cuda"), report[3:], report[1:2])
    assert got["meta"].data_ptr() == report[3:].data_ptr()
    assert report.tolist() == [99, 0, 99] + base["meta"].tolist()
    for key in kplan.PLAN_KEYS:
        assert torch.equal(got[key], base[key]), key
