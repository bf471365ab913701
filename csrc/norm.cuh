// The pieces of the decode step's RMSNorm (decode_ops.cu rms_norm_kernel), shared with the kernels that end in
// one (scatter.cu: the MoE scatter followed by the next layer's input norm), so a fused kernel computes the same
// bits as the separate launches by construction: one block of kNormThreads per row, thread tid holds the 16-byte
// chunks (i * kNormThreads + tid) * 8 for i < kNormVecs, squares summed in that order, then block_sum.
#pragma once

#include "common.cuh"

namespace rocket {
namespace dev {

constexpr int kNormThreads = 256;
constexpr int kNormVecs = 4;  // rows of up to kNormThreads * 8 * kNormVecs elements stay in registers

// Every thread gets the block's total, summed in the same order (warp butterflies, then warps in order).
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

// ss += x * x over the 8 bf16 of v, in element order.
__device__ __forceinline__ void sum_squares8(const uint4& v, float& ss) {
  const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
  for (int j = 0; j < 8; ++j) ss = __fmaf_rn(__bfloat162float(e[j]), __bfloat162float(e[j]), ss);
}

// 1 / sqrt(mean of squares + eps) from the row's sum of squares.
__device__ __forceinline__ float norm_scale(float total, int n, float eps) {
  return rsqrtf(__fadd_rn(__fdiv_rn(total, float(n)), eps));
}

// bf16(w * bf16(x * r)) of 8 elements (transformers' order).
__device__ __forceinline__ uint4 norm8(const uint4& v, const uint4& wv, float r) {
  const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
  const __nv_bfloat16* we = reinterpret_cast<const __nv_bfloat16*>(&wv);
  uint4 ov;
  __nv_bfloat16* oe = reinterpret_cast<__nv_bfloat16*>(&ov);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float y = round_bf16(__fmul_rn(__bfloat162float(e[j]), r));
    oe[j] = __float2bfloat16_rn(__fmul_rn(__bfloat162float(we[j]), y));
  }
  return ov;
}

// Where the vector kernel (and so a fused one) applies: n % 8 == 0, the row fits the registers, 16-byte aligned.
inline bool norm_vec_ok(int64_t n, const void* x, const void* w, const void* out) {
  return n % 8 == 0 && n <= int64_t(kNormThreads) * 8 * kNormVecs && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
}

}  // namespace dev
}  // namespace rocket
