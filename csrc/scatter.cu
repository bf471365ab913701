// moe_scatter_add: the one place expert rows become a token's MoE output (rocket_mpi/moe/scatter.py).
//
// Bitwise equal to the torch reference, which does `acc += coef[:, j] * rows[by_token[:, j]].float()`
// for j = 0..k-1 starting from zeros: a rounded fp32 multiply, then a rounded fp32 add, in j order,
// then one rounding to bf16. __fmul_rn / __fadd_rn keep nvcc from contracting them into an FMA,
// and acc starts at +0.0f and adds even the first product (0 + -0 = +0, as torch).
//
// With `sum` (the graphed step), the same pass also adds the rows' checksum (engine.row_sum: int16 words
// of canonical row i, column c, times ((i * n + c + 1) % 65521 + 1)) into *sum: every canonical row is
// read once by exactly one token, and integer adds give the same total in any order. That saves the
// step a separate kernel reading every row again (row_sums, 6 us per MoE layer on the H200).
//
// With residuals r0 (, r1) [T, H] bf16: out = r1 + (r0 + moe), each add torch's (the fp32 sum of two bf16, one
// rounding), so the graphed step's x + (routed + shared) needs no add kernels once the shared expert ran beside
// the routing (graph.py).
#include "norm.cuh"

namespace rocket {
namespace {

constexpr int kScatterThreads = 256;
constexpr uint32_t kSumMod = 65521;
constexpr int kBatch = 8;  // rows of a token loaded together

// Token tok's chunks c[i] (elements c[i] * VEC ..; valid[i] false: skipped) of one thread: the scatter's sum in j
// order, one rounding, then + each residual; `check` += the checksum terms of the rows it read. Every load is
// issued before the adds that need it: the residuals with the first batch's indices, then a batch's rows of all
// the thread's chunks together (a dependent chain of loads costs one L2 round trip each).
template <int VEC, int NV>
__device__ __forceinline__ void scatter_chunks(const __nv_bfloat16* __restrict__ rows,
                                               const int64_t* __restrict__ by_token, const float* __restrict__ coef,
                                               int64_t tok, const int (&c)[NV], const bool (&valid)[NV], int topk,
                                               int hidden, const int* __restrict__ by_canon, bool with_sum,
                                               const __nv_bfloat16* __restrict__ res0,
                                               const __nv_bfloat16* __restrict__ res1,
                                               __nv_bfloat16 (&o)[NV][VEC], long long& check) {
  auto load = [](__nv_bfloat16 (&dst)[VEC], const __nv_bfloat16* src) {
    if constexpr (VEC == 8) {
      *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) dst[v] = src[v];
    }
  };
  __nv_bfloat16 rv[2][NV][VEC];
  const __nv_bfloat16* res[2] = {res0, res1};
#pragma unroll
  for (int q = 0; q < 2; ++q)
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (res[q] != nullptr && valid[i]) load(rv[q][i], res[q] + tok * hidden + int64_t(c[i]) * VEC);
  float acc[NV][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[i][v] = 0.0f;
  for (int j0 = 0; j0 < topk; j0 += kBatch) {
    int64_t r[kBatch];
    float w[kBatch];
    int bc[kBatch];  // canonical rows: loaded with the indices, not after the rows
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      r[u] = j0 + u < topk ? by_token[tok * topk + j0 + u] : 0;
      w[u] = j0 + u < topk ? coef[tok * topk + j0 + u] : 0.0f;
      bc[u] = with_sum && j0 + u < topk ? by_canon[tok * topk + j0 + u] : 0;
    }
    __nv_bfloat16 x[kBatch][NV][VEC];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
#pragma unroll
      for (int i = 0; i < NV; ++i)
        if (j0 + u < topk && valid[i]) load(x[u][i], rows + r[u] * hidden + int64_t(c[i]) * VEC);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (j0 + u >= topk) continue;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if (!valid[i]) continue;
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[i][v] = __fadd_rn(acc[i][v], __fmul_rn(w[u], __bfloat162float(x[u][i][v])));
        if (with_sum) {  // launcher: rows x hidden < 2^31, so the flat index fits 32 bits
          uint32_t m = (uint32_t(bc[u]) * uint32_t(hidden) + uint32_t(c[i] * VEC) + 1u) % kSumMod;
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            check += static_cast<long long>(static_cast<int16_t>(dev::bf16_bits(x[u][i][v]))) * (m + 1);
            m = m + 1 == kSumMod ? 0 : m + 1;
          }
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < NV; ++i) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) o[i][v] = __float2bfloat16_rn(acc[i][v]);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      if (res[q] == nullptr) break;
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        o[i][v] = __float2bfloat16_rn(__fadd_rn(__bfloat162float(rv[q][i][v]), __bfloat162float(o[i][v])));
    }
  }
}

// The block's checksum terms into *sum (integer adds: any order of blocks, the same total).
template <int THREADS>
__device__ __forceinline__ void add_check(long long check, unsigned long long* sum) {
  __shared__ long long red[THREADS / 32];
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) check += __shfl_xor_sync(0xffffffffu, check, d);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = check;
  __syncthreads();
  if (threadIdx.x == 0) {
    long long t = 0;
    for (int w = 0; w < THREADS / 32; ++w) t += red[w];
    atomicAdd(sum, static_cast<unsigned long long>(t));
  }
}

template <int VEC>
__global__ void __launch_bounds__(kScatterThreads) scatter_add_kernel(
    const __nv_bfloat16* __restrict__ rows, const int64_t* __restrict__ by_token, const float* __restrict__ coef,
    __nv_bfloat16* __restrict__ out, int tokens, int topk, int hidden, const int* __restrict__ by_canon,
    unsigned long long* __restrict__ sum, const __nv_bfloat16* __restrict__ res0,
    const __nv_bfloat16* __restrict__ res1) {
  const int chunks = hidden / VEC;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  long long check = 0;
  if (idx < int64_t(tokens) * chunks) {
    const int64_t tok = idx / chunks;
    const int c[1] = {int(idx % chunks)};
    const bool valid[1] = {true};
    __nv_bfloat16 o[1][VEC];
    scatter_chunks<VEC, 1>(rows, by_token, coef, tok, c, valid, topk, hidden, by_canon, sum != nullptr, res0, res1, o,
                           check);
    __nv_bfloat16* dst = out + tok * hidden + int64_t(c[0]) * VEC;
    if constexpr (VEC == 8) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(o[0]);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) dst[v] = o[0][v];
    }
  }
  if (sum != nullptr) add_check<kScatterThreads>(check, sum);
}

// The scatter, then the next RMSNorm of the token's row (normed = rms_norm(out, norm_w)), in one launch: one block
// of dev::kNormThreads per token, thread tid scattering the NV chunks it then normalises, the chunks and the sum of
// squares of decode_ops.cu rms_norm_kernel<true> (norm.cuh): the same bits as the two launches. The norm's weights
// are loaded with the first loads.
template <int NV>
__global__ void __launch_bounds__(dev::kNormThreads) scatter_norm_kernel(
    const __nv_bfloat16* __restrict__ rows, const int64_t* __restrict__ by_token, const float* __restrict__ coef,
    __nv_bfloat16* __restrict__ out, int topk, int hidden, const int* __restrict__ by_canon,
    unsigned long long* __restrict__ sum, const __nv_bfloat16* __restrict__ res0,
    const __nv_bfloat16* __restrict__ res1, const __nv_bfloat16* __restrict__ norm_w, float eps,
    __nv_bfloat16* __restrict__ normed) {
  static_assert(NV >= 1 && NV <= dev::kNormVecs, "chunks per thread");
  __shared__ float red[32];
  const int64_t tok = blockIdx.x;
  int c[NV];
  bool valid[NV];
  uint4 wv[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    c[i] = i * dev::kNormThreads + threadIdx.x;  // chunk of 8
    valid[i] = c[i] * 8 < hidden;
    wv[i] = valid[i] ? __ldg(reinterpret_cast<const uint4*>(norm_w) + c[i]) : make_uint4(0, 0, 0, 0);
  }
  long long check = 0;
  __nv_bfloat16 o[NV][8];
  scatter_chunks<8, NV>(rows, by_token, coef, tok, c, valid, topk, hidden, by_canon, sum != nullptr, res0, res1, o,
                        check);
  float ss = 0.0f;
  uint4 v[dev::kNormVecs];
#pragma unroll
  for (int i = 0; i < dev::kNormVecs; ++i) {  // rms_norm_kernel's chunks past NV are past the row: zeros
    v[i] = make_uint4(0, 0, 0, 0);
    if (i < NV && valid[i]) {
      v[i] = *reinterpret_cast<const uint4*>(o[i]);
      *reinterpret_cast<uint4*>(out + tok * hidden + int64_t(c[i]) * 8) = v[i];
    }
    dev::sum_squares8(v[i], ss);
  }
  const float r = dev::norm_scale(dev::block_sum(ss, red), hidden, eps);
#pragma unroll
  for (int i = 0; i < NV; ++i)
    if (valid[i]) *reinterpret_cast<uint4*>(normed + tok * hidden + int64_t(c[i]) * 8) = dev::norm8(v[i], wv[i], r);
  if (sum != nullptr) add_check<dev::kNormThreads>(check, sum);
}

}  // namespace

void launch_moe_scatter_add(const void* rows, int64_t n_rows, const int64_t* by_token, const float* coef,
                            void* out, int tokens, int topk, int hidden, const int* by_canon, int64_t* sum,
                            const void* const* res, int n_res, cudaStream_t stream, const void* norm_w, float eps,
                            void* normed) {
  ROCKET_CHECK(tokens >= 0 && topk >= 0 && hidden > 0, "tokens " << tokens << ", topk " << topk << ", hidden "
               << hidden);
  ROCKET_CHECK((by_canon == nullptr) == (sum == nullptr), "moe_scatter_add: by_canon and sum go together");
  ROCKET_CHECK((norm_w == nullptr) == (normed == nullptr), "moe_scatter_add: norm_w and normed go together");
  ROCKET_CHECK(sum == nullptr || int64_t(tokens) * topk * hidden < (int64_t(1) << 31),
               "moe_scatter_add: " << tokens << " x " << topk << " rows of " << hidden << " exceed the checksum's "
               "32-bit index");
  (void)n_rows;  // indices are checked by the caller; kept for the interface
  ROCKET_CHECK(n_res >= 0 && n_res <= kMaxResiduals, "moe_scatter_add: " << n_res << " residuals (at most "
               << kMaxResiduals << ")");
  const auto* r0 = static_cast<const __nv_bfloat16*>(n_res > 0 ? res[0] : nullptr);
  const auto* r1 = static_cast<const __nv_bfloat16*>(n_res > 1 ? res[1] : nullptr);
  if (tokens == 0) return;
  const int threads = kScatterThreads;
  auto* s = reinterpret_cast<unsigned long long*>(sum);
  const auto* r = static_cast<const __nv_bfloat16*>(rows);
  auto* o = static_cast<__nv_bfloat16*>(out);
  bool vec = hidden % 8 == 0 && reinterpret_cast<uintptr_t>(rows) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(out) % 16 == 0;
  for (int i = 0; i < n_res; ++i) vec = vec && reinterpret_cast<uintptr_t>(res[i]) % 16 == 0;
  if (norm_w != nullptr && vec && dev::norm_vec_ok(hidden, out, norm_w, normed)) {  // one launch
    const int nv = (hidden / 8 + dev::kNormThreads - 1) / dev::kNormThreads;
    const auto* nw = static_cast<const __nv_bfloat16*>(norm_w);
    auto* no = static_cast<__nv_bfloat16*>(normed);
#define ROCKET_SCATTER_NORM(NV)                                                                                    \
  scatter_norm_kernel<NV><<<unsigned(tokens), dev::kNormThreads, 0, stream>>>(r, by_token, coef, o, topk, hidden, \
                                                                              by_canon, s, r0, r1, nw, eps, no)
    if (nv <= 1) ROCKET_SCATTER_NORM(1);
    else if (nv == 2) ROCKET_SCATTER_NORM(2);
    else if (nv == 3) ROCKET_SCATTER_NORM(3);
    else ROCKET_SCATTER_NORM(4);
#undef ROCKET_SCATTER_NORM
    ROCKET_LAUNCH_CHECK();
    return;
  }
  if (vec) {
    const int64_t n = int64_t(tokens) * (hidden / 8);
    scatter_add_kernel<8><<<unsigned((n + threads - 1) / threads), threads, 0, stream>>>(r, by_token, coef, o,
                                                                                         tokens, topk, hidden,
                                                                                         by_canon, s, r0, r1);
  } else {
    const int64_t n = int64_t(tokens) * hidden;
    scatter_add_kernel<1><<<unsigned((n + threads - 1) / threads), threads, 0, stream>>>(r, by_token, coef, o,
                                                                                         tokens, topk, hidden,
                                                                                         by_canon, s, r0, r1);
  }
  ROCKET_LAUNCH_CHECK();
  if (norm_w != nullptr) launch_rms_norm(out, norm_w, normed, tokens, hidden, eps, stream);  // the same as fused
}

}  // namespace rocket
