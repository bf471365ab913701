// cuda-ipc exchange as two kernels, so a whole decode step (rows and doorbells) fits in a CUDA graph.
//
// push: copy this rank's block (meta[2] rows, in slot space set meta[3]) from `src` into the same place
//       of every rank's row buffer (peers mapped through CUDA IPC, so the stores travel over NVLink),
//       then ring each peer's doorbell word for this rank with the layer's seq (meta[4]). Every block
//       fences its stores at system scope and bumps a counter; the last block to arrive rings: the
//       classic threadfence pattern, so a peer that reads seq also reads the rows.
// wait: one lane per peer spins (acquire, system scope) on this rank's doorbell word for that peer
//       until it reaches seq, bounded by a timeout read from %globaltimer. On expiry it records
//       (1, peer, seq, layer) in `err` and returns; later waits see err set and return at once, so a
//       dead peer costs one timeout per step, and the host reads err after the step and names them.
#include "common.cuh"

namespace rocket {
namespace {

__device__ __forceinline__ void store_release_sys(int64_t* p, int64_t v) {
  asm volatile("st.release.sys.global.s64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int64_t load_acquire_sys(const int64_t* p) {
  int64_t v;
  asm volatile("ld.acquire.sys.global.s64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(t));
  return t;
}

__global__ void ipc_push_kernel(const IpcPush a) {
  const int64_t rows = a.meta[2], set = a.meta[3];
  const int64_t words = rows * a.row_words;                    // uint4 per block
  const int64_t first = set * a.set_words + int64_t(a.rank) * a.cap_words;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = a.src[w];
    for (int r = 0; r < a.n_ranks; ++r) a.dst[r][first + w] = v;
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned arrived = atomicAdd(a.counter, 1u);
    if (arrived == gridDim.x - 1) {  // every block's stores are fenced: ring
      *a.counter = 0;                // for the next push (stream order: no other push runs now)
      __threadfence_system();
      const int64_t seq = a.meta[4];
      for (int r = 0; r < a.n_ranks; ++r)
        if (r != a.rank) store_release_sys(a.bells[r], seq);
    }
  }
}

__global__ void ipc_wait_kernel(const IpcWait a) {
  const int peer = threadIdx.x;
  if (peer >= a.n_ranks || peer == a.rank) return;
  const int64_t seq = a.meta[4];
  const uint64_t t0 = globaltimer_ns();
  for (uint32_t spin = 0;; ++spin) {
    if (load_acquire_sys(a.bells + peer) >= seq) return;
    if ((spin & 255) == 0) {
      if (*reinterpret_cast<volatile int64_t*>(a.err) != 0) return;  // a peer already timed out this step
      if (globaltimer_ns() - t0 > a.timeout_ns) {
        if (atomicCAS(reinterpret_cast<unsigned long long*>(a.err), 0ull, 1ull) == 0ull) {
          a.err[1] = peer;
          a.err[2] = seq;
          a.err[3] = a.layer;
        }
        return;
      }
    }
  }
}

}  // namespace

void launch_ipc_push(const IpcPush& a, int blocks, cudaStream_t stream) {
  ROCKET_CHECK(a.n_ranks >= 1 && a.n_ranks <= kPlanMaxRanks && a.rank >= 0 && a.rank < a.n_ranks,
               "rank " << a.rank << " of " << a.n_ranks);
  ROCKET_CHECK(blocks >= 1 && blocks <= 1024, "blocks " << blocks);
  ipc_push_kernel<<<blocks, 512, 0, stream>>>(a);
  ROCKET_LAUNCH_CHECK();
}

void launch_ipc_wait(const IpcWait& a, cudaStream_t stream) {
  ROCKET_CHECK(a.n_ranks >= 1 && a.n_ranks <= 32 && a.rank >= 0 && a.rank < a.n_ranks,
               "rank " << a.rank << " of " << a.n_ranks << " (the wait kernel has one lane per peer, 32 at most)");
  ipc_wait_kernel<<<1, 32, 0, stream>>>(a);
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
