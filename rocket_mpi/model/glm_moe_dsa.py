"""GLM-5 (transformers model_type glm_moe_dsa): MLA attention with the DeepSeek sparse-attention (DSA)
indexer, around the shared MoE blocks.

Per layer the cache holds the MLA latent (kv_a_layernorm output) and the roped shared key, one row of
kv_lora_rank + qk_rope_head_dim per token, plus the indexer's key (index_head_dim) on layers that run
their own indexer. Attention is computed in DeepSeek's "absorbed" form: kv_b_proj's key half is folded
into the query and its value half applied after the weighted sum, so keys and values are read straight
from the latent. The indexer scores every cached token (fp32, as transformers insists), keeps the
index_topk best, and attention runs over those only: a gather of index_topk latent rows per decode step and
per prefill row past index_topk positions, whatever the context length. Layers whose indexer_types entry is "shared" reuse the previous full
layer's selection.

Every rank runs all of this for all M streams with the same weights (replicated, deterministic), so the
normalised hidden state entering each MoE layer is bit-identical on every rank; the routed experts are
reached only through `moe(layer, x, L)`.

Device: the weights live where `to(device)` put them (CPU after `load`); every tensor forward and the
cache create follows `self.embed.device`. Host-side bookkeeping (cache lengths, stream offsets) stays in
Python lists and CPU tensors, so a decode step does not wait on the GPU for them.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rocket_mpi import ops
from rocket_mpi.checkpoint.reader import CheckpointReader  # noqa: F401 (type)
from rocket_mpi.config import ModelConfig
from rocket_mpi.errors import ConfigError
from rocket_mpi.model.glm4_moe import Layer  # the same per-layer weights, another Attention
from rocket_mpi.model.layers import (Rope, StackModel, distinct_writes, head_logits, latent_attention,
                                     latent_input_linears, linear_rows, linears, load_embed_head, load_ffn, load_linear,
                                     load_swiglu, matmul_fp32, mlp_forward, norm_of, pack_head, pack_mla, pack_mlps,
                                     prefill_blocks, rms_norm, stored_nbytes, unique_nbytes, yarn_mscale)

DT = torch.bfloat16
# q_a_layernorm, kv_a_layernorm and the indexer's LayerNorm are built with transformers' default eps,
# not config.rms_norm_eps (which only the block norms use)
LATENT_NORM_EPS = 1e-6

# -- weights ----------------------------------------------------------------------------
@dataclass
class Indexer:
    wq_b: torch.Tensor            # [index_heads * index_dim, q_lora]
    wk: torch.Tensor              # [index_dim, H]
    k_norm: torch.Tensor          # [index_dim] LayerNorm weight
    k_norm_bias: torch.Tensor     # [index_dim]
    # [index_heads, H] fp32: in transformers' _keep_in_fp32_modules (which it applies to fp16 loads only);
    # index_heads x H floats buy head weights as exact as the fp32 reference's, where top-k ties are decided
    weights_proj: torch.Tensor
    stored: dict = field(default_factory=dict)   # NVFP4 parts of wq_b / wk (layers: held as stored)


@dataclass
class Attention:
    q_a: torch.Tensor; q_a_bias: torch.Tensor | None; q_a_norm: torch.Tensor      # noqa: E702 [q_lora, H]
    q_b: torch.Tensor                                                           # [heads*(nope+rope), q_lora]
    kv_a: torch.Tensor; kv_a_bias: torch.Tensor | None; kv_a_norm: torch.Tensor   # noqa: E702 [c+rope, H]
    w_uk: torch.Tensor            # [heads, nope, c]  kv_b_proj's key half
    w_uv: torch.Tensor            # [heads, v, c]     kv_b_proj's value half
    o: torch.Tensor; o_bias: torch.Tensor | None                                  # noqa: E702 [H, heads*v]
    indexer: Indexer | None       # None on "shared" layers
    # pack_stack: copies in the expert kernel's BF16 tiles (layers.pack_linears; None where a shape does not fit):
    # "h" q_a | kv_a (| the indexer's wk): the linears of the normed input, one launch; "q_b", "wq_b", "o"
    packed: dict | None = None
    stored: dict = field(default_factory=dict)   # NVFP4 parts of q_a / kv_a / q_b / o (layers: held as stored)


class LatentCache:
    """M streams of different lengths. Per layer: latent ‖ roped key [M, capacity, c + rope], and the
    indexer keys [M, capacity, index_dim] where the layer runs its own indexer (None on shared layers)."""

    def __init__(self, indexed: list[bool], streams: int, capacity: int, latent_dim: int, index_dim: int,
                 dtype: torch.dtype = DT, device: torch.device | str = "cpu"):
        self.kv = [torch.zeros(streams, capacity, latent_dim, dtype=dtype, device=device) for _ in indexed]
        self.index_k = [torch.zeros(streams, capacity, index_dim, dtype=dtype, device=device) if own else None
                        for own in indexed]
        self.lengths = torch.zeros(streams, dtype=torch.long)  # host: tokens held per stream
        self.capacity = capacity

    @property
    def streams(self) -> int:
        return self.lengths.numel()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv + self.index_k if t is not None)


@dataclass
class PrefillSelection:
    """One stream's attention selection in a prefill of rows at positions p0.. (GlmMoeDsaModel._prefill_selection),
    which the layers of "shared" indexers reuse. blocks: (r0, r1, cols, valid) per block of query rows: cols None
    and valid a causal mask [r1 - r0, p0 + r1] (the block attends over its prefix), or cols [r1 - r0, k] each row's
    chosen key positions and valid [r1 - r0, k] which of them are real."""
    p0: int
    blocks: list

    def mask(self) -> torch.Tensor:
        """The selection as a dense mask [n, p0 + n] (tests and inspection; the forward never builds it)."""
        n = self.blocks[-1][1] if self.blocks else 0
        out = torch.zeros(n, self.p0 + n, dtype=torch.bool)  # host
        for r0, r1, cols, valid in self.blocks:
            if cols is None:
                out[r0:r1, :valid.shape[1]] = valid.cpu()
            else:
                c, v = cols.cpu(), valid.cpu()
                out[torch.arange(r0, r1)[:, None].expand_as(c)[v], c[v]] = True  # host
        return out


NO_TIMER = nullcontext()


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, r], cos/sin [T, r] (cat(freqs, freqs)): pairs (x0, x1), (x2, x3), ... each turned by one
    frequency. The result is laid out de-interleaved (rotated evens, then odds) as transformers'
    apply_rotary_pos_emb_interleave does; q and k share the layout, so their dot products do not see it.
    On a GPU with the extension one launch of ops.rope_interleaved (the same bits as these ~8 torch kernels,
    4 calls per layer and step)."""
    if x.is_cuda and ops.available():
        return ops.rope_interleaved(x, cos, sin)
    return rope_interleaved_ops(x, cos, sin)


def rope_interleaved_ops(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope_interleaved in torch ops (the CPU's form, and the GPU kernel's reference)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class GlmMoeDsaModel(StackModel):
    # forward_static's capture checked on a GPU (graph == eager step, static fire on the graphed step, host
    # and graph paths decode the same tokens): --decode-path auto takes the graph
    GRAPH_CHECKED = True
    # optional timing hook (benchmarks/bench_glm5.py): a callable key -> context manager around each
    # sub-block, keys ("attn", layer), ("ffn", layer), ("head",). None: a shared no-op context.
    timers = None

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[Layer], norm: torch.Tensor,
                 lm_head: torch.Tensor):
        raw = cfg.raw
        self.cfg = cfg
        self.embed = embed          # [V, H]
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head      # [V, H]
        self.head_packed = None     # pack_stack: lm_head in the kernel's tiles (layers.pack_head)
        self.stored: dict = {}      # an NVFP4 lm_head's parts (layers: held as stored)
        self.heads = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"]
        self.latent = raw["kv_lora_rank"]
        self.index_heads, self.index_dim = raw["index_n_heads"], raw["index_head_dim"]
        # None: no indexer (DeepSeek-V3): every layer attends over every position, as where the top-k takes them all
        self.index_topk = raw["index_topk"] or None
        yarn = raw.get("yarn")
        self.rope = Rope(self.rope_dim, cfg.rope_theta, DT, yarn, cfg.max_position_embeddings)
        self.scale = (self.nope + self.rope_dim) ** -0.5          # the un-absorbed qk_head_dim's scale
        if yarn is not None and yarn["mscale_all_dim"]:          # YaRN's softmax temperature, as transformers'
            m = yarn_mscale(yarn["factor"], yarn["mscale_all_dim"])
            self.scale = self.scale * m * m
        self.index_scale = self.index_dim ** -0.5 if self.index_dim else 0.0

    # -- loading ---------------------------------------------------------------------
    @classmethod
    def load(cls, reader: CheckpointReader) -> "GlmMoeDsaModel":
        cfg = reader.config
        raw = cfg.raw
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        ql, c = raw["q_lora_rank"], raw["kv_lora_rank"]
        nope, r, v = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"]
        ih, idim = raw["index_n_heads"], raw["index_head_dim"]
        bias = cfg.attention_bias

        def lin(name, n, k, with_bias=False, dtype=DT, stored=None, key=None):
            # BF16 or NVFP4 (dequantised; where `stored` is given also held as stored on a GPU: layers)
            return load_linear(reader, name, n, k, with_bias, stored, key, dtype)

        def vec(name, n):
            return reader.get_float(name, (n,), DT)

        def mlp(prefix, inter, stored, key):
            return load_swiglu(reader, prefix, h, inter, DT, stored, key)

        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}.self_attn"
            st: dict = {}   # kv_b stays dense: MLA's absorbed form reads its halves per head (w_uk, w_uv)
            q_a, q_a_b = lin(p + ".q_a_proj", ql, h, bias, stored=st, key="q_a")
            q_b, _ = lin(p + ".q_b_proj", nh * (nope + r), ql, stored=st, key="q_b")
            kv_a, kv_a_b = lin(p + ".kv_a_proj_with_mqa", c + r, h, bias, stored=st, key="kv_a")
            kv_b, _ = lin(p + ".kv_b_proj", nh * (nope + v), c)
            kv_b = kv_b.view(nh, nope + v, c)
            o, o_b = lin(p + ".o_proj", h, nh * v, bias, stored=st, key="o")
            indexer = None
            if raw["indexer_types"][i] == "full":
                x, ist = p + ".indexer", {}
                indexer = Indexer(lin(x + ".wq_b", ih * idim, ql, stored=ist, key="wq_b")[0],
                                  lin(x + ".wk", idim, h, stored=ist, key="wk")[0],
                                  vec(x + ".k_norm.weight", idim), vec(x + ".k_norm.bias", idim),
                                  lin(x + ".weights_proj", ih, h, dtype=torch.float32)[0], ist)
            attn = Attention(q_a, q_a_b, vec(p + ".q_a_layernorm.weight", ql), q_b,
                             kv_a, kv_a_b, vec(p + ".kv_a_layernorm.weight", c),
                             kv_b[:, :nope].contiguous(), kv_b[:, nope:].contiguous(), o, o_b, indexer, stored=st)
            q = f"model.layers.{i}"
            layer = Layer(vec(q + ".input_layernorm.weight", h), vec(q + ".post_attention_layernorm.weight", h),
                          attn, None)
            for name, value in load_ffn(reader, q, i, cfg, mlp, layer.stored).items():
                setattr(layer, name, value)
            layers.append(layer)
        stored: dict = {}  # an NVFP4 lm_head's parts (held as stored on a GPU: layers.pack_head)
        embed, head = load_embed_head(reader, cfg, DT, stored)
        model = cls(cfg, embed, layers, vec("model.norm.weight", h), head)
        model.stored = stored
        return model

    def new_cache(self, streams: int, capacity: int, device=None) -> LatentCache:
        """On the weights' device unless told otherwise."""
        return LatentCache([L.attn.indexer is not None for L in self.layers], streams, capacity,
                           self.latent + self.rope_dim, self.index_dim, DT,
                           self.embed.device if device is None else device)

    def pack_stack(self) -> None:
        """Every layer's q_a | kv_a | indexer wk (one launch over the normed input), q_b, the indexer's wq_b, o and
        the SwiGLU MLPs also in BF16 tiles (as glm4_moe.pack_stack), which steps of at most
        ops.STACK_KERNEL_MAX_ROWS rows take: decode steps read the weights at about copy bandwidth with no
        split-K reduce kernels; the lm_head too, which every step and prefill takes. On the CPU the packed forms
        run F.linear on the unpacked weights: the same bits."""
        dev = self.embed.device
        for L in self.layers:
            if L.attn.packed is None:
                L.attn.packed = pack_mla(L.attn, dev)
            pack_mlps(L, dev)
        pack_head(self, dev)

    def _section(self, *key):
        return NO_TIMER if self.timers is None else self.timers(key)

    def nbytes(self) -> int:
        ts = [self.embed, self.norm, self.lm_head]
        for L in self.layers:
            a = L.attn
            ts += [L.input_norm, L.post_norm, a.q_a, a.q_a_norm, a.q_b, a.kv_a, a.kv_a_norm, a.w_uk, a.w_uv, a.o]
            ts += [t for t in (a.q_a_bias, a.kv_a_bias, a.o_bias, L.router_w, L.router_b) if t is not None]
            if a.indexer is not None:
                ix = a.indexer
                ts += [ix.wq_b, ix.wk, ix.k_norm, ix.k_norm_bias, ix.weights_proj]
            for pair in (L.mlp, L.shared):
                if pair is not None:
                    ts += list(pair)
        return unique_nbytes(ts) + stored_nbytes(self)

    # -- forward ---------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, cache: LatentCache, seqlens: list[int], moe) -> torch.Tensor:
        """Run `tokens` [T] (streams' new tokens packed, seqlens[s] of them for stream s, appended after
        what the cache holds) through the stack; returns last-position logits [M, V] fp32 per stream.
        `moe(layer, x_normed [T, H], L) -> [T, H]` computes the routed experts (the split lives there)."""
        cfg = self.cfg
        dev = self.embed.device
        starts = cache.lengths.tolist()
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, seqlens)]).to(dev)
        cos, sin = self.rope.cos_sin(positions)                      # [T, rope] bf16
        x = self.embed[tokens.to(dev)]                                # [T, H]
        selection = None                                              # the last full indexer's top-k
        for i, L in enumerate(self.layers):
            with self._section("attn", i):
                h = rms_norm(x, L.input_norm, cfg.rms_norm_eps)
                x, selection = self._attention(i, L.attn, h, cos, sin, cache, starts, seqlens, selection, x=x)
            with self._section("ffn", i):
                h = rms_norm(x, L.post_norm, cfg.rms_norm_eps)
                if L.mlp is not None:
                    x = mlp_forward(h, L.mlp, L.mlp_packed, residual=(x,))                  # x + mlp
                else:
                    x = mlp_forward(h, L.shared, L.shared_packed, residual=(moe(i, h, L), x))  # x + (routed + shared)
        cache.lengths += torch.tensor(seqlens)                        # host
        with self._section("head"):
            last = (torch.tensor(seqlens).cumsum(0) - 1).to(dev)
            h = rms_norm(x[last], self.norm, cfg.rms_norm_eps)
            return head_logits(self, h).float()

    def _indexer_k(self, ix: Indexer, wk_h, cos, sin):
        """wk_h: the indexer's wk over the normed input [T, index_dim] -> its keys [T, index_dim] (BF16, layer-normed
        and roped on the first rope channels), which the cache keeps."""
        r = self.rope_dim
        k = F.layer_norm(wk_h, (self.index_dim,), ix.k_norm, ix.k_norm_bias, LATENT_NORM_EPS)
        return torch.cat((rope_interleaved(k[:, None, :r], cos, sin)[:, 0], k[:, r:]), dim=-1)

    def _indexer_qw(self, ix: Indexer, h, q_resid, cos, sin, packs=None):
        """-> the indexer's queries [T, index_heads, index_dim] (roped as the keys), head weights [T, index_heads]
        fp32: what scoring needs."""
        t, r = h.shape[0], self.rope_dim
        q = linears(q_resid, [ix.wq_b], packs=packs)[0].view(t, self.index_heads, self.index_dim)
        q = torch.cat((rope_interleaved(q[..., :r], cos, sin), q[..., r:]), dim=-1)
        w = linear_rows(h.float(), ix.weights_proj) * self.index_heads ** -0.5
        return q, w

    def _index_scores(self, q, w, keys) -> torch.Tensor:
        """q [B, heads, d], w [B, heads] fp32, keys [B or 1, S, d] -> [B, S] fp32:
        sum over heads of w * relu(q . k / sqrt(d)), as transformers' indexer computes it."""
        kt = keys[0].t() if keys.shape[0] == 1 else keys.transpose(1, 2)
        s = matmul_fp32(q, kt).mul_(self.index_scale).relu_()                             # [B, heads, S]
        return torch.matmul(w[:, None, :], s)[:, 0]

    def _attention(self, i, a: Attention, h, cos, sin, cache: LatentCache, starts, seqlens, selection, pos=None,
                   span: int | None = None, x: torch.Tensor | None = None, fused: bool = False):
        """-> (x + the attention block of layer i over h = its normed x, the selection). pos [M] on the device:
        the fixed-shape decode step (forward_static) over the cache's first `span` positions (None: its
        capacity), starts/seqlens unused. The linears take their packed copies where the model has them
        (pack_stack) and the step has at most ops.STACK_KERNEL_MAX_ROWS rows, x + o in the o projection's
        epilogue; fused: the RMSNorms in ops.rms_norm (the fixed-shape step on a GPU)."""
        t, nh, c = h.shape[0], self.heads, self.latent
        dev = h.device
        norm, P, own = norm_of(fused), a.packed or {}, a.indexer is not None
        qa, kv, *wk_h = linears(h, *latent_input_linears(a), P.get("h"))
        q_resid = norm(qa, a.q_a_norm, LATENT_NORM_EPS)                                # [T, q_lora]
        q = linears(q_resid, [a.q_b], packs=P.get("q_b"))[0].view(t, nh, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent = norm(kv[:, :c], a.kv_a_norm, LATENT_NORM_EPS)                          # kv [T, c + rope]
        k_rot = rope_interleaved(kv[:, None, c:], cos, sin)[:, 0]
        # absorbed MLA: q_nope . (W_uk latent) == (q_nope W_uk) . latent, so keys are the cached latent rows
        q_cat = torch.cat((torch.einsum("thd,hdc->thc", q_nope, a.w_uk), rope_interleaved(q_rot, cos, sin)), dim=-1)
        kv_new = torch.cat((latent, k_rot), dim=-1)                                      # [T, c + rope]
        kvc, ixc = cache.kv[i], cache.index_k[i]
        dense = self.index_topk is None   # no indexer: every position
        if own:
            ik = self._indexer_k(a.indexer, wk_h[0], cos, sin)
        elif selection is None and not dense:
            raise ConfigError(f"layer {i}: a 'shared' indexer layer needs an earlier 'full' one")

        if pos is not None or all(n == 1 for n in seqlens):
            if pos is None:   # the host knows the lengths: attend over the longest stream's span only
                pos, span = torch.tensor(starts, device=dev), max(starts) + 1
            elif span is None:
                span = cache.capacity
            # within index_topk positions the top-k of every query is all of its positions: no scores needed
            iq, iw = self._indexer_qw(a.indexer, h, q_resid, cos, sin, P.get("wq_b")) \
                if own and span > self.index_topk else (None, None)
            o_lat, selection = self._decode_attention(i, a, q_cat, kv_new, ik if own else None, iq, iw, cache, pos,
                                                      span, selection)
        else:
            iq = iw = None
            if own and any(p0 + n > self.index_topk for p0, n in zip(starts, seqlens)):  # some rows choose
                iq, iw = self._indexer_qw(a.indexer, h, q_resid, cos, sin, P.get("wq_b"))
            outs, sels, off = [], [], 0
            for s, (p0, n) in enumerate(zip(starts, seqlens)):
                if n == 0:
                    sels.append(None)
                    continue
                kvc[s, p0:p0 + n] = kv_new[off:off + n]
                if own:
                    ixc[s, p0:p0 + n] = ik[off:off + n]
                    sel = self._prefill_selection(None if iq is None else iq[off:off + n],
                                                  None if iw is None else iw[off:off + n], ixc[s], p0, n)
                elif dense:
                    sel = self._prefill_selection(None, None, kvc[s], p0, n)
                else:
                    sel = selection[s]
                outs += self._prefill_attend(q_cat[off:off + n], kvc[s], sel)
                sels.append(sel)
                off += n
            o_lat = torch.cat(outs)
            selection = sels
        o = torch.einsum("thc,hvc->thv", o_lat, a.w_uv).reshape(t, nh * self.v_dim)
        return linears(o, [a.o], [a.o_bias], P.get("o"), residual=() if x is None else (x,))[0], selection

    def _prefill_selection(self, iq, iw, keys, p0: int, n: int) -> PrefillSelection:
        """Stream rows at positions p0..p0 + n - 1 (indexer queries iq [n, ih, d], weights iw [n, ih], the stream's
        cached indexer keys [capacity, d]) -> their selection, block by block (prefill_blocks): a block whose
        last row sees at most index_topk keys takes them all (a causal mask over its prefix, no scores); past
        that each row takes its index_topk best keys <= its position, as positions [r, k] and whether each is
        a real one (a row with fewer keys pads with masked ones), attended gathered: the attention's work and
        memory per row stay index_topk's, whatever the context (a mask over the context would be [n, p0 + n])."""
        dev, k, end = keys.device, self.index_topk or float("inf"), p0 + n
        wide = end > k                      # some rows choose: their scores [rows, ih, keys] and the gathered rows
        per_row = max(self.index_heads * end, k * max(self.heads, self.latent + self.rope_dim)) if wide \
            else self.heads * end
        blocks = []
        for r0, r1 in prefill_blocks(n, per_row):
            w = p0 + r1
            pos = torch.arange(p0 + r0, w, device=dev)
            causal = torch.arange(w, device=dev)[None, :] <= pos[:, None]                   # [rows, w]
            if w <= k:
                blocks.append((r0, r1, None, causal))
                continue
            scores = self._index_scores(iq[r0:r1], iw[r0:r1], keys[None, :w])
            top, cols = ops.topk_first(scores.masked_fill(~causal, float("-inf")), k)     # [rows, k]
            blocks.append((r0, r1, cols, top > float("-inf")))
        return PrefillSelection(p0, blocks)

    def _prefill_attend(self, q, rows, sel: PrefillSelection) -> list[torch.Tensor]:
        """One stream's prefill queries q [n, heads, c + rope] over its cached rows [capacity, c + rope] under its
        selection -> per block [rows, heads, c]: a block whose rows see all of their past over its prefix (a causal
        mask), else each row over its own index_topk rows, gathered (as a decode step does)."""
        return [self._prefill_block(q[r0:r1], rows[:sel.p0 + r1], valid) if cols is None
                else self._over_rows(q[r0:r1], rows[cols], valid) for r0, r1, cols, valid in sel.blocks]

    def _over_rows(self, q, rows, valid) -> torch.Tensor:
        """Each of B queries' heads q [B, heads, c + rope] over its own rows [B, k, c + rope] (valid [B, k]) ->
        [B, heads, c]: a decode step's streams or a prefill's rows past index_topk keys."""
        c = self.latent
        return latent_attention(q, rows, rows[..., :c], valid, self.scale)

    def _prefill_block(self, q, rows, mask) -> torch.Tensor:
        """A prefill block's queries q [r, heads, c + rope] over its stream's latent rows [w, c + rope] under its
        selection mask [r, w] -> [r, heads, c]: the r x heads queries as one stream's query rows of
        latent_attention (fp32 scores, the rows read once for every head)."""
        c, (r, nh) = self.latent, q.shape[:2]
        valid = mask[:, None, :].expand(r, nh, mask.shape[1]).reshape(1, r * nh, -1)
        return latent_attention(q.reshape(1, r * nh, -1), rows[None], rows[None, :, :c], valid,
                                self.scale).view(r, nh, c)

    def _decode_attention(self, i, a: Attention, q_cat, kv_new, ik, iq, iw, cache: LatentCache, pos, span: int,
                          selection):
        """One new token per stream at positions `pos` [M] (device), batched over streams: write the
        cache rows, score the first `span` cached positions with the indexer (positions past a stream's
        own are masked), attend over the top-k rows only. Where span <= index_topk (iq None) the top-k is
        every position <= pos, taken in order without scores. span = the longest stream + 1 on the host path,
        the step's span on the fixed-shape step (graph.span_for: a power-of-two multiple of its smallest, or the
        capacity; no device value picks it; the extra positions are masked and never chosen over a real one). -> ([M, heads, c], selection)."""
        dev = q_cat.device
        kvc, ixc = cache.kv[i], cache.index_k[i]
        idx = torch.arange(pos.numel(), device=dev)
        with distinct_writes():
            kvc[idx, pos] = kv_new
            if a.indexer is not None:
                ixc[idx, pos] = ik
        if (a.indexer is not None and iq is None) or self.index_topk is None:  # every position <= pos, in order
            sel = torch.arange(span, device=dev).expand(pos.numel(), span)
            selection = (sel, sel <= pos[:, None])
        elif a.indexer is not None:
            scores = self._index_scores(iq, iw, ixc[:, :span])                            # [M, span]
            scores = scores.masked_fill(torch.arange(span, device=dev)[None, :] > pos[:, None], float("-inf"))
            top, sel = ops.topk_first(scores, min(self.index_topk, span))                 # [M, k]
            selection = (sel, top > float("-inf"))              # a short stream pads with masked rows
        sel, valid = selection
        return self._over_rows(q_cat, kvc[idx[:, None], sel], valid), selection             # rows [M, k, c + rope]

    def forward_static(self, tokens: torch.Tensor, pos: torch.Tensor, cache: LatentCache, moe,
                       span: int | None = None) -> torch.Tensor:
        """One decode step, one new token per stream, with fixed shapes and no host read (CUDA-graph safe):
        tokens [M] and pos [M] (each stream's position = what its cache holds) live on the device. The
        indexer scores the cache's first `span` positions (None: its whole capacity; every pos < span,
        graph.span_for) under a length mask (_decode_attention); everything else
        is forward's decode step. The caller advances pos and cache.lengths. Returns
        the logits [M, V] in bf16 (see glm4_moe.forward_static). On a GPU with the extension, as glm4_moe's step:
        the RMSNorms in ops.rms_norm, the packed linears (pack_stack), the shared expert beside the routed
        ones with x + (routed + shared) in the scatter, and the step's glue fused: the embedding with the first
        norm and each MoE scatter with the next norm."""
        eps = self.cfg.rms_norm_eps
        dev = self.embed.device
        fused = dev.type == "cuda" and ops.available()
        glue = fused
        norm = norm_of(fused)
        cos, sin = self.rope.cos_sin(pos)
        h = None
        if glue:
            x, h = ops.embed_rms_norm(self.embed, tokens, self.layers[0].input_norm, eps)
        else:
            x = self.embed[tokens]
        n, selection = len(self.layers), None
        for i, L in enumerate(self.layers):
            if h is None:
                h = norm(x, L.input_norm, eps)
            x, selection = self._attention(i, L.attn, h, cos, sin, cache, None, None, selection, pos=pos,
                                           span=span, x=x, fused=fused)
            h = norm(x, L.post_norm, eps)
            if L.mlp is not None:
                x, h = mlp_forward(h, L.mlp, L.mlp_packed, residual=(x,)), None                 # x + mlp
                continue
            hs = h  # the shared expert's input (the lambda runs inside moe, after h is rebound below)
            shared = lambda: mlp_forward(hs, L.shared, L.shared_packed)  # noqa: E731
            if glue:  # the scatter also makes the next input norm (the final norm after the last layer)
                nxt = self.layers[i + 1].input_norm if i + 1 < n else self.norm
                x, h = moe(i, h, L, shared=shared, residual=x, next_norm=(nxt, eps))         # x + (routed + shared)
            else:
                x, h = moe(i, h, L, shared=shared, residual=x), None
        if h is None:
            h = norm(x, self.norm, eps)
        return head_logits(self, h)  # bf16, as glm4_moe.forward_static


class DeepseekV3Model(GlmMoeDsaModel):
    """DeepSeek-V3 (transformers model_type deepseek_v3; DeepSeek-V3 / R1 and the models on its architecture): GLM-5's
    MLA and MoE without the DSA indexer, every layer attending over every position, with YaRN's rope
    (config/glm_moe_dsa.normalize_deepseek_v3). Its fixed-shape step is GLM-5's, checked captured on a GPU (the graph
    against the eager step, a graphed 2-rank static fire): --decode-path auto takes the graph there."""
    GRAPH_CHECKED = True
