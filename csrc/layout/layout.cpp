#include "layout/layout.h"

#include <algorithm>

#include "layout/error.h"
#include "layout/placements.h"

namespace hypershard::layout {
namespace {

constexpr const char* kContext = "layout";

}  // namespace

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Prod:
      return "prod";
  }
  return "?";
}

ReduceOp parse_reduce_op(const std::string& name) {
  if (name == "sum") return ReduceOp::Sum;
  if (name == "avg") return ReduceOp::Avg;
  if (name == "max") return ReduceOp::Max;
  if (name == "min") return ReduceOp::Min;
  if (name == "prod" || name == "product") return ReduceOp::Prod;
  fail("reduce op", str_cat("unknown Partial reduce op '", name, "'; allowed: sum, avg, max, min, prod"));
}

Span chunk_span(int64_t size, int64_t parts, int64_t index) {
  const int64_t chunk = (size + parts - 1) / parts;
  const int64_t begin = std::min(index * chunk, size);
  const int64_t end = std::min(begin + chunk, size);
  return {begin, end - begin};
}

bool Layout::has_empty_shard() const {
  if (numel(global_shape_) == 0) return false;  // empty everywhere
  for (size_t d = 0; d < global_shape_.size(); ++d) {
    std::vector<int64_t> lengths{global_shape_[d]};  // the chunks of dim d after each nested axis
    for (const int64_t axis : dim_axes_[d]) {
      const int64_t parts = mesh_->shape()[axis];
      std::vector<int64_t> next;
      for (const int64_t length : lengths) {
        for (int64_t i = 0; i < parts; ++i) {
          const int64_t chunk = chunk_span(length, parts, i).length;
          if (chunk == 0) return true;
          next.push_back(chunk);
        }
      }
      lengths = std::move(next);
    }
  }
  return false;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

Layout Layout::create(MeshPtr mesh, std::vector<int64_t> global_shape, DimAxes dim_axes, PartialOps partial) {
  HS_CHECK(mesh != nullptr, kContext, "no mesh given");
  const int64_t mesh_ndim = mesh->ndim();
  for (size_t d = 0; d < global_shape.size(); ++d)
    HS_CHECK(global_shape[d] >= 0, kContext, "dim ", d, " has size ", global_shape[d], "; allowed: sizes >= 0");
  if (dim_axes.empty()) dim_axes.resize(global_shape.size());
  HS_CHECK(dim_axes.size() == global_shape.size(), kContext, "sharding given for ", dim_axes.size(),
           " dims but the tensor ", shape_string(global_shape), " has ", global_shape.size());
  if (partial.empty()) partial.resize(mesh_ndim);
  HS_CHECK(static_cast<int64_t>(partial.size()) == mesh_ndim, kContext, "Partial given for ", partial.size(),
           " mesh axes but mesh ", mesh->to_string(), " has ", mesh_ndim);
  std::vector<int64_t> owner(mesh_ndim, -1);
  for (size_t d = 0; d < dim_axes.size(); ++d) {
    for (int64_t axis : dim_axes[d]) {
      HS_CHECK(axis >= 0 && axis < mesh_ndim, kContext, "dim ", d, " is sharded on mesh axis ", axis, " but mesh ",
               mesh->to_string(), " has axes 0..", mesh_ndim - 1);
      const std::string& name = mesh->axis_names()[axis];
      HS_CHECK(owner[axis] < 0, kContext, "mesh axis '", name, "' shards dims ", owner[axis], " and ", d,
               "; allowed: an axis shards at most one dim");
      owner[axis] = static_cast<int64_t>(d);
      HS_CHECK(!partial[axis].has_value(), kContext, "mesh axis '", name, "' shards dim ", d, " and is Partial(",
               reduce_op_name(*partial[axis]), "); allowed: an axis is either sharding or Partial");
    }
  }
  std::optional<ReduceOp> shared_op;
  for (int64_t axis = 0; axis < mesh_ndim; ++axis) {
    if (!partial[axis]) continue;
    HS_CHECK(!shared_op || *shared_op == *partial[axis], kContext, "mesh axis '", mesh->axis_names()[axis],
             "' is Partial(", reduce_op_name(*partial[axis]), ") but another axis is Partial(",
             reduce_op_name(*shared_op), "); allowed: one reduce op for all Partial axes");
    shared_op = partial[axis];
  }
  Layout layout;
  layout.mesh_ = std::move(mesh);
  layout.global_shape_ = std::move(global_shape);
  layout.dim_axes_ = std::move(dim_axes);
  layout.partial_ = std::move(partial);
  return layout;
}

Layout Layout::replicate(MeshPtr mesh, std::vector<int64_t> global_shape) {
  return create(std::move(mesh), std::move(global_shape), {}, {});
}

int64_t Layout::sharded_dim(int64_t axis) const {
  for (size_t d = 0; d < dim_axes_.size(); ++d)
    for (int64_t a : dim_axes_[d])
      if (a == axis) return static_cast<int64_t>(d);
  return -1;
}

bool Layout::has_partial() const {
  return std::any_of(partial_.begin(), partial_.end(), [](const auto& p) { return p.has_value(); });
}

bool Layout::is_sharded_anywhere() const {
  return std::any_of(dim_axes_.begin(), dim_axes_.end(), [](const auto& axes) { return !axes.empty(); });
}

std::optional<ReduceOp> Layout::partial_op() const {
  for (const auto& p : partial_)
    if (p) return p;
  return std::nullopt;
}

void Layout::check_position(int64_t position) const {
  HS_CHECK(position >= 0 && position < mesh_->size(), kContext, "position ", position, " is outside mesh ",
           mesh_->to_string());
}

std::vector<int64_t> Layout::local_shape_at(int64_t position) const {
  check_position(position);
  std::vector<int64_t> shape = global_shape_;
  for (size_t d = 0; d < dim_axes_.size(); ++d)
    for (int64_t axis : dim_axes_[d])
      shape[d] = chunk_span(shape[d], mesh_->shape()[axis], mesh_->coordinate_on(position, axis)).length;
  return shape;
}

std::vector<int64_t> Layout::global_offset_at(int64_t position) const {
  check_position(position);
  std::vector<int64_t> offset(global_shape_.size(), 0);
  for (size_t d = 0; d < dim_axes_.size(); ++d) {
    int64_t length = global_shape_[d];
    for (int64_t axis : dim_axes_[d]) {
      const Span span = chunk_span(length, mesh_->shape()[axis], mesh_->coordinate_on(position, axis));
      offset[d] += span.begin;
      length = span.length;
    }
  }
  return offset;
}

std::vector<int64_t> Layout::local_shape(int64_t rank) const { return local_shape_at(mesh_->position_of(rank)); }

std::vector<int64_t> Layout::global_offset(int64_t rank) const { return global_offset_at(mesh_->position_of(rank)); }

Layout Layout::with_partial(int64_t axis, std::optional<ReduceOp> op) const {
  PartialOps partial = partial_;
  partial.at(axis) = op;
  return create(mesh_, global_shape_, dim_axes_, std::move(partial));
}

Layout Layout::with_global_shape(std::vector<int64_t> global_shape) const {
  return create(mesh_, std::move(global_shape), dim_axes_, partial_);
}

Layout Layout::without_axis(int64_t axis) const {
  DimAxes dims = dim_axes_;
  for (auto& axes : dims) axes.erase(std::remove(axes.begin(), axes.end(), axis), axes.end());
  PartialOps partial = partial_;
  partial.at(axis).reset();
  return create(mesh_, global_shape_, std::move(dims), std::move(partial));
}

Layout Layout::with_minor_shard(int64_t axis, int64_t dim) const {
  HS_CHECK(dim >= 0 && dim < ndim(), kContext, "dim ", dim, " is out of range for a ", ndim(), "-d tensor");
  DimAxes dims = dim_axes_;
  dims[dim].push_back(axis);
  return create(mesh_, global_shape_, std::move(dims), partial_);
}

bool Layout::operator==(const Layout& other) const {
  const bool same_mesh = mesh_ == other.mesh_ || (mesh_ && other.mesh_ && *mesh_ == *other.mesh_);
  return same_mesh && global_shape_ == other.global_shape_ && dim_axes_ == other.dim_axes_ &&
         partial_ == other.partial_;
}

std::string Layout::sharding_string() const { return to_alias(*this).to_string(); }

std::string Layout::to_string() const { return shape_string(global_shape_) + " " + sharding_string(); }

}  // namespace hypershard::layout
