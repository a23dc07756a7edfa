// hypershard's own fused ops: schema, CPU kernels, kernels for other devices, autograd. Each register_* defines its ops
// in the `hypershard` library; the family holding the ops' distributed rules (csrc/ops) hands it to the registry
// (r.kernels), and install_dispatch installs them once.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

namespace hypershard::kernels {

// at::parallel_for grain for loops over rows of `row_elements` each: about 32k elements per task.
inline int64_t row_grain(int64_t row_elements) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elements, 1));
}

// autograd_support.cpp: for a backward op's autograd kernel that ran below autograd: when grad
// mode is on and an input requires grad (create_graph=True), `outputs` get a grad_fn that raises
// "a second derivative of <op> is not implemented" if it is ever reached.
void forbid_second_derivative(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                              const char* op);

// external_autograd.cpp: kernels at AutogradPrivateUse2 for torch_npu's npu_rms_norm /
// npu_rotary_mul (and their backward ops) and transformers' grouped_mm_fallback, registered before
// those ops are defined (torch_npu / transformers imported later).
void register_external_autograd_kernels();

// grouped_mm.cpp: hypershard::grouped_mm_local, the local program of the grouped products'
// rule (csrc/ops/matmul.cpp).
void register_grouped_mm_kernels();

// rotary.cpp: hypershard::rotary_position_embedding and its backward (modes 0..3).
void register_rotary_kernels();
// Raises the argument errors of rotary_position_embedding (mode, D, cos/sin shapes, dtypes).
void check_rotary_arguments(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t mode);
at::Tensor rotary_position_embedding_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                         int64_t mode);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_position_embedding_backward_cpu(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t mode,
    std::array<bool, 3> output_mask);

// rms_norm.cpp: hypershard::rms_norm (y and rstd) and its backward.
void register_rms_norm_kernels();
void check_rms_norm_arguments(const at::Tensor& x, const at::Tensor& weight);
std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad, const at::Tensor& x,
                                                         const at::Tensor& weight, const at::Tensor& rstd,
                                                         std::array<bool, 2> output_mask);

// composite.cpp: the ops above composed of ATen ops at CompositeExplicitAutograd, for every
// device without a kernel of its own (CUDA, NPU); called by the two register_* above.
void register_rms_norm_composite();
void register_rotary_composite();

}  // namespace hypershard::kernels
