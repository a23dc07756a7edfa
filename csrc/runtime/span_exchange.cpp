#include "runtime/span_exchange.h"

#include <c10/util/accumulate.h>

#include <algorithm>
#include <numeric>

#include "runtime/redistribute.h"
#include "runtime/gil.h"
#include "runtime/in_flight.h"
#include "runtime/traced_collectives.h"

namespace hypershard::runtime {
namespace {

Span intersect(const Span& a, const Span& b) { return {std::max(a.begin, b.begin), std::min(a.end, b.end)}; }

// Whether any member wants an element another member owns (the same answer on every rank).
bool crosses_ranks(const SpanPlan& plan) {
  const int64_t k = static_cast<int64_t>(plan.owned.size());
  for (int64_t c = 0; c < k; ++c)
    for (const Span& w : plan.wanted[c])
      for (int64_t o = 0; o < k; ++o)
        if (o != c && intersect(w, plan.owned[o]).length() > 0) return true;
  return false;
}

// `rows` (dim 0 = the exchanged dim) with no rows, for an empty message.
at::Tensor no_rows(const at::Tensor& rows) {
  auto shape = rows.sizes().vec();
  shape[0] = 0;
  return at::empty(shape, rows.options());
}

// One all-to-all on the plan's axis: piece lists per member (rows along dim 0), received rows
// per member. Returns what arrived, member after member.
at::Tensor all_to_all_pieces(const std::vector<std::vector<at::Tensor>>& pieces, const std::vector<int64_t>& recv_rows,
                             const at::Tensor& like, const SpanPlan& plan, const DeviceMesh& mesh) {
  const int64_t k = static_cast<int64_t>(pieces.size());
  std::vector<at::Tensor> flat;
  std::vector<int64_t> send_rows(static_cast<size_t>(k), 0);
  for (int64_t c = 0; c < k; ++c)
    for (const at::Tensor& p : pieces[c]) {
      flat.push_back(p);
      send_rows[c] += p.size(0);
    }
  const at::Tensor send = flat.empty() ? no_rows(like) : at::cat(flat, 0);
  return all_to_all_rows(send, send_rows, recv_rows, mesh, plan.axis);
}

}  // namespace

at::Tensor all_to_all_rows(const at::Tensor& send, std::vector<int64_t> send_rows, std::vector<int64_t> recv_rows,
                           const DeviceMesh& mesh, int64_t axis) {
  const int64_t me = mesh.coordinate(axis);
  const at::Tensor contiguous = send.contiguous();
  auto shape = contiguous.sizes().vec();
  shape[0] = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  const int64_t row_elements = c10::multiply_integers(shape.begin() + 1, shape.end());
  const int64_t sent_rows = std::accumulate(send_rows.begin(), send_rows.end(), int64_t{0}) - send_rows[me];
  at::Tensor received;
  if (tracing()) {
    received = from_movable(traced_all_to_all(movable_view(contiguous), recv_rows, send_rows, mesh, axis), contiguous);
  } else {
    received = at::empty(shape, contiguous.options());
    at::Tensor received_bytes = movable_view(received), send_bytes = movable_view(contiguous);
    CollectiveInFlight in_flight(CollectiveKind::kAllToAll, mesh, axis, static_cast<int64_t>(contiguous.nbytes()));
    without_gil([&] { mesh.group(axis).alltoall_base(received_bytes, send_bytes, recv_rows, send_rows)->wait(); });
  }
  count_collective(sent_rows * row_elements * static_cast<int64_t>(contiguous.element_size()));
  return received;
}

Span member_span(const layout::Layout& l, const DeviceMesh& mesh, int64_t axis, int64_t c, int64_t dim) {
  const int64_t pos = mesh.member_position(axis, c);
  const int64_t begin = l.global_offset_at(pos)[dim];
  return {begin, begin + l.local_shape_at(pos)[dim]};
}

SpanPlan owned_spans(const layout::Layout& l, const DeviceMesh& mesh, int64_t dim) {
  SpanPlan plan;
  plan.dim = dim;
  plan.axis = l.dim_axes()[dim].at(0);
  for (int64_t c = 0; c < mesh.mesh()->shape()[plan.axis]; ++c)
    plan.owned.push_back(member_span(l, mesh, plan.axis, c, dim));
  return plan;
}

at::Tensor fetch_spans(const at::Tensor& local, const SpanPlan& plan, const DeviceMesh& mesh, int64_t zeros_before,
                       int64_t zeros_after) {
  const int64_t k = static_cast<int64_t>(plan.owned.size()), me = mesh.coordinate(plan.axis), dim = plan.dim;
  const Span& mine = plan.owned[me];
  auto zeros = [&](int64_t n) {
    auto shape = local.sizes().vec();
    shape[dim] = n;
    return at::zeros(shape, local.options());
  };
  // This rank's own pieces come straight from `local`; only the others' travel (rows along dim 0).
  at::Tensor received;
  std::vector<int64_t> offset(static_cast<size_t>(k), 0);
  if (crosses_ranks(plan)) {
    const at::Tensor rows = local.movedim(dim, 0);
    std::vector<std::vector<at::Tensor>> pieces(static_cast<size_t>(k));
    std::vector<int64_t> recv_rows(static_cast<size_t>(k), 0);
    for (int64_t c = 0; c < k; ++c) {
      if (c == me) continue;
      for (const Span& w : plan.wanted[c])
        if (const Span i = intersect(w, mine); i.length() > 0)
          pieces[c].push_back(rows.narrow(0, i.begin - mine.begin, i.length()));
      for (const Span& w : plan.wanted[me]) recv_rows[c] += intersect(w, plan.owned[c]).length();
    }
    received = all_to_all_pieces(pieces, recv_rows, rows, plan, mesh);
    for (int64_t c = 1; c < k; ++c) offset[c] = offset[c - 1] + recv_rows[c - 1];
  }
  // Each wanted span is the members' intersections in member order (= GLOBAL order on one axis).
  std::vector<at::Tensor> out;
  if (zeros_before > 0) out.push_back(zeros(zeros_before));
  for (const Span& w : plan.wanted[me])
    for (int64_t c = 0; c < k; ++c) {
      const Span i = intersect(w, plan.owned[c]);
      if (i.length() == 0) continue;
      if (c == me) {
        out.push_back(local.narrow(dim, i.begin - mine.begin, i.length()));
      } else {
        out.push_back(received.narrow(0, offset[c], i.length()).movedim(0, dim));
        offset[c] += i.length();
      }
    }
  if (zeros_after > 0) out.push_back(zeros(zeros_after));
  if (out.empty()) return zeros(0);
  if (out.size() == 1) return out[0];  // a view of `local` or of what arrived: no copy
  return at::cat(out, dim);
}

at::Tensor return_spans_summed(const at::Tensor& fetched, int64_t local_length, const SpanPlan& plan,
                               const DeviceMesh& mesh) {
  const int64_t k = static_cast<int64_t>(plan.owned.size()), me = mesh.coordinate(plan.axis), dim = plan.dim;
  const Span& mine = plan.owned[me];
  auto shape = fetched.sizes().vec();
  shape[dim] = local_length;
  at::Tensor result = at::zeros(shape, fetched.options());
  // The pieces of `fetched` member c owns, in the order fetch_spans laid them out; this rank's
  // own are added here directly, the others travel back (rows along dim 0).
  const at::Tensor rows = fetched.movedim(dim, 0);
  std::vector<std::vector<at::Tensor>> pieces(static_cast<size_t>(k));
  int64_t at_row = 0;
  for (const Span& w : plan.wanted[me])
    for (int64_t c = 0; c < k; ++c)
      if (const Span i = intersect(w, plan.owned[c]); i.length() > 0) {
        if (c == me)
          result.narrow(dim, i.begin - mine.begin, i.length()).add_(fetched.narrow(dim, at_row, i.length()));
        else
          pieces[c].push_back(rows.narrow(0, at_row, i.length()));
        at_row += i.length();
      }
  if (!crosses_ranks(plan)) return result;
  std::vector<int64_t> recv_rows(static_cast<size_t>(k), 0);
  for (int64_t c = 0; c < k; ++c)
    if (c != me)
      for (const Span& w : plan.wanted[c]) recv_rows[c] += intersect(w, mine).length();
  const at::Tensor received = all_to_all_pieces(pieces, recv_rows, rows, plan, mesh);
  int64_t offset = 0;
  for (int64_t c = 0; c < k; ++c) {
    if (c == me) continue;
    for (const Span& w : plan.wanted[c])
      if (const Span i = intersect(w, mine); i.length() > 0) {
        result.narrow(dim, i.begin - mine.begin, i.length())
            .add_(received.narrow(0, offset, i.length()).movedim(0, dim));
        offset += i.length();
      }
  }
  return result;
}

}  // namespace hypershard::runtime
