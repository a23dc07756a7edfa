// Rules stated as dimension factors (Shardy style), shared by the embedding, normalization and
// attention families: every tensor dim gets a one-char label; operands that carry the same
// label are sharded alike (same mesh axes, same order, hence the same torch.chunk blocks).
//
// Each mesh axis takes one role:
//   shard a label   every operand carrying the label is sharded on it, the others whole on that
//                   axis; a result that carries the label is sharded the same way, a result
//                   without it is a sum over the label: Partial(sum) on that axis.
//   carry           the `linear` operand is Partial(sum|avg) and every other operand whole: every
//                   result (linear in that operand) is Partial with the same op.
//   replicate       everything whole on that axis.
// The roles the inputs suggest are tried first (zero redistribution); on a miss every
// combination is costed (elements moved, cached_plan) and the cheapest wins (ties: fewer inputs
// redistributed, then fewer Partial result axes). Labels in `whole` are never sharded (an input
// sharded on one is gathered); kWhole marks a single dim that is never sharded (a size-1
// broadcast dim). Partial on a non-linear operand, or a max/min Partial, is reduced by the
// redistribution: rules that must refuse a sum/avg Partial check it before calling plan_factors.
// `fixed` pins an axis to shard a label (for a label only a result carries, such as the rows of
// a vocab-parallel table's gradient).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "ops/op_call.h"

namespace hypershard::ops {

constexpr char kWhole = '.';

struct FactorOperand {
  int64_t tensor = -1;  // OpCall tensor index
  std::string labels;   // one per dim
  bool linear = false;  // may carry a sum/avg Partial into every result
};

struct FactorSpec {
  std::vector<FactorOperand> operands;
  std::vector<std::string> outputs;              // labels per result
  std::vector<std::vector<int64_t>> out_shapes;  // GLOBAL shape per result
  std::string whole;                             // labels never sharded
  // Axes whose role is fixed by the caller: (axis, label to shard), major -> minor per label.
  std::vector<std::pair<int64_t, char>> fixed;
};

struct FactorPlan {
  std::vector<LayoutPtr> inputs;   // per operand (spec order)
  std::vector<LayoutPtr> outputs;  // per result
  // Per mesh axis: the label it shards (0: none) and whether it carries a Partial.
  std::vector<char> shard_label;
  std::vector<bool> carry;
  int64_t cost = 0;
  int64_t changed = 0;
  int64_t partial_axes = 0;
};

FactorPlan plan_factors(const OpCall& call, const FactorSpec& spec);

// `plan`'s input layouts in OpCall order (tensors outside the spec keep their layout).
std::vector<LayoutPtr> inputs_in_call_order(const OpCall& call, const FactorSpec& spec, const FactorPlan& plan);

}  // namespace hypershard::ops
