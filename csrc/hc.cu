// GLM-5.3-Flash's hyper-connections in the fixed-shape decode step (rocket_mpi/model/glm5_next_hc.py has the math
// and the torch reference the CPU runs): hc_pre in two launches and hc_post in one. In torch hc_pre is ~140 small
// kernels, 120 of them the Sinkhorn normalisation of the [T, N, N] mixing matrix (20 iterations of sum, + eps,
// divide, by rows and by columns), which made them a large share of a GLM-5.3-Flash decode step's kernel time.
//
//   hc_mix      grid (slices, T): partial dot products of the token's flattened streams [N*H] with the J = (2+N)N
//               rows of fn, and the partial sum of squares, over kHcSlice k each (fixed order: a thread's k
//               ascending, a butterfly in each warp, the warps in order)
//   hc_finish   grid T: the slices' partials in slice order; RMS scale, pre / post / comb (softmax, Sinkhorn: one
//               lane per matrix entry, row and column sums in index order); the collapse sum_i pre[i] * streams[i];
//               optionally then the RMSNorm of the collapsed row (the input norm of the block it feeds), in
//               norm.cuh's layout: the bits of decode_ops.cu's rms_norm launched after it
//   hc_post     out[j] = post[j] * y + sum_i comb[i, j] * streams[i], rounded where torch's BF16 ops round: the
//               product, the matmul's result (fp32 sums in i order), the add
//
// Deterministic (fixed sum orders, no atomics), and a token's result depends on no other token. Not bitwise torch's
// (the sum orders differ, and the RMS scale multiplies the dot products instead of the inputs): tests compare them
// within a tolerance (tests/test_device_plan.py).
#include "norm.cuh"

namespace rocket {
namespace {

constexpr int kHcSlice = 512;
constexpr int kHcThreads = 256;
constexpr int kHcWarps = kHcThreads / 32;

template <int N>
__global__ void __launch_bounds__(kHcThreads) hc_mix_kernel(const __nv_bfloat16* __restrict__ x,
                                                            const float* __restrict__ fn, int K, int slices,
                                                            float* __restrict__ part) {
  constexpr int J = (2 + N) * N;
  const int s = blockIdx.x, t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int k0 = s * kHcSlice, k1 = min(K, k0 + kHcSlice);
  float acc[J + 1];
#pragma unroll
  for (int j = 0; j <= J; ++j) acc[j] = 0.0f;
  for (int k = k0 + threadIdx.x; k < k1; k += kHcThreads) {
    const float v = __bfloat162float(x[int64_t(t) * K + k]);
    acc[J] = __fmaf_rn(v, v, acc[J]);
#pragma unroll
    for (int j = 0; j < J; ++j) acc[j] = __fmaf_rn(v, __ldg(fn + int64_t(j) * K + k), acc[j]);
  }
  __shared__ float red[kHcWarps][J + 1];
#pragma unroll
  for (int j = 0; j <= J; ++j) {
    float v = acc[j];
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, d));
    if (lane == 0) red[warp][j] = v;
  }
  __syncthreads();
  if (threadIdx.x <= J) {
    float v = red[0][threadIdx.x];
    for (int w = 1; w < kHcWarps; ++w) v = __fadd_rn(v, red[w][threadIdx.x]);
    part[(int64_t(t) * slices + s) * (J + 1) + threadIdx.x] = v;
  }
}

__device__ __forceinline__ float hc_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Sum over the N lanes lo, lo + stride, ... (of the first N * N lanes), in that order; every lane gets its group's.
template <int N>
__device__ __forceinline__ float group_sum(float v, int lo, int stride) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) s = __fadd_rn(s, __shfl_sync(0xffffffffu, v, lo + i * stride));
  return s;
}

template <int N>
__global__ void __launch_bounds__(kHcThreads) hc_finish_kernel(const __nv_bfloat16* __restrict__ x,
                                                               const float* __restrict__ part, int slices, int H,
                                                               const float* __restrict__ base,
                                                               const float* __restrict__ scale, int iters, float eps,
                                                               float norm_eps, float* __restrict__ post,
                                                               float* __restrict__ comb,
                                                               __nv_bfloat16* __restrict__ collapsed,
                                                               const __nv_bfloat16* __restrict__ norm_w, float rms_eps,
                                                               __nv_bfloat16* __restrict__ normed) {
  static_assert(kHcThreads == dev::kNormThreads, "hc_finish's norm is rms_norm_kernel's block layout");
  constexpr int J = (2 + N) * N;
  const int t = blockIdx.x, lane = threadIdx.x & 31;
  const int K = N * H;
  __shared__ float mix[J + 1];
  __shared__ float pre[N];
  if (threadIdx.x <= J) {
    float v = 0.0f;
#pragma unroll 8
    for (int s = 0; s < slices; ++s) v = __fadd_rn(v, part[(int64_t(t) * slices + s) * (J + 1) + threadIdx.x]);
    mix[threadIdx.x] = v;
  }
  __syncthreads();
  // warp 0: the RMS scale, pre and post; then the Sinkhorn loop (a latency chain of ~80 dependent steps) while the
  // other warps collapse the streams with pre
  const float r = __frsqrt_rn(__fadd_rn(__fdiv_rn(mix[J], float(K)), norm_eps));  // torch: rsqrt(mean(x^2) + eps)
  // torch: linear(x * r, fn) * scale + base, each op rounded (explicit, so nothing contracts to an FMA)
  auto w = [&](int q, int which) { return __fadd_rn(__fmul_rn(__fmul_rn(mix[q], r), scale[which]), base[q]); };
  if (threadIdx.x < N) {
    pre[lane] = __fadd_rn(hc_sigmoid(w(lane, 0)), eps);
    post[t * N + lane] = __fmul_rn(2.0f, hc_sigmoid(w(N + lane, 1)));
  }
  __syncthreads();
  if (threadIdx.x < 32) {
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
  } else {
    const __nv_bfloat16* xt = x + int64_t(t) * K;
    for (int h = threadIdx.x - 32; h < H; h += kHcThreads - 32) {
      float acc = __fmul_rn(pre[0], __bfloat162float(xt[h]));
#pragma unroll
      for (int q = 1; q < N; ++q) acc = __fadd_rn(acc, __fmul_rn(pre[q], __bfloat162float(xt[q * H + h])));
      collapsed[int64_t(t) * H + h] = __float2bfloat16_rn(acc);
    }
  }
  if (normed == nullptr) return;  // the same for the whole grid
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

template <int N>
void hc_pre_n(const HcPre& a, cudaStream_t stream) {
  const int K = N * a.hidden, slices = hc_slices(N, a.hidden);
  hc_mix_kernel<N><<<dim3(slices, a.tokens), kHcThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.x), a.fn, K, slices, a.part);
  ROCKET_LAUNCH_CHECK();
  hc_finish_kernel<N><<<a.tokens, kHcThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.x), a.part, slices, a.hidden, a.base, a.scale, a.iters, a.eps, a.norm_eps,
      a.post, a.comb, static_cast<__nv_bfloat16*>(a.collapsed), static_cast<const __nv_bfloat16*>(a.norm_w),
      a.rms_eps, static_cast<__nv_bfloat16*>(a.normed));
  ROCKET_LAUNCH_CHECK();
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
