"""Routed experts this rank owns, and the torch reference that computes them.

Each expert runs over exactly its rows: the same inputs, in the same order, with the same shapes
whichever rank owns it, so a row's output is bit-identical on the owner and on a single rank. A replicated
expert (moe/placement.py) is loaded by each of its owners, each computing its share of the rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rocket_mpi import ops
from rocket_mpi.ops.stack import linear_rows
from rocket_mpi.checkpoint.reader import CheckpointReader


# loading packs NVFP4 experts in batches: at most LOAD_BATCH_MAX, and about LOAD_BATCH_BYTES of device memory for the
# packing's temporaries (about PACK_TEMP_FACTOR times an expert's unpacked codes, one byte per weight)
LOAD_BATCH_BYTES = 512 << 20
LOAD_BATCH_MAX = 16
PACK_TEMP_FACTOR = 6


class ExpertSource:
    """One MoE layer's routed experts as the checkpoint holds them: what loading and live rebalancing read."""

    def __init__(self, reader: CheckpointReader, layer: int, prefix: str | None, device, s2_down: torch.Tensor):
        cfg = reader.config
        self.reader, self.layer, self.device, self.s2 = reader, layer, device, s2_down
        self.h, self.i = cfg.hidden_size, cfg.moe_intermediate_size
        self.pre = prefix or f"model.layers.{layer}.mlp.experts"

    def read(self, e: int):
        """(gate, up, down) reader Linears of expert e."""
        r, pre, h, i = self.reader, self.pre, self.h, self.i
        return r.linear(f"{pre}.{e}.gate_proj", i, h), r.linear(f"{pre}.{e}.up_proj", i, h), \
            r.linear(f"{pre}.{e}.down_proj", h, i)

    def dense(self, e: int, parts=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) BF16 of expert e for the torch reference, down without its weight_scale_2."""
        g, u, d = parts or self.read(e)
        if d.nvfp4 and float(d.weight_scale_2) != float(self.s2[e]):
            raise AssertionError("s2_down table disagrees with the expert's own weight_scale_2")
        return torch.cat((g.dense(), u.dense()), dim=0), d.dense(with_global_scale=False)

    @staticmethod
    def kernel_parts(parts):
        """(gate, up, down) as the expert kernel packs them: NVFP4 Linears as they are, BF16 ones dense; and whether
        they are NVFP4."""
        g, u, d = parts
        nv = g.nvfp4 and u.nvfp4 and d.nvfp4
        return ((g, u, d) if nv else (g.dense(), u.dense(), d.dense())), nv

    def packed(self, e: int, bf16: bool, device=None) -> ops.PackedExperts:
        """Expert e alone in the kernel's layout (one slot, on `device`, default the engine's): what a move copies
        into a slot (a far slot's copy is packed in host memory)."""
        parts, nv = self.kernel_parts(self.read(e))
        if nv == bf16:
            raise AssertionError(f"layer {self.layer}: mixed NVFP4 and BF16 routed experts")
        packer = ops.ExpertPacker([e], self.h, self.i, bf16=bf16, device=device or self.device)
        packer.add(e, *parts)
        return packer.done()


class ExpertStore:
    """Owned experts of one MoE layer: gate_up [2I, H] and down [H, I] BF16 (NVFP4 dequantised).

    `down` leaves out its NVFP4 weight_scale_2: the scatter applies it (s2_down), which is why every
    rank loads the s2_down table of all experts.
    """

    def __init__(self, layer: int, owned: list[int], gate_up: dict[int, torch.Tensor], down: dict[int, torch.Tensor],
                 s2_down: torch.Tensor, packed_bytes: int, swiglu_limit: float | None = None):
        self.layer = layer
        self.owned = owned
        self.capacity = len(owned)   # experts kept in device memory (the expert cache, moe/cache.py)
        self.fetch = None            # CPU, bounded: expert id -> (gate_up, down) read from the checkpoint
        # GPU, host memory short: owned experts with no slot (in the checkpoint files only), read into a far slot
        # when a step needs them (_compute_staged); the far experts' last use (a launch count there), to pick which
        # far slot to reuse
        self.unslotted: set[int] = set()
        self.far_used: dict[int, int] = {}
        self.launches = 0
        self.file_reads = 0          # experts read from the checkpoint into a far slot, and their bytes
        self.file_bytes = 0
        self.source: ExpertSource | None = None  # where loading read the experts (live rebalancing reads there too)
        self.gate_up = gate_up
        self.down = down
        self.s2_down = s2_down       # [E] fp32, all experts
        self.packed_bytes = packed_bytes
        self.swiglu_limit = swiglu_limit
        # bytes one expert's weights cost to read per launch on the path compute() takes (dense BF16 here)
        self.packed = None           # ops.PackedExperts when the CUDA kernel runs them
        self.read_bytes_per_expert = 0
        if owned and gate_up:
            e = next(iter(gate_up))  # any expert held here (a bounded cache's need not include the lowest id)
            self.read_bytes_per_expert = (gate_up[e].numel() + down[e].numel()) * gate_up[e].element_size()

    @classmethod
    def load(cls, reader: CheckpointReader, layer: int, owned: list[int], prefix: str | None = None,
             device=None, resident: list[int] | None = None, slots: int | None = None,
             near: int | None = None, far_slots: int | None = None) -> "ExpertStore":
        """`prefix`: the experts' tensor-name prefix (default model.layers.{layer}.mlp.experts).
        On a GPU with the CUDA extension built, NVFP4 experts stay packed and run in the batch-invariant
        kernel (ops.nvfp4_experts), and BF16 experts are packed into the same kernel's BF16 tiles; otherwise they
        are dequantised to BF16 for the torch reference. `resident`: the owned experts kept in device memory (the
        expert cache; None: all): on a GPU the others go to far slots in host memory, on a CPU they are read from
        the checkpoint when a step needs them. `slots`: room for this many experts (live rebalancing: a fixed
        number, more than owned leaves spare slots); `near`: how many of them in device memory (default: the
        resident experts', all where resident is None); `far_slots` (GPU, host memory short): at most this many far
        slots, the far experts past them read from the checkpoint when a step needs them (compute, swap)."""
        cfg = reader.config
        h, i, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        pre = prefix or f"model.layers.{layer}.mlp.experts"
        s2 = torch.ones(n, dtype=torch.float32)
        for e in range(n):  # one float per expert: the only thing a rank needs of foreign experts
            name = f"{pre}.{e}.down_proj.weight_scale_2"
            if name in reader:
                s2[e] = float(reader.get(name, None, (torch.float32,), finite=True).reshape(()))
        src = ExpertSource(reader, layer, prefix, device, s2)
        gate_up, down, nbytes, packer = {}, {}, 0, None
        use_kernel = device is not None and ops.on_gpu(device)
        keep = set(owned if resident is None else resident)
        n_slots = max(len(owned), slots or 0)
        dense_bytes = 0
        batch: list = []  # NVFP4 experts read, not yet packed: the packer packs them together (LOAD_BATCH_BYTES)
        per_batch = max(1, min(LOAD_BATCH_MAX, LOAD_BATCH_BYTES // (PACK_TEMP_FACTOR * 2 * i * h)))
        for e in owned:
            if packer is not None and e in packer.unslotted:
                continue  # in the checkpoint only (host memory short): read when a step needs it
            g, u, d = src.read(e)
            nv = g.nvfp4 and u.nvfp4 and d.nvfp4
            if use_kernel:
                # packed as read (NVFP4 tiles where all three parts are NVFP4, else BF16 tiles: parts of mixed
                # formats, e.g. NVFP4 gate/up with an FP8 down, decoded), one expert at a time (ops.ExpertPacker)
                if packer is None:
                    packer = ops.ExpertPacker(owned, h, i, bf16=not nv, device=device,
                                              resident=None if resident is None else sorted(keep),
                                              slots=slots if far_slots is None else None,
                                              near_slots=near, far_slots=far_slots)
                    if e in packer.unslotted:
                        continue
                elif packer.bf16 == nv:
                    raise AssertionError(f"layer {layer}: mixed NVFP4 and BF16 routed experts")
                parts, _ = src.kernel_parts((g, u, d))
                nbytes += (sum(x.weight.numel() * x.weight.element_size() for x in parts) if nv
                           else sum(x.numel() * x.element_size() for x in parts))  # what the kernel reads
                batch.append((e, *parts))
                if len(batch) >= (per_batch if nv else 1):
                    packer.add_many(batch)
                    batch = []
                continue
            nbytes += sum(x.weight.numel() * x.weight.element_size() for x in (g, u, d))
            dense_bytes = 3 * h * i * 2
            if e in keep:
                gate_up[e], down[e] = src.dense(e, (g, u, d))
        if batch:
            packer.add_many(batch)
        per_expert = nbytes // max(len(packer.slot), 1) if packer is not None else 0
        if packer is not None and packer.unslotted:  # the unslotted experts were not read: the same size each
            nbytes = per_expert * len(owned)
        store = cls(layer, owned, gate_up, down, s2, nbytes, cfg.swiglu_limit)
        store.source = src
        if packer is not None:
            if gate_up:
                raise AssertionError(f"layer {layer}: mixed NVFP4 and BF16 routed experts")
            store.packed = packer.done()
            store.unslotted = set(packer.unslotted)
            store.read_bytes_per_expert = per_expert
            store.capacity = store.packed.near
        else:
            store.read_bytes_per_expert = dense_bytes
            store.fetch = src.dense
            store.capacity = (n_slots if resident is None else len(keep)) if near is None else near
        return store

    # -- the expert cache (moe/cache.py) ------------------------------------------------
    def is_resident(self, e: int) -> bool:
        if self.packed is not None:
            return e in self.packed.slot and self.packed.slot[e] < self.packed.near
        return e in self.gate_up

    def resident(self) -> list[int]:
        return [e for e in self.owned if self.is_resident(e)]

    def swap(self, e_in: int, e_out: int) -> None:
        """Far expert e_in takes resident expert e_out's place in device memory. An unslotted e_in (in the checkpoint
        only) is read into e_out's device slot, and e_out becomes unslotted (the checkpoint has its bytes)."""
        if self.packed is not None:
            pk = self.packed
            if e_in in self.unslotted:
                if not self.is_resident(e_out):
                    raise ValueError(f"layer {self.layer}: swap {e_in} in for {e_out}: {e_out} must be resident")
                slot = pk.slot[e_out]
                pk.drop(e_out)
                pk.put(e_in, slot, self.source.packed(e_in, pk.bf16))
                self.unslotted.discard(e_in)
                self.unslotted.add(e_out)
                return
            pk.swap(e_in, e_out)
            return
        if e_in in self.gate_up or e_out not in self.gate_up:
            raise ValueError(f"layer {self.layer}: swap {e_in} in for {e_out}: {e_in} must be far, {e_out} resident")
        dev = self.gate_up[e_out].device
        gu, d = self.fetch(e_in)
        del self.gate_up[e_out], self.down[e_out]
        self.gate_up[e_in], self.down[e_in] = gu.to(dev), d.to(dev)

    # -- live rebalancing (moe/rebalance.py) ---------------------------------------------
    def prepare(self, experts: list[int]) -> dict:
        """The experts' weights read from the checkpoint for a later rehome (live rebalancing reads them in the
        background while steps run), in host memory: {} where the checkpoint is drawn on a GPU (a preset), whose
        experts rehome draws at the move instead."""
        if getattr(self.source.reader, "device", torch.device("cpu")).type != "cpu":
            return {}
        pk = self.packed
        if pk is not None:
            return {e: self.source.packed(e, pk.bf16, device="cpu") for e in experts}
        return {e: self.source.dense(e) for e in experts}

    def rehome(self, owned: list[int], ready: dict | None = None) -> tuple[list[int], list[int], int]:
        """Hold the experts `owned` from now on: the ones that leave free their slots, the ones that arrive are read
        from the checkpoint (or taken from `ready`, prepare's) into free slots (device slots first), and a far
        expert takes a device slot left free. The slots are fixed, so the packed buffers stay where they are (a
        captured step stays valid: the caller rewrites the slot tables). -> (arrived, left, bytes read)."""
        owned = sorted(owned)
        left = [e for e in self.owned if e not in set(owned)]
        arrived = [e for e in owned if e not in set(self.owned)]
        ready = ready or {}
        pk = self.packed
        moved = 0
        if pk is not None:
            if len(owned) > pk.n_slots:
                raise ValueError(f"layer {self.layer}: {len(owned)} experts do not fit the {pk.n_slots} slots")
            for e in left:
                pk.drop(e)
            for e in arrived:
                src = ready[e] if e in ready else self.source.packed(e, pk.bf16)
                pk.put(e, pk.free_slots()[0], src)
                moved += pk.bytes_per_expert
            for e in sorted(e for e, s in pk.slot.items() if s >= pk.near):  # device slots filled first
                free = pk.free_slots()
                if not free or free[0] >= pk.near:
                    break
                pk.move(e, free[0])
                moved += pk.bytes_per_expert
        else:
            dev = next(iter(self.gate_up.values())).device if self.gate_up else torch.device("cpu")
            for e in left:
                self.gate_up.pop(e, None)
                self.down.pop(e, None)
            for e in arrived + [e for e in owned if e not in arrived and e not in self.gate_up]:
                if len(self.gate_up) >= self.capacity:
                    break
                gu, d = ready[e] if e in ready else self.source.dense(e)
                self.gate_up[e], self.down[e] = gu.to(dev), d.to(dev)
                moved += (gu.numel() + d.numel()) * gu.element_size()
        self.owned = owned
        return arrived, left, moved

    def _weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) of expert e: resident, or read from the checkpoint for this step (a CPU cache miss)."""
        if e in self.gate_up:
            return self.gate_up[e], self.down[e]
        if self.fetch is None or e not in self.owned:
            raise KeyError(f"layer {self.layer}: expert {e} is not on this rank")
        return self.fetch(e)

    def _compute_staged(self, x: torch.Tensor, tokens: torch.Tensor, segments: list[tuple[int, int, int]],
                        base: int, n: int) -> torch.Tensor:
        """compute() where some owned experts have no slot: the segments in runs whose unslotted experts fit the
        far slots the run does not read, each run's unslotted experts read from the checkpoint into far slots (the
        least recently read far experts' go), then the run's launch. A row's bits do not depend on which rows share
        its launch (the kernel is batch-invariant), so the runs give the bits one launch would."""
        pk = self.packed
        self.launches += 1
        n_far = pk.n_slots - pk.near
        if n_far < 1:
            raise RuntimeError(f"layer {self.layer}: experts {sorted(self.unslotted)} are in the checkpoint only and "
                               f"there is no far slot to read them into")
        out = torch.empty(n, x.shape[1], dtype=torch.bfloat16, device=x.device)
        is_far = lambda e: e in pk.slot and pk.slot[e] >= pk.near  # noqa: E731

        def launch(run: list, need: set) -> None:
            keep = {e for e, s, t in run if t > s}
            if need:
                if x.is_cuda:  # the far slots about to be rewritten may still be read by launches in flight
                    torch.cuda.current_stream(x.device).synchronize()
                for e in sorted(need):
                    spare = [sl for sl in pk.free_slots() if sl >= pk.near]
                    if spare:
                        slot = spare[0]
                    else:  # the far expert read longest ago that this run does not read
                        _, victim = min((self.far_used.get(f, 0), f) for f in pk.slot if is_far(f) and f not in keep)
                        slot = pk.slot[victim]
                        pk.drop(victim)
                        self.unslotted.add(victim)
                    pk.put(e, slot, self.source.packed(e, pk.bf16, device="cpu"))
                    self.unslotted.discard(e)
                    self.file_reads += 1
                    self.file_bytes += self.read_bytes_per_expert
            for e in keep:
                if is_far(e):
                    self.far_used[e] = self.launches
            lo, hi = run[0][1], run[-1][2]
            if hi > lo:
                out[lo - base:hi - base] = ops.nvfp4_experts(x, run, pk, lo, tokens[lo:hi], self.swiglu_limit)

        # a run's experts as things stand when it starts (a run's reads may take far slots a later one counted on)
        run, need, far_here = [], set(), set()
        for seg in segments:
            e, s, t = seg
            if t > s:
                if run and len(need | ({e} if e in self.unslotted else set())) + \
                        len(far_here | ({e} if is_far(e) else set())) > n_far:
                    launch(run, need)
                    run, need, far_here = [], set(), set()
                if e in self.unslotted:
                    need.add(e)
                elif is_far(e):
                    far_here.add(e)
            run.append(seg)
        launch(run, need)
        return out

    def far_resident_bytes(self) -> int:
        """Bytes of owned experts outside device memory: far slots in host memory (GPU); 0 on a CPU (the
        checkpoint holds them)."""
        return self.packed.far_bytes if self.packed is not None else 0

    def compute(self, x: torch.Tensor, tokens: torch.Tensor, segments: list[tuple[int, int, int]],
                base: int) -> torch.Tensor:
        """Rows of this rank's block: x [T, H]; segments (expert, start, end) in canonical row indices
        starting at `base`. Returns [end-base, H] BF16 without s2_down."""
        n = (segments[-1][2] - base) if segments else 0
        if self.packed is not None and n:
            if self.unslotted:  # host memory short: some experts are in the checkpoint files only
                return self._compute_staged(x, tokens, segments, base, n)
            return ops.nvfp4_experts(x, segments, self.packed, base, tokens[base:base + n], self.swiglu_limit)
        out = torch.empty(n, x.shape[1], dtype=torch.bfloat16, device=x.device)
        for e, start, end in segments:
            if end == start:
                continue
            xe = x[tokens[start:end]]                                        # [n_e, H]
            w_gu, w_dn = self._weights(e)
            # linear_rows: a row's bits whatever number of rows the batch routes to its expert
            gate, up = linear_rows(xe, w_gu.to(xe.device)).chunk(2, dim=-1)
            if self.swiglu_limit is not None:  # GLM-5.3-Flash: clamp before the activation
                gate = gate.clamp(max=self.swiglu_limit)
                up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
            out[start - base:end - base] = linear_rows(F.silu(gate) * up, w_dn.to(xe.device))
        return out

    def to(self, device) -> "ExpertStore":
        if self.packed is not None:
            self.packed = self.packed.to(device)  # built on the engine's device: a no-op there
        self.gate_up = {e: t.to(device) for e, t in self.gate_up.items()}
        self.down = {e: t.to(device) for e, t in self.down.items()}
        return self

    def resident_bytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        return sum(t.numel() * t.element_size() for t in list(self.gate_up.values()) + list(self.down.values()))
