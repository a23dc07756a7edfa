// Ops that assemble a new tensor from pieces: a base with a view's elements replaced (the
// *_scatter ops functionalization emits for writes through views), block_diag and _chunk_cat.
//
//   select_scatter(self, src, dim, index)   self keeps its sharding, dim too: the rank whose block
//                                           of dim holds the GLOBAL index writes src there, the
//                                           others copy their block; src (self's shape without
//                                           dim) takes self's sharding on the other dims
//   slice_scatter(self, src, dim, start, end, step)  dim whole in self and src (GLOBAL start,
//                                           end); the other dims keep self's sharding, src's alike
//   diagonal_scatter(self, src, offset, dim1, dim2)  dim1, dim2 whole (GLOBAL offset); the other
//                                           dims keep self's sharding, src's leading dims alike
//                                           and its diagonal dim whole
//   block_diag(tensors)                     every operand whole (each block's place depends on
//                                           every operand's shape); a Replicate result
//   _chunk_cat(tensors, dim, num_chunks)    the dims before dim are a batch: they keep the first
//                                           operand's sharding in every operand and the result;
//                                           dim and the dims after it are whole
//
// Partial: each op copies elements and fills zeros, so it is linear in all its operands together:
// a sum/avg Partial passes. The result is Partial on every axis some operand is Partial(sum|avg)
// on (an operand whole there is filled for free: rank 0 keeps it, the others hold zeros), except
// on an axis that shards select_scatter's dim (src is reduced first there). Operands Partial with
// different ops on one axis, and max/min Partials, are reduced first (exact).
#include <ATen/ATen.h>

#include <algorithm>

#include "ops/diagonal.h"
#include "ops/families.h"

namespace hypershard::ops {
namespace {

using Stack = torch::jit::Stack;

// The Partial every operand and the result take: per axis the operands' common sum/avg op;
// `excluded` axes (and axes whose operands disagree) take none (their Partials are reduced).
layout::PartialOps joint_partial(const OpCall& call, const std::vector<bool>& excluded = {}) {
  const int64_t axes = call.mesh->mesh()->ndim();
  layout::PartialOps out(static_cast<size_t>(axes));
  for (int64_t axis = 0; axis < axes; ++axis) {
    if (!excluded.empty() && excluded[axis]) continue;
    bool agree = true;
    for (size_t t = 0; t < call.tensors.size(); ++t) {
      const auto& op = call.layout(static_cast<int64_t>(t)).partial()[axis];
      if (!op) continue;
      if (!is_sum_like(*op) || (out[axis] && *out[axis] != *op))
        agree = false;
      else
        out[axis] = op;
    }
    if (!agree) out[axis] = std::nullopt;
  }
  return out;
}

// Self's per-dim mesh axes with the `whole` dims cleared.
layout::DimAxes without(const Layout& self, std::initializer_list<int64_t> whole) {
  auto dims = self.dim_axes();
  for (int64_t d : whole) dims[d].clear();
  return dims;
}

// src's layout: `dims` (self's per-dim axes for src's dims), the joint Partial. src must have the
// GLOBAL shape of the view it replaces, checked here on every rank alike (torch checks it in the
// kernel, which sees only the blocks).
LayoutPtr src_layout(const OpCall& call, const std::vector<int64_t>& view_shape, layout::DimAxes dims,
                     const layout::PartialOps& partial) {
  const Layout& src = call.layout(1);
  if (src.global_shape() != view_shape)
    fail_argument(call, 1, "has the shape " + layout::shape_string(src.global_shape()),
                  "the shape " + layout::shape_string(view_shape) + " of the view of self it replaces");
  return make_layout(src, src.global_shape(), std::move(dims), partial);
}

std::vector<int64_t> without_dim(std::vector<int64_t> shape, int64_t dim) {
  shape.erase(shape.begin() + dim);
  return shape;
}

// ------------------------------------------------------------------ the *_scatter ops

OpPlan select_scatter_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  const int64_t dim = wrap_dim(call, int_arg(call.arg(2)), self.ndim());
  const int64_t size = self.global_shape()[dim];
  int64_t index = int_arg(call.arg(3));
  if (index < -size || index >= size)
    fail_call(call, layout::str_cat("index ", index, " is out of range for dim ", dim, " of size ", size));
  if (index < 0) index += size;
  std::vector<bool> shards_dim(static_cast<size_t>(self.mesh()->ndim()), false);
  for (int64_t axis : self.dim_axes()[dim]) shards_dim[axis] = true;
  const auto partial = joint_partial(call, shards_dim);
  OpPlan plan;
  plan.inputs.push_back(make_layout(self, self.global_shape(), self.dim_axes(), partial));
  auto src_dims = self.dim_axes();
  src_dims.erase(src_dims.begin() + dim);
  plan.inputs.push_back(src_layout(call, without_dim(self.global_shape(), dim), std::move(src_dims), partial));
  plan.outputs.push_back(plan.inputs[0]);
  if (self.dim_axes()[dim].empty()) return plan;
  // dim sharded: the block holding the GLOBAL index writes, at its local position
  const int64_t first = self.global_offset_at(call.mesh->position())[dim];
  const int64_t length = self.local_shape_at(call.mesh->position())[dim];
  const bool mine = index >= first && index < first + length;
  const int64_t local_index = index - first;
  plan.expand = [mine, local_index, dim](const OpCall& c, Stack& stack) {
    const size_t num = static_cast<size_t>(c.num_args());
    const at::Tensor local = stack[stack.size() - num].toTensor();
    const at::Tensor src = stack[stack.size() - num + 1].toTensor();
    torch::jit::drop(stack, num);
    stack.emplace_back(mine ? at::select_scatter(local, src, dim, local_index) : local.clone());
  };
  return plan;
}

OpPlan slice_scatter_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  const int64_t dim = wrap_dim(call, int_arg(call.arg(2)), self.ndim());
  const int64_t step = int_arg(call.arg(5));
  if (step <= 0) fail_call(call, "slice step must be positive");
  // the slice's length along dim, as torch bounds it (GLOBAL start and end)
  const int64_t n = self.global_shape()[dim];
  int64_t start = call.arg(3).isNone() ? 0 : int_arg(call.arg(3));
  int64_t end = call.arg(4).isNone() ? n : int_arg(call.arg(4));
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  auto view_shape = self.global_shape();
  view_shape[dim] = (end - start + step - 1) / step;
  const auto partial = joint_partial(call);
  auto dims = without(self, {dim});
  OpPlan plan;
  plan.inputs.push_back(make_layout(self, self.global_shape(), dims, partial));
  plan.inputs.push_back(src_layout(call, view_shape, dims, partial));
  plan.outputs.push_back(plan.inputs[0]);
  return plan;
}

OpPlan diagonal_scatter_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  const int64_t n = self.ndim();
  const int64_t offset = int_arg(call.arg(2));
  const int64_t d1 = wrap_dim(call, int_arg(call.arg(3)), n), d2 = wrap_dim(call, int_arg(call.arg(4)), n);
  if (d1 == d2) fail_call(call, "diagonal dimensions cannot be identical");
  const auto& shape = self.global_shape();
  const auto partial = joint_partial(call);
  auto dims = without(self, {d1, d2});
  auto [view_shape, src_dims] = diagonal_view(shape, dims, offset, d1, d2);
  OpPlan plan;
  plan.inputs.push_back(make_layout(self, self.global_shape(), dims, partial));
  plan.inputs.push_back(src_layout(call, view_shape, std::move(src_dims), partial));
  plan.outputs.push_back(plan.inputs[0]);
  return plan;
}

// ------------------------------------------------------------------ block_diag / _chunk_cat

OpPlan block_diag_rule(const OpCall& call) {
  const auto shapes = meta_output_shapes(call);
  const auto partial = joint_partial(call);
  OpPlan plan;
  for (const auto& t : call.tensors)
    plan.inputs.push_back(make_layout(*t.layout, t.layout->global_shape(), layout::DimAxes(t.layout->ndim()), partial));
  plan.outputs.push_back(make_layout(call.layout(0), shapes.at(0), layout::DimAxes(shapes.at(0).size()), partial));
  return plan;
}

OpPlan chunk_cat_rule(const OpCall& call) {
  const auto shapes = meta_output_shapes(call);  // torch's checks: equal leading sizes, num_chunks >= 1
  const Layout& first = call.layout(0);
  const int64_t dim = wrap_dim(call, int_arg(call.arg(1)), first.ndim());
  const auto partial = joint_partial(call);
  layout::DimAxes batch(first.dim_axes().begin(), first.dim_axes().begin() + dim);
  OpPlan plan;
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    layout::DimAxes dims(static_cast<size_t>(l.ndim()));
    std::copy(batch.begin(), batch.end(), dims.begin());
    plan.inputs.push_back(make_layout(l, l.global_shape(), std::move(dims), partial));
  }
  layout::DimAxes out_dims = batch;
  out_dims.resize(shapes.at(0).size());
  plan.outputs.push_back(make_layout(first, shapes.at(0), std::move(out_dims), partial));
  return plan;
}

}  // namespace

void register_assembly(Registry& r) {
  r.add("aten::_chunk_cat", &chunk_cat_rule);
  r.add("aten::block_diag", &block_diag_rule);
  r.add("aten::diagonal_scatter", &diagonal_scatter_rule);
  r.add("aten::select_scatter", &select_scatter_rule);
  r.add("aten::slice_scatter", &slice_scatter_rule);
}

}  // namespace hypershard::ops
