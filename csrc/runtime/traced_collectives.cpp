#include "runtime/traced_collectives.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>

#include "runtime/dtensor_impl.h"

namespace hypershard::runtime {
namespace {

thread_local bool t_tracing = false;

// One waited functional collective: the op's boxed call, then _c10d_functional::wait_tensor
// (the compiled program may move the wait later; the traced program's order is eager's).
at::Tensor call_and_wait(const char* name, std::vector<c10::IValue> args) {
  const auto& op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  torch::jit::Stack stack(std::make_move_iterator(args.begin()), std::make_move_iterator(args.end()));
  op.callBoxed(&stack);
  torch::jit::Stack waited{stack.back()};
  c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "").callBoxed(&waited);
  return waited.back().toTensor();
}

c10::IValue group_name(const DeviceMesh& mesh, int64_t axis) { return c10::IValue(mesh.group(axis).getGroupName()); }

// Inductor (torch 2.13) lowers a data-moving functional collective of a bool tensor into an int64
// buffer: a compiled program's gathered padding mask came back int64 (sdpa then refuses it). A
// bool tensor therefore moves converted to uint8 and is converted back (not viewed: inductor's CPU
// code for a uint8 -> bool view inside a fused kernel does not compile).
template <typename Move>
at::Tensor moved_as_bytes(const at::Tensor& send, Move move) {
  if (send.scalar_type() != at::kBool) return move(send);
  return move(send.to(at::kByte)).to(at::kBool);
}

}  // namespace

bool tracing() { return t_tracing; }

bool under_tracer(const torch::jit::Stack& arguments) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return true;
  auto traced_local = [](const at::Tensor& t) {
    const auto* impl = t.defined() ? dtensor_impl(t) : nullptr;
    return impl != nullptr && impl->local().key_set().has(c10::DispatchKey::Python);
  };
  for (const auto& v : arguments) {
    if (v.isTensor() && traced_local(v.toTensor())) return true;
    if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList())
        if (traced_local(t)) return true;
  }
  return false;
}

TracingScope::TracingScope() : previous_(t_tracing) { t_tracing = true; }
TracingScope::~TracingScope() { t_tracing = previous_; }

void check_not_tracing(const char* what) {
  TORCH_CHECK(!t_tracing, "hypershard: torch.compile: ", what,
              " has no functional-collective form yet, so it cannot be traced into a compiled graph; run this "
              "model eagerly or compile it with torch.compile (which graph-breaks at DTensors, docs/compile.md)");
}

at::Tensor traced_all_gather(const at::Tensor& send, const DeviceMesh& mesh, int64_t axis) {
  return moved_as_bytes(send, [&](const at::Tensor& bytes) {
    return call_and_wait("_c10d_functional::all_gather_into_tensor",
                         {bytes, c10::IValue(mesh.mesh()->shape()[axis]), group_name(mesh, axis)});
  });
}

at::Tensor traced_all_reduce(const at::Tensor& t, const std::string& reduce_op, const DeviceMesh& mesh, int64_t axis) {
  return call_and_wait("_c10d_functional::all_reduce", {t, c10::IValue(reduce_op), group_name(mesh, axis)});
}

at::Tensor traced_reduce_scatter(const at::Tensor& send, const std::string& reduce_op, const DeviceMesh& mesh,
                                 int64_t axis) {
  return call_and_wait("_c10d_functional::reduce_scatter_tensor",
                       {send, c10::IValue(reduce_op), c10::IValue(mesh.mesh()->shape()[axis]), group_name(mesh, axis)});
}

at::Tensor traced_all_to_all(const at::Tensor& send, const std::vector<int64_t>& recv_counts,
                             const std::vector<int64_t>& send_counts, const DeviceMesh& mesh, int64_t axis) {
  return moved_as_bytes(send, [&](const at::Tensor& bytes) {
    return call_and_wait("_c10d_functional::all_to_all_single",
                         {bytes, c10::IValue(recv_counts), c10::IValue(send_counts), group_name(mesh, axis)});
  });
}

}  // namespace hypershard::runtime
