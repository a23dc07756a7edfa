// The operator flow of the boxed path, in the five phases of the requirement:
//
//   preprocess -> infer_layout -> get_expand_impl -> execute_local -> wrap_output
//
// dtensor_fallback (the boxed kernel of every op without a typed one) runs them in that order.
// The typed fast path (fast_path.cpp) is the same flow for calls with nothing to move: its
// preprocess reads typed arguments into the same plan key, its infer_layout is a per-thread slot
// over the same plans, and it executes and wraps with the same guard and wrappers declared in
// dispatch_internal.h. Default mode's gather-everything fallback (replicate_fallback) is here
// too: preprocess and infer_layout hand calls to it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/AutogradState.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <optional>

#include "layout/error.h"
#include "ops/families.h"
#include "runtime/dispatch.h"
#include "runtime/dispatch_internal.h"
#include "runtime/dtensor_impl.h"
#include "runtime/in_flight.h"
#include "runtime/redistribute.h"
#include "runtime/traced_collectives.h"

namespace hypershard::runtime {
namespace detail {

std::atomic<int64_t> g_calls{0};
std::atomic<int64_t> g_fallback_calls{0};
std::atomic<int64_t> g_fallback_bytes{0};
std::atomic<int64_t> g_implicit_calls{0};
std::atomic<bool> g_check_replicas{false};

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
    if (v.isTensor() && v.toTensor().defined())
      meta.emplace_back(meta_shadow(v.toTensor()));
    else
      meta.push_back(v);
  }
  // Internal meta tensors: a tracer's modes (torch.compile) must neither see nor record them.
  c10::impl::ExcludeDispatchKeyGuard no_modes(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  op.callBoxed(&meta);
  std::vector<std::pair<std::vector<int64_t>, int64_t>> out;
  for (const auto& r : meta) {
    if (r.isTensor())
      out.emplace_back(r.toTensor().strides().vec(), r.toTensor().storage_offset());
    else if (r.isTensorList())
      for (const auto& t : r.toTensorList())
        out.emplace_back(static_cast<at::Tensor>(t).strides().vec(), static_cast<at::Tensor>(t).storage_offset());
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

}  // namespace

at::Tensor wrap_local(at::Tensor local, const LayoutPtr& layout, const DeviceMeshPtr& mesh, const OutputView* view) {
  // A local with the lazy conjugate / negative bit (conj(), _neg_view()) is materialized: the
  // wrapper cannot carry the bit (torch's Conjugate fallback would resolve it a second time), so
  // such a "view" holds its own values and refuses writes like a redistributed one.
  const bool materialized = local.is_conj() || local.is_neg();
  if (materialized) local = local.resolve_conj().resolve_neg();
  std::optional<Geometry> geometry;
  if (view && view->local_geometry)
    geometry = Geometry{local.strides(), local.storage_offset()};  // the local's impl outlives the call
  else if (view && view->geometry)
    geometry = *view->geometry;
  auto wrapped = make_dtensor(std::move(local), layout, mesh, geometry ? &*geometry : nullptr);
  if (view && view->detached)
    dtensor_impl(wrapped)->mark_detached_view(view->detached.impl, view->detached.version);
  else if (view && materialized)
    dtensor_impl(wrapped)->mark_detached_view(nullptr, -1);
  return wrapped;
}

namespace {

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
  if (local.sizes() == impl->local().sizes())
    impl->local().copy_(local);  // keeps views of it aliased
  else
    impl->replace(std::move(local), target);
}

void write_back_value(const c10::IValue& caller, const c10::IValue& result, const DeviceMesh& mesh) {
  if (caller.isTensor() && result.isTensor()) {
    write_back(caller.toTensor(), result.toTensor(), mesh);
  } else if (caller.isTensorList() && result.isTensorList()) {
    const auto wrappers = caller.toTensorList();
    const auto results = result.toTensorList();
    for (size_t i = 0; i < wrappers.size() && i < results.size(); ++i)
      write_back(wrappers.get(i), results.get(i), mesh);
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
    if (full != t.layout)
      gathered_bytes += layout::numel(t.layout->global_shape()) * static_cast<int64_t>(value.element_size());
    set_arg_tensor(args, t, redistribute_local(dtensor_impl(value)->local(), t.layout, full, *call.mesh));
  }
  for (size_t a = 0; a < num_args; ++a)
    if (info.written_args[a]) results[a] = args[a];
  if (counted) g_fallback_calls.fetch_add(1, std::memory_order_relaxed);
  g_fallback_bytes.fetch_add(gathered_bytes, std::memory_order_relaxed);
  if (counted && !info.fallback_warned.exchange(true))
    TORCH_WARN("hypershard: ", call.name(), " ", why, ": computed on gathered inputs (", call.describe_inputs(), "; ",
               gathered_bytes,
               " bytes gathered this call), outputs Replicate. Warned once per op; "
               "hypershard.set_strict(True) makes it an error.");
  {
    LocalExecutionGuard local(info.is_view);
    op.callBoxed(stack);
  }
  for (size_t a = 0; a < num_args; ++a)
    if (info.written_args[a]) write_back_value(callers[a], results[a], *call.mesh);

  const size_t num_returns = info.returns.size();
  c10::IValue* rets = stack->data() + (stack->size() - num_returns);
  const OutputView view{/*local_geometry=*/true, nullptr, detached};
  auto wrap = [&](at::Tensor local, bool is_view) {
    auto layout = intern_layout(layout::Layout::replicate(call.mesh->mesh(), local.sizes().vec()));
    return wrap_local(std::move(local), layout, call.mesh, is_view ? &view : nullptr);
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
                             (t.item >= 0 ? "[" + std::to_string(t.item) + "]" : "") + " (#" + std::to_string(t.arg) +
                             ")";
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

// ------------------------------------------------------------------ the five phases

enum class PlainDestination : int8_t {
  kNone,      // no plain tensor is written
  kWhole,     // written from whole inputs: exact without gathering (strict mode allows it)
  kGathered,  // written from sharded inputs: default mode gathers them (strict mode raises)
};

PlainDestination plain_destination(const OpInfo& info, const ops::OpCall& call) {
  // A composite kernel that allocates a plain tensor and writes DTensor data into it (F.one_hot
  // does: zeros + scatter_) would return a plain tensor built from one rank's shard.
  // Default mode computes such a call on gathered inputs: the plain destination then receives
  // the global result, the same on every rank. When every DTensor input is whole already
  // (Replicate everywhere: transformers writes position ids computed from replicated grids into
  // a plain tensor) that is exact with nothing gathered, and strict mode allows it too. A rule
  // registered with PlainWrites::kPlanned writes them itself.
  if (info.rule && info.rule->plain_writes == ops::PlainWrites::kPlanned) return PlainDestination::kNone;
  for (int64_t a = 0; a < call.num_args(); ++a) {
    const c10::IValue& v = call.args[a];
    if (!info.written_args[a] || !v.isTensor() || !v.toTensor().defined() || is_dtensor(v.toTensor())) continue;
    bool whole = true;
    for (const auto& t : call.tensors)
      if (t.is_dtensor &&
          t.layout != intern_layout(layout::Layout::replicate(t.layout->mesh(), t.layout->global_shape())))
        whole = false;
    if (whole) return PlainDestination::kWhole;
    TORCH_CHECK(!g_strict.load(std::memory_order_relaxed), "hypershard: ", info.name,
                ": writes into the plain tensor argument ", call.schema().arguments()[a].name(),
                " from DTensor inputs (", call.describe_inputs(),
                "); the result would hold one rank's shard; "
                "allowed: a DTensor destination (create it with hypershard.distribute_tensor or a *_like op on a "
                "DTensor)");
    return PlainDestination::kGathered;
  }
  return PlainDestination::kNone;
}

// What execute_local leaves for wrap_output.
struct LocalResult {
  c10::SmallVector<c10::IValue, 4> written;  // per schema argument: the caller's wrapper of a written one
  bool geometry_from_local = false;          // views: the local result's geometry is the wrapper's
  std::vector<std::pair<std::vector<int64_t>, int64_t>> geometry;  // views: else each output's, from the rule or meta
  DetachedBase detached;  // views of a redistributed input: the base they do not alias
};

}  // namespace

ops::OpCall preprocess(const c10::OperatorHandle& op, const OpInfo& info, const c10::IValue* args) {
  ops::OpCall call;
  call.op = &op;
  call.args = args;
  call.in_backward = torch::autograd::get_current_graph_task_id() >= 0;
  try {
    collect_tensors(call);
  } catch (const layout::LayoutError& e) {
    TORCH_CHECK(false, e.what());
  }
  TORCH_CHECK(call.mesh != nullptr, "hypershard: ", info.name,
              ": reached the DTensor fallback without a DTensor argument");
  return call;
}

Inferred infer_layout(OpInfo& info, ops::OpCall& call) {
  if (!info.rule) {
    if (g_strict.load(std::memory_order_relaxed)) missing_operator(call);
    return {nullptr, "has no distributed rule"};
  }
  std::shared_ptr<const ops::OpPlan> plan;
  try {
    plan = infer(info, call);
  } catch (const ops::NotCovered& e) {
    // Arguments the rule does not cover: the fallback's, as for an op without a rule.
    TORCH_CHECK(!g_strict.load(std::memory_order_relaxed), e.what());
    return {nullptr, "has no distributed rule for these arguments"};
  } catch (const layout::LayoutError& e) {
    TORCH_CHECK(false, e.what());
  }
  if (!plan->refused.empty()) {
    // A plan cached in default mode may meet strict mode later.
    TORCH_CHECK(!g_strict.load(std::memory_order_relaxed), plan->refused);
    g_implicit_calls.fetch_add(1, std::memory_order_relaxed);
  }
  return {std::move(plan), nullptr};
}

LocalImpl get_expand_impl(const c10::OperatorHandle& op, const ops::OpPlan& plan) {
  return LocalImpl{&op, plan.expand ? &plan.expand : nullptr};
}

namespace {

// The local call: the inputs redistributed to the plan's layouts, arguments rewritten into local
// terms, then `impl` below autograd. Keeps what the returns need (the wrappers of written
// arguments; for views, where their geometry comes from).
LocalResult execute_local(const c10::OperatorHandle& op, const OpInfo& info, ops::OpCall& call, const ops::OpPlan& plan,
                          const LocalImpl& impl, torch::jit::Stack* stack) {
  const size_t num_args = static_cast<size_t>(call.num_args());
  c10::IValue* args = stack->data() + (stack->size() - num_args);
  LocalResult result;
  // Views of tensors whose wrapper geometry is the local's (same sizes and strides: nothing is
  // split, or only over axes of one rank) take the local result's geometry; the others need
  // the global arguments for a meta shadow.
  result.geometry_from_local = info.is_view;
  for (size_t i = 0; i < call.tensors.size() && result.geometry_from_local; ++i) {
    const auto& t = call.tensors[i];
    if (!t.is_dtensor) continue;
    at::Tensor scratch;
    result.geometry_from_local =
        plan.inputs[i] == t.layout && dtensor_impl(arg_tensor(args, t, scratch))->geometry_is_local();
  }
  std::vector<c10::IValue> original;
  if (info.is_view && !result.geometry_from_local) original.assign(args, args + num_args);
  for (size_t a = 0; a < num_args; ++a)
    if (info.written_args[a]) {
      if (result.written.empty()) result.written.resize(num_args);
      result.written[a] = args[a];
    }

  // A view of a redistributed input does not alias the caller's tensor.
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const auto& t = call.tensors[i];
    at::Tensor scratch;
    const at::Tensor& value = arg_tensor(args, t, scratch);
    if (t.is_dtensor) {
      auto* dt = dtensor_impl(value);
      if (info.is_view && !result.detached && (dt->is_detached_view() || plan.inputs[i] != t.layout || plan.copies))
        result.detached = DetachedBase::of(value);
      if (value.requires_grad() && value.is_leaf()) install_grad_hook(value);
      at::Tensor local = dt->local();
      if (plan.inputs[i] != t.layout) local = redistribute_local(local, t.layout, plan.inputs[i], *call.mesh);
      set_arg_tensor(args, t, std::move(local));
    } else if (plan.inputs[i] && plan.inputs[i] != t.layout) {
      // A plain operand taken as Replicate, cut to what the rule needs (a chunk, a fill).
      auto replicated = intern_layout(layout::Layout::replicate(call.mesh->mesh(), value.sizes().vec()));
      set_arg_tensor(args, t, redistribute_local(value, replicated, plan.inputs[i], *call.mesh));
    }
  }
  if (plan.localize) plan.localize(call, args);
  if (plan.shifted_int_arg >= 0)
    args[plan.shifted_int_arg] = c10::IValue(args[plan.shifted_int_arg].toInt() + plan.int_shift);
  if (auto shape = planned_local_shape(plan, *call.mesh)) args[plan.local_shape_arg] = c10::IValue(*shape);

  LocalExecutionGuard local(info.is_view);
  if (info.is_view && !result.geometry_from_local) {
    std::optional<ops::ViewGeometry> cheap;
    if (plan.geometry) cheap = plan.geometry(original.at(call.tensors[0].arg).toTensor());
    if (cheap)
      result.geometry.push_back(std::move(*cheap));
    else
      result.geometry = view_geometry(op, original);
  }
  impl(call, *stack);
  return result;
}

// The returned locals become DTensors in the plan's output layouts; a written argument's wrapper
// takes its new local and is returned as itself.
void wrap_output(const OpInfo& info, const ops::OpCall& call, const ops::OpPlan& plan, const LocalResult& result,
                 torch::jit::Stack* stack) {
  const size_t num_returns = info.returns.size();
  c10::IValue* rets = stack->data() + (stack->size() - num_returns);
  size_t out_index = 0, view_index = 0;
  // A view takes the local's geometry or, in order, the next one execute_local computed.
  Geometry next_geometry;
  OutputView view{result.geometry_from_local, nullptr, result.detached};
  auto wrap = [&](at::Tensor local, bool is_view, const LayoutPtr& layout) {
    if (!is_view) return wrap_local(std::move(local), layout, call.mesh, nullptr);
    view.geometry = nullptr;
    if (!view.local_geometry && view_index < result.geometry.size()) {
      next_geometry = Geometry{result.geometry[view_index].first, result.geometry[view_index].second};
      view.geometry = &next_geometry;
      ++view_index;
    }
    return wrap_local(std::move(local), layout, call.mesh, &view);
  };
  for (size_t r = 0; r < num_returns; ++r) {
    c10::IValue& v = rets[r];
    const ReturnInfo& ri = info.returns[r];
    if (ri.kind == ReturnKind::kWritten && ri.arg >= 0 && !result.written.empty() &&
        result.written[ri.arg].isTensor()) {
      const at::Tensor& wrapper = result.written[ri.arg].toTensor();
      if (auto* impl = dtensor_impl(wrapper)) {
        const at::Tensor local = v.toTensor();
        const auto& layout = plan.outputs.at(out_index);
        if (layout != impl->layout() || local.sizes() != impl->local().sizes())
          impl->replace(local, layout);
        else if (!local.is_same(impl->local()))
          impl->replace(local, layout);
      }
      v = result.written[ri.arg];
      ++out_index;
    } else if (v.isTensor()) {
      at::Tensor local = v.toTensor();
      if (local.defined()) {
        LayoutPtr layout = plan.outputs.at(out_index);
        // A layout split nowhere: its local shape is its global shape, and the kernel's result is
        // the authority where the plan's shape (from a Meta kernel) differs -- cuDNN attention's
        // dropout seed and offset are 1-element tensors on a GPU, 0-dim per its Meta kernel.
        // data_shaped plans take every shape from the local result (whole dims, Partial kept).
        if ((plan.data_shaped || !layout->is_sharded_anywhere()) &&
            local.sizes() != c10::IntArrayRef(layout->global_shape()))
          layout = intern_layout(layout::Layout::create(layout->mesh(), local.sizes().vec(),
                                                        layout::DimAxes(local.dim()), layout->partial()));
        v = wrap(std::move(local), ri.kind == ReturnKind::kView, layout);
      }
      ++out_index;
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> wrapped;
      wrapped.reserve(list.size());
      for (size_t i = 0; i < list.size(); ++i)
        wrapped.push_back(wrap(list.get(i), ri.kind == ReturnKind::kView, plan.outputs.at(out_index++)));
      v = std::move(wrapped);
    }
  }
}

}  // namespace

void dtensor_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  const OpInFlight in_op(op.operator_name());  // a hung collective's report names the op (in_flight.h)
  sync_registrations();
  OpInfo& info = op_info(op);
  c10::IValue* args = stack->data() + (stack->size() - op.schema().arguments().size());

  ops::OpCall call = preprocess(op, info, args);
  if (const auto plain = plain_destination(info, call); plain != PlainDestination::kNone) {
    replicate_fallback(op, info, call, stack, "writes into a plain tensor",
                       /*counted=*/plain == PlainDestination::kGathered);
    return;
  }
  // (a traced operand has no values to compare)
  if (g_check_replicas.load(std::memory_order_relaxed) && !tracing()) check_plain_operands(call);
  check_detached_views(op, info, call);
  info.calls.fetch_add(1, std::memory_order_relaxed);

  const Inferred inferred = infer_layout(info, call);
  if (!inferred.plan) {
    replicate_fallback(op, info, call, stack, inferred.fallback_reason);
    return;
  }
  const LocalImpl impl = get_expand_impl(op, *inferred.plan);
  const LocalResult result = execute_local(op, info, call, *inferred.plan, impl, stack);
  wrap_output(info, call, *inferred.plan, result, stack);
}

}  // namespace detail
}  // namespace hypershard::runtime
