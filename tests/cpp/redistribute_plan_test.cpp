#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>

#include "layout/placements.h"
#include "layout/redistribute_plan.h"
#include "layout_enumeration.h"
#include "simulator.h"
#include "test_util.h"

namespace hypershard::layout {
namespace {

using hypershard::testing::expect_error;

MeshPtr mesh_2x2() { return Mesh::create({2, 2}, {"dp", "tp"}); }

Layout alias(const MeshPtr& mesh, std::vector<int64_t> shape, const std::string& text) {
  return from_alias(mesh, std::move(shape), parse_alias(text));
}

std::vector<StepKind> kinds(const RedistributePlan& plan) {
  std::vector<StepKind> out;
  for (const auto& s : plan.steps) out.push_back(s.kind);
  return out;
}

TEST(Plan, SingleAxisTransitionsAreOneStep) {
  auto mesh = Mesh::create({4}, {"tp"});
  const auto r = Layout::replicate(mesh, {8, 4});
  const auto s0 = alias(mesh, {8, 4}, "(\"tp\", \"None\")");
  const auto s1 = alias(mesh, {8, 4}, "(\"None\", \"tp\")");
  const auto p = alias(mesh, {8, 4}, "(\"None\", \"None\") partial(sum: tp)");
  EXPECT_TRUE(plan_redistribute(r, r).steps.empty());
  EXPECT_EQ(kinds(plan_redistribute(r, s0)), std::vector<StepKind>{StepKind::LocalChunk});
  EXPECT_EQ(plan_redistribute(r, s0).total_elements(), 0);
  EXPECT_EQ(kinds(plan_redistribute(r, p)), std::vector<StepKind>{StepKind::PartialFill});
  EXPECT_EQ(plan_redistribute(r, p).total_elements(), 0);
  // S -> R: each of 4 ranks sends its 8 elements to 3 peers.
  EXPECT_EQ(kinds(plan_redistribute(s0, r)), std::vector<StepKind>{StepKind::AllGather});
  EXPECT_EQ(plan_redistribute(s0, r).total_elements(), 4 * 3 * 8);
  // S(0) -> S(1): each rank keeps a quarter of its block.
  EXPECT_EQ(kinds(plan_redistribute(s0, s1)), std::vector<StepKind>{StepKind::AllToAll});
  EXPECT_EQ(plan_redistribute(s0, s1).total_elements(), 4 * 6);
  EXPECT_EQ(kinds(plan_redistribute(p, r)), std::vector<StepKind>{StepKind::AllReduce});
  EXPECT_EQ(plan_redistribute(p, r).total_elements(), 4 * (24 + 3 * 8));
  EXPECT_EQ(kinds(plan_redistribute(p, s1)), std::vector<StepKind>{StepKind::ReduceScatter});
  EXPECT_EQ(plan_redistribute(p, s1).total_elements(), 4 * 24);
}

TEST(Plan, ReorderingAxesOfOneDim) {
  auto mesh = mesh_2x2();
  const auto ab = alias(mesh, {8}, "((\"dp\", \"tp\"),)");
  const auto ba = alias(mesh, {8}, "((\"tp\", \"dp\"),)");
  const auto plan = plan_redistribute(ab, ba);
  // tp (minor) must leave first; the cheapest plan never gathers the whole tensor on dp too.
  ASSERT_FALSE(plan.steps.empty());
  EXPECT_EQ(plan.steps[0].axis, 1);
  EXPECT_LT(plan.total_elements(), plan_redistribute(ab, Layout::replicate(mesh, {8})).total_elements() + 1);
  EXPECT_EQ(plan.steps.back().to, ba);
}

TEST(Plan, PrintsStepsAndBytes) {
  auto mesh = mesh_2x2();
  const auto src = alias(mesh, {4, 4}, "(\"dp\", \"None\") partial(sum: tp)");
  const auto dst = alias(mesh, {4, 4}, "(\"None\", \"tp\")");
  const auto text = plan_redistribute(src, dst).to_string(4);
  EXPECT_NE(text.find("reduce_scatter on axis 'tp' dim 1 (sum)"), std::string::npos) << text;
  EXPECT_NE(text.find("all_gather on axis 'dp' dim 0"), std::string::npos) << text;
  EXPECT_NE(text.find("bytes sent in all"), std::string::npos) << text;
}

TEST(Plan, Errors) {
  auto mesh = mesh_2x2();
  auto other = Mesh::create({4}, {"dp"});
  expect_error([&] { plan_redistribute(Layout::replicate(mesh, {4}), Layout::replicate(other, {4})); },
               "source mesh (dp=2, tp=2) differs from target mesh (dp=4)");
  expect_error([&] { plan_redistribute(Layout::replicate(mesh, {4}), Layout::replicate(mesh, {5})); },
               "source shape [4] differs from target shape [5]");
}

// The state of one mesh axis, to recognise single-axis transitions.
struct AxisState {
  int kind;  // 0 R, 1 P, 2 S
  int64_t dim;
  bool minor_most;
};
AxisState axis_state(const Layout& l, int64_t axis) {
  const int64_t dim = l.sharded_dim(axis);
  if (dim >= 0) return {2, dim, l.dim_axes()[dim].back() == axis};
  return {l.is_partial(axis) ? 1 : 0, -1, false};
}

// The plan a naive executor would run: gather and reduce everything, then chunk and fill.
int64_t gather_everything_cost(const Layout& src, const Layout& dst) {
  int64_t total = 0;
  Layout state = src;
  for (int64_t d = 0; d < state.ndim(); ++d)
    while (!state.dim_axes()[d].empty()) {
      const int64_t axis = state.dim_axes()[d].back();
      total +=
          RedistributeStep{
              StepKind::AllGather, axis,  d,     -1,
              ReduceOp::Sum,       state, state, step_elements_sent(StepKind::AllGather, axis, d, -1, state)}
              .total_elements();
      state = state.without_axis(axis);
    }
  for (int64_t axis = 0; axis < state.mesh()->ndim(); ++axis)
    if (state.is_partial(axis)) {
      total +=
          RedistributeStep{
              StepKind::AllReduce, axis,  -1,    -1,
              ReduceOp::Sum,       state, state, step_elements_sent(StepKind::AllReduce, axis, -1, -1, state)}
              .total_elements();
      state = state.without_axis(axis);
    }
  (void)dst;  // chunk and fill move nothing
  return total;
}

class EveryPair : public ::testing::TestWithParam<std::pair<int, int>> {};

// HS_EXHAUSTIVE_PAIRS=n checks about n pairs per case instead of all of them: the pairs (i, j)
// with (i + j) % stride == 0, so every layout is still a source and a target. `make
// test-sanitize` sets it (ASan and UBSan run about 10x slower); unset or 0 checks every pair.
int64_t pair_stride(size_t layouts) {
  const char* env = std::getenv("HS_EXHAUSTIVE_PAIRS");
  const int64_t limit = env ? std::atoll(env) : 0;
  const auto pairs = static_cast<int64_t>(layouts * layouts);
  return limit > 0 ? std::max<int64_t>(1, pairs / limit) : 1;
}

// For every pair (A, B) of layouts: simulating the plan of A -> B on W ranks turns A's shards into
// B's shards, every step's counted traffic equals the plan's, single-axis transitions take one
// direct step, and no plan costs more than gathering everything.
TEST_P(EveryPair, PlanSimulatesExactly) {
  const auto& mesh_case = hypershard::testing::exhaustive_cases()[GetParam().first];
  const auto& shape = mesh_case.tensor_shapes[GetParam().second];
  auto mesh = hypershard::testing::make_mesh(mesh_case.shape);
  const auto layouts = hypershard::testing::all_layouts(mesh, shape);
  const auto global = hypershard::testing::iota_tensor(shape);
  std::mt19937 rng(1234);
  const int64_t stride = pair_stride(layouts.size());
  int64_t pairs = 0, single_axis = 0;
  for (size_t i = 0; i < layouts.size(); ++i) {
    const auto& a = layouts[i];
    const auto shards = hypershard::testing::make_shards(a, global, rng);
    ASSERT_EQ(hypershard::testing::check_shards(a, global, shards), "") << a.to_string();
    for (size_t j = 0; j < layouts.size(); ++j) {
      if (static_cast<int64_t>(i + j) % stride != 0) continue;
      const auto& b = layouts[j];
      const auto plan = plan_redistribute(a, b);
      // Built only when an assertion fails (gtest streams lazily).
      const auto where = [&] {
        return a.to_string() + " -> " + b.to_string() + " on " + mesh->to_string() + "\nplan:\n" + plan.to_string();
      };
      ASSERT_EQ(plan.steps.empty(), a == b) << where();
      for (size_t i = 0; i < plan.steps.size(); ++i)
        ASSERT_EQ(plan.steps[i].from, i == 0 ? a : plan.steps[i - 1].to) << where();
      if (!plan.steps.empty()) {
        ASSERT_EQ(plan.steps.back().to, b) << where();
      }

      const auto run = hypershard::testing::run_plan(plan, mesh, shards);
      ASSERT_EQ(hypershard::testing::check_shards(b, global, run.shards), "") << where();
      for (size_t i = 0; i < plan.steps.size(); ++i)
        ASSERT_EQ(run.elements_sent[i], plan.steps[i].elements_sent) << where() << "\nstep " << i;

      ASSERT_LE(plan.total_elements(), gather_everything_cost(a, b)) << where();

      // Single-axis transitions (every other axis identical) are one direct step.
      for (int64_t axis = 0; axis < mesh->ndim(); ++axis) {
        if (a == b || a.without_axis(axis) != b.without_axis(axis)) continue;
        const auto sa = axis_state(a, axis), sb = axis_state(b, axis);
        const bool shard_end_ok = (sa.kind != 2 || sa.minor_most) && (sb.kind != 2 || sb.minor_most);
        const bool compatible_fill =
            !(sa.kind == 0 && sb.kind == 1 && a.partial_op() && a.partial_op() != b.partial_op());
        // P -> P (another op) and S -> P are two steps by design: through Replicate.
        if (!shard_end_ok || !compatible_fill || (sb.kind == 1 && sa.kind != 0)) continue;
        ++single_axis;
        ASSERT_EQ(plan.steps.size(), 1u) << where();
        const StepKind expected[3][3] = {
            {StepKind::LocalChunk /*R->R unused*/, StepKind::PartialFill, StepKind::LocalChunk},
            {StepKind::AllReduce, StepKind::AllReduce /*P->P: skipped*/, StepKind::ReduceScatter},
            {StepKind::AllGather, StepKind::AllGather /*S->P: skipped*/, StepKind::AllToAll}};
        ASSERT_EQ(plan.steps[0].kind, expected[sa.kind][sb.kind]) << where();
      }
      ++pairs;
    }
  }
  std::cout << "[ verified ] " << pairs << " layout pairs (" << single_axis << " single-axis) of "
            << layout::shape_string(shape) << " on " << mesh->to_string()
            << (stride > 1 ? " (HS_EXHAUSTIVE_PAIRS: 1 pair in " + std::to_string(stride) + ")" : "") << std::endl;
}

std::vector<std::pair<int, int>> every_case() {
  std::vector<std::pair<int, int>> out;
  const auto& cases = hypershard::testing::exhaustive_cases();
  for (size_t m = 0; m < cases.size(); ++m)
    for (size_t s = 0; s < cases[m].tensor_shapes.size(); ++s) out.emplace_back(m, s);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Exhaustive, EveryPair, ::testing::ValuesIn(every_case()),
                         [](const ::testing::TestParamInfo<std::pair<int, int>>& info) {
                           const auto& c = hypershard::testing::exhaustive_cases()[info.param.first];
                           std::string name = "mesh";
                           for (int64_t s : c.shape) name += "_" + std::to_string(s);
                           name += "_shape";
                           for (int64_t s : c.tensor_shapes[info.param.second]) name += "_" + std::to_string(s);
                           return name;
                         });

}  // namespace
}  // namespace hypershard::layout
