"""The fixed-shape decode step: the row plan on the device, the exchange in kernels, the step in a CUDA graph.

The eager GPU step is host-bound: Python launches a few hundred small kernels per step and reads the routing back
once per MoE layer (HostMoE). Here every MoE layer is DeviceMoE (moe/step.py): route (two kernels) -> moe_plan
(one kernel, slot space) -> this rank's block in the expert kernel (fixed grid) -> the fabric's SlotExchange ->
moe_scatter_add (which also sums the rows' checksum), with shapes fixed by (streams, top-k, ranks). So the whole
decode step (attention over a span of the cache with a length mask, the MoE layers, lm_head, argmax, the next
positions) is captured in a CUDA graph and replayed: one launch and one small device-to-host read per step.

Spans: a step attends over the cache's first `span` positions, the smallest of S, 2S, 4S, ... (capped at the
capacity; S = Settings.graph_span_min, 256 by default) that holds every stream's new token (span_for). The host
knows the lengths (every stream advances one position per step), so no device value picks it: a run asking for
4000 tokens starts at span 256, not 4096. A new span drops the graph, runs one step eagerly and captures the next
(one graph held at a time). The span sets the shapes of the attention's sums, so S is one of the settings every
rank must share (the lengths are the same on every rank).

Parity: canonical order, the kernel's weight passes and the scatter order are the host plan's (the tests check
moe_plan against its reference), so the split and one rank compute the same bits. The graphed step attends over
its span where the eager step attends over the longest stream: its tokens can differ from the eager GPU step's in
the last bit of a softmax sum, never between ranks, since every rank takes the same path and spans (the handshake
checks both).
"""
from __future__ import annotations

import time

import torch

from rocket_mpi import ops
from rocket_mpi.errors import FabricTimeout, RocketError
from rocket_mpi.fabric import GRAPHED_FABRICS
from rocket_mpi.moe.step import DeviceMoE, inject
from rocket_mpi.ops import plan as kplan

STEPS_AHEAD = 1  # decode steps launched before the oldest is read back (GraphStep)


def span_for(longest: int, capacity: int, smallest: int) -> int:
    """The positions a step attends over when the longest stream holds `longest` (its new token goes to position
    `longest`): smallest * 2^k for the least k that holds it, capped at the capacity."""
    if longest >= capacity:
        raise RocketError(f"a decode step at position {longest} past the cache's {capacity} positions")
    span = smallest
    while span <= longest:
        span *= 2
    return min(span, capacity)


def unsupported(engine, fabric_name: str, graph: bool = True) -> str:
    """'' where the fixed-shape step can run for this engine (graph: captured, on a GPU), else why not.
    Without the graph it also runs on a CPU, every op through its torch reference and the rows through
    the fabric's own exchange: the same plan and slot layout the GPU runs, checked by CPU tests."""
    if not hasattr(engine.model, "forward_static"):
        return f"model type {engine.cfg.model_type} has no fixed-shape decode step yet (glm4_moe, glm_moe_dsa and glm5_next have)"
    why = kplan.model_limit(engine.cfg, engine.size) or kplan.pairs_limit(engine.pair_capacity)
    if why:
        return why
    if any(getattr(s, "unslotted", None) for s in engine.experts.values()):
        return ("some routed experts are in the checkpoint files only (host memory short for the expert cache: "
                "--host-memory), and only the host path reads them in when a step needs them")
    fault = engine.settings.fault
    if fault and fault.kind not in ("stall", "die"):
        return "ROCKET_FAULT injects wrong rows on the host path only"
    if engine.device.type != "cuda":
        return "it needs --device cuda" if graph else ""
    if not ops.available():
        return ops.unavailable_reason()
    if fabric_name not in GRAPHED_FABRICS:
        return f"fabric {fabric_name} is host-driven"
    return ""


class GraphStep:
    """One decode step for M streams at device positions, run eagerly once, then captured and replayed; again at
    each new span (span_for: the host's lengths pick it).

    tokens/pos are the graph's inputs and outputs: the step writes the chosen tokens into `tokens` and
    advances `pos`, so consecutive replays need nothing from the host. So the host launches a step (launch), may
    launch the next `ahead` ones before reading it back, and reads each in order (collect): each launch
    copies the step's report (and the cuda-ipc error words, and with keep_logits its logits) into a slot of its
    own on the stream, before the next replay overwrites them, and records an event there."""

    def __init__(self, engine, cache, tokens: torch.Tensor, graph: bool, keep_logits: bool = False,
                 ahead: int = STEPS_AHEAD, share: "GraphStep | None" = None):
        """share: a GraphStep of at least as many streams whose MoE tables, device seq and exchange this one uses
        (DeviceMoE's share): the server's steps over its first slots (serve/scheduler.py Slots)."""
        self.engine, self.cache = engine, cache
        dev = engine.device
        self.pos = cache.lengths.to(dev).clone()
        self.moe = DeviceMoE(engine, tokens.numel(), None if share is None else share.moe)
        self.tokens = self.moe.tokens  # the report's first words: the step's input, and the argmax's output
        self.tokens.copy_(tokens.to(dev, torch.long))
        self.fused = ops.on_gpu(dev)  # argmax and pos += 1 in one kernel
        self.ticket = torch.zeros(1, dtype=torch.int32, device=dev)  # the argmax kernel's (zero between launches)
        self.want_graph = graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_error = ""
        self.ran = False
        self.smallest = engine.settings.graph_span_min
        self.span = 0
        self.spans: list[tuple[int, int]] = []  # (first step, span) of each span the run took
        self.keep_logits = keep_logits
        self.ahead = ahead
        pin = dev.type == "cuda"
        # a slot per step in flight: the report and error words in host memory the copies land in (pinned, so they
        # stay on the stream), the logits on the device
        rep, err = self.moe.report, self.moe.xchg.err
        err = torch.zeros(0, dtype=torch.long) if err is None else err
        self.slots = [(torch.empty(rep.shape, dtype=rep.dtype, device="cpu", pin_memory=pin),
                       torch.empty(err.shape, dtype=err.dtype, device="cpu", pin_memory=pin), None)
                      for _ in range(ahead + 1)]
        self.pending: list[tuple] = []  # (step, slot, event, launch time) of the steps launched, oldest first
        self.last_done = 0.0

    def _body(self):
        m = self.moe
        m.calls = 0
        logits = self.engine.model.forward_static(self.tokens, self.pos, self.cache, m, self.span)  # bf16
        if self.fused:  # the next step's input, written in place, and pos += 1: one launch
            ops.argmax_(logits, self.tokens, self.ticket, self.pos)
        else:
            torch.argmax(logits, dim=-1, out=self.tokens)
            self.pos.add_(1)
        self.logits = logits
        self.ran = True

    def follows(self, longest: int) -> bool:
        """Whether a step whose longest stream holds `longest` may be launched while others are in flight: it keeps
        the current span (a new span runs eagerly and captures, which wants the device to itself)."""
        return self.span != 0 and span_for(longest, self.cache.capacity, self.smallest) == self.span

    def launch(self, step: int, longest: int) -> None:
        """Launch decode step `step` (longest: the longest stream's length before it, which picks the span). The
        first call runs eagerly (and warms up), the second captures the graph (where wanted) and every call from
        then on replays it; then the step's report goes to its slot (collect reads it)."""
        fault = self.engine.settings.fault
        if fault and fault.kind in ("stall", "die") and fault.rank == self.engine.rank and fault.step == step:
            inject(fault.kind, fault.rank, step, torch.empty(0))  # a dead or stalled rank: it never runs this step
        span = span_for(longest, self.cache.capacity, self.smallest)
        if span != self.span:  # the former graph's shapes no longer hold every stream: run eagerly, then capture
            if self.pending:
                raise RocketError(f"decode step {step}: a new span ({self.span} -> {span}) with steps in flight")
            self.span, self.graph, self.ran = span, None, False
            self.spans.append((step, span))
        t0 = time.perf_counter()
        if not self.ran or not self.want_graph or (self.graph is None and self.graph_error):
            self._body()
        else:
            if self.graph is None:
                self._capture()
            if self.graph is not None:
                self.graph.replay()
            else:
                self._body()
        slot = step % len(self.slots)
        report, err, logits = self.slots[slot]
        report.copy_(self.moe.report, non_blocking=True)
        if self.moe.xchg.err is not None:
            err.copy_(self.moe.xchg.err, non_blocking=True)
        if self.keep_logits:  # the next replay writes the graph's logits again
            if logits is None or logits.shape != self.logits.shape:
                logits = torch.empty_like(self.logits)
                self.slots[slot] = (report, err, logits)
            logits.copy_(self.logits)
        event = None
        if self.engine.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.pending.append((step, slot, event, t0))

    def collect(self, step: int) -> tuple[list[int], dict, torch.Tensor | None, float]:
        """Wait for step `step` (the oldest launched) -> (chosen tokens, counters, its logits where kept else None,
        seconds: from its launch or the previous step's end, whichever is later, to its end, so steps launched ahead
        count what they add to the run)."""
        if not self.pending or self.pending[0][0] != step:
            raise RocketError(f"decode step {step} collected, but the steps in flight are "
                              f"{[p[0] for p in self.pending]}")
        _, slot, event, t0 = self.pending.pop(0)
        self._finish(step, event)
        done = time.perf_counter()
        seconds, self.last_done = done - max(t0, self.last_done), done
        report, err, logits = self.slots[slot]
        if self.moe.xchg.err is not None:
            self.moe.xchg.check(err.tolist(), step)
        vals = report.tolist()
        m, n_moe, w = self.tokens.numel(), self.moe.calls, self.moe.meta_words
        sums = vals[m:m + n_moe]
        at = m + len(self.moe.sums)  # the plans' meta rows
        metas = [vals[at + i * w:at + (i + 1) * w] for i in range(n_moe)]
        rows, experts = [mt[kplan.META_ROWS] for mt in metas], [mt[kplan.META_EXPERTS] for mt in metas]
        self.engine.seq += n_moe  # each MoE layer's plan bumped the device seq by one
        return vals[:m], {"crc": ops.fold_row_sums(sums), "rows_mine": sum(rows), "experts_mine": sum(experts),
                          "rows_total": n_moe * self.moe.cap, "bytes_sent": sum(self.moe.xchg.bytes_sent(r) for r in rows)
                          }, logits, seconds

    def _capture(self):
        torch.cuda.synchronize(self.engine.device)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                self._body()
        except Exception as e:  # noqa: BLE001 - reported, and the step runs eagerly instead
            self.graph_error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            torch.cuda.synchronize(self.engine.device)
            self.ran = False
            return
        self.graph = g

    def _finish(self, step: int, done):
        """Bound the wait for the step (a dead peer must not hang the host); collect then reports a fabric
        timeout the device recorded."""
        if done is None:
            return  # the CPU reference mode waits inside the fabric's exchange, with its timeout
        fab = self.engine.fabric
        n_moe = max(len(self.engine.cfg.moe_layers), 1)
        limit = fab.timeout * (n_moe + 1) * len(self.slots) + 30  # the steps launched before it too
        deadline = time.monotonic() + limit
        nap = self.moe.xchg.host_gil  # the exchange's proxy posts under the GIL (verbs): poll with it given up
        spins = 0
        while not done.query():
            spins += 1
            if nap:
                time.sleep(20e-6)
            if spins % 1024 == 0:
                if fab.idle_hook is not None:
                    fab.idle_hook()
                if time.monotonic() > deadline:
                    raise FabricTimeout(f"rank {self.engine.rank}: decode step {step} did not finish in "
                                        f"{limit:.0f} s "
                                        f"(fabric {fab.name}, graphed step): a peer is dead or stalled")
                time.sleep(0)
