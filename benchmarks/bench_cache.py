"""The expert cache's policy replayed on a recorded routing trace, against LRU and Belady's optimum.

    python -m rocket_mpi decode --checkpoint preset:default:skew=1.5 --streams 8 --tokens 200 --telemetry trace.npz
    python benchmarks/bench_cache.py --trace trace.npz --capacity 0.25,0.5 [--interval 8] [--margins 0.5,1] [--first 48]
                                     [--start other_trace.npz]

Each MoE layer is one cache of `capacity` x (experts the rank owns) slots. A step's requests are the experts with rows
(each is read once however many rows it has); the hit rate counts those reads. The policies:
    ours    rocket_mpi.moe.cache.Policy as the engine runs it: decayed firing frequency, at most PROMOTIONS swaps per
            layer at each upkeep, every --interval steps (the graphed engine's: 8) and after steps 1, 2, 4, ... below
            it (moe.cache.warm_upkeep), starting from the lowest ids (a swap copies the expert in: bytes a demand cache
            would not move); --margins adds it at other promotion margins and swap limits (ours@H or ours@H/P),
            --cold-upkeeps without the early upkeeps, --start TRACE2 started from another recorded trace as
            --expert-cache-from starts the engine ("ours from start")
    LRU     demand caching: a miss is brought in, the least recently read expert goes
    Belady  demand caching with bypass and the future known: a miss is brought in only if it is read again before
            the cached expert read last, which goes (the most hits any demand cache can have)
Prints per window (all steps; with --first N also the first N, a cold start) one table: per capacity, each policy's
hit rate, ours as a fraction of Belady's, and each policy's expert transfers per step (misses read + copies in).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rocket_mpi.moe.cache import Policy, first_resident, warm_upkeep  # noqa: E402
from rocket_mpi.runtime.telemetry import firing_shares  # noqa: E402


def requests(rows: np.ndarray, owned: list[int]) -> list[set[int]]:
    """rows [steps, E] of one layer -> per step, the owned experts with rows."""
    own = np.array(owned)
    return [set(own[rows[t, own] > 0].tolist()) for t in range(rows.shape[0])]


def replay_ours(reqs: list[set[int]], owned: list[int], cap: int, interval: int = 1, warm: bool = False,
                start: np.ndarray | None = None, **policy) -> tuple[int, int, int]:
    """(hits, reads, copies) of the engine's policy, its upkeep every `interval` steps (the graphed engine's: 8) with
    the steps' firing counts; warm: also after steps 1, 2, 4, ... below the interval (moe.cache.warm_upkeep); start:
    the layer's firing shares in another trace (--expert-cache-from: the most fired resident, the scores seeded);
    policy: Policy's keyword arguments (hysteresis, promotions)."""
    pol = Policy(owned, cap, first_resident(owned, cap, start), **policy)
    if start is not None:
        pol.seed(start)
    hits = reads = copies = 0
    n = max(owned) + 1
    active = np.zeros(n)
    resident = pol.resident
    last = 0
    for t, req in enumerate(reqs):
        hits += len(req & resident)
        reads += len(req)
        active[list(req)] += 1
        due = (t + 1) % interval == 0 or (warm and warm_upkeep(t + 1, interval))
        if due or t + 1 == len(reqs):
            pol.observe(active, t + 1 - last)
            last = t + 1
            copies += len(pol.swaps())
            resident = pol.resident
            active = np.zeros(n)
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
    ap.add_argument("--interval", type=int, default=1, help="ours: steps between upkeeps (the graphed engine's: 8)")
    ap.add_argument("--margins", default="", help="ours: also replayed at these promotion margins (Policy hysteresis), "
                    "each H or H/P (P: swaps per upkeep, Policy promotions)")
    ap.add_argument("--first", type=int, default=0, help="also the first N steps alone (a cold start)")
    ap.add_argument("--cold-upkeeps", action="store_true", help="ours also without the upkeeps after steps 1, 2, "
                    "4, ... below the interval (the engine's since the cache is cold at first)")
    ap.add_argument("--start", metavar="TRACE2", help="ours also started from this other trace of the same model "
                    "(decode --expert-cache-from)")
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
          f"experts ({int(mine.sum())} over all layers); ours: upkeep every {a.interval} step(s)")
    pols = [("ours", replay_ours, {"warm": True})]
    if a.cold_upkeeps:
        pols.append(("ours, every N only", replay_ours, {}))
    for m in (m for m in a.margins.split(",") if m):  # H or H/P: margin H, at most P swaps per upkeep
        h, _, n = m.partition("/")
        pols.append((f"ours@{m}", replay_ours,
                     {"warm": True, "hysteresis": float(h), **({"promotions": int(n)} if n else {})}))
    if a.start:
        z2 = np.load(a.start)
        if list(z2["layers"]) != list(layers) or z2["rows"].shape[2] != rows.shape[2]:
            raise SystemExit(f"--start {a.start}: {z2['rows'].shape[2]} experts in MoE layers {list(z2['layers'])}, "
                             f"the trace has {rows.shape[2]} in {list(layers)}")
        shares = firing_shares(z2["rows"], list(range(len(layers))))
        print(f"ours from start: resident and scores from {a.start} ({z2['rows'].shape[0]} steps)")
        pols.append(("ours from start", replay_ours, {"warm": True, "start": shares}))
    pols += [("LRU", replay_lru, {}), ("Belady", replay_belady, {})]
    windows = [("all steps", steps)] + ([(f"first {a.first} steps", a.first)] if 0 < a.first < steps else [])
    for title, n_steps in windows:
        print(f"\n{title}: hit rate of the expert reads; misses + copies per step (expert transfers over the host "
              "link: a miss is read, a copy moves one in)")
        print("| capacity | " + " | ".join(name for name, _, _ in pols) + " | ours / Belady | "
              + " | ".join(f"{name} transfers" for name, _, _ in pols) + " |")
        print("|" + "---:|" * (2 + 2 * len(pols)))
        for frac in (float(x) for x in a.capacity.split(",")):
            tot = {name: [0, 0, 0] for name, _, _ in pols}
            for i in range(len(layers)):
                owned = [int(e) for e in np.nonzero(mine[i])[0]]
                if not owned:
                    continue
                cap = int(frac * len(owned))
                reqs = requests(rows[:n_steps, i], owned)
                for name, fn, kw in pols:
                    if "start" in kw:
                        kw = dict(kw, start=kw["start"][i])
                    h, r, c = fn(reqs, owned, cap, a.interval, **kw) if fn is replay_ours else fn(reqs, owned, cap)
                    tot[name][0] += h
                    tot[name][1] += r
                    tot[name][2] += c
            rate = {k: v[0] / v[1] if v[1] else 1.0 for k, v in tot.items()}
            moved = {k: ((v[1] - v[0]) + v[2]) / max(n_steps, 1) for k, v in tot.items()}
            best = rate["Belady"]
            print(f"| {frac:.0%} | " + " | ".join(f"{rate[k]:.1%}" for k, _, _ in pols)
                  + f" | {rate['ours'] / best if best else 1.0:.1%} | "
                  + " | ".join(f"{moved[k]:.1f}" for k, _, _ in pols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
