"""The server against the decode command at the same M: throughput, time to first token, step time.

    python benchmarks/bench_serve.py --checkpoint DIR|preset:NAME [--ranks 2] [--device cuda] [--clients 1,8,32]
                                     [--tokens 64] [--fabric shm] [--slots most|each]

Starts `serve` (under mpiexec for --ranks > 1) with as many slots as the most clients (--slots each: one server per
client count, with that many slots), then for each client count C
sends C concurrent streaming completions (greedy, fixed length: ignore_eos) of distinct prompts, and reads the
server's decode-step time from /metrics; then runs `decode --streams C` on the same prompts with the same path
(host) and, on a GPU, the graphed step, and prints one table. Throughput = completion tokens / wall time of the
C requests, time to first token (TTFT) from each request's send to its first chunk.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rocket_mpi.checkpoint.make import config_dict  # noqa: E402
from rocket_mpi.cli import launch  # noqa: E402
from rocket_mpi.runtime.prompts import default_prompts  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(ranks: int, args: list[str]) -> list[str]:
    base = [sys.executable, "-m", "rocket_mpi", *args]
    return base if ranks == 1 else [*launch.launcher(), "-n", str(ranks), *base]


def _stream(url: str, prompt: list[int], tokens: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first, n = None, 0
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter() - t0
            n += len(ids)
    return first or 0.0, time.perf_counter() - t0, n


def _metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {k: float(v) for k, v in (ln.split() for ln in text.splitlines() if ln and not ln.startswith("#"))}


def _measure(a, common: list[str], prompts: list, clients: list[int], rows: list[dict]) -> float:
    """Start a server with max(clients) slots, time each client count on it (rows appended) -> seconds to ready."""
    port = _port()
    url = f"http://127.0.0.1:{port}"
    slots = max(clients)
    srv = subprocess.Popen(_cmd(a.ranks, ["serve", *common, "--port", str(port), "--max-streams", str(slots),
                                          "--max-model-len", str(64 + a.tokens), "--log-level", "warning",
                                          "--decode-path", a.serve_path]),
                           stdout=subprocess.PIPE, text=True, env=launch.clean_env(), start_new_session=True)
    try:
        t_start = time.perf_counter()
        for line in srv.stdout:
            if "serving on" in line:
                break
        else:
            raise SystemExit("the server did not start")
        ready = time.perf_counter() - t_start
        _stream(url, prompts[0], 4)  # first request (warms the host path's allocations)
        for c in clients:
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(c) as pool:
                res = list(pool.map(lambda p: _stream(url, p, a.tokens), prompts[:c]))
            wall = time.perf_counter() - t0
            m = _metrics(url)
            ttft = sorted(r[0] for r in res)
            rows.append({"clients": c, "slots": slots, "tok_s": sum(r[2] for r in res) / wall,
                         "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2], "ttft_max_ms": 1e3 * ttft[-1],
                         "server_step_ms": 1e3 * m["rocket_step_seconds"], "fabric_share": m["rocket_fabric_share"]})
    finally:
        os.killpg(srv.pid, signal.SIGINT)
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(srv.pid, signal.SIGKILL)
    return ready


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fabric", default="auto")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--serve-path", default="auto", help="the server's --decode-path (auto: graph on a GPU)")
    ap.add_argument("--slots", choices=("most", "each"), default="most",
                    help="most: one server with as many slots as the most clients; each: a server per client count "
                         "with that many slots")
    ap.add_argument("--json", help="write the table's rows here too")
    a = ap.parse_args()
    clients = [int(c) for c in a.clients.split(",")]
    common = ["--checkpoint", a.checkpoint, "--device", a.device, "--fabric", a.fabric, "--threads", str(a.threads)]
    if os.path.isdir(a.checkpoint):
        vocab = json.load(open(os.path.join(a.checkpoint, "config.json")))["vocab_size"]
    else:  # preset:NAME[:...]
        vocab = config_dict(a.checkpoint.split(":")[1])["vocab_size"]
    prompts = default_prompts(max(clients), vocab)
    rows, ready = [], []
    groups = [clients] if a.slots == "most" else [[c] for c in clients]
    for group in groups:  # one server per group, with as many slots as its most clients
        ready.append(_measure(a, common, prompts, group, rows))
    work = tempfile.mkdtemp(prefix="bench-serve-")
    pf = os.path.join(work, "prompts.json")
    json.dump(prompts, open(pf, "w"))
    paths = ["host"] + (["graph"] if a.device == "cuda" else [])
    for row in rows:
        for path in paths:
            out = os.path.join(work, f"d{row['clients']}{path}.json")
            r = subprocess.run(_cmd(a.ranks, ["decode", *common, "--prompts", pf, "--streams", str(row["clients"]),
                                              "--tokens", str(a.tokens), "--ignore-eos", "--decode-path", path,
                                              "--out", out, "--quiet"]),
                               capture_output=True, text=True, env=launch.clean_env(), timeout=1800)
            if r.returncode:
                row[f"cli_{path}_ms"] = float("nan")
                print(f"decode --decode-path {path} failed: {r.stderr[-500:]}", file=sys.stderr)
                continue
            per = json.load(open(out))["runs"][-1]["per_rank"]
            row[f"cli_{path}_ms"] = max(p["ms_per_step"] for p in per)
        row["server_vs_cli_host"] = row["server_step_ms"] / row["cli_host_ms"]
        if "cli_graph_ms" in row:
            row["server_vs_cli_graph"] = row["server_step_ms"] / row["cli_graph_ms"]
    print(f"serve vs decode: {a.checkpoint}, {a.ranks} rank(s), device {a.device}, fabric {a.fabric}, "
          f"{a.tokens} tokens per request, server --decode-path {a.serve_path}; server ready "
          f"{max(ready):.1f} s after start")
    head = ["clients", "slots", "tok_s", "ttft_p50_ms", "ttft_max_ms", "server_step_ms", "cli_host_ms"] + \
        (["cli_graph_ms"] if "graph" in paths else []) + ["server_vs_cli_host"] + \
        (["server_vs_cli_graph"] if "graph" in paths else []) + ["fabric_share"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in head) + " |")
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
