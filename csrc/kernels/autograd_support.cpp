// What the fused ops' autograd kernels share.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "kernels/kernels.h"

namespace hypershard::kernels {

void forbid_second_derivative(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                              const char* op) {
  if (!torch::autograd::compute_requires_grad(inputs)) return;
  auto error = c10::make_intrusive<torch::autograd::Error>(
      std::string("hypershard: ") + op +
          ": a second derivative (double backward) is not implemented; first-order gradients, also with "
          "create_graph=True, are",
      torch::autograd::collect_next_edges(inputs));
  for (const auto& out : outputs)
    if (out.defined() && torch::autograd::isDifferentiableType(out.scalar_type()))
      torch::autograd::set_history(out, error);
}

}  // namespace hypershard::kernels
