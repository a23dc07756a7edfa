// A sum over one mesh axis that runs while the caller goes on: gradient buckets started during
// the backward pass (grad_sync.cpp) and finished when it ends.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "runtime/device_mesh.h"

namespace hypershard::runtime {

class PendingSum {
 public:
  PendingSum() = default;
  // Starts summing contiguous `buffer` over this rank's group on `axis`, in place (counted by the
  // traffic counters like sum_in_place_along).
  PendingSum(at::Tensor buffer, const DeviceMesh& mesh, int64_t axis);
  // Blocks until the sum is in `buffer` (release the GIL around it: c10d's wait may need it).
  void wait();
  const at::Tensor& buffer() const { return buffer_; }

 private:
  at::Tensor buffer_, moved_;  // moved_: the bytes the backend reduces (another dtype, or buffer_)
  c10::intrusive_ptr<c10d::Work> work_;
};

}  // namespace hypershard::runtime
