"""Continuous batching over M stream slots, on every rank of the split.

Rank 0 owns the requests: between decode steps it admits waiting requests into free slots, drops the ones that
ended or whose client went away, and tells every other rank the next step's plan in one small message (bcast):
which slots start (their prompt tokens) and which decode (the token each feeds). That is control, not routing:
the rows still move by the zero-metadata exchange inside the forward. Rank 0 draws each token (every rank would
draw the same, runtime/sampling.py), so the plan carries the drawn tokens and the ranks cannot diverge.

A step is a prefill forward for the slots that start (their prompts cut as the decode command cuts them), then one
decode forward for the slots that go on: the same forwards, with the same shapes per stream, as `decode` runs, so
a request's tokens are bitwise those the decode command gives the same prompt alone (batch invariance). While the
same slots decode greedily, the next decode step is launched before the one in flight is read back (one word,
"next", tells the other ranks), fed the tokens the device chose: the device does not wait for the host's
bookkeeping, as `decode`'s graphed loop does not. An idle
rank 0 sends a heartbeat every HEARTBEAT seconds that every rank answers, so a dead or stalled rank is named within
the fabric timeout even with no traffic.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from rocket_mpi.errors import RocketError
from rocket_mpi.model.cache import clear_stream, first_streams
from rocket_mpi.runtime.dist import acknowledge, bcast
from rocket_mpi.runtime.engine import CACHE_QUANTUM, MAINTAIN_EVERY
from rocket_mpi.runtime.graph import GraphStep
from rocket_mpi.runtime.sampling import Sampling, Stop, choose, cut_at_stop, logprobs

HEARTBEAT = 1.0  # seconds an idle rank 0 waits for a request before it checks on the other ranks
WINDOW = 64      # decode steps the step-time and fabric-share gauges average over


class Slots:
    """The persistent cache of M stream slots and the forwards that fill it (the same calls, in the same order, on
    every rank).

    path "host": each decode step is the host path's forward over the slots that decode (the others cost nothing).
    "graph" (or "device", the same without the CUDA graph): the decode step is the fixed-shape step (runtime/graph.py
    GraphStep) of the first b slots, b the least of 1, 2, 4, ..., M that holds every slot that decodes (requests
    take the lowest free slot, so b follows the number of live streams), fed the slots' tokens and positions from
    the host; a slot below b that does not decode this step runs at its next free position (what it writes there is
    overwritten before it is read), and its recurrent state, where the model has one, is put back after the step.
    The steps of every b share one exchange, device seq and MoE tables (GraphStep's share), and each one's rows
    depend on no other row (batch invariance), so a stream's tokens are the same whatever b its steps took. Every
    b's graph is captured at start-up (warm) and again only where the longest slot passes a span.

    A decode step is launched (launch), then collected (collect): in between, the host may launch the step after it
    (launch_next), fed the tokens the step chose on the device (greedy), so the device never waits for the host's
    bookkeeping; the server does that while the same slots decode greedily (Scheduler._follow_on)."""

    def __init__(self, engine, slots: int, capacity: int, path: str = "host"):
        self.engine, self.m, self.path = engine, slots, path
        self.capacity = -(-capacity // CACHE_QUANTUM) * CACHE_QUANTUM
        self.cache = engine.model.new_cache(slots, self.capacity)
        self.steps = 0          # forwards run (the engine's step number: fault injection, logs)
        self.launches = 0       # fixed-shape steps launched (GraphStep's step numbers)
        self.sizes = step_sizes(slots)
        self.statics: dict[int, GraphStep] = {}  # the fixed-shape step of the first b slots, per b in sizes
        # launched decode steps not yet collected: (step, live slots, kept state, host path's logits, GraphStep)
        self.pending: list[tuple] = []
        self.since = 0          # decode steps since the expert cache's last upkeep
        xc = engine.expert_cache  # its upkeep's interval: every step where it records the routing (--telemetry)
        self.every = 1 if xc is not None and xc.trace is not None else MAINTAIN_EVERY
        self.decodes = 0        # decode steps since serving began: live rebalancing's clock (--rebalance-every)
        self.serving = False    # warm() done: live rebalancing counts and moves from then on
        pin = engine.device.type == "cuda"
        # positions of a step launched behind another in flight: a pinned buffer per step in flight (the copy is
        # ordered on the stream, so the host must not rewrite a buffer before its step ran)
        self.pos_bufs = [torch.zeros(slots, dtype=torch.long, pin_memory=pin) for _ in range(2)]

    @torch.inference_mode()
    def warm(self) -> None:
        """Run and capture the fixed-shape step before the first request (on every rank), then empty the slots."""
        if self.path != "host":
            for b in reversed(self.sizes):  # the largest first: the others share its exchange
                for _ in range(3):  # eager, capture, replay
                    self.launch({s: 0 for s in range(b)})
                    self.collect()
            for s in range(self.m):
                clear_stream(self.cache, s)
        if self.engine.expert_cache is not None:
            self.engine.expert_cache.begin()  # the accounting counts the requests' steps
        self.decodes = 0
        if self.engine.rebalancer is not None:  # the warm-up's steps (token 0) are not the requests' routing
            self.engine.rebalancer.begin(forget=True)
        self.serving = True

    @torch.inference_mode()
    def prefill(self, joins: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Prefill the slots in `joins` (emptied first) with their prompts -> each one's next-token logits [V]."""
        if not joins:
            return {}
        eng, m = self.engine, self.m
        eng.step = self.steps
        for s in joins:
            clear_stream(self.cache, s)
        if self.since:  # the decode steps since the last upkeep, counted before the prompts' rows join them
            self._upkeep(promote=False)
        seqlens = [len(joins.get(s, ())) for s in range(m)]
        tokens = torch.tensor([t for s in range(m) for t in joins.get(s, ())], dtype=torch.long)
        eng.moe.reset()
        logits, _ = eng._forward(tokens, self.cache, seqlens)
        self.steps += 1
        self._upkeep(account=False)
        return {s: logits[s] for s in joins}

    @torch.inference_mode()
    def launch(self, decodes: dict[int, int]) -> None:
        """One decode step for the slots in `decodes` (slot -> the token it feeds), with nothing in flight; collect
        reads it."""
        if self.pending:
            raise RocketError(f"serve: a decode step launched with {len(self.pending)} in flight")
        eng, m, cache = self.engine, self.m, self.cache
        eng.step = self.steps
        live = sorted(decodes)
        if self.path == "host":
            seqlens = [1 if s in decodes else 0 for s in range(m)]
            tokens = torch.tensor([decodes[s] for s in live], dtype=torch.long)
            eng.moe.reset()
            f0, t0 = eng.fabric.stats.seconds, time.perf_counter()
            logits = eng.model.forward(tokens, cache, seqlens, eng.moe)
            self.pending.append((self.steps, live, [], (logits[live], t0, eng.fabric.stats.seconds - f0), None))
            self.steps += 1
            self.decodes += 1
            return
        st = self._static(self.step_size(live))
        tokens = torch.zeros(st.tokens.numel(), dtype=torch.long)
        tokens[live] = torch.tensor([decodes[s] for s in live], dtype=torch.long)
        st.tokens.copy_(tokens)
        st.moe.seq.fill_(eng.seq)  # the host path's prefills moved the doorbell sequence on
        self._launch_fixed(st, live)

    def step_size(self, live: list[int]) -> int:
        """The slots the fixed-shape step for `live` runs: the least size that holds its highest slot."""
        top = max(live, default=0) + 1
        return next(b for b in self.sizes if b >= top)

    def _static(self, b: int) -> GraphStep:
        st = self.statics.get(b)
        if st is None:
            share = None if b == self.m else self._static(self.m)  # the largest step's exchange serves all
            st = GraphStep(self.engine, first_streams(self.cache, b), torch.zeros(b, dtype=torch.long),
                           graph=self.path == "graph", keep_logits=True, ahead=1, share=share)
            self.statics[b] = st
        return st

    def can_follow(self) -> bool:
        """Whether launch_next may run now: one fixed-shape step in flight, its span holds the next, the expert
        cache's upkeep (or a live rebalancing) is not due, and no idle slot has recurrent state to put back between
        the two."""
        if self.path == "host" or len(self.pending) != 1 or self.pending[0][3] is not None:
            return False
        live, st = self.pending[0][1], self.pending[0][4]
        longest = int(self.cache.lengths[:st.tokens.numel()].max())
        if longest >= self.capacity or not st.follows(longest):
            return False
        xc = self.engine.expert_cache
        if xc is not None and (self.since + 1 >= self.every or self._rebalance_due()):
            return False
        return len(live) == st.tokens.numel() or not recurrent_state(self.cache)

    @torch.inference_mode()
    def launch_next(self) -> None:
        """The decode step after the one in flight, for the same slots, fed the tokens that step chose on the device
        (its argmax: greedy). Only where can_follow()."""
        if not self.can_follow():
            raise RocketError("serve: launch_next without a step it may follow")
        self.engine.step = self.steps
        self._launch_fixed(self.pending[0][4], self.pending[0][1])

    def _launch_fixed(self, st: GraphStep, live: list[int]) -> None:
        cache, b = self.cache, st.tokens.numel()
        idle = [s for s in range(b) if s not in live]
        pos = self.pos_bufs[self.launches % 2][:b]
        pos.copy_(cache.lengths[:b].clamp(max=self.capacity - 1))  # idle slots stay at their next free position
        st.pos.copy_(pos, non_blocking=True)
        kept = [(t, t[idle].clone()) for t in recurrent_state(cache)] if idle and not self.pending else []
        st.launch(self.launches, int(pos[live].max()) if live else 0)
        cache.lengths[live] += 1
        self.pending.append((self.launches, live, kept, None, st))
        self.launches += 1
        self.steps += 1
        self.since += 1
        self.decodes += 1

    @torch.inference_mode()
    def collect(self, logits: bool = False) -> tuple[list[int], list[int], dict[int, torch.Tensor], float, float]:
        """Wait for the oldest decode step in flight -> (its slots, the token each chose on the device (greedy),
        with `logits` each slot's next-token logits [V] (else {}), seconds, fabric seconds)."""
        step, live, kept, host, st = self.pending.pop(0)
        if host is not None:  # the host path ran it at launch (the argmax's read waits for the device)
            rows, t0, fab = host
            chosen = rows.argmax(dim=-1).tolist()
            self._upkeep()
            out = {s: rows[i] for i, s in enumerate(live)} if logits else {}
            return live, chosen, out, time.perf_counter() - t0, fab
        f0 = self.engine.fabric.stats.seconds
        chosen, _, rows, seconds = st.collect(step)
        for t, saved in kept:
            idle = [s for s in range(st.tokens.numel()) if s not in live]
            t[idle] = saved
        out = {s: rows[s] for s in live} if logits else {}
        if not self.pending:
            self._upkeep()
        return live, [chosen[s] for s in live], out, seconds, self.engine.fabric.stats.seconds - f0

    def _upkeep(self, account: bool = True, promote: bool = True) -> None:
        """The expert cache's upkeep (moe/cache.py), as decode runs it: after every host-path forward; on the
        fixed-shape path every MAINTAIN_EVERY decode steps (every step where it records the routing), and where a
        live rebalancing is due, with none in flight.
        Then, where it is due, the live rebalancing (moe/rebalance.py Rebalancer.at_step) with the counts the upkeep
        read: at the first upkeep at or after its step (the fixed-shape path does not launch past it).
        promote=False: the fixed-shape path's decode steps so far only counted (before a prefill), no promotion.
        Every rank runs the same forwards in the same order, so every rank keeps the same residency and placement."""
        xc = self.engine.expert_cache
        if xc is None:
            return
        if self.path == "host" or not account:
            xc.maintain(1, account=account)
            self.since = 0
        elif self.since and (not promote or self.since >= self.every or self._rebalance_due()):
            xc.maintain(self.since, promote=promote)
            self.since = 0
        if account and self._rebalance_due():
            self.engine.rebalancer.at_step(self.decodes + 1)

    def _rebalance_due(self) -> bool:
        """Whether the live rebalancing wants the steps paused before the next decode step (decode's numbering: the
        steps since serving began, from 1)."""
        rb = self.engine.rebalancer
        return rb is not None and self.serving and rb.wants(self.decodes + 1)


def step_sizes(m: int) -> list[int]:
    """The fixed-shape step sizes of a server of m slots: 1, 2, 4, ... below m, and m."""
    sizes, b = [], 1
    while b < m:
        sizes.append(b)
        b *= 2
    return sizes + [m]


def recurrent_state(cache) -> list[torch.Tensor]:
    """The per-slot tensors a decode step updates in place whatever its position (GLM-5.3-Flash's KDA conv and
    recurrent states); a KV-style cache has none."""
    return [t for d in (getattr(cache, "conv", None), getattr(cache, "rec", None)) if d for t in d.values()]


@dataclass
class Request:
    """One completion: its prompt ids, limits and the sink its events go to (called from the scheduler's thread).
    Events: ("token", token id, text delta, logprobs), then ("done", finish reason, usage) or ("error", message);
    logprobs is None, or with `logprobs` set (the alternatives wanted, 0 or more) (the token's log-probability,
    [(token id, log-probability)] of the `logprobs` most likely tokens)."""
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop: Stop
    sink: object
    logprobs: int | None = None
    generated: list[int] = field(default_factory=list)
    sent: str = ""                 # the text already sent
    text: str = ""                 # generated[:done] decoded (IncrementalText), stop strings not cut yet
    start: int = 0                 # the decode window of the next piece: generated[start:] (IncrementalText)
    done: int = 0
    cancelled: bool = False        # set by the server thread when the client goes away
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None


class Scheduler:
    """Rank 0's loop (run) over the slots; submit and cancel are called from the HTTP server's thread."""

    def __init__(self, comm, slots: Slots, timeout: float, detok=None):
        self.comm, self.slots, self.timeout, self.detok = comm, slots, timeout, detok
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request | None] = [None] * slots.m
        self.stopping = threading.Event()
        self.error = ""            # why the loop ended, if it failed (health reports it)
        self.running = False
        self.tokens_total = self.requests_total = self.steps_total = 0
        self.recent = collections.deque(maxlen=WINDOW)  # (seconds, fabric seconds, slots run) of recent decode steps
        self.emitted = collections.deque()               # (time, tokens) of recent steps, for tokens/s

    # -- the server thread's side ------------------------------------------------
    def submit(self, req: Request) -> None:
        if self.error or self.stopping.is_set():
            raise RocketError(self.error or "the server is shutting down")
        self.inbox.put(req)

    def cancel(self, req: Request) -> None:
        req.cancelled = True

    def stop(self) -> None:
        self.stopping.set()

    def metrics(self) -> dict:
        now = time.perf_counter()
        while self.emitted and now - self.emitted[0][0] > 10.0:
            self.emitted.popleft()
        recent = list(self.recent)
        step = sum(r[0] for r in recent) / len(recent) if recent else 0.0
        fab = sum(r[1] for r in recent) / max(sum(r[0] for r in recent), 1e-12) if recent else 0.0
        span = (now - self.emitted[0][0]) if len(self.emitted) > 1 else 0.0
        return {"tokens_generated_total": self.tokens_total, "requests_finished_total": self.requests_total,
                "decode_steps_total": self.steps_total, "streams_active": sum(r is not None for r in self.active),
                "requests_waiting": self.inbox.qsize() + len(self.waiting), "step_seconds": step,
                "fabric_share": fab, "slots": self.slots.m,
                "step_slots": sum(r[2] for r in recent) / len(recent) if recent else 0.0,
                "tokens_per_second": sum(n for _, n in self.emitted) / span if span > 0 else 0.0,
                **self._cache_metrics(), **self._rebalance_metrics()}

    def _cache_metrics(self) -> dict:
        """The expert cache of rank 0 (--expert-cache; every rank sees the same routing, each its own experts): rows
        that met a resident and a far expert, far bytes read, promotions, and the resident experts now."""
        xc = self.slots.engine.expert_cache
        if xc is None:
            return {}
        st = xc.stats
        rows = st.hit_rows + st.miss_rows
        return {"expert_cache_hit_rows_total": st.hit_rows, "expert_cache_miss_rows_total": st.miss_rows,
                "expert_cache_hit_rate": st.hit_rows / rows if rows else 1.0,
                "expert_cache_far_bytes_total": st.far_bytes, "expert_cache_swaps_total": st.swaps,
                "expert_cache_moved_bytes_total": st.moved_bytes,
                "expert_cache_resident_experts": sum(p.capacity for p in xc.policies.values())}

    def _rebalance_metrics(self) -> dict:
        """Live rebalancing on this rank (rank 0: every rank recomputes the same placements): placements recomputed,
        how many changed owners, the experts this rank read in and the seconds the steps waited for it all."""
        rb = self.slots.engine.rebalancer
        if rb is None:
            return {}
        st = rb.stats
        return {"rebalances_total": st.rebalances, "rebalances_changed_total": st.changed,
                "rebalance_experts_arrived_total": st.arrived, "rebalance_seconds_total": st.seconds}

    # -- rank 0's loop -------------------------------------------------------------
    def run(self) -> None:
        self.running = True
        try:
            while not self.stopping.is_set():
                self._iterate()
            while self.slots.pending:  # a step launched ahead of the last read: its tokens go nowhere
                self.slots.collect()
            bcast(self.comm, {"shutdown": True}, self.timeout, "shutdown")
        except Exception as e:
            self.error = str(e) or type(e).__name__
            raise
        finally:
            self.running = False
            why = self.error or "the server shut down"
            for req in [r for r in self.active if r is not None] + list(self.waiting) + self._drain():
                req.sink(("error", why))

    def _drain(self) -> list[Request]:
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def _iterate(self) -> None:
        self.waiting.extend(self._drain())
        for s, req in enumerate(self.active):  # a client that went away frees its slot before the next step
            if req is not None and req.cancelled:
                self.active[s] = None
        if self.slots.pending:  # a decode step in flight: launch the next one behind it where it may, then read it
            if self._follow_on():
                bcast(self.comm, {"next": True}, self.timeout, "step plan")
                self.slots.launch_next()
            self._collect()
            return
        joins = {}
        for s in range(self.slots.m):
            while self.active[s] is None and self.waiting:
                req = self.waiting.popleft()
                if not req.cancelled:
                    self.active[s], joins[s] = req, req.prompt
        decodes = {s: r.generated[-1] for s, r in enumerate(self.active) if r is not None and s not in joins}
        if not joins and not decodes:  # idle: wait for a request, and check on the other ranks now and then
            try:
                self.waiting.append(self.inbox.get(timeout=HEARTBEAT))
            except queue.Empty:
                bcast(self.comm, {"beat": True}, self.timeout, "heartbeat")
                acknowledge(self.comm, self.timeout, "the idle heartbeat")
            return
        bcast(self.comm, {"joins": joins, "decodes": decodes}, self.timeout, "step plan")
        if joins:  # the prompts' forward: its logits give each joining request its first token, now
            logits = self.slots.prefill(joins)
            now = time.perf_counter()
            fed = sorted(logits)
            reqs = [self.active[s] for s in fed]
            chosen = choose(torch.stack([logits[s] for s in fed]), [r.sampling for r in reqs],
                            [len(r.generated) for r in reqs])
            for s, r, tok in zip(fed, reqs, chosen):
                self._advance(s, r, tok, now, logits[s])
            self.emitted.append((now, len(fed)))
        if decodes:  # read back on the next call, after the next step is launched where it may be
            self.slots.launch(decodes)

    def _follow_on(self) -> bool:
        """Whether the next decode step may be launched before the one in flight is read: the same slots go on (none
        joins, none left, none ends at its length limit with the step in flight), every one greedy (the device's
        argmax feeds it), and the slots allow it (Slots.can_follow). A slot that ends at the step in flight on an
        end-of-text id or stop string gets one step more, whose token is dropped."""
        live = self.slots.pending[0][1]
        busy = [s for s, r in enumerate(self.active) if r is not None]
        if busy != live or (self.waiting and len(busy) < self.slots.m):
            return False
        for s in live:
            r = self.active[s]
            if not r.sampling.greedy or r.logprobs is not None or len(r.generated) + 1 >= r.max_tokens:
                return False
        return self.slots.can_follow()

    def _collect(self) -> None:
        """Read the oldest decode step in flight and advance its requests (those still there)."""
        live, st = self.slots.pending[0][1], self.slots.pending[0][4]
        width = len(live) if st is None else st.tokens.numel()  # the slots the step ran
        reqs = [self.active[s] for s in live]
        sampled = any(r is not None and not r.sampling.greedy for r in reqs)
        wanted = sampled or any(r is not None and r.logprobs is not None for r in reqs)
        live, chosen, logits, seconds, fab = self.slots.collect(logits=wanted)
        self.recent.append((seconds, fab, width))
        self.steps_total += 1
        now = time.perf_counter()
        fed = [(s, r, t) for s, r, t in zip(live, reqs, chosen) if r is not None and self.active[s] is r]
        if sampled:
            picked = choose(torch.stack([logits[s] for s, _, _ in fed]), [r.sampling for _, r, _ in fed],
                            [len(r.generated) for _, r, _ in fed]) if fed else []
            fed = [(s, r, t) for (s, r, _), t in zip(fed, picked)]
        for s, r, tok in fed:
            self._advance(s, r, tok, now, logits.get(s))
        self.emitted.append((now, len(fed)))

    def _advance(self, s: int, req: Request, tok: int, now: float, row: torch.Tensor | None = None) -> None:
        lp = logprobs(row, tok, req.logprobs) if req.logprobs is not None else None
        req.generated.append(tok)
        req.first_token = req.first_token or now
        self.tokens_total += 1
        why = req.stop.reason(req.generated, self.detok)
        if not why and (len(req.generated) >= req.max_tokens
                        or len(req.prompt) + len(req.generated) >= self.slots.capacity):
            why = "length"
        req.sink(("token", tok, self._delta(req, bool(why)), lp))
        if why:
            self.active[s] = None
            self.requests_total += 1
            req.sink(("done", why, {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.generated),
                                    "total_tokens": len(req.prompt) + len(req.generated)}))

    def _delta(self, req: Request, final: bool) -> str:
        """The text the request's tokens add: held back while it could be the start of a stop string or an
        incomplete character, and cut before a stop string. Decoded a few tokens at a time (text_piece), not the
        whole stream each step; the last delta from the whole stream's decode."""
        if self.detok is None:
            return ""
        if final:
            req.text = self.detok(req.generated)
        else:
            req.text, req.start, req.done = text_piece(self.detok, req.generated, req.text, req.start, req.done)
        full = cut_at_stop(req.text, req.stop.strings)
        if not final:
            hold = max((k for st in req.stop.strings for k in range(1, len(st)) if full.endswith(st[:k])), default=0)
            full = full[:len(full) - hold]
            full = full.rstrip("\ufffd")
        delta = full[len(req.sent):] if full.startswith(req.sent) else ""
        req.sent = full if full.startswith(req.sent) else req.sent
        return delta


def text_piece(detok, ids: list[int], text: str, start: int, done: int) -> tuple[str, int, int]:
    """ids decoded, given `text` = ids[:done] decoded, decoding only ids[start:] (start: where the last piece began,
    the context a byte-level token needs to finish a character begun before it) -> (text, start, done) for the next
    call; the same while the new ids end in an incomplete character. Where a decode of the window does not extend
    the one before (a tokenizer whose decode of a piece depends on more context) the whole stream is decoded once.
    The pieces join into the decode of all the ids at once (tests/test_serve_text.py)."""
    before = detok(ids[start:done])
    after = detok(ids[start:])
    if len(after) <= len(before) or after.endswith("\ufffd"):
        return text, start, done
    if not after.startswith(before):
        return detok(ids), len(ids), len(ids)
    return text + after[len(before):], done, len(ids)


def follow(comm, slots: Slots, timeout: float) -> None:
    """Every rank but 0: run the steps rank 0 plans until it says stop (each wait bounded by `timeout`), in rank 0's
    order: a step behind the one in flight ("next") is launched before that one is read; any other word reads the
    step in flight first."""
    while True:
        msg = bcast(comm, None, timeout, "next step plan")
        if msg.get("next"):
            slots.launch_next()
            slots.collect()
            continue
        if slots.pending:
            slots.collect()
        if msg.get("shutdown"):
            return
        if msg.get("beat"):
            acknowledge(comm, timeout, "the idle heartbeat")
            continue
        slots.prefill(msg["joins"])
        if msg["decodes"]:
            slots.launch(msg["decodes"])
