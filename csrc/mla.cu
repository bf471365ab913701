// GLM-5.3-Flash's MLA decode glue in three kernels, in place of the torch ops of glm5_next_mla.mla_decode that the
// fixed-shape step on a GPU ran one kernel each (about 40 per MLA layer, 60 where the indexer scores, most of them on
// a few hundred bytes):
//
//   cache_step  block r (one per stream, 128 threads): the token's latent row into the latent cache at pos[r] of
//               cache row index[r]; with an indexer, its key through the LayerNorm (fp32 mean, then the mean of
//               squared deviations, as two passes; y = (x - mean) * rstd * w + b, one bf16 rounding) and its gate
//               into their caches, and where the token completes a pool (pos + 1 a multiple of kpool), that pool's
//               key: per channel, softmax over the pool's kpool slots of gate + ape in fp32, each weight rounded to
//               bf16, each weight x key rounded to bf16, summed in slot order in fp32, one bf16 rounding (the
//               torch ops' roundings; the sums' orders are this kernel's). A thread owns its channels from the
//               write to the pool's read, so the pool sees the token's own key without a barrier.
//   softmax     one warp per (stream, head) row of fp32 scores [rows, span]: bf16(softmax(s x scale)) over the row's
//               visible columns, exactly 0 elsewhere; a row with none visible is NaN (as a softmax over -inf).
//               Visible: valid[stream, j] where a mask is given, else j < n with n the stream's visible prefix
//               (pos + 1 with the tail selected, else the complete pools' positions (pos + 1) / kpool x kpool).
//
//   pick        block r (one per stream, 256 threads), where the indexer scores: of the stream's pool scores [P]
//               (fp32, index_scores), the k largest in topk_first's order (the larger first, of equal ones the lower
//               pool; NaN as +inf, -0 as +0; pools that are not candidates, complete with their last position <= pos,
//               as the lowest finite fp32, so a stream with fewer than k candidates fills up with the lowest such
//               pools), found by a radix select over the scores' order-preserving 32-bit keys (four 8-bit digits,
//               a histogram each) and taken in ascending pool order; written as _pool_cols writes them: each
//               pool's kpool positions (valid where it is a candidate), then with the tail, the incomplete pool's
//               positions up to pos (valid) and pos again for the rest (not valid).
//
// Every sum is in a fixed order set by the row's own length, so a stream's bits do not depend on the others.
#include "common.cuh"

namespace rocket {
namespace {

constexpr int kCacheThreads = 128;
constexpr int kSoftmaxWarps = 8;

__device__ __forceinline__ float bf(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }

// Every thread gets the block's total, summed in one order (lanes in a butterfly, then the warps in order).
__device__ __forceinline__ float cache_block_sum(float v, float* red) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.0f;
#pragma unroll
  for (int w = 0; w < kCacheThreads / 32; ++w) t += red[w];
  __syncthreads();
  return t;
}

__global__ void __launch_bounds__(kCacheThreads) mla_cache_step_kernel(const MlaCacheStep a) {
  __shared__ float red[kCacheThreads / 32];
  const int r = blockIdx.x, tid = threadIdx.x;
  const int64_t s = a.index != nullptr ? a.index[r] : r, p = a.pos[r];
  if (s < 0 || s >= a.cache_rows || p < 0 || p >= a.cap) return;  // no cache row there: nothing written
  const auto* lat = static_cast<const __nv_bfloat16*>(a.latent) + int64_t(r) * a.latent_stride;
  auto* lat_c = static_cast<__nv_bfloat16*>(a.latent_cache) + (s * a.cap + p) * a.kv_lora;
  for (int i = tid; i < a.kv_lora; i += kCacheThreads) lat_c[i] = lat[i];
  if (a.key == nullptr) return;
  const int d = a.dim;
  const auto* key = static_cast<const __nv_bfloat16*>(a.key) + int64_t(r) * a.key_stride;
  const auto* gate = static_cast<const __nv_bfloat16*>(a.gate) + int64_t(r) * a.gate_stride;
  const auto* w = static_cast<const __nv_bfloat16*>(a.ln_w);
  const auto* b = static_cast<const __nv_bfloat16*>(a.ln_b);
  auto* key_c = static_cast<__nv_bfloat16*>(a.key_cache) + s * a.cap * d;
  auto* gate_c = static_cast<__nv_bfloat16*>(a.gate_cache) + s * a.cap * d;
  float sum = 0.0f;
  for (int c = tid; c < d; c += kCacheThreads) sum += bf(key, c);
  const float mean = __fdiv_rn(cache_block_sum(sum, red), float(d));
  float dev2 = 0.0f;
  for (int c = tid; c < d; c += kCacheThreads) {
    const float x = __fsub_rn(bf(key, c), mean);
    dev2 = __fmaf_rn(x, x, dev2);
  }
  const float rstd = rsqrtf(__fadd_rn(__fdiv_rn(cache_block_sum(dev2, red), float(d)), a.eps));
  for (int c = tid; c < d; c += kCacheThreads) {
    const float y = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(bf(key, c), mean), rstd), bf(w, c)), bf(b, c));
    key_c[p * d + c] = __float2bfloat16_rn(y);
    gate_c[p * d + c] = gate[c];
  }
  const int kp = a.kpool;
  if ((p + 1) % kp != 0) return;
  const int64_t j = p / kp, first = j * kp;
  auto* pool = static_cast<__nv_bfloat16*>(a.pool_cache) + (s * a.pools + j) * d;
  for (int c = tid; c < d; c += kCacheThreads) {  // this thread wrote channel c of row p above
    float mx = -INFINITY;
    for (int t = 0; t < kp; ++t) mx = fmaxf(mx, __fadd_rn(bf(gate_c, (first + t) * d + c), a.ape[t * d + c]));
    float total = 0.0f;
    for (int t = 0; t < kp; ++t)
      total = __fadd_rn(total, expf(__fsub_rn(__fadd_rn(bf(gate_c, (first + t) * d + c), a.ape[t * d + c]), mx)));
    float acc = 0.0f;
    for (int t = 0; t < kp; ++t) {
      const float e = expf(__fsub_rn(__fadd_rn(bf(gate_c, (first + t) * d + c), a.ape[t * d + c]), mx));
      const float wt = dev::round_bf16(__fdiv_rn(e, total));
      acc = __fadd_rn(acc, dev::round_bf16(__fmul_rn(wt, bf(key_c, (first + t) * d + c))));
    }
    pool[c] = __float2bfloat16_rn(acc);
  }
}

__global__ void __launch_bounds__(kSoftmaxWarps * 32) mla_softmax_kernel(const MlaSoftmax a) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kSoftmaxWarps + (threadIdx.x >> 5);
  if (row >= int64_t(a.streams) * a.heads) return;
  const int64_t stream = row / a.heads;
  const float* s = a.scores + row * a.span;
  __nv_bfloat16* o = static_cast<__nv_bfloat16*>(a.probs) + row * a.span;
  const bool* valid = a.valid != nullptr ? a.valid + stream * a.span : nullptr;
  int n = a.span;  // with a mask every column is looked at; else the visible prefix
  if (valid == nullptr) {
    const int64_t p1 = a.pos[stream] + 1, seen = a.tail ? p1 : p1 / a.kpool * a.kpool;
    n = int(seen < 0 ? 0 : (seen > a.span ? a.span : seen));
  }
  auto visible = [&](int j) { return j < n && (valid == nullptr || valid[j]); };
  float mx = -INFINITY;
  for (int j = lane; j < n; j += 32)
    if (visible(j)) mx = fmaxf(mx, __fmul_rn(s[j], a.scale));
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  float sum = 0.0f;
  for (int j = lane; j < n; j += 32)
    if (visible(j)) sum = __fadd_rn(sum, expf(__fsub_rn(__fmul_rn(s[j], a.scale), mx)));
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, d));
  const bool none = mx == -INFINITY;  // no visible column: NaN, as softmax over a row of -inf
  for (int j = lane; j < a.span; j += 32) {
    float v = 0.0f;
    if (none) v = __int_as_float(0x7fc00000);
    else if (visible(j)) v = __fdiv_rn(expf(__fsub_rn(__fmul_rn(s[j], a.scale), mx)), sum);
    o[j] = __float2bfloat16_rn(v);
  }
}

constexpr int kPickThreads = 256;

// A pool's score as a key whose unsigned order is topk_first's order of values: NaN as +inf, -0 as +0, and a pool
// that is not a candidate as the lowest finite fp32 (the torch path's masked_fill with finfo.min).
__device__ __forceinline__ uint32_t pick_key(float v, bool candidate) {
  if (!candidate) v = -3.4028234663852886e38f;
  if (isnan(v)) v = INFINITY;
  if (v == 0.0f) v = 0.0f;
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__global__ void __launch_bounds__(kPickThreads) mla_pick_kernel(const MlaPick a) {
  __shared__ int hist[256];
  __shared__ int warp_sums[kPickThreads / 32];
  __shared__ uint32_t s_digit;
  __shared__ int s_above;
  const int r = blockIdx.x, tid = threadIdx.x, P = a.pools, kp = a.kpool;
  const float* sc = a.scores + int64_t(r) * P;
  const int64_t pos = a.pos[r];
  // thread tid owns pools [lo, hi): contiguous, so block scans keep pool order
  const int per = (P + kPickThreads - 1) / kPickThreads, lo = min(P, tid * per), hi = min(P, lo + per);
  auto key = [&](int j) { return pick_key(sc[j], int64_t(j + 1) * kp - 1 <= pos); };
  uint32_t prefix = 0, mask = 0;
  int remaining = a.k;  // how many of the keys matching prefix are still to take (>= 1)
  for (int shift = 24; shift >= 0; shift -= 8) {
    hist[tid] = 0;  // kPickThreads == 256 bins
    __syncthreads();
    for (int j = lo; j < hi; ++j) {
      const uint32_t u = key(j);
      if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1);
    }
    __syncthreads();
    if (tid < 32) {  // the digit where the count from the top reaches remaining: lane l holds bins 255 - 8 l ...
      int c[8], sum = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += (c[i] = hist[255 - 8 * tid - i]);
      int incl = sum;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, d);
        if (tid >= d) incl += y;
      }
      const int excl = incl - sum;
      const unsigned hit = __ballot_sync(0xffffffffu, excl < remaining && incl >= remaining);
      if (tid == __ffs(hit) - 1) {
        int above = excl, i = 0;
        while (above + c[i] < remaining) above += c[i++];
        s_digit = uint32_t(255 - 8 * tid - i);
        s_above = above;
      }
    }
    __syncthreads();
    prefix |= s_digit << shift;
    mask |= 255u << shift;
    remaining -= s_above;
    __syncthreads();
  }
  // prefix is the k-th largest key; take every key above it and the first `remaining` equal to it, in pool order
  int eq = 0;
  for (int j = lo; j < hi; ++j) eq += key(j) == prefix;
  int total;
  const int eq_before = dev::block_exclusive_scan<kPickThreads>(eq, warp_sums, total);
  int take = 0;
  for (int j = lo, e = eq_before; j < hi; ++j) {
    const uint32_t u = key(j);
    if (u > prefix || (u == prefix && e++ < remaining)) ++take;
  }
  int at = dev::block_exclusive_scan<kPickThreads>(take, warp_sums, total);
  const int n_cols = (a.k + (a.tail ? 1 : 0)) * kp;
  int64_t* cols = a.cols + int64_t(r) * n_cols;
  bool* valid = a.valid + int64_t(r) * n_cols;
  for (int j = lo, e = eq_before; j < hi; ++j) {
    const uint32_t u = key(j);
    if (u > prefix || (u == prefix && e++ < remaining)) {
      const bool taken = int64_t(j + 1) * kp - 1 <= pos;
      for (int t = 0; t < kp; ++t) {
        cols[at * kp + t] = int64_t(j) * kp + t;
        valid[at * kp + t] = taken;
      }
      ++at;
    }
  }
  if (a.tail)
    for (int t = tid; t < kp; t += kPickThreads) {
      const int64_t c = (pos + 1) / kp * kp + t;
      cols[int64_t(a.k) * kp + t] = c < pos ? c : pos;
      valid[int64_t(a.k) * kp + t] = c <= pos;
    }
}

}  // namespace

void launch_mla_pick(const MlaPick& a, cudaStream_t stream) {
  if (a.streams <= 0) return;
  mla_pick_kernel<<<a.streams, kPickThreads, 0, stream>>>(a);
  ROCKET_LAUNCH_CHECK();
}

void launch_mla_cache_step(const MlaCacheStep& a, cudaStream_t stream) {
  if (a.rows <= 0) return;
  mla_cache_step_kernel<<<a.rows, kCacheThreads, 0, stream>>>(a);
  ROCKET_LAUNCH_CHECK();
}

void launch_mla_softmax(const MlaSoftmax& a, cudaStream_t stream) {
  const int64_t rows = int64_t(a.streams) * a.heads;
  if (rows <= 0) return;
  mla_softmax_kernel<<<unsigned((rows + kSoftmaxWarps - 1) / kSoftmaxWarps), kSoftmaxWarps * 32, 0, stream>>>(a);
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
