// Tracing hypershard's local program (torch.compile, hypershard/tensor/fake_guard.py): while a
// TracingScope is open on this thread, the operator flow runs on traced locals (FakeTensors,
// FunctionalTensors under a tracer) and every collective of a redistribution or of an expand
// implementation is emitted as a functional collective (the _c10d_functional ops) followed by
// its wait_tensor: ops the tracer records into the graph, as torch DTensor's are. Outside a
// scope nothing here runs.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>

#include <string>
#include <vector>

#include "runtime/device_mesh.h"

namespace hypershard::runtime {

bool tracing();

// Whether a call with these arguments runs under a tracer (a dispatch mode is active, or a
// DTensor's local is a Python tensor such as a FakeTensor) rather than for real (Dynamo's graph
// run op by op on real locals, backend="eager").
bool under_tracer(const torch::jit::Stack& arguments);

struct TracingScope {
  TracingScope();
  ~TracingScope();
  TracingScope(const TracingScope&) = delete;
  TracingScope& operator=(const TracingScope&) = delete;

 private:
  bool previous_;
};

// Raises, naming `what`, when a collective that has no functional form here runs while tracing.
void check_not_tracing(const char* what);

// The functional collectives over this rank's group on `axis`, each waited: `reduce_op` is
// c10d's name ("sum", "max", "min", "product").
at::Tensor traced_all_gather(const at::Tensor& send, const DeviceMesh& mesh, int64_t axis);  // along dim 0
at::Tensor traced_all_reduce(const at::Tensor& t, const std::string& reduce_op, const DeviceMesh& mesh, int64_t axis);
at::Tensor traced_reduce_scatter(const at::Tensor& send, const std::string& reduce_op, const DeviceMesh& mesh,
                                 int64_t axis);  // along dim 0
at::Tensor traced_all_to_all(const at::Tensor& send, const std::vector<int64_t>& recv_counts,
                             const std::vector<int64_t>& send_counts, const DeviceMesh& mesh, int64_t axis);

}  // namespace hypershard::runtime
