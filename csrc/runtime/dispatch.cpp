#include "runtime/dispatch.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/AutogradState.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_map>

#include "layout/error.h"
#include "ops/families.h"
#include "ops/user_rules.h"
#include "runtime/dispatch_internal.h"
#include "runtime/dtensor_impl.h"
#include "runtime/fast_path.h"
#include "runtime/redistribute.h"
#include "runtime/thread_cache.h"

namespace hypershard::runtime {
namespace {

using detail::arg_tensor;
using detail::CachedPlan;
using detail::collect_tensors;
using detail::dtensor_fallback;
using detail::g_calls;
using detail::g_check_replicas;
using detail::g_fallback_bytes;
using detail::g_fallback_calls;
using detail::g_hits;
using detail::g_implicit_calls;
using detail::g_strict;
using detail::infer;
using detail::install_grad_hook;
using detail::kMaxPlansPerOp;
using detail::layout_plain_tensors;
using detail::missing_operator;
using detail::op_info;
using detail::OpInfo;
using detail::preprocess;
using detail::ReturnInfo;
using detail::ReturnKind;

std::shared_mutex g_infos_mutex;
auto* g_infos = new std::unordered_map<const void*, OpInfo*>();  // never destroyed
std::atomic<int64_t> g_fast_calls{0};

OpInfo* build_op_info(const c10::OperatorHandle& op) {
  auto* info = new OpInfo();
  const auto& schema = op.schema();
  const auto& n = schema.operator_name();
  info->name = n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
  info->rule = ops::registry().find(info->name);
  const auto& args = schema.arguments();
  info->written_args.assign(args.size(), 0);
  info->tensor_args.assign(args.size(), 0);
  for (size_t a = 0; a < args.size(); ++a) {
    info->written_args[a] = args[a].alias_info() && args[a].alias_info()->isWrite();
    info->tensor_args[a] = detail::is_tensor_typed(args[a].type());
  }
  for (const auto& ret : schema.returns()) {
    ReturnInfo r;
    if (const auto* alias = ret.alias_info()) {
      for (size_t a = 0; a < args.size(); ++a) {
        const auto* arg_alias = args[a].alias_info();
        if (arg_alias && arg_alias->beforeSets() == alias->beforeSets()) {
          r.arg = static_cast<int64_t>(a);
          break;
        }
      }
      r.kind = alias->isWrite() ? ReturnKind::kWritten : ReturnKind::kView;
      if (r.kind == ReturnKind::kView) info->is_view = true;
    }
    info->returns.push_back(r);
  }
  return info;
}

}  // namespace

OpInfo& detail::op_info(const c10::OperatorHandle& op) {
  const void* key = &op.schema();
  const uint64_t hash = reinterpret_cast<uintptr_t>(key) >> 4;
  // No lock on the per-op path once this thread has seen the op.
  thread_local ThreadCache<std::pair<const void*, OpInfo*>, 64, 4> recent;
  if (auto* hit = recent.find(hash, [&](const auto& e) { return e.first == key; })) return *hit->second;
  OpInfo* info = nullptr;
  {
    std::shared_lock<std::shared_mutex> read(g_infos_mutex);
    auto it = g_infos->find(key);
    if (it != g_infos->end()) info = it->second;
  }
  if (!info) {
    std::unique_lock<std::shared_mutex> write(g_infos_mutex);
    auto& slot = (*g_infos)[key];
    if (!slot) slot = build_op_info(op);
    info = slot;
  }
  recent.claim(hash) = {key, info};
  return *info;
}

namespace {

// ------------------------------------------------------------------ registration

// The fallback kernels maybe_register gave ops, by op: kept for the process, except where a typed
// kernel replaces one (register_user_rule).
std::mutex g_fallback_kernels_mutex;
auto* g_fallback_kernels = new std::unordered_map<c10::OperatorName, c10::RegistrationHandleRAII>();

// Ops whose CompositeExplicitAutograd kernel would otherwise win over the backend fallback on
// PrivateUse2 (and would run on the storage-less wrapper): register the fallback for them.
// CompositeImplicitAutograd ops are left alone: they must decompose.
void maybe_register(const c10::OperatorHandle& op) {
  if (!op.hasSchema()) return;
  if (op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) return;
  if (!op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
      !op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
    return;
  if (op.hasKernelForDispatchKey(c10::DispatchKey::PrivateUse2)) return;
  auto handle = c10::Dispatcher::singleton().registerImpl(
      op.operator_name(), c10::DispatchKey::PrivateUse2,
      c10::KernelFunction::makeFromBoxedFunction<&dtensor_fallback>(), std::nullopt, nullptr,
      "hypershard: DTensor fallback (composite-explicit op)");
  std::lock_guard<std::mutex> guard(g_fallback_kernels_mutex);
  g_fallback_kernels->emplace(op.operator_name(), std::move(handle));
}

// The dispatcher calls listeners with its lock held, so a listener only notes the op; the
// registration happens at the next sync (fallback entry or a DTensor constructor).
std::mutex g_pending_mutex;
std::vector<c10::OperatorName>* g_pending = new std::vector<c10::OperatorName>();
std::atomic<bool> g_has_pending{false};

class Listener : public c10::OpRegistrationListener {
 public:
  void onOperatorRegistered(const c10::OperatorHandle& op) override {
    std::lock_guard<std::mutex> guard(g_pending_mutex);
    g_pending->push_back(op.operator_name());
    g_has_pending.store(true, std::memory_order_release);
  }
  void onOperatorDeregistered(const c10::OperatorHandle&) override {}
};

}  // namespace

namespace detail {

void count_fast_call(OpInfo& info) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  g_hits.fetch_add(1, std::memory_order_relaxed);
  g_fast_calls.fetch_add(1, std::memory_order_relaxed);
  info.calls.fetch_add(1, std::memory_order_relaxed);
}

std::shared_ptr<const ops::OpPlan> peek_plan(const c10::OperatorHandle& op, OpInfo& info, torch::jit::Stack& stack) {
  ops::OpCall call = preprocess(op, info, stack.data() + (stack.size() - op.schema().arguments().size()));
  if (!info.rule) missing_operator(call);
  try {
    return infer(info, call, /*record=*/false);
  } catch (const ops::NotCovered&) {
    throw;  // the boxed path decides (fallback or error)
  } catch (const layout::LayoutError& e) {
    TORCH_CHECK(false, e.what());
  }
}

void key_of_stack(const c10::OperatorHandle& op, OpInfo& info, torch::jit::Stack& stack, PlanKey& key) {
  ops::OpCall call = preprocess(op, info, stack.data() + (stack.size() - op.schema().arguments().size()));
  HS_CHECK(info.rule != nullptr, info.name, "has no rule, so no plan key");
  plan_key(info, call, key);
}

}  // namespace detail

std::vector<int64_t> plan_key_words(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  sync_registrations();
  PlanKey key;
  detail::key_of_stack(op, op_info(op), stack, key);
  return std::vector<int64_t>(key.words().begin(), key.words().end());
}

void sync_registrations() {
  if (!g_has_pending.load(std::memory_order_acquire)) return;
  std::vector<c10::OperatorName> pending;
  {
    std::lock_guard<std::mutex> guard(g_pending_mutex);
    pending.swap(*g_pending);
    g_has_pending.store(false, std::memory_order_release);
  }
  for (const auto& name : pending)
    if (auto op = c10::Dispatcher::singleton().findOp(name)) maybe_register(*op);
}

InferredPlan infer_plan(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  sync_registrations();
  OpInfo& info = op_info(op);
  const size_t num_args = op.schema().arguments().size();
  TORCH_CHECK(stack.size() >= num_args, "hypershard: infer_plan: ", info.name, " needs ", num_args, " arguments");
  ops::OpCall call;
  call.op = &op;
  call.args = stack.data() + (stack.size() - num_args);
  collect_tensors(call);
  TORCH_CHECK(call.mesh != nullptr, "hypershard: infer_plan: ", info.name, ": no DTensor argument");
  if (!info.rule) missing_operator(call);
  layout_plain_tensors(call);
  auto plan = info.rule->rule(call);
  const bool localizes = plan.localize || plan.local_shape_arg >= 0 || plan.shifted_int_arg >= 0;
  return {std::move(plan.inputs), std::move(plan.outputs), localizes, static_cast<bool>(plan.expand),
          std::move(plan.refused)};
}

void install_dispatch() {
  static std::once_flag once;
  std::call_once(once, [] {
    static auto* library =
        new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse2, __FILE__, __LINE__);
    library->fallback(torch::CppFunction::makeFromBoxedFunction<&dtensor_fallback>());
    ops::registry().install_kernels();
    register_fast_paths();  // after the families' kernels: it skips an op that has one
    // The listener is also told of every op registered so far; sync registers them.
    static auto* listener = new c10::RegistrationHandleRAII(
        c10::Dispatcher::singleton().addRegistrationListener(std::make_unique<Listener>()));
    (void)listener;
    sync_registrations();
    c10::AutogradState::get_tls_state().set_view_replay_enabled(true);
  });
}

DispatchStats dispatch_stats() {
  DispatchStats s;
  s.calls = g_calls.load();
  s.cache_hits = g_hits.load();
  s.fast_calls = g_fast_calls.load();
  s.fallback_calls = g_fallback_calls.load();
  s.fallback_bytes = g_fallback_bytes.load();
  s.implicit_calls = g_implicit_calls.load();
  std::shared_lock<std::shared_mutex> read(g_infos_mutex);
  for (const auto& [key, info] : *g_infos) {
    std::shared_lock<std::shared_mutex> plans(info->mutex);
    s.cache_entries += static_cast<int64_t>(info->plans.size());
  }
  return s;
}

std::vector<std::pair<std::string, int64_t>> cached_op_plans() {
  std::vector<std::pair<std::string, int64_t>> out;
  std::shared_lock<std::shared_mutex> read(g_infos_mutex);
  for (const auto& [key, info] : *g_infos) {
    std::shared_lock<std::shared_mutex> plans(info->mutex);
    if (!info->plans.empty()) out.emplace_back(info->name, static_cast<int64_t>(info->plans.size()));
  }
  std::sort(out.begin(), out.end());
  return out;
}

void reset_dispatch_stats() {
  g_calls.store(0);
  g_hits.store(0);
  g_fast_calls.store(0);
  g_fallback_calls.store(0);
  g_fallback_bytes.store(0);
  g_implicit_calls.store(0);
}

std::vector<std::string> rule_names() { return ops::registry().names(); }
std::vector<std::pair<std::string, std::string>> rule_families() { return ops::registry().families(); }

namespace {

// "aten::add.Tensor" -> its handle, or nullopt when no such operator is registered (yet).
std::optional<c10::OperatorHandle> find_operator(const std::string& op) {
  const auto dot = op.find('.', op.find("::") == std::string::npos ? 0 : op.find("::") + 2);
  const c10::OperatorName name(op.substr(0, dot), dot == std::string::npos ? "" : op.substr(dot + 1));
  return c10::Dispatcher::singleton().findSchema(name);
}

// Serves the op's later calls with `rule` (nullptr: none); drops the plans cached under the old one.
void replace_rule(OpInfo& info, const ops::RuleEntry* rule) {
  std::unique_lock<std::shared_mutex> write(info.mutex);
  info.rule = rule;
  info.plans.clear();
  info.generation.fetch_add(1, std::memory_order_release);
}

}  // namespace

void set_rule_enabled(const std::string& op, bool enabled) {
  const auto handle = find_operator(op);
  TORCH_CHECK(handle.has_value(), "hypershard: set_rule_enabled: no operator ", op);
  OpInfo& info = op_info(*handle);
  const auto* rule = ops::registry().find(info.name);
  TORCH_CHECK(rule != nullptr, "hypershard: set_rule_enabled: ", op, " has no rule");
  replace_rule(info, enabled ? rule : nullptr);
}

bool install_fast_path(const c10::OperatorHandle& op, const std::string& name);  // fast_path.cpp

void register_user_rule(const std::string& op, ops::UserRule rule) {
  ops::register_user_rule(op, std::move(rule));
  sync_registrations();
  if (const auto handle = find_operator(op)) {
    {
      // The boxed fallback kernel maybe_register gave the op (a custom op is composite-explicit)
      // makes way for its typed kernel, which boxes into the same flow where it cannot go fast.
      std::lock_guard<std::mutex> guard(g_fallback_kernels_mutex);
      g_fallback_kernels->erase(handle->operator_name());
    }
    // No signature the fast path reads: the fallback kernel again.
    if (!install_fast_path(*handle, op)) maybe_register(*handle);
    // An op called before (through the fallback, or refused in strict mode) has its info already.
    replace_rule(op_info(*handle), ops::registry().find(op));
  }
}

void set_strict(bool on) { g_strict.store(on); }
bool strict() { return g_strict.load(); }
void set_check_replicas(bool on) {
  if (g_check_replicas.exchange(on) == on) return;
  // A user rule's plan carries its debug check only when made in debug mode (user_rules.cpp):
  // switching the mode makes them anew.
  for (const auto& name : ops::user_rule_names())
    if (const auto handle = find_operator(name)) replace_rule(op_info(*handle), ops::registry().find(name));
}
bool check_replicas() { return g_check_replicas.load(); }

std::vector<OpCount> op_counts() {
  std::vector<OpCount> out;
  std::shared_lock<std::shared_mutex> read(g_infos_mutex);
  for (const auto& [key, info] : *g_infos)
    if (info->calls.load() > 0) out.push_back({info->name, info->calls.load(), info->rule != nullptr});
  std::sort(out.begin(), out.end(), [](const OpCount& a, const OpCount& b) { return a.name < b.name; });
  return out;
}

void reset_op_counts() {
  std::shared_lock<std::shared_mutex> read(g_infos_mutex);
  for (const auto& [key, info] : *g_infos) info->calls.store(0);
}

}  // namespace hypershard::runtime
