// hypershard::rms_norm and hypershard::rotary_position_embedding (forward and backward) on every
// device but the CPU: the maths of rms_norm.cpp and rotary.cpp composed of ATen ops, registered
// at CompositeExplicitAutograd. A backend's own kernel (the fused CPU loops) takes precedence, so
// this serves CUDA, an NPU (PrivateUse1) and any other device: without it a GPU run stopped at
// "Could not run 'hypershard::rms_norm' with arguments from the 'CUDA' backend" (the GPU check).
//
// The same arithmetic contract as the CPU kernels: inputs widened to the op-math type (float for
// bfloat16 / float16, else their own), every product and sum there, one rounding to the output
// dtype at the end; weight / cos / sin gradients summed over the broadcast dims before it. Not
// one fused pass: each ATen op is a kernel launch, and the intermediates are full tensors.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "kernels/kernels.h"

namespace hypershard::kernels {
namespace {

std::vector<int64_t> dims_from(int64_t first, int64_t end) {
  std::vector<int64_t> dims;
  for (int64_t d = first; d < end; ++d) dims.push_back(d);
  return dims;
}

// ---------------------------------------------------------------------------------- rms_norm

std::tuple<at::Tensor, at::Tensor> rms_norm_composite(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm_arguments(x, weight);
  const auto acc = at::toOpMathType(x.scalar_type());
  const auto normalized = dims_from(x.dim() - weight.dim(), x.dim());
  const auto xa = x.to(acc);
  // the mean of nothing is NaN, as torch's mean and the CPU kernel
  const auto rstd = (xa.square().mean(normalized, /*keepdim=*/true) + eps).rsqrt();
  return {(xa * rstd * weight.to(acc)).to(at::result_type(x, weight)), rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_composite(const at::Tensor& grad, const at::Tensor& x,
                                                               const at::Tensor& weight, const at::Tensor& rstd,
                                                               std::array<bool, 2> output_mask) {
  check_rms_norm_arguments(x, weight);
  TORCH_CHECK(grad.sizes() == x.sizes(), "hypershard::rms_norm_backward: grad has shape ", grad.sizes(), " and x ",
              x.sizes(), "; allowed: grad shaped like x");
  const auto acc = at::toOpMathType(x.scalar_type());
  const int64_t lead = x.dim() - weight.dim();
  const auto g = grad.to(acc), h = x.to(acc) * rstd.to(acc);
  at::Tensor dx, dweight;
  if (output_mask[0]) {
    const auto u = g * weight.to(acc);
    dx = (rstd.to(acc) * (u - h * (u * h).mean(dims_from(lead, x.dim()), /*keepdim=*/true))).to(x.scalar_type());
  }
  if (output_mask[1]) {
    const auto full = g * h;
    dweight = (lead > 0 ? full.sum(dims_from(0, lead)) : full).to(weight.scalar_type());
  }
  return {dx, dweight};
}

// ---------------------------------------------------------------------------------- rotary

// p: the deinterleave of mode 3 (evens, then odds); the identity otherwise.
at::Tensor permute_in(const at::Tensor& t, int64_t mode) {
  if (mode != 3) return t;
  return at::cat({t.slice(-1, 0, c10::nullopt, 2), t.slice(-1, 1, c10::nullopt, 2)}, -1);
}

// p^T: evens and odds interleaved back.
at::Tensor permute_out(const at::Tensor& t, int64_t mode) {
  if (mode != 3) return t;
  const int64_t half = t.size(-1) / 2;
  return at::stack({t.narrow(-1, 0, half), t.narrow(-1, half, half)}, -1).flatten(-2);
}

// R: the signed rotation of pairs (rotary.cpp's header); mode 3 rotates halves after p.
at::Tensor rotate(const at::Tensor& t, int64_t mode) {
  const int64_t d = t.size(-1);
  if (mode == 1) return at::stack({-t.slice(-1, 1, c10::nullopt, 2), t.slice(-1, 0, c10::nullopt, 2)}, -1).flatten(-2);
  if (mode == 2) {
    const int64_t q = d / 4;
    return at::cat({-t.narrow(-1, q, q), t.narrow(-1, 0, q), -t.narrow(-1, 3 * q, q), t.narrow(-1, 2 * q, q)}, -1);
  }
  const int64_t half = d / 2;
  return at::cat({-t.narrow(-1, half, half), t.narrow(-1, 0, half)}, -1);
}

at::Tensor rotary_composite(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t mode) {
  check_rotary_arguments(x, cos, sin, mode);
  const auto acc = at::toOpMathType(x.scalar_type());
  const auto px = permute_in(x.to(acc), mode);
  return (px * cos.to(acc) + rotate(px, mode) * sin.to(acc)).to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_backward_composite(const at::Tensor& grad, const at::Tensor& x,
                                                                         const at::Tensor& cos, const at::Tensor& sin,
                                                                         int64_t mode,
                                                                         std::array<bool, 3> output_mask) {
  check_rotary_arguments(x, cos, sin, mode);
  TORCH_CHECK(grad.sizes() == x.sizes(), "hypershard::rotary_position_embedding_backward: grad has shape ",
              grad.sizes(), " and x ", x.sizes(), "; allowed: grad shaped like x");
  const auto acc = at::toOpMathType(x.scalar_type());
  const auto g = grad.to(acc);
  at::Tensor dx, dcos, dsin;
  // R is antisymmetric: R^T(v) = -R(v)
  if (output_mask[0]) dx = permute_out(g * cos.to(acc) - rotate(g * sin.to(acc), mode), mode).to(x.scalar_type());
  if (output_mask[1] || output_mask[2]) {
    const auto px = permute_in(x.to(acc), mode);
    if (output_mask[1]) dcos = (g * px).sum_to_size(cos.sizes()).to(cos.scalar_type());
    if (output_mask[2]) dsin = (g * rotate(px, mode)).sum_to_size(sin.sizes()).to(sin.scalar_type());
  }
  return {dx, dcos, dsin};
}

torch::Library& composite_library() {
  static auto* library = new torch::Library(torch::Library::IMPL, "hypershard",
                                            c10::DispatchKey::CompositeExplicitAutograd, __FILE__, __LINE__);
  return *library;
}

}  // namespace

void register_rms_norm_composite() {
  composite_library().impl("rms_norm", TORCH_FN(rms_norm_composite));
  composite_library().impl("rms_norm_backward", TORCH_FN(rms_norm_backward_composite));
}

void register_rotary_composite() {
  composite_library().impl("rotary_position_embedding", TORCH_FN(rotary_composite));
  composite_library().impl("rotary_position_embedding_backward", TORCH_FN(rotary_backward_composite));
}

}  // namespace hypershard::kernels
