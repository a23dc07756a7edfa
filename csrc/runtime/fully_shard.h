// Fully sharded data parallelism: the collectives and buffers of one parameter group (the
// parameters of one fully_shard'ed module), below autograd. hypershard/fsdp/fully_shard.py owns the
// module hooks and the autograd function that call it, once per module and pass -- nothing here
// runs per op.
//
// Each parameter is stored sharded: its unsharded layout U (whatever tensor or expert
// parallelism gave it, Replicate on the data-parallel `axis`) with dim 0 additionally split over
// `axis` as its minor-most sharding (U.with_minor_shard(axis, 0)): each rank holds a torch.chunk
// of its U-local rows. Uneven and empty chunks are padded to the longest one, so that
//
//   gather          = ONE all-gather over `axis` of a flat buffer that holds, per parameter,
//                     this rank's padded chunk (cast to the compute dtype), then a copy-out of
//                     the pieces into each parameter's U-local tensor;
//   reduce_scatter  = ONE reduce-scatter over `axis` of a [members, flat] buffer that holds
//                     each member's padded rows of every gradient (in the reduce dtype).
//
// The U-local tensors are kept between passes; free_unsharded() releases their memory (the
// storages shrink to 0 bytes) and the next gather fills the same storages again, so tensors
// autograd saved in the forward see the values again in the backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <optional>
#include <vector>

#include "runtime/dtensor_impl.h"

namespace hypershard::runtime {

class FullyShardGroup {
 public:
  // `sharded`: the parameters (DTensors in their sharded layouts); `unsharded`: the layout of
  // each during compute. `param_dtype`: the compute dtype of the gathered parameters (default:
  // their own); `reduce_dtype`: the dtype gradients are summed in (default: the compute dtype).
  FullyShardGroup(std::vector<at::Tensor> sharded, std::vector<LayoutPtr> unsharded, int64_t axis,
                  std::optional<at::ScalarType> param_dtype, std::optional<at::ScalarType> reduce_dtype);

  // Issues the all-gather (asynchronous); a no-op when one is in flight or the group is gathered.
  void start_gather();
  // Waits for the all-gather (issuing it first if needed), copies the pieces out and returns the
  // unsharded parameters: new DTensor wrappers of the kept U-local tensors.
  std::vector<at::Tensor> finish_gather();
  // Releases the U-local tensors' memory (their storages shrink to 0 bytes).
  void free_unsharded();
  bool gathered() const { return gathered_; }
  bool gather_in_flight() const { return static_cast<bool>(work_); }

  // The gradients of the unsharded parameters (undefined where none) -> the gradients of the
  // sharded ones. `sync` false: accumulate them unreduced and return none (gradient
  // accumulation without communication); the next synchronized call adds what accumulated.
  std::vector<at::Tensor> reduce_scatter(const std::vector<at::Tensor>& grads, bool sync);

  struct Stats {
    int64_t gathers = 0;     // all-gathers finished
    int64_t prefetched = 0;  // of those, issued before they were needed (start_gather ahead)
    int64_t reduce_scatters = 0;
    int64_t bytes_sent = 0;   // by this rank, both kinds
    double wait_seconds = 0;  // spent waiting for all-gathers in finish_gather
  };
  const Stats& stats() const { return stats_; }
  void reset_stats() { stats_ = Stats(); }

  int64_t size() const { return static_cast<int64_t>(params_.size()); }
  int64_t flat_numel() const { return flat_; }  // per member, padding included
  int64_t unsharded_bytes() const;              // bytes of the gathered U-local tensors

 private:
  struct Param {
    at::Tensor sharded;  // the parameter (a DTensor)
    LayoutPtr unsharded_layout;
    LayoutPtr sharded_layout;
    std::vector<int64_t> local_shape;  // U-local shape
    std::vector<int64_t> rows;         // rows of each member's chunk of U-local dim 0
    std::vector<int64_t> row_offsets;  // where each member's chunk starts
    int64_t padded_rows = 0;
    int64_t row_numel = 1;
    int64_t offset = 0;          // in the per-member flat buffer, elements
    at::Tensor unsharded_local;  // kept; its storage is freed and refilled
    at::Tensor pending;          // accumulated unsynchronized gradient (U-local, reduce dtype)
    std::vector<std::optional<layout::ReduceOp>> pending_partial;
  };

  DeviceMeshPtr mesh_;
  int64_t axis_;
  int64_t members_;
  int64_t coordinate_;
  at::ScalarType param_dtype_;
  at::ScalarType reduce_dtype_;
  std::vector<Param> params_;
  int64_t flat_ = 0;
  bool gathered_ = false;
  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor send_, received_;
  Stats stats_;
};

}  // namespace hypershard::runtime
