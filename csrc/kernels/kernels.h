// hypershard's own fused ops: schema, CPU kernels, autograd. Each register_* defines its ops in
// the `hypershard` library (install_dispatch calls them once); the distributed rules of these ops
// live with their families in csrc/ops.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <tuple>

namespace hypershard::kernels {

// rotary.cpp: hypershard::rotary_position_embedding and its backward (modes 0..3).
void register_rotary_kernels();
// Raises the argument errors of rotary_position_embedding (mode, D, cos/sin shapes, dtypes).
void check_rotary_arguments(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t mode);
at::Tensor rotary_position_embedding_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                         int64_t mode);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_position_embedding_backward_cpu(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t mode,
    std::array<bool, 3> output_mask);

}  // namespace hypershard::kernels
