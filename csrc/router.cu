// The router of one MoE layer on the device, in two kernels instead of the ~15 small torch ops of
// rocket_mpi/moe/router.py (route), for the fixed-shape decode step:
//
//   router_logits   partial[s, t, e] = sum over k in slice s of float(x[t, k]) * W[e, k]   (x bf16, W fp32;
//                   slices of kSlice = 512 k, so a launch has (E / 8) x (H / 512) blocks: the 2 MB of W of
//                   a 128-expert router are read by 128 blocks at once instead of 16)
//   moe_route       logit = the partials summed in slice order; sigmoid, + e_score_correction_bias for the
//                   choice only, group-limited top-k, the chosen experts' unbiased scores normalised
//                   (norm_topk_prob) times routed_scaling_factor
//
// Every rank runs the same kernels on the same hidden state, so the split and one rank route the same.
// Both are row-invariant (a token's result never depends on the other tokens of the launch, or on how
// many there are): each (t, e) has one fixed sum order (lane j of the expert's warp adds quads 4 (j + 32 i)
// of the slice in ascending i, then a fixed butterfly; then slices in order), set by H alone; moe_route
// gives each token its own warp. They are not bitwise torch's (cuBLAS picks its own sum order), only close:
// tests/test_router.py checks logits within 2^-20, and from the same logits the same experts and
// weights within 2^-18 of route().
//
// Ties in the top-k go to the lower expert id; a NaN logit is never chosen while a number is left.
#include <cmath>

#include "common.cuh"

namespace rocket {
namespace {

constexpr int kLogitWarps = 8;      // experts per block, one warp each
constexpr int kSlice = 512;         // k per block (kSlice / 4 quads: 4 per lane)
constexpr int kLogitTokens = 8;     // tokens per pass over the slice (registers)
constexpr int kRouteWarps = 4;      // tokens per block of moe_route

// grid (ceil(E / kLogitWarps), slices, token chunks). The block stages its x slice of kLogitTokens tokens in
// shared memory as fp32, and each warp reads its expert's 2 KiB of W (from L2 after the first chunk).
__global__ void __launch_bounds__(kLogitWarps * 32) router_logits_kernel(const __nv_bfloat16* __restrict__ x,
                                                                         const float* __restrict__ w, int tokens,
                                                                         int hidden, int n_experts,
                                                                         float* __restrict__ partial) {
  __shared__ float4 xs[kLogitTokens][kSlice / 4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int e = blockIdx.x * kLogitWarps + warp, k0 = blockIdx.y * kSlice;
  const int quads = min(kSlice, hidden - k0) / 4;  // hidden % 4 == 0 (launcher)
  constexpr int kPerLane = kSlice / 4 / 32;
  float4 wv[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int q = lane + 32 * i;
    wv[i] = (e < n_experts && q < quads) ? __ldg(reinterpret_cast<const float4*>(w + int64_t(e) * hidden + k0) + q)
                                         : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // Chunks of kLogitTokens tokens are dealt over gridDim.z (one each up to 65535 chunks): a decode step's
  // M tokens run side by side rather than one chunk after another (M = 64: 23.6 -> 12.5 us per layer).
  for (int t0 = blockIdx.z * kLogitTokens; t0 < tokens; t0 += gridDim.z * kLogitTokens) {
    const int nt = min(kLogitTokens, tokens - t0);
    __syncthreads();  // the previous chunk's reads are done
#pragma unroll 4
    for (int i = threadIdx.x; i < kLogitTokens * quads; i += blockDim.x) {
      const int t = i / quads, q = i % quads;
      float4 f = make_float4(0.f, 0.f, 0.f, 0.f);  // rows t >= nt: zeros, computed, never stored
      if (t < nt) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(x + int64_t(t0 + t) * hidden + k0) + q);
        const __nv_bfloat162 a = dev::bits_bf16x2(v.x), b = dev::bits_bf16x2(v.y);
        f = make_float4(__low2float(a), __high2float(a), __low2float(b), __high2float(b));
      }
      xs[t][q] = f;
    }
    __syncthreads();
    if (e >= n_experts) continue;  // whole warps; the block's barriers above stay matched
    float acc[kLogitTokens];
#pragma unroll
    for (int t = 0; t < kLogitTokens; ++t) {
      acc[t] = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (lane + 32 * i < quads) {
          const float4 xv = xs[t][lane + 32 * i];
          acc[t] = __fmaf_rn(xv.x, wv[i].x, acc[t]);
          acc[t] = __fmaf_rn(xv.y, wv[i].y, acc[t]);
          acc[t] = __fmaf_rn(xv.z, wv[i].z, acc[t]);
          acc[t] = __fmaf_rn(xv.w, wv[i].w, acc[t]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kLogitTokens; ++t) {
      float v = acc[t];
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, d));
      if (lane == t && t < nt) partial[(int64_t(blockIdx.y) * tokens + t0 + t) * n_experts + e] = v;
    }
  }
}

// (value, id) of the better of two candidates: larger value, then lower id. Symmetric, so every lane of
// a butterfly ends with the same winner.
__device__ __forceinline__ void better(float& v, int& id, float ov, int oid) {
  if (ov > v || (ov == v && oid < id)) {
    v = ov;
    id = oid;
  }
}

__device__ __forceinline__ void warp_best(float& v, int& id) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, d);
    const int oid = __shfl_xor_sync(0xffffffffu, id, d);
    better(v, id, ov, oid);
  }
}

constexpr int kNone = 0x7fffffff;

// An order-preserving key of a float that is not NaN: a larger float has a larger key, equal floats equal keys
// (-0 as +0), and every key is > 0 (-inf: 0x007fffff), so 0 can mean "none".
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t b = __float_as_uint(v == 0.0f ? 0.0f : v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// One warp per token; lane l holds experts l + 32 j (j < NPL) in registers: score (unbiased sigmoid) and
// choice (score + bias; -inf where its group is dropped, NaN once taken). Shared memory only for the
// group scores (n_group > 1).
template <int NPL>
__global__ void __launch_bounds__(kRouteWarps * 32) moe_route_kernel(const float* __restrict__ partial, int slices,
                                                                     const float* __restrict__ bias, int tokens,
                                                                     int n_experts, int n_group, int topk_group,
                                                                     int topk, int norm, float scaling,
                                                                     int64_t* __restrict__ experts,
                                                                     float* __restrict__ weights) {
  __shared__ float group_choice[kRouteWarps][32 * NPL];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * kRouteWarps + warp;
  if (t >= tokens) return;  // whole warps: nothing below syncs the block
  const int E = n_experts;
  float score[NPL], choice[NPL], logit[NPL];
  // logits: the slices' partials in slice order; the loads of 4 slices x NPL experts are issued together
  // (one after another they cost an L2 round trip each: 7.6 us per call on the H200 at 8 slices, NPL 4)
#pragma unroll
  for (int j = 0; j < NPL; ++j) logit[j] = 0.0f;
#pragma unroll 4
  for (int s = 0; s < slices; ++s) {
    float v[NPL];
#pragma unroll
    for (int j = 0; j < NPL; ++j) v[j] = lane + 32 * j < E ? partial[(int64_t(s) * tokens + t) * E + lane + 32 * j] : 0.0f;
#pragma unroll
    for (int j = 0; j < NPL; ++j) logit[j] = s == 0 ? v[j] : __fadd_rn(logit[j], v[j]);
  }
#pragma unroll
  for (int j = 0; j < NPL; ++j) {
    const int e = lane + 32 * j;
    score[j] = 0.0f;
    choice[j] = NAN;  // past E: never a candidate
    if (e < E) {
      const float l = logit[j];
      const float sg = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-l)));  // torch's sigmoid: 1 / (1 + exp(-x))
      score[j] = sg;
      const float c = __fadd_rn(sg, bias[e]);
      choice[j] = isnan(c) ? -INFINITY : c;
    }
  }
  if (n_group > 1) {  // keep the topk_group groups with the best sum of their two best choices
    float* gc = group_choice[warp];
#pragma unroll
    for (int j = 0; j < NPL; ++j)
      if (lane + 32 * j < E) gc[lane + 32 * j] = choice[j];
    __syncwarp();
    const int gs = E / n_group;
    float gscore = -INFINITY;
    if (lane < n_group) {
      float b0 = -INFINITY, b1 = -INFINITY;
      for (int e = lane * gs; e < (lane + 1) * gs; ++e) {
        const float c = gc[e];
        if (c > b0) {
          b1 = b0;
          b0 = c;
        } else if (c > b1) {
          b1 = c;
        }
      }
      gscore = __fadd_rn(b0, b1);
      if (isnan(gscore)) gscore = -INFINITY;
    }
    unsigned keep = 0;
    for (int r = 0; r < topk_group; ++r) {
      float v = gscore;
      int id = lane < n_group && !(keep >> lane & 1u) ? lane : kNone;
      if (id == kNone) v = -INFINITY;
      warp_best(v, id);
      keep |= 1u << id;
    }
#pragma unroll
    for (int j = 0; j < NPL; ++j) {
      const int e = lane + 32 * j;
      if (e < E && !(keep >> (e / gs) & 1u)) choice[j] = -INFINITY;
    }
  }
  // the choices' keys, once (the top-k rounds compare keys; 0: past E, or taken)
  uint32_t key[NPL];
#pragma unroll
  for (int j = 0; j < NPL; ++j) key[j] = isnan(choice[j]) ? 0u : order_key(choice[j]);
  float picked = 0.0f;  // lane r holds the score of pick r
  for (int r = 0; r < topk; ++r) {
    // the best choice, ties to the lower id: each lane's best (j ascending, so a tie keeps the lower id), then
    // the warp's largest key and the lowest id holding it: two redux instructions instead of a butterfly of ten
    // shuffles. Key 0: no candidate left (the id stays kNone).
    uint32_t kl = 0;
    int il = kNone;
#pragma unroll
    for (int j = 0; j < NPL; ++j) {
      if (key[j] > kl) {
        kl = key[j];
        il = lane + 32 * j;
      }
    }
    const uint32_t km = __reduce_max_sync(0xffffffffu, kl);
    const int id = static_cast<int>(__reduce_min_sync(0xffffffffu, kl == km ? static_cast<uint32_t>(il) : ~0u));
    float sv = 0.0f;
#pragma unroll
    for (int j = 0; j < NPL; ++j)
      if (lane + 32 * j == id) {
        sv = score[j];
        key[j] = 0u;  // taken
      }
    sv = __shfl_sync(0xffffffffu, sv, id & 31);
    if (lane == r) picked = sv;
    if (lane == 0) experts[int64_t(t) * topk + r] = id;
  }
  // sum of the picks in pick order, then each lane its own weight
  float sum = 0.0f;
  for (int r = 0; r < topk; ++r) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, picked, r));
  if (lane < topk) {
    float wgt = picked;
    if (norm) wgt = __fdiv_rn(wgt, __fadd_rn(sum, 1e-20f));
    weights[int64_t(t) * topk + lane] = __fmul_rn(wgt, scaling);
  }
}

}  // namespace

int router_slices(int hidden) { return (hidden + kSlice - 1) / kSlice; }

void launch_router_logits(const void* x, const float* w, int tokens, int hidden, int n_experts, float* partial,
                          cudaStream_t stream) {
  ROCKET_CHECK(tokens >= 0 && n_experts > 0 && hidden > 0 && hidden % 4 == 0,
               "router_logits: tokens " << tokens << ", experts " << n_experts << ", hidden " << hidden
               << " (a multiple of 4)");
  if (tokens == 0) return;
  const int chunks = (tokens + kLogitTokens - 1) / kLogitTokens;
  const dim3 grid((n_experts + kLogitWarps - 1) / kLogitWarps, router_slices(hidden), chunks < 65535 ? chunks : 65535);
  router_logits_kernel<<<grid, kLogitWarps * 32, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), w, tokens,
                                                                hidden, n_experts, partial);
  ROCKET_LAUNCH_CHECK();
}

void launch_moe_route(const float* partial, int slices, const float* bias, int tokens, int n_experts, int n_group,
                      int topk_group, int topk, bool norm, float scaling, int64_t* experts, float* weights,
                      cudaStream_t stream) {
  ROCKET_CHECK(n_experts > 0 && n_experts <= kRouteMaxExperts, "moe_route: " << n_experts << " experts (at most "
               << kRouteMaxExperts << ")");
  ROCKET_CHECK(topk > 0 && topk <= 32 && topk <= n_experts, "moe_route: top-" << topk << " of " << n_experts
               << " (at most 32)");
  ROCKET_CHECK(n_group >= 1 && n_group <= 32 && n_experts % n_group == 0 && topk_group >= 1 &&
               topk_group <= n_group && (n_group == 1 || n_experts / n_group >= 2),
               "moe_route: n_group " << n_group << ", topk_group " << topk_group << " for " << n_experts
               << " experts");
  ROCKET_CHECK(slices >= 1, "moe_route: " << slices << " slices");
  if (tokens <= 0) return;
  const unsigned blocks = (tokens + kRouteWarps - 1) / kRouteWarps;
  const int npl = (n_experts + 31) / 32;
#define ROCKET_ROUTE(N) \
  moe_route_kernel<N><<<blocks, kRouteWarps * 32, 0, stream>>>(partial, slices, bias, tokens, n_experts, n_group, \
                                                               topk_group, topk, norm ? 1 : 0, scaling, experts, weights)
  if (npl <= 1) ROCKET_ROUTE(1);
  else if (npl <= 2) ROCKET_ROUTE(2);
  else if (npl <= 4) ROCKET_ROUTE(4);
  else if (npl <= 8) ROCKET_ROUTE(8);
  else if (npl <= 12) ROCKET_ROUTE(12);  // GLM-5.3-Flash's 288 experts
  else if (npl <= 16) ROCKET_ROUTE(16);
  else ROCKET_ROUTE(32);
#undef ROCKET_ROUTE
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
