// Pointwise ops: unary, binary and ternary elementwise ops with broadcasting, comparisons,
// where.self, casts, their in-place and out= variants, and the pointwise backward ops.
//
// Sharding: every output dim takes the mesh axes of the inputs that are not broadcast along it;
// a broadcast input dim is never sharded. When the inputs disagree, each input's sharding is a
// candidate for the output and the cheapest one (fewest elements moved; ties: fewer inputs
// redistributed, then fewer Partial output axes, sharding_search.h) wins; in-place ops keep
// self's layout and redistribute the other operands to it.
//
// Partial algebra (why each row holds):
//   linear      add/sub/lerp/where(c, a, b)/copy_/complex(re, im): every data operand
//               Partial(sum|avg) on the same axes, since (sum a_i) + (sum b_i) = sum (a_i + b_i); a
//               Replicate operand is first filled (rank 0 keeps it, the others hold 0), which
//               moves nothing.
//   bilinear    mul: ONE operand Partial(sum|avg), the others not Partial on those axes; two
//               sum-Partials would give sum_i a_i * sum_j b_j != sum_i a_i b_i.
//   numerator   div, polar(abs, angle) and the *_backward(grad, x) ops: only the first operand may
//               be Partial.
//   scale       mul/div by a Python scalar, clone, negation: sum/avg kept; neg swaps max/min.
//   monotone    non-decreasing unary ops (exp, relu, sigmoid, clamp, ...) keep max/min Partials:
//               max_i f(a_i) = f(max_i a_i).
//   cast        float-to-float casts keep every Partial; other casts reject them.
//   reject      everything else (comparisons, abs, pow, fill_ ...): a sum/avg Partial input is an
//               error that names the op and the argument (redistribute it first), except a 0-dim
//               or an integer one (a sum or counts that model code tests: `mask.sum() ==
//               mask.numel()`, eager MoE's `expert_mask.sum(...) > 0`), which is reduced first; a
//               max/min/prod Partial (only made by the monotone row above) is reduced first, which
//               is exact.
// The engine (elementwise_layouts, pointwise.h) is shared with the _foreach_* list ops
// (foreach.cpp), which run it once per list position.
// Beyond these tables, every op torch tags `pointwise` gets the reject row (register_tagged_pointwise).
// Excluded: ops whose value depends on position (handled by their own families).
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/ScalarType.h>

#include <algorithm>

#include "ops/families.h"
#include "ops/partial.h"
#include "ops/pointwise.h"
#include "ops/sharding_search.h"

namespace hypershard::ops {
namespace {

bool is_max_like(ReduceOp op) { return op == ReduceOp::Max || op == ReduceOp::Min; }
ReduceOp swap_max_min(ReduceOp op) {
  return op == ReduceOp::Max ? ReduceOp::Min : op == ReduceOp::Min ? ReduceOp::Max : op;
}

// Is the output dtype of a cast floating (the only casts that keep a Partial)?
bool cast_keeps_partial(const OpCall& call, int64_t input) {
  if (!c10::isFloatingType(call.tensors[input].dtype)) return false;
  const auto dtype_index = call.schema().argumentIndexWithName("dtype");
  if (!dtype_index) return true;
  const auto& dtype = call.arg(*dtype_index);
  return dtype.isNone() || c10::isFloatingType(static_cast<c10::ScalarType>(dtype.toInt()));
}

// The Partial op the output may carry when operand `source` is Partial(op); nullopt = not allowed.
std::optional<ReduceOp> output_partial(Algebra algebra, ReduceOp op, const OpCall& call, int64_t source,
                                       int64_t first_data) {
  switch (algebra) {
    case Algebra::kReject:
      return std::nullopt;
    case Algebra::kLinear:
    case Algebra::kBilinear:
    case Algebra::kScale:
      return is_sum_like(op) ? std::optional<ReduceOp>(op) : std::nullopt;
    case Algebra::kNumerator:
      return source == first_data && is_sum_like(op) ? std::optional<ReduceOp>(op) : std::nullopt;
    case Algebra::kNegate:
      return swap_max_min(op);
    case Algebra::kMonotone:
      return is_max_like(op) ? std::optional<ReduceOp>(op) : std::nullopt;
    case Algebra::kCast:
      return cast_keeps_partial(call, source) ? std::optional<ReduceOp>(op) : std::nullopt;
    case Algebra::kIdentity:
      return op;
  }
  return std::nullopt;
}

// The Partial op operand `t` must carry when the output is Partial(out_op) coming from `source`.
std::optional<ReduceOp> input_partial(Algebra algebra, ReduceOp out_op, int64_t t, int64_t source, bool is_mask) {
  if (is_mask) return std::nullopt;
  switch (algebra) {
    case Algebra::kLinear:
      return out_op;  // every data operand
    case Algebra::kBilinear:
    case Algebra::kNumerator:
      return t == source ? std::optional<ReduceOp>(out_op) : std::nullopt;
    case Algebra::kNegate:
      return swap_max_min(out_op);
    default:
      return out_op;  // unary: the one operand
  }
}

std::vector<int64_t> broadcast_shape(const OpCall& call, const std::vector<int64_t>& operands) {
  std::vector<int64_t> out;
  for (int64_t t : operands) {
    const auto& shape = call.layout(t).global_shape();
    if (shape.size() > out.size()) out.insert(out.begin(), shape.size() - out.size(), 1);
    for (size_t i = 0; i < shape.size(); ++i) {
      int64_t& o = out[out.size() - shape.size() + i];
      if (shape[i] == o || shape[i] == 1) continue;
      if (o != 1) fail_call(call, "shapes cannot be broadcast together");
      o = shape[i];
    }
  }
  return out;
}

struct Candidate {
  layout::DimAxes dims;  // per output dim
  std::optional<ReduceOp> partial;
  std::vector<int64_t> partial_axes;
  int64_t source = -1;  // the operand the candidate copies (an index into call.tensors)
};

struct ScoredLayouts {
  ElementwiseLayouts layouts;
  SearchScore score;
};

OpPlan elementwise_rule(const OpCall& call, Algebra algebra, int64_t mask_arg) {
  std::vector<int64_t> operands(call.tensors.size());
  for (size_t t = 0; t < operands.size(); ++t) operands[t] = static_cast<int64_t>(t);
  auto layouts = elementwise_layouts(call, algebra, mask_arg, operands);
  OpPlan plan;
  plan.inputs = std::move(layouts.inputs);
  plan.outputs.assign(call.schema().returns().size(), layouts.output);
  return plan;
}

template <Algebra A, int64_t kMask>
OpPlan elementwise_rule(const OpCall& call) {
  return elementwise_rule(call, A, kMask);
}

template <Algebra A, int64_t kMask = kNoMask>
void add(Registry& r, const char* name) {
  r.add(name, &elementwise_rule<A, kMask>, KeyScalars::kNone);
}

// Casts: the dtype decides whether a Partial survives, so it joins the key.
void add_cast(Registry& r, const char* name) {
  r.add(name, &elementwise_rule<Algebra::kCast, kNoMask>, KeyScalars::kAll);
}

}  // namespace

ElementwiseLayouts elementwise_layouts(const OpCall& call, Algebra algebra, int64_t mask_arg,
                                       const std::vector<int64_t>& operands) {
  const auto out_shape = broadcast_shape(call, operands);
  const int64_t out_ndim = static_cast<int64_t>(out_shape.size());
  const int64_t mesh_ndim = call.mesh->mesh()->ndim();
  const auto& args = call.schema().arguments();
  const size_t n = operands.size();

  // Operand roles (k indexes `operands`): out= buffers take no part; a written first argument
  // is in-place self.
  std::vector<bool> is_out(n, false), is_mask(n, false);
  int64_t inplace_self = -1, first_data = -1;  // indices into call.tensors
  for (size_t k = 0; k < n; ++k) {
    const auto& t = call.tensors[operands[k]];
    const auto& arg = args[t.arg];
    const bool written = arg.alias_info() && arg.alias_info()->isWrite();
    if (written && t.arg == 0)
      inplace_self = operands[k];
    else if (written)
      is_out[k] = true;
    is_mask[k] = t.arg == mask_arg;
    if (!is_out[k] && !is_mask[k] && first_data < 0) first_data = operands[k];
  }

  auto input_dim = [&](int64_t t, int64_t out_dim) -> int64_t {  // -1: broadcast / absent
    const auto& shape = call.layout(t).global_shape();
    const int64_t d = out_dim - (out_ndim - static_cast<int64_t>(shape.size()));
    if (d < 0 || (shape[d] == 1 && out_shape[out_dim] != 1)) return -1;
    return d;
  };

  // Partial inputs the algebra cannot keep: a sum/avg Partial is an error in forward code (it
  // usually means a missing redistribution in the user's plan, e.g. a row-parallel output fed
  // to relu); inside a backward pass the formula is torch's (amax's divides the gradient by a
  // count summed over the reduced dim), so it is reduced first. A max/min/prod Partial only
  // comes from hypershard's own monotone algebra (and the backward ops that reuse such
  // outputs), so it is reduced first too; both are exact.
  std::vector<bool> reduce_first(n, false);
  for (size_t k = 0; k < n; ++k) {
    const int64_t t = operands[k];
    const auto op = call.layout(t).partial_op();
    if (!op || is_out[k]) continue;
    if (!is_mask[k] && output_partial(algebra, *op, call, t, first_data)) continue;
    // A 0-dim one (a sum tested in model code: transformers' `mask.sum() == numel`) or an
    // integer one (counts: eager MoE's `expert_mask.sum(...) > 0` over dp-sharded tokens) is
    // reduced first: it is data-dependent control, not an activation missing its reduction, and
    // unmodified code has no other way.
    const bool scalar = call.layout(t).global_shape().empty();
    const auto dtype = call.tensors[t].dtype;
    const bool count = c10::isIntegralType(dtype, /*includeBool=*/false);  // a bool Partial has no meaning
    if (is_sum_like(*op) && !call.in_backward && !scalar && !count)
      fail_argument(call, t, partial_name(*op) + " input is not supported by this op", redistribute_partial_first());
    reduce_first[k] = true;
  }

  std::vector<Candidate> candidates;
  for (size_t k = 0; k < n; ++k) {
    const int64_t t = operands[k];
    if (is_out[k] || (inplace_self >= 0 && t != inplace_self)) continue;
    const auto& l = call.layout(t);
    Candidate c;
    c.source = t;
    c.dims.assign(out_ndim, {});
    for (int64_t o = 0; o < out_ndim; ++o) {
      const int64_t d = input_dim(t, o);
      if (d >= 0) c.dims[o] = l.dim_axes()[d];
    }
    if (auto op = l.partial_op(); op && !reduce_first[k]) {
      c.partial = output_partial(algebra, *op, call, t, first_data);
      for (int64_t a = 0; a < mesh_ndim; ++a)
        if (l.is_partial(a)) c.partial_axes.push_back(a);
    }
    if (t == inplace_self) {
      // self's sharding must survive: a broadcast self dim that another operand shards is an error.
      if (static_cast<int64_t>(l.global_shape().size()) != out_ndim || l.global_shape() != out_shape)
        fail_argument(call, t, "an in-place op cannot broadcast self to " + layout::shape_string(out_shape),
                      "operands that broadcast to self's shape");
    }
    candidates.push_back(std::move(c));
  }
  if (candidates.empty()) fail_call(call, "internal error: no operand to take the output layout from");

  // Each operand's sharding as the output's, scored by the one search (sharding_search.h).
  const Layout& any = call.layout(candidates[0].source);
  auto best = search_candidates(candidates.size(), [&](size_t i) {
    const Candidate& c = candidates[i];
    std::optional<ScoredLayouts> plan(std::in_place);
    for (size_t k = 0; k < n; ++k) {
      const int64_t t = operands[k];
      const auto& current = call.tensors[t].layout;
      if (is_out[k]) {
        plan->layouts.inputs.push_back(current);
        continue;
      }
      const auto& shape = current->global_shape();
      layout::DimAxes dims(shape.size());
      for (int64_t o = 0; o < out_ndim; ++o) {
        const int64_t d = input_dim(t, o);
        if (d >= 0) dims[d] = c.dims[o];
      }
      layout::PartialOps partial(mesh_ndim);
      if (c.partial)  // a reduce-first operand is reduced, then filled where the algebra needs it
        if (auto op = input_partial(algebra, *c.partial, t, c.source, is_mask[k]))
          for (int64_t a : c.partial_axes) partial[a] = *op;
      auto required = make_layout(*current, shape, std::move(dims), std::move(partial));
      plan->score.add_input(current, required);
      plan->layouts.inputs.push_back(std::move(required));
    }
    layout::PartialOps out_partial(mesh_ndim);
    if (c.partial)
      for (int64_t a : c.partial_axes) out_partial[a] = *c.partial;
    plan->score.partial_axes = static_cast<int64_t>(c.partial ? c.partial_axes.size() : 0);
    plan->layouts.output = make_layout(any, out_shape, c.dims, std::move(out_partial));
    return plan;
  });
  return std::move(best->layouts);
}

void register_pointwise(Registry& r) {
  using A = Algebra;
  // Linear in all data operands.
  for (const char* op :
       {"aten::add.Tensor", "aten::add_.Tensor", "aten::add.out", "aten::sub.Tensor", "aten::sub_.Tensor",
        "aten::sub.out", "aten::rsub.Tensor", "aten::lerp.Scalar", "aten::lerp_.Scalar", "aten::copy_"})
    add<A::kLinear>(r, op);
  add<A::kLinear, 0>(r, "aten::where.self");
  add<A::kLinear, 0>(r, "aten::where.self_out");
  // Bilinear / numerator.
  for (const char* op : {"aten::mul.Tensor", "aten::mul_.Tensor", "aten::mul.out"}) add<A::kBilinear>(r, op);
  for (const char* op :
       {"aten::div.Tensor", "aten::div_.Tensor", "aten::div.out", "aten::div.Tensor_mode", "aten::threshold_backward",
        "aten::gelu_backward", "aten::silu_backward", "aten::sigmoid_backward", "aten::tanh_backward",
        "aten::softplus_backward", "aten::native_dropout_backward", "aten::hardswish_backward",
        "aten::log_sigmoid_backward", "aten::_prelu_kernel_backward"})
    add<A::kNumerator>(r, op);
  // polar(abs, angle) = abs * e^(i angle): linear in abs only (the numerator row).
  add<A::kNumerator>(r, "aten::polar");
  // complex(real, imag) = real + i imag: linear in both operands together.
  add<A::kLinear>(r, "aten::complex");
  // Scaled by a Python scalar / identity-like.
  for (const char* op : {"aten::mul.Scalar", "aten::mul_.Scalar", "aten::div.Scalar", "aten::div_.Scalar"})
    add<A::kScale>(r, op);
  for (const char* op : {"aten::clone", "aten::zero_", "aten::contiguous", "aten::positive"}) add<A::kIdentity>(r, op);
  add<A::kNegate>(r, "aten::neg");
  add<A::kNegate>(r, "aten::neg_");
  // Monotone non-decreasing unary ops.
  for (const char* op :
       {"aten::exp",      "aten::exp_",    "aten::exp2",      "aten::expm1",      "aten::log",       "aten::log_",
        "aten::log1p",    "aten::log2",    "aten::log10",     "aten::sqrt",       "aten::sqrt_",     "aten::relu",
        "aten::relu_",    "aten::sigmoid", "aten::sigmoid_",  "aten::tanh",       "aten::tanh_",     "aten::erf",
        "aten::floor",    "aten::ceil",    "aten::round",     "aten::trunc",      "aten::sign",      "aten::softplus",
        "aten::clamp",    "aten::clamp_",  "aten::clamp_min", "aten::clamp_min_", "aten::clamp_max", "aten::clamp_max_",
        "aten::hardtanh", "aten::atan",    "aten::asinh",     "aten::sinh"})
    add<A::kMonotone>(r, op);
  // Everything else pointwise: no Partial.
  for (const char* op : {"aten::abs",
                         "aten::abs_",
                         "aten::rsqrt",
                         "aten::rsqrt_",
                         "aten::reciprocal",
                         "aten::reciprocal_",
                         "aten::sin",
                         "aten::cos",
                         "aten::tan",
                         "aten::gelu",
                         "aten::gelu_",
                         "aten::silu",
                         "aten::silu_",
                         "aten::square",
                         "aten::pow.Tensor_Scalar",
                         "aten::pow_.Scalar",
                         "aten::pow.Tensor_Tensor",
                         "aten::pow.Scalar",
                         "aten::add.Scalar",
                         "aten::add_.Scalar",
                         "aten::sub.Scalar",
                         "aten::sub_.Scalar",
                         "aten::rsub.Scalar",
                         "aten::eq.Tensor",
                         "aten::eq.Scalar",
                         "aten::ne.Tensor",
                         "aten::ne.Scalar",
                         "aten::lt.Tensor",
                         "aten::lt.Scalar",
                         "aten::le.Tensor",
                         "aten::le.Scalar",
                         "aten::gt.Tensor",
                         "aten::gt.Scalar",
                         "aten::ge.Tensor",
                         "aten::ge.Scalar",
                         "aten::maximum",
                         "aten::minimum",
                         "aten::logical_not",
                         "aten::logical_and",
                         "aten::logical_or",
                         "aten::logical_xor",
                         "aten::logical_and_",
                         "aten::logical_or_",
                         "aten::bitwise_not",
                         "aten::bitwise_and.Tensor",
                         "aten::bitwise_or.Tensor",
                         "aten::isnan",
                         "aten::isinf",
                         "aten::addcmul",
                         "aten::addcmul_",
                         "aten::addcdiv",
                         "aten::addcdiv_",
                         "aten::fill_.Scalar",
                         "aten::fill_.Tensor",
                         "aten::lerp.Tensor",
                         "aten::lerp_.Tensor",
                         "aten::sgn",
                         "aten::nan_to_num",
                         "aten::remainder.Scalar",
                         "aten::remainder.Tensor",
                         "aten::fmod.Scalar",
                         "aten::floor_divide",
                         "aten::xlogy.Tensor",
                         "aten::erfinv",
                         "aten::hardtanh_backward",
                         "aten::logit",
                         "aten::frac",
                         "aten::atan2",
                         "aten::hardswish",
                         "aten::hardswish_",
                         "aten::log_sigmoid_forward",
                         "aten::_prelu_kernel"})
    add<A::kReject>(r, op);
  add<A::kReject, 1>(r, "aten::masked_fill.Scalar");
  add<A::kReject, 1>(r, "aten::masked_fill.Tensor");
  add<A::kReject, 1>(r, "aten::masked_fill_.Scalar");
  add<A::kReject, 1>(r, "aten::masked_fill_.Tensor");
  add_cast(r, "aten::_to_copy");
}

void register_tagged_pointwise(Registry& r) {
  using A = Algebra;
  // Every other ATen op torch tags pointwise (the list inductor fuses by), with its in-place and
  // out= overloads: the same engine without Partial (the reject row; default mode reduces a
  // Partial input first). Left out: ops another family has a rule for (this runs last), seeded
  // random ops (each shard would draw the same numbers; random.cpp owns them) and ops returning
  // something other than tensors (equal's bool is a reduction over every element).
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    const auto op = dispatcher.findOp(name);
    if (!op || !op->hasSchema() || !op->hasTag(at::Tag::pointwise) || op->hasTag(at::Tag::nondeterministic_seeded))
      continue;
    const auto& returns = op->schema().returns();
    const bool tensors_only = !returns.empty() && std::all_of(returns.begin(), returns.end(), [](const auto& ret) {
      return ret.type()->kind() == c10::TypeKind::TensorType;
    });
    const std::string full = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    if (tensors_only && r.find(full) == nullptr) add<A::kReject>(r, full.c_str());
  }
  // Tagged pointwise from torch 2.13 on, untagged in torch 2.11 (pyproject allows 2.11-2.13;
  // under 2.11, leaky_relu and _conj_physical were Missing operators in strict mode).
  for (const char* op : {"aten::leaky_relu", "aten::leaky_relu_", "aten::_conj_physical", "aten::celu_", "aten::elu_",
                         "aten::hardsigmoid_", "aten::hardtanh_", "aten::selu_"})
    if (r.find(op) == nullptr) add<A::kReject>(r, op);
}

}  // namespace hypershard::ops
