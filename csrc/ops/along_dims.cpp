// Ops that compute along some dims, every other dim independent: their result on a block of the
// other dims is the block of their result. So the named dims are made whole (gathered where
// sharded) and the op runs on the local shards; every other dim keeps its sharding.
//
//   sorts        kthvalue, mode, median.dim, nanmedian.dim                       dim
//                (sort, argsort, msort: along_sharded.cpp, which sorts a sharded dim without
//                gathering it)
//   reductions   logsumexp, nansum, norm.ScalarOpt_dim,                          dim (None or [] = all)
//                std_mean/var_mean.correction, aminmax, count_nonzero(.dim_IntList)
//   windows      unfold(_copy) (the dimension argument is whole; a new last dim of windows),
//                unfold_backward (that dim and the window dim whole; linear)
//   gates        glu, glu_backward (the halved dim whole)                        dim
//   slices       renorm(_) (one norm per slice of dim: dim keeps its sharding,     every dim but dim
//                the other dims are whole)
//   hashes       hash_tensor                                                     dim ([] = all)
//   permutations rot90 (linear)                                                  dims
//                channel_shuffle (linear)                                        dim 1
//                pixel_shuffle, pixel_unshuffle (linear)                         the last three
//   whole        median, nanmedian (no dim argument: every dim), _linalg_check_errors
//                (every rank checks the whole info tensor, so every rank raises alike)
//   diagonal     diag_embed (the last dim becomes a diagonal in the output's last two; leading
//                dims are a batch; the diagonal elsewhere: every dim whole)
//   transforms   _fft_c2c, _fft_r2c, _fft_c2r (the transformed dims whole; linear) dim
//   indexing     gather, scatter(.src/.value/.reduce/_add/_reduce.two), index_select, dim: its indices are
//                index_add, index_copy, index_fill, index_reduce (and in place)   GLOBAL coordinates
//                operands of self's rank (index, src, source) take self's sharding on the other dims
//                where their sizes agree; a dim where they differ (a shorter index) is made whole;
//                an in-place form leaves self in the planned layout. A self sharded along dim
//                alone is indexed by ownership instead (owned_indexing_rule): reads come out
//                Partial(sum), writes keep self's layout, nothing of self is gathered
//   advanced     index.Tensor, index_put(_), _index_put_impl_ (x[i, j] = v): see plan_indexing
//   triangles    tril, triu (and in place): every dim keeps its sharding; the diagonal argument is
//                shifted per rank by its block's GLOBAL row minus column offset (triangle_rule)
//   linalg       inv_ex, cholesky_ex, lu_factor_ex, lu, qr, eig, _linalg_eigh,   the last two (the
//                _linalg_svd, _linalg_slogdet, _linalg_det, matrix_exp,          matrix); leading
//                pinv.atol_rtol_tensor, lu_solve, solve_triangular, cholesky,    dims are a batch
//                cholesky_inverse/_solve, ldl_factor_ex/_solve, _solve_ex, _linalg_eigvals,
//                householder_product, triangular_solve, lu_unpack (operands batched like the
//                first keep its batch sharding)
//   pooling      avg_pool2d, _adaptive_avg_pool2d, max_pool2d_with_indices,       the last two
//                adaptive_max_pool2d and their backward ops (1-d pools reach them) (spatial);
//                a rank's empty channel block skips the kernel (skip_empty_blocks)
//   cross        linalg_cross                                                    dim
//
// Output layouts come from the outputs' GLOBAL shapes, which the op itself reports on meta
// tensors (topk's k, a keepdim, a matrix factor's shape): an output of the input's rank (or one
// more: a new last dim) keeps the sharding of every dim whose size it keeps; one with the named
// dims removed keeps the others'; any other keeps its leading batch dims' sharding. An output
// that would lose a kept sharding makes the input whole instead. Tensor arguments after the
// first: operands of the first's rank go along with it (indexing); a matrix op's operands
// batched like the first keep its batch sharding (other_operand); every other one is read whole.
//
// (Scans, flip and roll keep a sharded dim sharded, topk merges per-rank candidates:
// along_sharded.cpp.)
//
// Partial: the Fourier transforms are linear (they combine elements linearly), and the
// permutations only move elements, and unfold_backward adds windows, so a sum/avg Partial passes
// through them. Every other op here is not: a sum/avg Partial input is an error (default
// mode reduces it first) -- inside a backward pass, where the formula is torch's, it is reduced.
#include <ATen/ATen.h>

#include <algorithm>

#include "ops/families.h"
#include "ops/masked.h"
#include "ops/partial.h"

namespace hypershard::ops {
namespace {

enum class Along : int8_t {
  kDimArg,     // the "dim" argument: an int, an int list, or None / [] for every dim
  kAll,        // every dim
  kMatrix,     // the last two dims
  kLastDim,    // the last dim
  kAllButDim,  // every dim but the "dim" argument (renorm: one norm per slice of dim)
  kChannel,    // dim 1 (channel_shuffle)
  kLastThree,  // the last three dims (pixel_shuffle: channels and the two spatial dims)
};

struct AlongSpec {
  Along along;
  bool linear;  // a sum/avg Partial passes through
};

// The input dims the op computes along (GLOBAL dims of tensor 0).
std::vector<int64_t> named_dims(const OpCall& call, AlongSpec spec, int64_t ndim) {
  std::vector<int64_t> all(static_cast<size_t>(ndim));
  if (ndim == 0) {  // a 0-d tensor has nothing to make whole; its dim 0 / -1 (torch allows them) names none
    if (spec.along == Along::kMatrix) fail_call(call, "a matrix op needs at least 2 dims");
    return all;
  }
  for (int64_t d = 0; d < ndim; ++d) all[d] = d;
  if (spec.along == Along::kAll) return all;
  if (spec.along == Along::kMatrix) {
    if (ndim < 2) fail_call(call, "a matrix op needs at least 2 dims");
    return {ndim - 2, ndim - 1};
  }
  if (spec.along == Along::kChannel || spec.along == Along::kLastThree) {
    const int64_t first = spec.along == Along::kChannel ? 1 : ndim - 3;
    if (first < 0 || ndim < 2)
      fail_argument(call, 0, layout::str_cat("has ", ndim, " dims"),
                    spec.along == Along::kChannel ? "at least 2 dims" : "at least 3 dims");
    if (spec.along == Along::kChannel) return {1};
    return {ndim - 3, ndim - 2, ndim - 1};
  }
  if (spec.along == Along::kAllButDim) {
    const int64_t dim = wrap_dim(call, int_arg(call.arg(call.arg_index("dim"))), ndim);
    all.erase(all.begin() + dim);
    return all;
  }
  if (spec.along == Along::kLastDim) {
    // diag_embed puts the diagonal in the output's last two dims by default; other positions
    // would move the batch dims: every dim whole then.
    const int64_t out_ndim = ndim + 1;
    const int64_t d1 = wrap_dim(call, call.arg(2).toInt(), out_ndim),
                  d2 = wrap_dim(call, call.arg(3).toInt(), out_ndim);
    if (std::min(d1, d2) != ndim - 1 || std::max(d1, d2) != ndim) return all;
    return {ndim - 1};
  }
  auto index = call.schema().argumentIndexWithName("dim");
  if (!index) index = call.schema().argumentIndexWithName("dimension");  // unfold
  if (!index) index = call.schema().argumentIndexWithName("dims");       // rot90
  if (!index) return all;
  const c10::IValue& value = call.arg(static_cast<int64_t>(*index));
  if (value.isNone()) return all;
  std::vector<int64_t> dims;
  if (value.isInt()) {
    dims.push_back(wrap_dim(call, value.toInt(), ndim));
  } else {
    for (int64_t d : value.toIntList()) dims.push_back(wrap_dim(call, d, ndim));
    if (dims.empty()) return all;
  }
  return dims;
}

// A tensor argument after the first: for a matrix op, an operand batched like the first (its
// leading `batch` dims of the first's sizes, then its own core dims: a vector of pivots or tau,
// else a matrix) takes the first's batch sharding; every other operand (pinv's tolerances, a
// broadcast operand) is read whole.
LayoutPtr other_operand(const OpCall& call, int64_t t, int64_t batch, const layout::DimAxes& kept) {
  const Layout& other = call.layout(t);
  const Layout& first = call.layout(0);
  const std::string& name = call.schema().arguments()[call.tensors[t].arg].name();
  const int64_t core = name == "pivots" || name == "tau" ? 1 : 2;
  bool batched_alike = batch >= 0 && other.ndim() == batch + core;
  for (int64_t d = 0; d < batch && batched_alike; ++d)
    batched_alike = other.global_shape()[d] == first.global_shape()[d];
  layout::DimAxes dims(static_cast<size_t>(other.ndim()));
  if (batched_alike)
    for (int64_t d = 0; d < batch; ++d) dims[d] = kept[d];
  return make_layout(other, other.global_shape(), std::move(dims), {});
}

// An output's per-dim mesh axes: one of the input's rank (or one more, a new last dim) keeps the
// sharding of every dim whose size it keeps; one with the named dims removed keeps the others';
// any other its leading dims'.
template <typename IsNamed>
layout::DimAxes output_dims(const std::vector<int64_t>& shape, const std::vector<int64_t>& in_shape,
                            const layout::DimAxes& kept, const IsNamed& is_named, size_t named) {
  const int64_t rank = static_cast<int64_t>(shape.size()), n = static_cast<int64_t>(in_shape.size());
  layout::DimAxes dims(shape.size());
  if (rank == n || rank == n + 1) {  // n + 1: a new last dim (unfold's windows, diag_embed's diagonal)
    for (int64_t d = 0; d < n; ++d)
      if (shape[d] == in_shape[d]) dims[d] = kept[d];
  } else if (named > 0 && rank == n - static_cast<int64_t>(named)) {
    int64_t o = 0;
    for (int64_t d = 0; d < n; ++d)
      if (!is_named(d)) dims[o++] = kept[d];
  } else {
    for (int64_t d = 0; d < std::min(rank, n) && !is_named(d) && shape[d] == in_shape[d]; ++d) dims[d] = kept[d];
  }
  return dims;
}

std::vector<int64_t> mesh_axes(const layout::DimAxes& dims) {
  std::vector<int64_t> axes;
  for (const auto& d : dims) axes.insert(axes.end(), d.begin(), d.end());
  std::sort(axes.begin(), axes.end());
  return axes;
}

template <Along A, bool kLinear>
OpPlan along_dims_rule(const OpCall& call) {
  const AlongSpec spec{A, kLinear};
  const Layout& in = call.layout(0);
  const int64_t n = in.ndim();
  const auto named = named_dims(call, spec, n);
  auto is_named = [&](int64_t d) { return std::find(named.begin(), named.end(), d) != named.end(); };

  layout::PartialOps partial = in.partial();
  const auto op = in.partial_op();
  if (!(kLinear && op && is_sum_like(*op)) && refuse_sum_partial(call, 0, redistribute_partial_first()))
    partial.assign(partial.size(), std::nullopt);  // reduced first: exact
  layout::DimAxes kept = in.dim_axes();
  for (int64_t d : named) kept[d].clear();
  // Operands of the first's rank (an index, a source) go along dim by dim: a dim keeps its
  // sharding only where every such operand has the first's size (gather's index may be shorter).
  std::vector<bool> aligned(call.tensors.size(), false);
  if (A != Along::kMatrix)
    for (size_t t = 1; t < call.tensors.size(); ++t) {
      const Layout& other = call.layout(static_cast<int64_t>(t));
      if (other.ndim() != n) continue;
      aligned[t] = true;
      for (int64_t d = 0; d < n; ++d)
        if (other.global_shape()[d] != in.global_shape()[d]) kept[d].clear();
    }

  // Every output must hold each kept sharding on a dim of its own (the local call computes this
  // rank's block only); when one cannot (its shape does not show the input's dims), the input
  // is made whole.
  const auto shapes = meta_output_shapes(call);
  std::vector<layout::DimAxes> outs;
  for (int attempt = 0; attempt < 2; ++attempt) {
    outs.clear();
    bool holds_all = true;
    for (const auto& shape : shapes) {
      outs.push_back(output_dims(shape, in.global_shape(), kept, is_named, named.size()));
      holds_all = holds_all && mesh_axes(outs.back()) == mesh_axes(kept);
    }
    if (holds_all) break;
    for (auto& axes : kept) axes.clear();
  }

  OpPlan plan;
  plan.inputs.push_back(make_layout(in, in.global_shape(), kept, partial));
  for (size_t t = 1; t < call.tensors.size(); ++t) {
    const Layout& other = call.layout(static_cast<int64_t>(t));
    plan.inputs.push_back(aligned[t]
                              ? make_layout(other, other.global_shape(), kept, {})
                              : other_operand(call, static_cast<int64_t>(t), A == Along::kMatrix ? n - 2 : -1, kept));
  }
  // Integer outputs (indices, counts) carry no Partial; a linear op's values keep it.
  for (size_t o = 0; o < shapes.size(); ++o)
    plan.outputs.push_back(make_layout(in, shapes[o], std::move(outs[o]), kLinear ? partial : layout::PartialOps{}));
  return plan;
}

// ------------------------------------------------------------------ advanced indexing

// x[i0, i1, ...] (index.Tensor) and its writes (index_put(_), _index_put_impl_): the indexed dims
// are whole (the indices are GLOBAL coordinates), the index tensors are read whole, every other
// dim keeps its sharding; the result has the broadcast index shape where the indexed dims were
// (all at the front when they are not adjacent, as torch does). index_put's values take the
// result's sharding where their sizes agree (size 1 broadcasts). A boolean mask index (a
// data-dependent size) goes to masked.cpp's rules (GLOBAL order). index.Tensor is linear in
// self (it selects elements): a sum-Partial self passes; index_put keeps Partial(sum) self and
// values when it accumulates (summed_axes), and refuses Partial otherwise.
struct Indexing {
  std::vector<int64_t> dims;          // self's indexed dims
  std::vector<int64_t> result_shape;  // of self[indices]
  layout::DimAxes result_dims;        // its sharding
  layout::DimAxes self_dims;          // self's required sharding
};

Indexing plan_indexing(const OpCall& call) {
  const Layout& self = call.layout(0);
  const auto list = call.arg(1).toList();
  Indexing ix;
  std::vector<int64_t> broadcast;
  for (size_t i = 0; i < list.size(); ++i) {
    const c10::IValue item = list.get(i);
    if (!item.isTensor() || !item.toTensor().defined()) continue;
    const auto type = item.toTensor().scalar_type();
    if (type == at::kBool || type == at::kByte)
      not_covered(call, "a boolean mask index selects a data-dependent number of elements");
    ix.dims.push_back(static_cast<int64_t>(i));
    const auto shape = call.layout(call.tensor_index(1, static_cast<int64_t>(i))).global_shape();
    // broadcast the index shapes (right-aligned)
    std::vector<int64_t> merged(std::max(broadcast.size(), shape.size()), 1);
    for (size_t k = 0; k < merged.size(); ++k) {
      const int64_t a = k < broadcast.size() ? broadcast[broadcast.size() - 1 - k] : 1;
      const int64_t b = k < shape.size() ? shape[shape.size() - 1 - k] : 1;
      if (a != b && a != 1 && b != 1) fail_call(call, "the index tensors' shapes cannot be broadcast together");
      merged[merged.size() - 1 - k] = a == 1 ? b : a;
    }
    broadcast = std::move(merged);
  }
  if (ix.dims.empty()) fail_call(call, "no index tensor");
  if (static_cast<int64_t>(list.size()) > self.ndim()) fail_call(call, "too many indices for the tensor");
  ix.self_dims = self.dim_axes();
  for (int64_t d : ix.dims) ix.self_dims[d].clear();
  const bool adjacent = ix.dims.back() - ix.dims.front() + 1 == static_cast<int64_t>(ix.dims.size());
  auto add_self_dim = [&](int64_t d) {
    ix.result_shape.push_back(self.global_shape()[d]);
    ix.result_dims.push_back(ix.self_dims[d]);
  };
  auto add_index_dims = [&] {
    for (int64_t size : broadcast) {
      ix.result_shape.push_back(size);
      ix.result_dims.emplace_back();
    }
  };
  if (adjacent) {
    for (int64_t d = 0; d < ix.dims.front(); ++d) add_self_dim(d);
    add_index_dims();
    for (int64_t d = ix.dims.back() + 1; d < self.ndim(); ++d) add_self_dim(d);
  } else {
    add_index_dims();
    for (int64_t d = 0; d < self.ndim(); ++d)
      if (std::find(ix.dims.begin(), ix.dims.end(), d) == ix.dims.end()) add_self_dim(d);
  }
  return ix;
}

OpPlan index_rule(const OpCall& call) {
  if (has_bool_mask_index(call)) return bool_mask_index_rule(call);  // masked.cpp: GLOBAL order
  const Layout& self = call.layout(0);
  const Indexing ix = plan_indexing(call);
  layout::PartialOps partial = self.partial();
  if (auto op = self.partial_op(); op && !is_sum_like(*op))
    partial.assign(partial.size(), std::nullopt);  // max/min parts: reduced first (exact)
  OpPlan plan;
  plan.inputs.push_back(make_layout(self, self.global_shape(), ix.self_dims, partial));
  for (size_t t = 1; t < call.tensors.size(); ++t)
    plan.inputs.push_back(
        replicate_like(call.layout(static_cast<int64_t>(t)), call.layout(static_cast<int64_t>(t)).global_shape()));
  plan.outputs.push_back(make_layout(self, ix.result_shape, ix.result_dims, partial));
  return plan;
}

// The mesh axes a summing index_put (accumulate=True: self + the values added at the indices,
// linear in self and values together) keeps Partial(sum): those where self or values is a
// sum-Partial and that shard no dim self or values keeps sharded. Both operands are planned
// Partial there (a whole one is filled: rank 0 keeps it, the others hold zeros), and so is the
// result; on an axis that also shards self the Partial is reduced first (the write is linear, so
// reducing is exact). Any other Partial is an error (an overwrite is not linear in the parts),
// or, inside a backward pass, reduced first.
layout::PartialOps summed_axes(const OpCall& call, const Indexing& ix, int64_t values) {
  const Layout& self = call.layout(0);
  layout::PartialOps out(static_cast<size_t>(self.mesh()->ndim()));
  const auto accumulate = call.schema().argumentIndexWithName("accumulate");
  const bool summing = accumulate && call.arg(*accumulate).toBool();
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    const bool operand = t == 0 || static_cast<int64_t>(t) == values;
    for (int64_t axis = 0; axis < l.mesh()->ndim(); ++axis) {
      const auto& op = l.partial()[axis];
      if (!op) continue;
      const bool linear = summing && operand && *op == ReduceOp::Sum;
      const bool shards = std::any_of(ix.self_dims.begin(), ix.self_dims.end(), [&](const std::vector<int64_t>& axes) {
        return std::find(axes.begin(), axes.end(), axis) != axes.end();
      });
      if (linear && !shards)
        out[axis] = ReduceOp::Sum;
      else if (!linear && !call.in_backward)
        fail_argument(call, static_cast<int64_t>(t), "a Partial operand of an indexed write",
                      "Replicate or Shard; Partial(sum) self and values of an accumulating write (accumulate=True)");
    }
  }
  return out;
}

OpPlan index_put_rule(const OpCall& call) {
  if (has_bool_mask_index(call)) return bool_mask_index_put_rule(call);  // masked.cpp
  const Layout& self = call.layout(0);
  const Indexing ix = plan_indexing(call);
  const int64_t values = call.tensor_index(2);
  const layout::PartialOps summed = summed_axes(call, ix, values);
  OpPlan plan;
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    if (t == 0) {
      plan.inputs.push_back(make_layout(l, l.global_shape(), ix.self_dims, summed));
    } else if (static_cast<int64_t>(t) == values) {
      // right-aligned against self[indices]: a dim of the same size shares its sharding
      layout::DimAxes dims(static_cast<size_t>(l.ndim()));
      const int64_t shift = static_cast<int64_t>(ix.result_shape.size()) - l.ndim();
      for (int64_t d = 0; d < l.ndim(); ++d)
        if (d + shift >= 0 && l.global_shape()[d] == ix.result_shape[d + shift]) dims[d] = ix.result_dims[d + shift];
      // an axis that shards values but is Partial in the plan cannot be both: values whole there
      for (auto& axes : dims)
        axes.erase(std::remove_if(axes.begin(), axes.end(), [&](int64_t a) { return summed[a].has_value(); }),
                   axes.end());
      plan.inputs.push_back(make_layout(l, l.global_shape(), std::move(dims), summed));
    } else {
      plan.inputs.push_back(replicate_like(l, l.global_shape()));
    }
  }
  plan.outputs.push_back(make_layout(self, self.global_shape(), ix.self_dims, summed));
  return plan;
}

// ------------------------------------------------------------------ indexing by ownership

// gather, index_select and the indexed writes (scatter*, index_add/copy/fill/reduce, in place
// too) on a self sharded along `dim`: no gather of self (and, for the reads and the summing
// writes, no copy of it either). Its other dims keep their sharding, and
// operands of self's rank follow it there (they must match self's size on those dims); the
// index is whole along dim. Each
// rank owns the GLOBAL positions [r0, r0 + L) of dim. Its local call runs on self padded with one
// zero slice at position L, with every index it does not own redirected there: a read of a
// foreign position yields zero (the result is Partial(sum) over the axes sharding dim: exactly
// one rank holds each element), a write to one lands in the pad, which is cut off afterwards
// (self keeps its layout). Sum-Partial operands of the summing writes stay Partial
// (summing_partial_plan). Anything else (dim not sharded, an operand shorter than self on a
// sharded dim, another Partial) is the along-dims rule's: dim made whole.
bool is_indexed_read(const std::string& name) { return name == "aten::gather" || name == "aten::index_select"; }

// index_add and scatter_add (and in place) are linear in self and the added values together:
// sum-Partial operands stay Partial (the other operand filled: rank 0 keeps it, the others hold
// zeros). `dim` and the index's Partial are whole. Every other dim keeps self's sharding where
// no summed axis shards it and every operand of self's rank has self's extent there (its rows
// are independent: gather's backward, a zeros tensor row-sharded like its gradient, stays so);
// elsewhere it is whole.
OpPlan summing_partial_plan(const OpCall& call, const layout::PartialOps& summed) {
  const Layout& self = call.layout(0);
  const int64_t n = self.ndim();
  const int64_t dim = n == 0 ? 0 : wrap_dim(call, call.arg(1).toInt(), n);
  layout::DimAxes rows(static_cast<size_t>(n));
  for (int64_t d = 0; d < n; ++d) {
    const auto& axes = self.dim_axes()[d];
    bool keep = d != dim && !axes.empty();
    for (int64_t axis : axes) keep = keep && !summed[axis];
    for (const auto& t : call.tensors)
      keep = keep && (t.layout->ndim() != n || t.layout->global_shape()[d] == self.global_shape()[d]);
    if (keep) rows[d] = axes;
  }
  OpPlan plan;
  for (size_t t = 0; t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    const bool index = call.tensors[t].arg == 2;
    plan.inputs.push_back(make_layout(l, l.global_shape(),
                                      l.ndim() == n ? rows : layout::DimAxes(static_cast<size_t>(l.ndim())),
                                      index ? layout::PartialOps{} : summed));
  }
  plan.outputs.push_back(make_layout(self, self.global_shape(), rows, summed));
  return plan;
}

bool is_summing_write(const std::string& name) {
  return name == "aten::index_add" || name == "aten::index_add_" || name == "aten::scatter_add" ||
         name == "aten::scatter_add_";
}

// A GLOBAL index along a dim this rank holds positions [begin, begin + length) of, as local
// positions clamped into the block, with `foreign` marking (true) the indices another rank owns;
// `foreign` is undefined when this rank owns every index (then a block starting at 0 passes the
// index itself: no new tensor). A contiguous CPU index is read in one loop, which also raises
// torch's out-of-range error for an index outside [0, global) (clamping would turn it into a
// silent zero); any other runs as tensor ops (reading it would synchronise a device).
struct OwnedIndex {
  at::Tensor local;
  at::Tensor foreign;
  bool all_foreign = false;
};

template <typename T>
OwnedIndex localize_cpu_index(const OpCall& call, const at::Tensor& index, int64_t dim, int64_t begin, int64_t length,
                              int64_t global) {
  const T* in = index.const_data_ptr<T>();
  const int64_t n = index.numel();
  int64_t owned_count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(in[i]);
    HS_CHECK(v >= 0 && v < global, call.schema().name(), "index ", v, " is out of bounds for dimension ", dim,
             " with size ", global);
    owned_count += v >= begin && v < begin + length;
  }
  OwnedIndex out;
  if (owned_count == n && begin == 0) {
    out.local = index;
    return out;
  }
  out.local = at::empty_like(index, at::MemoryFormat::Contiguous);
  T* local = out.local.mutable_data_ptr<T>();
  if (owned_count == n) {
    for (int64_t i = 0; i < n; ++i) local[i] = static_cast<T>(in[i] - begin);
    return out;
  }
  out.all_foreign = owned_count == 0;
  out.foreign = at::empty(index.sizes(), index.options().dtype(at::kBool));
  bool* foreign = out.foreign.mutable_data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(in[i]) - begin;
    foreign[i] = v < 0 || v >= length;
    local[i] = static_cast<T>(std::clamp<int64_t>(v, 0, length - 1));
  }
  return out;
}

OwnedIndex localize_index(const OpCall& call, const at::Tensor& index, int64_t dim, int64_t begin, int64_t length,
                          int64_t global) {
  if (index.is_cpu() && index.is_contiguous()) {
    if (index.scalar_type() == at::kLong) return localize_cpu_index<int64_t>(call, index, dim, begin, length, global);
    if (index.scalar_type() == at::kInt) return localize_cpu_index<int32_t>(call, index, dim, begin, length, global);
  }
  OwnedIndex out;
  const at::Tensor local_index = index - begin;
  out.local = local_index.clamp(0, length - 1);
  out.foreign = local_index.ne(out.local);
  return out;
}

OpPlan owned_indexing_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  const int64_t n = self.ndim();
  if (is_summing_write(call.schema().name())) {
    layout::PartialOps summed(static_cast<size_t>(self.mesh()->ndim()));
    bool any = false, other = false;
    for (const auto& t : call.tensors) {
      if (t.arg == 2 && t.layout->has_partial()) other = true;  // a Partial index: not linear
      for (int64_t axis = 0; axis < self.mesh()->ndim(); ++axis) {
        const auto& op = t.layout->partial()[axis];
        if (!op) continue;
        if (*op == ReduceOp::Sum)
          summed[axis] = ReduceOp::Sum, any = true;
        else
          other = true;
      }
    }
    if (any && !other) return summing_partial_plan(call, summed);
  }
  const int64_t dim = n == 0 ? 0 : wrap_dim(call, call.arg(1).toInt(), n);
  bool applies = n > 0 && !self.dim_axes()[dim].empty();
  for (const auto& t : call.tensors) applies = applies && !t.layout->has_partial();
  // Operands of self's rank (gather/scatter's index and src, index_add's source) follow self on
  // the other dims, which they must match in size where self is sharded; a 1-d index is whole.
  std::vector<LayoutPtr> operands;
  for (size_t t = 1; applies && t < call.tensors.size(); ++t) {
    const Layout& l = call.layout(static_cast<int64_t>(t));
    layout::DimAxes dims(static_cast<size_t>(l.ndim()));
    if (l.ndim() == n) {
      for (int64_t d = 0; d < n && applies; ++d) {
        if (d == dim || self.dim_axes()[d].empty()) continue;
        applies = l.global_shape()[d] == self.global_shape()[d];
        dims[d] = self.dim_axes()[d];
      }
    }
    operands.push_back(make_layout(l, l.global_shape(), std::move(dims)));
  }
  if (!applies) return along_dims_rule<Along::kDimArg, false>(call);
  const std::string name = call.schema().name();
  const bool read = is_indexed_read(name);
  OpPlan plan;
  plan.inputs.push_back(intern(self));
  plan.inputs.insert(plan.inputs.end(), operands.begin(), operands.end());
  if (read) {
    // The result keeps self's sharding on its other dims (gather: the index's shape, which
    // matches self's there; index_select: self's shape with dim resized).
    layout::PartialOps summed(static_cast<size_t>(self.mesh()->ndim()));
    for (int64_t axis : self.dim_axes()[dim]) summed[axis] = ReduceOp::Sum;
    const auto shape = meta_output_shapes(call).at(0);
    layout::DimAxes dims = self.dim_axes();
    dims[dim].clear();
    plan.outputs.push_back(make_layout(self, shape, std::move(dims), std::move(summed)));
  } else {
    plan.outputs.push_back(plan.inputs[0]);
  }
  const LayoutPtr layout = plan.inputs[0];
  const bool in_place = !call.schema().returns().empty() && call.schema().returns()[0].alias_info() &&
                        call.schema().returns()[0].alias_info()->isWrite();
  // Reads and the summing writes need no pad: indices they do not own are clamped into the block
  // and their results (reads) or added values (writes) zeroed -- no copy of self. The
  // overwriting writes use the pad slice (a clamped index would overwrite a real position).
  const bool summing = is_summing_write(name);
  const bool rows_index = name.rfind("aten::index_", 0) == 0;  // a 1-d index along dim
  const int64_t global = self.global_shape()[dim];
  plan.expand = [layout, dim, global, read, in_place, summing, rows_index](const OpCall& c, torch::jit::Stack& stack) {
    const size_t num = c.schema().arguments().size();
    c10::IValue* args = stack.data() + (stack.size() - num);
    at::Tensor local = args[0].toTensor();
    const int64_t begin = layout->global_offset_at(c.mesh->position())[dim], length = local.size(dim);
    const at::Tensor index = args[2].toTensor();
    // a mask shaped to broadcast against a tensor whose dim `dim` runs along a 1-d index
    auto along_dim = [&](const at::Tensor& mask, const at::Tensor& like) {
      std::vector<int64_t> shape(static_cast<size_t>(like.dim()), 1);
      shape[dim] = mask.numel();
      return mask.view(shape);
    };
    if ((read || summing) && length > 0) {
      // local positions, clamped into the block; `foreign` marks the indices of another rank
      const OwnedIndex owned = localize_index(c, index, dim, begin, length, global);
      args[2] = owned.local;
      if (summing && owned.foreign.defined()) {
        const int64_t source = c.arg_index(rows_index ? "source" : "src");
        at::Tensor values = args[source].toTensor();
        if (rows_index) {
          values = values.masked_fill(along_dim(owned.foreign, values), 0);
        } else {
          for (int64_t d = 0; d < index.dim(); ++d) values = values.narrow(d, 0, index.size(d));
          values = values.masked_fill(owned.foreign, 0);
        }
        args[source] = std::move(values);
      }
      c.op->callBoxed(stack);
      if (read && owned.foreign.defined()) {
        at::Tensor result = stack.back().toTensor();
        if (owned.all_foreign)
          result.zero_();
        else
          result.masked_fill_(rows_index ? along_dim(owned.foreign, result) : owned.foreign, 0);
      }
      return;
    }
    const at::Tensor owned = index.ge(begin).logical_and(index.lt(begin + length));
    args[2] = at::where(owned, index - begin, at::full({}, length, index.options()));
    auto pad_shape = local.sizes().vec();
    pad_shape[dim] = 1;
    args[0] = at::cat({local, at::zeros(pad_shape, local.options())}, dim);
    c.op->callBoxed(stack);
    at::Tensor result = stack.back().toTensor();
    stack.pop_back();
    if (read) {
      stack.emplace_back(std::move(result));
    } else if (in_place) {
      local.copy_(result.narrow(dim, 0, length));
      stack.emplace_back(std::move(local));
    } else {
      stack.emplace_back(result.narrow(dim, 0, length).contiguous());
    }
  };
  return plan;
}

// tril / triu (and in place): every dim keeps its sharding, the matrix dims too. A rank's block
// starts at GLOBAL (row r0, column c0); the global test j - i <= k (tril) or >= k (triu) is
// j' - i' against k + r0 - c0 in local coordinates, so the diagonal argument is shifted per rank.
// Every Partial passes through: zeroing elements commutes with sum, avg, max, min and prod of
// the parts (each part's zeros reduce to zero, the kept elements to their reduction).
OpPlan triangle_rule(const OpCall& call) {
  const Layout& self = call.layout(0);
  if (self.ndim() < 2) fail_argument(call, 0, "has fewer than 2 dims", "a matrix or a batch of matrices");
  OpPlan plan;
  plan.inputs.push_back(intern(self));
  plan.outputs.push_back(plan.inputs[0]);
  if (self.is_sharded_anywhere()) {
    const auto offset = self.global_offset_at(call.mesh->position());
    const int64_t n = self.ndim();
    plan.shifted_int_arg = call.arg_index("diagonal");
    plan.int_shift = offset[n - 2] - offset[n - 1];
  }
  return plan;
}

// unfold_backward(grad_in, input_sizes, dim, size, step): the windows summed back into the input's
// shape. The unfolded dim and grad_in's window dim (its last) are whole; the other dims keep their
// sharding, and input_sizes is this rank's block. Linear (it adds): a sum Partial passes.
OpPlan unfold_backward_rule(const OpCall& call) {
  const Layout& grad = call.layout(0);
  const auto sizes = int_list(call.arg(1));
  const int64_t n = static_cast<int64_t>(sizes.size());
  if (grad.ndim() != std::max<int64_t>(n, 1) + (n > 0 ? 1 : 0))
    fail_argument(call, 0, layout::str_cat("has ", grad.ndim(), " dims"), "the input's dims and a window dim");
  const int64_t dim = wrap_dim(call, int_arg(call.arg(2)), n);
  layout::DimAxes dims = grad.dim_axes();
  if (n > 0) dims[dim].clear();
  dims.back().clear();
  layout::PartialOps partial = grad.partial();
  if (auto op = grad.partial_op(); op && !is_sum_like(*op)) partial.assign(partial.size(), std::nullopt);
  OpPlan plan;
  plan.inputs.push_back(make_layout(grad, grad.global_shape(), dims, partial));
  plan.outputs.push_back(make_layout(grad, sizes, layout::DimAxes(dims.begin(), dims.begin() + n), partial));
  plan.local_shape_arg = 1;
  return plan;
}

// 2-d pools: the along-dims plan; a rank whose channel block is empty (3 channels over 4 ranks),
// which torch's pooling kernels refuse, makes its empty results without the kernel (the max
// pools' second result: int64 indices).
template <bool kLinear>
OpPlan pool2d_rule(const OpCall& call) {
  OpPlan plan = along_dims_rule<Along::kMatrix, kLinear>(call);
  skip_empty_blocks(plan, {c10::ScalarType::Undefined, at::kLong});
  return plan;
}

template <Along A, bool kLinear = false>
void add(Registry& r, std::initializer_list<const char*> names) {
  for (const char* name : names) r.add(name, &along_dims_rule<A, kLinear>, KeyScalars::kAll);
}

}  // namespace

void register_along_dims(Registry& r) {
  r.add("aten::index.Tensor", &index_rule, KeyScalars::kAll);
  for (const char* op : {"aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
    r.add(op, &index_put_rule, KeyScalars::kAll);
  // Discrete Fourier transforms along their dims (linear: a sum Partial passes)
  add<Along::kDimArg, true>(r, {"aten::_fft_c2c", "aten::_fft_c2r", "aten::_fft_r2c"});
  add<Along::kDimArg>(
      r, {"aten::kthvalue", "aten::mode", "aten::median.dim", "aten::nanmedian.dim", "aten::logsumexp", "aten::nansum",
          "aten::norm.ScalarOpt_dim", "aten::std_mean.correction", "aten::var_mean.correction", "aten::aminmax",
          "aten::count_nonzero", "aten::count_nonzero.dim_IntList", "aten::unfold", "aten::unfold_copy", "aten::glu",
          "aten::glu_backward", "aten::hash_tensor"});
  r.add("aten::unfold_backward", &unfold_backward_rule, KeyScalars::kAll);
  // renorm: one norm per slice of dim, so dim keeps its sharding and the others are whole
  add<Along::kAllButDim>(r, {"aten::renorm", "aten::renorm_"});
  // Permutations of elements (linear: a sum Partial passes): rot90 in its two dims, channel and
  // pixel shuffles in the channel (and spatial) dims
  add<Along::kDimArg, true>(r, {"aten::rot90"});
  add<Along::kChannel, true>(r, {"aten::channel_shuffle"});
  add<Along::kLastThree, true>(r, {"aten::pixel_shuffle", "aten::pixel_unshuffle"});
  // Indexing along dim: the indices are GLOBAL coordinates of that dim, which is made whole.
  // A self sharded along dim alone is indexed by ownership (owned_indexing_rule).
  for (const char* op : {"aten::gather",
                         "aten::scatter.src",
                         "aten::scatter.value",
                         "aten::scatter.reduce",
                         "aten::scatter.value_reduce",
                         "aten::scatter_add",
                         "aten::scatter_reduce.two",
                         "aten::index_select",
                         "aten::index_add",
                         "aten::index_copy",
                         "aten::index_fill.int_Scalar",
                         "aten::index_fill.int_Tensor",
                         "aten::scatter_.src",
                         "aten::scatter_.value",
                         "aten::scatter_add_",
                         "aten::scatter_reduce_.two",
                         "aten::scatter_.reduce",
                         "aten::scatter_.value_reduce",
                         "aten::index_add_",
                         "aten::index_copy_",
                         "aten::index_fill_.int_Scalar",
                         "aten::index_fill_.int_Tensor",
                         "aten::index_reduce",
                         "aten::index_reduce_"})
    r.add(op, &owned_indexing_rule, KeyScalars::kAll);
  // The diagonal is shifted per rank by a constant of the plan (OpPlan::shifted_int_arg): its value
  // does not change the plan.
  for (const char* op : {"aten::tril", "aten::tril_", "aten::triu", "aten::triu_"})
    r.add(op, &triangle_rule, KeyScalars::kNone);
  add<Along::kAll>(r, {"aten::median", "aten::nanmedian", "aten::_linalg_check_errors"});
  // 2-d pooling (the last two dims, spatial, whole; batch and channels keep their sharding); the
  // averages are linear in their input (a sum Partial passes), the max pools are not
  for (const char* op : {"aten::avg_pool2d", "aten::avg_pool2d_backward", "aten::_adaptive_avg_pool2d",
                         "aten::_adaptive_avg_pool2d_backward"})
    r.add(op, &pool2d_rule<true>, KeyScalars::kAll);
  for (const char* op : {"aten::max_pool2d_with_indices", "aten::max_pool2d_with_indices_backward",
                         "aten::adaptive_max_pool2d", "aten::adaptive_max_pool2d_backward"})
    r.add(op, &pool2d_rule<false>, KeyScalars::kAll);
  add<Along::kDimArg>(r, {"aten::linalg_cross"});
  add<Along::kLastDim>(r, {"aten::diag_embed"});
  add<Along::kMatrix>(r, {"aten::linalg_inv_ex",
                          "aten::linalg_cholesky_ex",
                          "aten::linalg_lu_factor_ex",
                          "aten::linalg_lu",
                          "aten::linalg_qr",
                          "aten::linalg_eig",
                          "aten::_linalg_eigh",
                          "aten::_linalg_svd",
                          "aten::_linalg_slogdet",
                          "aten::_linalg_det",
                          "aten::linalg_matrix_exp",
                          "aten::linalg_pinv.atol_rtol_tensor",
                          "aten::linalg_lu_solve",
                          "aten::linalg_solve_triangular",
                          "aten::cholesky",
                          "aten::cholesky_inverse",
                          "aten::cholesky_solve",
                          "aten::linalg_ldl_factor_ex",
                          "aten::linalg_ldl_solve",
                          "aten::_linalg_solve_ex",
                          "aten::_linalg_eigvals",
                          "aten::linalg_householder_product",
                          "aten::triangular_solve",
                          "aten::lu_unpack"});
}

}  // namespace hypershard::ops
