// Enumerates every layout of a tensor on a mesh, for exhaustive tests.
#pragma once

#include <algorithm>
#include <functional>
#include <vector>

#include "layout/layout.h"

namespace hypershard::testing {

using layout::DimAxes;
using layout::Layout;
using layout::MeshPtr;
using layout::PartialOps;
using layout::ReduceOp;

inline const std::vector<ReduceOp>& all_reduce_ops() {
  static const std::vector<ReduceOp> ops{ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod};
  return ops;
}

// Every layout: each mesh axis Replicate, Partial (one op from `ops` shared by all Partial axes)
// or sharding some dim; every order of the axes on a dim sharded by several.
inline std::vector<Layout> all_layouts(const MeshPtr& mesh, const std::vector<int64_t>& shape,
                                       const std::vector<ReduceOp>& ops = all_reduce_ops()) {
  const int64_t mesh_ndim = mesh->ndim();
  const int64_t ndim = static_cast<int64_t>(shape.size());
  std::vector<Layout> out;
  // choice[a]: -2 Replicate, -1 Partial, d >= 0 Shard(d)
  std::vector<int64_t> choice(mesh_ndim, -2);
  std::function<void(int64_t)> assign = [&](int64_t axis) {
    if (axis == mesh_ndim) {
      DimAxes dims(ndim);
      bool any_partial = false;
      for (int64_t a = 0; a < mesh_ndim; ++a) {
        if (choice[a] >= 0) dims[choice[a]].push_back(a);
        any_partial = any_partial || choice[a] == -1;
      }
      // Cartesian product of the permutations of each dim's axes.
      std::function<void(int64_t, DimAxes&)> permute = [&](int64_t d, DimAxes& current) {
        if (d == ndim) {
          if (!any_partial) {
            out.push_back(Layout::create(mesh, shape, current, {}));
            return;
          }
          for (ReduceOp op : ops) {
            PartialOps partial(mesh_ndim);
            for (int64_t a = 0; a < mesh_ndim; ++a)
              if (choice[a] == -1) partial[a] = op;
            out.push_back(Layout::create(mesh, shape, current, partial));
          }
          return;
        }
        std::vector<int64_t> axes = current[d];
        std::sort(axes.begin(), axes.end());
        do {
          current[d] = axes;
          permute(d + 1, current);
        } while (std::next_permutation(axes.begin(), axes.end()));
      };
      permute(0, dims);
      return;
    }
    for (int64_t c = -2; c < ndim; ++c) {
      choice[axis] = c;
      assign(axis + 1);
    }
  };
  assign(0);
  return out;
}

struct MeshCase {
  std::vector<int64_t> shape;
  std::vector<std::vector<int64_t>> tensor_shapes;  // even and uneven, 1-D to 3-D
};

// The meshes and tensor shapes every exhaustive test runs over.
inline const std::vector<MeshCase>& exhaustive_cases() {
  static const std::vector<MeshCase> cases{
      {{2}, {{4}, {3}, {4, 2}, {3, 5}, {2, 4, 2}, {3, 1, 5}}},
      {{3}, {{6}, {4}, {3, 6}, {4, 2}, {3, 3, 6}, {2, 4, 5}}},
      {{4}, {{8}, {5}, {4, 8}, {3, 6}, {4, 4, 2}, {2, 3, 5}}},
      {{2, 2}, {{8}, {5}, {4, 4}, {3, 5}, {4, 2, 4}, {3, 2, 5}}},
      {{2, 3}, {{12}, {5}, {6, 6}, {5, 4}, {6, 3, 2}, {5, 2, 3}}},
      {{2, 2, 2}, {{8}, {5}, {8, 4}, {3, 5}, {4, 4, 2}, {3, 5, 2}}},
  };
  return cases;
}

inline MeshPtr make_mesh(const std::vector<int64_t>& shape) {
  static const std::vector<std::string> names{"dp", "tp", "sp", "ep"};
  return layout::Mesh::create(shape, std::vector<std::string>(names.begin(), names.begin() + shape.size()));
}

}  // namespace hypershard::testing
