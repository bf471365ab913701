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
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from rocket_mpi.errors import RocketError
from rocket_mpi.moe.balance import balance
from rocket_mpi.moe.placement import Placement

DECAY = 0.95  # per decode step: a placement follows the firings of the last ~20 steps


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
    seconds: float = 0.0      # recompute + moves + table rewrites, waited for
    balance_seconds: float = 0.0  # of which recomputing the placements (balance())
    last_step: int = 0
    replicas: int = 0         # extra copies in the placement now, all MoE layers together

    def as_dict(self) -> dict:
        return {"rebalances": self.rebalances, "changed": self.changed, "arrived": self.arrived, "left": self.left,
                "moved_bytes": self.moved_bytes, "ms": 1e3 * self.seconds,
                "balance_ms": 1e3 * self.balance_seconds, "last_step": self.last_step,
                "replicas": self.replicas}


class Rebalancer:
    """The engine's live rebalancing: observe(delta, steps) from the expert cache's upkeep, rebalance(step) at the
    decode steps due(step) says; the placement it sets is the engine's. on_change[key](layer): a MoE implementation
    rewrites that layer's tables (moe/step.py)."""

    def __init__(self, engine, every: int, replicas: int, expert_bytes: int, slots: int, pairs: int):
        self.engine = engine
        self.every, self.replicas, self.expert_bytes = every, replicas, expert_bytes
        self.slots, self.pairs = slots, pairs
        self.layers = list(engine.cfg.moe_layers)
        n_exp = engine.cfg.n_routed_experts
        self.rows = np.zeros((len(self.layers), n_exp))
        self.active = np.zeros((len(self.layers), n_exp))
        self.weight = 0.0
        self.on_change: dict = {}
        self.stats = RebalanceStats()

    def observe(self, delta: np.ndarray, steps: int) -> None:
        """delta [n_moe, 2, E]: the rows of each expert and the steps it had rows in, over the last `steps` steps."""
        f = decay_factor(steps)
        self.rows = self.rows * f + delta[:, 0]
        self.active = self.active * f + delta[:, 1]
        self.weight = self.weight * f + steps

    def begin(self) -> None:
        """A new run: the accounting starts again (the decayed counts and the placement carry over)."""
        self.stats = RebalanceStats()

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def rebalance(self, step: int) -> None:
        """Recompute every MoE layer's placement and move this rank's experts where it changed."""
        if not self.weight:
            return
        e = self.engine
        t0 = time.perf_counter()
        old = e.placement
        owners = {}
        for i, layer in enumerate(self.layers):
            current = [list(o) if len(o) > 1 else o[0] for o in old.owners[layer]]
            owners[layer] = balance(self.rows[i] / self.weight, self.active[i] / self.weight, old.n_ranks,
                                    self.replicas, self.expert_bytes, None, current=current)
        new = Placement(owners, old.n_ranks, source=f"rebalanced at decode step {step}")
        self.stats.balance_seconds += time.perf_counter() - t0
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
        st = self.stats
        st.rebalances += 1
        st.last_step = step
        st.replicas = sum(new.replicas(la) for la in self.layers)
        changed = [la for la in self.layers if new.owners[la] != old.owners[la]]
        if changed:
            st.changed += 1
            e.placement = new
            xc = e.expert_cache
            for layer in changed:
                arrived, left, moved = e.experts[layer].rehome(new.owned(layer, e.rank))
                st.arrived += len(arrived)
                st.left += len(left)
                st.moved_bytes += moved
                if xc is not None:
                    xc.rebuild(layer)
                for fn in self.on_change.values():
                    fn(layer)
            if e.device.type == "cuda":  # the moves' copies, in the time
                torch.cuda.synchronize(e.device)
        st.seconds += time.perf_counter() - t0
