"""Memory stays flat over a long decode: RSS after warm-up grows by less than 10 % over the rest of the run.

One CPU rank of the tiny preset, 4 streams x 320 tokens on the host path, in a fresh process (oneDNN sizes its
caches at its first matmul, engine.ONEDNN_CACHE_SHAPES): before the fix the attention's span took a new matmul shape
every step and RSS grew by ~1.3 MiB a step (0.46 -> 0.95 GiB here); benchmarks/soak.py runs the long multi-rank
version (RSS at 100 / 1000 / 3000 tokens per rank)."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT
from rocket_mpi.cli import launch

SCRIPT = """
import json, sys, torch
from rocket_mpi.runtime.engine import Engine
from rocket_mpi.runtime.prompts import default_prompts
torch.set_num_threads(1)
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
e = Engine(sys.argv[1])
e.set_decode_path("host", "local")
seen = {}
e.generate(default_prompts(4, e.cfg.vocab_size), int(sys.argv[2]),
           on_step=lambda step, logits: seen.__setitem__(step, rss()) if step % 20 == 0 else None)
print(json.dumps(seen))
"""

WARMUP, TOKENS = 100, 320


def test_rss_is_flat_after_warmup(tiny_ckpt):
    r = subprocess.run([sys.executable, "-c", SCRIPT, tiny_ckpt, str(TOKENS)], capture_output=True, text=True,
                       timeout=240, env=launch.clean_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rss = {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    base = rss[WARMUP]
    peak = max(v for k, v in rss.items() if k >= WARMUP)
    table = ", ".join(f"{k}: {v / 2**20:.0f}" for k, v in sorted(rss.items()))
    assert peak <= 1.10 * base, f"RSS grew {100 * (peak / base - 1):.0f} % after step {WARMUP} (MiB by step: {table})"
