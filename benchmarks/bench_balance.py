"""Balanced placements against contiguous ranges on skewed routing: per-rank rows, expert and wait times, step time.

    python benchmarks/bench_balance.py --checkpoint preset:default:skew=1.5 --ranks 2,3 --sweep 1,8,32
    python benchmarks/bench_balance.py --checkpoint preset:air8:nvfp4:skew=1.5 --ranks 2,3 --sweep 1,8,32 \\
        --device cuda --fabric cuda-ipc --paths host,graph          # 2-3 ranks sharing one GPU (start MPS first)

1. Records a routing trace: `decode --telemetry` on one rank (routing does not depend on the placement) over held-out
   prompts (not the prompts measured below), --record-streams streams x --record-tokens tokens.
2. Plans with `place` for each N: balanced (no replicas) and, with --replicas R > 0, balanced + exactly R extra copies
   per layer (place would add replicas only where they lower its modelled cost; forcing them measures what they cost).
3. Decodes each placement under mpiexec -n N with the same prompts (--sweep, --repeats times, placements interleaved)
   and prints per N, M and placement: each rank's rows per step, expert ms (wall; CPU ranks also the process's CPU
   time in its experts, which ranks sharing cores do not inflate) and wait ms (time in the exchange: copies,
   doorbells, waiting for the peers; the host path times them, the fixed-shape path does not), the step time and its
   ratio to contiguous, the busiest rank's rows over the mean, and the wait asymmetry (the most waiting rank over the
   least). Each figure is the decode report's mean over its timed steps, the median over the repeats.
Replicated placements need a runtime with replicated experts; where decode refuses them, the row says why.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rocket_mpi.checkpoint.reader import CheckpointReader  # noqa: E402
from rocket_mpi.checkpoint.synthetic import SyntheticReader, is_synthetic  # noqa: E402
from rocket_mpi.cli import launch  # noqa: E402
from rocket_mpi.moe.balance import balance, step_stats  # noqa: E402

TIMEOUT = 1800.0


def run(args: list[str], n: int, launcher: str | None) -> tuple[bool, str]:
    """python -m rocket_mpi ARGS alone or under the launcher: (ok, stdout or the error's last line)."""
    r = launch.single(args, TIMEOUT) if n == 1 else launch.mpirun(n, args, TIMEOUT, launcher_cmd=launcher)
    if r.returncode:
        lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        return False, next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "?")
    return True, r.stdout


def held_out_prompts(path: str, streams: int, vocab: int) -> None:
    """Random prompts of 4..19 tokens from their own seed (decode's default prompts are what gets measured)."""
    rng = np.random.default_rng(4321)
    with open(path, "w") as f:
        json.dump([rng.integers(2, vocab, int(rng.integers(4, 20))).tolist() for _ in range(streams)], f)


def fmt(values, spec: str) -> str:
    return "/".join("-" if v is None else format(v, spec) for v in values)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="preset:default:skew=1.5")
    ap.add_argument("--ranks", default="2,3")
    ap.add_argument("--sweep", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=24, help="decode steps per measured run (10 are timed after 3)")
    ap.add_argument("--replicas", type=int, default=2, help="R: the balanced + R replicas placement (0: none)")
    ap.add_argument("--trace", help="plan from this trace (decode --telemetry) instead of recording one")
    ap.add_argument("--record-streams", type=int, default=8)
    ap.add_argument("--record-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fabric", default="auto")
    ap.add_argument("--paths", default="host", help="decode paths to measure (host times the experts and the wait)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--launcher", help="MPI launcher (default: as static-fire's)")
    ap.add_argument("--workdir", help="where the trace, placements and runs go (default: a temporary folder)")
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="bench_balance_")
    os.makedirs(work, exist_ok=True)
    reader = SyntheticReader(a.checkpoint) if is_synthetic(a.checkpoint) else CheckpointReader(a.checkpoint)
    cfg = reader.config
    common = ["--checkpoint", a.checkpoint, "--device", a.device, "--threads", str(a.threads), "--quiet"]
    print(f"{a.checkpoint}: {cfg.model_type}, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, "
          f"{len(cfg.moe_layers)} MoE layers; device {a.device}, fabric {a.fabric}; work in {work}", flush=True)
    trace = a.trace or os.path.join(work, "trace.npz")
    if not a.trace:
        prompts = os.path.join(work, "held_out_prompts.json")
        held_out_prompts(prompts, a.record_streams, cfg.vocab_size)
        ok, out = run(["decode", *common, "--prompts", prompts, "--streams", str(a.record_streams), "--tokens",
                       str(a.record_tokens), "--telemetry", trace], 1, a.launcher)
        if not ok:
            print(f"recording the trace failed: {out}")
            return 1
        print(f"recorded {trace}: {a.record_streams} held-out prompts x {a.record_tokens} tokens on one rank",
              flush=True)
    ranks = [int(x) for x in a.ranks.split(",")]
    sweep = [int(x) for x in a.sweep.split(",")]
    for n in ranks:
        plans = {"contiguous": None}
        forced = ["--replicas", str(a.replicas), "--exact"]
        for name, extra in (("balanced", []), (f"balanced+{a.replicas}rep", forced)):
            if name != "balanced" and a.replicas <= 0:
                continue
            path = os.path.join(work, f"{name}_{n}.json")
            ok, out = run(["place", "--telemetry", trace, "--ranks", str(n), "--checkpoint", a.checkpoint, "--out",
                           path, *extra], 1, a.launcher)
            if not ok:
                print(f"place --ranks {n} {' '.join(extra)} failed: {out}")
                return 1
            plans[name] = path
            print(f"\nplace --ranks {n} {' '.join(extra)}:")
            print("\n".join(ln for ln in out.splitlines() if ln.strip().startswith(("all", "modelled", "from the"))))
        time_balance(trace, n, a.replicas)
        for path_name in a.paths.split(","):
            measure(a, n, sweep, plans, common, path_name, work)
    return 0


def time_balance(trace: str, n: int, replicas: int) -> None:
    """What planning costs each rank in a live rebalance: balance() per MoE layer of the trace, fresh and from the
    placement it gave (nothing to move), median of 5, on this machine's CPU."""
    z = np.load(trace)
    rows, bpe = z["rows"], int(z["expert_bytes"])
    fresh, again = [], []
    for i in range(rows.shape[1]):
        mu, act = step_stats(rows[:, i])
        for _ in range(5):
            t0 = time.perf_counter()
            cur = balance(mu, act, n, replicas, bpe, None)
            t1 = time.perf_counter()
            balance(mu, act, n, replicas, bpe, None, current=cur)
            fresh.append(t1 - t0)
            again.append(time.perf_counter() - t1)
    print(f"balance() for {rows.shape[2]} experts on {n} ranks, up to {replicas} replicas: "
          f"{1e3 * statistics.median(fresh):.1f} ms per MoE layer fresh, {1e3 * statistics.median(again):.1f} ms from "
          f"the running placement ({rows.shape[1]} MoE layers: {1e3 * statistics.median(fresh) * rows.shape[1]:.0f} ms "
          f"per rebalance)")


def measure(a, n: int, sweep: list[int], plans: dict, common: list[str], path_name: str, work: str) -> None:
    """Decode every placement on n ranks over the sweep (repeats interleaved) and print the table."""
    res: dict[str, list] = {name: [] for name in plans}
    fail: dict[str, str] = {}
    for rep in range(a.repeats):
        for name, plan in plans.items():
            if name in fail:
                continue
            out = os.path.join(work, f"run_{n}_{name}_{path_name}_{rep}.json")
            ok, msg = run(["decode", *common, "--sweep", ",".join(map(str, sweep)), "--tokens", str(a.tokens),
                           "--fabric", a.fabric, "--decode-path", path_name, "--out", out,
                           *(["--placement", plan] if plan else [])], n, a.launcher)
            if not ok:
                fail[name] = msg
                continue
            with open(out) as f:
                res[name].append(json.load(f)["runs"])
    print(f"\nN={n}, decode path {path_name}: per rank (rank 0/1/...) rows per step, expert ms, wait ms; step ms "
          f"(mean over the ranks); busiest rank's rows / mean; wait asymmetry (most / least waiting rank)")
    print(f"{'M':>3} {'placement':<18} {'rows/step':>20} {'expert ms':>20} {'expert CPU ms':>20} {'wait ms':>20} "
          f"{'step ms':>8} {'x contig':>8} {'rows max/mean':>13} {'wait max/min':>12}")
    for i, m in enumerate(sweep):
        base = None
        for name in plans:
            if name in fail:
                print(f"{m:>3} {name:<18} not run: {fail[name]}")
                continue
            if not res[name]:
                continue
            per = [run_list[i]["per_rank"] for run_list in res[name]]   # repeats x ranks

            def med(key, r):
                vals = [p[r][key] for p in per if p[r].get(key) is not None]
                return statistics.median(vals) if vals else None

            rows = [med("rows_per_step", r) for r in range(n)]
            exp = [med("expert_ms", r) for r in range(n)]
            cpu = [med("expert_cpu_ms", r) for r in range(n)]
            wait = [med("wait_ms", r) for r in range(n)]
            step = statistics.median(statistics.fmean(s["ms_per_step"] for s in p) for p in per)
            base = step if name == "contiguous" else base
            rows_ratio = max(rows) / statistics.fmean(rows) if statistics.fmean(rows) else 1.0
            asym = (f"{max(wait) / min(wait):.2f}" if None not in wait and min(wait) > 0 else "-")
            print(f"{m:>3} {name:<18} {fmt(rows, '.1f'):>20} {fmt(exp, '.2f'):>20} {fmt(cpu, '.2f'):>20} "
                  f"{fmt(wait, '.2f'):>20} "
                  f"{step:>8.2f} {step / base if base else float('nan'):>8.3f} {rows_ratio:>13.3f} {asym:>12}")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
