// The one sharding search of csrc/ops: how a rule that has several acceptable layouts picks one.
// matmul, the factor rules (embedding, normalization, attention), pointwise and loss use it.
//
// A search tries combinations of options, one option per slot: a slot is a mesh axis and its
// options the roles that axis may take (plan_factors below), or a single slot listing whole
// candidate layouts (pointwise: each operand's sharding; loss: grad's or output's, self's or
// target's). The caller's evaluate turns a combination into a scored plan, or nullopt where the
// options cannot coexist. Every slot's first option is what the inputs suggest, so the first
// combination is taken at once when it redistributes nothing; otherwise every combination is
// scored and the best wins by `better`, the one tie-break of every rule:
//   1. fewer elements moved by the input redistributions (cached_plan);
//   2. fewer inputs redistributed;
//   3. fewer Partial result axes (a Partial result is a reduction someone pays later);
//   4. the earlier combination (the inputs' own suggestions come first).
// So a plan does not depend on the order of equally cheap candidates: add(Partial, Shard) and
// add(Shard, Partial) both give the Shard result.
//
// plan_factors states a rule as dimension factors (Shardy style): every tensor dim gets a
// one-char label; operands that carry the same label are sharded alike (same mesh axes, same
// order, hence the same torch.chunk blocks). Each mesh axis takes one role:
//   shard a label   every operand carrying the label is sharded on it, the others whole on that
//                   axis; a result that carries the label is sharded the same way, a result
//                   without it is a sum over the label: Partial(sum) on that axis.
//   carry           ONE `linear` operand is Partial(sum|avg) and every other operand whole: every
//                   result (linear in that operand) is Partial with the same op. A product is
//                   linear in each factor separately, so each linear operand is its own carrier:
//                   (sum_i a_i) b = sum_i (a_i b), but (sum_i a_i)(sum_j b_j) != sum_i a_i b_i.
//   replicate       everything whole on that axis.
// An `additive` operand (a bias added to result 0) takes result 0's Partial on every axis: a
// whole bias is filled for free (rank 0 keeps it, the others hold 0), a Partial bias suggests
// carrying its Partial through each linear operand (the cost decides which).
// Labels in `whole` are never sharded (an input sharded on one is gathered); kWhole marks a
// single dim that is never sharded (a size-1 broadcast dim). Partial on a non-linear operand,
// or a max/min Partial, is reduced by the redistribution: rules that must refuse a sum/avg
// Partial check it before calling plan_factors. `fixed` pins an axis to shard a label (for a
// label only a result carries, such as the rows of a vocab-parallel table's gradient).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops/op_call.h"

namespace hypershard::ops {

// ------------------------------------------------------------------ scoring, the tie-break

struct SearchScore {
  int64_t cost = 0;          // elements moved by the input redistributions
  int64_t changed = 0;       // inputs redistributed
  int64_t partial_axes = 0;  // Partial axes of the results
  // Counts the redistribution of one input from `current` to `required`.
  void add_input(const LayoutPtr& current, const LayoutPtr& required);
};

// Is `a` strictly better than `b` (the header comment's rule)? Equal scores keep the earlier.
bool better(const SearchScore& a, const SearchScore& b);

// ------------------------------------------------------------------ the search loop

// Tries the combinations of one option per slot (`sizes[s]` options in slot s; none may be
// empty), as the header comment says. evaluate(pick), pick[s] the option of slot s, returns a
// std::optional of a plan with a `SearchScore score`; the best plan, nullopt when none fits.
template <class Evaluate>
auto search_combinations(const std::vector<size_t>& sizes, Evaluate&& evaluate) {
  std::vector<size_t> pick(sizes.size(), 0);
  auto best = evaluate(pick);
  if (best && best->score.changed == 0) return best;
  // The odometer over the rest, the last slot fastest; the first combination is scored above.
  auto advance = [&] {
    for (size_t s = sizes.size(); s-- > 0;) {
      if (++pick[s] < sizes[s]) return true;
      pick[s] = 0;
    }
    return false;
  };
  while (advance())
    if (auto c = evaluate(pick); c && (!best || better(c->score, best->score))) best = std::move(c);
  return best;
}

// The same over one list of `n` > 0 whole candidates: evaluate(i) for the i-th.
template <class Evaluate>
auto search_candidates(size_t n, Evaluate&& evaluate) {
  return search_combinations({n}, [&](const std::vector<size_t>& pick) { return evaluate(pick[0]); });
}

// ------------------------------------------------------------------ rules as factors

constexpr char kWhole = '.';

struct FactorOperand {
  int64_t tensor = -1;    // OpCall tensor index
  std::string labels;     // one per dim
  bool linear = false;    // may carry its sum/avg Partial into every result
  bool additive = false;  // added to result 0: takes its Partial (see the header comment)
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
  SearchScore score;
};

// The best roles of the mesh axes for `spec`.
FactorPlan plan_factors(const OpCall& call, const FactorSpec& spec);

// `plan` as a rule's OpPlan: the input layouts in OpCall order (tensors outside the spec keep
// theirs) and the results' layouts.
OpPlan to_op_plan(const OpCall& call, const FactorSpec& spec, const FactorPlan& plan);
// The whole rule of an op stated as factors: to_op_plan of plan_factors.
OpPlan plan_from_factors(const OpCall& call, const FactorSpec& spec);

}  // namespace hypershard::ops
