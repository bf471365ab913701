"""Continuous batching over M stream slots, on every rank of the split.

Rank 0 owns the requests: between decode steps it admits waiting requests into free slots, drops the ones that
ended or whose client went away, and tells every other rank the next step's plan in one small message (bcast):
which slots start (their prompt tokens) and which decode (the token each feeds). That is control, not routing:
the rows still move by the zero-metadata exchange inside the forward. Rank 0 draws each token (every rank would
draw the same, runtime/sampling.py), so the plan carries the drawn tokens and the ranks cannot diverge.

A step is a prefill forward for the slots that start (their prompts cut as the decode command cuts them), then one
decode forward for the slots that go on: the same forwards, with the same shapes per stream, as `decode` runs, so
a request's tokens are bitwise those the decode command gives the same prompt alone (batch invariance). An idle
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
from rocket_mpi.model.cache import clear_stream
from rocket_mpi.runtime.dist import acknowledge, bcast
from rocket_mpi.runtime.engine import CACHE_QUANTUM
from rocket_mpi.runtime.graph import GraphStep
from rocket_mpi.runtime.sampling import Sampling, Stop, choose, cut_at_stop

HEARTBEAT = 1.0  # seconds an idle rank 0 waits for a request before it checks on the other ranks
WINDOW = 64      # decode steps the step-time and fabric-share gauges average over


class Slots:
    """The persistent cache of M stream slots and the forwards that fill it (the same calls on every rank).

    path "host": each decode step is the host path's forward over the slots that decode (the others cost nothing).
    "graph" (or "device", the same without the CUDA graph): the decode step is the fixed-shape step of all M slots
    (runtime/graph.py GraphStep) fed the slots' tokens and positions from the host; a slot that does not decode
    this step runs at its next free position (what it writes there is overwritten before it is read), and its
    recurrent state, where the model has one, is put back after the step. The graph is captured once at start-up
    (warm) and again only where the longest slot passes a span."""

    def __init__(self, engine, slots: int, capacity: int, path: str = "host"):
        self.engine, self.m, self.path = engine, slots, path
        self.capacity = -(-capacity // CACHE_QUANTUM) * CACHE_QUANTUM
        self.cache = engine.model.new_cache(slots, self.capacity)
        self.steps = 0
        self.static = None

    @torch.inference_mode()
    def warm(self) -> None:
        """Run and capture the fixed-shape step before the first request (on every rank), then empty the slots."""
        if self.path == "host":
            return
        for _ in range(3):  # eager, capture, replay
            self.forward({}, {s: 0 for s in range(self.m)})
        for s in range(self.m):
            clear_stream(self.cache, s)

    @torch.inference_mode()
    def forward(self, joins: dict[int, list[int]], decodes: dict[int, int]) -> dict[int, torch.Tensor]:
        """Prefill the slots in `joins` (emptied first) with their prompts, then one decode step for the slots in
        `decodes` (slot -> the token it feeds). -> each of those slots' next-token logits [V]."""
        eng, m, out = self.engine, self.m, {}
        eng.step = self.steps
        if joins:
            for s in joins:
                clear_stream(self.cache, s)
            seqlens = [len(joins.get(s, ())) for s in range(m)]
            tokens = torch.tensor([t for s in range(m) for t in joins.get(s, ())], dtype=torch.long)
            eng.moe.reset()
            logits, _ = eng._forward(tokens, self.cache, seqlens)
            out.update((s, logits[s]) for s in joins)
        if decodes and self.path != "host":
            out.update(self._fixed_shape(decodes))
        elif decodes:
            seqlens = [1 if s in decodes else 0 for s in range(m)]
            tokens = torch.tensor([decodes[s] for s in sorted(decodes)], dtype=torch.long)
            eng.moe.reset()
            logits = eng.model.forward(tokens, self.cache, seqlens, eng.moe)
            out.update((s, logits[s]) for s in decodes)
        self.steps += 1
        return out

    def _fixed_shape(self, decodes: dict[int, int]) -> dict[int, torch.Tensor]:
        eng, m, cache = self.engine, self.m, self.cache
        if self.static is None:
            self.static = GraphStep(eng, cache, torch.zeros(m, dtype=torch.long), graph=self.path == "graph",
                                    keep_logits=True, ahead=0)
        st = self.static
        live = sorted(decodes)
        idle = [s for s in range(m) if s not in decodes]
        tokens = torch.zeros(m, dtype=torch.long)
        tokens[live] = torch.tensor([decodes[s] for s in live], dtype=torch.long)
        pos = cache.lengths.clamp(max=self.capacity - 1)
        kept = [(t, t[idle].clone()) for t in recurrent_state(cache)] if idle else []
        st.tokens.copy_(tokens)
        st.pos.copy_(pos)
        st.moe.seq.fill_(eng.seq)  # the host path's prefills moved the doorbell sequence on
        st.launch(self.steps, int(pos[live].max()))
        _, _, logits, _ = st.collect(self.steps)
        for t, saved in kept:
            t[idle] = saved
        cache.lengths[live] += 1
        return {s: logits[s] for s in live}


def recurrent_state(cache) -> list[torch.Tensor]:
    """The per-slot tensors a decode step updates in place whatever its position (GLM-5.3-Flash's KDA conv and
    recurrent states); a KV-style cache has none."""
    return [t for d in (getattr(cache, "conv", None), getattr(cache, "rec", None)) if d for t in d.values()]


@dataclass
class Request:
    """One completion: its prompt ids, limits and the sink its events go to (called from the scheduler's thread).
    Events: ("token", token id, text delta), then ("done", finish reason, usage) or ("error", message)."""
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop: Stop
    sink: object
    generated: list[int] = field(default_factory=list)
    sent: str = ""                 # the text already sent
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
        self.recent = collections.deque(maxlen=WINDOW)  # (seconds, fabric seconds) of recent decode steps
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
                "tokens_per_second": sum(n for _, n in self.emitted) / span if span > 0 else 0.0}

    # -- rank 0's loop -------------------------------------------------------------
    def run(self) -> None:
        self.running = True
        try:
            while not self.stopping.is_set():
                self._iterate()
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
        fab = self.slots.engine.fabric.stats
        f0, t0 = fab.seconds, time.perf_counter()
        logits = self.slots.forward(joins, decodes)
        dt = time.perf_counter() - t0
        if decodes and not joins:  # the gauges follow decode steps; a step with a prefill is counted apart
            self.recent.append((dt, fab.seconds - f0))
        self.steps_total += 1
        now = time.perf_counter()
        fed = sorted(logits)
        reqs = [self.active[s] for s in fed]
        chosen = choose(torch.stack([logits[s] for s in fed]), [r.sampling for r in reqs],
                        [len(r.generated) for r in reqs])
        for s, r, tok in zip(fed, reqs, chosen):
            self._advance(s, r, tok, now)
        self.emitted.append((now, len(logits)))

    def _advance(self, s: int, req: Request, tok: int, now: float) -> None:
        req.generated.append(tok)
        req.first_token = req.first_token or now
        self.tokens_total += 1
        why = req.stop.reason(req.generated, self.detok)
        if not why and (len(req.generated) >= req.max_tokens
                        or len(req.prompt) + len(req.generated) >= self.slots.capacity):
            why = "length"
        req.sink(("token", tok, self._delta(req, bool(why))))
        if why:
            self.active[s] = None
            self.requests_total += 1
            req.sink(("done", why, {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.generated),
                                    "total_tokens": len(req.prompt) + len(req.generated)}))

    def _delta(self, req: Request, final: bool) -> str:
        """The text the request's tokens add: held back while it could be the start of a stop string or an
        incomplete character, and cut before a stop string."""
        if self.detok is None:
            return ""
        full = cut_at_stop(self.detok(req.generated), req.stop.strings)
        if not final:
            hold = max((k for st in req.stop.strings for k in range(1, len(st)) if full.endswith(st[:k])), default=0)
            full = full[:len(full) - hold]
            full = full.rstrip("\ufffd")
        delta = full[len(req.sent):] if full.startswith(req.sent) else ""
        req.sent = full if full.startswith(req.sent) else req.sent
        return delta


def follow(comm, slots: Slots, timeout: float) -> None:
    """Every rank but 0: run the steps rank 0 plans until it says stop (each wait bounded by `timeout`)."""
    while True:
        msg = bcast(comm, None, timeout, "next step plan")
        if msg.get("shutdown"):
            return
        if msg.get("beat"):
            acknowledge(comm, timeout, "the idle heartbeat")
            continue
        slots.forward(msg["joins"], msg["decodes"])
