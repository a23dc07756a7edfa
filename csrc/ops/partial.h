// Partial helpers shared by the families: how an error names a Partial op, the one text that
// tells the caller to redistribute a refused Partial input, and a layout without its Partial.
#pragma once

#include <string>
#include <string_view>

#include "ops/op_call.h"

namespace hypershard::ops {

// "Partial(sum)": how the house errors name a Partial op.
inline std::string partial_name(ReduceOp op) { return std::string("Partial(") + layout::reduce_op_name(op) + ")"; }
// `l` must be Partial on some axis.
inline std::string partial_name(const Layout& l) { return partial_name(*l.partial_op()); }

// The `allowed` set of an error that refuses a Partial input, written once so every family says
// it alike: "<layouts> (<why>; redistribute the Partial input first)", `why` optional.
inline std::string redistribute_partial_first(std::string_view why = {},
                                              std::string_view layouts = "Replicate or Shard") {
  std::string text(layouts);
  text += " (";
  if (!why.empty()) text.append(why).append("; ");
  return text += "redistribute the Partial input first)";
}

// `l`'s sharding with no Partial axis (what a redistribution that reduces the Partial gives).
inline LayoutPtr without_partial(const Layout& l) { return make_layout(l, l.global_shape(), l.dim_axes(), {}); }

}  // namespace hypershard::ops
