// The boxed fallback that runs every ATen op with a DTensor argument:
// preprocess -> infer_layout (cached) -> redistribute inputs -> local call or expand impl ->
// wrap outputs. Installed by install_dispatch() (called once when hypershard._C loads).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "layout/intern.h"

namespace hypershard::runtime {

void install_dispatch();
// Registers the fallback for composite-explicit ops defined since the last sync (cheap when
// nothing is pending; called at fallback entry and by the DTensor constructors).
void sync_registrations();

struct DispatchStats {
  int64_t calls = 0;
  int64_t cache_hits = 0;
  int64_t cache_entries = 0;   // op plans cached, all ops together
  int64_t fast_calls = 0;      // calls the typed fast path ran without boxing (fast_path.cpp)
  int64_t fallback_calls = 0;  // calls of ops without a rule, run on gathered inputs
  int64_t fallback_bytes = 0;  // global bytes of the non-Replicate inputs those calls gathered
  int64_t implicit_calls = 0;  // calls whose rule refused the inputs' layouts, run on redistributed ones
};
DispatchStats dispatch_stats();
// The number of cached op plans per op ("aten::add.Tensor"), ops without plans left out, sorted.
std::vector<std::pair<std::string, int64_t>> cached_op_plans();
void reset_dispatch_stats();

// Process-free rule inference (the UT level): what the op's rule plans for `stack` (the op's
// arguments, DTensors on a mesh that need not have process groups), without the plan cache and
// without running or redistributing anything. Rule errors propagate (LayoutError / c10::Error).
struct InferredPlan {
  std::vector<layout::LayoutPtr> inputs;   // per tensor argument, in schema order
  std::vector<layout::LayoutPtr> outputs;  // per returned tensor
  bool localizes = false;                  // rewrites non-tensor arguments into local terms
  bool expands = false;                    // replaces the plain local call
  std::string refused;                     // non-empty: what strict mode raises for this plan
};
InferredPlan infer_plan(const c10::OperatorHandle& op, torch::jit::Stack& stack);
// The words of the plan-cache key (runtime/plan_key.h) the op's arguments on `stack` get: tests
// check that different calls never share one.
std::vector<int64_t> plan_key_words(const c10::OperatorHandle& op, torch::jit::Stack& stack);

// Every op hypershard has a rule for, "aten::add.Tensor" style.
std::vector<std::string> rule_names();
// (op name, family file) for every rule, sorted by name.
std::vector<std::pair<std::string, std::string>> rule_families();
// Benchmarks and tests only: calls of `op` ("aten::add.Tensor") ignore its rule while disabled,
// as if it had none (the fallback serves them; strict mode raises Missing operator). Not
// thread-safe against concurrent calls of that op.
void set_rule_enabled(const std::string& op, bool enabled);

// Per-op call counts since the last reset, for coverage reports.
struct OpCount {
  std::string name;
  int64_t calls;
  bool has_rule;
};
std::vector<OpCount> op_counts();
void reset_op_counts();
// Strict mode: an op without a rule raises "Missing operator" (on every rank, before any
// collective). Off by default: such an op runs through the fallback -- inputs gathered to
// Replicate, the op computed on the global values, outputs Replicate -- with a warning once per op.
void set_strict(bool on);
bool strict();
// Debug mode: every plain tensor operand of an op with DTensor operands is checked to be the
// same on every rank (it counts as Replicate); costs one small all-reduce per mesh axis and
// operand.
void set_check_replicas(bool on);
bool check_replicas();

}  // namespace hypershard::runtime
