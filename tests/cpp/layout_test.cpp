#include <gtest/gtest.h>

#include "layout/layout.h"
#include "layout_enumeration.h"
#include "test_util.h"

namespace hypershard::layout {
namespace {

using hypershard::testing::expect_error;

TEST(ChunkSpan, FollowsTorchChunk) {
  // torch.chunk(arange(5), 4) -> sizes 2, 2, 1 and an empty fourth shard.
  EXPECT_EQ(chunk_span(5, 4, 0).length, 2);
  EXPECT_EQ(chunk_span(5, 4, 2).begin, 4);
  EXPECT_EQ(chunk_span(5, 4, 2).length, 1);
  EXPECT_EQ(chunk_span(5, 4, 3).begin, 5);
  EXPECT_EQ(chunk_span(5, 4, 3).length, 0);
  // torch.chunk(arange(3), 4) -> sizes 1, 1, 1, then empty.
  EXPECT_EQ(chunk_span(3, 4, 3).length, 0);
  EXPECT_EQ(chunk_span(0, 3, 1).length, 0);
  EXPECT_EQ(chunk_span(7, 3, 2).begin, 6);
  EXPECT_EQ(chunk_span(7, 3, 2).length, 1);
}

TEST(Layout, NestedChunkingOfOneDimOverTwoAxes) {
  auto mesh = Mesh::create({2, 2}, {"dp", "tp"});
  // Dim 0 of size 5 split over dp then tp: dp chunks [0,3) [3,5); each split again over tp.
  auto layout = Layout::create(mesh, {5, 4}, {{0, 1}, {}});
  EXPECT_EQ(layout.local_shape_at(0), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(layout.global_offset_at(1), (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(layout.local_shape_at(1), (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(layout.global_offset_at(2), (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(layout.global_offset_at(3), (std::vector<int64_t>{4, 0}));
  // The reversed order (tp major) puts rank 1 (dp=0, tp=1) at the second tp chunk.
  auto reversed = Layout::create(mesh, {5, 4}, {{1, 0}, {}});
  EXPECT_EQ(reversed.global_offset_at(1), (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(reversed.to_string(), "[5, 4] ((\"tp\", \"dp\"), \"None\")");
}

TEST(Layout, HasEmptyShardAgreesWithEveryRanksLocalShape) {
  auto mesh = Mesh::create({2, 2}, {"dp", "tp"});
  for (int64_t rows = 0; rows <= 9; ++rows) {
    for (const DimAxes& axes : {DimAxes{{0}, {}}, DimAxes{{0, 1}, {}}, DimAxes{{1, 0}, {}}, DimAxes{{}, {0}}}) {
      const auto layout = Layout::create(mesh, {rows, 1}, axes);
      bool some_local_empty = false;
      for (int64_t p = 0; p < 4; ++p) some_local_empty |= numel(layout.local_shape_at(p)) == 0;
      EXPECT_EQ(layout.has_empty_shard(), rows > 0 && some_local_empty) << layout.to_string();
    }
  }
  // 5 rows over dp then tp: chunks [3, 2], then [2, 1] and [1, 1]: none empty.
  EXPECT_FALSE(Layout::create(mesh, {5, 4}, {{0, 1}, {}}).has_empty_shard());
  // 1 row over dp: one rank holds it, the other nothing.
  EXPECT_TRUE(Layout::create(mesh, {1, 4}, {{0}, {}}).has_empty_shard());
}

TEST(Layout, LocalShapeByRankId) {
  auto mesh = Mesh::create({2}, {"dp"}, {7, 3});
  auto layout = Layout::create(mesh, {3, 2}, {{0}, {}});
  EXPECT_EQ(layout.local_shape(3), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(layout.global_offset(3), (std::vector<int64_t>{2, 0}));
  expect_error([&] { layout.local_shape(0); }, "rank 0 is not in mesh");
}

TEST(Layout, Queries) {
  auto mesh = Mesh::create({2, 2, 2}, {"dp", "tp", "sp"});
  auto layout = Layout::create(mesh, {4, 4}, {{}, {2}}, {ReduceOp::Max, std::nullopt, std::nullopt});
  EXPECT_EQ(layout.sharded_dim(2), 1);
  EXPECT_EQ(layout.sharded_dim(0), -1);
  EXPECT_TRUE(layout.is_partial(0));
  EXPECT_TRUE(layout.is_replicate(1));
  EXPECT_EQ(layout.partial_op(), ReduceOp::Max);
  EXPECT_EQ(layout.to_string(), "[4, 4] (\"None\", \"sp\") partial(max: dp)");
  EXPECT_EQ(layout.without_axis(0).has_partial(), false);
  EXPECT_EQ(layout.with_minor_shard(1, 1).dim_axes()[1], (std::vector<int64_t>{2, 1}));
}

TEST(Layout, Errors) {
  auto mesh = Mesh::create({2, 2}, {"dp", "tp"});
  expect_error([&] { Layout::create(nullptr, {4}, {}); }, "no mesh given");
  expect_error([&] { Layout::create(mesh, {-1}, {}); }, "dim 0 has size -1");
  expect_error([&] { Layout::create(mesh, {4, 4}, {{0}}); }, "sharding given for 1 dims but the tensor [4, 4] has 2");
  expect_error([&] { Layout::create(mesh, {4}, {{0}}, {std::nullopt}); }, "Partial given for 1 mesh axes");
  expect_error([&] { Layout::create(mesh, {4}, {{2}}); }, "dim 0 is sharded on mesh axis 2");
  expect_error([&] { Layout::create(mesh, {4, 4}, {{0}, {0}}); },
               "mesh axis 'dp' shards dims 0 and 1; allowed: an axis shards at most one dim");
  expect_error([&] { Layout::create(mesh, {4}, {{0, 0}}); }, "mesh axis 'dp' shards dims 0 and 0");
  expect_error([&] { Layout::create(mesh, {4}, {{1}}, {std::nullopt, ReduceOp::Sum}); },
               "mesh axis 'tp' shards dim 0 and is Partial(sum)");
  expect_error([&] { Layout::create(mesh, {4}, {{}}, {ReduceOp::Sum, ReduceOp::Max}); },
               "one reduce op for all Partial axes");
  expect_error([&] { Layout::replicate(mesh, {4}).with_minor_shard(0, 1); }, "dim 1 is out of range");
  expect_error([] { parse_reduce_op("mean"); }, "unknown Partial reduce op 'mean'");
  EXPECT_EQ(parse_reduce_op("product"), ReduceOp::Prod);
}

// Every layout on every test mesh: the ranks' slices cover each global element exactly once per
// replica (a replica = one choice of coordinates on the axes that shard nothing).
TEST(Layout, SlicesCoverEveryElementOncePerReplica) {
  int64_t layouts = 0;
  for (const auto& c : hypershard::testing::exhaustive_cases()) {
    auto mesh = hypershard::testing::make_mesh(c.shape);
    for (const auto& shape : c.tensor_shapes) {
      for (const auto& layout : hypershard::testing::all_layouts(mesh, shape, {ReduceOp::Sum})) {
        ++layouts;
        int64_t replicas = 1;
        for (int64_t a = 0; a < mesh->ndim(); ++a)
          if (!layout.is_sharded(a)) replicas *= mesh->shape()[a];
        std::vector<int64_t> hits(numel(shape), 0);
        std::vector<int64_t> strides(shape.size(), 1);
        for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d)
          strides[d] = strides[d + 1] * shape[d + 1];
        for (int64_t p = 0; p < mesh->size(); ++p) {
          const auto local = layout.local_shape_at(p);
          const auto offset = layout.global_offset_at(p);
          for (int64_t i = 0; i < numel(local); ++i) {
            int64_t flat = 0, rest = i;
            for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
              flat += (rest % local[d] + offset[d]) * strides[d];
              rest /= local[d];
            }
            ++hits[flat];
          }
        }
        for (int64_t i = 0; i < numel(shape); ++i)
          ASSERT_EQ(hits[i], replicas) << layout.to_string() << " on " << mesh->to_string() << " element " << i;
      }
    }
  }
  EXPECT_EQ(layouts, 908);  // the exhaustive set, Partial as sum only
}

}  // namespace
}  // namespace hypershard::layout
