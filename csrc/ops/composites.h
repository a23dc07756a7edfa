// linear's one sequence rule (composites.cpp), read by its eager kernel there and, through
// hypershard._C, by traced programs (hypershard/tensor/traced.py), which see a layout, not a DTensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "layout/layout.h"

namespace hypershard::ops {

// Whether linear of an input laid out as `input` by a `weight_dim`-D weight takes the batched
// product: a 3-D input with its dim 1 sharded (a sequence under context parallelism) and more
// than one row in dim 0, by a 2-D weight.
bool linear_keeps_sequence_shards(const layout::Layout& input, int64_t weight_dim);

// That product: bmm(input, weight^T expanded over the batch) (+ bias).
at::Tensor linear_batched(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

}  // namespace hypershard::ops
