// Scaled dot-product attention as it lowers on CPU.
//
//   aten::_scaled_dot_product_flash_attention_for_cpu
//       query "bhLE", key "bhSE", value "bhSF", attn_mask (broadcast to "bhLS")
//       -> output "bhLF", logsumexp "bhL"
//   aten::_scaled_dot_product_flash_attention_for_cpu_backward
//       grad_out "bhLF", query, key, value, out, logsumexp, attn_mask
//       -> grad_query "bhLE", grad_key "bhSE", grad_value "bhSF"
// F.scaled_dot_product_attention picks this kernel on CPU for 4-D fp32/bf16/fp16 inputs
// without dropout, with is_causal, an attn_mask (a bool mask is first turned into an additive
// one by where.self) or enable_gqa (key/value with fewer heads). With dropout it takes the
// composite math path: mul, bmm (matmul family), _safe_softmax (normalization family),
// empty_like + bernoulli_ (random family). HF's "eager" attention is matmul + _softmax +
// dropout; HF's "sdpa" attention uses enable_gqa without a mask and repeat_kv (unsqueeze,
// expand, reshape: views family) with one.
//
// Sharding (sharding_search.h), per mesh axis: the batch dim (b) or the heads dim (h) of query,
// key, value, mask, output and logsumexp alike; everything whole otherwise. A mask dim of size 1
// broadcasts and stays whole. The sequence dims (L, S) and the head dims (E, F) must be whole:
// an input sharded there is an error (attention over a sharded sequence needs ring or
// all-to-all attention, which is not a local rule). With grouped heads (key/value with Hkv <
// Hq heads, query head i reading key/value head i / (Hq / Hkv)) the heads shard alike when Hkv
// divides evenly over the sharding axes. With more head shards than that (tensor parallelism
// wider than the KV heads), key and value stay whole on the heads and each rank reads the KV
// heads its query heads need (replicated_kv); their gradients are then Partial(sum).
//
// Partial algebra: attention is not linear in query, key or value: a sum/avg Partial input is
// an error (max/min Partials are reduced first). The backward is linear in grad_out: a sum/avg
// Partial grad_out carries into every gradient.
//
// Excluded: the CUDA/NPU attention kernels (_scaled_dot_product_flash_attention,
// _efficient_attention, npu_fusion_attention: same factors, no CPU test), context parallelism
// (sharded sequence).
#include <ATen/ATen.h>

#include <optional>
#include <utility>

#include "ops/families.h"
#include "ops/partial.h"
#include "ops/sharding_search.h"

namespace hypershard::ops {
namespace {


constexpr char kBatch = 'b';
constexpr char kHeads = 'h';
constexpr const char* kWholeLabels = "LSEF";

struct Attention {
  int64_t query = -1, key = -1, value = -1, mask = -1;
  std::string mask_labels;
};

// Binds the four attention tensors by argument name and checks what must hold before any plan.
Attention bind(const OpCall& call) {
  Attention a;
  a.query = call.tensor_index(call.arg_index("query"));
  a.key = call.tensor_index(call.arg_index("key"));
  a.value = call.tensor_index(call.arg_index("value"));
  a.mask = call.tensor_index(call.arg_index("attn_mask"));
  const auto& q = call.layout(a.query).global_shape();
  for (int64_t t : {a.query, a.key, a.value})
    if (call.layout(t).ndim() != 4)
      fail_argument(call, t, "has " + std::to_string(call.layout(t).ndim()) + " dims",
                    "4-D (batch, heads, sequence, head_dim)");
  if (a.mask >= 0) {
    const auto& m = call.layout(a.mask).global_shape();
    const int64_t n = static_cast<int64_t>(m.size());
    if (n > 4) fail_argument(call, a.mask, "has more than 4 dims", "a mask that broadcasts to (batch, heads, L, S)");
    const std::string full = "bhLS";
    const std::vector<int64_t> target{q[0], q[1], q[2], call.layout(a.key).global_shape()[2]};
    for (int64_t j = 0; j < n; ++j) {
      const int64_t o = 4 - n + j;
      a.mask_labels += m[j] == 1 && target[o] != 1 ? kWhole : full[o];
    }
  }
  // Sum/avg Partials: query, key, value and mask are not linear arguments.
  std::vector<int64_t> checked{a.query, a.key, a.value};
  if (a.mask >= 0) checked.push_back(a.mask);
  for (int64_t t : checked) {
    const Layout& l = call.layout(t);
    if (auto op = l.partial_op(); op && is_sum_like(*op))
      fail_argument(call, t, partial_name(*op) + " input is not supported by attention (it is not linear in it)",
                    redistribute_partial_first({}, "Replicate or Shard on batch/heads"));
    const std::string labels = t == a.mask ? a.mask_labels : "bhLE";
    for (int64_t d = 0; d < l.ndim(); ++d)
      if (!l.dim_axes()[d].empty() && (labels[d] == 'L' || labels[d] == 'E' || labels[d] == kWhole))
        fail_argument(call, t, layout::str_cat("dim ", d, d == l.ndim() - 1 ? " (head_dim)" : " (sequence)",
                                               " is sharded; attention needs whole sequences and head dims"),
                      "batch (dim 0) or heads (dim 1) sharded");
  }
  return a;
}

// With grouped heads every rank's query heads must read exactly its key/value heads.
void check_grouped_heads(const OpCall& call, const Attention& a, const FactorPlan& f) {
  const int64_t hq = call.layout(a.query).global_shape()[1];
  const int64_t hkv = call.layout(a.key).global_shape()[1];
  if (hq == hkv) return;
  int64_t parts = 1;
  for (size_t axis = 0; axis < f.shard_label.size(); ++axis)
    if (f.shard_label[axis] == kHeads) parts *= call.mesh->mesh()->shape()[axis];
  if (parts > 1 && hkv % parts != 0)
    fail_argument(call, a.key, layout::str_cat(hkv, " key/value heads (grouped under ", hq,
                                                " query heads) cannot be split evenly over ", parts, " shards"),
                  "heads sharded over a number of shards that divides the key/value heads, or batch sharding");
}

FactorSpec attention_spec(const Attention& a) {
  FactorSpec spec;
  spec.operands = {{a.query, "bhLE", false}, {a.key, "bhSE", false}, {a.value, "bhSF", false}};
  if (a.mask >= 0) spec.operands.push_back({a.mask, a.mask_labels, false});
  spec.whole = kWholeLabels;
  return spec;
}

// Fewer key/value heads than head shards (tensor parallelism wider than the KV heads): key and
// value stay whole on the heads (every rank holds every KV head, as Megatron replicates them) and
// each rank's local call reads the KV heads its query heads map to (query head i reads KV head
// i / group). Valid when every rank's query heads lie within one group or cover whole groups.
// In the backward, each rank's key/value gradient covers its KV heads only (zeros elsewhere):
// Partial(sum) over the axes that shard the heads.
struct ReplicatedKv {
  LayoutPtr query;  // the planned query layout (its heads sharded)
  int64_t group = 1;
};

std::optional<ReplicatedKv> replicated_kv(const OpCall& call, const Attention& a, const FactorPlan& f,
                                          const std::vector<LayoutPtr>& inputs) {
  const int64_t hq = call.layout(a.query).global_shape()[1];
  const int64_t hkv = call.layout(a.key).global_shape()[1];
  if (hq == hkv || hkv == 0 || hq % hkv != 0) return std::nullopt;
  int64_t parts = 1;
  for (size_t axis = 0; axis < f.shard_label.size(); ++axis)
    if (f.shard_label[axis] == kHeads) parts *= call.mesh->mesh()->shape()[axis];
  if (parts <= 1 || hkv % parts == 0) return std::nullopt;
  ReplicatedKv r{inputs[a.query], hq / hkv};
  for (int64_t pos = 0; pos < call.mesh->mesh()->size(); ++pos) {
    const int64_t begin = r.query->global_offset_at(pos)[1], length = r.query->local_shape_at(pos)[1];
    const bool one_group = length == 0 || begin / r.group == (begin + length - 1) / r.group;
    const bool whole_groups = begin % r.group == 0 && length % r.group == 0;
    if (!one_group && !whole_groups) return std::nullopt;  // check_grouped_heads names the problem
  }
  return r;
}

// The KV heads [begin, end) this rank's query heads read.
std::pair<int64_t, int64_t> kv_heads_of(const ReplicatedKv& r, const OpCall& c, int64_t local_heads) {
  const int64_t begin = r.query->global_offset_at(c.mesh->position())[1];
  if (local_heads == 0) return {0, 1};
  return {begin / r.group, (begin + local_heads - 1) / r.group + 1};
}

LayoutPtr heads_whole(const LayoutPtr& l, layout::PartialOps partial = {}) {
  auto dims = l->dim_axes();
  dims[1].clear();
  return make_layout(*l, l->global_shape(), std::move(dims), std::move(partial));
}

OpPlan finish(const OpCall& call, const Attention& a, const FactorSpec& spec, bool backward) {
  const auto f = plan_factors(call, spec);
  OpPlan plan = to_op_plan(call, spec, f);
  const auto kv = replicated_kv(call, a, f, plan.inputs);
  if (!kv) {
    check_grouped_heads(call, a, f);
    return plan;
  }
  layout::PartialOps summed(static_cast<size_t>(call.mesh->mesh()->ndim()));
  for (int64_t axis : kv->query->dim_axes()[1]) summed[axis] = ReduceOp::Sum;
  plan.inputs[a.key] = heads_whole(plan.inputs[a.key]);
  plan.inputs[a.value] = heads_whole(plan.inputs[a.value]);
  if (backward) {
    plan.outputs[1] = heads_whole(plan.inputs[a.key], summed);
    plan.outputs[2] = heads_whole(plan.inputs[a.value], summed);
  }
  const ReplicatedKv r = *kv;
  const int64_t key_arg = call.tensors[a.key].arg, value_arg = call.tensors[a.value].arg;
  const int64_t query_arg = call.tensors[a.query].arg;
  plan.expand = [r, key_arg, value_arg, query_arg, backward](const OpCall& c, torch::jit::Stack& stack) {
    const size_t n = c.schema().arguments().size();
    c10::IValue* args = stack.data() + (stack.size() - n);
    const at::Tensor key = args[key_arg].toTensor(), value = args[value_arg].toTensor();
    const auto [begin, end] = kv_heads_of(r, c, args[query_arg].toTensor().size(1));
    args[key_arg] = key.narrow(1, begin, end - begin);
    args[value_arg] = value.narrow(1, begin, end - begin);
    c.op->callBoxed(stack);
    if (!backward) return;
    c10::IValue* rets = stack.data() + (stack.size() - 3);
    for (int i = 1; i <= 2; ++i) {
      const at::Tensor& like = i == 1 ? key : value;
      at::Tensor full = at::zeros(like.sizes(), like.options());
      full.narrow(1, begin, end - begin).copy_(rets[i].toTensor());
      rets[i] = std::move(full);
    }
  };
  return plan;
}

OpPlan flash_attention_cpu_rule(const OpCall& call) {
  const Attention a = bind(call);
  const auto& q = call.layout(a.query).global_shape();
  const auto& v = call.layout(a.value).global_shape();
  FactorSpec spec = attention_spec(a);
  spec.outputs = {"bhLF", "bhL"};
  spec.out_shapes = {{q[0], q[1], q[2], v[3]}, {q[0], q[1], q[2]}};
  return finish(call, a, spec, false);
}

OpPlan flash_attention_cpu_backward_rule(const OpCall& call) {
  const Attention a = bind(call);
  FactorSpec spec = attention_spec(a);
  spec.operands.push_back({call.tensor_index(call.arg_index("grad_out")), "bhLF", true});
  spec.operands.push_back({call.tensor_index(call.arg_index("out")), "bhLF", false});
  spec.operands.push_back({call.tensor_index(call.arg_index("logsumexp")), "bhL", false});
  spec.outputs = {"bhLE", "bhSE", "bhSF"};
  spec.out_shapes = {call.layout(a.query).global_shape(), call.layout(a.key).global_shape(),
                     call.layout(a.value).global_shape()};
  return finish(call, a, spec, true);
}

}  // namespace

void register_attention(Registry& r) {
  // dropout_p, is_causal and scale change values only.
  r.add("aten::_scaled_dot_product_flash_attention_for_cpu", &flash_attention_cpu_rule, KeyScalars::kNone);
  r.add("aten::_scaled_dot_product_flash_attention_for_cpu_backward", &flash_attention_cpu_backward_rule,
        KeyScalars::kNone);
}

}  // namespace hypershard::ops
