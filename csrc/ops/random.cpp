// Random ops: in-place fills, *_like draws, bernoulli and dropout.
//
//   aten::bernoulli_.float, bernoulli_.Tensor, normal_, uniform_, exponential_,  in-place fills
//   cauchy_, geometric_, log_normal_, random_(.from, .to)
//   aten::rand_like, randn_like, randint_like (+ .low_dtype, .generator ...)     fresh draws
//   aten::bernoulli.p                                                        a fresh draw like self
//   aten::bernoulli (probabilities in self), bernoulli.Tensor (p)            draws from a tensor of p
//   aten::multinomial, poisson, normal.Tensor_float (means in self),       (the draw's shape: dims of
//   normal.Tensor_Tensor (std read whole)                                   self's size keep its sharding)
//   aten::native_dropout                                                     mask draw + scale
// F.dropout on CPU is empty_like + bernoulli_.float + div_ + mul (the pointwise family); on
// accelerators it is native_dropout, whose backward native_dropout_backward is pointwise.
//
// Semantics: a Replicate tensor holds the same draw on every rank; a sharded tensor holds exactly
// the slice of the tensor ONE device would draw with the same generator state. So every rank
// draws the whole GLOBAL tensor with the op's own kernel -- the same generator (the default one
// unless the call names one), the same shape, dtype and memory order, hence the same values and
// the same generator advance as one device -- and keeps its slice. Cost: one global-size draw and
// buffer per rank and call, no communication. It relies on every rank's generator being in the
// same state (torch.manual_seed(s) on every rank, as distribute_tensor relies on equal global
// values); a draw that differs per rank cannot be detected without a collective.
// When nothing is sharded the local call is that draw already (no expand).
// Memory order: the global buffer takes the local's memory order (the wrapper reports the same
// order), and a non-dense local gets a non-contiguous buffer, because CPU kernels fill
// contiguous and strided tensors along different code paths (normal_ for >= 16 elements).
//
// Partial: an in-place fill of a Partial tensor would leave a "sum of identical draws": an
// error. A probability tensor (bernoulli(p), bernoulli_(p)) that is Partial(sum|avg) is an error
// too; max/min Partials are reduced first. The *_like ops and bernoulli.p only read self's shape:
// a Partial self gives a Replicate draw on those axes (as empty_like does). native_dropout is
// linear in its input: a sum/avg Partial input keeps its Partial (the mask is Replicate there).
//
// Excluded: randperm (no tensor input), normal.float_Tensor (its tensor is not the first
// argument), rrelu_with_noise (it writes its noise argument), _standard_gamma and binomial (no
// rule yet).
#include <ATen/ATen.h>

#include <numeric>

#include "ops/families.h"
#include "ops/partial.h"

namespace hypershard::ops {
namespace {

using Stack = torch::jit::Stack;

// ------------------------------------------------------------------ the global draw

// An uninitialised tensor of the GLOBAL shape whose memory order is the local's (as the wrapper
// reports it): contiguous for a contiguous local, dims in the local's stride order otherwise,
// and not contiguous (every other element of a buffer twice as long) for a non-dense local.
at::Tensor global_buffer(const at::Tensor& local, const std::vector<int64_t>& shape) {
  const int64_t n = static_cast<int64_t>(shape.size());
  if (n == 0 || local.dim() != n || local.is_contiguous()) return at::empty(shape, local.options());
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  const auto strides = local.strides();
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  std::vector<int64_t> permuted(n), inverse(n);
  for (int64_t i = 0; i < n; ++i) {
    permuted[i] = shape[order[i]];
    inverse[order[i]] = i;
  }
  const bool dense = local.is_non_overlapping_and_dense();
  if (!dense) permuted[n - 1] *= 2;
  auto base = at::empty(permuted, local.options());
  if (!dense) base = base.slice(n - 1, 0, std::nullopt, 2);
  return base.permute(inverse);
}

// This rank's block of a global tensor laid out as `l` (Partial axes ignored).
at::Tensor local_slice(const at::Tensor& global, const Layout& l, int64_t position) {
  const auto offset = l.global_offset_at(position);
  const auto shape = l.local_shape_at(position);
  at::Tensor out = global;
  for (int64_t d = 0; d < global.dim(); ++d)
    if (shape[d] != global.size(d)) out = out.narrow(d, offset[d], shape[d]);
  return out;
}

// Runs the op's own kernel with argument 0 replaced by `first`; returns its single result.
at::Tensor call_with(const OpCall& call, const Stack& stack, at::Tensor first) {
  Stack inner(stack.end() - call.num_args(), stack.end());
  inner[0] = std::move(first);
  call.op->callBoxed(&inner);
  return inner.back().toTensor();
}

enum class Draw : int8_t {
  kFill,        // in-place: self is overwritten by the draw
  kLike,        // fresh: a draw shaped like self (self's values unused)
  kFromValues,  // fresh: self holds the probabilities (gathered to Replicate first)
};

struct RandomSpec {
  Draw draw;
  LayoutPtr out;  // the result's layout (self's, without Partial)
};

void random_expand(const RandomSpec& s, const OpCall& call, Stack& stack) {
  const at::Tensor self = stack[stack.size() - call.num_args()].toTensor();
  const int64_t position = call.mesh->position();
  at::Tensor global = s.draw == Draw::kFromValues ? call_with(call, stack, self)
                                                  : call_with(call, stack, global_buffer(self, s.out->global_shape()));
  at::Tensor mine = local_slice(global, *s.out, position);
  torch::jit::drop(stack, call.num_args());
  if (s.draw == Draw::kFill) {
    self.copy_(mine);
    stack.emplace_back(self);
    return;
  }
  // A slice keeps the whole global buffer alive: copy it out.
  stack.emplace_back(mine.numel() == global.numel() ? mine : mine.clone());
}

// ------------------------------------------------------------------ rules

[[noreturn]] void fail_partial(const OpCall& call, int64_t tensor, const std::string& why) {
  fail_argument(call, tensor, partial_name(call.layout(tensor)) + " input: " + why, redistribute_partial_first());
}

// The required layout of a probability tensor: whole on every axis (every rank draws globally);
// sum/avg Partial is an error, max/min Partial is reduced by the redistribution.
LayoutPtr probabilities(const OpCall& call, int64_t tensor) {
  const Layout& l = call.layout(tensor);
  if (auto op = l.partial_op(); op && is_sum_like(*op))
    fail_partial(call, tensor, "probabilities that are a sum of parts cannot be drawn from");
  return replicate_like(l, l.global_shape());
}

template <Draw D>
OpPlan random_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  if (D == Draw::kFill && self.has_partial())
    fail_partial(call, 0, "a fill would leave the same draw in every part of the sum");
  OpPlan plan;
  RandomSpec spec{D, nullptr};
  if (D == Draw::kFromValues) {
    if (auto op = self.partial_op(); op && is_sum_like(*op))
      fail_partial(call, 0, "probabilities that are a sum of parts cannot be drawn from");
    // the result's dims that have self's size keep self's sharding (multinomial's last dim
    // becomes num_samples; normal(mean, std) may broadcast to more dims: then it is whole)
    const auto shape = meta_output_shapes(call).at(0);
    layout::DimAxes dims(shape.size());
    if (shape.size() == static_cast<size_t>(self.ndim()))
      for (size_t d = 0; d < shape.size(); ++d)
        if (shape[d] == self.global_shape()[d]) dims[d] = self.dim_axes()[d];
    spec.out = make_layout(self, shape, std::move(dims), {});
    plan.inputs.push_back(probabilities(call, 0));
  } else {
    spec.out = without_partial(self);
    plan.inputs.push_back(call.tensors[0].layout);
  }
  // A second tensor (bernoulli_.Tensor / bernoulli.Tensor p, randint_like.Tensor high) is read whole.
  for (size_t t = 1; t < call.tensors.size(); ++t) plan.inputs.push_back(probabilities(call, static_cast<int64_t>(t)));
  plan.outputs.push_back(spec.out);
  // Nothing sharded: the local call IS the one-device draw (same generator, shape and memory).
  if (spec.out->is_sharded_anywhere()) plan.expand = [spec](const OpCall& c, Stack& s) { random_expand(spec, c, s); };
  return plan;
}

// native_dropout(input, p, train) -> (input * mask * scale, mask): the mask is drawn globally
// by the op's own kernel on a global tensor of ones (same dtype, so the same draw as one device).
void native_dropout_expand(const LayoutPtr& mask_layout, const OpCall& call, Stack& stack) {
  const at::Tensor input = stack[stack.size() - call.num_args()].toTensor();
  const double p = call.arg(1).toDouble();
  const auto ones = at::ones(mask_layout->global_shape(), input.options());
  auto global = at::native_dropout(ones, p, call.arg(2).toOptional<bool>());
  at::Tensor mask = local_slice(std::get<1>(global), *mask_layout, call.mesh->position()).clone();
  const double scale = p == 1.0 ? 0.0 : 1.0 / (1.0 - p);
  at::Tensor out = input.mul(mask).mul_(scale);
  torch::jit::drop(stack, call.num_args());
  stack.emplace_back(std::move(out));
  stack.emplace_back(std::move(mask));
}

OpPlan native_dropout_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  OpPlan plan;
  auto input = call.tensors[0].layout;
  if (auto op = in.partial_op(); op && !is_sum_like(*op)) input = without_partial(in);  // reduced first
  auto mask = without_partial(in);
  plan.inputs.push_back(input);
  plan.outputs.push_back(input);
  plan.outputs.push_back(mask);
  const auto& train = call.arg(2);
  // Not training, nothing to draw or nothing sharded: the local op is exact (a Partial input's
  // parts all get the same mask).
  if ((train.isNone() || train.toBool()) && layout::numel(in.global_shape()) > 0 && in.is_sharded_anywhere())
    plan.expand = [mask](const OpCall& c, Stack& s) { native_dropout_expand(mask, c, s); };
  return plan;
}

}  // namespace

void register_random(Registry& r) {
  using D = Draw;
  // Scalars (p, mean, std, bounds, dtype) change values only, never a layout.
  r.add("aten::bernoulli", &random_rule<D::kFromValues>, KeyScalars::kNone);
  r.add("aten::bernoulli.Tensor", &random_rule<D::kLike>, KeyScalars::kNone);
  r.add("aten::bernoulli.p", &random_rule<D::kLike>, KeyScalars::kNone);
  r.add("aten::bernoulli_.Tensor", &random_rule<D::kFill>, KeyScalars::kNone);
  r.add("aten::bernoulli_.float", &random_rule<D::kFill>, KeyScalars::kNone);
  r.add("aten::cauchy_", &random_rule<D::kFill>, KeyScalars::kNone);
  r.add("aten::exponential_", &random_rule<D::kFill>, KeyScalars::kNone);
  r.add("aten::geometric_", &random_rule<D::kFill>, KeyScalars::kNone);
  r.add("aten::log_normal_", &random_rule<D::kFill>, KeyScalars::kNone);
  r.add("aten::multinomial", &random_rule<D::kFromValues>, KeyScalars::kAll);  // num_samples: a shape
  r.add("aten::native_dropout", &native_dropout_rule, KeyScalars::kAll);       // train decides the expand
  r.add("aten::normal_", &random_rule<D::kFill>, KeyScalars::kNone);
  r.add("aten::normal.Tensor_float", &random_rule<D::kFromValues>, KeyScalars::kNone);   // self: the means
  r.add("aten::normal.Tensor_Tensor", &random_rule<D::kFromValues>, KeyScalars::kNone);  // std read whole
  r.add("aten::poisson", &random_rule<D::kFromValues>, KeyScalars::kNone);               // self: the rates
  r.add("aten::rand_like", &random_rule<D::kLike>, KeyScalars::kNone);
  r.add("aten::rand_like.generator", &random_rule<D::kLike>, KeyScalars::kNone);
  r.add("aten::randint_like", &random_rule<D::kLike>, KeyScalars::kNone);
  r.add("aten::randint_like.Tensor", &random_rule<D::kLike>, KeyScalars::kNone);
  r.add("aten::randint_like.generator", &random_rule<D::kLike>, KeyScalars::kNone);
  r.add("aten::randint_like.low_dtype", &random_rule<D::kLike>, KeyScalars::kNone);
  r.add("aten::randint_like.low_generator_dtype", &random_rule<D::kLike>, KeyScalars::kNone);
  r.add("aten::randn_like", &random_rule<D::kLike>, KeyScalars::kNone);
  r.add("aten::randn_like.generator", &random_rule<D::kLike>, KeyScalars::kNone);
  r.add("aten::random_", &random_rule<D::kFill>, KeyScalars::kNone);
  r.add("aten::random_.from", &random_rule<D::kFill>, KeyScalars::kNone);
  r.add("aten::random_.to", &random_rule<D::kFill>, KeyScalars::kNone);
  r.add("aten::uniform_", &random_rule<D::kFill>, KeyScalars::kNone);
}

}  // namespace hypershard::ops
