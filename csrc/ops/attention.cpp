// Scaled dot-product attention: one rule for every kernel F.scaled_dot_product_attention lowers
// to, on CPU, CUDA and PrivateUse1 backends, and for torch_npu's fusion attention.
//
//   aten::_scaled_dot_product_flash_attention_for_cpu      (CPU)
//       query "bhLE", key "bhSE", value "bhSF", attn_mask (broadcast to "bhLS")
//       -> output "bhLF", logsumexp "bhL"
//   aten::_scaled_dot_product_flash_attention              (CUDA; no mask)
//       -> output, logsumexp "bhL", cum_seq_q/k, max_q/k, rng_state, unused, debug_attn_mask
//   aten::_scaled_dot_product_efficient_attention          (CUDA; attn_bias)
//       -> output, log_sumexp "bhM" (L rounded up to 32; (b, h, 0) without compute_log_sumexp),
//          philox_seed, philox_offset
//   aten::_scaled_dot_product_cudnn_attention              (CUDA; attn_bias)
//       -> output, logsumexp "bhL1", cum_seq_q/k, max_q/k, philox_seed, philox_offset, debug_attn_mask
//   aten::_scaled_dot_product_fused_attention_overrideable (PrivateUse1 backends; attn_bias)
//       -> as the cuDNN kernel's, logsumexp "bhL"
//   ... and each one's _backward: grad_out "bhLF", query, key, value, out, logsumexp (attn_bias,
//       the philox state, cum_seq/max_q/k as the forward returned them)
//       -> grad_query "bhLE", grad_key "bhSE", grad_value "bhSF" (efficient and overrideable also
//          grad_attn_bias, laid out like attn_bias)
//   npu::npu_fusion_attention(query, key, value, head_num, input_layout, pse, padding_mask,
//                             atten_mask, scale, keep_prob, ...)         (Ascend, when torch_npu is loaded)
//       -> attention_out (like query, value's head dim), softmax_max and softmax_sum "bhL8" (TND:
//          "Th8"), softmax_out (empty), seed, offset, numels
//   npu::npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse,
//                                  padding_mask, atten_mask, softmax_max, softmax_sum, softmax_in,
//                                  attention_in, ...) -> dq, dk, dv, dpse (newer releases: dsink)
//
// Which kernel: F.scaled_dot_product_attention's CompositeImplicitAutograd kernel asks the device's
// sdp chooser (called directly, not dispatched, with the DTensors themselves) and calls one of the
// ops above, so a DTensor on CUDA reaches the flash kernel (fp16/bf16, no mask), the efficient one
// (fp32 too, with a mask, padded to a multiple of 8 and expanded to (b, h, L, S)) or cuDNN's
// (preferred on sm90/sm100 with cuDNN > 9.15), with grouped key/value heads as they are; the math
// path (matmul, _safe_softmax: other families) otherwise. On CPU it is the _for_cpu kernel for
// 4-D fp32/bf16/fp16 inputs without dropout (a bool mask first becomes an additive one by
// where.self), the math path with dropout. HF's "sdpa" attention uses enable_gqa without a mask and
// repeat_kv (unsqueeze, expand, reshape: views family) with one; its "eager" attention is matmul +
// _softmax + dropout.
//
// Sharding (sharding_search.h), per mesh axis: the batch dim (b) or the heads dim (h) of query,
// key, value, output, the per-row statistics (logsumexp, softmax_max/sum) and the masks (attn_mask,
// attn_bias, atten_mask and pse broadcast to (batch, heads, L, S): a size-1 dim stays whole); for
// the aten kernels also the query's sequence (L, context parallelism below); the head dims (E, F)
// whole: an input sharded there is an error. torch_npu's input_layout orders the dims: BNSD
// (torch's), BSND, BSH and SBH (heads and head dim merged in H: every rank's block of H must hold
// whole heads) and TND (sequences packed along T by actual_seq_qlen/kvlen, T whole: heads only);
// head_num becomes this rank's heads. npu's sequences are whole (a sharded one is an error: its
// causal sparse modes build the mask from local positions). With grouped heads (key/value with
// Hkv < Hq heads, query head i reading key/value head i / (Hq / Hkv)) the heads shard alike when
// Hkv divides evenly over the sharding axes. With more head shards than that (tensor parallelism
// wider than the KV heads), key and value stay whole on the heads and each rank's call reads the
// KV heads its query heads need (replicated_kv); their gradients are then Partial(sum), as is a
// mask's or pse's gradient over the axes that shard a dim it broadcasts over. The kernels' other
// outputs (rng state, philox seed/offset, cum_seq placeholders, softmax_out) are Replicate; the
// aten kernels' output shapes are their Meta kernels'.
//
// Context parallelism (docs/context_parallel.md; the algorithms in attention_sequence.cpp), for the
// aten kernels (torch's BNSD order): with the sequence sharded (query on L, key/value on S over the
// same axes), the query stays sharded. Each rank's output rows only need its own query rows, so the
// forward is exact; in the backward each rank's key/value gradient is its query rows'
// contribution, a Partial(sum) over the L axes, brought back onto the caller's key/value layout (S
// sharded) in the same call. On an even split (L == S in equal blocks) key and value stay sharded
// in the plan and the expand runs the mesh's algorithm (DeviceMesh::sequence_attention:
// all-gather-KV, Ulysses or ring; plans do not depend on it); otherwise the plan gathers key and
// value on S (the framework's redistribution: all-gather-KV) and the expand reduce-scatters their
// gradients. A causal mask is then built from GLOBAL positions: the query rows' are their block's
// offset plus i (a local is_causal would align row 0 with key 0), and with a load-balanced sequence
// axis (DeviceMesh::load_balanced_sequence_axis: sequences stored in head-tail order of 2n chunks)
// stored row j of a length-L sequence maps to position chunk(j) * L/2n + j % (L/2n), chunk(j) =
// j / (L/2n) for the first half of each rank's block, 2n-1 - its block index for the second. The
// op then runs with that additive mask (plus the caller's; rows padded to 16 elements, the
// efficient kernel's alignment) instead of is_causal. Head-tail order needs L == S and 2n dividing
// L (refused otherwise, the same text on every rank). Per kernel: the CPU kernel, cuDNN's, the
// efficient and the overrideable one (attn_bias) are planned so; the flash kernel has no mask
// argument: causal with a sharded query is not covered (default mode computes it on the gathered
// sequence), causal on a head-tail mesh an error (gathering keeps the stored order); not causal it
// is planned. Ulysses and ring run on the CPU kernel (the others run all-gather-KV).
// The efficient kernel pads logsumexp to 32 rows per call: a sharded query whose
// blocks are not whole multiples of 32 rows is not covered. The CUDA kernels' sequence plans
// follow the CPU kernel's maths, tested on CPU only.
//
// Dropout inside a fused kernel draws its mask from the rank's own generator over the local
// shape: a sharded call would not hold its slice of one device's draw (the random family's
// semantics). So with dropout_p > 0 (keep_prob < 1) and anything sharded the call is not covered
// (default mode computes it on gathered inputs, every rank drawing what one device draws; strict
// mode raises); so is npu's per-batch prefix list with the batch sharded.
//
// Partial algebra: attention is not linear in query, key, value or the masks: a sum/avg Partial
// input is an error (max/min Partials are reduced first). The backward is linear in grad_out /
// dy: a sum/avg Partial there carries into every gradient.
//
// torch_npu registers its autograd at its own backend's key, which a DTensor never reaches, and
// hypershard has no autograd kernel for npu_fusion_attention yet (csrc/kernels/external_autograd.cpp
// has npu_rms_norm's and npu_rotary_mul's): on DTensors it runs forward only.
//
// Excluded: _flash_attention_forward/backward, _efficient_attention_forward/backward and
// _cudnn_attention_forward/backward (what the CUDA kernels above call on the local tensors, below
// hypershard; called directly they take packed varlen sequences: neither F.scaled_dot_product_attention
// nor HF's attention reaches them), Ulysses and ring on the CUDA / PrivateUse1 kernels (they run
// all-gather-KV), npu's padding_mask (reserved) and a softmax_layout other than "" (not
// covered: other statistics shapes).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "ops/families.h"
#include "ops/partial.h"
#include "ops/attention_sequence.h"
#include "ops/sharding_search.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {
namespace {

using sequence_attention::head_tail_chunks;
using sequence_attention::SequencePlan;

constexpr char kBatch = 'b';
constexpr char kHeads = 'h';
constexpr char kQuerySequence = 'L';
constexpr const char* kWholeLabels = "LSEF";
constexpr const char* kGatheredKvLabels = "SEF";  // key/value are gathered on S (all-gather-KV)

// Where query, key, value and the output keep their dims: b batch, h heads, L / S the query / key
// sequence, E / F the query-key / value head dim.
struct DimOrder {
  const char* name;  // torch_npu's input_layout
  const char* query;
  const char* key;
  const char* value;
  const char* out;
  bool merged;  // h is heads x head dim (its blocks must hold whole heads)
};

constexpr DimOrder kTorchOrder{"BNSD", "bhLE", "bhSE", "bhSF", "bhLF", false};
constexpr DimOrder kNpuOrders[] = {
    kTorchOrder,
    {"BSND", "bLhE", "bShE", "bShF", "bLhF", false},
    {"BSH", "bLh", "bSh", "bSh", "bLh", true},
    {"SBH", "Lbh", "Sbh", "Sbh", "Lbh", true},
    {"TND", "LhE", "ShE", "ShF", "LhF", false},
};

int64_t dim_of(const char* labels, char label) {
  const char* p = std::strchr(labels, label);
  return p ? p - labels : -1;
}

std::string whole_labels(size_t n) { return std::string(n, kWhole); }

// The schema index of the first argument with one of these names, or -1.
int64_t argument_named(const OpCall& call, std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (const auto index = call.schema().argumentIndexWithName(name)) return static_cast<int64_t>(*index);
  return -1;
}

struct Attention {
  const DimOrder* order = &kTorchOrder;
  int64_t query = -1, key = -1, value = -1, mask = -1, pse = -1, sink = -1;
  std::string mask_labels, pse_labels, sink_labels;
  int64_t batch = -1;                     // -1: no batch dim (TND)
  int64_t query_heads = 0, kv_heads = 0;  // head counts
  int64_t unit = 1;                       // elements per head along h (merged: the head dim)
  int64_t heads_dim = 1;                  // h in query, key and value
  int64_t length_q = 0, length_k = 0;     // L and S
  // The aten kernels (bound with kTorchOrder itself) shard the query's sequence (context
  // parallelism); npu's orders, its BNSD copy included, keep sequences whole.
  bool sequences() const { return order == &kTorchOrder; }
};

// A mask or position bias broadcast to (batch, heads, L, S): its dims where they have the full
// size, the rest (broadcast) whole.
std::string broadcast_labels(const OpCall& call, int64_t t, const Attention& a) {
  const auto& m = call.layout(t).global_shape();
  const int64_t n = static_cast<int64_t>(m.size());
  if (n > 4) fail_argument(call, t, "has more than 4 dims", "a mask that broadcasts to (batch, heads, L, S)");
  const std::array<int64_t, 4> full{a.batch, a.query_heads, a.length_q, a.length_k};
  std::string labels;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t o = 4 - n + j;
    labels += m[j] == full[o] ? "bhLS"[o] : kWhole;
  }
  return labels;
}

const char* describe(char label) {
  switch (label) {
    case 'L':
    case 'S':
      return " (sequence)";
    case 'E':
    case 'F':
      return " (head_dim)";
    default:
      return " (broadcast)";
  }
}

// Binds the attention tensors by argument name and checks what must hold before any plan.
Attention bind(const OpCall& call, const DimOrder& order, int64_t head_num = 0) {
  Attention a;
  a.order = &order;
  a.query = call.tensor_named({"query"});
  a.key = call.tensor_named({"key"});
  a.value = call.tensor_named({"value"});
  a.mask = call.tensor_named({"attn_mask", "attn_bias", "atten_mask"});
  a.pse = call.tensor_named({"pse"});
  a.sink = call.tensor_named({"sink"});
  const std::array<std::pair<int64_t, const char*>, 3> qkv{
      {{a.query, order.query}, {a.key, order.key}, {a.value, order.value}}};
  for (const auto& [t, labels] : qkv)
    if (call.layout(t).ndim() != static_cast<int64_t>(std::strlen(labels)))
      fail_argument(call, t, "has " + std::to_string(call.layout(t).ndim()) + " dims",
                    &order == &kTorchOrder
                        ? std::string("4-D (batch, heads, sequence, head_dim)")
                        : layout::str_cat(std::strlen(labels), "-D (input_layout ", order.name, ")"));
  const auto& q = call.layout(a.query).global_shape();
  const auto& k = call.layout(a.key).global_shape();
  a.heads_dim = dim_of(order.query, kHeads);
  if (order.merged) {
    if (head_num <= 0 || q[a.heads_dim] % head_num != 0)
      fail_argument(call, a.query,
                    layout::str_cat("H = ", q[a.heads_dim], " is not head_num = ", head_num, " whole heads"),
                    "head_num > 0 dividing query's H");
    a.unit = q[a.heads_dim] / head_num;
    if (a.unit == 0 || k[a.heads_dim] % a.unit != 0)
      fail_argument(call, a.key, layout::str_cat("H = ", k[a.heads_dim], " is not a whole number of heads of ", a.unit),
                    "key's H a multiple of query's head dim");
  }
  a.query_heads = q[a.heads_dim] / a.unit;
  a.kv_heads = k[a.heads_dim] / a.unit;
  a.length_q = q[dim_of(order.query, kQuerySequence)];
  a.length_k = k[dim_of(order.key, 'S')];
  if (const int64_t b = dim_of(order.query, kBatch); b >= 0) a.batch = q[b];
  if (a.mask >= 0) a.mask_labels = broadcast_labels(call, a.mask, a);
  if (a.pse >= 0) a.pse_labels = broadcast_labels(call, a.pse, a);
  if (a.sink >= 0) {
    const auto& s = call.layout(a.sink).global_shape();
    a.sink_labels = s.size() == 1 && s[0] == a.query_heads ? std::string(1, kHeads) : whole_labels(s.size());
  }
  // Sum/avg Partials: attention is linear in none of these; dims other than batch/heads (and the
  // sequences in torch's order) whole.
  std::vector<std::string> dims;
  if (a.batch >= 0) dims.push_back(layout::str_cat("batch (dim ", dim_of(order.query, kBatch), ")"));
  dims.push_back(layout::str_cat("heads (dim ", a.heads_dim, ")"));
  if (a.sequences()) dims.push_back("sequence (dim 2)");
  std::string allowed;
  for (size_t i = 0; i < dims.size(); ++i) allowed += (i == 0 ? "" : i + 1 == dims.size() ? " or " : ", ") + dims[i];
  allowed += " sharded";
  const char* needs =
      a.sequences() ? "; attention needs whole head dims" : "; attention needs whole sequences and head dims";
  const std::array<std::pair<int64_t, std::string>, 6> checked{{{a.query, order.query},
                                                                {a.key, order.key},
                                                                {a.value, order.value},
                                                                {a.mask, a.mask_labels},
                                                                {a.pse, a.pse_labels},
                                                                {a.sink, a.sink_labels}}};
  for (const auto& [t, labels] : checked) {
    if (t < 0) continue;
    const Layout& l = call.layout(t);
    if (auto op = l.partial_op(); op && is_sum_like(*op))
      fail_argument(call, t, partial_name(*op) + " input is not supported by attention (it is not linear in it)",
                    redistribute_partial_first({}, "Replicate or Shard on batch/heads"));
    for (int64_t d = 0; d < l.ndim(); ++d) {
      const char label = labels[d];
      const bool sequence = label == 'L' || label == 'S';
      if (!l.dim_axes()[d].empty() && label != kBatch && label != kHeads && !(sequence && a.sequences()))
        fail_argument(call, t, layout::str_cat("dim ", d, describe(label), " is sharded", needs), allowed);
    }
  }
  return a;
}

FactorSpec attention_spec(const Attention& a) {
  FactorSpec spec;
  spec.operands = {{a.query, a.order->query, false}, {a.key, a.order->key, false}, {a.value, a.order->value, false}};
  if (a.mask >= 0) spec.operands.push_back({a.mask, a.mask_labels, false});
  if (a.pse >= 0) spec.operands.push_back({a.pse, a.pse_labels, false});
  if (a.sink >= 0) spec.operands.push_back({a.sink, a.sink_labels, false});
  spec.whole = a.sequences() ? kGatheredKvLabels : kWholeLabels;
  return spec;
}

// A per-row statistic (logsumexp, the debug mask): (batch, heads, L, ...), sharded like the rows;
// nullopt for the kernels' other outputs (rng state, philox seed/offset, placeholders).
std::optional<std::string> statistic_labels(const std::vector<int64_t>& shape, const Attention& a) {
  if (shape.size() < 2 || shape[0] != a.batch || shape[1] != a.query_heads) return std::nullopt;
  std::string labels = "bh" + whole_labels(shape.size() - 2);
  if (shape.size() > 2 && shape[2] == a.length_q) labels[2] = kQuerySequence;
  return labels;
}

// The number of query head shards: the product of the axes that shard the heads.
int64_t head_parts(const OpCall& call, const FactorPlan& f) {
  int64_t parts = 1;
  for (size_t axis = 0; axis < f.shard_label.size(); ++axis)
    if (f.shard_label[axis] == kHeads) parts *= call.mesh->mesh()->shape()[axis];
  return parts;
}

// With grouped heads every rank's query heads must read exactly its key/value heads.
void check_grouped_heads(const OpCall& call, const Attention& a, const FactorPlan& f) {
  if (a.query_heads == a.kv_heads) return;
  const int64_t parts = head_parts(call, f);
  if (parts > 1 && a.kv_heads % parts != 0)
    fail_argument(call, a.key,
                  layout::str_cat(a.kv_heads, " key/value heads (grouped under ", a.query_heads,
                                  " query heads) cannot be split evenly over ", parts, " shards"),
                  "heads sharded over a number of shards that divides the key/value heads, or batch sharding");
}

// Merged heads (BSH, SBH): every rank's block of H must hold whole heads.
void check_whole_heads(const OpCall& call, const Attention& a, const OpPlan& plan) {
  if (a.unit == 1) return;
  for (int64_t t : {a.query, a.key, a.value}) {
    const auto& l = plan.inputs[t];
    for (int64_t pos = 0; pos < call.mesh->mesh()->size(); ++pos)
      if (l->global_offset_at(pos)[a.heads_dim] % a.unit != 0 || l->local_shape_at(pos)[a.heads_dim] % a.unit != 0)
        fail_argument(call, t, layout::str_cat("a block of H would split a head of ", a.unit, " elements"),
                      "heads sharded over a number of shards that divides the head count");
  }
}

// Fewer key/value heads than head shards (tensor parallelism wider than the KV heads): key and
// value stay whole on the heads (every rank holds every KV head, as Megatron replicates them) and
// each rank's local call reads the KV heads its query heads map to (query head i reads KV head
// i / group). Valid when every rank's query heads lie within one group or cover whole groups.
// In the backward, each rank's key/value gradient covers its KV heads only (zeros elsewhere):
// Partial(sum) over the axes that shard the heads.
struct ReplicatedKv {
  LayoutPtr query;  // the planned query layout (its heads sharded)
  int64_t group = 1, unit = 1, heads_dim = 1;
};

std::optional<ReplicatedKv> replicated_kv(const OpCall& call, const Attention& a, const FactorPlan& f,
                                          const std::vector<LayoutPtr>& inputs) {
  const int64_t hq = a.query_heads, hkv = a.kv_heads;
  if (hq == hkv || hkv == 0 || hq % hkv != 0) return std::nullopt;
  const int64_t parts = head_parts(call, f);
  if (parts <= 1 || hkv % parts == 0) return std::nullopt;
  ReplicatedKv r{inputs[a.query], hq / hkv, a.unit, a.heads_dim};
  for (int64_t pos = 0; pos < call.mesh->mesh()->size(); ++pos) {
    const int64_t begin = r.query->global_offset_at(pos)[r.heads_dim] / r.unit;
    const int64_t length = r.query->local_shape_at(pos)[r.heads_dim] / r.unit;
    const bool one_group = length == 0 || begin / r.group == (begin + length - 1) / r.group;
    const bool whole_groups = begin % r.group == 0 && length % r.group == 0;
    if (!one_group && !whole_groups) return std::nullopt;  // check_grouped_heads names the problem
  }
  return r;
}

// The KV heads [begin, end) this rank's query heads read.
std::pair<int64_t, int64_t> kv_heads_of(const ReplicatedKv& r, const OpCall& c, int64_t local_heads) {
  const int64_t begin = r.query->global_offset_at(c.mesh->position())[r.heads_dim] / r.unit;
  if (local_heads == 0) return {0, 1};
  return {begin / r.group, (begin + local_heads - 1) / r.group + 1};
}

LayoutPtr heads_whole(const LayoutPtr& l, int64_t dim, layout::PartialOps partial = {}) {
  auto dims = l->dim_axes();
  dims[dim].clear();
  return make_layout(*l, l->global_shape(), std::move(dims), std::move(partial));
}

// The kernel's dropout probability: dropout_p, or 1 - keep_prob (npu).
double dropout_of(const OpCall& call) {
  if (const auto i = call.schema().argumentIndexWithName("dropout_p")) return call.arg(*i).toDouble();
  if (const auto i = call.schema().argumentIndexWithName("keep_prob")) return 1.0 - call.arg(*i).toDouble();
  return 0.0;
}

void refuse_uncovered(const OpCall& call, const FactorPlan& f) {
  const bool sharded = std::any_of(f.shard_label.begin(), f.shard_label.end(), [](char l) { return l != 0; });
  if (sharded && dropout_of(call) > 0)
    not_covered(call,
                "dropout inside the attention kernel with sharded inputs: each rank would draw its own "
                "mask, not its slice of one device's draw");
  const bool batch_sharded = std::find(f.shard_label.begin(), f.shard_label.end(), kBatch) != f.shard_label.end();
  if (const auto i = call.schema().argumentIndexWithName("prefix"); i && batch_sharded && !call.arg(*i).isNone())
    not_covered(call, "a per-batch prefix list with the batch sharded");
}

// ------------------------------------------------------------------ sequence positions

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

// What a kernel cannot do with the query's sequence sharded (or stored in head-tail order).
void check_sequence_kernel(const OpCall& call, const SequencePlan& p) {
  const bool causal = p.causal_arg >= 0 && call.arg(p.causal_arg).toBool();
  // Keyed on its scalars (KeyScalars::kAll): is_causal is this plan's.
  if (causal && p.mask_arg < 0) {
    if (head_tail_chunks(*call.mesh) > 0)
      fail_call(call,
                "is_causal over a sequence stored in head-tail order: this kernel takes no mask to hold "
                "the global positions (gathering keeps the stored order); allowed: the efficient or cuDNN "
                "kernel (an attn_mask), or a mesh without a load-balanced sequence axis");
    not_covered(call,
                "is_causal with the query's sequence sharded: the flash kernel takes no mask to hold the "
                "global positions of this rank's rows");
  }
  // The efficient kernel pads logsumexp's rows to a multiple of 32 per call.
  if (!p.query_sharded || call.schema().name().find("efficient") == std::string::npos) return;
  constexpr int64_t kRows = 32;
  for (int64_t pos = 0; pos < call.mesh->mesh()->size(); ++pos)
    if (p.query->global_offset_at(pos)[2] % kRows != 0 || p.query->local_shape_at(pos)[2] % kRows != 0)
      not_covered(call, layout::str_cat("the query's sequence sharded in blocks that are not multiples of ", kRows,
                                        " rows: the efficient kernel pads each call's logsumexp to ", kRows,
                                        " rows, so the blocks' would not be slices of the global one"));
}

// The plan of `spec` with the grouped-heads and sequence cases settled. `backward`: the results
// begin with the query, key and value gradients. `extra`: the results that are no function of the
// rows (rng state, philox seed/offset, empty placeholders): Replicate, never a Partial sum over the
// shards.
OpPlan finish(const OpCall& call, const Attention& a, const FactorSpec& spec, bool backward,
              const std::vector<bool>& extra = {}) {
  const auto f = plan_factors(call, spec);
  refuse_uncovered(call, f);
  OpPlan plan = to_op_plan(call, spec, f);
  for (size_t i = 0; i < extra.size(); ++i)
    if (extra[i]) plan.outputs[i] = replicate_like(*plan.outputs[i], spec.out_shapes[i]);
  SequencePlan p;
  const std::optional<ReplicatedKv> kv = replicated_kv(call, a, f, plan.inputs);
  p.query = plan.inputs[a.query];
  p.length_q = a.length_q;
  p.length_k = a.length_k;
  p.query_sharded = a.sequences() && !p.query->dim_axes()[2].empty();
  p.empty_rows = call.schema().name().find("_for_cpu") != std::string::npos;
  if (!kv) {
    check_grouped_heads(call, a, f);
  } else {
    layout::PartialOps summed(static_cast<size_t>(call.mesh->mesh()->ndim()));
    for (int64_t axis : kv->query->dim_axes()[a.heads_dim]) summed[axis] = ReduceOp::Sum;
    plan.inputs[a.key] = heads_whole(plan.inputs[a.key], a.heads_dim);
    plan.inputs[a.value] = heads_whole(plan.inputs[a.value], a.heads_dim);
    if (backward)
      for (int i = 1; i <= 2; ++i) {
        auto partial = plan.outputs[i]->partial();
        for (size_t axis = 0; axis < partial.size(); ++axis)
          if (summed[axis]) partial[axis] = summed[axis];
        plan.outputs[i] = heads_whole(plan.outputs[i], a.heads_dim, std::move(partial));
      }
  }
  check_whole_heads(call, a, plan);
  bool scatter = false;
  if (backward && a.sequences())
    for (int i = 0; i < 2; ++i) {
      p.partial_grad[i] = plan.outputs[i + 1];
      p.scattered_grad[i] = scattered_back(call.layout(i == 0 ? a.key : a.value), plan.outputs[i + 1], f);
      if (p.scattered_grad[i]) {
        plan.outputs[i + 1] = p.scattered_grad[i];
        scatter = true;
      }
    }
  // The CPU kernel's plans are cached without is_causal: the expand decides per call whether a
  // mask is needed.
  const bool positions = a.sequences() && (p.query_sharded || head_tail_chunks(*call.mesh) > 0);
  p.causal_arg = argument_named(call, {"is_causal"});
  p.mask_arg = argument_named(call, {"attn_mask", "attn_bias"});
  p.key_arg = call.tensors[a.key].arg;
  p.value_arg = call.tensors[a.value].arg;
  p.query_arg = call.tensors[a.query].arg;
  if (positions) check_sequence_kernel(call, p);
  // An even split keeps key and value sharded: the expand runs the mesh's algorithm.
  if (!kv && a.sequences())
    sequence_attention::plan_even_split(call, p, plan.inputs, plan.outputs, a.key, a.value, a.mask, a.query_heads,
                                        backward);
  if (!kv && !positions && !scatter) return plan;

  plan.expand = [p, kv, positions, backward](const OpCall& c, torch::jit::Stack& stack) {
    const size_t n = c.schema().arguments().size();
    c10::IValue* args = stack.data() + (stack.size() - n);
    const at::Tensor key = args[p.key_arg].toTensor(), value = args[p.value_arg].toTensor();
    const at::Tensor query = args[p.query_arg].toTensor();
    if (p.even && sequence_attention::run_even_split(c, p, stack, backward)) return;
    std::pair<int64_t, int64_t> heads{0, 0};
    int64_t dim = 1, unit = 1;
    if (kv) {
      dim = kv->heads_dim;
      unit = kv->unit;
      heads = kv_heads_of(*kv, c, query.size(dim) / unit);
      args[p.key_arg] = key.narrow(dim, heads.first * unit, (heads.second - heads.first) * unit);
      args[p.value_arg] = value.narrow(dim, heads.first * unit, (heads.second - heads.first) * unit);
    }
    if (p.empty_rows && query.size(2) == 0) {
      // An empty block of query rows (uneven shards, torch.chunk): torch's CPU kernel divides by
      // the row count, so the (empty) results are made here; the backward's key/value gradient
      // part is zero, and this rank still joins the reduce-scatter below.
      const at::Tensor key_used = args[p.key_arg].toTensor(), value_used = args[p.value_arg].toTensor();
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
      if (positions && p.causal_arg >= 0 && p.mask_arg >= 0 && args[p.causal_arg].toBool()) {
        args[p.mask_arg] = sequence_attention::causal_mask(c, p, query.size(2), query, args[p.mask_arg]);
        args[p.causal_arg] = false;
      }
      c.op->callBoxed(stack);
    }
    if (!backward) return;
    c10::IValue* rets = stack.data() + (stack.size() - c.schema().returns().size());
    for (int i = 1; i <= 2; ++i) {
      at::Tensor grad = rets[i].toTensor();
      if (kv) {
        const at::Tensor& like = i == 1 ? key : value;
        at::Tensor full = at::zeros(like.sizes(), like.options());
        full.narrow(dim, heads.first * unit, (heads.second - heads.first) * unit).copy_(grad);
        grad = std::move(full);
      }
      if (p.scattered_grad[i - 1])
        grad = runtime::redistribute_local(grad.contiguous(), p.partial_grad[i - 1], p.scattered_grad[i - 1], *c.mesh);
      rets[i] = std::move(grad);
    }
  };
  return plan;
}

// ------------------------------------------------------------------ the aten kernels

OpPlan sdpa_rule(const OpCall& call) {
  const Attention a = bind(call, kTorchOrder);
  FactorSpec spec = attention_spec(a);
  spec.out_shapes = meta_output_shapes(call);
  spec.outputs.push_back(kTorchOrder.out);
  std::vector<bool> extra(spec.out_shapes.size(), false);
  for (size_t i = 1; i < spec.out_shapes.size(); ++i) {
    const auto labels = statistic_labels(spec.out_shapes[i], a);
    extra[i] = !labels;
    spec.outputs.push_back(labels.value_or(whole_labels(spec.out_shapes[i].size())));
  }
  return finish(call, a, spec, false, extra);
}

OpPlan sdpa_backward_rule(const OpCall& call) {
  const Attention a = bind(call, kTorchOrder);
  FactorSpec spec = attention_spec(a);
  const int64_t lse = call.tensor_named({"logsumexp"});
  spec.operands.push_back({call.tensor_named({"grad_out", "grad_out_"}), kTorchOrder.out, true});
  spec.operands.push_back({call.tensor_named({"out"}), kTorchOrder.out, false});
  const auto& lse_shape = call.layout(lse).global_shape();
  spec.operands.push_back({lse, statistic_labels(lse_shape, a).value_or(whole_labels(lse_shape.size())), false});
  spec.outputs = {kTorchOrder.query, kTorchOrder.key, kTorchOrder.value};
  spec.out_shapes = {call.layout(a.query).global_shape(), call.layout(a.key).global_shape(),
                     call.layout(a.value).global_shape()};
  std::vector<bool> extra(3, false);
  if (call.schema().returns().size() == 4) {  // grad_attn_bias, laid out like attn_bias (undefined without)
    spec.outputs.push_back(a.mask >= 0 ? a.mask_labels : "");
    spec.out_shapes.push_back(a.mask >= 0 ? call.layout(a.mask).global_shape() : std::vector<int64_t>{});
    extra.push_back(a.mask < 0);
  }
  return finish(call, a, spec, true, extra);
}

// ------------------------------------------------------------------ torch_npu's fusion attention

const DimOrder& npu_order(const OpCall& call) {
  std::string name = call.arg(call.arg_index("input_layout")).toStringRef();
  for (auto& ch : name) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  for (const auto& order : kNpuOrders)
    if (name == order.name) return order;
  fail_call(call, "input_layout '" + name + "' is not supported; allowed: BNSD, BSND, BSH, SBH, TND");
}

Attention bind_npu(const OpCall& call) {
  const DimOrder& order = npu_order(call);
  const Attention a = bind(call, order, call.arg(call.arg_index("head_num")).toInt());
  if (call.tensor_named({"padding_mask"}) >= 0) not_covered(call, "padding_mask (reserved by torch_npu)");
  if (const auto i = call.schema().argumentIndexWithName("softmax_layout"); i && !call.arg(*i).toStringRef().empty())
    not_covered(call, "softmax_layout '" + call.arg(*i).toStringRef() + "'");
  return a;
}

// softmax_max / softmax_sum: (B, N, Sq, 8), TND (T, N, 8), N the query heads.
std::pair<std::string, std::vector<int64_t>> npu_statistics(const OpCall& call, const Attention& a) {
  const auto& q = call.layout(a.query).global_shape();
  if (a.batch < 0) return {"Lh.", {q[0], a.query_heads, 8}};
  return {"bhL.", {a.batch, a.query_heads, q[dim_of(a.order->query, 'L')], 8}};
}

// head_num becomes this rank's query heads where the heads are sharded.
void localize_head_num(OpPlan& plan, const Attention& a) {
  const LayoutPtr query = plan.inputs[a.query];
  if (query->dim_axes()[a.heads_dim].empty()) return;
  const int64_t dim = a.heads_dim, unit = a.unit;
  plan.localize = [query, dim, unit](const OpCall& call, c10::IValue* args) {
    args[call.arg_index("head_num")] = c10::IValue(query->local_shape_at(call.mesh->position())[dim] / unit);
  };
}

OpPlan npu_fusion_attention_rule(const OpCall& call) {
  const Attention a = bind_npu(call);
  FactorSpec spec = attention_spec(a);
  auto out = call.layout(a.query).global_shape();
  const int64_t v_last = call.layout(a.value).global_shape().back();
  out.back() = a.order->merged ? a.query_heads * (v_last / std::max<int64_t>(a.kv_heads, 1)) : v_last;
  const auto [stats_labels, stats_shape] = npu_statistics(call, a);
  spec.outputs = {a.order->out, stats_labels, stats_labels, "."};
  spec.out_shapes = {out, stats_shape, stats_shape, {0}};
  OpPlan plan = finish(call, a, spec, false, {false, false, false, true});  // softmax_out: empty
  localize_head_num(plan, a);
  return plan;
}

OpPlan npu_fusion_attention_grad_rule(const OpCall& call) {
  const Attention a = bind_npu(call);
  FactorSpec spec = attention_spec(a);
  const auto [stats_labels, stats_shape] = npu_statistics(call, a);
  spec.operands.push_back({call.tensor_named({"dy"}), a.order->out, true});
  for (const char* name : {"softmax_max", "softmax_sum"})
    if (const int64_t t = call.tensor_named({name}); t >= 0) spec.operands.push_back({t, stats_labels, false});
  if (const int64_t t = call.tensor_named({"softmax_in"}); t >= 0)
    spec.operands.push_back({t, whole_labels(call.layout(t).ndim()), false});
  if (const int64_t t = call.tensor_named({"attention_in"}); t >= 0) spec.operands.push_back({t, a.order->out, false});
  spec.outputs = {a.order->query, a.order->key, a.order->value};
  spec.out_shapes = {call.layout(a.query).global_shape(), call.layout(a.key).global_shape(),
                     call.layout(a.value).global_shape()};
  // dpse (and dsink in newer releases): like pse (sink), or empty.
  const std::array<std::pair<int64_t, std::string>, 2> grads{{{a.pse, a.pse_labels}, {a.sink, a.sink_labels}}};
  std::vector<bool> extra(3, false);
  for (size_t i = 0; spec.outputs.size() < call.schema().returns().size(); ++i) {
    const bool given = i < grads.size() && grads[i].first >= 0;
    spec.outputs.push_back(given ? grads[i].second : ".");
    spec.out_shapes.push_back(given ? call.layout(grads[i].first).global_shape() : std::vector<int64_t>{0});
    extra.push_back(!given);
  }
  OpPlan plan = finish(call, a, spec, true, extra);
  localize_head_num(plan, a);
  return plan;
}

}  // namespace

void register_attention(Registry& r) {
  // The CPU kernel's dropout_p, is_causal and scale change values only. The others key on their
  // scalars: dropout decides coverage, compute_log_sumexp and return_debug_mask shapes, npu's
  // head_num, input_layout and keep_prob the plan.
  r.add("aten::_scaled_dot_product_cudnn_attention", &sdpa_rule, KeyScalars::kAll);
  r.add("aten::_scaled_dot_product_cudnn_attention_backward", &sdpa_backward_rule, KeyScalars::kAll);
  r.add("aten::_scaled_dot_product_efficient_attention", &sdpa_rule, KeyScalars::kAll);
  r.add("aten::_scaled_dot_product_efficient_attention_backward", &sdpa_backward_rule, KeyScalars::kAll);
  r.add("aten::_scaled_dot_product_flash_attention", &sdpa_rule, KeyScalars::kAll);
  r.add("aten::_scaled_dot_product_flash_attention_backward", &sdpa_backward_rule, KeyScalars::kAll);
  r.add("aten::_scaled_dot_product_flash_attention_for_cpu", &sdpa_rule, KeyScalars::kNone);
  r.add("aten::_scaled_dot_product_flash_attention_for_cpu_backward", &sdpa_backward_rule, KeyScalars::kNone);
  r.add("aten::_scaled_dot_product_fused_attention_overrideable", &sdpa_rule, KeyScalars::kAll);
  r.add("aten::_scaled_dot_product_fused_attention_overrideable_backward", &sdpa_backward_rule, KeyScalars::kAll);
  r.add("npu::npu_fusion_attention", &npu_fusion_attention_rule, KeyScalars::kAll);
  r.add("npu::npu_fusion_attention_grad", &npu_fusion_attention_grad_rule, KeyScalars::kAll);
}

}  // namespace hypershard::ops
