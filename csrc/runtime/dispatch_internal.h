// What the boxed fallback (dispatch.cpp) and the typed fast path (fast_path.cpp) share: the
// per-op information, the plan cache and the steps of the operator flow both run.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ops/op_call.h"
#include "runtime/dtensor_impl.h"

namespace hypershard::runtime::detail {

enum class ReturnKind : int8_t { kFresh, kView, kWritten };

struct ReturnInfo {
  ReturnKind kind = ReturnKind::kFresh;
  int64_t arg = -1;  // the aliased argument
};

// A plan-cache key lives on the stack (no heap allocation on the cached path); the map stores
// owned copies and is searched by hash, then by content.
using PlanKey = c10::SmallVector<int64_t, 24>;

inline uint64_t hash_key(const PlanKey& key) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : key) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  return h;
}

struct CachedPlan {
  std::vector<int64_t> key;
  std::shared_ptr<const ops::OpPlan> plan;
};

constexpr size_t kMaxPlansPerOp = 4096;

struct OpInfo {
  std::string name;
  const ops::RuleEntry* rule = nullptr;
  std::vector<ReturnInfo> returns;
  std::vector<int8_t> written_args;  // per schema argument
  bool is_view = false;
  std::atomic<int64_t> calls{0};  // for coverage reports
  std::atomic<bool> fallback_warned{false};  // the fallback's warning is given once per op
  std::atomic<uint64_t> generation{0};  // bumped when the plan cache is cleared
  std::shared_mutex mutex;
  std::unordered_multimap<uint64_t, CachedPlan> plans;
};

OpInfo& op_info(const c10::OperatorHandle& op);

// Counts one call the fast path ran (its plan came from the fast path's cache).
void count_fast_call(OpInfo& info);

// The plan for the op's arguments on `stack` (collect the tensors, then the cached rule),
// neither counted nor cached: the caller then runs the call through the fallback, which
// counts and caches it. Rule and mesh errors raise as c10::Error with the house text.
std::shared_ptr<const ops::OpPlan> peek_plan(const c10::OperatorHandle& op, OpInfo& info, torch::jit::Stack& stack);

// The first output's local shape on this rank when the plan rewrites a size argument to it
// (OpPlan::local_shape_arg) and that output is split; nullopt when the caller's list stands.
inline std::optional<std::vector<int64_t>> planned_local_shape(const ops::OpPlan& plan, const DeviceMesh& mesh) {
  if (plan.local_shape_arg < 0 || !plan.outputs.at(0)->is_sharded_anywhere()) return std::nullopt;
  return plan.outputs[0]->local_shape_at(mesh.position());
}

// A leaf's .grad keeps the leaf's layout: adds the gradient hook where the leaf's hook list lacks it
// (grad_sync.cpp).
void install_grad_hook(const at::Tensor& leaf);

// ---- plan inference (plan_inference.cpp)

// Strict mode: an op without a rule, or a rule that refuses the caller's layouts, raises instead
// of running through the fallback or an implicit redistribution.
extern std::atomic<bool> g_strict;
extern std::atomic<int64_t> g_hits;  // plan-cache hits, for dispatch_stats

// Preprocess: the call's tensor operands (lists included) with their layouts and dtypes; raises
// when two operands live on different meshes.
void collect_tensors(ops::OpCall& call);
// Tensor operand `t` among `args` (a list element is copied into `scratch`).
const at::Tensor& arg_tensor(const c10::IValue* args, const ops::TensorArg& t, at::Tensor& scratch);
[[noreturn]] void missing_operator(const ops::OpCall& call);
// A plain tensor operand counts as Replicate on the call's mesh, with its own shape.
void layout_plain_tensors(ops::OpCall& call);
// The plan for `call` from the caches, or the rule's on a miss. `record`: count the lookup in the
// dispatch stats and keep a computed plan in the caches; a peek (the fast path filling its own
// slot) does neither, so the call it then makes through the fallback is counted once.
std::shared_ptr<const ops::OpPlan> infer(OpInfo& info, ops::OpCall& call, bool record = true);

// The boxed operator flow, for every call the fast path does not take.
void dtensor_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

}  // namespace hypershard::runtime::detail
