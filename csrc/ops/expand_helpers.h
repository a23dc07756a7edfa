// Helpers for expand implementations shared by the families (loss, reductions): finishing an
// expand on the boxed stack and all-reducing a local result along several mesh axes.
#pragma once

#include <ATen/core/stack.h>

#include <initializer_list>
#include <vector>

#include "ops/op_call.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {

// Pops the call's arguments and pushes `outputs`, the op's returns in order.
inline void replace_args(const OpCall& call, torch::jit::Stack& stack, std::initializer_list<at::Tensor> outputs) {
  torch::jit::drop(stack, call.num_args());
  for (const auto& t : outputs) stack.emplace_back(t);
}

// `t` all-reduced with `op` along each of `axes` of the call's mesh, in order.
inline at::Tensor all_reduce_axes(at::Tensor t, const OpCall& call, const std::vector<int64_t>& axes, ReduceOp op) {
  for (int64_t axis : axes) t = runtime::all_reduce_along(t, *call.mesh, axis, op);
  return t;
}

}  // namespace hypershard::ops
