// Reductions: sum, mean, amax, amin, max, min, argmax, argmin, var, std, linalg_vector_norm,
// _foreach_norm, prod, any, all, and histc / bincount (counts: Partial(sum) over the sharding axes;
// histc's data range and bincount's length all-reduced from the data; see histc_rule, bincount_rule).
//
//   aten::sum, sum.dim_IntList, sum.IntList_out, mean, mean.dim          (linear)
//   aten::amax, amin, max, min, prod, prod.dim_int, any, any.dim, any.dims, all, all.dim,
//   all.dims, linalg_vector_norm                                          (collective)
//   aten::max.dim, min.dim, argmax, argmin                                (select: value + index)
//   aten::var.correction, std.correction                                  (moments)
//   aten::_foreach_norm.Scalar                                            (one norm per element)
//   aten::trace                      (linear: each block sums its part of the GLOBAL diagonal,
//                                    Partial(sum); see trace_rule)
//   aten::equal, allclose            (one bool for the whole tensors, ANDed over the mesh; see
//                                    compare_whole_rule)
//   aten::value_selecting_reduction_backward            (a kernel at the autograd key, see below;
//                                                       also serves sort/topk's backward)
//
// Sharding: dims that are not reduced keep their mesh axes (they shift left when keepdim is
// false); a reduced dim becomes size 1 (keepdim) or disappears. What happens to the mesh axes
// that sharded a reduced dim ("reduced axes") depends on the op:
//   linear      sum/mean: the output is Partial(sum) on the reduced axes, since the sum over a
//               dim is the sum of the shards' sums. mean divides each shard's SUM by the GLOBAL
//               count (an average of shard means is wrong for uneven shards), so its expand
//               implementation replaces the local mean.
//   collective  amax/amin/max/min/prod/any/all/linalg_vector_norm: local reduction, then an
//               all-reduce along the reduced axes inside the op (max, min, prod, or/and on
//               bool-as-uint8; norms reduce sum |x|^p, or max/min for p = +-inf, and take the
//               1/p power after): the output is the GLOBAL value, Replicate on those axes.
//               Not Partial(max|min|prod) outputs, although they would be exact: every
//               non-monotone consumer (sub, div, eq in amax's own backward, ...) reduces them
//               first at the same cost. A rank whose shard of a reduced dim is empty
//               contributes the op's identity.
//   select      max.dim/min.dim/argmax/argmin over a sharded dim: each rank reduces its shard,
//               adds its global offset (argmax without dim: the global flat index), and the
//               (value, index) candidates are gathered along the reduced axes; the winner is the
//               max/min value, NaN first, ties to the smallest GLOBAL index (torch's rule on one
//               device). Values and indices are Replicate on those axes, never Partial.
//   moments     var/std over a sharded dim: each shard's (count, mean, M2) are gathered and
//               combined with Chan's parallel formula in float64 (no input gather); Replicate.
//   foreach     _foreach_norm: every element's GLOBAL norm (0-d Replicate), one collective per
//               group of elements with the same sharding axes and dtype.
//
// Partial inputs (the algebra, and the reason):
//   sum/mean keep Partial(sum): linear, sum_d(sum_i a_i) = sum_i(sum_d a_i); Partial(avg) is
//   kept only when no reduced dim is sharded (avg and sum axes cannot be mixed in one layout).
//   amax/max keep Partial(max), amin/min keep Partial(min), prod keeps Partial(prod), any keeps
//   Partial(max) and all Partial(min): each reduction commutes with the same reduction across
//   ranks. Every other Partial input is an error naming the argument (redistribute it first);
//   max.dim/argmax, var/std and norms never take Partial (indices and moments of a sum are not
//   the sums of the parts' indices and moments).
//
// Backward: the formulas reach unsqueeze, expand, view (views family), pointwise ops and these
// reductions; max.dim/min.dim's value_selecting_reduction_backward gets a kernel of its own at
// the autograd key (register_reduction_kernels, below). amax/amin/max/min and +-inf norms over
// a sharded dim divide by mask.sum(dim), a Partial(sum) count, which the pointwise family
// reduces first inside a backward pass. Not covered: prod.default's backward calls nonzero (no
// rule yet).
//
// Excluded: complex var/std over a sharded dim (rejected); var_mean/std_mean, nansum,
// logsumexp, aminmax, count_nonzero (no rule yet).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/core/ScalarType.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "ops/expand_helpers.h"
#include "ops/families.h"
#include "ops/partial.h"
#include "ops/pointwise.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {
namespace {

using Stack = torch::jit::Stack;

enum class Kind : int8_t { kSum, kMean, kMax, kMin, kProd, kAny, kAll, kNorm };

// ------------------------------------------------------------------ dims and layouts

struct Reduced {
  std::vector<int64_t> dims;  // ascending, wrapped
  bool keepdim = false;
  std::vector<int64_t> axes;  // mesh axes sharding a reduced dim (per dim major -> minor)
  int64_t count = 1;          // GLOBAL number of elements each output element reduces
};

// The reduced dims from the "dim" argument: absent or None = every dim; an int[] that is
// empty also means every dim, except for any.dims/all.dims (where it reduces nothing).
Reduced reduced_dims(const OpCall& call, bool empty_is_all) {
  const Layout& in = call.layout(0);
  const int64_t ndim = in.ndim();
  std::vector<int64_t> all(ndim);
  for (int64_t d = 0; d < ndim; ++d) all[d] = d;
  Reduced r;
  const auto dim_index = call.schema().argumentIndexWithName("dim");
  const c10::IValue* dim = dim_index ? &call.arg(*dim_index) : nullptr;
  if (!dim || dim->isNone()) {
    r.dims = all;
  } else if (dim->isInt()) {
    if (ndim > 0) r.dims = {wrap_dim(call, dim->toInt(), ndim)};
  } else {
    const auto list = dim->toIntVector();
    if (list.empty() && empty_is_all) r.dims = all;
    for (int64_t d : list) {
      const int64_t w = wrap_dim(call, d, ndim);
      if (std::find(r.dims.begin(), r.dims.end(), w) != r.dims.end())
        fail_call(call, layout::str_cat("dim ", w, " appears multiple times in the list of dims"));
      if (ndim > 0) r.dims.push_back(w);
    }
    std::sort(r.dims.begin(), r.dims.end());
  }
  const auto keepdim_index = call.schema().argumentIndexWithName("keepdim");
  r.keepdim = keepdim_index && call.arg(*keepdim_index).toBool();
  for (int64_t d : r.dims) {
    r.count *= in.global_shape()[d];
    for (int64_t axis : in.dim_axes()[d]) r.axes.push_back(axis);
  }
  return r;
}

bool is_reduced(const Reduced& r, int64_t dim) { return std::find(r.dims.begin(), r.dims.end(), dim) != r.dims.end(); }

// The output: reduced dims size 1 (keepdim) or gone, the other dims keep their axes.
LayoutPtr reduced_layout(const Layout& in, const Reduced& r, layout::PartialOps partial) {
  std::vector<int64_t> shape;
  layout::DimAxes dims;
  for (int64_t d = 0; d < in.ndim(); ++d) {
    if (!is_reduced(r, d)) {
      shape.push_back(in.global_shape()[d]);
      dims.push_back(in.dim_axes()[d]);
    } else if (r.keepdim) {
      shape.push_back(1);
      dims.emplace_back();
    }
  }
  return make_layout(in, std::move(shape), std::move(dims), std::move(partial));
}

[[noreturn]] void fail_partial(const OpCall& call, const std::string& allowed) {
  fail_argument(call, 0, partial_name(call.layout(0)) + " input is not supported by this reduction", allowed);
}

std::vector<int64_t> sharding_axes(const Layout& l) {
  std::vector<int64_t> axes;
  for (const auto& dim : l.dim_axes()) axes.insert(axes.end(), dim.begin(), dim.end());
  return axes;
}

// ------------------------------------------------------------------ local helpers (expand)

// Reduced dims of size 1 (the local shape a keepdim reduction produces), for empty shards.
std::vector<int64_t> keepdim_shape(const at::Tensor& x, const std::vector<int64_t>& dims) {
  auto shape = x.sizes().vec();
  for (int64_t d : dims) shape[d] = 1;
  return shape;
}

int64_t local_count(const at::Tensor& x, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= x.size(d);
  return n;
}

at::Tensor squeeze_reduced(const at::Tensor& t, const std::vector<int64_t>& dims, bool keepdim) {
  return keepdim || dims.empty() ? t : at::squeeze(t, dims);
}

// The identity of max (lowest) or min (highest) for `type`.
c10::Scalar extreme(c10::ScalarType type, bool lowest) {
  c10::Scalar value;
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, type, "hypershard_extreme", [&] {
    using L = std::numeric_limits<scalar_t>;
    if constexpr (L::has_infinity)
      value = lowest ? -INFINITY : INFINITY;
    else if constexpr (std::is_same_v<scalar_t, bool>)
      value = !lowest;
    else
      value = static_cast<int64_t>(lowest ? L::lowest() : L::max());
  });
  return value;
}

const runtime::DeviceMesh& mesh_of(const OpCall& call) { return *call.mesh; }

// max/min all-reduce along `axes` (runtime::all_reduce_along keeps NaN; gloo has no bool max).
at::Tensor all_reduce_extremum(at::Tensor t, const OpCall& call, const std::vector<int64_t>& axes, bool is_max) {
  const ReduceOp op = is_max ? ReduceOp::Max : ReduceOp::Min;
  const bool is_bool = t.scalar_type() == at::kBool;
  if (is_bool) t = t.to(at::kByte);
  for (int64_t axis : axes) t = runtime::all_reduce_along(t, mesh_of(call), axis, op);
  return is_bool ? t.to(at::kBool) : t;
}

// This rank's tensor stacked with the other members' along `axes`: [K, ...t.shape].
at::Tensor gather_candidates(const at::Tensor& t, const OpCall& call, const std::vector<int64_t>& axes) {
  const bool is_bool = t.scalar_type() == at::kBool;
  at::Tensor out = (is_bool ? t.to(at::kByte) : t).unsqueeze(0);
  out = runtime::all_gather_in_chunk_order(out, mesh_of(call), axes, 0);
  return is_bool ? out.to(at::kBool) : out;
}

// ------------------------------------------------------------------ linear: sum, mean

void mean_expand(const Reduced& r, const OpCall& call, Stack& stack) {
  const at::Tensor x = call.arg(0).toTensor();
  const auto dtype_index = call.schema().argumentIndexWithName("dtype");
  const auto& dtype_arg = call.arg(*dtype_index);
  const auto dtype = dtype_arg.isNone() ? x.scalar_type() : static_cast<c10::ScalarType>(dtype_arg.toInt());
  TORCH_CHECK(at::isFloatingType(dtype) || at::isComplexType(dtype), "mean(): could not infer output dtype. ",
              (dtype_arg.isNone() ? "Input" : "Optional"),
              " dtype must be either a floating point or complex dtype. Got: ", dtype);
  // As torch's CPU mean: half types sum in float32, then divide and cast back.
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  auto out = at::sum(x, r.dims, r.keepdim, half ? at::kFloat : dtype).div_(r.count);
  replace_args(call, stack, {half ? out.to(dtype) : out});
}

template <Kind K>
OpPlan linear_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const Reduced r = reduced_dims(call, true);
  const auto op = in.partial_op();
  if (op && !(*op == ReduceOp::Sum || (*op == ReduceOp::Avg && r.axes.empty())))
    fail_partial(call, "Replicate, Shard, Partial(sum), or Partial(avg) when no reduced dim is sharded");
  layout::PartialOps partial = in.partial();
  for (int64_t axis : r.axes) partial[axis] = ReduceOp::Sum;
  OpPlan plan;
  plan.inputs.push_back(call.tensors[0].layout);
  plan.outputs.push_back(reduced_layout(in, r, std::move(partial)));
  // out= (sum.IntList_out): the buffer takes the output's layout; its old values do not matter.
  for (size_t t = 1; t < call.tensors.size(); ++t) {
    if (!call.tensors[t].is_dtensor || call.layout(t).global_shape() != plan.outputs[0]->global_shape())
      fail_argument(
          call, static_cast<int64_t>(t),
          "out= must be a DTensor of the result's shape " + layout::shape_string(plan.outputs[0]->global_shape()),
          "a DTensor out of the result's shape");
    plan.inputs.push_back(plan.outputs[0]);
  }
  if (K == Kind::kMean && !r.axes.empty()) plan.expand = [r](const OpCall& c, Stack& s) { mean_expand(r, c, s); };
  return plan;
}

// ------------------------------------------------------------------ collective: amax ... norm

double norm_ord(const OpCall& call) { return call.arg(call.arg_index("ord")).toScalar().toDouble(); }

// The op's own kernel with keepdim, so dtype promotion and errors are torch's.
at::Tensor local_reduce(Kind k, const OpCall& call, const at::Tensor& x, const std::vector<int64_t>& dims) {
  const auto dtype_index = call.schema().argumentIndexWithName("dtype");
  std::optional<c10::ScalarType> dtype;
  if (dtype_index && !call.arg(*dtype_index).isNone())
    dtype = static_cast<c10::ScalarType>(call.arg(*dtype_index).toInt());
  const bool all = static_cast<int64_t>(dims.size()) == x.dim();
  switch (k) {
    case Kind::kMax:
      return at::amax(x, dims, true);
    case Kind::kMin:
      return at::amin(x, dims, true);
    case Kind::kProd:
      return all ? at::prod(x, dtype).reshape(keepdim_shape(x, dims)) : at::prod(x, dims[0], true, dtype);
    case Kind::kAny:
      return at::any(x, at::OptionalIntArrayRef(dims), true);
    case Kind::kAll:
      return at::all(x, at::OptionalIntArrayRef(dims), true);
    case Kind::kNorm:
      return at::linalg_vector_norm(x, norm_ord(call), dims, true, dtype);
    default:
      TORCH_CHECK(false, "hypershard: internal error: local_reduce of a linear kind");
  }
}

// What ranks combine: amax/amin as they are, finite non-zero p-norms as sum |x|^p.
bool norm_is_power(double p) { return std::isfinite(p) && p != 0; }

at::Tensor collective_local(Kind k, const OpCall& call, const at::Tensor& x, const std::vector<int64_t>& dims,
                            int64_t global_count) {
  const bool extremum = k == Kind::kMax || k == Kind::kMin || k == Kind::kNorm;
  if (!extremum || local_count(x, dims) > 0 || global_count == 0) {
    auto out = local_reduce(k, call, x, dims);
    if (k == Kind::kNorm && norm_is_power(norm_ord(call))) out = out.pow(norm_ord(call));
    return out;
  }
  // An empty shard: the op on a stand-in (same dtype checks), filled with the identity.
  auto out = local_reduce(k, call, at::zeros(keepdim_shape(x, dims), x.options()), dims);
  if (k == Kind::kNorm) return out.fill_(norm_ord(call) == -INFINITY ? INFINITY : 0.0);
  return out.fill_(extreme(out.scalar_type(), k == Kind::kMax));
}

template <Kind K>
void collective_expand(const Reduced& r, const OpCall& call, Stack& stack) {
  const at::Tensor x = call.arg(0).toTensor();
  auto out = collective_local(K, call, x, r.dims, r.count);
  if constexpr (K == Kind::kMax || K == Kind::kMin) {
    out = all_reduce_extremum(out, call, r.axes, K == Kind::kMax);
  } else if constexpr (K == Kind::kProd) {
    out = all_reduce_axes(out, call, r.axes, ReduceOp::Prod);
  } else if constexpr (K == Kind::kAny || K == Kind::kAll) {
    out = all_reduce_extremum(out, call, r.axes, K == Kind::kAny);
  } else {
    const double p = norm_ord(call);
    if (std::isinf(p))
      out = all_reduce_extremum(out, call, r.axes, p > 0);
    else
      out = all_reduce_axes(out, call, r.axes, ReduceOp::Sum);
    if (norm_is_power(p)) out = out.pow(1.0 / p);
  }
  replace_args(call, stack, {squeeze_reduced(out, r.dims, r.keepdim)});
}

// The Partial op a collective reduction passes through (see the header), if any.
std::optional<ReduceOp> kept_partial(Kind k) {
  switch (k) {
    case Kind::kMax:
    case Kind::kAny:
      return ReduceOp::Max;
    case Kind::kMin:
    case Kind::kAll:
      return ReduceOp::Min;
    case Kind::kProd:
      return ReduceOp::Prod;
    default:
      return std::nullopt;
  }
}

template <Kind K>
OpPlan collective_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const Reduced r = reduced_dims(call, K != Kind::kAny && K != Kind::kAll);
  const auto kept = kept_partial(K);
  if (in.has_partial() && in.partial_op() != kept)
    fail_partial(call, kept ? std::string("Replicate, Shard or Partial(") + layout::reduce_op_name(*kept) + ")"
                            : redistribute_partial_first());
  OpPlan plan;
  plan.inputs.push_back(call.tensors[0].layout);
  plan.outputs.push_back(reduced_layout(in, r, in.partial()));  // reduced axes: all-reduced, Replicate
  if (!r.axes.empty()) plan.expand = [r](const OpCall& c, Stack& s) { collective_expand<K>(r, c, s); };
  return plan;
}

// ------------------------------------------------------------------ select: max.dim ... argmin

// The winner among candidates [K, ...] (index -1: an empty shard): the max (min) value, NaN
// first, ties to the smallest global index. Returns (value, index) without the K dim.
std::pair<at::Tensor, at::Tensor> select_winner(const at::Tensor& values, const at::Tensor& index, bool is_max) {
  const auto valid = index.ge(0);
  const auto v = at::where(valid, values, extreme(values.scalar_type(), is_max));
  auto best = is_max ? v.amax(0, true) : v.amin(0, true);
  auto hit = valid.logical_and(v.eq(best));
  if (at::isFloatingType(values.scalar_type())) {
    const auto nan = valid.logical_and(at::isnan(values));
    const auto any_nan = nan.any(0, true);
    hit = at::where(any_nan, nan, hit);
    best = best.masked_fill(any_nan, std::numeric_limits<double>::quiet_NaN());
  }
  const auto winner = at::where(hit, index, std::numeric_limits<int64_t>::max()).amin(0);
  return {best.squeeze(0), winner};
}

struct Select {
  LayoutPtr in;
  int64_t dim = -1;  // -1: argmax/argmin without dim (global flat index)
  bool keepdim = false;
  bool is_max = true;
  bool values = true;  // max.dim/min.dim return (values, indices); argmax/argmin the index
  std::vector<int64_t> axes;
};

// This rank's (value, global index) with keepdim, index -1 for an empty shard.
std::pair<at::Tensor, at::Tensor> local_candidate(const Select& s, const at::Tensor& x, int64_t position) {
  const auto offset = s.in->global_offset_at(position);
  if (s.dim >= 0) {
    const bool empty = x.size(s.dim) == 0;
    const auto src = empty ? at::zeros(keepdim_shape(x, {s.dim}), x.options()) : x;
    auto [value, index] = s.is_max ? at::max(src, s.dim, true) : at::min(src, s.dim, true);
    return {value, empty ? at::full_like(index, -1) : index + offset[s.dim]};
  }
  const bool empty = x.numel() == 0;
  const auto src = empty ? at::zeros({1}, x.options()) : x.reshape(-1);
  auto [value, rest] = s.is_max ? at::max(src, 0) : at::min(src, 0);
  if (empty) return {value, at::full_like(rest, -1)};
  // Local flat index -> local coordinates -> global flat index.
  const auto& shape = s.in->global_shape();
  auto global = at::zeros_like(rest);
  int64_t stride = 1;
  for (int64_t d = x.dim() - 1; d >= 0; --d) {
    global = global + (at::remainder(rest, x.size(d)) + offset[d]) * stride;
    rest = at::div(rest, x.size(d), "floor");
    stride *= shape[d];
  }
  return {value, global};
}

void select_expand(const Select& s, const OpCall& call, Stack& stack) {
  const at::Tensor x = call.arg(0).toTensor();
  auto [value, index] = local_candidate(s, x, call.mesh->position());
  auto [best, winner] =
      select_winner(gather_candidates(value, call, s.axes), gather_candidates(index, call, s.axes), s.is_max);
  if (s.dim >= 0 && !s.keepdim) {
    best = best.squeeze(s.dim);
    winner = winner.squeeze(s.dim);
  } else if (s.dim < 0 && s.keepdim) {
    winner = winner.reshape(std::vector<int64_t>(x.dim(), 1));
  }
  if (s.values)
    replace_args(call, stack, {best, winner});
  else
    replace_args(call, stack, {winner});
}

template <bool kIsMax, bool kValues>
OpPlan select_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  if (in.has_partial())
    fail_partial(call, redistribute_partial_first("a value's index is not the reduction of the parts' indices"));
  const Reduced r = reduced_dims(call, true);
  OpPlan plan;
  plan.inputs.push_back(call.tensors[0].layout);
  const auto out = reduced_layout(in, r, {});
  for (size_t i = 0; i < call.schema().returns().size(); ++i) plan.outputs.push_back(out);
  const bool flat = call.arg(call.arg_index("dim")).isNone();
  Select s{call.tensors[0].layout,           flat ? -1 : (r.dims.empty() ? 0 : r.dims[0]), r.keepdim, kIsMax, kValues,
           flat ? sharding_axes(in) : r.axes};
  if (!s.axes.empty() && in.ndim() > 0) plan.expand = [s](const OpCall& c, Stack& st) { select_expand(s, c, st); };
  return plan;
}

// ------------------------------------------------------------------ moments: var, std

template <bool kStd>
void moments_expand(const Reduced& r, const OpCall& call, Stack& stack) {
  const at::Tensor x = call.arg(0).toTensor();
  const auto& correction_arg = call.arg(call.arg_index("correction"));
  const double correction = correction_arg.isNone() ? 1.0 : correction_arg.toScalar().toDouble();
  // (count, mean, M2) of this shard in float64; an empty shard contributes zeros.
  const int64_t n = local_count(x, r.dims);
  at::Tensor mean, m2;
  if (n > 0) {
    const bool half = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
    auto [var, m] = at::var_mean(half ? x.to(at::kFloat) : x, r.dims, at::Scalar(0), true);
    mean = m.to(at::kDouble);
    m2 = var.to(at::kDouble).mul_(n);
  } else {
    mean = at::zeros(keepdim_shape(x, r.dims), x.options().dtype(at::kDouble));
    m2 = at::zeros_like(mean);
  }
  const auto stats =
      gather_candidates(at::stack({at::full_like(mean, static_cast<double>(n)), mean, m2}), call, r.axes);
  const auto counts = stats.select(1, 0), means = stats.select(1, 1), m2s = stats.select(1, 2);
  // Chan et al.: M2 = sum M2_k + sum n_k (mean_k - mean)^2.
  const auto total_mean = counts.mul(means).sum(0) / static_cast<double>(r.count);
  const auto total_m2 = m2s.sum(0) + counts.mul((means - total_mean).square()).sum(0);
  auto out = total_m2 / std::max(0.0, static_cast<double>(r.count) - correction);
  if (kStd) out = out.sqrt();
  replace_args(call, stack, {squeeze_reduced(out.to(x.scalar_type()), r.dims, r.keepdim)});
}

template <bool kStd>
OpPlan moments_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  if (in.has_partial())
    fail_partial(call, redistribute_partial_first("the variance of a sum is not the sum of variances"));
  const Reduced r = reduced_dims(call, true);
  if (!r.axes.empty() && at::isComplexType(call.tensors[0].dtype))
    fail_argument(call, 0, "a complex variance over a sharded dim is not supported",
                  "real dtypes, or an unsharded dim");
  OpPlan plan;
  plan.inputs.push_back(call.tensors[0].layout);
  plan.outputs.push_back(reduced_layout(in, r, {}));
  // Non-floating dtypes: the local call raises torch's own error on every rank.
  if (!r.axes.empty() && at::isFloatingType(call.tensors[0].dtype))
    plan.expand = [r](const OpCall& c, Stack& s) { moments_expand<kStd>(r, c, s); };
  return plan;
}

// ------------------------------------------------------------------ foreach: _foreach_norm

struct ForeachNorm {
  std::vector<std::vector<int64_t>> axes;  // per element: the axes sharding it
  std::vector<int64_t> numel;              // per element: its GLOBAL numel
};

void foreach_norm_expand(const ForeachNorm& f, const OpCall& call, Stack& stack) {
  const auto list = call.arg(0).toTensorList();
  const double p = norm_ord(call);
  std::vector<at::Tensor> out(list.size());
  std::map<std::pair<std::vector<int64_t>, c10::ScalarType>, std::vector<size_t>> groups;
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor x = list.get(i);
    std::vector<int64_t> all(x.dim());
    for (int64_t d = 0; d < x.dim(); ++d) all[d] = d;
    out[i] = collective_local(Kind::kNorm, call, x, all, f.numel[i]).reshape({});
    if (!f.axes[i].empty()) groups[{f.axes[i], out[i].scalar_type()}].push_back(i);
  }
  for (const auto& [key, members] : groups) {
    std::vector<at::Tensor> parts;
    for (size_t i : members) parts.push_back(out[i]);
    auto stacked = at::stack(parts);
    stacked = std::isinf(p) ? all_reduce_extremum(stacked, call, key.first, p > 0)
                            : all_reduce_axes(stacked, call, key.first, ReduceOp::Sum);
    for (size_t j = 0; j < members.size(); ++j) out[members[j]] = stacked[static_cast<int64_t>(j)];
  }
  c10::List<at::Tensor> result;
  for (auto& t : out) result.push_back(norm_is_power(p) ? t.pow(1.0 / p) : t);
  torch::jit::drop(stack, call.num_args());
  stack.emplace_back(std::move(result));
}

OpPlan foreach_norm_rule(const OpCall& call) {
  OpPlan plan;
  ForeachNorm f;
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    if (l.has_partial())
      fail_argument(call, static_cast<int64_t>(t), partial_name(l) + " input is not supported by this reduction",
                    redistribute_partial_first());
    plan.inputs.push_back(call.tensors[t].layout);
    plan.outputs.push_back(replicate_like(l, {}));
    f.axes.push_back(sharding_axes(l));
    f.numel.push_back(layout::numel(l.global_shape()));
  }
  if (std::any_of(f.axes.begin(), f.axes.end(), [](const auto& a) { return !a.empty(); }))
    plan.expand = [f](const OpCall& c, Stack& s) { foreach_norm_expand(f, c, s); };
  return plan;
}

// ------------------------------------------------------------------ max.dim backward (autograd level)

// value_selecting_reduction_backward (the backward of max.dim/min.dim/kthvalue/mode, and of
// sort/topk, which select several values along dim) is composite-implicit: it scatters the
// gradient into a PLAIN zeros tensor of the input's global size, which hypershard refuses (that
// tensor would hold one rank's shard). This kernel builds the same gradient from DTensor ops:
// one selected value per position (max/min: K = 1 index along dim) is
// where(GLOBAL index == position along dim, grad, 0); K > 1 indices (sort, topk) compare every
// index with every position on an extra axis and sum over the K indices. Runs at the
// AutogradPrivateUse2 key, so autograd records its ops (double backward works).
at::Tensor value_selecting_reduction_backward_kernel(const at::Tensor& grad, int64_t dim, const at::Tensor& indices,
                                                     c10::SymIntArrayRef sizes, bool keepdim) {
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  if (ndim == 0) return grad.clone();
  dim = c10::maybe_wrap_dim(dim, ndim);
  const auto g = keepdim ? grad : grad.unsqueeze(dim);
  const auto index = keepdim ? indices : indices.unsqueeze(dim);
  const int64_t length = sizes[dim].expect_int();
  const auto zero = at::zeros({}, g.options());
  if (index.size(dim) == 1) {
    std::vector<int64_t> shape(ndim, 1);
    shape[dim] = length;
    const auto positions = at::arange(length, index.options()).view(shape);  // plain: Replicate
    return at::where(index.eq(positions), g, zero);
  }
  // positions on a new axis `dim`, the K indices moved to dim + 1: [..., length, K, ...]
  std::vector<int64_t> shape(ndim + 1, 1);
  shape[dim] = length;
  const auto positions = at::arange(length, index.options()).view(shape);  // plain: Replicate
  return at::where(index.unsqueeze(dim).eq(positions), g.unsqueeze(dim), zero).sum(dim + 1);
}

}  // namespace

void register_reduction_kernels() {
  aten_autograd_kernels().impl("value_selecting_reduction_backward",
                               TORCH_FN(value_selecting_reduction_backward_kernel));
}

// ------------------------------------------------------------------ counts

// histc(self, bins, min, max): each rank counts its shard into the same bins, so the histogram is
// Partial(sum) over the axes that shard self (a Replicate axis holds the same counts already).
// min = max = 0 means "the data's range": the GLOBAL range, one max and one min all-reduce, so
// every rank bins with the edges one device would use. A Partial self (a sum of parts) has no
// counts of its own: an error (default mode reduces it first).
OpPlan histc_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  if (in.has_partial())
    fail_argument(call, 0, "a histogram of a Partial tensor counts its parts, not its values",
                  redistribute_partial_first());
  std::vector<int64_t> axes;
  for (int64_t axis = 0; axis < in.mesh()->ndim(); ++axis)
    if (in.is_sharded(axis)) axes.push_back(axis);
  layout::PartialOps counts(static_cast<size_t>(in.mesh()->ndim()));
  for (int64_t axis : axes) counts[axis] = ReduceOp::Sum;
  OpPlan plan;
  plan.inputs.push_back(call.tensors[0].layout);
  plan.outputs.push_back(make_layout(in, {call.arg(1).toInt()}, {{}}, counts));
  if (!axes.empty() && call.arg(2).toScalar().toDouble() == 0.0 && call.arg(3).toScalar().toDouble() == 0.0) {
    plan.expand = [axes](const OpCall& c, Stack& stack) {
      const at::Tensor local = stack[stack.size() - c.num_args()].toTensor();
      const int64_t bins = c.arg(1).toInt();
      // An empty shard contributes the identity of each extreme.
      auto lo = local.numel() ? local.min().reshape({1})
                              : at::full({1}, extreme(local.scalar_type(), /*lowest=*/false), local.options());
      auto hi = local.numel() ? local.max().reshape({1})
                              : at::full({1}, extreme(local.scalar_type(), /*lowest=*/true), local.options());
      lo = all_reduce_extremum(lo, c, axes, /*is_max=*/false);
      hi = all_reduce_extremum(hi, c, axes, /*is_max=*/true);
      // No data on any rank: one device's empty histogram (its range rule sees min = max = 0).
      const bool empty = lo.item<double>() > hi.item<double>();
      torch::jit::drop(stack, c.num_args());
      stack.emplace_back(at::histc(local, bins, empty ? 0.0 : lo.item(), empty ? 0.0 : hi.item()));
    };
  }
  return plan;
}

// bincount(self, weights?, minlength): self 1-D non-negative integers. Each rank counts its
// shard (weights follow self's sharding) into the same number of bins -- one max all-reduce gives
// the GLOBAL largest value, so every rank's local call gets minlength max(minlength, max + 1),
// the length one device's result has -- and the counts are Partial(sum) over the axes sharding
// self. The length depends on the data: the plan is data_shaped. A Partial self or weights (sums
// of parts) is an error, as for histc.
OpPlan bincount_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const int64_t weights = call.tensor_index(1);
  for (int64_t t : {int64_t{0}, weights})
    if (t >= 0 && call.layout(t).has_partial())
      fail_argument(call, t, "the counts of a Partial tensor would count its parts, not its values",
                    redistribute_partial_first());
  if (in.ndim() != 1) fail_argument(call, 0, "is not 1-D", "a 1-D tensor of non-negative integers");
  const std::vector<int64_t> axes = in.dim_axes()[0];
  layout::PartialOps counts(static_cast<size_t>(in.mesh()->ndim()));
  for (int64_t axis : axes) counts[axis] = ReduceOp::Sum;
  OpPlan plan;
  plan.inputs.push_back(call.tensors[0].layout);
  if (weights >= 0) {
    const Layout& w = call.layout(weights);
    plan.inputs.push_back(make_layout(w, w.global_shape(), in.dim_axes()));
  }
  plan.outputs.push_back(make_layout(in, {0}, {{}}, counts));  // the length comes from the local result
  plan.data_shaped = true;
  if (axes.empty()) return plan;
  plan.expand = [axes](const OpCall& c, Stack& stack) {
    const size_t num = static_cast<size_t>(c.num_args());
    const at::Tensor local = stack[stack.size() - num].toTensor();
    const c10::IValue weights = stack[stack.size() - num + 1];
    at::Tensor largest = local.numel() ? local.max().reshape({1}).to(at::kLong) : at::full({1}, -1, at::kLong);
    largest = all_reduce_extremum(largest, c, axes, /*is_max=*/true);
    const int64_t minlength = std::max(stack[stack.size() - 1].toInt(), largest.item<int64_t>() + 1);
    torch::jit::drop(stack, num);
    stack.emplace_back(
        at::bincount(local, weights.isNone() ? std::optional<at::Tensor>() : weights.toTensor(), minlength));
  };
  return plan;
}

namespace {

// ------------------------------------------------------------------ trace

// trace(self): the sum of a matrix's GLOBAL diagonal. A rank's block starts at GLOBAL (row r0,
// column c0), so the global entries (i, i) it holds are its local diagonal of offset r0 - c0; the
// blocks' sums add up to the trace: Partial(sum) on every axis that shards the matrix, and on
// those a sum Partial input has (trace is linear). Any other Partial is reduced first.
OpPlan trace_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  if (self.ndim() != 2) fail_argument(call, 0, layout::str_cat("has ", self.ndim(), " dims"), "a matrix (2 dims)");
  layout::PartialOps partial(static_cast<size_t>(self.mesh()->ndim()));
  for (int64_t axis = 0; axis < self.mesh()->ndim(); ++axis) {
    const auto& op = self.partial()[axis];
    if (op && *op == ReduceOp::Sum) partial[axis] = op;
  }
  OpPlan plan;
  plan.inputs.push_back(make_layout(self, self.global_shape(), self.dim_axes(), partial));
  for (int64_t axis = 0; axis < self.mesh()->ndim(); ++axis)
    if (self.is_sharded(axis)) partial[axis] = ReduceOp::Sum;
  plan.outputs.push_back(make_layout(self, {}, {}, partial));
  if (!self.is_sharded_anywhere()) return plan;
  const auto offset = self.global_offset_at(call.mesh->position());
  const int64_t shift = offset[0] - offset[1];
  plan.expand = [shift](const OpCall& c, Stack& stack) {
    const at::Tensor local = stack.back().toTensor();
    torch::jit::drop(stack, c.num_args());
    // the local diagonal's sum in trace's result dtype (integers sum into int64, as trace does)
    stack.emplace_back(at::sum(local.diagonal(shift)));
  };
  return plan;
}

// ------------------------------------------------------------------ equal / allclose

// equal(self, other), allclose(self, other, rtol, atol, equal_nan): one bool for the whole
// tensors, the same on every rank. The operands are laid out alike by the pointwise engine
// (allclose broadcasts; a sum Partial is an error in forward code, the reject row), each rank
// compares its blocks, and the verdicts are ANDed (a min of 0/1) along every axis that shards
// them. equal of different GLOBAL shapes is false on every rank, with no collective.
OpPlan compare_whole_rule(const OpCall& call) {
  OpPlan plan;
  if (call.schema().name() == "aten::equal" && call.layout(0).global_shape() != call.layout(1).global_shape()) {
    for (const auto& t : call.tensors) plan.inputs.push_back(t.layout);
    plan.expand = [](const OpCall& c, Stack& stack) {
      torch::jit::drop(stack, c.num_args());
      stack.emplace_back(false);
    };
    return plan;
  }
  auto layouts = elementwise_layouts(call, Algebra::kReject, kNoMask, {0, 1});
  plan.inputs = std::move(layouts.inputs);
  std::vector<int64_t> axes;
  for (int64_t axis = 0; axis < call.mesh->mesh()->ndim(); ++axis)
    if (layouts.output->is_sharded(axis)) axes.push_back(axis);
  if (axes.empty()) return plan;
  plan.expand = [axes](const OpCall& c, Stack& stack) {
    c.op->callBoxed(stack);
    const bool local = stack.back().toBool();
    stack.pop_back();
    const at::Tensor all = all_reduce_extremum(at::full({1}, local ? 1 : 0, at::kLong), c, axes, /*is_max=*/false);
    stack.emplace_back(all.item<int64_t>() == 1);
  };
  return plan;
}

}  // namespace

void register_reductions(Registry& r) {
  r.kernels(&register_reduction_kernels);
  using K = Kind;
  r.add("aten::histc", &histc_rule, KeyScalars::kAll);
  r.add("aten::bincount", &bincount_rule, KeyScalars::kAll);
  r.add("aten::_foreach_norm.Scalar", &foreach_norm_rule, KeyScalars::kAll);
  r.add("aten::all", &collective_rule<K::kAll>, KeyScalars::kAll);
  r.add("aten::all.dim", &collective_rule<K::kAll>, KeyScalars::kAll);
  r.add("aten::all.dims", &collective_rule<K::kAll>, KeyScalars::kAll);
  r.add("aten::amax", &collective_rule<K::kMax>, KeyScalars::kAll);
  r.add("aten::amin", &collective_rule<K::kMin>, KeyScalars::kAll);
  r.add("aten::any", &collective_rule<K::kAny>, KeyScalars::kAll);
  r.add("aten::any.dim", &collective_rule<K::kAny>, KeyScalars::kAll);
  r.add("aten::any.dims", &collective_rule<K::kAny>, KeyScalars::kAll);
  r.add("aten::allclose", &compare_whole_rule, KeyScalars::kNone);
  r.add("aten::argmax", &select_rule<true, false>, KeyScalars::kAll);
  r.add("aten::argmin", &select_rule<false, false>, KeyScalars::kAll);
  r.add("aten::equal", &compare_whole_rule, KeyScalars::kNone);
  r.add("aten::linalg_vector_norm", &collective_rule<K::kNorm>, KeyScalars::kAll);
  r.add("aten::max", &collective_rule<K::kMax>, KeyScalars::kAll);
  r.add("aten::max.dim", &select_rule<true, true>, KeyScalars::kAll);
  r.add("aten::mean", &linear_rule<K::kMean>, KeyScalars::kAll);
  r.add("aten::mean.dim", &linear_rule<K::kMean>, KeyScalars::kAll);
  r.add("aten::min", &collective_rule<K::kMin>, KeyScalars::kAll);
  r.add("aten::min.dim", &select_rule<false, true>, KeyScalars::kAll);
  r.add("aten::prod", &collective_rule<K::kProd>, KeyScalars::kAll);
  r.add("aten::prod.dim_int", &collective_rule<K::kProd>, KeyScalars::kAll);
  r.add("aten::std.correction", &moments_rule<true>, KeyScalars::kAll);
  r.add("aten::sum", &linear_rule<K::kSum>, KeyScalars::kAll);
  r.add("aten::sum.IntList_out", &linear_rule<K::kSum>, KeyScalars::kAll);
  r.add("aten::sum.dim_IntList", &linear_rule<K::kSum>, KeyScalars::kAll);
  r.add("aten::trace", &trace_rule, KeyScalars::kNone);
  r.add("aten::var.correction", &moments_rule<false>, KeyScalars::kAll);
}

}  // namespace hypershard::ops
