// Mesh: an N-dimensional arrangement of ranks with named axes.
//
// ranks() is stored row-major over shape(): the rank at coordinate (c0, ..., cn-1) is
// ranks()[c0 * stride0 + ...]. A mesh is immutable once created; layouts hold it by shared
// pointer so that copying a layout never copies the rank list.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hypershard::layout {

class Mesh {
 public:
  // Validates: at least one axis, every axis size >= 1, axis names non-empty and unique,
  // ranks unique and non-negative, ranks.size() == product(shape). Empty `ranks` means
  // 0..size-1.
  static std::shared_ptr<const Mesh> create(std::vector<int64_t> shape, std::vector<std::string> axis_names,
                                            std::vector<int64_t> ranks = {});

  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<std::string>& axis_names() const { return axis_names_; }
  const std::vector<int64_t>& ranks() const { return ranks_; }
  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size() const { return static_cast<int64_t>(ranks_.size()); }
  int64_t axis_size(int64_t axis) const { return shape_.at(axis); }

  // Index of the axis called `name`; raises naming the valid axes when there is none.
  int64_t axis_index(const std::string& name) const;
  bool contains(int64_t rank) const;
  // Position of `rank` in ranks() (row-major index); raises when the rank is not in the mesh.
  int64_t position_of(int64_t rank) const;
  // Coordinate of the rank at row-major `position`.
  std::vector<int64_t> coordinate_at(int64_t position) const;
  std::vector<int64_t> coordinate(int64_t rank) const { return coordinate_at(position_of(rank)); }
  // One coordinate of the rank at `position` (unchecked: hot path of the shard geometry).
  int64_t coordinate_on(int64_t position, int64_t axis) const { return (position / strides_[axis]) % shape_[axis]; }
  int64_t position_at(const std::vector<int64_t>& coordinate) const;

  // The ranks that differ from `rank` only along `axis`, ordered by their coordinate on it:
  // the process group of that axis which `rank` belongs to.
  std::vector<int64_t> axis_group(int64_t axis, int64_t rank) const;
  // Every group along `axis` (each ordered by coordinate), in row-major order of the other
  // coordinates. Every rank must create all of them, in this order, with torch.distributed.
  std::vector<std::vector<int64_t>> axis_groups(int64_t axis) const;

  // The sub-mesh over the named axes (in the order given) that contains `rank`.
  std::shared_ptr<const Mesh> submesh(const std::vector<std::string>& names, int64_t rank) const;

  bool operator==(const Mesh& other) const {
    return shape_ == other.shape_ && axis_names_ == other.axis_names_ && ranks_ == other.ranks_;
  }
  bool operator!=(const Mesh& other) const { return !(*this == other); }

  // "(dp=2, tp=2)"; the rank list is added when it is not 0..size-1.
  std::string to_string() const;

 private:
  Mesh() = default;
  std::vector<int64_t> shape_;
  std::vector<std::string> axis_names_;
  std::vector<int64_t> ranks_;
  std::vector<int64_t> strides_;  // row-major strides of shape_
};

using MeshPtr = std::shared_ptr<const Mesh>;

}  // namespace hypershard::layout
