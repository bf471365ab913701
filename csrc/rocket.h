// rocket_mpi CUDA kernels: the one host interface (plain C++, no torch).
//
// The .cu files define kernels and the launchers declared here; bindings.cpp is the only file that
// sees torch, and it turns tensors into these pointers after checking them. Every launcher throws
// std::runtime_error (file:line, what) on a bad argument or a failed launch.
#pragma once

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cuda_runtime_api.h>

namespace rocket {

// Error text without iostreams. The extension can carry its own static copy of libstdc++ (the H200
// image's /opt/gcc links one in) beside the process's shared one; a std::ostringstream built in that
// copy crashed in its locale code (num_put) on the first error message, killing the process instead of
// raising. std::to_string and snprintf do not touch locales.
struct Msg {
  std::string s;
  Msg& operator<<(const char* v) { s += v; return *this; }
  Msg& operator<<(const std::string& v) { s += v; return *this; }
  Msg& operator<<(char v) { s += v; return *this; }
  Msg& operator<<(bool v) { s += v ? "true" : "false"; return *this; }
  template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
  Msg& operator<<(T v) { s += std::to_string(v); return *this; }
  Msg& operator<<(double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", v);
    s += b;
    return *this;
  }
  Msg& operator<<(float v) { return *this << static_cast<double>(v); }
};

}  // namespace rocket

#define ROCKET_CHECK(cond, what)                                                             \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      ::rocket::Msg rocket_msg_;                                                             \
      rocket_msg_ << __FILE__ << ":" << __LINE__ << ": check failed (" #cond "): " << what;  \
      throw std::runtime_error(rocket_msg_.s);                                               \
    }                                                                                        \
  } while (0)

#define ROCKET_CUDA_CHECK(expr)                                                              \
  do {                                                                                       \
    cudaError_t rocket_err_ = (expr);                                                        \
    if (rocket_err_ != cudaSuccess) {                                                        \
      ::rocket::Msg rocket_msg_;                                                             \
      rocket_msg_ << __FILE__ << ":" << __LINE__ << ": " #expr " failed: "                   \
                  << cudaGetErrorName(rocket_err_) << ": " << cudaGetErrorString(rocket_err_); \
      throw std::runtime_error(rocket_msg_.s);                                               \
    }                                                                                        \
  } while (0)

namespace rocket {

// ---- packed NVFP4 layout (rocket_mpi/ops/pack.py writes it; DESIGN in that file) ----
// A matrix W [N, K] (N output features, K reduction) is cut into tiles of 16 features x 64 k.
// codes:  uint8 [N/16][K/64][32 lanes][16 B]   lane (g, t) holds, for k-step j = 0..3, one
//         32-bit word with the 8 E2M1 codes of its mma.m16n8k16 A fragment (bit layout in pack.py)
// scales: uint8 [N/16][K/64][8 g][8 B]         rows g and g+8, k-steps 0..3, one byte each
// Both padded with zeros to N % 16 == 0 (gate/up: I % 64) and K % 64 == 0.
constexpr int kTileN = 16;            // features per tile (mma M)
constexpr int kTileK = 64;            // k per tile (4 mma k-steps)
constexpr int kTileCodeBytes = 512;   // 16 x 64 x 4 bit
constexpr int kTileScaleBytes = 64;   // 16 x 4 e4m3 blocks
constexpr int kRowTile = 8;           // rows per mma N
constexpr int kMaxRowTiles = 4;       // rows per weight pass: 32

// Rows in mma B-fragment order ("frag"): uint32 [tiles][K/32][32 lanes][4]; lane (g, t) of tile T,
// k-pair P holds bf16 pairs (row 8T+g; k = 32P + 16s + 8r + 2t, +1) at word 2s + r.

constexpr int kMaxResiduals = 2;

// Programmatic dependent launch of an expert launch's down GEMM (ExpertsLaunch::pdl). kPdlPerPass: down is gate/up's
// dependent and each of its passes waits for its own pass of gate/up (NVFP4 tiles with a plan; otherwise for all of
// gate/up). kPdlAuto: kPdlPerPass for launches of more than a few rows of x, else kPdlOff.
constexpr int kPdlAuto = -1;
constexpr int kPdlOff = 0;
constexpr int kPdlPerPass = 3;
// The NVFP4 expert launch's kernel instance (ExpertsLaunch::wide). kWideOn: 2 blocks per SM, 128 registers, every
// pass through the unrolled loop (17-32 rows of one expert: no spills); kWideOff: 3 blocks per SM, 80 registers (more
// warps for the passes of 1-16 rows); kWideWg: kWideOn's shape on warpgroup mma (wgmma: sm_90 GPUs, hidden sizes
// padded to multiples of 128; the rows in another layout); kWideAuto: kWideWg where it runs, else kWideOn, when the
// launch's passes average more than kWideTilesPerPass row tiles (a prefill chunk's), else kWideOff. Never changes the
// bits: each row's sequence of fp32 sums is the same in all three.
constexpr int kWideAuto = -1;
constexpr int kWideOff = 0;
constexpr int kWideOn = 1;
constexpr int kWideWg = 2;

struct ExpertsLaunch {
  // rows
  const void* x;              // bf16 [*, hidden] row-major, `x_rows` rows
  int64_t x_rows;
  const int64_t* row_index;   // nullable: block row r reads x[row_index[r]]
  const int* pad_rows;        // [tiles * 8] block row of each padded row, -1 = padding; null: dense rows
  const int4* groups;         // [n_groups] (slot, first tile, tiles 1..4, 0): one weight pass each; null: dense
  int n_groups, n_tiles;
  int dense_rows;             // pad_rows and groups null: rows 0..dense_rows-1 of slot 0, in order (a SwiGLU
                              // MLP of the replicated stack); n_tiles = ceil(rows / 8), n_groups = ceil(tiles / 4)
  // packed experts, `slot` indexes the leading dimension
  int bf16;                    // 0: NVFP4 codes + scales; 1: BF16 tiles in q_gu / q_dn (pack.py pack_bf16), no s_*
  const uint8_t *q_gu, *s_gu;  // gate/up tiles interleaved: tile T = gate rows 8T..8T+7, up rows 8T..8T+7
  const float* s2_gu;          // [slots][2] weight_scale_2 of gate, up
  const uint8_t *q_dn, *s_dn;  // down [hidden_pad, inter_pad]; its weight_scale_2 is the scatter's (but s2_dn)
  // Far slots (the expert cache, rocket_mpi/moe/cache.py): slots >= near live in host memory mapped into the device
  // (device pointers of registered pinned memory), slot s at far slot s - near; null: every slot is in q_* / s_*.
  // The kernel reads them through the same copies as device slots: the same bytes, the same bits.
  const uint8_t *q_gu_far = nullptr, *s_gu_far = nullptr, *q_dn_far = nullptr, *s_dn_far = nullptr;
  int near = 0;
  int hidden, inter;           // logical sizes (multiples of 16)
  int hidden_pad, inter_pad;   // multiples of 64
  float swiglu_limit;          // used when has_limit
  int has_limit;
  // scratch and result
  uint4* x_frag;               // [tiles][hidden_pad/32][32] uint4
  uint4* h_frag;               // [tiles][inter_pad/32][32] uint4
  int* ready;                  // [n_groups] int32 scratch (nullable): the passes' counts for kPdlPerPass
  void* out;                   // bf16 [out_rows, hidden]
  int64_t out_rows;
  // dense rows only: residuals bf16 [rows, hidden] added to the output in order, each add torch's `r + y` of two
  // bf16 tensors (fp32 sum, one rounding): out = res[1] + (res[0] + y), the replicated stack's x + (moe + shared)
  const void* res[kMaxResiduals];
  int n_res;
  int direct_k;                // dense rows: gate/up's K in direct_k_order (pack.py pack_bf16_direct,
                               // pack_codes_direct), so up to 16 rows are read from x itself, more through a prep
                               // launch in that order
  // Launch tuning (nvfp4_experts.cu). pdl never changes a row's bits, only when down's weight copies and rows start;
  // split sets the order of each output's fp32 sums (a row's bits still depend on no other row).
  int pdl = kPdlAuto;          // kPdlAuto, kPdlOff or kPdlPerPass (above)
  int split = 0;               // dense rows: K slices, 1, 2, 4 or 8; 0: by the output's width. Expert launches: 0
  int wide = kWideAuto;        // expert launches of NVFP4 tiles: kWideAuto, kWideOff or kWideOn (above)
  const float* s2_dn = nullptr;  // dense rows of NVFP4 tiles (a stack MLP held as stored): down's weight_scale_2 [1],
                                 // applied in down's epilogue (expert launches: null, the scatter applies it)
};

// x rows -> x_frag, gate/up + SwiGLU -> h_frag, down -> out. Batch-invariant: see nvfp4_experts.cu.
void launch_nvfp4_experts(const ExpertsLaunch& a, cudaStream_t stream);
// Throws unless pdl is kPdlAuto, kPdlOff or kPdlPerPass and split is 0, 1, 2, 4 or 8. The launchers check the same;
// the bindings call it first, so that a launch with no rows rejects a bad value too.
void check_launch_tuning(int pdl, int split, int wide = kWideAuto);

// y = x W^T (+ bias) with W in BF16 tiles, K in direct_k_order (pack.py pack_bf16_direct): the expert kernel's
// down GEMM over dense rows (up to 16 read from x itself, more through a prep launch), for
// the replicated stack's linears. Output features [seg_end[s-1], seg_end[s]) go to seg_out[s] ([rows, width]
// row-major), so a fused q/k/v projection writes three tensors; part ends are multiples of 32.
constexpr int kMaxSegs = 3;
struct LinearLaunch {
  const void* x;               // bf16 [rows, k]
  int64_t rows;
  const void* w;               // bf16 [n_pad / 16][k_pad / 64][4][256]
  const void* bias;            // nullable bf16 [n]
  int n, k, n_pad, k_pad;      // n, k multiples of 16; n_pad of 32, k_pad of 64
  uint4* x_frag;               // scratch [ceil(rows / 8)][k_pad / 32][32]
  int n_segs;
  int seg_end[kMaxSegs];
  void* seg_out[kMaxSegs];
  const void* res[kMaxResiduals];  // one output part only: as ExpertsLaunch's residuals (x + o in the stack)
  int n_res;
  int split = 0;               // K slices (1, 2, 4 or 8); 0: by the output's width (nvfp4_experts.cu dense_split)
  // NVFP4 tiles (launch_nvfp4_linear): w holds codes [n_pad / 16][k_pad / 64][32][16], s their block scales
  // [n_pad / 16][k_pad / 64][8][8] (pack.py pack_codes_direct: K in direct_k_order as the BF16 tiles', the block
  // scales as stored), w_scale each part's weight_scale_2
  const void* s = nullptr;
  float w_scale[kMaxSegs] = {1.0f, 1.0f, 1.0f};
};
void launch_bf16_linear(const LinearLaunch& a, cudaStream_t stream);
void launch_nvfp4_linear(const LinearLaunch& a, cudaStream_t stream);

// Packed tiles -> W [n_pad, k_pad] bf16 as the kernel sees it (E2M1 x scale x 2^-8); direct: tiles with K in
// direct_k_order (the dense NVFP4 launches', pack.py pack_codes_direct), W in the input's column order. The prefill's
// weights of the stack held as stored, and a test hook.
void launch_nvfp4_dequant_packed(const uint8_t* q, const uint8_t* s, int n_pad, int k_pad, bool direct, void* out,
                                 cudaStream_t stream);

// out[t] = bf16(sum_j coef[t,j] * rows[by_token[t,j]]), fp32 in j order from 0.0f, one rounding. With
// by_canon ([tokens, topk] each by_token entry's place in the checksum order) and sum, *sum += the rows' checksum. Then
// + res[0], + res[1] ([tokens, hidden] bf16, up to kMaxResiduals), each add rounded (torch's r + out). With norm_w
// ([hidden] bf16) and normed ([tokens, hidden] bf16): normed = rms_norm(out, norm_w, eps) too, in the same launch
// where launch_rms_norm would take its vector kernel (the same bits either way).
void launch_moe_scatter_add(const void* rows, int64_t n_rows, const int64_t* by_token, const float* coef,
                            void* out, int tokens, int topk, int hidden, const int* by_canon, int64_t* sum,
                            const void* const* res, int n_res, cudaStream_t stream, const void* norm_w = nullptr,
                            float eps = 0.0f, void* normed = nullptr);

// ---- the router on the device (router.cu; reference rocket_mpi/moe/router.py route) ----
constexpr int kRouteMaxExperts = 1024;
// partial [router_slices(hidden), tokens, E] fp32: x [tokens, hidden] bf16 . W [E, hidden] fp32 over each
// slice of hidden, a fixed sum order per (t, e); the logits are the partials summed in slice order.
int router_slices(int hidden);
void launch_router_logits(const void* x, const float* w, int tokens, int hidden, int n_experts, float* partial,
                          cudaStream_t stream);
// logits (partials summed), sigmoid, + bias for the choice, group-limited top-k (ties to the lower id),
// normalised weights x scaling.
void launch_moe_route(const float* partial, int slices, const float* bias, int tokens, int n_experts, int n_group,
                      int topk_group, int topk, bool norm, float scaling, int64_t* experts, float* weights,
                      cudaStream_t stream);

// ---- device row plan (moe_plan.cu; torch reference and layout in rocket_mpi/ops/plan.py) ----
constexpr int kPlanThreads = 1024;
constexpr int kPlanMaxExperts = 1024;  // one thread per expert in the counts
constexpr int kPlanMaxPairs = 1024;    // (expert, owner) pairs, replicas included: one thread each in the canonical scan
constexpr int kPlanMaxRows = 2048;    // tokens x topk of one call
constexpr int kPlanMaxRanks = 64;
constexpr int kPlanMaxTopk = 32;
constexpr int kPlanMetaHead = 6;      // meta: tiles, groups, rows here, set, seq, experts here, rows per rank...

struct PlanLaunch {
  const int64_t* experts;   // [tokens, topk] router choice
  const float* weights;     // [tokens, topk] router weights
  int tokens, topk;
  // The owners as (expert, owner) pairs, numbered expert by expert in ascending rank (rocket_mpi/ops/rows.py Owners):
  // expert e's pairs are pair0[e] .. pair0[e+1]-1. A replicated expert's rows are split among its pairs by routing
  // alone: its j-th row (of c, tokens ascending) goes to its pair (j * m) / c of m.
  const int* pair0;         // [E + 1]
  const int* pair_owner;    // [n_pairs] rank of each pair (entries past pair0[E] unused)
  const int* slot;          // [E] slot in this rank's packed experts (-1: not here)
  const int* canon;         // [n_pairs] pairs in (owner, expert id) order; -1 past the placement's pairs
  const float* s2_down;     // [E]
  int n_experts, n_pairs, rank, n_ranks;
  int cap;                  // rows a rank's block can hold: tokens * topk
  int stride;               // rows between the ranks' blocks in slot space: cap or more (a larger step's exchange)
  int n_sets;               // row buffer sets used in turn (seq % n_sets)
  int64_t set_stride;       // rows between sets (>= n_ranks * cap)
  int64_t* seq;             // device counter: +1 per call, the layer's exchange seq
  // outputs
  int64_t* by_token;        // [tokens, topk] slot-space row of each token's experts, ascending id
  float* coef;              // [tokens, topk] weight x s2_down, matching by_token
  int64_t* row_index;       // [cap] token of each row of this rank's block
  int* pad_rows;            // [cap * 8] block row of each padded row, -1 = padding
  int4* groups;             // [cap] weight passes; tiles = 0 past the last
  int64_t* canon_slot;      // [tokens * topk] slot-space row of canonical row i
  int* by_canon;            // [tokens, topk] each by_token entry's place in the scatter's checksum: t * topk + j
  int64_t* meta;            // [kPlanMetaHead + n_ranks]  (layout in rocket_mpi/ops/plan.py)
  int64_t* zero;            // nullable: one word set to 0 (the layer's checksum sum, which the scatter adds to)
  int* fires;               // nullable: [2][E] firing counts, += rows of each expert and += 1 where it has rows
};

void launch_moe_plan(const PlanLaunch& a, cudaStream_t stream);

// ---- cuda-ipc exchange kernel (ipc_bells.cu) ----
struct IpcPush {
  const uint4* src;                  // this rank's block rows, row-major
  uint4* dst[kPlanMaxRanks];         // rank r's row buffer (set 0, row 0), ours included
  int64_t* bells[kPlanMaxRanks];     // rank r's flag words for this rank ([kIpcMaxBlocks]; ours unused)
  const int64_t* meta;               // the layer's plan meta (rows, set, seq)
  int64_t row_words, cap_words, set_words;  // uint4 per row, per block capacity, per set
  int rank, n_ranks;
};
struct IpcWait {
  const int64_t* bells;              // this rank's flag words, [peer][kIpcMaxBlocks]
  const int64_t* meta;
  int64_t* err;                      // [4] (1, peer, seq, layer) after a timeout
  uint64_t timeout_ns;
  int rank, n_ranks, layer;
  int blocks;                        // blocks of each peer's push: the flag words to wait for per peer
};
constexpr int kIpcMaxBlocks = 32;    // flag words per sender on each receiver (rocket_mpi/fabric/cuda_ipc.py)
// One kernel: each block pushes its share of this rank's rows into every rank's buffer, then writes its own flag word
// on every peer (a.bells[r] = rank r's flag words for this sender); block 0 waits for every peer's `blocks` flag
// words (w.bells = ours).
void launch_ipc_exchange_flags(const IpcPush& a, const IpcWait& w, int blocks, cudaStream_t stream);

// ---- doorbell fabrics' graphed exchange (proxy_bells.cu; the host proxy between its two kernels: proxy.cpp) ----
struct BellStage {
  const uint4* src;                  // this rank's block (the expert kernel's out), device memory
  uint4* dst[kPlanMaxRanks];         // slot 0 of each place the block goes (host memory mapped for the device): our
                                     // region on our own staging (verbs: the NIC puts it from there), or on every
                                     // peer's staging (shm: the stage kernel puts it, the proxy only rings)
  int n_dst;
  unsigned long long* ready;         // the two ready records [2][8]: {seq, rows, ...} (host memory)
  unsigned long long* sync;          // device words: [0] blocks done (zero between launches: the grid's last block
                                     // writes the record), [1] the last seq the gather's block 0 saw rung
  const int64_t* meta;               // the layer's plan meta (rows, seq)
  int64_t row_words, slot_words;     // uint4 per row, per slot
};
struct BellGather {
  uint4* rows;                       // device rows in slot space: rank r's block at r * cap
  const uint4* regions;              // region 0 on our staging (region p at p * region_words), host memory
  const unsigned long long* bells;   // our doorbell words in[peer][rails], host memory
  const int64_t* meta;               // seq, rows per rank
  int64_t* err;                      // [4] (1, peer, seq, layer) after a timeout
  unsigned long long* sync;          // BellStage's: block 0 publishes seq at [1] for the other blocks
  uint64_t timeout_ns;
  int64_t row_words, cap_words, slot_words, region_words;
  int rank, n_ranks, rails, layer;
};
// Stage then gather, on one stream: the proxy thread puts and rings in between (see proxy_bells.cu).
void launch_bell_exchange(const BellStage& s, const BellGather& g, int stage_blocks, int gather_blocks,
                          cudaStream_t stream);

// ---- fused ops of the fixed-shape decode step (decode_ops.cu) ----
// With index ([rows] int64) and x_out: row b is x[index[b]] (an id outside [0, x_rows): zeros), also copied to
// x_out[b].
void launch_rms_norm(const void* x, const void* w, void* out, int64_t rows, int n, float eps, cudaStream_t stream,
                     const int64_t* index = nullptr, int64_t x_rows = 0, void* x_out = nullptr);
void launch_rope(void* q, void* k, const void* cos, const void* sin, int tokens, int hq, int hk, int d, int rot,
                 cudaStream_t stream);
// out [rows, r] = GLM-5's interleaved rotary form of x's rows (`stride` elements apart; `heads` rows per token, whose
// cos / sin row [r] they share)
void launch_rope_interleaved(const void* x, void* out, const void* cos, const void* sin, int64_t rows, int heads, int r,
                             int64_t stride, cudaStream_t stream);
void launch_rope_kv(void* q, void* k, const void* v, const void* cos, const void* sin, void* kc, void* vc,
                    const int64_t* pos, int tokens, int hq, int hk, int d, int rot, int cap, cudaStream_t stream,
                    int table_rows = 0);  // > 0: cos / sin are [table_rows, rot] tables read at pos
// tokens[r] = torch.argmax(logits[r]) of [rows, vocab] bf16 (and pos[r] += 1 where pos is given): `chunks` blocks
// per row (argmax_chunks) write part_v / part_i [rows * chunks], the last block (ticket: zero, left zero) reduces.
void launch_argmax(const void* logits, int rows, int vocab, float* part_v, int* part_i, int chunks,
                   unsigned* ticket, int64_t* tokens, int64_t* pos, cudaStream_t stream);
int argmax_chunks(int rows, int vocab);
void launch_decode_softmax(const void* scores, const int64_t* pos, int streams, int heads, int span, float scale,
                           void* probs, cudaStream_t stream);
void launch_kv_append(void* kc, void* vc, const void* k, const void* v, const int64_t* pos, int streams, int hkv,
                      int cap, int d, cudaStream_t stream);

// ---- GLM-5.3-Flash's MLA decode glue (mla.cu; the torch ops it replaces: rocket_mpi/model/glm5_next_mla.py) ----
// One token per stream r: its latent row (and with an indexer, its key through the LayerNorm and its gate) into the
// caches at pos[r] of cache row index[r] (r where index is null), and the key of the pool it completes.
struct MlaCacheStep {
  const void* latent;                // [rows, kv_lora] bf16, rows latent_stride elements apart
  const void* key;                   // [rows, dim] bf16 before the LayerNorm (key_stride); null: no indexer
  const void* gate;                  // [rows, dim] bf16 (gate_stride)
  const void* ln_w;                  // [dim] bf16: the key's LayerNorm
  const void* ln_b;                  // [dim] bf16
  const float* ape;                  // [kpool, dim] fp32: the pool softmax's per-slot bias
  void* latent_cache;                // [cache_rows, cap, kv_lora] bf16
  void* key_cache;                   // [cache_rows, cap, dim] bf16
  void* gate_cache;                  // [cache_rows, cap, dim] bf16
  void* pool_cache;                  // [cache_rows, pools, dim] bf16
  const int64_t* index;              // [rows] or null
  const int64_t* pos;                // [rows]
  int64_t latent_stride, key_stride, gate_stride, cache_rows;
  int rows, kv_lora, dim, cap, pools, kpool;
  float eps;
};
void launch_mla_cache_step(const MlaCacheStep& a, cudaStream_t stream);

// probs [streams, heads, span] bf16 = softmax of scores x scale over each stream's visible columns (valid [streams,
// span], or where valid is null the prefix that pos, kpool and tail give), 0 elsewhere, NaN where none is visible.
struct MlaSoftmax {
  const float* scores;               // [streams, heads, span] fp32
  const bool* valid;                 // [streams, span] or null
  const int64_t* pos;                // [streams]: read where valid is null
  void* probs;                       // [streams, heads, span] bf16
  int streams, heads, span, kpool;
  bool tail;                         // the incomplete pool's positions up to pos are visible too
  float scale;
};
void launch_mla_softmax(const MlaSoftmax& a, cudaStream_t stream);

// Per stream: the k best of its pool scores [pools] (topk_first's order; pools that are not candidates for pos as the
// lowest finite fp32) in ascending pool order as latent positions (kpool each, valid where a candidate), then with
// tail the incomplete pool's positions up to pos: cols / valid [streams, (k + tail) * kpool].
struct MlaPick {
  const float* scores;               // [streams, pools] fp32
  const int64_t* pos;                // [streams]
  int64_t* cols;                     // [streams, n_cols]
  bool* valid;                       // [streams, n_cols]
  int streams, pools, k, kpool;
  bool tail;
};
void launch_mla_pick(const MlaPick& a, cudaStream_t stream);

// ---- GLM-4.x decode attention, batch-invariant (decode_attention.cu; the reference: rocket_mpi/ops/attention.py) ----
// Row r's query heads [hq, d] over its cache row's positions 0..pos[r] (at most span), split into chunks of
// kDecodeAttentionChunk positions from position 0: every sum's order is set by the row's own length.
constexpr int kDecodeAttentionChunk = 256;
struct DecodeAttention {
  const void* q;                     // [rows, hq, d] bf16
  const void* kc;                    // [cache_rows, hkv, cap, d] bf16: one layer's keys
  const void* vc;                    // [cache_rows, hkv, cap, d] bf16: its values
  const int64_t* pos;                // [rows]: the last position row r sees
  const int64_t* index;              // [rows]: row r's cache row; null: row r is cache row r
  int64_t cache_rows;
  int rows, hq, hkv, cap, d;
  int span;                          // positions the launch may read, 1..cap (a row sees at most these)
  int chunks;                        // decode_attention_chunks(span): the grid's chunks, the scratch's
  float scale;
  float* part_o;                     // [rows, hq, chunks, d] fp32 scratch, where chunks >= 2
  float* part_ml;                    // [rows, hq, chunks, 2] fp32 scratch (max, sum), where chunks >= 2
  void* out;                         // [rows, hq, d] bf16
};
int decode_attention_chunks(int span);
bool decode_attention_takes(int hq, int hkv, int d);  // the head dims and groupings the kernel has
void launch_decode_attention(const DecodeAttention& a, cudaStream_t stream);

// ---- GLM-5.3-Flash hyper-connections (hc.cu; rocket_mpi/model/glm5_next_hc.py is the reference) ----
constexpr int kHcMaxStreams = 4;     // hc_mult
struct HcPre {
  const void* x;                     // [tokens, n, hidden] bf16: the residual streams
  const float* fn;                   // [(2 + n) n, n hidden]
  const float* base;                 // [(2 + n) n]
  const float* scale;                // [3]: pre, post, comb
  int n, tokens, hidden, iters;      // iters: Sinkhorn iterations
  float eps, norm_eps;
  float* part;                       // [tokens, hc_slices(n, hidden), (2 + n) n + 1] scratch
  float* post;                       // [tokens, n]
  float* comb;                       // [tokens, n, n]
  void* collapsed;                   // [tokens, hidden] bf16
  // optional (norm_w non-null; hc_norm_fusable): also normed = the RMSNorm of collapsed with norm_w [hidden] bf16
  // and rms_eps in hc_finish's launch, bit for bit launch_rms_norm's (norm.cuh's vector path)
  const void* norm_w;
  float rms_eps;
  void* normed;                      // [tokens, hidden] bf16
};
bool hc_norm_fusable(int hidden, const void* collapsed, const void* norm_w, const void* normed);
int hc_slices(int n, int hidden);
void launch_hc_pre(const HcPre& a, cudaStream_t stream);
// out [tokens, n, hidden] bf16 = post[j] * y + sum_i comb[i, j] * x[i] (see hc.cu for where it rounds)
void launch_hc_post(const float* post, const float* comb, const void* y, const void* x, int n, int tokens, int hidden,
                    void* out, cudaStream_t stream);

// ---- GLM-5.3-Flash KDA tokens: a decode step or a prefill (kda.cu; rocket_mpi/model/glm5_next_kda.py is the reference) ----
struct KdaDecode {
  const void* mixed;                 // [tokens, 3 heads dk] bf16: the q | k | v projection (before the conv)
  void* conv_state;                  // [streams, 3 heads dk, conv_k] bf16: the last conv_k inputs, shifted in place
  const float* conv_w;               // [3 heads dk, conv_k] the depthwise conv's weights
  int conv_k;
  const void* f;                     // [tokens, heads * dk] bf16: the forget gate's low-rank linear
  const void* b;                     // [tokens, heads] bf16: the beta linear (before its sigmoid)
  const void* gate;                  // [tokens, heads * dk] bf16: the output gate's low-rank linear
  const float* dt_bias;              // [heads * dk]
  const float* a_log;                // [heads]
  const float* o_norm;               // [dk]
  float* state;                      // [streams, heads, dk, dk] fp32, updated in place
  const int64_t* index;              // [segments]: the stream (state row) of each segment
  const int64_t* offsets;            // [segments + 1]: segment i is tokens offsets[i] .. offsets[i + 1] - 1 of its
                                     // stream, in order; null: one token per segment (segment i is token i)
  void* out;                         // [tokens, heads * dk] bf16: o_proj's input
  int segments, heads, dk;
  float q_scale, lower_bound, eps;
  int has_lower_bound;
};
void launch_kda_decode(const KdaDecode& a, cudaStream_t stream);

}  // namespace rocket
