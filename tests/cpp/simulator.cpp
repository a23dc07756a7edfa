#include "simulator.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "layout/error.h"

namespace hypershard::testing {
namespace {

using layout::chunk_span;
using layout::ReduceOp;
using layout::StepKind;

std::vector<int64_t> strides_of(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
  return strides;
}

// The box [begin, begin + shape) of `t`.
SimTensor slice(const SimTensor& t, const std::vector<int64_t>& begin, const std::vector<int64_t>& shape) {
  SimTensor out{shape, std::vector<double>(layout::numel(shape))};
  const auto src_strides = strides_of(t.shape);
  const auto dst_strides = strides_of(shape);
  for (int64_t i = 0; i < static_cast<int64_t>(out.values.size()); ++i) {
    int64_t src = 0;
    for (size_t d = 0; d < shape.size(); ++d) src += ((i / dst_strides[d]) % shape[d] + begin[d]) * src_strides[d];
    out.values[i] = t.values[src];
  }
  return out;
}

SimTensor chunk_along(const SimTensor& t, int64_t dim, int64_t parts, int64_t index) {
  const auto span = chunk_span(t.shape[dim], parts, index);
  std::vector<int64_t> begin(t.shape.size(), 0), shape = t.shape;
  begin[dim] = span.begin;
  shape[dim] = span.length;
  return slice(t, begin, shape);
}

SimTensor concat_along(const std::vector<SimTensor>& pieces, int64_t dim) {
  SimTensor out{pieces.at(0).shape, {}};
  out.shape[dim] = 0;
  for (const auto& p : pieces) out.shape[dim] += p.shape[dim];
  out.values.assign(layout::numel(out.shape), 0.0);
  const auto dst_strides = strides_of(out.shape);
  int64_t offset = 0;
  for (const auto& p : pieces) {
    const auto src_strides = strides_of(p.shape);
    for (int64_t i = 0; i < static_cast<int64_t>(p.values.size()); ++i) {
      int64_t dst = 0;
      for (size_t d = 0; d < p.shape.size(); ++d) {
        int64_t c = (i / src_strides[d]) % p.shape[d];
        if (static_cast<int64_t>(d) == dim) c += offset;
        dst += c * dst_strides[d];
      }
      out.values[dst] = p.values[i];
    }
    offset += p.shape[dim];
  }
  return out;
}

double combine(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return a + b;
    case ReduceOp::Max:
      return std::max(a, b);
    case ReduceOp::Min:
      return std::min(a, b);
    case ReduceOp::Prod:
      return a * b;
  }
  return 0;
}

// Elementwise reduction of equally shaped tensors (avg divides at the end).
SimTensor reduce_all(const std::vector<SimTensor>& inputs, ReduceOp op) {
  SimTensor out = inputs.at(0);
  for (size_t i = 1; i < inputs.size(); ++i) {
    if (inputs[i].shape != out.shape) layout::fail("simulator", "reduce of tensors with different shapes");
    for (size_t j = 0; j < out.values.size(); ++j) out.values[j] = combine(op, out.values[j], inputs[i].values[j]);
  }
  if (op == ReduceOp::Avg)
    for (double& v : out.values) v /= static_cast<double>(inputs.size());
  return out;
}

// Splits `value` into `count` contributions whose reduction under `op` is exactly `value`.
std::vector<double> split_value(double value, int64_t count, ReduceOp op, std::mt19937& rng) {
  std::uniform_int_distribution<int> small(1, 9);
  std::vector<double> parts(count);
  const int64_t keeper = std::uniform_int_distribution<int64_t>(0, count - 1)(rng);
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: {
      double rest = op == ReduceOp::Sum ? value : value * static_cast<double>(count);
      for (int64_t i = 0; i < count; ++i) {
        if (i == keeper) continue;
        parts[i] = small(rng) - 5;
        rest -= parts[i];
      }
      parts[keeper] = rest;
      break;
    }
    case ReduceOp::Max:
    case ReduceOp::Min:
      for (int64_t i = 0; i < count; ++i)
        parts[i] = i == keeper ? value : value + (op == ReduceOp::Max ? -small(rng) : small(rng));
      break;
    case ReduceOp::Prod: {
      // Powers of two keep every product exact.
      int exponent_sum = 0;
      for (int64_t i = 0; i < count; ++i) {
        if (i == keeper) continue;
        const int e = small(rng) % 5 - 2;
        parts[i] = std::ldexp(1.0, e);
        exponent_sum += e;
      }
      parts[keeper] = std::ldexp(value, -exponent_sum);
      break;
    }
  }
  return parts;
}

// Mesh positions that differ from `position` only on the given axes, in row-major order.
std::vector<int64_t> group_over(const layout::Mesh& mesh, int64_t position, const std::vector<int64_t>& axes) {
  std::vector<int64_t> group;
  for (int64_t p = 0; p < mesh.size(); ++p) {
    bool same = true;
    for (int64_t a = 0; a < mesh.ndim() && same; ++a)
      same = std::find(axes.begin(), axes.end(), a) != axes.end() ||
             mesh.coordinate_on(p, a) == mesh.coordinate_on(position, a);
    if (same) group.push_back(p);
  }
  return group;
}

std::vector<int64_t> partial_axes(const Layout& layout) {
  std::vector<int64_t> axes;
  for (int64_t a = 0; a < layout.mesh()->ndim(); ++a)
    if (layout.is_partial(a)) axes.push_back(a);
  return axes;
}

}  // namespace

SimTensor iota_tensor(const std::vector<int64_t>& shape) {
  SimTensor t{shape, std::vector<double>(layout::numel(shape))};
  for (size_t i = 0; i < t.values.size(); ++i) t.values[i] = static_cast<double>(i + 1);
  return t;
}

std::vector<SimTensor> make_shards(const Layout& layout, const SimTensor& global, std::mt19937& rng) {
  const auto& mesh = *layout.mesh();
  std::vector<SimTensor> shards(mesh.size());
  for (int64_t p = 0; p < mesh.size(); ++p)
    shards[p] = slice(global, layout.global_offset_at(p), layout.local_shape_at(p));
  const auto axes = partial_axes(layout);
  if (axes.empty()) return shards;
  const ReduceOp op = *layout.partial_op();
  std::vector<bool> handled(mesh.size(), false);
  for (int64_t p = 0; p < mesh.size(); ++p) {
    if (handled[p]) continue;
    const auto group = group_over(mesh, p, axes);
    const SimTensor original = shards[p];
    for (size_t i = 0; i < original.values.size(); ++i) {
      const auto parts = split_value(original.values[i], static_cast<int64_t>(group.size()), op, rng);
      for (size_t g = 0; g < group.size(); ++g) shards[group[g]].values[i] = parts[g];
    }
    for (int64_t q : group) handled[q] = true;
  }
  return shards;
}

SimRun run_plan(const layout::RedistributePlan& plan, const layout::MeshPtr& mesh_ptr, std::vector<SimTensor> shards) {
  const auto& mesh = *mesh_ptr;
  SimRun run;
  for (const auto& step : plan.steps) {
    const int64_t axis = step.axis;
    const int64_t k = mesh.shape()[axis];
    std::vector<SimTensor> next(mesh.size());
    std::vector<int64_t> sent(mesh.size(), 0);
    std::vector<bool> handled(mesh.size(), false);
    for (int64_t p = 0; p < mesh.size(); ++p) {
      if (handled[p]) continue;
      const auto group = group_over(mesh, p, {axis});  // ordered by coordinate on `axis`
      for (int64_t q : group) handled[q] = true;
      switch (step.kind) {
        case StepKind::LocalChunk:
          for (int64_t c = 0; c < k; ++c) next[group[c]] = chunk_along(shards[group[c]], step.dst_dim, k, c);
          break;
        case StepKind::PartialFill:
          for (int64_t c = 0; c < k; ++c) {
            next[group[c]] = shards[group[c]];
            if (c == 0 || step.op == ReduceOp::Max || step.op == ReduceOp::Min || step.op == ReduceOp::Avg) continue;
            std::fill(next[group[c]].values.begin(), next[group[c]].values.end(),
                      step.op == ReduceOp::Prod ? 1.0 : 0.0);
          }
          break;
        case StepKind::AllGather: {
          std::vector<SimTensor> pieces;
          for (int64_t c = 0; c < k; ++c) {
            pieces.push_back(shards[group[c]]);
            sent[group[c]] += (k - 1) * static_cast<int64_t>(shards[group[c]].values.size());
          }
          const SimTensor whole = concat_along(pieces, step.src_dim);
          for (int64_t c = 0; c < k; ++c) next[group[c]] = whole;
          break;
        }
        case StepKind::AllToAll:
        case StepKind::ReduceScatter: {
          // pieces[dst][src]: the chunk `dst` of the sender `src`.
          std::vector<std::vector<SimTensor>> pieces(k, std::vector<SimTensor>(k));
          for (int64_t src = 0; src < k; ++src)
            for (int64_t dst = 0; dst < k; ++dst) {
              pieces[dst][src] = chunk_along(shards[group[src]], step.dst_dim, k, dst);
              if (dst != src) sent[group[src]] += static_cast<int64_t>(pieces[dst][src].values.size());
            }
          for (int64_t dst = 0; dst < k; ++dst)
            next[group[dst]] = step.kind == StepKind::AllToAll ? concat_along(pieces[dst], step.src_dim)
                                                               : reduce_all(pieces[dst], step.op);
          break;
        }
        case StepKind::AllReduce: {
          const auto shape = shards[group[0]].shape;
          const int64_t n = static_cast<int64_t>(shards[group[0]].values.size());
          std::vector<SimTensor> reduced(k);
          for (int64_t dst = 0; dst < k; ++dst) {  // reduce_scatter of the flat buffer
            const auto span = chunk_span(n, k, dst);
            std::vector<SimTensor> contributions;
            for (int64_t src = 0; src < k; ++src) {
              const auto& v = shards[group[src]].values;
              contributions.push_back(
                  {{span.length}, std::vector<double>(v.begin() + span.begin, v.begin() + span.begin + span.length)});
              if (src != dst) sent[group[src]] += span.length;
            }
            reduced[dst] = reduce_all(contributions, step.op);
          }
          SimTensor whole{shape, {}};  // all_gather of the reduced pieces
          for (int64_t src = 0; src < k; ++src) {
            whole.values.insert(whole.values.end(), reduced[src].values.begin(), reduced[src].values.end());
            sent[group[src]] += (k - 1) * static_cast<int64_t>(reduced[src].values.size());
          }
          for (int64_t c = 0; c < k; ++c) next[group[c]] = whole;
          break;
        }
      }
    }
    shards = std::move(next);
    run.elements_sent.push_back(std::move(sent));
  }
  run.shards = std::move(shards);
  return run;
}

std::string check_shards(const Layout& layout, const SimTensor& global, const std::vector<SimTensor>& shards) {
  const auto& mesh = *layout.mesh();
  const auto axes = partial_axes(layout);
  for (int64_t p = 0; p < mesh.size(); ++p) {
    const SimTensor expected = slice(global, layout.global_offset_at(p), layout.local_shape_at(p));
    SimTensor actual = shards[p];
    if (!axes.empty()) {
      std::vector<SimTensor> contributions;
      for (int64_t q : group_over(mesh, p, axes)) contributions.push_back(shards[q]);
      if (std::any_of(contributions.begin(), contributions.end(),
                      [&](const SimTensor& t) { return t.shape != expected.shape; }))
        return "position " + std::to_string(p) + ": a Partial contribution has the wrong shape";
      actual = reduce_all(contributions, *layout.partial_op());
    }
    if (actual.shape != expected.shape)
      return "position " + std::to_string(p) + ": local shape " + layout::shape_string(actual.shape) + ", expected " +
             layout::shape_string(expected.shape);
    for (size_t i = 0; i < expected.values.size(); ++i)
      if (std::abs(actual.values[i] - expected.values[i]) > 1e-9 * std::max(1.0, std::abs(expected.values[i]))) {
        std::ostringstream out;
        out << "position " << p << " element " << i << ": " << actual.values[i] << ", expected " << expected.values[i];
        return out.str();
      }
  }
  return "";
}

}  // namespace hypershard::testing
