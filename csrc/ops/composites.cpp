// Composite ops whose torch kernels read an argument's data (a DTensor has no storage, so they
// would raise "Cannot access data pointer"): kernels at AutogradPrivateUse2 that turn those
// arguments into values first, then call the op's plain form (which dispatches as usual, rule or
// fallback, and is recorded by autograd).
//
//   max_pool1d               its no-grad path runs a direct CPU loop over the input's data; the
//                            with-indices op (what it does when grad is required) is used always
//   tensor_split(tensor)     the split points, a tensor, are read as GLOBAL values
//   ctc_loss(Tensor lengths) the lengths, tensors, are read as GLOBAL values
//
// And composites whose decomposition would lose a sharding:
//
//   linear                   a 3-D input with its dim 1 sharded (a sequence under context
//                            parallelism) and more than one row in dim 0: torch flattens (batch,
//                            sequence) into rows, which keeps no shard when a rank's rows are not
//                            one block of the flattened dim (two sequences per rank), so the view
//                            would gather the activation. A batched product keeps both dims:
//                            bmm(input, weight^T expanded over the batch) (+ bias). Its weight
//                            gradient holds this rank's batch of [in, out] products until the
//                            expand's backward sums them: (batch per rank) x the weight's size.
#include <ATen/ATen.h>
#include <ATen/ops/linear_native.h>
#include <torch/library.h>

#include "ops/composites.h"
#include "ops/families.h"
#include "runtime/dtensor_impl.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {
namespace {

// A tensor argument's global values as a plain int64 tensor (a DTensor gathered to Replicate).
at::Tensor global_int64(const at::Tensor& t) {
  at::Tensor values = t;
  if (auto* impl = runtime::dtensor_impl(t)) {
    const auto& layout = impl->layout();
    auto full = runtime::intern_layout(layout::Layout::replicate(layout->mesh(), layout->global_shape()));
    values = runtime::redistribute_local(impl->local(), layout, full, *impl->device_mesh());
  }
  return values.to(at::kLong).contiguous();
}

std::vector<int64_t> int_list(const at::Tensor& t) {
  const at::Tensor values = global_int64(t);
  return {values.data_ptr<int64_t>(), values.data_ptr<int64_t>() + values.numel()};
}

at::Tensor max_pool1d_kernel(const at::Tensor& self, c10::IntArrayRef kernel_size, c10::IntArrayRef stride,
                             c10::IntArrayRef padding, c10::IntArrayRef dilation, bool ceil_mode) {
  return std::get<0>(at::max_pool1d_with_indices(self, kernel_size, stride, padding, dilation, ceil_mode));
}

std::vector<at::Tensor> tensor_split_kernel(const at::Tensor& self, const at::Tensor& indices_or_sections,
                                            int64_t dim) {
  TORCH_CHECK(indices_or_sections.dim() <= 1,
              "tensor_split expected tensor_indices_or_sections to be a "
              "zero-dimensional or one-dimensional tensor, but got a tensor with ",
              indices_or_sections.dim(), " dims");
  if (indices_or_sections.dim() == 0) return at::tensor_split(self, int_list(indices_or_sections).at(0), dim);
  return at::tensor_split(self, int_list(indices_or_sections), dim);
}

at::Tensor ctc_loss_kernel(const at::Tensor& log_probs, const at::Tensor& targets, const at::Tensor& input_lengths,
                           const at::Tensor& target_lengths, int64_t blank, int64_t reduction, bool zero_infinity) {
  return at::ctc_loss(log_probs, targets, int_list(input_lengths), int_list(target_lengths), blank, reduction,
                      zero_infinity);
}

at::Tensor linear_kernel(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const auto* impl = runtime::dtensor_impl(input);
  if (impl && linear_keeps_sequence_shards(*impl->layout(), weight.dim())) return linear_batched(input, weight, bias);
  return at::native::linear(input, weight, bias);
}

}  // namespace

bool linear_keeps_sequence_shards(const layout::Layout& input, int64_t weight_dim) {
  return input.global_shape().size() == 3 && weight_dim == 2 && input.global_shape()[0] > 1 &&
         !input.dim_axes()[1].empty();
}

at::Tensor linear_batched(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const at::Tensor out =
      at::bmm(input, weight.t().unsqueeze(0).expand({input.size(0), weight.size(1), weight.size(0)}));
  return bias && bias->defined() ? at::add(out, *bias) : out;
}

void register_composite_kernels() {
  aten_autograd_kernels().impl("linear", TORCH_FN(linear_kernel));
  aten_autograd_kernels().impl("max_pool1d", TORCH_FN(max_pool1d_kernel));
  aten_autograd_kernels().impl("tensor_split.tensor_indices_or_sections", TORCH_FN(tensor_split_kernel));
  aten_autograd_kernels().impl("ctc_loss.Tensor", TORCH_FN(ctc_loss_kernel));
}

}  // namespace hypershard::ops
