// Resampling along the trailing (spatial) dims: the pads that read their border from the input
// (F.pad's reflect / replicate modes) and upsampling (F.interpolate). Leading dims (batch,
// channels) keep their sharding and run locally.
//
//   pads        reflection_pad1d/2d/3d, replication_pad1d/2d/3d    the last 1/2/3 dims are padded;
//               and their _backward ops                           a padded dim sharded over ONE mesh
//                                                                 axis STAYS sharded: each rank
//                                                                 fetches the GLOBAL input positions
//                                                                 its output block reads (reflect:
//                                                                 the mirrored range near an edge;
//                                                                 replicate: the edge position) in
//                                                                 one all-to-all per such dim
//                                                                 (runtime/span_exchange.h) and
//                                                                 picks them locally; the backward
//                                                                 sums the picked gradients and
//                                                                 sends them back to their owners
//                                                                 (return_spans_summed). A padded
//                                                                 dim sharded over two axes is made
//                                                                 whole
//   upsampling  upsample_nearest1d/2d/3d, _upsample_nearest_exact1d/2d/3d, upsample_linear1d,
//               upsample_bilinear2d, upsample_bicubic2d, upsample_trilinear3d,
//               _upsample_bilinear2d_aa, _upsample_bicubic2d_aa, and their _backward ops: the
//               last 1/2/3 dims (spatial) whole, gathered where sharded -- an output position
//               reads a window whose place depends on the scale, the align_corners flag and (aa)
//               the support of the filter. The local call gets the caller's output_size and
//               scales unchanged (its spatial dims are the global ones); a backward's input_size
//               is rewritten to this rank's block (OpPlan::local_shape_arg)
//   area        _adaptive_avg_pool3d and its backward (F.interpolate(mode="area") on 3 spatial
//               dims; the 1-d and 2-d areas reach _adaptive_avg_pool2d, along_dims.cpp): the
//               last 3 dims whole, like the upsampling
//
// The .vec overloads (output_size or scale_factors) and F.pad's circular mode (_pad_circular) are
// composite in torch: they decompose before reaching hypershard (into the ops above; circular
// into narrow and cat, which have rules of their own).
//
// Partial:
//   pad forward        every Partial passes: each output element is a COPY of one input element,
//                      and copying commutes with any elementwise reduction of the parts
//   pad backward,      linear in their tensor input (each output is a fixed weighted sum of input
//   upsampling, area   elements: the weights depend on positions only), so a sum/avg Partial
//                      passes; a max/min Partial is reduced first (exact). The input of a backward
//                      that is read for its shape only (area backward's self) is never Partial
//
// An uneven shard can leave a rank an empty block (3 channels over 4 ranks), which torch's
// kernels refuse; where some rank's block is empty the plan makes that rank's (empty) results
// itself (skip_empty_blocks, op_call.h), no collective involved.
//
// Not covered: a padded dim sharded over two mesh axes is made whole instead of exchanged; the
// upsampling ops always gather a sharded spatial dim (a halo exchange would do, but the halo's
// width depends on the mode and scale). (The 3-d pools: spatial.cpp.)
#include <ATen/ATen.h>

#include <algorithm>

#include "ops/families.h"
#include "runtime/span_exchange.h"

namespace hypershard::ops {
namespace {

using runtime::Span;
using runtime::SpanPlan;

// ------------------------------------------------------------------ pads

enum class Pad : int8_t { kReflect, kReplicate };

// The GLOBAL input position output position `p` of a dim of `n` positions padded by `left` reads.
int64_t pad_source(Pad mode, int64_t p, int64_t left, int64_t n) {
  const int64_t i = p - left;
  if (mode == Pad::kReplicate) return std::clamp<int64_t>(i, 0, n - 1);
  if (i < 0) return -i;  // reflect: the edge itself is not repeated
  if (i >= n) return 2 * (n - 1) - i;
  return i;
}

// One padded dim: where it is, its padding before position 0, its unpadded length.
struct PaddedDim {
  int64_t dim = 0;
  int64_t left = 0;
  int64_t in_length = 0;
};

// The padded dims (the last padding.size() / 2, the last dim first in `padding`) of a tensor whose
// unpadded shape is `in_shape`.
std::vector<PaddedDim> padded_dims(const OpCall& call, const std::vector<int64_t>& in_shape) {
  const auto padding = int_list(call.arg(call.arg_index("padding")));
  const int64_t n = static_cast<int64_t>(in_shape.size()), k = static_cast<int64_t>(padding.size()) / 2;
  // torch's kernels take a batch of channels (k + 2 dims) or the channels alone (k + 1)
  if (n != k + 1 && n != k + 2)
    fail_call(call, layout::str_cat("a ", k, "-d pad needs a ", k + 1, "-d or ", k + 2, "-d input, not ", n, "-d"));
  std::vector<PaddedDim> out;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t d = n - 1 - j;
    out.push_back({d, padding[2 * j], in_shape[d]});
  }
  return out;
}

// This rank's (and every member's) view of one exchanged dim: member c's output block reads the
// distinct GLOBAL input positions `wanted[c]` (sorted, merged into spans); `index` maps each
// position of this rank's output block to its place in the concatenation of its wanted spans.
struct PadExchange {
  SpanPlan plan;
  std::vector<int64_t> index;
};

PadExchange pad_exchange(Pad mode, const PaddedDim& pd, const Layout& in, const Layout& out,
                         const runtime::DeviceMesh& mesh) {
  PadExchange ex;
  ex.plan = runtime::owned_spans(in, mesh, pd.dim);
  const int64_t axis = ex.plan.axis, me = mesh.coordinate(axis);
  for (int64_t c = 0; c < static_cast<int64_t>(ex.plan.owned.size()); ++c) {
    const Span block = runtime::member_span(out, mesh, axis, c, pd.dim);
    std::vector<int64_t> sources;
    for (int64_t p = block.begin; p < block.end; ++p) sources.push_back(pad_source(mode, p, pd.left, pd.in_length));
    std::vector<int64_t> distinct = sources;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    std::vector<Span> spans;
    for (int64_t s : distinct) {
      if (!spans.empty() && spans.back().end == s)
        ++spans.back().end;
      else
        spans.push_back({s, s + 1});
    }
    if (c == me) {
      for (int64_t s : sources) {  // the place of s in the concatenated spans
        int64_t place = 0;
        for (const Span& span : spans) {
          if (s >= span.begin && s < span.end) {
            place += s - span.begin;
            break;
          }
          place += span.length();
        }
        ex.index.push_back(place);
      }
    }
    ex.plan.wanted.push_back(std::move(spans));
  }
  return ex;
}

at::Tensor index_tensor(const std::vector<int64_t>& index, const at::Tensor& like) {
  return at::tensor(index, like.options().dtype(at::kLong));
}

// The GLOBAL sources of a whole padded dim, output position by output position.
std::vector<int64_t> whole_sources(Pad mode, const PaddedDim& pd, int64_t out_length) {
  std::vector<int64_t> sources;
  for (int64_t p = 0; p < out_length; ++p) sources.push_back(pad_source(mode, p, pd.left, pd.in_length));
  return sources;
}

// reflection_pad*d / replication_pad*d (self, padding) and their backward ops (grad_output, self,
// padding). `in` is the unpadded tensor's planned layout, `out` the padded one's.
template <Pad M, bool kBackward>
OpPlan pad_rule(const OpCall& call) {
  const Layout& first = call.layout(0);  // self, or grad_output (padded)
  const int64_t self = kBackward ? 1 : 0;
  const Layout& unpadded = call.layout(self);
  const std::vector<int64_t> in_shape = unpadded.global_shape();
  const auto pads = padded_dims(call, in_shape);
  const auto shapes = meta_output_shapes(call);  // torch's own argument checks, on every rank alike
  const std::vector<int64_t> out_shape = kBackward ? first.global_shape() : shapes.at(0);
  if (static_cast<int64_t>(out_shape.size()) != unpadded.ndim())
    fail_call(call, "the padded tensor's rank differs from the unpadded one's");

  // Every dim keeps the sharding of the tensor the op reads; a padded dim over two axes is whole.
  layout::DimAxes dims = first.dim_axes();
  bool exchanges = false;
  for (const PaddedDim& pd : pads) {
    auto& axes = dims[pd.dim];
    if (axes.size() > 1 || pd.in_length == 0 || out_shape[pd.dim] == 0) axes.clear();
    exchanges = exchanges || !axes.empty();
  }
  layout::PartialOps partial = first.partial();
  if (kBackward) {  // linear: a sum/avg Partial grad_output passes, max/min is reduced first
    if (const auto op = first.partial_op(); op && !is_sum_like(*op)) partial.assign(partial.size(), std::nullopt);
  }
  const LayoutPtr in = make_layout(unpadded, in_shape, dims, kBackward ? partial : first.partial());
  const LayoutPtr out = make_layout(first, out_shape, dims, partial);
  OpPlan plan;
  if (kBackward) {
    plan.inputs = {out, make_layout(unpadded, in_shape, dims, {})};
    plan.outputs = {in};
  } else {
    plan.inputs = {in};
    plan.outputs = {out};
  }
  if (!exchanges) {  // the padded dims are whole: torch's own kernel on the blocks
    skip_empty_blocks(plan);
    return plan;
  }

  // Each padded dim's work, made with the plan (the padding is in its key): an exchanged dim's
  // spans and this block's places in them, a whole dim's GLOBAL sources.
  struct PadStep {
    PaddedDim pd;
    bool exchange = false;
    PadExchange ex;
    int64_t fetched_length = 0;    // exchange: this rank's wanted positions
    std::vector<int64_t> sources;  // whole: each output position's source
  };
  std::vector<PadStep> steps;
  for (const PaddedDim& pd : pads) {
    PadStep step{pd};
    step.exchange = dim_parts(*in, pd.dim) > 1;
    if (step.exchange) {
      step.ex = pad_exchange(M, pd, *in, *out, *call.mesh);
      for (const Span& w : step.ex.plan.wanted[call.mesh->coordinate(step.ex.plan.axis)])
        step.fetched_length += w.length();
    } else {
      step.sources = whole_sources(M, pd, out->global_shape()[pd.dim]);
    }
    steps.push_back(std::move(step));
  }
  plan.expand = [steps, in](const OpCall& c, torch::jit::Stack& stack) {
    const size_t num = c.schema().arguments().size();
    c10::IValue* args = stack.data() + (stack.size() - num);
    at::Tensor local = args[0].toTensor();
    const runtime::DeviceMesh& mesh = *c.mesh;
    if (!kBackward) {
      // Each padded dim in turn: pick the block's sources (fetched first where the dim is sharded).
      for (const PadStep& step : steps) {
        const int64_t d = step.pd.dim;
        if (step.exchange) {
          const at::Tensor fetched = runtime::fetch_spans(local, step.ex.plan, mesh);
          local = fetched.index_select(d, index_tensor(step.ex.index, fetched));
        } else {
          local = local.index_select(d, index_tensor(step.sources, local));
        }
      }
    } else {
      // The adjoint, dim by dim: the gradient of every output position is added to its source;
      // for a sharded dim on the fetched positions, then summed at their owners.
      const auto in_local = in->local_shape_at(mesh.position());
      for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
        const int64_t d = it->pd.dim;
        auto shape = local.sizes().vec();
        if (it->exchange) {
          shape[d] = it->fetched_length;
          const at::Tensor summed =
              at::zeros(shape, local.options()).index_add_(d, index_tensor(it->ex.index, local), local);
          local = runtime::return_spans_summed(summed, in_local[d], it->ex.plan, mesh);
        } else {
          shape[d] = it->pd.in_length;
          local = at::zeros(shape, local.options()).index_add_(d, index_tensor(it->sources, local), local);
        }
      }
    }
    torch::jit::drop(stack, num);
    stack.emplace_back(local.contiguous());
  };
  return plan;
}

// ------------------------------------------------------------------ upsampling and area

// The last K dims (spatial) whole, every leading dim keeps the first tensor's sharding; other
// tensor arguments of its rank (area backward's self) follow it on the leading dims. A
// backward's input_size becomes this rank's block.
template <int K>
OpPlan spatial_rule(const OpCall& call) {
  const Layout& first = call.layout(0);
  const int64_t n = first.ndim();
  if (n < K) fail_call(call, layout::str_cat("needs at least ", K, " dims"));
  layout::DimAxes dims = first.dim_axes();
  for (int64_t d = n - K; d < n; ++d) dims[d].clear();
  layout::PartialOps partial = first.partial();
  if (const auto op = first.partial_op(); op && !is_sum_like(*op)) partial.assign(partial.size(), std::nullopt);
  const auto shapes = meta_output_shapes(call);
  OpPlan plan;
  plan.inputs.push_back(make_layout(first, first.global_shape(), dims, partial));
  for (size_t t = 1; t < call.tensors.size(); ++t) {
    const Layout& other = call.layout(static_cast<int64_t>(t));
    layout::DimAxes other_dims(static_cast<size_t>(other.ndim()));
    if (other.ndim() == n)
      for (int64_t d = 0; d < n - K; ++d)
        if (other.global_shape()[d] == first.global_shape()[d]) other_dims[d] = dims[d];
    plan.inputs.push_back(make_layout(other, other.global_shape(), std::move(other_dims), {}));
  }
  for (const auto& shape : shapes) {
    if (static_cast<int64_t>(shape.size()) != n) fail_call(call, "the result's rank differs from the input's");
    layout::DimAxes out_dims(static_cast<size_t>(n));
    for (int64_t d = 0; d < n - K; ++d)
      if (shape[d] == first.global_shape()[d]) out_dims[d] = dims[d];
    plan.outputs.push_back(make_layout(first, shape, std::move(out_dims), partial));
  }
  if (call.schema().argumentIndexWithName("input_size")) plan.local_shape_arg = call.arg_index("input_size");
  skip_empty_blocks(plan);
  return plan;
}

struct PadRow {
  const char* name;
  Rule rule;
};

struct SpatialRow {
  const char* name;  // forward op; "<name>_backward" is registered alongside
  Rule rule;
};

}  // namespace

void register_resampling(Registry& r) {
  const PadRow pads[] = {
      {"aten::reflection_pad1d", &pad_rule<Pad::kReflect, false>},
      {"aten::reflection_pad1d_backward", &pad_rule<Pad::kReflect, true>},
      {"aten::reflection_pad2d", &pad_rule<Pad::kReflect, false>},
      {"aten::reflection_pad2d_backward", &pad_rule<Pad::kReflect, true>},
      {"aten::reflection_pad3d", &pad_rule<Pad::kReflect, false>},
      {"aten::reflection_pad3d_backward", &pad_rule<Pad::kReflect, true>},
      {"aten::replication_pad1d", &pad_rule<Pad::kReplicate, false>},
      {"aten::replication_pad1d_backward", &pad_rule<Pad::kReplicate, true>},
      {"aten::replication_pad2d", &pad_rule<Pad::kReplicate, false>},
      {"aten::replication_pad2d_backward", &pad_rule<Pad::kReplicate, true>},
      {"aten::replication_pad3d", &pad_rule<Pad::kReplicate, false>},
      {"aten::replication_pad3d_backward", &pad_rule<Pad::kReplicate, true>},
  };
  // The padding and the sizes/scales change the plan (the output shape, the exchanged spans).
  for (const PadRow& row : pads) r.add(row.name, row.rule, KeyScalars::kAll);
  const SpatialRow spatial[] = {
      {"aten::_adaptive_avg_pool3d", &spatial_rule<3>},      {"aten::_upsample_bicubic2d_aa", &spatial_rule<2>},
      {"aten::_upsample_bilinear2d_aa", &spatial_rule<2>},   {"aten::_upsample_nearest_exact1d", &spatial_rule<1>},
      {"aten::_upsample_nearest_exact2d", &spatial_rule<2>}, {"aten::_upsample_nearest_exact3d", &spatial_rule<3>},
      {"aten::upsample_bicubic2d", &spatial_rule<2>},        {"aten::upsample_bilinear2d", &spatial_rule<2>},
      {"aten::upsample_linear1d", &spatial_rule<1>},         {"aten::upsample_nearest1d", &spatial_rule<1>},
      {"aten::upsample_nearest2d", &spatial_rule<2>},        {"aten::upsample_nearest3d", &spatial_rule<3>},
      {"aten::upsample_trilinear3d", &spatial_rule<3>},
  };
  for (const SpatialRow& row : spatial) {
    r.add(row.name, row.rule, KeyScalars::kAll);
    r.add(std::string(row.name) + "_backward", row.rule, KeyScalars::kAll);
  }
}

}  // namespace hypershard::ops
