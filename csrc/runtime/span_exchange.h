// Moving GLOBAL spans of one sharded dim between the members of one mesh axis: what an op needs
// when a rank's output block reads a range of the input that other ranks hold -- a flip or a
// roll (the mirrored or shifted range), a convolution's halo (kernel - 1 neighbouring positions),
// a slice or a pad whose output chunks do not line up with the input's. Each member sends exactly
// the elements another member asks for, in ONE all-to-all on the axis: the bytes moved are the
// wanted ranges' minus what a rank already holds, never the whole dim.
//
// Every rank computes every member's owned and wanted spans from the layout and the op's
// arguments alone (the same on every rank), so all ranks agree on the message sizes, and on
// skipping the collective when no element crosses ranks.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "layout/layout.h"
#include "runtime/device_mesh.h"

namespace hypershard::runtime {

// A half-open range [begin, end) of GLOBAL positions along one dim.
struct Span {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t length() const { return end > begin ? end - begin : 0; }
};

// Spans of one dim sharded over exactly one mesh axis: `owned[c]` is the span member c (the
// member with coordinate c on the axis, this rank's other coordinates) holds, `wanted[c]` the
// spans member c needs, in the order it wants them concatenated.
struct SpanPlan {
  int64_t dim = 0;
  int64_t axis = 0;
  std::vector<Span> owned;
  std::vector<std::vector<Span>> wanted;
};

// The GLOBAL span of `dim` of layout `l` that member `c` of mesh axis `axis` (this rank's other
// coordinates) holds.
Span member_span(const layout::Layout& l, const DeviceMesh& mesh, int64_t axis, int64_t c, int64_t dim);
// A plan for `dim` of `l`, sharded over exactly one mesh axis, with every member's owned span;
// the caller adds the wanted ones.
SpanPlan owned_spans(const layout::Layout& l, const DeviceMesh& mesh, int64_t dim);

// This rank's wanted spans of the tensor whose local block along plan.dim is `local`,
// concatenated along plan.dim (every other dim as in `local`), between `zeros_before` and
// `zeros_after` zero positions (a convolution's padding). This rank's own pieces are not sent
// (views of `local`); a single piece comes back uncopied, so it may alias `local`.
at::Tensor fetch_spans(const at::Tensor& local, const SpanPlan& plan, const DeviceMesh& mesh, int64_t zeros_before = 0,
                       int64_t zeros_after = 0);

// The reverse of fetch_spans, for gradients: `fetched` holds values for this rank's wanted spans
// (concatenated along plan.dim, as fetch_spans returned them); every element goes back to the
// member owning its position and the contributions for one position are summed there. Returns
// this rank's block (`local_length` long along plan.dim; zero where nothing was wanted).
at::Tensor return_spans_summed(const at::Tensor& fetched, int64_t local_length, const SpanPlan& plan,
                               const DeviceMesh& mesh);

// One all-to-all of rows (dim 0) on mesh axis `axis`: the first send_rows[0] rows of `send` go
// to member 0, the next send_rows[1] to member 1, ...; recv_rows[c] rows come from member c (the
// caller knows them: the collective exchanges no sizes). Returns what arrived, member after
// member. Every member of the axis calls it.
at::Tensor all_to_all_rows(const at::Tensor& send, std::vector<int64_t> send_rows, std::vector<int64_t> recv_rows,
                           const DeviceMesh& mesh, int64_t axis);

}  // namespace hypershard::runtime
