#include <gtest/gtest.h>

#include "layout/placements.h"
#include "layout_enumeration.h"
#include "test_util.h"

namespace hypershard::layout {
namespace {

using hypershard::testing::expect_error;

TEST(Placements, DefaultOrderNeedsNoEntry) {
  auto mesh = Mesh::create({2, 2}, {"dp", "tp"});
  auto layout = from_placements(mesh, {8, 6}, {{Placement::shard(0), Placement::shard(-2)}, {}});
  EXPECT_EQ(layout.dim_axes()[0], (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(to_placements(layout).to_string(), "(Shard(0), Shard(0))");
  auto reversed = from_placements(mesh, {8, 6}, {{Placement::shard(0), Placement::shard(0)}, {{0, {1, 0}}}});
  EXPECT_EQ(reversed.dim_axes()[0], (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(to_placements(reversed).to_string(), "(Shard(0), Shard(0)) order{0: [1, 0]}");
  auto partial = from_placements(mesh, {8}, {{Placement::partial(ReduceOp::Avg), Placement::replicate()}, {}});
  EXPECT_EQ(to_placements(partial).to_string(), "(Partial(avg), Replicate())");
}

TEST(Alias, ParseAndPrint) {
  auto alias = parse_alias("((\"dp\", 'tp'), None, \"None\", \"sp\",) partial(sum: ep)");
  ASSERT_EQ(alias.dims.size(), 4u);
  EXPECT_EQ(alias.dims[0], (std::vector<std::string>{"dp", "tp"}));
  EXPECT_TRUE(alias.dims[1].empty());
  EXPECT_TRUE(alias.dims[2].empty());
  EXPECT_EQ(alias.partial.at("ep"), ReduceOp::Sum);
  EXPECT_EQ(alias.to_string(), "((\"dp\", \"tp\"), \"None\", \"None\", \"sp\") partial(sum: ep)");
  EXPECT_EQ(parse_alias("(\"dp\",)").to_string(), "(\"dp\",)");
  EXPECT_EQ(parse_alias("()").dims.size(), 0u);
  EXPECT_EQ(parse_alias("(\"None\",) partial(max: dp, tp)").to_string(), "(\"None\",) partial(max: dp, tp)");
}

// Found by the fuzzer: axis names that are not bare words used to print unquoted in
// partial(...), and names holding a double quote inside double quotes, so Layout::to_string gave
// text that parse_alias rejected or read differently.
TEST(Alias, NamesThatNeedQuotesRoundTrip) {
  auto mesh = Mesh::create({2, 2, 1}, {"t p", "q\"r", "x'y"});
  const auto layout = Layout::create(mesh, {4, 3}, {{1}, {}}, {ReduceOp::Sum, std::nullopt, ReduceOp::Sum});
  EXPECT_EQ(layout.sharding_string(), R"x(('q"r', "None") partial(sum: "t p", "x'y"))x");
  for (const auto& l : hypershard::testing::all_layouts(mesh, {4, 3})) {
    const std::string text = to_alias(l).to_string();
    ASSERT_EQ(from_alias(mesh, {4, 3}, parse_alias(text)), l) << text;
  }
}

TEST(Alias, HyperParallelExamples) {
  auto mesh = Mesh::create({2, 4}, {"dp", "tp"});
  auto a = from_alias(mesh, {8, 16}, parse_alias("(\"dp\", \"None\")"));
  EXPECT_EQ(a.dim_axes(), (DimAxes{{0}, {}}));
  auto b = from_alias(mesh, {8, 16}, parse_alias("((\"dp\", \"tp\"), \"None\")"));
  EXPECT_EQ(b.dim_axes(), (DimAxes{{0, 1}, {}}));
}

TEST(TensorMap, CountsFromTheRight) {
  auto mesh = Mesh::create({2, 4}, {"dp", "tp"});
  // MindSpore: device matrix (2, 4); tensor_map (1, -1) = dim 0 split on dp (index 1 from the right).
  auto layout = from_tensor_map(mesh, {8, 16}, {{1}, {-1}});
  EXPECT_EQ(layout.dim_axes(), (DimAxes{{0}, {}}));
  EXPECT_EQ(to_tensor_map(from_alias(mesh, {8, 16}, parse_alias("(\"None\", (\"tp\", \"dp\"))"))),
            (TensorMap{{-1}, {0, 1}}));
}

// Every layout on every test mesh survives each notation both ways.
TEST(Converters, RoundTripEveryLayout) {
  int64_t checked = 0;
  for (const auto& c : hypershard::testing::exhaustive_cases()) {
    auto mesh = hypershard::testing::make_mesh(c.shape);
    for (const auto& shape : c.tensor_shapes) {
      for (const auto& layout : hypershard::testing::all_layouts(mesh, shape)) {
        ASSERT_EQ(from_placements(mesh, shape, to_placements(layout)), layout) << layout.to_string();
        ASSERT_EQ(from_alias(mesh, shape, to_alias(layout)), layout) << layout.to_string();
        ASSERT_EQ(from_alias(mesh, shape, parse_alias(to_alias(layout).to_string())), layout) << layout.to_string();
        ASSERT_EQ(from_tensor_map(mesh, shape, to_tensor_map(layout), layout.partial()), layout) << layout.to_string();
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 2396);  // the exhaustive set with all five reduce ops
}

TEST(Converters, Errors) {
  auto mesh = Mesh::create({2, 2}, {"dp", "tp"});
  const Placement s0 = Placement::shard(0), r = Placement::replicate();
  expect_error([&] { from_placements(mesh, {4}, {{s0}, {}}); }, "1 placements given for mesh (dp=2, tp=2) with 2 axes");
  expect_error([&] { from_placements(mesh, {4}, {{Placement::shard(1), r}, {}}); },
               "Shard on mesh axis 'dp' names dim 1 of a 1-d tensor; allowed: -1..0");
  expect_error([&] { from_placements(mesh, {}, {{s0, r}, {}}); }, "a 0-d tensor cannot be sharded");
  expect_error([&] { from_placements(mesh, {4}, {{Placement::shard(-2), r}, {}}); }, "names dim -2");
  expect_error([&] { from_placements(mesh, {4}, {{s0, s0}, {{0, {1}}}}); }, "shard order for dim 0 must list exactly");
  expect_error([&] { from_placements(mesh, {4}, {{s0, s0}, {{0, {1, 0}}, {0, {0, 1}}}}); },
               "shard order lists dim 0 twice");
  expect_error([&] { from_placements(mesh, {4}, {{s0, r}, {{3, {0}}}}); }, "shard order names dim 3");
  expect_error(
      [&] { from_placements(mesh, {4}, {{Placement::partial(ReduceOp::Sum), Placement::partial(ReduceOp::Max)}, {}}); },
      "one reduce op for all Partial axes");
  expect_error([&] { from_placements(nullptr, {4}, {{s0}, {}}); }, "no mesh given");
  expect_error([&] { from_alias(mesh, {4, 4}, parse_alias("(\"dp\",)")); }, "names 1 dims but the tensor [4, 4] has 2");
  expect_error([&] { from_alias(mesh, {4}, parse_alias("(\"sp\",)")); }, "no axis named 'sp'");
  expect_error([&] { from_alias(mesh, {4, 4}, parse_alias("(\"dp\", \"dp\")")); },
               "mesh axis 'dp' shards dims 0 and 1");
  expect_error([&] { from_alias(mesh, {4}, parse_alias("(\"dp\",) partial(sum: dp)")); },
               "is either sharding or Partial");
  expect_error([&] { from_alias(mesh, {4}, parse_alias("(\"None\",) partial(sum: xx)")); }, "no axis named 'xx'");
  expect_error([] { parse_alias("\"dp\""); }, "expected '(' but found '\"dp\"'");
  expect_error([] { parse_alias("(\"dp\""); }, "missing ')'");
  expect_error([] { parse_alias("(\"dp\" \"tp\")"); }, "expected ',' or ')'");
  expect_error([] { parse_alias("(dp,)"); }, "expected a quoted axis name but found 'dp'");
  expect_error([] { parse_alias("(\"dp)"); }, "unterminated quoted name");
  expect_error([] { parse_alias("(\"\",)"); }, "empty axis name");
  expect_error([] { parse_alias("((),)"); }, "an empty tuple is not a dim");
  expect_error([] { parse_alias("((\"dp\", \"None\"),)"); }, "\"None\" cannot appear inside");
  expect_error([] { parse_alias("(\"dp\",) extra"); }, "expected 'partial' but found 'extra'");
  expect_error([] { parse_alias("(\"dp\",) partial(sum tp)"); }, "expected ':'");
  expect_error([] { parse_alias("(\"None\",) partial(sum: dp, dp)"); }, "axis 'dp' is Partial twice");
  expect_error([] { parse_alias("(\"None\",) partial(sum: )"); }, "expected an axis name");
  expect_error([] { parse_alias("(\"None\",) partial(mean: dp)"); }, "unknown Partial reduce op 'mean'");
  expect_error([] { parse_alias("(\"None\",) partial(sum: dp) x"); }, "unexpected 'x' after partial");
  expect_error([] { parse_alias("(\"dp\"#)"); }, "unexpected character '#'");
  expect_error([&] { from_tensor_map(mesh, {4, 4}, {{0}}); },
               "tensor_map has 1 entries but the tensor [4, 4] has 2 dims");
  expect_error([&] { from_tensor_map(mesh, {4}, {{}}); }, "entry for dim 0 is empty");
  expect_error([&] { from_tensor_map(mesh, {4}, {{2}}); }, "entry 2 for dim 0 is out of range");
  expect_error([&] { from_tensor_map(mesh, {4}, {{-1, 0}}); }, "entry -1 for dim 0 is out of range");
  expect_error([&] { from_tensor_map(mesh, {4, 4}, {{0}, {0}}); }, "mesh axis 'tp' shards dims 0 and 1");
}

}  // namespace
}  // namespace hypershard::layout
