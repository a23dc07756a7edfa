#include "layout/mesh.h"

#include <algorithm>
#include <unordered_set>

#include "layout/error.h"

namespace hypershard::layout {
namespace {

constexpr const char* kContext = "mesh";

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", '" : "'") + names[i] + "'";
  return out;
}

}  // namespace

MeshPtr Mesh::create(std::vector<int64_t> shape, std::vector<std::string> axis_names, std::vector<int64_t> ranks) {
  HS_CHECK(!shape.empty(), kContext, "a mesh needs at least one axis");
  HS_CHECK(shape.size() == axis_names.size(), kContext, "shape has ", shape.size(), " axes but ", axis_names.size(),
           " axis names were given");
  int64_t size = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    HS_CHECK(shape[i] >= 1, kContext, "axis '", axis_names[i], "' has size ", shape[i], "; allowed: sizes >= 1");
    size *= shape[i];
  }
  std::unordered_set<std::string> seen_names;
  for (const auto& name : axis_names) {
    HS_CHECK(!name.empty(), kContext, "an axis name is empty; allowed: non-empty unique names");
    HS_CHECK(name != "None", kContext, "'None' is reserved for an unsplit dim and cannot name an axis");
    HS_CHECK(name.find('"') == std::string::npos || name.find('\'') == std::string::npos, kContext, "axis name '", name,
             "' holds both quote characters; allowed: names the alias notation "
             "can quote (no \" or no ')");
    HS_CHECK(seen_names.insert(name).second, kContext, "axis name '", name, "' is used twice; allowed: unique names");
  }
  if (ranks.empty()) {
    ranks.resize(size);
    for (int64_t i = 0; i < size; ++i) ranks[i] = i;
  }
  HS_CHECK(
      static_cast<int64_t>(ranks.size()) == size, kContext, "shape ", "(",
      [&] {
        std::string s;
        for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
        return s;
      }(),
      ") holds ", size, " ranks but ", ranks.size(), " ranks were given");
  std::unordered_set<int64_t> seen_ranks;
  for (int64_t r : ranks) {
    HS_CHECK(r >= 0, kContext, "rank ", r, " is negative; allowed: ranks >= 0");
    HS_CHECK(seen_ranks.insert(r).second, kContext, "rank ", r, " appears twice; allowed: unique ranks");
  }
  auto* mesh = new Mesh();
  mesh->shape_ = std::move(shape);
  mesh->axis_names_ = std::move(axis_names);
  mesh->ranks_ = std::move(ranks);
  mesh->strides_.assign(mesh->shape_.size(), 1);
  for (int64_t i = mesh->ndim() - 2; i >= 0; --i) mesh->strides_[i] = mesh->strides_[i + 1] * mesh->shape_[i + 1];
  return MeshPtr(mesh);
}

int64_t Mesh::axis_index(const std::string& name) const {
  for (size_t i = 0; i < axis_names_.size(); ++i)
    if (axis_names_[i] == name) return static_cast<int64_t>(i);
  fail(kContext, str_cat("no axis named '", name, "' in mesh ", to_string(), "; allowed: ", join_names(axis_names_)));
}

bool Mesh::contains(int64_t rank) const { return std::find(ranks_.begin(), ranks_.end(), rank) != ranks_.end(); }

int64_t Mesh::position_of(int64_t rank) const {
  auto it = std::find(ranks_.begin(), ranks_.end(), rank);
  HS_CHECK(it != ranks_.end(), kContext, "rank ", rank, " is not in mesh ", to_string());
  return it - ranks_.begin();
}

std::vector<int64_t> Mesh::coordinate_at(int64_t position) const {
  HS_CHECK(position >= 0 && position < size(), kContext, "position ", position, " is outside mesh ", to_string());
  std::vector<int64_t> coord(shape_.size());
  for (size_t i = 0; i < shape_.size(); ++i) coord[i] = (position / strides_[i]) % shape_[i];
  return coord;
}

int64_t Mesh::position_at(const std::vector<int64_t>& coordinate) const {
  HS_CHECK(coordinate.size() == shape_.size(), kContext, "a coordinate of ", coordinate.size(),
           " values given for a mesh of ", shape_.size(), " axes");
  int64_t pos = 0;
  for (size_t i = 0; i < shape_.size(); ++i) {
    HS_CHECK(coordinate[i] >= 0 && coordinate[i] < shape_[i], kContext, "coordinate ", coordinate[i],
             " is outside axis '", axis_names_[i], "' of size ", shape_[i]);
    pos += coordinate[i] * strides_[i];
  }
  return pos;
}

std::vector<int64_t> Mesh::axis_group(int64_t axis, int64_t rank) const {
  HS_CHECK(axis >= 0 && axis < ndim(), kContext, "axis ", axis, " is outside mesh ", to_string());
  auto coord = coordinate(rank);
  std::vector<int64_t> group(shape_[axis]);
  for (int64_t c = 0; c < shape_[axis]; ++c) {
    coord[axis] = c;
    group[c] = ranks_[position_at(coord)];
  }
  return group;
}

std::vector<std::vector<int64_t>> Mesh::axis_groups(int64_t axis) const {
  HS_CHECK(axis >= 0 && axis < ndim(), kContext, "axis ", axis, " is outside mesh ", to_string());
  std::vector<std::vector<int64_t>> groups;
  for (int64_t pos = 0; pos < size(); ++pos) {
    if (coordinate_at(pos)[axis] != 0) continue;  // one group per leader at coordinate 0
    groups.push_back(axis_group(axis, ranks_[pos]));
  }
  return groups;
}

MeshPtr Mesh::submesh(const std::vector<std::string>& names, int64_t rank) const {
  HS_CHECK(!names.empty(), kContext, "a sub-mesh needs at least one axis name");
  std::vector<int64_t> axes;
  for (const auto& name : names) {
    int64_t axis = axis_index(name);
    HS_CHECK(std::find(axes.begin(), axes.end(), axis) == axes.end(), kContext, "axis '", name,
             "' is named twice for a sub-mesh");
    axes.push_back(axis);
  }
  const auto base = coordinate(rank);
  std::vector<int64_t> sub_shape;
  for (int64_t a : axes) sub_shape.push_back(shape_[a]);
  std::vector<int64_t> sub_ranks;
  std::vector<int64_t> sub_coord(axes.size(), 0);
  const int64_t count = [&] {
    int64_t n = 1;
    for (int64_t s : sub_shape) n *= s;
    return n;
  }();
  for (int64_t i = 0; i < count; ++i) {
    auto coord = base;
    int64_t rest = i;
    for (int64_t j = static_cast<int64_t>(axes.size()) - 1; j >= 0; --j) {
      coord[axes[j]] = rest % sub_shape[j];
      rest /= sub_shape[j];
    }
    sub_ranks.push_back(ranks_[position_at(coord)]);
  }
  return create(sub_shape, names, sub_ranks);
}

std::string Mesh::to_string() const {
  std::string out = "(";
  for (size_t i = 0; i < shape_.size(); ++i) out += (i ? ", " : "") + axis_names_[i] + "=" + std::to_string(shape_[i]);
  out += ")";
  bool identity = true;
  for (size_t i = 0; i < ranks_.size(); ++i) identity = identity && ranks_[i] == static_cast<int64_t>(i);
  if (!identity) {
    out += " ranks [";
    for (size_t i = 0; i < ranks_.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks_[i]);
    out += "]";
  }
  return out;
}

}  // namespace hypershard::layout
