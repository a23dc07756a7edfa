// What the boxed fallback (dispatch.cpp) and the typed fast path (fast_path.cpp) share: the
// per-op information, the plan cache and the steps of the operator flow both run.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/AutogradState.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ops/op_call.h"
#include "runtime/dtensor_impl.h"
#include "runtime/plan_key.h"

namespace hypershard::runtime::detail {

enum class ReturnKind : int8_t { kFresh, kView, kWritten };

struct ReturnInfo {
  ReturnKind kind = ReturnKind::kFresh;
  int64_t arg = -1;  // the aliased argument
};

// The shared plan cache stores owned copies of the keys (plan_key.h) and is searched by hash,
// then by content.
struct CachedPlan {
  std::vector<int64_t> key;
  std::shared_ptr<const ops::OpPlan> plan;

  bool same(const PlanKey& other) const {
    const auto& words = other.words();
    return key.size() == words.size() && std::equal(words.begin(), words.end(), key.begin());
  }
};

constexpr size_t kMaxPlansPerOp = 4096;

struct OpInfo {
  std::string name;
  const ops::RuleEntry* rule = nullptr;
  std::vector<ReturnInfo> returns;
  std::vector<int8_t> written_args;  // per schema argument
  std::vector<int8_t> tensor_args;   // per schema argument: declared Tensor, Tensor? or a list of them
  bool is_view = false;
  std::atomic<int64_t> calls{0};             // for coverage reports
  std::atomic<bool> fallback_warned{false};  // the fallback's warning is given once per op
  std::atomic<uint64_t> generation{0};       // bumped when the plan cache is cleared
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
// The plan-cache key of the op's arguments on `stack` (the op must have a rule).
void key_of_stack(const c10::OperatorHandle& op, OpInfo& info, torch::jit::Stack& stack, PlanKey& key);

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

// Whether a schema argument is declared Tensor, Tensor?, Tensor[] or Tensor?[].
bool is_tensor_typed(const c10::TypePtr& type);
// Preprocess: the call's tensor operands (lists included) with their layouts and dtypes; raises
// when two operands live on different meshes.
void collect_tensors(ops::OpCall& call);
// Tensor operand `t` among `args` (a list element is copied into `scratch`).
const at::Tensor& arg_tensor(const c10::IValue* args, const ops::TensorArg& t, at::Tensor& scratch);
[[noreturn]] void missing_operator(const ops::OpCall& call);
// A plain tensor operand counts as Replicate on the call's mesh, with its own shape.
void layout_plain_tensors(ops::OpCall& call);
// The plan-cache key of `call` (plan_key.h): every argument in schema order, non-tensor ones when
// the rule reads them, then whether the call runs in a backward pass.
void plan_key(const OpInfo& info, const ops::OpCall& call, PlanKey& key);
// The plan for `call` from the caches, or the rule's on a miss. `record`: count the lookup in the
// dispatch stats and keep a computed plan in the caches; a peek (the fast path filling its own
// slot) does neither, so the call it then makes through the fallback is counted once.
std::shared_ptr<const ops::OpPlan> infer(OpInfo& info, ops::OpCall& call, bool record = true);

// ---- the operator flow (operator_flow.cpp): preprocess -> infer_layout -> get_expand_impl ->
// execute_local -> wrap_output. dtensor_fallback runs the five for every call the fast path does
// not take; the fast path runs them for its calls with typed arguments, sharing what follows.

extern std::atomic<int64_t> g_calls;           // every DTensor op call
extern std::atomic<int64_t> g_fallback_calls;  // calls computed on gathered inputs (no rule)
extern std::atomic<int64_t> g_fallback_bytes;
extern std::atomic<int64_t> g_implicit_calls;  // calls default mode redistributed implicitly
extern std::atomic<bool> g_check_replicas;     // debug: plain operands must match on every rank

// 1. preprocess: the OpCall over `args` (the schema's arguments in order), every tensor argument
// collected with its layout and the call's mesh found; mesh errors raise (c10::Error, the house
// text) before anything runs.
ops::OpCall preprocess(const c10::OperatorHandle& op, const OpInfo& info, const c10::IValue* args);

// 2. infer_layout: the plan from the caches, or the rule's on a miss. Strict mode raises for an
// op without a rule, arguments a rule does not cover, and a plan that redistributes implicitly;
// in default mode the first two come back without a plan, for the gather fallback.
struct Inferred {
  std::shared_ptr<const ops::OpPlan> plan;
  const char* fallback_reason = nullptr;  // without a plan: what the fallback's warning says
};
Inferred infer_layout(OpInfo& info, ops::OpCall& call);

// 3. get_expand_impl: what computes the local result -- the plan's expand implementation
// (collectives inside the op, GLOBAL offsets, ...) or, without one, the op's own ATen kernel.
struct LocalImpl {
  const c10::OperatorHandle* op = nullptr;
  const ops::ExpandFn* expand = nullptr;
  void operator()(const ops::OpCall& call, torch::jit::Stack& stack) const {
    if (expand)
      (*expand)(call, stack);
    else
      op->callBoxed(&stack);
  }
};
LocalImpl get_expand_impl(const c10::OperatorHandle& op, const ops::OpPlan& plan);

// 4. local execution runs below autograd (the wrappers record the op), below autocast (applied to
// the wrappers already), and with view replay for view ops. Every path that runs a local op
// holds this guard.
struct LocalExecutionGuard {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
  explicit LocalExecutionGuard(bool is_view) {
    if (is_view) c10::AutogradState::get_tls_state().set_view_replay_enabled(true);
  }
};

// 5. wrap_output: each returned local becomes a DTensor in its planned layout (operator_flow.cpp's
// wrap_output walks the boxed returns, the fast path wraps its one typed return); both wrap with:

// The base of a view op's outputs when its input had to be redistributed (they do not alias it).
struct DetachedBase {
  DTensorImpl* impl = nullptr;
  int64_t version = -1;  // its version counter's value, -1 without one (inference tensors)

  explicit operator bool() const { return impl != nullptr; }
  static DetachedBase of(const at::Tensor& base) {
    const auto& counter = base.unsafeGetTensorImpl()->version_counter();
    return {dtensor_impl(base), counter.enabled() ? static_cast<int64_t>(counter.current_version()) : -1};
  }
};
// How a returned view is wrapped: with the local's geometry, or the given one (the rule's or a
// meta shadow's; null: the wrapper's default); a view of a redistributed input is marked as not
// aliasing its base.
struct OutputView {
  bool local_geometry = true;
  const Geometry* geometry = nullptr;
  DetachedBase detached;
};
// One returned local as a DTensor; `view` null for a fresh tensor.
at::Tensor wrap_local(at::Tensor local, const LayoutPtr& layout, const DeviceMeshPtr& mesh, const OutputView* view);

// The boxed operator flow, for every call the fast path does not take.
void dtensor_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

}  // namespace hypershard::runtime::detail
