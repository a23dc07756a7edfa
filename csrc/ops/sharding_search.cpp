#include "ops/sharding_search.h"

#include <algorithm>

namespace hypershard::ops {

void SearchScore::add_input(const LayoutPtr& current, const LayoutPtr& required) {
  cost += layout::cached_plan(current, required).total_elements();
  changed += required != current;
}

bool better(const SearchScore& a, const SearchScore& b) {
  if (a.cost != b.cost) return a.cost < b.cost;
  if (a.changed != b.changed) return a.changed < b.changed;
  return a.partial_axes < b.partial_axes;
}

namespace {

// One role of a mesh axis (see the header comment).
struct Role {
  char label = 0;                 // shard this label
  std::optional<ReduceOp> carry;  // or carry a Partial with this op
  int carrier = -1;               // through this operand (spec index)
  bool operator==(const Role& o) const { return label == o.label && carry == o.carry && carrier == o.carrier; }
};

bool shardable(const FactorSpec& spec, char label) {
  return label != kWhole && spec.whole.find(label) == std::string::npos;
}

// The roles the operands suggest for `axis`, in operand order, Replicate last.
std::vector<Role> axis_candidates(const OpCall& call, const FactorSpec& spec, int64_t axis) {
  std::vector<Role> out;
  for (const auto& [fixed_axis, label] : spec.fixed)
    if (fixed_axis == axis) return {Role{label, std::nullopt}};
  auto add = [&](const Role& r) {
    if (std::find(out.begin(), out.end(), r) == out.end()) out.push_back(r);
  };
  const int n = static_cast<int>(spec.operands.size());
  for (int i = 0; i < n; ++i) {
    const auto& operand = spec.operands[i];
    const Layout& l = call.layout(operand.tensor);
    const int64_t d = l.sharded_dim(axis);
    if (d >= 0 && shardable(spec, operand.labels[d])) {
      add(Role{operand.labels[d], std::nullopt});
      continue;
    }
    const auto& op = l.partial()[axis];
    if (!op || !is_sum_like(*op)) continue;
    if (operand.linear) add(Role{0, *op, i});
    if (operand.additive)  // a Partial bias: carried by filling a linear operand (either one)
      for (int j = 0; j < n; ++j)
        if (spec.operands[j].linear) add(Role{0, *op, j});
  }
  add(Role{});
  return out;
}

// The layouts a combination of roles asks for; nullopt when a result would mix Partial ops.
std::optional<FactorPlan> evaluate(const OpCall& call, const FactorSpec& spec, const std::vector<Role>& roles) {
  const int64_t mesh_ndim = static_cast<int64_t>(roles.size());
  // The axes of a label, in the order of the first operand that shards it with them.
  auto label_axes = [&](char label) {
    std::vector<int64_t> axes;
    if (!shardable(spec, label)) return axes;
    auto chosen = [&](int64_t a) {
      return roles[a].label == label && std::find(axes.begin(), axes.end(), a) == axes.end();
    };
    for (const auto& [a, fixed_label] : spec.fixed)
      if (fixed_label == label && chosen(a)) axes.push_back(a);
    for (const auto& operand : spec.operands)
      for (size_t d = 0; d < operand.labels.size(); ++d)
        if (operand.labels[d] == label)
          for (int64_t a : call.layout(operand.tensor).dim_axes()[d])
            if (chosen(a)) axes.push_back(a);
    for (int64_t a = 0; a < mesh_ndim; ++a)
      if (chosen(a)) axes.push_back(a);
    return axes;
  };

  // The results' Partials first: an additive operand takes result 0's.
  std::vector<layout::PartialOps> out_partial(spec.outputs.size(), layout::PartialOps(mesh_ndim));
  FactorPlan plan;
  for (size_t r = 0; r < spec.outputs.size(); ++r) {
    std::optional<ReduceOp> shared;
    for (int64_t a = 0; a < mesh_ndim; ++a) {
      auto& p = out_partial[r][a];
      if (roles[a].carry)
        p = roles[a].carry;
      else if (roles[a].label && spec.outputs[r].find(roles[a].label) == std::string::npos)
        p = ReduceOp::Sum;
      if (!p) continue;
      if (shared && *shared != *p) return std::nullopt;  // one Partial op per layout
      shared = p;
      ++plan.score.partial_axes;
    }
  }

  plan.shard_label.assign(mesh_ndim, 0);
  plan.carry.assign(mesh_ndim, false);
  for (int64_t a = 0; a < mesh_ndim; ++a) {
    plan.shard_label[a] = roles[a].label;
    plan.carry[a] = roles[a].carry.has_value();
  }
  for (size_t i = 0; i < spec.operands.size(); ++i) {
    const auto& operand = spec.operands[i];
    const auto& current = call.tensors[operand.tensor].layout;
    layout::DimAxes dims;
    for (char label : operand.labels) dims.push_back(label_axes(label));
    layout::PartialOps partial(mesh_ndim);
    for (int64_t a = 0; a < mesh_ndim; ++a) {
      if (operand.additive && !out_partial.empty())
        partial[a] = out_partial[0][a];
      else if (roles[a].carrier == static_cast<int>(i))
        partial[a] = roles[a].carry;
    }
    auto required = make_layout(*current, current->global_shape(), std::move(dims), std::move(partial));
    plan.score.add_input(current, required);
    plan.inputs.push_back(std::move(required));
  }
  for (size_t r = 0; r < spec.outputs.size(); ++r) {
    layout::DimAxes dims;
    for (char label : spec.outputs[r]) dims.push_back(label_axes(label));
    plan.outputs.push_back(make_layout(call.layout(spec.operands[0].tensor), spec.out_shapes[r], std::move(dims),
                                       std::move(out_partial[r])));
  }
  return plan;
}

}  // namespace

FactorPlan plan_factors(const OpCall& call, const FactorSpec& spec) {
  for (const auto& operand : spec.operands)
    if (static_cast<int64_t>(operand.labels.size()) != call.layout(operand.tensor).ndim())
      fail_argument(call, operand.tensor, "has " + std::to_string(call.layout(operand.tensor).ndim()) + " dims",
                    std::to_string(operand.labels.size()) + " dims");
  const int64_t mesh_ndim = call.mesh->mesh()->ndim();
  std::vector<std::vector<Role>> options(mesh_ndim);
  std::vector<size_t> sizes(mesh_ndim);
  for (int64_t a = 0; a < mesh_ndim; ++a) {
    options[a] = axis_candidates(call, spec, a);
    sizes[a] = options[a].size();
  }
  std::vector<Role> roles(mesh_ndim);
  auto best = search_combinations(sizes, [&](const std::vector<size_t>& pick) {
    for (int64_t a = 0; a < mesh_ndim; ++a) roles[a] = options[a][pick[a]];
    return evaluate(call, spec, roles);
  });
  if (!best) fail_call(call, "internal error: no layout for the factors");  // all-Replicate always fits
  return std::move(*best);
}

OpPlan to_op_plan(const OpCall& call, const FactorSpec& spec, const FactorPlan& plan) {
  OpPlan out;
  for (const auto& t : call.tensors) out.inputs.push_back(t.layout);
  for (size_t i = 0; i < spec.operands.size(); ++i) out.inputs[spec.operands[i].tensor] = plan.inputs[i];
  out.outputs = plan.outputs;
  return out;
}

OpPlan plan_from_factors(const OpCall& call, const FactorSpec& spec) {
  return to_op_plan(call, spec, plan_factors(call, spec));
}

}  // namespace hypershard::ops
