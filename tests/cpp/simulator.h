// A pure C++ simulator of W ranks for checking redistribution plans.
//
// Each simulated rank holds a dense local tensor of doubles. `run_plan` executes a plan's
// steps using ONLY what a real executor has: the step (kind, mesh axis, dims, op), the mesh
// and each rank's local data. It never looks at the layouts inside the steps, so a plan
// whose layouts disagree with its collectives is caught. It counts the elements each rank
// actually sends, independently of the planner's cost model.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "layout/redistribute_plan.h"

namespace hypershard::testing {

using layout::Layout;

struct SimTensor {
  std::vector<int64_t> shape;
  std::vector<double> values;  // row-major
};

// Global test tensor: element i holds i + 1 (exact in double, never the Partial identity).
SimTensor iota_tensor(const std::vector<int64_t>& shape);

// The local tensors of `layout` for the global tensor `global`, one per mesh position.
// Partial axes get random contributions whose reduction is exactly the value.
std::vector<SimTensor> make_shards(const Layout& layout, const SimTensor& global, std::mt19937& rng);

struct SimRun {
  std::vector<SimTensor> shards;
  std::vector<std::vector<int64_t>> elements_sent;  // per step, per mesh position
};
SimRun run_plan(const layout::RedistributePlan& plan, const layout::MeshPtr& mesh, std::vector<SimTensor> shards);

// Empty when `shards` represent `global` under `layout` (reducing over Partial axes first);
// otherwise a description of the first mismatch.
std::string check_shards(const Layout& layout, const SimTensor& global, const std::vector<SimTensor>& shards);

}  // namespace hypershard::testing
