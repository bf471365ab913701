"""Balanced expert placement: which ranks own each routed expert of one MoE layer, from its firing counts.

Every rank sees the whole routing of every step, so every rank can count each expert's rows identically and compute
the same placement from the same numbers without sending a byte (`--rebalance-every`, and the `place` command offline).
`balance()` is therefore a pure function of its inputs: Python floats and the four basic operations only (no libm, no
numpy reductions whose order could differ between builds), every sort keyed by (value, expert id, rank), so every
rank returns the same placement for the same counts.

The cost model. A decode step waits at every MoE layer for the slowest rank's rows, so a layer costs its busiest rank.
A rank's share of a layer costs, per step,

    sum over the expert copies it holds of   P(the copy has rows) x expert_bytes  +  E[its rows] x row_bytes

in bytes read: at decode batch sizes an expert that has rows at all costs a read of its weights, and each row adds a
little (row_bytes, by default expert_bytes / 16: the expert kernel on an H200 is weight-bound up to about 14 rows,
the CPU reference adds 1/27 to 1/15 of an expert's time per row). An expert with several owners splits its rows in
token order: the j-th of its c rows goes to owner o[(j x m) // c] of its m owners (sorted by rank), so the first owner
has rows whenever the expert has, the others only when c is large enough. With the mean rows per step mu and the share
of steps with rows a, a step's count is modelled as 0 with probability 1 - a, else 1 + Poisson(mu / a - 1), which
gives each copy's P(rows) and E[rows] (copy_load).

The placement (learned from DeepSeek's EPLB: replicas for the experts with the most load per copy, then a packing of
the copies onto ranks; written anew for this cost model, distinct owners and fixed slot counts):
    1. replicas: an extra copy goes, one at a time, to the expert whose busiest copy costs most (at most one copy per
       rank); with slots_per_rank None up to `replicas` extra copies, as many as lower the busiest rank's cost
       (a copy costs a read whenever it has rows, so beyond that it only adds), else exactly the slots' worth;
    2. packing: replicated experts first (most copies first), each on the least-loaded ranks with a free slot that
       keep the rest placeable; then the single experts, costliest first, each on the least-loaded rank with a free
       slot (ties: fewer experts, lower rank);
    3. refinement: while moving one single-owner expert off the busiest rank, or swapping it with one of another
       rank's (equal counts stay equal), makes both ranks cheaper than the busiest was, take the best such move.
    With `current` (the placement running now): it stays as it is where its busiest rank costs at most KEEP more than
    the fresh placement's, else the refinement starts from it and that is kept under the same bound, else the fresh
    placement is taken: a live rebalance moves few experts, and none while the loads stay as they were.
"""
from __future__ import annotations

import bisect

import numpy as np

ROW_SHARE = 1.0 / 16   # row_bytes by default: one row costs this share of reading one expert's weights
KEEP = 0.02            # `current`: its refinement is kept within this fraction of the fresh placement's busiest cost
LAMBDA_MAX = 600.0     # copy_load: past this many rows per active step, copies split rows evenly and all have rows
MAX_MOVES = 4096       # refinement moves per packing (each strictly lowers the sorted loads, so it ends anyway)
WINDOW = 4             # refinement: swap partners tried on each side of the ideal one
ROW_SLACK = 0.02       # rows even out where the busiest rank's cost grows by at most this fraction (the row cost is
                       # the model's least certain number: 0 up to ~8 rows in the GPU kernel, 1/27..1/15 of a read on
                       # the CPU reference), so the rows balance too where the cost barely prefers one placement


def split_rows(c: int, m: int) -> list[int]:
    """Rows of each of m owners (sorted by rank) of an expert with c rows in a step: the j-th row (tokens ascending)
    goes to owner (j x m) // c, so owner i gets ceil((i+1) c / m) - ceil(i c / m)."""
    return [-(-(i + 1) * c // m) + (-i * c // m) for i in range(m)]


def _exp_neg(x: float) -> float:
    """e**-x for x >= 0 with + - * / alone, so the same bits on every machine (math.exp is the C library's)."""
    k = 0
    while x > 0.125:
        x *= 0.5
        k += 1
    term, s = 1.0, 1.0
    for i in range(1, 14):
        term = term * -x / i
        s += term
    for _ in range(k):
        s *= s
    return s


def copy_load(mu: float, a: float, m: int) -> list[tuple[float, float]]:
    """(P(the copy has rows), E[its rows]) per step for each of the m owners (in rank order) of an expert with mean
    mu rows per step that has rows in a share a of the steps (the module's count model)."""
    if mu <= 0.0 or a <= 0.0:
        return [(0.0, 0.0)] * m
    if m == 1:
        return [(a, mu)]
    lam = mu / a - 1.0 if mu > a else 0.0
    if lam > LAMBDA_MAX:
        return [(a, mu / m)] * m
    p_rows = [0.0] * m
    rows = [0.0] * m
    q = _exp_neg(lam)          # P(count = 1 | rows), then 2, 3, ...
    seen = 0.0
    c = 1
    while True:
        shares = split_rows(c, m)
        for i in range(m):
            if shares[i]:
                p_rows[i] += q
                rows[i] += q * shares[i]
        seen += q
        if c >= m and (c > lam and q < 1e-12 or seen >= 1.0):
            break
        q = q * lam / c
        c += 1
    tail = 1.0 - seen if seen < 1.0 else 0.0   # counts past the loop: every owner has rows
    return [(a * (p_rows[i] + tail), a * rows[i]) for i in range(m)]


def _check(load_rows, active, n_ranks, replicas, slots_per_rank) -> tuple[list[float], list[float], int]:
    mu = [float(x) for x in np.asarray(load_rows, dtype=np.float64).reshape(-1)]
    act = [float(x) for x in np.asarray(active, dtype=np.float64).reshape(-1)]
    n_exp = len(mu)
    if len(act) != n_exp or n_exp == 0:
        raise ValueError(f"balance: load_rows has {n_exp} experts, active {len(act)}: one value per expert each")
    for name, v in (("load_rows", mu), ("active", act)):
        bad = next((e for e, x in enumerate(v) if not (x >= 0.0 and x < float("inf"))), None)
        if bad is not None:
            raise ValueError(f"balance: {name}[{bad}] = {v[bad]!r}: expected a finite value >= 0")
    if n_ranks < 1:
        raise ValueError(f"balance: {n_ranks} ranks: at least 1")
    if replicas < 0:
        raise ValueError(f"balance: {replicas} replicas: at least 0")
    if slots_per_rank is None:
        extra = min(replicas, n_exp * (n_ranks - 1))
    else:
        extra = n_ranks * slots_per_rank - n_exp
        if extra < 0 or slots_per_rank > n_exp:
            raise ValueError(f"balance: {slots_per_rank} slots on each of {n_ranks} ranks cannot hold {n_exp} experts "
                             f"once each and no expert twice on a rank (need {-(-n_exp // n_ranks)}..{n_exp})")
    # a share of the steps can never exceed the rows (each step with rows has at least one)
    act = [min(x, 1.0, m) for x, m in zip(act, mu)]
    return mu, act, extra


def replica_order(cost_of, n_exp: int, n_ranks: int, extra: int) -> list[int]:
    """The experts that get the extra copies, in order: each time the expert whose costliest copy costs most (EPLB's
    rule, with this module's copies), never more copies than ranks. cost_of(e, m) -> the copies' costs."""
    counts = [1] * n_exp
    top = [max(cost_of(e, 1)) for e in range(n_exp)]
    order = []
    for _ in range(extra):
        best = None
        for e in range(n_exp):
            if counts[e] < n_ranks and (best is None or top[e] > top[best]):
                best = e
        if best is None:
            break
        order.append(best)
        counts[best] += 1
        top[best] = max(cost_of(best, counts[best]))
    return order


def _feasible(demands: list[int], free: list[int]) -> bool:
    """Gale-Ryser: can copies of experts with these counts sit on distinct ranks with these free slots?"""
    d = sorted(demands, reverse=True)
    total = 0
    for k, dk in enumerate(d, start=1):
        total += dk
        if total > sum(min(f, k) for f in free):
            return False
    return sum(d) <= sum(free)


class _Packing:
    """Owners and per-rank loads of one layer's placement under construction."""

    def __init__(self, n_exp: int, n_ranks: int, slots: int, fixed: bool, cost_of, rows_of):
        self.n_exp, self.n, self.slots, self.fixed = n_exp, n_ranks, slots, fixed   # fixed: exactly `slots` each
        self.cost_of, self.rows_of = cost_of, rows_of
        self.owners: list[list[int]] = [[] for _ in range(n_exp)]
        self.load = [0.0] * n_ranks
        self.rows = [0.0] * n_ranks
        self.count = [0] * n_ranks

    def free(self, r: int) -> int:
        return self.slots - self.count[r]

    def place(self, e: int, ranks: list[int]) -> None:
        ranks = sorted(ranks)
        self.owners[e] = ranks
        for r, c, w in zip(ranks, self.cost_of(e, len(ranks)), self.rows_of(e, len(ranks))):
            self.load[r] += c
            self.rows[r] += w
            self.count[r] += 1

    def key(self, r: int) -> tuple:
        return (self.load[r], self.count[r], r)

    def busiest(self) -> float:
        return max(self.load)

    def result(self) -> list[int | list[int]]:
        return [o[0] if len(o) == 1 else list(o) for o in self.owners]


def _pack(n_exp, n_ranks, slots, fixed, counts, cost_of, rows_of) -> _Packing:
    p = _Packing(n_exp, n_ranks, slots, fixed, cost_of, rows_of)
    multi = sorted((e for e in range(n_exp) if counts[e] > 1), key=lambda e: (-counts[e], -cost_of(e, counts[e])[0], e))
    pending = [counts[e] for e in multi]
    for k, e in enumerate(multi):
        m = counts[e]
        rest = pending[k + 1:] + [1] * (n_exp - len(multi))
        ranks = sorted((r for r in range(n_ranks) if p.free(r) > 0), key=p.key)[:m]
        free = [p.free(r) - (r in ranks) for r in range(n_ranks)]
        if len(ranks) < m or not _feasible(rest, free):
            # the least-loaded ranks would leave the rest unplaceable: the ranks with the most free slots (Gale-Ryser's
            # greedy, which places any feasible set)
            ranks = sorted((r for r in range(n_ranks) if p.free(r) > 0), key=lambda r: (-p.free(r),) + p.key(r))[:m]
        p.place(e, ranks)
    singles = sorted((e for e in range(n_exp) if counts[e] == 1), key=lambda e: (-cost_of(e, 1)[0], e))
    for e in singles:
        r = min((r for r in range(n_ranks) if p.free(r) > 0), key=p.key)
        p.place(e, [r])
    return p


def _move(p: _Packing, e: int, src: int, dst: int) -> None:
    """Single-owner expert e from rank src to rank dst."""
    c, w = p.cost_of(e, 1)[0], p.rows_of(e, 1)[0]
    p.load[src] -= c
    p.load[dst] += c
    p.rows[src] -= w
    p.rows[dst] += w
    p.count[src] -= 1
    p.count[dst] += 1
    p.owners[e] = [dst]


def _singles(p: _Packing, value) -> dict[int, list[tuple[float, int]]]:
    """rank -> its single-owner experts as sorted (value(e), e)."""
    out = {r: [] for r in range(p.n)}
    for e, o in enumerate(p.owners):
        if len(o) == 1:
            out[o[0]].append((value(e), e))
    for r in out:
        out[r].sort()
    return out


def _refine(p: _Packing, by_rows: bool = False) -> _Packing:
    """Moves (free slots only) and swaps of single-owner experts off the busiest rank, the best each time, while both
    ranks end below what the busiest was. by_rows: the busiest in rows, and no rank's cost may pass the busiest
    cost x (1 + ROW_SLACK)."""
    cost = lambda e: p.cost_of(e, 1)[0]  # noqa: E731
    rows = lambda e: p.rows_of(e, 1)[0]  # noqa: E731
    val, lim = (p.rows, rows) if by_rows else (p.load, cost)
    single = _singles(p, lim)
    cap = p.busiest() * (1.0 + ROW_SLACK)

    def fits(r, r2, dc):  # by_rows: the cost of r and r2 after moving cost dc from r to r2
        return not by_rows or (p.load[r] - dc <= cap and p.load[r2] + dc <= cap)

    for _ in range(MAX_MOVES):
        top = max(val)
        r = min(x for x in range(p.n) if val[x] == top)
        best = None   # (the pair's larger value after, expert out, rank in, expert in or -1)
        for v_x, x in single[r]:
            if v_x <= 0.0:
                continue
            for r2 in range(p.n):
                if r2 == r:
                    continue
                gap = val[r] - val[r2]
                if not p.fixed and p.count[r2] < p.slots and v_x < gap and fits(r, r2, cost(x)):
                    cand = (max(val[r] - v_x, val[r2] + v_x), x, r2, -1)
                    if best is None or cand < best:
                        best = cand
                lst = single[r2]
                # swap x for y on r2: d = v_x - v_y in (0, gap), best near gap / 2
                i = bisect.bisect_left(lst, (v_x - gap / 2, -1))
                for j in range(max(i - WINDOW, 0), min(i + WINDOW, len(lst))):
                    v_y, y = lst[j]
                    d = v_x - v_y
                    if 0.0 < d < gap and fits(r, r2, cost(x) - cost(y)):
                        cand = (max(val[r] - d, val[r2] + d), x, r2, y)
                        if best is None or cand < best:
                            best = cand
        if best is None or not best[0] < top:
            break
        _, x, r2, y = best
        for e, src, dst in ((x, r, r2),) + (((y, r2, r),) if y >= 0 else ()):
            _move(p, e, src, dst)
            single[src].remove((lim(e), e))
            bisect.insort(single[dst], (lim(e), e))
    return p


def _from_current(current, n_exp, n_ranks, slots, fixed, copies, cost_of, rows_of) -> _Packing | None:
    """The running placement as a packing, or None where it does not fit these inputs: its owners, its counts per
    rank (slots: at most, fixed: exactly) and its extra copies (copies: (at most, at least))."""
    if current is None or len(current) != n_exp:
        return None
    p = _Packing(n_exp, n_ranks, slots, fixed, cost_of, rows_of)
    for e, o in enumerate(current):
        ranks = [o] if isinstance(o, (int, np.integer)) else list(o)
        ranks = sorted(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < n_ranks for r in ranks):
            return None
        p.place(e, ranks)
    extra = sum(p.count) - n_exp
    if any(c > slots for c in p.count) or (fixed and any(c != slots for c in p.count)) or \
            not copies[1] <= extra <= copies[0]:
        return None
    return p


def balance(load_rows: np.ndarray, active: np.ndarray, n_ranks: int, replicas: int, expert_bytes: int,
            slots_per_rank: int | None, *, row_bytes: float | None = None, exact: bool = False,
            current: list | None = None) -> list[int | list[int]]:
    """The owners of each expert of one MoE layer: an int, or the sorted list of its owners' ranks.

    load_rows[e]: (decayed) rows routed to expert e per step; active[e]: (decayed) share of steps in which e had rows.
    slots_per_rank: every rank holds exactly this many experts of the layer, replicas included (so live rebalancing
    rewrites fixed-size buffers in place): n_ranks x slots_per_rank - E extra copies, `replicas` unused. None: up to
    `replicas` extra copies (exact: exactly that many), as many as lower the busiest rank's cost, and no rank more
    than ceil(copies / n_ranks) experts (the contiguous split's memory). expert_bytes: what reading one expert's
    weights costs; row_bytes: what one row costs (default expert_bytes x ROW_SHARE); current: the running placement
    (same format), kept nearly as it is where that costs at most KEEP more. Identical inputs give an identical
    placement on every machine (module docstring). Raises ValueError on inputs no placement fits."""
    mu, act, extra = _check(load_rows, active, n_ranks, replicas, slots_per_rank)
    n_exp = len(mu)
    big = float(expert_bytes)
    small = big * ROW_SHARE if row_bytes is None else float(row_bytes)
    memo: dict[tuple[int, int], list[tuple[float, float]]] = {}

    def stats(e: int, m: int) -> list[tuple[float, float]]:
        k = (e, m)
        if k not in memo:
            memo[k] = copy_load(mu[e], act[e], m)
        return memo[k]

    def cost_of(e: int, m: int) -> list[float]:
        return [pa * big + w * small for pa, w in stats(e, m)]

    def rows_of(e: int, m: int) -> list[float]:
        return [w for _, w in stats(e, m)]

    if n_ranks == 1:
        return [0] * n_exp
    order = replica_order(cost_of, n_exp, n_ranks, extra)
    fixed = slots_per_rank is not None
    best = None
    for k in ([len(order)] if fixed or exact else range(len(order) + 1)):  # ties: fewer copies (a copy adds reads)
        counts = [1] * n_exp
        for e in order[:k]:
            counts[e] += 1
        slots = slots_per_rank if fixed else -(-(n_exp + k) // n_ranks)
        p = _refine(_refine(_pack(n_exp, n_ranks, slots, fixed, counts, cost_of, rows_of)), by_rows=True)
        if best is None or p.busiest() < best.busiest():
            best = p
        if k == 0 and not fixed:  # the contiguous split is a candidate too (the rows' refinement may cost up to
            # ROW_SLACK more): a placement is never costlier than contiguous ranges
            c = _from_current(contiguous_owners(n_exp, n_ranks), n_exp, n_ranks, slots, fixed, (0, 0), cost_of,
                              rows_of)
            if c is not None and c.busiest() < best.busiest():
                best = c
    slots = slots_per_rank if fixed else max(-(-(n_exp + extra) // n_ranks), best.slots)
    copies = (len(order), len(order) if fixed or exact else 0)
    run = _from_current(current, n_exp, n_ranks, slots, fixed, copies, cost_of, rows_of)
    if run is not None:   # as it runs, else refined from there, where within KEEP of the fresh placement
        bound = best.busiest() * (1.0 + KEEP)
        if run.busiest() > bound:
            run = _refine(_refine(run), by_rows=True)
        if run.busiest() <= bound:
            best = run
    return best.result()


def contiguous_owners(n_exp: int, n_ranks: int) -> list[int]:
    """Contiguous ranges, the first n_exp % n_ranks ranks one more (moe/placement.py's default)."""
    out = []
    for r in range(n_ranks):
        out += [r] * (n_exp // n_ranks + (r < n_exp % n_ranks))
    return out


def owner_lists(owners: list) -> list[list[int]]:
    """A layer's placement entry (int or sorted list per expert) as lists."""
    return [[int(o)] if isinstance(o, (int, np.integer)) else [int(r) for r in o] for o in owners]


def trace_loads(rows: np.ndarray, owners: list, n_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """A layer's recorded routing rows [steps, E] under a placement -> (rows [steps, n_ranks], reads [steps, n_ranks]):
    each rank's rows and the experts it read (copies with rows) in every step, with the replicas' split rule."""
    rows = np.asarray(rows, dtype=np.int64)
    steps = rows.shape[0]
    out_rows = np.zeros((steps, n_ranks), dtype=np.int64)
    out_reads = np.zeros((steps, n_ranks), dtype=np.int64)
    for e, o in enumerate(owner_lists(owners)):
        c, m = rows[:, e], len(o)
        for i, r in enumerate(o):
            share = -(-(i + 1) * c // m) - (-(-i * c // m))   # split_rows, per step
            out_rows[:, r] += share
            out_reads[:, r] += share > 0
    return out_rows, out_reads


def step_stats(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A layer's recorded rows [steps, E] -> (mean rows per step, share of steps with rows) per expert: balance()'s
    inputs without decay."""
    rows = np.asarray(rows, dtype=np.float64)
    if not rows.shape[0]:
        return np.zeros(rows.shape[1]), np.zeros(rows.shape[1])
    return rows.mean(axis=0), (rows > 0).mean(axis=0)
