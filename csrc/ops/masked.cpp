// Boolean masks in GLOBAL order: selections and writes whose element count depends on the data.
//
//   masked_scatter(_)(self, mask, source)    source's elements, in order, land where mask is true
//   masked_scatter_backward(grad, mask, sizes)   the gradient of source: grad's elements where
//                                            mask is true, in order, zero-padded to `sizes`
//   index.Tensor(self, [mask])               self[mask]: the selected rows, in order
//   index_put(_), _index_put_impl_(self, [mask], values, accumulate)
//                                            self[mask] = values (or +=): values either one row
//                                            per selected position, in order, or broadcast
// (reached from advanced indexing in along_dims.cpp when its index is a boolean mask; the mask
// covers self's leading dims, as transformers' `hidden[visual_pos_masks, :]` does.)
//
// Which element is the k-th true one depends on every earlier mask element. Self (grad) keeps
// its sharding on any dims the mask covers -- the batch over dp and the sequence over cp alike
// -- and the mask follows it. Let j be the last sharded dim: for each index of the dims before
// j, this rank's elements of dim j onward are one contiguous RUN of the global row-major order.
// One all-reduce (per sharding axis) of the grid of run counts, [global dims before j, chunks of
// dim j] in int64, gives each run's start, hence every local true element's GLOBAL position
// (global_positions). The grid is B x chunks for a [B, S, ...] tensor with S the last sharded
// dim; with a later dim sharded too (hidden over tp) it is as large as B x S x chunks. Then
//   masked_scatter   each rank reads the source (whole) at its positions: no data moves;
//   index_put        per-position values (whole) likewise; broadcast values as they are;
//   index, masked_scatter_backward
//                    each rank writes its selected elements at their positions into zeros of
//                    the result's shape and the parts are summed (one all-reduce per sharding
//                    axis; every position has one writer, so the sum is exact): a Replicate
//                    result of the selected elements only, as big as the whole source or values
//                    they pair with (the image features every rank holds), never self.
// Self's dims after the mask's (index, index_put) and unsharded calls are whole. The mask (and
// a sharded self's) must have the shape of self's leading dims; masked_scatter's broadcasts.
// Partial: index and masked_scatter_backward are linear in self / grad (a sum-Partial passes,
// on its own axes); the writes refuse a Partial operand in forward code and reduce it first
// inside a backward pass.
#include "ops/masked.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

#include "ops/expand_helpers.h"
#include "ops/families.h"
#include "ops/partial.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {
namespace {

using Stack = torch::jit::Stack;

// The mesh axes sharding some dim of `l`, ascending.
std::vector<int64_t> sharding_axes(const Layout& l) {
  std::vector<int64_t> axes;
  for (const auto& dim : l.dim_axes()) axes.insert(axes.end(), dim.begin(), dim.end());
  std::sort(axes.begin(), axes.end());
  return axes;
}

// Where this rank's true elements of `mask` (its block of a tensor laid out as `layout`, which
// is sharded somewhere) sit among ALL true elements in GLOBAL row-major order, in local order;
// `total` gets the global count (the same on every rank).
at::Tensor global_positions(const at::Tensor& mask, const Layout& layout, const OpCall& call, int64_t& total) {
  const runtime::DeviceMesh& mesh = *call.mesh;
  const auto& dims = layout.dim_axes();
  int64_t j = layout.ndim() - 1;
  while (dims[j].empty()) --j;  // the last sharded dim
  std::vector<int64_t> tail(static_cast<size_t>(layout.ndim() - j));
  std::iota(tail.begin(), tail.end(), j);
  const auto options = mask.options().dtype(at::kLong);
  // a byte mask selects where it is nonzero: count those, not its values
  const at::Tensor run_counts = at::sum(mask.ne(0), tail, /*keepdim=*/false, at::kLong);  // [local dims before j]

  // The grid of every rank's run counts: [global dims before j, chunks of dim j]
  std::vector<int64_t> grid_shape(layout.global_shape().begin(), layout.global_shape().begin() + j);
  grid_shape.push_back(dim_parts(layout, j));
  const auto offset = layout.global_offset_at(mesh.position());
  const int64_t chunk = mesh.chunk_index(dims[j]);
  const auto mine = [&](at::Tensor grid) {
    for (int64_t d = 0; d < j; ++d) grid = grid.narrow(d, offset[d], run_counts.size(d));
    return grid.select(j, chunk);
  };
  at::Tensor grid = at::zeros(grid_shape, options);
  mine(grid).copy_(run_counts);
  // distinct blocks: each position of the sub-mesh the sharding axes span counted once
  grid = all_reduce_axes(grid, call, sharding_axes(layout), layout::ReduceOp::Sum).reshape({-1});
  total = grid.sum().item<int64_t>();
  const at::Tensor starts = (grid.cumsum(0) - grid).view(grid_shape);

  // Local true element k of run r sits at starts[r] + (k - trues of the runs before r).
  const at::Tensor counts = run_counts.reshape({-1}), run_starts = mine(starts).reshape({-1});
  const at::Tensor before = counts.cumsum(0) - counts;
  const int64_t local = counts.sum().item<int64_t>();
  return at::repeat_interleave(run_starts - before, counts, /*dim=*/0, local) + at::arange(local, options);
}

// `rows` (one per local true element, in local order) written at their GLOBAL positions into
// zeros of `total` rows, summed over the sharding axes: every rank's rows in global order.
at::Tensor rows_in_global_order(const at::Tensor& rows, const at::Tensor& positions, int64_t total,
                                const Layout& layout, const OpCall& call) {
  auto sizes = rows.sizes().vec();
  sizes[0] = total;
  at::Tensor out = at::zeros(sizes, rows.options());
  out.index_copy_(0, positions, rows);
  return all_reduce_axes(out, call, sharding_axes(layout), layout::ReduceOp::Sum);
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

// `l`'s Partial axes when they sum (linear selections keep them), else none.
layout::PartialOps sum_partial_of(const Layout& l) {
  layout::PartialOps partial = l.partial();
  if (auto op = l.partial_op(); op && !is_sum_like(*op)) partial.assign(partial.size(), std::nullopt);
  return partial;
}

// `l`'s dims with its shard axes on the first `k` dims, the others whole.
layout::DimAxes leading_dims_kept(const Layout& l, int64_t k) {
  layout::DimAxes dims(l.dim_axes().begin(), l.dim_axes().begin() + k);
  dims.resize(static_cast<size_t>(l.ndim()));
  return dims;
}

bool any_sharded(const layout::DimAxes& dims) {
  return std::any_of(dims.begin(), dims.end(), [](const auto& axes) { return !axes.empty(); });
}

// ------------------------------------------------------------------ masked_scatter (+ backward)

// The dims of a mask (argument `mask`) that broadcasts to argument 0 (`self_name`) laid out with
// `self_dims`: aligned from the right (transformers passes [B, S, 1]), a dim it broadcasts along
// whole, the others following self's.
layout::DimAxes broadcast_mask_dims(const OpCall& call, int64_t mask, const layout::DimAxes& self_dims,
                                    const char* self_name) {
  const auto& shape = call.layout(0).global_shape();
  const auto& mshape = call.layout(mask).global_shape();
  const int64_t lead = static_cast<int64_t>(shape.size()) - static_cast<int64_t>(mshape.size());
  bool broadcasts = lead >= 0;
  for (size_t d = 0; broadcasts && d < mshape.size(); ++d)
    broadcasts = mshape[d] == shape[lead + static_cast<int64_t>(d)] || mshape[d] == 1;
  if (!broadcasts)
    not_covered(call, "a mask of shape " + layout::shape_string(mshape) + " that does not broadcast to " + self_name +
                          "'s " + layout::shape_string(shape));
  layout::DimAxes dims(mshape.size());
  for (size_t d = 0; d < mshape.size(); ++d)
    if (mshape[d] == shape[lead + static_cast<int64_t>(d)]) dims[d] = self_dims[lead + static_cast<int64_t>(d)];
  return dims;
}

void masked_scatter_expand(const LayoutPtr& self_layout, const OpCall& call, Stack& stack) {
  at::Tensor self = call.arg(0).toTensor();
  const at::Tensor mask = call.arg(1).toTensor().expand_as(self), source = call.arg(2).toTensor();
  int64_t total = 0;
  const at::Tensor positions = global_positions(mask, *self_layout, call, total);
  TORCH_CHECK(total <= source.numel(), call.name(), ": Number of elements of source < number of ones in mask");
  const auto part = source.reshape({-1}).index_select(0, positions);
  const bool inplace = call.name() == "aten::masked_scatter_";
  at::Tensor out = inplace ? self.masked_scatter_(mask, part) : self.masked_scatter(mask, part);
  replace_args(call, stack, {out});
}

OpPlan masked_scatter_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  OpPlan plan;
  plan.inputs.push_back(whole_or_refused(call, 0, self.dim_axes()));
  plan.inputs.push_back(whole_or_refused(call, 1, broadcast_mask_dims(call, 1, self.dim_axes(), "self")));
  plan.inputs.push_back(whole_or_refused(call, 2, layout::DimAxes(call.layout(2).ndim())));
  plan.outputs.push_back(plan.inputs[0]);
  if (any_sharded(self.dim_axes()))
    plan.expand = [l = plan.inputs[0]](const OpCall& c, Stack& s) { masked_scatter_expand(l, c, s); };
  return plan;
}

void masked_scatter_backward_expand(const LayoutPtr& grad_layout, const OpCall& call, Stack& stack) {
  const at::Tensor grad = call.arg(0).toTensor(), mask = call.arg(1).toTensor().expand_as(grad);
  const auto sizes = int_list(call.arg(2));
  int64_t total = 0;
  const at::Tensor positions = global_positions(mask, *grad_layout, call, total);
  const int64_t numel = layout::numel(sizes);
  TORCH_CHECK(total <= numel, call.name(), ": the mask selects ", total, " elements, more than sizes ",
              layout::shape_string(sizes), " hold");
  at::Tensor out = at::zeros({numel}, grad.options());
  out.index_copy_(0, positions, grad.masked_select(mask));
  out = all_reduce_axes(out, call, sharding_axes(*grad_layout), layout::ReduceOp::Sum).view(sizes);
  replace_args(call, stack, {out});
}

OpPlan masked_scatter_backward_rule(const OpCall& call) {
  const Layout& grad = call.layout(0);
  const auto partial = sum_partial_of(grad);
  OpPlan plan;
  plan.inputs.push_back(make_layout(grad, grad.global_shape(), grad.dim_axes(), partial));
  plan.inputs.push_back(whole_or_refused(call, 1, broadcast_mask_dims(call, 1, grad.dim_axes(), "grad_output")));
  const auto sizes = int_list(call.arg(2));
  plan.outputs.push_back(make_layout(grad, sizes, layout::DimAxes(sizes.size()), partial));
  if (any_sharded(grad.dim_axes()))
    plan.expand = [l = plan.inputs[0]](const OpCall& c, Stack& s) { masked_scatter_backward_expand(l, c, s); };
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

void bool_index_expand(const LayoutPtr& mask_layout, const OpCall& call, Stack& stack) {
  const at::Tensor self = call.arg(0).toTensor();
  const at::Tensor mask = call.arg(1).toList().get(0).toTensor();
  int64_t total = 0;
  const at::Tensor positions = global_positions(mask, *mask_layout, call, total);
  at::Tensor out = rows_in_global_order(self.index({mask}), positions, total, *mask_layout, call);
  replace_args(call, stack, {out});
}

void bool_index_put_expand(const LayoutPtr& mask_layout, bool per_position, const OpCall& call, Stack& stack) {
  at::Tensor self = call.arg(0).toTensor();
  const at::Tensor mask = call.arg(1).toList().get(0).toTensor();
  at::Tensor values = call.arg(2).toTensor();
  const bool accumulate = call.arg(3).toBool();
  if (per_position) {
    int64_t total = 0;
    const at::Tensor positions = global_positions(mask, *mask_layout, call, total);
    TORCH_CHECK(values.size(0) == total, call.name(), ": shape mismatch: ", values.size(0), " values for the ", total,
                " positions the mask selects");
    values = values.index_select(0, positions);
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
  replace_args(call, stack, {out});
}

// What both indexing rules plan for the mask: which tensor it is, how many leading dims of self
// it covers, and the shardings (self's on those dims, followed by the mask; the rest whole).
struct MaskIndexing {
  int64_t mask = -1;
  layout::DimAxes self_dims, mask_dims;
  bool sharded = false;  // the mask is: the expand runs
};

MaskIndexing mask_indexing(const OpCall& call) {
  const Layout& self = call.layout(0);
  MaskIndexing m;
  m.mask = the_mask(call);
  check_mask_shape(call, m.mask, self.global_shape());
  const int64_t k = call.layout(m.mask).ndim();
  m.self_dims = leading_dims_kept(self, k);
  m.mask_dims.assign(m.self_dims.begin(), m.self_dims.begin() + k);
  m.sharded = any_sharded(m.mask_dims);
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
  const auto partial = sum_partial_of(self);
  OpPlan plan;
  plan.inputs.push_back(make_layout(self, self.global_shape(), m.self_dims, partial));
  plan.inputs.push_back(make_layout(call.layout(m.mask), call.layout(m.mask).global_shape(), m.mask_dims));
  std::vector<int64_t> out_shape{0};  // the selected count: a placeholder the dispatch replaces
  out_shape.insert(out_shape.end(), self.global_shape().begin() + static_cast<int64_t>(m.mask_dims.size()),
                   self.global_shape().end());
  plan.outputs.push_back(make_layout(self, out_shape, layout::DimAxes(out_shape.size()), partial));
  plan.data_shaped = true;
  if (m.sharded) plan.expand = [l = plan.inputs[1]](const OpCall& c, Stack& s) { bool_index_expand(l, c, s); };
  return plan;
}

OpPlan bool_mask_index_put_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  const MaskIndexing m = mask_indexing(call);
  const int64_t values = call.tensor_index(2);
  const auto& vshape = call.layout(values).global_shape();
  const std::vector<int64_t> rest(self.global_shape().begin() + static_cast<int64_t>(m.mask_dims.size()),
                                  self.global_shape().end());
  // One row per selected position (in order), or values that broadcast to every selected row.
  const bool per_position =
      vshape.size() == rest.size() + 1 && vshape[0] != 1 && std::equal(rest.begin(), rest.end(), vshape.begin() + 1);
  OpPlan plan;
  LayoutPtr mask_layout;
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const int64_t i = static_cast<int64_t>(t);
    if (i == 0)
      plan.inputs.push_back(whole_or_refused(call, 0, m.self_dims));
    else if (i == m.mask)
      plan.inputs.push_back(mask_layout = whole_or_refused(call, i, m.mask_dims));
    else
      plan.inputs.push_back(whole_or_refused(call, i, layout::DimAxes(call.layout(i).ndim())));
  }
  plan.outputs.push_back(plan.inputs[0]);
  if (m.sharded)
    plan.expand = [mask_layout, per_position](const OpCall& c, Stack& s) {
      bool_index_put_expand(mask_layout, per_position, c, s);
    };
  return plan;
}

void register_masked(Registry& r) {
  r.add("aten::masked_scatter", &masked_scatter_rule, KeyScalars::kNone);
  r.add("aten::masked_scatter_", &masked_scatter_rule, KeyScalars::kNone);
  r.add("aten::masked_scatter_backward", &masked_scatter_backward_rule, KeyScalars::kAll);  // sizes: the shape
}

}  // namespace hypershard::ops
