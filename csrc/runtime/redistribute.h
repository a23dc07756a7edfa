// Redistribution at run time: executing the layout core's plans with c10d collectives, and the
// differentiable conversions between DTensors and local tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include "layout/redistribute_plan.h"
#include "runtime/dtensor_impl.h"

namespace hypershard::runtime {

// Runs `plan` on this rank's local tensor (below autograd: plain tensors in and out).
at::Tensor run_plan(const layout::RedistributePlan& plan, const at::Tensor& local, const DeviceMesh& mesh);
at::Tensor redistribute_local(const at::Tensor& local, const LayoutPtr& src, const LayoutPtr& dst,
                              const DeviceMesh& mesh);

// Differentiable: a DTensor with layout `dst` (same global value). Backward redistributes the
// gradient to the source layout with Partial axes made Replicate.
at::Tensor redistribute(const at::Tensor& dtensor, const LayoutPtr& dst);

// Differentiable DTensor <-> local conversions (torch DTensor semantics).
at::Tensor from_local(const at::Tensor& local, const DeviceMeshPtr& mesh, const LayoutPtr& layout);
at::Tensor to_local(const at::Tensor& dtensor);

// `layout` with every Partial axis made Replicate: the layout of a gradient.
LayoutPtr without_partial(const LayoutPtr& layout);

// Collectives along one mesh axis for expand implementations (this rank's group on `axis`).
// all_reduce_along returns a new tensor (avg divides by the group size).
at::Tensor all_reduce_along(const at::Tensor& local, const DeviceMesh& mesh, int64_t axis, layout::ReduceOp op);
// Sums a contiguous buffer over this rank's group on `axis`, in place (gradient buckets).
void sum_in_place_along(at::Tensor& buffer, const DeviceMesh& mesh, int64_t axis);
// Concatenates the group's tensors along `dim` in coordinate order; every member's tensor has
// the same shape (no length exchange: one collective).
at::Tensor all_gather_along(const at::Tensor& local, const DeviceMesh& mesh, int64_t axis, int64_t dim);
// Every member's `local` (equal shapes) of this rank's group over `axes` (major -> minor, the
// axes sharding one dim) concatenated along `dim` in that dim's chunk order: gathering the minor
// axis first, then the major ones, orders them major-first.
at::Tensor all_gather_in_chunk_order(at::Tensor local, const DeviceMesh& mesh, const std::vector<int64_t>& axes,
                                     int64_t dim);

// Debug check (one small all-reduce per mesh axis): raises, with the same text on every
// rank, when `tensor` is not the same on every rank of `mesh`. `what` names the tensor in the
// message ("hypershard: <what>: ...").
void check_same_on_every_rank(const at::Tensor& tensor, const DeviceMesh& mesh, const std::string& what);

// Counters of what the collectives sent, for benchmarks and tests (redistributions and the
// expand implementations' all_reduce_along / all_gather_along alike).
struct TrafficCounters {
  int64_t collectives = 0;
  int64_t bytes_sent = 0;  // the cost model's bytes of this rank
};
TrafficCounters traffic();
void reset_traffic();
// Counts one collective that sent `bytes` from this rank (collectives run outside this file).
void count_collective(int64_t bytes);
// The same bytes as a dtype every c10d backend moves (a view: writing it writes `t`).
at::Tensor movable_view(const at::Tensor& t);
// `moved` (movable_view's or a widened form of a tensor of `like`'s dtype) in `like`'s dtype: a
// traced collective returns a new tensor in the carried dtype, not the caller's buffer.
at::Tensor from_movable(const at::Tensor& moved, const at::Tensor& like);

}  // namespace hypershard::runtime
