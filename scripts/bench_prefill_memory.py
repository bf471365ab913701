"""Peak memory of one long prefill, in query-row blocks (layers.PREFILL_ROWS) or in one block (not a test).

    python scripts/bench_prefill_memory.py preset:default --lengths 1024,2048,4096
    python scripts/bench_prefill_memory.py preset:glm5-4l:nvfp4 --device cuda --lengths 2048,8192

Each (length, blocks) pair runs in a fresh process: load the model, note the memory in use, prefill one stream of
that many tokens, note the peak (CPU: the resident set, ru_maxrss; GPU: torch's peak allocated bytes). Prints the
peak above the loaded model, the prefill's seconds (on a GPU after a 256-token prefill, so without the libraries'
first calls) and whether the next token matches the one-block run's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(ckpt: str, length: int, rows: int, device: str) -> None:
    import resource
    import time

    import torch

    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.engine import Engine
    from rocket_mpi.model import layers
    torch.set_num_threads(2)
    layers.PREFILL_ROWS = rows
    cuda = device == "cuda"
    if cuda:
        from rocket_mpi.run import _pick_device
        dev = _pick_device("cuda", None)  # as `rocket_mpi decode`: deterministic settings
    eng = Engine(ckpt, reader=SyntheticReader(ckpt, str(dev) if cuda else "cpu"), device=str(dev) if cuda else "cpu")
    tokens = torch.randint(2, eng.cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    if cuda:  # a short prefill first, so the timed one does not pay the libraries' first calls
        with torch.inference_mode():
            eng.model.forward(tokens[:256], eng.model.new_cache(1, 257), [min(length, 256)], eng.moe)
    cache = eng.model.new_cache(1, length + 1)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/statm") as f:
            base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = eng.model.forward(tokens, cache, [length], eng.moe)
        token = int(logits.argmax(-1)[0])
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak": peak - base, "seconds": dt, "token": token}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.checkpoint, *a.child, a.device)
        return 0
    from rocket_mpi.model import layers
    print(f"{a.checkpoint}: one stream's prefill on the {a.device}; blocks of {layers.PREFILL_ROWS} query rows against "
          f"one (peak memory above the loaded model and its cache)")
    print(f"{'tokens':>6} {'one block MiB':>13} {'blocks MiB':>10} {'ratio':>6} {'one block s':>11} {'blocks s':>8} "
          f"{'same token':>10}")
    for n in (int(x) for x in a.lengths.split(",")):
        res = []
        for rows in (n, layers.PREFILL_ROWS):
            out = subprocess.run([sys.executable, __file__, a.checkpoint, "--device", a.device, "--child", str(n),
                                  str(rows)], capture_output=True, text=True)
            if out.returncode:  # e.g. out of memory in one block: said in the table's place
                err = (out.stderr.strip().splitlines() or ["?"])[-1][:160]
                print(f"{n:>6} {'one block' if rows == n else 'blocks'}: exit {out.returncode}: {err}")
                res.append(None)
            else:
                res.append(json.loads(out.stdout.strip().splitlines()[-1]))
        one, blk = res
        if one is None or blk is None:
            continue
        print(f"{n:>6} {one['peak'] / 2**20:>13.0f} {blk['peak'] / 2**20:>10.0f} {one['peak'] / blk['peak']:>6.1f} "
              f"{one['seconds']:>11.2f} {blk['seconds']:>8.2f} {str(one['token'] == blk['token']):>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
