"""GLM-5.3-Flash text model (transformers model_type glm5_next, Glm5NextTextModel + lm_head).

Per layer: hyper-connection collapse -> RMSNorm -> KDA linear attention or MLA/DSA attention ->
hyper-connection expand; then the same around a dense MLP or the MoE block (routed experts through
`moe(layer, x, L)`, plus the shared expert). hc_mult residual streams per token (glm5_next_hc),
averaged before the final norm. SwiGLU projections are clamped to swiglu_limit in the dense and
shared MLPs here, and in the routed experts by rocket_mpi.moe.experts. The MTP layer
(layers.{num_hidden_layers}) and the vision tower are not read: text decode does not use them.

Checkpoint tensor names are the ones transformers writes (`model.language_model.` for the full
model, `model.` for a text-only one); the few that transformers renames on load are accepted under
both names.

Device: the weights live where `to(device)` put them (CPU after `load`); the cache and every tensor
forward creates follow `self.embed.device`; stream offsets and lengths stay on the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rocket_mpi import ops
from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.config import ModelConfig
from rocket_mpi.errors import CheckpointError
from rocket_mpi.model.glm5_next_hc import HcArgs, HyperConnection, hc_post, hc_pre
from rocket_mpi.model.glm5_next_kda import KDA, KdaArgs, kda_forward, pack_kda
from rocket_mpi.model.glm5_next_mla import MLA, Indexer, MlaArgs, MlaCache, mla_decode, mla_forward
from rocket_mpi.model.glm_moe_dsa import NO_TIMER
from rocket_mpi.model.layers import (StackModel, head_logits, load_linear, load_swiglu, mlp_forward, norm_of, pack_head,
                                     pack_linears, pack_mla, pack_mlps, rms_norm, stored_nbytes, unique_nbytes)

DT = torch.bfloat16

# -- weights -------------------------------------------------------------------------------
@dataclass
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn_hc: HyperConnection
    ffn_hc: HyperConnection
    kda: KDA | None
    mla: MLA | None
    shares_next: bool                                       # the next layer reuses this one's DSA selection
    mlp: tuple[torch.Tensor, torch.Tensor] | None           # dense: (gate_up [2I, H], down [H, I])
    router_w: torch.Tensor | None = None                    # [E, H] fp32
    router_b: torch.Tensor | None = None                    # [E] fp32
    shared: tuple[torch.Tensor, torch.Tensor] | None = None
    mlp_packed: object = None                               # pack_stack: ops.pack_mlp of mlp / shared
    shared_packed: object = None
    stored: dict = field(default_factory=dict)              # NVFP4 parts of mlp / shared (layers: held as stored)


class Glm5NextCache:
    """Per stream: KDA conv + recurrent states, MLA latents and indexer keys; `lengths` [M] tokens held."""

    def __init__(self, model: "Glm5NextModel", streams: int, capacity: int, device=None):
        k, m = model.kda_args, model.mla_args
        device = model.embed.device if device is None else device
        self.conv, self.rec, self.mla = {}, {}, {}
        for i, L in enumerate(model.layers):
            if L.kda is not None:
                self.conv[i] = torch.zeros(streams, 3 * k.dim, k.conv_kernel, dtype=DT, device=device)
                self.rec[i] = torch.zeros(streams, k.heads, k.head_dim, k.head_dim, dtype=torch.float32, device=device)
            else:
                self.mla[i] = MlaCache(streams, capacity, m, L.mla.indexer is not None, device)
        self.lengths = torch.zeros(streams, dtype=torch.long)  # host
        self.capacity = capacity

    @property
    def streams(self) -> int:
        return self.lengths.numel()

    def nbytes(self) -> int:
        ts = list(self.conv.values()) + list(self.rec.values()) + [t for c in self.mla.values() for t in c.tensors()]
        return sum(t.numel() * t.element_size() for t in ts)


def _prefix(reader: CheckpointReader) -> str:
    for p in ("model.language_model.", "model."):
        if p + "embed_tokens.weight" in reader:
            return p
    raise CheckpointError(f"{reader.dir}: no 'model.language_model.embed_tokens.weight' or "
                          f"'model.embed_tokens.weight': not a GLM-5.3-Flash checkpoint")


class Glm5NextModel(StackModel):
    # forward_static's capture checked on a GPU (graph == eager step, static fire on the graphed step, host
    # and graph paths decode the same tokens): --decode-path auto takes the graph
    GRAPH_CHECKED = True
    # optional timing hook (benchmarks/bench_glm5.py): a callable key -> context manager around each
    # sub-block, keys ("attn", layer), ("ffn", layer), ("head",). None: a shared no-op context.
    timers = None

    def __init__(self, cfg: ModelConfig, embed, layers: list[Layer], norm, lm_head):
        r = cfg.raw
        self.cfg = cfg
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.head_packed = None     # pack_stack: lm_head in the kernel's tiles (layers.pack_head)
        self.stored: dict = {}      # an NVFP4 lm_head's parts (layers: held as stored)
        self.hc_args = HcArgs(r["hc_mult"], r["hc_sinkhorn_iters"], r["hc_eps"], cfg.rms_norm_eps)
        self.kda_args = KdaArgs(r["linear_num_heads"], r["linear_head_dim"], r["linear_conv_kernel_dim"],
                                r["linear_lower_bound"], cfg.rms_norm_eps)
        self.mla_args = MlaArgs(cfg.num_attention_heads, r["qk_nope_head_dim"], r["v_head_dim"], r["kv_lora_rank"],
                                cfg.rms_norm_eps, r["index_n_heads"], r["index_head_dim"], r["index_topk"],
                                r["index_kpool"], bool(r["index_kpool_always_select_tail"]))
        self.limit = cfg.swiglu_limit

    @staticmethod
    def expert_prefix(reader: CheckpointReader, layer: int) -> str:
        return f"{_prefix(reader)}layers.{layer}.mlp.experts"

    # -- loading ---------------------------------------------------------------------
    @classmethod
    def load(cls, reader: CheckpointReader) -> "Glm5NextModel":
        cfg, r = reader.config, reader.config.raw
        h, pre = cfg.hidden_size, _prefix(reader)

        def lin(name, n, k, stored=None, key=None, lazy=False):
            # BF16 or NVFP4 (dequantised; where `stored` is given also held as stored on a GPU: layers)
            return load_linear(reader, name, n, k, False, stored, key, DT, lazy)[0]

        def bias(name, n, on):
            return reader.get_float(name, (n,), DT) if on else None

        def vec(name, n, dtype=DT):
            return reader.get_float(name, (n,), dtype)

        def first(*names):
            for nm in names:
                if nm in reader:
                    return nm
            raise CheckpointError(f"{reader.dir}: missing tensor '{names[0]}'")

        def mlp(p, inter, stored):  # the MLPs are held as stored on a GPU (layers), as MLA's and KDA's linears
            key = "shared" if p.endswith("shared_experts") else "mlp"
            return load_swiglu(reader, p, h, inter, DT, stored, key)

        nhc = r["hc_mult"]
        nmix = (2 + nhc) * nhc

        def hc(p, kind):
            fn = reader.get_float(first(f"{p}.hc_{kind}_fn", f"{p}.{kind}_hc.fn"), (nmix, nhc * h), DT).float()
            base = reader.get_float(first(f"{p}.hc_{kind}_base", f"{p}.{kind}_hc.base"), (nmix,), torch.float32)
            scale = reader.get_float(first(f"{p}.hc_{kind}_scale", f"{p}.{kind}_hc.scale"), (3,), torch.float32)
            return HyperConnection(fn, base, scale)

        def kda(p):
            nh, dk, kk = r["linear_num_heads"], r["linear_head_dim"], r["linear_conv_kernel_dim"]
            d = nh * dk
            st, parts = {}, {}  # the NVFP4 parts of the linears the GPU holds as stored
            qkv = torch.cat([lin(f"{p}.{x}_proj", d, h, parts, x) for x in "qkv"])
            if len(parts) == 3:
                st["qkv"] = [parts[x] for x in "qkv"]
            if f"{p}.q_conv1d.weight" in reader:
                conv = torch.cat([reader.get_float(f"{p}.{x}_conv1d.weight", (d, 1, kk), torch.float32) for x in "qkv"])
            else:
                conv = reader.get_float(f"{p}.conv1d.weight", (3 * d, 1, kk), torch.float32)
            fg = "" if f"{p}.f_a_proj.weight" in reader else ".forget_gate"
            return KDA(qkv, conv[:, 0, :].contiguous(),
                       lin(f"{p}{fg}.f_a_proj", dk, h, st, "f_a"), lin(f"{p}{fg}.f_b_proj", d, dk, st, "f_b"),
                       vec(f"{p}{fg}.dt_bias", d, torch.float32), vec(f"{p}{fg}.A_log", nh, torch.float32),
                       lin(f"{p}.b_proj", nh, h, st, "b"), lin(f"{p}.g_a_proj", dk, h, st, "g_a"),
                       lin(f"{p}.g_b_proj", d, dk, st, "g_b"), vec(f"{p}.o_norm.weight", dk).float(),
                       lin(f"{p}.o_proj", h, d, st, "o"), stored=st)

        def mla(p, full):
            a, ab = cfg.num_attention_heads, cfg.attention_bias
            ql, kl, dq, dv = r["q_lora_rank"], r["kv_lora_rank"], r["qk_nope_head_dim"], r["v_head_dim"]
            ix, st, ist = None, {}, {}  # the NVFP4 parts of the linears the GPU holds as stored (GLM-5's as well)
            if full:
                ih, d, kp = r["index_n_heads"], r["index_head_dim"], r["index_kpool"]
                q = f"{p}.indexer"
                ix = Indexer(lin(f"{q}.wq_b", ih * d, ql, ist, "wq_b"), lin(f"{q}.wk", d, h, ist, "wk"),
                             vec(f"{q}.k_norm.weight", d), vec(f"{q}.k_norm.bias", d), lin(f"{q}.weights_proj", ih, h),
                             reader.get_float(f"{q}.index_kpool_compress_ape", (kp, d), DT).float(),
                             reader.get_float(f"{q}.index_kpool_compress_gate", (d, h), DT), stored=ist)
            return MLA(lin(f"{p}.q_a_proj", ql, h, st, "q_a"), bias(f"{p}.q_a_proj.bias", ql, ab),
                       vec(f"{p}.q_a_layernorm.weight", ql), lin(f"{p}.q_b_proj", a * dq, ql, st, "q_b"),
                       lin(f"{p}.kv_a_proj_with_mqa", kl, h, st, "kv_a"), bias(f"{p}.kv_a_proj_with_mqa.bias", kl, ab),
                       vec(f"{p}.kv_a_layernorm.weight", kl), lin(f"{p}.kv_b_proj", a * (dq + dv), kl),
                       lin(f"{p}.o_proj", h, a * dv, st, "o"), bias(f"{p}.o_proj.bias", h, ab), ix, stored=st)

        layers = []
        types, idx = r["layer_types"], r["indexer_types"]
        for i in range(cfg.num_hidden_layers):
            p = f"{pre}layers.{i}"
            linear = types[i] == "linear_attention"
            full = not linear and idx[i] == "full"
            shares_next = full and i + 1 < cfg.num_hidden_layers and types[i + 1] == "indexed_attention" \
                and idx[i + 1] == "shared"
            L = Layer(vec(p + ".input_layernorm.weight", h), vec(p + ".post_attention_layernorm.weight", h),
                      hc(p, "attn"), hc(p, "ffn"), kda(p + ".self_attn") if linear else None,
                      None if linear else mla(p + ".self_attn", full), shares_next, None)
            if cfg.is_moe_layer(i):
                e = cfg.n_routed_experts
                L.router_w = reader.get_float(p + ".mlp.gate.weight", (e, h), torch.float32)
                L.router_b = reader.get(p + ".mlp.gate.e_score_correction_bias", (e,),
                                        (torch.float32, torch.bfloat16), finite=True).float()
                L.shared = mlp(p + ".mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts, L.stored)
            else:
                L.mlp = mlp(p + ".mlp", cfg.intermediate_size, L.stored)
            layers.append(L)
        embed = reader.get_float(pre + "embed_tokens.weight", (cfg.vocab_size, h), DT)
        stored: dict = {}  # an NVFP4 lm_head's parts (held as stored on a GPU: layers.pack_head)
        if cfg.tie_word_embeddings and "lm_head.weight" not in reader:
            head = embed
        else:
            head = lin("lm_head", cfg.vocab_size, h, stored, "lm_head", lazy=True)
        model = cls(cfg, embed, layers, vec(pre + "norm.weight", h), head)
        model.stored = stored
        return model

    def new_cache(self, streams: int, capacity: int, device=None) -> Glm5NextCache:
        """On the weights' device unless told otherwise."""
        return Glm5NextCache(self, streams, capacity, device)

    def pack_stack(self) -> None:
        """The stack's linears also in the kernel's tiles (as glm4_moe.pack_stack), which steps of at most
        ops.STACK_KERNEL_MAX_ROWS rows take: KDA's qkv | f_a | g_a (one launch over the normed input), b, f_b,
        g_b, o (glm5_next_kda.pack_kda); MLA's q_a | kv_a | indexer wk, the indexer's gate | weights, q_b, wq_b, o
        (layers.pack_mla); the dense and shared SwiGLU MLPs (swiglu_limit's clamp in the kernel's epilogue); NVFP4
        ones held as stored; the lm_head, which every step and prefill takes. On the CPU the packed forms run
        F.linear on the unpacked weights: the same bits."""
        dev = self.embed.device
        for L in self.layers:
            k, a = L.kda, L.mla
            if k is not None and k.packed is None:
                k.packed = pack_kda(k, dev)
            if a is not None and a.packed is None:
                ix = a.indexer
                a.packed = {**pack_mla(a, dev), "ix": None if ix is None else pack_linears([ix.gate, ix.weights])}
            pack_mlps(L, dev)
        pack_head(self, dev)

    def _section(self, *key):
        return NO_TIMER if self.timers is None else self.timers(key)

    def nbytes(self) -> int:
        ts = [self.embed, self.norm, self.lm_head]
        for L in self.layers:
            ts += [L.input_norm, L.post_norm, *vars(L.attn_hc).values(), *vars(L.ffn_hc).values()]
            for part in (L.kda, L.mla, L.mla.indexer if L.mla else None):
                if part is not None:
                    ts += [t for t in vars(part).values() if isinstance(t, torch.Tensor)]
            ts += [t for t in (L.router_w, L.router_b) if t is not None]
            for pair in (L.mlp, L.shared):
                if pair is not None:
                    ts += list(pair)
        return unique_nbytes(ts) + stored_nbytes(self)

    # -- forward ---------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, cache: Glm5NextCache, seqlens: list[int], moe) -> torch.Tensor:
        """`tokens` [T]: the streams' new tokens packed (seqlens[s] for stream s, after what the cache
        holds). Returns last-position logits [M, V] fp32. `moe(layer, x_normed [T, H], L) -> [T, H]`."""
        cfg, hca = self.cfg, self.hc_args
        dev = self.embed.device
        starts = cache.lengths.tolist()
        offs = torch.tensor([0] + seqlens).cumsum(0).tolist()                          # host
        segments = [(s, offs[s], n) for s, n in enumerate(seqlens) if n]
        kfuse = ops.on_gpu(dev)  # a GPU's KDA tokens in the kernel: a prefill's too (kda_forward)
        x = self.embed[tokens.to(dev)]                                                 # [T, H]
        streams = x.unsqueeze(1).expand(-1, hca.mult, -1).contiguous()                 # [T, N, H]
        selection = None
        for i, L in enumerate(self.layers):
            with self._section("attn", i):
                post, comb, h = hc_pre(L.attn_hc, streams, hca)
                h = rms_norm(h, L.input_norm, cfg.rms_norm_eps)
                if L.kda is not None:
                    y = kda_forward(L.kda, h, cache.conv[i], cache.rec[i], segments, self.kda_args, fuse=kfuse)
                    selection = None
                else:
                    y, sel = mla_forward(L.mla, h, cache.mla[i], starts, seqlens, self.mla_args, selection)
                    selection = sel if L.shares_next else None
                streams = hc_post(post, comb, y, streams)
            with self._section("ffn", i):
                post, comb, h = hc_pre(L.ffn_hc, streams, hca)
                h = rms_norm(h, L.post_norm, cfg.rms_norm_eps)
                if L.mlp is not None:  # gate and up clamped to swiglu_limit, as the routed experts are
                    y = mlp_forward(h, L.mlp, L.mlp_packed, limit=self.limit)
                else:                  # routed + shared
                    y = mlp_forward(h, L.shared, L.shared_packed, residual=(moe(i, h, L),), limit=self.limit)
                streams = hc_post(post, comb, y, streams)
        cache.lengths += torch.tensor(seqlens)                                         # host
        with self._section("head"):
            last = (torch.tensor(offs[1:]) - 1).to(dev)
            h = rms_norm(streams[last].mean(dim=1), self.norm, cfg.rms_norm_eps)
            return head_logits(self, h).float()

    def forward_static(self, tokens: torch.Tensor, pos: torch.Tensor, cache: Glm5NextCache, moe,
                       span: int | None = None) -> torch.Tensor:
        """One decode step, one new token per stream, with fixed shapes and no host read (CUDA-graph safe):
        tokens [M] and pos [M] (what each stream's cache holds) on the device. KDA layers step their
        states; MLA layers select over the cache's first `span` positions (None: its whole capacity; every
        pos < span, graph.span_for; mla_decode: positions past a stream's own are never chosen). The caller advances pos and cache.lengths. Returns
        the logits [M, V] in bf16 (see glm4_moe.forward_static). On a GPU with the extension: the RMSNorms in
        ops.rms_norm, the packed linears and MLPs (pack_stack), the shared expert beside the routed ones
        (moe's `shared`: routed + shared in the scatter), the hyper-connections and KDA tokens in their kernels,
        and each block's input norm in hc_pre's second launch (the same bits)."""
        hca = self.hc_args
        dev, eps = tokens.device, self.cfg.rms_norm_eps
        fused = dev.type == "cuda" and ops.available()
        norm = norm_of(fused)
        x = self.embed[tokens]
        streams = x.unsqueeze(1).expand(-1, hca.mult, -1).contiguous()
        idx = torch.arange(tokens.numel(), device=dev)
        selection = None
        span = cache.capacity if span is None else span
        fuse = kfuse = glue = fused  # each input norm in hc_pre's launch: the same bits

        def collapse(hc, streams, w):  # -> post, comb, the block's normed input
            if glue:
                return hc_pre(hc, streams, hca, fuse, norm=(w, eps))
            post, comb, h = hc_pre(hc, streams, hca, fuse)
            return post, comb, norm(h, w, eps)

        for i, L in enumerate(self.layers):
            post, comb, h = collapse(L.attn_hc, streams, L.input_norm)
            if L.kda is not None:
                y = kda_forward(L.kda, h, cache.conv[i], cache.rec[i], [], self.kda_args, idx=idx, fuse=kfuse)
                selection = None
            else:
                y, sel = mla_decode(L.mla, h, cache.mla[i], pos, span, self.mla_args, selection, fused)
                selection = sel if L.shares_next else None
            streams = hc_post(post, comb, y, streams, fuse)
            post, comb, h = collapse(L.ffn_hc, streams, L.post_norm)
            if L.mlp is not None:
                y = mlp_forward(h, L.mlp, L.mlp_packed, limit=self.limit)
            else:  # routed + shared, the shared expert beside the routed ones on a GPU (moe/step.py DeviceMoE)
                hs = h
                y = moe(i, h, L, shared=lambda: mlp_forward(hs, L.shared, L.shared_packed, limit=self.limit))
            streams = hc_post(post, comb, y, streams, fuse)
        h = norm(streams.mean(dim=1), self.norm, eps)
        return head_logits(self, h)  # bf16, as glm4_moe.forward_static
