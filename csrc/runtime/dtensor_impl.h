// DTensorImpl: the storage-less wrapper that carries a DTensor through PyTorch's dispatcher.
//
// It reports the GLOBAL sizes, and the strides / storage offset the same view would have on a
// dense global tensor (autograd's view and in-place machinery reads them). It holds this
// rank's local tensor and the Layout. Its dispatch keys are PrivateUse2 (PrivateUse1 stays free
// for Ascend's torch_npu) with AutogradPrivateUse2, ADInplaceOrView and the device's autocast
// key, so autograd records at the DTensor level and every op reaches hypershard's fallback.
// Data access throws: a shard must never pass for the whole tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <atomic>
#include <memory>

#include "layout/intern.h"
#include "runtime/device_mesh.h"

namespace hypershard::runtime {

using layout::intern_layout;
using layout::interned;
using layout::LayoutPtr;

// Keeps `mesh` alive for the process and returns a handle that find_mesh turns back into it
// (autograd nodes save the handle; meshes are few).
int64_t retain_mesh(const DeviceMeshPtr& mesh);
DeviceMeshPtr find_mesh(int64_t handle);

// A wrapper's global geometry when it is not the dense default (a view's strides and offset).
struct Geometry {
  c10::IntArrayRef strides;
  int64_t storage_offset = 0;
};

class DTensorImpl final : public c10::TensorImpl {
 public:
  // `geometry`: null = dense strides in the local's dimension order.
  DTensorImpl(at::Tensor local, LayoutPtr layout, DeviceMeshPtr mesh, const Geometry* geometry = nullptr);

  const at::Tensor& local() const { return local_; }
  const LayoutPtr& layout() const { return layout_; }
  const DeviceMeshPtr& device_mesh() const { return mesh_; }

  // After an in-place / out= op: the (possibly new) local and layout; refreshes the geometry.
  void replace(at::Tensor local, LayoutPtr layout);
  // Sizes = global shape; strides and offset as given (a view's global geometry).
  void set_geometry(c10::IntArrayRef strides, int64_t storage_offset);
  // Dense global strides in the dimension order of the local's strides.
  void set_dense_geometry();
  // Whether the wrapper's sizes, strides and offset are its local's (nothing split, or only over
  // axes of one rank): a view of it then takes the local view's geometry.
  bool geometry_is_local() const {
    return sizes() == local_.sizes() && strides() == local_.strides() && storage_offset() == local_.storage_offset();
  }

  // A "view" whose input had to be redistributed first (e.g. a slice across a sharded dim, or a
  // view that would cut a shard): it reads like a view but does not alias its base. Writing into
  // it is refused; so is writing into its base while it lives (the base counts its live detached
  // views), and reading it after its view family was written some other way (it shares the
  // family's version counter, whose value at creation it keeps) -- either would be lost silently.
  bool is_detached_view() const { return detached_view_; }
  // `base`: the viewed tensor; `base_version`: its version counter's value now (the view gets
  // that counter from autograd's as_view once the kernel returns), -1 when it has none.
  void mark_detached_view(DTensorImpl* base, int64_t base_version);
  bool has_live_detached_views() const { return live_detached_views_ && live_detached_views_->load() > 0; }
  // Whether the view family was written after this detached view was taken.
  bool is_stale_view() const;
  ~DTensorImpl() override;

  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(const c10::VariableVersion& version_counter,
                                                              bool allow_tensor_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(c10::VariableVersion&& version_counter,
                                                              bool allow_tensor_metadata_change) const override;
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override;

 private:
  const char* tensorimpl_type_name() const override { return "hypershard::DTensorImpl"; }
  template <typename Version>
  c10::intrusive_ptr<c10::TensorImpl> detached_copy(Version&& version, bool allow_metadata_change) const;

  at::Tensor local_;
  LayoutPtr layout_;
  DeviceMeshPtr mesh_;
  bool detached_view_ = false;
  int64_t detached_version_ = -1;                              // the family's version at creation
  std::shared_ptr<std::atomic<int64_t>> base_live_views_;      // a detached view: its base's count
  std::shared_ptr<std::atomic<int64_t>> live_detached_views_;  // a base: its live detached views
};

inline DTensorImpl* dtensor_impl(const at::TensorBase& t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::PrivateUse2)) return nullptr;
  return static_cast<DTensorImpl*>(t.unsafeGetTensorImpl());
}
inline bool is_dtensor(const at::TensorBase& t) { return dtensor_impl(t) != nullptr; }

// Wraps `local` (never itself a DTensor) as a DTensor with `layout`.
at::Tensor make_dtensor(at::Tensor local, LayoutPtr layout, DeviceMeshPtr mesh, const Geometry* geometry = nullptr);

// Raises unless `t` is a DTensor.
DTensorImpl& checked_dtensor(const at::Tensor& t, const char* what);

}  // namespace hypershard::runtime
