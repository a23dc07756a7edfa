// DeviceMesh: a layout::Mesh plus, for this process, its rank and the c10d process group of
// every mesh axis. Collectives run directly on those groups from C++.
//
// Dropping a process group may join its worker thread (gloo's ~ProcessGroupGloo), and that
// thread may need the GIL to finish (a finished work's saved thread-local state drops Python
// references). So a mesh never drops its groups while holding the GIL: its destructor and
// release_process_groups() let the GIL go for that moment. Python calls
// release_process_groups() at exit, before interpreter finalization, for every live mesh.
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
  ~DeviceMesh();
  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;

  const layout::MeshPtr& mesh() const { return mesh_; }
  int64_t rank() const { return rank_; }
  int64_t position() const { return position_; }  // row-major position of this rank
  int64_t coordinate(int64_t axis) const { return mesh_->coordinate_on(position_, axis); }
  // For a dim sharded over `axes` (major -> minor): this rank's chunk index, and the mesh
  // position of the member (this rank's other coordinates) that holds chunk `chunk`.
  int64_t chunk_index(const std::vector<int64_t>& axes) const {
    int64_t index = 0;
    for (int64_t a : axes) index = index * mesh_->shape()[a] + coordinate(a);
    return index;
  }
  int64_t chunk_member_position(const std::vector<int64_t>& axes, int64_t chunk) const {
    auto coord = mesh_->coordinate_at(position_);
    for (auto a = axes.rbegin(); a != axes.rend(); ++a) {
      coord[*a] = chunk % mesh_->shape()[*a];
      chunk /= mesh_->shape()[*a];
    }
    return mesh_->position_at(coord);
  }
  // The member with coordinate `c` on `axis` in this rank's group on `axis` (a dim sharded over
  // that axis alone).
  int64_t member_position(int64_t axis, int64_t c) const { return chunk_member_position({axis}, c); }
  c10::DeviceType device_type() const { return device_type_; }
  c10d::ProcessGroup& group(int64_t axis) const;
  bool has_group(int64_t axis) const { return groups_.at(axis).defined(); }

  // Same ranks, shape and names (the process groups may be different objects).
  bool same_mesh(const DeviceMesh& other) const { return this == &other || *mesh_ == *other.mesh_; }

  // The sub-mesh over the named axes that contains this rank, sharing this mesh's groups.
  std::shared_ptr<DeviceMesh> submesh(const std::vector<std::string>& names) const;

  std::string to_string() const { return mesh_->to_string(); }

  // Context parallelism's layout convention (docs/context_parallel.md): with a load-balanced
  // sequence axis of size n, every sequence dim of a tensor on this mesh is STORED in head-tail
  // (zig-zag) order of 2n chunks -- stored block i is chunk i then chunk 2n-1-i -- so that each
  // rank of a plain Shard holds an early and a late chunk. Rules that read positions (a causal
  // attention mask) map stored rows to positions through it. -1: natural order. Declared by
  // parallelize before the first call; a submesh does not inherit it.
  int64_t load_balanced_sequence_axis() const { return load_balanced_sequence_axis_; }
  void set_load_balanced_sequence_axis(int64_t axis);

  // How attention runs on a sequence sharded over one axis of this mesh (docs/context_parallel.md):
  // key/value all-gathered (the default), Ulysses all-to-all (heads <-> sequence) or ring (key/value
  // blocks passed rank to rank, online-softmax merging). Read by the attention expand per call
  // (plans do not depend on it); declared by parallelize(..., cp_algorithm=...).
  enum class SequenceAttention : int8_t { kAllGatherKv, kUlysses, kRing };
  SequenceAttention sequence_attention() const { return sequence_attention_; }
  void set_sequence_attention(SequenceAttention algorithm) { sequence_attention_ = algorithm; }

 private:
  layout::MeshPtr mesh_;
  int64_t rank_;
  int64_t position_;
  c10::DeviceType device_type_;
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups_;
  bool released_ = false;  // release_process_groups() took the groups
  int64_t load_balanced_sequence_axis_ = -1;
  SequenceAttention sequence_attention_ = SequenceAttention::kAllGatherKv;

  friend int64_t release_process_groups();
};

using DeviceMeshPtr = std::shared_ptr<DeviceMesh>;

// Drops the process groups of every live mesh (without the GIL); afterwards their collectives
// raise a clear error. Returns how many groups were released. Called at interpreter exit and by
// hypershard.release_process_groups().
int64_t release_process_groups();

}  // namespace hypershard::runtime
