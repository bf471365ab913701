"""The device row plan (csrc/moe_plan.cu) and its torch reference.

The host plan (ops/rows.py plan_rows + ops.launch_plan) gives each rank's block at
offsets that depend on routing, so the host must read the routing every layer. The device plan puts
every rank's block at a fixed place in "slot space" instead:

    slot-space row of canonical row i (owner o) = set * set_stride + o * cap + (i - offsets[o])

with cap = tokens * topk (the most rows one rank can own; a step of fewer streams that shares a larger step's exchange
places its blocks that exchange's cap apart instead: `stride`) and set = seq % n_sets (row buffer sets used
in turn, for fabrics that need double buffering). Canonical order, the split of a replicated expert's rows
among its owners (ops/rows.py), segments, tiles and weight passes are the host plan's, so a row's expert
output and the scatter order are the same bits either way.

The owners reach the kernel as pair tables (ops/rows.py Owners, device_tables): pair0 [E + 1] and pair_owner
[P] int32, and canon [P] int32, the pairs in canonical (owner, expert) order. The tables may be longer than the
placement needs (padded to a fixed number of pairs, canon with -1): live rebalancing rewrites them in place, so
a captured step stays valid when the number of replicas changes.

Outputs, all fixed-size for a given (tokens, topk, ranks):
    by_token   [T, k] int64   slot-space row of each token's experts, ascending expert id
    coef       [T, k] fp32    router weight x s2_down, matching by_token
    row_index  [cap] int64    token of each row of this rank's block (0 past its rows)
    pad_rows   [cap * 8] i32  the kernel's padded rows (launch_plan), -1 past them
    groups     [cap, 4] i32   the kernel's weight passes (launch_plan), zeros past them
    canon_slot [T * k] int64  slot-space row of canonical row i (the row checksum reads rows in this order)
    meta       [6 + N] int64  tiles, passes, rows of this rank, set, seq, experts of this rank with rows,
                              then rows per rank
    by_canon   [T, k] int32   where each by_token entry's row goes in the rows' checksum (the scatter sums it):
                              t * k + j, the (token, expert id) order, so the checksum is the same under every
                              placement and the split's equals the one-rank run's at every step
"""
from __future__ import annotations

import torch

from rocket_mpi.ops import _ext
from rocket_mpi.ops.experts import launch_plan
from rocket_mpi.ops.rows import Owners, plan_rows

META_HEAD = 6
META_TILES, META_GROUPS, META_ROWS, META_SET, META_SEQ, META_EXPERTS = range(META_HEAD)

# Limits of the device plan and router kernels (csrc/rocket.h; tests/test_plan.py checks they match)
PLAN_MAX_EXPERTS = 1024   # kPlanMaxExperts, kRouteMaxExperts
PLAN_MAX_PAIRS = 1024     # kPlanMaxPairs: (expert, owner) pairs of one layer, replicas included
PLAN_MAX_ROWS = 2048      # kPlanMaxRows: streams x top-k of one step
PLAN_MAX_RANKS = 64       # kPlanMaxRanks
PLAN_MAX_TOPK = 32        # kPlanMaxTopk (moe_route: top-k <= 32 and n_group <= 32 too)


def model_limit(cfg, ranks: int) -> str:
    """'' where the device plan and router kernels take this model and rank count, else why not."""
    if cfg.n_routed_experts > PLAN_MAX_EXPERTS:
        return f"{cfg.n_routed_experts} routed experts (the device plan and router take at most {PLAN_MAX_EXPERTS})"
    if cfg.num_experts_per_tok > PLAN_MAX_TOPK or cfg.n_group > PLAN_MAX_TOPK:
        return (f"top-{cfg.num_experts_per_tok} of {cfg.n_group} groups (the device router takes at most top-"
                f"{PLAN_MAX_TOPK} and {PLAN_MAX_TOPK} groups)")
    if ranks > PLAN_MAX_RANKS:
        return f"{ranks} ranks (the device plan takes at most {PLAN_MAX_RANKS})"
    return ""


def stream_limit(streams: int, cfg) -> str:
    """'' where one step of `streams` streams fits the device plan, else why not."""
    if streams * cfg.num_experts_per_tok > PLAN_MAX_ROWS:
        return (f"{streams} streams x top-{cfg.num_experts_per_tok} = {streams * cfg.num_experts_per_tok} rows per "
                f"MoE layer exceed the device plan's {PLAN_MAX_ROWS} (at most {PLAN_MAX_ROWS // cfg.num_experts_per_tok}"
                f" streams)")
    return ""


def pairs_limit(pairs: int) -> str:
    """'' where the device plan takes a layer of `pairs` (expert, owner) pairs, else why not."""
    if pairs > PLAN_MAX_PAIRS:
        return (f"{pairs} (expert, owner) pairs in a MoE layer (the device plan takes at most {PLAN_MAX_PAIRS}: "
                f"experts plus replicas)")
    return ""


def canonical_experts(owner) -> torch.Tensor:
    """[P] int32: the (expert, owner) pairs in canonical (owner rank, expert id) order (ops/rows.py Owners); without
    replicas pair e is expert e, so these are the experts in (owner, id) order."""
    return Owners.of(owner).canonical().to(torch.int32)


def device_tables(owner, pairs: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair0 [E + 1], pair_owner [pairs], canon [pairs]) int32 for moe_plan, padded to `pairs` (default: the
    placement's own count): pair_owner with 0 and canon with -1 past the placement's pairs."""
    o = Owners.of(owner)
    n = o.n_pairs if pairs is None else pairs
    if n < o.n_pairs:
        raise ValueError(f"{o.n_pairs} (expert, owner) pairs do not fit tables of {n}")
    pair_owner = torch.zeros(n, dtype=torch.int32)
    pair_owner[:o.n_pairs] = o.pair_owner.to(torch.int32)
    canon = torch.full((n,), -1, dtype=torch.int32)
    canon[:o.n_pairs] = o.canonical().to(torch.int32)
    return o.pair0.to(torch.int32), pair_owner, canon


def slot_table(n_experts: int, slot: dict[int, int]) -> torch.Tensor:
    """[E] int32: slot of each expert in this rank's packed experts, -1 where it is not here."""
    t = torch.full((n_experts,), -1, dtype=torch.int32)
    for e, s in slot.items():
        t[e] = s
    return t


def moe_plan_ref(experts: torch.Tensor, weights: torch.Tensor, owner, slot: dict[int, int],
                 s2_down: torch.Tensor, rank: int, n_ranks: int, n_sets: int, set_stride: int,
                 seq: int, stride: int = 0) -> dict[str, torch.Tensor]:
    """What moe_plan computes, from the host plan. owner: Owners, or a [E] tensor of one rank each; `seq` is the
    counter before the call (the plan uses seq + 1); stride: rows between the ranks' blocks in slot space (0: cap)."""
    experts, weights = experts.cpu(), weights.cpu().float()
    owner = owner.cpu() if isinstance(owner, torch.Tensor) else owner
    t, k = experts.shape
    cap = t * k
    stride = stride or cap
    if stride < cap or set_stride < n_ranks * stride:
        raise ValueError(f"moe_plan: blocks {stride} rows apart for {t} x {k}, sets {set_stride} apart")
    plan = plan_rows(experts, weights, owner, s2_down.cpu().float(), n_ranks)
    s = seq + 1
    set_ = s % n_sets if n_sets > 1 else 0
    offsets = torch.tensor(plan.offsets)
    own = plan.owners
    canon_slot = set_ * set_stride + own * stride + (torch.arange(plan.rows) - offsets[own])
    lo, hi = plan.block(rank)
    row_index = torch.zeros(cap, dtype=torch.long)
    row_index[:hi - lo] = plan.tokens[lo:hi]
    lp, n_tiles, n_groups, _ = launch_plan(plan.segments[rank], lo, slot)
    pad_rows = torch.full((cap * 8,), -1, dtype=torch.int32)
    pad_rows[:n_tiles * 8] = lp[:n_tiles * 8]
    groups = torch.zeros(cap, 4, dtype=torch.int32)
    groups[:n_groups] = lp[n_tiles * 8:].view(-1, 4)
    mine = sum(1 for _, a, b in plan.segments[rank] if b > a)
    meta = torch.tensor([n_tiles, n_groups, hi - lo, set_, s, mine]
                        + [plan.offsets[r + 1] - plan.offsets[r] for r in range(n_ranks)], dtype=torch.long)
    return {"by_token": canon_slot[plan.by_token], "coef": plan.coef, "row_index": row_index, "pad_rows": pad_rows,
            "groups": groups, "canon_slot": canon_slot, "meta": meta,
            "by_canon": torch.arange(t * k, dtype=torch.int32).view(t, k)}


PLAN_KEYS = ("by_token", "coef", "row_index", "pad_rows", "groups", "canon_slot", "meta", "by_canon")


def moe_plan(experts: torch.Tensor, weights: torch.Tensor, pair0: torch.Tensor, pair_owner: torch.Tensor,
             slot: torch.Tensor, canon: torch.Tensor, s2_down: torch.Tensor, rank: int, n_ranks: int, n_sets: int,
             set_stride: int, seq: torch.Tensor, meta_out: torch.Tensor | None = None,
             zero: torch.Tensor | None = None, fires: torch.Tensor | None = None, stride: int = 0
             ) -> dict[str, torch.Tensor]:
    """The device plan (one kernel, no host read; `seq` [1] int64 on the device is bumped by one). pair0,
    pair_owner, canon: the owners' pair tables (device_tables); slot [E] int32 (slot_table). CPU tensors take the
    reference (the CPU mode of runtime/graph.py's fixed-shape step). meta_out: where the meta goes (a row of the
    step's report, runtime/graph.py), returned as "meta"; zero: one int64 the plan sets to 0 (the layer's checksum
    sum, before the scatter adds to it); fires: [2, E] int32 firing counts the plan adds to (rows of each expert,
    and 1 for each expert with rows: count_fires); stride: rows between the ranks' blocks in slot space (0: cap; more
    where the step shares a larger step's exchange)."""
    if not experts.is_cuda:
        if fires is not None:
            fires += count_fires(experts, fires.shape[1])
        table = {e: s for e, s in enumerate(slot.tolist()) if s >= 0}
        out = moe_plan_ref(experts, weights, Owners.from_tables(pair0, pair_owner), table, s2_down, rank, n_ranks,
                           n_sets, set_stride, int(seq), stride)
        seq += 1
        if meta_out is not None:
            meta_out.copy_(out["meta"])
            out["meta"] = meta_out
        if zero is not None:
            zero.zero_()
        return out
    out = _ext.require().moe_plan(experts.contiguous(), weights.float().contiguous(), pair0, pair_owner, slot, canon,
                                  s2_down, rank, n_ranks, n_sets, set_stride, seq, meta_out, zero, fires, stride)
    return dict(zip(PLAN_KEYS, out))


def count_fires(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """One MoE layer's routing [T, k] -> [2, E] int32: rows of each expert, and whether it has any (what the device
    plan adds to its `fires`)."""
    rows = torch.bincount(experts.reshape(-1).cpu(), minlength=n_experts).to(torch.int32)
    return torch.stack((rows, (rows > 0).to(torch.int32))).to(experts.device)
