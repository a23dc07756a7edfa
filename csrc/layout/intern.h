// Interned layouts and cached plans: the per-op path compares and hashes layouts by address.
//
// intern_layout returns the same pointer for the same content (mesh, shape, sharding,
// Partial). Interned layouts and cached plans live for the process: a training run has few
// distinct ones. Thread-safe.
#pragma once

#include <memory>

#include "layout/layout.h"
#include "layout/redistribute_plan.h"

namespace hypershard::layout {

using LayoutPtr = std::shared_ptr<const Layout>;

LayoutPtr intern_layout(const Layout& layout);
// The interned pointer behind `raw` (which must come from intern_layout): lets autograd nodes
// save a plain integer and still recover the shared layout.
LayoutPtr interned(const Layout* raw);
size_t interned_count();

// plan_redistribute(*src, *dst), computed once per pair of interned layouts.
const RedistributePlan& cached_plan(const LayoutPtr& src, const LayoutPtr& dst);
size_t cached_plan_count();

}  // namespace hypershard::layout
