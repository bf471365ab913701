// Small fused ops of the fixed-shape decode step (rocket_mpi/graph.py): each replaces a chain of torch
// kernels with one launch, which is what a CUDA-graphed step of M tokens is made of.
//
//   rms_norm   x [rows, n] bf16, w [n] -> bf16: fp32 sum of squares, x * rsqrt(mean + eps) rounded to
//              bf16, times w rounded to bf16 (transformers' order; the sum's order is the kernel's own)
//   rope       q [T, hq, d], k [T, hk, d] in place, rotate-half on the first `rot` channels with the
//              step's cos/sin [T, rot] (bf16): out = bf16(bf16(x * cos) + bf16(rotated * sin)), exactly
//              torch's bf16 ops on the same inputs
//   kv_append  k/v [M, hkv, d] into the caches [M, hkv, cap, d] at each stream's position pos[M]
//   decode_attention  one query per stream against its cache up to its own position (pos[m] + 1 keys,
//              not the capacity), GQA, keys and values staged through shared memory in bursts, in transformers' eager order of roundings: bf16 scores, * scale
//              in bf16, fp32 softmax, probabilities rounded to bf16, fp32 sum of p * v rounded to bf16.
//              Replaces ~10 torch kernels per layer (matmul, scale, mask, softmax, casts, matmul) and
//              their reads of the whole capacity. Every sum has one fixed order (below), so a stream's
//              output depends on nothing but its own query, cache prefix and position.
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


// decode_attention: one block per (kv head g, stream m); the block's hpg = hq / hkv query heads share the
// keys. Keys and values come into shared memory in chunks of kAttnChunkBytes / (2 d) positions, each chunk
// one burst of cp.async (the first K and V chunks issued before pos is even read), so a short context costs
// about one memory round trip. Three passes over the stream's len = pos[m] + 1 positions, fixed orders:
//   1 scores: warp w takes positions w, w + warps, ... of a chunk; lane l holds channels l*VPL .. l*VPL+VPL-1;
//     per head a sequential fp32 sum over the lane's channels, then an xor butterfly (every lane ends
//     with the same bits; all heads' butterflies interleaved); s = bf16(bf16(dot) * scale) into the score
//     rows [hpg][cap] (shared memory when they fit, else the global scratch), running max per head
//   2 softmax: warp per head; lane-strided sequential sums of exp(s - max), butterfly; then
//     p = bf16(exp(s - max) / sum) in place
//   3 out[h][d] = bf16(sum over positions, ascending, of p[h][s] * v[s][d]), one thread per (d, head set)
constexpr int kAttnThreads = 256;
constexpr int kAttnMaxHpg = 32;   // query heads per kv head: one lane each holds a head's running max
constexpr int kAttnMaxAcc = 16;   // heads per thread in pass 3
constexpr int kAttnChunkBytes = 16 * 1024;  // keys (and values) of one chunk of positions in shared memory
constexpr int kAttnMaxSmem = 200 * 1024;    // q + K/V chunks + score rows in shared memory up to this

template <int VPL>
__device__ __forceinline__ void load_bf16_smem(const __nv_bfloat16* p, float (&v)[VPL]) {
  if constexpr (VPL == 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&u);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(e[j]);
  } else if constexpr (VPL == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = __bfloat162float(e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < VPL; ++j) v[j] = __bfloat162float(p[j]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// rows [r0, r0 + n) of a [cap][D] cache block into smem [n][D], 16 bytes per cp.async, one commit group
template <int D>
__device__ __forceinline__ void load_chunk(__nv_bfloat16* dst, const __nv_bfloat16* src, int r0, int n) {
  constexpr int kPer = D / 8;  // 16-byte pieces per row
  for (int i = threadIdx.x; i < n * kPer; i += blockDim.x)
    dev::cp_async_16(dst + i * 8, src + int64_t(r0) * D + i * 8);
  dev::cp_async_commit();
}

template <int VPL>
__global__ void __launch_bounds__(kAttnThreads) decode_attention_kernel(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kc, const __nv_bfloat16* __restrict__ vc,
    const int64_t* __restrict__ pos, float* __restrict__ scratch, __nv_bfloat16* __restrict__ out, int hq, int hkv,
    int cap, float scale, int smem_scores) {
  constexpr int D = 32 * VPL;
  constexpr int C = kAttnChunkBytes / (2 * D);           // positions per chunk
  extern __shared__ __align__(16) float smem_f[];        // K chunk, V chunk, q [hpg][VPL][32], score rows
  __shared__ float red[kAttnThreads / 32][kAttnMaxHpg];
  __shared__ float head_max[kAttnMaxHpg];
  auto* k_s = reinterpret_cast<__nv_bfloat16*>(smem_f);
  auto* v_s = k_s + C * D;
  float* q_s = smem_f + C * D;                           // after the two bf16 chunks (2 * C * D * 2 bytes)
  const int g = blockIdx.x, m = blockIdx.y, hpg = hq / hkv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int64_t head0 = int64_t(m) * hq + int64_t(g) * hpg;
  const __nv_bfloat16* kb = kc + (int64_t(m) * hkv + g) * cap * D;
  const __nv_bfloat16* vb = vc + (int64_t(m) * hkv + g) * cap * D;
  const int first = cap < C ? cap : C;
  load_chunk<D>(k_s, kb, 0, first);                      // before pos: a short context needs no more
  load_chunk<D>(v_s, vb, 0, first);
  const int64_t p = pos[m];
  const int len = p < 0 ? 0 : (p >= cap ? cap : int(p) + 1);
  float* sc = smem_scores ? q_s + hpg * D : scratch + head0 * cap;  // [hpg][cap]
  for (int i = threadIdx.x; i < hpg * D; i += blockDim.x) {
    const int h = i / D, c = i % D;
    q_s[(h * VPL + c % VPL) * 32 + c / VPL] = __bfloat162float(q[head0 * D + i]);
  }
  float mx = -INFINITY;                                  // lane h: head h's max over this warp's positions
  for (int c0 = 0; c0 < len; c0 += C) {
    const int n = len - c0 < C ? len - c0 : C;
    if (c0 == 0) {
      dev::cp_async_wait<1>();                           // K chunk 0 (V chunk 0 may still fly)
    } else {
      __syncthreads();                                   // every warp is done with the previous chunk
      load_chunk<D>(k_s, kb, c0, n);
      dev::cp_async_wait<0>();
    }
    __syncthreads();
    for (int s = warp; s < n; s += warps) {
      float kv[VPL];
      load_bf16_smem<VPL>(k_s + s * D + lane * VPL, kv);
      float part[kAttnMaxHpg];
#pragma unroll
      for (int h = 0; h < kAttnMaxHpg; ++h) {
        part[h] = 0.0f;
        if (h < hpg) {
#pragma unroll
          for (int j = 0; j < VPL; ++j) part[h] = __fmaf_rn(q_s[(h * VPL + j) * 32 + lane], kv[j], part[h]);
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int h = 0; h < kAttnMaxHpg; ++h)
          if (h < hpg) part[h] += __shfl_xor_sync(0xffffffffu, part[h], o);
      }
      float mine = 0.0f;
#pragma unroll
      for (int h = 0; h < kAttnMaxHpg; ++h)
        if (h == lane) mine = part[h];
      if (lane < hpg) {
        const float v = dev::round_bf16(__fmul_rn(dev::round_bf16(mine), scale));
        mx = fmaxf(mx, v);
        sc[int64_t(lane) * cap + c0 + s] = v;
      }
    }
  }
  red[warp][lane] = mx;
  __syncthreads();
  if (threadIdx.x < hpg) {
    float t = red[0][threadIdx.x];
    for (int w = 1; w < warps; ++w) t = fmaxf(t, red[w][threadIdx.x]);
    head_max[threadIdx.x] = t;
  }
  __syncthreads();
  for (int h = warp; h < hpg; h += warps) {
    float* row = sc + int64_t(h) * cap;
    const float hm = head_max[h];
    float sum = 0.0f;
    for (int s = lane; s < len; s += 32) sum = __fadd_rn(sum, expf(row[s] - hm));
    sum = warp_sum(sum);
    for (int s = lane; s < len; s += 32) row[s] = dev::round_bf16(__fdiv_rn(expf(row[s] - hm), sum));
  }
  const int groups = blockDim.x / D, d = threadIdx.x % D, grp = threadIdx.x / D;
  float acc[kAttnMaxAcc];
#pragma unroll
  for (int i = 0; i < kAttnMaxAcc; ++i) acc[i] = 0.0f;
  const int nh = grp < hpg ? (hpg - grp + groups - 1) / groups : 0;
  const float* pr = sc + int64_t(grp) * cap;
  const int64_t hstride = int64_t(groups) * cap;
  for (int c0 = 0; c0 < len; c0 += C) {
    const int n = len - c0 < C ? len - c0 : C;
    if (c0 > 0) {
      __syncthreads();                                   // every thread is done with the previous chunk
      load_chunk<D>(v_s, vb, c0, n);
    }
    dev::cp_async_wait<0>();
    __syncthreads();                                     // the chunk, and (first time) the probabilities
    for (int s = 0; s < n; ++s) {
      const float v = __bfloat162float(v_s[s * D + d]);
#pragma unroll
      for (int i = 0; i < kAttnMaxAcc; ++i)
        if (i < nh) acc[i] = __fmaf_rn(pr[i * hstride + c0 + s], v, acc[i]);
    }
  }
  dev::cp_async_wait<0>();                               // len 0: the speculative chunks still land first
#pragma unroll
  for (int i = 0; i < kAttnMaxAcc; ++i)
    if (i < nh) out[(head0 + grp + i * groups) * D + d] = __float2bfloat16_rn(acc[i]);
}

template <int VPL>
void launch_attention(dim3 grid, int smem, int smem_scores, const __nv_bfloat16* q, const __nv_bfloat16* kc,
                      const __nv_bfloat16* vc, const int64_t* pos, float* scratch, __nv_bfloat16* out, int hq,
                      int hkv, int cap, float scale, cudaStream_t stream) {
  static bool done[64] = {};  // the shared memory attribute, once per device
  int dev = 0;
  ROCKET_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 64 || !done[dev]) {
    ROCKET_CUDA_CHECK(cudaFuncSetAttribute(decode_attention_kernel<VPL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kAttnMaxSmem));
    if (dev < 64) done[dev] = true;
  }
  decode_attention_kernel<VPL><<<grid, kAttnThreads, smem, stream>>>(q, kc, vc, pos, scratch, out, hq, hkv, cap, scale,
                                                                     smem_scores);
}

}  // namespace

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

void launch_decode_attention(const void* q, const void* kc, const void* vc, const int64_t* pos, float* scratch,
                             void* out, int streams, int hq, int hkv, int cap, int d, float scale,
                             cudaStream_t stream) {
  ROCKET_CHECK(hkv > 0 && hq % hkv == 0 && hq / hkv <= kAttnMaxHpg, "decode_attention: " << hq << " query heads over "
               << hkv << " kv heads (at most " << kAttnMaxHpg << " per kv head)");
  ROCKET_CHECK(d == 32 || d == 64 || d == 128 || d == 256, "decode_attention: head dim " << d
               << " (32, 64, 128 or 256)");
  const int groups = kAttnThreads / d;
  ROCKET_CHECK((hq / hkv + groups - 1) / groups <= kAttnMaxAcc, "decode_attention: " << hq / hkv
               << " query heads per kv head at head dim " << d);
  if (streams == 0) return;
  const dim3 grid(hkv, streams);
  const int64_t fixed = 2 * kAttnChunkBytes + int64_t(hq / hkv) * d * 4, score_bytes = int64_t(hq / hkv) * cap * 4;
  const int smem_scores = fixed + score_bytes <= kAttnMaxSmem;  // else the scores go through `scratch`
  const int smem = int(fixed + (smem_scores ? score_bytes : 0));
  const auto* qp = static_cast<const __nv_bfloat16*>(q);
  const auto* kp = static_cast<const __nv_bfloat16*>(kc);
  const auto* vp = static_cast<const __nv_bfloat16*>(vc);
  auto* op = static_cast<__nv_bfloat16*>(out);
  switch (d) {
    case 32: launch_attention<1>(grid, smem, smem_scores, qp, kp, vp, pos, scratch, op, hq, hkv, cap, scale, stream); break;
    case 64: launch_attention<2>(grid, smem, smem_scores, qp, kp, vp, pos, scratch, op, hq, hkv, cap, scale, stream); break;
    case 128: launch_attention<4>(grid, smem, smem_scores, qp, kp, vp, pos, scratch, op, hq, hkv, cap, scale, stream); break;
    default: launch_attention<8>(grid, smem, smem_scores, qp, kp, vp, pos, scratch, op, hq, hkv, cap, scale, stream); break;
  }
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
