// cuda-ipc exchange in kernels, so a whole decode step (rows and doorbells) fits in a CUDA graph: push and
// wait as two kernels, or fused into one (the ringing block waits; ipc_exchange in bindings.cpp).
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
// flags (ipc_exchange_flags, the graphed step's exchange): no counter and no last block. Every block
//       fences its own stores and then writes seq into its own flag word on every peer (release, system
//       scope): flags [sender][kIpcMaxBlocks] on each receiver. Block 0 then waits for every peer's flag
//       words of this seq, one thread each. Against the doorbell version this drops the atomic counter
//       that serialises the blocks and the second system fence of the ringing block.
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
// included), grid-strided, kUnroll loads in flight per thread before their stores. (Session 15: 4 MiB in
// 17.7-19.2 us against 18.5-19.7 us with one load in flight, and no gain from 128 blocks instead of 32: the
// stores over NVLink and the fixed ~4 us of the round trip set the time, not the loads.)
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

// One lane per peer: its doorbell word.
__device__ __forceinline__ void wait_peer(const IpcWait& a, int peer) {
  if (peer >= a.n_ranks || peer == a.rank) return;
  wait_word(a, a.bells + peer, peer);
}

// The block's threads over every (peer, block) flag word of the exchange.
__device__ __forceinline__ void wait_flags(const IpcWait& a) {
  const int n = a.n_ranks * a.blocks;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int peer = i / a.blocks, b = i % a.blocks;
    if (peer != a.rank) wait_word(a, a.bells + peer * kIpcMaxBlocks + b, peer);
  }
}

// kWait: the block that rings (the last to finish its stores) then waits for the peers itself, so the
// exchange is one kernel (one graph node) instead of push + wait.
template <bool kWait>
__global__ void ipc_push_kernel(const IpcPush a, const IpcWait w) {
  __shared__ int last;
  const int64_t rows = a.meta[2], set = a.meta[3];
  const int64_t words = rows * a.row_words;                    // uint4 per block
  const int64_t first = set * a.set_words + int64_t(a.rank) * a.cap_words;
  push_rows(a, words, first);
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned arrived = atomicAdd(a.counter, 1u);
    last = arrived == gridDim.x - 1;
    if (last) {                      // every block's stores are fenced: ring
      *a.counter = 0;                // for the next push (stream order: no other push runs now)
      __threadfence_system();
      const int64_t seq = a.meta[4];
      for (int r = 0; r < a.n_ranks; ++r)
        if (r != a.rank) store_release_sys(a.bells[r], seq);
    }
  }
  if constexpr (kWait) {
    __syncthreads();
    if (last && threadIdx.x < 32) wait_peer(w, threadIdx.x);
  }
}

__global__ void ipc_wait_kernel(const IpcWait a) { wait_peer(a, threadIdx.x); }

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

namespace {
void check_wait(const IpcWait& a) {
  ROCKET_CHECK(a.n_ranks >= 1 && a.n_ranks <= 32 && a.rank >= 0 && a.rank < a.n_ranks,
               "rank " << a.rank << " of " << a.n_ranks << " (the wait has one lane per peer, 32 at most)");
}
}  // namespace

void launch_ipc_push(const IpcPush& a, const IpcWait* wait, int blocks, cudaStream_t stream) {
  ROCKET_CHECK(a.n_ranks >= 1 && a.n_ranks <= kPlanMaxRanks && a.rank >= 0 && a.rank < a.n_ranks,
               "rank " << a.rank << " of " << a.n_ranks);
  ROCKET_CHECK(blocks >= 1 && blocks <= 1024, "blocks " << blocks);
  if (wait) {
    check_wait(*wait);
    ROCKET_CHECK(wait->rank == a.rank && wait->n_ranks == a.n_ranks && wait->meta == a.meta,
                 "push and wait of one exchange disagree on rank, ranks or meta");
    ipc_push_kernel<true><<<blocks, 512, 0, stream>>>(a, *wait);
  } else {
    ipc_push_kernel<false><<<blocks, 512, 0, stream>>>(a, IpcWait{});
  }
  ROCKET_LAUNCH_CHECK();
}

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

void launch_ipc_wait(const IpcWait& a, cudaStream_t stream) {
  check_wait(a);
  ipc_wait_kernel<<<1, 32, 0, stream>>>(a);
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
