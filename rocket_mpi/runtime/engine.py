"""The decode engine: replicated BF16 stack + this rank's experts + a fabric for the rows.

One forward is one step (the prefill is step 0). Per MoE layer: route (same on every rank), plan
the canonical rows, compute this rank's block, exchange, scatter. Nothing about routing crosses
the fabric, only finished BF16 rows.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field

import torch

from rocket_mpi import ops
from rocket_mpi.checkpoint.reader import CheckpointReader, all_finite, finite_range, value_range
from rocket_mpi.config import PREFILL_CHUNK, ModelConfig
from rocket_mpi.errors import AgreedError, RocketError
from rocket_mpi.fabric.base import Fabric, LocalFabric
from rocket_mpi.model import model_class
from rocket_mpi.model.layers import loading_for
from rocket_mpi.moe.cache import ExpertCache, expert_bytes, first_resident, plan_residency, warm_upkeep
from rocket_mpi.moe.experts import ExpertStore
from rocket_mpi.moe.placement import Placement
from rocket_mpi.moe.rebalance import Rebalancer, fixed_slots
from rocket_mpi.moe.step import HostMoE
from rocket_mpi.ops import plan as kplan
from rocket_mpi.runtime.dist import mark
from rocket_mpi.runtime.graph import STEPS_AHEAD, GraphStep, unsupported
from rocket_mpi.runtime.progress import bar
from rocket_mpi.runtime.sampling import GREEDY, Sampling, Stop, choose
from rocket_mpi.settings import Settings

WARMUP_STEPS = 3
CACHE_QUANTUM = 64  # cache positions per stream: a multiple of this (Engine.generate)
TIMED_STEPS = 10
LONG_RUN = 64  # decode steps from which rank 0 shows them as they happen (Engine.progress)
MAINTAIN_EVERY = 8  # fixed-shape decode steps between the expert cache's upkeeps (a pause in the steps launched ahead)
# oneDNN (torch's CPU BF16 matmuls) compiles kernels for each new matmul shape and keeps them in two caches of 1024
# shapes (ideep's and oneDNN's own, about half a MiB a shape): a long CPU decode, whose attention span takes new
# shapes as it grows, kept gaining RSS (~1 MiB a step) until they filled. A step's own shapes are a few dozen; both
# caches read their size once, at the first matmul of the process, so it is set here, before any.
ONEDNN_CACHE_SHAPES = 64
for _name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    os.environ.setdefault(_name, str(ONEDNN_CACHE_SHAPES))


def prefill_chunks(seqlens: list[int], chunk: int) -> list[list[int]]:
    """The prompts (seqlens[s] tokens for stream s) cut into forwards of at most `chunk` tokens, all streams together.
    Each stream's prompt is cut at multiples of `chunk` from its own start, whatever the other prompts are, so a
    stream's prefill does not depend on its batch (batch invariance); a forward takes, stream by stream, the next
    piece of each stream that still fits, at most one piece per stream. -> per forward, the tokens of each stream."""
    if chunk < 1:
        raise ValueError(f"prefill chunk {chunk}: at least 1 token")
    out, used = [], [0] * len(seqlens)
    while any(u < n for u, n in zip(used, seqlens)):
        counts, room = [0] * len(seqlens), chunk
        for s, n in enumerate(seqlens):
            take = min(chunk, n - used[s])
            if 0 < take <= room:
                counts[s], used[s], room = take, used[s] + take, room - take
        out.append(counts)
    return out


@dataclass
class StepLog:
    seconds: float
    fabric_seconds: float
    rows_owned: int
    rows_total: int
    bytes_sent: int
    row_crc: int
    weight_bytes: int = 0    # weights this rank read: the replicated stack + the experts it ran
    expert_seconds: float = float("nan")  # in this rank's experts (host path; HostMoE.timings)
    wait_seconds: float = float("nan")    # in the exchange: copies, doorbells, waiting for the peers (host path)
    expert_cpu_seconds: float = float("nan")  # this process's CPU time in its experts (CPU ranks, host path)


@dataclass
class RunResult:
    streams: int
    tokens: list[list[int]]
    steps: list[StepLog] = field(default_factory=list)
    path: str = "host"       # the decode steps' path: host, device or graph (runtime/graph.py)
    note: str = ""           # why a wanted graph did not capture, if it did not
    spans: list = field(default_factory=list)  # the fixed-shape step's (first step, span) pairs (graph.span_for)
    prefill: tuple = (0, 1)  # (prompt tokens, forwards they took: more than one where they pass --prefill-chunk)
    finish: list = field(default_factory=list)  # per stream: "stop" (an end-of-text id or stop string), "length"
    expert_cache: dict | None = None  # the expert cache's accounting over the decode steps (moe/cache.py summary)
    rebalance: dict | None = None     # live rebalancing over the decode steps (moe/rebalance.py RebalanceStats)

    def timed(self) -> list[StepLog]:
        """Decode steps after the warm-up (step 0 is the prefill)."""
        decode = self.steps[1:]
        return decode[WARMUP_STEPS:WARMUP_STEPS + TIMED_STEPS] if len(decode) > WARMUP_STEPS else decode

    def summary(self, rank: int) -> dict:
        t = self.timed()
        n = max(len(t), 1)
        ms = 1e3 * sum(s.seconds for s in t) / n
        fab = 1e3 * sum(s.fabric_seconds for s in t) / n
        return {"rank": rank, "M": self.streams, "steps": len(t), "ms_per_step": ms,
                "tok_per_s": self.streams * 1e3 / ms if ms else 0.0, "fabric_ms": fab,
                "fabric_pct": 100.0 * fab / ms if ms else 0.0,
                "bytes_per_step": sum(s.bytes_sent for s in t) / n,
                "rows_per_step": sum(s.rows_owned for s in t) / n,
                "rows_total_per_step": sum(s.rows_total for s in t) / n,
                "weight_bytes_per_step": sum(s.weight_bytes for s in t) / n, "path": self.path,
                "expert_ms": _ms(s.expert_seconds for s in t), "wait_ms": _ms(s.wait_seconds for s in t),
                "expert_cpu_ms": _ms(s.expert_cpu_seconds for s in t),
                "prefill_s": self.steps[0].seconds if self.steps else 0.0,
                "decode_steps": len(self.steps[1:]), "decode_s": sum(s.seconds for s in self.steps[1:]),
                "rebalance": self.rebalance}


def _ms(seconds) -> float | None:
    """Mean milliseconds, None where not measured (the fixed-shape step times no part of itself)."""
    v = [1e3 * x for x in seconds if x == x]
    return sum(v) / len(v) if v else None


class WatchedMoE(HostMoE):
    """HostMoE that also keeps, each step, the min and max of every MoE layer's input (the normalised hidden state)
    and output, so that a NaN or Inf that reaches the logits can be traced to the first MoE layer it passed
    (Engine.check_logits). Two min/max passes over [tokens, hidden] a layer, left on the device: they are read back
    only when the logits are not finite, so the step's path has no extra host sync."""

    def reset(self) -> None:
        super().reset()
        self.ranges: list[tuple[str, torch.Tensor | None]] = []  # (where, value_range) in the step's order

    def __call__(self, layer, x, L, shared=None, residual=None, next_norm=None):
        mark(self.engine.step, layer)  # where this rank is, should it die (runtime/dist.py Sentinel)
        self.ranges.append((f"entering MoE layer {layer} (from the layers before it, or its attention)",
                            value_range(x)))
        out = super().__call__(layer, x, L, shared, residual, next_norm)
        self.ranges.append((f"leaving MoE layer {layer} (its experts' rows, shared expert or residual)",
                            value_range(out)))
        return out

    @property
    def bad(self) -> str | None:
        """The first place this step held a NaN or Inf, or None."""
        return next((where for where, r in self.ranges if not finite_range(r)), None)


def out_of_memory(rank: int, size: int, device: torch.device, what: str, err: BaseException) -> RocketError:
    """One line for a rank whose share of the model does not fit: where, what it was loading, how much was
    in use, and what would make it fit."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        where = (f"memory on GPU {device} ({torch.cuda.get_device_name(device)}, {total / 2**30:.1f} GiB, "
                 f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated by this rank)")
    else:
        where = "host memory"
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return RocketError(f"rank {rank} of {size}: out of {where} while loading {what} ({first}): this "
                       f"rank's share does not fit; use more ranks, NVFP4 experts, or a --placement that gives "
                       f"it fewer experts")


class Engine:
    def __init__(self, ckpt_dir: str, rank: int = 0, size: int = 1, placement: Placement | None = None,
                 reader: CheckpointReader | None = None, device: str = "cpu", settings: Settings | None = None,
                 progress: bool = False, expert_cache: float | None = None, share: int = 1, telemetry: bool = False,
                 rebalance_every: int = 0, replicas: int | None = None, host_memory: float | None = None,
                 cache_from: dict | None = None):
        """expert_cache: GiB of routed-expert weights this rank keeps in device memory (moe/cache.py), None: auto
        (all where they fit, else what fits); share: ranks sharing this rank's device (auto splits its memory);
        telemetry: record the routing of every decode step (ExpertCache.trace); rebalance_every: recompute the
        placement from the decayed firing counts every this many decode steps (moe/rebalance.py; 0: never), with up
        to `replicas` extra copies per MoE layer (None: as many as the placement has); host_memory: GiB of host memory
        for a GPU rank's far experts (None: its share of what is available; where they need more, the others stay in
        the checkpoint files, moe/cache.py plan_capacity); cache_from: per MoE layer, the share of a recorded trace's
        steps in which each expert fired (runtime/telemetry.py cache_start): a bounded cache starts with each layer's
        most fired experts resident and its scores at those rates."""
        t0 = time.perf_counter()
        self.settings = settings or Settings.from_env()  # the command line passes the one it read
        self.reader = reader or CheckpointReader(ckpt_dir)
        self.cfg: ModelConfig = self.reader.config
        self.rank, self.size = rank, size
        self.placement = placement or Placement.contiguous(self.cfg, size)
        n_exp = self.cfg.n_routed_experts
        if replicas is None:
            replicas = max((self.placement.replicas(la) for la in self.cfg.moe_layers), default=0)
        # live rebalancing keeps a fixed number of expert slots per layer and pair-table entries (moe/rebalance.py)
        slots = fixed_slots(self.placement, n_exp, replicas) if rebalance_every else 0
        self.pair_capacity = max([self.placement.table(la).n_pairs for la in self.cfg.moe_layers]
                                 + [min(n_exp + replicas, n_exp * size) if rebalance_every else 0])
        model_cls = model_class(self.cfg.model_type)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        fault = self.settings.fault
        what = "the replicated stack"
        try:
            with loading_for(self.device):  # a GPU keeps NVFP4 stack weights packed alone: never dequantised
                self.model = model_cls.load(self.reader)
            prefix = getattr(model_cls, "expert_prefix", lambda reader, layer: None)
            self.experts = {}
            owned_all = {layer: self.placement.owned(layer, rank) for layer in self.cfg.moe_layers}
            # NVFP4 experts: all three parts NVFP4 (weight_scale_2: not FP8's scales); an expert whose parts mix
            # formats runs BF16 (ExpertStore.load). The same on every rank.
            nvfp4 = any(all(f"{prefix(self.reader, la) or f'model.layers.{la}.mlp.experts'}.0.{p}.weight_scale_2"
                            in self.reader for p in ("gate_proj", "up_proj", "down_proj"))
                        for la in self.cfg.moe_layers)
            self.cache_plan = plan_residency(self.cfg, owned_all, self.device, self.model.nbytes(), expert_cache,
                                             share, rank, nvfp4, packed=ops.on_gpu(self.device), slots=slots,
                                             host_gib=host_memory)
            loading = bar("loading MoE layers", len(self.cfg.moe_layers), progress, unit="layer")
            for layer in self.cfg.moe_layers:
                owned = owned_all[layer]
                what = f"MoE layer {layer}'s experts ({len(owned)} of {self.cfg.n_routed_experts} on this rank)"
                if fault and fault.kind == "oom" and fault.rank == rank and fault.step == layer:
                    raise torch.OutOfMemoryError("ROCKET_FAULT: injected out of memory")
                keep = self.cache_plan.capacity
                room = max(len(owned), slots)
                self.experts[layer] = ExpertStore.load(self.reader, layer, owned, prefix(self.reader, layer),
                                                       self.device, None if keep >= room else
                                                       first_resident(owned, keep, (cache_from or {}).get(layer)),
                                                       room, min(keep, room),
                                                       self.cache_plan.far_slots)
                loading.update()
            loading.close()
            if self.device.type != "cpu":
                what = f"the replicated stack onto {self.device}"
                self.model.to(self.device)
                what = f"the experts onto {self.device}"
                for store in self.experts.values():
                    store.to(self.device)
        except (torch.OutOfMemoryError, MemoryError) as e:
            raise out_of_memory(rank, size, self.device, what, e) from None
        if self.device.type == "cuda":  # the load's copies and packing kernels, not the first step, pay for the load
            torch.cuda.synchronize(self.device)
        self.load_seconds = time.perf_counter() - t0
        self.expert_cache: ExpertCache | None = None
        if self.experts and (telemetry or rebalance_every or any(s.capacity < len(s.owned)
                                                                 for s in self.experts.values())):
            self.expert_cache = ExpertCache(self.experts, list(self.cfg.moe_layers), self.cfg.n_routed_experts,
                                            trace=[] if telemetry else None)
            if cache_from:
                self.expert_cache.start_from(cache_from)
        self.rebalancer: Rebalancer | None = None
        if rebalance_every and self.expert_cache is not None:  # the cache's counters feed the decayed counts
            bpe = expert_bytes(self.cfg.hidden_size, self.cfg.moe_intermediate_size, nvfp4, ops.on_gpu(self.device))
            self.rebalancer = Rebalancer(self, rebalance_every, replicas, bpe, slots, self.pair_capacity)
            self.expert_cache.listeners.append(self.rebalancer.observe)
        self.fabric: Fabric = LocalFabric(0, 1, 0, self.cfg.hidden_size, 1.0)
        self.seq = 0   # the exchanges so far: each one's doorbell value
        self.step = 0
        self.moe = WatchedMoE(self)
        self.steps_ahead = STEPS_AHEAD  # graphed steps launched before the oldest is read back (tests vary it)
        self.decode_path = "host"
        self.prefill_chunk = PREFILL_CHUNK
        self.decode_path_auto = False  # set_decode_path: auto falls back to host where a step exceeds a limit
        self.progress = progress       # progress bars for long prefills and runs (rank 0)

    def set_decode_path(self, want: str, fabric_name: str) -> str:
        """auto | graph | device | host (runtime/graph.py): where decode steps plan their rows and
        whether they run as one CUDA graph. auto takes graph where it can run. Returns the path taken."""
        why = unsupported(self, fabric_name, graph=want != "device")
        self.decode_path_auto = want == "auto"
        if want == "auto":  # graph where it runs and its capture has been checked on a GPU for this family
            checked = getattr(self.model, "GRAPH_CHECKED", False)
            self.decode_path = "graph" if not why and checked else "host"
        elif want in ("graph", "device"):
            if why:
                raise RocketError(f"--decode-path {want}: not possible here: {why}")
            self.decode_path = want
        elif want == "host":
            self.decode_path = "host"
        else:
            raise RocketError(f"--decode-path: unknown path {want!r} (auto, graph, device, host)")
        return self.decode_path

    def path_for(self, streams: int) -> str:
        """The decode path for `streams` streams decoded together: the fixed-shape step has a stream limit (the same on
        every rank: same streams, same model); past it auto falls back to host, a path asked for by name fails."""
        if self.decode_path == "host":
            return "host"
        why = kplan.stream_limit(streams, self.cfg)
        if why and self.decode_path_auto:
            return "host"
        if why:
            raise RocketError(f"--decode-path {self.decode_path}: {why}; use fewer streams or --decode-path host")
        return self.decode_path

    # -- accounting ------------------------------------------------------------------
    def resident_bytes(self) -> int:
        return self.model.nbytes() + sum(s.resident_bytes() for s in self.experts.values())

    def stack_read_bytes(self) -> int:
        """The replicated stack is read whole each step, but for the embedding (M rows of it)."""
        emb = self.model.embed
        tied = getattr(self.model, "lm_head", None) is emb
        return self.model.nbytes() - (0 if tied else emb.numel() * emb.element_size())

    def owned_experts(self) -> int:
        return sum(len(s.owned) for s in self.experts.values())

    @staticmethod
    def peak_rss_bytes() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # -- generation ------------------------------------------------------------------
    def max_rows(self, prompts_list: list[list[list[int]]]) -> int:
        # a prefill chunk's rows, or the graphed decode step's: each rank's block at a fixed place (runtime/graph.py)
        worst = max(max(min(sum(len(p) for p in prompts), self.prefill_chunk), len(prompts) * self.size)
                    for prompts in prompts_list)
        return worst * self.cfg.num_experts_per_tok

    def check_prompts(self, prompts: list[list[int]], n_tokens: int) -> None:
        cfg = self.cfg
        for s, p in enumerate(prompts):
            if not p:
                raise RocketError(f"prompt of stream {s} is empty")
            bad = [t for t in p if not isinstance(t, int) or not 0 <= t < cfg.vocab_size]
            if bad:
                raise RocketError(f"prompt of stream {s}: token id {bad[0]!r} out of range 0..{cfg.vocab_size - 1}")
            if len(p) + n_tokens > cfg.max_position_embeddings:
                raise RocketError(f"prompt of stream {s}: {len(p)} tokens + {n_tokens} to generate exceed "
                                  f"max_position_embeddings {cfg.max_position_embeddings}")

    def _forward(self, tokens: torch.Tensor, cache, seqlens: list[int]) -> tuple[torch.Tensor, int]:
        """model.forward, a prompt longer than prefill_chunk tokens (all streams together) in chunks
        (prefill_chunks: the same cut on every rank): its activations and the fabric's buffers (max_rows) stay
        bounded by the chunk whatever the prompt. -> (the logits of each stream's last token [M, V], forwards)."""
        if sum(seqlens) <= self.prefill_chunk:
            return self.model.forward(tokens, cache, seqlens, self.moe), 1
        logits, used = None, [0] * len(seqlens)
        starts = [0]
        for n in seqlens:
            starts.append(starts[-1] + n)
        chunks = prefill_chunks(seqlens, self.prefill_chunk)
        for counts in bar("prefill", len(chunks), self.progress, unit="chunk", items=chunks):
            # each stream's next piece from its own place in the packed prompts (a forward may take a later
            # stream's piece beside an earlier one that did not fit, so the pieces are not consecutive there)
            pieces = [tokens[starts[s] + used[s]:starts[s] + used[s] + c] for s, c in enumerate(counts) if c]
            out = self.model.forward(torch.cat(pieces), cache, counts, self.moe)
            used = [u + c for u, c in zip(used, counts)]
            ends = [s for s, c in enumerate(counts) if c and used[s] == seqlens[s]]  # prompts that end here
            if logits is None:
                logits = torch.empty_like(out)
            logits[ends] = out[ends]
        return logits, len(chunks)

    def check_logits(self, logits: torch.Tensor, step: int, moe: WatchedMoE | None = None) -> None:
        """A NaN or Inf in a step's logits would decode garbage (argmax picks token 0) with exit 0: stop, naming the
        step, the streams and, where the host path saw it, the first MoE layer it passed (WatchedMoE). Every rank
        computes the same logits, so every rank stops here together."""
        if all_finite(logits):
            return
        streams = [s for s in range(logits.shape[0]) if not all_finite(logits[s])]
        where = moe.bad if moe is not None else None
        seen = f"; first seen {where}" if where else ""
        raise AgreedError(f"decode step {step}: the logits of stream(s) {', '.join(map(str, streams))} hold NaN or "
                          f"Inf{seen} (weights or activations out of BF16's range)")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n_tokens: int, on_step=None, capacity: int = 0,
                 sampling: list[Sampling] | None = None, stop: Stop | None = None, detok=None) -> RunResult:
        """Decode every prompt for at most n_tokens tokens. sampling: per stream (default greedy); stop: when a stream
        ends early (its end-of-text ids, stop strings found by `detok(ids) -> str`); a stream that ended costs no
        more compute on the host path (0 tokens in the forwards), and the run ends when every stream has.
        capacity: cache positions per stream if more than the longest prompt + n_tokens (benchmarks: the
        graphed step's cost at a long run's cache)."""
        self.check_prompts(prompts, n_tokens)
        m = len(prompts)
        sampling = list(sampling) if sampling is not None else [GREEDY] * m
        stop = stop or Stop()
        greedy = all(sp.greedy for sp in sampling)
        # positions rounded up to a multiple of CACHE_QUANTUM: a span that is the capacity keeps the attention's
        # matmuls on aligned rows (an odd span costs the matmuls more than a round one, docs/PERFORMANCE.md)
        need = max(max(len(p) for p in prompts) + n_tokens, capacity)
        cache = self.model.new_cache(m, -(-need // CACHE_QUANTUM) * CACHE_QUANTUM)
        result = RunResult(m, [[] for _ in range(m)], finish=["length"] * m)
        done = [False] * m
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        seqlens = [len(p) for p in prompts]
        result.path = "host" if n_tokens < 2 else self.path_for(m)
        static = None
        launched = 0  # the fixed-shape step's last step launched
        per_expert = next((s.read_bytes_per_expert for s in self.experts.values() if s.owned), 0)
        long_run = self.progress and n_tokens >= LONG_RUN
        xc = self.expert_cache
        # the expert cache's upkeep: after each host-path step; on the fixed-shape path every `every` steps, where no
        # step is in flight (the steps launched ahead stop short of it), so each interval ran with one residency
        every = 1 if xc is None or xc.trace is not None else MAINTAIN_EVERY
        rb = self.rebalancer  # live rebalancing: at its steps, after the upkeep that read the counts, before the step

        def pause(n: int) -> bool:  # the fixed-shape step n waits until no step is in flight: upkeep, maybe a rebalance
            # (n - 1 decode steps are done before step n; while the cache is cold, upkeeps after 1, 2, 4 of them too)
            return xc is not None and (n % every == 0 or warm_upkeep(n - 1, every) or (rb is not None and rb.wants(n)))

        since = 0  # decode steps since the cache's last upkeep
        if xc is not None:
            xc.begin()
        if rb is not None:
            rb.begin()
        for step in bar(f"decoding {m} stream(s)", n_tokens, long_run, unit="step", items=range(n_tokens)):
            self.step = step
            mark(step)
            if step > 0 and result.path != "host":
                if static is None:  # a draw needs the logits and the token before the next step launches
                    static = GraphStep(self, cache, first, graph=result.path == "graph",
                                       keep_logits=on_step is not None or not greedy,
                                       ahead=self.steps_ahead if greedy else 0)
                # this step if it is not in flight yet, then up to static.ahead more while they keep its span; the
                # host's lengths count every step launched (they pick the spans)
                while launched < step or (launched + 1 < n_tokens and len(static.pending) <= static.ahead
                                          and static.follows(int(cache.lengths.max()))
                                          and not pause(launched + 1)):
                    if pause(launched + 1) and not static.pending:
                        if since:
                            xc.maintain(since)
                            since = 0
                        if rb is not None and rb.wants(launched + 1):
                            rb.at_step(launched + 1)
                    launched += 1
                    since += 1
                    self.step = launched
                    static.launch(launched, int(cache.lengths.max()))
                    cache.lengths += 1
                self.step = step
                chosen, c, logits, dt = static.collect(step)
                if logits is not None:  # kept where tokens are drawn; greedy fixed-shape steps keep none
                    self.check_logits(logits, step)
                if not greedy:
                    chosen = choose(logits, sampling, [len(t) for t in result.tokens])
                    static.tokens.copy_(torch.tensor(chosen, dtype=torch.long))
                result.spans = static.spans
                log = StepLog(dt, 0.0, c["rows_mine"], c["rows_total"], c["bytes_sent"], c["crc"],
                              c["experts_mine"] * per_expert + self.stack_read_bytes())
                if static.graph_error and not result.note:
                    result.note = f"CUDA graph capture failed, steps ran eagerly: {static.graph_error}"
            else:
                if rb is not None and rb.wants(step):  # the counts of the steps before it were read after each step
                    rb.at_step(step)
                self.moe.reset()
                f0, b0 = self.fabric.stats.seconds, self.fabric.stats.bytes_sent
                t0 = time.perf_counter()
                if step == 0:  # the prompts, in chunks where they pass prefill_chunk
                    logits, forwards = self._forward(tokens, cache, seqlens)
                    result.prefill = (sum(seqlens), forwards)
                else:  # a host-path decode step: one token per stream that goes on, one forward whatever M
                    logits = self.model.forward(tokens, cache, seqlens, self.moe)
                # the host needs the tokens: this waits for the device, so dt covers it
                self.check_logits(logits, step, self.moe)
                chosen = choose(logits, sampling, [len(t) for t in result.tokens])
                dt = time.perf_counter() - t0
                mo = self.moe
                log = StepLog(dt, self.fabric.stats.seconds - f0, mo.rows_owned, mo.rows_total,
                              self.fabric.stats.bytes_sent - b0, int(mo.crc), mo.expert_bytes + self.stack_read_bytes(),
                              *mo.timings())
                if xc is not None:  # the prefill's firings score the experts; the accounting counts decode steps
                    xc.maintain(1, account=step > 0)
            for s, t in enumerate(chosen):
                if done[s]:
                    continue
                result.tokens[s].append(t)
                if stop.reason(result.tokens[s], detok):
                    done[s], result.finish[s] = True, "stop"
            live = [s for s in range(m) if not done[s]]
            if step == 0:
                first = torch.tensor(chosen, dtype=torch.long)  # every stream's, for the fixed-shape step
            tokens = torch.tensor([chosen[s] for s in live], dtype=torch.long)
            seqlens = [0 if done[s] else 1 for s in range(m)]
            result.steps.append(log)
            if on_step:  # fp32 logits (the graphed step keeps the lm_head's bf16 ones: an exact cast)
                on_step(step, logits.float())
            if not live:
                break
        if static is not None:  # steps launched ahead of a run that ended early: finish them, drop their tokens
            for pending in list(static.pending):
                static.collect(pending[0])
        if xc is not None and since:
            xc.maintain(since, promote=False)
        if xc is not None:
            result.expert_cache = xc.summary()
        if rb is not None:
            rb.finish()
            result.rebalance = rb.stats.as_dict()
        return result
