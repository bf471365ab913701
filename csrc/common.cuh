// Device helpers shared by the kernels: async copies, the bf16 tensor-core mma, bit casts.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "rocket.h"

#define ROCKET_LAUNCH_CHECK() ROCKET_CUDA_CHECK(cudaGetLastError())

namespace rocket {
namespace dev {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 B global -> shared, L1 bypassed: weights are read once per launch.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
}

// An L2 policy for data read once per launch: evicted first, so the weight stream does not push the
// rows (read by every block of an expert) out of L2.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// 16 B global -> shared, L1 bypassed, with an L2 cache policy.
__device__ __forceinline__ void cp_async_16_stream(void* smem, const void* gmem, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "l"(policy)
               : "memory");
}

// 8 B global -> shared (.ca: the 4 lanes of a row group read the same 8 bytes).
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
}

// Programmatic dependent launch (sm_90). launch_dependents: the next kernel in the stream, if launched with
// cudaLaunchAttributeProgrammaticStreamSerialization, may start once every block of this grid has passed
// here or exited. grid_dependency_wait: wait until the grid this one depends on has completed and its
// memory is visible; returns at once when this kernel was launched without the attribute.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// p, through an empty volatile asm: the compiler must treat the result as unknown until that point, so loads
// through it stay after every volatile asm before the call (grid_dependency_wait), __ldg's too, which LLVM may
// otherwise move above an asm's "memory" clobber (it marks them invariant).
template <typename T>
__device__ __forceinline__ T* opaque(T* p) {
  asm volatile("" : "+l"(p));
  return p;
}

// The GPU's nanosecond clock (timeouts of spin waits).
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(t));
  return t;
}

// A warp's stores published to other blocks: each lane orders its earlier stores before lane 0's release add
// on `counter` (a reader that acquires the count sees them, through the async proxy too: bulk copies).
__device__ __forceinline__ void warp_release_add(int* counter, int lane) {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  __threadfence();
  __syncwarp();
  if (lane == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

// Spin (one thread) until *counter >= need, acquiring what its adders published, for the generic and the async
// proxy (bulk copies issued after it). Only another grid's progress can end it, so a count that never comes is a
// bug: after timeout_ns the kernel traps (a launch failure the host reports) instead of hanging.
__device__ __forceinline__ void wait_count(const int* counter, int need, uint64_t timeout_ns) {
  const uint64_t t0 = globaltimer_ns();
  for (uint32_t spin = 0;; ++spin) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
    if (v >= need) break;
    __nanosleep(32);
    if ((spin & 1023) == 1023 && globaltimer_ns() - t0 > timeout_ns) __trap();
  }
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// mbarriers (sm_90) for a block-wide ring filled by bulk copies (the TMA engine): init by one thread, then
// fence_barrier_init and a block barrier before any use.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrive once, announcing `bytes` more to come by bulk copies that complete_tx on this barrier.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
// Arrive once (release: this thread's earlier shared memory reads are done before the phase can complete).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Wait until the phase of parity `parity` has completed (acquire).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> this block's shared memory by the TMA
// engine; completes `bytes` of the barrier's expected transaction count.
__device__ __forceinline__ void bulk_copy_g2s(void* smem, const void* gmem, int bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(smem)),
               "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// D = A(16x16 bf16, row) * B(16x8 bf16, col) + C, fp32 accumulate. Fragment layout (PTX ISA,
// mma.m16n8k16 .bf16), lane = 4g + t:
//   a0: (g, 2t..2t+1)  a1: (g+8, 2t..2t+1)  a2: (g, 2t+8..2t+9)  a3: (g+8, 2t+8..2t+9)
//   b0: (k 2t..2t+1, n g)  b1: (k 2t+8..2t+9, n g)
//   c0, c1: (g, 2t), (g, 2t+1)  c2, c3: (g+8, 2t), (g+8, 2t+1)
// Each output element is its own dot product: nothing in column n depends on another column.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Warpgroup mma (sm_90a only: ROCKET_WGMMA; the host launches the kernels that use it on sm_90 GPUs only). The four
// warps of a warpgroup issue each instruction together: d (64 x N, fp32) += A (64 x 16 bf16, warp w's rows 16w..16w+15
// in mma_bf16_16816's A fragment layout, in registers) x B (16 x N bf16, shared memory, `desc`). Warp w's accumulators
// are mma_bf16_16816's c fragments of its 16 rows, n-tile j at d[j]. scripts/probe_wgmma.cu: the sums equal a
// sequence of mma_bf16_16816 over the same k-steps, bit for bit (N = 8, 16, 32).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ROCKET_WGMMA 1
#else
#define ROCKET_WGMMA 0
#endif

// B as 8 x 8 core matrices without swizzle, k-major: row n of a core matrix at 16 n bytes, its 8 k contiguous; the
// next core matrix in k `lbo` bytes on, in n `sbo` bytes on (PTX ISA, matrix descriptor; addresses in 16 B units).
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((saddr >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32);
}

#if ROCKET_WGMMA
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// The accumulators are written asynchronously: after wgmma_wait, this keeps the compiler from reading them earlier.
template <int RT>
__device__ __forceinline__ void wgmma_fence_acc(float (&d)[RT][4]) {
#pragma unroll
  for (int j = 0; j < RT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) asm volatile("" : "+f"(d[j][c])::"memory");
}

// d += A x B, N = 8 RT (one n-tile of 8 rows per RT).
template <int RT>
__device__ __forceinline__ void wgmma_bf16(float (&d)[RT][4], const uint32_t (&a)[4], uint64_t b);
template <>
__device__ __forceinline__ void wgmma_bf16<1>(float (&d)[1][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_bf16<2>(float (&d)[2][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, "
      "0;\n}"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_bf16<3>(float (&d)[3][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11}, "
      "{%12,%13,%14,%15}, %16, p, 1, 1, 0;\n}"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_bf16<4>(float (&d)[4][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
      "{%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
#endif

// d = f(a, b, c) bitwise, f given by its truth table (a = 0xF0, b = 0xCC, c = 0xAA). Written out
// because ptxas splits `(a & K1) | K2` into two LOP3 when both constants are immediates.
template <int LUT>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return d;
}

__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 bits_bf16x2(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }
__device__ __forceinline__ uint32_t bf16_bits(__nv_bfloat16 v) { return *reinterpret_cast<uint16_t*>(&v); }

// float -> bf16 -> float: round to nearest even, as torch's .to(torch.bfloat16).
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Exclusive prefix sum of one value per thread over a block of kThreads threads (a multiple of 32, at most 1024), in
// thread order; `total` gets the block's sum, in every thread. warp_sums: kThreads / 32 values of shared memory, free
// for the caller again when this returns. For integers (exact sums: the order of the additions does not matter).
template <int kThreads, typename T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* warp_sums, T& total) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 32");
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += y;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    T w = lane < kWarps ? warp_sums[lane] : T(0);
#pragma unroll
    for (int d = 1; d < kWarps; d <<= 1) {
      const T y = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += y;
    }
    if (lane < kWarps) warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  total = warp_sums[kWarps - 1];
  const T before = warp == 0 ? T(0) : warp_sums[warp - 1];
  __syncthreads();
  return before + incl - v;
}

}  // namespace dev
}  // namespace rocket
