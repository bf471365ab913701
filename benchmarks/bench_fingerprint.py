"""What the start-up content check costs: one rank's load of a written checkpoint with and without the ContentLog
(checkpoint/fingerprint.py: an xxh3 digest of every tensor the rank reads that other ranks read too), scaled to air8.

    python benchmarks/bench_fingerprint.py runs/small [--rounds 3] [--ranks 2] [--threads 1]

Loads the checkpoint (as rank 0 of a 1-rank run, every expert) round after round, alternating without / with the
log, page cache warm (a first load is thrown away), and prints the median load seconds of each, the bytes digested
(the replicated stack, routers and scale tables: a routed expert's weights, read by their owner alone, are not) and
their GB/s, and the NaN/Inf check's GB/s (one aminmax pass, reader.all_finite) beside torch.isfinite().all(). Then
air8 (GLM-4.5-Air's layers, 8 of them, BF16: 36 GB) from its shapes: per rank of `--ranks`, the bytes it loads
(the replicated stack and its share of the experts), the bytes it digests (the stack) and the seconds both checks
take at the rates measured here.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from rocket_mpi.checkpoint.fingerprint import ContentLog, tensor_digest
from rocket_mpi.checkpoint.make import config_dict
from rocket_mpi.checkpoint.reader import CheckpointReader, all_finite
from rocket_mpi.config import ModelConfig
from rocket_mpi.runtime.engine import Engine


def load(ckpt: str, digest: bool) -> tuple[float, float, int]:
    """-> (load seconds, digest seconds, bytes digested)."""
    reader = CheckpointReader(ckpt)
    t0 = time.perf_counter()
    log = ContentLog.record(reader) if digest else None
    Engine(ckpt, reader=reader)
    if log is not None:
        log.finish()
    return time.perf_counter() - t0, log.seconds if log else 0.0, log.nbytes() if log else 0


def rate(fn, t: torch.Tensor, reps: int = 3) -> float:
    """GB/s of fn over t (best of reps)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(t)
        best = min(best, time.perf_counter() - t0)
    return t.numel() * t.element_size() / best / 1e9


def air8_bytes_per_rank(ranks: int) -> tuple[int, int]:
    """(replicated stack bytes, one rank's expert bytes) of air8 in BF16, from its config."""
    cfg = ModelConfig.from_dict(config_dict("air8"))
    h, v, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = h * q * 2 + h * kv * 2 + q + 2 * kv
    moe = len(cfg.moe_layers)
    dense = L - moe
    stack = (2 * v * h + L * (attn + 2 * h) + dense * 3 * h * cfg.intermediate_size
             + moe * (3 * h * cfg.moe_intermediate_size * cfg.n_shared_experts + cfg.n_routed_experts * (h + 1)))
    experts = moe * cfg.n_routed_experts * 3 * h * cfg.moe_intermediate_size
    return 2 * stack, 2 * experts // ranks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2, help="air8 split over this many ranks, for the scaled rows")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (decode's --threads)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    size = sum(os.path.getsize(os.path.join(a.checkpoint, f)) for f in os.listdir(a.checkpoint)
               if f.endswith(".safetensors"))
    load(a.checkpoint, False)  # the page cache
    plain, logged, worker, nbytes = [], [], [], 0
    for r in range(a.rounds):
        for digest in ((False, True) if r % 2 == 0 else (True, False)):
            s, w, n = load(a.checkpoint, digest)
            (logged if digest else plain).append(s)
            if digest:
                worker.append(w)
                nbytes = n
    p, q, w = statistics.median(plain), statistics.median(logged), statistics.median(worker)
    pb, qb = min(plain), min(logged)
    t = torch.randn(1 << 27, dtype=torch.bfloat16)  # 256 MiB
    xxh = rate(tensor_digest, t)
    fin = rate(all_finite, t)
    isf = rate(lambda x: bool(torch.isfinite(x).all()), t[: 1 << 24])
    print(f"{a.checkpoint}: {size / 1e9:.2f} GB of safetensors; {a.rounds} rounds, {os.cpu_count()} CPUs here, "
          f"torch threads {a.threads}")
    print(f"{'load':<28}{'median s':>10}{'best s':>8}")
    print(f"{'without the content log':<28}{p:>10.2f}{pb:>8.2f}")
    print(f"{'with it':<28}{q:>10.2f}{qb:>8.2f}   best {qb - pb:+.2f} s; digests: {nbytes / 1e9:.2f} GB in {w:.2f} s "
          f"({nbytes / w / 1e9 if w else 0:.2f} GB/s)")
    print(f"\none core, 256 MiB of BF16 in memory: xxh3 digest {xxh:.2f} GB/s; NaN/Inf check (aminmax) {fin:.2f} GB/s; "
          f"torch.isfinite().all() {isf:.2f} GB/s")
    stack, experts = air8_bytes_per_rank(a.ranks)
    per_rank = stack + experts
    dig = nbytes / w if w else xxh * 1e9
    print(f"\nair8 BF16 over {a.ranks} ranks, per rank: {per_rank / 1e9:.1f} GB loaded ({stack / 1e9:.1f} GB replicated "
          f"stack + {experts / 1e9:.1f} GB of its experts), {stack / 1e9:.1f} GB digested")
    print(f"  digests at {dig / 1e9:.2f} GB/s (as in the loads above): {stack / dig:.1f} s per rank; the load's own "
          f"pass over the bytes at this host's rate ({size / p / 1e9:.2f} GB/s): {per_rank / (size / p):.1f} s")
    print(f"  the NaN/Inf check: {per_rank / (fin * 1e9):.1f} s per rank (isfinite().all() would take "
          f"{per_rank / (isf * 1e9):.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
