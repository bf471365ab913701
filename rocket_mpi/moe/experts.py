"""Routed experts this rank owns, and the torch reference that computes them.

Each expert runs over exactly its rows: the same inputs, in the same order, with the same shapes
whichever rank owns it, so a row's output is bit-identical on the owner and on a single rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rocket_mpi.checkpoint.reader import CheckpointReader


class ExpertStore:
    """Owned experts of one MoE layer: gate_up [2I, H] and down [H, I] BF16 (NVFP4 dequantised).

    `down` leaves out its NVFP4 weight_scale_2: the scatter applies it (s2_down), which is why every
    rank loads the s2_down table of all experts.
    """

    def __init__(self, layer: int, owned: list[int], gate_up: dict[int, torch.Tensor], down: dict[int, torch.Tensor],
                 s2_down: torch.Tensor, packed_bytes: int, swiglu_limit: float | None = None):
        self.layer = layer
        self.owned = owned
        self.gate_up = gate_up
        self.down = down
        self.s2_down = s2_down       # [E] fp32, all experts
        self.packed_bytes = packed_bytes
        self.swiglu_limit = swiglu_limit
        # bytes one expert's weights cost to read per launch on the path compute() takes (dense BF16 here)
        self.packed = None           # rocket_mpi.kernels.PackedExperts when the CUDA kernel runs them
        self.read_bytes_per_expert = 0
        if owned and gate_up:
            e = owned[0]
            self.read_bytes_per_expert = (gate_up[e].numel() + down[e].numel()) * gate_up[e].element_size()

    @classmethod
    def load(cls, reader: CheckpointReader, layer: int, owned: list[int], prefix: str | None = None,
             device=None) -> "ExpertStore":
        """`prefix`: the experts' tensor-name prefix (default model.layers.{layer}.mlp.experts).
        On a GPU with the CUDA extension built, NVFP4 experts stay packed and run in the batch-invariant
        kernel (rocket_mpi.kernels), and BF16 experts are packed into the same kernel's BF16 tiles
        (ROCKET_BF16_EXPERTS=grouped keeps them dense: F.linear eagerly, torch._grouped_mm in the graphed
        step); otherwise they are dequantised to BF16 for the torch reference."""
        cfg = reader.config
        h, i, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        pre = prefix or f"model.layers.{layer}.mlp.experts"
        s2 = torch.ones(n, dtype=torch.float32)
        for e in range(n):  # one float per expert: the only thing a rank needs of foreign experts
            name = f"{pre}.{e}.down_proj.weight_scale_2"
            if name in reader:
                s2[e] = float(reader.get(name, None, (torch.float32,), finite=True).reshape(()))
        gate_up, down, nbytes, packer = {}, {}, 0, None
        use_kernel = kernels_enabled(device)
        bf16_kernel = bf16_kernel_enabled() and use_kernel  # a bad ROCKET_BF16_EXPERTS fails everywhere
        for e in owned:
            g = reader.linear(f"{pre}.{e}.gate_proj", i, h)
            u = reader.linear(f"{pre}.{e}.up_proj", i, h)
            d = reader.linear(f"{pre}.{e}.down_proj", h, i)
            nv = g.nvfp4 and u.nvfp4 and d.nvfp4
            if (use_kernel and nv) or (bf16_kernel and not (g.nvfp4 or u.nvfp4 or d.nvfp4)):
                # packed as read, one expert at a time (kernels.ExpertPacker)
                if packer is None:
                    from rocket_mpi import kernels
                    packer = kernels.ExpertPacker(owned, h, i, bf16=not nv, device=device)
                elif packer.bf16 == nv:
                    raise AssertionError(f"layer {layer}: mixed NVFP4 and BF16 routed experts")
                parts = (g, u, d) if nv else (g.dense(), u.dense(), d.dense())
                nbytes += (sum(x.weight.numel() * x.weight.element_size() for x in parts) if nv
                           else sum(x.numel() * x.element_size() for x in parts))  # what the kernel reads
                packer.add(e, *parts)
                continue
            gate_up[e] = torch.cat((g.dense(), u.dense()), dim=0)
            down[e] = d.dense(with_global_scale=False)
            if d.nvfp4 and float(d.weight_scale_2) != float(s2[e]):
                raise AssertionError("s2_down table disagrees with the expert's own weight_scale_2")
            nbytes += sum(x.weight.numel() * x.weight.element_size() for x in (g, u, d))
        store = cls(layer, owned, gate_up, down, s2, nbytes, cfg.swiglu_limit)
        if packer is not None:
            if gate_up:
                raise AssertionError(f"layer {layer}: mixed NVFP4 and BF16 routed experts")
            store.packed = packer.done()
            store.read_bytes_per_expert = nbytes // max(len(owned), 1)
        return store

    def compute(self, x: torch.Tensor, tokens: torch.Tensor, segments: list[tuple[int, int, int]],
                base: int) -> torch.Tensor:
        """Rows of this rank's block: x [T, H]; segments (expert, start, end) in canonical row indices
        starting at `base`. Returns [end-base, H] BF16 without s2_down."""
        n = (segments[-1][2] - base) if segments else 0
        if self.packed is not None and n:
            from rocket_mpi import kernels
            return kernels.nvfp4_experts(x, segments, self.packed, base, tokens[base:base + n], self.swiglu_limit)
        out = torch.empty(n, x.shape[1], dtype=torch.bfloat16, device=x.device)
        for e, start, end in segments:
            xe = x[tokens[start:end]]                                        # [n_e, H]
            gate, up = F.linear(xe, self.gate_up[e]).chunk(2, dim=-1)
            if self.swiglu_limit is not None:  # GLM-5.3-Flash: clamp before the activation
                gate = gate.clamp(max=self.swiglu_limit)
                up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
            out[start - base:end - base] = F.linear(F.silu(gate) * up, self.down[e])
        return out

    def to(self, device) -> "ExpertStore":
        if self.packed is not None:
            self.packed = self.packed.to(device)  # built on the engine's device: a no-op there
        self.gate_up = {e: t.to(device) for e, t in self.gate_up.items()}
        self.down = {e: t.to(device) for e, t in self.down.items()}
        return self

    def stack(self) -> None:
        """BF16 experts as two stacked tensors (slots in ascending expert id), the per-expert dicts becoming
        views of them: what the graphed step's grouped GEMM reads (rocket_mpi/graph.py). One layer at a time,
        so the extra memory is one layer's experts while it runs."""
        if self.packed is not None or not self.owned or getattr(self, "gu_stack", None) is not None:
            return
        ids = sorted(self.owned)
        self.gu_stack = torch.stack([self.gate_up[e] for e in ids])      # [S, 2I, H]
        self.dn_stack = torch.stack([self.down[e] for e in ids])         # [S, H, I]
        self.gate_up = {e: self.gu_stack[s] for s, e in enumerate(ids)}
        self.down = {e: self.dn_stack[s] for s, e in enumerate(ids)}
        self.owned_index = torch.tensor(ids, device=self.gu_stack.device)

    def grouped(self, x: torch.Tensor, row_index: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The block's rows through torch._grouped_mm (fixed shapes, no host read): x [T, H], row_index [cap]
        (token of each block row), experts [T, k] the routing. Rows of slot s are contiguous in the block
        (canonical order), so the group ends are the cumulative row counts of the owned experts. Returns
        [cap, H] bf16; rows past this rank's count are not meaningful."""
        counts = (experts.reshape(-1, 1) == self.owned_index.view(1, -1)).sum(0)
        offs = counts.cumsum(0).to(torch.int32)
        xb = x[row_index]
        gate, up = torch._grouped_mm(xb, self.gu_stack.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        if self.swiglu_limit is not None:
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
        return torch._grouped_mm(F.silu(gate) * up, self.dn_stack.transpose(1, 2), offs=offs)

    def resident_bytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        return sum(t.numel() * t.element_size() for t in list(self.gate_up.values()) + list(self.down.values()))


def bf16_kernel_enabled() -> bool:
    """BF16 experts run in the expert kernel (BF16 tiles) unless ROCKET_BF16_EXPERTS=grouped keeps torch's
    path (F.linear eagerly, torch._grouped_mm in the graphed step): the A/B switch of the decode benchmark."""
    import os
    v = os.environ.get("ROCKET_BF16_EXPERTS", "kernel")
    if v not in ("kernel", "grouped"):
        from rocket_mpi.errors import RocketError
        raise RocketError(f"ROCKET_BF16_EXPERTS={v!r}: expected 'kernel' (default) or 'grouped'")
    return v == "kernel"


def check_pdl_switch() -> None:
    """ROCKET_EXPERTS_PDL (csrc/nvfp4_experts.cu reads it at each launch) checked at set-up, so a bad value is
    one error line from the command instead of a failed kernel launch mid-step."""
    import os
    v = os.environ.get("ROCKET_EXPERTS_PDL", "")
    if v not in ("", "0", "1", "2", "3"):
        from rocket_mpi.errors import RocketError
        raise RocketError(f"ROCKET_EXPERTS_PDL={v!r}: expected 0 (off), 1 (gate/up and down), 2 (down only) or 3 "
                          f"(down only, waiting per pass; unset: 3 above 2 tokens, 0 up to 2)")


def check_stack_split() -> None:
    """ROCKET_STACK_SPLIT (K slices of the stack's linears in the expert kernel's BF16 tiles, csrc/nvfp4_experts.cu
    dense_split) checked at set-up: one error line instead of a failed launch mid-step."""
    import os
    v = os.environ.get("ROCKET_STACK_SPLIT", "")
    if v not in ("", "1", "2", "4", "8"):
        from rocket_mpi.errors import RocketError
        raise RocketError(f"ROCKET_STACK_SPLIT={v!r}: expected 1, 2, 4 or 8 (K slices per feature group; unset: by "
                           f"the linear's shape)")


# Environment switches that change what a rank computes (its bits): every rank must see the same values, so the
# start-up handshake (run.py) compares them.
BIT_SWITCHES = ("ROCKET_KERNELS", "ROCKET_STACK", "ROCKET_BF16_EXPERTS", "ROCKET_DECODE_ATTENTION",
                "ROCKET_STACK_SPLIT", "ROCKET_HC_FUSE", "ROCKET_KDA_FUSE", "ROCKET_MLA_LATENT",
                "ROCKET_GRAPH_SPANS")


def bit_switches() -> dict[str, str]:
    import os
    return {k: os.environ.get(k, "") for k in BIT_SWITCHES}


def kernels_enabled(device) -> bool:
    """The CUDA kernels (NVFP4 experts, scatter) run on a GPU where the extension is built; ROCKET_KERNELS=0
    forces the torch reference everywhere."""
    import os
    check_pdl_switch()
    check_stack_split()
    from rocket_mpi.kernels import attention_switch
    from rocket_mpi.kernels.stack import stack_switch
    stack_switch()  # a bad ROCKET_STACK fails at set-up everywhere
    attention_switch()  # and a bad ROCKET_DECODE_ATTENTION
    from rocket_mpi.model.layers import latent_decode
    latent_decode()  # and a bad ROCKET_MLA_LATENT
    from rocket_mpi.graph import step_fused
    step_fused("cpu")  # and a bad ROCKET_STEP_FUSE
    if device is None or torch.device(device).type != "cuda" or os.environ.get("ROCKET_KERNELS") == "0":
        return False
    from rocket_mpi import kernels
    return kernels.available()
