#include <gtest/gtest.h>

#include "layout/mesh.h"
#include "test_util.h"

namespace hypershard::layout {
namespace {

using hypershard::testing::expect_error;

TEST(Mesh, CoordinatesAreRowMajor) {
  auto mesh = Mesh::create({2, 3}, {"dp", "tp"});
  EXPECT_EQ(mesh->size(), 6);
  EXPECT_EQ(mesh->coordinate(4), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(mesh->position_at({1, 2}), 5);
  EXPECT_EQ(mesh->axis_index("tp"), 1);
  EXPECT_EQ(mesh->to_string(), "(dp=2, tp=3)");
}

TEST(Mesh, CustomRankList) {
  auto mesh = Mesh::create({2, 2}, {"dp", "tp"}, {4, 5, 6, 7});
  EXPECT_EQ(mesh->coordinate(6), (std::vector<int64_t>{1, 0}));
  EXPECT_TRUE(mesh->contains(7));
  EXPECT_FALSE(mesh->contains(0));
  EXPECT_EQ(mesh->to_string(), "(dp=2, tp=2) ranks [4, 5, 6, 7]");
}

TEST(Mesh, AxisGroups) {
  auto mesh = Mesh::create({2, 3}, {"dp", "tp"});
  EXPECT_EQ(mesh->axis_group(0, 4), (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(mesh->axis_group(1, 4), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(mesh->axis_groups(0), (std::vector<std::vector<int64_t>>{{0, 3}, {1, 4}, {2, 5}}));
  EXPECT_EQ(mesh->axis_groups(1), (std::vector<std::vector<int64_t>>{{0, 1, 2}, {3, 4, 5}}));
}

TEST(Mesh, SubmeshByNames) {
  auto mesh = Mesh::create({2, 2, 2}, {"dp", "tp", "sp"});
  auto tp = mesh->submesh({"tp"}, 5);  // rank 5 = (1, 0, 1)
  EXPECT_EQ(tp->ranks(), (std::vector<int64_t>{5, 7}));
  auto sp_dp = mesh->submesh({"sp", "dp"}, 2);  // rank 2 = (0, 1, 0)
  EXPECT_EQ(sp_dp->shape(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(sp_dp->axis_names(), (std::vector<std::string>{"sp", "dp"}));
  EXPECT_EQ(sp_dp->ranks(), (std::vector<int64_t>{2, 6, 3, 7}));
}

TEST(Mesh, Errors) {
  expect_error([] { Mesh::create({}, {}); }, "at least one axis");
  expect_error([] { Mesh::create({2, 2}, {"dp"}); }, "2 axes but 1 axis names");
  expect_error([] { Mesh::create({2, 0}, {"dp", "tp"}); }, "axis 'tp' has size 0");
  expect_error([] { Mesh::create({2, 2}, {"dp", "dp"}); }, "axis name 'dp' is used twice");
  expect_error([] { Mesh::create({2}, {""}); }, "an axis name is empty");
  expect_error([] { Mesh::create({2}, {"None"}); }, "'None' is reserved");
  expect_error([] { Mesh::create({2}, {"a'\"b"}); }, "axis name 'a'\"b' holds both quote characters");
  expect_error([] { Mesh::create({2, 2}, {"dp", "tp"}, {0, 1, 2}); }, "holds 4 ranks but 3 ranks were given");
  expect_error([] { Mesh::create({2}, {"dp"}, {1, 1}); }, "rank 1 appears twice");
  expect_error([] { Mesh::create({2}, {"dp"}, {-1, 1}); }, "rank -1 is negative");
  auto mesh = Mesh::create({2, 2}, {"dp", "tp"});
  expect_error([&] { mesh->axis_index("sp"); }, "no axis named 'sp' in mesh (dp=2, tp=2); allowed: 'dp', 'tp'");
  expect_error([&] { mesh->coordinate(9); }, "rank 9 is not in mesh");
  expect_error([&] { mesh->position_at({0, 2}); }, "coordinate 2 is outside axis 'tp' of size 2");
  expect_error([&] { mesh->position_at({0}); }, "a coordinate of 1 values given for a mesh of 2 axes");
  expect_error([&] { mesh->coordinate_at(4); }, "position 4 is outside mesh");
  expect_error([&] { mesh->axis_group(2, 0); }, "axis 2 is outside mesh");
  expect_error([&] { mesh->axis_groups(-1); }, "axis -1 is outside mesh");
  expect_error([&] { mesh->submesh({}, 0); }, "at least one axis name");
  expect_error([&] { mesh->submesh({"dp", "dp"}, 0); }, "axis 'dp' is named twice");
  expect_error([&] { mesh->submesh({"ep"}, 0); }, "no axis named 'ep'");
}

}  // namespace
}  // namespace hypershard::layout
