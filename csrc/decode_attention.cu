// GLM-4.x decode attention (GQA, one query per stream) over the cache, split over the positions in fixed chunks, and
// batch-invariant: every sum that makes a stream's output has one order, fixed by the stream's own length (and the
// model's head dim), never by the other streams, their lengths, the stream's row in the launch or the span the
// launch covers; the kernel never reads a cache position past the stream's own.
//
//   chunks   block (chunk c, kv head x tile of 16 query heads, row r), 8 warps: positions [256 c, 256 c + 256) of
//            the row's stream, those below its length n = pos[r] + 1 (blocks of chunks past n return at once).
//            Warp w takes the chunk's positions 32 w .. 32 w + 31: its keys straight into registers (16-byte loads),
//            its values into shared memory (cp.async, the rows past n zero-filled), then on the tensor cores
//            (mma.m16n8k16, bf16 in, fp32 out): scores s = q.k of the tile's heads against its positions, t = s x
//            scale; the chunk's max m per head (over the 8 warps in shared memory), p = exp(t - m) rounded to bf16
//            (0 past n), l = the sum of those p, o = p.v. The warps' o and l are added in warp order. A stream whose
//            positions fit one chunk gets out = bf16(o / l) from its block; else the block writes (m, l, o).
//   combine  block (query head, row) of a stream with two chunks or more: M = the chunks' largest m, then in chunk
//            order L = sum l_c exp(m_c - M) and O = sum o_c exp(m_c - M); out = bf16(O / L). Launched only when
//            the launch spans more than one chunk.
//
// The sums' orders are the mma's (fixed by the instruction and the fragment each position and channel sits in), the
// lanes' in a fixed butterfly, the warps' and chunks' in ascending order; a position's fragment slot is set by the
// position itself, and the zeros past n (scores masked, p exactly 0, values zero-filled) sit in slots of their own.
// rocket_mpi/ops/attention.py decode_attention_ref is the same arithmetic in torch (each sum in torch's order): the
// GPU tests hold the kernel within a bf16 rounding of it, and bitwise equal to itself across batches and spans.
//
// Fragments (common.cuh's mma layout, lane = 4 g + t). A channel permutation makes every load 16 bytes: the k index
// of the q.k mma is not d but the slot of d in its lane's run of 8, k-steps in pairs, d = 32 u + 8 t + 2 i + e for
// k-step 2 u + (i >> 1) and k = 2 t + e + 8 (i & 1) (q and k permuted alike, so the dot product is over every d once).
// A head dim of 16 takes runs of 4 (one k-step: d = 4 t + 2 i + e).
#include "common.cuh"

namespace rocket {
namespace {

constexpr int kChunk = kDecodeAttentionChunk;
constexpr int kWarps = 8;
constexpr int kSeg = kChunk / kWarps;  // positions per warp: 32
constexpr int kThreads = kWarps * 32;
constexpr int kHeads = 16;             // query heads per block: the mma's 16 rows
constexpr int kCombineThreads = 128;

// 16 bytes global -> shared; nothing read and 16 zero bytes written where !valid.
__device__ __forceinline__ void cp_async_16_zfill(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dev::smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}

// Four 8x8 bf16 matrices, transposed (ldmatrix .trans): lanes 8 i .. 8 i + 7 give the rows of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(dev::smem_addr(smem))
               : "memory");
}

// W 32-bit words (W = 4: 16 bytes, W = 2: 8 bytes) from global memory, or zeros where !valid (nothing read).
template <int W>
__device__ __forceinline__ void load_words(uint32_t (&w)[W], const __nv_bfloat16* p, bool valid) {
  if constexpr (W == 4) {
    const uint4 v = valid ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
  } else {
    const uint2 v = valid ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0, 0);
    w[0] = v.x;
    w[1] = v.y;
  }
}

// The stream length a row attends: pos + 1, clamped to [0, span]; 0 where its cache row is out of range.
__device__ __forceinline__ int row_length(const DecodeAttention& a, int r, int64_t& stream) {
  stream = a.index != nullptr ? a.index[r] : r;
  if (stream < 0 || stream >= a.cache_rows) return 0;
  const int64_t p = a.pos[r];
  return p < 0 ? 0 : (p >= a.span ? a.span : int(p) + 1);
}

template <int D>
__global__ void __launch_bounds__(kThreads, 2) decode_attention_chunks_kernel(const DecodeAttention a) {
  constexpr int kSlice = D >= 32 ? 32 : 16;  // channels of one lane-group run (section comment)
  constexpr int kSlices = D / kSlice;
  constexpr int kWords = kSlice / 8;         // 32-bit words per lane per run
  constexpr int kNt = kSeg / 8;              // score n-tiles (8 positions) per warp
  constexpr int kDt = D / 8;                 // output n-tiles (8 channels)
  constexpr int kStride = D + 8;             // shared row: values bf16, then the warps' o fp32 (ldmatrix rows in
                                             // distinct banks)
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* vs = reinterpret_cast<__nv_bfloat16*>(smem);                         // [kChunk][kStride] bf16
  float* red_o = reinterpret_cast<float*>(smem);                                      // [kWarps][16][kStride] fp32
  float* red_m = reinterpret_cast<float*>(smem + size_t(kChunk) * kStride * 2);       // [kWarps][16]
  float* red_l = red_m + kWarps * kHeads;                                             // [kWarps][16]

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int c = blockIdx.x, r = blockIdx.z;
  const int grp = a.hq / a.hkv, tiles = (grp + kHeads - 1) / kHeads;
  const int kvh = blockIdx.y / tiles, h0 = (blockIdx.y % tiles) * kHeads;
  const int gt = min(kHeads, grp - h0);                       // heads of this block's tile
  const int64_t head0 = int64_t(r) * a.hq + int64_t(kvh) * grp + h0;   // its first (row, query head)
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out);
  int64_t stream = 0;
  const int n = row_length(a, r, stream);
  const int nch = (n + kChunk - 1) / kChunk;
  if (n == 0) {  // nothing to attend: zeros, as from a row that sees no key
    if (c == 0)
      for (int i = threadIdx.x; i < gt * D; i += kThreads) out[head0 * D + i] = __float2bfloat16_rn(0.0f);
    return;
  }
  if (c >= nch) return;
  const int c0 = c * kChunk, cnt = min(kChunk, n - c0);          // this chunk's positions below n
  const int vw = max(0, min(kSeg, cnt - warp * kSeg));            // this warp's
  const int64_t base = (stream * a.hkv + kvh) * int64_t(a.cap) * D;
  const __nv_bfloat16* kbase = static_cast<const __nv_bfloat16*>(a.kc) + base + int64_t(c0 + warp * kSeg) * D;
  const __nv_bfloat16* vbase = static_cast<const __nv_bfloat16*>(a.vc) + base + int64_t(c0 + warp * kSeg) * D;

  // the warp's values into its 32 rows of vs (zeros past n), in flight while the scores are made
  __nv_bfloat16* vw_rows = vs + warp * kSeg * kStride;
  if (vw > 0) {
#pragma unroll
    for (int i = lane; i < kSeg * (D / 8); i += 32) {
      const int row = i / (D / 8), col = (i % (D / 8)) * 8;
      const bool ok = row < vw;
      cp_async_16_zfill(vw_rows + row * kStride + col, ok ? vbase + int64_t(row) * D + col : vbase, ok);
    }
  }
  dev::cp_async_commit();

  // scores: s[nt] = the tile's heads (rows g, g + 8) . positions 8 nt + 2 t, + 1 of the warp's 32
  float s[kNt][4];
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
  if (vw > 0) {
    uint32_t qa[kSlices][kWords], qb[kSlices][kWords];  // heads g and g + 8 (zeros past the tile)
    const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(a.q);
#pragma unroll
    for (int u = 0; u < kSlices; ++u) {
      load_words<kWords>(qa[u], q + (head0 + g) * D + u * kSlice + t * (kSlice / 4), g < gt);
      load_words<kWords>(qb[u], q + (head0 + g + 8) * D + u * kSlice + t * (kSlice / 4), g + 8 < gt);
    }
    uint32_t kw[kNt][kSlices][kWords];  // key of position 8 nt + g, the lane's runs
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int u = 0; u < kSlices; ++u)
        load_words<kWords>(kw[nt][u], kbase + int64_t(8 * nt + g) * D + u * kSlice + t * (kSlice / 4),
                           8 * nt + g < vw);
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int u = 0; u < kSlices; ++u)
#pragma unroll
        for (int i = 0; i < kWords / 2; ++i) {
          const uint32_t af[4] = {qa[u][2 * i], qb[u][2 * i], qa[u][2 * i + 1], qb[u][2 * i + 1]};
          dev::mma_bf16_16816(s[nt], af, kw[nt][u][2 * i], kw[nt][u][2 * i + 1]);
        }
  }
  // t = s x scale, -inf past n; the warp's max per head (its 4 lanes of a head row), then the block's
  float mg = -INFINITY, mg8 = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool ok = 8 * nt + 2 * t + e < vw;
      s[nt][e] = ok ? __fmul_rn(s[nt][e], a.scale) : -INFINITY;
      s[nt][2 + e] = ok ? __fmul_rn(s[nt][2 + e], a.scale) : -INFINITY;
      mg = fmaxf(mg, s[nt][e]);
      mg8 = fmaxf(mg8, s[nt][2 + e]);
    }
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    mg = fmaxf(mg, __shfl_xor_sync(0xffffffffu, mg, o));
    mg8 = fmaxf(mg8, __shfl_xor_sync(0xffffffffu, mg8, o));
  }
  if (t == 0) {
    red_m[warp * kHeads + g] = mg;
    red_m[warp * kHeads + g + 8] = mg8;
  }
  __syncthreads();
  mg = mg8 = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    mg = fmaxf(mg, red_m[w * kHeads + g]);
    mg8 = fmaxf(mg8, red_m[w * kHeads + g + 8]);
  }
  // p = bf16(exp(t - m)) (0 past n), l = their sum: each lane its positions in order, then lanes t ^ 1, t ^ 2
  uint32_t pa[kNt][2];  // bf16 pairs: (head g, positions 8 nt + 2 t, + 1), (head g + 8, the same)
  float lg = 0.0f, lg8 = 0.0f;
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float m = e < 2 ? mg : mg8;
      p[e] = s[nt][e] == -INFINITY ? 0.0f : dev::round_bf16(expf(__fsub_rn(s[nt][e], m)));
    }
    lg = __fadd_rn(__fadd_rn(lg, p[0]), p[1]);
    lg8 = __fadd_rn(__fadd_rn(lg8, p[2]), p[3]);
    pa[nt][0] = dev::bf16x2_bits(__floats2bfloat162_rn(p[0], p[1]));
    pa[nt][1] = dev::bf16x2_bits(__floats2bfloat162_rn(p[2], p[3]));
  }
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    lg = __fadd_rn(lg, __shfl_xor_sync(0xffffffffu, lg, o));
    lg8 = __fadd_rn(lg8, __shfl_xor_sync(0xffffffffu, lg8, o));
  }
  if (t == 0) {
    red_l[warp * kHeads + g] = lg;
    red_l[warp * kHeads + g + 8] = lg8;
  }
  // o = p . v over the warp's positions, 16 a k-step; values transposed out of shared memory into B fragments
  float o[kDt][4];
#pragma unroll
  for (int dt = 0; dt < kDt; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  dev::cp_async_wait<0>();
  __syncwarp();  // the warp's value rows, copied by its lanes, are visible to all of them
  if (vw > 0) {
#pragma unroll
    for (int ks = 0; ks < kSeg / 16; ++ks) {
      const uint32_t af[4] = {pa[2 * ks][0], pa[2 * ks][1], pa[2 * ks + 1][0], pa[2 * ks + 1][1]};
      const int mat = lane >> 3;  // this lane's row address: matrix mat (+8 positions: bit 0, +8 channels: bit 1)
      const __nv_bfloat16* row = vw_rows + (16 * ks + (lane & 7) + 8 * (mat & 1)) * kStride + 8 * (mat >> 1);
#pragma unroll
      for (int dp = 0; dp < kDt / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, row + 16 * dp);
        dev::mma_bf16_16816(o[2 * dp], af, b[0], b[1]);
        dev::mma_bf16_16816(o[2 * dp + 1], af, b[2], b[3]);
      }
    }
  }
  __syncthreads();  // every warp's ldmatrix reads are done: red_o takes vs's bytes
  if (vw > 0) {
#pragma unroll
    for (int dt = 0; dt < kDt; ++dt) {
      float* at = red_o + (warp * kHeads + g) * kStride + 8 * dt + 2 * t;
      *reinterpret_cast<float2*>(at) = make_float2(o[dt][0], o[dt][1]);
      *reinterpret_cast<float2*>(at + 8 * kStride) = make_float2(o[dt][2], o[dt][3]);
    }
  }
  __syncthreads();
  // the warps in order: o and l of the chunk; its output, or its partial for the combine
  const int nw = (cnt + kSeg - 1) / kSeg;
  for (int i = threadIdx.x; i < gt * D; i += kThreads) {
    const int hh = i / D, d = i % D;
    float ov = red_o[hh * kStride + d], lv = red_l[hh];
    for (int w = 1; w < nw; ++w) {
      ov = __fadd_rn(ov, red_o[(w * kHeads + hh) * kStride + d]);
      lv = __fadd_rn(lv, red_l[w * kHeads + hh]);
    }
    const int64_t row = head0 + hh;
    if (nch == 1) {
      out[row * D + d] = __float2bfloat16_rn(__fdiv_rn(ov, lv));
    } else {
      a.part_o[(row * a.chunks + c) * D + d] = ov;
      if (d == 0) {
        float mv = -INFINITY;
        for (int w = 0; w < kWarps; ++w) mv = fmaxf(mv, red_m[w * kHeads + hh]);
        a.part_ml[(row * a.chunks + c) * 2] = mv;
        a.part_ml[(row * a.chunks + c) * 2 + 1] = lv;
      }
    }
  }
}

__global__ void __launch_bounds__(kCombineThreads) decode_attention_combine_kernel(const DecodeAttention a) {
  dev::launch_dependents();  // o's row prep (a programmatic dependent) may start: it waits for this grid
  const int h = blockIdx.x, r = blockIdx.y;
  int64_t stream = 0;
  const int n = row_length(a, r, stream);
  const int nch = (n + kChunk - 1) / kChunk;
  if (nch <= 1) return;  // the chunk kernel wrote it
  const int64_t row = int64_t(r) * a.hq + h;
  const float* ml = a.part_ml + row * a.chunks * 2;
  float mx = -INFINITY;
  for (int k = 0; k < nch; ++k) mx = fmaxf(mx, ml[2 * k]);
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out);
  for (int d = threadIdx.x; d < a.d; d += kCombineThreads) {
    float lv = 0.0f, ov = 0.0f;
    for (int k = 0; k < nch; ++k) {
      const float w = expf(__fsub_rn(ml[2 * k], mx));
      lv = __fadd_rn(lv, __fmul_rn(ml[2 * k + 1], w));
      ov = __fadd_rn(ov, __fmul_rn(a.part_o[(row * a.chunks + k) * a.d + d], w));
    }
    out[row * a.d + d] = __float2bfloat16_rn(__fdiv_rn(ov, lv));
  }
}

template <int D>
constexpr int chunk_smem() {
  return kChunk * (D + 8) * 2 + 2 * kWarps * kHeads * 4;
}

template <int D>
void launch_chunks(const DecodeAttention& a, dim3 grid, cudaStream_t stream) {
  static bool done[64] = {};  // the dynamic shared memory attribute, once per device
  constexpr int bytes = chunk_smem<D>();
  int dev = 0;
  ROCKET_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 64 || !done[dev]) {
    ROCKET_CUDA_CHECK(cudaFuncSetAttribute(decode_attention_chunks_kernel<D>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    if (dev < 64) done[dev] = true;
  }
  decode_attention_chunks_kernel<D><<<grid, kThreads, bytes, stream>>>(a);
  ROCKET_LAUNCH_CHECK();
}

}  // namespace

int decode_attention_chunks(int span) { return (span + kChunk - 1) / kChunk; }

bool decode_attention_takes(int hq, int hkv, int d) {
  return hkv > 0 && hq > 0 && hq % hkv == 0 && (d == 16 || d == 32 || d == 64 || d == 128);
}

void launch_decode_attention(const DecodeAttention& a, cudaStream_t stream) {
  ROCKET_CHECK(decode_attention_takes(a.hq, a.hkv, a.d), "decode_attention: " << a.hq << " query heads, " << a.hkv
               << " kv heads (a divisor), head dim " << a.d << " (16, 32, 64 or 128)");
  ROCKET_CHECK(a.span >= 1 && a.span <= a.cap && a.rows >= 0 && a.rows <= 65535 && a.cache_rows >= 0,
               "decode_attention: span " << a.span << " of " << a.cap << " cache positions, " << a.rows
               << " rows (at most 65535)");
  ROCKET_CHECK(a.chunks == decode_attention_chunks(a.span) && (a.chunks < 2 || (a.part_o && a.part_ml)),
               "decode_attention: " << a.chunks << " chunks for span " << a.span << " (scratch for 2 or more)");
  if (a.rows == 0) return;
  const int tiles = (a.hq / a.hkv + kHeads - 1) / kHeads;
  ROCKET_CHECK(int64_t(a.hkv) * tiles <= 65535, "decode_attention: " << a.hkv << " kv heads x " << tiles
               << " head tiles");
  const dim3 grid(unsigned(a.chunks), unsigned(a.hkv * tiles), unsigned(a.rows));
  switch (a.d) {
    case 16: launch_chunks<16>(a, grid, stream); break;
    case 32: launch_chunks<32>(a, grid, stream); break;
    case 64: launch_chunks<64>(a, grid, stream); break;
    default: launch_chunks<128>(a, grid, stream); break;
  }
  if (a.chunks >= 2) {
    decode_attention_combine_kernel<<<dim3(unsigned(a.hq), unsigned(a.rows)), kCombineThreads, 0, stream>>>(a);
    ROCKET_LAUNCH_CHECK();
  }
}

}  // namespace rocket
