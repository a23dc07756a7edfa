// Normalizations along trailing dims or one dim: layer norm, group norm, safe softmax; batch
// norm (statistics over every dim but the channels).
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
//   aten::_fused_rms_norm(_backward)   torch's (input, normalized_shape, weight?, eps) / (grad_out,
//                                      input, normalized_shape, rstd, weight?, output_mask): the same
//                                      rules, the normalized dims from normalized_shape. F.rms_norm
//                                      calls it on CUDA/XPU/MPS; on a DTensor its
//                                      CompositeImplicitAutograd kernel wins at AutogradPrivateUse2
//                                      (PrivateUse2 has no kernel of its own for it), so eager code
//                                      gets the composed ops below on every device: the rule serves
//                                      calls below autograd
// RMSNorm written out (x.pow(2).mean(-1, keepdim=True), rsqrt, mul, type_as / to) runs on the
// pointwise and reduction families and gets the same layouts as the fused op when the normalized
// dim is whole (the leading dims keep their sharding, the weight's gradient is a Partial sum).
// With x sharded on the normalized dim the two differ: the fused op gathers it; the composed
// form's variance is a Partial sum that strict mode refuses at rsqrt (default mode reduces it and
// keeps y sharded). F.rms_norm decomposes to the composed ops.
//
//   aten::native_batch_norm            input [N, C, *] any sharding; weight, bias, running_mean,
//   aten::_native_batch_norm_legit     running_var [C] sharded like the input's channel dim
//     (.no_stats, _no_training)        -> out like input, save_mean/save_invstd [C] like weight
//   aten::_batch_norm_with_update      (training) or [0] (inference); _with_update / _no_update
//   aten::_batch_norm_no_update        also return an empty reserve (Replicate)
//   aten::native_batch_norm_backward   grad_out, input alike, the [C] tensors like the channel dim
//   aten::batch_norm_backward          -> grad_input like input, grad_weight/grad_bias [C]
//   aten::cudnn_batch_norm(_backward)  F.batch_norm on CUDA (cuDNN) and ROCm (MIOpen): the same
//   aten::miopen_batch_norm(_backward) rules; cuDNN's reserve is the local call's workspace
//                                      (Replicate, the rank's own shape); the backward is the
//                                      expand's formula on the block, which needs no reserve
//
// Batch norm (F.batch_norm, BatchNorm1d/2d/3d, and instance_norm after its [1, N*C, *] view:
// that view keeps whole shards only for N sharded in equal blocks; with channels sharded or an
// uneven N the views family refuses it in strict mode). The input keeps its sharding on every dim; the [C] tensors
// follow its channel axes (a channel- sharded input: purely local, the ATen call on the block). Inference
// (training=False, running stats given) is pointwise per channel: local for any sharding. Training with N or spatial
// dims sharded needs the GLOBAL statistics: the expand all-gathers each rank's (count, mean,
// M2) per channel (Welford on its block, an empty block contributes zeros) in float64 over the
// axes sharding those dims, and every rank combines them in the same order (mean = sum n_i m_i
// / n, M2 = sum M2_i + sum n_i (m_i - mean)^2: no cancellation of sum x^2 - n mean^2), so
// save_mean/save_invstd are the same bits on every rank (Replicate on those axes). The output
// is the block normalised with them by torch's inference kernel; the result matches one device
// to float rounding of the statistics (a few ulp of the opmath type: each block's Welford pass
// is as accurate as one device's, the combination adds O(P) float64 roundings). running_mean/
// running_var are updated in place with the GLOBAL batch mean and unbiased variance (M2 / (n -
// 1), n the GLOBAL count), identically on every rank: they keep their own layout (the input's
// channel dim follows theirs; whole running stats with a channel-sharded input get the batch
// stats made whole first), and a Partial running stat is an error when training writes it.
// The backward (train=True) all-reduces sum(grad_out) and sum(grad_out * (x - mean)) per
// channel (float64) over the same axes, then runs torch's formula on the block; grad_weight
// and grad_bias come out whole there. In inference the backward is local (torch's kernel, or
// the same formula where a rank's block is empty: the kernel divides by the block's size) and
// grad_weight/grad_bias are Partial(sum) over the axes sharding N and spatial dims. A rank's empty block
// (5 rows over 4 ranks) takes part in every collective; errors (shapes, dtypes, inference
// without running stats, an empty input when training) are decided from the layouts, on every
// rank before any collective.
//
// Sharding (sharding_search.h): the leading dims (layer norm), the batch dim (group norm) and every
// dim but `dim` (softmax) keep their sharding; the normalized dims, channels and spatial dims
// (group norm) and the softmax dim must be whole (an input sharded there is gathered first). weight
// and bias are whole. The weight and bias gradients sum over the leading dims: Partial(sum) on the
// axes that shard them.
//
// Partial algebra: the forward ops are not linear in their input: a sum/avg-Partial input (or
// weight/bias, or a batch norm's running stats) is an error in forward code (reduced inside a
// backward pass); max/min Partials are reduced first. Every backward op here is linear
// in its incoming gradient (grad_out, grad_output): a sum/avg Partial there carries into every
// gradient (the saved tensors whole on that axis).
//
// Excluded: batch norm's out= and _functional variants and the CUDA sync-BN ops (batch_norm_stats, ...; not
// reached by F.batch_norm on a DTensor), _softmax/_log_softmax and their backward (the loss
// family), _safe_softmax over a sharded dim (gathered here), group norm with sharded channels.
#include <ATen/ATen.h>

#include <algorithm>
#include <optional>

#include "kernels/kernels.h"
#include "ops/families.h"
#include "ops/partial.h"
#include "ops/sharding_search.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {
namespace {

// A sum/avg-Partial input to a non-linear op is an error (a missing redistribution upstream).
void reject_sum_partial(const OpCall& call, int64_t tensor) {
  if (tensor < 0) return;
  const auto op = call.layout(tensor).partial_op();
  if (op && is_sum_like(*op))
    fail_argument(call, tensor, partial_name(*op) + " input is not supported by this op (it is not linear in it)",
                  redistribute_partial_first());
}

std::string leading_labels(int64_t n) {
  std::string labels;
  for (int64_t d = 0; d < n; ++d) labels += static_cast<char>('a' + d);
  return labels;
}

// ------------------------------------------------------------------ layer norm

constexpr char kNormalized = 'N';

struct LayerNormDims {
  int64_t leading = 0;
  std::string input;   // labels of the input
  std::string stats;   // labels of mean / rstd
  std::string params;  // labels of weight / bias
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
    fail_argument(call, input,
                  "shape " + layout::shape_string(in.global_shape()) + " does not end with normalized_shape " +
                      layout::shape_string(d.normalized),
                  "an input whose trailing dims are normalized_shape");
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
  return plan_from_factors(call, spec);
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
  return plan_from_factors(call, spec);
}

// ------------------------------------------------------------------ rms norm (fused)

// The normalized dims are normalized_shape (torch's _fused_rms_norm, whose weight is optional) or
// the weight's: x "ab..N", weight "N", rstd "ab..1" (x's shape, N dims 1).
LayerNormDims rms_norm_dims(const OpCall& call, int64_t input, int64_t weight) {
  if (call.schema().argumentIndexWithName("normalized_shape")) {
    auto d = layer_norm_dims(call, input);
    if (weight >= 0 && call.layout(weight).global_shape() != d.normalized)
      fail_argument(call, weight,
                    "shape " + layout::shape_string(call.layout(weight).global_shape()) + " is not normalized_shape " +
                        layout::shape_string(d.normalized),
                    "a weight shaped like normalized_shape");
    return d;
  }
  const Layout& in = call.layout(input);
  LayerNormDims d;
  d.normalized = call.layout(weight).global_shape();
  const int64_t k = static_cast<int64_t>(d.normalized.size());
  d.leading = in.ndim() - k;
  if (k < 1 || d.leading < 0 ||
      !std::equal(d.normalized.begin(), d.normalized.end(), in.global_shape().begin() + d.leading))
    fail_argument(call, weight,
                  "shape " + layout::shape_string(d.normalized) + " is not the end of x's shape " +
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
  spec.operands = {{input, d.input, false}};
  if (weight >= 0) spec.operands.push_back({weight, d.params, false});
  spec.outputs = {d.input, d.stats};
  spec.out_shapes = {call.layout(input).global_shape(), d.stats_shape};
  spec.whole = std::string{kNormalized};
  return plan_from_factors(call, spec);
}

OpPlan rms_norm_backward_rule(const OpCall& call) {
  const int64_t grad = call.tensor_named({"grad", "dy", "grad_out"}), input = call.tensor_named({"x", "self", "input"});
  const int64_t weight = call.tensor_named({"weight", "gamma"}), rstd = call.tensor_named({"rstd"});
  const auto d = rms_norm_dims(call, input, weight);
  const auto& shape = call.layout(input).global_shape();
  if (call.layout(grad).global_shape() != shape)
    fail_argument(call, grad, "shape differs from x " + layout::shape_string(shape), "grad shaped like x");
  if (call.layout(rstd).global_shape() != d.stats_shape)
    fail_argument(call, rstd, "shape is not " + layout::shape_string(d.stats_shape),
                  "rstd shaped like x with the normalized dims 1");
  FactorSpec spec;
  spec.operands = {{grad, d.input, true}, {input, d.input, false}, {rstd, d.stats, false}};
  if (weight >= 0) spec.operands.push_back({weight, d.params, false});
  spec.outputs = {d.input, d.params};
  spec.out_shapes = {call.layout(input).global_shape(), d.normalized};
  spec.whole = std::string{kNormalized};
  return plan_from_factors(call, spec);
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
  auto plan = plan_from_factors(call, spec);
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
  auto plan = plan_from_factors(call, spec);
  plan.localize = localize_batch(plan.inputs[input]);
  return plan;
}

// ------------------------------------------------------------------ batch norm

// input [N, C, *spatial]; weight, bias, running stats, save_mean/save_invstd [C] (dim 1).
constexpr int64_t kChannelDim = 1;

enum class BatchNormMode : int8_t { kArg, kTrain, kEval };  // training: the argument, or fixed by the op

// What a batch-norm expand needs beyond the call's arguments.
struct BatchNormExpand {
  std::vector<int64_t> stat_axes;  // the axes (of size > 1) sharding N or spatial dims
  double count = 0;                // GLOBAL elements per channel: numel / C
  // Running stats whole on the channel axes while the input is sharded there: the batch stats
  // are made whole (`channel` -> `whole`, both [2, C]) before the update.
  LayoutPtr channel, whole;
};

// The [C] layout sharded like the input's channel dim (`axes`).
LayoutPtr channel_layout(const Layout& like, int64_t channels, const std::vector<int64_t>& axes) {
  return make_layout(like, {channels}, {axes});
}

void check_batch_norm_input(const OpCall& call, int64_t input) {
  const Layout& in = call.layout(input);
  if (in.ndim() < 2)
    fail_argument(call, input, layout::str_cat("has ", in.ndim(), " dims"), "an input (N, C, *) of 2 or more dims");
}

void check_channel_param(const OpCall& call, int64_t t, int64_t channels) {
  if (t < 0) return;
  const auto& shape = call.layout(t).global_shape();
  if (shape != std::vector<int64_t>{channels})
    fail_argument(call, t, "shape " + layout::shape_string(shape) + " is not the input's channel count",
                  layout::str_cat("a 1-d tensor of ", channels, " elements"));
}

// The axes of size > 1 sharding some dim of `dims` but the channel dim.
std::vector<int64_t> statistic_axes(const Layout& like, const layout::DimAxes& dims) {
  std::vector<int64_t> axes;
  for (size_t d = 0; d < dims.size(); ++d)
    if (static_cast<int64_t>(d) != kChannelDim)
      for (int64_t a : dims[d])
        if (like.mesh()->axis_size(a) > 1) axes.push_back(a);
  std::sort(axes.begin(), axes.end());
  return axes;
}

int64_t global_numel(const Layout& l) {
  int64_t n = 1;
  for (int64_t s : l.global_shape()) n *= s;
  return n;
}

// Does some rank hold a block with no elements (torch's kernels divide by the block's size)?
// Also true for a globally empty tensor, unlike registry.cpp's test for skip_empty_blocks.
bool some_rank_holds_no_elements(const Layout& l) {
  const int64_t ranks = l.mesh()->size();
  for (int64_t p = 0; p < ranks; ++p) {
    const auto shape = l.local_shape_at(p);
    if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return true;
  }
  return false;
}

// torch's CPU kernels take the parameters in the input's dtype, or float with a bf16/half input.
void check_batch_norm_dtypes(const OpCall& call, int64_t input, std::initializer_list<int64_t> params) {
  const auto x = call.tensors[input].dtype;
  const bool reduced = x == at::kHalf || x == at::kBFloat16;
  std::optional<c10::ScalarType> first;
  for (int64_t t : params) {
    if (t < 0) continue;
    const auto p = call.tensors[t].dtype;
    if (!first) first = p;
    if (p != *first || (p != x && !(reduced && p == at::kFloat)))
      fail_argument(call, t, std::string("dtype ") + c10::toString(p) + " with a " + c10::toString(x) + " input",
                    "parameters in the input's dtype (float with a bfloat16/half input), all alike");
  }
}

at::Tensor optional_tensor(const OpCall& call, int64_t arg) {
  if (arg < 0) return {};
  const auto& v = call.arg(arg);
  return v.isNone() ? at::Tensor() : v.toTensor();
}

int64_t arg_named(const OpCall& call, const char* name) {
  const auto& args = call.schema().arguments();
  for (size_t a = 0; a < args.size(); ++a)
    if (args[a].name() == name) return static_cast<int64_t>(a);
  return -1;
}

std::vector<int64_t> reduced_dims(int64_t ndim) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < ndim; ++d) dims.push_back(d);
  return dims;
}

std::vector<int64_t> channel_view(int64_t ndim, int64_t channels) {
  std::vector<int64_t> shape(ndim, 1);
  shape[kChannelDim] = channels;
  return shape;
}

at::ScalarType opmath_dtype(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// Training forward with GLOBAL statistics. Each rank's (count, mean, M2) per channel (Welford on
// its block; zeros for an empty block) is all-gathered over the statistic axes in float64 and
// combined in the same order on every rank: mean = sum(n_i m_i) / n, M2 = sum(M2_i) +
// sum(n_i (m_i - mean)^2), so every rank holds the same bits. The output is the local block
// normalised with those (torch's inference kernel: (x - mean) / sqrt(var + eps) * w + b).
void batch_norm_expand(const BatchNormExpand& e, const OpCall& call, torch::jit::Stack& stack) {
  const at::Tensor x = call.arg(0).toTensor();
  const at::Tensor weight = optional_tensor(call, 1), bias = optional_tensor(call, 2);
  const at::Tensor running_mean = optional_tensor(call, arg_named(call, "running_mean"));
  const at::Tensor running_var = optional_tensor(call, arg_named(call, "running_var"));
  // cudnn_batch_norm / miopen_batch_norm name them exponential_average_factor and epsilon
  const int64_t momentum_arg = arg_named(call, "momentum"), eps_arg = arg_named(call, "eps");
  const double momentum =
      call.arg(momentum_arg >= 0 ? momentum_arg : call.arg_index("exponential_average_factor")).toDouble();
  const double eps = call.arg(eps_arg >= 0 ? eps_arg : call.arg_index("epsilon")).toDouble();
  const int64_t channels = x.size(kChannelDim);
  const auto dims = reduced_dims(x.dim());
  const auto wide = x.options().dtype(at::kDouble);
  const int64_t local_count = channels > 0 ? x.numel() / channels : 0;
  at::Tensor local = at::zeros({1, 3, channels}, wide);
  if (local_count > 0) {
    auto [var, mean] = at::var_mean(x.to(opmath_dtype(x)), dims, /*unbiased=*/false, /*keepdim=*/false);
    local[0][0].fill_(static_cast<double>(local_count));
    local[0][1].copy_(mean);
    local[0][2].copy_(var * static_cast<double>(local_count));
  }
  const auto all = runtime::all_gather_in_chunk_order(local, *call.mesh, e.stat_axes, 0);
  const auto counts = all.select(1, 0), means = all.select(1, 1);
  const auto n = counts.sum(0);
  const auto mean = (counts * means).sum(0) / n;
  const auto m2 = all.select(1, 2).sum(0) + (counts * (means - mean).square()).sum(0);
  const auto var = m2 / n;
  auto invstd = (var + eps).rsqrt();
  if (eps == 0) invstd = at::where(var == 0, at::zeros_like(invstd), invstd);  // torch's guard

  const auto save_dtype = weight.defined()         ? weight.scalar_type()
                          : running_mean.defined() ? running_mean.scalar_type()
                                                   : x.scalar_type();
  const auto math = opmath_dtype(x);
  const at::Tensor out = std::get<0>(at::native_batch_norm(x, weight.defined() ? weight.to(math) : weight,
                                                           bias.defined() ? bias.to(math) : bias, mean.to(math),
                                                           var.to(math), /*training=*/false, momentum, eps));
  if (running_mean.defined() || running_var.defined()) {
    // The batch mean and unbiased variance (GLOBAL count), made whole where the stats are.
    auto batch = at::stack({mean, m2 / (n - 1)});
    if (e.channel) batch = runtime::redistribute_local(batch, e.channel, e.whole, *call.mesh);
    if (running_mean.defined()) running_mean.copy_(batch[0] * momentum + running_mean.to(at::kDouble) * (1 - momentum));
    if (running_var.defined()) running_var.copy_(batch[1] * momentum + running_var.to(at::kDouble) * (1 - momentum));
  }
  torch::jit::drop(stack, call.num_args());
  stack.emplace_back(out);
  stack.emplace_back(mean.to(save_dtype));
  stack.emplace_back(invstd.to(save_dtype));
  if (call.schema().returns().size() == 4) stack.emplace_back(at::empty({0}, x.options().dtype(at::kByte)));
}

template <BatchNormMode kMode>
OpPlan batch_norm_rule(const OpCall& call) {
  const int64_t input = call.tensor_index(0), weight = call.tensor_index(1), bias = call.tensor_index(2);
  const int64_t rmean = call.tensor_named({"running_mean"}), rvar = call.tensor_named({"running_var"});
  check_batch_norm_input(call, input);
  const Layout& in = call.layout(input);
  const int64_t channels = in.global_shape()[kChannelDim];
  for (int64_t t : {weight, bias, rmean, rvar}) check_channel_param(call, t, channels);
  check_batch_norm_dtypes(call, input, {weight, bias, rmean, rvar});
  const bool training =
      kMode == BatchNormMode::kArg ? call.arg(call.arg_index("training")).toBool() : kMode == BatchNormMode::kTrain;
  if (!training && (rmean < 0 || rvar < 0))
    fail_call(call, "running_mean and running_var must be defined in evaluation mode");
  if (training && global_numel(in) == 0)
    fail_argument(call, input, "has no element", "an input with at least one element when training");
  for (int64_t t : {input, weight, bias, rmean, rvar})
    if (t >= 0) refuse_sum_partial(call, t, redistribute_partial_first());

  // The channel axes: the input's, unless training writes running stats sharded otherwise (they
  // are updated in place, so they keep their layout and the input follows them).
  layout::DimAxes dims = in.dim_axes();
  std::vector<int64_t> channel_axes = dims[kChannelDim];
  BatchNormExpand e;
  if (training && (rmean >= 0 || rvar >= 0)) {
    const int64_t first = rmean >= 0 ? rmean : rvar;
    for (int64_t t : {rmean, rvar})
      if (t >= 0) reject_partial(call, t, "the running stats are updated in place");
    const auto& stat_axes = call.layout(first).dim_axes()[0];
    if (rmean >= 0 && rvar >= 0 && call.layout(rvar).dim_axes()[0] != stat_axes)
      fail_argument(call, rvar, "is sharded unlike running_mean", "running_mean and running_var laid out alike");
    if (stat_axes.empty() && !channel_axes.empty()) {
      e.channel = make_layout(in, {2, channels}, {{}, channel_axes});
      e.whole = replicate_like(in, {2, channels});
    } else if (stat_axes != channel_axes) {
      channel_axes = stat_axes;
      for (auto& d : dims)
        d.erase(std::remove_if(d.begin(), d.end(),
                               [&](int64_t a) {
                                 return std::find(channel_axes.begin(), channel_axes.end(), a) != channel_axes.end();
                               }),
                d.end());
      dims[kChannelDim] = channel_axes;
    }
  }
  OpPlan plan;
  plan.inputs.resize(call.tensors.size());
  plan.inputs[input] = make_layout(in, in.global_shape(), dims);
  for (int64_t t : {weight, bias, rmean, rvar})
    if (t >= 0) plan.inputs[t] = channel_layout(call.layout(t), channels, channel_axes);
  if (training)  // written in place: as they are (checked above)
    for (int64_t t : {rmean, rvar})
      if (t >= 0) plan.inputs[t] = call.tensors[t].layout;
  plan.outputs.push_back(plan.inputs[input]);
  const auto stats = training ? channel_layout(in, channels, channel_axes) : replicate_like(in, {0});
  plan.outputs.push_back(stats);
  plan.outputs.push_back(stats);
  if (call.schema().returns().size() == 4) plan.outputs.push_back(replicate_like(in, {0}));  // reserve

  e.stat_axes = statistic_axes(in, dims);
  e.count = static_cast<double>(global_numel(in) / channels);
  if (training && (!e.stat_axes.empty() || e.channel || some_rank_holds_no_elements(*plan.inputs[input])))
    plan.expand = [e](const OpCall& c, torch::jit::Stack& s) { batch_norm_expand(e, c, s); };
  return plan;
}

// Where a batch norm backward op keeps each argument (positions in its schema). torch's order:
// (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
// output_mask[, reserve]); cuDNN's / MIOpen's: (input, grad_output, weight, running_mean,
// running_var, save_mean, save_var, epsilon[, reserveSpace]) -- only called when training (their
// forward's derivative takes native_batch_norm_backward in inference), every gradient wanted.
struct BatchNormBackwardArgs {
  int64_t grad = 0, input = 1, weight = 2, running_mean = 3, running_var = 4, save_mean = 5, save_invstd = 6;
  int64_t train = 7, eps = 8, mask = 9;  // train, mask: -1 = training, every gradient
};

BatchNormBackwardArgs backward_args(const OpCall& call) {
  BatchNormBackwardArgs a;
  if (call.schema().arguments()[0].name() == "input") {
    a.input = 0;
    a.grad = 1;
    a.train = -1;
    a.eps = 7;
    a.mask = -1;
  }
  return a;
}

// Training backward with GLOBAL sums: sum(dy) and sum(dy * (x - mean)) per channel are
// all-reduced over the statistic axes (float64), then torch's formula runs on the local block:
//   dx = (dy - sum(dy) / n - (x - mean) * invstd^2 * sum(dy (x - mean)) / n) * invstd * w
//   dw = sum(dy (x - mean)) * invstd,  db = sum(dy)      (whole on the statistic axes)
// Inference (a rank's block empty: torch's kernel divides by its size) is local: dx = dy *
// invstd * w with invstd = 1 / sqrt(running_var + eps); dw, db the block's sums.
void batch_norm_backward_expand(const BatchNormExpand& e, const OpCall& call, torch::jit::Stack& stack) {
  const BatchNormBackwardArgs args = backward_args(call);
  const at::Tensor grad = call.arg(args.grad).toTensor(), x = call.arg(args.input).toTensor();
  const at::Tensor weight = optional_tensor(call, args.weight);
  const bool train = args.train < 0 || call.arg(args.train).toBool();
  const double eps = call.arg(args.eps).toDouble();
  const std::array<bool, 3> mask =
      args.mask < 0 ? std::array<bool, 3>{true, true, true} : call.arg(args.mask).to<std::array<bool, 3>>();
  const int64_t channels = x.size(kChannelDim);
  const auto math = opmath_dtype(x);
  const auto view = channel_view(x.dim(), channels);
  const auto dims = reduced_dims(x.dim());
  const at::Tensor mean = optional_tensor(call, train ? args.save_mean : args.running_mean);
  const at::Tensor stat = optional_tensor(call, train ? args.save_invstd : args.running_var);
  const auto invstd = train ? stat.to(math) : (stat.to(math) + eps).rsqrt();
  const auto xmu = x.to(math) - mean.to(math).view(view);
  const auto dy = grad.to(math);
  auto sums = at::stack({dy.sum(dims), (dy * xmu).sum(dims)});
  if (train) {
    sums = sums.to(at::kDouble);
    for (int64_t axis : e.stat_axes) sums = runtime::all_reduce_along(sums, *call.mesh, axis, ReduceOp::Sum);
    sums = sums.to(math);
  }
  const auto sum_dy = sums[0], dot = sums[1];
  const auto param_dtype = weight.defined() ? weight.scalar_type() : mean.scalar_type();
  at::Tensor grad_input, grad_weight, grad_bias;
  if (mask[0]) {
    const auto scale = (weight.defined() ? invstd * weight.to(math) : invstd).view(view);
    if (train) {
      const auto k = (dot * invstd * invstd / e.count).view(view);
      grad_input = ((dy - sum_dy.view(view) / e.count - xmu * k) * scale).to(x.scalar_type());
    } else {
      grad_input = (dy * scale).to(x.scalar_type());
    }
  }
  if (mask[1]) grad_weight = (dot * invstd).to(param_dtype);
  if (mask[2]) grad_bias = sum_dy.to(param_dtype);
  torch::jit::drop(stack, call.num_args());
  stack.emplace_back(grad_input);
  stack.emplace_back(grad_weight);
  stack.emplace_back(grad_bias);
}

// native_batch_norm_backward, batch_norm_backward, cudnn_batch_norm_backward and
// miopen_batch_norm_backward (BatchNormBackwardArgs). cuDNN's reserve is the local forward's
// workspace: its backward always runs the expand (torch's formula on the block), which needs none.
OpPlan batch_norm_backward_rule(const OpCall& call) {
  const BatchNormBackwardArgs args = backward_args(call);
  const int64_t grad = call.tensor_index(args.grad), input = call.tensor_index(args.input);
  const int64_t weight = call.tensor_index(args.weight);
  const int64_t rmean = call.tensor_index(args.running_mean), rvar = call.tensor_index(args.running_var);
  const int64_t smean = call.tensor_index(args.save_mean), sinvstd = call.tensor_index(args.save_invstd);
  check_batch_norm_input(call, input);
  const Layout& in = call.layout(input);
  const int64_t channels = in.global_shape()[kChannelDim];
  if (call.layout(grad).global_shape() != in.global_shape())
    fail_argument(call, grad, "shape differs from input " + layout::shape_string(in.global_shape()),
                  "grad_out shaped like input");
  const bool train = args.train < 0 || call.arg(args.train).toBool();
  for (int64_t t : {weight, rmean, rvar}) check_channel_param(call, t, channels);
  if (train) {
    for (int64_t t : {smean, sinvstd}) {
      if (t < 0) fail_call(call, "save_mean and save_invstd must be defined when training");
      check_channel_param(call, t, channels);
    }
  }
  for (int64_t t : {input, weight, rmean, rvar, smean, sinvstd})
    if (t >= 0) refuse_sum_partial(call, t, redistribute_partial_first());

  // Linear in grad_out: its sum/avg Partial is kept on axes the input does not shard.
  const layout::DimAxes dims = in.dim_axes();
  const Layout& g = call.layout(grad);
  layout::PartialOps kept(g.partial().size());
  for (size_t a = 0; a < kept.size(); ++a) {
    const auto& op = g.partial()[a];
    if (!op || !is_sum_like(*op)) continue;
    bool sharding = false;
    for (const auto& d : dims) sharding |= std::find(d.begin(), d.end(), static_cast<int64_t>(a)) != d.end();
    if (sharding)
      refuse_sum_partial(call, grad, "grad_out Partial only on mesh axes that shard no dim of input");
    else
      kept[a] = op;
  }
  const auto& channel_axes = dims[kChannelDim];
  OpPlan plan;
  plan.inputs.resize(call.tensors.size());
  plan.inputs[grad] = make_layout(g, g.global_shape(), dims, kept);
  plan.inputs[input] = make_layout(in, in.global_shape(), dims);
  for (int64_t t : {weight, rmean, rvar, smean, sinvstd}) {
    if (t < 0) continue;
    const Layout& l = call.layout(t);
    plan.inputs[t] = l.global_shape() == std::vector<int64_t>{channels} ? channel_layout(l, channels, channel_axes)
                                                                        : replicate_like(l, l.global_shape());
  }
  for (size_t t = 0; t < call.tensors.size(); ++t)  // reserve
    if (!plan.inputs[t]) plan.inputs[t] = replicate_like(call.layout(t), call.layout(t).global_shape());
  plan.outputs.push_back(plan.inputs[grad]);

  BatchNormExpand e;
  e.stat_axes = statistic_axes(in, dims);
  e.count = channels > 0 ? static_cast<double>(global_numel(in) / channels) : 0;
  if (!train && (rmean < 0 || rvar < 0))
    fail_call(call, "running_mean and running_var must be defined in evaluation mode");
  // torch's kernel divides by the block's size: an empty block takes the expand.
  const bool expand = (train && !e.stat_axes.empty()) || some_rank_holds_no_elements(in) || args.train < 0;
  // Parameter gradients sum over N and spatial dims: Partial(sum) on the axes sharding them,
  // unless the training expand all-reduced the sums.
  layout::PartialOps param_partial = kept;
  if (!(train && expand))
    for (size_t d = 0; d < dims.size(); ++d)
      if (static_cast<int64_t>(d) != kChannelDim)
        for (int64_t a : dims[d]) param_partial[a] = ReduceOp::Sum;
  const auto param = make_layout(in, {channels}, {channel_axes}, param_partial);
  plan.outputs.push_back(param);
  plan.outputs.push_back(param);
  if (expand) plan.expand = [e](const OpCall& c, torch::jit::Stack& s) { batch_norm_backward_expand(e, c, s); };
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

// _safe_softmax: the softmax dim whole (gathered), unlike loss.cpp's _softmax, which keeps it
// sharded with collectives in its expand; the other dims keep their sharding.
OpPlan safe_softmax_rule(const OpCall& call) {
  reject_sum_partial(call, 0);
  const auto labels = softmax_labels(call, 0);
  FactorSpec spec;
  spec.operands = {{0, labels, false}};
  spec.outputs = {labels};
  spec.out_shapes = {call.layout(0).global_shape()};
  spec.whole = std::string{kSoftmaxDim};
  return plan_from_factors(call, spec);
}

}  // namespace

void register_normalization(Registry& r) {
  r.kernels(&kernels::register_rms_norm_kernels);
  // normalized_shape, dim, N/C/HxW/group decide dims and shapes; eps and dtypes do not (the rms
  // norms other than torch's take their dims from the weight's shape, a part of the key already).
  // Batch norm: `training` / `train` decides the plan, momentum and eps do not (the ops without
  // a training argument key on none; nn.BatchNorm's momentum=None varies per step).
  r.add("aten::_batch_norm_no_update", &batch_norm_rule<BatchNormMode::kEval>, KeyScalars::kNone);
  r.add("aten::_batch_norm_with_update", &batch_norm_rule<BatchNormMode::kTrain>, KeyScalars::kNone);
  r.add("aten::_fused_rms_norm", &rms_norm_rule, KeyScalars::kAll);
  r.add("aten::_fused_rms_norm_backward", &rms_norm_backward_rule, KeyScalars::kAll);
  r.add("aten::_native_batch_norm_legit", &batch_norm_rule<BatchNormMode::kArg>, KeyScalars::kAll);
  r.add("aten::_native_batch_norm_legit.no_stats", &batch_norm_rule<BatchNormMode::kArg>, KeyScalars::kAll);
  r.add("aten::_native_batch_norm_legit_no_training", &batch_norm_rule<BatchNormMode::kEval>, KeyScalars::kNone);
  r.add("aten::_safe_softmax", &safe_softmax_rule, KeyScalars::kAll);
  r.add("aten::batch_norm_backward", &batch_norm_backward_rule, KeyScalars::kAll);
  // What F.batch_norm reaches on CUDA (cuDNN) and ROCm (MIOpen): the same rules.
  r.add("aten::cudnn_batch_norm", &batch_norm_rule<BatchNormMode::kArg>, KeyScalars::kAll);
  r.add("aten::cudnn_batch_norm_backward", &batch_norm_backward_rule, KeyScalars::kAll);
  r.add("aten::miopen_batch_norm", &batch_norm_rule<BatchNormMode::kArg>, KeyScalars::kAll);
  r.add("aten::miopen_batch_norm_backward", &batch_norm_backward_rule, KeyScalars::kAll);
  r.add("aten::native_batch_norm", &batch_norm_rule<BatchNormMode::kArg>, KeyScalars::kAll);
  r.add("aten::native_batch_norm_backward", &batch_norm_backward_rule, KeyScalars::kAll);
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
