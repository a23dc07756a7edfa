// Converters between the canonical Layout and the three notations users bring:
//
//  1. torch-style placements: one Placement per mesh axis (Shard(d) / Replicate() /
//     Partial(op)), plus an explicit shard order for dims split over several axes whose order
//     is not ascending mesh-axis order (torch's default, which needs no entry);
//  2. Hyper-Parallel alias notation: per tensor dim "None", an axis name, or a tuple of axis
//     names (major -> minor), e.g. ("dp", "None") or (("dp", "tp"), "None"); Partial axes are
//     given separately by name;
//  3. MindSpore / Hyper-Parallel tensor_map: per tensor dim the mesh axes counted FROM THE
//     RIGHT (last mesh axis = 0), -1 = not split; a multi-axis dim lists several indices.
//
// Every converter validates and raises LayoutError with the offending dim/axis; every
// conversion round-trips losslessly through Layout.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "layout/layout.h"

namespace hypershard::layout {

struct Placement {
  enum class Kind : int8_t { Replicate, Shard, Partial };
  Kind kind = Kind::Replicate;
  int64_t dim = 0;              // Shard only
  ReduceOp op = ReduceOp::Sum;  // Partial only

  static Placement replicate() { return {}; }
  static Placement shard(int64_t dim) { return {Kind::Shard, dim, ReduceOp::Sum}; }
  static Placement partial(ReduceOp op = ReduceOp::Sum) { return {Kind::Partial, 0, op}; }
  bool operator==(const Placement& o) const {
    return kind == o.kind && (kind != Kind::Shard || dim == o.dim) && (kind != Kind::Partial || op == o.op);
  }
  std::string to_string() const;  // "Shard(0)", "Replicate()", "Partial(sum)"
};

// (tensor dim, mesh axes major -> minor) for the dims whose order is not ascending.
using ShardOrder = std::vector<std::pair<int64_t, std::vector<int64_t>>>;

struct Placements {
  std::vector<Placement> per_axis;
  ShardOrder shard_order;  // empty: ascending mesh-axis order for every dim
  bool operator==(const Placements& o) const { return per_axis == o.per_axis && shard_order == o.shard_order; }
  std::string to_string() const;  // "(Shard(0), Replicate())" + " order{0: [1, 0]}"
};

// Shard dims may be negative (counted from the end, as torch allows); they are normalised.
Layout from_placements(MeshPtr mesh, std::vector<int64_t> global_shape, const Placements& placements);
Placements to_placements(const Layout& layout);

// Alias notation: per tensor dim, the axis names (empty = "None").
struct AliasLayout {
  std::vector<std::vector<std::string>> dims;
  std::map<std::string, ReduceOp> partial;  // axis name -> op
  bool operator==(const AliasLayout& o) const { return dims == o.dims && partial == o.partial; }
  std::string to_string() const;  // ("dp", ("tp", "sp"), "None") partial(sum: tp)
};
// Parses the printed form: a parenthesised tuple whose items are "None", a quoted name, or a
// tuple of quoted names, optionally followed by partial(<op>: <axis>[, <axis>...]).
AliasLayout parse_alias(const std::string& text);

Layout from_alias(MeshPtr mesh, std::vector<int64_t> global_shape, const AliasLayout& alias);
AliasLayout to_alias(const Layout& layout);

// tensor_map: per tensor dim the mesh axes counted from the right, major -> minor;
// {-1} = not split.
using TensorMap = std::vector<std::vector<int64_t>>;
Layout from_tensor_map(MeshPtr mesh, std::vector<int64_t> global_shape, const TensorMap& map,
                       const PartialOps& partial = {});
TensorMap to_tensor_map(const Layout& layout);

}  // namespace hypershard::layout
