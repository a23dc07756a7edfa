// Ops over the trailing (spatial) dims of an [N, C, *spatial] activation whose leading dims
// (batch, channels) are independent: they keep their sharding and run locally, nothing gathered
// along them.
//
//   pools       avg_pool3d, max_pool3d_with_indices, adaptive_max_pool3d,   the last 3 (2 for
//               fractional_max_pool2d/3d, max_unpool2d/3d, and their        the 2-d ops) dims
//               backward ops (avg_pool3d_backward, ..._backward)            whole; every other
//               tensor argument of the first's rank (a backward's self, the indices) follows
//               the first on the leading dims; fractional pools' random_samples [N, C, K]
//               follow its batch and channel dims. The max pools' indices (and max_unpool's)
//               are positions within one (n, c) plane, which is whole: a batch/channel block
//               holds the same indices as the whole tensor (the 2-d pools: along_dims.cpp; 3-d
//               area: resampling.cpp)
//   sampling    grid_sampler_2d/3d(input [N, C, *S], grid [N, *O, K]) -> [N, C, *O]: N sharded
//               alike in input and grid, C as the input's (the grid is read by every channel),
//               the grid's output positions O keep their sharding, the input's S and the grid's
//               coordinate dim whole. The backward (grad_input, grad_grid): grad_input is
//               Partial(sum) over the axes sharding O (each rank's output positions scatter into
//               the whole input plane), grad_grid Partial(sum) over the axes sharding C (grad_grid
//               sums over the channels); output_mask's false outputs are undefined
//   unfolding   im2col(self [N?, C, H, W]) -> [N?, C*kh*kw, L] and col2im (the reverse, with the
//               summed overlaps): the batch keeps its sharding; channels too where the axes
//               sharding them split C evenly (then a block of C channels is the block of their
//               C*kh*kw rows, which are channel-major); H, W and L whole
//
// Partial: avg_pool3d, every pool backward (linear in grad_output: the pooled gradient is a fixed
// weighted sum given the indices / window), max_unpool (a scatter of self), im2col and col2im
// (copies and sums), grid_sampler (linear in input for a fixed grid) take a sum/avg Partial of
// their first tensor through; a max/min Partial is reduced first (exact). The max pools' forward
// is not linear (max of a sum is not the sum of maxes): a sum Partial input is refused in
// forward code (reduced in a backward pass). The grid and a backward's grad_output of
// grid_sampler are never Partial (the grid enters non-linearly; the backward reduces it).
//
// An uneven shard can leave a rank an empty block (3 channels over 4 ranks), which torch's
// kernels refuse: that rank's results (empty blocks, or zero parts of a Partial(sum)) are made
// without the kernel (skip_empty_blocks, op_call.h).
//
// Not covered: a sharded spatial dim is gathered (a halo exchange would do for the fixed-window
// pools: convolution.cpp's; the adaptive and fractional windows and the sampled positions depend
// on the data or the sizes).
#include <ATen/ATen.h>

#include <algorithm>

#include "ops/families.h"
#include "ops/mesh_axes.h"
#include "ops/partial.h"

namespace hypershard::ops {
namespace {

// tensor 0's Partial in the plan: a linear op keeps a sum/avg one, every other is reduced first;
// a non-linear op refuses a sum Partial in forward code.
layout::PartialOps first_partial(const OpCall& call, bool linear) {
  const Layout& first = call.layout(0);
  const auto op = first.partial_op();
  if (linear && op && is_sum_like(*op)) return first.partial();
  if (!linear) refuse_sum_partial(call, 0, redistribute_partial_first());
  return {};
}

// ------------------------------------------------------------------ pools

// Which dim of the first tensor (its leading dims: batch, channels) each dim of tensor t goes
// along with; -1: none (whole). A tensor of the first's rank: its leading dims; random_samples
// [N, C, K]: N and C right-aligned on the first's leading dims (an unbatched input [C, *S] has
// samples [1, C, K]).
std::vector<int64_t> leading_map(const OpCall& call, int64_t t, int64_t n, int64_t lead) {
  const Layout& l = call.layout(t);
  std::vector<int64_t> map(static_cast<size_t>(l.ndim()), -1);
  const std::string& name = call.schema().arguments()[call.tensors[t].arg].name();
  if (name == "random_samples") {
    for (int64_t j = 0; j < std::min<int64_t>(2, l.ndim()); ++j)
      if (lead - 2 + j >= 0) map[j] = lead - 2 + j;
  } else if (l.ndim() == n) {
    for (int64_t d = 0; d < lead; ++d) map[d] = d;
  }
  return map;
}

// The last K dims whole, the leading dims (batch, channels) keep the first tensor's sharding.
template <int K, bool kLinear>
OpPlan pool_rule(const OpCall& call) {
  // A backward's gradient has self's shape (fractional_max_pool3d_backward has no meta kernel);
  // a forward runs on meta tensors: torch's own argument checks, on every rank alike.
  const int64_t self = call.tensor_named({"self"});
  const bool backward = call.schema().name().size() > 9 &&
                        call.schema().name().compare(call.schema().name().size() - 9, 9, "_backward") == 0;
  const auto shapes = backward && self > 0 ? std::vector<std::vector<int64_t>>{call.layout(self).global_shape()}
                                           : meta_output_shapes(call);
  const Layout& first = call.layout(0);
  const int64_t n = first.ndim(), lead = n - K;
  if (lead < 1) fail_call(call, layout::str_cat("needs a ", K + 1, "-d or ", K + 2, "-d input, not ", n, "-d"));
  layout::DimAxes kept(static_cast<size_t>(n));
  for (int64_t d = 0; d < lead; ++d) kept[d] = first.dim_axes()[d];
  std::vector<std::vector<int64_t>> maps;
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    maps.push_back(leading_map(call, static_cast<int64_t>(t), n, lead));
    const Layout& l = call.layout(static_cast<int64_t>(t));
    for (int64_t d = 0; d < l.ndim(); ++d)  // a size that differs (a broadcast sample) is whole
      if (maps[t][d] >= 0 && l.global_shape()[d] != first.global_shape()[maps[t][d]]) kept[maps[t][d]].clear();
  }
  const layout::PartialOps partial = first_partial(call, kLinear);
  OpPlan plan;
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    layout::DimAxes dims(static_cast<size_t>(l.ndim()));
    for (int64_t d = 0; d < l.ndim(); ++d)
      if (maps[t][d] >= 0) dims[d] = kept[maps[t][d]];
    plan.inputs.push_back(make_layout(l, l.global_shape(), std::move(dims), t == 0 ? partial : layout::PartialOps{}));
  }
  for (size_t o = 0; o < shapes.size(); ++o) {
    const auto& shape = shapes[o];
    if (static_cast<int64_t>(shape.size()) != n) fail_call(call, "the result's rank differs from the input's");
    layout::DimAxes dims(static_cast<size_t>(n));
    for (int64_t d = 0; d < lead; ++d)
      if (shape[d] == first.global_shape()[d])
        dims[d] = kept[d];
      else if (!kept[d].empty())
        fail_call(call, "internal error: a leading dim's size changed");
    // integer indices carry no Partial; a linear op's single result keeps it
    plan.outputs.push_back(make_layout(first, shape, std::move(dims), o == 0 ? partial : layout::PartialOps{}));
  }
  // the max pools' second result: int64 indices
  skip_empty_blocks(plan, {c10::ScalarType::Undefined, at::kLong});
  return plan;
}

// ------------------------------------------------------------------ grid sampling

// grid_sampler_2d/3d(input, grid, ...) and their backward (grad_output, input, grid, ...,
// output_mask) -> (grad_input, grad_grid).
template <bool kBackward>
OpPlan grid_sampler_rule(const OpCall& call) {
  const auto shapes = meta_output_shapes(call);  // torch's checks (ranks, sizes, modes)
  const int64_t in_t = kBackward ? 1 : 0, grid_t = kBackward ? 2 : 1;
  const Layout& input = call.layout(in_t);
  const Layout& grid = call.layout(grid_t);
  const int64_t k = grid.ndim() - 2;  // spatial dims
  const std::vector<int64_t> empty;
  auto axes_of = [&](int64_t t, int64_t d) -> const std::vector<int64_t>* {
    return t >= 0 ? &call.layout(t).dim_axes()[d] : &empty;
  };
  const int64_t go_t = kBackward ? 0 : -1;
  std::vector<int64_t> used;
  const auto batch = take_axes({axes_of(in_t, 0), axes_of(grid_t, 0), axes_of(go_t, 0)}, used);
  const auto channels = take_axes({axes_of(in_t, 1), axes_of(go_t, 1)}, used);
  std::vector<std::vector<int64_t>> positions;  // the grid's output positions O
  for (int64_t d = 0; d < k; ++d) positions.push_back(take_axes({axes_of(grid_t, 1 + d), axes_of(go_t, 2 + d)}, used));

  auto activation = [&](const Layout& like, std::vector<int64_t> shape, bool at_positions, layout::PartialOps partial) {
    layout::DimAxes dims(shape.size());
    dims[0] = batch;
    dims[1] = channels;
    if (at_positions)
      for (int64_t d = 0; d < k; ++d) dims[2 + d] = positions[d];
    return make_layout(like, std::move(shape), std::move(dims), std::move(partial));
  };
  auto grid_layout = [&](std::vector<int64_t> shape, layout::PartialOps partial) {
    layout::DimAxes dims(shape.size());
    dims[0] = batch;
    for (int64_t d = 0; d < k; ++d) dims[1 + d] = positions[d];
    return make_layout(grid, std::move(shape), std::move(dims), std::move(partial));
  };
  OpPlan plan;
  if (!kBackward) {
    // linear in input: a sum/avg Partial passes (on an axis sharding nothing here)
    layout::PartialOps partial;
    if (const auto op = input.partial_op(); op && is_sum_like(*op)) {
      partial = input.partial();
      for (int64_t a : used) partial[a] = std::nullopt;
      bool any = false;
      for (const auto& p : partial) any = any || p.has_value();
      if (!any) partial.clear();
    }
    refuse_sum_partial(call, grid_t, "Replicate or Shard (the grid enters non-linearly)");
    plan.inputs = {activation(input, input.global_shape(), false, partial), grid_layout(grid.global_shape(), {})};
    plan.outputs = {activation(input, shapes.at(0), true, partial)};
    skip_empty_blocks(plan);
    return plan;
  }
  const Layout& go = call.layout(go_t);
  plan.inputs = {activation(go, go.global_shape(), true, {}), activation(input, input.global_shape(), false, {}),
                 grid_layout(grid.global_shape(), {})};
  const int64_t axes = input.mesh()->ndim();
  layout::PartialOps over_positions(static_cast<size_t>(axes)), over_channels(static_cast<size_t>(axes));
  for (const auto& p : positions)
    for (int64_t a : p) over_positions[a] = ReduceOp::Sum;
  for (int64_t a : channels) over_channels[a] = ReduceOp::Sum;
  // an output the mask leaves out is undefined (a 0-d shape from the meta call)
  plan.outputs.push_back(shapes.at(0).empty() ? replicate_like(input, {})
                                              : activation(input, shapes[0], false, over_positions));
  plan.outputs.push_back(shapes.at(1).empty() ? replicate_like(grid, {}) : grid_layout(shapes[1], over_channels));
  skip_empty_blocks(plan, {}, call.arg_index("output_mask"));
  return plan;
}

// ------------------------------------------------------------------ unfolding

// im2col(self [N?, C, H, W]) -> [N?, C*kh*kw, L]; col2im(self [N?, C*kh*kw, L], output_size) ->
// [N?, C, H, W]. The batch keeps its sharding; the channel dim too where its axes split C evenly.
template <bool kCol2im>
OpPlan unfolding_rule(const OpCall& call) {
  const auto shapes = meta_output_shapes(call);  // torch's shape checks
  const Layout& in = call.layout(0);
  const auto& out_shape = shapes.at(0);
  const int64_t n = in.ndim(), batch = kCol2im ? n - 2 : n - 3;
  if (batch < 0 || batch > 1) fail_call(call, "unexpected rank");
  layout::DimAxes in_dims(static_cast<size_t>(n)), out_dims(out_shape.size());
  if (batch == 1) in_dims[0] = out_dims[0] = in.dim_axes()[0];
  const int64_t channels = kCol2im ? out_shape[batch] : in.global_shape()[batch];
  if (dim_parts(in, batch) > 1 && channels % dim_parts(in, batch) == 0)
    in_dims[batch] = out_dims[batch] = in.dim_axes()[batch];
  const layout::PartialOps partial = first_partial(call, true);
  OpPlan plan;
  plan.inputs.push_back(make_layout(in, in.global_shape(), std::move(in_dims), partial));
  plan.outputs.push_back(make_layout(in, out_shape, std::move(out_dims), partial));
  skip_empty_blocks(plan);
  return plan;
}

struct Row {
  const char* name;
  Rule rule;
};

}  // namespace

void register_spatial(Registry& r) {
  const Row rows[] = {
      {"aten::adaptive_max_pool3d", &pool_rule<3, false>},
      {"aten::adaptive_max_pool3d_backward", &pool_rule<3, true>},
      {"aten::avg_pool3d", &pool_rule<3, true>},
      {"aten::avg_pool3d_backward", &pool_rule<3, true>},
      {"aten::col2im", &unfolding_rule<true>},
      {"aten::fractional_max_pool2d", &pool_rule<2, false>},
      {"aten::fractional_max_pool2d_backward", &pool_rule<2, true>},
      {"aten::fractional_max_pool3d", &pool_rule<3, false>},
      {"aten::fractional_max_pool3d_backward", &pool_rule<3, true>},
      {"aten::grid_sampler_2d", &grid_sampler_rule<false>},
      {"aten::grid_sampler_2d_backward", &grid_sampler_rule<true>},
      {"aten::grid_sampler_3d", &grid_sampler_rule<false>},
      {"aten::grid_sampler_3d_backward", &grid_sampler_rule<true>},
      {"aten::im2col", &unfolding_rule<false>},
      {"aten::max_pool3d_with_indices", &pool_rule<3, false>},
      {"aten::max_pool3d_with_indices_backward", &pool_rule<3, true>},
      {"aten::max_unpool2d", &pool_rule<2, true>},
      {"aten::max_unpool3d", &pool_rule<3, true>},
  };
  // kernel sizes, output sizes, modes and masks change the result shapes and the plan
  for (const Row& row : rows) r.add(row.name, row.rule, KeyScalars::kAll);
}

}  // namespace hypershard::ops
