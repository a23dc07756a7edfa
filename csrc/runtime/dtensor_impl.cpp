#include "runtime/dtensor_impl.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <unordered_map>

#include "layout/error.h"

namespace hypershard::runtime {
namespace {

c10::DispatchKeySet wrapper_keys(c10::DeviceType device) {
  auto keys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse2);
  // Autocast must act on the wrapper (above autograd), not on the locals below it.
  if (device == c10::DeviceType::CPU) keys = keys.add(c10::DispatchKey::AutocastCPU);
  if (device == c10::DeviceType::CUDA) keys = keys.add(c10::DispatchKey::AutocastCUDA);
  return keys;
}

}  // namespace

namespace {
std::mutex g_mesh_mutex;
auto* g_meshes = new std::vector<DeviceMeshPtr>();  // never destroyed (see retain_mesh)
}  // namespace

int64_t retain_mesh(const DeviceMeshPtr& mesh) {
  std::lock_guard<std::mutex> guard(g_mesh_mutex);
  for (size_t i = 0; i < g_meshes->size(); ++i)
    if ((*g_meshes)[i] == mesh) return static_cast<int64_t>(i);
  g_meshes->push_back(mesh);
  return static_cast<int64_t>(g_meshes->size() - 1);
}

DeviceMeshPtr find_mesh(int64_t handle) {
  std::lock_guard<std::mutex> guard(g_mesh_mutex);
  return g_meshes->at(handle);
}

DTensorImpl::DTensorImpl(at::Tensor local, LayoutPtr layout, DeviceMeshPtr mesh, const Geometry* geometry)
    : c10::TensorImpl(wrapper_keys(local.device().type()), local.dtype(), local.device()),
      local_(std::move(local)),
      layout_(std::move(layout)),
      mesh_(std::move(mesh)) {
  set_storage_access_should_throw();
  if (geometry)
    set_geometry(geometry->strides, geometry->storage_offset);  // one refresh, not two
  else
    set_dense_geometry();
}

void DTensorImpl::set_geometry(c10::IntArrayRef strides, int64_t storage_offset) {
  // Written directly: the public setters refuse on detached wrappers (allow_tensor_metadata_change
  // is false after .detach()), yet in-place ops must refresh them.
  sizes_and_strides_.set_sizes(layout_->global_shape());
  sizes_and_strides_.set_strides(strides);
  storage_offset_ = storage_offset;
  refresh_numel();
  refresh_contiguous();
}

void DTensorImpl::set_dense_geometry() {
  const auto& shape = layout_->global_shape();
  const int64_t ndim = static_cast<int64_t>(shape.size());
  c10::SmallVector<int64_t, 6> strides(ndim, 1);
  if (local_.dim() != ndim || local_.is_contiguous()) {
    for (int64_t i = ndim - 2; i >= 0; --i) strides[i] = strides[i + 1] * std::max<int64_t>(shape[i + 1], 1);
  } else {
    // Keep the local's memory order (innermost first; ties keep the natural order).
    c10::SmallVector<int64_t, 6> order(ndim);
    std::iota(order.begin(), order.end(), 0);
    const auto local_strides = local_.strides();
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return local_strides[a] > local_strides[b]; });
    int64_t next = 1;
    for (int64_t i = ndim - 1; i >= 0; --i) {
      strides[order[i]] = next;
      next *= std::max<int64_t>(shape[order[i]], 1);
    }
  }
  set_geometry(strides, 0);
}

void DTensorImpl::replace(at::Tensor local, LayoutPtr layout) {
  local_ = std::move(local);
  layout_ = std::move(layout);
  set_dense_geometry();
}

namespace {
constexpr int64_t kStale = -2;  // a detached view's version that never matches

int64_t current_version(const c10::TensorImpl& impl) {
  const auto& version = impl.version_counter();
  return version.enabled() ? static_cast<int64_t>(version.current_version()) : -1;
}
}  // namespace

void DTensorImpl::mark_detached_view(DTensorImpl* base, int64_t base_version) {
  detached_view_ = true;
  detached_version_ = base_version;
  if (base == nullptr || base_live_views_) return;
  if (!base->live_detached_views_) base->live_detached_views_ = std::make_shared<std::atomic<int64_t>>(0);
  base_live_views_ = base->live_detached_views_;
  base_live_views_->fetch_add(1);
}

bool DTensorImpl::is_stale_view() const {
  if (!detached_view_ || detached_version_ == -1) return false;
  return detached_version_ == kStale || current_version(*this) != detached_version_;
}

DTensorImpl::~DTensorImpl() {
  if (base_live_views_) base_live_views_->fetch_sub(1);
}

template <typename Version>
c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::detached_copy(Version&& version, bool allow_metadata_change) const {
  auto copy = c10::make_intrusive<DTensorImpl>(local_, layout_, mesh_);
  copy->set_geometry(strides(), storage_offset());
  copy->set_version_counter(std::forward<Version>(version));
  copy->set_allow_tensor_metadata_change(allow_metadata_change);
  if (detached_view_) {
    // A copy of a detached view (.detach(), .data) is one too, of the same base; a fresh version
    // counter (.data) starts it afresh, unless it is stale already.
    copy->detached_view_ = true;
    copy->detached_version_ = is_stale_view() ? kStale : current_version(*copy);
    copy->base_live_views_ = base_live_views_;
    if (base_live_views_) base_live_views_->fetch_add(1);
  }
  copy->live_detached_views_ = live_detached_views_;  // x.detach() writes x's values
  return copy;
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(const c10::VariableVersion& version_counter,
                                                                         bool allow_tensor_metadata_change) const {
  return detached_copy(version_counter, allow_tensor_metadata_change);
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(c10::VariableVersion&& version_counter,
                                                                         bool allow_tensor_metadata_change) const {
  return detached_copy(std::move(version_counter), allow_tensor_metadata_change);
}

void DTensorImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  // `x.data = y`: take y's local, layout and geometry.
  auto* other = dynamic_cast<DTensorImpl*>(impl.get());
  HS_CHECK(other != nullptr, "DTensor",
           "cannot set a DTensor's data to a plain tensor; "
           "allowed: a DTensor (use hypershard.distribute_tensor first)");
  local_ = other->local_;
  layout_ = other->layout_;
  mesh_ = other->mesh_;
  set_geometry(other->strides(), other->storage_offset());
}

at::Tensor make_dtensor(at::Tensor local, LayoutPtr layout, DeviceMeshPtr mesh, const Geometry* geometry) {
  HS_CHECK(!is_dtensor(local), "DTensor", "the local tensor is itself a DTensor");
  // A wrapper is an inference tensor exactly when its local is.
  std::optional<c10::InferenceMode> guard;
  if (local.is_inference() != c10::InferenceMode::is_enabled()) guard.emplace(local.is_inference());
  return at::Tensor(c10::make_intrusive<DTensorImpl>(std::move(local), std::move(layout), std::move(mesh), geometry));
}

DTensorImpl& checked_dtensor(const at::Tensor& t, const char* what) {
  auto* impl = dtensor_impl(t);
  HS_CHECK(impl != nullptr, "DTensor", what, " needs a DTensor but got a plain tensor");
  return *impl;
}

}  // namespace hypershard::runtime
