// Matrix products: one einsum-style rule for every op of the family, each op a spec.
//
//   aten::mm.default         "mk,kn->mn"
//   aten::bmm.default        "bmk,bkn->bmn"
//   aten::mv.default         "mk,k->m"
//   aten::dot.default        "k,k->"
//   aten::addmm.default      self + "mk,kn->mn"      (self broadcast to the result)
//   aten::baddbmm.default    self + "bmk,bkn->bmn"
//   aten::addmv.default      self + "mk,k->m"
//   aten::addr.default       self + "m,n->mn"         (an outer product)
//   aten::addbmm.default     self + "bmk,bkn->mn"     (the batch summed: b is contracted)
//   aten::vdot.default       "k,k->"                  (dot, the first operand conjugated)
//   aten::_grouped_mm        grouped products with offs (see the grouped section below), also
//                            transformers::grouped_mm_fallback
// matmul, linear and einsum reach these after view, _unsafe_view, expand, t, transpose.int,
// permute, unsqueeze and squeeze (views.cpp); their backward needs mm/bmm on transposes, mul
// (mv, dot) and, for a broadcast bias, sum.dim_IntList (the reduction family).
//
// Sharding, decided per mesh axis (one role per axis):
//   shard a kept label   (batch b, free m/n) the operands that carry the label are sharded
//                        alike, the others Replicate; the result is sharded the same way.
//   shard a contracted   (k) every operand carrying k is sharded alike (same axes, same order:
//                        then the local chunks of k match, also when uneven or empty); the
//                        local product is one term of the global sum: Partial(sum) result.
//   carry a Partial      ONE operand Partial(sum|avg), the others Replicate on that axis: the
//                        result is Partial with the same op.
//   replicate            everything whole on that axis.
// The roles each input suggests (its sharded dim's label, its Partial) are the candidates; a
// zero-redistribution match is taken at once, otherwise every combination of the axes'
// candidates is costed (elements moved by the redistributions, cached_plan) and the cheapest
// wins (ties: fewer inputs redistributed, then fewer Partial result axes). Nothing is gathered
// when a cheaper combination exists.
//
// Partial algebra (why each row holds):
//   bilinear  a product with ONE sum/avg-Partial operand stays Partial with that op:
//             (sum_i a_i) b = sum_i (a_i b). Two Partial operands on the same axis would give
//             (sum_i a_i)(sum_j b_j) != sum_i a_i b_i, so one of them (the cheaper) is reduced
//             first; Partials on DIFFERENT axes are fine (sum_ij a_i b_j = (sum a)(sum b)).
//   one op    a contracted shard gives Partial(sum); it cannot meet a carried Partial(avg) on
//             another axis (a layout has one Partial op), so such combinations are skipped.
//   bias      self + a@b is Partial(op) only when self is Partial(op) on the same axes: a
//             Replicate self is filled for free (sum: rank 0 keeps it, the others hold 0), as
//             add does. A Partial self with a non-Partial product keeps its Partial too: one
//             operand (the cheaper, mat1 on a tie) is filled the same way, so the result is
//             Partial (the algebra of add; alpha and beta scale every part alike).
//   other     max/min/prod-Partial operands are not bilinear: they are reduced first (an exact
//             all-reduce), never passed through.
// mm.out writes the product into out's own layout (below). Excluded: the other out= and
// in-place variants (addmm_, baddbmm_, bmm.out, ...) and ger:
// neither the target models nor autograd reach them (a Missing operator error names them).
#include <algorithm>
#include <array>

#include "kernels/kernels.h"
#include "ops/families.h"
#include "ops/sharding_search.h"
#include "runtime/redistribute.h"

namespace hypershard::ops {
namespace {

// The product's operands as factors (sharding_search.h): each matrix operand is linear (it may
// carry its own Partial), the bias is additive; '.' (kWhole) marks a size-1 bias dim broadcast
// to the result.
struct EinsumSpec {
  const char* equation;    // "mk,kn->mn"
  bool bias;               // schema argument 0 is added to the result (broadcast to it)
  const char* whole = "";  // labels never sharded (a grouped dim: offs index it globally)
};

constexpr EinsumSpec kMm{"mk,kn->mn", false};
constexpr EinsumSpec kBmm{"bmk,bkn->bmn", false};
constexpr EinsumSpec kMv{"mk,k->m", false};
constexpr EinsumSpec kDot{"k,k->", false};
constexpr EinsumSpec kAddr{"m,n->mn", true};
constexpr EinsumSpec kAddbmm{"bmk,bkn->mn", true};
constexpr EinsumSpec kAddmm{"mk,kn->mn", true};
constexpr EinsumSpec kBaddbmm{"bmk,bkn->bmn", true};
constexpr EinsumSpec kAddmv{"mk,k->m", true};

// `result_only`: the sizes of labels that only the result carries (the groups of a grouped
// product's weight gradient), which no operand can tell.
using LabelSizes = std::vector<std::pair<char, int64_t>>;

// The call seen through its spec: the operands first, then the bias, each with its labels;
// the sizes of each label checked across operands.
FactorSpec bind(const OpCall& call, const EinsumSpec& spec, const LabelSizes& result_only = {}) {
  const std::string eq = spec.equation;
  const auto arrow = eq.find("->");
  FactorSpec f;
  f.outputs = {eq.substr(arrow + 2)};
  f.whole = spec.whole;
  const int64_t first = spec.bias ? 1 : 0;
  for (size_t begin = 0; begin < arrow;) {
    const size_t comma = std::min(eq.find(',', begin), arrow);
    const int64_t t = call.tensor_index(first + static_cast<int64_t>(f.operands.size()));
    f.operands.push_back({t, eq.substr(begin, comma - begin), /*linear=*/true});
    begin = comma + 1;
  }
  const int64_t bias = spec.bias ? call.tensor_index(0) : 0;
  for (const auto& operand : f.operands)
    if (operand.tensor < 0 || bias < 0) fail_call(call, "internal error: a matrix operand is missing");

  std::array<int64_t, 128> size;
  size.fill(-1);
  for (const auto& operand : f.operands) {
    const auto& shape = call.layout(operand.tensor).global_shape();
    const auto& labels = operand.labels;
    if (shape.size() != labels.size())
      fail_argument(call, operand.tensor, "has " + std::to_string(shape.size()) + " dims",
                    std::to_string(labels.size()) + " dims (\"" + eq + "\")");
    for (size_t d = 0; d < labels.size(); ++d) {
      int64_t& s = size[static_cast<unsigned char>(labels[d])];
      if (s >= 0 && s != shape[d])
        fail_argument(call, operand.tensor,
                      std::string("size ") + std::to_string(shape[d]) + " of dim '" + labels[d] + "' differs from " +
                          std::to_string(s) + " in another operand",
                      "equal sizes per label of \"" + eq + "\"");
      s = shape[d];
    }
  }
  for (const auto& [label, n] : result_only) size[static_cast<unsigned char>(label)] = n;
  const std::string& output = f.outputs[0];
  std::vector<int64_t> out_shape;
  for (char c : output) out_shape.push_back(size[static_cast<unsigned char>(c)]);
  if (spec.bias) {
    const auto& shape = call.layout(bias).global_shape();
    const int64_t n = static_cast<int64_t>(out_shape.size()), m = static_cast<int64_t>(shape.size());
    std::string labels;
    for (int64_t d = 0; d < m; ++d) {
      const int64_t o = n - m + d;
      if (o >= 0 && shape[d] == out_shape[o])
        labels += output[o];
      else if (o >= 0 && shape[d] == 1)
        labels += kWhole;
      else
        fail_argument(call, bias,
                      "shape " + layout::shape_string(shape) + " does not broadcast to the result " +
                          layout::shape_string(out_shape),
                      "a shape that broadcasts to the result");
    }
    f.operands.push_back({bias, labels, /*linear=*/false, /*additive=*/true});
  }
  f.out_shapes = {std::move(out_shape)};
  return f;
}

OpPlan einsum_plan(const OpCall& call, const EinsumSpec& spec, const LabelSizes& result_only = {}) {
  return plan_from_factors(call, bind(call, spec, result_only));
}

template <const EinsumSpec& Spec>
OpPlan einsum_rule(const OpCall& call) {
  return einsum_plan(call, Spec);
}

// mm.out(self, mat2, *, out): mm's plan computed into a temporary that is redistributed to out's
// own layout and copied into out's local: out keeps its layout and, when it is a view (HF's
// grouped_mm_fallback writes into row slices of a gradient), its base sees the values.
OpPlan mm_out_rule(const OpCall& call) {
  OpPlan plan = einsum_plan(call, kMm);
  const int64_t out = call.tensor_named({"out"});
  const LayoutPtr product = plan.outputs.at(0), target = call.tensors[out].layout;
  if (target->global_shape() != product->global_shape())
    fail_argument(call, out, "shape differs from the product's " + layout::shape_string(product->global_shape()),
                  "an out of the product's shape (hypershard does not resize a DTensor out=)");
  plan.outputs = {target};
  plan.expand = [product, target](const OpCall& c, torch::jit::Stack& stack) {
    const size_t n = c.schema().arguments().size();
    const c10::IValue* args = stack.data() + (stack.size() - n);
    at::Tensor result = at::mm(args[0].toTensor(), args[1].toTensor());
    if (product != target) result = runtime::redistribute_local(result, product, target, *c.mesh);
    at::Tensor local_out = args[c.arg_index("out")].toTensor();
    local_out.copy_(result);
    torch::jit::drop(stack, n);
    stack.emplace_back(std::move(local_out));
  };
  return plan;
}

// ------------------------------------------------------------------ grouped matrix products

// _grouped_mm(self, mat2, offs?, bias?, out_dtype?) and transformers::grouped_mm_fallback(input,
// weight, offs): offs holds the GLOBAL cumulative row counts of the groups (experts).
//   2d x 3d + offs  "mk,ekn->mn"   rows m in groups (whole); e sharded = expert parallelism: each
//                                  rank computes the rows of its experts, zeros elsewhere, a
//                                  Partial(sum) result; k sharded: Partial(sum); n free (colwise)
//   2d x 2d + offs  "km,mn->ekn"   the weight gradient: the contracted m in groups (whole); k, n
//                                  free; e (a result-only dim) whole: every group computed
//   3d x 3d         "bmk,bkn->bmn" the batched product (bmm's rule)
// offs and the groups' data-dependent sizes are read on every rank alike (offs is whole; an
// integer Partial(sum) offs is reduced first). The local product is hypershard::grouped_mm_local
// (csrc/kernels/grouped_mm.cpp): a loop of mm over the rank's groups, as one op a traced program
// can hold (the group sizes are values).
constexpr EinsumSpec kGroupedRows{"mk,ekn->mn", false, "m"};
constexpr EinsumSpec kGroupedContraction{"km,mn->ekn", false, "me"};
constexpr EinsumSpec kGroupedBatch{"bmk,bkn->bmn", false};

OpPlan grouped_mm_rule(const OpCall& call) {
  const int64_t self = call.tensor_named({"self", "input"}), mat2 = call.tensor_named({"mat2", "weight"});
  const int64_t offs = call.tensor_named({"offs"}), bias = call.tensor_named({"bias"});
  if (bias >= 0) not_covered(call, "a bias");
  const int64_t a = call.layout(self).ndim(), b = call.layout(mat2).ndim();
  const EinsumSpec* spec = nullptr;
  if (offs >= 0 && a == 2 && b == 3)
    spec = &kGroupedRows;
  else if (offs >= 0 && a == 2 && b == 2)
    spec = &kGroupedContraction;
  else if (offs < 0 && a == 3 && b == 3)
    spec = &kGroupedBatch;
  else
    not_covered(call, layout::str_cat("a ", a, "-d by ", b, "-d product", offs >= 0 ? " with offs" : " without offs"));
  if (offs >= 0) {
    const Layout& o = call.layout(offs);
    const int64_t groups = spec == &kGroupedRows ? call.layout(mat2).global_shape()[0] : -1;
    if (o.ndim() != 1 || (groups >= 0 && o.global_shape()[0] != groups))
      fail_argument(call, offs, "shape " + layout::shape_string(o.global_shape()),
                    "a 1-d offs with one entry per group");
    // Integer counts summed over ranks (histc of a sharded list of expert ids, then cumsum: HF's
    // MoE after a sort that kept the tokens sharded) are reduced first, as every integer
    // sum-Partial is: data-dependent control, not an activation missing its reduction.
    if (const auto op = o.partial_op();
        op && !(is_sum_like(*op) && c10::isIntegralType(call.tensors[offs].dtype, /*includeBool=*/false)))
      fail_argument(call, offs, "is Partial", "offs Replicate (whole cumulative counts)");
  }
  LabelSizes groups;
  if (spec == &kGroupedContraction) groups.emplace_back('e', call.layout(offs).global_shape()[0]);
  OpPlan plan = einsum_plan(call, *spec, groups);
  if (offs < 0) return plan;
  plan.inputs[offs] = replicate_like(call.layout(offs), call.layout(offs).global_shape());
  // The rank's first expert: the weight's dim 0 may be sharded (expert parallelism).
  const LayoutPtr weight = plan.inputs[mat2];
  const bool rows = spec == &kGroupedRows;
  plan.expand = [weight, rows](const OpCall& c, torch::jit::Stack& stack) {
    static const auto local_op = c10::Dispatcher::singleton()
                                     .findSchemaOrThrow("hypershard::grouped_mm_local", "")
                                     .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                       std::optional<at::ScalarType>)>();
    const size_t n = c.schema().arguments().size();
    const c10::IValue* args = stack.data() + (stack.size() - n);
    std::optional<at::ScalarType> dtype;
    if (const auto i = c.schema().argumentIndexWithName("out_dtype"); i && !args[*i].isNone())
      dtype = args[*i].toScalarType();
    const int64_t first = rows ? weight->global_offset_at(c.mesh->position())[0] : 0;
    at::Tensor out = local_op.call(args[0].toTensor(), args[1].toTensor(), args[2].toTensor(), first, dtype);
    torch::jit::drop(stack, n);
    stack.emplace_back(std::move(out));
  };
  return plan;
}

}  // namespace

void register_matmul(Registry& r) {
  // alpha and beta scale values only: they never change a layout.
  r.add("aten::addmm", &einsum_rule<kAddmm>, KeyScalars::kNone);
  r.add("aten::addmv", &einsum_rule<kAddmv>, KeyScalars::kNone);
  r.add("aten::baddbmm", &einsum_rule<kBaddbmm>, KeyScalars::kNone);
  r.add("aten::bmm", &einsum_rule<kBmm>, KeyScalars::kNone);
  r.add("aten::addbmm", &einsum_rule<kAddbmm>, KeyScalars::kNone);
  r.add("aten::addr", &einsum_rule<kAddr>, KeyScalars::kNone);
  r.add("aten::dot", &einsum_rule<kDot>, KeyScalars::kNone);
  r.add("aten::vdot", &einsum_rule<kDot>, KeyScalars::kNone);  // dot with the first conjugated
  r.add("aten::mm", &einsum_rule<kMm>, KeyScalars::kNone);
  r.add("aten::mm.out", &mm_out_rule, KeyScalars::kNone);
  r.add("aten::mv", &einsum_rule<kMv>, KeyScalars::kNone);
  // offs, bias and out_dtype: tensors or dtypes; no scalar changes a layout.
  r.add("aten::_grouped_mm", &grouped_mm_rule, KeyScalars::kNone);
  r.add("transformers::grouped_mm_fallback", &grouped_mm_rule, KeyScalars::kNone);
  r.kernels(&kernels::register_grouped_mm_kernels);
}

}  // namespace hypershard::ops
