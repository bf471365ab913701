"""rocket_mpi/moe/balance.py: balanced placements of one MoE layer's experts, as every rank computes them.

Properties over random loads (hypothesis): every expert has an owner, replicas sit on distinct ranks, fixed slot counts
hold, the same inputs give the same placement (also in another process, with another hash seed), and on skewed loads
the busiest rank's modelled cost is no worse than contiguous ranges'. Plus the split rule and the count model."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from rocket_mpi.moe.balance import (_exp_neg, balance, contiguous_owners, copy_load, owner_lists, split_rows,
                                    trace_loads)

BYTES = 1000

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layers(draw, skewed: bool = False):
    """(load_rows, active, n_ranks): E experts, each with a mean of rows per step and a share of steps with rows."""
    n_exp = draw(st.integers(2 if skewed else 1, 40))
    n = draw(st.integers(1, 6))
    if skewed:  # a Zipf-like popularity in a random order, as --skew draws it
        s = draw(st.floats(0.5, 2.5))
        order = draw(st.permutations(range(n_exp)))
        total = draw(st.floats(1.0, 256.0))
        w = np.array([(1.0 + order[e]) ** -s for e in range(n_exp)])
        mu = w / w.sum() * total
        act = np.minimum(1.0, mu * draw(st.floats(0.3, 1.0)))
    else:
        mu = np.array(draw(st.lists(st.floats(0.0, 64.0), min_size=n_exp, max_size=n_exp)))
        act = np.array([min(m, draw(st.floats(0.0, 1.0))) for m in mu])
    return mu, act, n


def model_cost(mu, act, owners, n, row_bytes=BYTES / 16) -> list[float]:
    """Each rank's modelled cost of a placement (the module's count model)."""
    load = [0.0] * n
    for e, o in enumerate(owner_lists(owners)):
        for r, (pa, w) in zip(o, copy_load(float(mu[e]), float(act[e]), len(o))):
            load[r] += pa * BYTES + w * row_bytes
    return load


def check_valid(owners, n_exp, n):
    assert len(owners) == n_exp
    for e, o in enumerate(owners):
        if isinstance(o, list):
            assert len(o) >= 2 and o == sorted(set(o)), (e, o)  # replicas: distinct ranks, sorted
            assert all(isinstance(r, int) and 0 <= r < n for r in o), (e, o)
        else:
            assert isinstance(o, int) and 0 <= o < n, (e, o)


@SETTINGS
@given(layers(), st.integers(0, 4), st.booleans())
def test_every_expert_owned_replicas_distinct(layer, replicas, exact):
    mu, act, n = layer
    owners = balance(mu, act, n, replicas, BYTES, None, exact=exact)
    check_valid(owners, len(mu), n)
    extra = sum(len(o) - 1 for o in owner_lists(owners))
    cap = min(replicas, len(mu) * (n - 1)) if n > 1 else 0
    assert extra == cap if exact else extra <= cap
    counts = np.bincount([r for o in owner_lists(owners) for r in o], minlength=n)
    assert counts.max() <= -(-(len(mu) + extra) // n)  # no rank holds more than the contiguous split's most


@SETTINGS
@given(layers(), st.data())
def test_slots_per_rank_honoured(layer, data):
    mu, act, n = layer
    n_exp = len(mu)
    slots = data.draw(st.integers(-(-n_exp // n), n_exp))
    owners = balance(mu, act, n, 0, BYTES, slots)
    check_valid(owners, n_exp, n)
    counts = np.bincount([r for o in owner_lists(owners) for r in o], minlength=n)
    assert counts.tolist() == [slots] * n
    again = balance(mu, act, n, 0, BYTES, slots, current=owners)
    assert again == owners  # the running placement stays while the loads do


@SETTINGS
@given(layers(), st.integers(0, 3))
def test_deterministic_and_idempotent(layer, replicas):
    mu, act, n = layer
    a = balance(mu, act, n, replicas, BYTES, None)
    assert balance(mu.copy(), act.copy(), n, replicas, BYTES, None) == a
    assert balance(mu, act, n, replicas, BYTES, None, current=a) == a
    # a running placement with more copies than allowed now is not kept
    more = balance(mu, act, n, replicas + 2, BYTES, None, exact=True)
    b = balance(mu, act, n, replicas, BYTES, None, current=more)
    assert sum(len(o) - 1 for o in owner_lists(b)) <= replicas


@SETTINGS
@given(layers(skewed=True), st.integers(0, 2))
def test_no_worse_than_contiguous_on_skewed_loads(layer, replicas):
    mu, act, n = layer
    owners = balance(mu, act, n, replicas, BYTES, None)
    cont = contiguous_owners(len(mu), n)
    assert max(model_cost(mu, act, owners, n)) <= max(model_cost(mu, act, cont, n)) * (1 + 1e-9)


def simulated_layer(n_exp=64, tokens=8, k=8, skew=1.5, steps=200, seed=7):
    """Routing as the skewed presets make it: each token takes its top-k of popularity + noise. -> (mu, act)."""
    rng = np.random.default_rng(seed)
    bias = -skew * np.log1p(rng.permutation(n_exp)) / np.log(n_exp)
    rows = np.zeros((steps, n_exp))
    for s in range(steps):
        for _ in range(tokens):
            rows[s, np.argsort(-(bias + rng.gumbel(0, 0.3, n_exp)))[:k]] += 1
    return rows.mean(axis=0), (rows > 0).mean(axis=0)


def test_balances_a_skewed_layer():
    """64 experts, top-8 of 8 tokens, skewed: the busiest rank within 3 % of the mean in modelled cost and 10 % in
    rows for 2 and 3 ranks, whatever the seed (contiguous ranges are within 10 % by luck only)."""
    far = 0
    for seed in (7, 8, 9):
        mu, act = simulated_layer(seed=seed)
        assert mu.max() > 6 * mu.mean()   # a few experts take most rows
        for n in (2, 3):
            ratios = []
            for placement in (balance(mu, act, n, 0, BYTES, None), contiguous_owners(64, n)):
                cost = model_cost(mu, act, placement, n)
                rows = np.zeros(n)
                for e, o in enumerate(placement):
                    rows[o] += mu[e]
                ratios.append((max(cost) / (sum(cost) / n), rows.max() / rows.mean()))
            (cost, rows), (cost_c, _) = ratios
            assert cost <= 1.03 and rows <= 1.10 and cost <= cost_c, (seed, n, ratios)
            far += cost_c > 1.1
    assert far >= 3


def test_replica_of_an_expert_hotter_than_a_rank():
    """One expert with most of the rows (a compute-bound row cost): its copies split them, the busiest rank drops."""
    mu = np.array([60.0] + [1.0] * 7)
    act = np.array([1.0] + [0.6] * 7)
    one = balance(mu, act, 2, 0, BYTES, None, row_bytes=BYTES / 4)
    two = balance(mu, act, 2, 1, BYTES, None, row_bytes=BYTES / 4)
    assert two[0] == [0, 1]
    c1, c2 = (max(model_cost(mu, act, o, 2, BYTES / 4)) for o in (one, two))
    assert c2 < 0.75 * c1


def test_one_rank_and_bad_inputs():
    assert balance(np.ones(5), np.ones(5), 1, 3, BYTES, None) == [0] * 5
    with pytest.raises(ValueError, match="slots"):
        balance(np.ones(5), np.ones(5), 2, 0, BYTES, 2)      # 2 x 2 slots < 5 experts
    with pytest.raises(ValueError, match=r"load_rows\[1\]"):
        balance(np.array([1.0, np.nan]), np.ones(2), 2, 0, BYTES, None)
    with pytest.raises(ValueError, match="one value per expert"):
        balance(np.ones(4), np.ones(3), 2, 0, BYTES, None)


def test_same_placement_in_another_process():
    """Another interpreter with another hash seed (set and dict order) computes the same placement, ties (equal
    loads) included."""
    rng = np.random.default_rng(3)
    mu = np.round(rng.pareto(1.5, 48) * 3)
    act = np.minimum(1.0, mu)
    here = balance(mu, act, 3, 2, BYTES, None)
    code = ("import json, sys, numpy as np; from rocket_mpi.moe.balance import balance; "
            "mu, act = (np.array(v) for v in json.loads(sys.argv[1])); "
            "print(json.dumps(balance(mu, act, 3, 2, 1000, None)))")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code, json.dumps([mu.tolist(), act.tolist()])], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == here


def test_split_rule_and_count_model():
    for c in range(12):
        for m in range(1, 5):
            want = [0] * m
            for j in range(c):
                want[(j * m) // c] += 1
            assert split_rows(c, m) == want
    # a hot expert (8 rows every step) on two owners: both read every step, 4 rows each
    (p0, w0), (p1, w1) = copy_load(8.0, 1.0, 2)
    assert p0 == 1.0 and p1 > 0.99 and abs(w0 + w1 - 8.0) < 1e-9
    # one row per step: the first owner has it, the second never
    assert copy_load(1.0, 1.0, 2) == [(1.0, 1.0), (0.0, 0.0)]
    for mu, a, m in ((0.5, 0.4, 2), (3.0, 0.9, 3), (20.0, 1.0, 4)):
        loads = copy_load(mu, a, m)
        assert abs(sum(w for _, w in loads) - mu) < 1e-6 * mu
        assert loads[0][0] == pytest.approx(a) and all(p <= a + 1e-12 for p, _ in loads)
    for x in (0.0, 0.3, 7.0, 300.0):
        assert _exp_neg(x) == pytest.approx(np.exp(-x), rel=1e-11)


def test_trace_loads_follow_the_split_rule():
    rows = np.array([[3, 0, 1], [1, 2, 0]])   # steps x experts
    w, r = trace_loads(rows, [[0, 1], 1, 0], 2)
    # step 0: expert 0's 3 rows -> 2 on rank 0, 1 on rank 1; expert 2's row on rank 0
    assert w.tolist() == [[3, 1], [1, 2]] and r.tolist() == [[2, 1], [1, 1]]
