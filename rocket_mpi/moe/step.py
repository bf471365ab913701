"""The MoE step: route, plan the canonical rows, run this rank's block, exchange finished rows, scatter.

Two implementations of one contract, `moe(layer, x, L, shared=None, residual=None, next_norm=None)`, which a
model's forward calls for each MoE layer with x the normalised hidden state [T, H]:

    HostMoE    the plan on the host (ops.plan_rows: one small device-to-host read of the routing per layer),
               each rank's block at routing-dependent offsets, the fabric's exchange(seq, offsets, block)
    DeviceMoE  the plan on the device (ops.moe_plan) in slot space: every rank's block at a fixed place, so the
               whole decode step has fixed shapes and is captured in a CUDA graph (runtime/graph.py); the
               exchange is the fabric's SlotExchange. On a CPU the same plan and slot layout run through the
               torch references and the fabric's own exchange (what the CPU tests check).

Both return, per token, the fp32 sum of coef x row over its experts in ascending expert id, one rounding to bf16
(ops.moe_scatter_add); with `shared` (a callable: the shared expert over x) and `residual`: residual + (routed +
shared); residual None: routed + shared. Nothing about routing crosses the fabric, only finished bf16 rows, and
the canonical order, the expert kernel's passes and the scatter order are the same on both, so the split and
one rank compute the same bits on either.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from rocket_mpi import ops
from rocket_mpi.errors import RocketError
from rocket_mpi.ops import plan as kplan


class HostMoE:
    """The engine's MoE layer with the row plan on the host (any fabric, any device)."""

    def __init__(self, engine):
        self.engine = engine
        self.scatter_kernel = ops.on_gpu(engine.device)  # decided once, not per layer
        # on a GPU the router kernels, whose sums per token are fixed (route_ref's fp32 GEMM takes cuBLAS's order for
        # the step's row count: a token's weights would depend on the other tokens of the forward)
        self.router_kernels = self.scatter_kernel and not kplan.model_limit(engine.cfg, 1)
        xc = engine.expert_cache  # the expert cache counts every expert's rows (moe/cache.py)
        self.fires = xc.counter("host", "cpu") if xc is not None else None
        self.index = {layer: i for i, layer in enumerate(engine.cfg.moe_layers)}
        self.reset()

    def reset(self) -> None:
        """Zero the per-step accounting (the engine reads it after each step)."""
        self.crc, self.rows_owned, self.rows_total, self.expert_bytes = 0, 0, 0, 0
        self.marks = []  # per MoE layer: (before the experts, after them, after the exchange), timings() reads them

    def _mark(self):
        """A point in the step: on a CPU (wall clock, this process's CPU time); on a GPU an event on the stream (the
        experts run asynchronously)."""
        if self.engine.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter(), time.process_time()

    def timings(self) -> tuple[float, float, float]:
        """(seconds in this rank's experts, seconds in the exchange: copies, doorbells and waiting for the peers, CPU
        seconds this process spent in its experts: NaN on a GPU) over the step's MoE layers; read after the step (on a
        GPU its events have completed once the tokens were read). On a CPU shared by more ranks than cores the wall
        time of the experts grows with the others' work, their CPU time does not."""
        if self.engine.device.type == "cuda":
            return (sum(a.elapsed_time(b) for a, b, _ in self.marks) / 1e3,
                    sum(b.elapsed_time(c) for _, b, c in self.marks) / 1e3, float("nan"))
        return (sum(b[0] - a[0] for a, b, _ in self.marks), sum(c[0] - b[0] for _, b, c in self.marks),
                sum(b[1] - a[1] for a, b, _ in self.marks))

    def __call__(self, layer: int, x: torch.Tensor, L, shared=None, residual: torch.Tensor | None = None,
                 next_norm=None) -> torch.Tensor:
        if next_norm is not None:
            raise RocketError("HostMoE: next_norm is the fixed-shape step's (DeviceMoE)")
        e = self.engine
        route = ops.route if self.router_kernels else ops.route_ref
        weights, experts = route(x, L.router_w, L.router_b, e.cfg)
        store = e.experts[layer]
        # the plan is host bookkeeping over T x k integers: one small device-to-host copy per layer
        experts_h = experts.cpu()
        if self.fires is not None:
            self.fires[self.index[layer]] += kplan.count_fires(experts_h, e.cfg.n_routed_experts)
        plan = ops.plan_rows(experts_h, weights.cpu(), e.placement.table(layer), store.s2_down, e.size)
        if x.device.type != "cpu":
            plan.tokens, plan.by_token, plan.coef = (plan.tokens.to(x.device), plan.by_token.to(x.device),
                                                     plan.coef.to(x.device))
        lo, hi = plan.block(e.rank)
        t0 = self._mark()
        block = store.compute(x, plan.tokens, plan.segments[e.rank], lo)
        t1 = self._mark()
        e.seq += 1
        fault = e.settings.fault
        if fault and fault.rank == e.rank and fault.step == e.step:
            block = inject(fault.kind, e.rank, e.step, block)
        rows = e.fabric.exchange(e.seq, plan.offsets, block, layer, e.step).to(x.device)
        self.marks.append((t0, t1, self._mark()))
        self.crc = ops.row_checksum(rows[plan.by_token.reshape(-1)], self.crc)  # (token, expert): any placement
        self.rows_owned += hi - lo
        self.rows_total += plan.rows
        self.expert_bytes += len(plan.segments[e.rank]) * store.read_bytes_per_expert
        # on a GPU the scatter kernel: bitwise the torch reference (tests), fewer launches
        routed = (ops.moe_scatter_add(rows, plan.by_token, plan.coef) if self.scatter_kernel
                  else ops.moe_scatter_add_ref(rows, plan.by_token, plan.coef))
        if shared is None:
            return routed
        return ops.add_residuals(routed, (shared(),) if residual is None else (shared(), residual))


def inject(kind: str, rank: int, step: int, block: torch.Tensor) -> torch.Tensor:
    """Test hook (ROCKET_FAULT): a dead rank, a stalled rank, or a wrong row that the static fire must catch."""
    print(f"rank {rank}: ROCKET_FAULT injecting '{kind}' at step {step}", file=sys.stderr, flush=True)
    if kind == "die":
        os._exit(9)
    if kind == "stall":
        time.sleep(3600)
    if kind == "corrupt" and block.numel():
        block = block.clone()
        block[0] = 100.0  # far outside what a row holds: some greedy choice must change
    return block


class DeviceMoE:
    """The engine's MoE layer with a device plan and a fixed-capacity exchange (CUDA-graph safe)."""

    def __init__(self, engine, streams: int, share: "DeviceMoE | None" = None):
        """share: a DeviceMoE of at least as many streams whose tables, firing counts, router operands, device seq
        and exchange this one uses too (the server's steps of fewer slots: serve/scheduler.py), so steps of
        either size may follow each other on the same stream; its plans place blocks at that exchange's cap."""
        e = self.engine = engine
        cfg, dev = e.cfg, e.device
        self.rank, self.size = e.rank, e.size
        self.cap = streams * cfg.num_experts_per_tok
        self.hidden = cfg.hidden_size
        if share is not None:
            if share.cap < self.cap:
                raise RocketError(f"a step of {streams} streams cannot share an exchange of {share.cap} rows")
            self.tables, self.fires, self.router = share.tables, share.fires, share.router
            self.side, self.seq, self.xchg = share.side, share.seq, share.xchg
        else:
            # per MoE layer: the owners' pair tables (padded to the engine's fixed count, so live rebalancing
            # rewrites them in place), the slot table, s2_down
            self.tables = {layer: tuple(t.to(dev) for t in self._host_tables(layer)) for layer in e.experts}
            xc = e.expert_cache  # firing counts, added to by each layer's plan; residency changes refresh the slots
            self.fires = xc.counter("device", dev, self._refresh_slots) if xc is not None else None
            if e.rebalancer is not None:  # a new placement rewrites the tables
                e.rebalancer.on_change["device"] = self._refresh_tables
            self.router = {}  # the router kernels' operands, contiguous fp32 once (not per step)
            self.side = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # the shared expert's (__call__)
            self.seq = torch.tensor([e.seq], dtype=torch.long, device=dev)  # continues the host's seq
            self.xchg = e.fabric.slot_exchange(self.cap, dev)  # where rows live in slot space, and how they move
        self.host = self.xchg.mode == "host"
        # The step's report, one int64 tensor the host reads once after the step: the next tokens [streams] (the
        # argmax writes them there, and the next replay's embedding reads them), then per MoE layer its rows'
        # checksum sum (ops.row_sum, folded by the host; each layer's plan zeroes its word, the scatter adds),
        # then per MoE layer the plan's meta (written there by the plan): no stack / cat / zero kernels per step.
        n_moe = max(len(cfg.moe_layers), 1)
        self.meta_words = kplan.META_HEAD + self.size
        self.report = torch.zeros(streams + n_moe * (1 + self.meta_words), dtype=torch.long, device=dev)
        self.tokens = self.report[:streams]
        self.sums = self.report[streams:streams + n_moe]
        self.meta_rows = self.report[streams + n_moe:].view(n_moe, self.meta_words)
        self.calls = 0  # MoE layers run in this step so far (the body resets it)

    def __call__(self, layer: int, x: torch.Tensor, L, shared=None, residual: torch.Tensor | None = None,
                 next_norm: tuple[torch.Tensor, float] | None = None):
        """As HostMoE. On a GPU the shared expert runs on a side stream beside the router, plan, routed experts
        and exchange (a captured fork and join; the same kernels and adds as shared-then-add: the same bits).
        With next_norm = (weight, eps) (the next layer's input norm, or the final one): returns (out, its norm),
        on a GPU from the scatter's launch."""
        i = self.calls
        if i >= self.meta_rows.shape[0]:
            raise RocketError(f"the fixed-shape step ran MoE layer {layer} as its MoE call {i + 1}; the model has "
                              f"{self.meta_rows.shape[0]} MoE layers")
        cfg = self.engine.cfg
        store = self.engine.experts[layer]
        res, side = (), None
        if shared is not None:
            if self.host:
                res = (shared(),) if residual is None else (shared(), residual)
            else:
                side = self.side
                side.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(side):
                    res = (shared(),) if residual is None else (shared(), residual)
        if self.host:
            weights, experts = ops.route_ref(x, L.router_w, L.router_b, cfg)
        else:
            if layer not in self.router:
                self.router[layer] = (L.router_w.float().contiguous(), L.router_b.float().contiguous())
            weights, experts = ops.route(x, *self.router[layer], cfg)
        pair0, pair_owner, slot, canon, s2 = self.tables[layer]
        xc = self.xchg
        p = kplan.moe_plan(experts, weights, pair0, pair_owner, slot, canon, s2, self.rank, self.size, xc.n_sets,
                           xc.set_stride, self.seq, self.meta_rows[i], self.sums[i:i + 1],
                           None if self.fires is None else self.fires[i], xc.cap)
        if self.host:
            n = p["meta"].tolist()[kplan.META_ROWS]
            if n:
                xc.out[:n] = store.compute(x, p["row_index"], self._segments(layer, p), 0)
        elif store.packed is not None:
            pk = store.packed
            ops._ext.require().nvfp4_experts_into(x.contiguous(), p["row_index"], p["pad_rows"], p["groups"],
                                                  xc.out, pk.q_gu, pk.s_gu, pk.s2_gu, pk.q_dn, pk.s_dn,
                                                  pk.hidden, pk.inter, store.swiglu_limit, far=pk.far_args())
        rows = xc.exchange(p["meta"], layer, self.engine.step)
        if side is not None:  # join: the scatter adds the shared expert's output
            torch.cuda.current_stream(x.device).wait_stream(side)
        out = ops.moe_scatter_add(rows, p["by_token"], p["coef"], p["by_canon"], self.sums[i], res, next_norm)
        self.calls += 1
        return out

    def _host_tables(self, layer: int) -> tuple[torch.Tensor, ...]:
        """(pair0, pair_owner, slot, canon, s2_down) of `layer` on the host: the placement's pair tables padded to the
        engine's pair count; slots: the packed experts' (kernel), else ascending expert id (the CPU reference's)."""
        e = self.engine
        store = e.experts[layer]
        pair0, pair_owner, canon = kplan.device_tables(e.placement.table(layer), e.pair_capacity)
        slot = store.packed.slot if store.packed is not None else {x: i for i, x in enumerate(sorted(store.owned))}
        return pair0, pair_owner, kplan.slot_table(e.cfg.n_routed_experts, slot), canon, store.s2_down.float()

    def _refresh_slots(self, layer: int) -> None:
        """The expert cache moved experts of `layer`: its device slot table follows (a copy on the stream, before the
        next step reads it; the captured step reads the table, so the capture stays valid)."""
        store = self.engine.experts[layer]
        if store.packed is not None:
            table = self.tables[layer][2]
            table.copy_(kplan.slot_table(table.numel(), store.packed.slot))

    def _refresh_tables(self, layer: int) -> None:
        """Live rebalancing gave `layer` new owners: its tables are rewritten in place (same shapes, so a captured step
        stays valid and reads the new ones from its next replay)."""
        for dst, src in zip(self.tables[layer], self._host_tables(layer)):
            dst.copy_(src)

    def _segments(self, layer: int, p) -> list[tuple[int, int, int]]:
        """CPU: this rank's (expert, start, end) segments rebuilt from the plan's padded rows and weight passes,
        as the kernel reads them; an expert's passes (more than 32 rows) merged back into one segment."""
        inv = {s: e for e, s in enumerate(self.tables[layer][2].tolist()) if s >= 0}
        segs: list[tuple[int, int, int]] = []
        pad = p["pad_rows"]
        for slot, tile0, ntiles, _ in p["groups"].tolist():
            if not ntiles:
                continue
            rows = pad[tile0 * 8:(tile0 + ntiles) * 8]
            rows = rows[rows >= 0]
            e, a, b = inv[slot], int(rows[0]), int(rows[-1]) + 1
            if segs and segs[-1][0] == e and segs[-1][2] == a:
                segs[-1] = (e, segs[-1][1], b)
            else:
                segs.append((e, a, b))
        return segs
