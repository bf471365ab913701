// The doorbell fabrics' (shm, verbs) exchange inside the graphed step: two kernels around a host proxy
// (bell_exchange in bindings.cpp; rocket_mpi/fabric/slots.py DoorbellSlots; the proxy thread: proxy.cpp).
//
// stage:  every block copies its share of this rank's block (meta[2] rows of `src`) into slot seq & 1 of each
//         destination (host memory mapped for the device): our region on our own staging for verbs, whose NIC puts
//         it from there; our region on every peer's staging for shm, so that the proxy only rings (a memcpy by the
//         proxy from memory the GPU just wrote ran at about 8 GB/s, the largest part of a 64 KiB round trip).
//         Then it fences its stores at system scope and counts itself done on a device word (sync[0]); the last
//         block writes the ready record: rows, then seq (release, system scope), and zeroes the count for the next
//         launch. The proxy that reads seq then reads (verbs) or rings for (shm) the rows.
// gather: block 0 alone waits (one thread per (peer, rail) word, acquire at system scope) until each peer's
//         doorbell words in our host memory reach the layer's seq, bounded by a timeout read from %globaltimer; on
//         expiry it records (1, peer, seq, layer) in `err` (later waits see err set and return at once: a dead peer
//         costs one timeout per step, and the host names it after the step). Then it publishes seq on a device
//         word (sync[1], release at GPU scope), which the other blocks wait on in L2. Every poll of host memory
//         crosses PCIe, and one poller rather than one per block is what keeps the round trip short (on the H200,
//         2 KiB: 25.7 us with 16 pollers, 8.5 us with one). Then the blocks copy every peer's block (meta rows per
//         rank) from its region into the device rows at rank * cap, several loads in flight per thread, with loads
//         that fetch host memory again (ld.global.cv) rather than trust a cached line from an earlier seq.
#include "common.cuh"

namespace rocket {
namespace {

__device__ __forceinline__ void store_release_sys_u64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long load_acquire_sys_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_gpu_u64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long load_acquire_gpu_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ bool reached(unsigned long long v, unsigned long long seq) {
  return static_cast<int64_t>(v - seq) >= 0;  // 64-bit serial order
}

__global__ void bell_stage_kernel(const BellStage a) {
  const int64_t rows = a.meta[2];
  const unsigned long long seq = static_cast<unsigned long long>(a.meta[4]);
  const int64_t words = rows * a.row_words;
  const int64_t slot = static_cast<int64_t>(seq & 1) * a.slot_words;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) {
    const uint4 v = a.src[i];
    for (int d = 0; d < a.n_dst; ++d) a.dst[d][slot + i] = v;
  }
  __threadfence_system();  // this thread's rows, before the block is counted
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long done = atomicAdd(a.sync, 1ull);
    if (done == gridDim.x - 1) {  // every block's rows are out
      __threadfence_system();
      unsigned long long* rec = a.ready + (seq & 1) * 8;
      *reinterpret_cast<volatile unsigned long long*>(rec + 1) = static_cast<unsigned long long>(rows);
      store_release_sys_u64(rec, seq);
      *a.sync = 0;
    }
  }
}

// Record a timeout of `peer` at seq (the first to time out wins the words).
__device__ __forceinline__ void record_timeout(const BellGather& a, int peer, unsigned long long seq) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(a.err), 0ull, 1ull) == 0ull) {
    a.err[1] = peer;
    a.err[2] = static_cast<int64_t>(seq);
    a.err[3] = a.layer;
  }
}

__device__ __forceinline__ bool err_set(const BellGather& a) {
  return *reinterpret_cast<volatile int64_t*>(a.err) != 0;
}

// Spin until `word` (rung by `peer`) reaches seq, or time out.
__device__ __forceinline__ void wait_bell(const BellGather& a, const unsigned long long* word, int peer,
                                          unsigned long long seq) {
  const uint64_t t0 = dev::globaltimer_ns();
  for (uint32_t spin = 0;; ++spin) {
    if (reached(load_acquire_sys_u64(word), seq)) return;
    if ((spin & 255) == 0) {
      if (err_set(a)) return;  // a peer already timed out this step
      if (dev::globaltimer_ns() - t0 > a.timeout_ns) {
        record_timeout(a, peer, seq);
        return;
      }
    }
  }
}

// Blocks but the first: spin on block 0's device word until it publishes seq. Block 0 publishes after its own
// timeout too, so this one's (twice as long) only ends a launch whose block 0 never ran.
__device__ __forceinline__ void wait_go(const BellGather& a, unsigned long long seq) {
  const uint64_t t0 = dev::globaltimer_ns();
  for (uint32_t spin = 0;; ++spin) {
    if (reached(load_acquire_gpu_u64(a.sync + 1), seq)) return;
    if ((spin & 255) == 0 && dev::globaltimer_ns() - t0 > 2 * a.timeout_ns) {
      record_timeout(a, (a.rank + 1) % a.n_ranks, seq);
      return;
    }
  }
}

constexpr int kGatherUnroll = 8;  // 16-byte loads in flight per thread: host memory's latency, not its bandwidth

__global__ void bell_gather_kernel(const BellGather a) {
  const unsigned long long seq = static_cast<unsigned long long>(a.meta[4]);
  if (blockIdx.x == 0) {
    const int n = a.n_ranks * a.rails;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int peer = i / a.rails;
      if (peer != a.rank) wait_bell(a, a.bells + i, peer, seq);
    }
    __syncthreads();
    if (threadIdx.x == 0 && gridDim.x > 1) store_release_gpu_u64(a.sync + 1, seq);
  } else {
    if (threadIdx.x == 0) wait_go(a, seq);
    __syncthreads();
  }
  if (err_set(a)) return;
  const int64_t slot = static_cast<int64_t>(seq & 1) * a.slot_words;
  const int64_t step = int64_t(gridDim.x) * blockDim.x * kGatherUnroll;
  for (int p = 0; p < a.n_ranks; ++p) {
    if (p == a.rank) continue;
    const int64_t words = a.meta[kPlanMetaHead + p] * a.row_words;
    const uint4* src = a.regions + p * a.region_words + slot;
    uint4* dst = a.rows + p * a.cap_words;
    for (int64_t i0 = int64_t(blockIdx.x) * blockDim.x * kGatherUnroll + threadIdx.x; i0 < words; i0 += step) {
      uint4 v[kGatherUnroll];
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        const int64_t i = i0 + int64_t(u) * blockDim.x;
        if (i < words) v[u] = __ldcv(src + i);
      }
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        const int64_t i = i0 + int64_t(u) * blockDim.x;
        if (i < words) dst[i] = v[u];
      }
    }
  }
}

}  // namespace

void launch_bell_exchange(const BellStage& s, const BellGather& g, int stage_blocks, int gather_blocks,
                          cudaStream_t stream) {
  ROCKET_CHECK(g.n_ranks >= 2 && g.n_ranks <= kPlanMaxRanks && g.rank >= 0 && g.rank < g.n_ranks,
               "rank " << g.rank << " of " << g.n_ranks);
  ROCKET_CHECK(g.rails >= 1 && g.n_ranks * g.rails <= 1024, g.rails << " rails for " << g.n_ranks << " ranks");
  ROCKET_CHECK(stage_blocks >= 1 && stage_blocks <= 1024 && gather_blocks >= 1 && gather_blocks <= 1024,
               "blocks " << stage_blocks << ", " << gather_blocks);
  ROCKET_CHECK(s.n_dst >= 1 && s.n_dst < g.n_ranks, s.n_dst << " destinations for " << g.n_ranks << " ranks");
  ROCKET_CHECK(s.meta == g.meta && s.row_words == g.row_words && s.slot_words == g.slot_words,
               "stage and gather of one exchange disagree on meta, rows or slots");
  ROCKET_CHECK(g.region_words >= 2 * g.slot_words && g.slot_words >= g.cap_words,
               "regions of " << g.region_words << " words, slots of " << g.slot_words << ", blocks of "
               << g.cap_words);
  bell_stage_kernel<<<stage_blocks, 256, 0, stream>>>(s);
  ROCKET_LAUNCH_CHECK();
  bell_gather_kernel<<<gather_blocks, 256, 0, stream>>>(g);
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
