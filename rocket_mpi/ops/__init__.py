"""The fast ops, each a CUDA kernel (rocket_mpi._C, built from csrc/) beside its pure-torch reference.

    experts.py   nvfp4_experts: this rank's routed experts (NVFP4 W4A16 or BF16 tiles, batch-invariant)
    stack.py     linear / swiglu_dense: the replicated stack's linears and MLPs in the same kernel's tiles (BF16,
                 or NVFP4 held as stored)
    route.py     route: the router (sigmoid scores, group-limited top-k) in two kernels
    rows.py      plan_rows: the canonical row order on the host
    plan.py      moe_plan: the same plan on the device, in fixed-capacity slot space
    select.py    topk_first: the DSA indexers' top-k, exact ties to the lower index (independent of the row's length)
    scatter.py   moe_scatter_add: a token's rows summed in expert order, once rounded; the rows' checksum
    norm.py      rms_norm and the decode step's glue (embedding + norm, RoPE, KV append, softmax, argmax)
    attention.py decode_attention: GLM-4.x decode attention in fixed chunks of positions (batch-invariant)
    glm5.py      GLM-5.3-Flash's hyper-connection, KDA and MLA-glue kernels
    pack.py      packing NVFP4 / BF16 weights into the kernels' tiles; nvfp4.py the checkpoint format's math

CPU tensors take the reference; CUDA tensors need the extension and raise a RuntimeError saying why when it is
missing. The package imports everywhere: the extension is looked up only when an op needs it.
"""
from __future__ import annotations

import torch

from rocket_mpi.ops import _ext
from rocket_mpi.ops.attention import ATTN_CHUNK, decode_attention, decode_attention_ref  # noqa: F401
from rocket_mpi.ops.experts import (MAX_GROUPS, launch_plan, nvfp4_experts, nvfp4_experts_planned,  # noqa: F401
                                    nvfp4_experts_ref, nvfp4_experts_stages)
from rocket_mpi.ops.glm5 import hc_post, hc_pre, kda_decode, mla_cache_step, mla_pick, mla_softmax  # noqa: F401
from rocket_mpi.ops.norm import (argmax_, decode_softmax, embed_rms_norm, kv_append, rms_norm,  # noqa: F401
                                 rms_norm_ref, rope_, rope_interleaved, rope_kv_)
from rocket_mpi.ops.pack import (ExpertPacker, PackedExperts, dequant_packed, dequant_packed_cuda,  # noqa: F401
                                 emulate_decode, pack_bf16, pack_codes, pack_experts, pack_experts_bf16,
                                 padded_codes, split_fused_gate_up, unpack_bf16, unpack_codes)
from rocket_mpi.ops.route import route, route_ref  # noqa: F401
from rocket_mpi.ops.rows import RowPlan, plan_rows  # noqa: F401
from rocket_mpi.ops.scatter import (fold_row_sums, moe_scatter_add, moe_scatter_add_ref, row_checksum,  # noqa: F401
                                    row_sum)
from rocket_mpi.ops.select import topk_first  # noqa: F401
from rocket_mpi.ops.stack import (STACK_KERNEL_MAX_ROWS, PackedLinear, add_residuals, linear, pack_linear,  # noqa: F401
                                  pack_mlp, swiglu_dense, swiglu_mlp, unpack_linear, unpack_mlp, weight_shape)


def available() -> bool:
    """The extension is built and a CUDA device is present."""
    return _ext.reason() == ""


def unavailable_reason() -> str:
    return _ext.reason()


def on_gpu(device) -> bool:
    """Whether ops on `device` run as CUDA kernels: a GPU, with the extension built."""
    return torch.device(device).type == "cuda" and available()


def set_deterministic(mode: bool, warn_only: bool = False) -> None:
    """torch's deterministic-algorithms switch. torch.use_deterministic_algorithms also sets torch.compile's flag,
    importing torch._inductor and torch._dynamo (seconds per process, and a config write on every call); nothing
    here is compiled, so this sets torch's own flag alone where the build has the switch under it."""
    switch = getattr(torch._C, "_set_deterministic_algorithms", None)
    if switch is None:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        switch(mode, warn_only=warn_only)
