// Normalizations along trailing dims or one dim: layer norm, group norm, safe softmax.
//
//   aten::native_layer_norm            input "ab..N" (N: the normalized dims), weight/bias "N"
//                                      -> out "ab..N", mean/rstd "ab..1"
//   aten::native_layer_norm_backward   grad_out, input "ab..N", mean/rstd "ab..1", weight/bias "N"
//                                      -> grad_input "ab..N", grad_weight "N", grad_bias "N"
//   aten::native_group_norm(_backward) input "aC..." (batch a only), mean/rstd "ag", weight "C";
//                                      the N argument becomes this rank's batch size
//   aten::_safe_softmax                self with dim D whole -> same layout (the attention math
//                                      path; _softmax and the backward _softmax_backward_data are
//                                      the loss family's, which also handles a sharded dim)
//   hypershard::rms_norm               x "ab..N" (N: weight's dims), weight "N" -> y "ab..N", rstd "ab..1"
//   hypershard::rms_norm_backward      grad, x "ab..N", weight "N", rstd "ab..1" -> dx "ab..N", dweight "N"
//   npu::npu_rms_norm(_backward)       torch_npu's (self, gamma, epsilon) / (dy, self, gamma, rstd):
//                                      the same rules, serving Ascend users when torch_npu is loaded
// RMSNorm written out (x.pow(2).mean(-1, keepdim=True), rsqrt, mul, type_as / to) runs on the
// pointwise and reduction families and gets the same layouts as the fused op when the normalized
// dim is whole (the leading dims keep their sharding, the weight's gradient is a Partial sum).
// With x sharded on the normalized dim the two differ: the fused op gathers it; the composed
// form's variance is a Partial sum that strict mode refuses at rsqrt (default mode reduces it and
// keeps y sharded). F.rms_norm decomposes to the composed ops.
//
// Sharding (factors.h): the leading dims (layer norm), the batch dim (group norm) and every dim
// but `dim` (softmax) keep their sharding; the normalized dims, channels and spatial dims (group
// norm) and the softmax dim must be whole (an input sharded there is gathered first). weight and
// bias are whole. The weight and bias gradients sum over the leading dims: Partial(sum) on the
// axes that shard them.
//
// Partial algebra: the forward ops are not linear in their input: a sum/avg-Partial input (or
// weight/bias) is an error; max/min Partials are reduced first. Every backward op here is linear
// in its incoming gradient (grad_out, grad_output): a sum/avg Partial there carries into every
// gradient (the saved tensors whole on that axis).
//
// Excluded: _fused_rms_norm (not reached on CPU; hypershard::rms_norm is the fused op), batch
// norm (needs global statistics), _softmax/_log_softmax and their backward (the loss family),
// _safe_softmax over a sharded dim (gathered here), group norm with sharded channels.
#include <ATen/ATen.h>

#include "ops/factors.h"
#include "ops/families.h"

namespace hypershard::ops {
namespace {


// A sum/avg-Partial input to a non-linear op is an error (a missing redistribution upstream).
void reject_sum_partial(const OpCall& call, int64_t tensor) {
  if (tensor < 0) return;
  const auto op = call.layout(tensor).partial_op();
  if (op && is_sum_like(*op))
    fail_argument(call, tensor, std::string("Partial(") + layout::reduce_op_name(*op) +
                                    ") input is not supported by this op (it is not linear in it)",
                  "Replicate or Shard (redistribute the Partial input first)");
}

std::string leading_labels(int64_t n) {
  std::string labels;
  for (int64_t d = 0; d < n; ++d) labels += static_cast<char>('a' + d);
  return labels;
}


OpPlan from_factors(const OpCall& call, const FactorSpec& spec) {
  const auto f = plan_factors(call, spec);
  OpPlan plan;
  plan.inputs = inputs_in_call_order(call, spec, f);
  plan.outputs = f.outputs;
  return plan;
}

// ------------------------------------------------------------------ layer norm

constexpr char kNormalized = 'N';

struct LayerNormDims {
  int64_t leading = 0;
  std::string input;  // labels of the input
  std::string stats;  // labels of mean / rstd
  std::string params; // labels of weight / bias
  std::vector<int64_t> normalized;
  std::vector<int64_t> stats_shape;
};

LayerNormDims layer_norm_dims(const OpCall& call, int64_t input) {
  const Layout& in = call.layout(input);
  LayerNormDims d;
  d.normalized = int_list(call.arg(call.arg_index("normalized_shape")));
  const int64_t k = static_cast<int64_t>(d.normalized.size());
  d.leading = in.ndim() - k;
  if (d.leading < 0 || !std::equal(d.normalized.begin(), d.normalized.end(), in.global_shape().begin() + d.leading))
    fail_argument(call, input, "shape " + layout::shape_string(in.global_shape()) + " does not end with normalized_shape " +
                  layout::shape_string(d.normalized), "an input whose trailing dims are normalized_shape");
  d.input = leading_labels(d.leading) + std::string(k, kNormalized);
  d.stats = leading_labels(d.leading) + std::string(k, kWhole);
  d.params = std::string(k, kNormalized);
  d.stats_shape.assign(in.global_shape().begin(), in.global_shape().begin() + d.leading);
  d.stats_shape.resize(in.ndim(), 1);
  return d;
}

void add_param(FactorSpec& spec, const OpCall& call, const char* name, const std::string& labels) {
  const int64_t t = call.tensor_index(call.arg_index(name));
  if (t >= 0) spec.operands.push_back({t, labels, false});
}

OpPlan native_layer_norm_rule(const OpCall& call) {
  const int64_t input = call.tensor_index(0);
  for (size_t t = 0; t < call.tensors.size(); ++t) reject_sum_partial(call, static_cast<int64_t>(t));
  const auto d = layer_norm_dims(call, input);
  FactorSpec spec;
  spec.operands.push_back({input, d.input, false});
  add_param(spec, call, "weight", d.params);
  add_param(spec, call, "bias", d.params);
  spec.outputs = {d.input, d.stats, d.stats};
  spec.out_shapes = {call.layout(input).global_shape(), d.stats_shape, d.stats_shape};
  spec.whole = std::string{kNormalized};
  return from_factors(call, spec);
}

OpPlan native_layer_norm_backward_rule(const OpCall& call) {
  const int64_t grad = call.tensor_index(0), input = call.tensor_index(1);
  const auto d = layer_norm_dims(call, input);
  FactorSpec spec;
  spec.operands.push_back({grad, d.input, true});
  spec.operands.push_back({input, d.input, false});
  spec.operands.push_back({call.tensor_index(call.arg_index("mean")), d.stats, false});
  spec.operands.push_back({call.tensor_index(call.arg_index("rstd")), d.stats, false});
  add_param(spec, call, "weight", d.params);
  add_param(spec, call, "bias", d.params);
  spec.outputs = {d.input, d.params, d.params};
  spec.out_shapes = {call.layout(input).global_shape(), d.normalized, d.normalized};
  spec.whole = std::string{kNormalized};
  return from_factors(call, spec);
}

// ------------------------------------------------------------------ rms norm (fused)

// The normalized dims are the weight's: x "ab..N", weight "N", rstd "ab..1" (x's shape, N dims 1).
LayerNormDims rms_norm_dims(const OpCall& call, int64_t input, int64_t weight) {
  const Layout& in = call.layout(input);
  LayerNormDims d;
  d.normalized = call.layout(weight).global_shape();
  const int64_t k = static_cast<int64_t>(d.normalized.size());
  d.leading = in.ndim() - k;
  if (k < 1 || d.leading < 0 ||
      !std::equal(d.normalized.begin(), d.normalized.end(), in.global_shape().begin() + d.leading))
    fail_argument(call, weight, "shape " + layout::shape_string(d.normalized) + " is not the end of x's shape " +
                                    layout::shape_string(in.global_shape()),
                  "a weight of rank >= 1 shaped like x's trailing dims");
  d.input = leading_labels(d.leading) + std::string(k, kNormalized);
  d.stats = leading_labels(d.leading) + std::string(k, kWhole);
  d.params = std::string(k, kNormalized);
  d.stats_shape = in.global_shape();
  std::fill(d.stats_shape.begin() + d.leading, d.stats_shape.end(), 1);
  return d;
}

OpPlan rms_norm_rule(const OpCall& call) {
  const int64_t input = call.tensor_named({"x", "self", "input"}), weight = call.tensor_named({"weight", "gamma"});
  for (size_t t = 0; t < call.tensors.size(); ++t) reject_sum_partial(call, static_cast<int64_t>(t));
  const auto d = rms_norm_dims(call, input, weight);
  FactorSpec spec;
  spec.operands = {{input, d.input, false}, {weight, d.params, false}};
  spec.outputs = {d.input, d.stats};
  spec.out_shapes = {call.layout(input).global_shape(), d.stats_shape};
  spec.whole = std::string{kNormalized};
  return from_factors(call, spec);
}

OpPlan rms_norm_backward_rule(const OpCall& call) {
  const int64_t grad = call.tensor_named({"grad", "dy"}), input = call.tensor_named({"x", "self", "input"});
  const int64_t weight = call.tensor_named({"weight", "gamma"}), rstd = call.tensor_named({"rstd"});
  const auto d = rms_norm_dims(call, input, weight);
  const auto& shape = call.layout(input).global_shape();
  if (call.layout(grad).global_shape() != shape)
    fail_argument(call, grad, "shape differs from x " + layout::shape_string(shape), "grad shaped like x");
  if (call.layout(rstd).global_shape() != d.stats_shape)
    fail_argument(call, rstd, "shape is not " + layout::shape_string(d.stats_shape),
                  "rstd shaped like x with the normalized dims 1");
  FactorSpec spec;
  spec.operands = {{grad, d.input, true}, {input, d.input, false}, {weight, d.params, false}, {rstd, d.stats, false}};
  spec.outputs = {d.input, d.params};
  spec.out_shapes = {call.layout(input).global_shape(), d.normalized};
  spec.whole = std::string{kNormalized};
  return from_factors(call, spec);
}

// ------------------------------------------------------------------ group norm (batch only)

// input (N, C, *): the batch dim may be sharded; channels and spatial dims are whole.
std::string group_norm_input_labels(int64_t ndim) {
  std::string labels = "a";
  if (ndim > 1) labels += std::string(ndim - 1, 'C');
  return labels;
}

// Rewrites the N argument to this rank's batch size (of the input's required layout).
LocalizeFn localize_batch(LayoutPtr input) {
  return [input](const OpCall& call, c10::IValue* args) {
    args[call.arg_index("N")] = c10::IValue(input->local_shape_at(call.mesh->position())[0]);
  };
}

OpPlan native_group_norm_rule(const OpCall& call) {
  const int64_t input = call.tensor_index(0);
  for (size_t t = 0; t < call.tensors.size(); ++t) reject_sum_partial(call, static_cast<int64_t>(t));
  const Layout& in = call.layout(input);
  const int64_t groups = call.arg(call.arg_index("group")).toInt();
  FactorSpec spec;
  spec.operands.push_back({input, group_norm_input_labels(in.ndim()), false});
  add_param(spec, call, "weight", "C");
  add_param(spec, call, "bias", "C");
  spec.outputs = {spec.operands[0].labels, "ag", "ag"};
  spec.out_shapes = {in.global_shape(), {in.global_shape()[0], groups}, {in.global_shape()[0], groups}};
  spec.whole = "Cg";
  auto plan = from_factors(call, spec);
  plan.localize = localize_batch(plan.inputs[input]);
  return plan;
}

OpPlan native_group_norm_backward_rule(const OpCall& call) {
  const int64_t grad = call.tensor_index(0), input = call.tensor_index(1);
  const Layout& in = call.layout(input);
  const auto labels = group_norm_input_labels(in.ndim());
  FactorSpec spec;
  spec.operands.push_back({grad, labels, true});
  spec.operands.push_back({input, labels, false});
  spec.operands.push_back({call.tensor_index(call.arg_index("mean")), "ag", false});
  spec.operands.push_back({call.tensor_index(call.arg_index("rstd")), "ag", false});
  add_param(spec, call, "weight", "C");
  const int64_t channels = in.ndim() > 1 ? in.global_shape()[1] : 0;
  spec.outputs = {labels, "C", "C"};
  spec.out_shapes = {in.global_shape(), {channels}, {channels}};
  spec.whole = "Cg";
  auto plan = from_factors(call, spec);
  plan.localize = localize_batch(plan.inputs[input]);
  return plan;
}

// ------------------------------------------------------------------ softmax

constexpr char kSoftmaxDim = 'D';

std::string softmax_labels(const OpCall& call, int64_t tensor) {
  const int64_t ndim = call.layout(tensor).ndim();
  std::string labels = leading_labels(ndim);
  if (ndim == 0) return labels;
  int64_t dim = call.arg(call.arg_index("dim")).toInt();
  if (dim < -ndim || dim >= ndim)
    fail_call(call, layout::str_cat("dim ", dim, " is out of range for a ", ndim, "-d tensor"));
  labels[dim < 0 ? dim + ndim : dim] = kSoftmaxDim;
  return labels;
}

OpPlan softmax_rule(const OpCall& call) {
  reject_sum_partial(call, 0);
  const auto labels = softmax_labels(call, 0);
  FactorSpec spec;
  spec.operands = {{0, labels, false}};
  spec.outputs = {labels};
  spec.out_shapes = {call.layout(0).global_shape()};
  spec.whole = std::string{kSoftmaxDim};
  return from_factors(call, spec);
}

}  // namespace

void register_normalization(Registry& r) {
  // normalized_shape, dim, N/C/HxW/group decide dims and shapes; eps and dtypes do not (the rms
  // norms take their dims from the weight's shape, a part of the key already).
  r.add("aten::_safe_softmax", &softmax_rule, KeyScalars::kAll);
  r.add("aten::native_group_norm", &native_group_norm_rule, KeyScalars::kAll);
  r.add("aten::native_group_norm_backward", &native_group_norm_backward_rule, KeyScalars::kAll);
  r.add("aten::native_layer_norm", &native_layer_norm_rule, KeyScalars::kAll);
  r.add("aten::native_layer_norm_backward", &native_layer_norm_backward_rule, KeyScalars::kAll);
  r.add("hypershard::rms_norm", &rms_norm_rule, KeyScalars::kNone);
  r.add("hypershard::rms_norm_backward", &rms_norm_backward_rule, KeyScalars::kAll);
  r.add("npu::npu_rms_norm", &rms_norm_rule, KeyScalars::kNone);
  r.add("npu::npu_rms_norm_backward", &rms_norm_backward_rule, KeyScalars::kNone);
}

}  // namespace hypershard::ops
