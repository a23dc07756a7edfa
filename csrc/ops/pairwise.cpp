// Products and distances over pairs of rows (torch.cdist, F.pdist, F.bilinear): every pair is
// computed from whole feature vectors, so the feature dims are whole and the row dims keep
// their sharding.
//
//   cdist      _cdist_forward(x1 [*B, P, M], x2 [*B, R, M]) -> [*B, P, R]: the batch sharded
//              alike in x1 and x2 (when their batch shapes agree; a broadcast batch is whole), x1's
//              rows P keep their sharding (the result's dim -2), x2's rows R theirs (dim -1) on
//              other mesh axes, M whole (a p-norm of the differences: not a sum of per-block
//              terms, except p = 2 squared). The p = 2 algorithm (matrix product or direct)
//              torch picks from the row counts is pinned to the GLOBAL counts' choice, so a block
//              computes what one device would. _cdist_backward(grad, x1, x2, p, cdist) -> grad_x1:
//              the same layouts; grad_x1 is Partial(sum) over the axes sharding R (each rank adds
//              its columns' terms; torch computes grad_x2 with the same op, x1 and x2 swapped)
//   pdist      _pdist_forward, _pdist_backward: the input whole (the result lists the pairs of
//              rows in triangle order, which no row block maps to), computed on every rank
//   trilinear  _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim) (F.bilinear and its
//              gradients): the three operands are unsqueezed at their expand dims to a common
//              rank, multiplied and summed over sumdim. A kept dim (not summed) keeps its
//              sharding in every operand that has it (the first sharded operand's axes); a
//              summed dim is whole
//
// Partial: none of these passes a Partial (distances are not linear; _trilinear is linear in
// each operand but its backward reaches it with two operands from the same sum): a sum Partial
// operand is refused in forward code and reduced in a backward pass.
//
// Not covered: a sharded feature dim M (p = 2 could sum squared parts) and a sharded summed dim
// of _trilinear (a Partial(sum) result) are gathered.
#include <ATen/ATen.h>

#include <algorithm>

#include "ops/families.h"
#include "ops/mesh_axes.h"
#include "ops/partial.h"

namespace hypershard::ops {
namespace {

void refuse_partials(const OpCall& call) {
  for (size_t t = 0; t < call.tensors.size(); ++t)
    refuse_sum_partial(call, static_cast<int64_t>(t), redistribute_partial_first());
}

// ------------------------------------------------------------------ cdist

template <bool kBackward>
OpPlan cdist_rule(const OpCall& call) {
  const auto shapes = meta_output_shapes(call);  // torch's checks, on every rank alike
  refuse_partials(call);
  const int64_t x1_t = kBackward ? 1 : 0, x2_t = kBackward ? 2 : 1;
  const Layout& x1 = call.layout(x1_t);
  const Layout& x2 = call.layout(x2_t);
  const int64_t n = x1.ndim();
  // the pair tensors (the result, and a backward's grad and cdist)
  std::vector<int64_t> pairs_t;
  if (kBackward) pairs_t = {0, 3};
  bool alike = x2.ndim() == n;
  for (int64_t d = 0; alike && d < n - 2; ++d) alike = x2.global_shape()[d] == x1.global_shape()[d];
  for (int64_t t : pairs_t) alike = alike && call.layout(t).ndim() == n;
  auto dim_of = [&](int64_t t, int64_t d) -> const std::vector<int64_t>* {
    return t < static_cast<int64_t>(call.tensors.size()) ? &call.layout(t).dim_axes()[d] : nullptr;
  };
  const int64_t grad_t = kBackward ? 0 : 99;
  std::vector<int64_t> used;
  layout::DimAxes batch(static_cast<size_t>(std::max<int64_t>(n - 2, 0)));
  if (alike)
    for (int64_t d = 0; d < n - 2; ++d)
      batch[d] = take_axes({dim_of(x1_t, d), dim_of(x2_t, d), dim_of(grad_t, d)}, used);
  const auto rows1 = take_axes({dim_of(x1_t, n - 2), kBackward ? dim_of(grad_t, n - 2) : nullptr}, used);
  const auto rows2 = take_axes({dim_of(x2_t, x2.ndim() - 2), kBackward ? dim_of(grad_t, n - 1) : nullptr}, used);

  auto points = [&](const Layout& l, const std::vector<int64_t>& rows, layout::PartialOps partial = {}) {
    layout::DimAxes dims(static_cast<size_t>(l.ndim()));
    if (alike) std::copy(batch.begin(), batch.end(), dims.begin());
    dims[l.ndim() - 2] = rows;
    return make_layout(l, l.global_shape(), std::move(dims), std::move(partial));
  };
  auto distances = [&](const Layout& like, const std::vector<int64_t>& shape) {
    const int64_t r = static_cast<int64_t>(shape.size());
    layout::DimAxes dims(shape.size());
    if (alike) std::copy(batch.begin(), batch.end(), dims.begin());
    dims[r - 2] = rows1;
    dims[r - 1] = rows2;
    return make_layout(like, shape, std::move(dims));
  };
  OpPlan plan;
  if (!kBackward) {
    plan.inputs = {points(x1, rows1), points(x2, rows2)};
    plan.outputs = {distances(x1, shapes.at(0))};
    // p = 2: torch multiplies matrices when either side has more than 25 rows (compute_mode
    // None); a block must follow the GLOBAL counts' choice (1: always the product, 2: never)
    const auto mode = call.arg(3);
    const bool default_mode = mode.isNone() || mode.toInt() == 0;
    if (call.arg(2).toDouble() == 2.0 && default_mode && (!rows1.empty() || !rows2.empty())) {
      const int64_t global = x1.global_shape()[n - 2] > 25 || x2.global_shape()[x2.ndim() - 2] > 25 ? 1 : 2;
      plan.localize = [global](const OpCall&, c10::IValue* args) { args[3] = c10::IValue(global); };
    }
  } else {
    const Layout& grad = call.layout(0);
    const Layout& cdist = call.layout(3);
    plan.inputs = {distances(grad, grad.global_shape()), points(x1, rows1), points(x2, rows2),
                   distances(cdist, cdist.global_shape())};
    layout::PartialOps summed(static_cast<size_t>(x1.mesh()->ndim()));
    for (int64_t a : rows2) summed[a] = ReduceOp::Sum;
    if (rows2.empty()) summed.clear();
    plan.outputs = {points(x1, rows1, std::move(summed))};
  }
  skip_empty_blocks(plan);
  return plan;
}

// ------------------------------------------------------------------ pdist

OpPlan whole_rule(const OpCall& call) {
  const auto shapes = meta_output_shapes(call);
  refuse_partials(call);
  OpPlan plan;
  for (const auto& t : call.tensors) plan.inputs.push_back(replicate_like(*t.layout, t.layout->global_shape()));
  for (const auto& shape : shapes) plan.outputs.push_back(replicate_like(call.layout(0), shape));
  return plan;
}

// ------------------------------------------------------------------ trilinear

OpPlan trilinear_rule(const OpCall& call) {
  const auto shapes = meta_output_shapes(call);  // torch's checks
  refuse_partials(call);
  std::vector<int64_t> expand[3];
  for (int t = 0; t < 3; ++t) expand[t] = int_list(call.arg(3 + t));
  const auto sumdim = int_list(call.arg(6));
  const int64_t rank = call.layout(0).ndim() + static_cast<int64_t>(expand[0].size());
  auto in = [](const std::vector<int64_t>& list, int64_t v) {
    return std::find(list.begin(), list.end(), v) != list.end();
  };
  // where[t][v]: operand t's dim at the common dim v, -1 where t is unsqueezed
  std::vector<std::vector<int64_t>> where(3, std::vector<int64_t>(static_cast<size_t>(rank), -1));
  for (int t = 0; t < 3; ++t) {
    int64_t j = 0;
    for (int64_t v = 0; v < rank; ++v)
      if (!in(expand[t], v)) where[t][v] = j++;
    if (j != call.layout(t).ndim()) fail_call(call, "an operand's rank plus its expand dims differs from the first's");
  }
  std::vector<int64_t> used;
  layout::DimAxes axes(static_cast<size_t>(rank));
  for (int64_t v = 0; v < rank; ++v) {
    if (in(sumdim, v)) continue;
    std::vector<const std::vector<int64_t>*> candidates;
    int64_t size = -1;
    bool same = true;
    for (int t = 0; t < 3; ++t) {
      if (where[t][v] < 0) continue;
      const int64_t s = call.layout(t).global_shape()[where[t][v]];
      same = same && (size < 0 || s == size);
      size = s;
      candidates.push_back(&call.layout(t).dim_axes()[where[t][v]]);
    }
    if (!same) continue;  // sizes that broadcast: whole
    for (const auto* c : candidates) {
      axes[v] = take_axes({c}, used);
      if (!axes[v].empty()) break;
    }
  }
  OpPlan plan;
  for (int t = 0; t < 3; ++t) {
    const Layout& l = call.layout(t);
    layout::DimAxes dims(static_cast<size_t>(l.ndim()));
    for (int64_t v = 0; v < rank; ++v)
      if (where[t][v] >= 0) dims[where[t][v]] = axes[v];
    plan.inputs.push_back(make_layout(l, l.global_shape(), std::move(dims)));
  }
  const auto& shape = shapes.at(0);
  layout::DimAxes out_dims;
  for (int64_t v = 0; v < rank; ++v)
    if (!in(sumdim, v)) out_dims.push_back(axes[v]);
  if (out_dims.size() != shape.size()) fail_call(call, "internal error: the result's rank is not the kept dims'");
  plan.outputs.push_back(make_layout(call.layout(0), shape, std::move(out_dims)));
  skip_empty_blocks(plan);
  return plan;
}

}  // namespace

void register_pairwise(Registry& r) {
  // p, compute_mode and the expand/sum dims change the plan
  r.add("aten::_cdist_backward", &cdist_rule<true>, KeyScalars::kAll);
  r.add("aten::_cdist_forward", &cdist_rule<false>, KeyScalars::kAll);
  r.add("aten::_pdist_backward", &whole_rule, KeyScalars::kAll);
  r.add("aten::_pdist_forward", &whole_rule, KeyScalars::kAll);
  r.add("aten::_trilinear", &trilinear_rule, KeyScalars::kAll);
}

}  // namespace hypershard::ops
