"""Live rebalancing (--rebalance-every STEPS): every rank recomputes the placement from the same decayed firing counts
at the same decode steps, and moves the experts that change owner, with no byte on the fabric.

Counts: the expert cache's counters (moe/cache.py) hold each expert's rows in every MoE layer on both decode paths
(the device plan adds them inside the step); every rank sees the same routing, so every rank reads the same integers.
Each decode interval's counts decay by DECAY per step, and balance() (moe/balance.py) takes the decayed mean rows per
step and the decayed share of steps with rows. The arithmetic is elementwise IEEE (no libm, no reductions), so the
same numbers, hence the same placement, on every rank.

Moves: an expert that arrives on a rank is read from the checkpoint into a free slot of the layer (ExpertStore.rehome).
Every rank keeps a fixed number of slots per layer (`slots`: the initial placement's most, or the even share of the
experts and their replicas, whichever is larger) and the pair tables a fixed length, so the packed buffers and the
device tables are rewritten in place and a captured step stays valid (no re-capture). The step after a move decodes
with the new owners; tokens are the same bits under any placement.

In the background (every >= 2): at a due step S every rank takes its snapshot of the counts and the placement, and a
worker thread computes the new placement from it and reads the experts this rank gains from the checkpoint (where the
checkpoint is files or is drawn on the CPU: a preset drawn on a GPU is drawn at the move), while the steps go on; at
step S + lag (lag = every // 2, the same on every rank: half the interval, so a placement held for STEPS steps is
computed and read in the time of STEPS / 2 of them) the steps pause, wait for the worker and move to the new
placement. Every rank computes the same placement from the same snapshot and moves at the same step, so the
ranks agree on the owners of every step as before; only the step at which a placement takes effect moves by lag.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np
import torch

from rocket_mpi.errors import RocketError
from rocket_mpi.moe.balance import balance
from rocket_mpi.moe.placement import Placement

DECAY = 0.95  # per decode step: a placement follows the firings of the last ~20 steps
WAIT = 600.0  # seconds a move waits for the background's placement and reads before it names the rank and gives up


def decay_factor(steps: int) -> float:
    """DECAY ** steps by repeated multiplication: the same bits on every machine (no libm)."""
    f = 1.0
    for _ in range(steps):
        f *= DECAY
    return f


def fixed_slots(placement: Placement, n_experts: int, replicas: int) -> int:
    """Experts per layer every rank has room for: the running placement's most, at least ceil((E + replicas) / N)."""
    return max(placement.most_owned(), -(-(n_experts + replicas) // placement.n_ranks))


@dataclass
class RebalanceStats:
    rebalances: int = 0       # placements recomputed
    changed: int = 0          # of which gave other owners
    arrived: int = 0          # experts read into this rank's slots
    left: int = 0             # experts this rank gave up
    moved_bytes: int = 0      # bytes read from the checkpoint into slots (and device slots refilled from far ones)
    seconds: float = 0.0      # what the steps waited for: the moves, table rewrites (and, without a background, all)
    balance_seconds: float = 0.0  # recomputing the placements (balance()), in the background where there is one
    background_seconds: float = 0.0  # the background's work: balance() and reading the arriving experts
    last_step: int = 0
    replicas: int = 0         # extra copies in the placement now, all MoE layers together

    def as_dict(self) -> dict:
        return {"rebalances": self.rebalances, "changed": self.changed, "arrived": self.arrived, "left": self.left,
                "moved_bytes": self.moved_bytes, "ms": 1e3 * self.seconds,
                "balance_ms": 1e3 * self.balance_seconds, "background_ms": 1e3 * self.background_seconds,
                "last_step": self.last_step, "replicas": self.replicas}


@dataclass
class Plan:
    """A placement computed from one snapshot, and this rank's arriving experts read ahead (per layer: expert ->
    what ExpertStore.rehome puts in its slot)."""
    placement: Placement
    ready: dict
    balance_seconds: float
    seconds: float


class Rebalancer:
    """The engine's live rebalancing: observe(delta, steps) from the expert cache's upkeep; at_step(step) where
    wants(step) (a due step: a snapshot, whose placement is computed in the background, or at once without one; a
    background placement's move, lag steps after its snapshot); finish() at the end of a run. rebalance(step): a
    snapshot's placement computed and moved to at once. The placement it sets is the engine's. on_change[key](layer): a
    MoE implementation rewrites that layer's tables (moe/step.py)."""

    def __init__(self, engine, every: int, replicas: int, expert_bytes: int, slots: int, pairs: int,
                 background: bool = True):
        self.engine = engine
        self.every, self.replicas, self.expert_bytes = every, replicas, expert_bytes
        self.slots, self.pairs = slots, pairs
        self.lag = every // 2 if background else 0  # snapshot to move, in decode steps (0: at once)
        self.layers = list(engine.cfg.moe_layers)
        n_exp = engine.cfg.n_routed_experts
        self.rows = np.zeros((len(self.layers), n_exp))
        self.active = np.zeros((len(self.layers), n_exp))
        self.weight = 0.0
        self.on_change: dict = {}
        self.stats = RebalanceStats()
        self.next_due = every
        self.pending: tuple[int, Future] | None = None  # (the step it moves at, the background's Plan)
        self._pool: ThreadPoolExecutor | None = None

    def observe(self, delta: np.ndarray, steps: int) -> None:
        """delta [n_moe, 2, E]: the rows of each expert and the steps it had rows in, over the last `steps` steps."""
        f = decay_factor(steps)
        self.rows = self.rows * f + delta[:, 0]
        self.active = self.active * f + delta[:, 1]
        self.weight = self.weight * f + steps

    def begin(self, forget: bool = False) -> None:
        """A new run (its decode steps counted from 1): the accounting starts again (the decayed counts and the
        placement carry over; forget: the counts start again too)."""
        self.finish()
        self.stats = RebalanceStats()
        self.next_due = self.every
        if forget:
            self.rows[:] = 0.0
            self.active[:] = 0.0
            self.weight = 0.0

    def wants(self, step: int) -> bool:
        """Whether the steps pause before decode step `step` (or, for a caller that pauses only now and then: have
        passed a step where they should have) for at_step."""
        return step >= self.next_due or (self.pending is not None and step >= self.pending[0])

    def at_step(self, step: int) -> None:
        """Before decode step `step`, with no step in flight: a background placement due now is moved to, and a
        snapshot due now is taken (its placement started in the background, or computed and moved to at once)."""
        if self.pending is not None and step >= self.pending[0]:
            self._move_to_pending(step)
        if step >= self.next_due:
            self.next_due = (step // self.every + 1) * self.every
            if not self.weight:
                return
            if not self.lag:
                self.rebalance(step)
                return
            self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="rebalance")
            snap = (self.rows / self.weight, self.active / self.weight, self.engine.placement)
            self.pending = (step + self.lag, self._pool.submit(self._plan, step, *snap, True))

    def finish(self) -> None:
        """The run ended (on every rank at the same step): a placement still in the background is dropped."""
        if self.pending is not None:
            _, fut = self.pending
            self.pending = None
            self._result(fut, "the end of the run")

    def rebalance(self, step: int) -> None:
        """Recompute every MoE layer's placement from the counts now and move this rank's experts where it changed."""
        if not self.weight:
            return
        t0 = time.perf_counter()
        plan = self._plan(step, self.rows / self.weight, self.active / self.weight, self.engine.placement, False)
        self.stats.balance_seconds += plan.balance_seconds
        self._move(step, plan)
        self.stats.seconds += time.perf_counter() - t0

    def _move_to_pending(self, step: int) -> None:
        t0 = time.perf_counter()
        _, fut = self.pending
        self.pending = None
        plan = self._result(fut, f"decode step {step}")
        self.stats.balance_seconds += plan.balance_seconds
        self.stats.background_seconds += plan.seconds
        self._move(step, plan)
        self.stats.seconds += time.perf_counter() - t0

    def _result(self, fut: Future, when: str) -> Plan:
        try:
            return fut.result(timeout=WAIT)
        except FutureTimeout:
            raise RocketError(f"rank {self.engine.rank}: live rebalancing: the placement computed in the background "
                              f"was not ready within {WAIT:.0f} s at {when}") from None

    def _plan(self, step: int, rows: np.ndarray, active: np.ndarray, old: Placement, read_ahead: bool) -> Plan:
        """The placement of every MoE layer from the decayed counts (per step: rows, and share of steps with rows),
        checked against the fixed slots and tables; read_ahead: this rank's arriving experts read from the checkpoint
        too, where that needs no GPU (ExpertStore.prepare)."""
        e = self.engine
        t0 = time.perf_counter()
        owners = {}
        for i, layer in enumerate(self.layers):
            current = [list(o) if len(o) > 1 else o[0] for o in old.owners[layer]]
            owners[layer] = balance(rows[i], active[i], old.n_ranks, self.replicas, self.expert_bytes, None,
                                    current=current)
        new = Placement(owners, old.n_ranks, source=f"rebalanced at decode step {step}")
        t1 = time.perf_counter()
        for layer in self.layers:
            for r in range(new.n_ranks):
                if len(new.owned(layer, r)) > self.slots:
                    raise RocketError(f"rank {e.rank}: live rebalancing at decode step {step} gave rank {r} "
                                      f"{len(new.owned(layer, r))} experts of MoE layer {layer}, more than its "
                                      f"{self.slots} slots")
            if new.table(layer).n_pairs > self.pairs:
                raise RocketError(f"rank {e.rank}: live rebalancing at decode step {step} gave MoE layer {layer} "
                                  f"{new.replicas(layer)} replicas, more than the "
                                  f"{self.pairs - len(new.owners[layer])} its tables hold")
        ready = {}
        if read_ahead:
            for layer in self.layers:
                store, mine = e.experts[layer], new.owned(layer, e.rank)
                if new.owners[layer] != old.owners[layer]:
                    ready[layer] = store.prepare([x for x in mine if x not in set(old.owned(layer, e.rank))])
        return Plan(new, ready, t1 - t0, time.perf_counter() - t0)

    def _move(self, step: int, plan: Plan) -> None:
        """Make `plan` the engine's placement: this rank's experts moved where a layer changed, the tables rewritten."""
        e, new = self.engine, plan.placement
        st = self.stats
        st.rebalances += 1
        st.last_step = step
        st.replicas = sum(new.replicas(la) for la in self.layers)
        old = e.placement
        changed = [la for la in self.layers if new.owners[la] != old.owners[la]]
        if changed:
            st.changed += 1
            e.placement = new
            xc = e.expert_cache
            for layer in changed:
                arrived, left, moved = e.experts[layer].rehome(new.owned(layer, e.rank), plan.ready.get(layer))
                st.arrived += len(arrived)
                st.left += len(left)
                st.moved_bytes += moved
                if xc is not None:
                    xc.rebuild(layer)
                for fn in self.on_change.values():
                    fn(layer)
            if e.device.type == "cuda":  # the moves' copies, in the time
                torch.cuda.synchronize(e.device)
