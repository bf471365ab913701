// rocket_mpi CUDA kernels: the one host interface (plain C++, no torch).
//
// The .cu files define kernels and the launchers declared here; bindings.cpp is the only file that
// sees torch, and it turns tensors into these pointers after checking them. Every launcher throws
// std::runtime_error (file:line, what) on a bad argument or a failed launch.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>

#include <cuda_runtime_api.h>

#define ROCKET_CHECK(cond, what)                                                             \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::ostringstream rocket_msg_;                                                        \
      rocket_msg_ << __FILE__ << ":" << __LINE__ << ": check failed (" #cond "): " << what;  \
      throw std::runtime_error(rocket_msg_.str());                                           \
    }                                                                                        \
  } while (0)

#define ROCKET_CUDA_CHECK(expr)                                                              \
  do {                                                                                       \
    cudaError_t rocket_err_ = (expr);                                                        \
    if (rocket_err_ != cudaSuccess) {                                                        \
      std::ostringstream rocket_msg_;                                                        \
      rocket_msg_ << __FILE__ << ":" << __LINE__ << ": " #expr " failed: "                   \
                  << cudaGetErrorName(rocket_err_) << ": " << cudaGetErrorString(rocket_err_); \
      throw std::runtime_error(rocket_msg_.str());                                           \
    }                                                                                        \
  } while (0)

namespace rocket {

// ---- packed NVFP4 layout (rocket_mpi/kernels/pack.py writes it; DESIGN in that file) ----
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

struct ExpertsLaunch {
  // rows
  const void* x;              // bf16 [*, hidden] row-major, `x_rows` rows
  int64_t x_rows;
  const int64_t* row_index;   // nullable: block row r reads x[row_index[r]]
  const int* pad_rows;        // [tiles * 8] block row of each padded row, -1 = padding
  const int4* groups;         // [n_groups] (slot, first tile, tiles 1..4, 0): one weight pass each
  int n_groups, n_tiles;
  // packed experts, `slot` indexes the leading dimension
  const uint8_t *q_gu, *s_gu;  // gate/up tiles interleaved: tile T = gate rows 8T..8T+7, up rows 8T..8T+7
  const float* s2_gu;          // [slots][2] weight_scale_2 of gate, up
  const uint8_t *q_dn, *s_dn;  // down [hidden_pad, inter_pad]; its weight_scale_2 is the scatter's
  int hidden, inter;           // logical sizes (multiples of 16)
  int hidden_pad, inter_pad;   // multiples of 64
  float swiglu_limit;          // used when has_limit
  int has_limit;
  // scratch and result
  uint4* x_frag;               // [tiles][hidden_pad/32][32] uint4
  uint4* h_frag;               // [tiles][inter_pad/32][32] uint4
  void* out;                   // bf16 [out_rows, hidden]
  int64_t out_rows;
};

// x rows -> x_frag, gate/up + SwiGLU -> h_frag, down -> out. Batch-invariant: see nvfp4_experts.cu.
void launch_nvfp4_experts(const ExpertsLaunch& a, cudaStream_t stream);

// Packed tiles -> W [n_pad, k_pad] bf16 as the kernel sees it (E2M1 x scale x 2^-8). A test hook.
void launch_nvfp4_dequant_packed(const uint8_t* q, const uint8_t* s, int n_pad, int k_pad, void* out,
                                 cudaStream_t stream);

// out[t] = bf16(sum_j coef[t,j] * rows[by_token[t,j]]), fp32 in j order from 0.0f, one rounding.
void launch_moe_scatter_add(const void* rows, int64_t n_rows, const int64_t* by_token, const float* coef,
                            void* out, int tokens, int topk, int hidden, cudaStream_t stream);

}  // namespace rocket
