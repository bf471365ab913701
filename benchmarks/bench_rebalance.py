"""The cost of one live rebalance (--rebalance-every): milliseconds and bytes moved, on one rank's share of a split.

    python benchmarks/bench_rebalance.py preset:air8:nvfp4:skew=1.5 --ranks 2 --replicas 2          (one H200)
    python benchmarks/bench_rebalance.py preset:tiny --ranks 2 --device cpu --no-capture             (a quick check)

One engine loads rank `--rank`'s share of an N-rank split (contiguous ranges, the fixed slots live rebalancing keeps:
moe/rebalance.py) and its fixed-shape step's device tables (DeviceMoE). Skewed firing counts are fed as the decode
steps would feed them (a Zipf-like popularity over a seeded order of each layer's experts, --streams x top-k rows per
step), then one rebalance is timed: balance() for every MoE layer, the experts this rank gains read from the checkpoint
(a preset draws them on the device) into free slots, the device tables rewritten in place. Then the popularity drifts
(a quarter of the hot experts change place) and a second rebalance is timed: the steady state's cost. Each row: the
layers whose placement changed, experts gained and given up, MB read into slots, ms in all and in balance(), and
the rate of the moves.

Both ways of running it, side by side (two engines in turn, the same counts): at once (the steps wait for balance()
and the reads), and in the background (moe/rebalance.py: balance() and the reads of the arriving experts in a worker
thread from the snapshot on, the move --cover-ms later, what decode steps would run meanwhile; "ms" is then what the
move waited, "ms background" the worker's time). A preset drawn on a GPU is drawn at the move either way; a written
checkpoint, or a preset on the CPU, is read in the background.

Beside it (without --no-capture): what the alternative to rewriting the tables in place costs, a capture of the graphed
step (a one-rank engine of the same model and streams: the same kernels but the exchange's), median of 3.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np
import torch

from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.checkpoint.synthetic import SyntheticReader, is_synthetic
from rocket_mpi.moe.placement import Placement
from rocket_mpi.moe.step import DeviceMoE
from rocket_mpi.runtime import graph
from rocket_mpi.runtime.decode import pick_device
from rocket_mpi.runtime.engine import Engine
from rocket_mpi.runtime.prompts import default_prompts

STEPS = 16    # decode steps of counts fed before each rebalance
ZIPF = 1.2    # popularity exponent of the fed counts


def counts(rng: np.random.Generator, order: np.ndarray, rows: int, steps: int) -> np.ndarray:
    """[steps, 2, E]: each step's rows per expert (`rows` drawn with popularity 1 / (place + 1)^ZIPF over `order`) and
    whether it had any."""
    p = np.empty(len(order))
    p[order] = 1.0 / np.arange(1, len(order) + 1) ** ZIPF
    p /= p.sum()
    r = rng.multinomial(rows, p, size=steps)
    return np.stack([r, r > 0], axis=1)


def reader_for(spec: str, device) -> CheckpointReader:
    return SyntheticReader(spec, str(device)) if is_synthetic(spec) else CheckpointReader(spec)


def capture_ms(spec: str, device, streams: int) -> float:
    """A capture of the graphed step on one rank, median of 3 (GraphStep._capture timed, each a new span)."""
    times = []
    orig = graph.GraphStep._capture

    def timed(self):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        orig(self)
        torch.cuda.synchronize(device)
        times.append(1e3 * (time.perf_counter() - t0))

    graph.GraphStep._capture = timed
    try:
        eng = Engine(spec, 0, 1, None, reader_for(spec, device), device=str(device))
        eng.set_decode_path("graph", "local")
        for _ in range(3):
            eng.generate(default_prompts(streams, eng.cfg.vocab_size), 4)
    finally:
        graph.GraphStep._capture = orig
    del eng
    return statistics.median(times) if times else float("nan")


def rebalances(a, dev, background: bool) -> None:
    """Rank a.rank's share loaded with rebalancing on, two rebalances timed (the module docstring), at once or in the
    background."""
    reader = reader_for(a.checkpoint, dev)
    cfg = reader.config
    t0 = time.perf_counter()
    eng = Engine(a.checkpoint, a.rank, a.ranks, Placement.contiguous(cfg, a.ranks), reader, device=str(dev),
                 rebalance_every=2 if background else 1, replicas=a.replicas)
    rb = eng.rebalancer
    DeviceMoE(eng, a.streams)  # the fixed-shape step's tables: each rebalance rewrites them in place (on_change)
    owned = len(next(iter(eng.experts.values())).owned)
    n_exp, layers = cfg.n_routed_experts, len(cfg.moe_layers)
    mode = "in the background" if background else "at once"
    print(f"{mode}: rank {a.rank} of {a.ranks} loaded in {time.perf_counter() - t0:.1f} s on {dev}; "
          f"{layers} MoE layers x {n_exp} experts, {rb.slots} slots per layer (contiguous: {owned} owned), one "
          f"expert {rb.expert_bytes / 2**20:.2f} MiB, up to {a.replicas} replicas, {a.streams} streams x "
          f"top-{cfg.num_experts_per_tok}")
    rng = np.random.default_rng(a.seed)
    orders = [rng.permutation(n_exp) for _ in range(layers)]
    rows = a.streams * cfg.num_experts_per_tok
    print(f"{'rebalance':<22} {'layers changed':>14} {'arrived':>7} {'left':>5} {'MB read':>8} {'ms':>8} "
          f"{'ms balance':>10} {'ms background':>13} {'replicas':>8}")
    for what in ("from contiguous", "after a drift"):
        if what == "after a drift":  # a quarter of the 16 hottest experts of each layer trade places with cold ones
            for o in orders:
                hot, cold = o[:16:4].copy(), o[-4:].copy()
                o[:16:4], o[-4:] = cold, hot
        c = np.stack([counts(rng, o, rows, STEPS) for o in orders], axis=1)  # [steps, layers, 2, E]
        for step in range(STEPS):
            rb.observe(c[step], 1)
        rb.begin()
        before = {la: eng.placement.owners[la] for la in cfg.moe_layers}
        if background:  # the snapshot, then --cover-ms of steps, then the move
            rb.at_step(STEPS)
            time.sleep(a.cover_ms / 1e3)
            rb.at_step(STEPS + rb.lag)
        else:
            rb.rebalance(STEPS)
        st = rb.stats
        changed = sum(1 for la in cfg.moe_layers if eng.placement.owners[la] != before[la])
        print(f"{what:<22} {changed:>14} {st.arrived:>7} {st.left:>5} {st.moved_bytes / 1e6:>8.1f} "
              f"{1e3 * st.seconds:>8.1f} {1e3 * st.balance_seconds:>10.1f} {1e3 * st.background_seconds:>13.1f} "
              f"{st.replicas:>8}")
    rb.finish()
    del eng
    gc.collect()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the split (default 2)")
    ap.add_argument("--rank", type=int, default=0, help="whose share this process loads (default 0)")
    ap.add_argument("--replicas", type=int, default=2, help="extra copies per MoE layer balance() may place")
    ap.add_argument("--streams", type=int, default=8, help="M: rows per step are M x top-k (default 8)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-capture", action="store_true", help="skip the one-rank capture (its memory and time)")
    ap.add_argument("--cover-ms", type=float, default=100.0,
                    help="background: the steps between the snapshot and the move, in ms (default 100: 50 steps of 2 "
                         "ms, what --rebalance-every 100 gives)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dev = pick_device(a.device, None)
    for background in (False, True):
        rebalances(a, dev, background)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not a.no_capture and dev.type == "cuda":
        gc.collect()  # the split engine's memory, before the one-rank engine loads
        torch.cuda.empty_cache()
        print(f"one capture of the graphed step (1 rank, M={a.streams}), median of 3: "
              f"{capture_ms(a.checkpoint, dev, a.streams):.1f} ms (rebalancing rewrites the tables in place instead)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
