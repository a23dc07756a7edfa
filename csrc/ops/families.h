// One register function per operator family; register_all calls each explicitly.
#pragma once

#include "ops/op_call.h"

namespace hypershard::ops {

void register_all(Registry& r);
void register_pointwise(Registry& r);    // pointwise.cpp
void register_tensor_ops(Registry& r);   // tensor_ops.cpp: views, factories, copies, scalars

}  // namespace hypershard::ops
