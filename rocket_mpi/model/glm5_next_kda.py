"""KDA (Kimi delta attention) layers of GLM-5.3-Flash: linear attention with a per-stream state.

Per stream and layer the cache holds two things, nothing that grows with the context:
  conv state  [3*D, K]      the last K pre-convolution q|k|v inputs (BF16), for the depthwise causal conv
  recurrent   [h, dk, dv]   the delta-rule state S (fp32, as transformers keeps it)

One token, per head (fp32, after SiLU(conv) and l2-normalised q, k; q scaled by dk^-1/2):
    S <- S * exp(g)[:, None]            g: per-channel log decay from the forget gate, in [lower_bound, 0]
    S <- S + k (beta * (v - k^T S))     the delta rule
    o  = q^T S
then a gated RMSNorm (fp32, sigmoid gate from a low-rank projection) and o_proj.

transformers runs a chunked form for prefill and this recurrent form for decode; they are equal up to
fp32 rounding. Here every token takes the recurrent form: on a GPU one launch of csrc/kda.cu (a decode's
tokens side by side, a prefill's stream by stream in order with the state in registers, several times faster than
the torch loop); on the CPU one torch loop per stream for a prefill, one step batched over all streams for a
decode.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rocket_mpi import ops
from rocket_mpi.model.layers import held, linears, pack_linears, release_stored
from rocket_mpi.ops.pack import TILE_N

DT = torch.bfloat16


@dataclass
class KDA:
    qkv: torch.Tensor           # [3*D, H] BF16: q_proj | k_proj | v_proj
    conv: torch.Tensor          # [3*D, K] fp32 depthwise causal conv (q_conv1d | k_conv1d | v_conv1d)
    f_a: torch.Tensor           # [dk, H]   forget gate, low rank
    f_b: torch.Tensor           # [D, dk]
    dt_bias: torch.Tensor       # [D] fp32
    A_log: torch.Tensor         # [heads] fp32
    b: torch.Tensor             # [heads, H] beta projection
    g_a: torch.Tensor           # [dk, H]   output gate, low rank
    g_b: torch.Tensor           # [D, dk]
    o_norm: torch.Tensor        # [dk] fp32 (BF16 values)
    o: torch.Tensor             # [H, D]
    # Glm5NextModel.pack_stack: copies in the expert kernel's tiles (layers.pack_linears; None where a shape does not
    # fit): "h" qkv | f_a | g_a (one launch over the normed input; held as stored: q | k | v, then f_a | g_a | b, b
    # where it is whole tiles), "b" (where not in "h"), "f_b", "g_b", "o"
    packed: dict | None = None
    stored: dict = field(default_factory=dict)  # NVFP4 parts (layers: held as stored): "qkv" [q, k, v], f_a, f_b, ...


@dataclass(frozen=True)
class KdaArgs:
    heads: int
    head_dim: int
    conv_kernel: int
    lower_bound: float | None   # linear_lower_bound: g = lb * sigmoid(exp(A) * f); None: -exp(A) * softplus(f)
    eps: float                  # rms_norm_eps of the gated output norm

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)   # FLA's form: + eps, not max(., eps)


def forget_gate(a: KDA, f_ah: torch.Tensor, args: KdaArgs) -> torch.Tensor:
    """f_ah: f_a over h [T, dk] BF16 -> g [T, heads, dk] fp32 log decay."""
    f = _lin(a, "f_b", f_ah).float() + a.dt_bias
    f = f.view(f_ah.shape[0], args.heads, args.head_dim)
    rate = torch.exp(a.A_log).view(1, args.heads, 1)
    if args.lower_bound is not None:
        return args.lower_bound * torch.sigmoid(rate * f)
    return -rate * torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))


def kda_step(state: torch.Tensor, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of streams: state [B, h, dk, dv]; q, k, g [B, h, dk]; v [B, h, dv]; beta [B, h]."""
    state = state * g.exp()[..., None]
    kv_mem = (state * k[..., None]).sum(dim=-2)                       # [B, h, dv]
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, (state * q[..., None]).sum(dim=-2)


def pack_kda(a: KDA, device) -> dict:
    """KDA's linears in the kernel's tiles (KDA.packed): BF16, or NVFP4 held as stored, whose dense copies are
    released where the device holds the packed ones alone. q | k | v held as stored are three parts of one launch
    (each its own weight_scale_2) and f_a | g_a | b (all three over the normed input; b where it is whole tiles) a
    second; BF16 weights take one launch for q|k|v | f_a | g_a and one for b (a launch writes at most three parts)."""
    st = a.stored
    if "qkv" in st:
        n_b, k_b = ops.weight_shape(held(a, "b")[0])
        gates = ["f_a", "g_a", "b"] if n_b % TILE_N == 0 and k_b % TILE_N == 0 else ["f_a", "g_a"]
        qkv, low = pack_linears(st["qkv"], device=device), pack_linears(held(a, *gates), device=device)
        h = None if qkv is None or low is None else qkv + low
    else:
        gates = ["f_a", "g_a"]
        h = pack_linears([a.qkv, a.f_a, a.g_a], device=device)
    in_h = ["qkv", *gates] if h is not None else []
    P = {"h": h, **{n: None if n in in_h else pack_linears(held(a, n), device=device)
                    for n in ("b", "f_b", "g_b", "o")}}
    for key, names in (("h", in_h), ("b", ["b"]), ("f_b", ["f_b"]), ("g_b", ["g_b"]), ("o", ["o"])):
        if P[key] is not None:
            release_stored(a, names, device)
    return P


def kda_forward(a: KDA, h: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor,
                segments: list[tuple[int, int, int]], args: KdaArgs, idx: torch.Tensor | None = None,
                fuse: bool = False) -> torch.Tensor:
    """h [T, H] BF16 (streams' new tokens packed); segments (stream, offset, n). Advances conv_state
    [M, 3D, K] BF16 and rec_state [M, h, dk, dv] fp32 of those streams in place. Returns [T, H] BF16.
    idx [M] on the device instead of segments: one token for each of those streams (the fixed-shape step). With
    fuse, everything after the q|k|v projection up to o_proj in one kernel (ops.kda_decode: the same math, its
    sums in their own order; a prefill's tokens one after another in the launch instead of ~10 torch kernels each)."""
    t = h.shape[0]
    nh, dk, kk = args.heads, args.head_dim, args.conv_kernel
    P = a.packed or {}
    stored = P.get("h") is not None and "qkv" in a.stored  # q, k, v held as stored: three parts, then concatenated
    qkv = (a.qkv.chunk(3) if a.qkv is not None else (None,) * 3) if stored else [a.qkv]  # None: released
    # held as stored, b joins the gates' launch where it is whole tiles (pack_kda): then h has a part more
    with_b = P.get("h") is not None and sum(len(p.ends) for p in P["h"]) == len(qkv) + 3
    outs = linears(h, [*qkv, a.f_a, a.g_a, *([a.b] if with_b else [])], packs=P.get("h"))
    mixed = torch.cat(outs[:3], dim=-1) if stored else outs[0]   # [T, 3D] pre-conv
    f_ah, g_ah = outs[len(qkv)], outs[len(qkv) + 1]              # the gates' low rank
    b = outs[-1] if with_b else _lin(a, "b", h)                  # beta's logits
    if fuse and (idx is not None or segments):  # ~35 torch kernels, the recurrent state read ~10 times: here one
        counts = None
        if idx is None:  # a prefill or a host-path step: each stream's tokens in order, in the launch
            counts = [n for _, _, n in segments]
            if [off for _, off, _ in segments] != [sum(counts[:i]) for i in range(len(counts))]:
                raise ValueError(f"kda_forward: segments {segments} are not packed one after another")
            idx = torch.tensor([s for s, _, _ in segments], device=h.device)
        y = ops.kda_decode(mixed, conv_state, a.conv, _lin(a, "f_b", f_ah), b, _lin(a, "g_b", g_ah),
                               a.dt_bias, a.A_log, a.o_norm, rec_state, idx, nh, dk, args.lower_bound, args.eps, counts)
        return _lin(a, "o", y)
    conv_w = a.conv[:, None, :]                                       # [3D, 1, K]
    conv = torch.empty_like(mixed)
    decode = idx is not None or (all(n == 1 for _, _, n in segments) and len(segments) > 0)
    if decode:
        if idx is None:
            idx = torch.tensor([s for s, _, _ in segments], device=h.device)
        win = torch.cat((conv_state[idx], mixed[:, :, None]), dim=-1)                 # [M, 3D, K+1]
        conv_state[idx] = win[:, :, 1:]
        conv = F.silu(F.conv1d(win.float(), conv_w, groups=win.shape[1])[:, :, -1]).to(DT)
    else:
        for s, off, n in segments:
            win = torch.cat((conv_state[s], mixed[off:off + n].t()), dim=-1)          # [3D, K+n]
            conv_state[s] = win[:, -kk:]
            y = F.conv1d(win.float()[None], conv_w, groups=win.shape[0])[0, :, -n:]  # zeros before the start
            conv[off:off + n] = F.silu(y).to(DT).t()
    q, k, v = conv.float().view(t, 3, nh, dk).unbind(1)
    q = _l2norm(q) * dk ** -0.5
    k = _l2norm(k)
    g = forget_gate(a, f_ah, args)
    beta = torch.sigmoid(b).float()                                  # [T, heads]
    out = torch.empty(t, nh, dk, dtype=torch.float32, device=h.device)
    if decode:
        rec_state[idx], out = kda_step(rec_state[idx], q, k, v, g, beta)
    else:
        for s, off, n in segments:
            st = rec_state[s:s + 1]
            for j in range(off, off + n):
                st, o = kda_step(st, q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1], beta[j:j + 1])
                out[j] = o[0]
            rec_state[s] = st[0]
    out = out.to(DT).float()                                          # transformers rounds the core output
    gate = _lin(a, "g_b", g_ah).view(t, nh, dk).float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + args.eps) * a.o_norm * torch.sigmoid(gate)
    return _lin(a, "o", out.to(DT).reshape(t, -1))


def _lin(a: KDA, name: str, x: torch.Tensor) -> torch.Tensor:
    """x through the KDA weight `name`: its packed copy for steps of at most ops.STACK_KERNEL_MAX_ROWS rows
    where it has one (layers.linears), else F.linear."""
    return linears(x, [getattr(a, name)], packs=(a.packed or {}).get(name))[0]
