// Small fused ops of the fixed-shape decode step (rocket_mpi/graph.py): each replaces a chain of torch
// kernels with one launch, which is what a CUDA-graphed step of M tokens is made of.
//
//   rms_norm   x [rows, n] bf16, w [n] -> bf16: fp32 sum of squares, x * rsqrt(mean + eps) rounded to
//              bf16, times w rounded to bf16 (transformers' order; the sum's order is the kernel's own)
//   rope       q [T, hq, d], k [T, hk, d] in place, rotate-half on the first `rot` channels with the
//              step's cos/sin [T, rot] (bf16): out = bf16(bf16(x * cos) + bf16(rotated * sin)), exactly
//              torch's bf16 ops on the same inputs
//   kv_append  k/v [M, hkv, d] into the caches [M, hkv, cap, d] at each stream's position pos[M]
//   rope_kv    rope and kv_append in one launch: q rotated in place, k rotated (in place and into its cache), v
//              into its cache; the same bits as the two
//   decode_softmax  attention probabilities of one query per stream: scores [M, hq, span] bf16 -> bf16(softmax(
//              bf16(score * scale) with keys past pos[m] hidden)), fp32 max / sum / division as torch's softmax
//              of the masked scores (the sums' order is the kernel's); a hidden key's probability is exactly 0
// (The rows' checksum is summed by moe_scatter_add as it reads them: scatter.cu.)
#include "common.cuh"

namespace rocket {
namespace {

constexpr int kNormThreads = 256;

__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < warps; ++w) t += red[w];  // every thread, same order
  __syncthreads();
  return t;
}

// One block per row. Rows of up to kNormThreads * 8 * kNormVecs elements (n % 8 == 0) stay in registers
// between the two passes, 16-byte loads; other shapes take the scalar loop.
constexpr int kNormVecs = 4;

template <bool kVec>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const __nv_bfloat16* __restrict__ x,
                                                                const __nv_bfloat16* __restrict__ w,
                                                                __nv_bfloat16* __restrict__ out, int n, float eps) {
  __shared__ float red[32];
  const __nv_bfloat16* xr = x + int64_t(blockIdx.x) * n;
  __nv_bfloat16* o = out + int64_t(blockIdx.x) * n;
  float ss = 0.0f;
  if constexpr (kVec) {
    uint4 v[kNormVecs];
#pragma unroll
    for (int i = 0; i < kNormVecs; ++i) {
      const int c = (i * kNormThreads + threadIdx.x) * 8;
      v[i] = c < n ? __ldg(reinterpret_cast<const uint4*>(xr + c)) : make_uint4(0, 0, 0, 0);
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v[i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss = __fmaf_rn(__bfloat162float(e[j]), __bfloat162float(e[j]), ss);
    }
    const float r = rsqrtf(__fadd_rn(__fdiv_rn(block_sum(ss, red), float(n)), eps));
#pragma unroll
    for (int i = 0; i < kNormVecs; ++i) {
      const int c = (i * kNormThreads + threadIdx.x) * 8;
      if (c >= n) break;
      const uint4 wv = __ldg(reinterpret_cast<const uint4*>(w + c));
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v[i]);
      const __nv_bfloat16* we = reinterpret_cast<const __nv_bfloat16*>(&wv);
      uint4 ov;
      __nv_bfloat16* oe = reinterpret_cast<__nv_bfloat16*>(&ov);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float y = dev::round_bf16(__fmul_rn(__bfloat162float(e[j]), r));
        oe[j] = __float2bfloat16_rn(__fmul_rn(__bfloat162float(we[j]), y));
      }
      *reinterpret_cast<uint4*>(o + c) = ov;
    }
  } else {
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
      const float v = __bfloat162float(xr[c]);
      ss = __fmaf_rn(v, v, ss);
    }
    const float r = rsqrtf(__fadd_rn(__fdiv_rn(block_sum(ss, red), float(n)), eps));
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
      const float y = dev::round_bf16(__fmul_rn(__bfloat162float(xr[c]), r));
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
                               int hk, int d, int rot, int cap) {
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
    const float x1 = __bfloat162float(base[j]), x2 = __bfloat162float(base[j + half]);
    const float c1 = __bfloat162float(cos[int64_t(t) * rot + j]), s1 = __bfloat162float(sin[int64_t(t) * rot + j]);
    const float c2 = __bfloat162float(cos[int64_t(t) * rot + j + half]);
    const float s2 = __bfloat162float(sin[int64_t(t) * rot + j + half]);
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

}  // namespace

void launch_rope_kv(void* q, void* k, const void* v, const void* cos, const void* sin, void* kc, void* vc,
                    const int64_t* pos, int tokens, int hq, int hk, int d, int rot, int cap, cudaStream_t stream) {
  ROCKET_CHECK(rot > 0 && rot % 2 == 0 && rot <= d && d % 2 == 0, "rope_kv: rotary dim " << rot << " of head dim " << d);
  const int64_t n = int64_t(tokens) * (hq + 2 * hk) * (d / 2);
  if (n == 0) return;
  rope_kv_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(
      static_cast<__nv_bfloat16*>(q), static_cast<__nv_bfloat16*>(k), static_cast<const __nv_bfloat16*>(v),
      static_cast<const __nv_bfloat16*>(cos), static_cast<const __nv_bfloat16*>(sin), static_cast<__nv_bfloat16*>(kc),
      static_cast<__nv_bfloat16*>(vc), pos, tokens, hq, hk, d, rot, cap);
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

void launch_rms_norm(const void* x, const void* w, void* out, int64_t rows, int n, float eps, cudaStream_t stream) {
  ROCKET_CHECK(rows >= 0 && rows < (int64_t(1) << 31) && n > 0, "rms_norm: rows " << rows << ", n " << n);
  if (rows == 0) return;
  const auto* xp = static_cast<const __nv_bfloat16*>(x);
  const auto* wp = static_cast<const __nv_bfloat16*>(w);
  auto* op = static_cast<__nv_bfloat16*>(out);
  const bool vec = n % 8 == 0 && n <= kNormThreads * 8 * kNormVecs && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (vec) rms_norm_kernel<true><<<unsigned(rows), kNormThreads, 0, stream>>>(xp, wp, op, n, eps);
  else rms_norm_kernel<false><<<unsigned(rows), kNormThreads, 0, stream>>>(xp, wp, op, n, eps);
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

void launch_kv_append(void* kc, void* vc, const void* k, const void* v, const int64_t* pos, int streams, int hkv,
                      int cap, int d, cudaStream_t stream) {
  const int64_t n = int64_t(streams) * hkv * d;
  if (n == 0) return;
  kv_append_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(
      static_cast<__nv_bfloat16*>(kc), static_cast<__nv_bfloat16*>(vc), static_cast<const __nv_bfloat16*>(k),
      static_cast<const __nv_bfloat16*>(v), pos, streams, hkv, cap, d);
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
