#include "runtime/device_mesh.h"

#include <algorithm>
#include <mutex>

#include "layout/error.h"
#include "runtime/gil.h"

namespace hypershard::runtime {
namespace {

// Every live mesh, so that release_process_groups() can reach the groups of meshes still held
// by tensors, autograd graphs or caches when the interpreter exits. Never destroyed (static
// destruction order at exit is not ours to choose).
std::mutex g_live_mutex;
auto* g_live = new std::vector<DeviceMesh*>();

using Groups = std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>;

// Drops `groups` (the last references, possibly) with the GIL released.
void drop_groups(Groups& groups) {
  if (std::none_of(groups.begin(), groups.end(), [](const auto& g) { return g.defined(); })) return;
  without_gil([&] { groups.clear(); });
}

}  // namespace

DeviceMesh::DeviceMesh(layout::MeshPtr mesh, int64_t rank, c10::DeviceType device_type,
                       std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups, bool planning_only)
    : mesh_(std::move(mesh)), rank_(rank), device_type_(device_type), groups_(std::move(groups)) {
  HS_CHECK(mesh_ != nullptr, "device mesh", "no mesh given");
  position_ = mesh_->position_of(rank_);
  HS_CHECK(static_cast<int64_t>(groups_.size()) == mesh_->ndim(), "device mesh", groups_.size(),
           " process groups given for mesh ", mesh_->to_string(), "; allowed: one per axis");
  for (int64_t axis = 0; axis < mesh_->ndim(); ++axis) {
    if (!groups_[axis].defined()) {
      HS_CHECK(planning_only || mesh_->shape()[axis] == 1, "device mesh", "axis '", mesh_->axis_names()[axis],
               "' of size ", mesh_->shape()[axis], " has no process group");
      continue;
    }
    HS_CHECK(groups_[axis]->getSize() == mesh_->shape()[axis], "device mesh", "the process group of axis '",
             mesh_->axis_names()[axis], "' has ", groups_[axis]->getSize(), " ranks; the axis has ",
             mesh_->shape()[axis]);
    HS_CHECK(groups_[axis]->getRank() == coordinate(axis), "device mesh", "rank ", rank_, " is rank ",
             groups_[axis]->getRank(), " in the group of axis '", mesh_->axis_names()[axis], "' but has coordinate ",
             coordinate(axis), " on it; the group must list the ranks in coordinate order");
  }
  std::lock_guard<std::mutex> lock(g_live_mutex);
  g_live->push_back(this);
}

DeviceMesh::~DeviceMesh() {
  {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    g_live->erase(std::find(g_live->begin(), g_live->end(), this));
  }
  drop_groups(groups_);
}

int64_t release_process_groups() {
  Groups taken;
  {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    for (DeviceMesh* mesh : *g_live) {
      for (auto& group : mesh->groups_) {
        if (!group.defined()) continue;
        taken.push_back(std::move(group));
        mesh->released_ = true;
      }
    }
  }
  const auto count = static_cast<int64_t>(taken.size());
  drop_groups(taken);
  return count;
}

c10d::ProcessGroup& DeviceMesh::group(int64_t axis) const {
  const auto& group = groups_.at(axis);
  HS_CHECK(group.defined(), "device mesh", "axis '", mesh_->axis_names()[axis], "' has no process group",
           released_ ? " (released by release_process_groups, e.g. at interpreter exit)" : "");
  return *group;
}

void DeviceMesh::set_load_balanced_sequence_axis(int64_t axis) {
  HS_CHECK(axis >= -1 && axis < mesh_->ndim(), "device mesh", "load-balanced sequence axis ", axis,
           " is not an axis of ", mesh_->to_string());
  load_balanced_sequence_axis_ = axis;
}

std::shared_ptr<DeviceMesh> DeviceMesh::submesh(const std::vector<std::string>& names) const {
  auto sub = mesh_->submesh(names, rank_);
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
  for (const auto& name : names) groups.push_back(groups_[mesh_->axis_index(name)]);
  return std::make_shared<DeviceMesh>(std::move(sub), rank_, device_type_, std::move(groups));
}

}  // namespace hypershard::runtime
