#include "runtime/fully_shard.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <chrono>

#include "layout/error.h"
#include "runtime/dispatch_internal.h"
#include "runtime/gil.h"
#include "runtime/in_flight.h"
#include "runtime/redistribute.h"
#include "runtime/traced_collectives.h"

namespace hypershard::runtime {
namespace {

constexpr const char* kWhere = "fully_shard";

// Gives a storage `bytes` of fresh memory from its own allocator (contents undefined), or none.
void set_storage_bytes(const at::Tensor& t, size_t bytes) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == bytes) return;
  if (bytes == 0) {
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  } else {
    HS_CHECK(storage->allocator() != nullptr, kWhere, "a gathered parameter's storage has no allocator");
    storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  }
  storage->set_nbytes(bytes);
}

// Below autograd: these are plain local tensors being filled, not ops a graph should see.
struct BelowAutograd {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autograd_dispatch_keyset_with_ADInplaceOrView};
};

}  // namespace

FullyShardGroup::FullyShardGroup(std::vector<at::Tensor> sharded, std::vector<LayoutPtr> unsharded, int64_t axis,
                                 std::optional<at::ScalarType> param_dtype, std::optional<at::ScalarType> reduce_dtype)
    : axis_(axis) {
  HS_CHECK(!sharded.empty() && sharded.size() == unsharded.size(), kWhere,
           "a group needs one unsharded layout per parameter");
  mesh_ = checked_dtensor(sharded[0], "fully_shard").device_mesh();
  members_ = mesh_->mesh()->shape().at(axis);
  coordinate_ = mesh_->coordinate(axis);
  const auto own_dtype = sharded[0].scalar_type();
  param_dtype_ = param_dtype.value_or(own_dtype);
  reduce_dtype_ = reduce_dtype.value_or(param_dtype_);
  for (size_t i = 0; i < sharded.size(); ++i) {
    auto& impl = checked_dtensor(sharded[i], "fully_shard");
    HS_CHECK(impl.device_mesh()->same_mesh(*mesh_), kWhere, "the parameters of one group must share a mesh");
    HS_CHECK(sharded[i].scalar_type() == own_dtype, kWhere, "the parameters of one group must share a dtype (",
             own_dtype, " and ", sharded[i].scalar_type(), "); allowed: one dtype per fully_shard'ed module");
    Param p;
    p.sharded = sharded[i];
    p.unsharded_layout = unsharded[i];
    p.sharded_layout = impl.layout();
    p.local_shape = unsharded[i]->local_shape_at(mesh_->position());
    HS_CHECK(!p.local_shape.empty(), kWhere, "a 0-dim parameter cannot be sharded on dim 0");
    p.row_numel = layout::numel({p.local_shape.begin() + 1, p.local_shape.end()});
    int64_t offset = 0;
    for (int64_t c = 0; c < members_; ++c) {
      const int64_t rows = p.sharded_layout->local_shape_at(mesh_->member_position(axis, c))[0];
      p.rows.push_back(rows);
      p.row_offsets.push_back(offset);
      offset += rows;
      p.padded_rows = std::max(p.padded_rows, rows);
    }
    HS_CHECK(offset == p.local_shape[0], kWhere, "the chunks of a parameter's dim 0 add up to ", offset, " rows, not ",
             p.local_shape[0]);
    p.offset = flat_;
    flat_ += p.padded_rows * p.row_numel;
    p.unsharded_local =
        at::empty(p.local_shape, sharded[i].options().dtype(param_dtype_).device(impl.local().device()));
    set_storage_bytes(p.unsharded_local, 0);
    params_.push_back(std::move(p));
  }
}

void FullyShardGroup::start_gather() {
  if (gathered_ || work_) return;
  BelowAutograd below;
  const auto options = params_[0].unsharded_local.options();
  send_ = at::zeros({flat_}, options);
  for (auto& p : params_) {
    const auto& local = dtensor_impl(p.sharded)->local();
    const int64_t n = p.rows[coordinate_] * p.row_numel;
    if (n) send_.narrow(0, p.offset, n).copy_(local.reshape({n}));
  }
  received_ = at::empty({members_ * flat_}, options);
  if (members_ == 1) {
    received_.copy_(send_);
    return;
  }
  const int64_t bytes = flat_ * (members_ - 1) * static_cast<int64_t>(send_.element_size());
  count_collective(bytes);
  stats_.bytes_sent += bytes;
  check_not_tracing("fully_shard's parameter all-gather");
  at::Tensor received_bytes = movable_view(received_), send_bytes = movable_view(send_);
  without_gil([&] { work_ = mesh_->group(axis_)._allgather_base(received_bytes, send_bytes); });
}

std::vector<at::Tensor> FullyShardGroup::finish_gather() {
  if (!gathered_) {
    if (work_) ++stats_.prefetched;
    start_gather();
    if (work_) {
      const auto started = std::chrono::steady_clock::now();
      CollectiveInFlight in_flight(CollectiveKind::kAllGather, *mesh_, axis_,
                                   flat_ * static_cast<int64_t>(send_.element_size()),
                                   "fully_shard's parameter all-gather");
      without_gil([&] { work_->wait(); });
      stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      work_.reset();
    }
    ++stats_.gathers;
    BelowAutograd below;
    for (auto& p : params_) {
      set_storage_bytes(p.unsharded_local,
                        static_cast<size_t>(p.unsharded_local.numel()) * p.unsharded_local.element_size());
      for (int64_t c = 0; c < members_; ++c) {
        if (!p.rows[c]) continue;
        const auto piece = received_.narrow(0, c * flat_ + p.offset, p.rows[c] * p.row_numel);
        p.unsharded_local.narrow(0, p.row_offsets[c], p.rows[c]).copy_(piece.view([&] {
          auto s = p.local_shape;
          s[0] = p.rows[c];
          return s;
        }()));
      }
    }
    send_ = at::Tensor();
    received_ = at::Tensor();
    gathered_ = true;
  }
  std::vector<at::Tensor> out;
  out.reserve(params_.size());
  for (auto& p : params_) out.push_back(make_dtensor(p.unsharded_local, p.unsharded_layout, mesh_));
  return out;
}

void FullyShardGroup::free_unsharded() {
  if (work_) {  // never leave a collective unwaited
    CollectiveInFlight in_flight(CollectiveKind::kAllGather, *mesh_, axis_,
                                 flat_ * static_cast<int64_t>(send_.element_size()),
                                 "fully_shard's parameter all-gather");
    without_gil([&] { work_->wait(); });
    work_.reset();
    send_ = received_ = at::Tensor();
  }
  for (auto& p : params_) set_storage_bytes(p.unsharded_local, 0);
  gathered_ = false;
}

int64_t FullyShardGroup::unsharded_bytes() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.unsharded_local.numel() * static_cast<int64_t>(p.unsharded_local.element_size());
  return n;
}

std::vector<at::Tensor> FullyShardGroup::reduce_scatter(const std::vector<at::Tensor>& grads, bool sync) {
  HS_CHECK(grads.size() == params_.size(), kWhere, "expected ", params_.size(), " gradients, got ", grads.size());
  // Every gradient as its U-local "partial" value on `axis`: summed over the members it is the
  // gradient's U-local value (a gradient Replicate on `axis` keeps its value on member 0 only,
  // the others add nothing). `locals` are in the gradient's own dtype: a synchronized pass casts
  // them straight into the send buffer (a cast copy of the whole gradient first would hold the
  // group's gradients twice in the reduce dtype -- 1 GB more for a 248k x 1024 fp32 embedding).
  std::vector<at::Tensor> locals(params_.size());
  std::vector<bool> adds(params_.size(), false);
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    at::Tensor g = grads[i];
    if (!g.defined()) continue;
    auto* impl = dtensor_impl(g);
    HS_CHECK(impl != nullptr, kWhere, "the gradient of a gathered parameter is not a DTensor");
    auto layout = impl->layout();
    bool summed_here = !layout->partial().empty() && layout->partial()[axis_] == layout::ReduceOp::Sum;
    // Other sharding than the unsharded layout (an op's backward chose another one): bring it
    // there first, reduced (costed, rare).
    if (layout->dim_axes() != p.unsharded_layout->dim_axes()) {
      g = redistribute(g, without_partial(p.unsharded_layout));
      impl = dtensor_impl(g);
      layout = impl->layout();
      summed_here = false;
    }
    auto other = layout->partial();
    if (!other.empty()) other[axis_] = std::nullopt;
    if (p.pending.defined()) {
      HS_CHECK(other == p.pending_partial, kWhere,
               "gradients of one parameter arrived Partial over other axes in "
               "two accumulated backward passes; allowed: the same layout in every pass");
    }
    p.pending_partial = other;
    locals[i] = impl->local();
    adds[i] = summed_here || coordinate_ == 0;
  }
  BelowAutograd below;
  if (!sync) {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!locals[i].defined()) continue;
      auto& p = params_[i];
      at::Tensor local =
          adds[i] ? locals[i].to(reduce_dtype_) : at::zeros_like(locals[i], locals[i].options().dtype(reduce_dtype_));
      p.pending = p.pending.defined() ? p.pending.add_(local) : (adds[i] ? local.clone() : local);
    }
    return std::vector<at::Tensor>(params_.size());
  }
  const auto options = params_[0].unsharded_local.options().dtype(reduce_dtype_);
  auto send = at::zeros({members_, flat_}, options);
  std::vector<bool> has_grad(params_.size(), false);
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    const at::Tensor& pending = p.pending;
    const bool add = locals[i].defined() && adds[i];
    has_grad[i] = pending.defined() || locals[i].defined();
    if (!pending.defined() && !add) continue;  // zeros: what `send` holds already
    for (int64_t c = 0; c < members_; ++c) {
      if (!p.rows[c]) continue;
      auto rows_shape = p.local_shape;
      rows_shape[0] = p.rows[c];
      auto block = send[c].narrow(0, p.offset, p.rows[c] * p.row_numel).view(rows_shape);
      if (pending.defined()) {
        block.copy_(pending.narrow(0, p.row_offsets[c], p.rows[c]));
        if (add) block.add_(locals[i].narrow(0, p.row_offsets[c], p.rows[c]));
      } else {
        block.copy_(locals[i].narrow(0, p.row_offsets[c], p.rows[c]));  // cast to the reduce dtype
      }
    }
    p.pending = at::Tensor();
  }
  locals.clear();
  at::Tensor received;
  if (members_ == 1) {
    received = send[0];
  } else {
    received = at::empty({flat_}, options);
    const int64_t bytes = flat_ * (members_ - 1) * static_cast<int64_t>(send.element_size());
    count_collective(bytes);
    stats_.bytes_sent += bytes;
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    auto send_flat = send.view({members_ * flat_});  // c10d wants the members' blocks in one flat dim
    check_not_tracing("fully_shard's gradient reduce-scatter");
    CollectiveInFlight in_flight(CollectiveKind::kReduceScatter, *mesh_, axis_,
                                 static_cast<int64_t>(send_flat.nbytes()), "fully_shard's gradient reduce-scatter");
    without_gil([&] { mesh_->group(axis_)._reduce_scatter_base(received, send_flat, opts)->wait(); });
  }
  ++stats_.reduce_scatters;
  std::vector<at::Tensor> out(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!has_grad[i]) continue;
    auto& p = params_[i];
    const auto& sharded_local = dtensor_impl(p.sharded)->local();
    auto local = received.narrow(0, p.offset, p.rows[coordinate_] * p.row_numel)
                     .view(sharded_local.sizes())
                     .to(sharded_local.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    auto layout = p.sharded_layout;
    if (!p.pending_partial.empty() &&
        std::any_of(p.pending_partial.begin(), p.pending_partial.end(), [](const auto& op) { return op.has_value(); }))
      layout = intern_layout(
          layout::Layout::create(layout->mesh(), layout->global_shape(), layout->dim_axes(), p.pending_partial));
    out[i] = make_dtensor(local, layout, mesh_);
    // hypershard's gradient-layout hook on the parameter (normally installed when a leaf reaches
    // an op; a fully sharded one reaches only this group): it sums what is still Partial over
    // other axes (e.g. tp) in the data-parallel buckets before .grad takes it.
    if (p.sharded.requires_grad() && p.sharded.is_leaf()) detail::install_grad_hook(p.sharded);
  }
  return out;
}

}  // namespace hypershard::runtime
