// Convolutions (conv1d/2d/3d, transposed, grouped and depthwise: ATen's convolution and
// convolution_backward), data-parallel: the batch dim keeps its sharding, channel and spatial
// dims are whole (gathered where sharded), weight and bias are whole.
//
//   convolution            output batch-sharded like the input
//   convolution_backward   grad_input batch-sharded; grad_weight and grad_bias are sums over the
//                          batch, so each rank's are Partial(sum) over the axes sharding the batch
//
// Partial: a convolution is linear in its input but adds the bias once, so a sum/avg Partial
// input is refused (default mode reduces it first); in backward, grad_output is reduced first.
// Not yet: channel sharding of grouped/depthwise convolutions, a halo exchange for a sharded
// spatial dim (both gather today).
#include "ops/families.h"

namespace hypershard::ops {
namespace {

// `l` with every dim but the batch dim whole, Partial dropped (reduced).
LayoutPtr batch_only(const Layout& l, const std::vector<int64_t>& batch_axes) {
  layout::DimAxes dims(static_cast<size_t>(l.ndim()));
  if (!dims.empty()) dims[0] = batch_axes;
  return make_layout(l, l.global_shape(), std::move(dims), {});
}

// convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
OpPlan convolution_rule(const OpCall& call) {
  const Layout& input = call.layout(0);
  refuse_sum_partial(call, 0, "Replicate or Shard (a convolution adds its bias once; redistribute the Partial input first)");
  const std::vector<int64_t> batch = input.ndim() > 0 ? input.dim_axes()[0] : std::vector<int64_t>{};
  OpPlan plan;
  plan.inputs.push_back(batch_only(input, batch));
  for (size_t t = 1; t < call.tensors.size(); ++t)
    plan.inputs.push_back(replicate_like(call.layout(static_cast<int64_t>(t)), call.layout(static_cast<int64_t>(t)).global_shape()));
  const auto shape = meta_output_shapes(call).at(0);
  layout::DimAxes dims(shape.size());
  if (!dims.empty()) dims[0] = batch;
  plan.outputs.push_back(make_layout(input, shape, std::move(dims)));
  return plan;
}

// convolution_backward(grad_output, input, weight, bias_sizes?, ..., output_mask)
//   -> (grad_input, grad_weight, grad_bias)
OpPlan convolution_backward_rule(const OpCall& call) {
  const int64_t go = call.tensor_index(0, -1), in = call.tensor_index(1, -1);
  const Layout& input = call.layout(in);
  const std::vector<int64_t> batch = input.ndim() > 0 ? input.dim_axes()[0] : std::vector<int64_t>{};
  OpPlan plan;
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    const bool batched = static_cast<int64_t>(t) == go || static_cast<int64_t>(t) == in;
    plan.inputs.push_back(batched ? batch_only(l, batch) : replicate_like(l, l.global_shape()));
  }
  layout::PartialOps summed(static_cast<size_t>(input.mesh()->ndim()));
  for (int64_t axis : batch) summed[axis] = ReduceOp::Sum;
  const auto shapes = meta_output_shapes(call);
  for (size_t o = 0; o < shapes.size(); ++o) {
    layout::DimAxes dims(shapes[o].size());
    if (o == 0) {
      if (!dims.empty()) dims[0] = batch;
      plan.outputs.push_back(make_layout(input, shapes[o], std::move(dims)));
    } else {
      plan.outputs.push_back(make_layout(input, shapes[o], std::move(dims), summed));
    }
  }
  return plan;
}

}  // namespace

void register_convolution(Registry& r) {
  r.add("aten::convolution", &convolution_rule, KeyScalars::kAll);
  r.add("aten::convolution_backward", &convolution_backward_rule, KeyScalars::kAll);
}

}  // namespace hypershard::ops
