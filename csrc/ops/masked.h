// Boolean-mask selection and writes in GLOBAL order (masked.cpp): the rules advanced indexing
// (along_dims.cpp) hands a boolean mask index to.
#pragma once

#include "ops/op_call.h"

namespace hypershard::ops {

// self[mask] with one boolean mask over self's leading dims (index.Tensor).
OpPlan bool_mask_index_rule(const OpCall& call);
// self[mask] = values / += values (index_put, index_put_, _index_put_impl_) with one boolean mask.
OpPlan bool_mask_index_put_rule(const OpCall& call);
// Whether the index list of an index / index_put call holds a boolean mask.
bool has_bool_mask_index(const OpCall& call);

}  // namespace hypershard::ops
