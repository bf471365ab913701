"""Peak host memory of one long prefill, in query-row blocks (layers.PREFILL_ROWS) or in one block (not a test).

    python scripts/bench_prefill_memory.py preset:default --lengths 1024,2048,4096

Each (length, blocks) pair runs in a fresh process on the CPU: load the model, note the resident set, prefill one
stream of that many tokens, note the peak resident set (ru_maxrss). Prints the peak above the loaded model, the
prefill's seconds and whether the next token matches the one-block run's. (On a GPU the same shapes are allocated
on the device; this is the CPU's account of them.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(ckpt: str, length: int, rows: int) -> None:
    import resource
    import time

    import torch

    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.engine import Engine
    from rocket_mpi.model import layers
    torch.set_num_threads(2)
    layers.PREFILL_ROWS = rows
    eng = Engine(ckpt, reader=SyntheticReader(ckpt, "cpu"))
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    tokens = torch.randint(2, eng.cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = eng.model.forward(tokens, eng.model.new_cache(1, length + 1), [length], eng.moe)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak": peak - base, "seconds": dt, "token": int(logits.argmax(-1)[0])}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.checkpoint, *a.child)
        return 0
    from rocket_mpi.model import layers
    print(f"{a.checkpoint}: one stream's prefill on the CPU; blocks of {layers.PREFILL_ROWS} query rows against one")
    print(f"{'tokens':>6} {'one block MiB':>13} {'blocks MiB':>10} {'ratio':>6} {'one block s':>11} {'blocks s':>8} "
          f"{'same token':>10}")
    for n in (int(x) for x in a.lengths.split(",")):
        res = []
        for rows in (n, layers.PREFILL_ROWS):
            out = subprocess.run([sys.executable, __file__, a.checkpoint, "--child", str(n), str(rows)],
                                 capture_output=True, text=True, check=True)
            res.append(json.loads(out.stdout.strip().splitlines()[-1]))
        one, blk = res
        print(f"{n:>6} {one['peak'] / 2**20:>13.0f} {blk['peak'] / 2**20:>10.0f} {one['peak'] / blk['peak']:>6.1f} "
              f"{one['seconds']:>11.2f} {blk['seconds']:>8.2f} {str(one['token'] == blk['token']):>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
