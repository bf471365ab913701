// cuda-ipc exchange in one kernel, so a whole decode step (rows and flag words) fits in a CUDA graph
// (ipc_exchange_flags in bindings.cpp, the graphed step's exchange).
//
// push: every block copies its share of this rank's block (meta[2] rows, in slot space set meta[3]) from `src`
//       into the same place of every rank's row buffer (peers mapped through CUDA IPC, so the stores travel over
//       NVLink), fences its own stores at system scope and then writes the layer's seq (meta[4]) into its own flag
//       word on every peer (release, system scope): flags [sender][kIpcMaxBlocks] on each receiver. A peer that
//       reads a block's seq also reads that block's rows (the threadfence pattern); no counter, no last block.
// wait: block 0 then spins (acquire, system scope) on every peer's flag words of this seq, one thread each, bounded
//       by a timeout read from %globaltimer. On expiry it records (1, peer, seq, layer) in `err` and returns; later
//       waits see err set and return at once, so a dead peer costs one timeout per step, and the host reads err
//       after the step and names them.
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

// This block's share of the rows: uint4 i of the message to word `first + i` of every rank's buffer (ours
// included), grid-strided, kUnroll loads in flight per thread before their stores (the stores over NVLink and the
// round trip's fixed latency set the time, not the loads, so more blocks do not help).
constexpr int kUnroll = 4;
__device__ __forceinline__ void push_rows(const IpcPush& a, int64_t words, int64_t first) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < words; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = a.src[i + u * stride];
    for (int r = 0; r < a.n_ranks; ++r) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) a.dst[r][first + i + u * stride] = v[u];
    }
  }
  for (; i < words; i += stride) {
    const uint4 v = a.src[i];
    for (int r = 0; r < a.n_ranks; ++r) a.dst[r][first + i] = v;
  }
}

// Spin until `word` (written by `peer`) reaches the layer's seq, or time out.
__device__ __forceinline__ void wait_word(const IpcWait& a, const int64_t* word, int peer) {
  const int64_t seq = a.meta[4];
  const uint64_t t0 = dev::globaltimer_ns();
  for (uint32_t spin = 0;; ++spin) {
    if (load_acquire_sys(word) >= seq) return;
    if ((spin & 255) == 0) {
      if (*reinterpret_cast<volatile int64_t*>(a.err) != 0) return;  // a peer already timed out this step
      if (dev::globaltimer_ns() - t0 > a.timeout_ns) {
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

// The block's threads over every (peer, block) flag word of the exchange.
__device__ __forceinline__ void wait_flags(const IpcWait& a) {
  const int n = a.n_ranks * a.blocks;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int peer = i / a.blocks, b = i % a.blocks;
    if (peer != a.rank) wait_word(a, a.bells + peer * kIpcMaxBlocks + b, peer);
  }
}

// a.bells[r]: rank r's flag words for this sender ([kIpcMaxBlocks]); w.bells: ours, [sender][kIpcMaxBlocks].
__global__ void ipc_exchange_flags_kernel(const IpcPush a, const IpcWait w) {
  const int64_t rows = a.meta[2], set = a.meta[3];
  const int64_t words = rows * a.row_words;
  const int64_t first = set * a.set_words + int64_t(a.rank) * a.cap_words;
  push_rows(a, words, first);
  __threadfence_system();  // each thread's stores, before the block's flags (the threadfence pattern)
  __syncthreads();
  const int64_t seq = a.meta[4];
  for (int r = threadIdx.x; r < a.n_ranks; r += blockDim.x)
    if (r != a.rank) store_release_sys(a.bells[r] + blockIdx.x, seq);
  if (blockIdx.x == 0) wait_flags(w);
}

}  // namespace

void launch_ipc_exchange_flags(const IpcPush& a, const IpcWait& w, int blocks, cudaStream_t stream) {
  ROCKET_CHECK(a.n_ranks >= 1 && a.n_ranks <= kPlanMaxRanks && a.rank >= 0 && a.rank < a.n_ranks,
               "rank " << a.rank << " of " << a.n_ranks);
  ROCKET_CHECK(blocks >= 1 && blocks <= kIpcMaxBlocks, "blocks " << blocks << " (flag words for " << kIpcMaxBlocks
               << " per sender)");
  ROCKET_CHECK(w.blocks == blocks && w.rank == a.rank && w.n_ranks == a.n_ranks && w.meta == a.meta,
               "push and wait of one exchange disagree on blocks, rank, ranks or meta");
  ipc_exchange_flags_kernel<<<blocks, 512, 0, stream>>>(a, w);
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
