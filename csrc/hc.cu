// GLM-5.3-Flash's hyper-connections in the fixed-shape decode step (rocket_mpi/model/glm5_next_hc.py has the math
// and the torch reference the CPU runs): hc_pre in two launches and hc_post in one. In torch hc_pre is ~140 small
// kernels, 120 of them the Sinkhorn normalisation of the [T, N, N] mixing matrix (20 iterations of sum, + eps, divide,
// by rows and by columns), which made them a large share of a GLM-5.3-Flash decode step's kernel time.
//
//   hc_mix      grid (slices, T): partial dot products of the token's flattened streams [N*H] with the J = (2+N)N
//               rows of fn, and the partial sum of squares, over kHcSlice k each (fixed order: a lane's 4 k
//               ascending, then a butterfly in the warp)
//   hc_finish   grid (T, 2): the slices' partials in a fixed order and the RMS scale in both blocks of a token; then
//               one block post and comb (softmax, Sinkhorn: one lane per matrix entry, row and column sums in index
//               order), the other pre and the collapse sum_i pre[i] * streams[i], optionally then the RMSNorm of
//               the collapsed row (the input norm of the block it feeds), in norm.cuh's layout: the bits of
//               decode_ops.cu's rms_norm launched after it
//   hc_post     out[j] = post[j] * y + sum_i comb[i, j] * streams[i], rounded where torch's BF16 ops round: the
//               product, the matmul's result (fp32 sums in i order), the add
//
// Deterministic (fixed sum orders, no atomics), and a token's result depends on no other token. Not bitwise torch's
// (the sum orders differ, and the RMS scale multiplies the dot products instead of the inputs): tests compare them
// within a tolerance (tests/test_glm5_next_kernels.py).
#include "norm.cuh"

namespace rocket {
namespace {

constexpr int kHcLaneK = 4;                  // k per lane: one float4 of each fn row
constexpr int kHcSlice = 32 * kHcLaneK;      // k per block of hc_pre
constexpr int kHcThreads = 256;
constexpr int kHcWarps = kHcThreads / 32;

__device__ __forceinline__ float hc_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Sum over the N lanes lo, lo + stride, ... (of the first N * N lanes), in that order; every lane gets its group's.
template <int N>
__device__ __forceinline__ float group_sum(float v, int lo, int stride) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) s = __fadd_rn(s, __shfl_sync(0xffffffffu, v, lo + i * stride));
  return s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
}

// hc_pre's first launch, grid (slices, T), kHcThreads each: the partial dot products of a slice of the token's
// flattened streams x[t] (kHcSlice k: lane l holds k0 + 4l .. k0 + 4l + 3) with the J rows of fn, and the partial sum
// of squares (row J); warp w owns rows w, w + 8, ...: a lane's 4 products in k order, then a butterfly. Small slices
// and every load of a lane issued at once: at one token the launch is a latency chain, not a stream of bytes.
template <int N, bool kVec>
__global__ void __launch_bounds__(kHcThreads) hc_mix_kernel(const __nv_bfloat16* __restrict__ x,
                                                            const float* __restrict__ fn, int H, int slices,
                                                            float* __restrict__ part) {
  constexpr int J = (2 + N) * N;
  constexpr int kRows = (J + 1 + kHcWarps - 1) / kHcWarps;  // rows (with the sum of squares) per warp
  const int s = blockIdx.x, t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int K = N * H;
  const __nv_bfloat16* xt = x + int64_t(t) * K;
  float* pt = part + int64_t(t) * slices * (J + 1);
  const int k = s * kHcSlice + lane * kHcLaneK;
  float xv[kHcLaneK];
  float4 fv[kRows];
  if (kVec && k < K) {  // K % 4 == 0: the lane's 4 k are all in range
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(xt + k));
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
    xv[0] = __low2float(lo); xv[1] = __high2float(lo); xv[2] = __low2float(hi); xv[3] = __high2float(hi);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int j = warp + r * kHcWarps;
      fv[r] = j < J ? __ldg(reinterpret_cast<const float4*>(fn + int64_t(j) * K + k)) : make_float4(0, 0, 0, 0);
    }
  } else {
#pragma unroll
    for (int q = 0; q < kHcLaneK; ++q) xv[q] = k + q < K ? __bfloat162float(xt[k + q]) : 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int j = warp + r * kHcWarps;
      const float* f = fn + int64_t(j < J ? j : 0) * K + k;
      fv[r] = make_float4(0, 0, 0, 0);
      if (j < J) {
        if (k < K) fv[r].x = __ldg(f);
        if (k + 1 < K) fv[r].y = __ldg(f + 1);
        if (k + 2 < K) fv[r].z = __ldg(f + 2);
        if (k + 3 < K) fv[r].w = __ldg(f + 3);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int j = warp + r * kHcWarps;
    if (j > J) continue;  // the same for the whole warp
    float acc;
    if (j == J) {
      acc = __fmul_rn(xv[0], xv[0]);
      acc = __fmaf_rn(xv[1], xv[1], acc);
      acc = __fmaf_rn(xv[2], xv[2], acc);
      acc = __fmaf_rn(xv[3], xv[3], acc);
    } else {
      acc = __fmul_rn(xv[0], fv[r].x);
      acc = __fmaf_rn(xv[1], fv[r].y, acc);
      acc = __fmaf_rn(xv[2], fv[r].z, acc);
      acc = __fmaf_rn(xv[3], fv[r].w, acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) pt[s * (J + 1) + j] = acc;
  }
}

// hc_pre's second launch, grid (T, 2): the slices' partials summed (warp w: rows w, w + 8, ...; lane l: the slices l,
// l + 32, ... in order, then a butterfly), then the finish (see the top of this file); the collapse 8 columns per
// thread where H allows (the same arithmetic as the scalar path).
template <int N, bool kVec>
__global__ void __launch_bounds__(kHcThreads) hc_finish_kernel(const __nv_bfloat16* __restrict__ x,
                                                               const float* __restrict__ part, int H, int slices,
                                                               const float* __restrict__ base,
                                                               const float* __restrict__ scale, int iters, float eps,
                                                               float norm_eps, float* __restrict__ post,
                                                               float* __restrict__ comb,
                                                               __nv_bfloat16* __restrict__ collapsed,
                                                               const __nv_bfloat16* __restrict__ norm_w, float rms_eps,
                                                               __nv_bfloat16* __restrict__ normed) {
  static_assert(kHcThreads == dev::kNormThreads, "hc_finish's norm is rms_norm_kernel's block layout");
  dev::launch_dependents();  // the next linear's row prep (a programmatic dependent) may start: it waits for this grid
  constexpr int J = (2 + N) * N;
  constexpr int kRows = (J + 1 + kHcWarps - 1) / kHcWarps;  // rows (with the sum of squares) per warp
  const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int K = N * H;
  const __nv_bfloat16* xt = x + int64_t(t) * K;
  const float* pt = part + int64_t(t) * slices * (J + 1);
  __shared__ float mix[J + 1];
  __shared__ float pre[N];
  {
    // warp w: rows w, w + 8, ...; lane l: the slices l, l + 32, ... in order, kChunks * 32 of them per pass with every
    // load of a pass issued before its sums (a dependent L2 round trip per slice would cost more than the rest)
    constexpr int kChunks = 4;
    float v[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) v[r] = 0.0f;
    for (int c0 = 0; c0 < slices; c0 += 32 * kChunks) {  // slices: the mix launch's blocks per token
      float buf[kRows][kChunks];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int j = warp + r * kHcWarps;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int q = c0 + c * 32 + lane;
          buf[r][c] = j <= J && q < slices ? pt[q * (J + 1) + j] : 0.0f;
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          if (c0 + c * 32 + lane < slices) v[r] = __fadd_rn(v[r], buf[r][c]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int j = warp + r * kHcWarps;
      const float m = warp_sum(v[r]);
      if (lane == 0 && j <= J) mix[j] = m;
    }
  }
  __syncthreads();
  // Two blocks per token, side by side: blockIdx.y 1 runs post and the Sinkhorn loop (a latency chain of ~80
  // dependent steps, one warp), blockIdx.y 0 pre, the collapse and the norm (which need no comb)
  const float r = __frsqrt_rn(__fadd_rn(__fdiv_rn(mix[J], float(K)), norm_eps));  // torch: rsqrt(mean(x^2) + eps)
  // torch: linear(x * r, fn) * scale + base, each op rounded (explicit, so nothing contracts to an FMA)
  auto w = [&](int q, int which) { return __fadd_rn(__fmul_rn(__fmul_rn(mix[q], r), scale[which]), base[q]); };
  if (blockIdx.y == 1) {
    if (threadIdx.x >= 32) return;
    if (lane < N) post[t * N + lane] = __fmul_rn(2.0f, hc_sigmoid(w(N + lane, 1)));
    // comb: lane l < N*N is entry (i, j) = (l / N, l % N); row i: lanes iN .. iN + N - 1, column j: j, j + N, ...
    const int l = lane < N * N ? lane : 0, i = l / N, j = l % N;
    float c = w(2 * N + l, 2);
    float m = c;
#pragma unroll
    for (int q = 0; q < N; ++q) m = fmaxf(m, __shfl_sync(0xffffffffu, c, i * N + q));
    c = expf(c - m);
    c = __fadd_rn(__fdiv_rn(c, group_sum<N>(c, i * N, 1)), eps);     // softmax over j, + eps
    c = __fdiv_rn(c, __fadd_rn(group_sum<N>(c, j, N), eps));         // columns
    for (int it = 1; it < iters; ++it) {
      c = __fdiv_rn(c, __fadd_rn(group_sum<N>(c, i * N, 1), eps));   // rows
      c = __fdiv_rn(c, __fadd_rn(group_sum<N>(c, j, N), eps));       // columns
    }
    if (lane < N * N) comb[int64_t(t) * N * N + lane] = c;
    return;
  }
  if (threadIdx.x < N) pre[lane] = __fadd_rn(hc_sigmoid(w(lane, 0)), eps);
  __syncthreads();
  if (kVec && H % 8 == 0) {
    // 8 columns per thread: pre[0] * x0 + pre[1] * x1 + ..., each product and sum rounded, as the scalar path
    float p[N];
#pragma unroll
    for (int q = 0; q < N; ++q) p[q] = pre[q];
    for (int h = threadIdx.x * 8; h < H; h += kHcThreads * 8) {
      uint4 v[N];
#pragma unroll
      for (int q = 0; q < N; ++q) v[q] = __ldg(reinterpret_cast<const uint4*>(xt + q * H + h));
      uint4 o;
      __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float2 acc = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(&v[0])[e]);
        acc.x = __fmul_rn(p[0], acc.x);
        acc.y = __fmul_rn(p[0], acc.y);
#pragma unroll
        for (int q = 1; q < N; ++q) {
          const float2 f = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(&v[q])[e]);
          acc.x = __fadd_rn(acc.x, __fmul_rn(p[q], f.x));
          acc.y = __fadd_rn(acc.y, __fmul_rn(p[q], f.y));
        }
        ob[e] = __floats2bfloat162_rn(acc.x, acc.y);
      }
      *reinterpret_cast<uint4*>(collapsed + int64_t(t) * H + h) = o;
    }
  } else {
    for (int h = threadIdx.x; h < H; h += kHcThreads) {
      float acc = __fmul_rn(pre[0], __bfloat162float(xt[h]));
#pragma unroll
      for (int q = 1; q < N; ++q) acc = __fadd_rn(acc, __fmul_rn(pre[q], __bfloat162float(xt[q * H + h])));
      collapsed[int64_t(t) * H + h] = __float2bfloat16_rn(acc);
    }
  }
  if (normed == nullptr) return;  // the same for the whole block
  // The row is in memory for the block after the barrier; plain loads (not __ldg: this launch wrote it). Then
  // rms_norm_kernel<true, false>'s arithmetic in its layout (hc_norm_fusable: H % 8 == 0, H <= 8192, aligned).
  __syncthreads();
  __shared__ float red[32];
  const __nv_bfloat16* xr = collapsed + int64_t(t) * H;
  uint4 v[dev::kNormVecs];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < dev::kNormVecs; ++i) {
    const int c = (i * dev::kNormThreads + threadIdx.x) * 8;
    v[i] = c < H ? *reinterpret_cast<const uint4*>(xr + c) : make_uint4(0, 0, 0, 0);
    dev::sum_squares8(v[i], ss);
  }
  const float rn = dev::norm_scale(dev::block_sum(ss, red), H, rms_eps);
#pragma unroll
  for (int i = 0; i < dev::kNormVecs; ++i) {
    const int c = (i * dev::kNormThreads + threadIdx.x) * 8;
    if (c >= H) break;
    const uint4 wv = __ldg(reinterpret_cast<const uint4*>(norm_w + c));
    *reinterpret_cast<uint4*>(normed + int64_t(t) * H + c) = dev::norm8(v[i], wv, rn);
  }
}

template <int N>
__global__ void __launch_bounds__(kHcThreads) hc_post_kernel(const float* __restrict__ post,
                                                             const float* __restrict__ comb,
                                                             const __nv_bfloat16* __restrict__ y,
                                                             const __nv_bfloat16* __restrict__ x, int H,
                                                             __nv_bfloat16* __restrict__ out) {
  const int t = blockIdx.y, h = blockIdx.x * kHcThreads + threadIdx.x;
  if (h >= H) return;
  const int64_t base = int64_t(t) * N * H + h;
  const float yv = __bfloat162float(y[int64_t(t) * H + h]);
  float xs[N];
#pragma unroll
  for (int i = 0; i < N; ++i) xs[i] = __bfloat162float(x[base + int64_t(i) * H]);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float p = __bfloat162float(__float2bfloat16_rn(post[t * N + j]));
    const float prod = __bfloat162float(__float2bfloat16_rn(__fmul_rn(p, yv)));
    float mm = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i)
      mm = __fmaf_rn(__bfloat162float(__float2bfloat16_rn(comb[(int64_t(t) * N + i) * N + j])), xs[i], mm);
    const float mmb = __bfloat162float(__float2bfloat16_rn(mm));
    out[base + int64_t(j) * H] = __float2bfloat16_rn(__fadd_rn(prod, mmb));
  }
}

template <int N, bool kVec>
void hc_pre_n(const HcPre& a, cudaStream_t stream) {
  const int slices = hc_slices(N, a.hidden);
  hc_mix_kernel<N, kVec><<<dim3(slices, a.tokens), kHcThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.x), a.fn, a.hidden, slices, a.part);
  ROCKET_LAUNCH_CHECK();
  hc_finish_kernel<N, kVec><<<dim3(a.tokens, 2), kHcThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.x), a.part, a.hidden, slices, a.base, a.scale, a.iters, a.eps, a.norm_eps,
      a.post, a.comb, static_cast<__nv_bfloat16*>(a.collapsed), static_cast<const __nv_bfloat16*>(a.norm_w),
      a.rms_eps, static_cast<__nv_bfloat16*>(a.normed));
  ROCKET_LAUNCH_CHECK();
}

template <int N>
void hc_pre_n(const HcPre& a, cudaStream_t stream) {
  // float4 rows of fn and 4-element x chunks: K % 4 == 0 with 16-byte fn and 8-byte x (and collapsed) rows
  const bool vec = (N * a.hidden) % 4 == 0 && reinterpret_cast<uintptr_t>(a.fn) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.collapsed) % 16 == 0;
  if (vec) hc_pre_n<N, true>(a, stream);
  else hc_pre_n<N, false>(a, stream);
}

template <int N>
void hc_post_n(const float* post, const float* comb, const void* y, const void* x, int tokens, int hidden, void* out,
               cudaStream_t stream) {
  hc_post_kernel<N><<<dim3((hidden + kHcThreads - 1) / kHcThreads, tokens), kHcThreads, 0, stream>>>(
      post, comb, static_cast<const __nv_bfloat16*>(y), static_cast<const __nv_bfloat16*>(x), hidden,
      static_cast<__nv_bfloat16*>(out));
  ROCKET_LAUNCH_CHECK();
}

}  // namespace

int hc_slices(int n, int hidden) { return (n * hidden + kHcSlice - 1) / kHcSlice; }

bool hc_norm_fusable(int hidden, const void* collapsed, const void* norm_w, const void* normed) {
  return dev::norm_vec_ok(hidden, collapsed, norm_w, normed);
}

void launch_hc_pre(const HcPre& a, cudaStream_t stream) {
  ROCKET_CHECK(a.n >= 1 && a.n <= kHcMaxStreams && a.hidden > 0 && a.iters >= 1, "hc_pre: " << a.n
               << " streams (1.." << kHcMaxStreams << "), hidden " << a.hidden << ", " << a.iters << " iterations");
  ROCKET_CHECK(a.tokens >= 0 && a.tokens <= 65535, "hc_pre: " << a.tokens << " tokens");
  if (a.tokens == 0) return;
  ROCKET_CHECK(a.norm_w == nullptr || (a.normed != nullptr && hc_norm_fusable(a.hidden, a.collapsed, a.norm_w, a.normed)),
               "hc_pre: the input norm of hidden " << a.hidden << " does not fuse (hc_norm_fusable)");
  switch (a.n) {
    case 1: hc_pre_n<1>(a, stream); break;
    case 2: hc_pre_n<2>(a, stream); break;
    case 3: hc_pre_n<3>(a, stream); break;
    default: hc_pre_n<4>(a, stream); break;
  }
}

void launch_hc_post(const float* post, const float* comb, const void* y, const void* x, int n, int tokens, int hidden,
                    void* out, cudaStream_t stream) {
  ROCKET_CHECK(n >= 1 && n <= kHcMaxStreams && hidden > 0 && tokens >= 0 && tokens <= 65535, "hc_post: " << n
               << " streams, hidden " << hidden << ", " << tokens << " tokens");
  if (tokens == 0) return;
  switch (n) {
    case 1: hc_post_n<1>(post, comb, y, x, tokens, hidden, out, stream); break;
    case 2: hc_post_n<2>(post, comb, y, x, tokens, hidden, out, stream); break;
    case 3: hc_post_n<3>(post, comb, y, x, tokens, hidden, out, stream); break;
    default: hc_post_n<4>(post, comb, y, x, tokens, hidden, out, stream); break;
  }
}

}  // namespace rocket
