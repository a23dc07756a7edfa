// The pointwise rule engine (pointwise.cpp), shared by the pointwise family and the list ops
// (foreach.cpp), which apply it to each list position: one engine, one Partial algebra.
#pragma once

#include <vector>

#include "ops/op_call.h"

namespace hypershard::ops {

// The Partial algebra rows of pointwise.cpp's header comment.
enum class Algebra : int8_t { kReject, kLinear, kBilinear, kNumerator, kScale, kNegate, kMonotone, kCast, kIdentity };

constexpr int64_t kNoMask = -1;

struct ElementwiseLayouts {
  std::vector<LayoutPtr> inputs;  // per operand, in the order given
  LayoutPtr output;               // the (broadcast) result
};

// The pointwise rule over the operands `operands` (indices into call.tensors, in schema
// order): broadcasting, the cheapest output sharding, the Partial algebra `algebra`. The
// operand of schema argument `mask_arg` is a mask (never Partial); a written argument 0 is
// in-place self (it keeps its sharding); other written arguments are out= buffers. Errors name
// the operand (`self[3]` for a list item).
ElementwiseLayouts elementwise_layouts(const OpCall& call, Algebra algebra, int64_t mask_arg,
                                       const std::vector<int64_t>& operands);

}  // namespace hypershard::ops
