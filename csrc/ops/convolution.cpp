// Convolutions (conv1d/2d/3d, transposed, grouped and depthwise: ATen's convolution and
// convolution_backward): the batch dim keeps its sharding; a spatial dim sharded over one mesh
// axis stays sharded through a halo exchange; a grouped (depthwise) convolution's channels stay
// sharded when the shards hold whole groups; other channel shardings, the other spatial dims,
// weight and bias are whole (gathered where sharded).
//
// Groups: with input channels sharded over axes of `parts` ranks in all and `groups` a multiple
// of `parts`, rank r's channel chunk is exactly groups [r*G/parts, (r+1)*G/parts): its output
// channels and weight/bias rows are the same chunk of theirs (dim 0 split alike), and the local
// call runs with groups/parts groups -- each output channel reads only its own group's inputs,
// so no rank needs another's channels. grad_weight/grad_bias stay split like weight/bias.
//
//   convolution            output batch-sharded like the input, and sharded along the halo dim
//                          (the torch.chunk split of the OUTPUT's length)
//   convolution_backward   grad_input laid out like the input; grad_weight and grad_bias are sums
//                          over the batch and the output positions, so each rank's are
//                          Partial(sum) over the axes sharding the batch and the halo dim
//
// Halo exchange (a spatial dim sharded over one axis, not transposed): output position o reads
// padded input positions [o*stride, o*stride + dilation*(kernel-1)]. Each rank fetches, in one
// all-to-all (runtime/span_exchange.h), the GLOBAL input range its output chunk reads -- its own
// block plus (kernel-1)*dilation neighbouring positions for a stride-1 convolution -- adds the
// zero padding only where that range passes the tensor's ends, and convolves with no padding
// along that dim: exactly the single-device sums, element by element. Backward convolves the same
// fetched range and sends each input position's gradient back to its owner, which adds the
// contributions (return_spans_summed). A rank whose output chunk is empty still takes part in
// both exchanges. Qwen3.5's causal depthwise conv1d on a sequence-sharded activation takes this
// path. A transposed convolution, or a dim sharded over two axes, makes the dim whole.
//
// Partial: a convolution is linear in its input but adds the bias once, so a sum/avg Partial
// input is refused (default mode reduces it first); in backward, grad_output is reduced first.
// Not yet: channel sharding of dense (groups = 1) convolutions, which would leave a Partial sum
// over input channels (channels are gathered).
#include <ATen/ATen.h>

#include <optional>

#include "ops/families.h"
#include "ops/partial.h"
#include "runtime/span_exchange.h"

namespace hypershard::ops {
namespace {

using runtime::Span;
using runtime::SpanPlan;

// How a convolution's operands are split: the mesh axes of the batch, the halo dim and its axis
// (if any), and the axes splitting the groups -- a grouped (depthwise) convolution whose input
// channels are sharded over axes whose sizes multiply to a divisor of `groups` runs each rank's
// groups locally: input and output channels, and the weight's and bias's out-channels (dim 0),
// split alike (torch.chunk of a multiple of the parts cuts at group boundaries).
struct ConvSplit {
  std::vector<int64_t> batch;
  std::optional<int64_t> halo;
  int64_t halo_axis = -1;
  std::vector<int64_t> group_axes;
  int64_t group_parts = 1;
};

// The layout of an activation (input, output and their gradients) under `s`, Partial dropped.
LayoutPtr activation_layout(const Layout& l, std::vector<int64_t> shape, const ConvSplit& s) {
  layout::DimAxes dims(shape.size());
  if (!dims.empty()) dims[0] = s.batch;
  if (dims.size() > 1) dims[1] = s.group_axes;
  // (an undefined gradient, output_mask false, reports a 0-d shape)
  if (s.halo && *s.halo < static_cast<int64_t>(dims.size())) dims[*s.halo] = {s.halo_axis};
  return make_layout(l, std::move(shape), std::move(dims), {});
}

// The layout of a weight or bias (or their gradients) under `s`: out-channels split with the groups.
LayoutPtr parameter_layout(const Layout& l, std::vector<int64_t> shape, const ConvSplit& s,
                           layout::PartialOps partial = {}) {
  layout::DimAxes dims(shape.size());
  if (!dims.empty()) dims[0] = s.group_axes;
  return make_layout(l, std::move(shape), std::move(dims), std::move(partial));
}

// The spatial dim a halo exchange serves: the first spatial dim (>= 2) of the input sharded over
// exactly one mesh axis, for a convolution that is not transposed.
std::optional<int64_t> halo_dim(const Layout& input, bool transposed) {
  if (transposed) return std::nullopt;
  for (int64_t d = 2; d < input.ndim(); ++d)
    if (input.dim_axes()[d].size() == 1 && dim_parts(input, d) > 1) return d;
  return std::nullopt;
}

ConvSplit conv_split(const Layout& input, bool transposed, int64_t groups) {
  ConvSplit s;
  if (input.ndim() > 0) s.batch = input.dim_axes()[0];
  s.halo = halo_dim(input, transposed);
  if (s.halo) s.halo_axis = input.dim_axes()[*s.halo].front();
  if (!transposed && groups > 1 && input.ndim() > 1 && !input.dim_axes()[1].empty()) {
    int64_t parts = 1;
    for (int64_t axis : input.dim_axes()[1]) parts *= input.mesh()->shape()[axis];
    if (groups % parts == 0) {
      s.group_axes = input.dim_axes()[1];
      s.group_parts = parts;
    }
  }
  return s;
}

// Item i of an int list argument that may hold one value for every spatial dim.
int64_t list_item(const c10::IValue& list, size_t i) {
  const auto v = int_list(list);
  return v.size() == 1 ? v[0] : v.at(i);
}

// What each member of the halo axis reads: the GLOBAL input span its output chunk needs (clipped
// to the tensor), and how many zero positions of the padding go before and after it. Made with the
// plan: it depends on the layouts and the scalar arguments only (both in the plan's key).
struct HaloPlan {
  SpanPlan spans;
  int64_t zeros_before = 0, zeros_after = 0;  // this rank's
  int64_t output_length = 0;                  // this rank's output chunk
  int64_t input_length = 0;                   // this rank's input block
  c10::IValue padding;                        // the padding argument with the halo dim's entry 0
};

// `first_list`: the index of the stride argument (padding and dilation follow it): 3 in
// convolution, 4 in convolution_backward; `weight`: the weight's index in call.tensors.
HaloPlan plan_halo(const OpCall& call, const Layout& input, const Layout& output, int64_t dim, int64_t first_list,
                   int64_t weight) {
  const runtime::DeviceMesh& mesh = *call.mesh;
  const int64_t axis = input.dim_axes()[dim].front(), n = input.global_shape()[dim];
  const int64_t kernel = call.layout(weight).global_shape()[dim];
  const size_t spatial = static_cast<size_t>(dim - 2), spatial_dims = static_cast<size_t>(input.ndim() - 2);
  const c10::IValue* args = call.args;
  const int64_t stride = list_item(args[first_list], spatial), pad = list_item(args[first_list + 1], spatial),
                dilation = list_item(args[first_list + 2], spatial);
  HaloPlan h;
  std::vector<int64_t> padding;  // the fetched range carries the halo dim's padding
  for (size_t i = 0; i < spatial_dims; ++i) padding.push_back(i == spatial ? 0 : list_item(args[first_list + 1], i));
  h.padding = c10::IValue(padding);
  h.spans.dim = dim;
  h.spans.axis = axis;
  const int64_t me = mesh.coordinate(axis);
  for (int64_t m = 0; m < mesh.mesh()->shape()[axis]; ++m) {
    const Span in = runtime::member_span(input, mesh, axis, m, dim);
    const Span out = runtime::member_span(output, mesh, axis, m, dim);
    const int64_t in_length = in.length(), out_begin = out.begin, out_length = out.length();
    h.spans.owned.push_back(in);
    if (out_length == 0) {
      h.spans.wanted.push_back({});
      if (m == me) h.input_length = in_length;
      continue;
    }
    // padded positions [out_begin*stride, (out_end-1)*stride + dilation*(kernel-1)], unpadded
    const int64_t lo = out_begin * stride - pad;
    const int64_t hi = (out_begin + out_length - 1) * stride + dilation * (kernel - 1) + 1 - pad;
    const Span read{std::max<int64_t>(lo, 0), std::min(hi, n)};
    h.spans.wanted.push_back({read});
    if (m == me) {
      h.zeros_before = std::min(std::max<int64_t>(-lo, 0), hi - lo);
      h.zeros_after = hi - lo - h.zeros_before - read.length();
      h.output_length = out_length;
      h.input_length = in_length;
    }
  }
  return h;
}

// convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
OpPlan convolution_rule(const OpCall& call) {
  const Layout& input = call.layout(0);
  refuse_sum_partial(call, 0, redistribute_partial_first("a convolution adds its bias once"));
  const ConvSplit split = conv_split(input, call.arg(6).toBool(), int_arg(call.arg(8)));
  const auto halo = split.halo;
  OpPlan plan;
  plan.inputs.push_back(activation_layout(input, input.global_shape(), split));
  for (size_t t = 1; t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    plan.inputs.push_back(parameter_layout(l, l.global_shape(), split));
  }
  plan.outputs.push_back(activation_layout(input, meta_output_shapes(call).at(0), split));
  if (split.group_parts > 1) {
    const int64_t parts = split.group_parts;
    plan.localize = [parts](const OpCall&, c10::IValue* args) { args[8] = c10::IValue(int_arg(args[8]) / parts); };
  }
  if (!halo) return plan;
  const LayoutPtr out_layout = plan.outputs[0];
  const HaloPlan h = plan_halo(call, *plan.inputs[0], *out_layout, *halo, 3, call.tensor_index(1));
  plan.expand = [h, out_layout](const OpCall& c, torch::jit::Stack& stack) {
    const size_t num = c.schema().arguments().size();
    c10::IValue* args = stack.data() + (stack.size() - num);
    const at::Tensor local = args[0].toTensor();
    const at::Tensor padded = runtime::fetch_spans(local, h.spans, *c.mesh, h.zeros_before, h.zeros_after);
    if (h.output_length == 0) {  // an empty output chunk: nothing to convolve
      auto shape = out_layout->local_shape_at(c.mesh->position());
      torch::jit::drop(stack, num);
      stack.emplace_back(at::zeros(shape, local.options()));
      return;
    }
    args[0] = padded;
    args[4] = h.padding;
    c.op->callBoxed(stack);
  };
  return plan;
}

// convolution_backward(grad_output, input, weight, bias_sizes?, stride, padding, dilation,
// transposed, output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)
OpPlan convolution_backward_rule(const OpCall& call) {
  const int64_t go = call.tensor_index(0, -1), in = call.tensor_index(1, -1);
  const Layout& input = call.layout(in);
  const ConvSplit split = conv_split(input, call.arg(7).toBool(), int_arg(call.arg(9)));
  const auto halo = split.halo;
  OpPlan plan;
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    const bool activation = static_cast<int64_t>(t) == go || static_cast<int64_t>(t) == in;
    plan.inputs.push_back(activation ? activation_layout(l, l.global_shape(), split)
                                     : parameter_layout(l, l.global_shape(), split));
  }
  // grad_weight and grad_bias sum over the batch and the output positions
  layout::PartialOps summed(static_cast<size_t>(input.mesh()->ndim()));
  for (int64_t axis : split.batch) summed[axis] = ReduceOp::Sum;
  if (halo) summed[split.halo_axis] = ReduceOp::Sum;
  const auto shapes = meta_output_shapes(call);
  for (size_t o = 0; o < shapes.size(); ++o)
    plan.outputs.push_back(o == 0 ? activation_layout(input, shapes[o], split)
                                  : parameter_layout(input, shapes[o], split, summed));
  if (split.group_parts > 1) {
    const int64_t parts = split.group_parts;
    plan.localize = [parts](const OpCall&, c10::IValue* args) {
      args[9] = c10::IValue(int_arg(args[9]) / parts);
      if (!args[3].isNone()) {  // bias_sizes: this rank's out-channels
        std::vector<int64_t> sizes{list_item(args[3], 0) / parts};
        args[3] = c10::IValue(sizes);
      }
    };
  }
  if (!halo || go < 0 || in < 0) return plan;
  const int64_t dim = *halo;
  const HaloPlan h = plan_halo(call, *plan.inputs[in], *plan.inputs[go], dim, 4, call.tensor_index(2));
  plan.expand = [h, dim](const OpCall& c, torch::jit::Stack& stack) {
    const size_t num = c.schema().arguments().size();
    c10::IValue* args = stack.data() + (stack.size() - num);
    const at::Tensor local = args[1].toTensor(), weight = args[2].toTensor();
    const auto mask = args[10].toBoolList();
    const at::Tensor padded = runtime::fetch_spans(local, h.spans, *c.mesh, h.zeros_before, h.zeros_after);
    at::Tensor grad_input, grad_weight, grad_bias;
    if (h.output_length == 0) {  // no output positions here: zero contributions
      if (mask[1]) grad_weight = at::zeros_like(weight);
      if (mask[2]) grad_bias = at::zeros({weight.size(0)}, weight.options());
      if (mask[0]) grad_input = at::zeros_like(padded);
      torch::jit::drop(stack, num);
    } else {
      args[1] = padded;
      args[5] = h.padding;
      c.op->callBoxed(stack);
      grad_bias = stack.back().toTensor();
      stack.pop_back();
      grad_weight = stack.back().toTensor();
      stack.pop_back();
      grad_input = stack.back().toTensor();
      stack.pop_back();
      if (mask[0])
        grad_input = grad_input.narrow(dim, h.zeros_before, padded.size(dim) - h.zeros_before - h.zeros_after);
    }
    // each fetched position's gradient goes back to its owner, which adds them up
    if (mask[0]) grad_input = runtime::return_spans_summed(grad_input, h.input_length, h.spans, *c.mesh);
    stack.emplace_back(grad_input);
    stack.emplace_back(grad_weight);
    stack.emplace_back(grad_bias);
  };
  return plan;
}

}  // namespace

void register_convolution(Registry& r) {
  r.add("aten::convolution", &convolution_rule, KeyScalars::kAll);
  r.add("aten::convolution_backward", &convolution_backward_rule, KeyScalars::kAll);
}

}  // namespace hypershard::ops
