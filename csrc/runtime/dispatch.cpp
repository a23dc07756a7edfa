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

#include "kernels/kernels.h"
#include "layout/error.h"
#include "ops/families.h"
#include "runtime/dispatch_internal.h"
#include "runtime/dtensor_impl.h"
#include "runtime/fast_path.h"
#include "runtime/redistribute.h"

namespace hypershard::runtime {
namespace {

using detail::arg_tensor;
using detail::CachedPlan;
using detail::collect_tensors;
using detail::dtensor_fallback;
using detail::g_hits;
using detail::g_strict;
using detail::hash_key;
using detail::infer;
using detail::install_grad_hook;
using detail::kMaxPlansPerOp;
using detail::layout_plain_tensors;
using detail::missing_operator;
using detail::op_info;
using detail::OpInfo;
using detail::PlanKey;
using detail::ReturnInfo;
using detail::ReturnKind;


std::atomic<int64_t> g_calls{0};
std::atomic<int64_t> g_fallback_calls{0};
std::atomic<int64_t> g_fallback_bytes{0};
std::atomic<int64_t> g_implicit_calls{0};
std::atomic<bool> g_check_replicas{false};

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
  for (size_t a = 0; a < args.size(); ++a)
    info->written_args[a] = args[a].alias_info() && args[a].alias_info()->isWrite();
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
  // Per-thread direct-mapped cache: no lock on the per-op path once an op was seen.
  struct Slot {
    const void* key = nullptr;
    OpInfo* info = nullptr;
  };
  thread_local Slot slots[256];
  Slot& slot_cache = slots[(reinterpret_cast<uintptr_t>(key) >> 4) & 255];
  if (slot_cache.key == key) return *slot_cache.info;
  {
    std::shared_lock<std::shared_mutex> read(g_infos_mutex);
    auto it = g_infos->find(key);
    if (it != g_infos->end()) {
      slot_cache = {key, it->second};
      return *it->second;
    }
  }
  std::unique_lock<std::shared_mutex> write(g_infos_mutex);
  auto& slot = (*g_infos)[key];
  if (!slot) slot = build_op_info(op);
  slot_cache = {key, slot};
  return *slot;
}

namespace {

// ------------------------------------------------------------------ view geometry

at::Tensor meta_shadow(const at::Tensor& t) {
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  int64_t extent = 0;  // an empty tensor spans no storage (a size-0 dim would make the sum negative)
  if (t.numel() > 0) {
    extent = 1;
    for (int64_t d = 0; d < t.dim(); ++d) extent += (sizes[d] - 1) * strides[d];
  }
  auto base = at::empty({t.storage_offset() + extent}, t.options().device(c10::kMeta));
  return base.as_strided(sizes, strides, t.storage_offset());
}

// Runs the view op on meta tensors with the inputs' GLOBAL geometry; returns each output's
// (strides, offset), which the wrappers then report.
std::vector<std::pair<std::vector<int64_t>, int64_t>> view_geometry(const c10::OperatorHandle& op,
                                                                    const std::vector<c10::IValue>& original) {
  torch::jit::Stack meta;
  meta.reserve(original.size());
  for (const auto& v : original) {
    if (v.isTensor() && v.toTensor().defined()) meta.emplace_back(meta_shadow(v.toTensor()));
    else meta.push_back(v);
  }
  op.callBoxed(&meta);
  std::vector<std::pair<std::vector<int64_t>, int64_t>> out;
  for (const auto& r : meta) {
    if (r.isTensor()) out.emplace_back(r.toTensor().strides().vec(), r.toTensor().storage_offset());
    else if (r.isTensorList())
      for (const auto& t : r.toTensorList()) out.emplace_back(static_cast<at::Tensor>(t).strides().vec(), static_cast<at::Tensor>(t).storage_offset());
  }
  return out;
}

// ------------------------------------------------------------------ the fallback

void set_arg_tensor(c10::IValue* args, const ops::TensorArg& t, at::Tensor local) {
  auto& v = args[t.arg];
  if (t.item < 0) {
    v = std::move(local);
  } else if (v.isTensorList()) {
    // Never write into a list someone else holds: `v` and `list` account for two references.
    // (Counting `list` matters: "> 1" copied the whole list again for every element.)
    auto list = v.toTensorList();
    if (list.use_count() > 2) {
      list = list.copy();
      v = list;
    }
    list.set(t.item, std::move(local));
  } else {
    auto list = v.toList();
    if (list.use_count() > 2) {
      list = list.copy();
      v = list;
    }
    list.set(t.item, std::move(local));
  }
}

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

// One returned local as a DTensor. A view takes the local's geometry (`from_local`) or the next
// meta-shadow geometry; a view of a redistributed input is marked as not aliasing its base.
at::Tensor wrap_view_or_output(at::Tensor local, bool is_view, const LayoutPtr& layout, const DeviceMeshPtr& mesh,
                               bool from_local, const std::vector<std::pair<std::vector<int64_t>, int64_t>>& shadow,
                               size_t& view_index, const DetachedBase& detached) {
  // A local with the lazy conjugate / negative bit (conj(), _neg_view()) is materialized: the
  // wrapper cannot carry the bit (torch's Conjugate fallback would resolve it a second time), so
  // such a "view" holds its own values and refuses writes like a redistributed one.
  const bool materialized = local.is_conj() || local.is_neg();
  if (materialized) local = local.resolve_conj().resolve_neg();
  std::optional<Geometry> geometry;
  if (is_view && from_local) {
    geometry = Geometry{local.strides(), local.storage_offset()};  // the local's impl outlives the call
  } else if (is_view && view_index < shadow.size()) {
    geometry = Geometry{shadow[view_index].first, shadow[view_index].second};
    ++view_index;
  }
  auto wrapped = make_dtensor(std::move(local), layout, mesh, geometry ? &*geometry : nullptr);
  if (is_view && detached) dtensor_impl(wrapped)->mark_detached_view(detached.impl, detached.version);
  else if (is_view && materialized) dtensor_impl(wrapped)->mark_detached_view(nullptr, -1);
  return wrapped;
}

// The result of an op the fallback computed, written back into the caller's DTensor `wrapper`
// (an in-place or out= argument) in the wrapper's own layout: each rank keeps its part of the
// global result. A result of another shape (out= resized) replaces the wrapper's value as Replicate.
void write_back(const at::Tensor& wrapper, const at::Tensor& result, const DeviceMesh& mesh) {
  auto* impl = dtensor_impl(wrapper);
  if (impl == nullptr) return;
  const LayoutPtr& target = impl->layout();
  if (result.sizes() != c10::IntArrayRef(target->global_shape())) {
    impl->replace(result, intern_layout(layout::Layout::replicate(target->mesh(), result.sizes().vec())));
    return;
  }
  const auto full = intern_layout(layout::Layout::replicate(target->mesh(), target->global_shape()));
  at::Tensor local = redistribute_local(result, full, target, mesh);
  if (local.is_same(impl->local())) return;
  if (local.sizes() == impl->local().sizes()) impl->local().copy_(local);  // keeps views of it aliased
  else impl->replace(std::move(local), target);
}

void write_back_value(const c10::IValue& caller, const c10::IValue& result, const DeviceMesh& mesh) {
  if (caller.isTensor() && result.isTensor()) {
    write_back(caller.toTensor(), result.toTensor(), mesh);
  } else if (caller.isTensorList() && result.isTensorList()) {
    const auto wrappers = caller.toTensorList();
    const auto results = result.toTensorList();
    for (size_t i = 0; i < wrappers.size() && i < results.size(); ++i) write_back(wrappers.get(i), results.get(i), mesh);
  }
}

// Default mode's answer to an op without a rule (strict mode raises instead): every DTensor
// input is gathered to Replicate (Partial reduced), the op runs on the global values -- every
// rank computes what one device would (random ops draw what one device draws, given the ranks'
// shared seed) -- and the outputs are Replicate DTensors. Arguments the op writes (in-place,
// out=) get the result back in their own layouts and are returned as themselves. A view of a
// gathered input does not alias the caller's tensor, so writes through it raise.
// `why`: what the warning says the op has (no rule, a plain destination).
// `counted` false: the inputs are whole already (nothing gathered, the result exact): not a
// fallback call, no warning.
void replicate_fallback(const c10::OperatorHandle& op, OpInfo& info, ops::OpCall& call, torch::jit::Stack* stack,
                        const char* why = "has no distributed rule", bool counted = true) {
  const size_t num_args = op.schema().arguments().size();
  c10::IValue* args = stack->data() + (stack->size() - num_args);
  std::vector<c10::IValue> callers(num_args), results(num_args);  // written arguments only
  for (size_t a = 0; a < num_args; ++a)
    if (info.written_args[a]) callers[a] = args[a];
  int64_t gathered_bytes = 0;
  DetachedBase detached;  // the base of view outputs, when they cannot alias it
  for (const auto& t : call.tensors) {
    if (!t.is_dtensor) continue;
    at::Tensor scratch;
    const at::Tensor& value = arg_tensor(args, t, scratch);
    auto full = intern_layout(layout::Layout::replicate(t.layout->mesh(), t.layout->global_shape()));
    if (info.is_view && !detached && (full != t.layout || dtensor_impl(value)->is_detached_view()))
      detached = DetachedBase::of(value);
    if (full != t.layout) gathered_bytes += layout::numel(t.layout->global_shape()) * static_cast<int64_t>(value.element_size());
    set_arg_tensor(args, t, redistribute_local(dtensor_impl(value)->local(), t.layout, full, *call.mesh));
  }
  for (size_t a = 0; a < num_args; ++a)
    if (info.written_args[a]) results[a] = args[a];
  if (counted) g_fallback_calls.fetch_add(1, std::memory_order_relaxed);
  g_fallback_bytes.fetch_add(gathered_bytes, std::memory_order_relaxed);
  if (counted && !info.fallback_warned.exchange(true))
    TORCH_WARN("hypershard: ", call.name(), " ", why, ": computed on gathered inputs (",
               call.describe_inputs(), "; ", gathered_bytes,
               " bytes gathered this call), outputs Replicate. Warned once per op; "
               "hypershard.set_strict(True) makes it an error.");
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    if (info.is_view) c10::AutogradState::get_tls_state().set_view_replay_enabled(true);
    op.callBoxed(stack);
  }
  for (size_t a = 0; a < num_args; ++a)
    if (info.written_args[a]) write_back_value(callers[a], results[a], *call.mesh);

  const size_t num_returns = info.returns.size();
  c10::IValue* rets = stack->data() + (stack->size() - num_returns);
  size_t no_shadow = 0;
  auto wrap = [&](at::Tensor local, bool is_view) {
    auto layout = intern_layout(layout::Layout::replicate(call.mesh->mesh(), local.sizes().vec()));
    return wrap_view_or_output(std::move(local), is_view, layout, call.mesh, /*from_local=*/true, {}, no_shadow,
                               detached);
  };
  for (size_t r = 0; r < num_returns; ++r) {
    c10::IValue& v = rets[r];
    const ReturnInfo& ri = info.returns[r];
    const bool is_view = ri.kind == ReturnKind::kView;
    if (ri.kind == ReturnKind::kWritten && ri.arg >= 0 && !callers[ri.arg].isNone()) {
      v = callers[ri.arg];
    } else if (v.isTensor() && v.toTensor().defined()) {
      v = wrap(v.toTensor(), is_view);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> wrapped;
      for (const at::Tensor& t : v.toTensorList()) wrapped.push_back(wrap(t, is_view));
      v = std::move(wrapped);
    }
  }
}

// Debug mode: a plain operand counts as Replicate, so it must be the same on every rank.
void check_plain_operands(const ops::OpCall& call) {
  for (const auto& t : call.tensors) {
    if (t.is_dtensor) continue;
    at::Tensor scratch;
    const auto& tensor = arg_tensor(call.args, t, scratch);
    const std::string what = call.name() + ": argument " + call.schema().arguments()[t.arg].name() +
                             (t.item >= 0 ? "[" + std::to_string(t.item) + "]" : "") + " (#" + std::to_string(t.arg) + ")";
    try {
      check_same_on_every_rank(tensor, *call.mesh, what);
    } catch (const layout::LayoutError& e) {
      TORCH_CHECK(false, e.what());
    }
  }
}

// What views that do not alias their base (DetachedBase) would otherwise lose silently: a write
// into one, a write into a base that has one alive, a read of one whose base was written since.
void check_detached_views(const c10::OperatorHandle& op, const OpInfo& info, const ops::OpCall& call) {
  for (const auto& t : call.tensors) {
    if (!t.is_dtensor) continue;
    at::Tensor scratch;
    const auto* impl = dtensor_impl(arg_tensor(call.args, t, scratch));
    const bool written = info.written_args[t.arg];
    const std::string& name = op.schema().arguments()[t.arg].name();
    if (impl->is_detached_view()) {
      TORCH_CHECK(!written, "hypershard: ", info.name, ": argument ", name,
                  " is a view that had to be redistributed (a slice across a sharded dim, a view that would cut a "
                  "shard), so it does not alias its base and writing into it would be lost; allowed: redistribute "
                  "the base first (so that the view is local), or write into a copy");
      TORCH_CHECK(!impl->is_stale_view(), "hypershard: ", info.name, ": argument ", name,
                  " is a view that had to be redistributed, so it does not alias its base, and the base was written "
                  "in place after the view was taken: its values are stale; allowed: take the view again after "
                  "writing the base");
    }
    TORCH_CHECK(!(written && impl->has_live_detached_views()), "hypershard: ", info.name, ": argument ", name,
                " has a live view that had to be redistributed (a slice across a sharded dim, a view that would cut "
                "a shard), which does not alias it, so this write would not reach that view; allowed: drop the view "
                "first, or write into a copy");
  }
}

// preprocess: the OpCall over `args`, every tensor argument collected with its layout and the
// call's mesh found; mesh errors raise (c10::Error, the house text) before anything runs.
ops::OpCall begin_call(const c10::OperatorHandle& op, const OpInfo& info, const c10::IValue* args) {
  ops::OpCall call;
  call.op = &op;
  call.args = args;
  call.in_backward = torch::autograd::get_current_graph_task_id() >= 0;
  try {
    collect_tensors(call);
  } catch (const layout::LayoutError& e) {
    TORCH_CHECK(false, e.what());
  }
  TORCH_CHECK(call.mesh != nullptr, "hypershard: ", info.name, ": reached the DTensor fallback without a DTensor argument");
  return call;
}

}  // namespace

void detail::dtensor_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  sync_registrations();
  OpInfo& info = op_info(op);
  const size_t num_args = op.schema().arguments().size();
  c10::IValue* args = stack->data() + (stack->size() - num_args);

  ops::OpCall call = begin_call(op, info, args);
  // A composite kernel that allocates a plain tensor and writes DTensor data into it (F.one_hot
  // does: zeros + scatter_) would return a plain tensor built from one rank's shard.
  // Default mode computes such a call on gathered inputs: the plain destination then receives
  // the global result, the same on every rank. When every DTensor input is whole already
  // (Replicate everywhere: transformers writes position ids computed from replicated grids into
  // a plain tensor) that is exact with nothing gathered, and strict mode allows it too.
  for (size_t a = 0; a < num_args; ++a)
    if (info.written_args[a] && args[a].isTensor() && args[a].toTensor().defined() && !is_dtensor(args[a].toTensor())) {
      bool whole = true;
      for (const auto& t : call.tensors)
        if (t.is_dtensor && t.layout != intern_layout(layout::Layout::replicate(t.layout->mesh(), t.layout->global_shape())))
          whole = false;
      if (whole) {
        replicate_fallback(op, info, call, stack, "writes into a plain tensor", /*counted=*/false);
        return;
      }
      TORCH_CHECK(!g_strict.load(std::memory_order_relaxed), "hypershard: ", info.name,
                  ": writes into the plain tensor argument ", op.schema().arguments()[a].name(),
                  " from DTensor inputs (", call.describe_inputs(), "); the result would hold one rank's shard; "
                  "allowed: a DTensor destination (create it with hypershard.distribute_tensor or a *_like op on a "
                  "DTensor)");
      replicate_fallback(op, info, call, stack, "writes into a plain tensor");
      return;
    }
  if (g_check_replicas.load(std::memory_order_relaxed)) check_plain_operands(call);
  check_detached_views(op, info, call);
  info.calls.fetch_add(1, std::memory_order_relaxed);
  if (!info.rule) {
    if (g_strict.load(std::memory_order_relaxed)) missing_operator(call);
    replicate_fallback(op, info, call, stack);
    return;
  }

  std::shared_ptr<const ops::OpPlan> plan;
  try {
    plan = infer(info, call);
  } catch (const ops::NotCovered& e) {
    // Arguments the rule does not cover: the fallback's, as for an op without a rule.
    TORCH_CHECK(!g_strict.load(std::memory_order_relaxed), e.what());
    replicate_fallback(op, info, call, stack, "has no distributed rule for these arguments");
    return;
  } catch (const layout::LayoutError& e) {
    TORCH_CHECK(false, e.what());
  }
  if (!plan->refused.empty()) {
    // A plan cached in default mode may meet strict mode later.
    TORCH_CHECK(!g_strict.load(std::memory_order_relaxed), plan->refused);
    g_implicit_calls.fetch_add(1, std::memory_order_relaxed);
  }

  // Keep what the returns need: the wrappers of written arguments, and (views) the global args.
  // Views of tensors whose wrapper geometry is the local's (same sizes and strides: nothing is
  // split, or only over axes of one rank) take the local result's geometry; the others need
  // the global arguments for a meta shadow.
  bool geometry_from_local = info.is_view;
  for (size_t i = 0; i < call.tensors.size() && geometry_from_local; ++i) {
    const auto& t = call.tensors[i];
    if (!t.is_dtensor) continue;
    at::Tensor scratch;
    geometry_from_local = plan->inputs[i] == t.layout && dtensor_impl(arg_tensor(args, t, scratch))->geometry_is_local();
  }
  std::vector<c10::IValue> original;
  if (info.is_view && !geometry_from_local) original.assign(args, args + num_args);
  c10::SmallVector<c10::IValue, 4> written;
  for (size_t a = 0; a < num_args; ++a)
    if (info.written_args[a]) {
      if (written.empty()) written.resize(num_args);
      written[a] = args[a];
    }

  // A view of a redistributed input does not alias the caller's tensor.
  DetachedBase detached;
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const auto& t = call.tensors[i];
    at::Tensor scratch;
    const at::Tensor& value = arg_tensor(args, t, scratch);
    if (t.is_dtensor) {
      auto* impl = dtensor_impl(value);
      if (info.is_view && !detached && (impl->is_detached_view() || plan->inputs[i] != t.layout || plan->copies))
        detached = DetachedBase::of(value);
      if (value.requires_grad() && value.is_leaf()) install_grad_hook(value);
      at::Tensor local = impl->local();
      if (plan->inputs[i] != t.layout) local = redistribute_local(local, t.layout, plan->inputs[i], *call.mesh);
      set_arg_tensor(args, t, std::move(local));
    } else if (plan->inputs[i] && plan->inputs[i] != t.layout) {
      // A plain operand taken as Replicate, cut to what the rule needs (a chunk, a fill).
      auto replicated = intern_layout(layout::Layout::replicate(call.mesh->mesh(), value.sizes().vec()));
      set_arg_tensor(args, t, redistribute_local(value, replicated, plan->inputs[i], *call.mesh));
    }
  }
  if (plan->localize) plan->localize(call, args);
  if (plan->shifted_int_arg >= 0) args[plan->shifted_int_arg] = c10::IValue(args[plan->shifted_int_arg].toInt() + plan->int_shift);
  if (auto shape = detail::planned_local_shape(*plan, *call.mesh)) args[plan->local_shape_arg] = c10::IValue(*shape);

  std::vector<std::pair<std::vector<int64_t>, int64_t>> geometry;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    if (info.is_view) {
      c10::AutogradState::get_tls_state().set_view_replay_enabled(true);
      if (!geometry_from_local) {
        std::optional<ops::ViewGeometry> cheap;
        if (plan->geometry) cheap = plan->geometry(original.at(call.tensors[0].arg).toTensor());
        if (cheap) geometry.push_back(std::move(*cheap));
        else geometry = view_geometry(op, original);
      }
    }
    if (plan->expand) plan->expand(call, *stack);
    else op.callBoxed(stack);
  }

  // wrap_output
  const size_t num_returns = info.returns.size();
  c10::IValue* rets = stack->data() + (stack->size() - num_returns);
  size_t out_index = 0, view_index = 0;
  for (size_t r = 0; r < num_returns; ++r) {
    c10::IValue& v = rets[r];
    const ReturnInfo& ri = info.returns[r];
    if (ri.kind == ReturnKind::kWritten && ri.arg >= 0 && !written.empty() && written[ri.arg].isTensor()) {
      const at::Tensor& wrapper = written[ri.arg].toTensor();
      if (auto* impl = dtensor_impl(wrapper)) {
        const at::Tensor local = v.toTensor();
        const auto& layout = plan->outputs.at(out_index);
        if (layout != impl->layout() || local.sizes() != impl->local().sizes()) impl->replace(local, layout);
        else if (!local.is_same(impl->local())) impl->replace(local, layout);
      }
      v = written[ri.arg];
      ++out_index;
    } else if (v.isTensor()) {
      at::Tensor local = v.toTensor();
      if (local.defined()) {
        LayoutPtr layout = plan->outputs.at(out_index);
        if (plan->data_shaped && local.sizes() != c10::IntArrayRef(layout->global_shape()))  // whole dims, Partial kept
          layout = intern_layout(layout::Layout::create(layout->mesh(), local.sizes().vec(),
                                                        layout::DimAxes(local.dim()), layout->partial()));
        auto wrapped = wrap_view_or_output(std::move(local), ri.kind == ReturnKind::kView, layout, call.mesh,
                                           geometry_from_local, geometry, view_index, detached);
        v = std::move(wrapped);
      }
      ++out_index;
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> wrapped;
      wrapped.reserve(list.size());
      for (size_t i = 0; i < list.size(); ++i)
        wrapped.push_back(wrap_view_or_output(list.get(i), ri.kind == ReturnKind::kView, plan->outputs.at(out_index++),
                                              call.mesh, geometry_from_local, geometry, view_index, detached));
      v = std::move(wrapped);
    }
  }
}

namespace {

// ------------------------------------------------------------------ registration

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
  static auto* handles = new std::vector<c10::RegistrationHandleRAII>();  // kept for the process
  handles->push_back(c10::Dispatcher::singleton().registerImpl(
      op.operator_name(), c10::DispatchKey::PrivateUse2,
      c10::KernelFunction::makeFromBoxedFunction<&dtensor_fallback>(), std::nullopt, nullptr,
      "hypershard: DTensor fallback (composite-explicit op)"));
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
  ops::OpCall call = begin_call(op, info, stack.data() + (stack.size() - op.schema().arguments().size()));
  if (!info.rule) missing_operator(call);
  try {
    return infer(info, call, /*record=*/false);
  } catch (const ops::NotCovered&) {
    throw;  // the boxed path decides (fallback or error)
  } catch (const layout::LayoutError& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace detail

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
    static auto* library = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse2,
                                              __FILE__, __LINE__);
    library->fallback(torch::CppFunction::makeFromBoxedFunction<&dtensor_fallback>());
    ops::register_reshape_kernel();
    ops::register_one_hot_kernel();
    ops::register_reduction_kernels();
    ops::register_along_sharded_kernels();
    ops::register_composite_kernels();
    ops::register_cross_entropy_kernel();
    ops::register_embedding_kernels();
    kernels::register_rotary_kernels();
    kernels::register_rms_norm_kernels();
    kernels::register_external_autograd_kernels();
    register_fast_paths();
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

void set_rule_enabled(const std::string& op, bool enabled) {
  const auto dot = op.find('.', op.find("::") == std::string::npos ? 0 : op.find("::") + 2);
  const c10::OperatorName name(op.substr(0, dot), dot == std::string::npos ? "" : op.substr(dot + 1));
  const auto handle = c10::Dispatcher::singleton().findSchema(name);
  TORCH_CHECK(handle.has_value(), "hypershard: set_rule_enabled: no operator ", op);
  OpInfo& info = op_info(*handle);
  const auto* rule = ops::registry().find(info.name);
  TORCH_CHECK(rule != nullptr, "hypershard: set_rule_enabled: ", op, " has no rule");
  std::unique_lock<std::shared_mutex> write(info.mutex);
  info.rule = enabled ? rule : nullptr;
  info.plans.clear();
  info.generation.fetch_add(1, std::memory_order_release);
}

void set_strict(bool on) { g_strict.store(on); }
bool strict() { return g_strict.load(); }
void set_check_replicas(bool on) { g_check_replicas.store(on); }
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
