"""CPU decode benchmark (not a test): one table, everything measured side by side in one run.

- rocket_mpi decode tok/s at M=1 and M=8, one rank, beside transformers' generate on the same weights
  with the same thread count;
- 1 rank vs the 2-rank expert split (shm and mpi fabrics), with fabric ms per step.

Usage: python benchmarks/bench.py --checkpoint runs/default [--tokens 20] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from rocket_mpi.cli import launch
from rocket_mpi.runtime.prompts import default_prompts


def ours_split(ckpt, ranks, fabric, sweep, tokens, threads):
    out = os.path.join(tempfile.mkdtemp(), "o.json")
    args = ["decode", "--checkpoint", ckpt, "--sweep", ",".join(map(str, sweep)), "--tokens", str(tokens),
            "--threads", str(threads), "--out", out, "--quiet", "--fabric", fabric]
    r = launch.mpirun(ranks, args, 900) if ranks > 1 else launch.single(args, 900)
    if r.returncode != 0:
        raise SystemExit(f"decode failed: {r.stderr[-2000:]}")
    with open(out) as f:
        doc = json.load(f)
    res = {}
    for run in doc["runs"]:
        rows = run["per_rank"]
        res[run["streams"]] = {"ms": max(s["ms_per_step"] for s in rows), "fabric_ms": [s["fabric_ms"] for s in rows],
                               "kib": max(s["bytes_per_step"] for s in rows) / 1024}
    return res, doc["tokens"]


def transformers_ms(ckpt, m, tokens, threads):
    """Median-free but fair: generate() wall time per new token, prefill excluded by a 1-token run."""
    from transformers import Glm4MoeForCausalLM
    torch.set_num_threads(threads)
    model = Glm4MoeForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    prompts = default_prompts(m, model.config.vocab_size)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        t2 = time.perf_counter()
    return 1e3 * ((t2 - t1) - (t1 - t0)) / (tokens - 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    sweep = [1, 8]
    one, ref_tokens = ours_split(a.checkpoint, 1, "local", sweep, a.tokens, a.threads)
    rows = []
    for m in sweep:
        hf = transformers_ms(a.checkpoint, m, a.tokens, a.threads)
        rows.append(("transformers generate, 1 proc", m, hf, None, None))
        rows.append(("rocket_mpi, 1 rank", m, one[m]["ms"], None, None))
    for fabric in ("shm", "mpi"):
        res, toks = ours_split(a.checkpoint, 2, fabric, sweep, a.tokens, a.threads)
        same = "yes" if toks == ref_tokens else "NO"
        for m in sweep:
            rows.append((f"rocket_mpi, 2 ranks, {fabric} (same tokens: {same})", m, res[m]["ms"],
                         "/".join(f"{x:.2f}" for x in res[m]["fabric_ms"]), res[m]["kib"]))
    print(f"\nCPU decode, {a.checkpoint}, {a.threads} thread(s) per process, {os.cpu_count()} cores, "
          f"{a.tokens} tokens; ms/step of the timed decode steps (slowest rank)")
    print(f"{'what':<52} {'M':>3} {'ms/step':>9} {'tok/s':>8} {'vs HF':>6} {'fabric ms r0/r1':>16} {'KiB/step':>9}")
    hf_ms = {r[1]: r[2] for r in rows if r[0].startswith("transformers")}
    for name, m, ms, fab, kib in sorted(rows, key=lambda r: r[1]):
        print(f"{name:<52} {m:>3} {ms:>9.2f} {m * 1e3 / ms:>8.1f} {hf_ms[m] / ms:>5.2f}x {fab or '-':>16} "
              f"{'-' if kib is None else f'{kib:.1f}':>9}")


if __name__ == "__main__":
    main()
