"""static-fire: the one-rank reference and the N-rank split on the same prompts; every stream's
tokens must match exactly, and so must every step's row checksum on every rank (the checksum runs over each MoE
layer's rows in (token, expert) order, so it does not depend on the placement: any row with other bits fails, even
where the tokens do not show it). Exit 0 only on PASS."""
from __future__ import annotations

import json
import os
import tempfile

from rocket_mpi.cli import launch
from rocket_mpi.cli.flags import sampling_args
from rocket_mpi.errors import RocketError
from rocket_mpi.settings import Settings


def _decode_args(args, sweep, out):
    a = ["decode", "--checkpoint", args.checkpoint, "--sweep", ",".join(map(str, sweep)), "--tokens",
         str(args.tokens), "--threads", str(args.threads), "--out", out,
         "--fabric-timeout", str(args.fabric_timeout), "--startup-timeout", str(args.startup_timeout),
         "--device", args.device, "--decode-path", args.decode_path, "--prefill-chunk", str(args.prefill_chunk),
         "--log-level", args.log_level, "--expert-cache", args.expert_cache, "--host-memory", args.host_memory]
    if args.prompts:
        a += ["--prompts", args.prompts]
    if args.expert_cache_from:
        a += ["--expert-cache-from", args.expert_cache_from]
    return a + sampling_args(args)


def static_fire(args, settings: Settings) -> int:
    sweep = sorted(set(args.sweep))
    work = args.workdir or tempfile.mkdtemp(prefix="rocket-static-fire-")
    os.makedirs(work, exist_ok=True)
    ref_out, split_out = os.path.join(work, "reference.json"), os.path.join(work, "split.json")
    budget = args.startup_timeout + 60 + args.tokens * 30
    ref = launch.single(_decode_args(args, sweep, ref_out) + ["--fabric", "local", "--quiet"], budget)
    if ref.returncode != 0:
        raise RocketError(f"the one-rank reference failed (exit {ref.returncode}): {_tail(ref.stderr)}")
    split_args = _decode_args(args, sweep, split_out) + ["--fabric", args.fabric]
    for flag, val in (("--placement", args.placement), ("--rails", args.rails),
                      ("--rebalance-every", args.rebalance_every or None), ("--replicas", args.replicas)):
        if val is not None:
            split_args += [flag, str(val)]
    split_args += ["--rail-split-min-bytes", str(args.rail_split_min_bytes)]
    split = launch.mpirun(args.ranks, split_args, budget, launcher_cmd=args.launcher or settings.mpiexec)
    print(split.stdout, end="")
    if split.returncode != 0:
        print(f"STATIC FIRE FAIL: the {args.ranks}-rank split exited {split.returncode}: {_tail(split.stderr)}")
        return 1
    with open(ref_out) as f:
        ref_doc = json.load(f)
    with open(split_out) as f:
        split_doc = json.load(f)
    return report(ref_doc, split_doc, args.ranks)


def compare(ref_doc: dict, split_doc: dict):
    """-> (mismatched stream indices, total streams, first divergence or None)."""
    bad, first = set(), None
    total = max(r["streams"] for r in ref_doc["runs"])
    for rr, sr in zip(ref_doc["runs"], split_doc["runs"]):
        for s, (a, b) in enumerate(zip(rr["tokens"], sr["tokens"])):
            if a != b:
                bad.add(s)
                # the first token that differs, or where one stream ended (a stop) and the other went on
                step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                if first is None or (rr["streams"], step) < (first["M"], first["step"]):
                    pick = lambda xs, i: xs[i] if i < len(xs) else "(ended)"  # noqa: E731
                    first = {"M": rr["streams"], "stream": s, "step": step, "ref": pick(a, step),
                             "split": pick(b, step), "ref_crc": pick(rr["row_checksums"]["0"], step),
                             "split_crc": {k: pick(v, step) for k, v in sr["row_checksums"].items()}}
    return bad, total, first


def compare_rows(ref_doc: dict, split_doc: dict):
    """The first (M, step, rank, reference checksum, split checksum) where a split rank's row checksum differs from
    the reference's, or None."""
    for rr, sr in zip(ref_doc["runs"], split_doc["runs"]):
        want = rr["row_checksums"]["0"]
        for rank, got in sorted(sr["row_checksums"].items(), key=lambda kv: int(kv[0])):
            for step, (a, b) in enumerate(zip(want, got)):
                if a != b:
                    return rr["streams"], step, rank, a, b
            if len(want) != len(got):
                return rr["streams"], min(len(want), len(got)), rank, "(ended)", "(ended)"
    return None


def report(ref_doc: dict, split_doc: dict, ranks: int) -> int:
    if [r["streams"] for r in ref_doc["runs"]] != [r["streams"] for r in split_doc["runs"]]:
        print("STATIC FIRE FAIL: the reference and the split ran different sweeps")
        return 1
    bad, total, first = compare(ref_doc, split_doc)
    for rr, sr in zip(ref_doc["runs"], split_doc["runs"]):
        if rr.get("path") != sr.get("path"):  # e.g. a reference short of host memory reads experts on the host path
            print(f"note: at M={rr['streams']} the reference decoded on the {rr.get('path')} path and the split on the "
                  f"{sr.get('path')} path; give --decode-path to compare one path with itself")
    sweep = ",".join(str(r["streams"]) for r in ref_doc["runs"])
    where = f"{ranks} ranks, fabric {split_doc['fabric']}, sweep M={sweep}, {max(len(t) for t in ref_doc['runs'][0]['tokens'])} tokens"
    if not bad:
        rows = compare_rows(ref_doc, split_doc)
        if rows is not None:
            m, step, rank, a, b = rows
            print(f"STATIC FIRE FAIL: 0/{total} streams mismatched but the rows differ ({where}): at M={m} step "
                  f"{step} rank {rank}'s row checksum is {b}, the reference's {a}")
            return 1
        print(f"STATIC FIRE PASS: 0/{total} streams mismatched ({where})")
        print("row checksums: every rank's equal to the reference's at every step")
        return 0
    crcs = " ".join(f"rank{k}={v}" for k, v in sorted(first["split_crc"].items()))
    print(f"STATIC FIRE FAIL: {len(bad)}/{total} streams mismatched ({where}); first divergence at M={first['M']} "
          f"stream {first['stream']} step {first['step']}: reference token {first['ref']}, split token "
          f"{first['split']}; row checksums at that step: reference {first['ref_crc']}, {crcs}")
    return 1


def _tail(text: str, n: int = 6) -> str:
    """Our own error lines if there are any (a launcher's abort banner says nothing), else the last lines."""
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    ours = [ln for ln in lines if "rocket_mpi" in ln and "error" in ln]
    return " | ".join(ours[-n:] or lines[-n:]) or "(no output)"
