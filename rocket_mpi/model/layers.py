"""Small building blocks of the replicated BF16 stack, each the same arithmetic as transformers'.

NVFP4 linears of the stack (a checkpoint that quantises attention, dense MLPs, shared experts: ModelOpt's all-Linears
recipe) load as today, dequantised to BF16 (the CPU's weights, bit for bit the transformers reference), and their
parts as stored go into the owning dataclass's `stored` dict ({field: reader.Linear}, an MLP's field: (gate, up,
down)). On a GPU with the extension pack_stack packs those parts into the kernel's NVFP4 tiles (ops/stack.py) and
releases the dense field (release_stored: None, an MLP's (None, None)), so the device holds them as stored, 3.6x
fewer bytes; steps of more than ops.STACK_KERNEL_MAX_ROWS rows dequantise the packed copy on the fly (dense_linears,
dense_mlp). A move to another device rebuilds a released field from its parts (move_weights)."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import torch
import torch.nn.functional as F

from rocket_mpi import ops
from rocket_mpi.ops.norm import rms_norm_ref as rms_norm  # noqa: F401 (the families take the references from here)
from rocket_mpi.ops.pack import TILE_N
from rocket_mpi.ops.stack import ROW_CLASS, linear_rows, swiglu_mlp  # noqa: F401




PREFILL_ROWS = 512  # query rows per attention block of a prefill at most (prefill_blocks)
PREFILL_SCORES = 1 << 28  # score elements (heads x rows x keys) per block at most, while a block keeps 16+ rows
PREFILL_MIN_ROWS = 16


def prefill_blocks(n: int, per_row: int = 0) -> list[tuple[int, int]]:
    """A prefill of n query rows in blocks [r0, r1): each block attends over the keys up to its own last row, so a
    prompt's scores are [heads, rows, keys] a block at a time, not [heads, n, n] (an 8192-token prompt over 96
    heads: 12 GiB of bf16 scores and 24 GiB of fp32 probabilities per layer at once). per_row: score elements of
    one query row in the widest block (heads x the keys of the last row); a block's rows are PREFILL_ROWS, fewer
    where per_row x PREFILL_ROWS would pass PREFILL_SCORES (a long context: 96 heads over 16384 keys take 170 rows,
    about 2 GiB of scores and probabilities), but at least PREFILL_MIN_ROWS. Every row keeps its own keys, mask
    and sums; the matmuls' shapes are the block's (the same on every rank: the blocks depend on the shapes only)."""
    rows = PREFILL_ROWS
    if per_row > 0:
        rows = max(min(rows, PREFILL_SCORES // per_row), min(PREFILL_MIN_ROWS, rows))
    return [(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]


@contextlib.contextmanager
def distinct_writes():
    """Around index writes whose indices are distinct by construction (one row per stream at its position, topk's
    picks): torch's deterministic mode (runtime/decode.py) would sort the indices and check their bounds first, a
    radix sort, min / max reductions, compares and _assert_async per write on a GPU (a third of an eager GLM-5
    step's kernels); with no index twice the plain kernel writes every element once, so the bits are the same
    (GPU test)."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    ops.set_deterministic(False)
    try:
        yield
    finally:
        ops.set_deterministic(was, warn_only=warn)


_BMM_FP32_OUT = "dtype" in torch.ops.aten.bmm.overloads()   # bmm(..., out_dtype=): bf16 in, fp32 out (CUDA)


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, m, k] @ b [B, k, n] (or one b [k, n] for every batch) of bf16 values -> fp32 [B, m, n]: bf16 products
    (exact in fp32), fp32 sums. On a GPU the bf16 tensor cores (bmm / mm with out_dtype); on the CPU, or a torch
    without out_dtype (before 2.8), the same products from fp32 copies in an fp32 GEMM (on a GPU that GEMM is a
    long prefill's largest cost, so the GPU path avoids it)."""
    if a.is_cuda and _BMM_FP32_OUT:
        if b.dim() == 2:
            return torch.mm(a.reshape(-1, a.shape[-1]), b, out_dtype=torch.float32).view(*a.shape[:-1], b.shape[-1])
        return torch.bmm(a, b, out_dtype=torch.float32)
    return _matmul_rows_cols(a.float(), b.float())


COL_BLOCK = 64  # the CPU GEMM's columns are padded to a multiple of this: a column's sum then does not depend on n


def _matmul_rows_cols(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a @ b on the CPU with every output element's bits independent of how many rows and columns share the
    call (batch invariance: n is often a span set by the longest stream): rows padded to ROW_CLASS, columns to a
    multiple of COL_BLOCK (MKL's sgemm sums a launch's edge rows and columns in other orders)."""
    n = b.shape[-1]
    b = F.pad(b, (0, -n % COL_BLOCK))
    if b.dim() == 2:
        flat = a.reshape(-1, a.shape[-1])
        rows = flat.shape[0]
        if 0 < rows < ROW_CLASS:
            flat = torch.cat((flat, flat[:1].expand(ROW_CLASS - rows, -1)))
        return torch.mm(flat, b)[:rows, :n].reshape(*a.shape[:-1], n)
    m = a.shape[-2]
    if 0 < m < ROW_CLASS:
        a = torch.cat((a, a[..., :1, :].expand(*a.shape[:-2], ROW_CLASS - m, a.shape[-1])), dim=-2)
    return torch.matmul(a, b)[..., :m, :n]


def latent_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None,
                     scale: float, probs=None) -> torch.Tensor:
    """Attention of MLA's absorbed form (decode steps; prefill blocks and gathered prefill rows): every head of a
    stream attends over that stream's rows, one shared key / value head. q [M, heads, d], keys [M, n, d], values [M, n, dv], valid
    [M, n] bool (or [M, heads, n]: a mask per query row, a prefill's rows x heads) -> [M, heads, dv]. Two batched
    GEMMs that read each stream's rows once for all its heads, the scores kept in fp32 (bf16 products, fp32 sums;
    on the CPU from fp32 copies: the same products) for an fp32 softmax. SDPA is several times slower here: with
    the heads as one head's query rows it runs one block per stream, and with enable_gqa its math path repeats
    the rows per head. A stream with no valid row gets NaN, as SDPA gives. probs(scores, scale) -> the bf16
    probabilities, in place of the mask, softmax and cast (ops.mla_softmax: one launch; valid is then its business)."""
    s = matmul_fp32(q, keys.transpose(1, 2))
    if probs is not None:
        return torch.bmm(probs(s, scale), values)
    p = (s * scale).masked_fill(~(valid[:, None, :] if valid.dim() == 2 else valid), float("-inf")).softmax(dim=-1)
    return torch.bmm(p.to(values.dtype), values)


def dense_linears(weights: list, packs) -> list[torch.Tensor]:
    """The dense weights of linears, their packed copy (pack_linears' list, in the same order) dequantised on the fly
    where one of them is held as stored (None: released by pack_stack)."""
    if packs is None or all(w is not None for w in weights):
        return weights
    return [w for p in packs for w in ops.unpack_linear(p)]


def dense_mlp(mlp: tuple, packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up, down) of a SwiGLU MLP, its packed copy dequantised on the fly where it is held as stored."""
    return ops.unpack_mlp(packed) if mlp[0] is None else mlp


def mlp_forward(x: torch.Tensor, mlp: tuple[torch.Tensor, torch.Tensor], packed=None, residual=(),
                limit: float | None = None) -> torch.Tensor:
    """A dense or shared-expert SwiGLU MLP (gate_up, down; swiglu_mlp's `limit`), then + each of `residual` in
    order (r + y, one bf16 rounding each, as the stack writes x + mlp); with its `packed` copy (pack_mlps), steps
    of at most ops.STACK_KERNEL_MAX_ROWS rows run in the expert kernel's tiles, the adds in its epilogue."""
    if packed is not None and x.shape[0] <= ops.STACK_KERNEL_MAX_ROWS:
        return ops.swiglu_dense(x, packed, residual, limit)
    return ops.add_residuals(swiglu_mlp(x, *dense_mlp(mlp, packed), limit), residual)


@dataclasses.dataclass
class RowGroups:
    """The rows of a forward where some stream has more than ops.STACK_KERNEL_MAX_ROWS of them (stack_rows): `short`
    the rows of the other streams, in order (device indices); `pieces` per stream with rows, in row order, (start,
    end, long): a long stream's rows [start, end) of the forward, a short one's [start, end) of the short rows."""
    short: torch.Tensor
    pieces: list[tuple[int, int, bool]]


def stack_rows(seqlens: list[int], device) -> RowGroups | None:
    """How a forward of seqlens[s] rows per stream takes the replicated stack's linears where they have packed copies
    (pack_stack), so that a row's bits depend on its own stream alone (batch invariance): a stream of at most
    ops.STACK_KERNEL_MAX_ROWS rows (every decode step, short prompts) takes the packed copies, every such row in one
    launch (the kernel computes each row on its own, whatever the launch holds); a longer one (a prompt's chunk,
    cut at its own offsets: engine.prefill_chunks) the dense weights (cuBLAS, faster there) in a GEMM of its own
    rows, the GEMM it gets alone. None where every stream takes the packed copies."""
    limit = ops.STACK_KERNEL_MAX_ROWS
    if all(n <= limit for n in seqlens):
        return None
    short, pieces, start = [], [], 0
    for n in seqlens:
        if n > limit:
            pieces.append((start, start + n, True))
        elif n:
            pieces.append((len(short), len(short) + n, False))
            short += range(start, start + n)
        start += n
    return RowGroups(torch.tensor(short, dtype=torch.long, device=device), pieces)


def _by_rows(x: torch.Tensor, rows: RowGroups | None, packed, dense, residual) -> list[torch.Tensor]:
    """packed(x, residual) over every row where rows is None; else the short rows through packed in one call and each
    long stream's through dense, then every output part put back in row order. A long stream's rows are copied to
    a fresh tensor first: cuBLAS picks its kernels by the operands' alignment too, and a fresh tensor's is the one
    the stream has alone."""
    if rows is None:
        return packed(x, tuple(residual))
    res = tuple(residual)
    short = packed(x[rows.short], tuple(r[rows.short] for r in res)) if rows.short.numel() else None
    parts: list[list[torch.Tensor]] = []
    for start, end, long in rows.pieces:
        outs = dense(x[start:end].clone(), tuple(r[start:end] for r in res)) if long else [o[start:end] for o in short]
        parts = [[o] for o in outs] if not parts else [p + [o] for p, o in zip(parts, outs)]
    return [p[0] if len(p) == 1 else torch.cat(p) for p in parts]


def stack_linears(x: torch.Tensor, weights: list[torch.Tensor], biases=None, packs=None, residual=(),
                  rows: RowGroups | None = None) -> list[torch.Tensor]:
    """x through linears of one input -> one tensor per weight; `residual` (one weight only): + each in order (the
    stack's x + o). With packed copies (pack_linear's list) the rows go as stack_rows says (`rows`; None: every row
    through the packed copies, whatever their count); without, F.linear over every row."""
    biases = biases or [None] * len(weights)

    def dense(xs, res):
        outs = [linear_rows(xs, w, b) for w, b in zip(dense_linears(weights, packs), biases)]
        if res:
            outs[0] = ops.add_residuals(outs[0], res)
        return outs

    if packs is None:
        return dense(x, tuple(residual))
    return _by_rows(x, rows, lambda xs, res: ops.linear(xs, packs, res), dense, residual)


def stack_mlp(x: torch.Tensor, mlp: tuple[torch.Tensor, torch.Tensor], packed=None, residual=(),
              rows: RowGroups | None = None) -> torch.Tensor:
    """A dense or shared-expert SwiGLU MLP, then + each of `residual` in order, its rows as stack_linears' (its packed
    copy: pack_mlps)."""
    def dense(xs, res):
        return [ops.add_residuals(swiglu_mlp(xs, *dense_mlp(mlp, packed)), res)]

    if packed is None:
        return dense(x, tuple(residual))[0]
    return _by_rows(x, rows, lambda xs, res: [ops.swiglu_dense(xs, packed, res)], dense, residual)[0]


def pack_linears(weights: list, biases: list[torch.Tensor | None] | None = None, device=None):
    """A packed copy (ops.pack_linear: one launch where the parts fuse) of linears that share their input (BF16
    weights, or NVFP4 parts held as stored: held()), on `device`, or None where a shape is not whole tiles of 16
    (the tiny test presets' narrow heads): those keep F.linear."""
    if any(n % TILE_N or k % TILE_N for n, k in (ops.weight_shape(w) for w in weights)):
        return None
    return ops.pack_linear(list(weights), biases, device=device)


def linears(x: torch.Tensor, weights: list[torch.Tensor], biases=None, packs=None, residual=()
            ) -> list[torch.Tensor]:
    """x through linears of one input -> one tensor per weight: steps of at most ops.STACK_KERNEL_MAX_ROWS rows
    through their packed copy (pack_linears) where they have one, else F.linear each. `residual` (one weight
    only): + each in order (r + y, the stack's x + o), in the kernel's epilogue where it runs."""
    if packs is not None and x.shape[0] <= ops.STACK_KERNEL_MAX_ROWS:
        return ops.linear(x, packs, residual)
    outs = [linear_rows(x, w, b) for w, b in zip(dense_linears(weights, packs), biases or [None] * len(weights))]
    if residual:
        outs[0] = ops.add_residuals(outs[0], residual)
    return outs


def latent_input_linears(a, stored: bool = False) -> tuple[list, list[torch.Tensor | None]]:
    """An MLA layer's linears over its normed input (GLM-5's Attention, GLM-5.3-Flash's MLA): q_a, kv_a and, where
    the layer runs its own indexer, the indexer's wk -> (weights, biases); pack_stack packs them as one launch
    (stored: the weights as it packs them, held())."""
    ws, bs = held(a, "q_a", "kv_a") if stored else [a.q_a, a.kv_a], [a.q_a_bias, a.kv_a_bias]
    if a.indexer is not None:
        ws, bs = ws + (held(a.indexer, "wk") if stored else [a.indexer.wk]), bs + [None]
    return ws, bs


def norm_of(fused: bool):
    """The RMSNorm a step takes: ops.rms_norm (one launch, its own sum order) where the step's kernels are
    fused (a GPU with the extension), else rms_norm (torch ops)."""
    return ops.rms_norm if fused else rms_norm


def pack_mlps(layer, device) -> None:
    """A copy of a layer's dense MLP and shared expert (where it has them) in the expert kernel's tiles on `device`:
    BF16, or NVFP4 held as stored (then the dense pair is released where the device holds the packed copy alone)."""
    for name in ("mlp", "shared"):
        m = getattr(layer, name, None)
        if isinstance(m, tuple) and getattr(layer, name + "_packed", None) is None:
            parts = (getattr(layer, "stored", None) or {}).get(name)
            packed = ops.pack_mlp(*m, device=device) if parts is None else \
                ops.pack_mlp(parts[:2], parts[2], device=device)
            setattr(layer, name + "_packed", packed)
            release_stored(layer, [name], device)


def pack_mla(a, device) -> dict:
    """An MLA layer's linears (GLM-5's Attention, GLM-5.3-Flash's MLA) in the kernel's tiles: "h" q_a | kv_a (| the
    indexer's wk; one launch over the normed input), "q_b", "wq_b" (the indexer's, where the layer runs one), "o";
    NVFP4 ones held as stored (held()), their dense copies released where the device holds the packed ones alone."""
    ix = a.indexer
    P = {"h": pack_linears(*latent_input_linears(a, stored=True), device=device),
         "q_b": pack_linears(held(a, "q_b"), device=device),
         "wq_b": None if ix is None else pack_linears(held(ix, "wq_b"), device=device),
         "o": pack_linears(held(a, "o"), [a.o_bias], device=device)}
    for owner, names, key in ((a, ["q_a", "kv_a"], "h"), (ix, ["wk"], "h"), (a, ["q_b"], "q_b"),
                              (ix, ["wq_b"], "wq_b"), (a, ["o"], "o")):
        if owner is not None and P[key] is not None:
            release_stored(owner, names, device)
    return P


def pack_head(model, device) -> None:
    """model.lm_head also in the kernel's tiles (model.head_packed, once; as stored where it is NVFP4, its dense copy
    then released): every head() takes it, so a stream's logits do not depend on how many rows share the launch
    (cuBLAS picks its kernel, and with it a row's sums, by the row count). The copy adds vocab x hidden x 2 bytes to
    the device where the head is BF16."""
    if model.head_packed is None:
        model.head_packed = pack_linears(held(model, "lm_head"), device=device)
        if model.head_packed is not None:
            release_stored(model, ["lm_head"], device)


def head_logits(model, h: torch.Tensor) -> torch.Tensor:
    """lm_head over the final normed rows -> bf16 logits: its packed copy where pack_head made one (each row on its
    own, at any row count), else F.linear."""
    if model.head_packed is not None:
        return ops.linear(h, model.head_packed)[0]
    return linear_rows(h, model.lm_head)


def held(obj, *names) -> list:
    """Fields of a weights dataclass as pack_stack packs them: NVFP4 parts as stored where obj.stored has them
    (reader.Linear), else the dense tensors."""
    st = getattr(obj, "stored", None) or {}
    return [st.get(n, getattr(obj, n)) for n in names]


def holds_stored(device) -> bool:
    """Whether a device holds NVFP4 stack weights as stored (their packed copy alone): a GPU with the extension."""
    return stack_kernel_enabled(device)


def release_stored(obj, names, device) -> None:
    """After pack_stack packed fields `names` of obj onto `device`: where the device holds them as stored, the dense
    weights of those with NVFP4 parts (obj.stored) are dropped (None; an MLP's pair (None, None), so that the field
    still says the layer has one): the packed copy is what every step reads, and larger steps dequantise it."""
    st = getattr(obj, "stored", None) or {}
    if not holds_stored(device):
        return
    for n in names:
        if n in st:
            setattr(obj, n, (None, None) if isinstance(getattr(obj, n), tuple) else None)


def stored_dense(parts, device, dtype=torch.bfloat16):
    """A released field's dense weights again from its NVFP4 parts (load_linear / load_swiglu's, bit for bit): an
    MLP's (gate, up, down) tuple, a list of linears stored as one fused weight (GLM-5.3-Flash's KDA q | k | v), or
    one linear's."""
    if isinstance(parts, tuple):
        gate, up, down = parts
        return torch.cat((gate.dense(dtype), up.dense(dtype)), 0).to(device), down.dense(dtype).to(device)
    if isinstance(parts, list):
        return torch.cat([p.dense(dtype) for p in parts], 0).to(device)
    return parts.dense(dtype).to(device)


def stored_nbytes(model) -> int:
    """Bytes of the stack weights a model holds as stored: its NVFP4 packed copies on a device that holds them so
    (their dense fields are released, so nbytes counts these instead)."""
    copies = packed_copies(model)
    if not copies:  # loaded for such a device (loading_for), not packed yet: the parts of the empty fields
        return sum(_parts_nbytes(parts) for obj in _stored_owners(model)
                   for key, parts in obj.stored.items() if _released(getattr(obj, key, 0)))
    total = 0
    for obj, f in copies:
        v = getattr(obj, f)
        for item in (v.values() if isinstance(v, dict) else [v]):
            for p in (item if isinstance(item, list) else [item]):
                nv = isinstance(p, ops.PackedLinear) and p.nvfp4 or isinstance(p, ops.PackedExperts) and not p.bf16
                if nv and holds_stored(p.w.device if isinstance(p, ops.PackedLinear) else p.device):
                    total += p.nbytes
    return total


def _released(v) -> bool:
    return v is None or (isinstance(v, tuple) and len(v) > 0 and v[0] is None)


def _parts_nbytes(parts) -> int:
    """Bytes of NVFP4 parts held as stored (codes and block scales): a Linear's, an MLP's three, a fused list's."""
    if isinstance(parts, (tuple, list)):
        return sum(_parts_nbytes(p) for p in parts)
    return parts.weight.numel() * parts.weight.element_size() + parts.weight_scale.numel()


def _stored_owners(model) -> list:
    """Every object of a model that holds NVFP4 parts as stored (a `stored` dict): the model (its lm_head), each
    layer (its MLPs), and the layers' attention, KDA, MLA and indexer weights."""
    out = [model]
    for L in model.layers:
        parts = [L] + [getattr(L, n, None) for n in ("attn", "kda", "mla")]
        out += parts + [getattr(p, "indexer", None) for p in parts[1:] if p is not None]
    return [o for o in out if getattr(o, "stored", None)]


def stack_kernel_enabled(device) -> bool:
    """The replicated stack's linears run in the expert kernel's BF16 tiles (ops/stack.py) on a GPU with the
    extension built."""
    return ops.on_gpu(device)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, y: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and the factor on cos / sin, computed as transformers' _compute_yarn_parameters does (the
    same fp32 ops in the same order, so the same bits). y: config/glm_moe_dsa._yarn's settings."""
    orig = y["original_max_position_embeddings"]
    factor = y["factor"] if y["factor"] is not None else max_positions / orig
    att = y["attention_factor"]
    if att is None:
        m, m_all = y["mscale"], y["mscale_all_dim"]
        att = float(yarn_mscale(factor, m) / yarn_mscale(factor, m_all)) if m and m_all else yarn_mscale(factor)
    fast, slow = y["beta_fast"] or 32, y["beta_slow"] or 1

    def corr(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr(fast), corr(slow)
    if y["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, att


class Rope:
    """Partial rotary embedding on the first `rotary_dim` channels of each head (rotate-half form). yarn (DeepSeek-V3's
    rope: config/glm_moe_dsa._yarn's settings): YaRN's frequencies, cos and sin times its attention factor."""

    def __init__(self, rotary_dim: int, theta: float, dtype: torch.dtype, yarn: dict | None = None,
                 max_positions: int = 0):
        self.dim = rotary_dim
        self.dtype = dtype
        self.attention = 1.0
        if yarn is None:
            self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        else:
            self.inv_freq, self.attention = yarn_inv_freq(rotary_dim, theta, yarn, max_positions)
        self._tables: dict[tuple[int, str], torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq  # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention != 1.0:
            cos, sin = cos * self.attention, sin * self.attention
        return cos.to(self.dtype), sin.to(self.dtype)

    def table(self, n: int, device) -> torch.Tensor:
        """cos_sin of positions 0..n-1 as one [2, n, rotary_dim] tensor, made once per (n, device) and kept (a
        captured step reads it by address for as long as it lives): the fixed-shape GPU step gathers its rows (one
        kernel, `table[:, pos]`) instead of the six of cos_sin. The same elementwise ops on the same device, so the
        same bits per position (tests/test_step_kernels.py checks it on the GPU; on a CPU the vectorised and scalar
        paths of cos may differ in the last bit, so the CPU step keeps cos_sin)."""
        key = (n, str(device))
        if key not in self._tables:
            self._tables[key] = torch.stack(self.cos_sin(torch.arange(n, device=device)))
        return self._tables[key]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]; cos/sin [T, rotary_dim]."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        rot, rest = x[..., : self.dim], x[..., self.dim:]
        half = self.dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def host_parts(li):
    """An NVFP4 reader.Linear's parts in host memory (a synthetic reader draws them on the device); its bias stays
    with the dense field."""
    return dataclasses.replace(li, weight=li.weight.cpu(), weight_scale=li.weight_scale.cpu(),
                               weight_scale_2=li.weight_scale_2.cpu(), bias=None)


_STORED_ONLY = contextvars.ContextVar("rocket_mpi_stored_only", default=False)


@contextlib.contextmanager
def loading_for(device):
    """Around a model's load for `device`: where the device holds NVFP4 weights as stored (holds_stored), the
    linears whose packed copy is all it will keep (load_linear / load_swiglu with lazy=True, shapes of whole tiles of
    16) are never dequantised: their dense field stays empty (None; an MLP's (None, None)) as pack_stack would leave
    it, and no BF16 copy is made on the host or moved to the device (an lm_head's would be vocab x hidden x 2 bytes)."""
    token = _STORED_ONLY.set(holds_stored(device))
    try:
        yield
    finally:
        _STORED_ONLY.reset(token)


def _skip_dense(lazy: bool, *shapes: tuple[int, int]) -> bool:
    return lazy and _STORED_ONLY.get() and all(n % TILE_N == 0 and k % TILE_N == 0 for n, k in shapes)


def load_linear(reader, name: str, n: int, k: int, bias: bool = False, stored: dict | None = None,
                key: str | None = None, dtype=torch.bfloat16, lazy: bool = False):
    """A Linear at `name` as (weight [n, k], bias), BF16 or NVFP4 dequantised; an NVFP4 one's parts also go into
    `stored[key]` where given (the module docstring). lazy: the field is released wherever the device holds it as
    stored, so under loading_for such a device its weight is None (not dequantised)."""
    li = reader.linear(name, n, k, bias)
    if li.nvfp4 and stored is not None:
        stored[key] = host_parts(li)
        if _skip_dense(lazy, (n, k)):
            return None, li.bias
    return li.dense(dtype), li.bias


def load_swiglu(reader, prefix: str, hidden: int, inter: int, dtype=torch.bfloat16, stored: dict | None = None,
                key: str | None = None, lazy: bool = False):
    """A SwiGLU MLP at `prefix` as (gate_up [2I, H], down [H, I]), BF16 or NVFP4 dequantised; where all three are
    NVFP4, their parts also go into `stored[key]` as (gate, up, down) where given (lazy: as load_linear's, then
    (None, None))."""
    lis = [reader.linear(prefix + ".gate_proj", inter, hidden), reader.linear(prefix + ".up_proj", inter, hidden),
           reader.linear(prefix + ".down_proj", hidden, inter)]
    if stored is not None and all(li.nvfp4 for li in lis):
        stored[key] = tuple(host_parts(li) for li in lis)
        if _skip_dense(lazy, (inter, hidden), (hidden, inter)):
            return None, None
    gate, up, down = (li.dense(dtype) for li in lis)
    return torch.cat((gate, up), 0), down


def unique_nbytes(tensors) -> int:
    """Bytes of the distinct tensors among `tensors` (None skipped; a tied weight counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def load_ffn(reader, prefix: str, layer: int, cfg, mlp, stored: dict | None = None) -> dict:
    """The MLP half of layer `layer` at `prefix` (model.layers.L): a dense SwiGLU, or the MoE block's
    router (fp32 weight and correction bias) and shared expert. `mlp(prefix, inter, stored, key)` loads a SwiGLU
    (load_swiglu); `stored`: the layer's dict of NVFP4 parts."""
    if not cfg.is_moe_layer(layer):
        return {"mlp": mlp(prefix + ".mlp", cfg.intermediate_size, stored, "mlp")}
    e, h = cfg.n_routed_experts, cfg.hidden_size
    return {"router_w": reader.get_float(prefix + ".mlp.gate.weight", (e, h), torch.float32),
            "router_b": reader.get(prefix + ".mlp.gate.e_score_correction_bias", (e,),
                                   (torch.float32, torch.bfloat16), finite=True).float(),
            "shared": mlp(prefix + ".mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts, stored,
                          "shared")}


def load_embed_head(reader, cfg, dtype=torch.bfloat16, stored: dict | None = None):
    """(embed [V, H], lm_head [V, H]); a tied head without its own tensor is the embedding itself. An NVFP4 head's
    parts also go into stored["lm_head"] where given."""
    embed = reader.get_float("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), dtype)
    if cfg.tie_word_embeddings and "lm_head.weight" not in reader:
        return embed, embed
    return embed, load_linear(reader, "lm_head", cfg.vocab_size, cfg.hidden_size, stored=stored, key="lm_head",
                              dtype=dtype, lazy=True)[0]


def move_weights(obj, device) -> None:
    """Every tensor of a weights dataclass (nested dataclasses and tuples of tensors too) to `device`, in place; a
    field released by pack_stack (held as stored) gets its dense weights back from obj.stored (pack_stack on
    `device` releases it again where that device holds it as stored). The NVFP4 parts stay in host memory."""
    st = getattr(obj, "stored", None) or {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.name in st and _released(v):
            if not holds_stored(device):  # where it does, pack_stack packs the parts and the field stays empty
                setattr(obj, f.name, stored_dense(st[f.name], device))
        elif isinstance(v, torch.Tensor):
            setattr(obj, f.name, v.to(device))
        elif isinstance(v, tuple):
            setattr(obj, f.name, tuple(t.to(device) for t in v))
        elif dataclasses.is_dataclass(v):
            move_weights(v, device)


PACKED_FIELDS = ("packed", "mlp_packed", "shared_packed", "o_packed", "qkv")  # glm4_moe's qkv: its packed q/k/v


def packed_copies(model) -> list[tuple[object, str]]:
    """(owner, field) of every packed stack copy a model holds (pack_stack): its lm_head's (glm4_moe's head_packed)
    and those in its layers' dataclasses."""
    out = [(model, "head_packed")] if getattr(model, "head_packed", None) is not None else []
    for L in model.layers:
        for obj in (L, getattr(L, "attn", None), getattr(L, "kda", None), getattr(L, "mla", None)):
            for f in PACKED_FIELDS:
                v = getattr(obj, f, None) if obj is not None else None
                if v is not None and not isinstance(v, torch.Tensor):   # GLM-5.3-Flash's KDA.qkv is a weight
                    out.append((obj, f))
    return out


def move_stack(model, device) -> None:
    """A model's replicated stack to `device` in place: embedding, final norm, lm_head (kept tied to the
    embedding where it is), every layer's weights, and the rotary table where the model has one. Packed copies
    (pack_stack) are dropped: they belong to the device they were packed on, and the model's `to` packs again
    where its device takes them."""
    for obj, f in packed_copies(model):
        setattr(obj, f, None)
    tied = model.lm_head is model.embed
    model.embed, model.norm = model.embed.to(device), model.norm.to(device)
    head = model.lm_head
    if head is None and not holds_stored(device):  # released by pack_stack (held as stored), or never dequantised
        head = stored_dense(model.stored["lm_head"], device)
    model.lm_head = model.embed if tied else None if head is None else head.to(device)
    for L in model.layers:
        move_weights(L, device)
    rope = getattr(model, "rope", None)
    if rope is not None:
        rope.inv_freq = rope.inv_freq.to(device)


class StackModel:
    """What the three families' models share: `to`. A subclass has embed, norm, lm_head, layers and stored (and
    rope where it has one), and a pack_stack() that copies its linears into the expert kernel's tiles."""

    def to(self, device):
        """Move every weight to `device` (one rank per GPU: the replicated stack lives on its GPU); on a GPU with
        the extension, the stack's linears also get a copy in the expert kernel's tiles (pack_stack: BF16, or NVFP4
        held as stored)."""
        move_stack(self, device)
        if stack_kernel_enabled(device):
            self.pack_stack()
        return self
