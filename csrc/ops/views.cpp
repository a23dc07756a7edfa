// Views and shape ops.
//
//   t, transpose.int, permute         the per-dim axes move with their dims
//   unsqueeze                         a new whole dim
//   view_as_real / view_as_complex    a new last dim of 2, whole / that dim folded (made whole)
//   squeeze(.dim/.dims), squeeze_    squeezed dims are size 1 and must be whole (a sharded
//                                     size-1 dim has empty shards that would not squeeze)
//   expand                            expanded dims (size 1 -> n) and new leading dims are whole
//   view, _unsafe_view, _reshape_alias  dims are grouped into minimal equal-product groups; only
//                                     the major dim of a group may be sharded, and only when every
//                                     rank's shard stays a whole block of the new major dim with
//                                     exactly the torch.chunk split of that dim (a group flattened
//                                     into one dim may keep several sharded dims, their axes major
//                                     first, when every rank's block stays contiguous and is the
//                                     chunk of that order: [batch/dp, seq/cp] -> [tokens/(dp, cp)]
//                                     with one sequence per dp rank). Otherwise view and
//                                     _reshape_alias raise (they must alias) and _unsafe_view
//                                     gathers the offending dims first. reshape/flatten get a kernel
//                                     of their own (register_reshape_kernel) that redistributes
//                                     before viewing, so x.view(16, 6) of a [12, 8] tensor sharded
//                                     on dim 1 is never computed from wrong local data.
//   slice.Tensor, select.int, split*, unbind  local on a whole dim (and a slice covering a whole
//                                     sharded dim); a slice of a dim sharded over one mesh axis
//                                     keeps it sharded: each rank fetches the GLOBAL range its
//                                     output chunk reads (runtime/span_exchange.h, one all-to-all);
//                                     otherwise the dim is gathered first (global indices then
//                                     equal local ones). Either result no longer aliases its base
//                                     and refuses in-place writes (dispatch.cpp)
//   cat, stack                        the cat dim whole (kept when legacy empty operands leave
//                                     one: a KV cache's first update); other dims sharded alike
//   select_backward, slice_backward   the inverse shapes, same rule (slice_backward of a gradient
//                                     sharded over one axis: the exchange in reverse)
//   constant_pad_nd                   padded dims whole, the others keep their sharding
//   diagonal(_backward)               dim1, dim2 whole (GLOBAL offset); the other dims keep theirs
//   repeat                            dims repeated once keep their sharding; the others are whole
//   as_strided                        only on a tensor with no sharded dim (a checked backstop)
//   *_copy (view_copy, expand_copy, diagonal_copy, permute_copy, transpose_copy, t_copy,
//   unsqueeze_copy, squeeze_copy, view_as_real/complex_copy, as_strided_copy)  the view's rule
//                                     (view_copy: the gathering form of view)
//   select_copy, slice_copy, narrow_copy, split_copy, split_with_sizes_copy, unbind_copy  the
//                                     dim whole (GLOBAL start, index), the other dims keep theirs
//                                     (_reshape_alias_copy has no rule yet)
// Partial: every op here is linear (it moves or copies elements), so Partial passes through
// unchanged; cat/stack make the output Partial where any operand is (a whole operand is filled
// for free; sum and avg on one axis do not mix).
#include <ATen/ATen.h>
#include <ATen/InferSize.h>
#include <torch/library.h>

#include <numeric>
#include <optional>
#include <utility>

#include "ops/diagonal.h"
#include "ops/families.h"
#include "ops/partial.h"
#include "ops/view_plan.h"
#include "runtime/dtensor_impl.h"
#include "runtime/redistribute.h"
#include "runtime/span_exchange.h"

namespace hypershard::ops {
namespace {

OpPlan single(const OpCall& call, LayoutPtr input, LayoutPtr output) {
  OpPlan plan;
  plan.inputs.push_back(std::move(input));
  for (size_t i = 1; i < call.tensors.size(); ++i) plan.inputs.push_back(call.tensors[i].layout);
  plan.outputs.push_back(std::move(output));
  return plan;
}

// ------------------------------------------------------------------ permutations

OpPlan permute_with(const OpCall& call, const std::vector<int64_t>& order) {
  const Layout& in = call.layout(0);
  std::vector<int64_t> shape;
  layout::DimAxes dims;
  for (int64_t d : order) {
    shape.push_back(in.global_shape()[d]);
    dims.push_back(in.dim_axes()[d]);
  }
  OpPlan plan = single(call, call.tensors[0].layout, make_layout(in, shape, dims, in.partial()));
  // The wrapper's strides move with their dims, exactly as torch permutes them.
  plan.geometry = [order](const at::Tensor& input) -> std::optional<ViewGeometry> {
    std::vector<int64_t> strides;
    strides.reserve(order.size());
    for (int64_t d : order) strides.push_back(input.stride(d));
    return ViewGeometry{std::move(strides), input.storage_offset()};
  };
  return plan;
}

OpPlan permute_rule(const OpCall& call) {
  const int64_t ndim = call.layout(0).ndim();
  auto order = int_list(call.arg(1));
  std::vector<bool> seen(ndim, false);
  if (static_cast<int64_t>(order.size()) != ndim)
    fail_call(call, layout::str_cat("dims has ", order.size(), " entries for a ", ndim,
                                    "-d tensor; allowed: a permutation of its dims"));
  for (auto& d : order) {
    d = wrap_dim(call, d, ndim);
    if (seen[d])
      fail_call(call, layout::str_cat("dim ", d, " appears twice in dims; allowed: a permutation of its dims"));
    seen[d] = true;
  }
  return permute_with(call, order);
}

OpPlan transpose_rule(const OpCall& call) {
  const int64_t ndim = call.layout(0).ndim();
  std::vector<int64_t> order(ndim);
  std::iota(order.begin(), order.end(), 0);
  if (ndim >= 2) {
    const bool is_t = call.schema().name() == "aten::t" || call.schema().name() == "aten::t_copy";
    const int64_t a = is_t ? 0 : wrap_dim(call, int_arg(call.arg(1)), ndim);
    const int64_t b = is_t ? 1 : wrap_dim(call, int_arg(call.arg(2)), ndim);
    std::swap(order[a], order[b]);
  }
  return permute_with(call, order);
}

// ------------------------------------------------------------------ unsqueeze / squeeze / expand

OpPlan unsqueeze_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const int64_t dim = wrap_dim(call, int_arg(call.arg(1)), in.ndim() + 1);
  auto shape = in.global_shape();
  auto dims = in.dim_axes();
  shape.insert(shape.begin() + dim, 1);
  dims.insert(dims.begin() + dim, std::vector<int64_t>{});
  return single(call, call.tensors[0].layout, make_layout(in, shape, dims, in.partial()));
}

// view_as_real: a new last dim of 2 (real, imaginary), whole; view_as_complex: the last dim of 2
// folded into the dtype, so it must be whole. Both are linear over the reals: Partial passes.
OpPlan view_as_real_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  auto shape = in.global_shape();
  auto dims = in.dim_axes();
  shape.push_back(2);
  dims.emplace_back();
  return single(call, call.tensors[0].layout, make_layout(in, shape, dims, in.partial()));
}

OpPlan view_as_complex_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  if (in.ndim() < 1 || in.global_shape().back() != 2)
    fail_argument(call, 0, "the last dim is not of size 2", "a last dim of 2 (real, imaginary)");
  auto input = whole_dims(in, {in.ndim() - 1});
  auto shape = in.global_shape();
  auto dims = input->dim_axes();
  shape.pop_back();
  dims.pop_back();
  return single(call, input, make_layout(in, shape, dims, in.partial()));
}

OpPlan squeeze_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  std::vector<int64_t> candidates;
  if (call.num_args() == 1) {
    for (int64_t d = 0; d < in.ndim(); ++d) candidates.push_back(d);
  } else if (call.arg(1).isInt()) {
    candidates.push_back(wrap_dim(call, call.arg(1).toInt(), in.ndim()));
  } else {
    for (int64_t d : int_list(call.arg(1))) candidates.push_back(wrap_dim(call, d, in.ndim()));
  }
  std::vector<int64_t> squeezed;
  for (int64_t d : candidates)
    if (d < in.ndim() && in.global_shape()[d] == 1) squeezed.push_back(d);
  auto input = whole_dims(in, squeezed);
  std::vector<int64_t> shape;
  layout::DimAxes dims;
  for (int64_t d = 0; d < in.ndim(); ++d) {
    if (std::find(squeezed.begin(), squeezed.end(), d) != squeezed.end()) continue;
    shape.push_back(in.global_shape()[d]);
    dims.push_back(in.dim_axes()[d]);
  }
  OpPlan plan = single(call, input, make_layout(in, shape, dims, in.partial()));
  // squeeze() and squeeze(dim) decide on the LOCAL sizes: a candidate dim of global size > 1
  // whose shard has size 1 on some rank would be squeezed there too.
  bool shard_of_one = false;
  for (int64_t d : candidates) {
    if (d >= in.ndim() || in.dim_axes()[d].empty() || std::find(squeezed.begin(), squeezed.end(), d) != squeezed.end())
      continue;
    for (int64_t p = 0; p < in.mesh()->size() && !shard_of_one; ++p) shard_of_one = in.local_shape_at(p)[d] == 1;
  }
  if (shard_of_one) {
    // Then the local call squeezes exactly the dims of global size 1.
    plan.expand = [squeezed](const OpCall& c, torch::jit::Stack& stack) {
      at::Tensor local = stack[stack.size() - c.num_args()].toTensor();
      torch::jit::drop(stack, c.num_args());
      stack.emplace_back(at::_ops::squeeze_dims::call(local, squeezed));
    };
  }
  return plan;
}

OpPlan expand_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  auto size = int_list(call.arg(1));
  const int64_t lead = static_cast<int64_t>(size.size()) - in.ndim();
  if (lead < 0) fail_call(call, "expand to fewer dims than the tensor has");
  layout::DimAxes dims(size.size());
  std::vector<int64_t> whole;
  for (int64_t o = 0; o < static_cast<int64_t>(size.size()); ++o) {
    if (o < lead) continue;
    const int64_t d = o - lead;
    const int64_t from = in.global_shape()[d];
    if (size[o] == -1) size[o] = from;
    if (from == size[o])
      dims[o] = in.dim_axes()[d];
    else
      whole.push_back(d);  // size 1 broadcast: must be whole on every rank
  }
  auto out = make_layout(in, size, dims, in.partial());
  auto plan = single(call, whole_dims(in, whole), out);
  plan.local_shape_arg = call.arg_index("size");
  return plan;
}

// ------------------------------------------------------------------ view / reshape

std::vector<int64_t> view_shape(const OpCall& call, const Layout& in) {
  return at::infer_size(int_list(call.arg(1)), layout::numel(in.global_shape()));
}

template <bool kMayGather>
OpPlan view_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const auto out_shape = view_shape(call, in);
  const auto view = plan_view(in, out_shape);
  if (!view.exact && !kMayGather)
    fail_argument(call, 0,
                  "viewing as " + layout::shape_string(out_shape) +
                      " would cut through a sharded dim (the local shards are not whole blocks of the result)",
                  "a view that keeps every shard whole; use reshape, which redistributes first");
  OpPlan plan = single(call, view.input, view.output);
  plan.local_shape_arg = call.arg_index("size");
  if (view.exact && call.schema().name() != "aten::_reshape_alias") {
    // torch's view: the input's strides recomputed for the new shape, the same offset.
    plan.geometry = [out_shape](const at::Tensor& input) -> std::optional<ViewGeometry> {
      auto strides = at::detail::computeStride(input.sizes(), input.strides(), out_shape);
      if (!strides) return std::nullopt;  // not viewable: the meta shadow raises torch's error
      return ViewGeometry{std::vector<int64_t>(strides->begin(), strides->end()), input.storage_offset()};
    };
  }
  if (call.schema().name() == "aten::_reshape_alias") {
    auto out = view.output;
    plan.localize = [out](const OpCall& c, c10::IValue* args) {
      const auto local_shape = out->local_shape_at(c.mesh->position());
      const at::Tensor& local = args[0].toTensor();
      auto strides = at::detail::computeStride(local.sizes(), local.strides(), local_shape);
      TORCH_CHECK(strides.has_value(), "hypershard: _reshape_alias: the local shard cannot be aliased");
      args[1] = c10::IValue(local_shape);
      args[2] = c10::IValue(std::vector<int64_t>(strides->begin(), strides->end()));
    };
  }
  return plan;
}

// ------------------------------------------------------------------ slicing along one dim

// A slice's bounds along a dim of length n, normalized as torch does; `length` is the result's.
struct SliceBounds {
  int64_t start = 0, step = 1, length = 0;
};

SliceBounds slice_bounds(const c10::IValue& start_v, const c10::IValue& end_v, int64_t step, int64_t n) {
  int64_t start = start_v.isNone() ? 0 : int_arg(start_v);
  int64_t end = end_v.isNone() ? n : int_arg(end_v);
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  return {start, step, (end - start + step - 1) / step};
}

// slice(self, dim, start, end, step) of a dim sharded over one mesh axis: the result keeps the dim
// sharded there (the torch.chunk split of its own length). Output position j reads input
// start + step*j, so a rank's output chunk [a, a + m) reads the GLOBAL input range
// [start + step*a, start + step*(a + m - 1)] which it fetches and slices with the step.
OpPlan exchanged_slice_plan(const OpCall& call, int64_t dim, SliceBounds b) {
  const Layout& in = call.layout(0);
  auto shape = in.global_shape();
  shape[dim] = b.length;
  OpPlan plan = single(call, call.tensors[0].layout, make_layout(in, shape, in.dim_axes(), in.partial()));
  plan.copies = true;
  // the spans are made with the plan (the bounds are in its key)
  runtime::SpanPlan spans = runtime::owned_spans(*plan.inputs[0], *call.mesh, dim);
  const Layout& output = *plan.outputs[0];
  for (size_t m = 0; m < spans.owned.size(); ++m) {
    const runtime::Span out = runtime::member_span(output, *call.mesh, spans.axis, static_cast<int64_t>(m), dim);
    if (out.length() == 0)
      spans.wanted.emplace_back();
    else
      spans.wanted.push_back({{b.start + b.step * out.begin, b.start + b.step * (out.end - 1) + 1}});
  }
  plan.expand = [spans, dim, b](const OpCall& c, torch::jit::Stack& stack) {
    const size_t num = c.schema().arguments().size();
    const at::Tensor fetched = runtime::fetch_spans(stack[stack.size() - num].toTensor(), spans, *c.mesh);
    torch::jit::drop(stack, num);
    stack.emplace_back(fetched.slice(dim, 0, c10::nullopt, b.step).contiguous());
  };
  return plan;
}

// slice_backward(grad, input_sizes, dim, start, end, step) of a gradient sharded along dim over one
// mesh axis: the input gradient keeps that sharding. A rank's chunk [p, p + l) of the input holds
// the gradient positions j with p <= start + step*j < p + l, which it fetches and places with the
// step (zeros elsewhere).
OpPlan exchanged_slice_backward_plan(const OpCall& call, const std::vector<int64_t>& sizes, int64_t dim) {
  const Layout& grad = call.layout(0);
  const SliceBounds b = slice_bounds(call.arg(3), call.arg(4), int_arg(call.arg(5)), sizes[dim]);
  OpPlan plan = single(call, call.tensors[0].layout, make_layout(grad, sizes, grad.dim_axes(), grad.partial()));
  // the spans are made with the plan (the bounds are in its key)
  const LayoutPtr output = plan.outputs[0];
  runtime::SpanPlan spans = runtime::owned_spans(*plan.inputs[0], *call.mesh, dim);
  runtime::Span mine;  // the gradient positions this rank's chunk holds
  for (size_t m = 0; m < spans.owned.size(); ++m) {
    const runtime::Span out = runtime::member_span(*output, *call.mesh, spans.axis, static_cast<int64_t>(m), dim);
    const int64_t from = out.begin - b.start;
    const runtime::Span j{from <= 0 ? 0 : (from + b.step - 1) / b.step,
                          std::min(b.length, out.end - b.start <= 0 ? 0 : (out.end - 1 - b.start) / b.step + 1)};
    spans.wanted.push_back(j.length() > 0 ? std::vector<runtime::Span>{j} : std::vector<runtime::Span>{});
    if (static_cast<int64_t>(m) == call.mesh->coordinate(spans.axis)) mine = j;
  }
  const auto local_shape = output->local_shape_at(call.mesh->position());
  const int64_t first = b.start + b.step * mine.begin - output->global_offset_at(call.mesh->position())[dim];
  plan.expand = [spans, mine, local_shape, first, dim, b](const OpCall& c, torch::jit::Stack& stack) {
    const size_t num = c.schema().arguments().size();
    const at::Tensor local_grad = stack[stack.size() - num].toTensor();
    const at::Tensor fetched = runtime::fetch_spans(local_grad, spans, *c.mesh);
    at::Tensor result = at::zeros(local_shape, local_grad.options());
    if (mine.length() > 0) result.slice(dim, first, first + b.step * (mine.length() - 1) + 1, b.step).copy_(fetched);
    torch::jit::drop(stack, num);
    stack.emplace_back(std::move(result));
  };
  return plan;
}

// slice / select / split / unbind: local when `dim` is whole; a slice of a dim sharded over one
// axis by exchange (exchanged_slice_plan); otherwise gather the dim first.
OpPlan along_dim_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const auto dim_index = call.schema().argumentIndexWithName("dim");
  const int64_t dim = wrap_dim(call, dim_index ? int_arg(call.arg(*dim_index)) : 0, in.ndim());
  std::string name = call.schema().name();
  // a *_copy op (slice_copy, unbind_copy, ...) plans as its view with the dim whole
  const bool is_copy = name.size() > 5 && name.compare(name.size() - 5, 5, "_copy") == 0;
  if (is_copy) name.resize(name.size() - 5);
  const int64_t full_length = in.global_shape()[dim];
  if (name == "aten::slice" && !is_copy) {
    // A slice covering the whole dim (x[:, :], x[..., :n] with n >= length) stays local and
    // keeps the sharding, so it still aliases its base.
    const auto& start_v = call.arg(2);
    const auto& end_v = call.arg(3);
    const int64_t start = start_v.isNone() ? 0 : int_arg(start_v);
    const int64_t end = end_v.isNone() ? full_length : int_arg(end_v);
    if ((start == 0 || start <= -full_length) && end >= full_length && int_arg(call.arg(4)) == 1) {
      auto plan = single(call, call.tensors[0].layout, call.tensors[0].layout);
      plan.localize = [dim](const OpCall& c, c10::IValue* args) {
        args[2] = c10::IValue(int64_t{0});
        args[3] = c10::IValue(args[0].toTensor().size(dim));
      };
      return plan;
    }
    if (in.dim_axes()[dim].size() == 1 && dim_parts(in, dim) > 1)
      return exchanged_slice_plan(call, dim, slice_bounds(start_v, end_v, int_arg(call.arg(4)), full_length));
  }
  auto input = whole_dims(in, {dim});
  const Layout& whole = *input;
  OpPlan plan;
  plan.inputs.push_back(input);
  auto with_dim = [&](int64_t size) {
    auto shape = whole.global_shape();
    shape[dim] = size;
    return make_layout(whole, shape, whole.dim_axes(), whole.partial());
  };
  const int64_t length = whole.global_shape()[dim];
  if (name == "aten::select") {
    auto shape = whole.global_shape();
    auto dims = whole.dim_axes();
    shape.erase(shape.begin() + dim);
    dims.erase(dims.begin() + dim);
    plan.outputs.push_back(make_layout(whole, shape, dims, whole.partial()));
  } else if (name == "aten::slice") {
    plan.outputs.push_back(with_dim(slice_bounds(call.arg(2), call.arg(3), int_arg(call.arg(4)), length).length));
  } else if (name == "aten::narrow") {
    plan.outputs.push_back(with_dim(int_arg(call.arg(3))));
  } else if (name == "aten::split" || name == "aten::unsafe_split") {
    const int64_t size = int_arg(call.arg(1));
    const int64_t pieces = size == 0 ? 1 : std::max<int64_t>((length + size - 1) / size, 1);
    for (int64_t i = 0; i < pieces; ++i) plan.outputs.push_back(with_dim(std::min(size, length - i * size)));
  } else if (name == "aten::split_with_sizes" || name == "aten::unsafe_split_with_sizes") {
    for (int64_t size : int_list(call.arg(1))) plan.outputs.push_back(with_dim(size));
  } else if (name == "aten::unbind") {
    auto shape = whole.global_shape();
    auto dims = whole.dim_axes();
    shape.erase(shape.begin() + dim);
    dims.erase(dims.begin() + dim);
    auto piece = make_layout(whole, shape, dims, whole.partial());
    for (int64_t i = 0; i < length; ++i) plan.outputs.push_back(piece);
  }
  return plan;
}

// select_backward / slice_backward: the gradient of the whole input, zero elsewhere.
OpPlan slicing_backward_rule(const OpCall& call) {
  const Layout& grad = call.layout(0);
  const auto sizes = int_list(call.arg(1));
  const int64_t dim = wrap_dim(call, int_arg(call.arg(2)), static_cast<int64_t>(sizes.size()));
  const bool is_select = call.schema().name() == "aten::select_backward";
  if (!is_select && grad.dim_axes()[dim].size() == 1 && dim_parts(grad, dim) > 1)
    return exchanged_slice_backward_plan(call, sizes, dim);
  layout::DimAxes out_dims(sizes.size());
  layout::DimAxes grad_dims = grad.dim_axes();
  if (!is_select) grad_dims[dim].clear();
  for (int64_t o = 0, g = 0; o < static_cast<int64_t>(sizes.size()); ++o) {
    if (o == dim) {
      if (!is_select) ++g;
      continue;
    }
    out_dims[o] = grad_dims[g++];
  }
  auto input = make_layout(grad, grad.global_shape(), grad_dims, grad.partial());
  auto out = make_layout(grad, sizes, out_dims, grad.partial());
  auto plan = single(call, input, out);
  plan.local_shape_arg = call.arg_index("input_sizes");
  return plan;
}

// ------------------------------------------------------------------ diagonal

// diagonal(self, offset, dim1, dim2): dim1 and dim2 whole (the offset is GLOBAL); the other dims
// keep their sharding and come first, the diagonal last (whole). Linear: Partial passes.
OpPlan diagonal_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const int64_t n = in.ndim();
  const int64_t offset = int_arg(call.arg(1));
  const int64_t d1 = wrap_dim(call, int_arg(call.arg(2)), n), d2 = wrap_dim(call, int_arg(call.arg(3)), n);
  if (d1 == d2) fail_call(call, "diagonal dimensions cannot be identical");
  const auto& shape = in.global_shape();
  layout::DimAxes kept = in.dim_axes();
  kept[d1].clear();
  kept[d2].clear();
  auto [out_shape, out_dims] = diagonal_view(shape, kept, offset, d1, d2);
  return single(call, make_layout(in, shape, kept, in.partial()), make_layout(in, out_shape, out_dims, in.partial()));
}

// diagonal_backward(grad, input_sizes, offset, dim1, dim2): the inverse -- grad's leading dims
// go back to the input's other dims; dim1, dim2 and grad's diagonal dim are whole.
OpPlan diagonal_backward_rule(const OpCall& call) {
  const Layout& grad = call.layout(0);
  const auto sizes = int_list(call.arg(1));
  const int64_t n = static_cast<int64_t>(sizes.size());
  const int64_t d1 = wrap_dim(call, int_arg(call.arg(3)), n), d2 = wrap_dim(call, int_arg(call.arg(4)), n);
  layout::DimAxes grad_dims = grad.dim_axes();
  if (!grad_dims.empty()) grad_dims.back().clear();
  layout::DimAxes out_dims(sizes.size());
  for (int64_t o = 0, g = 0; o < n; ++o)
    if (o != d1 && o != d2) out_dims[o] = grad_dims[g++];
  auto plan = single(call, make_layout(grad, grad.global_shape(), grad_dims, grad.partial()),
                     make_layout(grad, sizes, out_dims, grad.partial()));
  plan.local_shape_arg = call.arg_index("input_sizes");
  return plan;
}

// ------------------------------------------------------------------ repeat

// repeat(self, repeats): a dim repeated once keeps its sharding (each rank's block is the
// block of the result); a dim repeated more, and the new leading dims, are whole. Linear (it
// copies elements): Partial passes.
OpPlan repeat_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const auto repeats = int_list(call.arg(1));
  const int64_t lead = static_cast<int64_t>(repeats.size()) - in.ndim();
  if (lead < 0) fail_call(call, "fewer repeats than the tensor has dims");
  layout::DimAxes kept = in.dim_axes();
  std::vector<int64_t> out_shape(repeats.begin(), repeats.begin() + lead);
  layout::DimAxes out_dims(static_cast<size_t>(lead));
  for (int64_t d = 0; d < in.ndim(); ++d) {
    if (repeats[lead + d] != 1) kept[d].clear();
    out_shape.push_back(in.global_shape()[d] * repeats[lead + d]);
    out_dims.push_back(kept[d]);
  }
  return single(call, make_layout(in, in.global_shape(), kept, in.partial()),
                make_layout(in, out_shape, out_dims, in.partial()));
}

// ------------------------------------------------------------------ cat / stack

OpPlan cat_rule(const OpCall& call) {
  const bool is_stack = call.schema().name() == "aten::stack";
  // The reference: the first DTensor operand of full rank.
  int64_t ref = -1;
  for (size_t i = 0; i < call.tensors.size(); ++i)
    if (call.tensors[i].is_dtensor && (ref < 0 || call.layout(i).ndim() > call.layout(ref).ndim())) ref = int64_t(i);
  const Layout& r = call.layout(ref);
  const int64_t dim = wrap_dim(call, int_arg(call.arg(1)), r.ndim() + (is_stack ? 1 : 0));
  // Legacy empty operands (1-D, size 0) are skipped by torch.cat. With one other operand the
  // result is that operand (a KV cache's first update: cat([empty, key], -2)): its dim stays sharded.
  const auto legacy_empty = [&](size_t i) {
    const Layout& t = call.layout(i);
    return !is_stack && t.ndim() == 1 && t.global_shape()[0] == 0 && r.ndim() != 1;
  };
  int64_t operands = 0;
  for (size_t i = 0; i < call.tensors.size(); ++i) operands += legacy_empty(i) ? 0 : 1;
  layout::DimAxes dims = r.dim_axes();
  if (!is_stack && operands > 1) dims[dim].clear();
  // Partial: sum/avg pass through; the output is Partial on every axis some operand is Partial
  // on, and an operand whole there is filled for free (rank 0 keeps it, the others hold 0) --
  // a backward pass concatenates a Partial gradient with plain ones (DeepSeek's q/k rope parts).
  layout::PartialOps partial(r.mesh()->ndim());
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const Layout& t = call.layout(i);
    for (size_t a = 0; a < t.partial().size(); ++a) {
      const auto& op = t.partial()[a];
      if (!op) continue;
      if (*op != ReduceOp::Sum && *op != ReduceOp::Avg)
        fail_argument(call, int64_t(i), partial_name(*op) + " input", "Partial(sum), Partial(avg), Replicate or Shard");
      if (partial[a] && *partial[a] != *op)
        fail_argument(call, int64_t(i), "a Partial operand that the others do not share", "operands Partial alike");
      partial[a] = op;
    }
  }
  OpPlan plan;
  int64_t total = 0;
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const Layout& t = call.layout(i);
    if (legacy_empty(i)) {
      plan.inputs.push_back(call.tensors[i].layout);
      continue;
    }
    if (t.ndim() != r.ndim()) fail_argument(call, int64_t(i), "a different number of dims", "operands of equal rank");
    // Checked here, before the inputs are gathered, so the error comes before any collective.
    for (int64_t d = 0; d < t.ndim(); ++d)
      if ((is_stack || d != dim) && t.global_shape()[d] != r.global_shape()[d])
        fail_argument(
            call, int64_t(i),
            layout::str_cat("size ", t.global_shape()[d], " at dim ", d, " differs from ", r.global_shape()[d],
                            " in another operand"),
            is_stack ? std::string("operands of equal shape") : layout::str_cat("equal sizes except along dim ", dim));
    plan.inputs.push_back(make_layout(t, t.global_shape(), dims, partial));
    total += is_stack ? 1 : t.global_shape()[dim];
  }
  auto shape = r.global_shape();
  layout::DimAxes out_dims = dims;
  if (is_stack) {
    shape.insert(shape.begin() + dim, total);
    out_dims.insert(out_dims.begin() + dim, std::vector<int64_t>{});
  } else {
    shape[dim] = total;
  }
  plan.outputs.push_back(make_layout(r, shape, out_dims, partial));
  return plan;
}

// ------------------------------------------------------------------ constant_pad_nd

// Padded dims are made whole (the added elements sit at the global ends); the others keep their
// sharding. Padding with a non-zero value is not linear, so a Partial input must be reduced then.
OpPlan constant_pad_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const auto pad = int_list(call.arg(1));
  const int64_t ndim = in.ndim();
  if (pad.size() % 2 != 0 || static_cast<int64_t>(pad.size()) / 2 > ndim)
    fail_call(call, "the padding must have an even length of at most twice the number of dims");
  std::vector<int64_t> padded;
  auto shape = in.global_shape();
  for (size_t i = 0; i < pad.size() / 2; ++i) {
    const int64_t d = ndim - 1 - static_cast<int64_t>(i);
    padded.push_back(d);
    shape[d] += pad[2 * i] + pad[2 * i + 1];
  }
  const double value = call.arg(2).toScalar().toDouble();
  if (in.has_partial() && value != 0.0)
    fail_argument(call, 0, "padding a Partial tensor with a non-zero value", "Replicate or Shard, or value 0");
  auto input = whole_dims(in, padded);
  return single(call, input, make_layout(in, shape, input->dim_axes(), in.partial()));
}

// ------------------------------------------------------------------ as_strided (backstop)

OpPlan as_strided_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  for (int64_t d = 0; d < in.ndim(); ++d)
    if (!in.dim_axes()[d].empty())
      fail_argument(call, 0, "as_strided on a sharded tensor cannot be mapped to the local shards",
                    "a tensor with no sharded dim (redistribute first), or a view op with a rule");
  const auto size = int_list(call.arg(1));
  return single(call, call.tensors[0].layout, make_layout(in, size, layout::DimAxes(size.size()), in.partial()));
}

// ------------------------------------------------------------------ reshape (autograd level)

// reshape is composite-implicit and would pick view-vs-copy from the GLOBAL strides; for a
// sharded tensor the local shards decide. Runs at the AutogradPrivateUse2 key, so the
// redistribution and the view are both recorded by autograd.
at::Tensor reshape_kernel(const at::Tensor& self, c10::SymIntArrayRef proposed) {
  auto* impl = runtime::dtensor_impl(self);
  std::vector<int64_t> sizes;
  for (const auto& s : proposed) sizes.push_back(s.expect_int());
  const Layout& in = *impl->layout();
  const auto out_shape = at::infer_size(sizes, layout::numel(in.global_shape()));
  const auto view = plan_view(in, out_shape);
  at::Tensor source = view.exact ? self : runtime::redistribute(self, view.input);
  // The local shard must also be viewable; otherwise copy it (as reshape does) first.
  const at::Tensor& local = runtime::dtensor_impl(source)->local();
  const auto local_shape = view.output->local_shape_at(impl->device_mesh()->position());
  if (!at::detail::computeStride(local.sizes(), local.strides(), local_shape).has_value() ||
      !at::detail::computeStride(source.sizes(), source.strides(), out_shape).has_value())
    return at::_ops::_unsafe_view::call(source.clone(at::MemoryFormat::Contiguous),
                                        c10::fromIntArrayRefSlow(out_shape));
  return at::_ops::view::call(source, c10::fromIntArrayRefSlow(out_shape));
}

}  // namespace

void register_reshape_kernel() { aten_autograd_kernels().impl("reshape", TORCH_FN(reshape_kernel)); }

void register_views(Registry& r) {
  r.kernels(&register_reshape_kernel);
  // The *_copy ops (what functionalization emits: the view's values in a new tensor) plan as their
  // view; a copy need not alias, so view_copy may gather where view would raise.
  const std::pair<const char*, Rule> copies[] = {
      {"aten::view_copy", &view_rule<true>},
      {"aten::expand_copy", &expand_rule},
      {"aten::diagonal_copy", &diagonal_rule},
      {"aten::permute_copy", &permute_rule},
      {"aten::transpose_copy.int", &transpose_rule},
      {"aten::unsqueeze_copy", &unsqueeze_rule},
      {"aten::squeeze_copy", &squeeze_rule},
      {"aten::squeeze_copy.dim", &squeeze_rule},
      {"aten::squeeze_copy.dims", &squeeze_rule},
      {"aten::view_as_real_copy", &view_as_real_rule},
      {"aten::view_as_complex_copy", &view_as_complex_rule},
      {"aten::t_copy", &transpose_rule},
      {"aten::as_strided_copy", &as_strided_rule},
      {"aten::narrow_copy", &along_dim_rule},
      {"aten::select_copy.int", &along_dim_rule},
      {"aten::slice_copy.Tensor", &along_dim_rule},
      {"aten::split_copy.Tensor", &along_dim_rule},
      {"aten::split_with_sizes_copy", &along_dim_rule},
      {"aten::unbind_copy.int", &along_dim_rule},
  };
  for (const auto& [op, rule] : copies) r.add(op, rule);
  r.add("aten::_reshape_alias", &view_rule<false>);
  r.add("aten::_unsafe_view", &view_rule<true>);
  r.add("aten::as_strided", &as_strided_rule);
  r.add("aten::cat", &cat_rule);
  r.add("aten::constant_pad_nd", &constant_pad_rule);
  r.add("aten::diagonal", &diagonal_rule);
  r.add("aten::repeat", &repeat_rule);
  r.add("aten::diagonal_backward", &diagonal_backward_rule);
  r.add("aten::expand", &expand_rule);
  r.add("aten::permute", &permute_rule);
  r.add("aten::select.int", &along_dim_rule);
  r.add("aten::select_backward", &slicing_backward_rule);
  r.add("aten::slice.Tensor", &along_dim_rule);
  r.add("aten::slice_backward", &slicing_backward_rule);
  r.add("aten::split.Tensor", &along_dim_rule);
  r.add("aten::split_with_sizes", &along_dim_rule);
  r.add("aten::unsafe_split.Tensor", &along_dim_rule);
  r.add("aten::unsafe_split_with_sizes", &along_dim_rule);
  r.add("aten::squeeze", &squeeze_rule);
  r.add("aten::squeeze.dim", &squeeze_rule);
  r.add("aten::squeeze.dims", &squeeze_rule);
  // in place: the wrapper takes the planned layout (the local is squeezed in place)
  r.add("aten::squeeze_", &squeeze_rule);
  r.add("aten::squeeze_.dim", &squeeze_rule);
  r.add("aten::squeeze_.dims", &squeeze_rule);
  r.add("aten::stack", &cat_rule);
  r.add("aten::t", &transpose_rule);
  r.add("aten::transpose.int", &transpose_rule);
  r.add("aten::unbind.int", &along_dim_rule);
  r.add("aten::unsqueeze", &unsqueeze_rule);
  r.add("aten::view_as_complex", &view_as_complex_rule);
  r.add("aten::view_as_real", &view_as_real_rule);
  r.add("aten::view", &view_rule<false>);
}

}  // namespace hypershard::ops
