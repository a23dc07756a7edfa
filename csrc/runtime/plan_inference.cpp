// Plan inference, the steps of the operator flow that the boxed fallback (dispatch.cpp) and the
// typed fast path (fast_path.cpp) share: a call's tensor operands collected with their layouts
// (preprocess), the plan-cache key, and on a miss the rule -- with default mode's retry on
// redistributed layouts when the rule refuses the caller's (torch parity) -- its plan kept in a
// per-op cache behind a per-thread one.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <shared_mutex>

#include "layout/error.h"
#include "ops/families.h"
#include "runtime/dispatch_internal.h"
#include "runtime/dtensor_impl.h"
#include "runtime/redistribute.h"
#include "runtime/thread_cache.h"

namespace hypershard::runtime {
namespace detail {

std::atomic<bool> g_strict{false};
std::atomic<int64_t> g_hits{0};

namespace {

void add_tensor(ops::OpCall& call, const at::Tensor& t, int64_t arg, int64_t item) {
  if (!t.defined()) return;
  ops::TensorArg ta;
  ta.arg = arg;
  ta.item = item;
  ta.dtype = t.scalar_type();
  if (auto* impl = dtensor_impl(t)) {
    ta.is_dtensor = true;
    ta.layout = impl->layout();
    if (!call.mesh) {
      call.mesh = impl->device_mesh();
    } else if (call.mesh != impl->device_mesh() && !call.mesh->same_mesh(*impl->device_mesh())) {
      layout::fail(call.name(), "operands live on different meshes: " + call.mesh->to_string() + " and " +
                                    impl->device_mesh()->to_string() + "; allowed: one mesh per op");
    }
  }
  call.tensors.push_back(std::move(ta));
}

// Default mode's torch-parity answer to a rule that refuses the caller's layouts (a Partial input
// the op cannot keep, a view that would cut a shard, operands sharded unlike each other): the
// rule is asked again with the DTensor inputs redistributed -- Partial inputs reduced, then also
// shards gathered over one mesh axis, then two, ... -- and the first plan it accepts is used
// (the fewest axes gathered; the dispatch redistributes the inputs to the plan's layouts, and a
// view of a redistributed input refuses writes). A refusal of every candidate (a genuine error,
// such as mismatched shapes) and strict mode raise the rule's own error.
ops::OpPlan run_rule(const OpInfo& info, ops::OpCall& call) {
  try {
    return info.rule->rule(call);
  } catch (const ops::NotCovered&) {
    throw;
  } catch (const layout::LayoutError& refusal) {
    if (g_strict.load(std::memory_order_relaxed)) throw;
    std::vector<LayoutPtr> given;
    bool any_partial = false;
    for (const auto& t : call.tensors) {
      given.push_back(t.layout);
      any_partial = any_partial || (t.is_dtensor && t.layout->has_partial());
    }
    auto restore = [&] {
      for (size_t i = 0; i < given.size(); ++i) call.tensors[i].layout = given[i];
    };
    const int64_t axes = call.mesh->mesh()->ndim();
    for (int64_t gathered = 0; gathered <= axes; ++gathered) {
      for (uint32_t mask = 0; mask < (1u << axes); ++mask) {
        if (__builtin_popcount(mask) != gathered || (gathered == 0 && !any_partial)) continue;
        bool changed = false;
        for (size_t i = 0; i < given.size(); ++i) {
          if (!call.tensors[i].is_dtensor) continue;
          layout::Layout candidate = *given[i];
          for (int64_t axis = 0; axis < axes; ++axis)
            if (candidate.is_partial(axis) || (((mask >> axis) & 1u) && candidate.is_sharded(axis)))
              candidate = candidate.without_axis(axis);
          call.tensors[i].layout = intern_layout(std::move(candidate));
          changed = changed || call.tensors[i].layout != given[i];
        }
        if (!changed) continue;
        try {
          ops::OpPlan plan = info.rule->rule(call);
          restore();
          plan.refused = refusal.what();
          return plan;
        } catch (const layout::LayoutError&) {
        }
      }
    }
    restore();
    throw;
  }
}

}  // namespace

bool is_tensor_typed(const c10::TypePtr& declared) {
  c10::TypePtr type = declared;
  if (type->kind() == c10::TypeKind::OptionalType) type = type->expectRef<c10::OptionalType>().getElementType();
  if (type->kind() == c10::TypeKind::ListType) {
    type = type->expectRef<c10::ListType>().getElementType();
    if (type->kind() == c10::TypeKind::OptionalType) type = type->expectRef<c10::OptionalType>().getElementType();
  }
  return type->kind() == c10::TypeKind::TensorType;
}

void collect_tensors(ops::OpCall& call) {
  const auto& args = call.schema().arguments();
  for (size_t a = 0; a < args.size(); ++a) {
    const c10::IValue& v = call.args[a];
    if (v.isTensor()) {
      add_tensor(call, v.toTensor(), static_cast<int64_t>(a), -1);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t i = 0; i < list.size(); ++i)
        add_tensor(call, list.get(i), static_cast<int64_t>(a), static_cast<int64_t>(i));
    } else if (v.isList() && is_tensor_typed(args[a].type())) {
      auto list = v.toList();
      for (size_t i = 0; i < list.size(); ++i) {
        const c10::IValue item = list.get(i);
        if (item.isTensor()) add_tensor(call, item.toTensor(), static_cast<int64_t>(a), static_cast<int64_t>(i));
      }
    }
  }
}

const at::Tensor& arg_tensor(const c10::IValue* args, const ops::TensorArg& t, at::Tensor& scratch) {
  const auto& v = args[t.arg];
  if (t.item < 0) return v.toTensor();
  scratch = v.isTensorList() ? v.toTensorList().get(t.item) : v.toList().get(t.item).toTensor();
  return scratch;
}

[[noreturn]] void missing_operator(const ops::OpCall& call) {
  TORCH_CHECK(false, "hypershard: Missing operator ", call.name(),
              ": no distributed rule for this op; inputs: ", call.describe_inputs());
}

void layout_plain_tensors(ops::OpCall& call) {
  for (auto& t : call.tensors) {
    if (t.is_dtensor) continue;
    at::Tensor scratch;
    const auto& tensor = arg_tensor(call.args, t, scratch);
    t.layout = intern_layout(layout::Layout::replicate(call.mesh->mesh(), tensor.sizes().vec()));
  }
}

void plan_key(const OpInfo& info, const ops::OpCall& call, PlanKey& key) {
  const bool key_scalars = info.rule->key == ops::KeyScalars::kAll;
  for (int64_t a = 0; a < call.num_args(); ++a) key.argument(call.args[a], info.tensor_args[a], key_scalars);
  key.in_backward(call.in_backward);
}

std::shared_ptr<const ops::OpPlan> infer(OpInfo& info, ops::OpCall& call, bool record) {
  PlanKey key;
  plan_key(info, call, key);
  const uint64_t key_hash = key.hash();  // the shared map's; the per-thread cache mixes in the op
  const uint64_t hash = key_hash ^ reinterpret_cast<uintptr_t>(&info);
  // The per-thread cache in front of the shared one (plans are immutable); an entry remembers
  // the op's cache generation, so clearing the op's plans invalidates it.
  struct Entry {
    const OpInfo* info = nullptr;
    uint64_t generation = 0;
    CachedPlan cached;
  };
  thread_local ThreadCache<Entry, 256, 4> recent;
  const uint64_t generation = info.generation.load(std::memory_order_acquire);
  if (const Entry* hit = recent.find(
          hash, [&](const Entry& e) { return e.info == &info && e.generation == generation && e.cached.same(key); })) {
    if (record) g_hits.fetch_add(1, std::memory_order_relaxed);
    return hit->cached.plan;
  }
  auto remember = [&](const CachedPlan& c) {
    if (record) recent.claim(hash) = Entry{&info, generation, c};
  };
  {
    std::shared_lock<std::shared_mutex> read(info.mutex);
    for (auto [it, end] = info.plans.equal_range(key_hash); it != end; ++it)
      if (it->second.same(key)) {
        if (record) g_hits.fetch_add(1, std::memory_order_relaxed);
        remember(it->second);
        return it->second.plan;
      }
  }
  // Miss: plain tensors become Replicate layouts, then the rule runs.
  layout_plain_tensors(call);
  auto plan = std::make_shared<ops::OpPlan>(run_rule(info, call));
  HS_CHECK(plan->inputs.size() == call.tensors.size(), info.name, "internal error: the rule returned ",
           plan->inputs.size(), " input layouts for ", call.tensors.size(), " tensors");
  if (!record) return plan;
  std::unique_lock<std::shared_mutex> write(info.mutex);
  if (info.plans.size() >= kMaxPlansPerOp) {  // bounded, whatever the workload
    info.plans.clear();
    info.generation.fetch_add(1, std::memory_order_release);  // invalidates the per-thread slots
  }
  const auto& words = key.words();
  auto it = info.plans.emplace(key_hash, CachedPlan{std::vector<int64_t>(words.begin(), words.end()), plan});
  remember(it->second);
  return plan;
}

}  // namespace detail
}  // namespace hypershard::runtime
