// Lookups: each output element is found from one element of a "query" tensor in a whole table,
// so the query keeps its sharding (any dims) and the table is read whole.
//
//   searchsorted.Tensor(sorted_sequence, self, ..., sorter)  query self; table sorted_sequence (and
//                                                  sorter): 1-D whole; N-D: its leading dims go
//                                                  with self's (row i of self searches row i), its
//                                                  last dim whole
//   bucketize.Tensor(self, boundaries, ...)        query self; table boundaries (1-D, whole)
//   take(self, index)                              query index (its output has index's shape);
//                                                  table self, whole: the indices are GLOBAL
//                                                  positions in the flattened self
//   isin.Tensor_Tensor(elements, test_elements)    query elements; table test_elements, whole
//   isin.Tensor_Scalar(elements, test_element)     query elements (the table is a number)
//   isin.Scalar_Tensor(element, test_elements)     the table whole; a Replicate 0-d result
//   put(_)(self, index, source, accumulate)        take's write and backward: see put_rule
//
// Output: the query's layout. Partial: a search (or a membership test) maps each value through a
// step function, which is not linear, so a sum/avg Partial query is an error (default mode
// reduces it first); take only selects elements of the table (linear in self): a sum Partial
// table passes through to the output on the mesh axes that do not shard the index (reduced first
// on those that do). Integer indices are never Partial.
#include "ops/families.h"
#include "ops/partial.h"

namespace hypershard::ops {
namespace {

// The output's layout: the query's sharding, with `partial` (none for a search).
LayoutPtr query_output(const Layout& query, const std::vector<int64_t>& shape, layout::PartialOps partial = {}) {
  return make_layout(query, shape, query.dim_axes(), std::move(partial));
}

OpPlan searchsorted_rule(const OpCall& call) {
  const int64_t table = call.tensor_index(0), query = call.tensor_index(1);
  refuse_sum_partial(call, query, redistribute_partial_first("a search is not linear"));
  const Layout& q = call.layout(query);
  const Layout& seq = call.layout(table);
  OpPlan plan;
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    if (static_cast<int64_t>(t) == query) {
      plan.inputs.push_back(make_layout(q, q.global_shape(), q.dim_axes()));
      continue;
    }
    // the table and its sorter: leading dims with the query's (N-D), the searched dim whole
    layout::DimAxes dims(static_cast<size_t>(l.ndim()));
    if (seq.ndim() > 1)
      for (int64_t d = 0; d + 1 < l.ndim() && d < q.ndim(); ++d) dims[d] = q.dim_axes()[d];
    plan.inputs.push_back(make_layout(l, l.global_shape(), std::move(dims)));
  }
  plan.outputs.push_back(query_output(q, q.global_shape()));
  return plan;
}

OpPlan bucketize_rule(const OpCall& call) {
  refuse_sum_partial(call, 0, redistribute_partial_first("a search is not linear"));
  const Layout& q = call.layout(0);
  OpPlan plan;
  plan.inputs.push_back(make_layout(q, q.global_shape(), q.dim_axes()));
  for (size_t t = 1; t < call.tensors.size(); ++t)
    plan.inputs.push_back(
        replicate_like(call.layout(static_cast<int64_t>(t)), call.layout(static_cast<int64_t>(t)).global_shape()));
  plan.outputs.push_back(query_output(q, q.global_shape()));
  return plan;
}

OpPlan take_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  const Layout& index = call.layout(1);
  layout::PartialOps partial = self.partial();
  const auto op = self.partial_op();
  if (index.has_partial()) fail_argument(call, 1, "a Partial index", "Replicate or Shard");
  if (op && !is_sum_like(*op)) partial.assign(partial.size(), std::nullopt);  // max/min parts: reduced first
  for (int64_t axis = 0; axis < self.mesh()->ndim(); ++axis)
    if (index.is_sharded(axis)) partial[axis] = std::nullopt;  // an axis shards the output or sums it, not both
  OpPlan plan;
  plan.inputs.push_back(
      make_layout(self, self.global_shape(), layout::DimAxes(static_cast<size_t>(self.ndim())), partial));
  plan.inputs.push_back(call.tensors[1].layout);
  plan.outputs.push_back(query_output(index, index.global_shape(), partial));
  return plan;
}

// isin.Scalar_Tensor(element, test_elements): one bool from a whole table, Replicate.
OpPlan isin_scalar_rule(const OpCall& call) {
  refuse_sum_partial(call, 0, redistribute_partial_first("a membership test is not linear"));
  const Layout& table = call.layout(0);
  OpPlan plan;
  plan.inputs.push_back(replicate_like(table, table.global_shape()));
  plan.outputs.push_back(replicate_like(table, {}));
  return plan;
}

// put(_)(self, index, source, accumulate): take's write (and its backward, accumulating). With
// accumulate the write is linear in self and source together: index and source keep their common
// sharding, each rank adds its source elements at their GLOBAL positions into a whole self that
// is Partial(sum) over the axes sharding the index (rank 0 holds self's values, the others zeros),
// and the result is that Partial. An overwrite, or an index and source of different shapes, reads
// everything whole.
OpPlan put_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  const Layout& index = call.layout(1);
  const Layout& source = call.layout(2);
  for (int64_t t = 0; t < 3; ++t) refuse_sum_partial(call, t, redistribute_partial_first());
  const bool summing = call.arg(3).toBool() && index.global_shape() == source.global_shape();
  layout::PartialOps summed(static_cast<size_t>(self.mesh()->ndim()));
  for (int64_t axis = 0; axis < self.mesh()->ndim() && summing; ++axis)
    if (index.is_sharded(axis)) summed[axis] = ReduceOp::Sum;
  const layout::DimAxes kept = summing ? index.dim_axes() : layout::DimAxes(static_cast<size_t>(index.ndim()));
  OpPlan plan;
  plan.inputs.push_back(
      make_layout(self, self.global_shape(), layout::DimAxes(static_cast<size_t>(self.ndim())), summed));
  plan.inputs.push_back(make_layout(index, index.global_shape(), kept));
  plan.inputs.push_back(make_layout(source, source.global_shape(), kept));
  plan.outputs.push_back(plan.inputs[0]);
  return plan;
}

}  // namespace

void register_lookups(Registry& r) {
  r.add("aten::isin.Scalar_Tensor", &isin_scalar_rule, KeyScalars::kAll);
  r.add("aten::isin.Tensor_Scalar", &bucketize_rule, KeyScalars::kAll);
  r.add("aten::isin.Tensor_Tensor", &bucketize_rule, KeyScalars::kAll);
  r.add("aten::put", &put_rule, KeyScalars::kAll);
  r.add("aten::put_", &put_rule, KeyScalars::kAll);
  r.add("aten::searchsorted.Tensor", &searchsorted_rule, KeyScalars::kAll);
  r.add("aten::bucketize.Tensor", &bucketize_rule, KeyScalars::kAll);
  r.add("aten::take", &take_rule, KeyScalars::kAll);
}

}  // namespace hypershard::ops
