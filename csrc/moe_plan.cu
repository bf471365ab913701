// moe_plan: the canonical row plan of one MoE layer, built on the GPU from the router's output, so a
// decode step needs no device-to-host copy and can be captured in a CUDA graph.
//
// It computes what rocket_mpi/moe/rows.py (plan_rows) and rocket_mpi/kernels.launch_plan compute on the
// host, in fixed-capacity buffers (rocket_mpi/kernels/plan.py has the torch reference and the layout):
//
//   canonical row of (token t, expert e) = start[e] + (tokens t' < t routed to e)
//   start[e]  = rows of the experts before e in (owner rank, expert id) order
//   rank r's block = rows [off[r], off[r+1]); its rows live in "slot space" at
//                    set * set_stride + r * cap + (row - off[r])    (cap = tokens * topk)
//
// so every rank writes its block at a fixed place whatever the routing, and the exchange and the scatter
// need no offsets from the host. One block of threads does it all: decode plans are a few hundred rows.
#include "common.cuh"

namespace rocket {
namespace {

__global__ void __launch_bounds__(kPlanThreads) moe_plan_kernel(const PlanLaunch a) {
  __shared__ int cnt[kPlanMaxExperts];
  __shared__ int start[kPlanMaxExperts];
  __shared__ int tstart[kPlanMaxExperts];
  __shared__ int expk[kPlanMaxRows];     // expert of flat (token, slot) i
  __shared__ int rowpos[kPlanMaxRows];   // slot-space row of flat (token, slot) i
  __shared__ int off[kPlanMaxRanks + 1];
  __shared__ long long s_seq;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int R = a.tokens * a.topk, E = a.n_experts, C = a.cap;

  for (int e = tid; e < E; e += nt) cnt[e] = 0;
  for (int i = tid; i < C * kRowTile; i += nt) a.pad_rows[i] = -1;
  for (int i = tid; i < C; i += nt) {
    a.groups[i] = make_int4(0, 0, 0, 0);  // tiles = 0: the expert kernels skip the group
    a.row_index[i] = 0;
  }
  __syncthreads();
  for (int i = tid; i < R; i += nt) {
    const int e = static_cast<int>(a.experts[i]);
    expk[i] = e;
    atomicAdd(&cnt[e], 1);  // a count: the order of the adds does not matter
  }
  __syncthreads();

  if (tid == 0) {
    const long long s = static_cast<long long>(*a.seq) + 1;  // one exchange per call, as the host's seq
    *a.seq = s;
    s_seq = s;
    int row = 0, tiles = 0, ng = 0, r = 0, mine = 0;
    off[0] = 0;
    for (int c = 0; c < E; ++c) {  // experts in (owner, id) order
      const int e = a.canon[c], o = a.owner[e];
      while (r < o) off[++r] = row;
      start[e] = row;
      row += cnt[e];
      if (o == a.rank && cnt[e] > 0) {
        const int n_t = (cnt[e] + kRowTile - 1) / kRowTile;
        tstart[e] = tiles;
        for (int q = 0; q < n_t; q += kMaxRowTiles)
          a.groups[ng++] = make_int4(a.slot[e], tiles + q, min(kMaxRowTiles, n_t - q), 0);
        tiles += n_t;
        ++mine;
      }
    }
    while (r < a.n_ranks) off[++r] = row;
    a.meta[0] = tiles;
    a.meta[1] = ng;
    a.meta[2] = off[a.rank + 1] - off[a.rank];
    a.meta[3] = a.n_sets > 1 ? s % a.n_sets : 0;
    a.meta[4] = s;
    a.meta[5] = mine;
    for (int q = 0; q < a.n_ranks; ++q) a.meta[kPlanMetaHead + q] = off[q + 1] - off[q];
  }
  __syncthreads();

  const int64_t base = int64_t(a.n_sets > 1 ? s_seq % a.n_sets : 0) * a.set_stride;
  for (int i = tid; i < R; i += nt) {
    const int t = i / a.topk, e = expk[i];
    int rnk = 0;
    for (int q = 0; q < t * a.topk; ++q) rnk += expk[q] == e;  // a token routes to an expert at most once
    const int row = start[e] + rnk, o = a.owner[e], rel = row - off[o];
    const int64_t sp = base + int64_t(o) * C + rel;
    rowpos[i] = static_cast<int>(sp);
    a.canon_slot[row] = sp;
    if (o == a.rank) {
      a.row_index[rel] = t;
      a.pad_rows[(tstart[e] + rnk / kRowTile) * kRowTile + rnk % kRowTile] = rel;
    }
  }
  __syncthreads();

  // per token, its rows in ascending expert id, and coef = router weight x s2_down (one fp32 multiply)
  for (int t = tid; t < a.tokens; t += nt) {
    int idx[kPlanMaxTopk];
    for (int j = 0; j < a.topk; ++j) {  // insertion sort of the token's slots by expert id
      int q = j;
      while (q > 0 && expk[t * a.topk + idx[q - 1]] > expk[t * a.topk + j]) {
        idx[q] = idx[q - 1];
        --q;
      }
      idx[q] = j;
    }
    for (int j = 0; j < a.topk; ++j) {
      const int i = t * a.topk + idx[j];
      a.by_token[t * a.topk + j] = rowpos[i];
      a.coef[t * a.topk + j] = __fmul_rn(a.weights[i], a.s2_down[expk[i]]);
    }
  }
}

}  // namespace

void launch_moe_plan(const PlanLaunch& a, cudaStream_t stream) {
  ROCKET_CHECK(a.tokens > 0 && a.topk > 0 && a.topk <= kPlanMaxTopk, "tokens " << a.tokens << ", topk " << a.topk);
  ROCKET_CHECK(int64_t(a.tokens) * a.topk <= kPlanMaxRows, a.tokens << " tokens x top-" << a.topk
               << " rows exceed the device plan's " << kPlanMaxRows);
  ROCKET_CHECK(a.n_experts > 0 && a.n_experts <= kPlanMaxExperts, a.n_experts << " experts (device plan: at most "
               << kPlanMaxExperts << ")");
  ROCKET_CHECK(a.n_ranks > 0 && a.n_ranks <= kPlanMaxRanks && a.rank >= 0 && a.rank < a.n_ranks,
               "rank " << a.rank << " of " << a.n_ranks);
  ROCKET_CHECK(a.cap >= a.tokens * a.topk, "capacity " << a.cap);
  ROCKET_CHECK(a.n_sets >= 1 && a.set_stride >= int64_t(a.n_ranks) * a.cap, "sets " << a.n_sets << ", stride "
               << a.set_stride);
  ROCKET_CHECK(int64_t(a.n_sets) * a.set_stride < (int64_t(1) << 31), "slot space exceeds int32");
  moe_plan_kernel<<<1, kPlanThreads, 0, stream>>>(a);
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
