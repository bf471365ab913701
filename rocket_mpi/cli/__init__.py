"""python -m rocket_mpi {decode, static-fire, serve, make-checkpoint, fabric-bench, plan, place}: the command line.

The flags are parsed here, once, into typed settings (settings.py: RunSettings, FabricSettings, and the
environment's Settings); every layer below takes what it needs of them explicitly.
"""
from __future__ import annotations

import argparse
import sys
import time

from rocket_mpi import __version__
from rocket_mpi.checkpoint.make import all_presets, make_checkpoint
from rocket_mpi.cli import fabric_bench
from rocket_mpi.cli import place as place_cmd
from rocket_mpi.cli import plan as plan_cmd
from rocket_mpi.cli.flags import (add_run_flags, add_serve_flags, int_list, nonneg_float, pos_int, run_settings,
                                  serve_run_settings, serve_settings)
from rocket_mpi.cli.report import print_report
from rocket_mpi.cli.static_fire import static_fire
from rocket_mpi.errors import RocketError
from rocket_mpi.runtime.decode import decode
from rocket_mpi.serve import serve
from rocket_mpi.settings import Settings

PROG = "rocket_mpi"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the flag, exit 2
        print(f"{PROG}: error: {self.prog}: {message}", file=sys.stderr)
        sys.exit(2)


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description=__doc__, formatter_class=_Help)
    ap.add_argument("--version", action="version", version=f"rocket_mpi {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    d = sub.add_parser("decode", help="greedy decode M streams (alone, or under mpirun -np N)", formatter_class=_Help)
    add_run_flags(d)
    d.add_argument("--streams", type=pos_int, default=8, help="M, streams decoded together")
    d.add_argument("--sweep", type=int_list, help="several M in one run, e.g. 1,8 (overrides --streams)")
    d.add_argument("--out", help="JSON with the generated tokens (rank 0 writes it)")
    d.add_argument("--telemetry", metavar="FILE",
                   help="record the last run's routing (rows per decode step, MoE layer and expert), per rank and step "
                        "the expert and exchange times, the model's identity and the expert cache's accounting to FILE "
                        "(.npz; the place command plans from it, benchmarks/bench_cache.py replays it)")
    d.add_argument("--quiet", action="store_true", help="no report, progress bars or info lines (warnings and errors "
                                                        "still print)")

    s = sub.add_parser("static-fire", help="N-rank split vs one rank: every stream's tokens must match",
                       formatter_class=_Help)
    add_run_flags(s)
    s.add_argument("--ranks", type=pos_int, required=True)
    s.add_argument("--sweep", type=int_list, default=[1, 8])
    s.add_argument("--launcher", help="MPI launcher command (default: $ROCKET_MPIEXEC, else mpiexec beside python, "
                                      "else on PATH)")
    s.add_argument("--workdir", help="where the runs' JSON goes (default: a temporary folder)")

    m = sub.add_parser("make-checkpoint", help="write a random checkpoint of a preset shape", formatter_class=_Help)
    m.add_argument("--preset", default="default", choices=all_presets())
    m.add_argument("--out", required=True)
    g = m.add_mutually_exclusive_group()
    g.add_argument("--nvfp4", action="store_true", help="quantise the routed experts to NVFP4")
    g.add_argument("--nvfp4-all", action="store_true", help="quantise every Linear as ModelOpt does (lm_head stays BF16)")
    g.add_argument("--nvfp4-head", action="store_true", help="quantise every Linear, lm_head too (as llama.cpp's Q4_K_M "
                                                             "quantises it)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--shards", type=pos_int, default=1)
    m.add_argument("--skew", type=nonneg_float, default=0.0,
                   help="routing skew: router biases giving the experts a Zipf-like popularity (0: uniform; 1-2: a few "
                        "hot experts per layer, as real MoE routing)")

    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the split (alone, or under mpirun -np N)",
                       formatter_class=_Help)
    add_serve_flags(v)

    fabric_bench.add_parser(sub, _Help)
    plan_cmd.add_parser(sub, _Help)
    place_cmd.add_parser(sub, _Help)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
    except RocketError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "make-checkpoint":
        return _guard(lambda: _make(args))
    if args.cmd == "plan":
        return _guard(lambda: plan_cmd.plan(args))
    if args.cmd == "place":
        return _guard(lambda: place_cmd.place(args))
    if args.cmd == "static-fire":
        return _guard(lambda: static_fire(args, settings))
    if args.cmd == "fabric-bench":
        return fabric_bench.main(args, settings)
    if args.cmd == "serve":
        return serve(serve_run_settings(args), serve_settings(args), settings)
    if args.cmd == "decode":
        run = run_settings(args, args.sweep or [args.streams])
        return decode(run, settings, report=None if args.quiet else print_report)
    return 2


def _guard(fn) -> int:
    try:
        return fn() or 0
    except RocketError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


def _make(args) -> int:
    t0 = time.perf_counter()
    cfg = make_checkpoint(args.preset, args.out, args.seed, args.nvfp4, args.nvfp4_all, args.shards, skew=args.skew,
                          nvfp4_head=args.nvfp4_head)
    kind = ("NVFP4 experts" if args.nvfp4 else "NVFP4 all Linears" if args.nvfp4_all else
            "NVFP4 all Linears and lm_head" if args.nvfp4_head else "BF16")
    print(f"wrote {args.out}: preset {args.preset} ({cfg['num_hidden_layers']} layers, {cfg['n_routed_experts']} "
          f"experts, hidden {cfg['hidden_size']}), {kind}, seed {args.seed}, {time.perf_counter() - t0:.1f} s")
    return 0
