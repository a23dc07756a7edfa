// Context parallelism for the attention family (attention.cpp): the query's sequence sharded, the
// stored order of a load-balanced axis, and the three algorithms a call can run with
// (docs/context_parallel.md). attention.cpp plans; this file holds what its expand runs.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/stack.h>

#include <array>
#include <vector>

#include "ops/op_call.h"

namespace hypershard::ops::sequence_attention {

// Global positions of stored rows [begin, begin + count) of a sequence of `length` stored in
// head-tail order of `chunks` chunks (0: natural order).
at::Tensor stored_positions(int64_t begin, int64_t count, int64_t length, int64_t chunks);

// The chunks of the head-tail order on this mesh (0: natural order).
int64_t head_tail_chunks(const runtime::DeviceMesh& mesh);

// A tensor whose layout the Ulysses algorithm moves from its sequence dim to its heads dim.
struct HeadsMove {
  int64_t index = -1;  // schema argument (inputs) or return (outputs) index
  LayoutPtr sequence, heads;
  int64_t rows_dim = -1, columns_dim = -1;  // dims holding all L rows / S columns once moved (-1: none)
};

// What the expand needs besides the plain call.
struct SequencePlan {
  LayoutPtr query;  // the planned query: its L block's global offset
  int64_t length_q = 0, length_k = 0;
  bool query_sharded = false;  // L sharded: a causal mask needs the block's offset
  bool empty_rows = false;     // make an empty block's results here (the CPU kernel divides by the rows)
  // Backward: reduce-scatter the key/value gradients from `partial_grad[i]` to `scattered_grad[i]`.
  LayoutPtr partial_grad[2], scattered_grad[2];
  int64_t query_arg = -1, key_arg = -1, value_arg = -1, causal_arg = -1, mask_arg = -1;

  // An even split: L == S, the query's L and key/value's S sharded alike over `axes` in equal
  // blocks. Key and value then arrive sharded (kv_sharded) and the expand runs the mesh's
  // algorithm: all-gather-KV gathers them to kv_whole itself.
  bool even = false;
  std::vector<int64_t> axes;
  LayoutPtr kv_sharded[2], kv_whole[2];
  std::vector<int64_t> row_args;       // arguments holding this rank's query rows on dim 2
  bool blockwise = false;              // all-gather-KV runs a causal call block by block (the CPU kernel)
  bool ring = false;                   // the ring algorithm can run (one axis, the CPU kernel)
  std::vector<HeadsMove> ulysses_in;   // empty: Ulysses cannot run (heads do not divide, ...)
  std::vector<HeadsMove> ulysses_out;  // forward: output, logsumexp; backward: the gradients
};

// The additive causal mask [1, 1, rows of this rank, S] from GLOBAL positions, added to the
// caller's mask (a bool mask becomes 0 / -inf first).
at::Tensor causal_mask(const OpCall& c, const SequencePlan& p, int64_t local_rows, const at::Tensor& query,
                       const c10::IValue& caller_mask);

// Settles p.even, p.ring and the Ulysses moves at plan time. `inputs` / `outputs`: the plan's
// layouts (key and value planned whole on S; `outputs` with the backward's key/value gradients
// already scattered back); `key`, `value`, `mask`: OpCall tensor indices (mask -1: none).
void plan_even_split(const OpCall& call, SequencePlan& p, std::vector<LayoutPtr>& inputs,
                     const std::vector<LayoutPtr>& outputs, int64_t key, int64_t value, int64_t mask,
                     int64_t query_heads, bool backward);

// Runs an even-split call with the mesh's algorithm when it applies (Ulysses, ring) and returns
// true; otherwise gathers key and value in `stack` (all-gather-KV) and returns false: the caller
// runs the kernel.
bool run_even_split(const OpCall& c, const SequencePlan& p, torch::jit::Stack& stack, bool backward);

// How many even-split calls (forward and backward) each algorithm ran, indexed by
// DeviceMesh::SequenceAttention (a call the mesh's algorithm cannot run counts as all-gather-KV):
// tests and benchmarks see which one ran.
std::array<int64_t, 3> calls_per_algorithm();
void reset_calls_per_algorithm();

}  // namespace hypershard::ops::sequence_attention
