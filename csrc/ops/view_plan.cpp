// The layout algebra of view / reshape (view_plan.h): dims grouped into minimal equal-product
// groups, the sharded dims each group may keep, and the rank-by-rank check that every shard stays a
// whole block of the new shape.
#include "ops/view_plan.h"

#include <algorithm>
#include <optional>
#include <utility>

namespace hypershard::ops {
namespace {

struct DimGroup {
  int64_t in_begin, in_end, out_begin, out_end;
};

// Minimal groups of input and output dims with equal products (size-1 dims are their own).
std::vector<DimGroup> dim_groups(const std::vector<int64_t>& in, const std::vector<int64_t>& out) {
  std::vector<DimGroup> groups;
  size_t i = 0, j = 0;
  while (i < in.size() || j < out.size()) {
    if (i < in.size() && in[i] == 1) {
      const bool pair = j < out.size() && out[j] == 1;
      groups.push_back({int64_t(i), int64_t(i + 1), int64_t(j), int64_t(j + pair)});
      ++i;
      j += pair;
      continue;
    }
    if (j < out.size() && out[j] == 1) {
      groups.push_back({int64_t(i), int64_t(i), int64_t(j), int64_t(j + 1)});
      ++j;
      continue;
    }
    if (i >= in.size() || j >= out.size()) break;  // only zero-size leftovers
    DimGroup g{int64_t(i), 0, int64_t(j), 0};
    int64_t pin = in[i++], pout = out[j++];
    while (pin != pout) {
      if (pin < pout && i < in.size())
        pin *= in[i++];
      else if (j < out.size())
        pout *= out[j++];
      else
        break;
    }
    g.in_end = int64_t(i);
    g.out_end = int64_t(j);
    groups.push_back(g);
  }
  return groups;
}

// A rank's block of dims [begin, end) as one range of their row-major order, (first, count), or
// nullopt when it is not one range: after the first dim longer than one element, every dim must be
// whole. An empty block is one range.
std::optional<std::pair<int64_t, int64_t>> row_major_block(const std::vector<int64_t>& shape,
                                                           const std::vector<int64_t>& offset,
                                                           const std::vector<int64_t>& length, int64_t begin,
                                                           int64_t end) {
  int64_t first = 0, count = 1;
  bool longer = false, one_range = true;
  for (int64_t d = begin; d < end; ++d) {
    first = first * shape[d] + offset[d];
    count *= length[d];
    if (longer && length[d] != shape[d]) one_range = false;
    longer = longer || length[d] != 1;
  }
  if (count == 0) return std::make_pair(int64_t{0}, int64_t{0});
  if (!one_range) return std::nullopt;
  return std::make_pair(first, count);
}

}  // namespace

ViewPlan plan_view(const Layout& in, const std::vector<int64_t>& out_shape) {
  const auto& in_shape = in.global_shape();
  if (in_shape == out_shape) {  // the identity view (view_as itself) keeps every shard, empty ones too
    ViewPlan same;
    same.exact = true;
    same.input = same.output = intern(in);
    return same;
  }
  const bool any_zero = layout::numel(in_shape) == 0;
  const auto groups = dim_groups(in_shape, out_shape);
  layout::DimAxes out_dims(out_shape.size());
  std::vector<int64_t> gather;
  // A group flattened into ONE output dim may keep several sharded dims: their axes, major dim
  // first, shard the output dim (batch over dp and sequence over cp flattened into tokens); the
  // check below keeps it only where every rank's block stays contiguous and is that dim's chunk.
  auto flattens = [](const DimGroup& g) { return g.out_end - g.out_begin == 1 && g.in_end - g.in_begin > 1; };
  // The reverse: ONE input dim sharded over several axes split into several output dims (such a
  // flattened dim viewed back) gives its axes, major first, to the output dims in order, each as
  // many as its size takes; the check below keeps it where every rank's block stays one range.
  auto splits_axes = [&](const DimGroup& g) {
    return g.in_end - g.in_begin == 1 && g.out_end - g.out_begin > 1 && in.dim_axes()[g.in_begin].size() > 1;
  };
  for (const auto& g : groups) {
    if (!any_zero && splits_axes(g)) {
      int64_t od = g.out_begin, taken = 1;
      for (int64_t axis : in.dim_axes()[g.in_begin]) {
        const int64_t n = in.mesh()->axis_size(axis);
        while (od < g.out_end && out_shape[od] % (taken * n) != 0) ++od, taken = 1;
        if (od == g.out_end) break;
        out_dims[od].push_back(axis);
        taken *= n;
        if (taken == out_shape[od]) ++od, taken = 1;
      }
      continue;
    }
    for (int64_t d = g.in_begin; d < g.in_end; ++d) {
      if (in.dim_axes()[d].empty()) continue;
      // Otherwise only the group's major dim may stay sharded, onto the group's major output dim.
      if (any_zero || g.out_begin == g.out_end || (d != g.in_begin && !flattens(g))) {
        gather.push_back(d);
        continue;
      }
      const auto& axes = in.dim_axes()[d];
      out_dims[g.out_begin].insert(out_dims[g.out_begin].end(), axes.begin(), axes.end());
    }
  }
  // Exactness of the kept shards: rank by rank, the input block of the major dim must be the
  // output block of its major dim (scaled by the inner products of the group).
  auto candidate = Layout::create(in.mesh(), out_shape, out_dims, in.partial());
  for (const auto& g : groups) {
    if ((flattens(g) && !out_dims[g.out_begin].empty()) || (!any_zero && splits_axes(g))) {
      // Rank by rank: the block of the group's input dims and that of its output dims are the same
      // range of the group's row-major order.
      bool exact = true;
      for (int64_t p = 0; p < in.mesh()->size() && exact; ++p) {
        const auto in_block =
            row_major_block(in_shape, in.global_offset_at(p), in.local_shape_at(p), g.in_begin, g.in_end);
        const auto out_block = row_major_block(out_shape, candidate.global_offset_at(p), candidate.local_shape_at(p),
                                               g.out_begin, g.out_end);
        exact = in_block && out_block && *in_block == *out_block;
      }
      if (!exact) {
        for (int64_t d = g.in_begin; d < g.in_end; ++d)
          if (!in.dim_axes()[d].empty()) gather.push_back(d);
        for (int64_t d = g.out_begin; d < g.out_end; ++d) out_dims[d].clear();
      }
      continue;
    }
    if (g.in_begin == g.in_end || g.out_begin == g.out_end || in.dim_axes()[g.in_begin].empty()) continue;
    if (std::find(gather.begin(), gather.end(), g.in_begin) != gather.end()) continue;
    int64_t inner_in = 1, inner_out = 1;
    for (int64_t d = g.in_begin + 1; d < g.in_end; ++d) inner_in *= in_shape[d];
    for (int64_t d = g.out_begin + 1; d < g.out_end; ++d) inner_out *= out_shape[d];
    bool exact = true;
    for (int64_t p = 0; p < in.mesh()->size() && exact; ++p) {
      const int64_t in_begin = in.global_offset_at(p)[g.in_begin] * inner_in;
      const int64_t in_len = in.local_shape_at(p)[g.in_begin] * inner_in;
      const int64_t out_begin = candidate.global_offset_at(p)[g.out_begin] * inner_out;
      const int64_t out_len = candidate.local_shape_at(p)[g.out_begin] * inner_out;
      exact = in_begin == out_begin && in_len == out_len;
    }
    if (!exact) {
      gather.push_back(g.in_begin);
      out_dims[g.out_begin].clear();
    }
  }
  ViewPlan plan;
  plan.exact = gather.empty();
  plan.input = gather.empty() ? intern(in) : whole_dims(in, gather);
  plan.output = make_layout(in, out_shape, out_dims, in.partial());
  return plan;
}

}  // namespace hypershard::ops
