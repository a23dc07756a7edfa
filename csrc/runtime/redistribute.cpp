#include "runtime/redistribute.h"

#include "runtime/async_sum.h"
#include "runtime/gil.h"
#include "runtime/in_flight.h"
#include "runtime/traced_collectives.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <limits>

#include "layout/error.h"

namespace hypershard::runtime {
namespace {

using layout::chunk_span;
using layout::RedistributeStep;
using layout::ReduceOp;
using layout::StepKind;

std::atomic<int64_t> g_collectives{0};
std::atomic<int64_t> g_bytes{0};

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return c10d::ReduceOp::SUM;  // avg = sum, then divide (portable)
    case ReduceOp::Max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::Min:
      return c10d::ReduceOp::MIN;
    case ReduceOp::Prod:
      return c10d::ReduceOp::PRODUCT;
  }
  return c10d::ReduceOp::SUM;
}

// The functional collectives' name of to_c10d(op).
const char* functional_name(ReduceOp op) {
  switch (to_c10d(op)) {
    case c10d::ReduceOp::MAX:
      return "max";
    case c10d::ReduceOp::MIN:
      return "min";
    case c10d::ReduceOp::PRODUCT:
      return "product";
    default:
      return "sum";
  }
}

// ------------------------------------------------------------------ dtypes the backends lack
// c10d backends carry only some dtypes (gloo: float, double, half, bfloat16, int8, uint8, bool,
// int32, int64; NCCL has no int16 and no complex either). The others travel reinterpreted: data
// movement (all-gather, all-to-all) moves their bytes (a same-size view; complex as its real
// pairs); reductions run where their arithmetic gives the same result: complex as its real pairs
// (sums are componentwise), narrow or unsigned integers widened to int64 and cut back (sums and
// products wrap modulo 2^bits alike), other floats (float8) widened to float32 and rounded back
// once.

bool carried_as_is(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kBool:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

// The same bytes as a dtype every backend moves (a view: writing it writes `t`).
at::Tensor movable(const at::Tensor& t) {
  if (carried_as_is(t.scalar_type())) return t;
  if (t.is_complex()) return movable(at::view_as_real(t));
  switch (t.element_size()) {
    case 1:
      return t.view(at::kByte);
    case 2:
      return t.view(at::kHalf);
    case 4:
      return t.view(at::kInt);
    case 8:
      return t.view(at::kLong);
    default:
      break;
  }
  TORCH_CHECK(false, "hypershard: no collective can carry dtype ", t.scalar_type());
}

// `t` (contiguous) in a dtype whose reduction by `op` gives `t`'s: itself, a view (complex), or
// a widened copy (then the caller copies the result back into its buffer).
at::Tensor reducible(const at::Tensor& t, ReduceOp op) {
  const auto type = t.scalar_type();
  if (carried_as_is(type)) return t;
  if (t.is_complex()) {
    TORCH_CHECK(op == ReduceOp::Sum || op == ReduceOp::Avg, "hypershard: a Partial(", layout::reduce_op_name(op),
                ") of complex dtype ", type, " cannot be reduced (only sum and avg are defined for complex values)");
    return reducible(at::view_as_real(t), op);
  }
  if (at::isIntegralType(type, /*includeBool=*/false)) {
    TORCH_CHECK(type != at::kUInt64 || op == ReduceOp::Sum || op == ReduceOp::Prod, "hypershard: a Partial(",
                layout::reduce_op_name(op), ") of dtype uint64 cannot be reduced (no wider integer to compare in)");
    return type == at::kUInt64 ? t.view(at::kLong) : t.to(at::kLong);
  }
  return t.to(at::kFloat);
}

// Pads `t` along `dim` to `length` with zeros.
at::Tensor pad_to(const at::Tensor& t, int64_t dim, int64_t length) {
  if (t.size(dim) == length) return t;
  auto sizes = t.sizes().vec();
  sizes[dim] = length - t.size(dim);
  return at::cat({t, at::zeros(sizes, t.options())}, dim);
}

// Every member's `send` (equal shapes, contiguous) along dim 0, in coordinate order.
at::Tensor gather_dim0(const at::Tensor& send, const DeviceMesh& mesh, int64_t axis) {
  if (tracing()) return from_movable(traced_all_gather(movable(send), mesh, axis), send);
  auto sizes = send.sizes().vec();
  sizes[0] *= mesh.mesh()->shape()[axis];
  auto gathered = at::empty(sizes, send.options());
  at::Tensor gathered_bytes = movable(gathered), send_bytes = movable(send);
  CollectiveInFlight in_flight(CollectiveKind::kAllGather, mesh, axis, static_cast<int64_t>(send.nbytes()));
  without_gil([&] { mesh.group(axis)._allgather_base(gathered_bytes, send_bytes)->wait(); });
  return gathered;
}

at::Tensor all_gather(const RedistributeStep& step, const at::Tensor& local, const DeviceMesh& mesh) {
  const int64_t k = mesh.mesh()->shape()[step.axis];
  const int64_t d = step.src_dim;
  std::vector<int64_t> lengths(k);
  int64_t longest = 0;
  for (int64_t c = 0; c < k; ++c) {
    lengths[c] = step.from.local_shape_at(mesh.member_position(step.axis, c))[d];
    longest = std::max(longest, lengths[c]);
  }
  // Gather equal-sized padded chunks along dim 0, then trim and join along d.
  auto send = pad_to(local, d, longest).movedim(d, 0).contiguous();
  at::Tensor gathered = gather_dim0(send, mesh, step.axis);
  // Even chunks need no trimming: the gathered buffer already is the result along dim 0.
  const bool even = std::all_of(lengths.begin(), lengths.end(), [&](int64_t l) { return l == longest; });
  at::Tensor joined = gathered;
  if (!even) {
    std::vector<at::Tensor> pieces;
    for (int64_t c = 0; c < k; ++c) pieces.push_back(gathered.narrow(0, c * longest, lengths[c]));
    joined = at::cat(pieces, 0);
  }
  return d == 0 ? joined : joined.movedim(0, d).contiguous();
}

at::Tensor reduce_op_finish(at::Tensor t, ReduceOp op, int64_t k) {
  if (op == ReduceOp::Avg) t.div_(k);
  return t;
}

// c10d backends need not propagate NaN through max/min (gloo drops it, depending on the rank
// order), so floating tensors travel with a NaN flag in a trailing dimension of the same buffer:
// one collective, and torch's single-device answer (NaN wins).
bool needs_nan_flag(const at::Tensor& t, ReduceOp op) {
  return (op == ReduceOp::Max || op == ReduceOp::Min) && at::isFloatingType(t.scalar_type());
}

at::Tensor with_nan_flag(const at::Tensor& t, ReduceOp op) {
  const auto nan = at::isnan(t);
  auto flag = nan.to(t.scalar_type());
  if (op == ReduceOp::Min) flag = flag.neg();  // min over ranks finds the -1 as max finds the 1
  return at::stack({t.masked_fill(nan, 0), flag}, -1);
}

at::Tensor without_nan_flag(const at::Tensor& packed) {
  return packed.select(-1, 0).masked_fill(packed.select(-1, 1).ne(0), std::numeric_limits<double>::quiet_NaN());
}

// One c10d all-reduce of a contiguous `buffer` over this rank's group on `axis`, in place (avg:
// the sum; reduce_op_finish divides).
void all_reduce_in_place(at::Tensor& buffer, const DeviceMesh& mesh, int64_t axis, ReduceOp op) {
  if (tracing()) {  // a new tensor: the caller's `buffer` is rebound, not written
    buffer = from_movable(traced_all_reduce(reducible(buffer, op), functional_name(op), mesh, axis), buffer);
    return;
  }
  std::vector<at::Tensor> tensors{reducible(buffer, op)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  CollectiveInFlight in_flight(CollectiveKind::kAllReduce, mesh, axis, static_cast<int64_t>(tensors[0].nbytes()));
  without_gil([&] { mesh.group(axis).allreduce(tensors, opts)->wait(); });
  if (!tensors[0].is_alias_of(buffer)) buffer.copy_(tensors[0]);
}

at::Tensor all_reduce_raw(const at::Tensor& local, const DeviceMesh& mesh, int64_t axis, ReduceOp op) {
  const bool flagged = needs_nan_flag(local, op);
  // (a traced all-reduce returns a new tensor: no copy to reduce into)
  at::Tensor buffer = flagged ? with_nan_flag(local, op) : tracing() ? local.contiguous() : local.contiguous().clone();
  all_reduce_in_place(buffer, mesh, axis, op);
  return reduce_op_finish(flagged ? without_nan_flag(buffer) : buffer, op, mesh.mesh()->shape()[axis]);
}

at::Tensor all_reduce(const RedistributeStep& step, const at::Tensor& local, const DeviceMesh& mesh) {
  return all_reduce_raw(local, mesh, step.axis, step.op);
}

at::Tensor reduce_scatter(const RedistributeStep& step, const at::Tensor& local_in, const DeviceMesh& mesh) {
  const bool flagged = needs_nan_flag(local_in, step.op);
  const at::Tensor local = flagged ? with_nan_flag(local_in, step.op) : local_in;  // flag dim last: d unchanged
  const int64_t k = mesh.mesh()->shape()[step.axis];
  const int64_t d = step.dst_dim;
  const int64_t length = local.size(d);
  const int64_t longest = chunk_span(length, k, 0).length;
  std::vector<at::Tensor> chunks;
  for (int64_t c = 0; c < k; ++c) {
    const auto span = chunk_span(length, k, c);
    chunks.push_back(pad_to(local.narrow(d, span.begin, span.length), d, longest).movedim(d, 0));
  }
  const auto original = local.scalar_type();
  auto send = reducible(at::cat(chunks, 0).contiguous(), step.op);
  at::Tensor received;
  if (tracing()) {
    received = traced_reduce_scatter(send, functional_name(step.op), mesh, step.axis);
  } else {
    auto sizes = send.sizes().vec();
    sizes[0] = longest;
    received = at::empty(sizes, send.options());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = to_c10d(step.op);
    CollectiveInFlight in_flight(CollectiveKind::kReduceScatter, mesh, step.axis, static_cast<int64_t>(send.nbytes()));
    without_gil([&] { mesh.group(step.axis)._reduce_scatter_base(received, send, opts)->wait(); });
  }
  if (at::isComplexType(original))
    received = at::view_as_complex(received);
  else
    received = received.to(original);
  const int64_t mine = chunk_span(length, k, mesh.coordinate(step.axis)).length;
  auto result = received.narrow(0, 0, mine).movedim(0, d);
  return reduce_op_finish((flagged ? without_nan_flag(result) : result).contiguous(), step.op, k);
}

at::Tensor all_to_all(const RedistributeStep& step, const at::Tensor& local, const DeviceMesh& mesh) {
  const int64_t k = mesh.mesh()->shape()[step.axis];
  const int64_t src = step.src_dim, dst = step.dst_dim;
  const int64_t me = mesh.coordinate(step.axis);
  // Send: chunk c of my block along dst goes to member c.
  std::vector<at::Tensor> pieces;
  std::vector<int64_t> send_counts(k), recv_counts(k);
  const int64_t dst_length = local.size(dst);
  for (int64_t c = 0; c < k; ++c) {
    const auto span = chunk_span(dst_length, k, c);
    pieces.push_back(local.narrow(dst, span.begin, span.length).contiguous().view(-1));
    send_counts[c] = pieces.back().numel();
  }
  // Receive: member c's block along src, with my chunk along dst.
  std::vector<std::vector<int64_t>> recv_shapes(k);
  const int64_t my_dst = chunk_span(dst_length, k, me).length;
  for (int64_t c = 0; c < k; ++c) {
    auto shape = step.from.local_shape_at(mesh.member_position(step.axis, c));
    shape[dst] = my_dst;
    recv_counts[c] = layout::numel(shape);
    recv_shapes[c] = std::move(shape);
  }
  auto send = at::cat(pieces, 0);
  at::Tensor received;
  if (tracing()) {
    received = from_movable(traced_all_to_all(movable(send), recv_counts, send_counts, mesh, step.axis), send);
  } else {
    received = at::empty({std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0})}, local.options());
    at::Tensor received_bytes = movable(received), send_bytes = movable(send);
    CollectiveInFlight in_flight(CollectiveKind::kAllToAll, mesh, step.axis, static_cast<int64_t>(send.nbytes()));
    without_gil(
        [&] { mesh.group(step.axis).alltoall_base(received_bytes, send_bytes, recv_counts, send_counts)->wait(); });
  }
  std::vector<at::Tensor> blocks;
  int64_t offset = 0;
  for (int64_t c = 0; c < k; ++c) {
    blocks.push_back(received.narrow(0, offset, recv_counts[c]).view(recv_shapes[c]));
    offset += recv_counts[c];
  }
  return at::cat(blocks, src);
}

at::Tensor run_step(const RedistributeStep& step, const at::Tensor& local, const DeviceMesh& mesh) {
  const int64_t k = mesh.mesh()->shape()[step.axis];
  const int64_t me = mesh.coordinate(step.axis);
  if (step.kind != StepKind::LocalChunk && step.kind != StepKind::PartialFill) {
    g_collectives.fetch_add(1, std::memory_order_relaxed);
    g_bytes.fetch_add(step.elements_sent.at(mesh.position()) * static_cast<int64_t>(local.element_size()),
                      std::memory_order_relaxed);
  }
  switch (step.kind) {
    case StepKind::LocalChunk: {
      // A compact copy, not a view: a shard must not keep the whole tensor's memory alive, and
      // its memory order must be the dense one the wrapper reports (kernels such as normal_ fill
      // strided and contiguous tensors differently).
      const auto span = chunk_span(local.size(step.dst_dim), k, me);
      return local.narrow(step.dst_dim, span.begin, span.length).clone(at::MemoryFormat::Contiguous);
    }
    case StepKind::PartialFill:
      if (me == 0 || step.op == ReduceOp::Max || step.op == ReduceOp::Min || step.op == ReduceOp::Avg) return local;
      return step.op == ReduceOp::Prod ? at::ones_like(local) : at::zeros_like(local);
    case StepKind::AllGather:
      return all_gather(step, local, mesh);
    case StepKind::AllReduce:
      return all_reduce(step, local, mesh);
    case StepKind::ReduceScatter:
      return reduce_scatter(step, local, mesh);
    case StepKind::AllToAll:
      return all_to_all(step, local, mesh);
  }
  return local;
}

// ------------------------------------------------------------------ autograd functions

struct RedistributeFunction : torch::autograd::Function<RedistributeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, LayoutPtr dst) {
    auto& impl = checked_dtensor(input, "redistribute");
    ctx->saved_data["src"] = c10::IValue(reinterpret_cast<int64_t>(impl.layout().get()));
    auto local = redistribute_local(impl.local(), impl.layout(), dst, *impl.device_mesh());
    return make_dtensor(std::move(local), std::move(dst), impl.device_mesh());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // Interned layouts live for the process, so the raw pointer stays valid.
    auto target = without_partial(interned(reinterpret_cast<const layout::Layout*>(ctx->saved_data["src"].toInt())));
    return {redistribute(grads[0], target), at::Tensor()};
  }
};

struct FromLocalFunction : torch::autograd::Function<FromLocalFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& local, DeviceMeshPtr mesh,
                            LayoutPtr layout) {
    ctx->saved_data["layout"] = c10::IValue(reinterpret_cast<int64_t>(layout.get()));
    // An alias of the local: in-place changes through either are seen by both, as in torch.
    return make_dtensor(local.alias(), std::move(layout), std::move(mesh));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto layout = interned(reinterpret_cast<const layout::Layout*>(ctx->saved_data["layout"].toInt()));
    auto grad = redistribute(grads[0], without_partial(layout));
    auto local = to_local(grad);
    // d(mean of k locals)/d(local) = 1/k for every avg-Partial axis.
    if (layout->partial_op() == ReduceOp::Avg) {
      int64_t k = 1;
      for (int64_t a = 0; a < layout->mesh()->ndim(); ++a)
        if (layout->is_partial(a)) k *= layout->mesh()->shape()[a];
      local = local / k;
    }
    return {local, at::Tensor(), at::Tensor()};
  }
};

struct ToLocalFunction : torch::autograd::Function<ToLocalFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input) {
    auto& impl = checked_dtensor(input, "to_local");
    ctx->saved_data["layout"] = c10::IValue(reinterpret_cast<int64_t>(impl.layout().get()));
    ctx->saved_data["mesh"] = c10::IValue(retain_mesh(impl.device_mesh()));
    return impl.local().alias();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto layout = interned(reinterpret_cast<const layout::Layout*>(ctx->saved_data["layout"].toInt()));
    const DeviceMeshPtr mesh = find_mesh(ctx->saved_data["mesh"].toInt());
    return {from_local(grads[0], mesh, without_partial(layout))};
  }
};

}  // namespace

at::Tensor run_plan(const layout::RedistributePlan& plan, const at::Tensor& local, const DeviceMesh& mesh) {
  at::Tensor current = local;
  for (const auto& step : plan.steps) {
    // On an axis of one rank every step is the identity (a chunk of one is the whole, a
    // reduction over one part is the part): skip it rather than call a collective.
    if (mesh.mesh()->shape()[step.axis] == 1) continue;
    current = run_step(step, current, mesh);
  }
  return current;
}

at::Tensor redistribute_local(const at::Tensor& local, const LayoutPtr& src, const LayoutPtr& dst,
                              const DeviceMesh& mesh) {
  if (src == dst) return local;
  return run_plan(layout::cached_plan(src, dst), local, mesh);
}

LayoutPtr without_partial(const LayoutPtr& layout) {
  if (!layout->has_partial()) return layout;
  return intern_layout(layout::Layout::create(layout->mesh(), layout->global_shape(), layout->dim_axes(), {}));
}

at::Tensor redistribute(const at::Tensor& dtensor, const LayoutPtr& dst) {
  auto& impl = checked_dtensor(dtensor, "redistribute");
  HS_CHECK(*impl.layout()->mesh() == *dst->mesh(), "redistribute", "target mesh ", dst->mesh()->to_string(),
           " differs from the DTensor's mesh ", impl.layout()->mesh()->to_string());
  HS_CHECK(impl.layout()->global_shape() == dst->global_shape(), "redistribute", "target shape ",
           layout::shape_string(dst->global_shape()), " differs from the DTensor's shape ",
           layout::shape_string(impl.layout()->global_shape()));
  if (impl.layout() == dst) return dtensor;
  return RedistributeFunction::apply(dtensor, dst);
}

at::Tensor from_local(const at::Tensor& local, const DeviceMeshPtr& mesh, const LayoutPtr& layout) {
  HS_CHECK(!is_dtensor(local), "from_local", "the local tensor is already a DTensor");
  const auto expected = layout->local_shape_at(mesh->position());
  HS_CHECK(local.sizes().vec() == expected, "from_local", "rank ", mesh->rank(), " has a local tensor of shape ",
           layout::shape_string(local.sizes().vec()), " but layout ", layout->to_string(), " gives it ",
           layout::shape_string(expected));
  return FromLocalFunction::apply(local, mesh, layout);
}

at::Tensor to_local(const at::Tensor& dtensor) { return ToLocalFunction::apply(dtensor); }

namespace {

// Counts one all-reduce of `t` along `axis` at the planner's cost: reduce_scatter + all_gather
// of the flattened chunks.
void count_all_reduce(const at::Tensor& t, const DeviceMesh& mesh, int64_t axis) {
  g_collectives.fetch_add(1, std::memory_order_relaxed);
  const int64_t k = mesh.mesh()->shape()[axis], n = t.numel();
  const int64_t piece = chunk_span(n, k, mesh.coordinate(axis)).length;
  g_bytes.fetch_add((n - piece + piece * (k - 1)) * static_cast<int64_t>(t.element_size()), std::memory_order_relaxed);
}

}  // namespace

at::Tensor all_reduce_along(const at::Tensor& local, const DeviceMesh& mesh, int64_t axis, layout::ReduceOp op) {
  if (mesh.mesh()->shape()[axis] == 1) return local.clone();
  count_all_reduce(local, mesh, axis);
  return all_reduce_raw(local, mesh, axis, op);
}

PendingSum::PendingSum(at::Tensor buffer, const DeviceMesh& mesh, int64_t axis) : buffer_(std::move(buffer)) {
  TORCH_INTERNAL_ASSERT(buffer_.is_contiguous());
  if (mesh.mesh()->shape()[axis] == 1) return;
  check_not_tracing("an asynchronous gradient-bucket sum");
  count_all_reduce(buffer_, mesh, axis);
  moved_ = reducible(buffer_, ReduceOp::Sum);
  std::vector<at::Tensor> tensors{moved_};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(ReduceOp::Sum);
  without_gil([&] { work_ = mesh.group(axis).allreduce(tensors, opts); });
}

void PendingSum::wait() {
  if (!work_) return;
  without_gil([&] { work_->wait(); });
  work_.reset();
  if (!moved_.is_alias_of(buffer_)) buffer_.copy_(moved_);
}

void sum_in_place_along(at::Tensor& buffer, const DeviceMesh& mesh, int64_t axis) {
  PendingSum(buffer, mesh, axis).wait();
}

void check_same_on_every_rank(const at::Tensor& tensor, const DeviceMesh& mesh, const std::string& what) {
  // A fingerprint: sum, position-weighted sum, NaN count, numel. Equal data gives equal
  // fingerprints; the global max and min of each entry differ iff some rank's does.
  auto values = tensor.detach();
  if (values.is_complex()) values = at::view_as_real(values);
  values = values.to(at::kDouble).reshape(-1);
  const auto weights = at::arange(1, values.numel() + 1, values.options());
  const auto finite = values.nan_to_num(0, 0, 0);
  auto fingerprint = at::stack({finite.sum(), (finite * weights).sum(), values.isnan().sum().to(at::kDouble),
                                at::scalar_tensor(static_cast<double>(values.numel()), values.options())});
  // max(f) and max(-f) = -min(f) in one buffer: one all-reduce per mesh axis.
  auto extremes = at::cat({fingerprint, fingerprint.neg()});
  for (int64_t axis = 0; axis < mesh.mesh()->ndim(); ++axis)
    extremes = all_reduce_along(extremes, mesh, axis, ReduceOp::Max);
  const int64_t n = fingerprint.numel();
  HS_CHECK(at::equal(extremes.narrow(0, 0, n), extremes.narrow(0, n, n).neg()), what, "a plain tensor of shape ",
           layout::shape_string(tensor.sizes().vec()), " differs across the ranks of mesh ", mesh.to_string(),
           ", but a plain tensor is used as Replicate; allowed: the same value on every rank (make per-rank data "
           "a DTensor with DTensor.from_local)");
}

at::Tensor all_gather_along(const at::Tensor& local, const DeviceMesh& mesh, int64_t axis, int64_t dim) {
  const int64_t k = mesh.mesh()->shape()[axis];
  if (k == 1) return local;
  auto send = local.movedim(dim, 0).contiguous();
  g_collectives.fetch_add(1, std::memory_order_relaxed);
  g_bytes.fetch_add(send.numel() * (k - 1) * static_cast<int64_t>(send.element_size()), std::memory_order_relaxed);
  const at::Tensor gathered = gather_dim0(send, mesh, axis);
  return dim == 0 ? gathered : gathered.movedim(0, dim).contiguous();
}

TrafficCounters traffic() { return {g_collectives.load(), g_bytes.load()}; }
at::Tensor all_gather_in_chunk_order(at::Tensor local, const DeviceMesh& mesh, const std::vector<int64_t>& axes,
                                     int64_t dim) {
  for (auto it = axes.rbegin(); it != axes.rend(); ++it) local = all_gather_along(local, mesh, *it, dim);
  return local;
}

void count_collective(int64_t bytes) {
  g_collectives.fetch_add(1, std::memory_order_relaxed);
  g_bytes.fetch_add(bytes, std::memory_order_relaxed);
}
at::Tensor movable_view(const at::Tensor& t) { return movable(t); }
at::Tensor from_movable(const at::Tensor& moved, const at::Tensor& like) {
  if (moved.scalar_type() == like.scalar_type()) return moved;
  if (like.is_complex()) return at::view_as_complex(from_movable(moved, at::view_as_real(like)));
  if (moved.element_size() == like.element_size()) return moved.view(like.scalar_type());
  return moved.to(like.scalar_type());
}
void reset_traffic() {
  g_collectives.store(0);
  g_bytes.store(0);
}

}  // namespace hypershard::runtime
