"""Argument types and the flags several commands share (one name for one thing in every command)."""
from __future__ import annotations

import argparse

from rocket_mpi.checkpoint.make import all_presets
from rocket_mpi.config import PREFILL_CHUNK
from rocket_mpi.runtime.progress import LEVELS
from rocket_mpi.errors import RocketError
from rocket_mpi.fabric import BACKENDS
from rocket_mpi.moe.cache import parse_budget
from rocket_mpi.serve import ServeSettings
from rocket_mpi.settings import FabricSettings, RunSettings


def int_list(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}' is not a comma-separated list of integers") from None
    if not v or any(x <= 0 for x in v):
        raise argparse.ArgumentTypeError(f"'{s}' must list positive integers")
    return v


def _number(s: str, kind, ok, want: str):
    """s as `kind` (int or float) where ok(value), else the flag's one-line error."""
    try:
        v = kind(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {'int value' if kind is int else 'number'}: '{s}'") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"must be {want}, got {s}")
    return v


def pos_int(s: str) -> int:
    return _number(s, int, lambda v: v > 0, "positive")


def nonneg_int(s: str) -> int:
    return _number(s, int, lambda v: v >= 0, ">= 0")


def pos_float(s: str) -> float:
    return _number(s, float, lambda v: 0 < v < float("inf"), "a positive finite number")


def nonneg_float(s: str) -> float:
    return _number(s, float, lambda v: 0 <= v < float("inf"), "a finite number >= 0")


def unit_float(s: str) -> float:
    return _number(s, float, lambda v: 0 < v <= 1, "in (0, 1]")


def port_number(s: str) -> int:
    return _number(s, int, lambda v: 0 <= v < 65536, "a port, 0..65535")


def add_fabric_flags(p: argparse.ArgumentParser, choices=BACKENDS) -> None:
    p.add_argument("--fabric", default="auto", choices=choices,
                   help="how ranks exchange rows; auto: verbs across hosts with RDMA, shm / cuda-ipc on one host, "
                        "else mpi / nccl")
    p.add_argument("--fabric-timeout", "--timeout", dest="fabric_timeout", type=pos_float, default=30.0,
                   help="seconds any wait for a peer may last")
    p.add_argument("--rails", help="verbs: comma-separated device[:port] names (default: every active port); "
                                   "shm: a count of virtual rails")
    p.add_argument("--gid-index", type=int, default=None, help="verbs: GID index (default: RoCE v2 IPv4)")
    p.add_argument("--rail-split-min-bytes", "--split-min", dest="rail_split_min_bytes", type=pos_int, default=8192,
                   help="payloads of at least this many bytes are split over the rails")


def fabric_settings(args) -> FabricSettings:
    return FabricSettings(args.fabric, args.fabric_timeout, args.rails, args.gid_index, args.rail_split_min_bytes)


def cache_budget(text: str) -> str:
    """--expert-cache: auto, or GiB >= 0 (kept as given: static-fire passes it on)."""
    try:
        parse_budget(text)
    except RocketError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None
    return text


def add_rank_flags(p: argparse.ArgumentParser) -> None:
    """What every rank of a decoding job is given: the checkpoint, its split, the device, the fabric, the path."""
    p.add_argument("--checkpoint", required=True,
                   help="Hugging Face checkpoint folder, or preset:NAME[:nvfp4|:nvfp4-all|:nvfp4-head] (random weights made in "
                        f"memory; presets: {', '.join(all_presets())})")
    p.add_argument("--placement", help="JSON: MoE layer (or \"default\") -> rank, or list of ranks (replicas), of "
                                       "each expert")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=pos_int, default=1, help="torch threads per rank (fixed for parity)")
    p.add_argument("--startup-timeout", type=pos_float, default=600.0, help="seconds to wait for all ranks to load")
    p.add_argument("--expert-cache", type=cache_budget, default="auto", metavar="GIB|auto",
                   help="GiB of this rank's routed-expert weights kept in device memory; the rest sits in pinned host "
                        "memory (GPU) or is read from the checkpoint (CPU) when a step needs it. auto: all where they "
                        "fit beside the stack, KV cache and workspaces, else as much as fits")
    p.add_argument("--host-memory", type=cache_budget, default="auto", metavar="GIB|auto",
                   help="GPU ranks: GiB of host memory for the routed experts outside device memory; where they need "
                        "more, each layer keeps as many as fit and reads the others from the checkpoint files when a "
                        "step needs them (on the host decode path). auto: the host's available memory (its share)"),
    p.add_argument("--expert-cache-from", metavar="TRACE",
                   help="start the expert cache from a routing trace recorded with decode --telemetry (of this "
                        "model): each layer keeps the experts that fired in most of its steps resident from the first "
                        "step, and the cache's scores start at their rates, instead of the lowest ids and no history")
    add_fabric_flags(p)
    p.add_argument("--decode-path", default="auto", choices=("auto", "graph", "device", "host"),
                   help="GPU decode steps: graph = row plan on the device, the step one CUDA graph; device = the "
                        "same without the graph; host = row plan on the host each layer; auto = graph where it "
                        "can run (a GPU with the extension, any fabric but mpi), else host")
    p.add_argument("--prefill-chunk", type=pos_int, default=PREFILL_CHUNK,
                   help="prompt tokens per prefill forward, all streams together: longer prompts are prefilled in "
                        "chunks, which bounds the prefill's memory and the fabric's row buffers")
    p.add_argument("--log-level", default="info", choices=LEVELS,
                   help="what the ranks log on stderr (rank 0 from this level, the others warnings and errors)")


def add_rebalance_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rebalance-every", type=nonneg_int, default=0, metavar="STEPS",
                   help="every STEPS decode steps, every rank recomputes the placement from the decayed firing counts "
                        "(the same on every rank) and reads the experts it gains from the checkpoint (0: never)")
    p.add_argument("--replicas", type=nonneg_int, default=None, metavar="R",
                   help="with --rebalance-every: at most R extra copies of the hottest experts per MoE layer "
                        "(default: as many as the --placement file has, else 0)")


def add_run_flags(p: argparse.ArgumentParser) -> None:
    add_rank_flags(p)
    add_rebalance_flags(p)
    p.add_argument("--tokens", type=pos_int, default=20, help="tokens to generate per stream")
    p.add_argument("--prompts", help="JSON list of token-id lists (or strings, with tokenizer.json)")
    p.add_argument("--chat", help="JSON list of conversations (lists of {role, content} messages), rendered with the "
                                  "checkpoint's chat template (instead of --prompts)")
    g = p.add_argument_group("sampling and stopping (greedy and end-of-text by default)")
    g.add_argument("--temperature", type=nonneg_float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=unit_float, default=1.0, help="keep the most likely tokens up to this mass")
    g.add_argument("--top-k", type=nonneg_int, default=0, help="keep this many most likely tokens (0: all)")
    g.add_argument("--seed", type=int, default=0, help="stream s draws with seed + s, from (seed, position) alone")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a stream once its text holds TEXT (repeatable; needs tokenizer.json)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not end streams at the checkpoint's end-of-text ids (fixed lengths, for benchmarks)")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    add_rank_flags(p)
    add_rebalance_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address rank 0 listens on")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--max-streams", type=pos_int, default=8,
                   help="stream slots decoded together; more requests wait for a free slot")
    p.add_argument("--max-model-len", type=pos_int, default=None,
                   help="positions per slot, prompt and completion together (default: the model's, at most 8192)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the checkpoint folder's)")
    p.add_argument("--reasoning-parser", choices=("glm",),
                   help="glm: chat completions return what the model writes between <think> and </think> as "
                        "reasoning_content, apart from the content (default: the text as written)")
    p.add_argument("--telemetry", metavar="FILE",
                   help="record the routing of every decode step served (rows per step, MoE layer and expert) and the "
                        "model's identity; rank 0 writes FILE (.npz, as decode --telemetry) when the server shuts "
                        "down: plan a placement from it (place) or start a cache from it (--expert-cache-from)")


def serve_run_settings(args) -> RunSettings:
    return RunSettings(checkpoint=args.checkpoint, streams=(), tokens=1, placement=args.placement, device=args.device,
                       threads=args.threads, startup_timeout=args.startup_timeout, decode_path=args.decode_path,
                       prefill_chunk=args.prefill_chunk, fabric=fabric_settings(args), log_level=args.log_level,
                       progress=True, expert_cache=args.expert_cache, host_memory=args.host_memory,
                       expert_cache_from=args.expert_cache_from, rebalance_every=args.rebalance_every,
                       replicas=args.replicas, telemetry=args.telemetry)


def serve_settings(args) -> ServeSettings:
    return ServeSettings(args.host, args.port, args.max_streams, args.max_model_len or 0, args.served_model_name,
                         args.reasoning_parser)


def run_settings(args, streams: list[int]) -> RunSettings:
    return RunSettings(checkpoint=args.checkpoint, streams=tuple(streams), tokens=args.tokens, prompts=args.prompts,
                       placement=args.placement, device=args.device, threads=args.threads,
                       startup_timeout=args.startup_timeout, decode_path=args.decode_path,
                       prefill_chunk=args.prefill_chunk, out=getattr(args, "out", None), fabric=fabric_settings(args),
                       log_level="warning" if getattr(args, "quiet", False) else args.log_level,
                       progress=not getattr(args, "quiet", False), temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                       ignore_eos=args.ignore_eos, chat=args.chat, expert_cache=args.expert_cache,
                       host_memory=args.host_memory, expert_cache_from=args.expert_cache_from,
                       telemetry=getattr(args, "telemetry", None), rebalance_every=args.rebalance_every,
                       replicas=args.replicas)


def sampling_args(args) -> list[str]:
    """The sampling and stopping flags as given, for a command that starts decode runs (static-fire)."""
    a = ["--temperature", repr(args.temperature), "--top-p", repr(args.top_p), "--top-k", str(args.top_k),
         "--seed", str(args.seed)]
    for st in args.stop:
        a += ["--stop", st]
    if args.ignore_eos:
        a.append("--ignore-eos")
    if args.chat:
        a += ["--chat", args.chat]
    return a
