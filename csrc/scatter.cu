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
#include "common.cuh"

namespace rocket {
namespace {

constexpr int kScatterThreads = 256;
constexpr uint32_t kSumMod = 65521;
constexpr int kBatch = 8;  // rows of a token loaded together

template <int VEC>
__global__ void __launch_bounds__(kScatterThreads) scatter_add_kernel(
    const __nv_bfloat16* __restrict__ rows, const int64_t* __restrict__ by_token, const float* __restrict__ coef,
    __nv_bfloat16* __restrict__ out, int tokens, int topk, int hidden, const int* __restrict__ by_canon,
    unsigned long long* __restrict__ sum, const __nv_bfloat16* __restrict__ res0,
    const __nv_bfloat16* __restrict__ res1) {
  const int chunks = hidden / VEC;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = idx < int64_t(tokens) * chunks;
  long long check = 0;
  if (active) {
    const int64_t tok = idx / chunks;
    const int c = int(idx % chunks);
    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
    // Rows in batches of kBatch: the batch's indices, then its row loads, all in flight together, then the
    // adds in j order (one j after another the dependent loads cost two round trips per row: 6.1 us per
    // call at 8 tokens x top-8 on the H200, session 13's profile).
    for (int j0 = 0; j0 < topk; j0 += kBatch) {
      int64_t r[kBatch];
      float w[kBatch];
      __nv_bfloat16 x[kBatch][VEC];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        r[u] = j0 + u < topk ? by_token[tok * topk + j0 + u] : 0;
        w[u] = j0 + u < topk ? coef[tok * topk + j0 + u] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (j0 + u >= topk) continue;
        const __nv_bfloat16* src = rows + r[u] * hidden + int64_t(c) * VEC;
        if constexpr (VEC == 8) {
          *reinterpret_cast<uint4*>(x[u]) = __ldg(reinterpret_cast<const uint4*>(src));
        } else {
#pragma unroll
          for (int v = 0; v < VEC; ++v) x[u][v] = src[v];
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (j0 + u >= topk) continue;
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], __fmul_rn(w[u], __bfloat162float(x[u][v])));
        if (sum != nullptr) {  // launcher: rows x hidden < 2^31, so the flat index fits 32 bits
          uint32_t m = (uint32_t(by_canon[tok * topk + j0 + u]) * uint32_t(hidden) + uint32_t(c * VEC) + 1u) % kSumMod;
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            check += static_cast<long long>(static_cast<int16_t>(dev::bf16_bits(x[u][v]))) * (m + 1);
            m = m + 1 == kSumMod ? 0 : m + 1;
          }
        }
      }
    }
    __nv_bfloat16 o[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) o[v] = __float2bfloat16_rn(acc[v]);
    const int64_t at = tok * hidden + int64_t(c) * VEC;
    for (const __nv_bfloat16* res : {res0, res1}) {
      if (res == nullptr) break;
      __nv_bfloat16 r[VEC];
      if constexpr (VEC == 8) {
        *reinterpret_cast<uint4*>(r) = __ldg(reinterpret_cast<const uint4*>(res + at));
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) r[v] = res[at + v];
      }
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        o[v] = __float2bfloat16_rn(__fadd_rn(__bfloat162float(r[v]), __bfloat162float(o[v])));
    }
    __nv_bfloat16* dst = out + at;
    if constexpr (VEC == 8) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(o);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) dst[v] = o[v];
    }
  }
  if (sum == nullptr) return;
  __shared__ long long red[kScatterThreads / 32];
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) check += __shfl_xor_sync(0xffffffffu, check, d);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = check;
  __syncthreads();
  if (threadIdx.x == 0) {
    long long t = 0;
    for (int w = 0; w < kScatterThreads / 32; ++w) t += red[w];
    atomicAdd(sum, static_cast<unsigned long long>(t));  // integer: any order of blocks, same total
  }
}

}  // namespace

void launch_moe_scatter_add(const void* rows, int64_t n_rows, const int64_t* by_token, const float* coef,
                            void* out, int tokens, int topk, int hidden, const int* by_canon, int64_t* sum,
                            const void* const* res, int n_res, cudaStream_t stream) {
  ROCKET_CHECK(tokens >= 0 && topk >= 0 && hidden > 0, "tokens " << tokens << ", topk " << topk << ", hidden "
               << hidden);
  ROCKET_CHECK((by_canon == nullptr) == (sum == nullptr), "moe_scatter_add: by_canon and sum go together");
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
}

}  // namespace rocket
