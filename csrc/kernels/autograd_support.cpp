// What the fused ops' autograd kernels share.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>
#include <type_traits>
#include <utility>

#include "kernels/kernels.h"

namespace hypershard::kernels {
namespace {

// torch 2.13 holds autograd nodes in c10::intrusive_ptr, torch 2.11 and 2.12 in std::shared_ptr
// (pyproject supports 2.11-2.13): make a node the way the installed headers hold it.
template <typename NodeT, typename... Args>
auto make_node(Args&&... args) {
  using Held = std::decay_t<decltype(std::declval<torch::autograd::Edge>().function)>;
  if constexpr (std::is_same_v<Held, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<NodeT>(std::forward<Args>(args)...);
  else
    return c10::make_intrusive<NodeT>(std::forward<Args>(args)...);
}

}  // namespace

void forbid_second_derivative(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                              const char* op) {
  if (!torch::autograd::compute_requires_grad(inputs)) return;
  auto error = make_node<torch::autograd::Error>(
      std::string("hypershard: ") + op +
          ": a second derivative (double backward) is not implemented; first-order gradients, also with "
          "create_graph=True, are",
      torch::autograd::collect_next_edges(inputs));
  for (const auto& out : outputs)
    if (out.defined() && torch::autograd::isDifferentiableType(out.scalar_type()))
      torch::autograd::set_history(out, error);
}

}  // namespace hypershard::kernels
