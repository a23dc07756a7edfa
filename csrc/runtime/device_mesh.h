// DeviceMesh: a layout::Mesh plus, for this process, its rank and the c10d process group of
// every mesh axis. Collectives run directly on those groups from C++.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <string>
#include <vector>

#include "layout/mesh.h"

namespace hypershard::runtime {

class DeviceMesh {
 public:
  // `groups[a]` is the process group of this rank's axis-`a` group (ranks ordered by their
  // coordinate on that axis); it may be null on a mesh of one rank per axis, and on any axis
  // when `planning_only` (a mesh for process-free rule tests: plans can be made on it,
  // collectives raise).
  DeviceMesh(layout::MeshPtr mesh, int64_t rank, c10::DeviceType device_type,
             std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups, bool planning_only = false);

  const layout::MeshPtr& mesh() const { return mesh_; }
  int64_t rank() const { return rank_; }
  int64_t position() const { return position_; }  // row-major position of this rank
  int64_t coordinate(int64_t axis) const { return mesh_->coordinate_on(position_, axis); }
  c10::DeviceType device_type() const { return device_type_; }
  c10d::ProcessGroup& group(int64_t axis) const;
  bool has_group(int64_t axis) const { return groups_.at(axis).defined(); }

  // Same ranks, shape and names (the process groups may be different objects).
  bool same_mesh(const DeviceMesh& other) const { return this == &other || *mesh_ == *other.mesh_; }

  // The sub-mesh over the named axes that contains this rank, sharing this mesh's groups.
  std::shared_ptr<DeviceMesh> submesh(const std::vector<std::string>& names) const;

  std::string to_string() const { return mesh_->to_string(); }

 private:
  layout::MeshPtr mesh_;
  int64_t rank_;
  int64_t position_;
  c10::DeviceType device_type_;
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups_;
};

using DeviceMeshPtr = std::shared_ptr<DeviceMesh>;

}  // namespace hypershard::runtime
