// The layout algebra of view / reshape, shared by the view rules and the reshape kernel
// (views.cpp): which input layout a view of a new shape needs, and what it gives.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/op_call.h"

namespace hypershard::ops {

// The layout `l` with `dims` made whole (their axes removed), other dims and Partial unchanged.
inline LayoutPtr whole_dims(const Layout& l, const std::vector<int64_t>& dims) {
  auto axes = l.dim_axes();
  for (int64_t d : dims) axes[d].clear();
  return make_layout(l, l.global_shape(), std::move(axes), l.partial());
}

struct ViewPlan {
  LayoutPtr input;  // the input layout the local view needs
  LayoutPtr output;
  bool exact;  // the current input layout already works
};

// Whether `in` viewed as `out_shape` keeps every shard a whole block; which dims to gather if not.
ViewPlan plan_view(const Layout& in, const std::vector<int64_t>& out_shape);

}  // namespace hypershard::ops
