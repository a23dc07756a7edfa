// Ops along a sharded dim that never gather it: each rank computes its own block of the result and
// exchanges only what that block depends on. Every other dim keeps its sharding too.
//
//   scans   cumsum, cumprod, logcumsumexp,    the local scan, then the totals of the chunks before
//           cummax, cummin                    this rank's folded into it: ONE all-gather of each
//                                             rank's last slice (for cummax/cummin its GLOBAL
//                                             index too) along the axes sharding `dim`
//   topk    topk (k, dim)                     the k best of each rank's block with GLOBAL indices,
//                                             one all-gather of these candidates, the k best of
//                                             them: values and indices whole along dim (the dim
//                                             gathered when candidates tie: torch's tie order)
//   sort    sort(.stable), argsort(.stable),  a sample sort: each rank sorts its block, k-1 regular
//           msort                             samples per row split the values into one bucket
//                                             per rank, one exchange sends each bucket to its
//                                             rank, one more moves each element to the rank whose
//                                             block holds its GLOBAL rank (sharded_sort): results
//                                             keep the input's sharding, nothing is gathered
//                                             (a non-stable sort with equal values: gathered, see
//                                             sharded_sort; of integers or bools: planned whole)
//   moves   flip (dims), roll (shifts, dims)  each rank fetches the GLOBAL range its block reads
//                                             (the mirrored range; the range `shift` before it,
//                                             cyclically) in one all-to-all per sharded dim
//                                             (runtime/span_exchange.h), then flips or rolls the
//                                             remaining dims locally
//
// Why the scans hold: scan(x)[i] for i in chunk j is op(total of chunks 0..j-1, local scan[i]),
// with op = + (cumsum), * (cumprod), logaddexp (logcumsumexp), and for cummax/cummin the later
// of two candidates on ties (torch takes the last index of an equal maximum, `>=`), a NaN
// winning over numbers (torch propagates NaN with the index of the last NaN). A chunk with no
// elements (uneven shards) is skipped. Values equal one device's up to the association of the
// additions or multiplications (rounding only); indices are exact.
// Where a scan or move does not apply -- the dim sharded over two mesh axes (moves), a complex
// logcumsumexp, roll over the flattened tensor (no dims) -- the dim is made whole, as the
// along-dims family does.
//
// cummaxmin_backward (autograd level): torch's composite writes into a plain tensor; the kernel
// here scatter-adds into zeros like the input instead.
//
// Partial: cumsum, flip and roll are linear (they add or move elements), so a sum/avg Partial
// passes through -- the exchanged totals and ranges are Partial alike. cumprod, logcumsumexp,
// cummax, cummin, topk and sort are not: a sum/avg Partial input is an error (default mode reduces it
// first; inside a backward pass it is reduced); a max/min Partial is reduced.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <c10/util/accumulate.h>

#include <algorithm>
#include <limits>

#include "ops/families.h"
#include "ops/partial.h"
#include "runtime/redistribute.h"
#include "runtime/span_exchange.h"

namespace hypershard::ops {
namespace {

using runtime::Span;
using runtime::SpanPlan;

enum class Scan : int8_t { kSum, kProd, kLogSumExp, kMax, kMin };

// The input's layout with the Partial a non-linear op cannot take dropped (reduced first); a
// sum/avg Partial into a non-linear op is refused in forward code.
layout::PartialOps kept_partial(const OpCall& call, bool linear) {
  const Layout& in = call.layout(0);
  const auto op = in.partial_op();
  if (linear && op && is_sum_like(*op)) return in.partial();
  if (refuse_sum_partial(call, 0, redistribute_partial_first())) return layout::PartialOps(in.partial().size());
  return in.partial();
}

// ------------------------------------------------------------------ scans

// What a scan along a sharded dim needs of the layout on this rank, made with the plan: the axes
// sharding the dim, the GLOBAL offset of this rank's block, and the chunks before it that hold
// elements (an empty chunk of uneven shards has no total to fold in).
struct ScanFold {
  std::vector<int64_t> axes;
  int64_t offset = 0;
  std::vector<int64_t> earlier;
};

ScanFold scan_fold(const Layout& l, const runtime::DeviceMesh& mesh, int64_t dim) {
  ScanFold fold;
  fold.axes = l.dim_axes()[dim];
  fold.offset = l.global_offset_at(mesh.position())[dim];
  const int64_t mine = mesh.chunk_index(fold.axes);
  for (int64_t j = 0; j < mine; ++j)
    if (l.local_shape_at(mesh.chunk_member_position(fold.axes, j))[dim] > 0) fold.earlier.push_back(j);
  return fold;
}

// Folds the chunk totals before this rank's into its local scan (the stack holds the op's
// returns: the values, and for cummax/cummin the local indices).
void fold_scan_totals(Scan scan, const OpCall& call, const ScanFold& fold, int64_t dim, torch::jit::Stack& stack) {
  const runtime::DeviceMesh& mesh = *call.mesh;
  const auto& axes = fold.axes;
  const bool indexed = scan == Scan::kMax || scan == Scan::kMin;
  at::Tensor values = stack[stack.size() - (indexed ? 2 : 1)].toTensor();
  at::Tensor indices = indexed ? stack.back().toTensor() : at::Tensor();
  const int64_t length = values.size(dim);
  if (indexed) indices.add_(fold.offset);  // local -> GLOBAL
  // Each rank's last slice (zeros for an empty block: skipped below, its length is known).
  auto last = [&](const at::Tensor& t) {
    if (length > 0) return t.narrow(dim, length - 1, 1).contiguous();
    auto shape = t.sizes().vec();
    shape[dim] = 1;
    return at::zeros(shape, t.options());
  };
  const at::Tensor totals = runtime::all_gather_in_chunk_order(last(values), mesh, axes, dim);
  const at::Tensor total_indices =
      indexed ? runtime::all_gather_in_chunk_order(last(indices), mesh, axes, dim) : at::Tensor();
  // Is `candidate` (later in the dim) the scan's pick over `current`?
  auto later_wins = [&](const at::Tensor& candidate, const at::Tensor& current) {
    const at::Tensor better = scan == Scan::kMax ? candidate.ge(current) : candidate.le(current);
    return better.logical_or(at::isnan(candidate));
  };
  at::Tensor prefix, prefix_indices;
  for (const int64_t j : fold.earlier) {
    const at::Tensor total = totals.narrow(dim, j, 1);
    if (!prefix.defined()) {
      prefix = total;
      if (indexed) prefix_indices = total_indices.narrow(dim, j, 1);
      continue;
    }
    switch (scan) {
      case Scan::kSum:
        prefix = prefix + total;
        break;
      case Scan::kProd:
        prefix = prefix * total;
        break;
      case Scan::kLogSumExp:
        prefix = at::logaddexp(prefix, total);
        break;
      case Scan::kMax:
      case Scan::kMin: {
        const at::Tensor take = later_wins(total, prefix);
        prefix = at::where(take, total, prefix);
        prefix_indices = at::where(take, total_indices.narrow(dim, j, 1), prefix_indices);
        break;
      }
    }
  }
  if (!prefix.defined() || length == 0) return;
  switch (scan) {
    case Scan::kSum:
      values.add_(prefix);
      break;
    case Scan::kProd:
      values.mul_(prefix);
      break;
    case Scan::kLogSumExp:
      values.copy_(at::logaddexp(prefix, values));
      break;
    case Scan::kMax:
    case Scan::kMin: {
      const at::Tensor keep = later_wins(values, prefix);
      values.copy_(at::where(keep, values, prefix));
      indices.copy_(at::where(keep, indices, prefix_indices));
      break;
    }
  }
}

template <Scan S>
OpPlan scan_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const bool linear = S == Scan::kSum;
  const layout::PartialOps partial = kept_partial(call, linear);
  const int64_t dim = in.ndim() == 0 ? 0 : wrap_dim(call, call.arg(1).toInt(), in.ndim());
  layout::DimAxes dims = in.dim_axes();
  // complex logcumsumexp: no complex logaddexp to fold with; the dim is made whole
  if (S == Scan::kLogSumExp && in.ndim() > 0 && c10::isComplexType(call.tensors[0].dtype)) dims[dim].clear();
  OpPlan plan;
  plan.inputs.push_back(make_layout(in, in.global_shape(), dims, partial));
  plan.outputs.push_back(plan.inputs[0]);
  if (S == Scan::kMax || S == Scan::kMin) plan.outputs.push_back(make_layout(in, in.global_shape(), dims, {}));
  if (in.ndim() > 0 && dim_parts(*plan.inputs[0], dim) > 1) {
    plan.expand = [fold = scan_fold(*plan.inputs[0], *call.mesh, dim), dim](const OpCall& c, torch::jit::Stack& stack) {
      c.op->callBoxed(stack);
      fold_scan_totals(S, c, fold, dim, stack);
    };
  }
  return plan;
}

// ------------------------------------------------------------------ flip and roll

// The spans of GLOBAL positions member c's block reads, for a flip or a roll by `shift`.
SpanPlan move_plan(const Layout& l, const runtime::DeviceMesh& mesh, int64_t dim, std::optional<int64_t> shift) {
  const int64_t n = l.global_shape()[dim];
  SpanPlan plan = runtime::owned_spans(l, mesh, dim);
  for (const Span& o : plan.owned) {
    if (!shift) {
      plan.wanted.push_back({{n - o.end, n - o.begin}});
      continue;
    }
    // out[i] = x[(i - shift) mod n]: a cyclic range, split where it wraps
    const int64_t begin = o.length() == 0 ? 0 : (((o.begin - *shift) % n) + n) % n;
    const int64_t first = std::min(o.length(), n - begin);
    std::vector<Span> spans{{begin, begin + first}};
    if (first < o.length()) spans.push_back({0, o.length() - first});
    plan.wanted.push_back(std::move(spans));
  }
  return plan;
}

// flip(self, dims) / roll(self, shifts, dims): the dims sharded over one mesh axis are exchanged
// (move_plan); a dim sharded over more is made whole; roll over every dim flattened (dims [])
// makes every dim whole.
OpPlan move_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const bool is_roll = call.schema().name() == "aten::roll";
  const layout::PartialOps partial = kept_partial(call, true);
  const int64_t dims_index = call.arg_index("dims");
  std::vector<int64_t> moved;
  for (int64_t d : call.arg(dims_index).toIntList())
    moved.push_back(wrap_dim(call, d, std::max<int64_t>(in.ndim(), 1)));
  layout::DimAxes dims = in.dim_axes();
  if (is_roll && moved.empty()) dims.assign(dims.size(), {});
  std::vector<int64_t> exchanged;  // positions in `moved`
  for (size_t i = 0; i < moved.size() && in.ndim() > 0; ++i) {
    auto& axes = dims[moved[i]];
    if (axes.size() > 1) axes.clear();
    if (axes.size() == 1 && dim_parts(in, moved[i]) > 1 && in.global_shape()[moved[i]] > 0)
      exchanged.push_back(static_cast<int64_t>(i));
  }
  OpPlan plan;
  plan.inputs.push_back(make_layout(in, in.global_shape(), dims, partial));
  plan.outputs.push_back(plan.inputs[0]);
  if (exchanged.empty()) return plan;
  // What each exchanged dim fetches, and what the local call still moves (a flip still reverses
  // a fetched block; a roll's fetched block is already in place): made with the plan, whose key
  // holds the shifts and dims.
  const std::vector<int64_t> shifts = is_roll ? int_list(call.arg(1)) : std::vector<int64_t>{};
  std::vector<SpanPlan> fetches;
  std::vector<int64_t> rest_dims, rest_shifts;
  for (size_t i = 0; i < moved.size(); ++i) {
    const bool exchange = std::find(exchanged.begin(), exchanged.end(), static_cast<int64_t>(i)) != exchanged.end();
    if (exchange)
      fetches.push_back(
          move_plan(*plan.inputs[0], *call.mesh, moved[i], is_roll ? std::optional<int64_t>(shifts[i]) : std::nullopt));
    if (!exchange || !is_roll) {
      rest_dims.push_back(moved[i]);
      if (is_roll) rest_shifts.push_back(shifts[i]);
    }
  }
  plan.expand = [fetches, rest_dims, rest_shifts, is_roll, dims_index](const OpCall& c, torch::jit::Stack& stack) {
    const size_t num = c.schema().arguments().size();
    c10::IValue* args = stack.data() + (stack.size() - num);
    at::Tensor local = args[0].toTensor();
    for (const SpanPlan& fetch : fetches) local = runtime::fetch_spans(local, fetch, *c.mesh);
    if (rest_dims.empty()) {                                             // a roll whose every dim was exchanged
      if (local.is_alias_of(args[0].toTensor())) local = local.clone();  // a roll by whole turns
      torch::jit::drop(stack, num);
      stack.emplace_back(std::move(local));
      return;
    }
    args[0] = local;
    args[dims_index] = c10::IValue(rest_dims);
    if (is_roll) args[1] = c10::IValue(rest_shifts);
    c.op->callBoxed(stack);
  };
  return plan;
}

// ------------------------------------------------------------------ topk

// Whether any two of the candidates along `dim` (of one slice) are equal, or any is NaN.
bool has_ties(const at::Tensor& candidates, int64_t dim) {
  if (candidates.size(dim) < 2) return false;
  const at::Tensor ordered = std::get<0>(candidates.sort(dim));
  const int64_t n = ordered.size(dim);
  return ordered.narrow(dim, 1, n - 1).eq(ordered.narrow(dim, 0, n - 1)).any().item<bool>() ||
         (candidates.is_floating_point() && at::isnan(candidates).any().item<bool>());
}

// topk(self, k, dim, largest, sorted). Along a sharded dim: each rank takes the k best of its
// block (all of it when shorter), with GLOBAL indices; ONE all-gather per axis sharding dim brings
// every rank's candidates (k per chunk, padded: each chunk's count is known from the layout, so
// the padding is cut before use); the k best of the candidates are the k best of the dim, since
// each of those is among the k best of its own chunk. Values and indices come out whole along
// dim (k positions), every other dim keeps its sharding. Along a whole dim the local call is the
// answer. Candidates with equal values (a masked row of -inf, say) fall back to gathering the dim:
// torch breaks such ties its own way, and one device's indices are the reference.
OpPlan topk_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const layout::PartialOps partial = kept_partial(call, false);
  const int64_t dim = in.ndim() == 0 ? 0 : wrap_dim(call, call.arg(2).toInt(), in.ndim());
  const auto shapes = meta_output_shapes(call);  // validates k against the GLOBAL length
  layout::DimAxes out_dims = in.dim_axes();
  std::vector<int64_t> axes;
  if (in.ndim() > 0) std::swap(axes, out_dims[dim]);
  // sorted=False: torch's kernel returns the k best in an order of its own; the dim is gathered
  const bool merge = in.ndim() > 0 && dim_parts(in, dim) > 1 && call.arg(4).toBool();
  OpPlan plan;
  plan.inputs.push_back(
      make_layout(in, in.global_shape(), merge ? in.dim_axes() : out_dims, layout::PartialOps(partial.size())));
  for (const auto& shape : shapes) plan.outputs.push_back(make_layout(in, shape, out_dims));
  if (!merge) return plan;
  const LayoutPtr layout = plan.inputs[0];
  const LayoutPtr whole_layout = make_layout(in, in.global_shape(), out_dims);
  plan.expand = [layout, whole_layout, axes, dim](const OpCall& c, torch::jit::Stack& stack) {
    const size_t num = c.schema().arguments().size();
    const at::Tensor local = stack[stack.size() - num].toTensor();
    const int64_t k = stack[stack.size() - num + 1].toInt();
    const bool largest = stack[stack.size() - num + 3].toBool(), sorted = stack[stack.size() - num + 4].toBool();
    const runtime::DeviceMesh& mesh = *c.mesh;
    auto pad_to_k = [&](const at::Tensor& t) {
      if (t.size(dim) == k) return t;
      auto shape = t.sizes().vec();
      shape[dim] = k - t.size(dim);
      return at::cat({t, at::zeros(shape, t.options())}, dim);
    };
    auto [values, indices] = at::topk(local, std::min(k, local.size(dim)), dim, largest, /*sorted=*/true);
    indices.add_(layout->global_offset_at(mesh.position())[dim]);
    const at::Tensor all_values = runtime::all_gather_in_chunk_order(pad_to_k(values).contiguous(), mesh, axes, dim);
    const at::Tensor all_indices = runtime::all_gather_in_chunk_order(pad_to_k(indices).contiguous(), mesh, axes, dim);
    std::vector<at::Tensor> value_parts, index_parts;
    for (int64_t j = 0; j * k < all_values.size(dim); ++j) {
      const int64_t count = std::min(k, layout->local_shape_at(mesh.chunk_member_position(axes, j))[dim]);
      value_parts.push_back(all_values.narrow(dim, j * k, count));
      index_parts.push_back(all_indices.narrow(dim, j * k, count));
    }
    const at::Tensor candidates = at::cat(value_parts, dim), candidate_indices = at::cat(index_parts, dim);
    if (has_ties(candidates, dim)) {
      // Equal values (or NaNs): which of them torch's kernel picks, and in which order, is its own
      // business; the dim is gathered and torch's kernel runs on it, as on one device. Every rank
      // of the group holds the same candidates, so the group decides alike.
      const at::Tensor whole = runtime::redistribute_local(local, layout, whole_layout, mesh);
      torch::jit::drop(stack, num);
      auto [v, i] = at::topk(whole, k, dim, largest, sorted);
      stack.emplace_back(std::move(v));
      stack.emplace_back(std::move(i));
      return;
    }
    auto [best, position] = at::topk(candidates, k, dim, largest, sorted);
    torch::jit::drop(stack, num);
    stack.emplace_back(std::move(best));
    stack.emplace_back(candidate_indices.gather(dim, position));
  };
  return plan;
}

// ------------------------------------------------------------------ sort

// Whether x comes at or after s in the sort's order (broadcasting). NaN sorts last ascending and
// first descending, as torch's kernel puts it; equal values are "at": they land in one bucket.
at::Tensor at_or_after(const at::Tensor& x, const at::Tensor& s, bool descending) {
  if (!x.is_floating_point()) return descending ? x.le(s) : x.ge(s);
  return descending ? at::isnan(s).logical_or(x.le(s)) : at::isnan(x).logical_or(x.ge(s));
}

// (value, GLOBAL index) pairs to their members on `axis`: the first send_counts[0] pairs go to
// member 0, ...; recv_counts[c] pairs come from member c. Two all-to-alls (values, then the
// indices as int32 when the dim is that short: `wide` false): packing both into one message of
// bytes costs more in strided copies than the second collective's latency.
std::pair<at::Tensor, at::Tensor> exchange_pairs(const at::Tensor& values, const at::Tensor& indices, bool wide,
                                                 const at::Tensor& send_counts, const at::Tensor& recv_counts,
                                                 const runtime::DeviceMesh& mesh, int64_t axis) {
  auto counts = [](const at::Tensor& t) {
    const at::Tensor c = t.to(at::kLong).contiguous();
    return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  };
  const auto sent = counts(send_counts), received = counts(recv_counts);
  return {runtime::all_to_all_rows(values, sent, received, mesh, axis),
          runtime::all_to_all_rows(wide ? indices : indices.to(at::kInt), sent, received, mesh, axis).to(at::kLong)};
}

// Elements laid out in blocks (a, b), a-major (block (a, b) holds counts[a][b] elements), moved
// into b-major order: `flat` reordered so that block (b, a) follows (b, a-1). No sort: each
// block moves as a whole, by its start in the new order minus its start in the old.
at::Tensor transposed_blocks(const at::Tensor& flat, const at::Tensor& counts) {
  const at::Tensor c = counts.contiguous().view(-1);
  const at::Tensor old_start = (c.cumsum(0) - c).view(counts.sizes());
  const at::Tensor ct = counts.t().contiguous().view(-1);
  const at::Tensor new_start = (ct.cumsum(0) - ct).view({counts.size(1), counts.size(0)}).t();
  const at::Tensor to =
      at::arange(flat.size(0), c.options()) + at::repeat_interleave((new_start - old_start).contiguous().view(-1), c);
  return at::empty_like(flat).index_copy_(0, to, flat);
}

// A value that sorts after every other in the sort's order, equal ones included when it comes
// last among equals (NaN ascending, -inf descending, the dtype's extremes for integers).
c10::Scalar sorts_last(at::ScalarType type, bool descending) {
  if (type == at::kBool) return c10::Scalar(!descending);
  if (c10::isFloatingType(type))
    return descending ? c10::Scalar(-std::numeric_limits<double>::infinity())
                      : c10::Scalar(std::numeric_limits<double>::quiet_NaN());
  return AT_DISPATCH_INTEGRAL_TYPES(type, "sorts_last", [&] {
    return c10::Scalar(descending ? std::numeric_limits<scalar_t>::lowest() : std::numeric_limits<scalar_t>::max());
  });
}

// What a sort along a dim sharded over ONE mesh axis needs of the layout, made with the plan.
struct SortExchange {
  SpanPlan spans;    // every member's GLOBAL span of the dim (the output's are the same)
  LayoutPtr layout;  // the input's, and whole_layout the dim made whole (the tie fallback)
  LayoutPtr whole_layout;
};

// sort along the dim, this rank's block of the GLOBAL sort: a sample sort that never gathers the
// dim. With `rows` the slices along the dim (every other dim as this rank holds it):
//  1. each rank sorts its block (stable, GLOBAL indices) and all-gathers k-1 regular samples per
//     row; the samples' k-1 quantiles split every row into k value buckets, the same on every rank
//     (equal values always share a bucket);
//  2. one all-gather of each rank's counts per (row, bucket), then one exchange (an all-to-all of
//     the values, one of the indices) sends bucket c of every row to member c, which sorts what
//     arrived stably (the sources arrive in member order, so equal values stay in GLOBAL index
//     order: a stable sort's order);
//  3. the buckets' GLOBAL ranks follow from the counts, and one more exchange moves every element
//     to the member whose output block holds its rank.
// Every regrouping between these steps moves whole runs (transposed_blocks): the only sorts are
// the local one and the merge. Time: two sorts of a block where gathering sorts the whole dim
// once -- on 2 to 4 CPU ranks about as slow as gathering or slower (make bench, sort_rows); what
// it saves is memory (no rank holds the dim) and bytes from 4 ranks on.
// Bytes sent per rank: the elements of its block that belong to another rank's bucket (about
// (k-1)/k of it), each with its index (int32 below 2^31 positions), plus the few that step 3
// moves to even the buckets out; gathering the dim sends the whole block to each of k-1 ranks and
// holds the whole dim on every rank. Results equal one device's stable sort exactly. A non-stable sort is
// torch's own order among equal values: when any two are equal (or two NaNs) -- one all-reduce of
// the verdict, equal values share a bucket so each rank sees its ties -- the dim is gathered and
// torch's kernel decides, as on one device (like topk).
std::pair<at::Tensor, at::Tensor> sharded_sort(const at::Tensor& local, int64_t dim, bool descending, bool stable,
                                               const SortExchange& ex, const runtime::DeviceMesh& mesh) {
  const SpanPlan& spans = ex.spans;
  const int64_t axis = spans.axis, k = static_cast<int64_t>(spans.owned.size()), me = mesh.coordinate(axis);
  const at::Tensor moved = local.movedim(dim, -1);
  const int64_t n = moved.size(-1);
  const int64_t rows = c10::multiply_integers(moved.sizes().begin(), moved.sizes().end() - 1);
  auto finish = [&](const at::Tensor& v, const at::Tensor& i) {
    return std::make_pair(v.view(moved.sizes()).movedim(-1, dim).contiguous(),
                          i.view(moved.sizes()).movedim(-1, dim).contiguous());
  };
  const auto long_options = local.options().dtype(at::kLong);
  if (rows == 0) return finish(moved.clone(), at::empty(moved.sizes(), long_options));  // the same on every member
  auto [values, order] = at::sort(moved.reshape({rows, n}), /*stable=*/true, 1, descending);
  const bool wide = spans.owned.back().end > std::numeric_limits<int32_t>::max();
  const at::Tensor global = order + spans.owned[me].begin;

  // 1. splitters: k-1 regular samples of each non-empty block, their k-1 quantiles
  std::vector<int64_t> sample_at;
  for (int64_t j = 1; j < k; ++j) sample_at.push_back(n > 0 ? j * n / k : 0);
  const at::Tensor samples =
      n > 0 ? values.index_select(1, at::tensor(sample_at, long_options)) : at::zeros({rows, k - 1}, values.options());
  const at::Tensor all_samples = runtime::all_gather_along(samples, mesh, axis, 1);
  std::vector<int64_t> valid;
  for (int64_t c = 0; c < k; ++c)
    if (spans.owned[c].length() > 0)
      for (int64_t j = 0; j < k - 1; ++j) valid.push_back(c * (k - 1) + j);
  const at::Tensor pooled =
      std::get<0>(all_samples.index_select(1, at::tensor(valid, long_options)).sort(/*stable=*/true, 1, descending));
  std::vector<int64_t> split_at;
  for (int64_t j = 1; j < k; ++j) split_at.push_back(j * pooled.size(1) / k);
  const at::Tensor splitters = pooled.index_select(1, at::tensor(split_at, long_options));
  const at::Tensor bucket = at_or_after(values.unsqueeze(2), splitters.unsqueeze(1), descending).sum(2);

  // 2. buckets to their members (a sorted row's buckets are runs: [row][bucket] blocks, moved
  // bucket-major); counts[s][row][c]: what member s sends member c of each row
  const at::Tensor counts = at::zeros({rows, k}, long_options).scatter_add_(1, bucket, at::ones_like(bucket));
  const at::Tensor all_counts = runtime::all_gather_along(counts.unsqueeze(0), mesh, axis, 0);
  auto [got_values, got_global] =
      exchange_pairs(transposed_blocks(values.reshape(-1), counts), transposed_blocks(global.reshape(-1), counts), wide,
                     counts.sum(0), all_counts.select(2, me).sum(1), mesh, axis);
  // what arrived, [source][row] blocks, row-major, each row padded to the longest with a value
  // that sorts last; one stable sort per row merges the sources' runs (they arrive in member
  // order, so equal values stay in GLOBAL index order: a stable sort's order)
  const at::Tensor from = all_counts.select(2, me);  // [source, row]
  const at::Tensor held_here = from.sum(0);          // per row
  got_values = transposed_blocks(got_values, from);
  got_global = transposed_blocks(got_global, from);
  const int64_t longest = held_here.numel() > 0 ? held_here.max().item<int64_t>() : 0;
  const at::Tensor row_start = held_here.cumsum(0) - held_here;
  const at::Tensor padded_at = at::arange(got_values.size(0), long_options) +
                               at::repeat_interleave(at::arange(rows, long_options) * longest - row_start, held_here);
  at::Tensor padded = at::full({rows * longest}, sorts_last(values.scalar_type(), descending), values.options());
  padded.index_copy_(0, padded_at, got_values);
  at::Tensor padded_global = at::zeros({rows * longest}, long_options).index_copy_(0, padded_at, got_global);
  auto [merged, merge_order] = at::sort(padded.view({rows, longest}), /*stable=*/true, 1, descending);
  got_values = merged.view(-1).index_select(0, padded_at);
  got_global = padded_global.view({rows, longest}).gather(1, merge_order).view(-1).index_select(0, padded_at);

  if (!stable) {
    // Equal neighbours in one row (two NaNs count as equal): torch's non-stable order is its own.
    at::Tensor tie = at::zeros({1}, long_options);
    if (longest > 1) {
      const at::Tensor a = merged.narrow(1, 1, longest - 1), b = merged.narrow(1, 0, longest - 1);
      at::Tensor equal = a.eq(b);
      if (a.is_floating_point()) equal = equal.logical_or(at::isnan(a).logical_and(at::isnan(b)));
      // (position j of a row holds data, not padding, below the row's count)
      const at::Tensor real = at::arange(1, longest, long_options).unsqueeze(0) < held_here.unsqueeze(1);
      tie.fill_(equal.logical_and(real).any().item<bool>());
    }
    if (runtime::all_reduce_along(tie, mesh, axis, ReduceOp::Max).item<int64_t>() > 0) {
      const at::Tensor whole = runtime::redistribute_local(local, ex.layout, ex.whole_layout, mesh);
      auto [v, i] = at::sort(whole, dim, descending);
      const runtime::Span mine = spans.owned[me];
      auto block = [&](const at::Tensor& t) { return t.narrow(dim, mine.begin, mine.length()).contiguous(); };
      return {block(v), block(i)};
    }
  }

  // 3. to the member whose block holds each element's GLOBAL rank. held[row][c]: what member c
  // holds of each row after step 2, first[row][c] the GLOBAL rank of its first; a row's ranks
  // here are consecutive, so what goes to member c is a run: [row][c] blocks again.
  const at::Tensor held = all_counts.sum(0);
  const at::Tensor first = held.cumsum(1) - held;
  // per row: how many of the ranks member s holds lie in member c's output block
  auto overlap = [&](int64_t s, int64_t c) {
    const at::Tensor begin = first.select(1, s), end = begin + held.select(1, s);
    const runtime::Span o = spans.owned[c];
    return (at::clamp_max(end, o.end) - at::clamp_min(begin, o.begin)).clamp_min(0);
  };
  std::vector<at::Tensor> to_member, from_member;
  for (int64_t c = 0; c < k; ++c) {
    to_member.push_back(overlap(me, c));
    from_member.push_back(overlap(c, me));
  }
  const at::Tensor sends = at::stack(to_member, 1);   // [row, member]
  const at::Tensor arrives = at::stack(from_member);  // [source, row]
  auto [final_values, final_global] =
      exchange_pairs(transposed_blocks(got_values, sends), transposed_blocks(got_global, sends), wide, sends.sum(0),
                     arrives.sum(1), mesh, axis);
  return finish(transposed_blocks(final_values, arrives), transposed_blocks(final_global, arrives));
}

// sort(self, dim, descending), sort.stable(self, *, stable, dim, descending), argsort(.stable),
// msort(self) (dim 0). Along a dim sharded over one mesh axis: sharded_sort, the results keeping
// the input's sharding; along a whole dim the local call is the answer; a dim sharded over more
// axes, or a non-stable sort of integers or bools, is made whole. Every other dim keeps its
// sharding.
OpPlan sort_rule(const OpCall& call) {
  const Layout& in = call.layout(0);
  const std::string name = call.schema().name();
  kept_partial(call, false);
  const bool msort = name == "aten::msort";
  const int64_t dim = in.ndim() == 0 || msort ? 0 : wrap_dim(call, call.arg(call.arg_index("dim")).toInt(), in.ndim());
  layout::DimAxes dims = in.dim_axes();
  // A non-stable sort of integers or bools (expert ids, labels) nearly always meets equal keys,
  // whose order is then torch's kernel's own: the dim is made whole up front, as one device
  // sorts it, instead of an exchange that would end in gathering it anyway.
  bool stable = false, descending = false;  // both in the plan's key (KeyScalars::kAll)
  if (const auto s = call.schema().argumentIndexWithName("stable"); s && !call.arg(*s).isNone())
    stable = call.arg(*s).toBool();
  if (const auto d = call.schema().argumentIndexWithName("descending")) descending = call.arg(*d).toBool();
  const bool repeats = !stable && !c10::isFloatingType(call.tensors[0].dtype);
  const bool exchange =
      in.ndim() > 0 && dims[dim].size() == 1 && dim_parts(in, dim) > 1 && in.global_shape()[dim] > 0 && !repeats;
  if (!exchange && in.ndim() > 0) dims[dim].clear();
  OpPlan plan;
  plan.inputs.push_back(make_layout(in, in.global_shape(), dims, layout::PartialOps(in.partial().size())));
  for (size_t o = 0; o < call.schema().returns().size(); ++o)
    plan.outputs.push_back(make_layout(in, in.global_shape(), dims));
  if (!exchange) return plan;
  layout::DimAxes whole = dims;
  whole[dim].clear();
  SortExchange ex{runtime::owned_spans(*plan.inputs[0], *call.mesh, dim), plan.inputs[0],
                  make_layout(in, in.global_shape(), whole)};
  const bool values_out = name != "aten::argsort", indices_out = !msort;
  plan.expand = [ex = std::move(ex), dim, descending, stable, values_out, indices_out](const OpCall& c,
                                                                                       torch::jit::Stack& stack) {
    const size_t num = c.schema().arguments().size();
    auto [values, indices] = sharded_sort(stack[stack.size() - num].toTensor(), dim, descending, stable, ex, *c.mesh);
    torch::jit::drop(stack, num);
    if (values_out) stack.emplace_back(std::move(values));
    if (indices_out) stack.emplace_back(std::move(indices));
  };
  return plan;
}

// ------------------------------------------------------------------ cummax/cummin backward

// cummaxmin_backward is composite-implicit: it scatter-adds the gradient into a PLAIN zeros
// tensor of the input's size, which hypershard refuses (that tensor would hold one rank's shard).
// The same maths from DTensor ops: zeros like the input, scatter_add of the gradient at the
// GLOBAL indices (the indexing family adds by ownership along a sharded dim). At the
// AutogradPrivateUse2 key, so autograd records these ops.
at::Tensor cummaxmin_backward_kernel(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& indices,
                                     int64_t dim) {
  if (input.numel() == 0) return input;
  return at::zeros_like(input).scatter_add(dim, indices, grad);
}

}  // namespace

void register_along_sharded_kernels() {
  aten_autograd_kernels().impl("cummaxmin_backward", TORCH_FN(cummaxmin_backward_kernel));
}

void register_along_sharded(Registry& r) {
  r.kernels(&register_along_sharded_kernels);
  r.add("aten::cumsum", &scan_rule<Scan::kSum>, KeyScalars::kAll);
  r.add("aten::cumprod", &scan_rule<Scan::kProd>, KeyScalars::kAll);
  r.add("aten::logcumsumexp", &scan_rule<Scan::kLogSumExp>, KeyScalars::kAll);
  r.add("aten::cummax", &scan_rule<Scan::kMax>, KeyScalars::kAll);
  r.add("aten::cummin", &scan_rule<Scan::kMin>, KeyScalars::kAll);
  r.add("aten::flip", &move_rule, KeyScalars::kAll);
  r.add("aten::topk", &topk_rule, KeyScalars::kAll);
  r.add("aten::roll", &move_rule, KeyScalars::kAll);
  for (const char* op : {"aten::sort", "aten::sort.stable", "aten::argsort", "aten::argsort.stable", "aten::msort"})
    r.add(op, &sort_rule, KeyScalars::kAll);
}

}  // namespace hypershard::ops
