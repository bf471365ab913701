"""place: a balanced expert placement from a recorded routing trace (decode --telemetry).

    python -m rocket_mpi decode --checkpoint DIR --streams 8 --tokens 200 --telemetry trace.npz
    python -m rocket_mpi place --telemetry trace.npz --ranks 3 --replicas 2 --out placement.json
    mpiexec -n 3 python -m rocket_mpi decode --checkpoint DIR --placement placement.json

Routing does not depend on the placement (every rank routes the same rows whoever owns them), so a trace recorded on
any number of ranks plans any other. Per MoE layer, the mean rows per step of each expert and the share of steps in
which it had rows go to rocket_mpi.moe.balance.balance(), the function live rebalancing runs on every rank. Prints per
layer the busiest rank over the mean, before (contiguous ranges, or --placement) and after, in rows and in modelled
cost (expert reads x their bytes + rows x a row's cost, replayed step by step on the trace with the replicas' split
rule), and the same over the whole step: each step waits at every MoE layer for that layer's busiest rank.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np

from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.checkpoint.synthetic import SyntheticReader, is_synthetic
from rocket_mpi.errors import RocketError
from rocket_mpi.moe.balance import ROW_SHARE, balance, contiguous_owners, owner_lists, step_stats, trace_loads
from rocket_mpi.moe.placement import Placement
from rocket_mpi.runtime.telemetry import describe, read_telemetry, require_model



def add_parser(sub, formatter) -> None:
    p = sub.add_parser("place", help="a balanced expert placement from a routing trace (decode --telemetry)",
                       formatter_class=formatter, description=__doc__)
    p.add_argument("--telemetry", required=True, metavar="FILE", help=".npz written by decode --telemetry")
    p.add_argument("--ranks", type=int, required=True, help="N, the ranks the placement is for")
    p.add_argument("--replicas", type=int, default=0,
                   help="R: up to R extra copies per MoE layer of its hottest experts, where they lower the busiest "
                        "rank's modelled cost")
    p.add_argument("--exact", action="store_true", help="exactly R extra copies per layer, useful or not")
    p.add_argument("--slots", type=int, help="K: every rank holds exactly K experts per layer, replicas included "
                                             "(N x K - E extra copies; --replicas unused)")
    p.add_argument("--row-cost", default="default",
                   help=f"what one row costs, as a share of reading one expert's weights: a number, 'default' "
                        f"({ROW_SHARE:g}) or 'fit' (from the trace's recorded expert times)")
    p.add_argument("--checkpoint", help="refuse a trace recorded from another model than this checkpoint "
                                        "(DIR or preset:NAME)")
    p.add_argument("--placement", help="the running placement: compared with, and kept nearly as it is where that "
                                       "costs at most 2 %% more (default: contiguous ranges, planned afresh)")
    p.add_argument("--out", help="write the placement here (JSON: MoE layer -> owner, or sorted owner list, per "
                                 "expert)")


def check_model(t: dict, path: str, checkpoint: str):
    """The checkpoint's config, or one line when the trace was recorded from another model."""
    reader = SyntheticReader(checkpoint) if is_synthetic(checkpoint) else CheckpointReader(checkpoint)
    require_model(t, path, reader.config, f"--checkpoint {checkpoint}")
    return reader.config


def fit_row_cost(t: dict) -> tuple[float, str] | None:
    """Least squares over the recorded (step, rank) pairs: expert seconds = a x expert reads + b x rows + c (CPU time
    on CPU ranks: the wall time of ranks sharing cores grows with the others' work). -> (b / a, how the fit went), or
    None where the trace has no expert times or they do not fit (a <= 0)."""
    cpu = t.get("expert_cpu_s")
    exp_s = cpu if cpu is not None and cpu.size and np.isfinite(cpu).all() else t["expert_s"]
    if exp_s.size == 0 or not np.isfinite(exp_s).all():
        return None
    n = exp_s.shape[1]
    reads = np.zeros_like(exp_s)
    rows = np.zeros_like(exp_s)
    for i, la in enumerate(t["model"]["moe_layers"]):
        w, r = trace_loads(t["rows"][:, i], t["placement"][str(la)], n)
        rows += w
        reads += r
    x = np.stack([reads.ravel(), rows.ravel(), np.ones(reads.size)], axis=1)
    y = exp_s.ravel()
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    a, b = float(coef[0]), float(coef[1])
    if a <= 0:
        return None
    b = max(b, 0.0)
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - x @ coef) ** 2).sum()) / ss if ss > 0 else 0.0
    return b / a, (f"an expert read {1e3 * a:.4f} ms, a row {1e3 * b:.4f} ms (1/{a / b:.0f} of a read)" if b > 0 else
                   f"an expert read {1e3 * a:.4f} ms, rows no measurable cost") + f"; R^2 {r2:.2f} over {y.size} " \
                                                                                     f"rank-steps"


def loads(rows: np.ndarray, owners: list, n: int, expert_bytes: float, row_bytes: float):
    """One layer under one placement, replayed on the trace: (rows [steps, n], modelled cost [steps, n])."""
    w, r = trace_loads(rows, owners, n)
    return w.astype(np.float64), r * expert_bytes + w * row_bytes


def ratio(x: np.ndarray) -> float:
    """The busiest rank's mean over all ranks' mean (1.0 for an idle layer)."""
    mean = x.mean()
    return float(x.mean(axis=0).max() / mean) if mean > 0 else 1.0


def place(args) -> int:
    n = args.ranks
    folder = os.path.dirname(os.path.abspath(args.out)) if args.out else None
    if folder and not os.path.isdir(folder):  # before the work, not after it
        raise RocketError(f"--out {args.out}: the folder {folder} does not exist")
    t = read_telemetry(args.telemetry)
    m = t["model"]
    n_exp, layers = m["n_experts"], list(m["moe_layers"])
    if n < 1:
        raise RocketError(f"--ranks {n}: at least 1")
    if args.replicas < 0 or args.replicas > n_exp * (n - 1):
        raise RocketError(f"--replicas {args.replicas}: 0..{n_exp * (n - 1)} for {n_exp} experts on {n} ranks (at "
                          f"most one copy of an expert per rank)")
    if args.slots is not None and not (-(-n_exp // n) <= args.slots <= n_exp):
        raise RocketError(f"--slots {args.slots}: {n} ranks x {args.slots} cannot hold {n_exp} experts once each with "
                          f"at most one copy per rank ({-(-n_exp // n)}..{n_exp})")
    cfg = check_model(t, args.telemetry, args.checkpoint) if args.checkpoint else \
        SimpleNamespace(moe_layers=tuple(layers), n_routed_experts=n_exp)
    big = float(t["expert_bytes"]) or 1.0
    fit = fit_row_cost(t)
    if args.row_cost == "fit":
        if fit is None:
            raise RocketError(f"--row-cost fit: {args.telemetry} has no expert times that fit (recorded on the "
                              f"fixed-shape path, or too few steps); give a number")
        share, how = fit[0], "fit from the trace"
    elif args.row_cost == "default":
        share, how = ROW_SHARE, "default"
    else:
        try:
            share, how = float(args.row_cost), "--row-cost"
        except ValueError:
            raise RocketError(f"--row-cost {args.row_cost!r}: a number >= 0, default or fit") from None
        if not 0 <= share < float("inf"):
            raise RocketError(f"--row-cost {args.row_cost!r}: a number >= 0, default or fit")
    small = big * share
    before = (Placement.from_file(args.placement, cfg, n).to_json() if args.placement else
              {str(la): contiguous_owners(n_exp, n) for la in layers})
    steps, streams = t["rows"].shape[0], int(t["streams"])
    print(f"{args.telemetry}: {describe(m)}, top-{m['top_k']}; {steps} decode steps of M={streams} recorded on "
          f"{int(t.get('ranks', 0))} rank(s), {t.get('device', '?')}, {t.get('path', '?')} path")
    print(f"cost model: an expert with rows costs one read of its weights ({big / 2**20:.2f} MiB), a row "
          f"{share:.4g} of that ({how}); " + (f"the recorded expert times fit {fit[1]}" if fit else
                               "the recorded expert times fit no such model (not timed, or too noisy)"))
    _recorded(t)
    mode = (f"exactly {n} x {args.slots} expert slots" if args.slots is not None else
            f"{'exactly' if args.exact else 'up to'} {args.replicas} replica(s) per layer")
    was = "--placement" if args.placement else "contiguous"
    print(f"\nplacement for {n} rank(s), {mode}; busiest rank / mean, before ({was}) -> after")
    print(f"{'layer':>5} {'rows':>13} {'cost':>13} {'cost per step':>15} {'replicas':>8} {'experts/rank':>12}")
    out, tot = {}, {k: np.zeros(2) for k in ("rows", "cost", "step", "mean_rows", "mean_cost")}
    moved = 0
    for i, la in enumerate(layers):
        rows = t["rows"][:, i]
        mu, act = step_stats(rows)
        try:
            new = balance(mu, act, n, args.replicas, int(big), args.slots, row_bytes=small, exact=args.exact,
                          current=before[str(la)] if args.placement else None)
        except ValueError as e:
            raise RocketError(f"place: MoE layer {la}: {e}") from None
        out[str(la)] = new
        moved += sum(len(set(a) - set(b)) for a, b in zip(owner_lists(new), owner_lists(before[str(la)])))
        cols = []
        for j, owners in enumerate((before[str(la)], new)):
            w, c = loads(rows, owners, n, big, small)
            tot["rows"][j] += w.mean(axis=0).max()
            tot["cost"][j] += c.mean(axis=0).max()
            tot["step"][j] += c.max(axis=1).mean()
            tot["mean_rows"][j] += w.mean()
            tot["mean_cost"][j] += c.mean()
            cols.append((ratio(w), ratio(c), float(c.max(axis=1).mean() / c.mean()) if c.mean() > 0 else 1.0))
        counts = np.bincount([r for o in owner_lists(new) for r in o], minlength=n)
        reps = sum(len(o) - 1 for o in owner_lists(new))
        (rb, cb, sb), (ra, ca, sa) = cols
        print(f"{la:>5} {rb:>5.3f} -> {ra:<5.3f} {cb:>5.3f} -> {ca:<5.3f} {sb:>7.3f} -> {sa:<5.3f} {reps:>8} "
              f"{f'{counts.min()}..{counts.max()}':>12}")
    summ = [(tot[k] / tot[base]) for k, base in (("rows", "mean_rows"), ("cost", "mean_cost"), ("step", "mean_cost"))]
    print(f"{'all':>5} {summ[0][0]:>5.3f} -> {summ[0][1]:<5.3f} {summ[1][0]:>5.3f} -> {summ[1][1]:<5.3f} "
          f"{summ[2][0]:>7.3f} -> {summ[2][1]:<5.3f}")
    print(f"modelled MoE cost of a step (each layer's busiest rank, summed): {tot['step'][0] / 2**20:.2f} -> "
          f"{tot['step'][1] / 2**20:.2f} MiB read-equivalents ({tot['step'][1] / tot['step'][0]:.3f}x)")
    print("rows, cost: the busiest rank's mean per step over the mean rank's; cost per step: each step's busiest rank "
          "over the mean (what a step waits for); all: summed over the MoE layers (each waits for its own busiest)")
    print(f"from the {'--placement' if args.placement else 'contiguous'} placement: {moved} expert copies move to "
          f"another rank ({moved * big / 2**20:.1f} MiB of weights to load)")
    if args.out:
        write_placement(args.out, out)
        print(f"wrote {args.out}")
    return 0


def _recorded(t: dict) -> None:
    """The recording's own per-rank times, where it has them (host path)."""
    exp_s, wait_s = t["expert_s"], t.get("wait_s")
    if exp_s.size == 0 or not np.isfinite(exp_s).all():
        return
    rows = t["rows_owned"].mean(axis=0)
    cpu = t.get("expert_cpu_s")
    cpu = cpu if cpu is not None and cpu.size and np.isfinite(cpu).all() else None
    per = ", ".join(f"rank {r}: {rows[r]:.0f} rows, expert {1e3 * exp_s[:, r].mean():.2f} ms"
                    + (f" ({1e3 * cpu[:, r].mean():.2f} ms CPU)" if cpu is not None else "")
                    + f", wait {1e3 * wait_s[:, r].mean():.2f} ms" for r in range(exp_s.shape[1]))
    print(f"recorded per step: {per}")


def write_placement(path: str, owners: dict[str, list]) -> None:
    """The placement file: one line per MoE layer (decode --placement reads it)."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in owners.items())
    with open(path, "w") as f:
        f.write("{\n" + body + "\n}\n")
