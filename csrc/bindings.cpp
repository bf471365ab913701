// rocket_mpi._C: the only file that sees torch. Checks every tensor (device, dtype, shape, layout),
// allocates outputs and scratch, and calls the plain launchers of rocket.h on the current stream.
#include <cstdint>
#include <optional>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "rocket.h"

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

// Returns {out, x_frag, h_frag}: the scratch fragments are kept for the tests' stage-by-stage checks.
std::vector<torch::Tensor> nvfp4_experts_stages(const torch::Tensor& x, const std::optional<torch::Tensor>& row_index,
                                                const torch::Tensor& plan, int64_t n_tiles, int64_t n_groups,
                                                int64_t n_rows, const torch::Tensor& q_gu, const torch::Tensor& s_gu,
                                                const torch::Tensor& s2_gu, const torch::Tensor& q_dn,
                                                const torch::Tensor& s_dn, int64_t hidden, int64_t inter,
                                                std::optional<double> swiglu_limit) {
  const c10::Device dev = x.device();
  expect(x, "x", torch::kBFloat16, 2, dev, 4);
  ROCKET_CHECK(x.size(1) == hidden, "x has " << x.size(1) << " columns, experts have hidden " << hidden);
  expect(plan, "plan", torch::kInt, 1, dev);
  ROCKET_CHECK(plan.numel() == n_tiles * rocket::kRowTile + n_groups * 4,
               "plan has " << plan.numel() << " ints for " << n_tiles << " tiles and " << n_groups << " groups");
  const int64_t hp = round_up(hidden, rocket::kTileK), ip = round_up(inter, rocket::kTileK);
  expect(q_gu, "q_gu", torch::kByte, 5, dev);
  const int64_t slots = q_gu.size(0);
  ROCKET_CHECK(q_gu.sizes() == torch::IntArrayRef({slots, 2 * ip / 16, hp / 64, 32, 16}),
               "q_gu " << q_gu.sizes() << " does not match hidden " << hidden << ", inter " << inter);
  expect(s_gu, "s_gu", torch::kByte, 5, dev);
  ROCKET_CHECK(s_gu.sizes() == torch::IntArrayRef({slots, 2 * ip / 16, hp / 64, 8, 8}), "s_gu " << s_gu.sizes());
  expect(s2_gu, "s2_gu", torch::kFloat, 2, dev, 4);
  ROCKET_CHECK(s2_gu.sizes() == torch::IntArrayRef({slots, 2}), "s2_gu " << s2_gu.sizes());
  expect(q_dn, "q_dn", torch::kByte, 5, dev);
  ROCKET_CHECK(q_dn.sizes() == torch::IntArrayRef({slots, hp / 16, ip / 64, 32, 16}), "q_dn " << q_dn.sizes());
  expect(s_dn, "s_dn", torch::kByte, 5, dev);
  ROCKET_CHECK(s_dn.sizes() == torch::IntArrayRef({slots, hp / 16, ip / 64, 8, 8}), "s_dn " << s_dn.sizes());
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

  rocket::ExpertsLaunch a{};
  a.x = x.data_ptr();
  a.x_rows = x.size(0);
  a.row_index = ri;
  a.pad_rows = plan.data_ptr<int>();
  a.groups = reinterpret_cast<const int4*>(plan.data_ptr<int>() + n_tiles * rocket::kRowTile);
  a.n_groups = static_cast<int>(n_groups);
  a.n_tiles = static_cast<int>(n_tiles);
  a.q_gu = q_gu.data_ptr<uint8_t>();
  a.s_gu = s_gu.data_ptr<uint8_t>();
  a.s2_gu = s2_gu.data_ptr<float>();
  a.q_dn = q_dn.data_ptr<uint8_t>();
  a.s_dn = s_dn.data_ptr<uint8_t>();
  a.hidden = static_cast<int>(hidden);
  a.inter = static_cast<int>(inter);
  a.hidden_pad = static_cast<int>(hp);
  a.inter_pad = static_cast<int>(ip);
  a.has_limit = swiglu_limit.has_value() ? 1 : 0;
  a.swiglu_limit = swiglu_limit.has_value() ? static_cast<float>(*swiglu_limit) : 0.0f;
  a.x_frag = reinterpret_cast<uint4*>(x_frag.data_ptr<int>());
  a.h_frag = reinterpret_cast<uint4*>(h_frag.data_ptr<int>());
  a.out = out.data_ptr();
  a.out_rows = n_rows;
  rocket::launch_nvfp4_experts(a, c10::cuda::getCurrentCUDAStream().stream());
  return {out, x_frag, h_frag};
}

torch::Tensor nvfp4_experts(const torch::Tensor& x, const std::optional<torch::Tensor>& row_index,
                            const torch::Tensor& plan, int64_t n_tiles, int64_t n_groups, int64_t n_rows,
                            const torch::Tensor& q_gu, const torch::Tensor& s_gu, const torch::Tensor& s2_gu,
                            const torch::Tensor& q_dn, const torch::Tensor& s_dn, int64_t hidden, int64_t inter,
                            std::optional<double> swiglu_limit) {
  return nvfp4_experts_stages(x, row_index, plan, n_tiles, n_groups, n_rows, q_gu, s_gu, s2_gu, q_dn, s_dn, hidden,
                              inter, swiglu_limit)[0];
}

torch::Tensor dequant_packed(const torch::Tensor& q, const torch::Tensor& s) {
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
                                      static_cast<int>(out.size(1)), out.data_ptr(),
                                      c10::cuda::getCurrentCUDAStream().stream());
  return out;
}

torch::Tensor moe_scatter_add(const torch::Tensor& rows, const torch::Tensor& by_token, const torch::Tensor& coef) {
  const c10::Device dev = rows.device();
  expect(rows, "rows", torch::kBFloat16, 2, dev, 2);
  expect(by_token, "by_token", torch::kLong, 2, dev, 8);
  expect(coef, "coef", torch::kFloat, 2, dev, 4);
  ROCKET_CHECK(coef.sizes() == by_token.sizes(), "coef " << coef.sizes() << " vs by_token " << by_token.sizes());
  const int64_t tokens = by_token.size(0), topk = by_token.size(1), hidden = rows.size(1);
  const c10::cuda::CUDAGuard guard(dev);
  auto out = torch::empty({tokens, hidden}, rows.options());
  rocket::launch_moe_scatter_add(rows.data_ptr(), rows.size(0), by_token.data_ptr<int64_t>(), coef.data_ptr<float>(),
                                 out.data_ptr(), static_cast<int>(tokens), static_cast<int>(topk),
                                 static_cast<int>(hidden), c10::cuda::getCurrentCUDAStream().stream());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rocket_mpi CUDA kernels (csrc/): NVFP4 routed experts, moe_scatter_add";
  m.def("nvfp4_experts", &nvfp4_experts, "NVFP4 routed experts of one rank (batch-invariant)", py::arg("x"),
        py::arg("row_index"), py::arg("plan"), py::arg("n_tiles"), py::arg("n_groups"), py::arg("n_rows"),
        py::arg("q_gu"), py::arg("s_gu"), py::arg("s2_gu"), py::arg("q_dn"), py::arg("s_dn"), py::arg("hidden"),
        py::arg("inter"), py::arg("swiglu_limit"));
  m.def("nvfp4_experts_stages", &nvfp4_experts_stages, "nvfp4_experts returning {out, x_frag, h_frag} (tests)");
  m.def("dequant_packed", &dequant_packed, "packed NVFP4 tiles -> bf16 [N, K] as the kernel decodes them");
  m.def("moe_scatter_add", &moe_scatter_add, "per token fp32 sum of coef * row in order, one bf16 rounding");
}
