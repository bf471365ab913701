// Whether a warpgroup mma gives the expert kernel's bits: wgmma (m64nNk16, bf16 in, fp32 accumulate, A in registers
// in the mma.sync fragment layout, B in shared memory as 8x8 core matrices without swizzle) against mma.sync m16n8k16
// (csrc/nvfp4_experts.cu's instruction) on the same A, B and k order, N = 8, 16, 32, K = 16 * S summed over S
// instructions, 50 random trials each with wide exponents. A kernel that takes wgmma for some row counts and mma.sync
// for others keeps a row's bits whatever the batch only if the two agree bit for bit. The wgmma layout is checked
// against a double-precision sum first (two descriptor offset orders tried; the one that matches is reported).
// Standalone (run on an H100/H200): nvcc -O3 -gencode=arch=compute_90a,code=sm_90a scripts/probe_wgmma.cu -o
// probe_wgmma && ./probe_wgmma
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <cmath>
#include <vector>
#include <random>

constexpr int M = 64, S = 8, K = 16 * S, NMAX = 32;

__device__ __forceinline__ uint32_t pack2(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return uint32_t(__bfloat16_as_ushort(lo)) | (uint32_t(__bfloat16_as_ushort(hi)) << 16);
}

// A fragment of mma m16n8k16 for rows r0..r0+15, k0..k0+15 of A [M, K] row-major
__device__ void a_frag(const __nv_bfloat16* A, int r0, int k0, int lane, uint32_t a[4]) {
  const int g = lane >> 2, t = lane & 3;
  auto at = [&](int r, int k) { return A[(r0 + r) * K + k0 + k]; };
  a[0] = pack2(at(g, 2 * t), at(g, 2 * t + 1));
  a[1] = pack2(at(g + 8, 2 * t), at(g + 8, 2 * t + 1));
  a[2] = pack2(at(g, 2 * t + 8), at(g, 2 * t + 9));
  a[3] = pack2(at(g + 8, 2 * t + 8), at(g + 8, 2 * t + 9));
}

// mma.sync reference: warp w rows 16w.., n8 tiles, S k-steps in order
template <int N>
__global__ void mma_kernel(const __nv_bfloat16* A, const __nv_bfloat16* B /* [N, K] */, float* D /* [M, N] */) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  float c[N / 8][4] = {};
  for (int s = 0; s < S; ++s) {
    uint32_t a[4];
    a_frag(A, 16 * w, 16 * s, lane, a);
    for (int j = 0; j < N / 8; ++j) {
      const __nv_bfloat16* b = B + (8 * j + g) * K + 16 * s;
      const uint32_t b0 = pack2(b[2 * t], b[2 * t + 1]), b1 = pack2(b[2 * t + 8], b[2 * t + 9]);
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};"
                   : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
  }
  for (int j = 0; j < N / 8; ++j) {
    const int r = 16 * w + g, col = 8 * j + 2 * t;
    D[r * N + col] = c[j][0];
    D[r * N + col + 1] = c[j][1];
    D[(r + 8) * N + col] = c[j][2];
    D[(r + 8) * N + col + 1] = c[j][3];
  }
}

__device__ __forceinline__ uint64_t desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return uint64_t((addr >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32);  // base offset 0, layout 0: no swizzle
}

template <int N> struct Wg;
template <> struct Wg<8> {
  static __device__ void mma(float (&d)[4], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
};
template <> struct Wg<16> {
  static __device__ void mma(float (&d)[8], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, "
                 "%12, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
};
template <> struct Wg<32> {
  static __device__ void mma(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,"
                 "%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
};

// B [N, K] (k contiguous) into shared memory as 8x8 core matrices: core (nb, kb) at (nb * (K / 8) + kb) * 128 bytes,
// its row n at + 16 n. Core matrices adjacent in K are 128 bytes apart, in N K / 8 * 128.
template <int N>
__global__ void wgmma_kernel(const __nv_bfloat16* A, const __nv_bfloat16* B, float* D, int swap_offsets) {
  __shared__ __align__(128) __nv_bfloat16 sb[NMAX * K];
  for (int i = threadIdx.x; i < N * K; i += blockDim.x) {
    const int n = i / K, k = i % K;
    sb[((n / 8) * (K / 8) + k / 8) * 64 + (n % 8) * 8 + k % 8] = B[i];
  }
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  float d[N / 2] = {};
  const uint32_t kstep = 128, nstep = (K / 8) * 128;
  for (int s = 0; s < S; ++s) {
    uint32_t a[4];
    a_frag(A, 16 * w, 16 * s, lane, a);
    const void* base = sb + (2 * s) * 64;  // k-block 2s (16 k per step)
    const uint64_t b = swap_offsets ? desc(base, nstep, kstep) : desc(base, kstep, nstep);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    Wg<N>::mma(d, a, b);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
  for (int j = 0; j < N / 8; ++j) {
    const int r = 16 * w + g, col = 8 * j + 2 * t;
    D[r * N + col] = d[4 * j + 0];
    D[r * N + col + 1] = d[4 * j + 1];
    D[(r + 8) * N + col] = d[4 * j + 2];
    D[(r + 8) * N + col + 1] = d[4 * j + 3];
  }
}

template <int N>
bool run(int trial, std::mt19937& gen, int& layout) {
  std::vector<__nv_bfloat16> hA(M * K), hB(N * K);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> ex(-12, 12);
  for (auto& v : hA) v = __float2bfloat16(nd(gen) * std::ldexp(1.f, ex(gen)));  // wide exponents: rounding shows
  for (auto& v : hB) v = __float2bfloat16(nd(gen) * std::ldexp(1.f, ex(gen) / 3));
  __nv_bfloat16 *dA, *dB;
  float *dD1, *dD2;
  cudaMalloc(&dA, M * K * 2); cudaMalloc(&dB, N * K * 2); cudaMalloc(&dD1, M * N * 4); cudaMalloc(&dD2, M * N * 4);
  cudaMemcpy(dA, hA.data(), M * K * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dB, hB.data(), N * K * 2, cudaMemcpyHostToDevice);
  std::vector<float> ref(M * N), mag(M * N), h1(M * N), h2(M * N);
  for (int r = 0; r < M; ++r)
    for (int n = 0; n < N; ++n) {
      double s = 0, m = 0;
      for (int k = 0; k < K; ++k) {
        const double p = double(__bfloat162float(hA[r * K + k])) * __bfloat162float(hB[n * K + k]);
        s += p; m += std::fabs(p);
      }
      ref[r * N + n] = float(s); mag[r * N + n] = float(m);
    }
  mma_kernel<N><<<1, 128>>>(dA, dB, dD1);
  cudaMemcpy(h1.data(), dD1, M * N * 4, cudaMemcpyDeviceToHost);
  auto close = [&](const std::vector<float>& h) {
    for (int i = 0; i < M * N; ++i)
      if (!(std::fabs(h[i] - ref[i]) <= 1e-3f * mag[i] + 1e-30f)) return false;
    return true;
  };
  bool ok = false;
  for (int sw = 0; sw < 2 && !ok; ++sw) {
    if (layout >= 0 && sw != layout) continue;
    wgmma_kernel<N><<<1, 128>>>(dA, dB, dD2, sw);
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) { printf("N=%d: %s\n", N, cudaGetErrorString(e)); return false; }
    cudaMemcpy(h2.data(), dD2, M * N * 4, cudaMemcpyDeviceToHost);
    if (close(h2)) { ok = true; layout = sw; }
  }
  const bool mma_ok = close(h1);
  int diff = 0;
  float worst = 0;
  for (int i = 0; i < M * N; ++i) {
    if (__builtin_memcmp(&h1[i], &h2[i], 4)) ++diff;
    worst = std::fmax(worst, std::fabs(h1[i] - h2[i]) / (mag[i] + 1e-30f));
  }
  if (trial == 0 || diff)
    printf("N=%2d trial %d: mma.sync within tolerance of the reference: %s; wgmma: %s (descriptor layout %d); "
           "%d of %d sums differ from mma.sync's bits (worst |diff| / sum|p| %.3g)\n",
           N, trial, mma_ok ? "yes" : "NO", ok ? "yes" : "NO", layout, diff, M * N, worst);
  cudaFree(dA); cudaFree(dB); cudaFree(dD1); cudaFree(dD2);
  return ok && mma_ok && diff == 0;
}

int main() {
  std::mt19937 gen(7);
  int layout = -1;
  for (int n : {8, 16, 32}) {
    int equal = 0, trials = 50;
    for (int i = 0; i < trials; ++i)
      equal += n == 8 ? run<8>(i, gen, layout) : n == 16 ? run<16>(i, gen, layout) : run<32>(i, gen, layout);
    printf("N=%d: %d of %d trials bitwise equal to mma.sync (K=%d, %d rows)\n", n, equal, trials, K, M);
  }
  return 0;
}
