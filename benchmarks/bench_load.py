"""Loading a checkpoint's replicated stack (no routed experts): the host's time to read it with every NVFP4 stack
linear dequantised to BF16 (what a CPU rank keeps, and what a GPU load did before layers.loading_for), against a
load for a device that holds them as stored (layers.loading_for: the linears a GPU keeps packed alone are never
dequantised), then each one moved and packed (model.to). Prints one table: seconds (median of --rounds), the linears
dequantised, and the stack bytes the expert cache's plan sees before packing (model.nbytes).

    python benchmarks/bench_load.py CKPT [--device cuda] [--rounds 3]

--device cpu (a machine with no GPU) emulates a device that holds the stack as stored (layers.holds_stored forced
on): the host's side of a GPU load measured anywhere, packing on the CPU. The logits of the two loads are compared
bit for bit on one decode step first.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from rocket_mpi.checkpoint import reader as reader_mod
from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.model import layers, model_class


def _logits(model, device) -> torch.Tensor:
    """One decode step of 2 streams through the model alone (no routed experts: the MoE adds zeros)."""
    cache = model.new_cache(2, 8)
    return model.forward(torch.tensor([3, 17]), cache, [1, 1], lambda layer, x, L: torch.zeros_like(x)).float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)   # as the decode command's default --threads
    if args.device == "cpu":
        layers.holds_stored = lambda device: True  # emulated: a device that keeps NVFP4 stack weights packed alone
    reader = CheckpointReader(args.checkpoint)
    cls = model_class(reader.config.model_type)
    dequantised: list[str] = []
    real = reader_mod.Linear.dense
    reader_mod.Linear.dense = lambda self, *a, **k: (self.nvfp4 and dequantised.append(self.name)) or real(self, *a, **k)

    rows, logits = [], {}
    for name, lazy in (("every NVFP4 linear dequantised", False), ("for a device that holds them (loading_for)", True)):
        load_s, move_s = [], []
        for _ in range(args.rounds):
            dequantised.clear()
            t0 = time.perf_counter()
            if lazy:
                with layers.loading_for(args.device):
                    model = cls.load(reader)
            else:
                model = cls.load(reader)
            load_s.append(time.perf_counter() - t0)
            planned, n_deq = model.nbytes(), len(dequantised)
            t0 = time.perf_counter()
            model.to(args.device)
            if args.device == "cpu":  # emulated: what model.to packs on a GPU
                model.pack_stack()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            move_s.append(time.perf_counter() - t0)
        logits[name] = _logits(model, args.device)
        rows.append((name, statistics.median(load_s), statistics.median(move_s), n_deq, planned, model.nbytes()))
        del model
    a, b = logits.values()
    same = torch.equal(a, b)
    cfg = reader.config
    print(f"{args.checkpoint}: {cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab "
          f"{cfg.vocab_size}; device {args.device}{' (holding the stack as stored: emulated)' if args.device == 'cpu' else ''}; "
          f"median of {args.rounds}; one decode step's logits {'equal' if same else 'DIFFER'}\n")
    print("| load | host load s | move and pack s | NVFP4 linears dequantised | plan's stack GB | packed stack GB |")
    print("|:--|--:|--:|--:|--:|--:|")
    for name, ls, ms, n, planned, packed in rows:
        print(f"| {name} | {ls:.2f} | {ms:.2f} | {n} | {planned / 1e9:.3f} | {packed / 1e9:.3f} |")
    print(f"\nhost load, dequantised / loading_for: {rows[0][1] / rows[1][1]:.2f}x; load + move and pack: "
          f"{(rows[0][1] + rows[0][2]) / (rows[1][1] + rows[1][2]):.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
