#include "layout/redistribute_plan.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "layout/error.h"

namespace hypershard::layout {
namespace {

constexpr const char* kContext = "redistribute";

// A state's identity for the search: per dim its axes (then -1), then per axis its Partial op.
std::vector<int64_t> state_key(const Layout& layout) {
  std::vector<int64_t> key;
  for (const auto& axes : layout.dim_axes()) {
    key.insert(key.end(), axes.begin(), axes.end());
    key.push_back(-1);
  }
  for (const auto& p : layout.partial()) key.push_back(p ? static_cast<int64_t>(*p) : -1);
  return key;
}

bool is_minor_most(const Layout& layout, int64_t axis, int64_t dim) {
  const auto& axes = layout.dim_axes()[dim];
  return !axes.empty() && axes.back() == axis;
}

struct Edge {
  StepKind kind;
  int64_t axis;
  int64_t src_dim;
  int64_t dst_dim;
  ReduceOp op;
  Layout to;
};

// Single-axis moves from `state` that keep every axis in {its target state, Replicate}
// (an axis still in its source state can only leave it).
std::vector<Edge> edges_from(const Layout& state, const Layout& dst) {
  std::vector<Edge> edges;
  const int64_t mesh_ndim = state.mesh()->ndim();
  for (int64_t axis = 0; axis < mesh_ndim; ++axis) {
    const int64_t target_dim = dst.sharded_dim(axis);
    const auto target_op = dst.partial()[axis];
    const int64_t dim = state.sharded_dim(axis);
    if (state.is_replicate(axis)) {
      if (target_dim >= 0)
        edges.push_back(
            {StepKind::LocalChunk, axis, -1, target_dim, ReduceOp::Sum, state.with_minor_shard(axis, target_dim)});
      if (target_op) {
        const auto current_op = state.partial_op();
        if (!current_op || *current_op == *target_op)
          edges.push_back({StepKind::PartialFill, axis, -1, -1, *target_op, state.with_partial(axis, target_op)});
      }
    } else if (dim >= 0) {
      if (!is_minor_most(state, axis, dim)) continue;  // minor axes must leave first
      const Layout gathered = state.without_axis(axis);
      edges.push_back({StepKind::AllGather, axis, dim, -1, ReduceOp::Sum, gathered});
      if (target_dim >= 0 && target_dim != dim)
        edges.push_back(
            {StepKind::AllToAll, axis, dim, target_dim, ReduceOp::Sum, gathered.with_minor_shard(axis, target_dim)});
    } else {
      const ReduceOp op = *state.partial()[axis];
      const Layout reduced = state.with_partial(axis, std::nullopt);
      edges.push_back({StepKind::AllReduce, axis, -1, -1, op, reduced});
      if (target_dim >= 0)
        edges.push_back(
            {StepKind::ReduceScatter, axis, -1, target_dim, op, reduced.with_minor_shard(axis, target_dim)});
    }
  }
  return edges;
}

int64_t sum_of(const std::vector<int64_t>& values) {
  int64_t total = 0;
  for (int64_t v : values) total += v;
  return total;
}

}  // namespace

const char* step_kind_name(StepKind kind) {
  switch (kind) {
    case StepKind::LocalChunk:
      return "local_chunk";
    case StepKind::PartialFill:
      return "partial_fill";
    case StepKind::AllGather:
      return "all_gather";
    case StepKind::AllToAll:
      return "all_to_all";
    case StepKind::AllReduce:
      return "all_reduce";
    case StepKind::ReduceScatter:
      return "reduce_scatter";
  }
  return "?";
}

std::vector<int64_t> step_elements_sent(StepKind kind, int64_t axis, int64_t src_dim, int64_t dst_dim,
                                        const Layout& from) {
  const Mesh& mesh = *from.mesh();
  const int64_t parts = mesh.shape()[axis];
  std::vector<int64_t> sent(mesh.size(), 0);
  for (int64_t pos = 0; pos < mesh.size(); ++pos) {
    const std::vector<int64_t> local = from.local_shape_at(pos);
    const int64_t coord = mesh.coordinate_on(pos, axis);
    const int64_t n = numel(local);
    switch (kind) {
      case StepKind::LocalChunk:
      case StepKind::PartialFill:
        break;
      case StepKind::AllGather:
        sent[pos] = (parts - 1) * n;
        break;
      case StepKind::AllToAll:
      case StepKind::ReduceScatter: {
        // Everything but the piece of dst_dim this rank keeps goes to its owner.
        const int64_t length = local[dst_dim];
        if (length == 0) break;
        const int64_t kept = chunk_span(length, parts, coord).length;
        sent[pos] = n / length * (length - kept);
        break;
      }
      case StepKind::AllReduce: {
        // reduce_scatter then all_gather of the flattened tensor's torch.chunk pieces.
        const int64_t own = chunk_span(n, parts, coord).length;
        sent[pos] = (n - own) + (parts - 1) * own;
        break;
      }
    }
  }
  (void)src_dim;
  return sent;
}

int64_t RedistributeStep::total_elements() const { return sum_of(elements_sent); }

std::string RedistributeStep::to_string() const {
  std::string out = str_cat(step_kind_name(kind), " on axis '", from.mesh()->axis_names()[axis], "'");
  if (src_dim >= 0 && dst_dim >= 0)
    out += str_cat(" dim ", src_dim, " -> dim ", dst_dim);
  else if (src_dim >= 0)
    out += str_cat(" dim ", src_dim);
  else if (dst_dim >= 0)
    out += str_cat(" dim ", dst_dim);
  if (kind == StepKind::AllReduce || kind == StepKind::ReduceScatter || kind == StepKind::PartialFill)
    out += str_cat(" (", reduce_op_name(op), ")");
  return out + ": " + from.sharding_string() + " -> " + to.sharding_string();
}

int64_t RedistributePlan::total_elements() const {
  int64_t total = 0;
  for (const auto& step : steps) total += step.total_elements();
  return total;
}

int64_t RedistributePlan::elements_sent_at(int64_t position) const {
  int64_t total = 0;
  for (const auto& step : steps) total += step.elements_sent.at(position);
  return total;
}

std::string RedistributePlan::to_string(int64_t element_size) const {
  if (steps.empty()) return "(no steps)";
  std::string out;
  for (size_t i = 0; i < steps.size(); ++i) {
    out += str_cat(i ? "\n" : "", i + 1, ". ", steps[i].to_string());
    const int64_t total = steps[i].total_elements();
    if (element_size > 0)
      out += str_cat("  [", total * element_size, " bytes sent in all]");
    else
      out += str_cat("  [", total, " elements sent in all]");
  }
  return out;
}

RedistributePlan plan_redistribute(const Layout& src, const Layout& dst) {
  HS_CHECK(src.mesh() && dst.mesh() && *src.mesh() == *dst.mesh(), kContext, "source mesh ",
           src.mesh() ? src.mesh()->to_string() : "none", " differs from target mesh ",
           dst.mesh() ? dst.mesh()->to_string() : "none", "; allowed: the same mesh");
  HS_CHECK(src.global_shape() == dst.global_shape(), kContext, "source shape ", shape_string(src.global_shape()),
           " differs from target shape ", shape_string(dst.global_shape()), "; allowed: the same global shape");
  const auto target = state_key(dst);

  // Dijkstra over layouts; (elements, steps, key) orders the frontier deterministically.
  struct Visit {
    int64_t cost;
    int64_t steps;
    std::vector<int64_t> parent;
    std::optional<RedistributeStep> step;
    Layout layout;
  };
  using Entry = std::tuple<int64_t, int64_t, std::vector<int64_t>>;
  std::map<std::vector<int64_t>, Visit> visits;
  std::set<std::vector<int64_t>> done;
  std::set<Entry> frontier;
  const auto start = state_key(src);
  visits.emplace(start, Visit{0, 0, {}, std::nullopt, src});
  frontier.emplace(0, 0, start);
  while (!frontier.empty()) {
    const auto [cost, steps, key] = *frontier.begin();
    frontier.erase(frontier.begin());
    if (!done.insert(key).second) continue;
    if (key == target) break;
    const Layout current = visits.at(key).layout;
    for (Edge& edge : edges_from(current, dst)) {
      auto next_key = state_key(edge.to);
      if (done.count(next_key)) continue;
      RedistributeStep step{
          edge.kind,    edge.axis,
          edge.src_dim, edge.dst_dim,
          edge.op,      current,
          edge.to,      step_elements_sent(edge.kind, edge.axis, edge.src_dim, edge.dst_dim, current)};
      const int64_t next_cost = cost + step.total_elements();
      auto it = visits.find(next_key);
      if (it != visits.end() &&
          std::make_pair(it->second.cost, it->second.steps) <= std::make_pair(next_cost, steps + 1))
        continue;
      if (it != visits.end()) frontier.erase(Entry{it->second.cost, it->second.steps, next_key});
      Layout to = edge.to;
      visits.insert_or_assign(next_key, Visit{next_cost, steps + 1, key, std::move(step), std::move(to)});
      frontier.emplace(next_cost, steps + 1, std::move(next_key));
    }
  }
  HS_CHECK(done.count(target), kContext, "internal error: no plan from ", src.to_string(), " to ", dst.to_string());
  RedistributePlan plan;
  for (auto key = target; key != start;) {
    Visit& visit = visits.at(key);
    plan.steps.push_back(std::move(*visit.step));
    key = visit.parent;
  }
  std::reverse(plan.steps.begin(), plan.steps.end());
  return plan;
}

}  // namespace hypershard::layout
