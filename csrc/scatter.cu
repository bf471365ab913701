// moe_scatter_add: the one place expert rows become a token's MoE output (rocket_mpi/moe/scatter.py).
//
// Bitwise equal to the torch reference, which does `acc += coef[:, j] * rows[by_token[:, j]].float()`
// for j = 0..k-1 starting from zeros: a rounded fp32 multiply, then a rounded fp32 add, in j order,
// then one rounding to bf16. __fmul_rn / __fadd_rn keep nvcc from contracting them into an FMA,
// and acc starts at +0.0f and adds even the first product (0 + -0 = +0, as torch).
#include "common.cuh"

namespace rocket {
namespace {

template <int VEC>
__global__ void scatter_add_kernel(const __nv_bfloat16* __restrict__ rows, const int64_t* __restrict__ by_token,
                                   const float* __restrict__ coef, __nv_bfloat16* __restrict__ out, int tokens,
                                   int topk, int hidden) {
  const int chunks = hidden / VEC;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(tokens) * chunks) return;
  const int64_t tok = idx / chunks;
  const int c = int(idx % chunks);
  float acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
  for (int j = 0; j < topk; ++j) {
    const int64_t r = by_token[tok * topk + j];
    const float w = coef[tok * topk + j];
    const __nv_bfloat16* src = rows + r * hidden + int64_t(c) * VEC;
    __nv_bfloat16 x[VEC];
    if constexpr (VEC == 8) {
      *reinterpret_cast<uint4*>(x) = __ldg(reinterpret_cast<const uint4*>(src));
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) x[v] = src[v];
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], __fmul_rn(w, __bfloat162float(x[v])));
  }
  __nv_bfloat16 o[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) o[v] = __float2bfloat16_rn(acc[v]);
  __nv_bfloat16* dst = out + tok * hidden + int64_t(c) * VEC;
  if constexpr (VEC == 8) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(o);
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) dst[v] = o[v];
  }
}

}  // namespace

void launch_moe_scatter_add(const void* rows, int64_t n_rows, const int64_t* by_token, const float* coef,
                            void* out, int tokens, int topk, int hidden, cudaStream_t stream) {
  ROCKET_CHECK(tokens >= 0 && topk >= 0 && hidden > 0, "tokens " << tokens << ", topk " << topk << ", hidden "
               << hidden);
  (void)n_rows;  // indices are checked by the caller; kept for the interface
  if (tokens == 0) return;
  const int threads = 256;
  const auto* r = static_cast<const __nv_bfloat16*>(rows);
  auto* o = static_cast<__nv_bfloat16*>(out);
  const bool vec = hidden % 8 == 0 && reinterpret_cast<uintptr_t>(rows) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (vec) {
    const int64_t n = int64_t(tokens) * (hidden / 8);
    scatter_add_kernel<8><<<unsigned((n + threads - 1) / threads), threads, 0, stream>>>(r, by_token, coef, o,
                                                                                         tokens, topk, hidden);
  } else {
    const int64_t n = int64_t(tokens) * hidden;
    scatter_add_kernel<1><<<unsigned((n + threads - 1) / threads), threads, 0, stream>>>(r, by_token, coef, o,
                                                                                         tokens, topk, hidden);
  }
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
