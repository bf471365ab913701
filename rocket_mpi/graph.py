"""Decode steps without the host: the row plan on the device, the exchange in kernels, the step in a CUDA graph.

The eager GPU step is host-bound: Python launches a few hundred small kernels per step and reads the
routing back once per MoE layer (the host plan). Here every MoE layer is

    route (router_logits + moe_route, two kernels) -> moe_plan (one kernel: the canonical plan in slot
    space, kernels/plan.py)
    -> this rank's block: nvfp4_experts_into (our kernel, fixed grid: NVFP4 experts, or BF16 experts in
       its BF16 tiles), or with ROCKET_BF16_EXPERTS=grouped torch._grouped_mm over the stacked BF16 weights
       with group ends counted on the device
    -> exchange -> moe_scatter_add, which also sums the rows' checksum (folded by the host after the step)

with shapes fixed by (streams, top-k, ranks), so the whole decode step (attention over a span of the cache
with a length mask, MoE layers, lm_head, argmax, the next positions) is captured in a CUDA graph and
replayed: one launch and one small device-to-host read (tokens + plan counters) per step.

Spans: a step attends over the cache's first `span` positions, the smallest of SPAN_MIN, 2 SPAN_MIN, 4 SPAN_MIN,
... (capped at the capacity) that holds every stream's new token (span_for). The host knows the lengths (every
stream advances one position per step), so no device value picks it. A run asking for 4000 tokens starts at
span 256, not 4096: its early steps cost what a short run's do (the MLA / DSA models' attention, top-k and
length masks grow with the span). A new span drops the graph, runs one step eagerly and captures the next
(one graph held at a time); ROCKET_GRAPH_SPANS picks SPAN_MIN or the capacity throughout. The span changes the
shapes of the attention's sums, so it is one of the switches every rank must share (the lengths are the same
on every rank).

Exchange per fabric (rows of rank r's block live at slot space r * cap + i on every rank):
    local     one rank: the block is the row set
    nccl      all_gather_into_tensor of every rank's cap rows (captured by NCCL)
    cuda-ipc  ipc_exchange_flags, one kernel: block rows into every peer's buffer over NVLink, each block
              then writes its own flag word (seq) on every peer, and block 0 spins on ours with a timeout
              (a timeout is recorded on the device and raised by the host after the step naming peer,
              layer and step); two row buffer sets used in turn (seq parity) as the eager path's double
              buffer

Parity: canonical order, the kernel's weight passes and the scatter order are the host plan's
(tests/test_device_plan.py checks moe_plan against its reference), so the split and one rank compute the
same bits; grouped_mm rows are checked the same whichever experts and rows share the launch (a GPU
test) as the DESIGN asks of the expert kernel. The graphed step attends over its span where the eager step attends
over the longest stream: its tokens can differ from the eager GPU step's in the last bit of a softmax sum, never
between ranks, since every rank takes the same path and spans (the handshake checks --graph and
ROCKET_GRAPH_SPANS).
"""
from __future__ import annotations

import time

import torch

from rocket_mpi.errors import FabricTimeout, RocketError
from rocket_mpi.kernels import plan as kplan
from rocket_mpi.moe.router import route

PUSH_BLOCKS = 32  # blocks of the exchange kernel: one flag word each (fabric/cuda_ipc.py IPC_MAX_BLOCKS)
SPAN_MIN = 256    # the first span of the fixed-shape step (span_for)


def span_switch() -> int:
    """ROCKET_GRAPH_SPANS: 'auto' (default: spans from SPAN_MIN up, doubling), 'capacity' (the cache's whole
    capacity at every step, as before session 27) or a positive integer (the smallest span: small values make short
    test runs cross spans) -> the smallest span, 0 for 'capacity'."""
    import os
    v = os.environ.get("ROCKET_GRAPH_SPANS", "auto")
    if v == "auto":
        return SPAN_MIN
    if v == "capacity":
        return 0
    if v.isdigit() and int(v) > 0:
        return int(v)
    raise RocketError(f"ROCKET_GRAPH_SPANS={v!r}: expected 'auto' (default), 'capacity' or a positive integer "
                      f"(the smallest span)")


def span_for(longest: int, capacity: int, smallest: int) -> int:
    """The positions a step attends over when the longest stream holds `longest` (its new token goes to position
    `longest`): smallest * 2^k for the least k that holds it, capped at the capacity; the capacity where
    smallest = 0."""
    if longest >= capacity:
        raise RocketError(f"a decode step at position {longest} past the cache's {capacity} positions")
    if smallest <= 0:
        return capacity
    span = smallest
    while span <= longest:
        span *= 2
    return min(span, capacity)


def step_fused(device) -> bool:
    """Whether the fixed-shape step takes its fused glue kernels on this device: the embedding with the first
    RMSNorm, RoPE reading its table at pos, each MoE scatter with the next RMSNorm, the argmax with pos += 1
    (kernels: the same bits as the separate ops, GPU tests). ROCKET_STEP_FUSE=0 takes the separate ops (A/B runs;
    read when a step is built, so a captured graph keeps what it had)."""
    from rocket_mpi import kernels
    return kernels.gpu_switch("ROCKET_STEP_FUSE", device, "fused glue kernels")


def unsupported(engine, fabric_name: str, graph: bool = True) -> str:
    """'' where the fixed-shape step can run for this engine (graph: captured, on a GPU), else why not.
    Without the graph it also runs on a CPU, every op through its torch reference and the rows through
    the fabric's own exchange: the same plan and slot layout the GPU runs, checked by CPU tests."""
    import os
    from rocket_mpi import kernels
    if not hasattr(engine.model, "forward_static"):
        return f"model type {engine.cfg.model_type} has no fixed-shape decode step yet (glm4_moe, glm_moe_dsa and glm5_next have)"
    why = kplan.model_limit(engine.cfg, engine.size)
    if why:
        return why
    fault = os.environ.get("ROCKET_FAULT", "")
    if fault and not fault.startswith(("stall:", "die:")):
        return "ROCKET_FAULT injects wrong rows on the host path only"
    if engine.device.type != "cuda":
        return "it needs --device cuda" if graph else ""
    if not kernels.available():
        return kernels.unavailable_reason()
    if any(s.packed is None for s in engine.experts.values() if s.owned):
        cap = torch.cuda.get_device_capability(engine.device)
        if not hasattr(torch, "_grouped_mm") or cap[0] != 9:  # checked on H200 only (row invariance test)
            return (f"BF16 experts take torch._grouped_mm, checked on sm_90 only (this GPU is sm_{cap[0]}{cap[1]}); "
                    f"NVFP4 experts run in our kernel")
    if fabric_name not in ("local", "cuda-ipc", "nccl"):
        return f"fabric {fabric_name} is host-driven"
    return ""


class DeviceMoE:
    """The engine's MoE layer with a device plan and a fixed-capacity exchange (CUDA-graph safe)."""

    def __init__(self, engine, streams: int):
        from rocket_mpi.fabric.base import LocalFabric
        from rocket_mpi.fabric.cuda_ipc import BELL_BYTES, FLAGS_OFFSET, IPC_MAX_BLOCKS, CudaIpcFabric
        from rocket_mpi.fabric.nccl import NcclFabric
        e = self.engine = engine
        cfg, dev = e.cfg, e.device
        self.rank, self.size = e.rank, e.size
        self.cap = streams * cfg.num_experts_per_tok
        self.hidden = cfg.hidden_size
        self.tables = {}
        for layer, store in e.experts.items():
            store.stack()  # BF16 experts: stacked for the grouped GEMM (NVFP4: a no-op)
            owner = e.placement.owners[layer]
            # slots: the packed experts' (kernel), else ascending expert id (the BF16 stack's order)
            slot = store.packed.slot if store.packed is not None else {e: i for i, e in enumerate(sorted(store.owned))}
            self.tables[layer] = (owner.to(dev, torch.int32), kplan.slot_table(owner.numel(), slot).to(dev),
                                  kplan.canonical_experts(owner).to(dev), store.s2_down.to(dev, torch.float32))
        self.router = {}  # the router kernels' operands, contiguous fp32 once (not per step)
        self.side = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # the shared expert's (__call__)
        self.seq = torch.tensor([e.seq], dtype=torch.long, device=dev)  # continues the host's seq
        self.err = torch.zeros(4, dtype=torch.long, device=dev)
        fab = e.fabric
        rows_needed = self.size * self.cap
        if dev.type == "cpu":  # the torch references, rows through the fabric's exchange at fixed offsets
            self.mode, self.n_sets, self.set_stride = "host", 1, rows_needed
            self.rows = torch.empty(0, self.hidden, dtype=torch.bfloat16)
            self.out = torch.zeros(self.cap, self.hidden, dtype=torch.bfloat16)
        elif isinstance(fab, LocalFabric) or self.size == 1:
            self.mode, self.n_sets, self.set_stride = "local", 1, self.cap
            self.rows = torch.empty(self.cap, self.hidden, dtype=torch.bfloat16, device=dev)
            self.out = self.rows
        elif isinstance(fab, NcclFabric):
            self.mode, self.n_sets, self.set_stride = "nccl", 1, rows_needed
            self.rows = torch.empty(rows_needed, self.hidden, dtype=torch.bfloat16, device=dev)
            self.out = self.rows[self.rank * self.cap:(self.rank + 1) * self.cap]
        elif isinstance(fab, CudaIpcFabric):
            slot_rows = fab.slot_bytes // fab.row_bytes
            if slot_rows < rows_needed:
                raise RocketError(f"cuda-ipc: row buffers of {slot_rows} rows, the graphed step needs {rows_needed}")
            self.mode, self.n_sets, self.set_stride = "cuda-ipc", 2, slot_rows
            fab.enable_peer_access()
            self.rows = fab.buf[BELL_BYTES:BELL_BYTES + 2 * fab.slot_bytes].view(torch.bfloat16).view(-1, self.hidden)
            self.out = torch.empty(self.cap, self.hidden, dtype=torch.bfloat16, device=dev)
            self.dst = [fab.base[r] + BELL_BYTES for r in range(self.size)]
            self.peer_flags = [fab.base[r] + FLAGS_OFFSET + 8 * IPC_MAX_BLOCKS * self.rank for r in range(self.size)]
            self.flags = fab.flags
            self.timeout = fab.timeout
        else:
            raise RocketError(f"the graphed step has no exchange for fabric {fab.name}")
        # The step's report, one int64 tensor the host reads once after the step: the next tokens [streams] (the
        # argmax writes them there, and the next replay's embedding reads them), then per MoE layer its rows'
        # checksum sum (engine.row_sum, folded by the host; each layer's plan zeroes its word, the scatter adds),
        # then per MoE layer the plan's meta (written there by the plan): no stack / cat / zero kernels per step.
        n_moe = max(len(cfg.moe_layers), 1)
        self.meta_words = kplan.META_HEAD + self.size
        self.report = torch.zeros(streams + n_moe * (1 + self.meta_words), dtype=torch.long, device=dev)
        self.tokens = self.report[:streams]
        self.sums = self.report[streams:streams + n_moe]
        self.meta_rows = self.report[streams + n_moe:].view(n_moe, self.meta_words)
        self.calls = 0  # MoE layers run in this step so far (the body resets it)

    def bytes_sent(self, rows_mine: int) -> int:
        row = self.hidden * 2
        if self.mode in ("nccl", "host"):
            return self.cap * row * (self.size - 1)
        return rows_mine * row * (self.size - 1)

    def __call__(self, layer: int, x: torch.Tensor, L, shared=None, residual: torch.Tensor | None = None,
                 next_norm: tuple[torch.Tensor, float] | None = None):
        """The routed experts of `layer` over x (the normed hidden state) -> [T, H]. With `shared` (a callable:
        the layer's shared expert over x) and `residual`: residual + (routed + shared), both adds in the scatter
        kernel, and on a GPU the shared expert runs on a side stream beside the router, plan, routed experts
        and exchange (a captured fork and join: at M=1 the routed experts fill 88 of 132 SMs and the router and
        plan are single-block kernels). The same kernels and adds as shared-then-add: the same bits.
        residual None (GLM-5.3-Flash, whose hyper-connections add the block's output): routed + shared.
        With next_norm = (weight, eps) (the next layer's input norm, or the final one): returns (out, its norm),
        on a GPU from the scatter's launch (kernels.moe_scatter_add)."""
        i = self.calls
        if i >= self.meta_rows.shape[0]:
            raise RocketError(f"the fixed-shape step ran MoE layer {layer} as its MoE call {i + 1}; the model has "
                              f"{self.meta_rows.shape[0]} MoE layers")
        from rocket_mpi import kernels
        cfg = self.engine.cfg
        store = self.engine.experts[layer]
        res, side = (), None
        if shared is not None:
            if self.mode == "host":
                res = (shared(),) if residual is None else (shared(), residual)
            else:
                side = self.side
                side.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(side):
                    res = (shared(),) if residual is None else (shared(), residual)
        if self.mode == "host":
            weights, experts = route(x, L.router_w, L.router_b, cfg)
        else:
            if layer not in self.router:
                self.router[layer] = (L.router_w.float().contiguous(), L.router_b.float().contiguous())
            weights, experts = kernels.route(x, *self.router[layer], cfg)
        owner, slot, canon, s2 = self.tables[layer]
        p = kplan.moe_plan(experts, weights, owner, slot, canon, s2, self.rank, self.size, self.n_sets,
                           self.set_stride, self.seq, self.meta_rows[i], self.sums[i:i + 1])
        if self.mode == "host":
            return self._host_rest(layer, x, store, p, res, next_norm)
        if store.packed is not None:
            pk = store.packed
            kernels._ext.require().nvfp4_experts_into(x.contiguous(), p["row_index"], p["pad_rows"], p["groups"],
                                                      self.out, pk.q_gu, pk.s_gu, pk.s2_gu, pk.q_dn, pk.s_dn,
                                                      pk.hidden, pk.inter, store.swiglu_limit)
        elif store.owned:  # ROCKET_BF16_EXPERTS=grouped: torch's grouped GEMM, fixed shapes (row invariance:
            # tests/test_device_plan.py)
            self.out.copy_(store.grouped(x, p["row_index"], experts))
        C = kernels._ext.require()
        if self.mode == "nccl":
            import torch.distributed as dist
            dist.all_gather_into_tensor(self.rows, self.out)
        elif self.mode == "cuda-ipc":
            C.ipc_exchange_flags(self.out, p["meta"], self.dst, self.peer_flags, self.cap, self.set_stride,
                                 self.rank, PUSH_BLOCKS, self.flags, self.err, self.timeout, layer)
        if side is not None:  # join: the scatter adds the shared expert's output
            torch.cuda.current_stream(x.device).wait_stream(side)
        out = kernels.moe_scatter_add(self.rows, p["by_token"], p["coef"], p["by_canon"], self.sums[i], res,
                                      next_norm)
        self.calls += 1
        return out

    def _host_rest(self, layer: int, x: torch.Tensor, store, p, res=(), next_norm=None):
        """CPU: this rank's block by the torch reference over the plan's rows (segments rebuilt from the
        padded rows and weight passes, as the kernel reads them), every rank's cap rows through the
        fabric at fixed offsets, then the same slot-space checksum and scatter."""
        from rocket_mpi.kernels import moe_scatter_add
        meta = p["meta"].tolist()
        n = meta[kplan.META_ROWS]
        inv = {s: e for e, s in enumerate(self.tables[layer][1].tolist()) if s >= 0}
        segs, pad = [], p["pad_rows"]
        for slot, tile0, ntiles, _ in p["groups"].tolist():
            if ntiles:
                rows = pad[tile0 * 8:(tile0 + ntiles) * 8]
                rows = rows[rows >= 0]
                segs.append((inv[slot], int(rows[0]), int(rows[-1]) + 1))
        segs = _merge(segs)
        if n:
            self.out[:n] = store.compute(x, p["row_index"], segs, 0)
        seq, fab = meta[kplan.META_SEQ], self.engine.fabric
        self.rows = fab.exchange(seq, [r * self.cap for r in range(self.size + 1)], self.out, layer,
                                 self.engine.step)
        out = moe_scatter_add(self.rows, p["by_token"], p["coef"], p["by_canon"], self.sums[self.calls], res,
                              next_norm)
        self.calls += 1
        return out


def _merge(segs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Weight passes of one expert (more than 32 rows) back into one segment per expert."""
    out: list[tuple[int, int, int]] = []
    for e, a, b in segs:
        if out and out[-1][0] == e and out[-1][2] == a:
            out[-1] = (e, out[-1][1], b)
        else:
            out.append((e, a, b))
    return out


def steps_ahead() -> int:
    """ROCKET_STEPS_AHEAD: decode steps the host launches before it reads the oldest one back (default 1; 0: launch,
    wait and read each step in turn, as before session 32). Launching the next replay before reading this one keeps
    the GPU busy while the host waits for the step's report, reads it and books the step: the same kernels in the
    same order on the same stream, so the same bits."""
    import os
    v = os.environ.get("ROCKET_STEPS_AHEAD", "1")
    if v not in ("0", "1", "2"):
        raise RocketError(f"ROCKET_STEPS_AHEAD={v!r}: expected 0, 1 (default) or 2")
    return int(v)


class GraphStep:
    """One decode step for M streams at device positions, run eagerly once, then captured and replayed; again at
    each new span (span_for: the host's lengths pick it).

    tokens/pos are the graph's inputs and outputs: the step writes the chosen tokens into `tokens` and
    advances `pos`, so consecutive replays need nothing from the host. So the host launches a step (launch), may
    launch the next ones before reading it back (steps_ahead), and reads each in order (collect): each launch
    copies the step's report (and the cuda-ipc error words, and with keep_logits its logits) into a slot of its
    own on the stream, before the next replay overwrites them, and records an event there."""

    def __init__(self, engine, cache, tokens: torch.Tensor, graph: bool, keep_logits: bool = False, ahead: int = 0):
        self.engine, self.cache = engine, cache
        dev = engine.device
        self.pos = cache.lengths.to(dev).clone()
        self.moe = DeviceMoE(engine, tokens.numel())
        self.tokens = self.moe.tokens  # the report's first words: the step's input, and the argmax's output
        self.tokens.copy_(tokens.to(dev, torch.long))
        self.fused = step_fused(dev)
        self.ticket = torch.zeros(1, dtype=torch.int32, device=dev)  # the argmax kernel's (zero between launches)
        self.want_graph = graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_error = ""
        self.ran = False
        self.smallest = span_switch()
        self.span = 0
        self.spans: list[tuple[int, int]] = []  # (first step, span) of each span the run took
        self.keep_logits = keep_logits
        self.ahead = ahead
        pin = dev.type == "cuda"
        # a slot per step in flight: the report and error words in host memory the copies land in (pinned, so they
        # stay on the stream), the logits on the device
        rep, err = self.moe.report, self.moe.err
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
            from rocket_mpi import kernels
            kernels.argmax_(logits, self.tokens, self.ticket, self.pos)
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
        fault = self.engine.fault
        if fault and fault[0] in ("stall", "die") and fault[1] == self.engine.rank and fault[2] == step:
            self.engine._inject(fault[0], torch.empty(0))  # a dead or stalled rank: it never runs this step
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
        if self.moe.mode == "cuda-ipc":
            err.copy_(self.moe.err, non_blocking=True)
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
        if self.moe.mode == "cuda-ipc":
            e = err.tolist()
            if e[0]:
                raise self.engine.fabric.timeout_error(int(e[1]), int(e[3]), step, int(e[2]))
        from rocket_mpi.engine import fold_row_sums
        vals = report.tolist()
        m, n_moe, w = self.tokens.numel(), self.moe.calls, self.moe.meta_words
        sums = vals[m:m + n_moe]
        at = m + len(self.moe.sums)  # the plans' meta rows
        metas = [vals[at + i * w:at + (i + 1) * w] for i in range(n_moe)]
        rows, experts = [mt[kplan.META_ROWS] for mt in metas], [mt[kplan.META_EXPERTS] for mt in metas]
        self.engine.seq += n_moe  # each MoE layer's plan bumped the device seq by one
        return vals[:m], {"crc": fold_row_sums(sums), "rows_mine": sum(rows), "experts_mine": sum(experts),
                          "rows_total": n_moe * self.moe.cap, "bytes_sent": sum(self.moe.bytes_sent(r) for r in rows)
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
        spins = 0
        while not done.query():
            spins += 1
            if spins % 1024 == 0:
                if time.monotonic() > deadline:
                    raise FabricTimeout(f"rank {self.engine.rank}: decode step {step} did not finish in "
                                        f"{limit:.0f} s "
                                        f"(fabric {fab.name}, graphed step): a peer is dead or stalled")
                time.sleep(0)
