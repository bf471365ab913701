"""The expert cache: at most a budget of a rank's routed-expert weights in device memory, the rest elsewhere.

Where the rest lives:
    GPU ranks   far slots of each layer's packed experts (ops.PackedExperts): registered host memory that the expert
                kernel reads in place, so a miss costs its bytes over the host link and no extra launch or copy; the
                fixed-shape step's capture stays valid because residency is data (the slot tables and slot contents),
                not pointers baked into the graph.
    CPU ranks   the checkpoint itself: a missed expert is read (memory-mapped safetensors) and dequantised for the
                step that needs it and dropped after.

Which experts stay: every rank sees the whole routing of every step, so it counts exactly how often each of its
experts fires (the device plan adds to a [2, E] counter per layer inside the step; the host path counts on the host).
Between steps (every `interval` steps on the graphed path, where the counters are read) the Policy scores each expert
by its firings with exponential decay and swaps the best far experts for the worst resident ones. A swap moves bytes,
never bits: an expert's weights are the same bytes in either place and the kernel reads them the same way, so the
tokens are bitwise those of the all-resident run for every budget (tests/test_expert_cache.py).

Accounting: rows that met a resident expert (hits) or a far one (misses) add up to the rows routed to this rank's
experts; far bytes are the far experts' weights read per step (one read per expert with rows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from rocket_mpi.errors import RocketError

DECAY = 0.9          # per step: an expert's score is its firings over the last ~10 steps
HYSTERESIS = 1.0     # a far expert replaces a resident one when it scores this much higher (decayed firings); with
PROMOTIONS = 8       # at most this many swaps per layer at each upkeep (bounds the bytes one upkeep moves). Chosen on
                     # recorded traces replayed with the graphed engine's upkeep every 8 steps (benchmarks/bench_cache.py
                     # --interval 8): the fewest expert transfers (misses read + copies in and out) in the first 48 steps
                     # and over 200-400 steps (docs/PERFORMANCE.md, expert cache); a margin of 2 and 4 swaps left a cold
                     # start missing 5-8 points more
GIB = 2 ** 30


def warm_upkeep(done: int, every: int) -> bool:
    """The fixed-shape path's extra upkeeps while the cache is cold: after 1, 2, 4, ... decode steps, below `every`
    (its upkeep interval). With an upkeep every 8 steps alone, the first 48 steps of a cold start hit 84-90 % of expert
    reads on recorded traces; with these, 93-96 % (benchmarks/bench_cache.py --first 48, against --cold-upkeeps;
    docs/PERFORMANCE.md)."""
    return 0 < done < every and done & (done - 1) == 0


def parse_budget(text: str) -> float | None:
    """--expert-cache: 'auto' (None) or GiB >= 0 per rank."""
    if text == "auto":
        return None
    try:
        v = float(text)
    except ValueError:
        raise RocketError(f"--expert-cache {text!r}: expected auto or a size in GiB (e.g. 20, 0.5, 0)") from None
    if not math.isfinite(v) or v < 0:
        raise RocketError(f"--expert-cache {text!r}: expected auto or a finite size in GiB >= 0")
    return v


class Policy:
    """Which of a layer's owned experts hold its `capacity` device slots: decayed firing frequency with hysteresis.

    Pure bookkeeping over counts, so a recorded routing trace replays it offline (benchmarks/bench_cache.py) against
    LRU and Belady's optimum. Arrays over the owned experts (ascending ids), so an upkeep of every layer costs well
    under a millisecond of host time (a loop per expert took 31 ms for 45 layers of 288 on a 2-core VM, every 8
    steps, while the device waited)."""

    def __init__(self, owned: list[int], capacity: int, resident: list[int], decay: float = DECAY,
                 promotions: int = PROMOTIONS, hysteresis: float = HYSTERESIS):
        self.owned = sorted(owned)
        self.capacity = capacity
        res = set(resident)
        if len(res) != min(capacity, len(self.owned)) or not res <= set(self.owned):
            raise ValueError(f"resident {sorted(resident)}: expected {capacity} of the owned {self.owned}")
        self.decay, self.promotions, self.hysteresis = decay, promotions, hysteresis
        self.ids = np.array(self.owned, dtype=np.int64)
        self.scores = np.zeros(len(self.owned))             # per owned expert, in self.owned's order
        self.mask = np.isin(self.ids, list(res))            # resident, likewise

    @property
    def resident(self) -> set[int]:
        return set(self.ids[self.mask].tolist())

    def seed(self, share: np.ndarray) -> None:
        """Scores as if the experts had fired in `share` [E] of the steps for a long while (the decayed count's steady
        state): a recorded trace's rates (--expert-cache-from), so the first upkeeps weigh the first steps' firings
        against them rather than against nothing."""
        self.scores = np.asarray(share, dtype=np.float64)[self.ids] / (1.0 - self.decay)

    def carry(self, old: "Policy") -> None:
        """Take the scores of the experts `old` also owns."""
        _, i, j = np.intersect1d(self.ids, old.ids, assume_unique=True, return_indices=True)
        self.scores[i] = old.scores[j]

    def observe(self, active: np.ndarray, steps: int = 1) -> None:
        """active[e]: the steps (of the last `steps`) in which expert e had rows."""
        self.scores = self.scores * self.decay ** steps + np.asarray(active)[self.ids].astype(np.float64)

    def swaps(self) -> list[tuple[int, int]]:
        """(far expert in, resident expert out) pairs, best first; the policy's residency already updated."""
        if self.capacity == 0 or self.capacity >= len(self.owned):
            return []
        s, ids = self.scores, self.ids
        far = np.flatnonzero(~self.mask)
        res = np.flatnonzero(self.mask)
        far = far[np.lexsort((ids[far], -s[far]))][:self.promotions]   # highest score first, then lowest id
        res = res[np.lexsort((-ids[res], s[res]))][:self.promotions]   # lowest score first, then highest id
        out = []
        for a, b in zip(far.tolist(), res.tolist()):
            if s[a] <= s[b] + self.hysteresis:
                break
            out.append((int(ids[a]), int(ids[b])))
            self.mask[a], self.mask[b] = True, False
        return out


def first_resident(owned: list[int], capacity: int, prior: np.ndarray | None = None) -> list[int]:
    """The experts a layer starts with in device memory: the highest prior first (a recorded trace's share of steps
    in which each expert fired, --expert-cache-from), ties and no prior to the lowest ids."""
    order = sorted(owned, key=(lambda e: (-float(prior[e]), e)) if prior is not None else None)
    return sorted(order[:capacity])


@dataclass
class CacheStats:
    """Since the first decode step: rows and expert reads that met resident (hit) and far (miss) experts."""
    hit_rows: int = 0
    miss_rows: int = 0
    hit_reads: int = 0
    miss_reads: int = 0
    far_bytes: int = 0        # far experts' weights the kernel read (GPU) or the checkpoint gave (CPU)
    moved_bytes: int = 0      # promotions: bytes copied in (and the demoted expert's out)
    swaps: int = 0
    steps: int = 0

    def as_dict(self, resident_bytes: int, far_resident_bytes: int, capacity: dict[int, int],
                owned: dict[int, int]) -> dict:
        rows = self.hit_rows + self.miss_rows
        steps = max(self.steps, 1)
        return {"resident_gib": resident_bytes / GIB, "far_gib": far_resident_bytes / GIB,
                "resident_experts": sum(capacity.values()), "owned_experts": sum(owned.values()),
                "hit_rate": self.hit_rows / rows if rows else 1.0, "hit_rows": self.hit_rows,
                "miss_rows": self.miss_rows, "hit_reads": self.hit_reads, "miss_reads": self.miss_reads,
                "far_bytes_per_step": self.far_bytes / steps, "moved_bytes_per_step": self.moved_bytes / steps,
                "swaps": self.swaps, "steps": self.steps}


@dataclass
class ExpertCache:
    """The rank's cache over its layers' ExpertStores (moe/experts.py), kept up to date from firing counts.

    counters: cumulative [n_moe, 2, E] int32 tensors (any device) that the MoE steps add to; maintain() reads them,
    accounts the interval since the last call under the residency it ran with, then swaps. on_swap(layer): called
    after a layer's residency changed (the fixed-shape step refreshes its device slot table). listeners(delta,
    steps): given each decode interval's counts [n_moe, 2, E] (live rebalancing's decayed counts, moe/rebalance.py)."""
    stores: dict
    layers: list[int]                       # MoE layers in order: counter row i is layers[i]
    n_experts: int
    policies: dict[int, Policy] = field(default_factory=dict)
    counters: dict[str, torch.Tensor] = field(default_factory=dict)
    on_swap: dict = field(default_factory=dict)
    trace: list[np.ndarray] | None = None   # per maintenance: [n_moe, E] rows (--telemetry)
    stats: CacheStats = field(default_factory=CacheStats)
    last: np.ndarray | None = None
    listeners: list = field(default_factory=list)

    def __post_init__(self):
        for layer in self.layers:
            st = self.stores[layer]
            self.policies[layer] = Policy(st.owned, st.capacity, st.resident())
        self.last = np.zeros((len(self.layers), 2, self.n_experts), dtype=np.int64)
        self.base = np.zeros_like(self.last)  # the counts of counters since replaced

    @property
    def bounded(self) -> bool:
        """Some layer keeps fewer experts in device memory than it owns."""
        return any(len(p.owned) > p.capacity for p in self.policies.values())

    def counter(self, key: str, device, on_swap=None) -> torch.Tensor:
        """A cumulative counter on `device` for one MoE implementation (`key`: host or device) to add to, replacing
        that key's former one (its counts kept); on_swap(layer) as the class says."""
        old = self.counters.get(key)
        if old is not None:
            self.base += old.cpu().numpy().astype(np.int64)
        c = torch.zeros(len(self.layers), 2, self.n_experts, dtype=torch.int32, device=device)
        self.counters[key] = c
        if on_swap is not None:
            self.on_swap[key] = on_swap
        return c

    def begin(self) -> None:
        """A new run: the accounting starts again (the scores and residency carry over)."""
        self.stats = CacheStats()
        self.file_base = self._file()
        self.last = self._read()
        if self.trace is not None:
            self.trace.clear()

    def _file(self) -> tuple[int, int]:
        """(experts, bytes) read from the checkpoint files into far slots so far (GPU, host memory short)."""
        return (sum(getattr(self.stores[la], "file_reads", 0) for la in self.layers),
                sum(getattr(self.stores[la], "file_bytes", 0) for la in self.layers))

    def _read(self) -> np.ndarray:
        return sum((c.cpu().numpy().astype(np.int64) for c in self.counters.values()), self.base.copy())

    def maintain(self, steps: int, account: bool = True, promote: bool = True) -> None:
        """Account the last `steps` steps (account: decode steps, not the prefill), then promote. Reads the counters
        (waits for the device)."""
        now = self._read()
        delta, self.last = now - self.last, now
        if self.trace is not None and account:
            self.trace.append(delta[:, 0].astype(np.int32))
        for fn in self.listeners if account else ():
            fn(delta, steps)
        st = self.stats
        st.steps += steps if account else 0
        for i, layer in enumerate(self.layers):
            store, pol = self.stores[layer], self.policies[layer]
            rows, active = delta[i, 0][pol.ids], delta[i, 1][pol.ids]
            if account:  # under the residency the interval ran with (the policy's mirrors the store's)
                hit, miss = (active > 0) & pol.mask, (active > 0) & ~pol.mask
                st.hit_rows += int(rows[hit].sum())
                st.hit_reads += int(active[hit].sum())
                st.miss_rows += int(rows[miss].sum())
                st.miss_reads += int(active[miss].sum())
                st.far_bytes += int(active[miss].sum()) * store.read_bytes_per_expert
            pol.observe(delta[i, 1], steps)
            swaps = pol.swaps() if promote else []
            for e_in, e_out in swaps:
                store.swap(e_in, e_out)
            if swaps:
                st.swaps += len(swaps)
                st.moved_bytes += 2 * len(swaps) * store.read_bytes_per_expert
                for fn in self.on_swap.values():
                    fn(layer)

    def start_from(self, shares: dict) -> None:
        """Each layer's policy scores from a recorded trace's firing shares (Policy.seed); the residency is the load's
        (first_resident with the same shares)."""
        for layer in self.layers:
            self.policies[layer].seed(shares[layer])

    def rebuild(self, layer: int) -> None:
        """The layer's experts changed (live rebalancing, ExpertStore.rehome): a policy over the new ones, the scores
        of the experts that stay carried over."""
        old, st = self.policies[layer], self.stores[layer]
        pol = Policy(st.owned, st.capacity, st.resident(), old.decay, old.promotions, old.hysteresis)
        pol.carry(old)
        self.policies[layer] = pol

    def summary(self) -> dict:
        res = sum(self.stores[la].resident_bytes() for la in self.layers)
        far = sum(self.stores[la].far_resident_bytes() for la in self.layers)
        d = self.stats.as_dict(res, far, {la: self.policies[la].capacity for la in self.layers},
                               {la: len(self.policies[la].owned) for la in self.layers})
        (r0, b0), (r1, b1) = getattr(self, "file_base", (0, 0)), self._file()
        d["file_reads"], d["file_bytes_per_step"] = r1 - r0, (b1 - b0) / max(self.stats.steps, 1)
        d["unslotted_experts"] = sum(len(getattr(self.stores[la], "unslotted", ())) for la in self.layers)
        return d

    def trace_array(self) -> np.ndarray:
        """The recorded routing: [maintenances, n_moe, E] rows per expert."""
        if not self.trace:
            return np.zeros((0, len(self.layers), self.n_experts), dtype=np.int32)
        return np.stack(self.trace)


# -- the memory plan: how many experts of each layer stay in device memory ------------------------------------------
RESERVE_FRACTION = 0.06   # auto: device memory left for the KV cache, activations and workspaces ...
RESERVE_MIN = 2 * GIB     # ... at least this much
HOST_RESERVE = 2 * GIB    # host memory left free beside the far experts


def expert_bytes(hidden: int, inter: int, nvfp4: bool, packed: bool) -> int:
    """Device bytes of one routed expert: packed for the kernel (NVFP4 codes + scale bytes, or BF16 tiles) on a GPU,
    dense BF16 gate/up/down for the torch reference on a CPU."""
    hp, ip = -(-hidden // 64) * 64, -(-inter // 64) * 64
    if not packed:
        return 3 * hidden * inter * 2
    return hp * ip * 27 // 16 if nvfp4 else 6 * hp * ip


def host_available() -> int:
    """Bytes of host memory the kernel says can be had (MemAvailable), or 0 where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class CachePlan:
    """Experts per MoE layer kept in device memory (`capacity`; at least the most a layer owns: all), and why."""
    capacity: int
    bytes_per_expert: int
    owned_bytes: int          # all of this rank's routed experts
    resident_bytes: int
    reason: str
    far_slots: int | None = None  # GPU, host memory short: far slots per layer, the other far experts in the files

    def as_dict(self) -> dict:
        return {"capacity_per_layer": self.capacity, "bytes_per_expert": self.bytes_per_expert,
                "owned_gib": self.owned_bytes / GIB, "resident_gib": self.resident_bytes / GIB, "reason": self.reason,
                "far_slots_per_layer": self.far_slots}


def plan_capacity(owned: dict[int, list[int]], bpe: int, budget_gib: float | None, device_free: int,
                  host_free: int, far_in_host: bool, rank: int, where: str, slots: int = 0) -> CachePlan:
    """The residency of a rank's experts. owned: MoE layer -> its experts here; bpe: device bytes of one;
    budget_gib: --expert-cache (None: auto); device_free: bytes the experts may take in device memory under auto (the
    stack, KV cache and workspaces already set aside); host_free: host bytes for far experts (GPU ranks, far_in_host);
    where: the device, for the messages; slots: room for at least this many experts in every layer (live
    rebalancing's fixed slots), whatever it owns now. Where the far experts do not fit host_free, each layer gets the
    far slots that do (far_slots) and its other far experts stay in the checkpoint files, read into a far slot when a
    step needs them (moe/experts.py; the host decode path); not with live rebalancing's fixed slots."""
    sizes = [max(len(v), slots) for v in owned.values()]
    most = max(sizes, default=0)
    n_layers = max(sum(1 for v in sizes if v), 1)
    total = sum(sizes) * bpe
    if budget_gib is None:
        if total <= device_free:
            return CachePlan(most, bpe, total, total, "auto: every expert fits in device memory")
        cap = max(device_free, 0) // (n_layers * bpe)
        reason = (f"auto: {total / GIB:.2f} GiB of experts, {max(device_free, 0) / GIB:.2f} GiB free for them on "
                  f"{where}")
    else:
        budget = int(budget_gib * GIB)
        if budget > device_free and budget < total:
            raise RocketError(f"rank {rank}: --expert-cache {budget_gib:g} GiB does not fit on {where}: "
                              f"{max(device_free, 0) / GIB:.2f} GiB are free beside the stack and workspaces")
        cap = min(budget // (n_layers * bpe), most)
        reason = f"--expert-cache {budget_gib:g} GiB"
    cap = int(min(cap, most))
    resident = sum(min(v, cap) for v in sizes) * bpe
    far = total - resident
    reason += f": {cap} of {most} experts per layer resident"
    far_slots = None
    if far and far_in_host and far > host_free:
        far_slots = max(host_free, 0) // (n_layers * bpe)
        if far_slots < 1 or slots:
            why = ("live rebalancing keeps every expert in a slot" if slots else
                   f"not even one far slot per layer ({bpe / GIB:.3f} GiB each, {n_layers} layers) fits")
            raise RocketError(f"rank {rank}: out of host memory for the expert cache: {far / GIB:.2f} GiB of experts "
                              f"outside {where} must sit in host memory, {max(host_free, 0) / GIB:.2f} GiB are "
                              f"available, and {why}; give the cache more device memory or host memory "
                              f"(--host-memory), or use more ranks")
        reason += (f"; host memory short ({max(host_free, 0) / GIB:.2f} GiB for {far / GIB:.2f} GiB of far experts): "
                   f"{far_slots} far slots per layer, the other experts read from the checkpoint files when a step "
                   f"needs them")
    return CachePlan(cap, bpe, total, resident, reason, far_slots)


def plan_residency(cfg, owned: dict[int, list[int]], device: torch.device, stack_bytes: int, budget_gib: float | None,
                   share: int, rank: int, nvfp4: bool, packed: bool, slots: int = 0,
                   host_gib: float | None = None) -> CachePlan:
    """plan_capacity with this machine's memory: a GPU's free memory (split among the `share` ranks on it) less the
    stack and a reserve; a CPU rank's available host memory (split likewise) less a reserve. host_gib (--host-memory):
    host memory for a GPU rank's far experts (None: the available share less a reserve)."""
    bpe = expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size, nvfp4, packed)
    share = max(share, 1)
    host = host_available()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = max(RESERVE_MIN, int(RESERVE_FRACTION * total / share))
        dev_free = free // share - stack_bytes - reserve
        where = f"GPU {device} ({total / GIB:.1f} GiB, shared by {share} rank(s))"
        host_free = host // share - HOST_RESERVE if host_gib is None else int(host_gib * GIB)
    else:
        dev_free = host // share - RESERVE_MIN if host else 1 << 62  # the stack is in host memory already
        where = "host memory" + (f" (shared by {share} ranks)" if share > 1 else "")
        host_free = 0
    return plan_capacity(owned, bpe, budget_gib, dev_free, host_free, device.type == "cuda" and packed, rank, where,
                         slots)
