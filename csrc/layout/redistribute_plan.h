// Redistribution planner: from layout A to layout B on the same mesh (same global shape), the
// cheapest sequence of single-axis steps.
//
// Steps (each changes the state of one mesh axis; `from`/`to` are the layouts around it):
//   LocalChunk    R    -> S(d)   keep this rank's chunk of dim d              (no traffic)
//   PartialFill   R    -> P(op)  coordinate 0 keeps the value, others hold op's identity
//                                (max/min/avg: every rank keeps it)           (no traffic)
//   AllGather     S(d) -> R      concatenate the axis group's chunks along d
//   AllToAll      S(d) -> S(d')  re-chunk along d' and concatenate along d
//   AllReduce     P    -> R
//   ReduceScatter P    -> S(d)
// An axis can be added to or removed from a dim only at the dim's minor end (nested
// chunking), so reordering is done by removing minor axes first.
//
// Cost model: the elements each rank SENDS when every piece of data goes straight to every
// rank that needs it (all_gather: its chunk to each of the k-1 peers; all_to_all and
// reduce_scatter: the pieces that other ranks own; all_reduce: reduce_scatter + all_gather of
// the torch.chunk pieces of the flattened tensor). Ring algorithms send the same amounts for
// even sizes. The planner searches states where each axis is in its source state, its target
// state or Replicate (Dijkstra; total bytes, then number of steps), which makes every
// single-axis transition one direct step and never detours through a full gather when a
// cheaper path exists.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layout/layout.h"

namespace hypershard::layout {

enum class StepKind : int8_t { LocalChunk, PartialFill, AllGather, AllToAll, AllReduce, ReduceScatter };
const char* step_kind_name(StepKind kind);

struct RedistributeStep {
  StepKind kind;
  int64_t axis;     // mesh axis the step runs along
  int64_t src_dim;  // AllGather / AllToAll: the dim the axis leaves; else -1
  int64_t dst_dim;  // LocalChunk / AllToAll / ReduceScatter: the dim it joins; else -1
  ReduceOp op;      // AllReduce / ReduceScatter / PartialFill
  Layout from;
  Layout to;
  std::vector<int64_t> elements_sent;  // per row-major mesh position
  int64_t total_elements() const;
  std::string to_string() const;
};

struct RedistributePlan {
  std::vector<RedistributeStep> steps;
  int64_t total_elements() const;  // summed over steps and ranks
  // Elements rank at `position` sends over the whole plan.
  int64_t elements_sent_at(int64_t position) const;
  std::string to_string(int64_t element_size = 0) const;
};

// Elements each rank (row-major mesh position) sends for `step` run from `from`.
std::vector<int64_t> step_elements_sent(StepKind kind, int64_t axis, int64_t src_dim, int64_t dst_dim,
                                        const Layout& from);

// Raises when the meshes or global shapes differ.
RedistributePlan plan_redistribute(const Layout& src, const Layout& dst);

}  // namespace hypershard::layout
