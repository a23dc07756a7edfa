// Mesh-axis bookkeeping shared by rules that give each dim of a result the axes of one of several
// operand dims (grid sampling, cdist): an axis shards at most one dim of a layout.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace hypershard::ops {

// The first of `candidates` (mesh axes of some dim; nullptr: none) left non-empty after removing
// `used`, which it then joins.
inline std::vector<int64_t> take_axes(std::initializer_list<const std::vector<int64_t>*> candidates,
                                      std::vector<int64_t>& used) {
  for (const auto* axes : candidates) {
    if (!axes) continue;
    std::vector<int64_t> out;
    for (int64_t a : *axes)
      if (std::find(used.begin(), used.end(), a) == used.end()) out.push_back(a);
    if (out.empty()) continue;
    used.insert(used.end(), out.begin(), out.end());
    return out;
  }
  return {};
}

}  // namespace hypershard::ops
