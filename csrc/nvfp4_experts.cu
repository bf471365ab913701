// Routed experts of one rank: NVFP4 weights, BF16 rows, FP32 accumulation on the tensor cores.
//
// Three launches per call:
//   prep     rows (gathered through row_index) -> x_frag, padded per expert to tiles of 8 rows
//   gate_up  h = SwiGLU(x Wg^T * s2g, x Wu^T * s2u) -> h_frag, rounded to bf16 as the torch reference
//   down     out = h Wd^T (no weight_scale_2: the scatter applies s2_down) -> out rows, bf16
// The launch's pdl argument (ExpertsLaunch::pdl, pdl_for) sets how down follows gate_up. kPdlPerPass: down is
// launched as a programmatic dependent (PDL) of gate_up, so its blocks take the SM slots gate_up's last wave leaves
// free and start their weight copies there, then each block waits for its own pass only: a count per pass that
// gate/up's warps add to once their h_frag rows are stored (GemmParams::ready; BF16 tiles and dense rows wait for
// all of gate/up, griddepcontrol.wait). kPdlOff: down is launched normally. kPdlAuto (the default): kPdlOff for
// launches of at most kPdlOffRows rows of x, kPdlPerPass above. The prep and gate_up of expert launches are always
// launched normally. Over dense rows (the stack's linears and MLPs) the chain is programmatic: prep is the dependent
// of the kernel before it (a norm, hc_finish, the attention or KDA kernel that wrote x trigger at their start) and
// the GEMM prep's, so the GEMM's first weight copies overlap prep and the end of the kernel before it.
//
// Dense launches (ops/stack.py: the replicated stack's linears and SwiGLU MLPs, BF16 tiles): one weight slot,
// rows in order (no plan), an optional bias, outputs split into up to 3 tensors (a fused q/k/v), and K split over
// 4 or 8 of the block's warps (run_group, dense_split), since one matrix alone has too few feature groups to fill
// the GPU. NVFP4 stack weights held as stored take the NVFP4 tiles the same way (launch_nvfp4_linear, the dense
// rows of launch_nvfp4_experts): K split as the BF16 tiles', so their rows come through L1 (instances of their own,
// kSplitK: the expert launches' ring instances stay as they were), each output part's weight_scale_2 in the down
// epilogue (GemmParams seg_mul, s2_out). Their linears and an MLP's gate/up have K in direct_k_order as the BF16
// tiles' (kSplitK 2, kDirectW: each lane applies its one block scale in all 4 k-steps), so up to 16 rows are read
// from x itself, no prep launch; the GEMM is then the programmatic dependent of the kernel that wrote x.
//
// Batch invariance (DESIGN: "a row's expert output is bit-identical whatever other rows share the
// launch"). One warp owns 2 tiles of 16 output features of one expert for up to 32 rows of that
// expert and walks the whole K itself: k-steps of 16 in ascending order, one mma per step into the
// same fp32 accumulator, starting from 0. Nothing about that sequence depends on how many rows there
// are, which rows, where they sit in the tile, the grid size, or the other experts: rows only choose
// which mma *column* a row occupies, and an mma column is its own dot product. No split-K, no atomics,
// no cross-warp reduction. More than 32 rows of one expert take another weight pass (another group),
// each computing its rows with that same sequence. The epilogues are elementwise.
//
// Weights as mma operand A (16 features x 16 k), rows as operand B (8 rows), so one decoded weight
// fragment feeds every row tile. Decode (pack.py has the bit layout and the proof in numbers):
// each 32-bit word holds a lane's 8 codes of one k-step; 9 mask/shift/rotate steps put each E2M1 code
// (sign, 2 exponent bits, 1 mantissa bit) into bf16 bits 15, 8..6, which reads as E2M1 * 2^-126
// (0.5 lands on a bf16 subnormal, exact). The e4m3 block scale is stored as the 8 bits 4..11 of
// bf16(scale * 2^118) (bits 12..14 are always 1), so one LOP3 rebuilds it, and one HMUL2 gives the
// exact bf16 E2M1 * scale * 2^-8 (<= 6 significant bits). The 2^-8 comes back as * 256 in fp32
// in the epilogue, where it is exact.
//
// Memory: each warp streams its 2 tiles through a private 4-stage cp.async ring (16 B per lane per
// tile and stage, 3 stages in flight; 24 warps per SM); every lane copies only what it reads itself, so
// no barrier is needed. The row fragments (x_frag / h_frag, shared by the block's warps, which work on the same
// pass) come through one block-wide shared-memory ring in the NVFP4 instances, filled by bulk copies of one
// thread (RowsRing, mbarriers: the block's one synchronisation), and through L1 in the BF16 instances (the ring
// reaches more of the copy bandwidth than every warp loading the rows through L1).
//
// Instances of the NVFP4 expert launches (rocket.h kWide*): 3 blocks of 8 warps per SM for passes of up to 16 rows
// (decode), 2 blocks per SM for passes of more (prefill chunks); on sm_90 GPUs those take warpgroup mma
// (mainloop_wg): the same decoded A fragments, the rows read by the tensor cores from the rows ring as core matrices,
// so prep and gate/up lay the rows out for it (prep_rows_kernel, epilogue_swiglu with wg). Its sums are mma.sync's,
// bit for bit.
#include <utility>

#include "common.cuh"

namespace rocket {
namespace {

constexpr int kFT = 2;                                      // feature tiles per warp
constexpr int kStageCodes = kFT * 32 * 16;                  // per warp and stage: codes 512 B per tile
constexpr int kStageBytes = kStageCodes + kFT * 32 * 8;     // + each lane's 8 scale bytes per tile
// The weight ring of each warp: S stages, L k-tiles in flight, B blocks per SM (the register bound). S=4 L=3 B=3
// (24 warps per SM, 80 registers) was the fastest of the rings and block shapes measured on the H200 (deeper rings
// with fewer warps, 2-8 warps per block, a 64-register instance for the 1-row-tile path): more warps hide more
// latency than a deeper ring does. At 80 registers only the 3- and 4-row-tile paths (17-32 rows of one expert)
// spill, a few words each.
constexpr int kRing = 4, kRingLookahead = 3, kBlocksPerSm = 3, kWarps = 8;  // kWarps: per block (one expert;
                                                                               // they share its rows in L1)
// BF16 weights (a BF16 checkpoint's experts): the same kernel without the decode. A tile's k-step j is 512 B,
// lane l's A fragment at j * 512 + l * 16 (pack.py pack_bf16), so a k-tile is 2 KiB per tile and the ring is
// 4 KiB per warp and stage: 3 stages, 2 in flight, 2 blocks per SM (96 KiB of shared memory each).
constexpr int kBf16TileBytes = kTileN * kTileK * 2;
constexpr int kBf16StageBytes = kFT * kBf16TileBytes;
constexpr int kBf16Ring = 3, kBf16RingLookahead = 2, kBf16BlocksPerSm = 2, kBf16Warps = 8;
template <int S, bool kBf16>
__host__ __device__ constexpr int warp_smem() { return S * (kBf16 ? kBf16StageBytes : kStageBytes); }
// The rows of NVFP4 launches: one ring per block (its warps share the pass's rows), filled by bulk copies of one
// thread a group of k-tiles ahead, so a warp reads its rows from shared memory instead of every warp loading them
// through L1 (see mainloop). A stage: 8 KiB, kRowsGroup k-tiles of up to 2 row tiles or 2 of 3-4, 1 KiB per
// k-tile and tile (x_frag / h_frag keep a tile's k-tiles contiguous), with a full and an empty mbarrier. 3 blocks
// of 8 warps per SM stay resident (3 x 72 KiB of shared memory).
constexpr int kRowsRing = 3, kRowsGroup = 4;
// A down block waits for its pass's gate/up warps (kPdlPerPass) at most this long, then traps: only a bug
// can get there (every gate/up block has started before any down block does), and a trap is an error, not a hang.
constexpr uint64_t kReadyTimeoutNs = 10ull * 1000 * 1000 * 1000;
constexpr int kRowsTileBytes = 2 * 32 * 16;
// The wide instance (kWide: 2 blocks per SM, 128 registers; launches whose passes average more than 2 row tiles,
// i.e. prefill chunks, launch_gemm) takes every row-tile count through the unrolled loop with groups of kRowsGroup
// k-tiles, so its stage holds 4 row tiles.
template <bool kWide>
__host__ __device__ constexpr int rows_stage() { return (kWide ? 4 : 2) * kRowsGroup * kRowsTileBytes; }
template <bool kWide>
__host__ __device__ constexpr int rows_ring_bytes() { return kRowsRing * rows_stage<kWide>() + 2 * kRowsRing * 8; }
template <int S, bool kBf16, int W, bool kWide = false, int kSplitK = 0>
__host__ __device__ constexpr int block_smem() {  // NVFP4 dense instances (kSplitK): rows through L1, no rows ring
  return W * warp_smem<S, kBf16>() + (kBf16 || kSplitK ? 0 : rows_ring_bytes<kWide>());
}
// The blocks per SM that the launch bounds ask for fit the H200's shared memory (228 KiB per SM, 1 KiB of it
// reserved per block). (GB10, sm_121, has about 100 KiB per SM: one block of either instance there; not measured.)
static_assert(kBlocksPerSm * (block_smem<kRing, false, kWarps>() + 1024) <= 228 * 1024, "NVFP4 blocks per SM");
static_assert(kBf16BlocksPerSm * (block_smem<kBf16Ring, true, kBf16Warps>() + 1024) <= 228 * 1024, "BF16 blocks per SM");
// NVFP4 tiles with K split (dense launches of the stack held as stored; rows through L1): 2 blocks per SM, so the
// launch bounds leave the L1 rows' prefetch its registers (128), as the BF16 instances'. 3 blocks per SM (80
// registers), or 6- to 12-stage rings, were not faster on the H200 (docs/PERFORMANCE.md, tried and not kept).
constexpr int kSplitRing = 4, kSplitLookahead = 3, kSplitBlocksPerSm = 2;
constexpr int kL1RowsAhead = 3;  // k-tiles of rows loaded ahead in their launches of one row tile (mainloop)
static_assert(kSplitBlocksPerSm * (block_smem<kSplitRing, false, kWarps, false, 1>() + 1024) <= 228 * 1024,
              "split NVFP4 blocks");
constexpr int kWideBlocksPerSm = 2;
static_assert(kWideBlocksPerSm * (block_smem<kRing, false, kWarps, true>() + 1024) <= 228 * 1024, "wide NVFP4 blocks");

struct RowsRing {
  char* data;       // kRowsRing stages of rows_stage<kWide>() bytes
  uint64_t* full;   // stage filled (one arrival with its bytes)
  uint64_t* empty;  // stage read by every warp of the block that has a feature group
};

// Decode masks: see rocket_mpi/ops/pack.py (decode_words, CODE_SOURCE). At one row tile the ALU pipe, not the
// copies, bounds the main loop, so it is unrolled by the ring size (ring slots and pointer offsets constant, no
// register copies of the prefetched rows, no zero fills) and decodes a word in 9 operations (scripts/sass_loops.py
// counts its instructions).
constexpr uint32_t kCodeMask = 0x81C081C0u;   // bf16x2 sign + exponent bits 0..1 + mantissa bit 6
constexpr uint32_t kCodeMaskP = 0x80C080C0u;  // reg3: sign, exponent bit 0, mantissa
constexpr uint32_t kCodeMaskQ = 0x01000100u;  // reg3: exponent bit 1
constexpr uint32_t kScaleMask = 0x0FF00FF0u;  // scale byte at bf16 bits 4..11 of each half
constexpr uint32_t kScaleHigh = 0x70007000u;  // bf16 exponent bits 5..7 of every scale * 2^118

struct GemmParams {
  const uint8_t* q;          // tiles of the expert in slot 0
  const uint8_t* s;
  int64_t q_slot_stride;     // bytes between slots
  int64_t s_slot_stride;
  const uint8_t* q_far;      // nullable: slots >= near at q_far / s_far (slot - near), host memory mapped in
  const uint8_t* s_far;
  int near;
  const uint4* frag;         // B fragments [tiles][2 * nk][32]
  const int4* groups;
  int nk;                    // K / 64
  int n_fgroups;             // feature groups of kFT tiles per expert
  float w_mul;               // undoes the weights' packed scale in the epilogues: 2^8 (NVFP4), 1 (BF16); NVFP4
                             // dense launches: 2^8 x weight_scale_2 (one part)
  // gate/up epilogue
  const float* s2;           // [slots][2]
  float limit;
  int has_limit;
  uint32_t* h_frag;          // [tiles][h_pairs][32][4]
  int h_pairs;               // inter_pad / 32
  // down epilogue
  __nv_bfloat16* out;
  int hidden;
  const int* pad_rows;       // null: dense rows (below)
  int split_k;               // dense launches: K cut into split_k slices (1, 2, 4 or 8), one warp each, so a block
                             // of W warps takes W / split_k feature groups (run_group); 0: expert launches (a warp
                             // per group)
  int n_groups;              // entries of `groups`, or weight passes of dense rows
  // Dense rows (the replicated stack's linears and SwiGLU MLPs, ops.linear / swiglu_dense): one weight slot,
  // rows 0..dense_rows-1 in order, so no pad_rows and no groups; pass y covers row tiles 4y..4y+3.
  int dense_rows;
  int n_tiles;
  int pass_major;            // blockIdx.x is the pass: a feature group's passes run side by side and read its
                             // weights once from DRAM, the rest from L2
  const __nv_bfloat16* bias; // down epilogue: + bias[feature] in fp32 before the one rounding (nullable)
  int n_segs;                // > 1: features [seg_end[s-1], seg_end[s]) go to seg_out[s] (row stride its width)
  int seg_end[kMaxSegs];
  __nv_bfloat16* seg_out[kMaxSegs];
  float seg_mul[kMaxSegs];   // n_segs > 1: part s's w_mul (NVFP4: each part has its own weight_scale_2)
  const float* s2_out;       // nullable: down epilogue times *s2_out (a dense NVFP4 MLP's down weight_scale_2; expert
                             // launches leave it to the scatter)
  const __nv_bfloat16* res[kMaxResiduals];  // down epilogue, dense rows: residuals added in order (see rocket.h)
  int n_res;
  // Dense rows read straight from x (BF16 tiles with K in direct_k_order, pack.py; at most 2 row tiles): lane
  // (g, t) of row tile T reads row 8T + g at k-tile kt from x_rows + row * x_ld4 + 8 kt + 2 t (uint4 units), the
  // same two uint4 per k-tile that x_frag holds after a prep launch. Null: x_frag.
  const uint4* x_rows;
  int64_t x_ld4;
  // Per-pass readiness (kPdlPerPass, NVFP4 expert launches): prep zeroes ready[pass]; each gate/up warp adds
  // 1 to its pass's count once its h_frag stores are published; the down kernel (gate/up's programmatic dependent)
  // starts a pass's rows once the count reaches ready_need (gate/up's feature groups) instead of waiting for the
  // whole gate/up grid, so down's passes run in the SM slots gate/up's last wave leaves. Null: griddepcontrol.wait.
  int* ready;
  int ready_need;            // down: > 0 to wait per pass (gate/up: 0, it adds)
};

// Block row i of the launch: its row, or -1 for a padding row.
__device__ __forceinline__ int pad_row(const GemmParams& p, int i) {
  return p.pad_rows != nullptr ? p.pad_rows[i] : (i < p.dense_rows ? i : -1);
}

// The lane's A fragment for one k-step: 8 codes in `w`, scales of rows g and g+8 in the low and
// high bf16 of `sc`. Returns exact bf16 pairs E2M1 * scale * 2^-8.
__device__ __forceinline__ void decode_a(uint32_t w, uint32_t sc, uint32_t (&a)[4]) {
  const uint32_t o0 = w & kCodeMask;                                  // (g,   k 2t..2t+1)
  const uint32_t o1 = __funnelshift_r(w, w, 4) & kCodeMask;           // (g+8, k 2t..2t+1)
  const uint32_t o2 = (w << 6) & kCodeMask;                           // (g,   k 2t+8..2t+9)
  const uint32_t o3 = ((w << 2) & kCodeMaskP) | ((w >> 6) & kCodeMaskQ);  // (g+8, k 2t+8..2t+9)
  const __nv_bfloat162 s = dev::bits_bf16x2(sc);
  const __nv_bfloat162 lo = __low2bfloat162(s), hi = __high2bfloat162(s);
  a[0] = dev::bf16x2_bits(__hmul2(dev::bits_bf16x2(o0), lo));
  a[1] = dev::bf16x2_bits(__hmul2(dev::bits_bf16x2(o1), hi));
  a[2] = dev::bf16x2_bits(__hmul2(dev::bits_bf16x2(o2), lo));
  a[3] = dev::bf16x2_bits(__hmul2(dev::bits_bf16x2(o3), hi));
}

// bf16x2 (scale row g, scale row g+8) * 2^118 of k-step j from the lane's 8 scale bytes.
template <int J>
__device__ __forceinline__ uint32_t decode_scales(uint2 sv) {
  uint32_t v = (J < 2) ? sv.x : sv.y;
  if (J & 1) v = __funnelshift_r(v, v, 8);  // odd steps sit one byte up, rotated
  return dev::lop3<0xEA>(v, kScaleMask, kScaleHigh);  // (v & mask) | high in one LOP3
}

__device__ __forceinline__ uint32_t word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// The lane's A fragment of k-step jj (0-3, a constant where unrolled) of one tile's k-tile: codes qv, scales sv.
__device__ __forceinline__ void decode_step(const uint4& qv, uint2 sv, int jj, uint32_t (&a)[4]) {
  const uint32_t sc = jj == 0 ? decode_scales<0>(sv) : jj == 1 ? decode_scales<1>(sv)
                    : jj == 2 ? decode_scales<2>(sv) : decode_scales<3>(sv);
  decode_a(word(qv, jj), sc, a);
}

// Rows of each row tile of one k-tile for this lane (B fragments, 2 x uint4 per tile), from fr[rt] + off.
template <int RT>
__device__ __forceinline__ void load_b(uint4 (&b)[RT][2], const uint4* const (&fr)[RT], int off, int pp_stride) {
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
    for (int pp = 0; pp < 2; ++pp) b[rt][pp] = __ldg(fr[rt] + off + pp * pp_stride);
  }
}

// This lane's weights of feature group fg's kFT tiles from k-tile kt0: the slot's copy in device memory, or (an
// expert-cache miss) in mapped host memory.
template <bool kBf16>
__device__ __forceinline__ void weight_ptrs(const GemmParams& p, int slot, int fg, int kt0, int lane,
                                            const uint8_t* (&qp)[kFT], const uint8_t* (&sp)[kFT]) {
  constexpr int kTileBytes = kBf16 ? kBf16TileBytes : kTileCodeBytes;  // weight bytes of a tile per k-tile
  const int64_t q_tile = int64_t(p.nk) * kTileBytes, s_tile = int64_t(p.nk) * kTileScaleBytes;
  const bool far = p.q_far != nullptr && slot >= p.near;
  const uint8_t* qb = far ? p.q_far : p.q;
  const uint8_t* sb = far ? p.s_far : p.s;
  const int64_t ws = far ? slot - p.near : slot;
#pragma unroll
  for (int i = 0; i < kFT; ++i) {
    qp[i] = qb + ws * p.q_slot_stride + (int64_t(fg) * kFT + i) * q_tile + int64_t(kt0) * kTileBytes + lane * 16;
    sp[i] = kBf16 ? nullptr : sb + ws * p.s_slot_stride + (int64_t(fg) * kFT + i) * s_tile +
                              int64_t(kt0) * kTileScaleBytes + (lane >> 2) * 8;
  }
}

// Copy the k-tile `u` past the one qp / sp point at into the warp's weight ring slot st_in (u: a constant where
// unrolled). Each lane copies only what it reads itself.
template <bool kBf16>
__device__ __forceinline__ void issue_weights(char* s_codes, char* s_scales, const uint8_t* const (&qp)[kFT],
                                              const uint8_t* const (&sp)[kFT], int st_in, int u) {
  constexpr int kStage = kBf16 ? kBf16StageBytes : kStageBytes;
  constexpr int kTileBytes = kBf16 ? kBf16TileBytes : kTileCodeBytes;
#pragma unroll
  for (int i = 0; i < kFT; ++i) {
    if constexpr (kBf16) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        dev::cp_async_16(s_codes + st_in * kStage + i * kTileBytes + j * 512, qp[i] + u * kTileBytes + j * 512);
    } else {
      dev::cp_async_16(s_codes + st_in * kStage + i * 512, qp[i] + u * kTileBytes);
      dev::cp_async_8(s_scales + st_in * kStage + i * 256, sp[i] + u * kTileScaleBytes);
    }
  }
}

// This lane's NVFP4 codes and scales of its kFT tiles in weight ring slot st (what it copied there itself).
__device__ __forceinline__ void read_slot(const char* s_codes, const char* s_scales, int st, uint4 (&qv)[kFT],
                                          uint2 (&sv)[kFT]) {
#pragma unroll
  for (int i = 0; i < kFT; ++i) {
    qv[i] = *reinterpret_cast<const uint4*>(s_codes + st * kStageBytes + i * 512);
    sv[i] = *reinterpret_cast<const uint2*>(s_scales + st * kStageBytes + i * 256);
  }
}

// Weights packed with K in direct_k_order (kDirectW: NVFP4 dense launches, pack.py pack_codes_direct): lane t's 16
// inputs of a k-tile are one 16-input block, so its scale is that block's (t) in all 4 k-steps: bf16x2 (scale row g,
// scale row g+8) * 2^118 of block t, as decode_scales<t>.
__device__ __forceinline__ uint32_t decode_scales_lane(uint2 sv, int t) {
  uint32_t v = t < 2 ? sv.x : sv.y;
  if (t & 1) v = __funnelshift_r(v, v, 8);
  return dev::lop3<0xEA>(v, kScaleMask, kScaleHigh);
}

// n k-tiles issued: move the weight pointers on.
template <bool kBf16>
__device__ __forceinline__ void advance_weights(const uint8_t* (&qp)[kFT], const uint8_t* (&sp)[kFT], int n) {
  constexpr int kTileBytes = kBf16 ? kBf16TileBytes : kTileCodeBytes;
#pragma unroll
  for (int i = 0; i < kFT; ++i) {
    qp[i] += n * kTileBytes;
    if constexpr (!kBf16) sp[i] += n * kTileScaleBytes;
  }
}

// The rows ring's producer (thread 0): fill stage g % kRowsRing with group g (G k-tiles of nk, RT row tiles from src,
// kTileStride apart in the stage) once every warp of the block has released its previous use.
template <int RT, int G, int kStage, int kTileStride>
__device__ __forceinline__ void rows_issue(const RowsRing& rr, const uint4* const (&src)[RT], int g, int nk) {
  const int st = g % kRowsRing, use = g / kRowsRing;
  if (use > 0) dev::mbar_wait(&rr.empty[st], (use - 1) & 1);
  const int n = min(G, nk - g * G);
  dev::mbar_arrive_expect_tx(&rr.full[st], RT * n * kRowsTileBytes);
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
    dev::bulk_copy_g2s(rr.data + st * kStage + rt * kTileStride, src[rt] + int64_t(g) * G * 2 * 32, n * kRowsTileBytes,
                       &rr.full[st]);
}

// The batch-invariant core: acc[i][rt] = W tile (fg * kFT + i) x rows of tile (tile0 + rt) over all K,
// k-steps of 16 in ascending order, one mma per step into the same fp32 accumulator starting from 0.
// Weights stream through the warp's cp.async ring, one commit group per k-tile. B fragments: NVFP4 from the
// block's rows ring (below); BF16 through L1 (shared by the block's warps on the same pass), prefetched one
// k-tile ahead where the registers allow (RT <= 2: up to 16 rows, the decode case). 17-32 rows load them half a
// k-tile at a time (fewer live registers, less spilling under the 80-register bound).
// kL1Rows (NVFP4 tiles with K split: dense launches of the stack held as stored): the rows through L1 as the BF16
// instances read them, since the block's warps walk different k-tiles and so cannot share the rows ring.
template <int RT, int S, int L, bool kBf16, bool kWaitPass = false, bool kL1Rows = false, bool kWide = false,
          bool kDirectW = false>
__device__ __forceinline__ void mainloop(const GemmParams& p, int slot, int tile0, int fg, char* smem_warp, int lane,
                                         float (&acc)[kFT][RT][4], int kt0, int nk, const RowsRing& rr) {
  // k-tiles kt0 .. kt0 + nk - 1 (all of K, or one warp's slice of a split launch)
  if (nk <= 0) return;
  constexpr bool kPrefetch = RT <= 2;
  constexpr int kStage = kBf16 ? kBf16StageBytes : kStageBytes;
  constexpr int kTileBytes = kBf16 ? kBf16TileBytes : kTileCodeBytes;  // weight bytes of a tile per k-tile
  const int nk_all = p.nk;
  const uint8_t* qp[kFT];
  const uint8_t* sp[kFT];
  weight_ptrs<kBf16>(p, slot, fg, kt0, lane, qp, sp);
  // No L2 evict-first hint: with createpolicy + cp.async .L2::cache_hint, nvcc 13.0 emitted an LDGSTS
  // whose descriptor sat in an odd uniform register (desc[UR1]), an illegal instruction on H200.
  char* s_codes = smem_warp + lane * 16;
  char* s_scales = smem_warp + kStageCodes + lane * 8;
  static_assert(L >= 1 && L <= S - 1, "lookahead");
  auto issue = [&](int st_in, int u) { issue_weights<kBf16>(s_codes, s_scales, qp, sp, st_in, u); };
  auto advance = [&](int n) { advance_weights<kBf16>(qp, sp, n); };
  // L k-tiles in flight; slot (kt + L) % S is refilled S - L iterations after its read (each lane reads
  // only what it copied, and a read's registers are consumed within its iteration, so L = S - 1 is safe).
#pragma unroll
  for (int kt = 0; kt < L; ++kt) {
    if (kt < nk) issue(kt, kt);
    dev::cp_async_commit();
  }
  advance(L < nk ? L : nk);
  // Programmatic dependent launch: above, only the pass (groups: the plan, complete before prep, which is
  // launched normally, began) and weight copies (static data); the rows (x_frag from prep, h_frag from
  // gate/up) and every store only after this wait. (So prep must not become a programmatic dependent of the
  // plan kernel: `groups` would be read while it may still be written.) With per-pass readiness (down launches
  // with ready_need, expert launches: blockIdx.y is the pass) the block's rows come only through the ring that
  // thread 0 fills, so thread 0 alone waits, for its pass's count; the other warps wait on the ring's mbarrier, and
  // the epilogue's stores (out) are read by no kernel before this grid ends. (Launch parameters only, so the main
  // loops keep their registers.)
  if (!kWaitPass || p.ready_need == 0) dev::grid_dependency_wait();
  else if (threadIdx.x == 0) dev::wait_count(p.ready + blockIdx.y, p.ready_need, kReadyTimeoutNs);
  // The rows (x_frag, h_frag): the NVFP4 instances copy them with bulk copies (volatile asm, so they stay after
  // the wait's volatile asm) and read them from shared memory after the ring's mbarrier; the BF16 instances read
  // them through __ldg, which the compiler may move above the wait unless the address depends on something after
  // it: with a plan, fr depends on the pad_rows loads below; dense rows have none, so the pointers are laundered
  // after the wait.
  constexpr bool kRing = !kBf16 && !kL1Rows;  // the rows through the block's ring, else through L1
  const uint4* frag = p.frag;
  const uint4* x_rows = p.x_rows;
  if constexpr (!kRing) {
    frag = dev::opaque(frag);
    x_rows = dev::opaque(x_rows);
  }
  // The lane's rows. Up to 16 rows (kPrefetch): row tile tile0 + rt at fr[rt], k-tile kt at + kt * 64; a
  // padding row (-1 in pad_rows; prep writes nothing there) reads the fragments of row 0 of its tile (always
  // a real row) instead: an mma column is its own dot product, so what a padding column holds never reaches
  // a real row, and no predicated loads or zero fills are needed (its outputs are not used: h_frag is read
  // the same way by the down kernel, out is not written). 17-32 rows: one pointer (the registers are spoken
  // for), row tile rt at fr[0] + rt * 2 nk * 32, padding rows fed as zeros; fr[0] sits at the lane's own row
  // because a pass of 2+ tiles starts with a full one (only an expert's last tile has padding rows). (NVFP4: the
  // rows ring below; a padding row reads its tile's row 0 there, at any row count.)
  constexpr int kPtrs = kPrefetch ? RT : 1;
  const uint4* fr[kPtrs];
  bool valid[RT];
  // the rows' uint4 of one k-tile: pp_stride apart, the next k-tile kt_stride on (x_frag: 32, 64; x itself: 1, 8)
  int pp_stride = 32, kt_stride = 64;
  bool direct = false;
  if constexpr ((kBf16 || kDirectW) && kPrefetch) direct = x_rows != nullptr;
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
    const int tile_row = (tile0 + rt) * kRowTile;
    valid[rt] = pad_row(p, tile_row + (lane >> 2)) >= 0;
    if (rt < kPtrs) {
      if (direct)  // a padding row reads its tile's row 0, as below
        fr[rt] = x_rows + int64_t(valid[rt] ? tile_row + (lane >> 2) : tile_row) * p.x_ld4 + kt0 * 8 + 2 * (lane & 3);
      else
        fr[rt] = frag + (int64_t(tile0 + rt) * nk_all + kt0) * 2 * 32 + (valid[rt] ? lane : (lane & 3));
    }
  }
  if (direct) {
    pp_stride = 1;
    kt_stride = 8;
  }
  // The mmas of one k-tile: weights from ring slot st, rows of k-steps 2 pp, 2 pp + 1 from rows_half(bh, pp).
  auto mma_ktile = [&](int st, auto&& rows_half) {
    if constexpr (kBf16) {  // the A fragments as stored: no decode
#pragma unroll
      for (int pp = 0; pp < 2; ++pp) {
        uint4 bh[RT];
        rows_half(bh, pp);
#pragma unroll
        for (int jj = 2 * pp; jj < 2 * pp + 2; ++jj) {
#pragma unroll
          for (int i = 0; i < kFT; ++i) {
            const uint4 v = *reinterpret_cast<const uint4*>(s_codes + st * kStage + i * kTileBytes + jj * 512);
            const uint32_t a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int rt = 0; rt < RT; ++rt)
              dev::mma_bf16_16816(acc[i][rt], a, (jj & 1) ? bh[rt].z : bh[rt].x, (jj & 1) ? bh[rt].w : bh[rt].y);
          }
        }
      }
    } else {
      uint4 qv[kFT];
      uint2 sv[kFT];
      read_slot(s_codes, s_scales, st, qv, sv);
      [[maybe_unused]] uint32_t sc_lane[kFT];  // kDirectW: the lane's one block scale per tile for all 4 k-steps
      if constexpr (kDirectW) {
#pragma unroll
        for (int i = 0; i < kFT; ++i) sc_lane[i] = decode_scales_lane(sv[i], lane & 3);
      }
#pragma unroll
      for (int pp = 0; pp < 2; ++pp) {
        uint4 bh[RT];
        rows_half(bh, pp);
#pragma unroll
        for (int jj = 2 * pp; jj < 2 * pp + 2; ++jj) {
#pragma unroll
          for (int i = 0; i < kFT; ++i) {
            uint32_t a[4];
            if constexpr (kDirectW) decode_a(word(qv[i], jj), sc_lane[i], a);
            else decode_step(qv[i], sv[i], jj, a);
#pragma unroll
            for (int rt = 0; rt < RT; ++rt)
              dev::mma_bf16_16816(acc[i][rt], a, (jj & 1) ? bh[rt].z : bh[rt].x, (jj & 1) ? bh[rt].w : bh[rt].y);
          }
        }
      }
    }
  };
  // NVFP4: the rows come through the block's ring (RowsRing), a group of G k-tiles per stage (4 up to 2 row tiles,
  // 2 for 3-4). Thread 0 (warp 0's lane 0, which always has a feature group) fills group g + 1 at the start of
  // group g, once every warp of the block has released group g + 1 - kRowsRing; a warp waits for its group's
  // stage, reads its lane's uint4 of each k-tile and row tile there (a padding row: row 0's, as above), and
  // releases the stage after the group's mmas. Every warp loading the same rows through L1 cost the decode step a
  // good part of its time; the ring wins most of that back, and at 17-32 rows it keeps the rows out of the smaller
  // L1 its shared memory leaves.
  constexpr bool kUnrolled = kRing && (kPrefetch || kWide);  // the unrolled ring loop below, a group per pass
  constexpr int kRowsStage = rows_stage<kWide>();
  constexpr int G = kUnrolled ? kRowsGroup : 2;
  constexpr int kRowTileStride = G * kRowsTileBytes;  // a stage: [row tile][k-tile of the group][lane's uint4]
  static_assert(RT * kRowTileStride <= kRowsStage, "a group's rows fit a stage");
  const bool producer = threadIdx.x == 0;
  const int groups = (nk + G - 1) / G;
  const uint4* src[RT];
  int sel[RT];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
    src[rt] = frag + (int64_t(tile0 + rt) * nk_all + kt0) * 2 * 32;
    sel[rt] = valid[rt] ? lane : (lane & 3);
  }
  auto rows_issue = [&](int g) { rocket::rows_issue<RT, G, kRowsStage, kRowTileStride>(rr, src, g, nk); };
  const char* rows = rr.data;
  auto rows_first = [&](int j) {  // k-tile j opens its group
    const int g = j / G;
    if (producer && g + 1 < groups) rows_issue(g + 1);
    rows = rr.data + (g % kRowsRing) * kRowsStage;
    dev::mbar_wait(&rr.full[g % kRowsRing], (g / kRowsRing) & 1);
  };
  auto rows_last = [&](int j) {  // k-tile j closes its group: this warp is done with the stage
    __syncwarp();
    if (lane == 0) dev::mbar_arrive(&rr.empty[(j / G) % kRowsRing]);
  };
  auto ring_rows = [&](int j) {  // mma_ktile's rows of k-tile j
    return [&, j](uint4 (&bh)[RT], int pp) {
      const char* kr = rows + (j % G) * kRowsTileBytes + pp * 32 * 16;
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) bh[rt] = *reinterpret_cast<const uint4*>(kr + rt * kRowTileStride + sel[rt] * 16);
    };
  };
  if constexpr (kRing) {
    if (producer) rows_issue(0);
  }
  if constexpr (kUnrolled) {
    static_assert(S == kRowsGroup, "the unrolled loop walks one group per pass");
    // k-tile j = u past where qp / sp point: weights in ring slot st, the k-tile L on (if `more`) into st_next;
    // `first` / `last`: j opens / closes its group
    auto step = [&](int u, int j, int st, int st_next, bool more, bool first, bool last) {
      if (first) rows_first(j);
      dev::cp_async_wait<L - 1>();  // this k-tile's weights have landed (one group per k-tile)
      if (more) issue(st_next, u);
      dev::cp_async_commit();
      mma_ktile(st, ring_rows(j));
      if (last) rows_last(j);
    };
    int kt = 0;
    for (; kt + S + L <= nk; kt += S) {
#pragma unroll
      for (int u = 0; u < S; ++u) step(u, kt + u, u, (u + L) % S, true, u == 0, u == S - 1);
      advance(S);
    }
    for (; kt < nk; ++kt) {
      const bool more = kt + L < nk;
      step(0, kt, kt % S, (kt + L) % S, more, kt % G == 0, kt % G == G - 1 || kt + 1 == nk);
      if (more) advance(1);
    }
  } else if constexpr (kPrefetch) {
    // Up to 16 rows: the rows of each k-tile are loaded one k-tile ahead (bn). A step is k-tile `u` past
    // where qp / sp / fr point: its weights sit in ring slot st; the k-tile L further on (if `more`) is issued
    // into slot st_next; `next`: a k-tile follows. Unrolled by the ring size while every step issues: the
    // ring slots and pointer offsets are constants and the prefetched rows change registers without copies
    // (209 -> 146 instructions per k-tile at one row tile, with the decode below). The last S + L - 1
    // k-tiles or fewer run one by one; the same mma sequence either way.
    // NVFP4 dense launches of one row tile (kL1Rows, up to 8 rows): the rows kL1RowsAhead k-tiles ahead, since a
    // k-tile's decode and mmas take less time than the rows' trip from L2.
    constexpr int kAhead = (kL1Rows && RT == 1) ? kL1RowsAhead : 1;
    uint4 bn[kAhead][RT][2];
#pragma unroll
    for (int a = 0; a < kAhead; ++a)
      if (a < nk) load_b<RT>(bn[a], fr, a * kt_stride, pp_stride);
    // `next`: k-tile u + kAhead (past where fr points) exists
    auto step = [&](int u, int st, int st_next, bool more, bool next) {
      uint4 b[RT][2];
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        b[rt][0] = bn[0][rt][0];
        b[rt][1] = bn[0][rt][1];
      }
#pragma unroll
      for (int a = 0; a + 1 < kAhead; ++a)
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          bn[a][rt][0] = bn[a + 1][rt][0];
          bn[a][rt][1] = bn[a + 1][rt][1];
        }
      if (next) load_b<RT>(bn[kAhead - 1], fr, (u + kAhead) * kt_stride, pp_stride);
      dev::cp_async_wait<L - 1>();  // this k-tile has landed (one group per k-tile)
      if (more) issue(st_next, u);
      dev::cp_async_commit();
      mma_ktile(st, [&](uint4 (&bh)[RT], int pp) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) bh[rt] = b[rt][pp];
      });
    };
    static_assert(kAhead <= L, "the unrolled steps' rows stay within K");
    int kt = 0;
    for (; kt + S + L <= nk; kt += S) {
#pragma unroll
      for (int u = 0; u < S; ++u) step(u, u, (u + L) % S, true, true);
      advance(S);
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) fr[rt] += S * kt_stride;
    }
    for (; kt < nk; ++kt) {
      const bool more = kt + L < nk;
      step(0, kt % S, (kt + L) % S, more, kt + kAhead < nk);
      if (more) advance(1);
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) fr[rt] += kt_stride;
    }
  } else {
    // 17-32 rows: the rows are loaded half a k-tile at a time, which keeps the 3- and 4-tile paths within
    // the register bound; not unrolled (unrolled, it spills more and runs slower).
    // NVFP4: the rows through the block's ring (above), BF16 tiles (and kL1Rows): through L1.
    int st_in = L % S, st_out = 0;
    for (int kt = 0; kt < nk; ++kt) {
      if constexpr (kRing) {
        if (kt % G == 0) rows_first(kt);
      }
      dev::cp_async_wait<L - 1>();
      if (kt + L < nk) {
        issue(st_in, 0);
        advance(1);
      }
      dev::cp_async_commit();
      st_in = st_in + 1 == S ? 0 : st_in + 1;
      if constexpr (!kRing) {
        mma_ktile(st_out, [&](uint4 (&bh)[RT], int pp) {
#pragma unroll
          for (int rt = 0; rt < RT; ++rt)
            bh[rt] = valid[rt] ? __ldg(fr[0] + (rt * 2 * nk_all + pp) * 32) : make_uint4(0u, 0u, 0u, 0u);
        });
      } else {
        mma_ktile(st_out, ring_rows(kt));
        if (kt % G == G - 1 || kt + 1 == nk) rows_last(kt);
      }
      st_out = st_out + 1 == S ? 0 : st_out + 1;
      fr[0] += 2 * 32;
    }
  }
}

// The warpgroup-mma main loop (kWg: NVFP4 expert launches on sm_90a, launch_gemm). The same sums as mainloop's: each
// k-step's decoded A fragment (this warp's 16 features of tile i, mma.sync's layout) is this warp's quarter of a
// wgmma m64nNk16's A, and the pass's rows (N = 8 RT) are its B, which the tensor cores read from the block's rows ring
// themselves. acc[i] takes the k-steps in ascending order from 0, one instruction each, and wgmma's sums equal
// mma.sync's bit for bit (scripts/probe_wgmma.cu), so a row's bits do not depend on the instance its launch takes.
// The rows are in the wgmma layout (prep_rows_kernel and epilogue_swiglu with wg): per row tile and k-tile 1 KiB of
// 8 x 8 core matrices [k-block][row][8 k], so a stage is [row tile][k-tile of the group][k-block][row], a k-step's B
// at k-block 2 jj (lbo 128 B on for its second 8 k, sbo a row tile on for the next 8 rows). A warpgroup (4 warps: 4
// feature groups of the pass; launches whose feature groups are whole warpgroups, wg_ok) issues each instruction
// together. Per k-step: decode into one of two register sets while the instructions of the step before run, one
// commit group a step, at most one in flight; a rows stage is released once its last k-step's group is complete.
template <int RT, int S, int L, bool kWaitPass>
__device__ __forceinline__ void mainloop_wg(const GemmParams& p, int slot, int tile0, int fg, char* smem_warp, int lane,
                                            float (&acc)[kFT][RT][4], const RowsRing& rr) {
#if ROCKET_WGMMA
  const int nk = p.nk;
  const uint8_t* qp[kFT];
  const uint8_t* sp[kFT];
  weight_ptrs<false>(p, slot, fg, 0, lane, qp, sp);
  char* s_codes = smem_warp + lane * 16;
  char* s_scales = smem_warp + kStageCodes + lane * 8;
#pragma unroll
  for (int kt = 0; kt < L; ++kt) {
    if (kt < nk) issue_weights<false>(s_codes, s_scales, qp, sp, kt, kt);
    dev::cp_async_commit();
  }
  advance_weights<false>(qp, sp, L < nk ? L : nk);
  // as mainloop: the rows only after the previous grid (or this pass's gate/up warps) are done
  if (!kWaitPass || p.ready_need == 0) dev::grid_dependency_wait();
  else if (threadIdx.x == 0) dev::wait_count(p.ready + blockIdx.y, p.ready_need, kReadyTimeoutNs);
  constexpr int G = kRowsGroup, kRowsStage = rows_stage<true>(), kRowTileStride = G * kRowsTileBytes;
  static_assert(S == G && RT * kRowTileStride <= kRowsStage, "a group's rows fit a stage, a group per ring pass");
  const bool producer = threadIdx.x == 0;
  const int groups = (nk + G - 1) / G;
  const uint4* src[RT];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) src[rt] = p.frag + int64_t(tile0 + rt) * nk * 2 * 32;
  if (producer) rows_issue<RT, G, kRowsStage, kRowTileStride>(rr, src, 0, nk);
  const uint32_t ring = dev::smem_addr(rr.data);
  uint32_t a[2][kFT][4];
  // k-tile j = u past where qp / sp point: weights in ring slot st, the k-tile L on (if `more`) into st_next;
  // `first` / `last`: j opens / closes its rows group
  auto step = [&](int u, int j, int st, int st_next, bool more, bool first, bool last) {
    const int g = j / G;
    if (first) {
      if (producer && g + 1 < groups) rows_issue<RT, G, kRowsStage, kRowTileStride>(rr, src, g + 1, nk);
      dev::mbar_wait(&rr.full[g % kRowsRing], (g / kRowsRing) & 1);
    }
    dev::cp_async_wait<L - 1>();
    if (more) issue_weights<false>(s_codes, s_scales, qp, sp, st_next, u);
    dev::cp_async_commit();
    uint4 qv[kFT];
    uint2 sv[kFT];
    read_slot(s_codes, s_scales, st, qv, sv);
    const uint32_t rows = ring + (g % kRowsRing) * kRowsStage + (j % G) * kRowsTileBytes;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
      for (int i = 0; i < kFT; ++i) {
        decode_step(qv[i], sv[i], jj, a[jj & 1][i]);
      }
      dev::wgmma_fence();
      const uint64_t b = dev::wgmma_desc(rows + jj * 2 * 128, 128, kRowTileStride);
#pragma unroll
      for (int i = 0; i < kFT; ++i) dev::wgmma_bf16<RT>(acc[i], a[jj & 1][i], b);
      dev::wgmma_commit();
      dev::wgmma_wait<1>();  // the step before is complete: its register set may be decoded into
    }
    if (last) {  // the stage's last instructions complete, then this warp releases it
      dev::wgmma_wait<0>();
      __syncwarp();
      if (lane == 0) dev::mbar_arrive(&rr.empty[g % kRowsRing]);
    }
  };
  int kt = 0;
  for (; kt + S + L <= nk; kt += S) {
#pragma unroll
    for (int u = 0; u < S; ++u) step(u, kt + u, u, (u + L) % S, true, u == 0, u == S - 1);
    advance_weights<false>(qp, sp, S);
  }
  for (; kt < nk; ++kt) {
    const bool more = kt + L < nk;
    step(0, kt, kt % S, (kt + L) % S, more, kt % G == 0, kt % G == G - 1 || kt + 1 == nk);
    if (more) advance_weights<false>(qp, sp, 1);
  }
  dev::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kFT; ++i) dev::wgmma_fence_acc<RT>(acc[i]);
#else
  __trap();  // the host launches kWg instances on sm_90 GPUs only (wg_device)
#endif
}

// torch: gate, up = F.linear(x, W).chunk(2) (bf16); clamp; F.silu(gate) * up (bf16 each step).
__device__ __forceinline__ uint32_t swiglu(float g_acc, float u_acc, float sg, float su, float limit, int has_limit) {
  float g = dev::round_bf16(__fmul_rn(g_acc, sg));
  float u = dev::round_bf16(__fmul_rn(u_acc, su));
  if (has_limit) {  // gate.clamp(max=L), up.clamp(-L, L); NaN passes through as in torch
    g = dev::round_bf16(g > limit ? limit : g);
    u = dev::round_bf16(u > limit ? limit : (u < -limit ? -limit : u));
  }
  const float s = dev::round_bf16(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
  return dev::bf16_bits(__float2bfloat16_rn(__fmul_rn(s, u)));
}

// Tile i of this warp holds gate (rows g) and up (rows g+8) of intermediate features 16 fg + 8 i + g:
// together one k-step (fg) of the down projection. Lanes g, g^1 swap one value so each stores a
// bf16 pair straight into the down kernel's B fragment (kWg: into its core matrices, mainloop_wg).
template <int RT, bool kWg>
__device__ __forceinline__ void epilogue_swiglu(const GemmParams& p, int slot, int tile0, int fg, int lane,
                                                const float (&acc)[kFT][RT][4]) {
  static_assert(kFT == 2, "two gate/up tiles make one 16-wide k-step of down");
  const int g = lane >> 2, t = lane & 3, odd = g & 1;
  const float sg = __fmul_rn(p.s2[2 * slot], p.w_mul);     // 2^8 undoes NVFP4's packed 2^-8, exactly
  const float su = __fmul_rn(p.s2[2 * slot + 1], p.w_mul);
  const int dst_lane = (2 * t + odd) * 4 + (g >> 1);  // (fragment layout)
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
    uint32_t pair[kFT];
#pragma unroll
    for (int i = 0; i < kFT; ++i) {
      const uint32_t h0 = swiglu(acc[i][rt][0], acc[i][rt][2], sg, su, p.limit, p.has_limit);  // row 2t
      const uint32_t h1 = swiglu(acc[i][rt][1], acc[i][rt][3], sg, su, p.limit, p.has_limit);  // row 2t+1
      const uint32_t recv = __shfl_xor_sync(0xffffffffu, odd ? h0 : h1, 4);
      pair[i] = odd ? (recv | (h1 << 16)) : (h0 | (recv << 16));
    }
    if constexpr (kWg) {
      // pair i: row 2t + odd, down's k 16 fg + 8 i + (g & ~1) and the next: k-tile fg / 4, k-block (2 fg + i) % 8
      char* dst = reinterpret_cast<char*>(p.h_frag) + (int64_t(tile0 + rt) * p.h_pairs + (fg >> 2) * 2) * 512 +
                  (2 * t + odd) * 16 + (g & ~1) * 2;
#pragma unroll
      for (int i = 0; i < kFT; ++i) *reinterpret_cast<uint32_t*>(dst + ((2 * fg + i) & 7) * 128) = pair[i];
    } else {
      uint32_t* dst = p.h_frag + ((int64_t(tile0 + rt) * p.h_pairs + (fg >> 1)) * 32 + dst_lane) * 4 + (fg & 1) * 2;
      *reinterpret_cast<uint2*>(dst) = make_uint2(pair[0], pair[1]);
    }
  }
}

// torch's a + b of two bf16 values, both halves: the fp32 sum rounded once (exact operands, so the order of the
// operands does not matter).
__device__ __forceinline__ uint32_t add_bf16x2(uint32_t a, uint32_t b) {
  const __nv_bfloat162 x = dev::bits_bf16x2(a), y = dev::bits_bf16x2(b);
  return dev::bf16x2_bits(__floats2bfloat162_rn(__fadd_rn(__low2float(x), __low2float(y)),
                                                __fadd_rn(__high2float(x), __high2float(y))));
}

template <int RT>
__device__ __forceinline__ void epilogue_down(const GemmParams& p, int tile0, int fg, int lane,
                                              const float (&acc)[kFT][RT][4]) {
  const int g = lane >> 2, t = lane & 3, odd = g & 1;
  // The output of this warp's features: one segment (their ends are multiples of kFT * kTileN, checked).
  __nv_bfloat16* out = p.out;
  int f0 = 0, ld = p.hidden;
  float w_mul = p.w_mul;
  if (p.n_segs > 1) {
    const int fbase = fg * kFT * kTileN;
    int s = 0;
    while (s + 1 < p.n_segs && fbase >= p.seg_end[s]) ++s;
    f0 = s ? p.seg_end[s - 1] : 0;
    ld = p.seg_end[s] - f0;
    out = p.seg_out[s];
    w_mul = p.seg_mul[s];
  }
  if (p.s2_out != nullptr) w_mul = __fmul_rn(w_mul, __ldg(p.s2_out));  // 2^8 x s2: exact, one rounding below
  float bias[kFT][2];  // of feature (fg kFT + i) 16 + 8 half + g: c0, c1 (half 0) and c2, c3 (half 1)
#pragma unroll
  for (int i = 0; i < kFT; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int f = (fg * kFT + i) * kTileN + 8 * half + g;
      bias[i][half] = (p.bias != nullptr && f < p.hidden) ? __bfloat162float(p.bias[f]) : 0.0f;
    }
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
    const int row = pad_row(p, (tile0 + rt) * kRowTile + 2 * t + odd);
#pragma unroll
    for (int i = 0; i < kFT; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // features g (c0, c1) and g + 8 (c2, c3)
        const float b = bias[i][half];
        const uint32_t v0 =
            dev::bf16_bits(__float2bfloat16_rn(__fadd_rn(__fmul_rn(acc[i][rt][2 * half], w_mul), b)));
        const uint32_t v1 =
            dev::bf16_bits(__float2bfloat16_rn(__fadd_rn(__fmul_rn(acc[i][rt][2 * half + 1], w_mul), b)));
        const uint32_t recv = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
        const uint32_t pair = odd ? (recv | (v1 << 16)) : (v0 | (recv << 16));
        const int feat = (fg * kFT + i) * kTileN + 8 * half + (g & ~1);
        if (row >= 0 && feat < p.hidden) {
          const int64_t at = int64_t(row) * ld + (feat - f0);
          uint32_t v = pair;
          for (int r = 0; r < p.n_res; ++r) v = add_bf16x2(__ldg(reinterpret_cast<const uint32_t*>(p.res[r] + at)), v);
          *reinterpret_cast<uint32_t*>(out + at) = v;
        }
      }
    }
  }
}

// One weight pass of one feature group: the mainloop, then the epilogue.
// kSplit (dense launches: one weight matrix has too few feature groups to fill the GPU, 16 for a 4096-wide
// output): K is cut into P = p.split_k slices and the block's W warps take W / P feature groups, P consecutive warps
// each, slice j = warp % P the k-tiles [j nk / P, (j + 1) nk / P), in the ascending order of the mainloop from 0;
// then the group's first warp adds the others' partial sums in slice order (fp32) and runs the epilogue. The split
// depends on the launch's shape alone (launch_bf16_linear), so a row's bits still do not depend on the other rows.
// A warp whose group is past the last (`active` false) still meets the block's barriers and stores nothing.
template <int RT, bool kSwiglu, int S, int L, bool kBf16, int W, int kSplit, bool kWide, bool kWg>
__device__ __forceinline__ void run_group(const GemmParams& p, const int4& grp, int fg, char* smem, int warp,
                                          int lane, const RowsRing& rr, bool active = true) {
  float acc[kFT][RT][4];
#pragma unroll
  for (int i = 0; i < kFT; ++i)
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][rt][c] = 0.0f;
  char* smem_warp = smem + warp * warp_smem<S, kBf16>();
  if constexpr (kWg) {
    mainloop_wg<RT, S, L, !kSwiglu>(p, grp.x, grp.y, fg, smem_warp, lane, acc, rr);
  } else if constexpr (!kSplit) {
    mainloop<RT, S, L, kBf16, !kSwiglu && !kBf16, false, kWide>(p, grp.x, grp.y, fg, smem_warp, lane, acc, 0, p.nk,
                                                                  rr);
  } else {
    const int P = p.split_k, slice = warp % P;
    const int kt0 = slice * p.nk / P, kt1 = (slice + 1) * p.nk / P;
    mainloop<RT, S, L, kBf16, false, !kBf16, false, kSplit == 2>(p, grp.x, grp.y, fg, smem_warp, lane, acc, kt0,
                                                                  active ? kt1 - kt0 : 0, rr);
    constexpr int kVals = kFT * RT * 4;
    static_assert(W * kVals * 32 * 4 <= W * warp_smem<S, kBf16>(), "partials fit in the rings' shared memory");
    dev::cp_async_wait<0>();
    __syncthreads();  // every ring drained: its shared memory now holds the partial sums
    float* part = reinterpret_cast<float*>(smem) + lane;
    if (slice > 0) {
#pragma unroll
      for (int i = 0; i < kFT; ++i)
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
          for (int c = 0; c < 4; ++c) part[((warp * kFT + i) * RT * 4 + rt * 4 + c) * 32] = acc[i][rt][c];
    }
    __syncthreads();
    if (slice != 0 || !active) return;
    for (int w = warp + 1; w < warp + P; ++w)
#pragma unroll
      for (int i = 0; i < kFT; ++i)
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            acc[i][rt][c] = __fadd_rn(acc[i][rt][c], part[((w * kFT + i) * RT * 4 + rt * 4 + c) * 32]);
  }
  if constexpr (kSwiglu) {
    epilogue_swiglu<RT, kWg>(p, grp.x, grp.y, fg, lane, acc);
    // per-pass readiness (expert launches: blockIdx.y is the pass): this warp's h_frag rows are stored
    if constexpr (!kBf16 && !kSplit) {
      if (p.ready != nullptr) dev::warp_release_add(p.ready + blockIdx.y, lane);
    }
  } else {
    epilogue_down<RT>(p, grp.y, fg, lane, acc);
  }
}

template <bool kSwiglu, int S, int L, bool kBf16, int W, int kSplit, bool kWide = false, bool kWg = false>
__device__ __forceinline__ void run_pass(const GemmParams& p, const int4& grp, int fg, char* smem, int warp, int lane,
                                         const RowsRing& rr, bool active = true) {
  switch (grp.z) {
    case 1: run_group<1, kSwiglu, S, L, kBf16, W, kSplit, kWide, kWg>(p, grp, fg, smem, warp, lane, rr, active); break;
    case 2: run_group<2, kSwiglu, S, L, kBf16, W, kSplit, kWide, kWg>(p, grp, fg, smem, warp, lane, rr, active); break;
    case 3: run_group<3, kSwiglu, S, L, kBf16, W, kSplit, kWide, kWg>(p, grp, fg, smem, warp, lane, rr, active); break;
    case 4: run_group<4, kSwiglu, S, L, kBf16, W, kSplit, kWide, kWg>(p, grp, fg, smem, warp, lane, rr, active); break;
    default: break;  // tiles = 0: an unused entry of a fixed-capacity plan (moe_plan.cu)
  }
}

// grid (feature groups / W, passes): warp w of block x takes feature group x * W + w of pass
// y, so a block's warps share the pass's rows in L1 (dense launches: block x takes feature group x, its warps
// split K; with several passes the grid is pass-major). Which warp or block does the work never changes
// what it computes. (A persistent grid dealing units out evenly was slower on the H200.)
// kSplitK: the NVFP4 instance of dense launches with K split (the stack held as stored), its rows through L1.
// kWg: the wide instance's shape with the warpgroup-mma main loop (mainloop_wg).
template <bool kSwiglu, int S, int L, int B, bool kBf16, int W, int kSplitK = 0, bool kWide = false,
          bool kWg = false>
__global__ void __launch_bounds__(W * 32, B) experts_gemm_kernel(const GemmParams p) {
  static_assert(!kWg || (kWide && !kBf16 && !kSplitK && W % 4 == 0), "kWg: NVFP4 expert launches, whole warpgroups");
  extern __shared__ __align__(16) char smem[];
  // gate/up: the down kernel (launched as its programmatic dependent) may take SM slots this grid's last
  // wave leaves free, and start its weight copies there, once every block of this grid has started.
  if constexpr (kSwiglu) dev::launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int fblock = p.pass_major ? blockIdx.y : blockIdx.x, pass = p.pass_major ? blockIdx.x : blockIdx.y;
  // split K (dense launches: BF16 tiles, and NVFP4 ones in the kSplitK instance): the block's warps take W / split_k
  // feature groups, split_k consecutive warps each. (The NVFP4 ring instances keep the expression they were tuned
  // with.)
  int fg;
  if constexpr (kBf16 || kSplitK) fg = p.split_k ? fblock * (W / p.split_k) + warp / p.split_k : fblock * W + warp;
  else fg = p.split_k ? fblock : fblock * W + warp;
  RowsRing rr{};
  if constexpr (!kBf16 && !kSplitK) {  // NVFP4: the block's rows ring (expert launches)
    char* ring = smem + W * warp_smem<S, kBf16>();
    rr.data = ring;
    rr.full = reinterpret_cast<uint64_t*>(ring + kRowsRing * rows_stage<kWide>());
    rr.empty = rr.full + kRowsRing;
    if (threadIdx.x == 0) {
      const int active = min(W, p.n_fgroups - fblock * W);  // warps with a feature group: each releases a stage
      for (int i = 0; i < kRowsRing; ++i) {
        dev::mbar_init(&rr.full[i], 1);
        dev::mbar_init(&rr.empty[i], active);
      }
      dev::fence_barrier_init();
    }
    __syncthreads();  // the barriers are initialised before any warp uses them (and before any warp leaves)
  }
  // whole warps: the epilogues' shuffles need all 32 lanes (split: a group past the last stays for the barriers)
  if (fg >= p.n_fgroups && !((kBf16 || kSplitK) && p.split_k)) return;
  int4 grp;
  if (p.groups != nullptr) {
    grp = p.groups[pass];
  } else {  // dense rows: slot 0, row tiles 4 pass .. 4 pass + 3
    const int tile0 = pass * kMaxRowTiles;
    grp = make_int4(0, tile0, min(kMaxRowTiles, p.n_tiles - tile0), 0);
  }
  if constexpr (kBf16 || kSplitK) {  // dense launches (the NVFP4 ring instances stay as they were)
    if (p.split_k) {
      run_pass<kSwiglu, S, L, kBf16, W, (kBf16 ? 1 : kSplitK)>(p, grp, fg, smem, warp, lane, rr, fg < p.n_fgroups);
      return;
    }
  }
  if constexpr (!kSplitK) run_pass<kSwiglu, S, L, kBf16, W, 0, kWide, kWg>(p, grp, fg, smem, warp, lane, rr);
}

// One thread per (tile, k-pair, lane): the uint4 that lane will load in the gate/up kernel. wg (the warpgroup-mma
// instance, mainloop_wg): per tile and k-tile, 8 core matrices [k-block][row][8 k] instead, one uint4 a row's 8 k.
__global__ void prep_rows_kernel(const uint32_t* __restrict__ x, int64_t x_rows, int64_t x_ld_words,
                                 const int64_t* __restrict__ row_index, const int* __restrict__ pad_rows,
                                 int dense_rows, int n_tiles, int hidden, int pairs, int direct_k, int wg,
                                 uint4* __restrict__ frag, int* __restrict__ ready, int n_ready) {
  // The GEMM after a dense prep (launched as its programmatic dependent) may start now and stream its first weight
  // k-tiles while this grid runs; it reads the fragments only after griddepcontrol.wait (mainloop). A dense prep is
  // itself the programmatic dependent of the kernel before it (launch_prep): every thread waits for that grid here,
  // before it reads x (and so the GEMM's wait for this grid covers that kernel too).
  dev::launch_dependents();
  dev::grid_dependency_wait();
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < n_ready) ready[idx] = 0;  // kPdlPerPass: the passes' counts (the grid has >= n_ready threads)
  if (idx >= int64_t(n_tiles) * pairs * 32) return;
  const int lane = int(idx & 31), g = lane >> 2, t = lane & 3;
  const int64_t rest = idx >> 5;
  const int pp = int(rest % pairs), tile = int(rest / pairs);
  const int in_tile = int(idx % (int64_t(pairs) * 32));  // wg: row in_tile % 8, k from 8 (in_tile / 8)
  const int i = tile * kRowTile + (wg ? in_tile & 7 : g);
  int64_t src = pad_rows != nullptr ? pad_rows[i] : (i < dense_rows ? i : -1);
  if (src < 0) return;  // a padding row: the GEMMs never load it (mainloop reads row 0's instead)
  if (row_index != nullptr) src = row_index[src];
  // row_index values live on the device and are not checked by the binding (that would sync): an
  // out-of-range index reads as a zero row instead of past x. Without row_index, x_rows >= rows (checked).
  const bool valid = src >= 0 && src < x_rows;
  uint32_t v[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    // word e of pair pp: k-step j = 2 (pp % 2) + e / 2, register kh = e % 2 of k-tile pp / 2; its input column
    // in the logical order, or in direct_k_order (weights packed by pack_bf16_direct)
    const int k = wg ? 8 * (in_tile >> 3) + 2 * e
                : direct_k ? 64 * (pp >> 1) + 16 * t + 4 * (2 * (pp & 1) + (e >> 1)) + 2 * (e & 1)
                           : 32 * pp + 16 * (e >> 1) + 8 * (e & 1) + 2 * t;
    v[e] = (valid && k < hidden) ? __ldg(x + src * x_ld_words + k / 2) : 0u;
  }
  frag[idx] = make_uint4(v[0], v[1], v[2], v[3]);
}

// One thread per (tile, k-tile, lane): the same decode as the mainloop, written out as W [n, k]. direct: the tiles'
// K is in direct_k_order (pack_codes_direct: the lane's block scale t, and its k-step j's inputs 16 t + 4 j + 0..3),
// written back in the input's column order.
__global__ void dequant_packed_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s, int n_tiles,
                                      int nk, int k_pad, int direct, __nv_bfloat16* __restrict__ out) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(n_tiles) * nk * 32) return;
  const int lane = int(idx & 31), g = lane >> 2, t = lane & 3;
  const int64_t tk = idx >> 5;  // tile * nk + kt
  const int kt = int(tk % nk), tile = int(tk / nk);
  const uint4 qv = *reinterpret_cast<const uint4*>(q + tk * kTileCodeBytes + lane * 16);
  const uint2 sv = *reinterpret_cast<const uint2*>(s + tk * kTileScaleBytes + g * 8);
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  const int64_t ld = k_pad / 2;  // words per row
  const uint32_t sc_lane = decode_scales_lane(sv, t);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t a[4];
    if (direct) decode_a(word(qv, j), sc_lane, a);
    else decode_step(qv, sv, j, a);
    const int64_t r0 = int64_t(tile) * kTileN + g;
    const int64_t kw = (int64_t(kt) * kTileK + (direct ? 16 * t + 4 * j : 16 * j + 2 * t)) / 2;
    const int hi = direct ? 1 : 4;  // words on to the k-step's second input pair (k 2t + 8, 2t + 9 of the mma)
    o[r0 * ld + kw] = a[0];
    o[(r0 + 8) * ld + kw] = a[1];
    o[r0 * ld + kw + hi] = a[2];
    o[(r0 + 8) * ld + kw + hi] = a[3];
  }
}

// kernel<<<grid, block, smem, stream>>>(args...); pdl: as the programmatic dependent of the kernel ahead of it in the
// stream (it may start before that kernel ends, and waits for it with griddepcontrol.wait).
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, bool pdl, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  ROCKET_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// prep_rows_kernel over n thread slots; pdl: as the programmatic dependent of the kernel before it in the stream (dense
// rows: the norm or attention kernel that wrote x may let it start early, and the GEMM after it then too).
void launch_prep(int64_t n, bool pdl, cudaStream_t stream, const uint32_t* x, int64_t x_rows, int64_t x_ld_words,
                 const int64_t* row_index, const int* pad_rows, int dense_rows, int n_tiles, int hidden, int pairs,
                 int direct_k, bool wg, uint4* frag, int* ready, int n_ready) {
  const int threads = 256;
  launch_kernel(prep_rows_kernel, dim3(unsigned((n + threads - 1) / threads)), dim3(threads), 0, pdl, stream, x, x_rows,
                x_ld_words, row_index, pad_rows, dense_rows, n_tiles, hidden, pairs, direct_k, int(wg), frag, ready,
                n_ready);
}

// The dynamic shared memory attribute belongs to a function on each device: set once per (kernel, device).
template <typename Kernel>
void set_smem_attr(Kernel kernel, int bytes, bool (&done)[64]) {
  int dev = 0;
  ROCKET_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 64 || !done[dev]) {
    ROCKET_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    if (dev < 64) done[dev] = true;
  }
}

// pdl: launched as the programmatic dependent of the kernel before it in the stream (down: gate/up; a dense GEMM:
// its prep launch, or, NVFP4 rows read from x, the kernel that wrote x), so its blocks can start while that kernel's
// last wave runs (the wait is in mainloop).
template <bool kSwiglu, int S, int L, int B, bool kBf16, int W, int kSplitK = 0, bool kWide = false,
          bool kWg = false>
void launch_gemm_cfg(const GemmParams& p, bool pdl, cudaStream_t stream) {
  static bool done[64] = {};
  constexpr int bytes = block_smem<S, kBf16, W, kWide, kSplitK>();
  auto kernel = experts_gemm_kernel<kSwiglu, S, L, B, kBf16, W, kSplitK, kWide, kWg>;
  set_smem_attr(kernel, bytes, done);
  const int per_block = p.split_k ? W / p.split_k : W;  // feature groups per block
  const unsigned fblocks = (p.n_fgroups + per_block - 1) / per_block;
  ROCKET_CHECK((p.pass_major ? fblocks : unsigned(p.n_groups)) <= 65535u, "grid of " << fblocks << " x "
               << p.n_groups << " blocks");
  launch_kernel(kernel, p.pass_major ? dim3(p.n_groups, fblocks) : dim3(fblocks, p.n_groups), dim3(W * 32), bytes, pdl,
                stream, p);
}

// inst: the NVFP4 expert launches' instance (kWideOff, kWideOn, kWideWg; instance_for); BF16 tiles have one, dense
// NVFP4 rows two: weights with K in direct_k_order (direct_w: linears, an MLP's gate/up) or in the logical order (an
// MLP's down, whose rows gate/up writes).
template <bool kSwiglu>
void launch_gemm(const GemmParams& p, bool bf16, bool pdl, int inst, cudaStream_t stream, bool direct_w = false) {
  if (bf16) launch_gemm_cfg<kSwiglu, kBf16Ring, kBf16RingLookahead, kBf16BlocksPerSm, true, kBf16Warps>(p, pdl, stream);
  else if (p.split_k && direct_w)
    launch_gemm_cfg<kSwiglu, kSplitRing, kSplitLookahead, kSplitBlocksPerSm, false, kWarps, 2>(p, pdl, stream);
  else if (p.split_k)
    launch_gemm_cfg<kSwiglu, kSplitRing, kSplitLookahead, kSplitBlocksPerSm, false, kWarps, 1>(p, pdl, stream);
  else if (inst == kWideWg)
    launch_gemm_cfg<kSwiglu, kRing, kRingLookahead, kWideBlocksPerSm, false, kWarps, false, true, true>(p, pdl, stream);
  else if (inst == kWideOn)
    launch_gemm_cfg<kSwiglu, kRing, kRingLookahead, kWideBlocksPerSm, false, kWarps, false, true>(p, pdl, stream);
  else launch_gemm_cfg<kSwiglu, kRing, kRingLookahead, kBlocksPerSm, false, kWarps>(p, pdl, stream);
}

// The launch's pdl argument (rocket.h kPdl*), checked at each launch.
void check_pdl(int pdl) {
  ROCKET_CHECK(pdl == kPdlAuto || pdl == kPdlOff || pdl == kPdlPerPass, "pdl " << pdl << ": expected " << kPdlAuto
               << " (auto), " << kPdlOff << " (off) or " << kPdlPerPass << " (down waits for each pass of gate/up)");
}

// kPdlAuto: down as gate/up's dependent, each pass waiting for its own, except for launches of a few rows of x
// (tokens): there all of gate/up fits one wave, and the dependent's early blocks cost gate/up more than their
// weight copies gain. The mode never changes what a row computes, only when the weight copies and the rows start.
constexpr int64_t kPdlOffRows = 2;
int pdl_for(int pdl, int64_t rows) {
  if (pdl != kPdlAuto) return pdl;
  return rows <= kPdlOffRows ? kPdlOff : kPdlPerPass;
}

// K slices of a dense launch (the replicated stack's linears and MLPs, BF16 tiles): the launch's split argument, 1,
// 2, 4 or 8; 0: by the launch's shape alone, 4 for outputs of at least kSplit4Groups feature groups (8192 features,
// where 8 slices take more than one wave of 8-warp blocks), else 8. The slices set the order of each output's fp32
// sums, so the rule depends on no GPU property (the same bits on every rank whatever its GPU), and an explicit split
// must be the same on every rank; a row's bits still depend on no other row.
constexpr int kSplit4Groups = 256;
void check_split(int split) {
  ROCKET_CHECK(split == 0 || (split > 0 && split <= kBf16Warps && kBf16Warps % split == 0), "split " << split
               << ": expected 0 (by the output's width), 1, 2, 4 or 8");
}
int dense_split(int split, int n_fgroups) {
  if (split != 0) return split;
  return n_fgroups >= kSplit4Groups ? 4 : kBf16Warps;
}

void check_wide(int wide) {
  ROCKET_CHECK(wide == kWideAuto || wide == kWideOff || wide == kWideOn || wide == kWideWg, "wide " << wide
               << ": expected " << kWideAuto << " (auto), " << kWideOff << " (off), " << kWideOn << " (on) or "
               << kWideWg << " (warpgroup mma)");
}

// The warpgroup-mma instance runs on sm_90 GPUs (setup.py builds sm_90 as sm_90a); asked once per device.
bool wg_device() {
  static int cc[64] = {};  // 0: not asked yet, else major * 10 + minor
  int dev = 0;
  ROCKET_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64 && cc[dev] != 0) return cc[dev] == 90;
  int major = 0, minor = 0;
  ROCKET_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  ROCKET_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (dev < 64) cc[dev] = major * 10 + minor;
  return major == 9 && minor == 0;
}

// kWideAuto: the wide shape when the passes average more than this many row tiles (launch_plan's counts are exact; a
// device plan's are capacities, a pass per expert and tile, so decode steps stay off), with the warpgroup mma where
// the GPU and the shapes allow it (wg_ok), else mma.sync.
constexpr int kWideTilesPerPass = 2;
// The warpgroup-mma instance: an sm_90 GPU, and down's feature groups whole warpgroups (gate/up's always are:
// inter_pad / 16 of them).
bool wg_ok(int hidden_pad) { return (hidden_pad / (kFT * kTileN)) % 4 == 0 && wg_device(); }
int instance_for(int wide, int n_tiles, int n_groups, int hidden_pad) {
  if (wide == kWideWg)
    ROCKET_CHECK(wg_ok(hidden_pad), "wide " << kWideWg << " (warpgroup mma): needs an sm_90 GPU and a hidden size "
                 "padded to a multiple of " << 4 * kFT * kTileN << " (" << hidden_pad << ")");
  if (wide != kWideAuto) return wide;
  if (int64_t(n_tiles) <= int64_t(kWideTilesPerPass) * n_groups) return kWideOff;
  return wg_ok(hidden_pad) ? kWideWg : kWideOn;
}

// Rows and passes of an expert launch: its plan's, or dense rows (pass-major when there are several passes).
void pass_params(GemmParams& p, const ExpertsLaunch& a) {
  p.pad_rows = a.pad_rows;
  p.groups = a.groups;
  p.n_groups = a.n_groups;
  p.dense_rows = a.dense_rows;
  p.n_tiles = a.n_tiles;
  p.pass_major = a.pad_rows == nullptr && p.n_groups > 1;
  p.split_k = a.pad_rows == nullptr ? dense_split(a.split, p.n_fgroups) : 0;
  p.n_segs = 1;
}

// Dense rows in direct_k_order of at most 2 row tiles (decode steps), K a multiple of 64, x 16-byte aligned: the
// GEMM reads x itself (GemmParams::x_rows), no prep launch. Otherwise prep writes x_frag in that same order; a
// row's bits are the same either way.
bool rows_direct(const void* x, int64_t rows, int k) {
  return rows <= 2 * kRowTile && k % kTileK == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

}  // namespace

void check_launch_tuning(int pdl, int split, int wide) {
  check_pdl(pdl);
  check_split(split);
  check_wide(wide);
}

void launch_nvfp4_experts(const ExpertsLaunch& a, cudaStream_t stream) {
  check_pdl(a.pdl);
  check_split(a.split);
  check_wide(a.wide);
  ROCKET_CHECK(a.split == 0 || a.pad_rows == nullptr, "split " << a.split << ": dense rows only (expert launches: 0)");
  ROCKET_CHECK(a.hidden % 16 == 0 && a.inter % 16 == 0, "hidden " << a.hidden << ", inter " << a.inter
               << ": NVFP4 needs multiples of 16");
  ROCKET_CHECK(a.hidden_pad % kTileK == 0 && a.inter_pad % kTileK == 0 && a.hidden_pad >= a.hidden &&
               a.inter_pad >= a.inter, "padded sizes " << a.hidden_pad << ", " << a.inter_pad);
  const bool dense = a.pad_rows == nullptr;
  ROCKET_CHECK(a.s2_dn == nullptr || (dense && !a.bf16), "s2_dn: dense rows of NVFP4 tiles only");
  ROCKET_CHECK(a.n_res >= 0 && a.n_res <= kMaxResiduals && (a.n_res == 0 || dense), a.n_res
               << " residuals (at most " << kMaxResiduals << ", dense rows only)");
  ROCKET_CHECK(dense == (a.groups == nullptr) && (!dense || (a.dense_rows >= 0 && a.n_tiles ==
               (a.dense_rows + kRowTile - 1) / kRowTile && a.n_groups == (a.n_tiles + kMaxRowTiles - 1) /
               kMaxRowTiles)), "dense rows " << a.dense_rows << ": tiles " << a.n_tiles << ", passes " << a.n_groups);
  ROCKET_CHECK(a.n_tiles >= 0 && a.n_groups >= 0 && (dense || a.n_groups <= 65535), "groups " << a.n_groups);
  if (a.n_tiles == 0 || a.n_groups == 0) return;
  const int pdl = pdl_for(a.pdl, dense ? a.dense_rows : a.x_rows);
  // dense NVFP4 rows: the split instance; BF16 tiles: their one instance
  const int inst = dense || a.bf16 ? kWideOff : instance_for(a.wide, a.n_tiles, a.n_groups, a.hidden_pad);
  // per-pass readiness: NVFP4 expert launches (their down kernel reads h_frag only through the rows ring)
  const bool ready = pdl == kPdlPerPass && !dense && !a.bf16 && a.ready != nullptr;
  ROCKET_CHECK(!ready || a.n_groups <= a.n_tiles, "groups " << a.n_groups << " > tiles " << a.n_tiles);

  ROCKET_CHECK(!a.direct_k || (dense && a.row_index == nullptr), "direct_k_order: dense rows of x only");
  const bool direct = a.direct_k && rows_direct(a.x, a.dense_rows, a.hidden);
  if (!direct) {  // rows -> fragments
    const int pairs = a.hidden_pad / 32;
    const int64_t n = int64_t(a.n_tiles) * pairs * 32;
    launch_prep(n, dense, stream, static_cast<const uint32_t*>(a.x), a.x_rows, a.hidden / 2, a.row_index, a.pad_rows,
                a.dense_rows, a.n_tiles, a.hidden, pairs, a.direct_k, inst == kWideWg, a.x_frag,
                ready ? a.ready : nullptr, ready ? a.n_groups : 0);
  }
  {  // gate/up + SwiGLU: N = 2 inter_pad (tiles of 8 gate + 8 up), K = hidden_pad
    GemmParams p{};
    p.q = a.q_gu;
    p.s = a.s_gu;
    p.q_far = a.q_gu_far;
    p.s_far = a.s_gu_far;
    p.near = a.near;
    p.nk = a.hidden_pad / kTileK;
    const int tiles = 2 * a.inter_pad / kTileN;
    p.q_slot_stride = int64_t(tiles) * p.nk * (a.bf16 ? kBf16TileBytes : kTileCodeBytes);
    p.s_slot_stride = a.bf16 ? 0 : int64_t(tiles) * p.nk * kTileScaleBytes;
    p.w_mul = a.bf16 ? 1.0f : 256.0f;
    p.frag = a.x_frag;
    if (direct) {
      p.x_rows = static_cast<const uint4*>(a.x);
      p.x_ld4 = a.hidden / 8;
    }
    p.groups = a.groups;
    p.n_fgroups = tiles / kFT;
    p.s2 = a.s2_gu;
    p.limit = a.swiglu_limit;
    p.has_limit = a.has_limit;
    p.h_frag = reinterpret_cast<uint32_t*>(a.h_frag);
    p.h_pairs = a.inter_pad / 32;
    p.ready = ready ? a.ready : nullptr;
    pass_params(p, a);
    // dense rows: prep's dependent (NVFP4 reading x itself: the dependent of the kernel that wrote x)
    launch_gemm<true>(p, a.bf16 != 0, dense && (!direct || !a.bf16), inst, stream, dense && a.direct_k);
  }
  {  // down: N = hidden_pad, K = inter_pad
    GemmParams p{};
    p.q = a.q_dn;
    p.s = a.s_dn;
    p.q_far = a.q_dn_far;
    p.s_far = a.s_dn_far;
    p.near = a.near;
    p.nk = a.inter_pad / kTileK;
    const int tiles = a.hidden_pad / kTileN;
    p.q_slot_stride = int64_t(tiles) * p.nk * (a.bf16 ? kBf16TileBytes : kTileCodeBytes);
    p.s_slot_stride = a.bf16 ? 0 : int64_t(tiles) * p.nk * kTileScaleBytes;
    p.w_mul = a.bf16 ? 1.0f : 256.0f;
    p.frag = a.h_frag;
    p.groups = a.groups;
    p.n_fgroups = tiles / kFT;
    p.out = static_cast<__nv_bfloat16*>(a.out);
    p.hidden = a.hidden;
    p.ready = ready ? a.ready : nullptr;
    p.ready_need = ready ? 2 * a.inter_pad / kTileN / kFT : 0;  // gate/up's feature groups: one count per warp
    pass_params(p, a);
    p.s2_out = a.s2_dn;
    p.n_res = a.n_res;
    for (int r = 0; r < a.n_res; ++r) p.res[r] = static_cast<const __nv_bfloat16*>(a.res[r]);
    launch_gemm<false>(p, a.bf16 != 0, pdl == kPdlPerPass, inst, stream);
  }
}

namespace {

// One linear of the stack over dense rows: BF16 tiles (K in direct_k_order: up to 16 rows read from x itself) or
// NVFP4 tiles (rows through a prep launch, each part's weight_scale_2 in the epilogue's multiplier); K split by
// the output's width either way (dense_split).
void launch_linear(const LinearLaunch& a, bool nvfp4, cudaStream_t stream) {
  check_split(a.split);
  ROCKET_CHECK(a.k % 16 == 0 && a.k_pad % kTileK == 0 && a.k_pad >= a.k && a.n % 16 == 0 &&
               a.n_pad % (kFT * kTileN) == 0 && a.n_pad >= a.n, "linear [" << a.n << ", " << a.k << "] padded to ["
               << a.n_pad << ", " << a.k_pad << "]");
  ROCKET_CHECK(a.n_segs >= 1 && a.n_segs <= kMaxSegs && a.seg_end[a.n_segs - 1] == a.n, a.n_segs << " output parts");
  ROCKET_CHECK(a.n_res >= 0 && a.n_res <= kMaxResiduals && (a.n_res == 0 || a.n_segs == 1), a.n_res
               << " residuals for " << a.n_segs << " output parts (at most " << kMaxResiduals << ", one part)");
  for (int s = 0; s + 1 < a.n_segs; ++s)
    ROCKET_CHECK(a.seg_end[s] % (kFT * kTileN) == 0 && a.seg_end[s] < a.seg_end[s + 1], "output part " << s
                 << " ends at feature " << a.seg_end[s] << ": parts end at multiples of " << kFT * kTileN);
  if (a.rows == 0) return;
  const int n_tiles = int((a.rows + kRowTile - 1) / kRowTile);
  // BF16 and NVFP4 tiles alike: the weights are in direct_k_order (stack.py pack_linear)
  const bool direct = rows_direct(a.x, a.rows, a.k);
  if (!direct) {  // rows -> fragments
    const int pairs = a.k_pad / 32;
    const int64_t n = int64_t(n_tiles) * pairs * 32;
    launch_prep(n, true, stream, static_cast<const uint32_t*>(a.x), a.rows, a.k / 2, nullptr, nullptr, int(a.rows),
                n_tiles, a.k, pairs, 1, false, a.x_frag, nullptr, 0);
  }
  GemmParams p{};
  p.q = static_cast<const uint8_t*>(a.w);
  p.s = static_cast<const uint8_t*>(a.s);
  p.nk = a.k_pad / kTileK;
  p.w_mul = nvfp4 ? 256.0f * a.w_scale[0] : 1.0f;  // 2^8 undoes the packed 2^-8 (exact), then weight_scale_2
  p.frag = a.x_frag;
  if (direct) {
    p.x_rows = static_cast<const uint4*>(a.x);
    p.x_ld4 = a.k / 8;
  }
  p.n_fgroups = a.n_pad / (kFT * kTileN);
  p.out = static_cast<__nv_bfloat16*>(a.seg_out[0]);
  p.hidden = a.n;
  p.bias = static_cast<const __nv_bfloat16*>(a.bias);
  p.dense_rows = int(a.rows);
  p.n_tiles = n_tiles;
  p.n_groups = (n_tiles + kMaxRowTiles - 1) / kMaxRowTiles;
  p.pass_major = p.n_groups > 1;
  p.split_k = dense_split(a.split, p.n_fgroups);
  p.n_segs = a.n_segs;
  for (int s = 0; s < a.n_segs; ++s) {
    p.seg_end[s] = a.seg_end[s];
    p.seg_out[s] = static_cast<__nv_bfloat16*>(a.seg_out[s]);
    p.seg_mul[s] = nvfp4 ? 256.0f * a.w_scale[s] : 1.0f;
  }
  p.n_res = a.n_res;
  for (int r = 0; r < a.n_res; ++r) p.res[r] = static_cast<const __nv_bfloat16*>(a.res[r]);
  // after a prep launch: its programmatic dependent; NVFP4 reading x itself: the dependent of the kernel that wrote x
  launch_gemm<false>(p, !nvfp4, !direct || nvfp4, kWideOff, stream, nvfp4);
}

}  // namespace

void launch_bf16_linear(const LinearLaunch& a, cudaStream_t stream) {
  ROCKET_CHECK(a.s == nullptr, "launch_bf16_linear: BF16 tiles have no block scales");
  launch_linear(a, false, stream);
}

void launch_nvfp4_linear(const LinearLaunch& a, cudaStream_t stream) {
  ROCKET_CHECK(a.s != nullptr, "launch_nvfp4_linear: NVFP4 tiles need their block scales");
  for (int s = 0; s < a.n_segs && s < kMaxSegs; ++s)
    ROCKET_CHECK(a.w_scale[s] > 0.0f, "output part " << s << ": weight_scale_2 " << a.w_scale[s] << ", expected > 0");
  launch_linear(a, true, stream);
}

void launch_nvfp4_dequant_packed(const uint8_t* q, const uint8_t* s, int n_pad, int k_pad, bool direct, void* out,
                                 cudaStream_t stream) {
  ROCKET_CHECK(n_pad % kTileN == 0 && k_pad % kTileK == 0, "padded shape [" << n_pad << ", " << k_pad << "]");
  const int n_tiles = n_pad / kTileN, nk = k_pad / kTileK;
  const int64_t n = int64_t(n_tiles) * nk * 32;
  if (n == 0) return;
  const int threads = 256;
  dequant_packed_kernel<<<unsigned((n + threads - 1) / threads), threads, 0, stream>>>(
      q, s, n_tiles, nk, k_pad, int(direct), static_cast<__nv_bfloat16*>(out));
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
