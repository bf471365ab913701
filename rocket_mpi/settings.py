"""Everything rocket_mpi reads from the environment, read once into one frozen object.

The product has no tuning switches: each code path that won its measurement is the only one. What stays are a
debugging aid that changes the bits (so the start-up handshake compares it across ranks) and test hooks:

    ROCKET_GRAPH_SPANS   smallest attention span of the fixed-shape decode step (default 256; doubling from there).
                         Small values make short test runs cross spans. Changes the bits.
    ROCKET_FAULT         test hook: 'stall|die|corrupt:rank=R,step=S' plants a stalled, dead or wrong rank at decode
                         step S; 'oom:rank=R,step=L' runs rank R out of memory loading MoE layer L's experts
    ROCKET_HOSTNAME      test hook: the host name this rank reports when the fabric is chosen
    ROCKET_MPIEXEC       the MPI launcher static-fire starts its runs with (default: mpiexec beside python)

Build-time variables (setup.py): ROCKET_CUDA_ARCHS (default "90;121"), ROCKET_NO_CUDA=1, ROCKET_PTXAS_VERBOSE=1.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from rocket_mpi.errors import RocketError

SPAN_MIN = 256  # the default smallest span of the fixed-shape step
FAULT_KINDS = ("stall", "die", "corrupt", "oom")


@dataclass(frozen=True)
class Fault:
    """A planted fault (ROCKET_FAULT): `kind` at decode step `step` on rank `rank` (for oom: MoE layer `step`)."""
    kind: str
    rank: int
    step: int


@dataclass(frozen=True)
class Settings:
    graph_span_min: int = SPAN_MIN
    fault: Fault | None = None
    hostname: str | None = None
    mpiexec: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """The settings of this process's environment; a malformed value is one error naming the variable."""
        env = os.environ if env is None else env
        return cls(graph_span_min=_span(env.get("ROCKET_GRAPH_SPANS", "")), fault=parse_fault(env.get("ROCKET_FAULT")),
                   hostname=env.get("ROCKET_HOSTNAME") or None, mpiexec=env.get("ROCKET_MPIEXEC") or None)

    def bits(self) -> dict:
        """What changes the tokens a rank computes: every rank must hold the same (the handshake compares it)."""
        return {"graph_span_min": self.graph_span_min}


def _span(v: str) -> int:
    if v in ("", "auto"):
        return SPAN_MIN
    if v.isdigit() and int(v) > 0:
        return int(v)
    raise RocketError(f"ROCKET_GRAPH_SPANS={v!r}: expected a positive integer (the smallest attention span of the "
                      f"graphed decode step; default {SPAN_MIN})")


def parse_fault(spec: str | None) -> Fault | None:
    """'stall:rank=1,step=2' -> Fault('stall', 1, 2); rank and step default to 1."""
    if not spec:
        return None
    kind, _, rest = spec.partition(":")
    try:
        kv = dict(p.split("=", 1) for p in rest.split(",") if p)
        if kind not in FAULT_KINDS or set(kv) - {"rank", "step"}:
            raise ValueError
        return Fault(kind, int(kv.get("rank", 1)), int(kv.get("step", 1)))
    except ValueError:
        raise RocketError(f"ROCKET_FAULT={spec!r}: expected KIND:rank=R,step=S with KIND one of "
                          f"{', '.join(FAULT_KINDS)}") from None


@dataclass(frozen=True)
class FabricSettings:
    """How the ranks exchange rows (--fabric and its flags)."""
    name: str = "auto"               # auto, local, shm, mpi, verbs, cuda-ipc, nccl
    timeout: float = 30.0            # seconds any wait for a peer may last
    rails: str | None = None         # verbs: device[:port] names; shm: a count of virtual rails
    gid_index: int | None = None     # verbs: GID index (None: RoCE v2 IPv4)
    rail_split_min_bytes: int = 8192  # payloads of at least this many bytes are split over the rails

    def rail_spec(self, fabric: str):
        """--rails as the fabric takes it: a count for shm, a list of names for verbs, None for the default."""
        if not self.rails:
            return None
        if fabric == "shm":
            return int(self.rails) if self.rails.isdigit() else len(self.rails.split(","))
        return self.rails.split(",")


@dataclass(frozen=True)
class RunSettings:
    """One decode run (the decode command's flags, parsed once at the command line)."""
    checkpoint: str
    streams: tuple[int, ...] = (8,)  # M of each run of the sweep
    tokens: int = 20
    prompts: str | None = None
    placement: str | None = None
    device: str = "cpu"
    threads: int = 1
    startup_timeout: float = 600.0
    decode_path: str = "auto"
    prefill_chunk: int = 4096
    out: str | None = None
    fabric: FabricSettings = FabricSettings()
    log_level: str = "info"          # debug, info, warning, error
    progress: bool = True            # rank 0's progress bars (off with --quiet)
    temperature: float = 0.0         # 0: greedy (runtime/sampling.py)
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0                    # stream s of the prompts draws with seed + s
    stop: tuple[str, ...] = ()       # strings that end a stream (besides the checkpoint's end-of-text ids)
    ignore_eos: bool = False         # fixed lengths: only --tokens ends a stream
    chat: str | None = None          # a JSON file of conversations, rendered with the checkpoint's chat template
    expert_cache: str = "auto"       # GiB of routed experts in device memory per rank, or auto (moe/cache.py)
    host_memory: str = "auto"        # GiB of host memory for a GPU rank's far experts, or auto (moe/cache.py)
    expert_cache_from: str | None = None  # a routing trace (decode --telemetry) the expert cache starts from
    telemetry: str | None = None     # where rank 0 writes the routing trace and the expert cache's accounting
    rebalance_every: int = 0         # decode steps between live rebalancings (moe/rebalance.py), 0: never
    replicas: int | None = None      # extra expert copies per MoE layer rebalancing may place (None: the placement's)
