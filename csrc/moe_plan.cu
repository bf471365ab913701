// moe_plan: the canonical row plan of one MoE layer, built on the GPU from the router's output, so a
// decode step needs no device-to-host copy and can be captured in a CUDA graph.
//
// It computes what rocket_mpi/ops/rows.py (plan_rows) and rocket_mpi/ops/experts.py (launch_plan) compute on
// the host, in fixed-capacity buffers (rocket_mpi/ops/plan.py has the torch reference and the layout):
//
//   each expert's owners are (expert, owner) pairs; a replicated expert's c rows (tokens ascending) are split
//   among its m pairs by routing alone: row j goes to pair (j * m) / c
//   canonical row of (token t, expert e) = start[pair] + (j - first row of the pair), j = tokens t' < t routed to e
//   start[pair] = rows of the pairs before it in (owner rank, expert id) order
//   rank r's block = rows [off[r], off[r+1]); its rows live in "slot space" at
//                    set * set_stride + r * cap + (row - off[r])    (cap = tokens * topk, or the larger cap
//                    of an exchange the step shares: PlanLaunch.stride)
//
// so every rank writes its block at a fixed place whatever the routing, and the exchange and the scatter
// need no offsets from the host. One block of threads does it all: decode plans are a few hundred rows.
#include "common.cuh"

namespace rocket {
namespace {

// Counts packed in one 64-bit scan: rows (bits 0..20), tiles (21..41), weight passes (42..62).
constexpr int kTilesShift = 21, kGroupsShift = 42;
constexpr uint64_t kField = (uint64_t(1) << 21) - 1;

// Every global value the plan reads is loaded in the first phase, together (each thread's loads are
// independent, so they cost one memory round trip, not one per phase), and each flat (token, slot) i
// keeps its expert, weight and s2_down in its thread's registers until it writes its own outputs: a
// token's by_token / coef position is the number of its other slots with a lower expert id.
constexpr int kRowsPerThread = kPlanMaxRows / kPlanThreads;
static_assert(kRowsPerThread * kPlanThreads == kPlanMaxRows, "rows per thread");
static_assert(kPlanMaxPairs <= kPlanThreads && kPlanMaxExperts <= kPlanMaxPairs, "one thread per pair");

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The expert of pair p: the last e with pair0[e] <= p (p0 in shared memory, non-decreasing).
__device__ __forceinline__ int expert_of_pair(const int* p0, int n_experts, int p) {
  int lo = 0, hi = n_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p0[mid] <= p) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kPlanThreads) moe_plan_kernel(const PlanLaunch a) {
  __shared__ int cnt[kPlanMaxExperts];
  __shared__ int p0[kPlanMaxExperts + 1];
  __shared__ int slt[kPlanMaxExperts];
  __shared__ int start[kPlanMaxPairs];
  __shared__ int tstart[kPlanMaxPairs];
  __shared__ int own[kPlanMaxPairs];
  __shared__ int expk[kPlanMaxRows];     // expert of flat (token, slot) i
  __shared__ int rank_rows[kPlanMaxRanks];
  __shared__ int off[kPlanMaxRanks + 1];
  __shared__ uint64_t warp_sums[kPlanThreads / 32];
  __shared__ int mine;
  __shared__ long long s_seq;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int R = a.tokens * a.topk, E = a.n_experts, C = a.cap;

  // phase 1: all reads
  int ei[kRowsPerThread];
  float wi[kRowsPerThread];
#pragma unroll
  for (int u = 0; u < kRowsPerThread; ++u) {
    const int i = tid + u * kPlanThreads;
    ei[u] = i < R ? static_cast<int>(a.experts[i]) : 0;
    wi[u] = i < R ? a.weights[i] : 0.0f;
  }
  const int cp = tid < a.n_pairs ? a.canon[tid] : -1;  // this thread's pair, in canonical order
  const long long seq_in = tid == 0 ? static_cast<long long>(*a.seq) : 0;
  for (int e = tid; e < E; e += nt) {
    cnt[e] = 0;
    slt[e] = a.slot[e];
  }
  for (int e = tid; e <= E; e += nt) p0[e] = a.pair0[e];
  for (int p = tid; p < a.n_pairs; p += nt) own[p] = a.pair_owner[p];
  for (int r = tid; r < a.n_ranks; r += nt) rank_rows[r] = 0;
  if (tid == 0) mine = 0;
  for (int i = tid; i < C * kRowTile; i += nt) a.pad_rows[i] = -1;
  for (int i = tid; i < C; i += nt) {
    a.groups[i] = make_int4(0, 0, 0, 0);  // tiles = 0: the expert kernels skip the entry
    a.row_index[i] = 0;
  }
  float s2i[kRowsPerThread];
#pragma unroll
  for (int u = 0; u < kRowsPerThread; ++u) s2i[u] = tid + u * kPlanThreads < R ? a.s2_down[ei[u]] : 0.0f;
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kRowsPerThread; ++u) {
    const int i = tid + u * kPlanThreads;
    if (i < R) {
      expk[i] = ei[u];
      atomicAdd(&cnt[ei[u]], 1);  // counts: the order of the adds does not matter
    }
  }
  __syncthreads();

  // pairs in canonical (owner, expert id) order: one thread each (n_pairs <= kPlanThreads), one scan for rows,
  // tiles and weight passes together; a pair's rows are its share of its expert's (the split rule above)
  int n_t = 0, ce = 0;
  uint64_t v = 0;
  if (cp >= 0) {
    ce = expert_of_pair(p0, E, cp);
    const int m = p0[ce + 1] - p0[ce], q = cp - p0[ce], c = cnt[ce];
    const int n = ceil_div((q + 1) * c, m) - ceil_div(q * c, m);
    const int o = own[cp];
    if (o == a.rank && n > 0) n_t = (n + kRowTile - 1) / kRowTile;
    v = uint64_t(n) | (uint64_t(n_t) << kTilesShift) |
        (uint64_t((n_t + kMaxRowTiles - 1) / kMaxRowTiles) << kGroupsShift);
    atomicAdd(&rank_rows[o], n);
    if (n_t) atomicAdd(&mine, 1);
    if (a.fires != nullptr && q == 0) {  // the expert cache's telemetry: one thread per expert, no atomics
      a.fires[ce] += c;
      a.fires[E + ce] += c > 0;
    }
  }
  uint64_t total;
  const uint64_t ex = dev::block_exclusive_scan<kPlanThreads>(v, warp_sums, total);
  if (cp >= 0) {
    start[cp] = static_cast<int>(ex & kField);
    const int t0 = static_cast<int>((ex >> kTilesShift) & kField), g0 = static_cast<int>(ex >> kGroupsShift);
    tstart[cp] = t0;
    for (int q = 0; q < n_t; q += kMaxRowTiles)
      a.groups[g0 + q / kMaxRowTiles] = make_int4(slt[ce], t0 + q, min(kMaxRowTiles, n_t - q), 0);
  }
  if (tid == 0) {
    if (a.zero != nullptr) *a.zero = 0;
    const long long s = seq_in + 1;  // one exchange per call, as the host's seq
    *a.seq = s;
    s_seq = s;
    off[0] = 0;
    for (int r = 0; r < a.n_ranks; ++r) off[r + 1] = off[r] + rank_rows[r];
    a.meta[0] = static_cast<int64_t>((total >> kTilesShift) & kField);
    a.meta[1] = static_cast<int64_t>(total >> kGroupsShift);
    a.meta[2] = rank_rows[a.rank];
    a.meta[3] = a.n_sets > 1 ? s % a.n_sets : 0;
    a.meta[4] = s;
    a.meta[5] = mine;
    for (int q = 0; q < a.n_ranks; ++q) a.meta[kPlanMetaHead + q] = rank_rows[q];
  }
  __syncthreads();

  // each (token, slot) i: its pair (the split rule), canonical row, slot-space row, and its place among the
  // token's rows in ascending expert id, where it writes by_token / by_canon / coef (router weight x s2_down, one
  // fp32 multiply)
  const int64_t base = int64_t(a.n_sets > 1 ? s_seq % a.n_sets : 0) * a.set_stride;
#pragma unroll
  for (int u = 0; u < kRowsPerThread; ++u) {
    const int i = tid + u * kPlanThreads;
    if (i >= R) continue;
    const int t = i / a.topk, e = ei[u];
    int rnk = 0;
    for (int q = 0; q < t * a.topk; ++q) rnk += expk[q] == e;  // a token routes to an expert at most once
    int j = 0;
    for (int q = t * a.topk; q < (t + 1) * a.topk; ++q) j += expk[q] < e;
    const int m = p0[e + 1] - p0[e], c = cnt[e];
    const int q = m == 1 ? 0 : rnk * m / c;
    const int pair = p0[e] + q, r = rnk - ceil_div(q * c, m);
    const int row = start[pair] + r, o = own[pair], rel = row - off[o];
    const int64_t sp = base + int64_t(o) * a.stride + rel;
    a.canon_slot[row] = sp;
    if (o == a.rank) {
      a.row_index[rel] = t;
      a.pad_rows[(tstart[pair] + r / kRowTile) * kRowTile + r % kRowTile] = rel;
    }
    a.by_token[t * a.topk + j] = sp;
    a.by_canon[t * a.topk + j] = t * a.topk + j;  // the checksum's (token, expert) order: placement-independent
    a.coef[t * a.topk + j] = __fmul_rn(wi[u], s2i[u]);
  }
}

}  // namespace

void launch_moe_plan(const PlanLaunch& a, cudaStream_t stream) {
  ROCKET_CHECK(a.tokens > 0 && a.topk > 0 && a.topk <= kPlanMaxTopk, "tokens " << a.tokens << ", topk " << a.topk);
  ROCKET_CHECK(int64_t(a.tokens) * a.topk <= kPlanMaxRows, a.tokens << " tokens x top-" << a.topk
               << " rows exceed the device plan's " << kPlanMaxRows);
  ROCKET_CHECK(a.n_experts > 0 && a.n_experts <= kPlanMaxExperts, a.n_experts << " experts (device plan: at most "
               << kPlanMaxExperts << ")");
  ROCKET_CHECK(a.n_pairs >= a.n_experts && a.n_pairs <= kPlanMaxPairs, a.n_pairs << " (expert, owner) pairs for "
               << a.n_experts << " experts (device plan: at most " << kPlanMaxPairs << ")");
  ROCKET_CHECK(a.n_ranks > 0 && a.n_ranks <= kPlanMaxRanks && a.rank >= 0 && a.rank < a.n_ranks,
               "rank " << a.rank << " of " << a.n_ranks);
  ROCKET_CHECK(a.cap >= a.tokens * a.topk, "capacity " << a.cap);
  ROCKET_CHECK(a.stride >= a.cap, "blocks " << a.stride << " rows apart, capacity " << a.cap);
  ROCKET_CHECK(a.n_sets >= 1 && a.set_stride >= int64_t(a.n_ranks) * a.stride, "sets " << a.n_sets << ", stride "
               << a.set_stride);
  ROCKET_CHECK(int64_t(a.n_sets) * a.set_stride < (int64_t(1) << 31), "slot space exceeds int32");
  moe_plan_kernel<<<1, kPlanThreads, 0, stream>>>(a);
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
