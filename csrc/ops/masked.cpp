// Boolean masks in GLOBAL order: selections and writes whose element count depends on the data.
//
//   masked_scatter(_)(self, mask, source)    source's elements, in order, land where mask is true
//   index.Tensor(self, [mask])               self[mask]: the selected rows, in order
//   index_put(_), _index_put_impl_(self, [mask], values, accumulate)
//                                            self[mask] = values (or +=): values either one row
//                                            per selected position, in order, or broadcast
// (reached from advanced indexing in along_dims.cpp when its index is a boolean mask; the mask
// covers self's leading dims, as transformers' `hidden[visual_pos_masks, :]` does.)
//
// Which element is the k-th true one depends on every earlier mask element. When self is sharded
// on dim 0 only (any number of mesh axes; the other dims whole) the global row-major order is
// the order of the dim-0 chunks, so each rank needs only the number of true elements on the
// chunks before its own: ONE all-gather of one count per rank (a collective of a few bytes) gives
// its offset into the GLOBAL order. Then
//   masked_scatter   source (whole) is read from that offset: self keeps its sharding, no data
//                    moves (before: everything gathered and the result Replicate);
//   index_put        per-position values (whole) likewise from that offset; broadcast values as
//                    they are; self keeps its sharding;
//   index            each rank selects its rows and the rows are all-gathered in chunk order
//                    (padded to the longest, one collective per sharding axis): a Replicate
//                    result of the selected rows only, never self.
// Otherwise (no sharding, or another dim sharded) self, mask and source/values are whole, and so
// is the result. The mask (and a sharded self's) must have the shape of self's leading dims.
// Partial: index is linear in self (a sum-Partial self passes, on its own axes); the writes
// refuse a Partial operand in forward code and reduce it first inside a backward pass.
#include "ops/masked.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "ops/families.h"
#include "ops/partial.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {
namespace {

using Stack = torch::jit::Stack;

// The mesh axes sharding dim 0 of `l`, when no other dim is sharded; nullopt otherwise.
std::optional<std::vector<int64_t>> dim0_only_axes(const Layout& l) {
  if (l.ndim() == 0) return std::nullopt;
  for (int64_t d = 1; d < l.ndim(); ++d)
    if (!l.dim_axes()[d].empty()) return std::nullopt;
  if (l.dim_axes()[0].empty()) return std::nullopt;
  return l.dim_axes()[0];
}

// Where this rank's true mask elements sit in the GLOBAL order (one all-gather of the counts).
struct GlobalOrder {
  std::vector<int64_t> counts;  // true elements per dim-0 chunk
  int64_t offset = 0;           // before this rank's chunk
  int64_t count = 0;            // in this rank's chunk
};

GlobalOrder global_order(const at::Tensor& mask, const OpCall& call, const std::vector<int64_t>& axes) {
  const auto counts =
      runtime::all_gather_in_chunk_order(mask.sum().reshape({1}).to(at::kLong), *call.mesh, axes, 0).cpu();
  GlobalOrder order;
  order.counts.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + counts.numel());
  const int64_t mine = call.mesh->chunk_index(axes);
  for (int64_t c = 0; c < mine; ++c) order.offset += order.counts[c];
  order.count = order.counts[mine];
  return order;
}

void check_mask_shape(const OpCall& call, int64_t mask, const std::vector<int64_t>& self_shape) {
  const auto& shape = call.layout(mask).global_shape();
  if (shape.size() > self_shape.size() || !std::equal(shape.begin(), shape.end(), self_shape.begin()))
    not_covered(call, "a boolean mask index of shape " + layout::shape_string(shape) +
                          " that is not self's leading dims " + layout::shape_string(self_shape));
}

// A write's operand that may not be Partial (forward: the house error; backward: reduced).
LayoutPtr whole_or_refused(const OpCall& call, int64_t t, layout::DimAxes dims) {
  refuse_sum_partial(call, t, redistribute_partial_first());
  return make_layout(call.layout(t), call.layout(t).global_shape(), std::move(dims));
}

// `ndim` whole dims, dim 0 sharded over `axes` when given.
layout::DimAxes dims_with_dim0(int64_t ndim, const std::optional<std::vector<int64_t>>& axes) {
  layout::DimAxes dims(static_cast<size_t>(ndim));
  if (ndim > 0 && axes) dims[0] = *axes;
  return dims;
}

// ------------------------------------------------------------------ masked_scatter

void masked_scatter_expand(const std::vector<int64_t>& axes, const OpCall& call, Stack& stack) {
  at::Tensor self = call.arg(0).toTensor();
  const at::Tensor mask = call.arg(1).toTensor().expand_as(self), source = call.arg(2).toTensor();
  const auto order = global_order(mask, call, axes);
  const auto part = source.reshape({-1}).narrow(0, order.offset, order.count);
  const bool inplace = call.name() == "aten::masked_scatter_";
  at::Tensor out = inplace ? self.masked_scatter_(mask, part) : self.masked_scatter(mask, part);
  torch::jit::drop(stack, call.num_args());
  stack.emplace_back(out);
}

OpPlan masked_scatter_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  const auto& shape = self.global_shape();
  // The mask broadcasts to self (transformers passes [B, S, 1]): its dims align from the right;
  // a dim it broadcasts along is whole, its dim aligned with self's dim 0 follows self's sharding.
  const auto& mshape = call.layout(1).global_shape();
  const int64_t lead = static_cast<int64_t>(shape.size()) - static_cast<int64_t>(mshape.size());
  bool broadcasts = lead >= 0;
  for (size_t d = 0; broadcasts && d < mshape.size(); ++d)
    broadcasts = mshape[d] == shape[lead + static_cast<int64_t>(d)] || mshape[d] == 1;
  if (!broadcasts)
    not_covered(call, "a mask of shape " + layout::shape_string(mshape) + " that does not broadcast to self's " +
                          layout::shape_string(shape));
  OpPlan plan;
  const auto axes = dim0_only_axes(self);
  const bool mask_dim0 = lead == 0 && !mshape.empty() && mshape[0] == shape[0];  // not broadcast there
  plan.inputs.push_back(whole_or_refused(call, 0, dims_with_dim0(self.ndim(), axes)));
  plan.inputs.push_back(
      whole_or_refused(call, 1, dims_with_dim0(static_cast<int64_t>(mshape.size()), mask_dim0 ? axes : std::nullopt)));
  plan.inputs.push_back(whole_or_refused(call, 2, layout::DimAxes(call.layout(2).ndim())));
  plan.outputs.push_back(plan.inputs[0]);
  if (axes) plan.expand = [a = *axes](const OpCall& c, Stack& s) { masked_scatter_expand(a, c, s); };
  return plan;
}

// ------------------------------------------------------------------ index / index_put with a mask

// The index list's only tensor: a boolean mask at position 0 (others None); the mask's index
// in call.tensors, or raises NotCovered.
int64_t the_mask(const OpCall& call) {
  const auto list = call.arg(1).toList();
  int64_t found = -1;
  for (size_t i = 0; i < list.size(); ++i) {
    const c10::IValue item = list.get(i);
    if (!item.isTensor() || !item.toTensor().defined()) continue;
    const auto type = item.toTensor().scalar_type();
    if (i != 0 || (type != at::kBool && type != at::kByte))
      not_covered(call, "a boolean mask index other than one mask over self's leading dims");
    found = call.tensor_index(1, 0);
  }
  if (found < 0) not_covered(call, "no boolean mask index");
  return found;
}

// Rows of `local` (this rank's selection) all-gathered in chunk order, each chunk's padding cut.
at::Tensor gather_rows(const at::Tensor& local, const std::vector<int64_t>& counts, const OpCall& call,
                       const std::vector<int64_t>& axes) {
  const int64_t longest = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  auto sizes = local.sizes().vec();
  sizes[0] = longest - local.size(0);
  const auto padded = sizes[0] > 0 ? at::cat({local, at::zeros(sizes, local.options())}, 0) : local;
  const at::Tensor all = runtime::all_gather_in_chunk_order(padded.contiguous(), *call.mesh, axes, 0);
  std::vector<at::Tensor> pieces;
  for (size_t c = 0; c < counts.size(); ++c)
    pieces.push_back(all.narrow(0, static_cast<int64_t>(c) * longest, counts[c]));
  return at::cat(pieces, 0);
}

void bool_index_expand(const std::vector<int64_t>& axes, const OpCall& call, Stack& stack) {
  const at::Tensor self = call.arg(0).toTensor();
  const auto list = call.arg(1).toList();
  const at::Tensor mask = list.get(0).toTensor();
  at::Tensor out = gather_rows(self.index({mask}), global_order(mask, call, axes).counts, call, axes);
  torch::jit::drop(stack, call.num_args());
  stack.emplace_back(out);
}

void bool_index_put_expand(const std::vector<int64_t>& axes, bool per_position, const OpCall& call, Stack& stack) {
  at::Tensor self = call.arg(0).toTensor();
  const auto list = call.arg(1).toList();
  const at::Tensor mask = list.get(0).toTensor();
  at::Tensor values = call.arg(2).toTensor();
  const bool accumulate = call.arg(3).toBool();
  if (per_position) {
    const auto order = global_order(mask, call, axes);
    values = values.narrow(0, order.offset, order.count);
  }
  c10::List<std::optional<at::Tensor>> indices;
  indices.push_back(mask);
  at::Tensor out;
  const auto name = call.name();
  if (name == "aten::index_put")
    out = at::index_put(self, indices, values, accumulate);
  else if (name == "aten::index_put_")
    out = self.index_put_(indices, values, accumulate);
  else
    out = at::_index_put_impl_(self, indices, values, accumulate, call.arg(4).toBool());
  torch::jit::drop(stack, call.num_args());
  stack.emplace_back(out);
}

// What both indexing rules plan for the mask: which tensor it is, how many leading dims of self
// it covers, and the shardings (dim 0 of self and mask over `axes`, or everything whole).
struct MaskIndexing {
  int64_t mask = -1;
  int64_t k = 0;
  std::optional<std::vector<int64_t>> axes;
  layout::DimAxes self_dims, mask_dims;
};

MaskIndexing mask_indexing(const OpCall& call) {
  const Layout& self = call.layout(0);
  MaskIndexing m;
  m.mask = the_mask(call);
  check_mask_shape(call, m.mask, self.global_shape());
  m.k = call.layout(m.mask).ndim();
  m.axes = dim0_only_axes(self);
  m.self_dims = dims_with_dim0(self.ndim(), m.axes);
  m.mask_dims = dims_with_dim0(m.k, m.axes);
  return m;
}

}  // namespace

bool has_bool_mask_index(const OpCall& call) {
  const auto list = call.arg(1).toList();
  for (size_t i = 0; i < list.size(); ++i) {
    const c10::IValue item = list.get(i);
    if (item.isTensor() && item.toTensor().defined() &&
        (item.toTensor().scalar_type() == at::kBool || item.toTensor().scalar_type() == at::kByte))
      return true;
  }
  return false;
}

OpPlan bool_mask_index_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  const MaskIndexing m = mask_indexing(call);
  layout::PartialOps partial = self.partial();
  if (auto op = self.partial_op(); op && !is_sum_like(*op)) partial.assign(partial.size(), std::nullopt);
  OpPlan plan;
  plan.inputs.push_back(make_layout(self, self.global_shape(), m.self_dims, partial));
  plan.inputs.push_back(make_layout(call.layout(m.mask), call.layout(m.mask).global_shape(), m.mask_dims));
  std::vector<int64_t> out_shape{0};  // the selected count: a placeholder the dispatch replaces
  out_shape.insert(out_shape.end(), self.global_shape().begin() + m.k, self.global_shape().end());
  plan.outputs.push_back(make_layout(self, out_shape, layout::DimAxes(out_shape.size()), partial));
  plan.data_shaped = true;
  if (m.axes) plan.expand = [a = *m.axes](const OpCall& c, Stack& s) { bool_index_expand(a, c, s); };
  return plan;
}

OpPlan bool_mask_index_put_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  const MaskIndexing m = mask_indexing(call);
  const int64_t values = call.tensor_index(2);
  const auto& vshape = call.layout(values).global_shape();
  const std::vector<int64_t> rest(self.global_shape().begin() + m.k, self.global_shape().end());
  // One row per selected position (in order), or values that broadcast to every selected row.
  const bool per_position =
      vshape.size() == rest.size() + 1 && vshape[0] != 1 && std::equal(rest.begin(), rest.end(), vshape.begin() + 1);
  OpPlan plan;
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const int64_t i = static_cast<int64_t>(t);
    if (i == 0)
      plan.inputs.push_back(whole_or_refused(call, 0, m.self_dims));
    else if (i == m.mask)
      plan.inputs.push_back(whole_or_refused(call, i, m.mask_dims));
    else
      plan.inputs.push_back(whole_or_refused(call, i, layout::DimAxes(call.layout(i).ndim())));
  }
  plan.outputs.push_back(plan.inputs[0]);
  if (m.axes)
    plan.expand = [a = *m.axes, per_position](const OpCall& c, Stack& s) {
      bool_index_put_expand(a, per_position, c, s);
    };
  return plan;
}

void register_masked(Registry& r) {
  r.add("aten::masked_scatter", &masked_scatter_rule, KeyScalars::kNone);
  r.add("aten::masked_scatter_", &masked_scatter_rule, KeyScalars::kNone);
}

}  // namespace hypershard::ops
