// hypershard::rms_norm: y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2 over the normalized dims)
// + eps), one fused pass per row, forward and backward, CPU, fp32/fp64/bf16/fp16.
//
//   rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> (Tensor y, Tensor rstd)
//   rms_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor rstd, bool[2] output_mask)
//       -> (Tensor dx, Tensor dweight)
//
// The normalized dims are x's last weight.dim() dims (weight has their shape), as in torch_npu's
// npu_rms_norm; rstd has x's shape with those dims 1, in float (double for double). y has the
// dtype torch's promotion gives x and weight (HF's RMSNorm returns weight * normalized). Every
// product and sum is in float (double), with one rounding at the end.
//
// Backward, with n the normalized size, h = x * rstd and u = grad * weight:
//   dx = rstd * (u - h * mean(u * h)),   dweight = sum over the leading dims of grad * h.
// The autograd kernel (at the Autograd alias key, so DTensors get it) saves x, weight and rstd.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "kernels/kernels.h"

namespace hypershard::kernels {

void check_rms_norm_arguments(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t k = weight.dim();
  TORCH_CHECK(k >= 1 && x.dim() >= k && x.sizes().slice(x.dim() - k).equals(weight.sizes()),
              "hypershard::rms_norm: x has shape ", x.sizes(), " and weight ", weight.sizes(),
              "; allowed: weight of rank >= 1 with the shape of x's last weight.dim() dims");
  TORCH_CHECK(x.is_floating_point() && weight.is_floating_point(), "hypershard::rms_norm: x is ", x.scalar_type(),
              " and weight ", weight.scalar_type(), "; allowed: floating dtypes");
}

namespace {

std::vector<int64_t> stats_shape(const at::Tensor& x, int64_t k) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  for (int64_t i = x.dim() - k; i < x.dim(); ++i) shape[i] = 1;
  return shape;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_rms_norm_arguments(x_in, weight_in);
  const auto out_type = at::result_type(x_in, weight_in);
  const auto acc_type = at::toOpMathType(x_in.scalar_type());
  const auto x = x_in.contiguous(), weight = weight_in.to(acc_type).contiguous();
  const int64_t n = weight.numel(), rows = n == 0 ? 0 : x.numel() / n;
  auto rstd = at::empty(stats_shape(x, weight.dim()), x.options().dtype(acc_type));
  auto y = at::empty(x.sizes(), x.options().dtype(out_type));
  if (n == 0) rstd.fill_(std::numeric_limits<double>::quiet_NaN());  // the mean of nothing, as torch's mean
  if (x.numel() == 0) return {y, rstd};
  at::Tensor y_work = out_type == x.scalar_type() ? y : at::empty(x.sizes(), x.options().dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const acc_t* wp = weight.const_data_ptr<acc_t>();
    acc_t* rp = rstd.mutable_data_ptr<acc_t>();
    const bool direct = y_work.scalar_type() == x.scalar_type();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = xp + r * n;
        acc_t squares = 0;
        for (int64_t i = 0; i < n; ++i) squares += static_cast<acc_t>(xr[i]) * static_cast<acc_t>(xr[i]);
        const acc_t inv = acc_t(1) / std::sqrt(squares / static_cast<acc_t>(n) + static_cast<acc_t>(eps));
        rp[r] = inv;
        if (direct) {
          scalar_t* yr = y_work.mutable_data_ptr<scalar_t>() + r * n;
          for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<scalar_t>(static_cast<acc_t>(xr[i]) * inv * wp[i]);
        } else {
          acc_t* yr = y_work.mutable_data_ptr<acc_t>() + r * n;
          for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<acc_t>(xr[i]) * inv * wp[i];
        }
      }
    });
  });
  if (!y_work.is_same(y)) y.copy_(y_work);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_in, const at::Tensor& x_in,
                                                         const at::Tensor& weight_in, const at::Tensor& rstd_in,
                                                         std::array<bool, 2> output_mask) {
  check_rms_norm_arguments(x_in, weight_in);
  TORCH_CHECK(grad_in.sizes() == x_in.sizes(), "hypershard::rms_norm_backward: grad has shape ", grad_in.sizes(),
              " and x ", x_in.sizes(), "; allowed: grad shaped like x");
  const auto acc_type = at::toOpMathType(x_in.scalar_type());
  const auto x = x_in.contiguous(), weight = weight_in.to(acc_type).contiguous();
  const auto grad = grad_in.to(acc_type).contiguous(), rstd = rstd_in.to(acc_type).contiguous();
  const int64_t n = weight.numel(), rows = n == 0 ? 0 : x.numel() / n;
  TORCH_CHECK(rstd.numel() == rows, "hypershard::rms_norm_backward: rstd has shape ", rstd_in.sizes(),
              "; allowed: x's shape with the normalized dims 1");
  at::Tensor dx = output_mask[0] ? at::empty_like(x) : at::Tensor();
  // grad * h per element in float, summed over the leading dims below before rounding.
  at::Tensor dweight_full = output_mask[1] ? at::empty(x.sizes(), x.options().dtype(acc_type)) : at::Tensor();
  if (rows > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const acc_t* gp = grad.const_data_ptr<acc_t>();
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      const acc_t* wp = weight.const_data_ptr<acc_t>();
      const acc_t* rp = rstd.const_data_ptr<acc_t>();
      scalar_t* dxp = dx.defined() ? dx.mutable_data_ptr<scalar_t>() : nullptr;
      acc_t* dwp = dweight_full.defined() ? dweight_full.mutable_data_ptr<acc_t>() : nullptr;
      at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const acc_t* gr = gp + r * n;
          const scalar_t* xr = xp + r * n;
          const acc_t inv = rp[r];
          if (dxp) {
            acc_t dot = 0;
            for (int64_t i = 0; i < n; ++i) dot += gr[i] * wp[i] * static_cast<acc_t>(xr[i]) * inv;
            const acc_t mean = dot / static_cast<acc_t>(n);
            for (int64_t i = 0; i < n; ++i) {
              const acc_t h = static_cast<acc_t>(xr[i]) * inv;
              dxp[r * n + i] = static_cast<scalar_t>(inv * (gr[i] * wp[i] - h * mean));
            }
          }
          if (dwp)
            for (int64_t i = 0; i < n; ++i) dwp[r * n + i] = gr[i] * static_cast<acc_t>(xr[i]) * inv;
        }
      });
    });
  } else if (dweight_full.defined()) {
    dweight_full.zero_();
  }
  at::Tensor dweight;
  if (dweight_full.defined()) {
    const int64_t lead = x.dim() - weight.dim();
    std::vector<int64_t> dims(static_cast<size_t>(lead));
    for (int64_t i = 0; i < lead; ++i) dims[i] = i;
    dweight = (lead > 0 ? dweight_full.sum(dims) : dweight_full).to(weight_in.scalar_type());
  }
  return {dx, dweight};
}

namespace {

const c10::OperatorHandle& forward_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("hypershard::rms_norm", "");
  return op;
}
const c10::OperatorHandle& backward_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("hypershard::rms_norm_backward", "");
  return op;
}

using Backward = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, std::array<bool, 2>);

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, rstd] =
        forward_op().typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double)>().call(
            x, weight, eps);
    ctx->save_for_backward({x, weight, rstd});
    ctx->mark_non_differentiable({rstd});
    return {y, rstd};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const std::array<bool, 2> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
    auto [dx, dweight] = backward_op().typed<Backward>().call(grads[0], saved[0], saved[1], saved[2], mask);
    return {dx, dweight, at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto out = RmsNormFunction::apply(x, weight, eps);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_autograd(const at::Tensor& grad, const at::Tensor& x,
                                                              const at::Tensor& weight, const at::Tensor& rstd,
                                                              std::array<bool, 2> output_mask) {
  std::tuple<at::Tensor, at::Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = backward_op().typed<Backward>().call(grad, x, weight, rstd, output_mask);
  }
  forbid_second_derivative({std::get<0>(out), std::get<1>(out)}, {grad, x, weight}, "hypershard::rms_norm_backward");
  return out;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double) {
  check_rms_norm_arguments(x, weight);
  return {at::empty(x.sizes(), x.options().dtype(at::result_type(x, weight))),
          at::empty(stats_shape(x, weight.dim()), x.options().dtype(at::toOpMathType(x.scalar_type())))};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_meta(const at::Tensor&, const at::Tensor& x,
                                                          const at::Tensor& weight, const at::Tensor&,
                                                          std::array<bool, 2> output_mask) {
  check_rms_norm_arguments(x, weight);
  return {output_mask[0] ? at::empty_like(x) : at::Tensor(), output_mask[1] ? at::empty_like(weight) : at::Tensor()};
}

}  // namespace

void register_rms_norm_kernels() {
  static auto* def = new torch::Library(torch::Library::FRAGMENT, "hypershard", std::nullopt, __FILE__, __LINE__);
  def->def("rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> (Tensor, Tensor)");
  def->def(
      "rms_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor rstd, bool[2] output_mask) -> "
      "(Tensor, Tensor)");
  static auto* cpu = new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::CPU, __FILE__, __LINE__);
  cpu->impl("rms_norm", TORCH_FN(rms_norm_cpu));
  cpu->impl("rms_norm_backward", TORCH_FN(rms_norm_backward_cpu));
  static auto* autograd =
      new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::Autograd, __FILE__, __LINE__);
  autograd->impl("rms_norm", TORCH_FN(rms_norm_autograd));
  autograd->impl("rms_norm_backward", TORCH_FN(rms_norm_backward_autograd));
  static auto* meta =
      new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::Meta, __FILE__, __LINE__);
  meta->impl("rms_norm", TORCH_FN(rms_norm_meta));
  meta->impl("rms_norm_backward", TORCH_FN(rms_norm_backward_meta));
  register_rms_norm_composite();
}

}  // namespace hypershard::kernels
