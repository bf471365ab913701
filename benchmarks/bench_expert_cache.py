"""The expert cache on one GPU: decode steps with part of the experts in host memory, against the step's floor.

    python benchmarks/bench_expert_cache.py preset:air8:nvfp4:skew=1.5 --budgets all,0.5,0.25,0 --sweep 1,8 \
        [--hysteresis 0.5,2] [--start trace.npz]

Per budget (all: every expert resident; a fraction: that share of the experts' bytes; auto: as decode's default;
GIB: a size) one engine loads the model (the replicated stack resident, the experts split between device slots and
far slots in registered host memory), decodes the same prompts on the graphed path, and prints per M: ms per timed
step, the hit rate of the expert reads, the far bytes and promotion copies per step, and the floor
    resident bytes read / HBM copy bandwidth + far bytes / host-to-device bandwidth
(both bandwidths measured in the same process), with the step as a multiple of it. Tokens are compared with the
first budget's (the cache never changes the bits). "all-steps ms" is the mean over every decode step (the upkeep's
promotion copies land in one step of each interval, which the median of the timed steps leaves out).

--start TRACE: each engine's cache starts from that routing trace (decode --telemetry of the same preset), as
decode --expert-cache-from does; without it, from the lowest ids (a cold start).

--hysteresis H,...: the policy's promotion margin (moe/cache.py HYSTERESIS), one run per value on the same engine,
in turn (the residency one run leaves is where the next starts; the runs alternate, so each value starts warm).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from rocket_mpi.checkpoint.synthetic import SyntheticReader
from rocket_mpi.moe.cache import GIB, expert_bytes
from rocket_mpi.runtime.decode import measure_copy_bandwidth, measure_h2d_bandwidth, pick_device
from rocket_mpi.runtime.engine import Engine
from rocket_mpi.runtime.prompts import default_prompts
from rocket_mpi.runtime.telemetry import cache_start


def budget_gib(spec: str, owned_bytes: int) -> float | None:
    """all | auto | a fraction of the experts' bytes (0.5, 0) | GiB (20) -> --expert-cache's GiB (None: auto)."""
    if spec == "auto":
        return None
    if spec == "all":
        return owned_bytes / GIB + 1.0
    v = float(spec)
    return v * owned_bytes / GIB if v <= 1.0 else v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--budgets", default="all,0.5,0.25", help="all, auto, fractions (0.5) of the experts, or GiB (20)")
    ap.add_argument("--sweep", default="1,8")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--hysteresis", default="", help="policy margins to compare, e.g. 0.5,2 (default: the engine's)")
    ap.add_argument("--start", metavar="TRACE", help="start each cache from this trace (decode --expert-cache-from)")
    a = ap.parse_args()
    dev = pick_device("cuda", None)
    hbm, h2d = measure_copy_bandwidth(dev), measure_h2d_bandwidth(dev)
    print(f"{a.checkpoint}: copy {hbm:.0f} GB/s (read + write), pinned host-to-device {h2d:.1f} GB/s", flush=True)
    ref_tokens: dict[int, list] = {}
    cfg = SyntheticReader(a.checkpoint, "cpu").config
    start = cache_start(a.start, cfg, f"preset {a.checkpoint}") if a.start else None
    nvfp4 = ":nvfp4" in a.checkpoint
    owned_bytes = (len(cfg.moe_layers) * cfg.n_routed_experts *
                   expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size, nvfp4, packed=True))
    header = (f"{'budget':>7} {'hyst':>5} {'M':>3} {'resident GiB':>12} {'far GiB':>8} {'ms/step':>8} {'hit %':>6} "
              f"{'far MB/step':>11} {'copies MB/step':>14} {'floor ms':>8} {'x floor':>7} {'all-steps ms':>12} {'same tokens':>11}")
    for spec in a.budgets.split(","):
        t0 = time.perf_counter()
        eng = Engine(a.checkpoint, reader=SyntheticReader(a.checkpoint, str(dev)), device=str(dev),
                     expert_cache=budget_gib(spec, owned_bytes), cache_from=start)
        path = eng.set_decode_path("graph", "local")
        print(f"\nbudget {spec}: {eng.cache_plan.reason}; loaded in {time.perf_counter() - t0:.0f} s, {path} path"
              + (f"; the cache started from {a.start}" if start else ""), flush=True)
        print(header)
        hysts = [float(h) for h in a.hysteresis.split(",")] if a.hysteresis else [None]
        for m, h in ((int(x), h) for x in a.sweep.split(",") for h in hysts):
            if h is not None and eng.expert_cache is not None:
                for pol in eng.expert_cache.policies.values():
                    pol.hysteresis = h
            res = eng.generate(default_prompts(m, eng.cfg.vocab_size), a.tokens)
            timed = res.timed()
            ms = 1e3 * statistics.median(s.seconds for s in timed)
            st = res.expert_cache or {"hit_rate": 1.0, "far_bytes_per_step": 0.0, "moved_bytes_per_step": 0.0,
                                      "resident_gib": eng.resident_bytes() / GIB, "far_gib": 0.0}
            read = statistics.mean(s.weight_bytes for s in timed)
            far = st["far_bytes_per_step"]
            floor = 1e3 * ((read - far) / (hbm * 1e9) + far / (h2d * 1e9))
            same = ref_tokens.setdefault(m, res.tokens) == res.tokens
            all_ms = 1e3 * statistics.mean(s.seconds for s in res.steps[1:])
            hs = "-" if h is None else f"{h:g}"
            print(f"{spec:>7} {hs:>5} {m:>3} {st['resident_gib']:>12.2f} {st['far_gib']:>8.2f} {ms:>8.2f} "
                  f"{100 * st['hit_rate']:>6.1f} {far / 1e6:>11.1f} {st['moved_bytes_per_step'] / 1e6:>14.1f} "
                  f"{floor:>8.2f} {ms / floor:>7.2f} {all_ms:>12.2f} {str(same):>11}", flush=True)
        del eng
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
