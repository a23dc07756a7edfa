// Softmax and losses as LLM training reaches them: what F.softmax / F.log_softmax /
// F.nll_loss / F.cross_entropy decompose to (traced in torch 2.13), forward and backward.
//
//   aten::_softmax, _log_softmax                               (softmax: dim = the softmax dim)
//   aten::_softmax_backward_data, _log_softmax_backward_data    (the same, grad + output)
//   aten::nll_loss_forward, nll_loss_backward                   (self [N, C] or [C]; class dim 1 or 0)
//   aten::nll_loss2d_forward, nll_loss2d_backward               (self [N, C, H, W]: 3-D and >4-D
//                                                               inputs reach these after a view)
//   cross_entropy_loss                                          a kernel of its own at the autograd
//                                                               key, only for label_smoothing > 0
//
// Softmax: every dim keeps its mesh axes. A sharded softmax dim (the vocabulary case, on any
// number of mesh axes) is never gathered: the expand implementation all-reduces the row max
// (max) and the row sum of exp(x - max) (sum) along the axes sharding that dim, then finishes
// locally; the output keeps the input's sharding. The backward ops all-reduce their one row
// sum (sum(grad) for log_softmax, sum(grad * output) for softmax) the same way. A rank whose
// shard of the softmax dim is empty contributes -inf / 0.
//
// nll_loss (the class dim of self is the vocabulary dim V; the other dims, the "rows", are the
// batch/sequence dims and match target's dims one to one). Layouts: self as it is, or with its
// rows chunked like target (the cheaper); target sharded like self's rows and whole on the
// class axes; weight sharded like the class dim (a Replicate weight is chunked locally).
//   rows sharded      local ATen call on the shard. none: the per-row loss keeps the rows'
//                     sharding. sum: local sum -> Partial(sum); total_weight Partial(sum) too
//                     (exact; backward does not read it). mean: one all-reduce of the packed
//                     (local weighted sum, local total weight) -> the GLOBAL mean divided by the
//                     GLOBAL total weight (the count of non-ignored targets without weight),
//                     both Replicate. Backward: a local call that scales by that global total.
//   class sharded     vocab-parallel: nothing is gathered. The expand maps targets to this
//   (vocab-parallel)  rank's vocab range (global_offset_at) and marks the others ignored
//                     (ignore_index -1, never a local class), so the local ATen call picks the
//                     target log-prob (times its weight) only on the rank that owns the class;
//                     then none: the picked values are all-reduced along the class axes (the
//                     per-row loss is Replicate there); sum: Partial(sum) over class and row
//                     axes; mean: the packed all-reduce above over both. Backward: the same
//                     local mapping; the rows of other ranks' classes get zero.
// Where the collectives are: inside _log_softmax (max, sum-exp), _log_softmax_backward_data
// (sum of grad), nll_loss_forward (none: picked values; mean: sum + total weight); none in
// nll_loss_backward. A sum loss stays Partial(sum) until something needs its value.
//
// cross_entropy with label_smoothing > 0: torch's composite would hit masked_fill_ on the
// class-axis sum (a Partial(sum)), divide by a Partial(sum) count, and, with weight and mean,
// call masked_select (data-dependent shape). hypershard's kernel computes the same formula
//   (1 - ls) * nll + ls / C * sum_c(-w_c logp_c) (masked where ignored, reduced like nll,
//   mean divided by nll's GLOBAL total weight)
// with ops whose rules are exact on class-sharded log-probs (sum over the class dim gives a
// Partial(sum); where() with 0 keeps it), and gives the result nll's layout (one all-reduce
// of the per-row or scalar smoothing term). Other cross_entropy calls run torch's composite.
//
// Partial: a Partial self / input / output / target / weight is an error naming the argument
// (a softmax or a picked log-prob of a sum is not the sum of the parts'). The backward ops are
// linear in grad_output: a Partial(sum|avg) grad_output is kept on the mesh axes the result is
// not sharded on (the softmax backward ops then take grad's sharding; nll_loss_backward, whose
// result follows self, raises when every choice of sharding uses a Partial axis: each shard
// needs the whole gradient); a max/min/prod Partial grad is reduced first (exact).
// Excluded: _softmax/_log_softmax out= variants, multi_margin/binary losses (not reached by the
// target models); a target out of [0, C) raises torch's "Target t is out of bounds." only on
// the ranks whose shard holds it (a data-dependent check).
#include <ATen/ATen.h>
#include <ATen/ops/cross_entropy_loss_compositeimplicitautograd_dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "ops/expand_helpers.h"
#include "ops/families.h"
#include "ops/partial.h"
#include "ops/sharding_search.h"
#include "runtime/dtensor_impl.h"
#include "runtime/redistribute.h"
#include "runtime/traced_collectives.h"

namespace hypershard::ops {
namespace {

using Stack = torch::jit::Stack;

constexpr int64_t kNone = 0, kMean = 1, kSum = 2;  // at::Reduction

bool uses_axis(const layout::DimAxes& dims, int64_t axis) {
  for (const auto& d : dims)
    if (std::find(d.begin(), d.end(), axis) != d.end()) return true;
  return false;
}

bool is_low_precision(const at::Tensor& t) { return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16; }

// Grad Partial axes a backward op keeps (sum/avg, on axes the result is not sharded on); a
// sum/avg Partial on a sharding axis is an error; max/min/prod Partials are dropped (reduced).
layout::PartialOps kept_grad_partial(const OpCall& call, int64_t grad, const layout::DimAxes& dims, bool* conflict) {
  const Layout& g = call.layout(grad);
  layout::PartialOps kept(g.partial().size());
  for (size_t a = 0; a < kept.size(); ++a) {
    const auto& op = g.partial()[a];
    if (!op || !is_sum_like(*op)) continue;
    if (uses_axis(dims, static_cast<int64_t>(a))) {
      if (conflict) *conflict = true;
      continue;
    }
    kept[a] = op;
  }
  return kept;
}

// ------------------------------------------------------------------ softmax, log_softmax

// Local softmax over `dim` with its row max and row sum all-reduced along `axes`.
template <bool kLog>
void softmax_expand(const std::vector<int64_t>& axes, const OpCall& call, Stack& stack) {
  const at::Tensor x = call.arg(0).toTensor();
  const int64_t dim = call.arg(1).toInt() < 0 ? call.arg(1).toInt() + x.dim() : call.arg(1).toInt();
  const auto out_dtype = call.arg(2).toBool() ? at::kFloat : x.scalar_type();
  const at::Tensor xf = is_low_precision(x) ? x.to(at::kFloat) : x;
  at::Tensor max;
  if (xf.size(dim) > 0) {
    max = xf.amax(dim, true);
  } else {  // an empty shard of the softmax dim
    auto shape = xf.sizes().vec();
    shape[dim] = 1;
    max = at::full(shape, -INFINITY, xf.options());
  }
  max = all_reduce_axes(max, call, axes, ReduceOp::Max);
  // In place where possible: the logits are the largest tensor of a training step.
  auto out = xf - max;
  if (kLog) {
    out.sub_(all_reduce_axes(out.exp().sum(dim, true), call, axes, ReduceOp::Sum).log_());
  } else {
    out.exp_();
    out.div_(all_reduce_axes(out.sum(dim, true), call, axes, ReduceOp::Sum));
  }
  replace_args(call, stack, {out.to(out_dtype)});
}

template <bool kLog>
OpPlan softmax_rule(const OpCall& call) {
  reject_partial(call, 0, "a softmax of a sum is not the sum of the parts' softmaxes");
  const Layout& in = call.layout(0);
  const int64_t dim = wrap_dim(call, call.arg(1).toInt(), in.ndim());
  OpPlan plan;
  plan.inputs.push_back(call.tensors[0].layout);
  plan.outputs.push_back(make_layout(in, in.global_shape(), in.dim_axes()));
  if (in.ndim() > 0 && !in.dim_axes()[dim].empty()) {
    const auto axes = in.dim_axes()[dim];
    plan.expand = [axes](const OpCall& c, Stack& s) { softmax_expand<kLog>(axes, c, s); };
  }
  return plan;
}

// grad_input = grad - exp(out) * sum(grad)  (log_softmax)  |  out * (grad - sum(grad * out)).
template <bool kLog>
void softmax_backward_expand(const std::vector<int64_t>& axes, const OpCall& call, Stack& stack) {
  at::Tensor grad = call.arg(0).toTensor(), out = call.arg(1).toTensor();
  const int64_t dim = call.arg(2).toInt() < 0 ? call.arg(2).toInt() + grad.dim() : call.arg(2).toInt();
  const auto input_dtype = static_cast<c10::ScalarType>(call.arg(3).toInt());
  if (is_low_precision(grad) || is_low_precision(out)) {
    grad = grad.to(at::kFloat);
    out = out.to(at::kFloat);
  }
  const auto sum = all_reduce_axes((kLog ? grad : grad * out).sum(dim, true), call, axes, ReduceOp::Sum);
  at::Tensor result;
  if (kLog) {
    result = out.exp();
    result.mul_(sum.neg()).add_(grad);
  } else {
    result = grad - sum;
    result.mul_(out);
  }
  replace_args(call, stack, {result.to(input_dtype)});
}

// Candidates for the common sharding: grad's or output's (the cheaper to reach). grad's
// sum/avg Partial is kept where the candidate does not shard (the op is linear in grad).
template <bool kLog>
OpPlan softmax_backward_rule(const OpCall& call) {
  const int64_t g = call.tensor_index(0), o = call.tensor_index(1);
  if (g < 0 || o < 0) fail_call(call, "internal error: grad_output and output must be tensors");
  reject_partial(call, o, "the output of a softmax is never a Partial");
  const Layout& gl = call.layout(g);
  const Layout& ol = call.layout(o);
  if (gl.global_shape() != ol.global_shape())
    fail_argument(call, g,
                  "shape " + layout::shape_string(gl.global_shape()) + " differs from output's " +
                      layout::shape_string(ol.global_shape()),
                  "grad_output of the output's shape");
  const int64_t dim = wrap_dim(call, call.arg(2).toInt(), ol.ndim());
  struct Scored {
    OpPlan plan;
    std::vector<int64_t> axes;  // the axes sharding the softmax dim
    SearchScore score;
  };
  const Layout* sources[] = {&gl, &ol};
  auto best = search_candidates(2, [&](size_t i) -> std::optional<Scored> {
    layout::DimAxes dims = sources[i]->dim_axes();
    bool conflict = false;
    auto partial = kept_grad_partial(call, g, dims, &conflict);
    if (conflict) return std::nullopt;  // grad's own sharding never conflicts: the first candidate stays
    Scored s;
    auto grad_in = make_layout(gl, gl.global_shape(), dims, partial);
    auto out_in = make_layout(ol, ol.global_shape(), dims);
    s.score.add_input(call.tensors[g].layout, grad_in);
    s.score.add_input(call.tensors[o].layout, out_in);
    s.plan.inputs.resize(call.tensors.size());
    s.plan.inputs[g] = grad_in;
    s.plan.inputs[o] = out_in;
    s.plan.outputs.push_back(grad_in);
    if (ol.ndim() > 0) s.axes = dims[dim];
    return s;
  });
  if (!best) fail_call(call, "internal error: no layout for the softmax backward");  // grad's never conflicts
  if (!best->axes.empty())
    best->plan.expand = [axes = best->axes](const OpCall& c, Stack& s) { softmax_backward_expand<kLog>(axes, c, s); };
  return std::move(best->plan);
}

// ------------------------------------------------------------------ nll_loss, nll_loss2d

struct Nll {
  LayoutPtr self;  // self's layout for the local call
  int64_t class_dim = 1;
  int64_t reduction = kMean;
  std::vector<int64_t> class_axes;  // the axes sharding the class dim (vocab-parallel)
  std::vector<int64_t> row_axes;    // the axes sharding the other dims
};

// Schema positions: forward (self, target, weight, reduction, ignore_index); backward
// (grad_output, self, target, weight, reduction, ignore_index, total_weight).
struct NllArgs {
  int64_t first = 0;                                                          // 1 for the backward ops
  int64_t self = -1, target = -1, weight = -1, grad = -1, total_weight = -1;  // tensor indices
};

NllArgs nll_args(const OpCall& call, bool backward) {
  NllArgs a;
  a.first = backward ? 1 : 0;
  a.self = call.tensor_index(a.first);
  a.target = call.tensor_index(a.first + 1);
  a.weight = call.tensor_index(a.first + 2);
  if (backward) {
    a.grad = call.tensor_index(0);
    a.total_weight = call.tensor_index(6);
  }
  if (a.self < 0 || a.target < 0 || (backward && (a.grad < 0 || a.total_weight < 0)))
    fail_call(call, "internal error: a tensor argument is missing");
  return a;
}

// self's dim d <-> target's dim (self without the class dim).
int64_t row_dim(int64_t d, int64_t class_dim) { return d < class_dim ? d : d - 1; }

// The shape checks of the op, on GLOBAL shapes (shards may match where the globals do not).
void check_nll_shapes(const OpCall& call, const NllArgs& a, bool two_d) {
  const auto& self = call.layout(a.self).global_shape();
  const auto& target = call.layout(a.target).global_shape();
  const int64_t ndim = static_cast<int64_t>(self.size());
  if (two_d ? ndim != 4 : (ndim < 1 || ndim > 2))
    fail_argument(call, a.self, layout::str_cat("has ", ndim, " dims"), two_d ? "4 dims" : "1 or 2 dims");
  const int64_t class_dim = ndim == 1 ? 0 : 1;
  std::vector<int64_t> rows;
  for (int64_t d = 0; d < ndim; ++d)
    if (d != class_dim) rows.push_back(self[d]);
  if (target != rows)
    fail_argument(call, a.target, "shape does not match input " + layout::shape_string(self),
                  "target of shape " + layout::shape_string(rows));
  if (a.weight >= 0 &&
      (call.layout(a.weight).ndim() != 1 || call.layout(a.weight).global_shape()[0] != self[class_dim]))
    fail_argument(call, a.weight, "is not defined for all classes",
                  layout::str_cat("a 1-d weight of ", self[class_dim], " elements"));
}

// The sharding of self for the local call: self's own, or its rows sharded like target (class
// axes that target uses are dropped).
layout::DimAxes nll_self_dims(const Layout& self, const Layout& target, int64_t class_dim, bool from_target) {
  if (!from_target) return self.dim_axes();
  layout::DimAxes dims(self.ndim());
  for (int64_t d = 0; d < self.ndim(); ++d)
    if (d != class_dim) dims[d] = target.dim_axes()[row_dim(d, class_dim)];
  for (int64_t axis : self.dim_axes()[class_dim])
    if (!uses_axis(dims, axis)) dims[class_dim].push_back(axis);
  return dims;
}

// Targets in this rank's vocab range -> local class ids; every other target (and the ignored
// ones) -> -1, passed as the ignore_index (never a local class).
at::Tensor local_targets(const Nll& n, const OpCall& call, const at::Tensor& self, const at::Tensor& target,
                         int64_t ignore) {
  const int64_t n_classes = n.self->global_shape()[n.class_dim];
  // Byte targets widen (-1 must be representable); other dtypes stay, so the local kernel
  // raises torch's own dtype error.
  const auto t = target.scalar_type() == at::kByte ? target.to(at::kLong) : target;
  const auto used = t.ne(ignore);
  const auto bad = used.logical_and(t.lt(0).logical_or(t.ge(n_classes)));
  // No host sync on accelerators, nor while tracing (no values): a device-side assert, as
  // torch's kernels.
  if (!t.is_cpu() || runtime::tracing()) {
    at::_assert_async(bad.any().logical_not(), "hypershard: nll_loss: a target is out of bounds");
  } else if (bad.any().item<bool>()) {
    TORCH_CHECK_INDEX(false, "Target ", t.masked_select(bad)[0].item<int64_t>(), " is out of bounds.");
  }
  const int64_t offset = n.self->global_offset_at(call.mesh->position())[n.class_dim];
  const int64_t local = self.dim() == 0 ? 0 : self.size(n.class_dim);
  const auto mine = used.logical_and(t.ge(offset)).logical_and(t.lt(offset + local));
  return at::where(mine, t - offset, at::scalar_tensor(-1, t.options()));
}

template <bool k2d>
void nll_forward_expand(const Nll& n, const OpCall& call, Stack& stack) {
  const at::Tensor self = call.arg(0).toTensor();
  at::Tensor target = call.arg(1).toTensor();
  const auto& w = call.arg(2);
  const std::optional<at::Tensor> weight = w.isNone() ? std::nullopt : std::optional<at::Tensor>(w.toTensor());
  int64_t ignore = int_arg(call.arg(4));
  if (!n.class_axes.empty()) {
    target = local_targets(n, call, self, target, ignore);
    ignore = -1;
  }
  const int64_t local_reduction = n.reduction == kMean ? kSum : n.reduction;
  auto [out, total] = k2d ? at::nll_loss2d_forward(self, target, weight, local_reduction, ignore)
                          : at::nll_loss_forward(self, target, weight, local_reduction, ignore);
  // Half types are reduced in float32 (as torch's CPU kernels accumulate them).
  const auto wide = is_low_precision(out) ? at::kFloat : out.scalar_type();
  if (n.reduction == kNone && !n.class_axes.empty()) {
    out = all_reduce_axes(out.to(wide), call, n.class_axes, ReduceOp::Sum).to(out.scalar_type());
  } else if (n.reduction == kMean) {
    auto axes = n.class_axes;
    axes.insert(axes.end(), n.row_axes.begin(), n.row_axes.end());
    const auto packed = all_reduce_axes(at::stack({out.to(wide), total.to(wide)}), call, axes, ReduceOp::Sum);
    total = packed[1].to(total.scalar_type());
    out = (packed[0] / packed[1]).to(out.scalar_type());
  }
  replace_args(call, stack, {out, total});
}

template <bool k2d>
void nll_backward_expand(const Nll& n, const OpCall& call, Stack& stack) {
  const at::Tensor grad = call.arg(0).toTensor(), self = call.arg(1).toTensor();
  const auto& w = call.arg(3);
  const std::optional<at::Tensor> weight = w.isNone() ? std::nullopt : std::optional<at::Tensor>(w.toTensor());
  const auto target = local_targets(n, call, self, call.arg(2).toTensor(), int_arg(call.arg(5)));
  const at::Tensor total = call.arg(6).toTensor();
  auto out = k2d ? at::nll_loss2d_backward(grad, self, target, weight, n.reduction, -1, total)
                 : at::nll_loss_backward(grad, self, target, weight, n.reduction, -1, total);
  replace_args(call, stack, {out});
}

// The layouts of one nll call given the sharding of self (see the header).
struct NllLayouts {
  layout::DimAxes self_dims, row_dims;
  std::vector<int64_t> class_axes, row_axes;
};

NllLayouts nll_layouts(layout::DimAxes self_dims, int64_t class_dim) {
  NllLayouts l;
  l.class_axes = self_dims[class_dim];
  for (int64_t d = 0; d < static_cast<int64_t>(self_dims.size()); ++d) {
    if (d == class_dim) continue;
    l.row_dims.push_back(self_dims[d]);
    l.row_axes.insert(l.row_axes.end(), self_dims[d].begin(), self_dims[d].end());
  }
  l.self_dims = std::move(self_dims);
  return l;
}

template <bool k2d, bool kBackward>
OpPlan nll_rule(const OpCall& call) {
  const NllArgs a = nll_args(call, kBackward);
  reject_partial(call, a.self, "log-probabilities of a sum are not the sum of the parts'");
  reject_partial(call, a.target, "a class index has no sum");
  reject_partial(call, a.weight, "class weights must be whole values");
  check_nll_shapes(call, a, k2d);
  const Layout& self = call.layout(a.self);
  const Layout& target = call.layout(a.target);
  const int64_t class_dim = self.ndim() == 1 ? 0 : 1;
  const int64_t reduction = call.arg(a.first + 3).toInt();
  if (reduction < kNone || reduction > kSum) fail_call(call, layout::str_cat("invalid reduction ", reduction));
  const int64_t mesh_ndim = self.mesh()->ndim();
  const auto& row_shape = target.global_shape();

  struct Scored {
    OpPlan plan;
    Nll nll;
    SearchScore score;
  };
  // Candidates: self as it is, then self's rows chunked like target.
  auto best = search_candidates(2, [&](size_t from_target) -> std::optional<Scored> {
    const NllLayouts l = nll_layouts(nll_self_dims(self, target, class_dim, from_target != 0), class_dim);
    Scored s;
    OpPlan& plan = s.plan;
    plan.inputs.resize(call.tensors.size());
    plan.inputs[a.self] = make_layout(self, self.global_shape(), l.self_dims);
    plan.inputs[a.target] = make_layout(target, row_shape, l.row_dims);
    if (a.weight >= 0) {
      const Layout& w = call.layout(a.weight);
      plan.inputs[a.weight] = make_layout(w, w.global_shape(), {l.class_axes});
    }
    layout::PartialOps all_sum(mesh_ndim);  // sum: Partial over every sharding axis
    for (int64_t axis : l.class_axes) all_sum[axis] = ReduceOp::Sum;
    for (int64_t axis : l.row_axes) all_sum[axis] = ReduceOp::Sum;
    if (!kBackward) {
      plan.outputs.push_back(reduction == kNone  ? make_layout(self, row_shape, l.row_dims)
                             : reduction == kSum ? make_layout(self, {}, {}, all_sum)
                                                 : replicate_like(self, {}));
      plan.outputs.push_back(reduction == kSum ? make_layout(self, {}, {}, all_sum) : replicate_like(self, {}));
    } else {
      const Layout& g = call.layout(a.grad);
      bool conflict = false;
      const auto kept = kept_grad_partial(call, a.grad, l.self_dims, &conflict);
      if (conflict) return std::nullopt;
      const bool none = reduction == kNone;
      if (!none && g.ndim() != 0) fail_argument(call, a.grad, "is not a scalar", "a 0-d grad_output");
      if (none && g.global_shape() != row_shape)
        fail_argument(call, a.grad, "shape differs from target's",
                      "grad_output of shape " + layout::shape_string(row_shape));
      plan.inputs[a.grad] = make_layout(g, g.global_shape(), none ? l.row_dims : layout::DimAxes{}, kept);
      // total_weight: read only by mean, which needs the GLOBAL total (Replicate).
      const auto& tw = call.tensors[a.total_weight].layout;
      if (reduction == kMean && tw->has_partial() && is_sum_like(*tw->partial_op()))
        fail_argument(call, a.total_weight, partial_name(*tw) + " total weight with reduction mean",
                      "the Replicate total weight nll_loss_forward returns");
      plan.inputs[a.total_weight] = reduction == kMean ? replicate_like(*tw, tw->global_shape()) : tw;
      plan.outputs.push_back(make_layout(self, self.global_shape(), l.self_dims, kept));
    }
    for (size_t t = 0; t < call.tensors.size(); ++t) s.score.add_input(call.tensors[t].layout, plan.inputs[t]);
    s.nll = Nll{plan.inputs[a.self], class_dim, reduction, l.class_axes, l.row_axes};
    return s;
  });
  if (!best)
    fail_argument(call, a.grad,
                  partial_name(call.layout(a.grad)) +
                      " on a mesh axis that shards self (every shard "
                      "needs the whole gradient)",
                  "Partial only on mesh axes that shard no dim of self");
  Nll& best_nll = best->nll;
  // Axes of one rank split nothing: no collective, no target mapping (offset 0) along them.
  auto split_axes = [&](std::vector<int64_t>& axes) {
    axes.erase(std::remove_if(axes.begin(), axes.end(), [&](int64_t a) { return self.mesh()->axis_size(a) == 1; }),
               axes.end());
  };
  split_axes(best_nll.class_axes);
  split_axes(best_nll.row_axes);
  const bool vocab = !best_nll.class_axes.empty();
  if (!kBackward && (vocab || (reduction == kMean && !best_nll.row_axes.empty())))
    best->plan.expand = [n = best_nll](const OpCall& c, Stack& s) { nll_forward_expand<k2d>(n, c, s); };
  if (kBackward && vocab)
    best->plan.expand = [n = best_nll](const OpCall& c, Stack& s) { nll_backward_expand<k2d>(n, c, s); };
  return std::move(best->plan);
}

// ------------------------------------------------------------------ cross_entropy, label smoothing

// at::nll_loss_nd with both outputs: mean's total weight is the GLOBAL one (see nll_rule).
std::tuple<at::Tensor, at::Tensor> nll_nd(const at::Tensor& input, const at::Tensor& target,
                                          const std::optional<at::Tensor>& weight, int64_t reduction,
                                          const c10::SymInt& ignore_index) {
  TORCH_CHECK_VALUE(input.dim() >= 1, "Expected 1 or more dimensions (got ", input.dim(), ")");
  TORCH_CHECK_VALUE(input.dim() == 1 || input.sym_size(0) == target.sym_size(0), "Expected input batch_size (",
                    input.sym_size(0), ") to match target batch_size (", target.sym_size(0), ").");
  if (input.dim() <= 2) return at::nll_loss_forward_symint(input, target, weight, reduction, ignore_index);
  if (input.dim() == 4) return at::nll_loss2d_forward_symint(input, target, weight, reduction, ignore_index);
  const auto n = input.sym_size(0), c = input.sym_size(1);
  auto out_size = input.sym_sizes().slice(2).vec();
  out_size.insert(out_size.begin(), n);
  TORCH_CHECK(target.sym_sizes().slice(1) == input.sym_sizes().slice(2), "Expected target size ",
              c10::SymIntArrayRef(out_size), ", got ", target.sym_sizes());
  const bool empty = input.sym_numel() == 0;
  const auto in = input.contiguous().view_symint(empty ? std::vector<c10::SymInt>{n, c, 0, 0}
                                                       : std::vector<c10::SymInt>{n, c, 1, -1});
  const auto tg = target.contiguous().view_symint(target.sym_numel() == 0 ? std::vector<c10::SymInt>{n, 0, 0}
                                                                          : std::vector<c10::SymInt>{n, 1, -1});
  auto [out, total] = at::nll_loss2d_forward_symint(in, tg, weight, reduction, ignore_index);
  if (reduction == kNone) out = out.view_symint(out_size);
  return {out, total};
}

at::Tensor cross_entropy_kernel(const at::Tensor& self, const at::Tensor& target,
                                const std::optional<at::Tensor>& weight, int64_t reduction, c10::SymInt ignore_index,
                                double label_smoothing) {
  if (label_smoothing <= 0.0 || self.sym_sizes() == target.sym_sizes())  // no smoothing, or class probabilities
    return at::compositeimplicitautograd::cross_entropy_loss_symint(self, target, weight, reduction,
                                                                    std::move(ignore_index), label_smoothing);
  TORCH_CHECK(label_smoothing <= 1.0, "label_smoothing must be between 0.0 and 1.0. Got: ", label_smoothing);
  const int64_t class_dim = self.dim() == 1 ? 0 : 1;
  const auto input = at::log_softmax(self, class_dim, self.scalar_type());
  auto [nll, total_weight] = nll_nd(input, target, weight, reduction, ignore_index);
  const int64_t n_classes = input.size(class_dim);
  at::Tensor smooth;  // a Partial(sum) over the class axes when the class dim is sharded
  if (weight && weight->defined()) {
    std::vector<int64_t> shape(input.dim(), 1);
    shape[class_dim] = weight->size(0);
    smooth = -(input * weight->view(shape)).sum(class_dim);
  } else {
    smooth = -input.sum(class_dim);
  }
  // masked_fill_(ignored, 0) as where(): filling a sum-Partial with zeros keeps it exact.
  smooth = at::where(target.ne(ignore_index.expect_int()), smooth, at::scalar_tensor(0.0, smooth.options()));
  at::Tensor ret = reduction == kNone ? smooth : reduction == kSum ? smooth.sum() : smooth.sum() / total_weight;
  auto out = nll * (1 - label_smoothing) + ret * (label_smoothing / static_cast<double>(n_classes));
  // The result takes nll's layout (reduces the smoothing term's class-axis Partial).
  auto* nll_impl = runtime::dtensor_impl(nll);
  auto* out_impl = runtime::dtensor_impl(out);
  if (nll_impl && out_impl && nll_impl->layout() != out_impl->layout())
    out = runtime::redistribute(out, nll_impl->layout());
  return out;
}

}  // namespace

void register_cross_entropy_kernel() {
  aten_autograd_kernels().impl("cross_entropy_loss", TORCH_FN(cross_entropy_kernel));
}

void register_loss(Registry& r) {
  r.kernels(&register_cross_entropy_kernel);
  r.add("aten::_log_softmax", &softmax_rule<true>, KeyScalars::kAll);
  r.add("aten::_log_softmax_backward_data", &softmax_backward_rule<true>, KeyScalars::kAll);
  r.add("aten::_softmax", &softmax_rule<false>, KeyScalars::kAll);
  r.add("aten::_softmax_backward_data", &softmax_backward_rule<false>, KeyScalars::kAll);
  r.add("aten::nll_loss2d_backward", &nll_rule<true, true>, KeyScalars::kAll);
  r.add("aten::nll_loss2d_forward", &nll_rule<true, false>, KeyScalars::kAll);
  r.add("aten::nll_loss_backward", &nll_rule<false, true>, KeyScalars::kAll);
  r.add("aten::nll_loss_forward", &nll_rule<false, false>, KeyScalars::kAll);
}

}  // namespace hypershard::ops
