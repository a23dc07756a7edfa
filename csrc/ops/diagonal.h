// The diagonal view's geometry, shared by diagonal (views.cpp) and diagonal_scatter (assembly.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "layout/layout.h"

namespace hypershard::ops {

// diagonal(offset, d1, d2) of a tensor of GLOBAL `shape` laid out by `dims` (d1 and d2 whole):
// the view's GLOBAL shape and dim axes -- the other dims in order, then the diagonal (whole).
inline std::pair<std::vector<int64_t>, layout::DimAxes> diagonal_view(const std::vector<int64_t>& shape,
                                                                      const layout::DimAxes& dims, int64_t offset,
                                                                      int64_t d1, int64_t d2) {
  std::vector<int64_t> view_shape;
  layout::DimAxes view_dims;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d)
    if (d != d1 && d != d2) {
      view_shape.push_back(shape[d]);
      view_dims.push_back(dims[d]);
    }
  const int64_t length =
      offset >= 0 ? std::min(shape[d1], shape[d2] - offset) : std::min(shape[d1] + offset, shape[d2]);
  view_shape.push_back(std::max<int64_t>(length, 0));
  view_dims.emplace_back();
  return {std::move(view_shape), std::move(view_dims)};
}

}  // namespace hypershard::ops
