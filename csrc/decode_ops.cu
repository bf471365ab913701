// Small fused ops of the fixed-shape decode step (rocket_mpi/graph.py): each replaces a chain of torch
// kernels with one launch, which is what a CUDA-graphed step of M tokens is made of.
//
//   rms_norm   x [rows, n] bf16, w [n] -> bf16: fp32 sum of squares, x * rsqrt(mean + eps) rounded to
//              bf16, times w rounded to bf16 (transformers' order; the sum's order is the kernel's own)
//   rope       q [T, hq, d], k [T, hk, d] in place, rotate-half on the first `rot` channels with the
//              step's cos/sin [T, rot] (bf16): out = bf16(bf16(x * cos) + bf16(rotated * sin)), exactly
//              torch's bf16 ops on the same inputs
//   rope_interleaved  GLM-5's rotary form (glm_moe_dsa.rope_interleaved): rows x [T, H, r] (a view whose rows
//              sit one stride apart) -> out [T, H, r] with pairs (x[2j], x[2j+1]) turned by cos/sin[t, j] and laid
//              out de-interleaved (evens, then odds), bf16(bf16(x1 c) - bf16(x2 s)) | bf16(bf16(x2 c) + bf16(x1 s)):
//              torch's bf16 ops on the same inputs, one launch instead of ~8
//   kv_append  k/v [M, hkv, d] into the caches [M, hkv, cap, d] at each stream's position pos[M]
//   rope_kv    rope and kv_append in one launch: q rotated in place, k rotated (in place and into its cache), v
//              into its cache; the same bits as the two. cos / sin are the step's rows, or a table (Rope.table)
//              read at each stream's position (no gather launch)
//   argmax     the step's next tokens from the lm_head's bf16 logits, torch.argmax's choice, and pos += 1
//   decode_softmax  attention probabilities of one query per stream: scores [M, hq, span] bf16 -> bf16(softmax(
//              bf16(score * scale) with keys past pos[m] hidden)), fp32 max / sum / division as torch's softmax
//              of the masked scores (the sums' order is the kernel's); a hidden key's probability is exactly 0
// (The rows' checksum is summed by moe_scatter_add as it reads them: scatter.cu.)
#include "norm.cuh"

namespace rocket {
namespace {

using dev::kNormThreads;
using dev::kNormVecs;

// One block per row (norm.cuh). With `index` (kGather): row b is x[index[b]] (the embedding's rows for the step's
// tokens; an id outside [0, x_rows) reads as zeros) and is also written to x_out[b], so the gather and the first
// norm of the step are one launch; the same bits as x[index] then the norm.
template <bool kVec, bool kGather>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const __nv_bfloat16* __restrict__ x,
                                                                const __nv_bfloat16* __restrict__ w,
                                                                __nv_bfloat16* __restrict__ out, int n, float eps,
                                                                const int64_t* __restrict__ index, int64_t x_rows,
                                                                __nv_bfloat16* __restrict__ x_out) {
  dev::launch_dependents();  // the next linear's row prep (a programmatic dependent) may start: it waits for this grid
  __shared__ float red[32];
  int64_t src = blockIdx.x;
  bool valid = true;
  if constexpr (kGather) {
    src = index[blockIdx.x];
    valid = src >= 0 && src < x_rows;
    if (!valid) src = 0;
  }
  const __nv_bfloat16* xr = x + src * n;
  __nv_bfloat16* o = out + int64_t(blockIdx.x) * n;
  float ss = 0.0f;
  if constexpr (kVec) {
    uint4 v[kNormVecs];
#pragma unroll
    for (int i = 0; i < kNormVecs; ++i) {
      const int c = (i * kNormThreads + threadIdx.x) * 8;
      v[i] = c < n && valid ? __ldg(reinterpret_cast<const uint4*>(xr + c)) : make_uint4(0, 0, 0, 0);
      if constexpr (kGather) {
        if (c < n) *reinterpret_cast<uint4*>(x_out + int64_t(blockIdx.x) * n + c) = v[i];
      }
      dev::sum_squares8(v[i], ss);
    }
    const float r = dev::norm_scale(dev::block_sum(ss, red), n, eps);
#pragma unroll
    for (int i = 0; i < kNormVecs; ++i) {
      const int c = (i * kNormThreads + threadIdx.x) * 8;
      if (c >= n) break;
      const uint4 wv = __ldg(reinterpret_cast<const uint4*>(w + c));
      *reinterpret_cast<uint4*>(o + c) = dev::norm8(v[i], wv, r);
    }
  } else {
    const __nv_bfloat16 zero = __float2bfloat16_rn(0.0f);
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
      const __nv_bfloat16 xv = valid ? xr[c] : zero;
      if constexpr (kGather) x_out[int64_t(blockIdx.x) * n + c] = xv;
      const float v = __bfloat162float(xv);
      ss = __fmaf_rn(v, v, ss);
    }
    const float r = dev::norm_scale(dev::block_sum(ss, red), n, eps);
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
      const float y = dev::round_bf16(__fmul_rn(__bfloat162float(valid ? xr[c] : zero), r));
      o[c] = __float2bfloat16_rn(__fmul_rn(__bfloat162float(w[c]), y));
    }
  }
}

__global__ void rope_kernel(__nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ k,
                            const __nv_bfloat16* __restrict__ cos, const __nv_bfloat16* __restrict__ sin, int tokens,
                            int hq, int hk, int d, int rot) {
  const int half = rot / 2;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int heads = hq + hk;
  if (idx >= int64_t(tokens) * heads * half) return;
  const int j = int(idx % half);
  const int h = int((idx / half) % heads);
  const int t = int(idx / (int64_t(half) * heads));
  __nv_bfloat16* base = h < hq ? q + (int64_t(t) * hq + h) * d : k + (int64_t(t) * hk + (h - hq)) * d;
  const float x1 = __bfloat162float(base[j]), x2 = __bfloat162float(base[j + half]);
  const float c1 = __bfloat162float(cos[int64_t(t) * rot + j]), s1 = __bfloat162float(sin[int64_t(t) * rot + j]);
  const float c2 = __bfloat162float(cos[int64_t(t) * rot + j + half]);
  const float s2 = __bfloat162float(sin[int64_t(t) * rot + j + half]);
  base[j] = __float2bfloat16_rn(__fadd_rn(dev::round_bf16(__fmul_rn(x1, c1)), dev::round_bf16(__fmul_rn(-x2, s1))));
  base[j + half] =
      __float2bfloat16_rn(__fadd_rn(dev::round_bf16(__fmul_rn(x2, c2)), dev::round_bf16(__fmul_rn(x1, s2))));
}

// One thread per (row, pair j < r / 2); a row is one head of one token, `stride` elements after the previous.
__global__ void rope_interleaved_kernel(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ out,
                                        const __nv_bfloat16* __restrict__ cos, const __nv_bfloat16* __restrict__ sin,
                                        int64_t rows, int heads, int r, int64_t stride) {
  const int half = r / 2;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * half) return;
  const int j = int(idx % half);
  const int64_t row = idx / half, t = row / heads;
  const float x1 = __bfloat162float(x[row * stride + 2 * j]), x2 = __bfloat162float(x[row * stride + 2 * j + 1]);
  const float c = __bfloat162float(cos[t * r + j]), s = __bfloat162float(sin[t * r + j]);
  out[row * r + j] = __float2bfloat16_rn(__fsub_rn(dev::round_bf16(__fmul_rn(x1, c)), dev::round_bf16(__fmul_rn(x2, s))));
  out[row * r + half + j] =
      __float2bfloat16_rn(__fadd_rn(dev::round_bf16(__fmul_rn(x2, c)), dev::round_bf16(__fmul_rn(x1, s))));
}

__global__ void kv_append_kernel(__nv_bfloat16* __restrict__ kc, __nv_bfloat16* __restrict__ vc,
                                 const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                                 const int64_t* __restrict__ pos, int streams, int hkv, int cap, int d) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(streams) * hkv * d) return;
  const int c = int(idx % d);
  const int h = int((idx / d) % hkv);
  const int s = int(idx / (int64_t(d) * hkv));
  const int64_t p = pos[s];
  if (p < 0 || p >= cap) return;  // the caller sized the cache; never write past it
  const int64_t dst = ((int64_t(s) * hkv + h) * cap + p) * d + c;
  kc[dst] = k[idx];
  vc[dst] = v[idx];
}

// One thread per (token, head of q | k | v, channel pair j < d / 2). Rotary pairs (j, j + rot / 2) for j < rot / 2
// (q and k), the other channels copied two at a time (k past rot, all of v).
__global__ void rope_kv_kernel(__nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ k,
                               const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ cos,
                               const __nv_bfloat16* __restrict__ sin, __nv_bfloat16* __restrict__ kc,
                               __nv_bfloat16* __restrict__ vc, const int64_t* __restrict__ pos, int tokens, int hq,
                               int hk, int d, int rot, int cap, int table_rows) {
  const int half = rot / 2, pairs = d / 2, heads = hq + 2 * hk;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(tokens) * heads * pairs) return;
  const int j = int(idx % pairs);
  const int h = int((idx / pairs) % heads);
  const int t = int(idx / (int64_t(pairs) * heads));
  const int64_t p = pos[t];
  const bool store = p >= 0 && p < cap;  // the caller sized the cache; never write past it
  if (h >= hq + hk) {  // v: channels 2j, 2j + 1 into the cache
    const int hv = h - hq - hk;
    if (store) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(v + (int64_t(t) * hk + hv) * d + 2 * j);
      *reinterpret_cast<uint32_t*>(vc + ((int64_t(t) * hk + hv) * cap + p) * d + 2 * j) = w;
    }
    return;
  }
  const bool is_k = h >= hq;
  __nv_bfloat16* base = is_k ? k + (int64_t(t) * hk + (h - hq)) * d : q + (int64_t(t) * hq + h) * d;
  __nv_bfloat16* cache = is_k && store ? kc + ((int64_t(t) * hk + (h - hq)) * cap + p) * d : nullptr;
  if (j < half) {  // as rope_kernel
    // cos / sin: row t, or with a table (table_rows > 0) the table's row of this token's position (clamped: a
    // position past the table writes no cache and its q is never used)
    const int64_t cr = table_rows > 0 ? (p < 0 ? 0 : (p >= table_rows ? table_rows - 1 : p)) : t;
    const float x1 = __bfloat162float(base[j]), x2 = __bfloat162float(base[j + half]);
    const float c1 = __bfloat162float(cos[cr * rot + j]), s1 = __bfloat162float(sin[cr * rot + j]);
    const float c2 = __bfloat162float(cos[cr * rot + j + half]);
    const float s2 = __bfloat162float(sin[cr * rot + j + half]);
    const __nv_bfloat16 y1 =
        __float2bfloat16_rn(__fadd_rn(dev::round_bf16(__fmul_rn(x1, c1)), dev::round_bf16(__fmul_rn(-x2, s1))));
    const __nv_bfloat16 y2 =
        __float2bfloat16_rn(__fadd_rn(dev::round_bf16(__fmul_rn(x2, c2)), dev::round_bf16(__fmul_rn(x1, s2))));
    base[j] = y1;
    base[j + half] = y2;
    if (cache != nullptr) {
      cache[j] = y1;
      cache[j + half] = y2;
    }
  } else if (cache != nullptr) {  // k's channels past the rotary ones: rot + 2 (j - half), + 1
    const int c = rot + 2 * (j - half);
    cache[c] = base[c];
    cache[c + 1] = base[c + 1];
  }
}

// One warp per (stream, head) row of span scores.
constexpr int kSoftmaxWarps = 8;
__global__ void __launch_bounds__(kSoftmaxWarps * 32) decode_softmax_kernel(const __nv_bfloat16* __restrict__ scores,
                                                                            const int64_t* __restrict__ pos, int rows,
                                                                            int heads, int span, float scale,
                                                                            __nv_bfloat16* __restrict__ probs) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kSoftmaxWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  const __nv_bfloat16* s = scores + int64_t(row) * span;
  __nv_bfloat16* o = probs + int64_t(row) * span;
  const int64_t p = pos[row / heads];
  const int seen = int(p < 0 ? 0 : (p >= span ? span : p + 1));  // keys 0..pos
  auto scaled = [&](int j) { return dev::round_bf16(__fmul_rn(__bfloat162float(s[j]), scale)); };
  float mx = -INFINITY;
  for (int j = lane; j < seen; j += 32) mx = fmaxf(mx, scaled(j));
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  float sum = 0.0f;
  for (int j = lane; j < seen; j += 32) sum = __fadd_rn(sum, expf(__fsub_rn(scaled(j), mx)));
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, d));
  for (int j = lane; j < span; j += 32)
    o[j] = j < seen ? __float2bfloat16_rn(__fdiv_rn(expf(__fsub_rn(scaled(j), mx)), sum)) : __float2bfloat16_rn(0.0f);
}

// torch.argmax's order on (value, index): a NaN beats every number (the first NaN wins), equal values go to the
// lower index (-0 == +0). A total order, so any reduction tree picks the same element.
__device__ __forceinline__ bool argmax_before(float a, int ia, float b, int ib) {
  if (isnan(a)) return isnan(b) ? ia < ib : true;
  if (isnan(b)) return false;
  return a == b ? ia < ib : a > b;
}

__device__ __forceinline__ void argmax_warp(float& v, int& i) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, d);
    const int oi = __shfl_xor_sync(0xffffffffu, i, d);
    if (argmax_before(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxU = 4;
constexpr int kArgmaxNone = 0x7fffffff;  // an empty candidate: (-inf, kNone) loses to every element

// The block's best of its candidates (every thread gets it).
__device__ __forceinline__ void argmax_block(float& v, int& i, float* sv, int* si) {
  argmax_warp(v, i);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
  }
  __syncthreads();
  v = lane < kArgmaxThreads / 32 ? sv[lane] : -INFINITY;
  i = lane < kArgmaxThreads / 32 ? si[lane] : kArgmaxNone;
  argmax_warp(v, i);
  __syncthreads();
}

// grid (chunks, rows): block (c, r) takes chunk c of row r's logits and writes its best to part[r][c]; the block
// that finishes last (a ticket, atomicInc wrapping to 0 for the next call) reduces each row's chunks, writes the
// token and advances the row's position. One launch instead of torch's reduction, the token copy and pos += 1.
__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const __nv_bfloat16* __restrict__ logits, int vocab,
                                                                int chunk, bool vec, float* __restrict__ part_v,
                                                                int* __restrict__ part_i, unsigned* __restrict__ ticket,
                                                                int64_t* __restrict__ tokens,
                                                                int64_t* __restrict__ pos) {
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ bool last;
  const int row = blockIdx.y, chunks = gridDim.x;
  const __nv_bfloat16* l = logits + int64_t(row) * vocab;
  const int lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
  float v = -INFINITY;
  int idx = kArgmaxNone;
  auto take = [&](float x, int j) {
    if (argmax_before(x, j, v, idx)) {
      v = x;
      idx = j;
    }
  };
  if (vec) {  // 8 logits per 16-byte load, kArgmaxU loads in flight per thread (chunk: a multiple of 8 x threads)
    constexpr int kStep = 8 * kArgmaxThreads;
    for (int j0 = lo + 8 * int(threadIdx.x); j0 < hi; j0 += kArgmaxU * kStep) {
      uint4 w[kArgmaxU];
#pragma unroll
      for (int u = 0; u < kArgmaxU; ++u)
        w[u] = j0 + u * kStep < hi ? __ldg(reinterpret_cast<const uint4*>(l + j0 + u * kStep)) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < kArgmaxU; ++u) {
        if (j0 + u * kStep >= hi) break;
        const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&w[u]);
#pragma unroll
        for (int q = 0; q < 8; ++q) take(__bfloat162float(e[q]), j0 + u * kStep + q);
      }
    }
  } else {
    for (int j = lo + int(threadIdx.x); j < hi; j += kArgmaxThreads) take(__bfloat162float(l[j]), j);
  }
  argmax_block(v, idx, sv, si);
  if (threadIdx.x == 0) {
    part_v[row * chunks + blockIdx.x] = v;
    part_i[row * chunks + blockIdx.x] = idx;
    __threadfence();  // the partial is visible device-wide before the ticket
    last = atomicInc(ticket, gridDim.x * gridDim.y - 1) == gridDim.x * gridDim.y - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  // one warp per row (rows in turn over the block's warps): its chunks' partials over the lanes, then a butterfly
  const int lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < int(gridDim.y); r += kArgmaxThreads / 32) {
    float bv = -INFINITY;
    int bi = kArgmaxNone;
    for (int c = lane; c < chunks; c += 32) {
      const float cv = __ldcg(part_v + r * chunks + c);
      const int ci = __ldcg(part_i + r * chunks + c);
      if (argmax_before(cv, ci, bv, bi)) {
        bv = cv;
        bi = ci;
      }
    }
    argmax_warp(bv, bi);
    if (lane == 0) {
      tokens[r] = bi == kArgmaxNone ? 0 : bi;
      if (pos != nullptr) pos[r] += 1;
    }
  }
}

}  // namespace

void launch_rope_kv(void* q, void* k, const void* v, const void* cos, const void* sin, void* kc, void* vc,
                    const int64_t* pos, int tokens, int hq, int hk, int d, int rot, int cap, cudaStream_t stream,
                    int table_rows) {
  ROCKET_CHECK(rot > 0 && rot % 2 == 0 && rot <= d && d % 2 == 0, "rope_kv: rotary dim " << rot << " of head dim " << d);
  const int64_t n = int64_t(tokens) * (hq + 2 * hk) * (d / 2);
  if (n == 0) return;
  rope_kv_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(
      static_cast<__nv_bfloat16*>(q), static_cast<__nv_bfloat16*>(k), static_cast<const __nv_bfloat16*>(v),
      static_cast<const __nv_bfloat16*>(cos), static_cast<const __nv_bfloat16*>(sin), static_cast<__nv_bfloat16*>(kc),
      static_cast<__nv_bfloat16*>(vc), pos, tokens, hq, hk, d, rot, cap, table_rows);
  ROCKET_LAUNCH_CHECK();
}

void launch_decode_softmax(const void* scores, const int64_t* pos, int streams, int heads, int span, float scale,
                           void* probs, cudaStream_t stream) {
  const int rows = streams * heads;
  ROCKET_CHECK(streams >= 0 && heads > 0 && span > 0, "decode_softmax: " << streams << " streams, " << heads
               << " heads, span " << span);
  if (rows == 0) return;
  decode_softmax_kernel<<<unsigned((rows + kSoftmaxWarps - 1) / kSoftmaxWarps), kSoftmaxWarps * 32, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(scores), pos, rows, heads, span, scale, static_cast<__nv_bfloat16*>(probs));
  ROCKET_LAUNCH_CHECK();
}

void launch_rms_norm(const void* x, const void* w, void* out, int64_t rows, int n, float eps, cudaStream_t stream,
                     const int64_t* index, int64_t x_rows, void* x_out) {
  ROCKET_CHECK(rows >= 0 && rows < (int64_t(1) << 31) && n > 0, "rms_norm: rows " << rows << ", n " << n);
  ROCKET_CHECK((index == nullptr) == (x_out == nullptr), "rms_norm: index and x_out go together");
  if (rows == 0) return;
  const auto* xp = static_cast<const __nv_bfloat16*>(x);
  const auto* wp = static_cast<const __nv_bfloat16*>(w);
  auto* op = static_cast<__nv_bfloat16*>(out);
  auto* xo = static_cast<__nv_bfloat16*>(x_out);
  const bool vec = dev::norm_vec_ok(n, x, w, out) && reinterpret_cast<uintptr_t>(x_out) % 16 == 0;
  const unsigned grid = unsigned(rows);
  if (index != nullptr) {
    if (vec) rms_norm_kernel<true, true><<<grid, kNormThreads, 0, stream>>>(xp, wp, op, n, eps, index, x_rows, xo);
    else rms_norm_kernel<false, true><<<grid, kNormThreads, 0, stream>>>(xp, wp, op, n, eps, index, x_rows, xo);
  } else {
    if (vec) rms_norm_kernel<true, false><<<grid, kNormThreads, 0, stream>>>(xp, wp, op, n, eps, nullptr, 0, nullptr);
    else rms_norm_kernel<false, false><<<grid, kNormThreads, 0, stream>>>(xp, wp, op, n, eps, nullptr, 0, nullptr);
  }
  ROCKET_LAUNCH_CHECK();
}

void launch_rope(void* q, void* k, const void* cos, const void* sin, int tokens, int hq, int hk, int d, int rot,
                 cudaStream_t stream) {
  ROCKET_CHECK(rot > 0 && rot % 2 == 0 && rot <= d, "rope: rotary dim " << rot << " of head dim " << d);
  const int64_t n = int64_t(tokens) * (hq + hk) * (rot / 2);
  if (n == 0) return;
  rope_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(
      static_cast<__nv_bfloat16*>(q), static_cast<__nv_bfloat16*>(k), static_cast<const __nv_bfloat16*>(cos),
      static_cast<const __nv_bfloat16*>(sin), tokens, hq, hk, d, rot);
  ROCKET_LAUNCH_CHECK();
}

void launch_rope_interleaved(const void* x, void* out, const void* cos, const void* sin, int64_t rows, int heads, int r,
                             int64_t stride, cudaStream_t stream) {
  ROCKET_CHECK(r > 0 && r % 2 == 0 && heads > 0 && stride >= r, "rope_interleaved: rotary dim " << r << ", "
               << heads << " heads, row stride " << stride);
  const int64_t n = rows * (r / 2);
  if (n == 0) return;
  rope_interleaved_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(out), static_cast<const __nv_bfloat16*>(cos),
      static_cast<const __nv_bfloat16*>(sin), rows, heads, r, stride);
  ROCKET_LAUNCH_CHECK();
}

void launch_kv_append(void* kc, void* vc, const void* k, const void* v, const int64_t* pos, int streams, int hkv,
                      int cap, int d, cudaStream_t stream) {
  const int64_t n = int64_t(streams) * hkv * d;
  if (n == 0) return;
  kv_append_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(
      static_cast<__nv_bfloat16*>(kc), static_cast<__nv_bfloat16*>(vc), static_cast<const __nv_bfloat16*>(k),
      static_cast<const __nv_bfloat16*>(v), pos, streams, hkv, cap, d);
  ROCKET_LAUNCH_CHECK();
}

void launch_argmax(const void* logits, int rows, int vocab, float* part_v, int* part_i, int chunks,
                   unsigned* ticket, int64_t* tokens, int64_t* pos, cudaStream_t stream) {
  ROCKET_CHECK(rows > 0 && rows <= 65535 && vocab > 0 && chunks > 0 && int64_t(chunks) * rows < (int64_t(1) << 31),
               "argmax: " << rows << " rows of " << vocab << ", " << chunks << " chunks");
  // 16-byte loads where every row starts aligned; then each block's chunk is a multiple of 8 x threads (blocks
  // past the end find nothing and lose the reduction)
  const bool vec = vocab % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  int chunk = (vocab + chunks - 1) / chunks;
  if (vec) chunk = (chunk + 8 * kArgmaxThreads - 1) / (8 * kArgmaxThreads) * (8 * kArgmaxThreads);
  argmax_kernel<<<dim3(unsigned(chunks), unsigned(rows)), kArgmaxThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(logits), vocab, chunk, vec, part_v, part_i, ticket, tokens, pos);
  ROCKET_LAUNCH_CHECK();
}

// Blocks per row of launch_argmax: about two waves of 132 SMs in all, chunks of at least 2048 logits.
int argmax_chunks(int rows, int vocab) {
  const int want = (264 + rows - 1) / rows, most = (vocab + 2047) / 2048;
  return want < most ? (want > 0 ? want : 1) : (most > 0 ? most : 1);
}

}  // namespace rocket
