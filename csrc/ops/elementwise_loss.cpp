// Elementwise losses: a pointwise term of (self, target[, weight, pos_weight]) reduced by
// `reduction` (none / sum / mean), and their backward ops; and the per-sample losses
// (multi_margin_loss, multilabel_margin_loss: one loss per row of classes, see
// per_sample_loss_rule), reduced alike over the GLOBAL sample count.
//
//   aten::mse_loss, smooth_l1_loss, huber_loss, soft_margin_loss, binary_cross_entropy,
//   binary_cross_entropy_with_logits                      forward
//   aten::mse_loss_backward, smooth_l1_loss_backward, huber_loss_backward,
//   soft_margin_loss_backward, binary_cross_entropy_backward   backward (grad_output first)
// (l1_loss, kl_div, poisson_nll_loss and the other composite losses decompose into pointwise
// ops and reductions, whose rules already take the GLOBAL count.)
//
// Sharding: the term is elementwise, so every operand takes one sharding of the broadcast shape
// (= self's): the most sharded of self's and target's (a whole operand is cut locally, nothing
// moves); weight / pos_weight broadcast into it, whole along the dims they broadcast. Then
//   none  the per-element loss (or the gradient) keeps that sharding;
//   sum   each rank sums its shard: Partial(sum) over the axes that shard it;
//   mean  each rank sums its shard and divides by the GLOBAL element count: Partial(sum) too --
//         sum_r (s_r / N) is the mean over all N elements, whereas a local mean (s_r / n_r)
//         would weigh uneven shards wrongly (the mistake PyTorch's DTensor 2.13 makes for mse,
//         huber, smooth_l1, bce, bce_with_logits and soft_margin).
//   backward: grad_output (a scalar for sum/mean, Replicate) is linear, the local ATen call
//         with reduction sum, times 1/N for mean.
// Partial: a Partial self / target / weight is an error naming the argument (none of the terms
// is linear); a Partial(sum) grad_output is reduced first (inside a backward pass).
// Not covered (default mode's fallback, strict mode's error): a target of another shape than
// self (torch broadcasts it with a warning).
#include <ATen/ATen.h>

#include <algorithm>

#include "ops/families.h"

namespace hypershard::ops {
namespace {

constexpr int64_t kNone = at::Reduction::None, kMean = at::Reduction::Mean, kSum = at::Reduction::Sum;

struct Operands {
  int64_t grad = -1, self = -1, target = -1, weight = -1, pos_weight = -1;  // indices into call.tensors
};

Operands operands_of(const OpCall& call, bool backward) {
  Operands o;
  if (backward) o.grad = call.tensor_named({"grad_output"});
  o.self = call.tensor_named({"self"});
  o.target = call.tensor_named({"target"});
  o.weight = call.tensor_named({"weight"});
  o.pos_weight = call.tensor_named({"pos_weight"});
  return o;
}

int64_t sharded_ranks(const Layout& l) {
  int64_t n = 1;
  for (const auto& axes : l.dim_axes())
    for (int64_t a : axes) n *= l.mesh()->shape()[a];
  return n;
}

// `operand`'s layout inside the broadcast shape `out_shape` sharded by `dims`: its dims that
// broadcast (size 1 against a larger one, or absent) are whole.
LayoutPtr broadcast_into(const Layout& operand, const std::vector<int64_t>& out_shape, const layout::DimAxes& dims) {
  const auto& shape = operand.global_shape();
  const int64_t lead = static_cast<int64_t>(out_shape.size()) - static_cast<int64_t>(shape.size());
  layout::DimAxes mine(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t o = lead + static_cast<int64_t>(d);
    if (o >= 0 && !(shape[d] == 1 && out_shape[o] != 1)) mine[d] = dims[o];
  }
  return layout::intern_layout(Layout::create(operand.mesh(), shape, mine, {}));
}

std::vector<int64_t> axes_of(const layout::DimAxes& dims) {
  std::vector<int64_t> axes;
  for (const auto& d : dims) axes.insert(axes.end(), d.begin(), d.end());
  std::sort(axes.begin(), axes.end());
  return axes;
}

// The local call with reduction sum, then (mean) 1/N of the GLOBAL count N.
void sum_then_scale(int64_t reduction_arg, int64_t reduction, double count, const OpCall& call,
                    torch::jit::Stack& stack) {
  const int64_t base = static_cast<int64_t>(stack.size()) - call.num_args();
  stack[base + reduction_arg] = c10::IValue(kSum);
  call.op->callBoxed(stack);
  if (reduction == kMean) {  // the first result (multilabel_margin_loss_forward has a second)
    c10::IValue& first = stack[stack.size() - call.schema().returns().size()];
    const at::Tensor out = first.toTensor();
    first = c10::IValue(count > 0 ? out.mul(1.0 / count) : out.div(count));  // 0/0 = nan, as torch
  }
}

template <bool kBackward>
OpPlan elementwise_loss_rule(const OpCall& call) {
  const Operands o = operands_of(call, kBackward);
  for (int64_t t : {o.self, o.target, o.weight, o.pos_weight})
    reject_partial(call, t, "the loss term is not linear in it");
  const Layout& self = call.layout(o.self);
  const Layout& target = call.layout(o.target);
  const auto& shape = self.global_shape();
  if (target.global_shape() != shape)
    not_covered(call, "target of shape " + layout::shape_string(target.global_shape()) + " broadcast to self's " +
                          layout::shape_string(shape));
  const int64_t reduction_arg = call.arg_index("reduction");
  const int64_t reduction = call.arg(reduction_arg).toInt();
  // The more sharded of self's and target's layouts: cutting the other locally moves nothing.
  const layout::DimAxes dims = sharded_ranks(target) > sharded_ranks(self) ? target.dim_axes() : self.dim_axes();
  const auto axes = axes_of(dims);

  OpPlan plan;
  plan.inputs.resize(call.tensors.size());
  for (int64_t t : {o.self, o.target, o.weight, o.pos_weight})
    if (t >= 0) plan.inputs[t] = broadcast_into(call.layout(t), shape, dims);
  const auto full = layout::intern_layout(Layout::create(self.mesh(), shape, dims, {}));
  if (kBackward) {
    const Layout& grad = call.layout(o.grad);
    // grad_output: the loss's shape (none) in the same sharding, or a scalar, whole.
    plan.inputs[o.grad] = reduction == kNone
                              ? broadcast_into(grad, shape, dims)
                              : layout::intern_layout(Layout::replicate(grad.mesh(), grad.global_shape()));
    plan.outputs = {full};
    if (reduction == kMean && !axes.empty()) {
      const double count = static_cast<double>(layout::numel(shape));
      plan.expand = [reduction_arg, count](const OpCall& c, torch::jit::Stack& s) {
        sum_then_scale(reduction_arg, kMean, count, c, s);
      };
    }
    return plan;
  }
  if (reduction == kNone) {
    plan.outputs = {full};
    return plan;
  }
  layout::PartialOps partial(self.mesh()->ndim());
  for (int64_t a : axes) partial[a] = ReduceOp::Sum;
  plan.outputs = {layout::intern_layout(Layout::create(self.mesh(), {}, {}, partial))};
  if (!axes.empty()) {
    const double count = static_cast<double>(layout::numel(shape));
    plan.expand = [reduction_arg, reduction, count](const OpCall& c, torch::jit::Stack& s) {
      sum_then_scale(reduction_arg, reduction, count, c, s);
    };
  }
  return plan;
}

// ------------------------------------------------------------------ per-sample losses

// multi_margin_loss(self [N, C], target [N], p, margin, weight [C], reduction) and
// multilabel_margin_loss_forward(self [N, C], target [N, C], reduction) -> (loss, is_target [N, C]),
// with their backward ops: a loss per sample (row), computed from that row alone (its C classes
// whole), then reduced over the N samples. So the batch dim keeps self's sharding, the class dim
// and weight are whole, and
//   none  the per-sample losses (and gradients) keep the batch sharding;
//   sum   Partial(sum) over the batch axes;
//   mean  each rank's sum over 1/N of the GLOBAL sample count: Partial(sum) too; backward: the
//         local gradient of the sum times 1/N.
// A rank whose batch block is empty skips torch's kernel (which leaves a sum over no rows
// uninitialised): its part is 0.
// A single sample (self [C]) has nothing to shard: everything whole.
template <bool kBackward>
OpPlan per_sample_loss_rule(const OpCall& call) {
  const int64_t self_t = call.tensor_named({"self"}), target_t = call.tensor_named({"target"});
  const int64_t weight_t = call.tensor_named({"weight"}), is_target_t = call.tensor_named({"is_target"});
  const int64_t grad_t = kBackward ? call.tensor_named({"grad_output"}) : -1;
  for (int64_t t : {self_t, target_t, weight_t, is_target_t})
    reject_partial(call, t, "the loss term is not linear in it");
  const Layout& self = call.layout(self_t);
  const std::vector<int64_t> batch = self.ndim() == 2 ? self.dim_axes()[0] : std::vector<int64_t>{};
  const int64_t reduction_arg = call.arg_index("reduction");
  const int64_t reduction = call.arg(reduction_arg).toInt();
  // a tensor whose first dim (if it has one, of self's batch size) follows the batch
  auto batched = [&](const Layout& l) {
    layout::DimAxes dims(static_cast<size_t>(l.ndim()));
    if (!batch.empty() && l.ndim() > 0 && l.global_shape()[0] == self.global_shape()[0]) dims[0] = batch;
    return make_layout(l, l.global_shape(), std::move(dims), {});
  };
  OpPlan plan;
  plan.inputs.resize(call.tensors.size());
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    plan.inputs[t] = static_cast<int64_t>(t) == weight_t ? replicate_like(l, l.global_shape()) : batched(l);
  }
  if (kBackward && reduction != kNone)  // a scalar's gradient: whole
    plan.inputs[grad_t] = replicate_like(call.layout(grad_t), call.layout(grad_t).global_shape());
  // (the backward ops have no meta kernel: their one result is self's gradient)
  const auto shapes = kBackward ? std::vector<std::vector<int64_t>>{self.global_shape()} : meta_output_shapes(call);
  layout::PartialOps summed(static_cast<size_t>(self.mesh()->ndim()));
  for (int64_t a : batch) summed[a] = ReduceOp::Sum;
  for (size_t o = 0; o < shapes.size(); ++o) {
    const bool loss = !kBackward && o == 0 && reduction != kNone;  // a scalar: Partial(sum)
    layout::DimAxes dims(shapes[o].size());
    if (!loss && !batch.empty() && !shapes[o].empty()) dims[0] = batch;
    plan.outputs.push_back(make_layout(self, shapes[o], std::move(dims), loss ? summed : layout::PartialOps{}));
  }
  if (reduction != kNone && !batch.empty()) {
    const double count = static_cast<double>(self.global_shape()[0]);
    const int64_t self_arg = call.tensors[self_t].arg;
    plan.expand = [reduction_arg, reduction, count, self_arg](const OpCall& c, torch::jit::Stack& s) {
      const size_t num = c.schema().arguments().size();
      const at::Tensor local = s[s.size() - num + self_arg].toTensor();
      if (local.size(0) > 0) return sum_then_scale(reduction_arg, reduction, count, c, s);
      // A rank without rows: torch's kernels leave a sum over no rows uninitialised; its part of
      // the loss is 0, its gradient and is_target blocks are empty.
      torch::jit::drop(s, num);
      if (kBackward) {
        s.emplace_back(at::zeros_like(local));
      } else {
        s.emplace_back(at::zeros({}, local.options()));
        if (c.schema().returns().size() > 1) s.emplace_back(at::zeros_like(local));
      }
    };
  }
  return plan;
}

}  // namespace

void register_elementwise_loss(Registry& r) {
  for (const char* op : {"aten::mse_loss", "aten::smooth_l1_loss", "aten::huber_loss", "aten::soft_margin_loss",
                         "aten::binary_cross_entropy", "aten::binary_cross_entropy_with_logits"})
    r.add(op, &elementwise_loss_rule<false>, KeyScalars::kAll);
  for (const char* op : {"aten::mse_loss_backward", "aten::smooth_l1_loss_backward", "aten::huber_loss_backward",
                         "aten::soft_margin_loss_backward", "aten::binary_cross_entropy_backward"})
    r.add(op, &elementwise_loss_rule<true>, KeyScalars::kAll);
  for (const char* op : {"aten::multi_margin_loss", "aten::multilabel_margin_loss_forward"})
    r.add(op, &per_sample_loss_rule<false>, KeyScalars::kAll);
  for (const char* op : {"aten::multi_margin_loss_backward", "aten::multilabel_margin_loss_backward"})
    r.add(op, &per_sample_loss_rule<true>, KeyScalars::kAll);
}

}  // namespace hypershard::ops
