// libFuzzer target over the layout core: notation parsing and conversion, shard geometry and the
// redistribution planner, checked end to end by the simulator of tests/cpp/simulator.h.
//
// Input format (FuzzedDataProvider): the structure comes from the END of the input, the text
// from what is left at the front, so a seed can be plain alias text.
//   - a mesh of 1-3 axes of size 1-4 (at most 16 ranks), axis names from a pool that includes
//     names needing quotes, and optionally a shuffled rank list;
//   - a global shape of 1-3 dims of size 0-7 (even, uneven, empty and size 1);
//   - a source and a target layout, each built one of four ways: torch-style placements (with
//     a shard order), an AliasLayout printed and parsed back, a tensor_map, or Layout::create
//     on raw axis indices. Raw values range a little past the valid ones, so invalid inputs
//     are common;
//   - the remaining bytes, up to the first NUL, as alias text: parse_alias must either succeed
//     or raise LayoutError; when it succeeds and the text fits the mesh, it can replace the
//     target layout. A seed is therefore "<text>\0<structure bytes>".
//
// Only LayoutError (in the house format "hypershard: ...") is allowed for invalid input. The
// mesh's positions, coordinates, axis groups and a sub-mesh must agree. For valid layouts every
// notation must round-trip, the shards must tile the tensor, and the plan must chain from source
// to target, count the traffic the simulator counts, leave the target's shards exact and cost no
// more than going through Replicate. Any violation aborts.
//
//   make test-fuzz                      # bounded run (FUZZ_SECONDS, default 60)
//   build/cpp-fuzz/hypershard_layout_fuzz crash-<sha1>   # replay one input
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "layout/error.h"
#include "layout/placements.h"
#include "layout/redistribute_plan.h"
#include "simulator.h"

namespace hypershard::testing {
namespace {

using layout::AliasLayout;
using layout::DimAxes;
using layout::LayoutError;
using layout::Mesh;
using layout::MeshPtr;
using layout::PartialOps;
using layout::Placement;
using layout::Placements;
using layout::RedistributePlan;
using layout::ReduceOp;
using layout::str_cat;

// Reports `what` and aborts, so that libFuzzer records the input.
[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "layout_fuzz: invariant violated: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

#define FUZZ_CHECK(cond, ...)                                 \
  do {                                                        \
    if (!(cond)) violated(str_cat(#cond, ": ", __VA_ARGS__)); \
  } while (false)

constexpr int64_t kMaxRanks = 16;
constexpr int64_t kMaxDimSize = 7;

// Axis names, some of which need quoting or look like keywords of the alias notation.
const std::vector<std::string>& axis_name_pool() {
  static const std::vector<std::string> pool{"dp", "tp",  "sp",      "ep",  "cp",  "pp",  "x",    "a_1",
                                             "0",  "sum", "partial", "t p", "d-p", "x'y", "q\"r", "None2"};
  return pool;
}

// Runs `build`; an invalid input must raise LayoutError in the house format.
std::optional<layout::Layout> try_layout(const std::function<layout::Layout()>& build) {
  try {
    return build();
  } catch (const LayoutError& e) {
    const std::string message = e.what();
    FUZZ_CHECK(message.rfind("hypershard: ", 0) == 0, "error not in the house format: ", message);
    return std::nullopt;
  }
}

ReduceOp any_op(FuzzedDataProvider& in) { return static_cast<ReduceOp>(in.ConsumeIntegralInRange<int>(0, 4)); }

MeshPtr make_fuzz_mesh(FuzzedDataProvider& in) {
  const int64_t ndim = in.ConsumeIntegralInRange<int64_t>(1, 3);
  std::vector<int64_t> shape;
  int64_t size = 1;
  for (int64_t a = 0; a < ndim; ++a) {
    int64_t s = in.ConsumeIntegralInRange<int64_t>(1, 4);
    while (size * s > kMaxRanks) --s;
    shape.push_back(s);
    size *= s;
  }
  const auto& pool = axis_name_pool();
  std::vector<std::string> names;
  std::vector<bool> used(pool.size(), false);
  for (int64_t a = 0; a < ndim; ++a) {
    size_t i = in.ConsumeIntegralInRange<size_t>(0, pool.size() - 1);
    while (used[i]) i = (i + 1) % pool.size();
    used[i] = true;
    names.push_back(pool[i]);
  }
  std::vector<int64_t> ranks;
  if (in.ConsumeBool()) {  // a shuffled rank list with an offset
    const int64_t offset = in.ConsumeIntegralInRange<int64_t>(0, 3) * 100;
    for (int64_t r = 0; r < size; ++r) ranks.push_back(offset + r);
    for (int64_t r = size - 1; r > 0; --r) std::swap(ranks[r], ranks[in.ConsumeIntegralInRange<int64_t>(0, r)]);
  }
  return Mesh::create(shape, names, ranks);
}

// Positions, coordinates, axis groups and sub-meshes agree with each other.
void check_mesh(const Mesh& mesh, FuzzedDataProvider& in) {
  const std::string where = mesh.to_string();
  for (int64_t p = 0; p < mesh.size(); ++p) {
    FUZZ_CHECK(mesh.position_of(mesh.ranks()[p]) == p, "position of rank ", mesh.ranks()[p], " in ", where);
    FUZZ_CHECK(mesh.position_at(mesh.coordinate_at(p)) == p, "coordinate of position ", p, " in ", where);
  }
  for (int64_t axis = 0; axis < mesh.ndim(); ++axis) {
    std::vector<int64_t> seen(mesh.size(), 0);
    for (const auto& group : mesh.axis_groups(axis)) {
      FUZZ_CHECK(static_cast<int64_t>(group.size()) == mesh.shape()[axis], "group size on axis ", axis, " of ", where);
      const auto first = mesh.coordinate(group[0]);
      for (size_t c = 0; c < group.size(); ++c) {
        auto coord = mesh.coordinate(group[c]);
        FUZZ_CHECK(coord[axis] == static_cast<int64_t>(c), "group order on axis ", axis, " of ", where);
        coord[axis] = first[axis];
        FUZZ_CHECK(coord == first, "group on axis ", axis, " of ", where, " differs off its axis");
        FUZZ_CHECK(mesh.axis_group(axis, group[c]) == group, "axis_group of rank ", group[c], " in ", where);
        ++seen[mesh.position_of(group[c])];
      }
    }
    for (int64_t count : seen) FUZZ_CHECK(count == 1, "axis groups of axis ", axis, " do not partition ", where);
  }
  // The sub-mesh over some axes (in an order from the input) around one rank.
  std::vector<std::string> names;
  for (int64_t a = 0; a < mesh.ndim(); ++a)
    if (in.ConsumeBool()) names.push_back(mesh.axis_names()[a]);
  if (names.empty()) return;
  for (int64_t i = static_cast<int64_t>(names.size()) - 1; i > 0; --i)
    std::swap(names[i], names[in.ConsumeIntegralInRange<int64_t>(0, i)]);
  const int64_t rank = mesh.ranks()[in.ConsumeIntegralInRange<int64_t>(0, mesh.size() - 1)];
  const MeshPtr sub = mesh.submesh(names, rank);
  FUZZ_CHECK(sub->axis_names() == names && sub->contains(rank), "sub-mesh ", sub->to_string(), " of ", where);
  const auto base = mesh.coordinate(rank);
  for (int64_t r : sub->ranks()) {
    auto coord = mesh.coordinate(r);
    const auto sub_coord = sub->coordinate(r);
    for (size_t j = 0; j < names.size(); ++j) {
      const int64_t axis = mesh.axis_index(names[j]);
      FUZZ_CHECK(coord[axis] == sub_coord[j], "sub-mesh coordinate of rank ", r, " in ", sub->to_string(), " of ",
                 where);
      coord[axis] = base[axis];
    }
    FUZZ_CHECK(coord == base, "sub-mesh ", sub->to_string(), " of ", where, " leaves rank ", rank,
               "'s other coordinates");
  }
}

// A permutation of `axes` chosen by the input.
std::vector<int64_t> shuffled(FuzzedDataProvider& in, std::vector<int64_t> axes) {
  for (int64_t i = static_cast<int64_t>(axes.size()) - 1; i > 0; --i)
    std::swap(axes[i], axes[in.ConsumeIntegralInRange<int64_t>(0, i)]);
  return axes;
}

// One layout built through one of the four entry points; nullopt when the input is invalid.
std::optional<layout::Layout> make_fuzz_layout(FuzzedDataProvider& in, const MeshPtr& mesh,
                                               const std::vector<int64_t>& shape) {
  const int64_t mesh_ndim = mesh->ndim();
  const int64_t ndim = static_cast<int64_t>(shape.size());
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: {  // torch-style placements, dims in -ndim-1..ndim, with an optional shard order
      Placements p;
      for (int64_t a = 0; a < mesh_ndim; ++a) {
        switch (in.ConsumeIntegralInRange<int>(0, 2)) {
          case 0:
            p.per_axis.push_back(Placement::replicate());
            break;
          case 1:
            p.per_axis.push_back(Placement::shard(in.ConsumeIntegralInRange<int64_t>(-ndim - 1, ndim)));
            break;
          default:
            p.per_axis.push_back(Placement::partial(any_op(in)));
            break;
        }
      }
      if (in.ConsumeIntegralInRange<int>(0, 5) == 0) p.per_axis.push_back(Placement::replicate());  // one too many
      const int entries = in.ConsumeIntegralInRange<int>(0, 2);
      for (int e = 0; e < entries; ++e) {
        const int64_t dim = in.ConsumeIntegralInRange<int64_t>(-ndim, ndim);
        std::vector<int64_t> axes;
        if (in.ConsumeBool()) {  // usually valid: the axes that shard this dim, reordered
          const int64_t d = dim < 0 ? dim + ndim : dim;
          for (int64_t a = 0; a < static_cast<int64_t>(p.per_axis.size()); ++a)
            if (p.per_axis[a].kind == Placement::Kind::Shard &&
                (p.per_axis[a].dim == d || p.per_axis[a].dim == d - ndim))
              axes.push_back(a);
          axes = shuffled(in, axes);
        } else {
          const int count = in.ConsumeIntegralInRange<int>(0, 3);
          for (int i = 0; i < count; ++i) axes.push_back(in.ConsumeIntegralInRange<int64_t>(-1, mesh_ndim));
        }
        p.shard_order.emplace_back(dim, axes);
      }
      return try_layout([&] { return from_placements(mesh, shape, p); });
    }
    case 1: {  // alias notation: printed, parsed back, converted
      AliasLayout alias;
      const int64_t dims =
          ndim + (in.ConsumeIntegralInRange<int>(0, 7) == 0 ? in.ConsumeIntegralInRange<int64_t>(-1, 1) : 0);
      std::vector<bool> taken(mesh_ndim, false);
      const auto pick_name = [&] {
        const int64_t a = in.ConsumeIntegralInRange<int64_t>(0, mesh_ndim);
        if (a == mesh_ndim) return std::string("zz");  // not on the mesh
        taken[a] = true;
        return mesh->axis_names()[a];
      };
      for (int64_t d = 0; d < dims; ++d) {
        std::vector<std::string> names;
        const int count = in.ConsumeIntegralInRange<int>(0, 2);
        for (int i = 0; i < count; ++i) names.push_back(pick_name());
        alias.dims.push_back(names);
      }
      const ReduceOp op = any_op(in);
      for (int64_t a = 0; a < mesh_ndim; ++a)
        if (in.ConsumeIntegralInRange<int>(0, 3) == 0)
          alias.partial.emplace(mesh->axis_names()[a], in.ConsumeIntegralInRange<int>(0, 4) == 0 ? any_op(in) : op);
      const std::string text = alias.to_string();
      AliasLayout parsed;
      try {
        parsed = layout::parse_alias(text);
      } catch (const LayoutError& e) {
        violated(str_cat("printed alias text does not parse: ", text, ": ", e.what()));
      }
      FUZZ_CHECK(parsed == alias, "alias text round trip: ", text, " parsed back as ", parsed.to_string());
      return try_layout([&] { return from_alias(mesh, shape, parsed); });
    }
    case 2: {  // tensor_map: entries -2..mesh_ndim (valid: -1 alone, or 0..mesh_ndim-1)
      layout::TensorMap map(ndim + (in.ConsumeIntegralInRange<int>(0, 7) == 0 ? 1 : 0));
      for (auto& entry : map) {
        const int count = in.ConsumeIntegralInRange<int>(0, 3);
        for (int i = 0; i < count; ++i) entry.push_back(in.ConsumeIntegralInRange<int64_t>(-2, mesh_ndim));
        if (entry.empty() && in.ConsumeIntegralInRange<int>(0, 3) != 0) entry.push_back(-1);
      }
      PartialOps partial;
      if (in.ConsumeBool()) {
        partial.resize(mesh_ndim);
        const ReduceOp op = any_op(in);
        for (auto& p : partial)
          if (in.ConsumeIntegralInRange<int>(0, 2) == 0) p = op;
      }
      return try_layout([&] { return from_tensor_map(mesh, shape, map, partial); });
    }
    default: {  // Layout::create on raw axis indices -1..mesh_ndim
      DimAxes dims(ndim);
      for (auto& axes : dims) {
        const int count = in.ConsumeIntegralInRange<int>(0, 3);
        for (int i = 0; i < count; ++i) axes.push_back(in.ConsumeIntegralInRange<int64_t>(-1, mesh_ndim));
      }
      PartialOps partial(mesh_ndim);
      for (auto& p : partial)
        if (in.ConsumeIntegralInRange<int>(0, 3) == 0) p = any_op(in);
      return try_layout([&] { return layout::Layout::create(mesh, shape, dims, partial); });
    }
  }
}

// Every notation round-trips, and the shards of the layout tile the tensor.
void check_layout(const layout::Layout& l) {
  const MeshPtr& mesh = l.mesh();
  const auto& shape = l.global_shape();
  const std::string where = l.to_string() + " on " + mesh->to_string();

  const Placements placements = to_placements(l);
  FUZZ_CHECK(from_placements(mesh, shape, placements) == l, "placements round trip of ", where, ": ",
             placements.to_string());
  const AliasLayout alias = to_alias(l);
  FUZZ_CHECK(from_alias(mesh, shape, alias) == l, "alias round trip of ", where);
  const std::string text = alias.to_string();
  try {
    FUZZ_CHECK(layout::parse_alias(text) == alias, "alias text round trip of ", where, ": ", text);
  } catch (const LayoutError& e) {
    violated(str_cat("alias text of ", where, " does not parse: ", text, ": ", e.what()));
  }
  const layout::TensorMap map = to_tensor_map(l);
  FUZZ_CHECK(from_tensor_map(mesh, shape, map, l.partial()) == l, "tensor_map round trip of ", where);

  // Every element is held by exactly (product of the axes that shard nothing) positions.
  int64_t copies = 1;
  for (int64_t a = 0; a < mesh->ndim(); ++a)
    if (!l.is_sharded(a)) copies *= mesh->shape()[a];
  std::vector<int64_t> held(layout::numel(shape), 0);
  for (int64_t p = 0; p < mesh->size(); ++p) {
    const auto local = l.local_shape_at(p);
    const auto offset = l.global_offset_at(p);
    FUZZ_CHECK(local == l.local_shape(mesh->ranks()[p]), "local shape by rank of ", where);
    for (size_t d = 0; d < shape.size(); ++d)
      FUZZ_CHECK(local[d] >= 0 && offset[d] >= 0 && offset[d] + local[d] <= shape[d], "shard of position ", p,
                 " leaves dim ", d, " of ", where);
    const int64_t n = layout::numel(local);
    for (int64_t i = 0; i < n; ++i) {  // row-major index within the shard -> global index
      int64_t rest = i, global = 0, stride = 1;
      for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
        global += (rest % local[d] + offset[d]) * stride;
        rest /= local[d];
        stride *= shape[d];
      }
      ++held[global];
    }
  }
  for (size_t i = 0; i < held.size(); ++i)
    FUZZ_CHECK(held[i] == copies, "element ", i, " is held ", held[i], " times, expected ", copies, ", in ", where);
}

// The plan chains from `src` to `dst`, each step changes one axis and carries the planner's own
// traffic, and the simulator turns the source's shards into exactly the target's.
void check_plan(const layout::Layout& src, const layout::Layout& dst, uint32_t seed) {
  const MeshPtr& mesh = src.mesh();
  RedistributePlan plan;
  try {
    plan = plan_redistribute(src, dst);
  } catch (const LayoutError& e) {
    violated(str_cat("no plan from ", src.to_string(), " to ", dst.to_string(), ": ", e.what()));
  }
  const std::string where =
      src.to_string() + " -> " + dst.to_string() + " on " + mesh->to_string() + "\nplan:\n" + plan.to_string(4);
  FUZZ_CHECK(plan.steps.empty() == (src == dst), where);
  int64_t total = 0;
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const auto& step = plan.steps[i];
    FUZZ_CHECK(step.from == (i == 0 ? src : plan.steps[i - 1].to), "step ", i, " does not chain: ", where);
    FUZZ_CHECK(step.axis >= 0 && step.axis < mesh->ndim(), "step ", i, ": ", where);
    FUZZ_CHECK(step.from.without_axis(step.axis) == step.to.without_axis(step.axis), "step ", i,
               " changes more than its axis: ", where);
    FUZZ_CHECK(static_cast<int64_t>(step.elements_sent.size()) == mesh->size(), "step ", i, ": ", where);
    FUZZ_CHECK(
        step.elements_sent == layout::step_elements_sent(step.kind, step.axis, step.src_dim, step.dst_dim, step.from),
        "step ", i, " traffic differs from the cost model: ", where);
    total += step.total_elements();
  }
  if (!plan.steps.empty()) FUZZ_CHECK(plan.steps.back().to == dst, "the last step misses the target: ", where);
  FUZZ_CHECK(plan.total_elements() == total, where);
  int64_t by_position = 0;
  for (int64_t p = 0; p < mesh->size(); ++p) by_position += plan.elements_sent_at(p);
  FUZZ_CHECK(by_position == total, where);

  const SimTensor global = iota_tensor(src.global_shape());
  std::mt19937 rng(seed);
  const auto shards = make_shards(src, global, rng);
  const std::string source_check = check_shards(src, global, shards);
  FUZZ_CHECK(source_check.empty(), "simulated source shards: ", source_check, ": ", where);
  const SimRun run = run_plan(plan, mesh, shards);
  const std::string target_check = check_shards(dst, global, run.shards);
  FUZZ_CHECK(target_check.empty(), "target shards after the plan: ", target_check, ": ", where);
  FUZZ_CHECK(run.elements_sent.size() == plan.steps.size(), where);
  for (size_t i = 0; i < plan.steps.size(); ++i)
    FUZZ_CHECK(run.elements_sent[i] == plan.steps[i].elements_sent, "step ", i,
               ": the simulator counted other traffic than the plan's: ", where);

  // Going through Replicate is one of the paths the planner searches.
  const auto replicated = layout::Layout::replicate(mesh, src.global_shape());
  const int64_t via_replicate =
      plan_redistribute(src, replicated).total_elements() + plan_redistribute(replicated, dst).total_elements();
  FUZZ_CHECK(plan.total_elements() <= via_replicate, "costs more than via Replicate (", via_replicate, "): ", where);
}

void fuzz_one(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const MeshPtr mesh = make_fuzz_mesh(in);
  std::vector<int64_t> shape(in.ConsumeIntegralInRange<int64_t>(1, 3));
  for (auto& s : shape) s = in.ConsumeIntegralInRange<int64_t>(0, kMaxDimSize);
  const auto src = make_fuzz_layout(in, mesh, shape);
  auto dst = make_fuzz_layout(in, mesh, shape);
  const bool text_is_target = in.ConsumeBool();
  const uint32_t seed = in.ConsumeIntegral<uint32_t>();
  check_mesh(*mesh, in);

  // Whatever the bytes, the parser returns or raises LayoutError; what it returns prints as
  // text that parses back to the same thing.
  std::string text = in.ConsumeRemainingBytesAsString();
  text = text.substr(0, text.find('\0'));  // seeds end their text with a NUL
  std::optional<AliasLayout> alias;
  try {
    alias = layout::parse_alias(text);
  } catch (const LayoutError& e) {
    const std::string message = e.what();
    FUZZ_CHECK(message.rfind("hypershard: ", 0) == 0, "error not in the house format: ", message);
  }
  if (alias) {
    const std::string printed = alias->to_string();
    AliasLayout reparsed;
    try {
      reparsed = layout::parse_alias(printed);
    } catch (const LayoutError& e) {
      violated(str_cat("the printed form of parsed text does not parse: ", printed, ": ", e.what()));
    }
    FUZZ_CHECK(reparsed == *alias, "parse(print(parse(text))) differs: ", printed, " vs ", reparsed.to_string());
    const auto from_text = try_layout([&] { return from_alias(mesh, shape, *alias); });
    if (from_text) {
      check_layout(*from_text);
      if (text_is_target) dst = from_text;
    }
  }

  if (src) check_layout(*src);
  if (dst) check_layout(*dst);
  if (src && dst) {
    check_plan(*src, *dst, seed);
    FUZZ_CHECK(plan_redistribute(*src, *src).steps.empty(), "a plan to itself has steps: ", src->to_string());
  }
}

}  // namespace
}  // namespace hypershard::testing

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    hypershard::testing::fuzz_one(data, size);
  } catch (const hypershard::layout::LayoutError& e) {  // invalid inputs are caught where they arise
    hypershard::testing::violated(std::string("LayoutError from a valid input: ") + e.what());
  }
  return 0;
}
