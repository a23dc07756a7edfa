// Identity views, factories and scalar extraction.
//
//   detach, alias, lift_fresh        same layout (a view of the same local)
//   detach_                          same layout, in place (zero_grad(set_to_none=False))
//   *_like (empty/zeros/ones/full), fill.Scalar   the input's sharding; Partial axes become Replicate,
//                                    since a freshly filled tensor is not a sum of parts
//   new_empty/new_zeros/new_ones/new_full/new_empty_strided
//                                    sizes are GLOBAL (as torch DTensor's). A dim of the source's
//                                    rank and extent keeps the source's shard axes there (Partial
//                                    axes become Replicate); every other dim is whole. torch DTensor
//                                    replicates the whole result; we keep the shards because the
//                                    value is a constant (any layout holds it) and what fills it
//                                    is derived from the source, sharded alike: a Replicate result
//                                    makes the fill gather the batch (DeepSeek-V3.2's expand_kv).
//   _local_scalar_dense (item, tolist)     the input is reduced and gathered first, so every
//                                    rank reads the same global value
//   nonzero, masked_select           data-dependent sizes: the inputs gathered (Partial reduced),
//                                    the result Replicate, its global shape the local result's
//                                    (the planned shape is a placeholder, see OpPlan::data_shaped);
//                                    indices are GLOBAL coordinates since the input is whole.
//                                    argwhere and where(cond) decompose to nonzero.
//   _is_all_true, _is_any_true,      likewise gathered, a Replicate result shaped by the computation
//   repeat_interleave.Tensor         (a bool scalar, the repeated indices); masked_scatter_backward
//                                    is in masked.cpp
//   linspace/logspace with tensor     the 0-d bounds read whole (a Partial reduced), the result
//   bounds (Tensor_Tensor, ...)       Replicate: every rank computes the same `steps` values
//   one_hot                          a kernel of its own at the autograd key (its composite kernel
//                                    would scatter DTensor data into a plain zeros tensor): the
//                                    index keeps its sharding, the new class dim is whole;
//                                    num_classes=-1 takes the GLOBAL max (a collective)
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/families.h"
#include "ops/partial.h"
#include "runtime/dtensor_impl.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {
namespace {

OpPlan same_layout_rule(const OpCall& call) {
  OpPlan plan;
  for (const auto& t : call.tensors) plan.inputs.push_back(t.layout);
  plan.outputs.push_back(call.tensors[0].layout);
  return plan;
}

OpPlan like_rule(const OpCall& call) {
  OpPlan plan;
  for (const auto& t : call.tensors) plan.inputs.push_back(t.layout);
  plan.outputs.push_back(without_partial(call.layout(0)));
  return plan;
}

std::vector<int64_t> size_arg(const OpCall& call, const char* name) { return int_list(call.arg(call.arg_index(name))); }

// Rewrites the `size` argument (and `stride`, when present) to this rank's local shape.
void localize_size(const OpCall& call, c10::IValue* args, const LayoutPtr& out) {
  const auto local = out->local_shape_at(call.mesh->position());
  args[call.arg_index("size")] = c10::IValue(local);
  const auto stride_index = call.schema().argumentIndexWithName("stride");
  if (stride_index) {
    std::vector<int64_t> strides(local.size(), 1);
    for (int64_t i = static_cast<int64_t>(local.size()) - 2; i >= 0; --i)
      strides[i] = strides[i + 1] * std::max<int64_t>(local[i + 1], 1);
    args[*stride_index] = c10::IValue(strides);
  }
}

// The source's shard axes on each dim of the same extent (same rank only: dims are matched by
// position), nothing elsewhere; no Partial (a fresh fill is not a sum of parts). The source's own
// shape (autograd allocating a gradient buffer) keeps its whole sharding.
OpPlan new_sized_rule(const OpCall& call) {
  const auto size = size_arg(call, "size");
  const Layout& self = call.layout(0);
  OpPlan plan;
  plan.inputs.push_back(call.tensors[0].layout);
  layout::DimAxes dims(size.size());
  if (static_cast<int64_t>(size.size()) == self.ndim())
    for (size_t d = 0; d < size.size(); ++d)
      if (size[d] == self.global_shape()[d]) dims[d] = self.dim_axes()[d];
  auto out = make_layout(self, size, std::move(dims));
  plan.outputs.push_back(out);
  plan.localize = [out](const OpCall& c, c10::IValue* args) { localize_size(c, args, out); };
  return plan;
}

OpPlan gather_scalar_rule(const OpCall& call) {
  OpPlan plan;
  plan.inputs.push_back(replicate_like(call.layout(0), call.layout(0).global_shape()));
  return plan;
}

at::Tensor one_hot_kernel(const at::Tensor& self, int64_t num_classes) {
  auto& impl = runtime::checked_dtensor(self, "one_hot");
  const Layout& in = *impl.layout();
  const auto& mesh = *impl.device_mesh();
  TORCH_CHECK(!in.has_partial(), "hypershard: aten::one_hot: argument self (#0) ", in.to_string(),
              ": a Partial index has no meaning; allowed: Replicate or Shard");
  const at::Tensor& local = impl.local();
  if (num_classes == -1) {
    // The GLOBAL max: local max (of a possibly empty shard), then max over the sharding axes.
    auto top = local.numel() > 0 ? local.max().reshape({1}) : at::full({1}, -1, local.options());
    for (int64_t axis = 0; axis < mesh.mesh()->ndim(); ++axis)
      if (in.is_sharded(axis)) top = runtime::all_reduce_along(top, mesh, axis, ReduceOp::Max);
    num_classes = top.item<int64_t>() + 1;
  }
  at::Tensor out_local;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out_local = at::one_hot(local, num_classes);
  }
  auto shape = in.global_shape();
  shape.push_back(num_classes);
  auto dims = in.dim_axes();
  dims.emplace_back();
  return runtime::make_dtensor(std::move(out_local), make_layout(in, shape, dims), impl.device_mesh());
}

// Every tensor argument whole (shards gathered, Partial reduced), one Replicate result whose
// shape only the computation tells (`placeholder` until then).
OpPlan gathered_data_shaped_rule(const OpCall& call) {
  OpPlan plan;
  for (const auto& t : call.tensors) plan.inputs.push_back(replicate_like(*t.layout, t.layout->global_shape()));
  plan.outputs.push_back(replicate_like(call.layout(0), {0}));  // any shape: the dispatch replaces it
  plan.data_shaped = true;
  return plan;
}

// linspace/logspace(start, end, steps, ...) with tensor bounds: the bounds whole, a Replicate
// result of `steps` values.
OpPlan spaced_values_rule(const OpCall& call) {
  OpPlan plan;
  for (const auto& t : call.tensors) plan.inputs.push_back(replicate_like(*t.layout, t.layout->global_shape()));
  plan.outputs.push_back(replicate_like(call.layout(0), {call.arg(call.arg_index("steps")).toInt()}));
  return plan;
}

}  // namespace

void register_one_hot_kernel() { aten_autograd_kernels().impl("one_hot", TORCH_FN(one_hot_kernel)); }

void register_tensor_ops(Registry& r) {
  r.kernels(&register_one_hot_kernel);
  // _conj and _neg_view are lazy views (a bit on the tensor), linear: Partial passes through
  for (const char* op : {"aten::alias", "aten::alias_copy", "aten::detach", "aten::detach_", "aten::lift_fresh",
                         "aten::_conj", "aten::_neg_view"})
    r.add(op, &same_layout_rule, KeyScalars::kNone);
  // Random *_like ops are not here: they need the random-op rules (same draw on every replica).
  // fill.Scalar: a fresh tensor of self's layout filled with one value, as full_like
  for (const char* op :
       {"aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::fill.Scalar"})
    r.add(op, &like_rule, KeyScalars::kNone);
  for (const char* op :
       {"aten::new_empty_strided", "aten::new_empty", "aten::new_zeros", "aten::new_ones", "aten::new_full"})
    r.add(op, &new_sized_rule, KeyScalars::kAll);
  r.add("aten::_local_scalar_dense", &gather_scalar_rule, KeyScalars::kNone);
  r.add("aten::masked_select", &gathered_data_shaped_rule, KeyScalars::kNone);
  // Whole inputs, a Replicate result shaped by the computation too: the all/any checks HF's
  // torch_compilable_check runs, repeat_interleave's counts.
  r.add("aten::_is_all_true", &gathered_data_shaped_rule, KeyScalars::kNone);
  r.add("aten::_is_any_true", &gathered_data_shaped_rule, KeyScalars::kNone);
  r.add("aten::repeat_interleave.Tensor", &gathered_data_shaped_rule, KeyScalars::kNone);
  r.add("aten::nonzero", &gathered_data_shaped_rule, KeyScalars::kNone);
  for (const char* op :
       {"aten::linspace.Tensor_Tensor", "aten::linspace.Tensor_Scalar", "aten::linspace.Scalar_Tensor",
        "aten::logspace.Tensor_Tensor", "aten::logspace.Tensor_Scalar", "aten::logspace.Scalar_Tensor"})
    r.add(op, &spaced_values_rule, KeyScalars::kAll);  // steps: the result's shape
}

}  // namespace hypershard::ops
