// User rules: an op a user describes from Python (hypershard.register_rule) as dimension factors,
// "mk,kn->mn" style, planned by the factor search matmul, embedding and attention use
// (sharding_search.h): per mesh axis, shard one label (every operand carrying it sharded alike, a
// result without it Partial(sum)), carry one linear operand's Partial, or replicate; the cheapest
// by the one tie-break of every rule. The plan is cached per op like any native rule's, so a
// repeat call never reaches Python.
#include "ops/user_rules.h"

#include <map>
#include <mutex>
#include <unordered_map>

#include "ops/sharding_search.h"
#include "runtime/dispatch.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {

namespace {

const char* const kContext = "register_rule";

std::mutex g_mutex;
auto* g_rules = new std::unordered_map<std::string, UserRule>();  // never destroyed

UserRule rule_of(const OpCall& call) {
  std::lock_guard<std::mutex> guard(g_mutex);
  auto it = g_rules->find(call.name());
  HS_CHECK(it != g_rules->end(), call.name(), "no registered rule (internal error)");
  return it->second;
}

// Debug mode (hs.set_debug_checks): after the planned call, the op runs once more on whole
// (gathered) inputs, and each planned output, made whole, must equal its result. Both sides are
// Replicate by then, computed from the same values by the same kernel, so every rank reaches the
// same verdict. A rule that does not describe the op -- a dim the op mixes left shardable, an
// operand marked linear that is not -- is refused here instead of training on wrong values. The
// only honest difference is a Partial(sum) result summed in another order: float rounding of at
// most (terms summed) x eps x their magnitudes, so |planned - whole| <= 16 x ranks x eps x
// max|whole| (16: slack for the op's own internal reassociation); a wrong rule errs by O(max|whole|).
double machine_epsilon(c10::ScalarType dtype) {
  switch (c10::toRealValueType(dtype)) {
    case c10::ScalarType::Double:
      return 0x1p-52;
    case c10::ScalarType::Half:
      return 0x1p-10;
    case c10::ScalarType::BFloat16:
      return 0x1p-7;
    default:
      return 0x1p-23;  // float32 and the rest
  }
}

void check_against_whole(const OpCall& call, const UserRule& rule, const std::vector<LayoutPtr>& inputs,
                         const std::vector<LayoutPtr>& outputs, const std::vector<c10::IValue>& local_args,
                         const torch::jit::Stack& stack) {
  const auto& mesh = *call.mesh;
  torch::jit::Stack whole(local_args.begin(), local_args.end());
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const TensorArg& t = call.tensors[i];
    if (t.item >= 0) return;  // a Tensor[] argument: not checked
    const auto full = replicate_like(*inputs[i], inputs[i]->global_shape());
    whole[t.arg] = runtime::redistribute_local(whole[t.arg].toTensor(), inputs[i], full, mesh);
  }
  call.op->callBoxed(whole);
  const size_t num_returns = call.schema().returns().size();
  for (size_t r = 0; r < outputs.size() && r < num_returns; ++r) {
    const c10::IValue& planned = stack[stack.size() - num_returns + r];
    if (!planned.isTensor() || !whole[r].isTensor()) continue;
    const at::Tensor expected = whole[r].toTensor();
    const at::Tensor got = runtime::redistribute_local(planned.toTensor(), outputs[r],
                                                       replicate_like(*outputs[r], outputs[r]->global_shape()), mesh);
    if (!expected.is_floating_point() && !expected.is_complex()) {
      if (at::equal(got, expected)) continue;
    } else {
      const double scale = expected.numel() ? expected.abs().max().item<double>() : 0.0;
      const double eps = machine_epsilon(expected.scalar_type());
      const double bound = 16.0 * static_cast<double>(mesh.mesh()->size()) * eps * scale;
      const double diff = got.numel() ? (got - expected).abs().max().item<double>() : 0.0;
      if (diff <= bound) continue;
      fail_call(call, layout::str_cat("debug check on rank ", mesh.rank(), ": the registered rule \"", rule.text,
                                      "\" gives output ", r, " differing from the op on whole inputs by ", diff,
                                      " (bound ", bound,
                                      "); allowed: a rule that describes the op: a dim the op reduces over or "
                                      "mixes must be in `whole` or absent from the result, and only operands the "
                                      "op is linear in may be `linear`"));
    }
    fail_call(call, layout::str_cat("debug check on rank ", mesh.rank(), ": the registered rule \"", rule.text,
                                    "\" gives output ", r,
                                    " differing from the op on whole inputs; allowed: a rule "
                                    "that describes the op"));
  }
}

OpPlan user_rule(const OpCall& call) {
  const UserRule rule = rule_of(call);
  if (call.tensors.size() != rule.inputs.size())
    fail_call(call, layout::str_cat("the registered rule \"", rule.text, "\" names ", rule.inputs.size(),
                                    " tensor arguments but the call has ", call.tensors.size(),
                                    "; allowed: one label string per tensor argument, in the schema's order"));
  FactorSpec spec;
  std::map<char, int64_t> sizes;
  for (size_t i = 0; i < rule.inputs.size(); ++i) {
    const auto& shape = call.layout(static_cast<int64_t>(i)).global_shape();
    const std::string& labels = rule.inputs[i];
    if (static_cast<int64_t>(labels.size()) != static_cast<int64_t>(shape.size()))
      fail_argument(call, static_cast<int64_t>(i), layout::str_cat("has ", shape.size(), " dims"),
                    layout::str_cat(labels.size(), " dims, as the registered rule \"", rule.text, "\" says"));
    for (size_t d = 0; d < labels.size(); ++d) {
      if (labels[d] == kWhole) continue;
      auto [it, added] = sizes.emplace(labels[d], shape[d]);
      if (!added && it->second != shape[d])
        fail_argument(call, static_cast<int64_t>(i),
                      layout::str_cat("size ", shape[d], " of dim '", labels[d], "' differs from ", it->second,
                                      " in another operand"),
                      layout::str_cat("equal sizes per label of \"", rule.text, "\""));
    }
    spec.operands.push_back({static_cast<int64_t>(i), labels, rule.linear[i], false});
  }
  for (const std::string& labels : rule.outputs) {
    std::vector<int64_t> shape;
    for (char label : labels) shape.push_back(sizes.at(label));  // register_user_rule checked they exist
    spec.outputs.push_back(labels);
    spec.out_shapes.push_back(std::move(shape));
  }
  spec.whole = rule.whole;
  OpPlan plan = plan_from_factors(call, spec);
  // Only in debug mode (the typed fast path takes no plan with an expand); switching the mode
  // drops the op's plans (runtime::set_check_replicas), so each mode gets its own.
  if (runtime::check_replicas())
    plan.expand = [rule, inputs = plan.inputs, outputs = plan.outputs](const OpCall& c, torch::jit::Stack& stack) {
      const auto n = static_cast<size_t>(c.num_args());
      const std::vector<c10::IValue> args(stack.end() - n, stack.end());
      c.op->callBoxed(stack);
      check_against_whole(c, rule, inputs, outputs, args, stack);
    };
  return plan;
}

bool is_label(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

}  // namespace

std::vector<std::string> user_rule_names() {
  std::lock_guard<std::mutex> guard(g_mutex);
  std::vector<std::string> out;
  for (const auto& [name, rule] : *g_rules) out.push_back(name);
  return out;
}

void register_user_rule(const std::string& op_name, UserRule rule) {
  const std::string context = layout::str_cat(kContext, ": ", op_name);
  HS_CHECK(!rule.inputs.empty(), context, "\"", rule.text, "\" names no tensor argument; allowed: \"ab,b->a\" style");
  HS_CHECK(rule.linear.size() == rule.inputs.size(), context, rule.linear.size(), " linear flags for ",
           rule.inputs.size(), " operands; allowed: one per operand");
  std::map<char, int> seen;
  for (const std::string& labels : rule.inputs) {
    std::map<char, int> in_operand;
    for (char c : labels) {
      HS_CHECK(is_label(c) || c == kWhole, context, "label '", c, "' in \"", rule.text,
               "\"; allowed: letters, or '.' for a dim that is never sharded");
      if (c == kWhole) continue;
      HS_CHECK(++in_operand[c] == 1, context, "label '", c, "' twice in operand \"", labels,
               "\" (a diagonal); allowed: each label once per operand");
      ++seen[c];
    }
  }
  for (const std::string& labels : rule.outputs)
    for (char c : labels)
      HS_CHECK(seen.count(c) != 0, context, "result label '", c, "' of \"", rule.text,
               "\" names no input dim, so its size is unknown; allowed: labels of the inputs");
  for (char c : rule.whole)
    HS_CHECK(seen.count(c) != 0, context, "whole label '", c, "' is not a label of \"", rule.text, "\"");
  const RuleEntry* existing = registry().find(op_name);
  HS_CHECK(existing == nullptr || std::string(existing->family) == "user", context, "has a native rule (family ",
           existing ? existing->family : "", "); allowed: an op without one");
  {
    std::lock_guard<std::mutex> guard(g_mutex);
    (*g_rules)[op_name] = std::move(rule);
  }
  if (existing == nullptr) add_late_rule("user", op_name, &user_rule);
}

}  // namespace hypershard::ops
