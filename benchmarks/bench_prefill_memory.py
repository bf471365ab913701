"""Peak memory of one long prefill: in one block of query rows, in blocks (layers.PREFILL_ROWS), and in blocks and
forwards of --chunk tokens (Engine._forward, --prefill-chunk) (not a test). Blocks: layers.prefill_blocks, at most
PREFILL_ROWS rows and PREFILL_SCORES score elements each.

    python benchmarks/bench_prefill_memory.py preset:default --lengths 1024,2048,4096 --chunk 1024
    python benchmarks/bench_prefill_memory.py preset:glm5-4l:nvfp4 --device cuda --lengths 2048,8192

Each (length, variant) runs in a fresh process: load the model, note the memory in use, prefill one stream of that
many tokens, note the peak (CPU: the resident set, ru_maxrss; GPU: torch's peak allocated bytes). Prints the peak
above the loaded model, the prefill's seconds (on a GPU after a 256-token prefill, so without the libraries' first
calls) and whether the next token is the one-block run's (the variants round differently; a differing token is
possible, not a failure by itself).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from rocket_mpi.config import PREFILL_CHUNK


def child(ckpt: str, length: int, rows: int, chunk: int, device: str) -> None:
    import resource
    import time

    import torch

    from rocket_mpi.checkpoint.synthetic import SyntheticReader
    from rocket_mpi.runtime.engine import Engine
    from rocket_mpi.model import layers
    torch.set_num_threads(2)
    layers.PREFILL_ROWS = rows
    if rows >= length:  # one block really: no cut by the scores' size either
        layers.PREFILL_SCORES = 1 << 62
    cuda = device == "cuda"
    if cuda:
        from rocket_mpi.runtime.decode import pick_device
        dev = pick_device("cuda", None)  # as `rocket_mpi decode`: deterministic settings
    eng = Engine(ckpt, reader=SyntheticReader(ckpt, str(dev) if cuda else "cpu"), device=str(dev) if cuda else "cpu")
    eng.prefill_chunk = chunk
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
        logits = eng._forward(tokens, cache, [length])[0]  # in chunks of eng.prefill_chunk tokens
        token = int(logits.argmax(-1)[0])
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak": peak - base, "seconds": dt, "token": token}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--chunk", type=int, default=PREFILL_CHUNK, help="prompt tokens per forward (--prefill-chunk)")
    ap.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.checkpoint, *a.child, a.device)
        return 0
    from rocket_mpi.model import layers
    print(f"{a.checkpoint}: one stream's prefill on the {a.device}: in one forward and one block of query rows; in "
          f"blocks of {layers.PREFILL_ROWS} rows; in blocks and forwards of {a.chunk} tokens (prompts longer than "
          f"that). Peak memory above the loaded model and its cache, MiB; seconds; whether the next token is the "
          f"first variant's")
    print(f"{'tokens':>6} {'one MiB':>8} {'blocks MiB':>10} {'chunks MiB':>10} {'one s':>6} {'blocks s':>8} "
          f"{'chunks s':>8} {'same token':>10}")
    for n in (int(x) for x in a.lengths.split(",")):
        res = []
        for rows, chunk in [(n, n), (layers.PREFILL_ROWS, n)] + ([(layers.PREFILL_ROWS, a.chunk)] if n > a.chunk else []):
            out = subprocess.run([sys.executable, __file__, a.checkpoint, "--device", a.device, "--child", str(n),
                                  str(rows), str(chunk)], capture_output=True, text=True)
            if out.returncode:  # e.g. out of memory in one block: said in the table's place
                err = (out.stderr.strip().splitlines() or ["?"])[-1][:160]
                print(f"{n:>6} rows {rows}, chunk {chunk}: exit {out.returncode}: {err}")
                res.append(None)
            else:
                res.append(json.loads(out.stdout.strip().splitlines()[-1]))

        res += [None] * (3 - len(res))

        def col(r, key, scale, width):
            return f"{r[key] / scale:>{width}.{0 if key == 'peak' else 2}f}" if r else f"{'-':>{width}}"
        same = all(r["token"] == res[0]["token"] for r in res if r) if res[0] else "-"
        print(f"{n:>6} " + " ".join(col(r, "peak", 2**20, w) for r, w in zip(res, (8, 10, 10)))
              + " " + " ".join(col(r, "seconds", 1, w) for r, w in zip(res, (6, 8, 8))) + f" {str(same):>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
