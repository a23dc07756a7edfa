#include "ops/factors.h"

#include <algorithm>
#include <optional>

namespace hypershard::ops {
namespace {


struct Role {
  char label = 0;                  // shard this label
  std::optional<ReduceOp> carry;   // or carry a Partial with this op
  bool operator==(const Role& o) const { return label == o.label && carry == o.carry; }
};

bool shardable(const FactorSpec& spec, char label) {
  return label != kWhole && spec.whole.find(label) == std::string::npos;
}

std::vector<Role> axis_candidates(const OpCall& call, const FactorSpec& spec, int64_t axis) {
  std::vector<Role> out;
  for (const auto& [fixed_axis, label] : spec.fixed)
    if (fixed_axis == axis) return {Role{label, std::nullopt}};
  auto add = [&](const Role& r) {
    if (std::find(out.begin(), out.end(), r) == out.end()) out.push_back(r);
  };
  for (const auto& operand : spec.operands) {
    const Layout& l = call.layout(operand.tensor);
    const int64_t d = l.sharded_dim(axis);
    if (d >= 0 && shardable(spec, operand.labels[d])) add(Role{operand.labels[d], std::nullopt});
    else if (const auto& op = l.partial()[axis]; op && operand.linear && is_sum_like(*op)) add(Role{0, *op});
  }
  add(Role{});
  return out;
}

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

  FactorPlan plan;
  plan.shard_label.assign(mesh_ndim, 0);
  plan.carry.assign(mesh_ndim, false);
  for (int64_t a = 0; a < mesh_ndim; ++a) {
    plan.shard_label[a] = roles[a].label;
    plan.carry[a] = roles[a].carry.has_value();
  }
  for (const auto& operand : spec.operands) {
    const auto& current = call.tensors[operand.tensor].layout;
    layout::DimAxes dims;
    for (char label : operand.labels) dims.push_back(label_axes(label));
    layout::PartialOps partial(mesh_ndim);
    if (operand.linear)
      for (int64_t a = 0; a < mesh_ndim; ++a) partial[a] = roles[a].carry;
    auto required = make_layout(*current, current->global_shape(), std::move(dims), std::move(partial));
    plan.cost += layout::cached_plan(current, required).total_elements();
    plan.changed += required != current;
    plan.inputs.push_back(std::move(required));
  }
  for (size_t r = 0; r < spec.outputs.size(); ++r) {
    const auto& labels = spec.outputs[r];
    layout::PartialOps partial(mesh_ndim);
    std::optional<ReduceOp> shared;
    for (int64_t a = 0; a < mesh_ndim; ++a) {
      if (roles[a].carry) partial[a] = roles[a].carry;
      else if (roles[a].label && labels.find(roles[a].label) == std::string::npos) partial[a] = ReduceOp::Sum;
      if (!partial[a]) continue;
      if (shared && *shared != *partial[a]) return std::nullopt;  // one Partial op per layout
      shared = partial[a];
      ++plan.partial_axes;
    }
    layout::DimAxes dims;
    for (char label : labels) dims.push_back(label_axes(label));
    plan.outputs.push_back(make_layout(call.layout(spec.operands[0].tensor), spec.out_shapes[r], std::move(dims),
                                       std::move(partial)));
  }
  return plan;
}

bool better(const FactorPlan& a, const FactorPlan& b) {
  if (a.cost != b.cost) return a.cost < b.cost;
  if (a.changed != b.changed) return a.changed < b.changed;
  return a.partial_axes < b.partial_axes;
}

}  // namespace

FactorPlan plan_factors(const OpCall& call, const FactorSpec& spec) {
  for (const auto& operand : spec.operands)
    if (static_cast<int64_t>(operand.labels.size()) != call.layout(operand.tensor).ndim())
      fail_argument(call, operand.tensor, "has " + std::to_string(call.layout(operand.tensor).ndim()) + " dims",
                    std::to_string(operand.labels.size()) + " dims");
  const int64_t mesh_ndim = call.mesh->mesh()->ndim();
  std::vector<std::vector<Role>> options(mesh_ndim);
  for (int64_t a = 0; a < mesh_ndim; ++a) options[a] = axis_candidates(call, spec, a);

  std::vector<Role> roles(mesh_ndim);
  for (int64_t a = 0; a < mesh_ndim; ++a) roles[a] = options[a].front();
  std::optional<FactorPlan> best = evaluate(call, spec, roles);
  if (!best || best->changed != 0) {
    best.reset();
    std::vector<size_t> pick(mesh_ndim, 0);
    for (bool more = true; more;) {
      for (int64_t a = 0; a < mesh_ndim; ++a) roles[a] = options[a][pick[a]];
      if (auto c = evaluate(call, spec, roles); c && (!best || better(*c, *best))) best = std::move(c);
      more = false;
      for (int64_t a = mesh_ndim - 1; a >= 0 && !more; --a) {
        if (++pick[a] < options[a].size()) more = true;
        else pick[a] = 0;
      }
    }
  }
  if (!best) fail_call(call, "internal error: no layout for the factors");  // all-Replicate always fits
  return std::move(*best);
}

std::vector<LayoutPtr> inputs_in_call_order(const OpCall& call, const FactorSpec& spec, const FactorPlan& plan) {
  std::vector<LayoutPtr> inputs;
  for (const auto& t : call.tensors) inputs.push_back(t.layout);
  for (size_t i = 0; i < spec.operands.size(); ++i) inputs[spec.operands[i].tensor] = plan.inputs[i];
  return inputs;
}

}  // namespace hypershard::ops
