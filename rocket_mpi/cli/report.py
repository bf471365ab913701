"""The decode command's report: the per-rank step table, the roofline and the split ceiling (rank 0 prints it)."""
from __future__ import annotations

import sys

from rocket_mpi.runtime.engine import TIMED_STEPS, WARMUP_STEPS


def _roofline(s: dict, gbps) -> str:
    if not gbps or not s["ms_per_step"]:
        return "-"
    return f"{100 * (s['weight_bytes_per_step'] / 1e9 / gbps * 1e3) / s['ms_per_step']:.0f}"


def print_report(doc: dict, cfg) -> None:
    """What a decode ran, and per run of the sweep its per-rank table (cli/__init__.py calls it on rank 0)."""
    n = doc["ranks"]
    print(f"rocket_mpi decode: {doc['model_type']} {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts "
          f"top-{cfg.num_experts_per_tok}, hidden {cfg.hidden_size}; {n} rank(s), fabric {doc['fabric']}")
    for ld in doc["load"]:
        print(f"  rank {ld['rank']}: {ld['experts']} expert slots loaded in {ld['load_s']:.2f} s, "
              f"resident {ld['resident_gib']:.3f} GiB (peak RSS {ld['peak_rss_gib']:.2f} GiB)")
    wall = doc["load"][0].get("wall_s")
    if wall:  # where rank 0's time went until the results were gathered ("start": the interpreter, imports, MPI)
        print(f"  wall time of rank 0, s: " + ", ".join(f"{k} {v:.2f}" for k, v in wall.items())
              + f"; in all {sum(wall.values()):.2f}")
    hdr = f"{'rank':>4} {'M':>3} {'ms/step':>9} {'tok/s':>8} {'fabric ms':>9} {'fabric %':>8} {'expert ms':>9} " \
          f"{'rows/step':>9} {'KiB sent/step':>13} {'GB read/step':>12} {'roofline %':>10}"
    bw = {ld["rank"]: ld.get("copy_gbps") for ld in doc["load"]}
    for run in doc["runs"]:
        steps = run["per_rank"][0]["steps"]
        print(f"\nM={run['streams']}: {steps} timed decode steps after warm-up, decode path {run['path']}")
        if run.get("note"):
            print(f"  note: {run['note']}")
        pre = run.get("prefill", {})
        if pre.get("forwards", 1) > 1:
            print(f"  prefill: {pre['tokens']} prompt tokens in {pre['forwards']} forwards of at most {pre['chunk']} "
                  f"(--prefill-chunk)")
        if len(run.get("spans", ())) > 1:  # graph.span_for: each new span runs a step eagerly and captures anew
            print("  attention spans: " + ", ".join(f"{sp} from step {st}" for st, sp in run["spans"]))
        print(hdr)
        for s in run["per_rank"]:
            host = s.get("path", "host") == "host"  # the fixed-shape step does not time the exchange apart
            # the exchange as the stream ran it (GPU: events; the host's time in exchange() also waits for the experts)
            wait = s.get("wait_ms") if s.get("wait_ms") is not None else s["fabric_ms"]
            pct = 100.0 * wait / s["ms_per_step"] if s["ms_per_step"] else 0.0
            fab_ms, fab_pct = (f"{wait:.2f}", f"{pct:.1f}") if host else ("-", "-")
            exp_ms = f"{s['expert_ms']:.2f}" if host and s.get("expert_ms") is not None else "-"
            print(f"{s['rank']:>4} {s['M']:>3} {s['ms_per_step']:>9.2f} {s['tok_per_s']:>8.1f} {fab_ms:>9} "
                  f"{fab_pct:>8} {exp_ms:>9} {s['rows_per_step']:>9.0f} {s['bytes_per_step'] / 1024:>13.1f} "
                  f"{s['weight_bytes_per_step'] / 1e9:>12.3f} {_roofline(s, bw.get(s['rank'])):>10}")
        r0 = run["per_rank"][0]
        if r0.get("decode_steps", 0) > WARMUP_STEPS + TIMED_STEPS:  # steps past the timed window: the whole run too
            print(f"whole run (rank 0): prefill {r0['prefill_s']:.2f} s, {r0['decode_steps']} decode steps in "
                  f"{r0['decode_s']:.2f} s ({1e3 * r0['decode_s'] / r0['decode_steps']:.2f} ms per step, "
                  f"{r0['M'] * r0['decode_steps'] / r0['decode_s']:.1f} tok/s)")
        if any(bw.values()):
            print("roofline % = (GB read/step / measured copy GB/s) / ms per step; copy GB/s counts read + write: "
                  + ", ".join(f"rank {r}: {v:.0f}" for r, v in bw.items() if v))
        if run.get("split_ceiling"):
            stack = doc["load"][0]["stack_bytes"]
            print(f"split ceiling {run['split_ceiling']:.2f}x: one rank alone would read "
                  f"{run['one_rank_bytes_per_step'] / 1e9:.3f} GB per step, the busiest rank reads "
                  f"{run['busiest_rank_bytes_per_step'] / 1e9:.3f} GB (every rank reads the "
                  f"replicated stack, {stack / 1e9:.3f} GB; only the experts are split)")
        print_cache(run["per_rank"], {ld["rank"]: ld for ld in doc["load"]})
        print_rebalance(run["per_rank"])
        print(f"stream 0 tokens: {run['tokens'][0]}")
        if run.get("text"):
            print(f"stream 0 text:   {run['text'][0]!r}")
    sys.stdout.flush()


def print_cache(per_rank: list[dict], loads: dict) -> None:
    """The expert cache's table (ranks with one): resident and far GiB, hit rate, bytes from host memory per step,
    and the floor those bytes imply at the measured host-to-device bandwidth beside the resident bytes' HBM floor;
    where host memory was short, the experts read from the checkpoint files."""
    rows = [s for s in per_rank if s.get("expert_cache")]
    if not rows:
        return
    print(f"expert cache: {'rank':>4} {'resident GiB':>12} {'far GiB':>8} {'hit %':>6} {'far MB/step':>11} "
          f"{'copies MB/step':>14} {'HBM floor ms':>12} {'host floor ms':>13}")
    for s in rows:
        c, ld = s["expert_cache"], loads.get(s["rank"], {})
        hbm, h2d = ld.get("copy_gbps"), ld.get("h2d_gbps")
        far = c["far_bytes_per_step"]
        hbm_ms = f"{1e3 * (s['weight_bytes_per_step'] - far) / (hbm * 1e9):.2f}" if hbm else "-"
        host_ms = f"{1e3 * far / (h2d * 1e9):.2f}" if h2d else "-"
        print(f"              {s['rank']:>4} {c['resident_gib']:>12.2f} {c['far_gib']:>8.2f} {100 * c['hit_rate']:>6.1f} "
              f"{far / 1e6:>11.1f} {c['moved_bytes_per_step'] / 1e6:>14.1f} {hbm_ms:>12} {host_ms:>13}")
        if c.get("unslotted_experts"):  # host memory short: experts read from the checkpoint files into far slots
            print(f"              rank {s['rank']}: {c['unslotted_experts']} experts in the checkpoint files only; "
                  f"{c['file_reads']} read into far slots, {c['file_bytes_per_step'] / 1e6:.1f} MB per step")


def print_rebalance(per_rank: list[dict]) -> None:
    """Live rebalancing (--rebalance-every), per rank: placements recomputed and how many changed, the experts it
    gained and gave up, the bytes it read for them, the time the steps waited for it and the time it took in the
    background (moe/rebalance.py)."""
    rows = [s for s in per_rank if s.get("rebalance")]
    if not rows:
        return
    print(f"rebalance: {'rank':>4} {'placements':>10} {'changed':>7} {'arrived':>7} {'left':>5} {'MB moved':>9} "
          f"{'ms waited':>9} {'ms background':>13}")
    for s in rows:
        b = s["rebalance"]
        print(f"           {s['rank']:>4} {b['rebalances']:>10} {b['changed']:>7} {b['arrived']:>7} {b['left']:>5} "
              f"{b['moved_bytes'] / 1e6:>9.2f} {b['ms']:>9.1f} {b.get('background_ms', 0.0):>13.1f}")


def human(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def num(v: float) -> str:
    """Two decimals as in the report, three significant digits below 1 so slow rows do not print as 0.00."""
    return f"{v:.2f}" if v >= 1 else f"{v:.3g}"
