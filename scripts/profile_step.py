"""Where a decode step's host time goes (cProfile), one rank: python scripts/profile_step.py CKPT [cpu|cuda] [M]"""
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from rocket_mpi.checkpoint.reader import CheckpointReader  # noqa: E402
from rocket_mpi.checkpoint.synthetic import SyntheticReader, is_synthetic  # noqa: E402
from rocket_mpi.engine import Engine  # noqa: E402
from rocket_mpi.prompts import default_prompts  # noqa: E402

ckpt, dev = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu"
m = int(sys.argv[3]) if len(sys.argv) > 3 else 8
reader = SyntheticReader(ckpt, dev) if is_synthetic(ckpt) else CheckpointReader(ckpt)
eng = Engine(ckpt, reader=reader, device=dev)
prompts = default_prompts(m, eng.cfg.vocab_size)
eng.generate(prompts, 4)
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
res = eng.generate(prompts, 12)
prof.disable()
print(f"{(time.perf_counter() - t0) / 12 * 1e3:.2f} ms/step (incl. prefill) on {dev}, M={m}")
pstats.Stats(prof).sort_stats("tottime").print_stats(22)
