// The gradient layout policy: a leaf's .grad keeps the leaf's layout. A gradient that differs
// from it only by Partial(sum) axes (data-parallel gradients) is reduced in buckets: one
// all-reduce per mesh axis per bucket instead of one per parameter, started while the backward
// pass goes on as buckets fill (overlap) and finished when it ends (see grad_sync.cpp).
#pragma once

#include <cstdint>

namespace hypershard::runtime {

// The most bytes one bucket's all-reduce carries (default 25 MiB, DDP's default); 0 reduces
// each gradient when it arrives, as a plain hook would.
void set_grad_bucket_bytes(int64_t bytes);
int64_t grad_bucket_bytes();

// Whether full buckets start their all-reduce during the backward pass (default true); false:
// every bucket is reduced when the pass ends (the exposed-communication baseline of the bench).
void set_grad_overlap(bool overlap);
bool grad_overlap();

// While held (true), the Partial(sum) gradients of every backward pass stay Partial in .grad
// (later passes accumulate into them locally) instead of being reduced when each pass ends;
// hold_grad_sync(false) reduces them all in buckets at once. Pipelining holds them over the
// microbatches of a step, so dp reduces once per step.
void hold_grad_sync(bool hold);
bool grad_sync_held();

struct GradSyncStats {
  int64_t reduced_on_arrival = 0;  // gradients the hook redistributed at once
  int64_t bucketed = 0;            // gradients reduced in a bucket
  int64_t buckets = 0;             // buckets reduced (each: one all-reduce per Partial axis)
  int64_t overlapped = 0;          // of those, buckets started during the backward pass
};
GradSyncStats grad_sync_stats();
void reset_grad_sync_stats();

}  // namespace hypershard::runtime
