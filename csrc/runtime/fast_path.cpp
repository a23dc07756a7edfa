// The typed fast path: unboxed PrivateUse2 kernels for the ops whose signatures it reads.
//
// The boxed fallback copies every argument into an IValue stack, and copying a tensor that
// Python holds (refcount 1 -> 2) makes torch take the GIL to incref its PyObject; the local call
// is boxed and unboxed once more. For every op with a rule whose C++ signature is one of
// `Signatures` (at the end), a typed kernel reads the arguments where they are instead. It runs the same operator flow,
// with the same plan (the rule and its cache are the fallback's), for the calls where the flow has nothing to move:
// every tensor operand a DTensor on one mesh (or a wrapped Python number), each already in the
// layout the plan asks for, no argument rewrite but a view's size list, no expand
// implementation, views whose geometry is the local's or the rule's. Every other call goes to
// the boxed fallback unchanged, which raises the errors.
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/op_registration/infer_schema.h>
#include <c10/core/AutogradState.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <ATen/ops/_foreach_add_ops.h>
#include <ATen/ops/_foreach_addcdiv_ops.h>
#include <ATen/ops/_foreach_addcmul_ops.h>
#include <ATen/ops/_foreach_copy_ops.h>
#include <ATen/ops/_foreach_div_ops.h>
#include <ATen/ops/_foreach_mul_ops.h>
#include <ATen/ops/_foreach_norm_ops.h>
#include <ATen/ops/_foreach_sqrt_ops.h>
#include <ATen/ops/_foreach_zero_ops.h>
#include <ATen/ops/_softmax_ops.h>
#include <ATen/ops/_to_copy_ops.h>
#include <ATen/ops/add_ops.h>
#include <ATen/ops/cumsum_ops.h>
#include <ATen/ops/tril_ops.h>
#include <ATen/ops/gather_ops.h>
#include <ATen/ops/index_select_ops.h>
#include <ATen/ops/roll_ops.h>
#include <ATen/ops/_fft_r2c_ops.h>
#include <ATen/ops/avg_pool2d_ops.h>
#include <ATen/ops/_grouped_mm_ops.h>
#include <ATen/ops/convolution_ops.h>
#include <ATen/ops/constant_pad_nd_ops.h>
#include <ATen/ops/addcmul_ops.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/amax_ops.h>
#include <ATen/ops/clone_ops.h>
#include <ATen/ops/copy_ops.h>
#include <ATen/ops/expand_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/neg_ops.h>
#include <ATen/ops/permute_ops.h>
#include <ATen/ops/select_ops.h>
#include <ATen/ops/slice_ops.h>
#include <ATen/ops/sum_ops.h>
#include <ATen/ops/transpose_ops.h>
#include <ATen/ops/unsqueeze_ops.h>
#include <ATen/ops/view_ops.h>
#include <ATen/ops/where_ops.h>
#include <ATen/ops/zero_ops.h>

#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/dispatch.h"
#include "runtime/dispatch_internal.h"
#include "runtime/fast_path.h"
#include "runtime/thread_cache.h"

namespace hypershard::runtime {
namespace {

using detail::OpInfo;
using detail::ReturnKind;

std::atomic<bool> g_enabled{true};
std::atomic<bool> g_key_check{false};

// ------------------------------------------------------------------ reading typed arguments

// One call's typed arguments: the tensor operands in schema order and the plan key, written
// with the boxed flow's encoding (plan_key.h) word for word, from the typed values: tensors
// always, non-tensor arguments when the rule reads them. Operands are DTensors on one mesh, or
// wrapped numbers (the 0-d tensors Python scalars become in `x * 2`, the same on every rank,
// Replicate for the rules); any other plain tensor, and any argument kind not read here, is the
// fallback's.
struct FastArgs {
  c10::SmallVector<const at::Tensor*, 4> tensors;
  PlanKey key;
  const DeviceMeshPtr* mesh = nullptr;  // the first DTensor's
  bool key_scalars = false;
  bool ok = true;  // false: the boxed fallback takes the call

  void tensor(const at::Tensor& t) {
    if (!t.defined()) {
      key.undefined_tensor();
      return;
    }
    auto* impl = dtensor_impl(t);
    if (!impl) {
      if (!t.unsafeGetTensorImpl()->is_wrapped_number()) ok = false;
      tensors.push_back(&t);
      key.plain_tensor(t.scalar_type(), t.sizes());
      return;
    }
    if (!mesh)
      mesh = &impl->device_mesh();
    else if (impl->device_mesh() != *mesh)
      ok = false;  // two mesh objects: the fallback checks them
    tensors.push_back(&t);
    key.dtensor(impl->layout().get(), t.scalar_type());
  }
};

// Each reader writes one argument's chunk of the key (scalars only when the rule reads them).
void read(FastArgs& a, const at::Tensor& t) { a.tensor(t); }
void read(FastArgs& a, const std::optional<at::Tensor>& t) {
  if (t)
    a.tensor(*t);
  else
    a.key.none();
}
void read(FastArgs& a, at::TensorList list) {
  a.key.list(list.size());
  for (const at::Tensor& t : list) {
    if (!t.defined())
      a.ok = false;  // (an undefined list element: the fallback's case)
    else
      a.tensor(t);
  }
}
// Non-tensor values, keyed as the boxed stack holds them: each writes its chunk into `key` (when
// given: the rule reads scalars) and says whether this path runs the value at all -- a complex
// Scalar or a symbolic int goes to the boxed fallback (the one refusal, for the check and the key
// alike; a refused call's partial key is dropped with it).
bool read_value(PlanKey* key, int64_t v) {
  if (key) key->integer(v);
  return true;
}
bool read_value(PlanKey* key, bool v) {
  if (key) key->boolean(v);
  return true;
}
bool read_value(PlanKey* key, double v) {
  if (key) key->real(v);
  return true;
}
bool read_value(PlanKey* key, const c10::Scalar& s) {
  if (s.isComplex()) return false;
  if (!key) return true;
  // A double, an int or a bool IValue.
  if (s.isFloatingPoint())
    key->real(s.toDouble());
  else if (s.isBoolean())
    key->boolean(s.toBool());
  else
    key->integer(s.toLong());
  return true;
}
bool read_value(PlanKey* key, const c10::SymInt& v) {
  if (v.is_heap_allocated()) return false;
  if (key) key->integer(v.as_int_unchecked());
  return true;
}
bool read_value(PlanKey* key, c10::IntArrayRef v) {
  if (!key) return true;
  key->list(v.size());
  for (int64_t x : v) key->integer(x);
  return true;
}
template <typename T>
bool read_list(PlanKey* key, c10::ArrayRef<T> list) {
  if (key) key->list(list.size());
  for (const auto& x : list)
    if (!read_value(key, x)) return false;
  return true;
}
bool read_value(PlanKey* key, c10::SymIntArrayRef v) { return read_list(key, v); }
bool read_value(PlanKey* key, at::ArrayRef<c10::Scalar> list) { return read_list(key, list); }
bool read_value(PlanKey* key, at::OptionalIntArrayRef v) {
  if (!v) {
    if (key) key->none();
    return true;
  }
  return read_value(key, *v);
}
bool read_value(PlanKey* key, c10::Device d) {
  if (key) key->device(d);
  return true;
}
template <typename T, typename = std::enable_if_t<std::is_enum_v<T>>>
bool read_value(PlanKey* key, T v) {
  if (key) key->integer(static_cast<int64_t>(v));  // dtypes, layouts, memory formats: ints on the boxed stack
  return true;
}
template <typename T>
bool read_value(PlanKey* key, const std::optional<T>& v) {
  if (!v) {
    if (key) key->none();
    return true;
  }
  return read_value(key, *v);
}

// The kinds read_value keys; any other argument kind sends the call to the fallback.
template <typename T>
struct Keyable
    : std::bool_constant<std::is_enum_v<T> || std::is_same_v<T, int64_t> || std::is_same_v<T, bool> ||
                         std::is_same_v<T, double> || std::is_same_v<T, c10::Scalar> ||
                         std::is_same_v<T, c10::SymInt> || std::is_same_v<T, c10::IntArrayRef> ||
                         std::is_same_v<T, c10::SymIntArrayRef> || std::is_same_v<T, at::ArrayRef<c10::Scalar>> ||
                         std::is_same_v<T, at::OptionalIntArrayRef> || std::is_same_v<T, c10::Device>> {};
template <typename T>
struct Keyable<std::optional<T>> : Keyable<T> {};

// Each value is checked once; its chunk is written only when the rule reads scalars.
template <typename T>
void read(FastArgs& a, const T& v) {
  if constexpr (!Keyable<std::decay_t<T>>::value)
    a.ok = false;
  else if (!read_value(a.key_scalars ? &a.key : nullptr, v))
    a.ok = false;
}

// The local of a DTensor operand; every other argument passes through.
// (FastArgs left only DTensors and undefined tensors.)
const at::Tensor& local_of(const at::Tensor& t) {
  auto* impl = dtensor_impl(t);
  return impl ? impl->local() : t;
}
at::Tensor& local_of(at::Tensor& t) {
  auto* impl = dtensor_impl(t);
  return impl ? const_cast<at::Tensor&>(impl->local()) : t;
}
std::optional<at::Tensor> local_of(const std::optional<at::Tensor>& t) {
  if (t && t->defined()) return dtensor_impl(*t)->local();
  return t;
}
std::vector<at::Tensor> local_of(at::TensorList list) {
  std::vector<at::Tensor> locals;
  locals.reserve(list.size());
  for (const at::Tensor& t : list) locals.push_back(local_of(t));
  return locals;
}
template <typename T>
T&& local_of(T&& v) {
  return std::forward<T>(v);
}

// Argument `index` of the local call: the local shape where the plan rewrites that argument.
struct LocalShape {
  int64_t arg = -1;
  std::vector<int64_t> sizes;
  int64_t shifted = -1;  // OpPlan::shifted_int_arg
  int64_t shift = 0;
};
template <typename T>
decltype(auto) local_arg(int64_t index, const LocalShape& shape, T&& v) {
  using Plain = std::decay_t<T>;
  if constexpr (std::is_same_v<Plain, c10::SymIntArrayRef>) {
    return index == shape.arg ? c10::fromIntArrayRefUnchecked(shape.sizes) : c10::SymIntArrayRef(v);
  } else if constexpr (std::is_same_v<Plain, c10::IntArrayRef>) {
    return index == shape.arg ? c10::IntArrayRef(shape.sizes) : c10::IntArrayRef(v);
  } else if constexpr (std::is_same_v<Plain, int64_t>) {
    return index == shape.shifted ? v + shape.shift : v;
  } else if constexpr (std::is_same_v<Plain, c10::SymInt>) {  // (int arguments are SymInt on newer torch)
    return index == shape.shifted ? c10::SymInt(v.expect_int() + shape.shift) : c10::SymInt(v);
  } else {
    return local_of(std::forward<T>(v));
  }
}

// ------------------------------------------------------------------ the per-thread plan cache

struct Slot {
  const OpInfo* info = nullptr;
  PlanKey key;
  std::shared_ptr<const ops::OpPlan> plan;
  bool trivial = false;  // the fast path can run this plan
};

// What a typed kernel returns: one tensor (fresh or a view), its first argument written in
// place, nothing (in-place list ops), or a list of fresh tensors.
enum class Returns : int8_t { kOne, kWrittenSelf, kNothing, kList };

// Whether the plan asks for nothing the fast path does not do: every operand in its layout, no
// argument rewrite but a view's size list, no expand implementation, outputs whose shapes the
// plan knows, a written first argument keeping its layout.
bool is_trivial(const ops::OpPlan& plan, const FastArgs& args, const OpInfo& info, Returns returns,
                c10::ArrayRef<bool> int_list_args, c10::ArrayRef<bool> int_args) {
  // (data_shaped: the wrapper's shape comes from each call's local result; copies: a view's outputs
  // that do not alias the base)
  if (plan.localize || plan.expand || plan.data_shaped || plan.copies || !plan.refused.empty() ||
      plan.inputs.size() != args.tensors.size())
    return false;
  if (plan.shifted_int_arg >= 0 &&
      (plan.shifted_int_arg >= static_cast<int64_t>(int_args.size()) || !int_args[plan.shifted_int_arg]))
    return false;
  if (plan.local_shape_arg >= 0 &&
      (plan.local_shape_arg >= static_cast<int64_t>(int_list_args.size()) || !int_list_args[plan.local_shape_arg]))
    return false;
  for (size_t i = 0; i < args.tensors.size(); ++i) {
    const auto* impl = dtensor_impl(*args.tensors[i]);
    const auto& input = plan.inputs[i];
    if (impl ? input != impl->layout() : input && (input->is_sharded_anywhere() || input->has_partial())) return false;
  }
  switch (returns) {
    case Returns::kNothing:
      return info.returns.empty() && plan.outputs.empty();
    case Returns::kList:
      return info.returns.size() == 1 && info.returns[0].kind == ReturnKind::kFresh;
    case Returns::kWrittenSelf:
      return info.returns.size() == 1 && info.returns[0].kind == ReturnKind::kWritten && info.returns[0].arg == 0 &&
             plan.outputs.size() == 1 && plan.outputs[0] == plan.inputs[0];
    case Returns::kOne:
      return info.returns.size() == 1 && info.returns[0].kind != ReturnKind::kWritten && plan.outputs.size() == 1;
  }
  return false;
}

// The slot holding this call's plan, or null when it was not there: then the slot is filled
// (from the fallback's plan cache, or the rule; errors raise here with the fallback's text) and
// this call goes through the fallback, which counts it and caches its plan.
template <typename BoxArgs>
const Slot* find_slot(OpInfo& info, const c10::OperatorHandle& op, FastArgs& args, Returns returns,
                      c10::ArrayRef<bool> int_list_args, c10::ArrayRef<bool> int_args, BoxArgs&& box_args) {
  args.key.in_backward(torch::autograd::get_current_graph_task_id() >= 0);
  const uint64_t hash = args.key.hash() ^ (reinterpret_cast<uintptr_t>(&info) >> 4);
  thread_local ThreadCache<Slot, 64, 4> slots;
  const Slot* hit = slots.find(hash, [&](const Slot& s) { return s.info == &info && s.key == args.key; });
  if (hit && !g_key_check.load(std::memory_order_relaxed)) return hit;
  torch::jit::Stack stack = box_args();
  if (g_key_check.load(std::memory_order_relaxed)) {
    PlanKey boxed;
    detail::key_of_stack(op, info, stack, boxed);
    HS_CHECK(boxed == args.key, info.name, "internal error: the fast path's plan key (", args.key.words().size(),
             " words) differs from the boxed flow's (", boxed.words().size(), " words) for the same call");
    if (hit) return hit;
  }
  std::shared_ptr<const ops::OpPlan> plan;
  try {
    plan = detail::peek_plan(op, info, stack);
  } catch (const ops::NotCovered&) {
    return nullptr;  // the fallback's call, through the boxed path
  }
  Slot& slot = slots.claim(hash);
  slot.info = &info;
  slot.key = args.key;
  slot.trivial = is_trivial(*plan, args, info, returns, int_list_args, int_args);
  slot.plan = std::move(plan);
  return nullptr;
}

// ------------------------------------------------------------------ the typed kernel

// One kernel object per op, its code per C++ signature: any op with a rule whose signature is in
// `Signatures` (below) gets one.
template <typename Sig>
struct TypedKernel;

template <typename Ret, typename... Args>
struct TypedKernel<Ret(Args...)> {
  static constexpr Returns kReturns = std::is_same_v<Ret, at::Tensor&>               ? Returns::kWrittenSelf
                                      : std::is_void_v<Ret>                          ? Returns::kNothing
                                      : std::is_same_v<Ret, std::vector<at::Tensor>> ? Returns::kList
                                                                                     : Returns::kOne;
  static_assert(kReturns != Returns::kOne || std::is_same_v<Ret, at::Tensor>, "fast path: an unsupported return type");
  static constexpr std::array<bool, sizeof...(Args)> kIntListArgs = {
      (std::is_same_v<std::decay_t<Args>, c10::SymIntArrayRef> ||
       std::is_same_v<std::decay_t<Args>, c10::IntArrayRef>)...};
  static constexpr std::array<bool, sizeof...(Args)> kIntArgs = {
      (std::is_same_v<std::decay_t<Args>, int64_t> || std::is_same_v<std::decay_t<Args>, c10::SymInt>)...};

  const c10::OperatorHandle op;
  const c10::TypedOperatorHandle<Ret(Args...)> typed;  // the local call
  OpInfo& info;

  // Whether `op` has this C++ signature: the same argument and return types as its schema, SymInt
  // told from int (c10's inference from the C++ types, compared on the real types), and
  // `Tensor&` exactly where the schema writes a tensor (which the types alone do not tell).
  static bool matches(const c10::OperatorHandle& op) {
    static const c10::FunctionSchema inferred = c10::inferFunctionSchemaFlattenedReturns<Ret(Args...)>();
    static constexpr std::array<bool, sizeof...(Args)> kWritten = {std::is_same_v<Args, at::Tensor&>...};
    const auto& args = op.schema().arguments();
    const auto& rets = op.schema().returns();
    if (args.size() != inferred.arguments().size() || rets.size() != inferred.returns().size()) return false;
    const auto writes_tensor = [](const c10::Argument& a) {
      return a.alias_info() && a.alias_info()->isWrite() && a.type()->kind() == c10::TypeKind::TensorType;
    };
    for (size_t i = 0; i < args.size(); ++i)
      if (*args[i].real_type() != *inferred.arguments()[i].real_type() || writes_tensor(args[i]) != kWritten[i])
        return false;
    for (size_t i = 0; i < rets.size(); ++i)
      if (*rets[i].real_type() != *inferred.returns()[i].real_type()) return false;
    return std::is_same_v<Ret, at::Tensor&> == (rets.size() == 1 && writes_tensor(rets[0]));
  }

  static void install(torch::Library& library, const c10::OperatorHandle& op, const std::string& name) {
    // Never destroyed: the dispatcher calls it for the life of the process.
    auto* kernel = new TypedKernel{op, op.typed<Ret(Args...)>(), detail::op_info(op)};
    library.impl(name.substr(name.find("::") + 2).c_str(),
                 torch::CppFunction([kernel](c10::DispatchKeySet keys, Args... args) -> Ret {
                   return kernel->run(keys, std::forward<Args>(args)...);
                 }));
  }

  Ret boxed(c10::DispatchKeySet keys, Args... args) const {
    return c10::impl::BoxedKernelWrapper<Ret(Args...)>::call(
        c10::BoxedKernel::makeFromFunction<&detail::dtensor_fallback>(), op, keys, std::forward<Args>(args)...);
  }

  template <size_t... I>
  Ret call_local(std::index_sequence<I...>, const LocalShape& shape, Args&... args) const {
    return typed.call(local_arg(static_cast<int64_t>(I), shape, args)...);
  }

  Ret run(c10::DispatchKeySet keys, Args... args) const {
    if (!g_enabled.load(std::memory_order_relaxed) || !info.rule || check_replicas())
      return boxed(keys, std::forward<Args>(args)...);
    FastArgs fast;
    fast.key_scalars = info.rule->key == ops::KeyScalars::kAll;
    (read(fast, args), ...);
    if (!fast.ok || !fast.mesh) return boxed(keys, std::forward<Args>(args)...);
    const Slot* slot = find_slot(info, op, fast, kReturns, kIntListArgs, kIntArgs,
                                 [&] { return c10::impl::boxArgs<Args...>(args...); });
    if (!slot || !slot->trivial) return boxed(keys, std::forward<Args>(args)...);
    const ops::OpPlan& plan = *slot->plan;

    // Per call: views that do not alias their base (any use) and writes into a base that has one
    // are the fallback's to check (or refuse); a view's geometry is its local's when every operand's wrapper geometry
    // is its local's, else the rule's.
    const bool writes = kReturns == Returns::kWrittenSelf || kReturns == Returns::kNothing;
    bool geometry_from_local = info.is_view;
    for (const at::Tensor* t : fast.tensors) {
      auto* impl = dtensor_impl(*t);
      if (!impl) continue;  // a wrapped number
      if (impl->is_detached_view() || (writes && impl->has_live_detached_views()))
        return boxed(keys, std::forward<Args>(args)...);
      geometry_from_local = geometry_from_local && impl->geometry_is_local();
    }
    std::optional<ops::ViewGeometry> rule_geometry;
    if (info.is_view && !geometry_from_local) {
      if (plan.geometry) rule_geometry = plan.geometry(*fast.tensors[0]);
      if (!rule_geometry) return boxed(keys, std::forward<Args>(args)...);
    }
    detail::count_fast_call(info);
    for (const at::Tensor* t : fast.tensors)
      if (t->requires_grad() && t->is_leaf())
        if (dtensor_impl(*t) != nullptr) detail::install_grad_hook(*t);

    const DeviceMeshPtr& mesh = *fast.mesh;
    LocalShape shape;
    if (auto sizes = detail::planned_local_shape(plan, *mesh)) {
      shape.arg = plan.local_shape_arg;
      shape.sizes = std::move(*sizes);
    }
    shape.shifted = plan.shifted_int_arg;
    shape.shift = plan.int_shift;
    // The local call, below autograd (recorded on the wrappers) and autocast (applied to them).
    auto run_local = [&]() -> Ret {
      detail::LocalExecutionGuard local(info.is_view);
      return call_local(std::index_sequence_for<Args...>(), shape, args...);
    };
    if constexpr (kReturns == Returns::kNothing) {
      run_local();  // writes into the locals
    } else if constexpr (kReturns == Returns::kWrittenSelf) {
      run_local();  // writes into the first argument's local
      return std::get<0>(std::forward_as_tuple(args...));
    } else if constexpr (kReturns == Returns::kList) {
      std::vector<at::Tensor> locals = run_local();
      HS_CHECK(locals.size() == plan.outputs.size(), info.name, "internal error: ", locals.size(),
               " returned tensors for ", plan.outputs.size(), " planned layouts");
      for (size_t i = 0; i < locals.size(); ++i)
        locals[i] = detail::wrap_local(std::move(locals[i]), plan.outputs[i], mesh, nullptr);
      return locals;
    } else {
      at::Tensor local = run_local();
      if (!info.is_view) return detail::wrap_local(std::move(local), plan.outputs[0], mesh, nullptr);
      Geometry geometry;
      if (rule_geometry) geometry = Geometry{rule_geometry->first, rule_geometry->second};
      const detail::OutputView view{/*local_geometry=*/!rule_geometry, rule_geometry ? &geometry : nullptr, {}};
      return detail::wrap_local(std::move(local), plan.outputs[0], mesh, &view);
    }
  }
};

std::vector<std::string>* g_fast_ops = new std::vector<std::string>();  // never destroyed

template <typename... Sigs>
struct SignatureList {};

// The C++ signatures the typed path reads, each written as the generated type of one ATen op that
// has it (exact for the torch being built against: SymInt or int, `Tensor&` or `const Tensor&`).
// These are signatures, not an op list: every op with a rule and one of these signatures gets a
// typed kernel, so adding an op is its rule's row. A new signature goes here.
namespace aop = at::_ops;
using Signatures = SignatureList<
    // pointwise
    aop::add_Tensor::schema,   // (Tensor, Tensor, Scalar) -> Tensor
    aop::add__Tensor::schema,  // (Tensor!, Tensor, Scalar) -> Tensor!
    aop::mul_Tensor::schema,   // (Tensor, Tensor) -> Tensor
    aop::mul__Tensor::schema,  // (Tensor!, Tensor) -> Tensor!
    aop::mul_Scalar::schema,   // (Tensor, Scalar) -> Tensor
    aop::mul__Scalar::schema,  // (Tensor!, Scalar) -> Tensor!
    aop::neg::schema,          // (Tensor) -> Tensor
    aop::where_self::schema,   // (Tensor, Tensor, Tensor) -> Tensor
    aop::addcmul_::schema,     // (Tensor!, Tensor, Tensor, Scalar) -> Tensor!
    aop::copy_::schema,        // (Tensor!, Tensor, bool) -> Tensor!
    aop::zero_::schema,        // (Tensor!) -> Tensor!
    aop::clone::schema,        // (Tensor, MemoryFormat?) -> Tensor
    aop::_to_copy::schema,     // (Tensor, ScalarType?, Layout?, Device?, bool?, bool, MemoryFormat?)
    // views and shapes
    aop::view::schema,           // (Tensor, SymInt[]) -> Tensor
    aop::permute::schema,        // (Tensor, int[]) -> Tensor
    aop::transpose_int::schema,  // (Tensor, int, int) -> Tensor
    aop::select_int::schema,     // (Tensor, int, SymInt) -> Tensor
    aop::unsqueeze::schema,      // (Tensor, int) -> Tensor
    aop::tril::schema,           // (Tensor, SymInt) -> Tensor
    aop::expand::schema,         // (Tensor, SymInt[], bool) -> Tensor
    aop::slice_Tensor::schema,   // (Tensor, int, SymInt?, SymInt?, SymInt) -> Tensor
    // matmul, reductions, softmax, scans, indexing
    aop::addmm::schema,            // (Tensor, Tensor, Tensor, Scalar, Scalar) -> Tensor
    aop::sum_dim_IntList::schema,  // (Tensor, int[1]?, bool, ScalarType?) -> Tensor
    aop::amax::schema,             // (Tensor, int[], bool) -> Tensor
    aop::_softmax::schema,         // (Tensor, int, bool) -> Tensor
    aop::cumsum::schema,           // (Tensor, int, ScalarType?) -> Tensor
    aop::gather::schema,           // (Tensor, int, Tensor, bool) -> Tensor
    aop::index_select::schema,     // (Tensor, int, Tensor) -> Tensor
    aop::roll::schema,             // (Tensor, SymInt[], int[]) -> Tensor
    aop::_fft_r2c::schema,         // (Tensor, int[], int, bool) -> Tensor
    aop::avg_pool2d::schema,       // (Tensor, int[], int[], int[], bool, bool, int?) -> Tensor
    aop::_grouped_mm::schema,      // (Tensor, Tensor, Tensor?, Tensor?, ScalarType?) -> Tensor
    aop::convolution::schema,      // (Tensor, Tensor, Tensor?, SymInt[] x3, bool, SymInt[], SymInt)
    aop::constant_pad_nd::schema,  // (Tensor, SymInt[], Scalar) -> Tensor
    // list ops (optimizers with foreach=True, clip_grad_norm_, zero_grad)
    aop::_foreach_add__List::schema,            // (Tensor[]!, Tensor[], Scalar)
    aop::_foreach_add__Scalar::schema,          // (Tensor[]!, Scalar)
    aop::_foreach_add_List::schema,             // (Tensor[], Tensor[], Scalar) -> Tensor[]
    aop::_foreach_mul__List::schema,            // (Tensor[]!, Tensor[])
    aop::_foreach_mul__Tensor::schema,          // (Tensor[]!, Tensor)
    aop::_foreach_div__ScalarList::schema,      // (Tensor[]!, Scalar[])
    aop::_foreach_addcmul__Scalar::schema,      // (Tensor[]!, Tensor[], Tensor[], Scalar)
    aop::_foreach_addcdiv__ScalarList::schema,  // (Tensor[]!, Tensor[], Tensor[], Scalar[])
    aop::_foreach_sqrt::schema,                 // (Tensor[]) -> Tensor[]
    aop::_foreach_copy_::schema,                // (Tensor[]!, Tensor[], bool)
    aop::_foreach_zero_::schema,                // (Tensor[]!)
    aop::_foreach_norm_Scalar::schema>;         // (Tensor[], Scalar, ScalarType?) -> Tensor[]

// Installs the typed kernel of the first signature `op` has; false when it has none of them.
template <typename... Sigs>
bool install_typed(SignatureList<Sigs...>, torch::Library& library, const c10::OperatorHandle& op,
                   const std::string& name) {
  return ((TypedKernel<Sigs>::matches(op) && (TypedKernel<Sigs>::install(library, op, name), true)) || ...);
}

}  // namespace

void register_fast_paths() {
  static auto* library =
      new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse2, __FILE__, __LINE__);
  for (const std::string& name : ops::registry().names()) {
    if (name.rfind("aten::", 0) != 0) continue;  // the library is aten's
    const auto dot = name.find('.');
    const auto op = c10::Dispatcher::singleton().findSchema(
        {name.substr(0, dot), dot == std::string::npos ? "" : name.substr(dot + 1)});
    if (!op) continue;  // not in this torch
    // A composite-implicit op decomposes above PrivateUse2; a kernel there would change that.
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse2)) continue;  // a family's own kernel
    // The dispatcher checks the kernel against the op's schema and C++ signature once more; where
    // it refuses one that `matches` accepted, the op keeps the boxed fallback (never an import
    // failure), and test_fast_path_ops.py, which pins the ops that must be typed, says so.
    try {
      if (install_typed(Signatures{}, *library, *op, name)) g_fast_ops->push_back(name);
    } catch (const c10::Error&) {
    }
  }
}

// A user op given a rule after start-up (runtime::register_user_rule): its typed kernel where its
// signature is one the fast path reads and nothing serves it on PrivateUse2 yet; false otherwise.
// Declared where it is used (dispatch.cpp), so that fast_path.h and its includers stay as they are.
bool install_fast_path(const c10::OperatorHandle& op, const std::string& name) {
  if (op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) return false;  // must decompose
  // The fallback took the op already (it ran on a DTensor before its rule came): it stays boxed.
  if (op.hasKernelForDispatchKey(c10::DispatchKey::PrivateUse2)) return false;
  static std::mutex mutex;
  static auto* libraries = new std::unordered_map<std::string, torch::Library*>();  // never destroyed
  std::lock_guard<std::mutex> guard(mutex);
  const std::string ns = name.substr(0, name.find("::"));
  auto& library = (*libraries)[ns];
  if (!library)
    library = new torch::Library(torch::Library::IMPL, ns, c10::DispatchKey::PrivateUse2, __FILE__, __LINE__);
  try {
    if (!install_typed(Signatures{}, *library, op, name)) return false;
  } catch (const c10::Error&) {
    return false;  // as register_fast_paths: the dispatcher refused the kernel, the op stays boxed
  }
  g_fast_ops->push_back(name);
  return true;
}

std::vector<std::string> fast_path_ops() { return *g_fast_ops; }

void set_fast_path(bool on) { g_enabled.store(on); }
void set_key_check(bool on) { g_key_check.store(on); }
bool fast_path_enabled() { return g_enabled.load(); }

}  // namespace hypershard::runtime
