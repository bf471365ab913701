"""GLM-4.x MoE (transformers model_type glm4_moe): the replicated BF16 stack around the MoE blocks.

Every rank runs all of this for all M streams with the same weights, so the normalised hidden state
entering each MoE layer is bit-identical on every rank. The routed experts are reached only through
`moe(layer, x, L)`, which the engine binds to the expert split; the fixed-shape step also hands it the shared
expert and the residual (`moe(layer, x, L, shared=f, residual=x0)` -> x0 + (routed + f())), so that the graphed
step can run the shared expert beside the routing (moe/step.py DeviceMoE).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rocket_mpi import ops
from rocket_mpi.checkpoint.reader import CheckpointReader  # noqa: F401 (type)
from rocket_mpi.config import ModelConfig
from rocket_mpi.model.cache import KVCache
from rocket_mpi.model.layers import (Rope, StackModel, head_logits, held, load_embed_head, load_ffn, load_linear,
                                     load_swiglu, norm_of, pack_head, pack_mlps, prefill_blocks, release_stored,
                                     stack_linears, stack_mlp, stack_rows, stored_nbytes, unique_nbytes)

DT = torch.bfloat16
SPAN_QUANTUM = 64  # a host-path decode step attends over a multiple of this many cache positions


@dataclass
class Attention:
    q: torch.Tensor; k: torch.Tensor; v: torch.Tensor; o: torch.Tensor         # noqa: E702
    q_bias: torch.Tensor | None; k_bias: torch.Tensor | None; v_bias: torch.Tensor | None  # noqa: E702
    q_norm: torch.Tensor | None; k_norm: torch.Tensor | None                   # noqa: E702
    # pack_stack: q/k/v (with their biases, one fused launch) and o in the expert kernel's tiles too
    qkv: list | None = None
    o_packed: list | None = None
    stored: dict = field(default_factory=dict)             # NVFP4 parts of q/k/v/o (layers: held as stored)


@dataclass
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: Attention
    mlp: tuple[torch.Tensor, torch.Tensor] | None          # dense: (gate_up [2I, H], down [H, I])
    router_w: torch.Tensor | None = None                   # [E, H] fp32
    router_b: torch.Tensor | None = None                   # [E] fp32
    shared: tuple[torch.Tensor, torch.Tensor] | None = None
    mlp_packed: object = None                              # pack_stack: ops.pack_mlp of mlp / shared
    shared_packed: object = None
    stored: dict = field(default_factory=dict)             # NVFP4 parts of mlp / shared (layers: held as stored)


class Glm4MoeModel(StackModel):
    # --decode-path auto takes the graphed step: its capture is checked on the H200 (GPU tests, static fires)
    GRAPH_CHECKED = True

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[Layer], norm: torch.Tensor,
                 lm_head: torch.Tensor):
        self.cfg = cfg
        self.embed = embed          # [V, H]
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head      # [V, H]
        self.rope = Rope(cfg.rotary_dim, cfg.rope_theta, DT)
        self.scale = cfg.head_dim ** -0.5
        self.head_packed = None     # pack_stack: lm_head in the kernel's tiles (head)
        self.stored: dict = {}      # an NVFP4 lm_head's parts (layers: held as stored)

    # -- loading ---------------------------------------------------------------------
    @classmethod
    def load(cls, reader: CheckpointReader) -> "Glm4MoeModel":
        cfg = reader.config
        h, d = cfg.hidden_size, cfg.head_dim
        nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads

        def vec(name, n):
            return reader.get_float(name, (n,), DT)

        def mlp(prefix, inter, stored, key):
            return load_swiglu(reader, prefix, h, inter, DT, stored, key, lazy=True)

        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            st: dict = {}
            q, qb = load_linear(reader, p + ".self_attn.q_proj", nq * d, h, cfg.attention_bias, st, "q", lazy=True)
            k, kb = load_linear(reader, p + ".self_attn.k_proj", nkv * d, h, cfg.attention_bias, st, "k", lazy=True)
            v, vb = load_linear(reader, p + ".self_attn.v_proj", nkv * d, h, cfg.attention_bias, st, "v", lazy=True)
            o, _ = load_linear(reader, p + ".self_attn.o_proj", h, nq * d, stored=st, key="o", lazy=True)
            qn = vec(p + ".self_attn.q_norm.weight", d) if cfg.use_qk_norm else None
            kn = vec(p + ".self_attn.k_norm.weight", d) if cfg.use_qk_norm else None
            layer = Layer(vec(p + ".input_layernorm.weight", h), vec(p + ".post_attention_layernorm.weight", h),
                          Attention(q, k, v, o, qb, kb, vb, qn, kn, stored=st), None)
            for name, value in load_ffn(reader, p, i, cfg, mlp, layer.stored).items():
                setattr(layer, name, value)
            layers.append(layer)
        stored: dict = {}
        embed, head = load_embed_head(reader, cfg, DT, stored)
        model = cls(cfg, embed, layers, vec("model.norm.weight", h), head)
        model.stored = stored
        return model

    def new_cache(self, streams: int, capacity: int) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.num_hidden_layers, streams, cfg.num_key_value_heads, capacity, cfg.head_dim, DT,
                       self.embed.device)

    def pack_stack(self) -> None:
        """Every layer's q/k/v (one fused launch), o and SwiGLU MLPs, and lm_head, also in the kernel's tiles
        (ops/stack.py), which every decode step takes, and a prefill's streams of at most ops.STACK_KERNEL_MAX_ROWS
        rows (layers.stack_rows): the kernel computes each row on its own, so a stream's bits do not depend on its
        batch; the dense weights stay for longer prompts, where cuBLAS is faster. The head's copy adds its bytes to
        the device (vocab x hidden x 2; air8: 1.2 GB). NVFP4 weights are packed as stored and, on a GPU, their dense
        copies released (layers: held as stored; longer prompts dequantise them on the fly). On the CPU the packed
        forms run torch's own ops on the unpacked weights, so the logits are the same bits (the tests' check of
        this glue)."""
        dev = self.embed.device
        for L in self.layers:
            a = L.attn
            if a.qkv is None:
                a.qkv = ops.pack_linear(held(a, "q", "k", "v"), [a.q_bias, a.k_bias, a.v_bias], device=dev)
                a.o_packed = ops.pack_linear(held(a, "o"), device=dev)
                release_stored(a, ["q", "k", "v", "o"], dev)
            pack_mlps(L, dev)
        pack_head(self, dev)

    def nbytes(self) -> int:
        """Bytes a step reads (but the embedding's rows): the dense weights, and where the device holds NVFP4
        weights as stored, their packed copies instead."""
        ts = [self.embed, self.norm, self.lm_head]
        for L in self.layers:
            a = L.attn
            ts += [L.input_norm, L.post_norm, a.q, a.k, a.v, a.o]
            ts += [a.q_bias, a.k_bias, a.v_bias, a.q_norm, a.k_norm, L.router_w, L.router_b]  # None skipped
            for pair in (L.mlp, L.shared):  # bytes a step reads: the packed BF16 copies hold the same weights
                if pair is not None:
                    ts += list(pair)
        return unique_nbytes(ts) + stored_nbytes(self)

    # -- forward ---------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, cache: KVCache, seqlens: list[int], moe) -> torch.Tensor:
        """Run `tokens` [T] (streams' new tokens packed, seqlens[s] of them for stream s, appended after
        what the cache holds) through the stack; returns last-position logits [M, V] fp32 per stream.
        `moe(layer, x_normed [T, H], L) -> [T, H]` computes the routed experts (the split lives there)."""
        cfg = self.cfg
        starts = cache.lengths.tolist()
        dev = self.embed.device
        gpu = ops.on_gpu(dev)  # the norms and the decode attention in kernels whose sums are fixed per row
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, seqlens)]).to(dev)
        cos, sin = self.rope.cos_sin(positions)
        x = self.embed[tokens.to(dev)]                                # [T, H]
        decode = None
        live = [s for s, n in enumerate(seqlens) if n]
        if live and all(seqlens[s] == 1 for s in live):  # one new token per stream that goes on: where it goes and
            span = max(starts[s] for s in live) + 1       # what it sees, once, from the host list (no device sync)
            # in whole quanta of the cache (the keys past a stream's position are masked): a run's attention matmuls
            # then take a few shapes, not one per step; each new shape costs oneDNN (CPU bf16 matmuls) a kernel it
            # keeps, and a long run's RSS grew by ~1 MiB a step until its primitive cache filled
            span = min(-(-span // SPAN_QUANTUM) * SPAN_QUANTUM, cache.capacity)
            pos = torch.tensor([starts[s] for s in live], device=dev)
            hide = None if gpu else (torch.arange(span, device=dev)[None, :] > pos[:, None])[:, None, None, :]
            decode = (torch.tensor(live, device=dev), pos, span, hide)
        rows = stack_rows(seqlens, dev)  # which rows take the packed linears (a stream's own count decides)
        x, _ = self._layers(x, cos, sin, cache, starts, seqlens, decode, moe, fused=gpu, rows=rows)
        cache.lengths += torch.tensor(seqlens)
        last = (torch.tensor(seqlens).cumsum(0) - 1).to(dev)
        h = norm_of(gpu)(x[last], self.norm, cfg.rms_norm_eps)
        return self.head(h).float()

    def forward_static(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache, moe,
                       span: int | None = None) -> torch.Tensor:
        """One decode step, one new token per stream, with fixed shapes and no host read (CUDA-graph safe); returns
        the logits [M, V] in the lm_head's bf16 (the step's argmax picks the same token as on their fp32 copy, an
        exact cast, so the copy is left to whoever wants it: engine.generate's on_step):
        tokens [M] and pos [M] (each stream's position = what its cache holds) live on the device. Attends
        over the cache's first `span` positions (None: its whole capacity; every pos < span, graph.span_for) under
        a length mask. The caller advances pos and cache.lengths.
        On a GPU with the extension, RMSNorm, RoPE with the cache write, and the attention run as kernels
        (ops.rms_norm / rope_kv_ / decode_attention), the residual adds in the packed linears' epilogues: fewer
        launches in the graph, the same math (the sums in the kernels' own order; the attention's fixed by each
        stream's own length, so the span does not change a stream's bits). The
        step's glue is fused there too: the embedding with the first RMSNorm, RoPE reading the table at pos in
        rope_kv_, each MoE scatter with the next RMSNorm (the same bits as the separate ops)."""
        cfg = self.cfg
        dev = self.embed.device
        fused = dev.type == "cuda" and ops.available()
        glue = fused
        if fused:  # rows of the capacity's cos/sin table (Rope.table): read at pos by rope_kv_, or one gather
            table = self.rope.table(cache.capacity + 1, dev)  # + 1: pos = capacity writes nothing
            cos, sin = (table[0], table[1]) if glue else table[:, pos]
        else:
            cos, sin = self.rope.cos_sin(pos)
        h = None
        if glue:
            x, h = ops.embed_rms_norm(self.embed, tokens, self.layers[0].input_norm, cfg.rms_norm_eps)
        else:
            x = self.embed[tokens]
        span = cache.capacity if span is None else span
        if fused:  # rope_kv_ writes the caches at pos, decode_attention reads each stream's keys up to it
            decode = ("table" if glue else None, pos, span, None)
        else:
            hide = (torch.arange(span, device=dev)[None, :] > pos[:, None])[:, None, None, :]  # once per step
            decode = (torch.arange(tokens.numel(), device=dev), pos, span, hide)
        x, h = self._layers(x, cos, sin, cache, None, None, decode, moe, fused, static=True, h=h, glue=glue)
        if h is None:
            norm = norm_of(fused)
            h = norm(x, self.norm, cfg.rms_norm_eps)
        return self.head(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return head_logits(self, h)

    def decode_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, span: int,
                         rows: torch.Tensor | None) -> torch.Tensor:
        """A decode step's attention on a GPU (ops.decode_attention): q [M, hq, d] of the streams at pos [M] (cache
        rows `rows`, None: 0..M-1) over their positions 0..pos -> [M, hq * d]; each stream's sums in an order fixed
        by its own length, whatever the batch and the span."""
        return ops.decode_attention(q, kc, vc, pos, self.scale, span, rows).reshape(q.shape[0], -1)

    def _layers(self, x, cos, sin, cache, starts, seqlens, decode, moe, fused: bool = False,
                static: bool = False, h: torch.Tensor | None = None, glue: bool = False, rows=None):
        """The layers over x -> (x, h): h = the final RMSNorm of x where the last MoE scatter made it (glue),
        else None. h in: the first layer's input norm of x, made by the caller. fused: the norms in ops.rms_norm
        and the decode attention in ops.decode_attention (a GPU with the extension); rows: layers.stack_rows."""
        cfg = self.cfg
        norm = norm_of(fused)
        n = len(self.layers)
        for i, L in enumerate(self.layers):
            if h is None:
                h = norm(x, L.input_norm, cfg.rms_norm_eps)
            x = self._attention(i, L.attn, h, cos, sin, cache, starts, seqlens, decode, fused, static, x,
                                rows)                                                           # x + attention
            h = norm(x, L.post_norm, cfg.rms_norm_eps)
            if L.mlp is not None:
                x, h = stack_mlp(h, L.mlp, L.mlp_packed, residual=(x,), rows=rows), None     # x + mlp
            elif static:  # the fixed-shape step's MoE (moe/step.py DeviceMoE): the shared expert beside the routing
                hs = h  # the shared expert's input (the lambda runs inside moe, after h is rebound below)
                shared = lambda: stack_mlp(hs, L.shared, L.shared_packed)  # noqa: E731
                if glue:  # the scatter also makes the next input norm (the final norm after the last layer)
                    nxt = self.layers[i + 1].input_norm if i + 1 < n else self.norm
                    x, h = moe(i, h, L, shared=shared, residual=x, next_norm=(nxt, cfg.rms_norm_eps))
                else:
                    x, h = moe(i, h, L, shared=shared, residual=x), None
            else:
                routed = moe(i, h, L)                                                # x + (routed + shared)
                x, h = stack_mlp(h, L.shared, L.shared_packed, residual=(routed, x), rows=rows), None
        return x, h

    def _attention(self, i, a: Attention, h, cos, sin, cache: KVCache, starts, seqlens, decode,
                   fused: bool, static: bool, x: torch.Tensor, rows=None) -> torch.Tensor:
        """x + the attention block of layer i over h = its normed x (the add in the o projection's epilogue where
        the packed stack runs). fused: a GPU with the extension, where a decode step attends in
        ops.decode_attention (graphed or not) and so does a prompt of one token (a decode step's arithmetic, as it
        gets alone); rows: layers.stack_rows."""
        cfg = self.cfg
        t, d = h.shape[0], cfg.head_dim
        q, k, v = (y.view(t, -1, d) for y in stack_linears(h, [a.q, a.k, a.v], [a.q_bias, a.k_bias, a.v_bias],
                                                           a.qkv, rows=rows))
        norm = norm_of(fused)
        if a.q_norm is not None:
            q = norm(q, a.q_norm, cfg.rms_norm_eps)
            k = norm(k, a.k_norm, cfg.rms_norm_eps)
        kc, vc = cache.k[i], cache.v[i]
        if fused and static:  # the fixed-shape decode step on a GPU: RoPE and the cache write in one kernel
            tab, pos, span, _ = decode  # tab: cos / sin are the Rope.table halves, read at pos
            ops.rope_kv_(q, k, v, cos, sin, self.rope.dim, kc, vc, pos, table=tab is not None)
            out = self.decode_attention(q, kc, vc, pos, span, None)   # row i: cache row i, every slot
        elif decode is not None:
            # decode: one new token per stream, batched over streams with a length mask
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
            idx, pos, span, hide = decode
            kc[idx, :, pos] = k
            vc[idx, :, pos] = v
            some = idx.numel() < kc.shape[0]  # some streams ended (or sit idle): their rows are not read
            if fused:
                out = self.decode_attention(q, kc, vc, pos, span, idx if some else None)
            else:
                keys, vals = (kc[idx, :, :span], vc[idx, :, :span]) if some else (kc[:, :, :span], vc[:, :, :span])
                out = _attend(q[:, :, None, :], keys, vals, hide, self.scale).reshape(t, -1)
        else:
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
            outs, off = [], 0
            for s, (p0, n) in enumerate(zip(starts, seqlens)):
                if n == 0:
                    continue
                kc[s, :, p0:p0 + n] = k[off:off + n].transpose(0, 1)
                vc[s, :, p0:p0 + n] = v[off:off + n].transpose(0, 1)
                if fused and n == 1:
                    at = torch.tensor([s, p0], device=h.device)
                    outs.append(self.decode_attention(q[off:off + 1], kc, vc, at[1:], p0 + 1, at[:1]))
                    off += n
                    continue
                # on a GPU the stream's keys and values in a tensor of their own: cuBLAS sees heads p0 + n positions
                # apart (the stream's own length), not the cache's capacity (set by the longest stream of the run)
                ksrc, vsrc = ((kc[s:s + 1, :, :p0 + n].contiguous(), vc[s:s + 1, :, :p0 + n].contiguous()) if fused
                              else (kc[s:s + 1], vc[s:s + 1]))
                for r0, r1 in prefill_blocks(n, q.shape[1] * (p0 + n)):  # rows r0..r1 - 1 see keys < p0 + r1
                    qs = q[off + r0:off + r1].transpose(0, 1)[None]       # [1, heads, rows, d]
                    ks, vs = ksrc[:, :, :p0 + r1], vsrc[:, :, :p0 + r1]
                    keys = torch.arange(p0 + r1, device=h.device)
                    seen = torch.arange(p0 + r0, p0 + r1, device=h.device)
                    hide = keys[None, :] > seen[:, None]      # built where it is used: no host copy per block
                    o = _attend(qs, ks, vs, hide, self.scale)
                    outs.append(o[0].transpose(0, 1).reshape(r1 - r0, -1))
                off += n
            out = torch.cat(outs)
        return stack_linears(out, [a.o], packs=a.o_packed, residual=(x,), rows=rows)[0]


def _attend(q, k, v, hide, scale):
    """Eager GQA attention, transformers' eager order: bf16 scores, fp32 softmax, bf16 weights @ v.
    q [B, Hq, Tq, D], k/v [B, Hkv, S, D], hide bool broadcastable to [B, Hq, Tq, S], True where a key is not
    seen (the decode step builds it once, not an inverted mask per layer: one kernel fewer per layer). Plain
    matmuls: deterministic on every backend (SDPA's fused kernels are slow under deterministic settings). A GPU's
    decode steps take ops.decode_attention instead (Glm4MoeModel.decode_attention); its prefill takes this per
    stream, each GEMM's shapes set by the stream's own rows and positions."""
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, (hq // hkv) * tq, d)                       # heads of one kv group share k/v
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(b, hq, tq, -1)
    scores = (scores * scale).masked_fill(hide, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.view(b, hkv, (hq // hkv) * tq, -1), v)
    return out.view(b, hq, tq, d)
