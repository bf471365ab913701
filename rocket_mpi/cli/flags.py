"""Argument types and the flags several commands share (one name for one thing in every command)."""
from __future__ import annotations

import argparse

from rocket_mpi.checkpoint.make import all_presets
from rocket_mpi.config import PREFILL_CHUNK
from rocket_mpi.runtime.progress import LEVELS
from rocket_mpi.fabric import BACKENDS
from rocket_mpi.settings import FabricSettings, RunSettings


def int_list(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}' is not a comma-separated list of integers") from None
    if not v or any(x <= 0 for x in v):
        raise argparse.ArgumentTypeError(f"'{s}' must list positive integers")
    return v


def pos_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: '{s}'") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {v}")
    return v


def pos_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: '{s}'") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {s}")
    return v


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


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="Hugging Face checkpoint folder, or preset:NAME[:nvfp4|:nvfp4-all] (random weights made in "
                        f"memory; presets: {', '.join(all_presets())})")
    p.add_argument("--tokens", type=pos_int, default=20, help="tokens to generate per stream")
    p.add_argument("--prompts", help="JSON list of token-id lists (or strings, with tokenizer.json)")
    p.add_argument("--placement", help="JSON: MoE layer (or \"default\") -> rank of each expert")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=pos_int, default=1, help="torch threads per rank (fixed for parity)")
    p.add_argument("--startup-timeout", type=pos_float, default=600.0, help="seconds to wait for all ranks to load")
    add_fabric_flags(p)
    p.add_argument("--decode-path", default="auto", choices=("auto", "graph", "device", "host"),
                   help="GPU decode steps: graph = row plan on the device, the step one CUDA graph; device = the "
                        "same without the graph; host = row plan on the host each layer; auto = graph where it "
                        "can run (a GPU with the extension, fabric local/cuda-ipc/nccl), else host")
    p.add_argument("--prefill-chunk", type=pos_int, default=PREFILL_CHUNK,
                   help="prompt tokens per prefill forward, all streams together: longer prompts are prefilled in "
                        "chunks, which bounds the prefill's memory and the fabric's row buffers")
    p.add_argument("--log-level", default="info", choices=LEVELS,
                   help="what the ranks log on stderr (rank 0 from this level, the others warnings and errors)")


def run_settings(args, streams: list[int]) -> RunSettings:
    return RunSettings(checkpoint=args.checkpoint, streams=tuple(streams), tokens=args.tokens, prompts=args.prompts,
                       placement=args.placement, device=args.device, threads=args.threads,
                       startup_timeout=args.startup_timeout, decode_path=args.decode_path,
                       prefill_chunk=args.prefill_chunk, out=getattr(args, "out", None), fabric=fabric_settings(args),
                       log_level="warning" if getattr(args, "quiet", False) else args.log_level,
                       progress=not getattr(args, "quiet", False))
