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
// key, value, mask, output and logsumexp alike; or the query's sequence dim (L), with mask,
// output and logsumexp sharded alike on L. A mask dim of size 1 broadcasts and stays whole. The
// key/value sequence (S) and the head dims (E, F) are whole for the local call; a head dim
// sharded is an error.
//
// Context parallelism, all-gather-KV algorithm (docs/context_parallel.md): with the sequence
// sharded (query on L, key/value on S over the same axes), the query stays sharded and key/value
// are gathered on S (the plan's input redistribution: one all-gather of K and of V per call,
// forward and backward). Each rank's output rows only need its own query rows, so the forward is
// exact; in the backward each rank's key/value gradient is its query rows' contribution, a
// Partial(sum) over the L axes, which the expand reduce-scatters back onto the caller's key/value
// layout (S sharded) in the same call. A causal mask is then built from GLOBAL positions: the
// query rows' are their block's offset plus i (a local is_causal would align row 0 with key 0),
// and with a load-balanced sequence axis (DeviceMesh::load_balanced_sequence_axis: sequences
// stored in head-tail order of 2n chunks) stored row j of a length-L sequence maps to position
// chunk(j) * L/2n + j % (L/2n), chunk(j) = j / (L/2n) for the first half of each rank's block,
// 2n-1 - its block index for the second. The op then runs with that additive mask (plus the
// caller's) instead of is_causal. Head-tail order needs L == S and 2n dividing L (refused
// otherwise, the same text on every rank).
//
// Partial algebra: attention is not linear in query, key or value: a sum/avg Partial input is
// an error (max/min Partials are reduced first). The backward is linear in grad_out: a sum/avg
// Partial grad_out carries into every gradient.
//
// Excluded: the CUDA/NPU attention kernels (_scaled_dot_product_flash_attention,
// _efficient_attention, npu_fusion_attention: same factors, no CPU test); Ulysses (all-to-all)
// and ring context parallelism (only all-gather-KV is planned).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <limits>
#include <optional>
#include <utility>

#include "ops/families.h"
#include "ops/partial.h"
#include "ops/sharding_search.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {
namespace {

constexpr char kBatch = 'b';
constexpr char kHeads = 'h';
constexpr char kQuerySequence = 'L';
constexpr const char* kWholeLabels = "SEF";  // key/value are gathered on S (all-gather-KV)

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
      if (!l.dim_axes()[d].empty() && (labels[d] == 'E' || labels[d] == kWhole))
        fail_argument(call, t,
                      layout::str_cat("dim ", d, labels[d] == 'E' ? " (head_dim)" : " (broadcast)",
                                      " is sharded; attention needs whole head dims"),
                      "batch (dim 0), heads (dim 1) or sequence (dim 2) sharded");
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
    fail_argument(call, a.key,
                  layout::str_cat(hkv, " key/value heads (grouped under ", hq,
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

// ------------------------------------------------------------------ sequence positions

// Global positions of stored rows [begin, begin + count) of a sequence of `length` stored in
// head-tail order of `chunks` chunks (0: natural order): see the header comment.
at::Tensor stored_positions(int64_t begin, int64_t count, int64_t length, int64_t chunks) {
  const at::Tensor stored = at::arange(begin, begin + count, at::kLong);
  if (chunks == 0) return stored;
  const int64_t chunk = length / chunks;
  const at::Tensor block = stored.div(2 * chunk, "floor"), within = stored.remainder(2 * chunk);
  const at::Tensor head = block * chunk + within;                           // chunk `block`
  const at::Tensor tail = (chunks - 1 - block) * chunk + (within - chunk);  // chunk 2n-1-block
  return at::where(within < chunk, head, tail);
}

// The chunks of the head-tail order on this mesh (0: natural order).
int64_t head_tail_chunks(const runtime::DeviceMesh& mesh) {
  const int64_t axis = mesh.load_balanced_sequence_axis();
  return axis >= 0 && mesh.mesh()->shape()[axis] > 1 ? 2 * mesh.mesh()->shape()[axis] : 0;
}

// What the expand needs besides the plain call (see finish).
struct SequencePlan {
  std::optional<ReplicatedKv> kv;  // read this rank's KV heads (tp wider than the KV heads)
  LayoutPtr query;                 // the planned query: its L block's global offset
  int64_t length_q = 0, length_k = 0;
  bool query_sharded = false;  // L sharded: a causal mask needs the block's offset
  // Backward: reduce-scatter the key/value gradients from `partial_grad[i]` to `scattered_grad[i]`.
  LayoutPtr partial_grad[2], scattered_grad[2];
};

// The additive causal mask [1, 1, rows of this rank, S] from GLOBAL positions, added to the caller's
// mask (a bool mask becomes 0 / -inf first).
at::Tensor causal_mask(const OpCall& c, const SequencePlan& p, int64_t local_rows, const at::Tensor& query,
                       const c10::IValue& caller_mask) {
  const int64_t chunks = head_tail_chunks(*c.mesh);
  if (chunks > 0 && (p.length_q != p.length_k || p.length_q % chunks != 0))
    fail_call(c, layout::str_cat("a causal mask over a sequence stored in head-tail order of ", chunks,
                                 " chunks (load-balanced axis '",
                                 c.mesh->mesh()->axis_names()[c.mesh->load_balanced_sequence_axis()],
                                 "') needs equal query and key lengths divisible by ", chunks, "; got L=", p.length_q,
                                 ", S=", p.length_k, "; allowed: sequences padded to a multiple of 2 x the axis size"));
  const int64_t begin = p.query->global_offset_at(c.mesh->position())[2];
  const at::Tensor rows = stored_positions(begin, local_rows, p.length_q, chunks);
  const at::Tensor cols = stored_positions(0, p.length_k, p.length_k, chunks);
  const at::Tensor hidden = cols.unsqueeze(0).gt(rows.unsqueeze(1));
  at::Tensor mask = at::zeros({1, 1, local_rows, p.length_k}, query.options())
                        .masked_fill(hidden, -std::numeric_limits<double>::infinity());
  // Autograd passes an absent mask to the backward as an undefined tensor, not None.
  if (caller_mask.isTensor() && caller_mask.toTensor().defined()) {
    at::Tensor m = caller_mask.toTensor();
    if (m.scalar_type() == at::kBool)
      m = at::zeros(m.sizes(), query.options()).masked_fill(m.logical_not(), -std::numeric_limits<double>::infinity());
    mask = m + mask;
  }
  return mask;
}

// The Partial(sum) a key/value gradient gets over the axes that shard L, moved onto S where the
// caller's key/value is sharded on S over exactly those axes: nullptr where it stays Partial.
LayoutPtr scattered_back(const Layout& caller, const LayoutPtr& planned, const FactorPlan& f) {
  const auto& s_axes = caller.dim_axes()[2];
  if (s_axes.empty() || !planned->dim_axes()[2].empty()) return nullptr;
  auto partial = planned->partial();
  for (int64_t axis : s_axes)
    if (f.shard_label[axis] != kQuerySequence || partial[axis] != ReduceOp::Sum) return nullptr;
  for (int64_t axis : s_axes) partial[axis].reset();
  auto dims = planned->dim_axes();
  dims[2] = s_axes;
  return make_layout(*planned, planned->global_shape(), std::move(dims), std::move(partial));
}

OpPlan finish(const OpCall& call, const Attention& a, const FactorSpec& spec, bool backward) {
  const auto f = plan_factors(call, spec);
  OpPlan plan = to_op_plan(call, spec, f);
  SequencePlan p;
  p.kv = replicated_kv(call, a, f, plan.inputs);
  p.query = plan.inputs[a.query];
  p.length_q = call.layout(a.query).global_shape()[2];
  p.length_k = call.layout(a.key).global_shape()[2];
  p.query_sharded = !p.query->dim_axes()[2].empty();
  if (!p.kv) {
    check_grouped_heads(call, a, f);
  } else {
    layout::PartialOps summed(static_cast<size_t>(call.mesh->mesh()->ndim()));
    for (int64_t axis : p.kv->query->dim_axes()[1]) summed[axis] = ReduceOp::Sum;
    plan.inputs[a.key] = heads_whole(plan.inputs[a.key]);
    plan.inputs[a.value] = heads_whole(plan.inputs[a.value]);
    if (backward)
      for (int i = 1; i <= 2; ++i) {
        auto partial = plan.outputs[i]->partial();
        for (size_t axis = 0; axis < partial.size(); ++axis)
          if (summed[axis]) partial[axis] = summed[axis];
        plan.outputs[i] = heads_whole(plan.outputs[i], std::move(partial));
      }
  }
  bool scatter = false;
  if (backward)
    for (int i = 0; i < 2; ++i) {
      p.partial_grad[i] = plan.outputs[i + 1];
      p.scattered_grad[i] = scattered_back(call.layout(i == 0 ? a.key : a.value), plan.outputs[i + 1], f);
      if (p.scattered_grad[i]) {
        plan.outputs[i + 1] = p.scattered_grad[i];
        scatter = true;
      }
    }
  // Plans are cached without is_causal: the expand decides per call whether a mask is needed.
  const bool positions = p.query_sharded || head_tail_chunks(*call.mesh) > 0;
  if (!p.kv && !positions && !scatter) return plan;

  const int64_t key_arg = call.tensors[a.key].arg, value_arg = call.tensors[a.value].arg;
  const int64_t query_arg = call.tensors[a.query].arg;
  const int64_t causal_arg = call.arg_index("is_causal"), mask_arg = call.arg_index("attn_mask");
  plan.expand = [p, key_arg, value_arg, query_arg, causal_arg, mask_arg, positions, backward](
                    const OpCall& c, torch::jit::Stack& stack) {
    const size_t n = c.schema().arguments().size();
    c10::IValue* args = stack.data() + (stack.size() - n);
    const at::Tensor key = args[key_arg].toTensor(), value = args[value_arg].toTensor();
    const at::Tensor query = args[query_arg].toTensor();
    std::pair<int64_t, int64_t> heads{0, 0};
    if (p.kv) {
      heads = kv_heads_of(*p.kv, c, query.size(1));
      args[key_arg] = key.narrow(1, heads.first, heads.second - heads.first);
      args[value_arg] = value.narrow(1, heads.first, heads.second - heads.first);
    }
    if (query.size(2) == 0) {
      // An empty block of query rows (uneven shards, torch.chunk): torch's kernel divides by the
      // row count, so the (empty) results are made here; the backward's key/value gradient part
      // is zero, and this rank still joins the reduce-scatter below.
      const at::Tensor key_used = args[key_arg].toTensor(), value_used = args[value_arg].toTensor();
      torch::jit::drop(stack, n);
      if (!backward) {
        stack.emplace_back(at::empty({query.size(0), query.size(1), 0, value_used.size(3)}, query.options()));
        stack.emplace_back(
            at::empty({query.size(0), query.size(1), 0}, query.options().dtype(at::toOpMathType(query.scalar_type()))));
        return;
      }
      stack.emplace_back(at::zeros_like(query));
      stack.emplace_back(at::zeros_like(key_used));
      stack.emplace_back(at::zeros_like(value_used));
    } else {
      if (positions && args[causal_arg].toBool()) {
        args[mask_arg] = causal_mask(c, p, query.size(2), query, args[mask_arg]);
        args[causal_arg] = false;
      }
      c.op->callBoxed(stack);
    }
    if (!backward) return;
    c10::IValue* rets = stack.data() + (stack.size() - 3);
    for (int i = 1; i <= 2; ++i) {
      at::Tensor grad = rets[i].toTensor();
      if (p.kv) {
        const at::Tensor& like = i == 1 ? key : value;
        at::Tensor full = at::zeros(like.sizes(), like.options());
        full.narrow(1, heads.first, heads.second - heads.first).copy_(grad);
        grad = std::move(full);
      }
      if (p.scattered_grad[i - 1])
        grad = runtime::redistribute_local(grad.contiguous(), p.partial_grad[i - 1], p.scattered_grad[i - 1], *c.mesh);
      rets[i] = std::move(grad);
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
