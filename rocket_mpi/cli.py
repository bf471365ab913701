"""python -m rocket_mpi {decode, static-fire, make-checkpoint, fabric-bench}: the command-line contract."""
from __future__ import annotations

import argparse
import json
import sys

from rocket_mpi.config import PREFILL_CHUNK
from rocket_mpi.errors import RocketError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the flag, exit 2
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _int_list(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}' is not a comma-separated list of integers") from None
    if not v or any(x <= 0 for x in v):
        raise argparse.ArgumentTypeError(f"'{s}' must list positive integers")
    return v


def _pos_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: '{s}'") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {v}")
    return v


def _pos_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: '{s}'") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {s}")
    return v


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint folder")
    p.add_argument("--tokens", type=_pos_int, default=20, help="tokens to generate per stream")
    p.add_argument("--prompts", help="JSON list of token-id lists (or strings, with tokenizer.json)")
    p.add_argument("--fabric", default="auto", choices=("auto", "local", "shm", "mpi", "verbs", "cuda-ipc", "nccl"))
    p.add_argument("--placement", help="JSON: MoE layer (or \"default\") -> rank of each expert")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=_pos_int, default=1, help="torch threads per rank (fixed for parity)")
    p.add_argument("--fabric-timeout", type=_pos_float, default=30.0, help="seconds a rank waits for a peer's rows")
    p.add_argument("--startup-timeout", type=_pos_float, default=600.0, help="seconds to wait for all ranks to load")
    p.add_argument("--rails", help="verbs: comma-separated device[:port] names (default: every active port); "
                                   "shm: a count of virtual rails")
    p.add_argument("--gid-index", type=int, default=None, help="verbs: GID index (default: RoCE v2 IPv4)")
    p.add_argument("--rail-split-min-bytes", type=_pos_int, default=8192)
    p.add_argument("--decode-path", default="auto", choices=("auto", "graph", "device", "host"),
                   help="GPU decode steps: graph = row plan on the device, the step one CUDA graph; device = the "
                        "same without the graph; host = row plan on the host each layer; auto = graph where it "
                        "can run (NVFP4 experts, glm4_moe, fabric local/cuda-ipc/nccl), else host")
    p.add_argument("--prefill-chunk", type=_pos_int, default=PREFILL_CHUNK,
                   help="prompt tokens per prefill forward, all streams together: longer prompts are prefilled in "
                        "chunks, which bounds the prefill's memory and the fabric's row buffers")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="rocket_mpi", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    d = sub.add_parser("decode", help="greedy decode M streams (alone, or under mpirun -np N)")
    add_run_flags(d)
    d.add_argument("--streams", type=_pos_int, default=8, help="M, streams decoded together")
    d.add_argument("--sweep", type=_int_list, help="several M in one run, e.g. 1,8 (overrides --streams)")
    d.add_argument("--out", help="JSON with the generated tokens (rank 0 writes it)")
    d.add_argument("--quiet", action="store_true", help="no per-rank table")

    s = sub.add_parser("static-fire", help="N-rank split vs one rank: every stream's tokens must match")
    add_run_flags(s)
    s.add_argument("--ranks", type=_pos_int, required=True)
    s.add_argument("--sweep", type=_int_list, default=[1, 8])
    s.add_argument("--launcher", help="MPI launcher command (default: mpiexec beside python, else on PATH)")
    s.add_argument("--workdir", help="where the runs' JSON goes (default: a temporary folder)")

    m = sub.add_parser("make-checkpoint", help="write a random checkpoint of a preset shape")
    m.add_argument("--preset", default="default")
    m.add_argument("--out", required=True)
    g = m.add_mutually_exclusive_group()
    g.add_argument("--nvfp4", action="store_true", help="quantise the routed experts to NVFP4")
    g.add_argument("--nvfp4-all", action="store_true", help="quantise every Linear as ModelOpt does")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--shards", type=_pos_int, default=1)

    from rocket_mpi import fabric_bench
    fabric_bench.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "make-checkpoint":
        return _guard(lambda: _make(args))
    if args.cmd == "static-fire":
        from rocket_mpi.static_fire import static_fire
        return _guard(lambda: static_fire(args))
    if args.cmd == "fabric-bench":
        from rocket_mpi import fabric_bench
        return fabric_bench.main(args)
    if args.cmd == "decode":
        from rocket_mpi.run import decode
        return decode(args)
    return 2


def _guard(fn) -> int:
    try:
        return fn() or 0
    except RocketError as e:
        print(f"rocket_mpi: error: {e}", file=sys.stderr)
        return 1


def _make(args) -> int:
    import time

    from rocket_mpi.checkpoint.make import make_checkpoint
    t0 = time.perf_counter()
    cfg = make_checkpoint(args.preset, args.out, args.seed, args.nvfp4, args.nvfp4_all, args.shards)
    kind = "NVFP4 experts" if args.nvfp4 else "NVFP4 all Linears" if args.nvfp4_all else "BF16"
    print(f"wrote {args.out}: preset {args.preset} ({cfg['num_hidden_layers']} layers, {cfg['n_routed_experts']} "
          f"experts, hidden {cfg['hidden_size']}), {kind}, seed {args.seed}, {time.perf_counter() - t0:.1f} s")
    json.dumps(cfg)
    return 0
