// The tokens of a GLM-5.3-Flash KDA layer (rocket_mpi/model/glm5_next_kda.py has the math and the torch reference),
// from the q|k|v projection's output to o_proj's input, in one launch: per (token, head) the short causal convolution
// (its state shifted in place), SiLU, the l2-normed q and k, the forget gate's log decay, beta, the delta-rule update of
// the recurrent state [dk, dv] fp32 in place, q^T S, its bf16 rounding and the gated RMSNorm. In torch that is ~30
// small kernels per token and layer, and the state (64 KiB per head, 4 MiB per stream and layer) is read and written
// by about ten of them; here once per segment.
//
// A segment is one stream's consecutive tokens: a decode step has one token per stream (offsets null: segment i is
// token i), a prefill a stream's whole prompt, its tokens one after another in the block with the state in
// registers (torch's prefill: a loop of ~10 kernels per token). Each token's arithmetic is the same whatever the
// segment, so a prefill of n tokens gives the bits of n decode launches of one token each (a GPU test checks it).
//
// Block (head, segment): dk x 4 threads, thread (c, y) owns state column c (a dv index) and rows y R .. y R + R - 1
// (R = dk / 4). The head's per-k vectors are computed once, a row of threads each (q, k, v and the decay), and shared
// through shared memory; sums over dk run in a fixed order (a thread's rows ascending, then the four quarters in order;
// vector norms: a butterfly within each warp, then the warps in order). Deterministic, and a stream's result depends
// on no other stream. Not bitwise torch's (its sums run in cuBLAS / reduction order): tests compare within a tolerance
// (tests/test_glm5_next_kernels.py).
#include "common.cuh"

namespace rocket {
namespace {

constexpr int kKdaQuarters = 4;
constexpr int kKdaMaxDk = 128;
constexpr int kKdaMaxConv = 8;  // the short convolution's kernel size
constexpr int kKdaMaxR = kKdaMaxDk / kKdaQuarters;  // state rows per thread

__device__ __forceinline__ float kda_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Sum of v over the dk threads of this thread's row (threadIdx.y), every thread of the row gets it. dk: a power of
// two, 16..128; buf: [kKdaQuarters][kKdaMaxDk / 32] floats.
__device__ __forceinline__ float row_sum(float v, int dk, float* buf) {
  const int width = dk < 32 ? dk : 32;
  for (int d = width / 2; d > 0; d >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, d, width));
  if (dk <= 32) return v;
  const int warps = dk / 32, w = threadIdx.x / 32;
  __syncthreads();  // buf is free (an earlier row_sum's readers are done)
  if ((threadIdx.x & 31) == 0) buf[threadIdx.y * (kKdaMaxDk / 32) + w] = v;
  __syncthreads();
  float s = buf[threadIdx.y * (kKdaMaxDk / 32)];
  for (int i = 1; i < warps; ++i) s = __fadd_rn(s, buf[threadIdx.y * (kKdaMaxDk / 32) + i]);
  return s;
}

__global__ void __launch_bounds__(kKdaMaxDk * kKdaQuarters, 1) kda_decode_kernel(const KdaDecode a) {
  dev::launch_dependents();  // o's row prep (a programmatic dependent) may start: it waits for this grid
  // block (head, segment): the segment's tokens t0 .. t1 - 1 of one stream, in order (a decode step: one token each)
  const int h = blockIdx.x, seg = blockIdx.y, c = threadIdx.x, y = threadIdx.y;
  const int dk = a.dk, nh = a.heads, D = nh * dk, R = dk / kKdaQuarters;
  const int64_t t0 = a.offsets ? a.offsets[seg] : seg, t1 = a.offsets ? a.offsets[seg + 1] : seg + 1;
  __shared__ __align__(16) float qs[kKdaMaxDk];  // read 4 at a time
  __shared__ __align__(16) float ks[kKdaMaxDk];
  __shared__ __align__(16) float es[kKdaMaxDk];
  __shared__ float vs[kKdaMaxDk];
  __shared__ float part[2][kKdaQuarters][kKdaMaxDk];
  __shared__ float buf[kKdaQuarters * (kKdaMaxDk / 32)];
  const int64_t s_row = a.index[seg];
  const __nv_bfloat16* mixed_all = static_cast<const __nv_bfloat16*>(a.mixed);
  __nv_bfloat16* cst = static_cast<__nv_bfloat16*>(a.conv_state) + s_row * 3 * D * a.conv_k;
  // the state column c, rows y R .. y R + R - 1, in registers for the whole segment
  float* S = a.state + (s_row * nh + h) * int64_t(dk) * dk + c;
  float s[kKdaMaxR];
#pragma unroll
  for (int i = 0; i < kKdaMaxR; ++i)
    if (i < R) s[i] = S[int64_t(y * R + i) * dk];
  const float rate = expf(a.a_log[h]);
  for (int64_t t = t0; t < t1; ++t) {
    __syncthreads();  // the previous token's readers of qs, ks, vs, es, part and buf are done
    const int64_t col = t * D + int64_t(h) * dk + c;
    // Each row of threads computes one of the head's vectors at index c, so each is computed once: rows 0, 1, 2 the
    // causal depthwise conv of q, k, v over the last K inputs (conv state, then this segment's earlier tokens) and this
    // one, SiLU, rounded to bf16 as the torch step rounds them; row 3 the forget gate. (Row 0's output gate is read
    // now, used at the end.)
    float val = 0.0f, gate = 0.0f;
    if (y < 3) {
      const int64_t ch = int64_t(y) * D + h * dk + c;
      const float* conv_w = a.conv_w + ch * a.conv_k;
      float acc = 0.0f;
      for (int j = 0; j < a.conv_k; ++j) {  // input t - (K - 1) + j: from the state while before the segment
        const int64_t rel = t - t0 - (a.conv_k - 1) + j;
        const __nv_bfloat16 x = rel < 0 ? cst[ch * a.conv_k + a.conv_k + rel] : mixed_all[(t0 + rel) * 3 * D + ch];
        acc = __fmaf_rn(conv_w[j], __bfloat162float(x), acc);
      }
      val = __bfloat162float(__float2bfloat16_rn(__fdiv_rn(acc, __fadd_rn(1.0f, expf(-acc)))));  // SiLU
      if (y == 0) gate = __bfloat162float(static_cast<const __nv_bfloat16*>(a.gate)[col]);
    } else {
      // forget gate: f = linear + dt_bias; g = lb * sigmoid(exp(A_log) f), or -exp(A_log) * softplus(f)
      const float f = __fadd_rn(__bfloat162float(static_cast<const __nv_bfloat16*>(a.f)[col]), a.dt_bias[h * dk + c]);
      const float g = a.has_lower_bound ? __fmul_rn(a.lower_bound, kda_sigmoid(__fmul_rn(rate, f)))
                                        : __fmul_rn(-rate, f > 20.0f ? f : logf(__fadd_rn(1.0f, expf(f))));
      es[c] = expf(g);
    }
    const float beta = __bfloat162float(__float2bfloat16_rn(kda_sigmoid(__bfloat162float(
        static_cast<const __nv_bfloat16*>(a.b)[t * nh + h]))));
    // _l2norm of q (row 0) and k (row 1): x / sqrt(sum(x * x) + 1e-6), each row summing its own; q then * dk^-1/2
    const float nrm = sqrtf(__fadd_rn(row_sum(__fmul_rn(val, val), dk, buf), 1e-6f));
    if (y == 0) qs[c] = __fmul_rn(__fdiv_rn(val, nrm), a.q_scale);
    else if (y == 1) ks[c] = __fdiv_rn(val, nrm);
    else if (y == 2) vs[c] = val;
    __syncthreads();
    // the state: S <- S * exp(g); kv = k^T S; S <- S + k (beta (v - kv)); o = q^T S (the vectors' rows 4 at a time)
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < kKdaMaxR; i += 4) {
      if (i < R) {
        const float4 e4 = *reinterpret_cast<const float4*>(&es[y * R + i]);
        const float4 k4 = *reinterpret_cast<const float4*>(&ks[y * R + i]);
        const float e[4] = {e4.x, e4.y, e4.z, e4.w}, kk[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          s[i + j] = __fmul_rn(s[i + j], e[j]);
          kv = __fadd_rn(kv, __fmul_rn(s[i + j], kk[j]));
        }
      }
    }
    part[0][y][c] = kv;
    __syncthreads();
    kv = __fadd_rn(__fadd_rn(__fadd_rn(part[0][0][c], part[0][1][c]), part[0][2][c]), part[0][3][c]);
    const float delta = __fmul_rn(__fsub_rn(vs[c], kv), beta);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < kKdaMaxR; i += 4) {
      if (i < R) {
        const float4 k4 = *reinterpret_cast<const float4*>(&ks[y * R + i]);
        const float4 q4 = *reinterpret_cast<const float4*>(&qs[y * R + i]);
        const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, qq[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          s[i + j] = __fadd_rn(s[i + j], __fmul_rn(kk[j], delta));
          o = __fadd_rn(o, __fmul_rn(s[i + j], qq[j]));
        }
      }
    }
    part[1][y][c] = o;
    __syncthreads();
    o = __fadd_rn(__fadd_rn(__fadd_rn(part[1][0][c], part[1][1][c]), part[1][2][c]), part[1][3][c]);
    // out.to(bf16).float(); out * rsqrt(mean(out^2) + eps) * o_norm * sigmoid(gate), rounded to bf16 for o_proj
    const float ob = __bfloat162float(__float2bfloat16_rn(o));
    const float ms = __fdiv_rn(row_sum(__fmul_rn(ob, ob), dk, buf), float(dk));
    if (y == 0) {
      const float rr = __frsqrt_rn(__fadd_rn(ms, a.eps));
      const float out = __fmul_rn(__fmul_rn(__fmul_rn(ob, rr), a.o_norm[c]), kda_sigmoid(gate));
      static_cast<__nv_bfloat16*>(a.out)[col] = __float2bfloat16_rn(out);
    }
  }
#pragma unroll
  for (int i = 0; i < kKdaMaxR; ++i)
    if (i < R) S[int64_t(y * R + i) * dk] = s[i];
  __syncthreads();  // every row has read the conv state: rows 0-2 shift theirs by the segment's n inputs
  if (y < 3) {
    const int64_t n = t1 - t0, ch = int64_t(y) * D + h * dk + c;
    __nv_bfloat16* w = cst + ch * a.conv_k;
    for (int j = 0; j < a.conv_k; ++j) {  // input n - K + j: the old state's entry n + j (read before written)
      const int64_t rel = n - a.conv_k + j;
      w[j] = rel < 0 ? w[n + j] : mixed_all[(t0 + rel) * 3 * D + ch];
    }
  }
}

}  // namespace

void launch_kda_decode(const KdaDecode& a, cudaStream_t stream) {
  ROCKET_CHECK(a.dk == 16 || a.dk == 32 || a.dk == 64 || a.dk == 128, "kda_decode: head dim " << a.dk
               << " (16, 32, 64 or 128)");
  ROCKET_CHECK(a.heads > 0 && a.heads <= 65535 && a.segments >= 0 && a.segments <= 65535, "kda_decode: " << a.heads
               << " heads, " << a.segments << " segments");
  ROCKET_CHECK(a.conv_k >= 1 && a.conv_k <= kKdaMaxConv, "kda_decode: conv kernel " << a.conv_k << " (1.."
               << kKdaMaxConv << ")");
  if (a.segments == 0) return;
  kda_decode_kernel<<<dim3(a.heads, a.segments), dim3(a.dk, kKdaQuarters), 0, stream>>>(a);
  ROCKET_LAUNCH_CHECK();
}

}  // namespace rocket
