"""The expert cache's policy replayed on a recorded routing trace, against LRU and Belady's optimum.

    python -m rocket_mpi decode --checkpoint preset:default:skew=1.5 --streams 8 --tokens 200 --telemetry trace.npz
    python benchmarks/bench_cache.py --trace trace.npz --capacity 0.25,0.5

Each MoE layer is one cache of `capacity` x (experts the rank owns) slots. A step's requests are the experts with rows
(each is read once however many rows it has); the hit rate counts those reads. The policies:
    ours    rocket_mpi.moe.cache.Policy as the engine runs it: decayed firing frequency, at most PROMOTIONS swaps per
            layer after each step (a swap copies the expert in: bytes a demand cache would not move, shown as copies)
    LRU     demand caching: a miss is brought in, the least recently read expert goes
    Belady  demand caching with bypass and the future known: a miss is brought in only if it is read again before
            the cached expert read last, which goes (the most hits any demand cache can have)
Prints one table: per capacity, each policy's hit rate, ours as a fraction of Belady's, and the copies per step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rocket_mpi.moe.cache import Policy, first_resident  # noqa: E402


def requests(rows: np.ndarray, owned: list[int]) -> list[set[int]]:
    """rows [steps, E] of one layer -> per step, the owned experts with rows."""
    own = np.array(owned)
    return [set(own[rows[t, own] > 0].tolist()) for t in range(rows.shape[0])]


def replay_ours(reqs: list[set[int]], owned: list[int], cap: int) -> tuple[int, int, int]:
    """(hits, reads, copies) of the engine's policy."""
    pol = Policy(owned, cap, first_resident(owned, cap))
    hits = reads = copies = 0
    n = max(owned) + 1
    for req in reqs:
        hits += len(req & pol.resident)
        reads += len(req)
        active = np.zeros(n)
        active[list(req)] = 1
        pol.observe(active, 1)
        copies += len(pol.swaps())
    return hits, reads, copies


def replay_lru(reqs: list[set[int]], owned: list[int], cap: int) -> tuple[int, int, int]:
    last: dict[int, int] = {e: -1 for e in first_resident(owned, cap)}
    hits = reads = copies = 0
    for t, req in enumerate(reqs):
        for e in sorted(req):
            reads += 1
            if e in last:
                hits += 1
            elif cap:
                if len(last) >= cap:
                    del last[min(last, key=lambda x: (last[x], x))]
                last[e] = t
                copies += 1
            if e in last:
                last[e] = t
    return hits, reads, copies


def replay_belady(reqs: list[set[int]], owned: list[int], cap: int) -> tuple[int, int, int]:
    steps = len(reqs)
    nxt: list[dict[int, int]] = [{} for _ in range(steps)]  # nxt[t][e]: the first step after t that reads e
    upcoming: dict[int, int] = {}
    for t in range(steps - 1, -1, -1):
        nxt[t] = dict(upcoming)
        for e in reqs[t]:
            upcoming[e] = t
    first = dict(upcoming)
    cache = set(sorted(owned, key=lambda e: (first.get(e, steps), e))[:cap])  # the best start too
    hits = reads = copies = 0
    for t, req in enumerate(reqs):
        far = lambda e: nxt[t].get(e, steps + e)  # noqa: E731  (never again: farthest)
        for e in sorted(req):
            reads += 1
            if e in cache:
                hits += 1
                continue
            if not cap:
                continue
            if len(cache) < cap:
                cache.add(e)
                copies += 1
                continue
            victim = max(cache, key=far)
            if far(e) < far(victim):
                cache.remove(victim)
                cache.add(e)
                copies += 1
    return hits, reads, copies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help=".npz from decode --telemetry")
    ap.add_argument("--capacity", default="0.25,0.5", help="fractions of each layer's owned experts kept resident")
    ap.add_argument("--rank", type=int, default=0, help="whose experts (the trace's placement)")
    a = ap.parse_args()
    z = np.load(a.trace)
    rows, layers = z["rows"], z["layers"]
    if "placement" in z:  # the placement spelt out per layer: a rank or a list of ranks (replicas) per expert
        placed = json.loads(str(z["placement"]))
        mine = np.array([[a.rank in (o if isinstance(o, list) else [o]) for o in placed[str(la)]] for la in layers])
    else:  # older traces: the one owner of each expert
        mine = z["owners"] == a.rank
    steps = rows.shape[0]
    print(f"{a.trace}: {steps} decode steps, {len(layers)} MoE layers, {rows.shape[2]} experts; rank {a.rank}'s "
          f"experts ({int(mine.sum())} over all layers)")
    print(f"{'capacity':>9} {'ours':>7} {'LRU':>7} {'Belady':>7} {'ours/Belady':>12} {'copies/step ours':>17} "
          f"{'LRU':>6} {'Belady':>7}")
    for frac in (float(x) for x in a.capacity.split(",")):
        tot = {k: [0, 0, 0] for k in ("ours", "lru", "belady")}
        for i in range(len(layers)):
            owned = [int(e) for e in np.nonzero(mine[i])[0]]
            if not owned:
                continue
            cap = int(frac * len(owned))
            reqs = requests(rows[:, i], owned)
            for k, fn in (("ours", replay_ours), ("lru", replay_lru), ("belady", replay_belady)):
                h, r, c = fn(reqs, owned, cap)
                tot[k][0] += h
                tot[k][1] += r
                tot[k][2] += c
        rate = {k: v[0] / v[1] if v[1] else 1.0 for k, v in tot.items()}
        cps = {k: v[2] / max(steps, 1) for k, v in tot.items()}
        print(f"{frac:>9.0%} {rate['ours']:>7.1%} {rate['lru']:>7.1%} {rate['belady']:>7.1%} "
              f"{rate['ours'] / rate['belady'] if rate['belady'] else 1.0:>12.1%} {cps['ours']:>17.1f} "
              f"{cps['lru']:>6.1f} {cps['belady']:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
