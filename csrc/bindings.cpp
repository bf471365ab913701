// rocket_mpi._C: the only file that sees torch. Checks every tensor (device, dtype, shape, layout),
// allocates outputs and scratch, and calls the plain launchers of rocket.h on the current stream.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "rocket.h"

// torch values in error messages (rocket::Msg: no iostreams, see rocket.h)
namespace rocket {
Msg& operator<<(Msg& m, c10::IntArrayRef v) {
  m << "[";
  for (size_t i = 0; i < v.size(); ++i) m << (i ? ", " : "") << v[i];
  return m << "]";
}
Msg& operator<<(Msg& m, c10::ScalarType t) { return m << c10::toString(t); }
Msg& operator<<(Msg& m, const c10::Device& d) { return m << d.str(); }
}  // namespace rocket

namespace {

void expect(const torch::Tensor& t, const char* name, c10::ScalarType dtype, int64_t dim, const c10::Device& dev,
            int64_t align = 16) {
  ROCKET_CHECK(t.is_cuda(), name << " must be a CUDA tensor, got one on " << t.device());
  ROCKET_CHECK(t.device() == dev, name << " is on " << t.device() << ", the other inputs on " << dev);
  ROCKET_CHECK(t.scalar_type() == dtype, name << " is " << t.scalar_type() << ", expected " << dtype);
  ROCKET_CHECK(t.dim() == dim, name << " has " << t.dim() << " dims " << t.sizes() << ", expected " << dim);
  ROCKET_CHECK(t.is_contiguous(), name << " must be contiguous");
  ROCKET_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0, name << " must be " << align << "-byte aligned");
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// A launch's tuning argument (pdl, split) as the launcher's int: a value past int's range stays out of range, so the
// launcher's check names it.
int tuning_arg(int64_t v) { return static_cast<int>(std::clamp<int64_t>(v, INT_MIN, INT_MAX)); }

// The packed experts' shapes against hidden / inter. NVFP4: q_* uint8 codes and s_* scale bytes; BF16 (q_*
// bfloat16 [slots, tiles, K/64, 4, 256] in A-fragment order, pack.py pack_bf16): s_* empty, s2_gu ones.
// Returns whether the experts are BF16.
bool check_packed(const c10::Device& dev, const torch::Tensor& q_gu, const torch::Tensor& s_gu,
                  const torch::Tensor& s2_gu, const torch::Tensor& q_dn, const torch::Tensor& s_dn, int64_t hidden,
                  int64_t inter, int64_t far_slots = 0) {
  const int64_t hp = round_up(hidden, rocket::kTileK), ip = round_up(inter, rocket::kTileK);
  if (q_gu.scalar_type() == torch::kBFloat16) {
    expect(q_gu, "q_gu", torch::kBFloat16, 5, dev);
    const int64_t slots = q_gu.size(0);
    ROCKET_CHECK(q_gu.sizes() == torch::IntArrayRef({slots, 2 * ip / 16, hp / 64, 4, 256}),
                 "BF16 q_gu " << q_gu.sizes() << " does not match hidden " << hidden << ", inter " << inter);
    expect(q_dn, "q_dn", torch::kBFloat16, 5, dev);
    ROCKET_CHECK(q_dn.sizes() == torch::IntArrayRef({slots, hp / 16, ip / 64, 4, 256}), "BF16 q_dn " << q_dn.sizes());
    ROCKET_CHECK(s_gu.numel() == 0 && s_dn.numel() == 0, "BF16 experts have no block scales (s_gu " << s_gu.sizes()
                 << ", s_dn " << s_dn.sizes() << ")");
    expect(s2_gu, "s2_gu", torch::kFloat, 2, dev, 4);
    ROCKET_CHECK(s2_gu.sizes() == torch::IntArrayRef({slots + far_slots, 2}), "s2_gu " << s2_gu.sizes() << " for "
               << slots << " + " << far_slots << " slots");
    return true;
  }
  expect(q_gu, "q_gu", torch::kByte, 5, dev);
  const int64_t slots = q_gu.size(0);
  ROCKET_CHECK(q_gu.sizes() == torch::IntArrayRef({slots, 2 * ip / 16, hp / 64, 32, 16}),
               "q_gu " << q_gu.sizes() << " does not match hidden " << hidden << ", inter " << inter);
  expect(s_gu, "s_gu", torch::kByte, 5, dev);
  ROCKET_CHECK(s_gu.sizes() == torch::IntArrayRef({slots, 2 * ip / 16, hp / 64, 8, 8}), "s_gu " << s_gu.sizes());
  expect(s2_gu, "s2_gu", torch::kFloat, 2, dev, 4);
  ROCKET_CHECK(s2_gu.sizes() == torch::IntArrayRef({slots + far_slots, 2}), "s2_gu " << s2_gu.sizes() << " for "
               << slots << " + " << far_slots << " slots");
  expect(q_dn, "q_dn", torch::kByte, 5, dev);
  ROCKET_CHECK(q_dn.sizes() == torch::IntArrayRef({slots, hp / 16, ip / 64, 32, 16}), "q_dn " << q_dn.sizes());
  expect(s_dn, "s_dn", torch::kByte, 5, dev);
  ROCKET_CHECK(s_dn.sizes() == torch::IntArrayRef({slots, hp / 16, ip / 64, 8, 8}), "s_dn " << s_dn.sizes());
  return false;
}

// Far slots of the expert cache: {q_gu, s_gu, q_dn, s_dn} in host memory registered with CUDA (mapped), the same
// layout as the device slots but for the slot count. Returns their device pointers (null where empty) and the count.
struct Far {
  const uint8_t* q_gu = nullptr;
  const uint8_t* s_gu = nullptr;
  const uint8_t* q_dn = nullptr;
  const uint8_t* s_dn = nullptr;
  int64_t slots = 0;
};

const uint8_t* mapped(const torch::Tensor& t, const char* name) {
  if (t.numel() == 0) return nullptr;
  void* dptr = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&dptr, t.data_ptr(), 0);
  if (err != cudaSuccess) (void)cudaGetLastError();
  ROCKET_CHECK(err == cudaSuccess, "far " << name << ": host memory not registered with CUDA ("
               << cudaGetErrorString(err) << ")");
  return static_cast<const uint8_t*>(dptr);
}

Far check_far(const std::optional<std::vector<torch::Tensor>>& far, const torch::Tensor& q_gu, const torch::Tensor& s_gu,
              const torch::Tensor& q_dn, const torch::Tensor& s_dn) {
  Far f;
  if (!far.has_value()) return f;
  ROCKET_CHECK(far->size() == 4, "far: expected [q_gu, s_gu, q_dn, s_dn], got " << far->size() << " tensors");
  const torch::Tensor* near[4] = {&q_gu, &s_gu, &q_dn, &s_dn};
  const char* names[4] = {"q_gu", "s_gu", "q_dn", "s_dn"};
  f.slots = (*far)[0].dim() > 0 ? (*far)[0].size(0) : 0;
  for (int i = 0; i < 4; ++i) {
    const torch::Tensor& t = (*far)[i];
    ROCKET_CHECK(t.device().is_cpu(), "far " << names[i] << " must be in host memory, got " << t.device());
    ROCKET_CHECK(t.scalar_type() == near[i]->scalar_type() && t.is_contiguous(), "far " << names[i] << " is "
                 << t.scalar_type() << (t.is_contiguous() ? "" : ", not contiguous") << "; device slots are "
                 << near[i]->scalar_type());
    if (near[i]->numel() == 0 && near[i]->dim() == 2) {  // BF16 experts: no block scales either side
      ROCKET_CHECK(t.numel() == 0, "far " << names[i] << ": BF16 experts have no block scales");
      continue;
    }
    ROCKET_CHECK(t.dim() == near[i]->dim() && t.size(0) == f.slots && t.sizes().slice(1) == near[i]->sizes().slice(1),
                 "far " << names[i] << " " << t.sizes() << " does not match the device slots " << near[i]->sizes());
  }
  if (f.slots == 0) return f;
  f.q_gu = mapped((*far)[0], "q_gu");
  f.s_gu = mapped((*far)[1], "s_gu");
  f.q_dn = mapped((*far)[2], "q_dn");
  f.s_dn = mapped((*far)[3], "s_dn");
  return f;
}

// Fills ExpertsLaunch from checked tensors and launches on the current stream.
void launch_experts(const torch::Tensor& x, const int64_t* row_index, const int* pad_rows, const int* groups,
                    int64_t n_tiles, int64_t n_groups, const torch::Tensor& q_gu, const torch::Tensor& s_gu,
                    const torch::Tensor& s2_gu, const torch::Tensor& q_dn, const torch::Tensor& s_dn, int64_t hidden,
                    int64_t inter, std::optional<double> swiglu_limit, torch::Tensor& x_frag, torch::Tensor& h_frag,
                    torch::Tensor& out, int64_t out_rows, int64_t pdl, int64_t dense_rows = 0,
                    const std::vector<torch::Tensor>& residuals = {}, bool direct_k = false, int64_t split = 0,
                    const Far& far = Far{}, const float* s2_dn = nullptr, int64_t wide = rocket::kWideAuto) {
  rocket::ExpertsLaunch a{};
  a.wide = tuning_arg(wide);
  a.s2_dn = s2_dn;
  if (far.slots > 0) {
    a.q_gu_far = far.q_gu;
    a.s_gu_far = far.s_gu;
    a.q_dn_far = far.q_dn;
    a.s_dn_far = far.s_dn;
    a.near = static_cast<int>(q_gu.size(0));
  }
  a.pdl = tuning_arg(pdl);
  a.split = tuning_arg(split);
  a.direct_k = direct_k ? 1 : 0;
  a.n_res = static_cast<int>(residuals.size());
  for (size_t r = 0; r < residuals.size(); ++r) a.res[r] = residuals[r].data_ptr();
  a.dense_rows = static_cast<int>(dense_rows);
  a.x = x.data_ptr();
  a.x_rows = x.size(0);
  a.row_index = row_index;
  a.pad_rows = pad_rows;
  a.groups = reinterpret_cast<const int4*>(groups);
  a.n_groups = static_cast<int>(n_groups);
  a.n_tiles = static_cast<int>(n_tiles);
  a.bf16 = q_gu.scalar_type() == torch::kBFloat16 ? 1 : 0;
  a.q_gu = static_cast<const uint8_t*>(q_gu.data_ptr());
  a.s_gu = a.bf16 ? nullptr : s_gu.data_ptr<uint8_t>();
  a.s2_gu = s2_gu.data_ptr<float>();
  a.q_dn = static_cast<const uint8_t*>(q_dn.data_ptr());
  a.s_dn = a.bf16 ? nullptr : s_dn.data_ptr<uint8_t>();
  a.hidden = static_cast<int>(hidden);
  a.inter = static_cast<int>(inter);
  a.hidden_pad = static_cast<int>(round_up(hidden, rocket::kTileK));
  a.inter_pad = static_cast<int>(round_up(inter, rocket::kTileK));
  a.has_limit = swiglu_limit.has_value() ? 1 : 0;
  a.swiglu_limit = swiglu_limit.has_value() ? static_cast<float>(*swiglu_limit) : 0.0f;
  a.x_frag = reinterpret_cast<uint4*>(x_frag.data_ptr<int>());
  a.h_frag = reinterpret_cast<uint4*>(h_frag.data_ptr<int>());
  torch::Tensor ready;  // per-pass counts (pdl kPdlPerPass; prep zeroes them): NVFP4 plan launches only
  if (pad_rows != nullptr && !a.bf16) {
    ready = torch::empty({n_groups}, x.options().dtype(torch::kInt));
    a.ready = ready.data_ptr<int>();
  }
  a.out = out.data_ptr();
  a.out_rows = out_rows;
  rocket::launch_nvfp4_experts(a, c10::cuda::getCurrentCUDAStream().stream());
}

// Returns {out, x_frag, h_frag}: the scratch fragments are kept for the tests' stage-by-stage checks. pdl: how down
// follows gate/up (rocket.h kPdl*: -1 auto, 0 off, 3 each pass of down waits for its own pass of gate/up); wide: the
// kernel instance (rocket.h kWide*: -1 auto, 0 off, 1 on, 2 warpgroup mma). Neither ever changes the bits.
std::vector<torch::Tensor> nvfp4_experts_stages(const torch::Tensor& x, const std::optional<torch::Tensor>& row_index,
                                                const torch::Tensor& plan, int64_t n_tiles, int64_t n_groups,
                                                int64_t n_rows, const torch::Tensor& q_gu, const torch::Tensor& s_gu,
                                                const torch::Tensor& s2_gu, const torch::Tensor& q_dn,
                                                const torch::Tensor& s_dn, int64_t hidden, int64_t inter,
                                                std::optional<double> swiglu_limit, int64_t pdl,
                                                const std::optional<std::vector<torch::Tensor>>& far, int64_t wide) {
  rocket::check_launch_tuning(tuning_arg(pdl), 0, tuning_arg(wide));
  const c10::Device dev = x.device();
  expect(x, "x", torch::kBFloat16, 2, dev, 4);
  ROCKET_CHECK(x.size(1) == hidden, "x has " << x.size(1) << " columns, experts have hidden " << hidden);
  expect(plan, "plan", torch::kInt, 1, dev);
  ROCKET_CHECK(plan.numel() == n_tiles * rocket::kRowTile + n_groups * 4,
               "plan has " << plan.numel() << " ints for " << n_tiles << " tiles and " << n_groups << " groups");
  const Far f = check_far(far, q_gu, s_gu, q_dn, s_dn);
  check_packed(dev, q_gu, s_gu, s2_gu, q_dn, s_dn, hidden, inter, f.slots);
  const int64_t hp = round_up(hidden, rocket::kTileK), ip = round_up(inter, rocket::kTileK);
  const int64_t* ri = nullptr;
  if (row_index.has_value()) {
    expect(*row_index, "row_index", torch::kLong, 1, dev, 8);
    ROCKET_CHECK(row_index->numel() == n_rows, "row_index has " << row_index->numel() << " rows, plan " << n_rows);
    ri = row_index->data_ptr<int64_t>();
  } else {
    ROCKET_CHECK(x.size(0) >= n_rows, "x has " << x.size(0) << " rows, the plan covers " << n_rows);
  }

  const c10::cuda::CUDAGuard guard(dev);
  auto out = torch::empty({n_rows, hidden}, x.options());
  auto i32 = x.options().dtype(torch::kInt);
  auto x_frag = torch::empty({n_tiles, hp / 32, 32, 4}, i32);
  auto h_frag = torch::empty({n_tiles, ip / 32, 32, 4}, i32);
  if (n_tiles == 0 || n_groups == 0) return {out, x_frag, h_frag};
  launch_experts(x, ri, plan.data_ptr<int>(), plan.data_ptr<int>() + n_tiles * rocket::kRowTile, n_tiles, n_groups,
                 q_gu, s_gu, s2_gu, q_dn, s_dn, hidden, inter, swiglu_limit, x_frag, h_frag, out, n_rows, pdl, 0, {},
                 false, 0, f, nullptr, wide);
  return {out, x_frag, h_frag};
}

torch::Tensor nvfp4_experts(const torch::Tensor& x, const std::optional<torch::Tensor>& row_index,
                            const torch::Tensor& plan, int64_t n_tiles, int64_t n_groups, int64_t n_rows,
                            const torch::Tensor& q_gu, const torch::Tensor& s_gu, const torch::Tensor& s2_gu,
                            const torch::Tensor& q_dn, const torch::Tensor& s_dn, int64_t hidden, int64_t inter,
                            std::optional<double> swiglu_limit, int64_t pdl,
                            const std::optional<std::vector<torch::Tensor>>& far, int64_t wide) {
  return nvfp4_experts_stages(x, row_index, plan, n_tiles, n_groups, n_rows, q_gu, s_gu, s2_gu, q_dn, s_dn, hidden,
                              inter, swiglu_limit, pdl, far, wide)[0];
}

torch::Tensor dequant_packed(const torch::Tensor& q, const torch::Tensor& s, bool direct) {
  const c10::Device dev = q.device();
  expect(q, "q", torch::kByte, 4, dev);
  expect(s, "s", torch::kByte, 4, dev);
  ROCKET_CHECK(q.size(2) == 32 && q.size(3) == 16, "q " << q.sizes() << ": expected [N/16, K/64, 32, 16]");
  ROCKET_CHECK(s.sizes() == torch::IntArrayRef({q.size(0), q.size(1), 8, 8}),
               "s " << s.sizes() << " for q " << q.sizes());
  const c10::cuda::CUDAGuard guard(dev);
  auto out = torch::empty({q.size(0) * rocket::kTileN, q.size(1) * rocket::kTileK},
                          q.options().dtype(torch::kBFloat16));
  rocket::launch_nvfp4_dequant_packed(q.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(), static_cast<int>(out.size(0)),
                                      static_cast<int>(out.size(1)), direct, out.data_ptr(),
                                      c10::cuda::getCurrentCUDAStream().stream());
  return out;
}

// Residuals of a dense launch or the scatter: bf16 [rows, n], contiguous, on the device; at most kMaxResiduals.
void check_residuals(const std::vector<torch::Tensor>& res, int64_t rows, int64_t n, c10::Device dev) {
  ROCKET_CHECK(res.size() <= size_t(rocket::kMaxResiduals), res.size() << " residuals (at most "
               << rocket::kMaxResiduals << ")");
  for (const auto& r : res) {
    expect(r, "residual", torch::kBFloat16, 2, dev, 4);
    ROCKET_CHECK(r.size(0) == rows && r.size(1) == n && r.is_contiguous(), "residual " << r.sizes() << " for an output ["
                 << rows << ", " << n << "] (contiguous)");
  }
}

py::object moe_scatter_add(const torch::Tensor& rows, const torch::Tensor& by_token, const torch::Tensor& coef,
                              const std::optional<torch::Tensor>& by_canon, std::optional<torch::Tensor> sum,
                              const std::vector<torch::Tensor>& residuals,
                              const std::optional<torch::Tensor>& norm_w, double eps) {
  const c10::Device dev = rows.device();
  expect(rows, "rows", torch::kBFloat16, 2, dev, 2);
  expect(by_token, "by_token", torch::kLong, 2, dev, 8);
  expect(coef, "coef", torch::kFloat, 2, dev, 4);
  ROCKET_CHECK(coef.sizes() == by_token.sizes(), "coef " << coef.sizes() << " vs by_token " << by_token.sizes());
  ROCKET_CHECK(by_canon.has_value() == sum.has_value(), "moe_scatter_add: by_canon and sum go together");
  if (by_canon) {
    expect(*by_canon, "by_canon", torch::kInt, 2, dev, 4);
    ROCKET_CHECK(by_canon->sizes() == by_token.sizes(), "by_canon " << by_canon->sizes() << " vs by_token "
                 << by_token.sizes());
    ROCKET_CHECK(sum->is_cuda() && sum->device() == dev && sum->scalar_type() == torch::kLong && sum->numel() == 1,
                 "moe_scatter_add: sum must be one int64 on " << dev);
  }
  const int64_t tokens = by_token.size(0), topk = by_token.size(1), hidden = rows.size(1);
  check_residuals(residuals, tokens, hidden, dev);
  const void* res[rocket::kMaxResiduals] = {};
  for (size_t r = 0; r < residuals.size(); ++r) res[r] = residuals[r].data_ptr();
  const c10::cuda::CUDAGuard guard(dev);
  auto out = torch::empty({tokens, hidden}, rows.options());
  torch::Tensor normed;
  if (norm_w) {
    expect(*norm_w, "norm weight", torch::kBFloat16, 1, dev, 2);
    ROCKET_CHECK(norm_w->numel() == hidden, "moe_scatter_add: norm weight " << norm_w->sizes() << " for hidden "
                 << hidden);
    normed = torch::empty_like(out);
  }
  rocket::launch_moe_scatter_add(rows.data_ptr(), rows.size(0), by_token.data_ptr<int64_t>(), coef.data_ptr<float>(),
                                 out.data_ptr(), static_cast<int>(tokens), static_cast<int>(topk),
                                 static_cast<int>(hidden), by_canon ? by_canon->data_ptr<int>() : nullptr,
                                 sum ? sum->data_ptr<int64_t>() : nullptr, res, static_cast<int>(residuals.size()),
                                 c10::cuda::getCurrentCUDAStream().stream(), norm_w ? norm_w->data_ptr() : nullptr,
                                 static_cast<float>(eps), norm_w ? normed.data_ptr() : nullptr);
  if (norm_w) return py::make_tuple(out, normed);
  return py::cast(out);
}

// The router of one MoE layer (router.cu): x [T, H] bf16, W [E, H] fp32 -> partial logits [S, T, E] fp32
// (S = slices of H; the logits are their sum in slice order, which moe_route takes).
torch::Tensor router_logits(const torch::Tensor& x, const torch::Tensor& w) {
  const c10::Device dev = x.device();
  expect(x, "x", torch::kBFloat16, 2, dev, 8);
  expect(w, "router weight", torch::kFloat, 2, dev, 16);
  ROCKET_CHECK(w.size(1) == x.size(1) && x.size(1) % 4 == 0, "router_logits: x " << x.sizes() << ", weight "
               << w.sizes() << " (hidden a multiple of 4)");
  const c10::cuda::CUDAGuard guard(dev);
  const int hidden = static_cast<int>(x.size(1));
  auto partial = torch::empty({rocket::router_slices(hidden), x.size(0), w.size(0)}, w.options());
  rocket::launch_router_logits(x.data_ptr(), w.data_ptr<float>(), static_cast<int>(x.size(0)), hidden,
                               static_cast<int>(w.size(0)), partial.data_ptr<float>(),
                               c10::cuda::getCurrentCUDAStream().stream());
  return partial;
}

// partial [S, T, E] fp32 (router_logits; S = 1: plain logits), bias [E] fp32 -> {weights [T, k] fp32,
// experts [T, k] int64} (router.cu moe_route).
std::vector<torch::Tensor> moe_route(const torch::Tensor& partial, const torch::Tensor& bias, int64_t n_group,
                                     int64_t topk_group, int64_t topk, bool norm, double scaling) {
  const c10::Device dev = partial.device();
  expect(partial, "logits", torch::kFloat, 3, dev, 4);
  expect(bias, "bias", torch::kFloat, 1, dev, 4);
  ROCKET_CHECK(bias.numel() == partial.size(2), "bias " << bias.sizes() << " for logits " << partial.sizes());
  const int64_t t = partial.size(1);
  const c10::cuda::CUDAGuard guard(dev);
  auto experts = torch::empty({t, topk}, partial.options().dtype(torch::kLong));
  auto weights = torch::empty({t, topk}, partial.options());
  rocket::launch_moe_route(partial.data_ptr<float>(), static_cast<int>(partial.size(0)), bias.data_ptr<float>(),
                           static_cast<int>(t), static_cast<int>(partial.size(2)), static_cast<int>(n_group),
                           static_cast<int>(topk_group), static_cast<int>(topk), norm, static_cast<float>(scaling),
                           experts.data_ptr<int64_t>(), weights.data_ptr<float>(),
                           c10::cuda::getCurrentCUDAStream().stream());
  return {weights, experts};
}

// The experts of a device plan (moe_plan): rows into `out` (block row r at out[r]), fixed grid over the
// plan's capacity; unused groups (tiles = 0) exit at once. No host value depends on the routing.
void nvfp4_experts_into(const torch::Tensor& x, const torch::Tensor& row_index, const torch::Tensor& pad_rows,
                        const torch::Tensor& groups, torch::Tensor& out, const torch::Tensor& q_gu,
                        const torch::Tensor& s_gu, const torch::Tensor& s2_gu, const torch::Tensor& q_dn,
                        const torch::Tensor& s_dn, int64_t hidden, int64_t inter, std::optional<double> swiglu_limit,
                        int64_t pdl, const std::optional<std::vector<torch::Tensor>>& far) {
  rocket::check_launch_tuning(tuning_arg(pdl), 0);
  const c10::Device dev = x.device();
  expect(x, "x", torch::kBFloat16, 2, dev, 4);
  ROCKET_CHECK(x.size(1) == hidden, "x has " << x.size(1) << " columns, experts have hidden " << hidden);
  const Far f = check_far(far, q_gu, s_gu, q_dn, s_dn);
  check_packed(dev, q_gu, s_gu, s2_gu, q_dn, s_dn, hidden, inter, f.slots);
  expect(pad_rows, "pad_rows", torch::kInt, 1, dev);
  expect(groups, "groups", torch::kInt, 2, dev);
  const int64_t cap = groups.size(0);
  ROCKET_CHECK(groups.size(1) == 4 && pad_rows.numel() == cap * rocket::kRowTile,
               "groups " << groups.sizes() << ", pad_rows " << pad_rows.sizes());
  expect(row_index, "row_index", torch::kLong, 1, dev, 8);
  ROCKET_CHECK(row_index.numel() == cap, "row_index has " << row_index.numel() << " rows, capacity " << cap);
  expect(out, "out", torch::kBFloat16, 2, dev, 4);
  ROCKET_CHECK(out.size(0) >= cap && out.size(1) == hidden, "out " << out.sizes() << " for capacity " << cap);
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t hp = round_up(hidden, rocket::kTileK), ip = round_up(inter, rocket::kTileK);
  auto i32 = x.options().dtype(torch::kInt);
  auto x_frag = torch::empty({cap, hp / 32, 32, 4}, i32);
  auto h_frag = torch::empty({cap, ip / 32, 32, 4}, i32);
  if (cap == 0) return;
  launch_experts(x, row_index.data_ptr<int64_t>(), pad_rows.data_ptr<int>(), groups.data_ptr<int>(), cap, cap, q_gu,
                 s_gu, s2_gu, q_dn, s_dn, hidden, inter, swiglu_limit, x_frag, h_frag, out, out.size(0), pdl, 0, {},
                 false, 0, f);
}

// swiglu_dense and swiglu_dense_nvfp4 after their weights' checks: x's and the residuals' checks, the rows'
// fragments and the expert kernels without a plan (direct_k: gate/up's K in direct_k_order; s2_dn: down's
// weight_scale_2 for NVFP4 tiles, else null).
torch::Tensor dense_mlp(const torch::Tensor& x, const torch::Tensor& q_gu, const torch::Tensor& s_gu,
                        const torch::Tensor& s2_gu, const torch::Tensor& q_dn, const torch::Tensor& s_dn,
                        int64_t hidden, int64_t inter, const std::vector<torch::Tensor>& residuals,
                        std::optional<double> swiglu_limit, int64_t pdl, int64_t split, bool direct_k,
                        const float* s2_dn) {
  const int64_t rows = x.size(0);
  ROCKET_CHECK(rows < (int64_t(1) << 30), rows << " rows");
  const int64_t tiles = (rows + rocket::kRowTile - 1) / rocket::kRowTile;
  const int64_t passes = (tiles + rocket::kMaxRowTiles - 1) / rocket::kMaxRowTiles;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t hp = round_up(hidden, rocket::kTileK), ip = round_up(inter, rocket::kTileK);
  auto out = torch::empty({rows, hidden}, x.options());
  auto i32 = x.options().dtype(torch::kInt);
  auto x_frag = torch::empty({tiles, hp / 32, 32, 4}, i32);
  auto h_frag = torch::empty({tiles, ip / 32, 32, 4}, i32);
  if (rows == 0) return out;
  launch_experts(x, nullptr, nullptr, nullptr, tiles, passes, q_gu, s_gu, s2_gu, q_dn, s_dn, hidden, inter,
                 swiglu_limit, x_frag, h_frag, out, rows, pdl, rows, residuals, direct_k, split, Far{}, s2_dn);
  return out;
}

// x of a SwiGLU MLP: bf16 [rows, hidden], and the residuals its output takes.
void check_mlp_rows(const torch::Tensor& x, int64_t hidden, const std::vector<torch::Tensor>& residuals) {
  expect(x, "x", torch::kBFloat16, 2, x.device(), 4);
  check_residuals(residuals, x.size(0), hidden, x.device());
  ROCKET_CHECK(x.size(1) == hidden, "x has " << x.size(1) << " columns, the MLP has hidden " << hidden);
}

// A SwiGLU MLP of the replicated stack (gate/up and down of one expert, BF16 tiles: stack.py pack_mlp, gate/up's K
// in direct_k_order) over the rows of x in order: the expert kernels without a plan; then + each residual in order.
// pdl as nvfp4_experts_stages'; split: K slices of both GEMMs (0: by their widths; 1, 2, 4 or 8).
torch::Tensor swiglu_dense(const torch::Tensor& x, const torch::Tensor& q_gu, const torch::Tensor& s2_gu,
                           const torch::Tensor& q_dn, int64_t hidden, int64_t inter,
                           const std::vector<torch::Tensor>& residuals, std::optional<double> swiglu_limit,
                           int64_t pdl, int64_t split) {
  rocket::check_launch_tuning(tuning_arg(pdl), tuning_arg(split));
  check_mlp_rows(x, hidden, residuals);
  auto none = torch::empty({1, 0}, x.options().dtype(torch::kByte));
  ROCKET_CHECK(check_packed(x.device(), q_gu, none, s2_gu, q_dn, none, hidden, inter) && q_gu.size(0) == 1,
               "swiglu_dense takes one BF16 expert, got q_gu " << q_gu.sizes() << " " << q_gu.scalar_type());
  return dense_mlp(x, q_gu, none, s2_gu, q_dn, none, hidden, inter, residuals, swiglu_limit, pdl, split,
                   /*direct_k=*/true, nullptr);
}

// A SwiGLU MLP of the replicated stack held as stored (NVFP4 tiles of one expert, stack.py pack_mlp): as swiglu_dense,
// gate/up's K in direct_k_order (pack.py pack_codes_direct), down's weight_scale_2 (s2_dn [1]) in its epilogue.
torch::Tensor swiglu_dense_nvfp4(const torch::Tensor& x, const torch::Tensor& q_gu, const torch::Tensor& s_gu,
                                 const torch::Tensor& s2_gu, const torch::Tensor& q_dn, const torch::Tensor& s_dn,
                                 const torch::Tensor& s2_dn, int64_t hidden, int64_t inter,
                                 const std::vector<torch::Tensor>& residuals, std::optional<double> swiglu_limit,
                                 int64_t pdl, int64_t split) {
  rocket::check_launch_tuning(tuning_arg(pdl), tuning_arg(split));
  check_mlp_rows(x, hidden, residuals);
  const c10::Device dev = x.device();
  ROCKET_CHECK(!check_packed(dev, q_gu, s_gu, s2_gu, q_dn, s_dn, hidden, inter) && q_gu.size(0) == 1,
               "swiglu_dense_nvfp4 takes one NVFP4 expert, got q_gu " << q_gu.sizes() << " " << q_gu.scalar_type());
  expect(s2_dn, "s2_dn", torch::kFloat, 1, dev, 4);
  ROCKET_CHECK(s2_dn.numel() == 1, "s2_dn " << s2_dn.sizes() << ": one expert's down weight_scale_2");
  return dense_mlp(x, q_gu, s_gu, s2_gu, q_dn, s_dn, hidden, inter, residuals, swiglu_limit, pdl, split,
                   /*direct_k=*/true, s2_dn.data_ptr<float>());
}

// What nvfp4_linear and bf16_linear check alike: x [rows, k] bf16, the bias, the residuals (one output part only)
// and the output parts' ends (`ends`, or one part of n) -> the parts' ends.
std::vector<int64_t> linear_parts(const torch::Tensor& x, int64_t n, int64_t k,
                                  const std::optional<torch::Tensor>& bias, const std::vector<int64_t>& ends,
                                  const std::vector<torch::Tensor>& residuals) {
  const c10::Device dev = x.device();
  expect(x, "x", torch::kBFloat16, 2, dev, 4);
  check_residuals(residuals, x.size(0), n, dev);
  ROCKET_CHECK(residuals.empty() || ends.size() <= 1, "residuals need one output part, not " << ends.size());
  ROCKET_CHECK(x.size(1) == k, "x has " << x.size(1) << " columns, the weight " << k);
  ROCKET_CHECK(x.size(0) < (int64_t(1) << 30), x.size(0) << " rows");
  if (bias.has_value()) {
    expect(*bias, "bias", torch::kBFloat16, 1, dev, 2);
    ROCKET_CHECK(bias->numel() == n, "bias has " << bias->numel() << " values for " << n << " features");
  }
  const std::vector<int64_t> parts = ends.empty() ? std::vector<int64_t>{n} : ends;
  ROCKET_CHECK(parts.size() <= rocket::kMaxSegs && parts.back() == n, parts.size() << " output parts ending at "
               << parts.back() << " for " << n << " features");
  return parts;
}

// Every field of a linear launch but the weights' (w, s, w_scale): one output tensor per part (returned), the rows'
// fragment scratch (x_frag, which must live until the launch), rows, bias, shapes and residuals.
std::vector<torch::Tensor> linear_launch(rocket::LinearLaunch& a, const torch::Tensor& x, int64_t n, int64_t k,
                                         int64_t n_pad, int64_t k_pad, const std::optional<torch::Tensor>& bias,
                                         const std::vector<int64_t>& parts,
                                         const std::vector<torch::Tensor>& residuals, int64_t split,
                                         torch::Tensor& x_frag) {
  const int64_t rows = x.size(0);
  a.split = tuning_arg(split);
  std::vector<torch::Tensor> outs;
  int64_t start = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    ROCKET_CHECK(parts[p] > start, "output part " << p << " ends at " << parts[p] << ", after " << start);
    outs.push_back(torch::empty({rows, parts[p] - start}, x.options()));
    a.seg_end[p] = static_cast<int>(parts[p]);
    a.seg_out[p] = outs.back().data_ptr();
    start = parts[p];
  }
  const int64_t tiles = (rows + rocket::kRowTile - 1) / rocket::kRowTile;
  x_frag = torch::empty({tiles, k_pad / 32, 32, 4}, x.options().dtype(torch::kInt));
  a.x = x.data_ptr();
  a.rows = rows;
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.n = static_cast<int>(n);
  a.k = static_cast<int>(k);
  a.n_pad = static_cast<int>(n_pad);
  a.k_pad = static_cast<int>(k_pad);
  a.x_frag = reinterpret_cast<uint4*>(x_frag.data_ptr<int>());
  a.n_segs = static_cast<int>(parts.size());
  a.n_res = static_cast<int>(residuals.size());
  for (size_t r = 0; r < residuals.size(); ++r) a.res[r] = residuals[r].data_ptr();
  return outs;
}

// y = x W^T (+ bias) for W held as stored: NVFP4 tiles (codes w [n_pad / 16, k_pad / 64, 32, 16], block scales s
// [.., 8, 8], pack.py pack_codes, K in the logical order) with one weight_scale_2 per output part (w_scale); parts,
// bias, residuals and split as bf16_linear's.
std::vector<torch::Tensor> nvfp4_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& s,
                                        int64_t n, int64_t k, const std::vector<double>& w_scale,
                                        const std::optional<torch::Tensor>& bias, const std::vector<int64_t>& ends,
                                        const std::vector<torch::Tensor>& residuals, int64_t split) {
  rocket::check_launch_tuning(rocket::kPdlAuto, tuning_arg(split));
  const c10::Device dev = x.device();
  const std::vector<int64_t> parts = linear_parts(x, n, k, bias, ends, residuals);
  expect(w, "w", torch::kByte, 4, dev);
  expect(s, "s", torch::kByte, 4, dev);
  const int64_t n_pad = w.size(0) * rocket::kTileN, k_pad = w.size(1) * rocket::kTileK;
  ROCKET_CHECK(w.size(2) == 32 && w.size(3) == 16 && n_pad >= n && n_pad % 32 == 0 && n_pad - n < 32 && k_pad >= k &&
               k_pad - k < rocket::kTileK, "w " << w.sizes() << " does not hold [" << n << ", " << k << "] in tiles");
  ROCKET_CHECK(s.sizes() == torch::IntArrayRef({w.size(0), w.size(1), 8, 8}), "s " << s.sizes() << " for w "
               << w.sizes());
  ROCKET_CHECK(w_scale.size() == parts.size(), w_scale.size() << " weight_scale_2 values for " << parts.size()
               << " output parts");
  const c10::cuda::CUDAGuard guard(dev);
  rocket::LinearLaunch a{};
  torch::Tensor x_frag;
  auto outs = linear_launch(a, x, n, k, n_pad, k_pad, bias, parts, residuals, split, x_frag);
  a.w = w.data_ptr();
  a.s = s.data_ptr();
  for (size_t p = 0; p < parts.size(); ++p) a.w_scale[p] = static_cast<float>(w_scale[p]);
  rocket::launch_nvfp4_linear(a, c10::cuda::getCurrentCUDAStream().stream());
  return outs;
}

// y = x W^T (+ bias) for W in BF16 tiles [n_pad / 16, k_pad / 64, 4, 256] with K in direct_k_order (pack.py
// pack_bf16_direct): one output [rows, n] (+ each residual in order), or, with `ends` (features where each part
// ends, the last n), one tensor per part. split: K slices (0: by the output's width; 1, 2, 4 or 8).
std::vector<torch::Tensor> bf16_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n, int64_t k,
                                       const std::optional<torch::Tensor>& bias, const std::vector<int64_t>& ends,
                                       const std::vector<torch::Tensor>& residuals, int64_t split) {
  rocket::check_launch_tuning(rocket::kPdlAuto, tuning_arg(split));
  const c10::Device dev = x.device();
  const std::vector<int64_t> parts = linear_parts(x, n, k, bias, ends, residuals);
  expect(w, "w", torch::kBFloat16, 4, dev);
  const int64_t n_pad = w.size(0) * rocket::kTileN, k_pad = w.size(1) * rocket::kTileK;
  ROCKET_CHECK(w.size(2) == 4 && w.size(3) == 256 && n_pad >= n && n_pad % 32 == 0 && n_pad - n < 32 && k_pad >= k &&
               k_pad - k < rocket::kTileK, "w " << w.sizes() << " does not hold [" << n << ", " << k << "] in tiles");
  const c10::cuda::CUDAGuard guard(dev);
  rocket::LinearLaunch a{};
  torch::Tensor x_frag;
  auto outs = linear_launch(a, x, n, k, n_pad, k_pad, bias, parts, residuals, split, x_frag);
  a.w = w.data_ptr();
  rocket::launch_bf16_linear(a, c10::cuda::getCurrentCUDAStream().stream());
  return outs;
}

// Device row plan of one MoE layer; returns {by_token, coef, row_index, pad_rows, groups, canon_slot, meta,
// by_canon}.
std::vector<torch::Tensor> moe_plan(const torch::Tensor& experts, const torch::Tensor& weights,
                                    const torch::Tensor& pair0, const torch::Tensor& pair_owner,
                                    const torch::Tensor& slot, const torch::Tensor& canon,
                                    const torch::Tensor& s2_down, int64_t rank, int64_t n_ranks, int64_t n_sets,
                                    int64_t set_stride, torch::Tensor& seq,
                                    const std::optional<torch::Tensor>& meta_out,
                                    const std::optional<torch::Tensor>& zero,
                                    const std::optional<torch::Tensor>& fires, int64_t block_stride) {
  const c10::Device dev = experts.device();
  expect(experts, "experts", torch::kLong, 2, dev, 8);
  expect(weights, "weights", torch::kFloat, 2, dev, 4);
  ROCKET_CHECK(weights.sizes() == experts.sizes(), "weights " << weights.sizes() << " vs experts " << experts.sizes());
  const int64_t n_exp = slot.numel(), n_pairs = canon.numel();
  expect(pair0, "pair0", torch::kInt, 1, dev, 4);
  expect(pair_owner, "pair_owner", torch::kInt, 1, dev, 4);
  expect(slot, "slot", torch::kInt, 1, dev, 4);
  expect(canon, "canon", torch::kInt, 1, dev, 4);
  expect(s2_down, "s2_down", torch::kFloat, 1, dev, 4);
  ROCKET_CHECK(pair0.numel() == n_exp + 1 && s2_down.numel() == n_exp && pair_owner.numel() == n_pairs,
               "pair0/slot/s2_down/pair_owner/canon lengths " << pair0.numel() << "/" << n_exp << "/"
               << s2_down.numel() << "/" << pair_owner.numel() << "/" << n_pairs
               << " (expected E + 1, E, E, P, P)");
  expect(seq, "seq", torch::kLong, 1, dev, 8);
  const int64_t t = experts.size(0), k = experts.size(1), cap = t * k, stride = block_stride ? block_stride : cap;
  ROCKET_CHECK(stride >= cap && stride < (int64_t(1) << 24), "moe_plan: blocks " << stride << " rows apart for " << t
               << " x " << k);
  const c10::cuda::CUDAGuard guard(dev);
  auto l = experts.options();
  auto by_token = torch::empty({t, k}, l);
  auto coef = torch::empty({t, k}, weights.options());
  auto row_index = torch::empty({cap}, l);
  auto pad_rows = torch::empty({cap * rocket::kRowTile}, l.dtype(torch::kInt));
  auto groups = torch::empty({cap, 4}, l.dtype(torch::kInt));
  auto canon_slot = torch::empty({cap}, l);
  torch::Tensor meta;
  if (meta_out) {  // a row of the step's report (graph.py): written in place, no copy after the plan
    expect(*meta_out, "meta_out", torch::kLong, 1, dev, 8);
    ROCKET_CHECK(meta_out->numel() == rocket::kPlanMetaHead + n_ranks, "meta_out has " << meta_out->numel()
                 << " words, the plan writes " << rocket::kPlanMetaHead + n_ranks);
    meta = *meta_out;
  } else {
    meta = torch::empty({rocket::kPlanMetaHead + n_ranks}, l);
  }
  if (zero) {
    ROCKET_CHECK(zero->is_cuda() && zero->device() == dev && zero->scalar_type() == torch::kLong &&
                 zero->numel() == 1, "moe_plan: zero must be one int64 on " << dev);
  }
  auto by_canon = torch::empty({t, k}, l.dtype(torch::kInt));
  rocket::PlanLaunch a{};
  a.experts = experts.data_ptr<int64_t>();
  a.weights = weights.data_ptr<float>();
  a.tokens = static_cast<int>(t);
  a.topk = static_cast<int>(k);
  a.pair0 = pair0.data_ptr<int>();
  a.pair_owner = pair_owner.data_ptr<int>();
  a.slot = slot.data_ptr<int>();
  a.canon = canon.data_ptr<int>();
  a.s2_down = s2_down.data_ptr<float>();
  a.n_experts = static_cast<int>(n_exp);
  a.n_pairs = static_cast<int>(n_pairs);
  a.rank = static_cast<int>(rank);
  a.n_ranks = static_cast<int>(n_ranks);
  a.cap = static_cast<int>(cap);
  a.stride = static_cast<int>(stride);
  a.n_sets = static_cast<int>(n_sets);
  a.set_stride = set_stride;
  a.seq = seq.data_ptr<int64_t>();
  a.by_token = by_token.data_ptr<int64_t>();
  a.coef = coef.data_ptr<float>();
  a.row_index = row_index.data_ptr<int64_t>();
  a.pad_rows = pad_rows.data_ptr<int>();
  a.groups = reinterpret_cast<int4*>(groups.data_ptr<int>());
  a.canon_slot = canon_slot.data_ptr<int64_t>();
  a.meta = meta.data_ptr<int64_t>();
  a.by_canon = by_canon.data_ptr<int>();
  a.zero = zero ? zero->data_ptr<int64_t>() : nullptr;
  if (fires) {
    expect(*fires, "fires", torch::kInt, 2, dev, 4);
    ROCKET_CHECK(fires->size(0) == 2 && fires->size(1) == n_exp, "fires " << fires->sizes() << ", expected [2, "
                 << n_exp << "]");
    a.fires = fires->data_ptr<int>();
  }
  rocket::launch_moe_plan(a, c10::cuda::getCurrentCUDAStream().stream());
  return {by_token, coef, row_index, pad_rows, groups, canon_slot, meta, by_canon};
}

// cuda-ipc push: this rank's block (src, meta rows) into every rank's row buffer (dst addresses, set 0 row 0; ours
// included), then the flag words (flags[r]: rank r's words for this rank; ours unused).
rocket::IpcPush push_args(const torch::Tensor& src, const torch::Tensor& meta, const std::vector<int64_t>& dst,
                          const std::vector<int64_t>& flags, int64_t cap, int64_t set_rows, int64_t rank) {
  const c10::Device dev = src.device();
  expect(src, "src", torch::kBFloat16, 2, dev, 16);
  expect(meta, "meta", torch::kLong, 1, dev, 8);
  const int64_t n = static_cast<int64_t>(dst.size());
  ROCKET_CHECK(n >= 1 && n <= rocket::kPlanMaxRanks && static_cast<int64_t>(flags.size()) == n && rank < n,
               dst.size() << " destinations, " << flags.size() << " flag words, rank " << rank);
  ROCKET_CHECK(meta.numel() == rocket::kPlanMetaHead + n, "meta has " << meta.numel() << " values for " << n
               << " ranks");
  const int64_t row_bytes = src.size(1) * 2;
  ROCKET_CHECK(row_bytes % 16 == 0, "rows of " << row_bytes << " bytes: the push moves 16-byte words");
  ROCKET_CHECK(src.size(0) >= cap, "src has " << src.size(0) << " rows, capacity " << cap);
  rocket::IpcPush a{};
  a.src = reinterpret_cast<const uint4*>(src.data_ptr());
  for (int64_t r = 0; r < n; ++r) {
    ROCKET_CHECK(dst[r] % 16 == 0, "destination of rank " << r << " is not 16-byte aligned");
    a.dst[r] = reinterpret_cast<uint4*>(dst[r]);
    a.bells[r] = reinterpret_cast<int64_t*>(flags[r]);
  }
  a.meta = meta.data_ptr<int64_t>();
  a.row_words = row_bytes / 16;
  a.cap_words = cap * a.row_words;
  a.set_words = set_rows * a.row_words;
  a.rank = static_cast<int>(rank);
  a.n_ranks = static_cast<int>(n);
  return a;
}

rocket::IpcWait wait_args(const torch::Tensor& flags, const torch::Tensor& meta, torch::Tensor& err, double timeout_s,
                          int64_t rank, int64_t layer) {
  const c10::Device dev = flags.device();
  expect(flags, "flags", torch::kLong, 1, dev, 8);
  expect(meta, "meta", torch::kLong, 1, dev, 8);
  expect(err, "err", torch::kLong, 1, dev, 8);
  ROCKET_CHECK(err.numel() >= 4, "err needs 4 words");
  ROCKET_CHECK(timeout_s > 0, "timeout " << timeout_s);
  rocket::IpcWait a{};
  a.bells = flags.data_ptr<int64_t>();
  a.meta = meta.data_ptr<int64_t>();
  a.err = err.data_ptr<int64_t>();
  a.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  a.rank = static_cast<int>(rank);
  a.layer = static_cast<int>(layer);
  return a;
}

// The graphed step's exchange: one kernel, a flag word per (sender, block).
// peer_flags[r]: rank r's flag words for this rank; flags: ours, int64 [ranks, kIpcMaxBlocks].
void ipc_exchange_flags(const torch::Tensor& src, const torch::Tensor& meta, const std::vector<int64_t>& dst,
                        const std::vector<int64_t>& peer_flags, int64_t cap, int64_t set_rows, int64_t rank,
                        int64_t blocks, const torch::Tensor& flags, torch::Tensor& err, double timeout_s,
                        int64_t layer) {
  const c10::Device dev = src.device();
  expect(flags, "flags", torch::kLong, 2, dev, 8);
  const int64_t n = static_cast<int64_t>(dst.size());
  ROCKET_CHECK(flags.size(0) == n && flags.size(1) == rocket::kIpcMaxBlocks,
               "flags " << flags.sizes() << " for " << n << " ranks (" << rocket::kIpcMaxBlocks << " words each)");
  const rocket::IpcPush a = push_args(src, meta, dst, peer_flags, cap, set_rows, rank);
  for (int64_t r = 0; r < n; ++r)
    ROCKET_CHECK(peer_flags[r] % 8 == 0, "flag words of rank " << r << " are not 8-byte aligned");
  rocket::IpcWait w = wait_args(flags.view({-1}), meta, err, timeout_s, rank, layer);  // our words, all peers
  w.n_ranks = static_cast<int>(n);
  w.blocks = static_cast<int>(blocks);
  const c10::cuda::CUDAGuard guard(dev);
  rocket::launch_ipc_exchange_flags(a, w, static_cast<int>(blocks), c10::cuda::getCurrentCUDAStream().stream());
}

// ---- doorbell fabrics' graphed exchange (csrc/proxy_bells.cu; the proxy thread: csrc/proxy.cpp) ----
// out: this rank's block, a view of rows at rank * cap; staging: our staging's device address (host_map): doorbell
// words in[ranks][rails] at 0, the ready records at ready_offset, region p at header + p * region_bytes. puts: the
// device addresses of our region (slot 0) on each peer's staging, where the stage kernel puts the block itself
// (shm); empty: it stages the block in our own region, for the transport to put (verbs).
void bell_exchange(const torch::Tensor& out, const torch::Tensor& rows, const torch::Tensor& meta, int64_t staging,
                   int64_t header, int64_t region_bytes, int64_t slot_bytes, int64_t ready_offset,
                   const torch::Tensor& sync, const torch::Tensor& err, int64_t rank, int64_t rails,
                   double timeout_s, int64_t layer, int64_t stage_blocks, int64_t gather_blocks,
                   const std::vector<int64_t>& puts) {
  const c10::Device dev = rows.device();
  expect(rows, "rows", torch::kBFloat16, 2, dev, 16);
  ROCKET_CHECK(out.is_cuda() && out.device() == dev && out.scalar_type() == torch::kBFloat16 && out.dim() == 2 &&
               out.is_contiguous() && out.size(1) == rows.size(1), "out must be bf16 rows of rows' width on " << dev);
  expect(meta, "meta", torch::kLong, 1, dev, 8);
  expect(sync, "sync", torch::kLong, 1, dev, 8);
  expect(err, "err", torch::kLong, 1, dev, 8);
  const int64_t n = meta.numel() - rocket::kPlanMetaHead, cap = out.size(0), row_bytes = rows.size(1) * 2;
  ROCKET_CHECK(n >= 2 && n <= rocket::kPlanMaxRanks && rank >= 0 && rank < n, "meta for " << n << " ranks, rank "
               << rank);
  ROCKET_CHECK(rows.size(0) == n * cap, "rows " << rows.sizes() << " for " << n << " ranks of " << cap << " rows");
  ROCKET_CHECK(out.data_ptr() == static_cast<char*>(rows.data_ptr()) + rank * cap * row_bytes,
               "out must be rank " << rank << "'s block of rows");
  ROCKET_CHECK(sync.numel() == 2 && err.numel() >= 4, "sync needs 2 words, err 4");
  ROCKET_CHECK(row_bytes % 16 == 0, "rows of " << row_bytes << " bytes: the kernels move 16-byte words");
  ROCKET_CHECK(staging % 16 == 0 && header % 16 == 0 && region_bytes % 16 == 0 && slot_bytes % 16 == 0 &&
               ready_offset % 8 == 0, "staging layout not aligned: base " << staging << ", header " << header
               << ", region " << region_bytes << ", slot " << slot_bytes << ", ready " << ready_offset);
  ROCKET_CHECK(slot_bytes >= cap * row_bytes && region_bytes >= 2 * slot_bytes && ready_offset + 128 <= header &&
               8 * n * rails <= ready_offset, "staging layout: header " << header << ", ready " << ready_offset
               << ", region " << region_bytes << ", slot " << slot_bytes << " for " << n << " ranks x " << rails
               << " rails of " << cap << " rows");
  ROCKET_CHECK(timeout_s > 0, "timeout " << timeout_s);
  char* base = reinterpret_cast<char*>(staging);
  rocket::BellStage s{};
  s.src = reinterpret_cast<const uint4*>(out.data_ptr());
  ROCKET_CHECK(puts.size() < static_cast<size_t>(n), puts.size() << " puts for " << n << " ranks");
  if (puts.empty()) {
    s.dst[0] = reinterpret_cast<uint4*>(base + header + rank * region_bytes);
    s.n_dst = 1;
  } else {
    for (size_t d = 0; d < puts.size(); ++d) {
      ROCKET_CHECK(puts[d] != 0 && puts[d] % 16 == 0, "put " << d << " at " << puts[d] << ": not 16-byte aligned");
      s.dst[d] = reinterpret_cast<uint4*>(puts[d]);
    }
    s.n_dst = static_cast<int>(puts.size());
  }
  s.ready = reinterpret_cast<unsigned long long*>(base + ready_offset);
  s.sync = reinterpret_cast<unsigned long long*>(sync.data_ptr<int64_t>());
  s.meta = meta.data_ptr<int64_t>();
  s.row_words = row_bytes / 16;
  s.slot_words = slot_bytes / 16;
  rocket::BellGather g{};
  g.rows = reinterpret_cast<uint4*>(rows.data_ptr());
  g.regions = reinterpret_cast<const uint4*>(base + header);
  g.bells = reinterpret_cast<const unsigned long long*>(base);
  g.meta = s.meta;
  g.err = err.data_ptr<int64_t>();
  g.sync = s.sync;
  g.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  g.row_words = s.row_words;
  g.cap_words = cap * s.row_words;
  g.slot_words = s.slot_words;
  g.region_words = region_bytes / 16;
  g.rank = static_cast<int>(rank);
  g.n_ranks = static_cast<int>(n);
  g.rails = static_cast<int>(rails);
  g.layer = static_cast<int>(layer);
  const c10::cuda::CUDAGuard guard(dev);
  rocket::launch_bell_exchange(s, g, static_cast<int>(stage_blocks), static_cast<int>(gather_blocks),
                               c10::cuda::getCurrentCUDAStream().stream());
}

// Host memory [ptr, ptr + nbytes) registered with CUDA (mapped, portable) -> its device address.
int64_t host_map(int64_t ptr, int64_t nbytes) {
  ROCKET_CHECK(ptr != 0 && nbytes > 0, "host_map of " << nbytes << " bytes at " << ptr);
  void* host = reinterpret_cast<void*>(ptr);
  ROCKET_CUDA_CHECK(cudaHostRegister(host, static_cast<size_t>(nbytes), cudaHostRegisterMapped |
                                     cudaHostRegisterPortable));
  void* dev = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&dev, host, 0);
  if (e != cudaSuccess) {
    cudaHostUnregister(host);
    ROCKET_CUDA_CHECK(e);
  }
  return reinterpret_cast<int64_t>(dev);
}

void host_unmap(int64_t ptr) { ROCKET_CUDA_CHECK(cudaHostUnregister(reinterpret_cast<void*>(ptr))); }

// x [..., n] -> rms_norm(x, w). With index [rows] int64 (the embedding gather of the decode step's tokens): returns
// (x[index], rms_norm(x[index], w)) from one launch; an id outside x's rows reads as zeros.
py::object rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps,
                    const std::optional<torch::Tensor>& index) {
  const c10::Device dev = x.device();
  ROCKET_CHECK(x.is_cuda() && x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.dim() >= 1,
               "rms_norm: x must be contiguous bf16 on a GPU, got " << x.scalar_type() << " " << x.sizes());
  expect(w, "w", torch::kBFloat16, 1, dev, 2);
  const int64_t n = w.numel();
  ROCKET_CHECK(x.size(-1) == n, "rms_norm: x " << x.sizes() << ", weight " << w.sizes());
  const c10::cuda::CUDAGuard guard(dev);
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  if (index) {
    expect(*index, "index", torch::kLong, 1, dev, 8);
    ROCKET_CHECK(x.dim() == 2, "rms_norm: a gather takes x [rows, n], got " << x.sizes());
    auto rows = torch::empty({index->numel(), n}, x.options());
    auto out = torch::empty_like(rows);
    rocket::launch_rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), index->numel(), static_cast<int>(n),
                            static_cast<float>(eps), stream, index->data_ptr<int64_t>(), x.size(0), rows.data_ptr());
    return py::make_tuple(rows, out);
  }
  auto out = torch::empty_like(x);
  rocket::launch_rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() / std::max<int64_t>(n, 1),
                          static_cast<int>(n), static_cast<float>(eps), stream);
  return py::cast(out);
}

// GLM-5.3-Flash hyper-connections (hc.cu): x [T, n, H] bf16 -> (post [T, n] fp32, comb [T, n, n] fp32, collapsed
// [T, H] bf16), as glm5_next_hc.hc_pre computes them; with norm_w [H] bf16 also (..., normed [T, H]): rms_norm of
// collapsed with rms_eps, in hc_finish's launch where it fuses, else launched after it (the same bits).
py::tuple hc_pre(const torch::Tensor& x, const torch::Tensor& fn, const torch::Tensor& base, const torch::Tensor& scale,
                 int64_t iters, double eps, double norm_eps, const std::optional<torch::Tensor>& norm_w,
                 double rms_eps) {
  const c10::Device dev = x.device();
  expect(x, "x", torch::kBFloat16, 3, dev, 2);
  const int64_t t = x.size(0), n = x.size(1), h = x.size(2), j = (2 + n) * n;
  ROCKET_CHECK(n >= 1 && n <= rocket::kHcMaxStreams, "hc_pre: " << n << " streams (1.." << rocket::kHcMaxStreams << ")");
  expect(fn, "fn", torch::kFloat32, 2, dev, 4);
  ROCKET_CHECK(fn.size(0) == j && fn.size(1) == n * h, "hc_pre: fn " << fn.sizes() << " for x " << x.sizes());
  expect(base, "base", torch::kFloat32, 1, dev, 4);
  expect(scale, "scale", torch::kFloat32, 1, dev, 4);
  ROCKET_CHECK(base.numel() == j && scale.numel() == 3, "hc_pre: base " << base.sizes() << ", scale " << scale.sizes());
  const c10::cuda::CUDAGuard guard(dev);
  const auto f32 = x.options().dtype(torch::kFloat32);
  auto part = torch::empty({t, rocket::hc_slices(static_cast<int>(n), static_cast<int>(h)), j + 1}, f32);
  auto post = torch::empty({t, n}, f32), comb = torch::empty({t, n, n}, f32);
  auto collapsed = torch::empty({t, h}, x.options());
  rocket::HcPre a{};
  a.x = x.data_ptr();
  a.fn = fn.data_ptr<float>();
  a.base = base.data_ptr<float>();
  a.scale = scale.data_ptr<float>();
  a.n = static_cast<int>(n);
  a.tokens = static_cast<int>(t);
  a.hidden = static_cast<int>(h);
  a.iters = static_cast<int>(iters);
  a.eps = static_cast<float>(eps);
  a.norm_eps = static_cast<float>(norm_eps);
  a.part = part.data_ptr<float>();
  a.post = post.data_ptr<float>();
  a.comb = comb.data_ptr<float>();
  a.collapsed = collapsed.data_ptr();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  if (!norm_w) {
    rocket::launch_hc_pre(a, stream);
    return py::make_tuple(post, comb, collapsed);
  }
  expect(*norm_w, "norm weight", torch::kBFloat16, 1, dev, 2);
  ROCKET_CHECK(norm_w->numel() == h, "hc_pre: norm weight " << norm_w->sizes() << " for hidden " << h);
  auto normed = torch::empty({t, h}, x.options());
  const bool fused = rocket::hc_norm_fusable(static_cast<int>(h), collapsed.data_ptr(), norm_w->data_ptr(),
                                             normed.data_ptr());
  if (fused) {
    a.norm_w = norm_w->data_ptr();
    a.rms_eps = static_cast<float>(rms_eps);
    a.normed = normed.data_ptr();
  }
  rocket::launch_hc_pre(a, stream);
  if (!fused)
    rocket::launch_rms_norm(collapsed.data_ptr(), norm_w->data_ptr(), normed.data_ptr(), t, static_cast<int>(h),
                            static_cast<float>(rms_eps), stream);
  return py::make_tuple(post, comb, collapsed, normed);
}

// post [T, n], comb [T, n, n] fp32, y [T, H] and x [T, n, H] bf16 -> the new streams [T, n, H] bf16 (hc_post).
torch::Tensor hc_post(const torch::Tensor& post, const torch::Tensor& comb, const torch::Tensor& y,
                      const torch::Tensor& x) {
  const c10::Device dev = x.device();
  expect(x, "x", torch::kBFloat16, 3, dev, 2);
  const int64_t t = x.size(0), n = x.size(1), h = x.size(2);
  expect(post, "post", torch::kFloat32, 2, dev, 4);
  expect(comb, "comb", torch::kFloat32, 3, dev, 4);
  expect(y, "y", torch::kBFloat16, 2, dev, 2);
  ROCKET_CHECK(post.size(0) == t && post.size(1) == n && comb.size(0) == t && comb.size(1) == n && comb.size(2) == n &&
               y.size(0) == t && y.size(1) == h, "hc_post: post " << post.sizes() << ", comb " << comb.sizes()
               << ", y " << y.sizes() << ", x " << x.sizes());
  const c10::cuda::CUDAGuard guard(dev);
  auto out = torch::empty_like(x);
  rocket::launch_hc_post(post.data_ptr<float>(), comb.data_ptr<float>(), y.data_ptr(), x.data_ptr(), static_cast<int>(n),
                         static_cast<int>(t), static_cast<int>(h), out.data_ptr(), c10::cuda::getCurrentCUDAStream().stream());
  return out;
}

// One decode token per stream of a GLM-5.3-Flash KDA layer (kda.cu): mixed [T, 3 heads dk] bf16 (the q|k|v projection),
// conv_state [streams, 3 heads dk, K] bf16 (shifted in place at index), conv_w [3 heads dk, K] fp32,
// f / gate [T, heads dk] and b [T, heads] bf16 (the low-rank and beta linears), state [streams, heads, dk, dk] fp32
// (updated in place at index [T]) -> o_proj's input [T, heads dk] bf16.
torch::Tensor kda_decode(const torch::Tensor& mixed, torch::Tensor& conv_state, const torch::Tensor& conv_w,
                         const torch::Tensor& f, const torch::Tensor& b,
                         const torch::Tensor& gate, const torch::Tensor& dt_bias, const torch::Tensor& a_log,
                         const torch::Tensor& o_norm, torch::Tensor& state, const torch::Tensor& index, int64_t heads,
                         int64_t dk, double q_scale, std::optional<double> lower_bound, double eps,
                         const std::optional<torch::Tensor>& offsets) {
  const c10::Device dev = mixed.device();
  const int64_t t = mixed.size(0), d = heads * dk;
  expect(mixed, "mixed", torch::kBFloat16, 2, dev, 2);
  expect(conv_state, "conv_state", torch::kBFloat16, 3, dev, 2);
  expect(conv_w, "conv_w", torch::kFloat32, 2, dev, 4);
  ROCKET_CHECK(conv_state.size(1) == 3 * d && conv_w.size(0) == 3 * d && conv_w.size(1) == conv_state.size(2),
               "kda_decode: conv_state " << conv_state.sizes() << ", conv weights " << conv_w.sizes() << " for "
               << heads << " heads of " << dk);
  expect(f, "f", torch::kBFloat16, 2, dev, 2);
  expect(b, "b", torch::kBFloat16, 2, dev, 2);
  expect(gate, "gate", torch::kBFloat16, 2, dev, 2);
  expect(dt_bias, "dt_bias", torch::kFloat32, 1, dev, 4);
  expect(a_log, "A_log", torch::kFloat32, 1, dev, 4);
  expect(o_norm, "o_norm", torch::kFloat32, 1, dev, 4);
  expect(state, "state", torch::kFloat32, 4, dev, 4);
  expect(index, "index", torch::kLong, 1, dev, 8);
  ROCKET_CHECK(mixed.size(1) == 3 * d && f.size(0) == t && f.size(1) == d && b.size(0) == t && b.size(1) == heads &&
               gate.size(0) == t && gate.size(1) == d && dt_bias.numel() == d && a_log.numel() == heads &&
               o_norm.numel() == dk && state.size(1) == heads && state.size(2) == dk && state.size(3) == dk &&
               index.numel() == (offsets ? offsets->numel() - 1 : t), "kda_decode: mixed " << mixed.sizes() << ", f "
               << f.sizes() << ", b " << b.sizes() << ", gate " << gate.sizes() << ", state " << state.sizes()
               << ", index " << index.sizes() << (offsets ? ", offsets " : "") << (offsets ? offsets->sizes()
               : c10::IntArrayRef{}) << " for " << heads << " heads of " << dk);
  if (offsets) expect(*offsets, "offsets", torch::kLong, 1, dev, 8);  // ascending from 0 to t: the caller's (host) check
  const c10::cuda::CUDAGuard guard(dev);
  auto out = torch::empty({t, d}, mixed.options());
  rocket::KdaDecode a{};
  a.mixed = mixed.data_ptr();
  a.conv_state = conv_state.data_ptr();
  a.conv_w = conv_w.data_ptr<float>();
  a.conv_k = static_cast<int>(conv_w.size(1));
  a.f = f.data_ptr();
  a.b = b.data_ptr();
  a.gate = gate.data_ptr();
  a.dt_bias = dt_bias.data_ptr<float>();
  a.a_log = a_log.data_ptr<float>();
  a.o_norm = o_norm.data_ptr<float>();
  a.state = state.data_ptr<float>();
  a.index = index.data_ptr<int64_t>();
  a.offsets = offsets ? offsets->data_ptr<int64_t>() : nullptr;
  a.out = out.data_ptr();
  a.segments = static_cast<int>(index.numel());
  a.heads = static_cast<int>(heads);
  a.dk = static_cast<int>(dk);
  a.q_scale = static_cast<float>(q_scale);
  a.has_lower_bound = lower_bound.has_value();
  a.lower_bound = lower_bound ? static_cast<float>(*lower_bound) : 0.0f;
  a.eps = static_cast<float>(eps);
  rocket::launch_kda_decode(a, c10::cuda::getCurrentCUDAStream().stream());
  return out;
}

// tokens[r] = argmax(logits[r]) (torch.argmax's choice: the first maximum, a NaN first) of [rows, vocab] bf16, and
// pos[r] += 1 where pos is given; ticket: one int32 on the device, zero, which the launch leaves zero.
void argmax_(const torch::Tensor& logits, torch::Tensor& tokens, torch::Tensor& ticket,
             const std::optional<torch::Tensor>& pos) {
  const c10::Device dev = logits.device();
  expect(logits, "logits", torch::kBFloat16, 2, dev, 2);
  expect(tokens, "tokens", torch::kLong, 1, dev, 8);
  expect(ticket, "ticket", torch::kInt, 1, dev, 4);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  ROCKET_CHECK(tokens.numel() == rows && ticket.numel() == 1 && rows > 0 && vocab > 0 && vocab < (int64_t(1) << 31),
               "argmax: logits " << logits.sizes() << ", tokens " << tokens.sizes() << ", ticket " << ticket.sizes());
  if (pos) {
    expect(*pos, "pos", torch::kLong, 1, dev, 8);
    ROCKET_CHECK(pos->numel() == rows, "argmax: pos " << pos->sizes() << " for " << rows << " rows");
  }
  const c10::cuda::CUDAGuard guard(dev);
  const int chunks = rocket::argmax_chunks(static_cast<int>(rows), static_cast<int>(vocab));
  auto part_v = torch::empty({rows * chunks}, logits.options().dtype(torch::kFloat));
  auto part_i = torch::empty({rows * chunks}, logits.options().dtype(torch::kInt));
  rocket::launch_argmax(logits.data_ptr(), static_cast<int>(rows), static_cast<int>(vocab), part_v.data_ptr<float>(),
                        part_i.data_ptr<int>(), chunks, reinterpret_cast<unsigned*>(ticket.data_ptr<int>()),
                        tokens.data_ptr<int64_t>(), pos ? pos->data_ptr<int64_t>() : nullptr,
                        c10::cuda::getCurrentCUDAStream().stream());
}

void rope_(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos, const torch::Tensor& sin, int64_t rot) {
  const c10::Device dev = q.device();
  expect(q, "q", torch::kBFloat16, 3, dev, 2);
  expect(k, "k", torch::kBFloat16, 3, dev, 2);
  expect(cos, "cos", torch::kBFloat16, 2, dev, 2);
  expect(sin, "sin", torch::kBFloat16, 2, dev, 2);
  const int64_t t = q.size(0), d = q.size(2);
  ROCKET_CHECK(k.size(0) == t && k.size(2) == d, "rope: q " << q.sizes() << ", k " << k.sizes());
  ROCKET_CHECK(cos.sizes() == torch::IntArrayRef({t, rot}) && sin.sizes() == cos.sizes(),
               "rope: cos " << cos.sizes() << ", sin " << sin.sizes() << " for " << t << " tokens, rotary " << rot);
  const c10::cuda::CUDAGuard guard(dev);
  rocket::launch_rope(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), static_cast<int>(t),
                      static_cast<int>(q.size(1)), static_cast<int>(k.size(1)), static_cast<int>(d),
                      static_cast<int>(rot), c10::cuda::getCurrentCUDAStream().stream());
}

// x [T, H, r] bf16 (last dim contiguous, each token's H rows one stride apart) -> a new [T, H, r]: GLM-5's
// interleaved rotary form (decode_ops.cu)
torch::Tensor rope_interleaved(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const c10::Device dev = x.device();
  ROCKET_CHECK(x.is_cuda() && x.scalar_type() == torch::kBFloat16 && x.dim() == 3 && x.stride(2) == 1,
               "rope_interleaved: x " << x.sizes() << " " << x.scalar_type() << " (bf16 [T, H, r], last dim contiguous)");
  const int64_t t = x.size(0), h = x.size(1), r = x.size(2);
  const int64_t stride = h > 1 ? x.stride(1) : (t > 1 ? x.stride(0) : r);
  ROCKET_CHECK(t <= 1 || x.stride(0) == h * stride, "rope_interleaved: x strides " << x.strides()
               << " do not put a token's rows one stride apart");
  expect(cos, "cos", torch::kBFloat16, 2, dev, 2);
  expect(sin, "sin", torch::kBFloat16, 2, dev, 2);
  ROCKET_CHECK(cos.sizes() == torch::IntArrayRef({t, r}) && sin.sizes() == cos.sizes(),
               "rope_interleaved: cos " << cos.sizes() << ", sin " << sin.sizes() << " for x " << x.sizes());
  const c10::cuda::CUDAGuard guard(dev);
  auto out = torch::empty({t, h, r}, x.options());
  rocket::launch_rope_interleaved(x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), t * h,
                                  static_cast<int>(h), static_cast<int>(r), stride,
                                  c10::cuda::getCurrentCUDAStream().stream());
  return out;
}

void kv_append(torch::Tensor& kc, torch::Tensor& vc, const torch::Tensor& k, const torch::Tensor& v,
               const torch::Tensor& pos) {
  const c10::Device dev = kc.device();
  expect(kc, "kc", torch::kBFloat16, 4, dev, 2);
  expect(vc, "vc", torch::kBFloat16, 4, dev, 2);
  expect(k, "k", torch::kBFloat16, 3, dev, 2);
  expect(v, "v", torch::kBFloat16, 3, dev, 2);
  expect(pos, "pos", torch::kLong, 1, dev, 8);
  const int64_t m = kc.size(0), h = kc.size(1), cap = kc.size(2), d = kc.size(3);
  ROCKET_CHECK(vc.sizes() == kc.sizes() && k.sizes() == torch::IntArrayRef({m, h, d}) && v.sizes() == k.sizes() &&
               pos.numel() == m, "kv_append: caches " << kc.sizes() << ", k " << k.sizes() << ", pos " << pos.sizes());
  const c10::cuda::CUDAGuard guard(dev);
  rocket::launch_kv_append(kc.data_ptr(), vc.data_ptr(), k.data_ptr(), v.data_ptr(), pos.data_ptr<int64_t>(),
                           static_cast<int>(m), static_cast<int>(h), static_cast<int>(cap), static_cast<int>(d),
                           c10::cuda::getCurrentCUDAStream().stream());
}

// rope_ then kv_append in one launch: q [M, hq, d] and k [M, hk, d] rotated in place, k and v [M, hk, d] into the
// caches [M, hk, cap, d] at pos [M].
void rope_kv_(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
              const torch::Tensor& sin, int64_t rot, torch::Tensor& kc, torch::Tensor& vc, const torch::Tensor& pos,
              bool table) {
  const c10::Device dev = q.device();
  expect(q, "q", torch::kBFloat16, 3, dev, 4);
  expect(k, "k", torch::kBFloat16, 3, dev, 4);
  expect(v, "v", torch::kBFloat16, 3, dev, 4);
  expect(cos, "cos", torch::kBFloat16, 2, dev, 2);
  expect(sin, "sin", torch::kBFloat16, 2, dev, 2);
  expect(kc, "kc", torch::kBFloat16, 4, dev, 4);
  expect(vc, "vc", torch::kBFloat16, 4, dev, 4);
  expect(pos, "pos", torch::kLong, 1, dev, 8);
  const int64_t m = q.size(0), d = q.size(2), hk = k.size(1), cap = kc.size(2);
  ROCKET_CHECK(k.size(0) == m && k.size(2) == d && v.sizes() == k.sizes() && d % 2 == 0 &&
               kc.sizes() == torch::IntArrayRef({m, hk, cap, d}) && vc.sizes() == kc.sizes() && pos.numel() == m,
               "rope_kv: q " << q.sizes() << ", k " << k.sizes() << ", v " << v.sizes() << ", caches " << kc.sizes()
               << ", pos " << pos.sizes());
  ROCKET_CHECK((table ? cos.size(0) > 0 : cos.size(0) == m) && cos.size(1) == rot && sin.sizes() == cos.sizes(),
               "rope_kv: cos " << cos.sizes() << ", sin " << sin.sizes() << " for " << m << " tokens, rotary " << rot
               << (table ? " (a table read at pos)" : ""));
  const c10::cuda::CUDAGuard guard(dev);
  rocket::launch_rope_kv(q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(),
                         vc.data_ptr(), pos.data_ptr<int64_t>(), static_cast<int>(m), static_cast<int>(q.size(1)),
                         static_cast<int>(hk), static_cast<int>(d), static_cast<int>(rot), static_cast<int>(cap),
                         c10::cuda::getCurrentCUDAStream().stream(), table ? static_cast<int>(cos.size(0)) : 0);
}

// scores [M, heads, 1, span] bf16 (one query per stream) -> probabilities, keys past pos[m] hidden (decode_ops.cu).
torch::Tensor decode_softmax(const torch::Tensor& scores, const torch::Tensor& pos, double scale) {
  const c10::Device dev = scores.device();
  expect(scores, "scores", torch::kBFloat16, 4, dev, 2);
  expect(pos, "pos", torch::kLong, 1, dev, 8);
  ROCKET_CHECK(scores.size(2) == 1 && pos.numel() == scores.size(0) && scores.size(3) > 0,
               "decode_softmax: scores " << scores.sizes() << " (one query per stream), pos " << pos.sizes());
  const c10::cuda::CUDAGuard guard(dev);
  auto probs = torch::empty_like(scores);
  rocket::launch_decode_softmax(scores.data_ptr(), pos.data_ptr<int64_t>(), static_cast<int>(scores.size(0)),
                                static_cast<int>(scores.size(1)), static_cast<int>(scores.size(3)),
                                static_cast<float>(scale), probs.data_ptr(), c10::cuda::getCurrentCUDAStream().stream());
  return probs;
}

// Rows [M, n] bf16 whose elements are contiguous (rows may be a view's, stride(0) apart).
void expect_rows(const torch::Tensor& t, const char* name, int64_t m, int64_t n, const c10::Device& dev) {
  ROCKET_CHECK(t.is_cuda() && t.device() == dev, name << " must be on " << dev << ", got " << t.device());
  ROCKET_CHECK(t.scalar_type() == torch::kBFloat16, name << " is " << t.scalar_type() << ", expected BFloat16");
  ROCKET_CHECK(t.dim() == 2 && t.size(0) == m && t.size(1) == n && t.stride(1) == 1 && t.stride(0) >= n,
               name << " must be [" << m << ", " << n << "] with contiguous rows, got " << t.sizes() << " strides "
                    << t.strides());
}

// GLM-5.3-Flash's MLA decode step into its caches (mla.cu): the latent rows [M, kv_lora] at pos of cache rows index
// (None: row r), and where key is given, the indexer's keys (LayerNorm'd) and gates, and the pools they complete.
void mla_cache_step(const torch::Tensor& latent, const torch::Tensor& latent_cache, const torch::Tensor& pos,
                    const std::optional<torch::Tensor>& index, const std::optional<torch::Tensor>& key,
                    const std::optional<torch::Tensor>& gate, const std::optional<torch::Tensor>& ln_w,
                    const std::optional<torch::Tensor>& ln_b, const std::optional<torch::Tensor>& ape,
                    const std::optional<torch::Tensor>& key_cache, const std::optional<torch::Tensor>& gate_cache,
                    const std::optional<torch::Tensor>& pool_cache, double eps) {
  const c10::Device dev = latent.device();
  expect(latent_cache, "latent_cache", torch::kBFloat16, 3, dev, 2);
  expect(pos, "pos", torch::kLong, 1, dev, 8);
  const int64_t m = pos.numel(), rows = latent_cache.size(0), cap = latent_cache.size(1), kv = latent_cache.size(2);
  expect_rows(latent, "latent", m, kv, dev);
  if (index) {
    expect(*index, "index", torch::kLong, 1, dev, 8);
    ROCKET_CHECK(index->numel() == m, "mla_cache_step: index " << index->sizes() << " for " << m << " rows");
  }
  rocket::MlaCacheStep a{};
  a.latent = latent.data_ptr();
  a.latent_stride = latent.stride(0);
  a.latent_cache = latent_cache.data_ptr();
  a.index = index ? index->data_ptr<int64_t>() : nullptr;
  a.pos = pos.data_ptr<int64_t>();
  a.cache_rows = rows;
  a.rows = static_cast<int>(m);
  a.kv_lora = static_cast<int>(kv);
  a.cap = static_cast<int>(cap);
  ROCKET_CHECK(m <= INT_MAX && cap <= INT_MAX, "mla_cache_step: " << m << " rows, capacity " << cap);
  if (key) {
    ROCKET_CHECK(gate && ln_w && ln_b && ape && key_cache && gate_cache && pool_cache,
                 "mla_cache_step: a key needs gate, ln_w, ln_b, ape and the key, gate and pool caches");
    const int64_t d = key->size(-1);
    expect_rows(*key, "key", m, d, dev);
    expect_rows(*gate, "gate", m, d, dev);
    expect(*ln_w, "ln_w", torch::kBFloat16, 1, dev, 2);
    expect(*ln_b, "ln_b", torch::kBFloat16, 1, dev, 2);
    expect(*ape, "ape", torch::kFloat, 2, dev, 4);
    expect(*key_cache, "key_cache", torch::kBFloat16, 3, dev, 2);
    expect(*gate_cache, "gate_cache", torch::kBFloat16, 3, dev, 2);
    expect(*pool_cache, "pool_cache", torch::kBFloat16, 3, dev, 2);
    const int64_t kp = ape->size(0);
    ROCKET_CHECK(ln_w->numel() == d && ln_b->numel() == d && ape->size(1) == d && kp > 0 &&
                     key_cache->sizes() == gate_cache->sizes() && key_cache->size(0) == rows &&
                     key_cache->size(1) == cap && key_cache->size(2) == d && pool_cache->size(0) == rows &&
                     pool_cache->size(2) == d && pool_cache->size(1) > (cap - 1) / kp,
                 "mla_cache_step: key [" << m << ", " << d << "], ln " << ln_w->sizes() << " " << ln_b->sizes()
                                         << ", ape " << ape->sizes() << ", caches " << key_cache->sizes() << " "
                                         << gate_cache->sizes() << " " << pool_cache->sizes() << " beside latents "
                                         << latent_cache.sizes());
    a.key = key->data_ptr();
    a.key_stride = key->stride(0);
    a.gate = gate->data_ptr();
    a.gate_stride = gate->stride(0);
    a.ln_w = ln_w->data_ptr();
    a.ln_b = ln_b->data_ptr();
    a.ape = ape->data_ptr<float>();
    a.key_cache = key_cache->data_ptr();
    a.gate_cache = gate_cache->data_ptr();
    a.pool_cache = pool_cache->data_ptr();
    a.dim = static_cast<int>(d);
    a.pools = static_cast<int>(pool_cache->size(1));
    a.kpool = static_cast<int>(kp);
    a.eps = static_cast<float>(eps);
  }
  const c10::cuda::CUDAGuard guard(dev);
  rocket::launch_mla_cache_step(a, c10::cuda::getCurrentCUDAStream().stream());
}

// fp32 scores [M, heads, span] -> bf16 probabilities over each stream's visible columns (mla.cu): valid [M, span],
// or (valid None) positions below pos + 1 (tail) or below the complete pools' end.
torch::Tensor mla_softmax(const torch::Tensor& scores, const std::optional<torch::Tensor>& valid,
                          const std::optional<torch::Tensor>& pos, double scale, int64_t kpool, bool tail) {
  const c10::Device dev = scores.device();
  expect(scores, "scores", torch::kFloat, 3, dev, 4);
  const int64_t m = scores.size(0), span = scores.size(2);
  ROCKET_CHECK(m <= INT_MAX && scores.size(1) <= INT_MAX && span > 0 && span <= INT_MAX,
               "mla_softmax: scores " << scores.sizes());
  ROCKET_CHECK(valid.has_value() != pos.has_value(), "mla_softmax: give valid or pos, one of them");
  if (valid) {
    expect(*valid, "valid", torch::kBool, 2, dev, 1);
    ROCKET_CHECK(valid->size(0) == m && valid->size(1) == span,
                 "mla_softmax: valid " << valid->sizes() << " for scores " << scores.sizes());
  } else {
    expect(*pos, "pos", torch::kLong, 1, dev, 8);
    ROCKET_CHECK(pos->numel() == m && kpool > 0, "mla_softmax: pos " << pos->sizes() << ", kpool " << kpool
                                                                     << " for scores " << scores.sizes());
  }
  const c10::cuda::CUDAGuard guard(dev);
  auto probs = torch::empty(scores.sizes(), scores.options().dtype(torch::kBFloat16));
  rocket::MlaSoftmax a{};
  a.scores = scores.data_ptr<float>();
  a.valid = valid ? valid->data_ptr<bool>() : nullptr;
  a.pos = pos ? pos->data_ptr<int64_t>() : nullptr;
  a.probs = probs.data_ptr();
  a.streams = static_cast<int>(m);
  a.heads = static_cast<int>(scores.size(1));
  a.span = static_cast<int>(span);
  a.kpool = static_cast<int>(std::max<int64_t>(kpool, 1));
  a.tail = tail;
  a.scale = static_cast<float>(scale);
  rocket::launch_mla_softmax(a, c10::cuda::getCurrentCUDAStream().stream());
  return probs;
}

// Per stream the k best pools of its index scores [M, pools] fp32 (topk_first's order, candidates for pos) as
// latent positions in ascending pool order, then the tail (mla.cu) -> (cols int64, valid bool) [M, (k + tail) * kpool].
std::vector<torch::Tensor> mla_pick(const torch::Tensor& scores, const torch::Tensor& pos, int64_t k, int64_t kpool,
                                    bool tail) {
  const c10::Device dev = scores.device();
  expect(scores, "scores", torch::kFloat, 2, dev, 4);
  expect(pos, "pos", torch::kLong, 1, dev, 8);
  const int64_t m = scores.size(0), pools = scores.size(1);
  ROCKET_CHECK(pos.numel() == m && k > 0 && k <= pools && kpool > 0 && m <= INT_MAX && pools <= INT_MAX &&
                   (k + 1) * kpool <= INT_MAX,
               "mla_pick: scores " << scores.sizes() << ", pos " << pos.sizes() << ", k " << k << ", kpool " << kpool);
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t n_cols = (k + (tail ? 1 : 0)) * kpool;
  auto cols = torch::empty({m, n_cols}, scores.options().dtype(torch::kLong));
  auto valid = torch::empty({m, n_cols}, scores.options().dtype(torch::kBool));
  rocket::MlaPick a{};
  a.scores = scores.data_ptr<float>();
  a.pos = pos.data_ptr<int64_t>();
  a.cols = cols.data_ptr<int64_t>();
  a.valid = valid.data_ptr<bool>();
  a.streams = static_cast<int>(m);
  a.pools = static_cast<int>(pools);
  a.k = static_cast<int>(k);
  a.kpool = static_cast<int>(kpool);
  a.tail = tail;
  rocket::launch_mla_pick(a, c10::cuda::getCurrentCUDAStream().stream());
  return {cols, valid};
}

// GLM-4.x decode attention, batch-invariant (decode_attention.cu): q [rows, hq, d] bf16 over the caches
// [streams, hkv, cap, d] bf16 at positions 0..pos[r] (at most span) of cache row index[r] (row r where index is None)
// -> [rows, hq, d] bf16; the combine's scratch allocated here where the span takes two chunks or more.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                               const torch::Tensor& pos, const std::optional<torch::Tensor>& index, double scale,
                               int64_t span) {
  const c10::Device dev = q.device();
  expect(q, "q", torch::kBFloat16, 3, dev, 16);
  expect(kc, "kc", torch::kBFloat16, 4, dev, 16);
  expect(vc, "vc", torch::kBFloat16, 4, dev, 16);
  expect(pos, "pos", torch::kLong, 1, dev, 8);
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t streams = kc.size(0), hkv = kc.size(1), cap = kc.size(2);
  ROCKET_CHECK(kc.size(3) == d && vc.sizes() == kc.sizes() && pos.numel() == rows,
               "decode_attention: q " << q.sizes() << ", caches " << kc.sizes() << " and " << vc.sizes() << ", pos "
               << pos.sizes());
  ROCKET_CHECK(hq < INT_MAX && cap < INT_MAX && rocket::decode_attention_takes(int(hq), int(hkv), int(d)),
               "decode_attention: " << hq << " query heads over " << hkv << " kv heads, head dim " << d
               << " (kv heads divide the query heads; head dim 16, 32, 64 or 128)");
  ROCKET_CHECK(span >= 1 && span <= cap && rows <= 65535, "decode_attention: span " << span << " of " << cap
               << " cache positions, " << rows << " rows (at most 65535)");
  if (index) {
    expect(*index, "index", torch::kLong, 1, dev, 8);
    ROCKET_CHECK(index->numel() == rows, "decode_attention: index " << index->sizes() << " for " << rows << " rows");
  } else {
    ROCKET_CHECK(rows <= streams, "decode_attention: " << rows << " rows over caches of " << streams << " streams");
  }
  const c10::cuda::CUDAGuard guard(dev);
  const int chunks = rocket::decode_attention_chunks(static_cast<int>(span));
  auto out = torch::empty({rows, hq, d}, q.options());
  torch::Tensor part_o, part_ml;
  if (chunks >= 2) {
    part_o = torch::empty({rows, hq, chunks, d}, q.options().dtype(torch::kFloat));
    part_ml = torch::empty({rows, hq, chunks, 2}, q.options().dtype(torch::kFloat));
  }
  rocket::DecodeAttention a{};
  a.q = q.data_ptr();
  a.kc = kc.data_ptr();
  a.vc = vc.data_ptr();
  a.pos = pos.data_ptr<int64_t>();
  a.index = index ? index->data_ptr<int64_t>() : nullptr;
  a.cache_rows = streams;
  a.rows = static_cast<int>(rows);
  a.hq = static_cast<int>(hq);
  a.hkv = static_cast<int>(hkv);
  a.cap = static_cast<int>(cap);
  a.d = static_cast<int>(d);
  a.span = static_cast<int>(span);
  a.chunks = chunks;
  a.scale = static_cast<float>(scale);
  a.part_o = chunks >= 2 ? part_o.data_ptr<float>() : nullptr;
  a.part_ml = chunks >= 2 ? part_ml.data_ptr<float>() : nullptr;
  a.out = out.data_ptr();
  rocket::launch_decode_attention(a, c10::cuda::getCurrentCUDAStream().stream());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rocket_mpi CUDA kernels (csrc/): NVFP4 routed experts, moe_scatter_add";
  m.def("nvfp4_experts", &nvfp4_experts, "NVFP4 routed experts of one rank (batch-invariant); pdl: -1 auto, 0 off, "
        "3 down waits for each pass of gate/up; wide: -1 auto, 0 off, 1 on, 2 warpgroup mma (sm_90; neither changes "
        "the bits)", py::arg("x"),
        py::arg("row_index"), py::arg("plan"), py::arg("n_tiles"), py::arg("n_groups"), py::arg("n_rows"),
        py::arg("q_gu"), py::arg("s_gu"), py::arg("s2_gu"), py::arg("q_dn"), py::arg("s_dn"), py::arg("hidden"),
        py::arg("inter"), py::arg("swiglu_limit"), py::arg("pdl") = rocket::kPdlAuto, py::arg("far") = py::none(),
        py::arg("wide") = rocket::kWideAuto);
  m.def("nvfp4_experts_stages", &nvfp4_experts_stages, "nvfp4_experts returning {out, x_frag, h_frag} (tests)",
        py::arg("x"), py::arg("row_index"), py::arg("plan"), py::arg("n_tiles"), py::arg("n_groups"),
        py::arg("n_rows"), py::arg("q_gu"), py::arg("s_gu"), py::arg("s2_gu"), py::arg("q_dn"), py::arg("s_dn"),
        py::arg("hidden"), py::arg("inter"), py::arg("swiglu_limit"), py::arg("pdl") = rocket::kPdlAuto,
        py::arg("far") = py::none(), py::arg("wide") = rocket::kWideAuto);
  m.def("swiglu_dense", &swiglu_dense, "a SwiGLU MLP (one BF16 expert) over dense rows in the expert kernels "
        "(gate and up clamped to swiglu_limit where given), then + each residual in order; pdl as nvfp4_experts', "
        "split: K slices (0 by shape, 1, 2, 4, 8)", py::arg("x"), py::arg("q_gu"), py::arg("s2_gu"), py::arg("q_dn"),
        py::arg("hidden"), py::arg("inter"), py::arg("residuals") = std::vector<torch::Tensor>{},
        py::arg("swiglu_limit") = py::none(), py::arg("pdl") = rocket::kPdlAuto, py::arg("split") = 0);
  m.def("bf16_linear", &bf16_linear, "x W^T (+ bias), W in BF16 tiles, optionally split into parts by feature; one "
        "part: then + each residual in order; split: K slices (0 by shape, 1, 2, 4, 8)", py::arg("x"), py::arg("w"),
        py::arg("n"), py::arg("k"), py::arg("bias"), py::arg("ends"),
        py::arg("residuals") = std::vector<torch::Tensor>{}, py::arg("split") = 0);
  m.def("dequant_packed", &dequant_packed, "packed NVFP4 tiles -> bf16 [N, K] as the kernel decodes them (direct: K "
        "in direct_k_order, written back in the input's order)", py::arg("q"), py::arg("s"), py::arg("direct") = false);
  m.def("swiglu_dense_nvfp4", &swiglu_dense_nvfp4, "a SwiGLU MLP (one NVFP4 expert, down's weight_scale_2 s2_dn "
        "applied) over dense rows, then + each residual in order; limit, pdl and split as swiglu_dense's", py::arg("x"),
        py::arg("q_gu"), py::arg("s_gu"), py::arg("s2_gu"), py::arg("q_dn"), py::arg("s_dn"), py::arg("s2_dn"),
        py::arg("hidden"), py::arg("inter"), py::arg("residuals") = std::vector<torch::Tensor>{},
        py::arg("swiglu_limit") = py::none(), py::arg("pdl") = rocket::kPdlAuto, py::arg("split") = 0);
  m.def("nvfp4_linear", &nvfp4_linear, "x W^T (+ bias), W in NVFP4 tiles with one weight_scale_2 per output part, "
        "optionally split into parts by feature; one part: then + each residual in order; split: K slices (0 by shape, "
        "1, 2, 4, 8)", py::arg("x"), py::arg("w"), py::arg("s"), py::arg("n"), py::arg("k"), py::arg("w_scale"),
        py::arg("bias"), py::arg("ends"), py::arg("residuals") = std::vector<torch::Tensor>{}, py::arg("split") = 0);
  m.def("nvfp4_experts_into", &nvfp4_experts_into, "experts of a device plan into out (CUDA-graph safe); pdl as "
        "nvfp4_experts'", py::arg("x"), py::arg("row_index"), py::arg("pad_rows"), py::arg("groups"), py::arg("out"),
        py::arg("q_gu"), py::arg("s_gu"), py::arg("s2_gu"), py::arg("q_dn"), py::arg("s_dn"), py::arg("hidden"),
        py::arg("inter"), py::arg("swiglu_limit"), py::arg("pdl") = rocket::kPdlAuto, py::arg("far") = py::none());
  m.def("moe_plan", &moe_plan, "device row plan of one MoE layer (CUDA-graph safe); meta into meta_out where given, "
        "and *zero = 0", py::arg("experts"), py::arg("weights"), py::arg("pair0"), py::arg("pair_owner"),
        py::arg("slot"), py::arg("canon"),
        py::arg("s2_down"), py::arg("rank"), py::arg("n_ranks"), py::arg("n_sets"), py::arg("set_stride"),
        py::arg("seq"), py::arg("meta_out") = py::none(), py::arg("zero") = py::none(),
        py::arg("fires") = py::none(), py::arg("stride") = 0);
  m.def("ipc_exchange_flags", &ipc_exchange_flags, "cuda-ipc: one kernel, a flag word per (sender, block) (the "
        "graphed step's exchange)");
  m.def("bell_exchange", &bell_exchange, "shm/verbs graphed exchange: stage this rank's block and its ready record "
        "for the proxy thread, then wait on the doorbell words (timeout into err) and gather the peers' blocks",
        py::arg("out"), py::arg("rows"), py::arg("meta"), py::arg("staging"), py::arg("header"),
        py::arg("region_bytes"), py::arg("slot_bytes"), py::arg("ready_offset"), py::arg("sync"), py::arg("err"),
        py::arg("rank"), py::arg("rails"), py::arg("timeout_s"), py::arg("layer"), py::arg("stage_blocks"),
        py::arg("gather_blocks"), py::arg("puts") = std::vector<int64_t>{});
  m.def("host_map", &host_map, "cudaHostRegister (mapped, portable) -> the device address", py::arg("ptr"),
        py::arg("nbytes"));
  m.def("host_unmap", &host_unmap, "cudaHostUnregister", py::arg("ptr"));
  m.def("rms_norm", &rms_norm, "fused RMSNorm (decode step); with index, (x[index], its norm) from one launch",
        py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("index") = py::none());
  m.def("hc_pre", &hc_pre, "GLM-5.3-Flash hyper-connection collapse: (post, comb, collapsed), two launches; with "
        "norm_w also the collapsed row's RMSNorm (in the second launch where it fuses)", py::arg("x"), py::arg("fn"),
        py::arg("base"), py::arg("scale"), py::arg("iters"), py::arg("eps"), py::arg("norm_eps"),
        py::arg("norm_w") = py::none(), py::arg("rms_eps") = 0.0);
  m.def("hc_post", &hc_post, "GLM-5.3-Flash hyper-connection expand: the new streams, one launch");
  m.def("kda_decode", &kda_decode, "GLM-5.3-Flash KDA: one decode token per stream, or (offsets) each stream's "
        "segment of tokens in order, the q|k|v projection to o_proj's input, the conv and recurrent states updated in "
        "place (one launch)", py::arg("mixed"), py::arg("conv_state"), py::arg("conv_w"), py::arg("f"), py::arg("b"),
        py::arg("gate"), py::arg("dt_bias"), py::arg("a_log"), py::arg("o_norm"), py::arg("state"), py::arg("index"),
        py::arg("heads"), py::arg("dk"), py::arg("q_scale"), py::arg("lower_bound"), py::arg("eps"),
        py::arg("offsets") = py::none());
  m.def("argmax_", &argmax_, "tokens = argmax of each row of bf16 logits (torch's choice), pos += 1, one launch",
        py::arg("logits"), py::arg("tokens"), py::arg("ticket"), py::arg("pos") = py::none());
  m.def("rope_", &rope_, "rotate-half RoPE on q and k in place (decode step)");
  m.def("rope_interleaved", &rope_interleaved, "GLM-5's interleaved RoPE of x [T, H, r] into a new tensor, the bits of "
        "torch's bf16 ops");
  m.def("rope_kv_", &rope_kv_, "rope_ and kv_append in one launch (decode step); table: cos/sin read at pos",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"), py::arg("rot"), py::arg("kc"),
        py::arg("vc"), py::arg("pos"), py::arg("table") = false);
  m.def("decode_softmax", &decode_softmax, "attention probabilities of one query per stream, keys past pos hidden");
  m.def("mla_cache_step", &mla_cache_step, "GLM-5.3-Flash MLA decode step into the caches: latents, indexer keys "
        "(LayerNorm) and gates, and the pools they complete, one launch", py::arg("latent"), py::arg("latent_cache"),
        py::arg("pos"), py::arg("index") = py::none(), py::arg("key") = py::none(), py::arg("gate") = py::none(),
        py::arg("ln_w") = py::none(), py::arg("ln_b") = py::none(), py::arg("ape") = py::none(),
        py::arg("key_cache") = py::none(), py::arg("gate_cache") = py::none(), py::arg("pool_cache") = py::none(),
        py::arg("eps") = 1e-6);
  m.def("mla_softmax", &mla_softmax, "MLA decode attention probabilities over each stream's visible columns",
        py::arg("scores"), py::arg("valid") = py::none(), py::arg("pos") = py::none(), py::arg("scale") = 1.0,
        py::arg("kpool") = 1, py::arg("tail") = true);
  m.def("mla_pick", &mla_pick, "MLA decode: each stream's k best pools of its index scores as latent positions "
        "(cols, valid), ascending, then the tail", py::arg("scores"), py::arg("pos"), py::arg("k"), py::arg("kpool"),
        py::arg("tail"));
  m.def("kv_append", &kv_append, "k/v of one token per stream into the caches at pos (decode step)");
  m.def("moe_scatter_add", &moe_scatter_add, "per token fp32 sum of coef * row in order, one bf16 rounding; "
        "with by_canon and sum, also sum += the rows' checksum; then + each residual in order", py::arg("rows"),
        py::arg("by_token"), py::arg("coef"), py::arg("by_canon") = py::none(), py::arg("sum") = py::none(),
        py::arg("residuals") = std::vector<torch::Tensor>{}, py::arg("norm_w") = py::none(), py::arg("eps") = 0.0);
  m.def("router_logits", &router_logits, "router logits as partial sums over slices of hidden [S, T, E], fp32");
  m.def("moe_route", &moe_route, "sigmoid router: group-limited top-k and normalised weights, one warp per token");
  m.def("decode_attention", &decode_attention, "GLM-4.x decode attention of one query per stream over its cache rows "
        "0..pos, in fixed chunks of positions: batch-invariant", py::arg("q"), py::arg("kc"), py::arg("vc"),
        py::arg("pos"), py::arg("index"), py::arg("scale"), py::arg("span"));
}
