// Layout: how one global tensor is spread over a mesh.
//
// Canonical form, natural order (no reversed tensor_map arithmetic anywhere):
//   - the mesh;
//   - the GLOBAL shape (stored, never re-derived from a local shape);
//   - for every tensor dim, the ordered list of mesh axes that shard it, major -> minor;
//   - for every mesh axis, an optional Partial reduce op.
// A dim sharded by axes (a, b) is chunked over a first, and each of those chunks is then
// chunked over b ("nested chunking", which is what torch DTensor does for
// [Shard(0), Shard(0)]). Each chunking follows torch.chunk: chunk size ceil(n / k), the
// trailing shards may be shorter or empty.
//
// Invariants (checked by Layout::create): every axis index is valid, an axis shards at most
// one dim and is never both sharding and Partial, and all Partial axes share one reduce op
// (a mix such as sum over dp and max over tp has no single meaning: the order of reductions
// would change the value).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "layout/mesh.h"

namespace hypershard::layout {

enum class ReduceOp : int8_t { Sum, Avg, Max, Min, Prod };

const char* reduce_op_name(ReduceOp op);  // "sum", "avg", ...
// Accepts "sum", "avg", "max", "min", "prod" (and torch's "product"); raises otherwise.
ReduceOp parse_reduce_op(const std::string& name);

// [begin, begin + length) of one chunk of `size` elements split torch.chunk-style into
// `parts` chunks, for chunk `index`.
struct Span {
  int64_t begin = 0;
  int64_t length = 0;
};
Span chunk_span(int64_t size, int64_t parts, int64_t index);

using DimAxes = std::vector<std::vector<int64_t>>;        // per tensor dim
using PartialOps = std::vector<std::optional<ReduceOp>>;  // per mesh axis

class Layout {
 public:
  Layout() = default;
  // Validates the invariants listed above; raises LayoutError naming the dim or axis at fault.
  static Layout create(MeshPtr mesh, std::vector<int64_t> global_shape, DimAxes dim_axes, PartialOps partial = {});
  // Every dim whole, no Partial.
  static Layout replicate(MeshPtr mesh, std::vector<int64_t> global_shape);

  const MeshPtr& mesh() const { return mesh_; }
  const std::vector<int64_t>& global_shape() const { return global_shape_; }
  const DimAxes& dim_axes() const { return dim_axes_; }
  const PartialOps& partial() const { return partial_; }
  int64_t ndim() const { return static_cast<int64_t>(global_shape_.size()); }

  // The tensor dim that `axis` shards, or -1.
  int64_t sharded_dim(int64_t axis) const;
  bool is_sharded(int64_t axis) const { return sharded_dim(axis) >= 0; }
  bool is_partial(int64_t axis) const { return partial_.at(axis).has_value(); }
  bool is_replicate(int64_t axis) const { return !is_sharded(axis) && !is_partial(axis); }
  bool has_partial() const;
  bool is_sharded_anywhere() const;  // some dim is split over some axis
  // The reduce op shared by all Partial axes (nullopt when none is Partial).
  std::optional<ReduceOp> partial_op() const;

  // Shard geometry of the rank at row-major mesh `position`.
  std::vector<int64_t> local_shape_at(int64_t position) const;
  std::vector<int64_t> global_offset_at(int64_t position) const;
  // The same by rank id (raises when the rank is not in the mesh).
  std::vector<int64_t> local_shape(int64_t rank) const;
  std::vector<int64_t> global_offset(int64_t rank) const;
  // Whether some rank's chunk of a non-empty tensor is empty (a dim smaller than its shard count,
  // or a nested chunking leaving nothing): the same answer on every rank.
  bool has_empty_shard() const;

  // Copies with one thing changed; each result is validated.
  Layout with_partial(int64_t axis, std::optional<ReduceOp> op) const;
  Layout with_global_shape(std::vector<int64_t> global_shape) const;
  Layout without_axis(int64_t axis) const;                   // axis becomes Replicate
  Layout with_minor_shard(int64_t axis, int64_t dim) const;  // append axis as dim's minor-most

  bool operator==(const Layout& other) const;
  bool operator!=(const Layout& other) const { return !(*this == other); }

  // "[8, 6] ("dp", "None") partial(sum: tp)" — alias notation of the dims, then Partial axes.
  std::string to_string() const;
  // Only the per-dim/partial part, without shape: ("dp", "None") partial(sum: tp)
  std::string sharding_string() const;

 private:
  void check_position(int64_t position) const;
  MeshPtr mesh_;
  std::vector<int64_t> global_shape_;
  DimAxes dim_axes_;
  PartialOps partial_;
};

int64_t numel(const std::vector<int64_t>& shape);
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace hypershard::layout
