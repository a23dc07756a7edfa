// List ops: the _foreach_* ops (torch.optim with foreach=True, clip_grad_norm_, zero_grad) and
// the fused optimizer kernels (_fused_adam_, _fused_adamw_, _fused_sgd_: fused=True on CPU).
//
//   _foreach_<op>.List / .Scalar / .ScalarList / .Tensor and their in-place _foreach_<op>_
//   variants, for the pointwise ops add, sub, mul, div, lerp, addcmul, addcdiv, maximum,
//   minimum, clamp_min, clamp_max, pow, copy, zero, clone, neg and the unary math ops.
//   _foreach_norm is a reduction (reductions.cpp).
//
// Sharding: the lists are zipped (self[i] with other[i], tensor1[i], ...) and every position is
// an independent pointwise call: the pointwise engine (pointwise.h) runs once per position on
// that position's operands plus the single tensors shared by all positions (the clip
// coefficient of _foreach_mul_.Tensor), so each element keeps its own layout and the Partial
// algebra is exactly the pointwise family's, row by row:
//   linear      add/sub.List, add.Tensor, lerp.Scalar(List), copy
//   bilinear    mul.List, mul.Tensor          numerator  div.List, div.Tensor
//   scale       mul/div.Scalar(List)          negate     neg            identity  zero, clone
//   monotone    sqrt, exp, log, sigmoid, ..., clamp_min/clamp_max/maximum/minimum by a scalar
//   reject      add/sub by a scalar, addcmul, addcdiv, pow, abs, reciprocal, rsqrt, ...
// A shared tensor must be acceptable to every position in one layout; the `scalars` tensor of
// addcmul/addcdiv.Tensor holds one value per position and is made Replicate. In-place list ops
// return nothing, so an element of self keeps its layout (a Partial the op cannot keep is an
// error, not a silent reduction into a copy), and a plain self element never takes DTensor data.
//
// Fused optimizers: every per-parameter list (grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
// momentum_buffer_list) is brought to its parameter's layout and the fused kernel runs on the
// locals, which then hold matching pieces of every tensor (the update is elementwise). The
// autograd hook already gives grads their parameter's layout, but the rule does not rely on it:
// an element in another layout (a Partial grad, a state loaded in another sharding) is
// redistributed in the expand implementation, updated, and written back into its own layout
// (the lists are written in place and the op returns nothing). Parameters must not be Partial.
// state_steps, lr (tensor_lr), grad_scale and found_inf are Replicate.
//
// GradScaler (torch.amp, fp16 training): _amp_foreach_non_finite_check_and_unscale_(self[],
// found_inf, inv_scale) multiplies every gradient by inv_scale in place and sets found_inf to 1
// where one holds an inf or NaN. The gradients keep their layouts (Replicate or Shard); each rank
// checks its own blocks, so the expand all-reduces found_inf (max) over the mesh axes that split
// any gradient: one flag for the model, the same on every rank, as one device sets it. found_inf
// is GradScaler's plain tensor (every rank's the same after the all-reduce: the rule plans that
// write, PlainWrites::kPlanned) or a Replicate DTensor; inv_scale is read whole. A Partial
// gradient is not covered (its parts can be finite while their sum overflows: default mode
// computes the call on gathered gradients, strict mode raises). _amp_update_scale_(self,
// growth_tracker, found_inf, ...) updates GradScaler's scale: every argument whole (a Partial or
// sharded found_inf is made whole first; self and growth_tracker, written in place, not whole:
// not covered).
//
// Step-varying scalars (lr, betas, bias corrections, weights) never change a plan: every rule
// here is registered with KeyScalars::kNone, so the plan cache stays bounded across steps.
// Excluded: the .out / _out variants (functionalization only), _foreach_max, _foreach_powsum,
// _foreach_mm, _fused_adagrad_ (its state_steps list is written; no caller needs it yet), the
// functional _amp_foreach_non_finite_check_and_unscale / _amp_update_scale (functionalization only).
#include <ATen/ATen.h>

#include <algorithm>

#include "ops/families.h"
#include "ops/pointwise.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {
namespace {

using Stack = torch::jit::Stack;

bool is_written(const OpCall& call, int64_t arg) {
  const auto* alias = call.schema().arguments()[arg].alias_info();
  return alias && alias->isWrite();
}

const std::string& arg_name(const OpCall& call, int64_t arg) { return call.schema().arguments()[arg].name(); }

// The common length of the Tensor[] arguments (the lists are zipped).
int64_t list_length(const OpCall& call) {
  int64_t n = -1, first = -1;
  for (int64_t a = 0; a < call.num_args(); ++a) {
    if (!call.arg(a).isTensorList()) continue;
    const auto size = static_cast<int64_t>(call.arg(a).toTensorList().size());
    if (n < 0) {
      n = size;
      first = a;
    } else if (size != n) {
      fail_call(call, layout::str_cat("the lists ", arg_name(call, first), " (", n, " tensors) and ", arg_name(call, a),
                                      " (", size, " tensors) must have the same length"));
    }
  }
  return std::max<int64_t>(n, 0);
}

// ------------------------------------------------------------------ _foreach_* list ops

template <Algebra A>
OpPlan foreach_rule(const OpCall& call) {
  const int64_t n = list_length(call);
  std::vector<std::vector<int64_t>> items(n);  // per position: its operands (indices into tensors)
  std::vector<int64_t> shared;                 // single tensors every position uses
  OpPlan plan;
  plan.inputs.resize(call.tensors.size());
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const auto t = static_cast<int64_t>(i);
    const auto& ta = call.tensors[t];
    if (ta.item >= 0)
      items[ta.item].push_back(t);
    else if (arg_name(call, ta.arg) == "scalars")
      plan.inputs[t] = replicate_like(*ta.layout, ta.layout->global_shape());
    else
      shared.push_back(t);
  }
  const bool returns_list = !call.schema().returns().empty();
  for (int64_t p = 0; p < n; ++p) {
    auto operands = items[p];
    operands.insert(operands.end(), shared.begin(), shared.end());
    std::sort(operands.begin(), operands.end());  // schema order
    const bool any_dtensor =
        std::any_of(operands.begin(), operands.end(), [&](int64_t t) { return call.tensors[t].is_dtensor; });
    auto layouts = elementwise_layouts(call, A, kNoMask, operands);
    for (size_t k = 0; k < operands.size(); ++k) {
      const int64_t t = operands[k];
      const auto& ta = call.tensors[t];
      auto& required = layouts.inputs[k];
      if (ta.item < 0) {
        if (plan.inputs[t] && plan.inputs[t] != required)
          fail_argument(call, t,
                        "the list elements need it in different layouts (" + plan.inputs[t]->to_string() + " and " +
                            required->to_string() + ")",
                        "list elements that agree on it (redistribute the Partial elements or this tensor first)");
        plan.inputs[t] = std::move(required);
        continue;
      }
      if (ta.arg == 0 && is_written(call, 0)) {
        if (!ta.is_dtensor && any_dtensor)
          fail_argument(call, t, "a plain tensor cannot take DTensor data in place (it would hold one rank's piece)",
                        "a DTensor element (distribute it first)");
        if (required != ta.layout)
          fail_argument(call, t,
                        "an in-place list op keeps every element's layout, and this op would have to "
                        "redistribute it first",
                        "a layout this op keeps (redistribute the element first)");
      }
      plan.inputs[t] = std::move(required);
    }
    if (returns_list) plan.outputs.push_back(layouts.output);
  }
  for (int64_t t : shared)  // empty lists: shared tensors stay as they are
    if (!plan.inputs[t]) plan.inputs[t] = call.tensors[t].layout;
  return plan;
}

// ------------------------------------------------------------------ fused optimizers

// Per tensor argument: the layout a written list element is updated in (its parameter's), or
// null where that is its own.
using FusedTargets = std::vector<LayoutPtr>;

// The fused kernel on locals: every written list element in its parameter's layout and
// contiguous (the fused CPU kernels walk raw memory, and a Shard(1) piece is a strided view),
// then written back into its own layout and memory.
void fused_optimizer_expand(const FusedTargets& targets, const OpCall& call, Stack& stack) {
  c10::IValue* args = stack.data() + (stack.size() - call.num_args());
  const auto grad_scale = call.schema().argumentIndexWithName("grad_scale");
  const bool grads_change = grad_scale && !args[*grad_scale].isNone();  // unscaled in place
  struct WriteBack {
    int64_t tensor;
    at::Tensor own, work;
  };
  std::vector<WriteBack> write_back;
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const auto& ta = call.tensors[i];
    if (ta.item < 0 || !is_written(call, ta.arg)) continue;
    auto list = args[ta.arg].toTensorList();
    at::Tensor own = list.get(ta.item);
    at::Tensor work = targets[i] ? runtime::redistribute_local(own, ta.layout, targets[i], *call.mesh) : own;
    work = work.contiguous();
    if (work.is_same(own)) continue;
    if (list.use_count() > 1) {  // never write into the caller's list
      list = list.copy();
      args[ta.arg] = list;
    }
    list.set(ta.item, work);
    if (grads_change || arg_name(call, ta.arg) != "grads") write_back.push_back({static_cast<int64_t>(i), own, work});
  }
  call.op->callBoxed(&stack);
  for (auto& w : write_back) {
    const auto& ta = call.tensors[w.tensor];
    w.own.copy_(targets[w.tensor] ? runtime::redistribute_local(w.work, targets[w.tensor], ta.layout, *call.mesh)
                                  : w.work);
  }
}

OpPlan fused_optimizer_rule(const OpCall& call) {
  // Lists other than self may be empty (max_exp_avg_sqs without amsgrad, momentum buffers
  // without momentum); the kernel checks the others' lengths on every rank alike.
  const auto n = static_cast<int64_t>(call.arg(0).toTensorList().size());
  std::vector<int64_t> param(n, -1);
  std::vector<bool> has_dtensor(n, false);  // per position
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const auto& ta = call.tensors[i];
    if (ta.arg == 0) param[ta.item] = static_cast<int64_t>(i);
    if (ta.item >= 0 && ta.item < n && ta.is_dtensor) has_dtensor[ta.item] = true;
  }
  OpPlan plan;
  plan.inputs.resize(call.tensors.size());
  FusedTargets targets(call.tensors.size());
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const auto t = static_cast<int64_t>(i);
    const auto& ta = call.tensors[t];
    if (ta.item < 0 || !is_written(call, ta.arg)) {  // lr, grad_scale, found_inf, state_steps
      plan.inputs[t] = replicate_like(*ta.layout, ta.layout->global_shape());
      continue;
    }
    if (ta.item >= n) fail_call(call, layout::str_cat("the list ", arg_name(call, ta.arg), " is longer than self"));
    const int64_t p = param[ta.item];
    const auto& target = call.tensors[p].layout;
    if (ta.arg == 0) {
      if (target->has_partial())
        fail_argument(call, t, "a Partial parameter cannot be updated in place", "Replicate or Shard parameters");
    } else if (ta.layout->global_shape() != target->global_shape()) {
      fail_argument(call, t, "its shape differs from the parameter's " + layout::shape_string(target->global_shape()),
                    "the shape of self[" + std::to_string(ta.item) + "]");
    }
    if (!ta.is_dtensor && has_dtensor[ta.item])
      fail_argument(call, t, "a plain tensor cannot take DTensor data in place (it would hold one rank's piece)",
                    "DTensors for every list element of a DTensor parameter");
    plan.inputs[t] = ta.layout;  // written in place: converted (and written back) by the expand
    if (ta.layout != target) targets[t] = target;
  }
  plan.expand = [targets](const OpCall& c, Stack& s) { fused_optimizer_expand(targets, c, s); };
  return plan;
}

// ------------------------------------------------------------------ GradScaler

bool is_replicate(const Layout& l) { return !l.is_sharded_anywhere() && !l.has_partial(); }

OpPlan amp_unscale_rule(const OpCall& call) {
  OpPlan plan;
  plan.inputs.resize(call.tensors.size());
  std::vector<int64_t> axes;  // the mesh axes that split some gradient
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const auto t = static_cast<int64_t>(i);
    const auto& ta = call.tensors[t];
    if (ta.arg == 0) {
      if (ta.layout->has_partial())
        not_covered(call, "a Partial gradient: its parts can be finite while their sum overflows");
      for (const auto& dim : ta.layout->dim_axes()) axes.insert(axes.end(), dim.begin(), dim.end());
      plan.inputs[t] = ta.layout;  // unscaled in place, in its own layout
      continue;
    }
    if (is_written(call, ta.arg) && !is_replicate(*ta.layout))
      not_covered(call, "a found_inf that is not whole (GradScaler's is a plain tensor)");
    plan.inputs[t] = replicate_like(*ta.layout, ta.layout->global_shape());
  }
  std::sort(axes.begin(), axes.end());
  axes.erase(std::unique(axes.begin(), axes.end()), axes.end());
  if (axes.empty()) return plan;
  const int64_t found_inf_arg = call.arg_index("found_inf");
  plan.expand = [axes, found_inf_arg](const OpCall& c, Stack& stack) {
    at::Tensor found_inf = (stack.data() + (stack.size() - c.num_args()))[found_inf_arg].toTensor();
    c.op->callBoxed(&stack);
    for (int64_t axis : axes) found_inf.copy_(runtime::all_reduce_along(found_inf, *c.mesh, axis, ReduceOp::Max));
  };
  return plan;
}

OpPlan amp_update_scale_rule(const OpCall& call) {
  OpPlan plan;
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const auto t = static_cast<int64_t>(i);
    const auto& ta = call.tensors[t];
    if (is_written(call, ta.arg) && !is_replicate(*ta.layout))
      not_covered(call, "GradScaler's scale or growth tracker not whole (they are updated in place)");
    plan.inputs.push_back(replicate_like(*ta.layout, ta.layout->global_shape()));
  }
  plan.outputs = {plan.inputs[call.tensor_index(0)]};  // self, returned
  return plan;
}

// ------------------------------------------------------------------ registration helpers

// "aten::_foreach_<op>[.<overload>]" and, unless `functional_only`, its in-place "_foreach_<op>_".
template <Algebra A>
void add_foreach(Registry& r, const std::string& op, std::initializer_list<const char*> overloads,
                 bool functional_only = false) {
  for (const char* overload : overloads) {
    const std::string suffix = *overload ? std::string(".") + overload : "";
    r.add("aten::_foreach_" + op + suffix, &foreach_rule<A>, KeyScalars::kNone);
    if (!functional_only) r.add("aten::_foreach_" + op + "_" + suffix, &foreach_rule<A>, KeyScalars::kNone);
  }
}

}  // namespace

void register_foreach(Registry& r) {
  using A = Algebra;
  r.add("aten::_amp_foreach_non_finite_check_and_unscale_", &amp_unscale_rule, KeyScalars::kNone,
        PlainWrites::kPlanned);
  r.add("aten::_amp_update_scale_", &amp_update_scale_rule, KeyScalars::kNone, PlainWrites::kPlanned);
  add_foreach<A::kLinear>(r, "add", {"List", "Tensor"});
  add_foreach<A::kReject>(r, "add", {"Scalar", "ScalarList"});
  add_foreach<A::kReject>(r, "addcdiv", {"Scalar", "ScalarList", "Tensor"});
  add_foreach<A::kReject>(r, "addcmul", {"Scalar", "ScalarList", "Tensor"});
  add_foreach<A::kMonotone>(r, "clamp_max", {"Scalar", "ScalarList"});
  add_foreach<A::kReject>(r, "clamp_max", {"List"});
  add_foreach<A::kMonotone>(r, "clamp_min", {"Scalar", "ScalarList"});
  add_foreach<A::kReject>(r, "clamp_min", {"List"});
  add_foreach<A::kIdentity>(r, "clone", {""}, /*functional_only=*/true);
  add_foreach<A::kLinear>(r, "copy", {""});
  add_foreach<A::kNumerator>(r, "div", {"List", "Tensor"});
  add_foreach<A::kScale>(r, "div", {"Scalar", "ScalarList"});
  add_foreach<A::kLinear>(r, "lerp", {"Scalar", "ScalarList"});
  add_foreach<A::kReject>(r, "lerp", {"List"});
  add_foreach<A::kMonotone>(r, "maximum", {"Scalar", "ScalarList"});
  add_foreach<A::kReject>(r, "maximum", {"List"});
  add_foreach<A::kMonotone>(r, "minimum", {"Scalar", "ScalarList"});
  add_foreach<A::kReject>(r, "minimum", {"List"});
  add_foreach<A::kBilinear>(r, "mul", {"List", "Tensor"});
  add_foreach<A::kScale>(r, "mul", {"Scalar", "ScalarList"});
  add_foreach<A::kNegate>(r, "neg", {""});
  add_foreach<A::kReject>(r, "pow", {"List", "Scalar", "ScalarList"});
  add_foreach<A::kReject>(r, "pow", {"ScalarAndTensor"}, /*functional_only=*/true);
  add_foreach<A::kReject>(r, "sub", {"Scalar", "ScalarList"});
  add_foreach<A::kLinear>(r, "sub", {"List"});
  add_foreach<A::kIdentity>(r, "zero", {""});
  for (const char* op : {"atan", "ceil", "erf", "exp", "expm1", "floor", "log", "log10", "log1p", "log2", "round",
                         "sigmoid", "sign", "sinh", "sqrt", "tanh", "trunc"})
    add_foreach<A::kMonotone>(r, op, {""});
  for (const char* op :
       {"abs", "acos", "asin", "cos", "cosh", "erfc", "frac", "lgamma", "reciprocal", "rsqrt", "sin", "tan"})
    add_foreach<A::kReject>(r, op, {""});
  for (const char* op : {"aten::_fused_adam_", "aten::_fused_adam_.tensor_lr", "aten::_fused_adamw_",
                         "aten::_fused_adamw_.tensor_lr", "aten::_fused_sgd_", "aten::_fused_sgd_.tensor_lr"})
    r.add(op, &fused_optimizer_rule, KeyScalars::kNone);
}

}  // namespace hypershard::ops
