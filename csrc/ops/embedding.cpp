// Embedding lookups and their backward.
//
//   aten::embedding                  weight "VH", indices "abc..." -> "abc...H"
//   aten::embedding_dense_backward   grad "abc...H", indices "abc..." -> "VH" (num_weights GLOBAL)
// (F.embedding reaches embedding; its autograd formula embedding_backward is composite and
// reaches embedding_dense_backward for dense gradients.)
//
// Sharding, per mesh axis (sharding_search.h):
//   indices dims    the output keeps the indices' sharding (batch / sequence parallel); in the
//                   backward each rank sums its own tokens' rows: Partial(sum) weight gradient.
//   hidden (H)      a lookup of a column block: the output's last dim is sharded the same way;
//                   the backward's gradient is sharded on dim 1.
//   vocab (V)       vocab-parallel: each rank owns the rows [offset, offset + rows) of the table;
//                   the indices are whole on that axis, a rank looks up the indices it owns
//                   (local index = global - offset) and writes zero rows for the others, so the
//                   output is Partial(sum) (a "masked Partial": exactly one rank holds each row).
//                   Out-of-range indices raise torch's own IndexError on the ranks that see them.
// padding_idx only changes the backward (its row gets no gradient) and is a GLOBAL index there;
// scale_grad_by_freq counts every occurrence of an index, so with it the indices are whole.
//
// Partial algebra: the lookup is linear in the table (sum_i W_i)[idx] = sum_i W_i[idx], so a
// sum/avg-Partial weight carries into the output; the backward is linear in grad_output, which
// carries the same way. Partial indices have no meaning: an error. max/min Partials are reduced
// first.
//
// Vocab-parallel backward: embedding_dense_backward cannot see the weight's layout, so a rank
// would compute the whole [V, H] gradient and the leaf's hook would keep its rows. Instead
// aten::embedding has a kernel of its own at AutogradPrivateUse2 (register_embedding_kernels):
// the same forward, and a backward that, for a table sharded on its rows, calls
//   hypershard::embedding_vocab_backward(grad, indices, num_weights, padding_idx,
//                                        scale_grad_by_freq, int[] vocab_axes)
// (on plain tensors: embedding_dense_backward). Its rule shards the result's rows on
// vocab_axes (grad and indices whole there) and its expand accumulates only this rank's rows:
// foreign indices go to a scratch row that is dropped, padding_idx (global) becomes local when
// this rank owns it. Every other table layout uses torch's own formula (embedding_backward).
//
// Excluded: sparse gradients (sparse=True: embedding_sparse_backward), embedding_bag,
// _embedding_bag (no rule).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/families.h"
#include "ops/sharding_search.h"
#include "runtime/dtensor_impl.h"
#include "runtime/traced_collectives.h"

namespace hypershard::ops {
namespace {

using Stack = torch::jit::Stack;

constexpr char kVocab = 'V';
constexpr char kHidden = 'H';

std::string index_labels(int64_t ndim) {
  std::string labels;
  for (int64_t d = 0; d < ndim; ++d) labels += static_cast<char>('a' + d);
  return labels;
}

void check_indices(const OpCall& call, int64_t tensor) {
  if (call.layout(tensor).has_partial())
    fail_argument(call, tensor, "Partial indices have no meaning (an index is not a sum of parts)",
                  "Replicate or Shard");
}

// ------------------------------------------------------------------ embedding

struct VocabShard {
  LayoutPtr weight;  // the table's required layout (rows sharded)
};

// Masked local lookup: indices this rank owns read its rows, the others give zero rows.
void embedding_vocab_expand(const VocabShard& v, const OpCall& call, Stack& stack) {
  const size_t base = stack.size() - call.num_args();
  const at::Tensor weight = stack[base].toTensor();
  const at::Tensor indices = stack[base + 1].toTensor();
  const int64_t position = call.mesh->position();
  const int64_t offset = v.weight->global_offset_at(position)[0];
  const int64_t rows = v.weight->local_shape_at(position)[0];
  const int64_t vocab = v.weight->global_shape()[0];
  TORCH_CHECK(!at::isFloatingType(indices.scalar_type()) && indices.scalar_type() != at::kBool,
              "Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int; "
              "but got ",
              indices.scalar_type(), " instead (while checking arguments for embedding)");
  if (indices.numel() > 0) {
    const auto [low, high] = at::aminmax(indices);
    if (runtime::tracing())  // no values to read: a device-side assert
      at::_assert_async(low.ge(0).logical_and(high.lt(vocab)), "hypershard: embedding: index out of range in self");
    else
      TORCH_CHECK_INDEX(low.item<int64_t>() >= 0 && high.item<int64_t>() < vocab, "index out of range in self");
  }
  auto shape = indices.sizes().vec();
  shape.push_back(weight.size(1));
  at::Tensor out;
  if (rows == 0) {
    out = at::zeros(shape, weight.options());
  } else {
    const auto foreign = indices.lt(offset).logical_or_(indices.ge(offset + rows));
    out = at::embedding(weight, (indices - offset).masked_fill_(foreign, 0));
    out.masked_fill_(foreign.unsqueeze(-1), 0);
  }
  torch::jit::drop(stack, call.num_args());
  stack.emplace_back(std::move(out));
}

OpPlan embedding_rule(const OpCall& call) {
  const int64_t w = call.tensor_index(0), idx = call.tensor_index(1);
  check_indices(call, idx);
  const Layout& weight = call.layout(w);
  if (weight.ndim() != 2) fail_argument(call, w, "is not a 2-D table", "a [num_embeddings, embedding_dim] table");
  const Layout& indices = call.layout(idx);
  FactorSpec spec;
  const auto labels = index_labels(indices.ndim());
  spec.operands = {{w, std::string{kVocab, kHidden}, true}, {idx, labels, false}};
  spec.outputs = {labels + kHidden};
  auto shape = indices.global_shape();
  shape.push_back(weight.global_shape()[1]);
  spec.out_shapes = {shape};
  const auto f = plan_factors(call, spec);
  OpPlan plan = to_op_plan(call, spec, f);
  if (std::find(f.shard_label.begin(), f.shard_label.end(), kVocab) != f.shard_label.end()) {
    VocabShard v{f.inputs[0]};
    plan.expand = [v](const OpCall& c, Stack& s) { embedding_vocab_expand(v, c, s); };
  }
  return plan;
}

// ------------------------------------------------------------------ embedding_dense_backward

// The factors both embedding backwards share: grad [indices..., H], indices [...] -> [V, H].
// Frequencies (scale_grad_by_freq) count every occurrence of an index: they need all indices.
FactorSpec embedding_backward_factors(const OpCall& call) {
  const int64_t g = call.tensor_index(0), idx = call.tensor_index(1);
  check_indices(call, idx);
  const Layout& grad = call.layout(g);
  const Layout& indices = call.layout(idx);
  if (grad.ndim() != indices.ndim() + 1)
    fail_argument(call, g, "has " + std::to_string(grad.ndim()) + " dims",
                  std::to_string(indices.ndim() + 1) + " dims (the indices' dims and the embedding dim)");
  FactorSpec spec;
  const auto labels = index_labels(indices.ndim());
  spec.operands = {{g, labels + kHidden, true}, {idx, labels, false}};
  spec.outputs = {std::string{kVocab, kHidden}};
  spec.out_shapes = {{int_arg(call.arg(call.arg_index("num_weights"))), grad.global_shape().back()}};
  if (call.arg(call.arg_index("scale_grad_by_freq")).toBool()) spec.whole = labels;
  return spec;
}

OpPlan embedding_dense_backward_rule(const OpCall& call) {
  FactorSpec spec = embedding_backward_factors(call);
  spec.whole += kVocab;
  return plan_from_factors(call, spec);
}

// ------------------------------------------------------------------ vocab-parallel backward

// Rows [offset, offset + rows) of the gradient: foreign indices land in a scratch row.
void embedding_vocab_backward_expand(const LayoutPtr& out, const OpCall& call, Stack& stack) {
  const size_t base = stack.size() - call.num_args();
  const at::Tensor grad = stack[base].toTensor();
  const at::Tensor indices = stack[base + 1].toTensor();
  const int64_t padding_idx = int_arg(stack[base + 3]);
  const bool scale = stack[base + 4].toBool();
  const int64_t position = call.mesh->position();
  const int64_t offset = out->global_offset_at(position)[0];
  const int64_t rows = out->local_shape_at(position)[0];
  const auto foreign = indices.lt(offset).logical_or_(indices.ge(offset + rows));
  const auto local = (indices - offset).masked_fill_(foreign, rows);
  const int64_t local_padding = padding_idx >= offset && padding_idx < offset + rows ? padding_idx - offset : -1;
  auto result = at::embedding_dense_backward(grad, local, rows + 1, local_padding, scale).narrow(0, 0, rows);
  torch::jit::drop(stack, call.num_args());
  stack.emplace_back(std::move(result));
}

OpPlan embedding_vocab_backward_rule(const OpCall& call) {
  FactorSpec spec = embedding_backward_factors(call);
  for (int64_t axis : call.arg(call.arg_index("vocab_axes")).toIntVector()) {
    if (axis < 0 || axis >= call.mesh->mesh()->ndim())
      fail_call(call, layout::str_cat("vocab axis ", axis, " is not a mesh axis"));
    spec.fixed.emplace_back(axis, kVocab);
  }
  const auto f = plan_factors(call, spec);
  OpPlan plan = to_op_plan(call, spec, f);
  if (!spec.fixed.empty()) {
    const auto out = f.outputs[0];
    plan.expand = [out](const OpCall& c, Stack& s) { embedding_vocab_backward_expand(out, c, s); };
  }
  return plan;
}

// On one device (plain tensors) every row is this device's: the dense backward.
at::Tensor embedding_vocab_backward_plain(const at::Tensor& grad, const at::Tensor& indices, c10::SymInt num_weights,
                                          c10::SymInt padding_idx, bool scale_grad_by_freq,
                                          c10::IntArrayRef /*vocab_axes*/) {
  return at::embedding_dense_backward_symint(grad, indices, std::move(num_weights), std::move(padding_idx),
                                             scale_grad_by_freq);
}

// aten::embedding at AutogradPrivateUse2: torch's forward; the backward keeps a row-sharded
// table's gradient local to its rows (see the header).
struct EmbeddingFunction : torch::autograd::Function<EmbeddingFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& weight, const at::Tensor& indices,
                            c10::SymInt padding_idx, bool scale_grad_by_freq, bool sparse) {
    ctx->save_for_backward({indices});
    ctx->saved_data["num_weights"] = weight.sym_size(0);
    ctx->saved_data["padding_idx"] = padding_idx;
    ctx->saved_data["scale_grad_by_freq"] = scale_grad_by_freq;
    ctx->saved_data["sparse"] = sparse;
    std::vector<int64_t> vocab_axes;
    if (const auto* impl = runtime::dtensor_impl(weight); impl && impl->layout()->ndim() == 2)
      vocab_axes = impl->layout()->dim_axes()[0];
    ctx->saved_data["vocab_axes"] = vocab_axes;
    at::AutoDispatchBelowADInplaceOrView below;
    return at::embedding_symint(weight, indices, std::move(padding_idx), scale_grad_by_freq, sparse);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor indices = ctx->get_saved_variables()[0];
    const auto num_weights = ctx->saved_data["num_weights"].toSymInt();
    const auto padding_idx = ctx->saved_data["padding_idx"].toSymInt();
    const bool scale = ctx->saved_data["scale_grad_by_freq"].toBool();
    const bool sparse = ctx->saved_data["sparse"].toBool();
    const auto vocab_axes = ctx->saved_data["vocab_axes"].toIntVector();
    at::Tensor grad_weight;
    if (vocab_axes.empty() || sparse || !runtime::is_dtensor(grads[0])) {
      grad_weight = at::embedding_backward_symint(grads[0], indices, num_weights, padding_idx, scale, sparse);
    } else {
      static const auto op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("hypershard::embedding_vocab_backward", "")
                                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymInt, c10::SymInt, bool,
                                                   c10::IntArrayRef)>();
      grad_weight = op.call(grads[0], indices, num_weights, padding_idx, scale, vocab_axes);
    }
    return {grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor embedding_autograd(const at::Tensor& weight, const at::Tensor& indices, c10::SymInt padding_idx,
                              bool scale_grad_by_freq, bool sparse) {
  return EmbeddingFunction::apply(weight, indices, std::move(padding_idx), scale_grad_by_freq, sparse);
}

}  // namespace

void register_embedding_kernels() {
  static auto* def = new torch::Library(torch::Library::FRAGMENT, "hypershard", std::nullopt, __FILE__, __LINE__);
  def->def(
      "embedding_vocab_backward(Tensor grad_output, Tensor indices, SymInt num_weights, SymInt padding_idx, "
      "bool scale_grad_by_freq, int[] vocab_axes) -> Tensor");
  static auto* impl = new torch::Library(torch::Library::IMPL, "hypershard",
                                         c10::DispatchKey::CompositeExplicitAutograd, __FILE__, __LINE__);
  impl->impl("embedding_vocab_backward", TORCH_FN(embedding_vocab_backward_plain));
  aten_autograd_kernels().impl("embedding", TORCH_FN(embedding_autograd));
  // The vocab backward is only called from a backward: no autograd of its own.
  static auto* below =
      new torch::Library(torch::Library::IMPL, "hypershard", c10::DispatchKey::AutogradPrivateUse2, __FILE__, __LINE__);
  below->impl("embedding_vocab_backward", torch::CppFunction::makeFallthrough());
}

void register_embedding(Registry& r) {
  r.kernels(&register_embedding_kernels);
  // padding_idx, scale_grad_by_freq, sparse, num_weights and vocab_axes join the key.
  r.add("aten::embedding", &embedding_rule, KeyScalars::kAll);
  r.add("aten::embedding_dense_backward", &embedding_dense_backward_rule, KeyScalars::kAll);
  r.add("hypershard::embedding_vocab_backward", &embedding_vocab_backward_rule, KeyScalars::kAll);
}

}  // namespace hypershard::ops
