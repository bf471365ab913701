"""Where a decode step's host time goes (cProfile), one rank: python benchmarks/profile_step.py CKPT [cpu|cuda] [M]

CKPT is a checkpoint folder or a synthetic preset (preset:NAME[:nvfp4]). Runs 4 tokens to warm up, then profiles a
run of --tokens tokens (prefill included) on the host path and prints the functions by their own time."""
import argparse
import cProfile
import pstats
import time

from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.checkpoint.synthetic import SyntheticReader, is_synthetic
from rocket_mpi.runtime.decode import pick_device
from rocket_mpi.runtime.engine import Engine
from rocket_mpi.runtime.prompts import default_prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("device", nargs="?", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("m", nargs="?", type=int, default=8, help="streams (default 8)")
    ap.add_argument("--tokens", type=int, default=12, help="tokens of the profiled run (default 12)")
    ap.add_argument("--functions", type=int, default=22, help="functions listed (default 22)")
    a = ap.parse_args()
    dev = str(pick_device(a.device, None))  # as `rocket_mpi decode`: on a GPU its deterministic settings
    reader = SyntheticReader(a.checkpoint, dev) if is_synthetic(a.checkpoint) else CheckpointReader(a.checkpoint)
    eng = Engine(a.checkpoint, reader=reader, device=dev)
    prompts = default_prompts(a.m, eng.cfg.vocab_size)
    eng.generate(prompts, 4)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    eng.generate(prompts, a.tokens)
    prof.disable()
    print(f"{(time.perf_counter() - t0) / a.tokens * 1e3:.2f} ms/step (incl. prefill) on {dev}, M={a.m}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.functions)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
