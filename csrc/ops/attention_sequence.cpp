// Context parallelism for the attention family: attention.cpp's planned calls with the query's
// sequence sharded, run by the mesh's algorithm (DeviceMesh::sequence_attention;
// docs/context_parallel.md has the maths and the bytes).
//
// An even split (L == S, the query's L and key/value's S sharded alike over the same axes in equal
// blocks) keeps key and value sharded in the plan, so that one plan serves every algorithm and the
// expand chooses per call:
//   - all-gather-KV: key and value gathered on S here, the kernel runs on this rank's query rows,
//     the backward's key/value gradients (Partial(sum) over the axes) reduce-scattered back. A
//     causal call (the CPU kernel) takes the gathered key/value block by block, with the ring's
//     per-block masks and merge: no mask of rows x S, blocks hidden from every row skipped.
//   - Ulysses: query, key, value (and a mask's rows) moved by one all-to-all each from the
//     sequence dim to the heads dim, the kernel runs on all L rows of 1/n of the heads, the
//     results moved back. Needs every rank's query and key/value heads divisible by n (grouped
//     heads then stay grouped per block), one axis. A causal call on a head-tail
//     sequence is put in natural order around the kernel (an index_select; no L x L mask).
//   - ring: key/value blocks passed to the next rank n - 1 times while each rank computes its
//     query rows against the block it holds; the blocks' outputs merge by their log-sum-exp
//     (online softmax), so memory stays O(S/n). Backward: the same pass, each block's key/value
//     gradient accumulator travelling with it and arriving home after n passes. The kernel reads
//     a block's causal part from the rows' and columns' GLOBAL positions (an additive mask); a
//     block hidden from every row is skipped. One axis.
// Even splits are planned so for the CPU kernel only (its logsumexp [b, h, rows], its backward's
// attn_mask); the CUDA / PrivateUse1 kernels keep the plan that gathers key and value. Where the
// mesh's algorithm cannot run, the call runs all-gather-KV (the same result).
#include "ops/attention_sequence.h"

#include <ATen/OpMathType.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <optional>
#include <string>

#include "runtime/gil.h"
#include "runtime/redistribute.h"
#include "runtime/traced_collectives.h"

namespace hypershard::ops::sequence_attention {
namespace {

using runtime::DeviceMesh;

constexpr double kInf = std::numeric_limits<double>::infinity();

std::array<std::atomic<int64_t>, 3> g_calls{};

void count(DeviceMesh::SequenceAttention algorithm) {
  g_calls[static_cast<size_t>(algorithm)].fetch_add(1, std::memory_order_relaxed);
}

// Padding of a built mask's rows: the efficient kernel reads attn_bias rows aligned to 16 elements.
constexpr int64_t kMaskRowAlignment = 16;

// An uninitialised mask of `sizes` whose rows start at multiples of kMaskRowAlignment elements.
at::Tensor aligned_mask(at::IntArrayRef sizes, const at::TensorOptions& options) {
  std::vector<int64_t> padded(sizes.begin(), sizes.end());
  const int64_t last = padded.back();
  padded.back() = (last + kMaskRowAlignment - 1) / kMaskRowAlignment * kMaskRowAlignment;
  return at::empty(padded, options).narrow(-1, 0, last);
}

// A caller's mask as an additive one (a bool mask: true keeps).
at::Tensor additive(const at::Tensor& mask, const at::TensorOptions& options) {
  if (mask.scalar_type() != at::kBool) return mask;
  return at::zeros(mask.sizes(), options).masked_fill(mask.logical_not(), -kInf);
}

// The caller's mask argument, or an undefined tensor (autograd passes an absent mask to the
// backward as an undefined tensor, not None).
at::Tensor caller_mask_of(const c10::IValue& v) { return v.isTensor() ? v.toTensor() : at::Tensor(); }

void check_head_tail(const OpCall& c, const SequencePlan& p, int64_t chunks) {
  if (p.length_q == p.length_k && p.length_q % chunks == 0) return;
  fail_call(c, layout::str_cat("a causal mask over a sequence stored in head-tail order of ", chunks,
                               " chunks (load-balanced axis '",
                               c.mesh->mesh()->axis_names()[c.mesh->load_balanced_sequence_axis()],
                               "') needs equal query and key lengths divisible by ", chunks, "; got L=", p.length_q,
                               ", S=", p.length_k, "; allowed: sequences padded to a multiple of 2 x the axis size"));
}

bool is_causal(const SequencePlan& p, const c10::IValue* args) {
  return p.causal_arg >= 0 && args[p.causal_arg].toBool();
}

// `l` with `axes` taken off dim `from` and added (minor) to dim `to` (-1: dropped: that dim
// becomes whole on them).
LayoutPtr moved(const LayoutPtr& l, int64_t from, int64_t to, const std::vector<int64_t>& axes) {
  auto dims = l->dim_axes();
  auto& source = dims[from];
  for (int64_t axis : axes) source.erase(std::remove(source.begin(), source.end(), axis), source.end());
  if (to >= 0) dims[to].insert(dims[to].end(), axes.begin(), axes.end());
  return make_layout(*l, l->global_shape(), std::move(dims), l->partial());
}

// Key (i = 0) or value (1) of `args` gathered on S (all-gather-KV on an even split).
at::Tensor gathered(const OpCall& c, const SequencePlan& p, const c10::IValue* args, int i) {
  const at::Tensor local = args[i == 0 ? p.key_arg : p.value_arg].toTensor().contiguous();
  return runtime::redistribute_local(local, p.kv_sharded[i], p.kv_whole[i], *c.mesh);
}

// ------------------------------------------------------------------ Ulysses

void run_ulysses(const OpCall& c, const SequencePlan& p, torch::jit::Stack& stack) {
  const size_t n = c.schema().arguments().size();
  c10::IValue* args = stack.data() + (stack.size() - n);
  const int64_t chunks = head_tail_chunks(*c.mesh);
  const bool reorder = is_causal(p, args) && chunks > 0;
  at::Tensor stored, natural;  // stored row j holds position stored[j]; natural[i]: the row of position i
  if (reorder) {
    check_head_tail(c, p, chunks);
    stored = stored_positions(0, p.length_q, p.length_q, chunks);
    natural = stored.argsort();
  }
  for (const auto& move : p.ulysses_in) {
    c10::IValue& v = args[move.index];
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    at::Tensor t = runtime::redistribute_local(v.toTensor().contiguous(), move.sequence, move.heads, *c.mesh);
    if (reorder)
      for (int64_t dim : {move.rows_dim, move.columns_dim})
        if (dim >= 0) t = t.index_select(dim, natural);
    v = std::move(t);
  }
  c.op->callBoxed(stack);
  c10::IValue* rets = stack.data() + (stack.size() - c.schema().returns().size());
  for (const auto& move : p.ulysses_out) {
    at::Tensor t = rets[move.index].toTensor();
    if (reorder)
      for (int64_t dim : {move.rows_dim, move.columns_dim})
        if (dim >= 0) t = t.index_select(dim, stored);
    rets[move.index] = runtime::redistribute_local(t.contiguous(), move.heads, move.sequence, *c.mesh);
  }
}

// ------------------------------------------------------------------ ring

// One pass of a tensor to the next rank of the ring while receiving the previous rank's.
class RingPass {
 public:
  RingPass(const OpCall& c, int64_t axis, const at::Tensor& send, int tag) : send_(send.contiguous()) {
    const int64_t n = c.mesh->mesh()->shape()[axis], me = c.mesh->coordinate(axis);
    runtime::check_not_tracing("ring attention's rank-to-rank passing");
    received_ = at::empty_like(send_);
    auto& group = c.mesh->group(axis);
    std::vector<at::Tensor> out{runtime::movable_view(send_)}, in{runtime::movable_view(received_)};
    runtime::without_gil([&] {
      sent_ = group.send(out, static_cast<int>((me + 1) % n), tag);
      receiving_ = group.recv(in, static_cast<int>((me + n - 1) % n), tag);
    });
    runtime::count_collective(send_.numel() * static_cast<int64_t>(send_.element_size()));
  }
  at::Tensor wait() {
    runtime::without_gil([&] { sent_->wait(); });
    runtime::without_gil([&] { receiving_->wait(); });
    return received_;
  }

 private:
  at::Tensor send_, received_;
  c10::intrusive_ptr<c10d::Work> sent_, receiving_;
};

constexpr int kKeyValueTag = 71, kGradientTag = 72;

at::Tensor pack(const at::Tensor& a, const at::Tensor& b) { return at::cat({a.reshape(-1), b.reshape(-1)}); }
void unpack(const at::Tensor& packed, at::Tensor& a, at::Tensor& b) {
  a = packed.narrow(0, 0, a.numel()).view(a.sizes());
  b = packed.narrow(0, a.numel(), b.numel()).view(b.sizes());
}

// The length of each key/value block (S in equal blocks, one per rank of the query's sequence).
int64_t block_length(const SequencePlan& p) { return p.length_k / dim_parts(*p.query, 2); }

// This rank's query rows against key/value block `source`: the mask the kernel takes (causal part
// from GLOBAL positions plus the caller's columns of that block), whether every row is hidden
// (the block is skipped) and which rows are (their logsumexp is -inf, not the kernel's 0).
// A causal call without the caller's mask: a block as pieces of whole chunks (this rank's query
// rows x the block's key columns), each fully visible or causal on its diagonal (the kernel's
// is_causal skips the hidden half); chunks hidden from each other make no piece.
struct Piece {
  int64_t rows_begin = 0, rows = 0, columns_begin = 0, columns = 0;
  bool causal = false;
};

struct RingBlock {
  bool skip = false;
  c10::IValue mask;  // None: no mask
  at::Tensor hidden_rows;
  std::vector<Piece> pieces;  // non-empty: run these instead of one masked call
};

class RingMasks {
 public:
  RingMasks(const OpCall& c, const SequencePlan& p, const c10::IValue* args, const at::Tensor& query)
      : p_(p), options_(query.options()) {
    if (p.mask_arg >= 0) caller_ = caller_mask_of(args[p.mask_arg]);
    block_ = block_length(p);
    if (!is_causal(p, args)) return;
    const int64_t chunks = head_tail_chunks(*c.mesh);
    if (chunks > 0) check_head_tail(c, p, chunks);
    chunks_ = chunks;
    causal_ = true;
    const int64_t offset = p.query->global_offset_at(c.mesh->position())[2];
    row_block_ = offset / block_;
    // the stored positions of this rank's rows: only the masked path (a caller's mask) reads them
    if (caller_.defined()) rows_ = stored_positions(offset, query.size(2), p.length_q, chunks);
  }

  RingBlock at(int64_t source) const {
    RingBlock b;
    at::Tensor mask;
    if (causal_ && !caller_.defined()) {
      b.pieces = pieces(source);
      b.skip = b.pieces.empty();
      return b;
    }
    if (causal_) {
      const at::Tensor columns = stored_positions(source * block_, block_, p_.length_k, chunks_);
      const at::Tensor hidden = columns.unsqueeze(0).gt(rows_.unsqueeze(1));
      if (hidden.all().item<bool>()) {
        b.skip = true;
        return b;
      }
      if (hidden.any().item<bool>())
        mask = at::zeros({1, 1, rows_.size(0), block_}, options_).masked_fill(hidden, -kInf);
    }
    if (caller_.defined()) {
      at::Tensor m = caller_.size(-1) == p_.length_k ? caller_.narrow(-1, source * block_, block_) : caller_;
      m = additive(m, options_);
      mask = mask.defined() ? m + mask : m;
    }
    if (!mask.defined()) return b;
    b.hidden_rows = mask.eq(-kInf).all(-1);
    b.mask = mask.contiguous();
    return b;
  }

 private:
  // The chunks of block `block` (block-local start, length, natural chunk index): one in natural
  // order, the head and the tail chunk in head-tail order.
  std::vector<std::array<int64_t, 3>> chunks_of(int64_t block) const {
    if (chunks_ == 0) return {{0, block_, block}};
    const int64_t unit = block_ / 2;
    return {{0, unit, block}, {unit, unit, chunks_ - 1 - block}};
  }

  std::vector<Piece> pieces(int64_t source) const {
    std::vector<Piece> out;
    for (const auto& [rows_begin, rows, row_chunk] : chunks_of(row_block_))
      for (const auto& [columns_begin, columns, column_chunk] : chunks_of(source))
        if (column_chunk <= row_chunk)
          out.push_back(Piece{rows_begin, rows, columns_begin, columns, column_chunk == row_chunk});
    return out;
  }

  const SequencePlan& p_;
  at::TensorOptions options_;
  at::Tensor caller_, rows_;
  int64_t block_ = 0, chunks_ = 0, row_block_ = 0;
  bool causal_ = false;
};

// Calls the kernel on `base` with key/value block `key`, `value` and the block's mask; returns
// its results.
std::vector<c10::IValue> call_block(const OpCall& c, const SequencePlan& p, std::vector<c10::IValue> s,
                                    const at::Tensor& key, const at::Tensor& value, const RingBlock& block) {
  s[p.key_arg] = key;
  s[p.value_arg] = value;
  if (p.causal_arg >= 0) s[p.causal_arg] = false;
  if (p.mask_arg >= 0) s[p.mask_arg] = block.mask;
  c.op->callBoxed(s);
  return s;
}

// Calls the kernel on `piece` of this rank's rows (every row argument narrowed) against `piece`'s
// columns of key/value block `key`, `value`; returns its results.
std::vector<c10::IValue> call_piece(const OpCall& c, const SequencePlan& p, std::vector<c10::IValue> s,
                                    const at::Tensor& key, const at::Tensor& value, const Piece& piece) {
  for (int64_t arg : p.row_args) s[arg] = s[arg].toTensor().narrow(2, piece.rows_begin, piece.rows);
  s[p.key_arg] = key.narrow(2, piece.columns_begin, piece.columns).contiguous();
  s[p.value_arg] = value.narrow(2, piece.columns_begin, piece.columns).contiguous();
  s[p.causal_arg] = piece.causal;
  if (p.mask_arg >= 0) s[p.mask_arg] = c10::IValue();
  c.op->callBoxed(s);
  return s;
}

// Merges block results into the running (normalised) output and log-sum-exp, in op-math precision.
void merge(at::Tensor& out, at::Tensor& lse, const at::Tensor& block_out, at::Tensor block_lse,
           const at::Tensor& hidden_rows) {
  if (hidden_rows.defined()) block_lse = block_lse.masked_fill(hidden_rows, -kInf);
  const at::Tensor top = at::maximum(lse, block_lse);
  const at::Tensor base = at::where(top.isinf(), at::zeros_like(top), top);  // both -inf: weights 0
  const at::Tensor mine = (lse - base).exp(), theirs = (block_lse - base).exp();
  const at::Tensor total = mine + theirs;
  const at::Tensor denominator = at::where(total.eq(0), at::ones_like(total), total);
  out =
      out * (mine / denominator).unsqueeze(-1) + block_out.to(out.scalar_type()) * (theirs / denominator).unsqueeze(-1);
  lse = base + total.log();
}

// What a blockwise call (ring or gathered) shares: the call's arguments, popped off the stack,
// this rank's query rows and the blocks' masks.
struct Blockwise {
  std::vector<c10::IValue> base;
  at::Tensor query;
  c10::ScalarType math;
  std::optional<RingMasks> masks;

  Blockwise(const OpCall& c, const SequencePlan& p, torch::jit::Stack& stack) {
    const auto n = static_cast<std::ptrdiff_t>(c.schema().arguments().size());
    base.assign(stack.end() - n, stack.end());
    torch::jit::drop(stack, static_cast<size_t>(n));
    query = base[p.query_arg].toTensor();
    math = at::toOpMathType(query.scalar_type());
    masks.emplace(c, p, base.data(), query);
  }
  at::Tensor zeros(const at::Tensor& like) const { return at::zeros(like.sizes(), like.options().dtype(math)); }
};

// The forward's running output and log-sum-exp over the blocks seen so far.
struct MergedRows {
  at::Tensor out, lse;

  MergedRows(const Blockwise& b, int64_t value_dim) {
    const at::Tensor& q = b.query;
    out = at::zeros({q.size(0), q.size(1), q.size(2), value_dim}, q.options().dtype(b.math));
    lse = at::full({q.size(0), q.size(1), q.size(2)}, -kInf, q.options().dtype(b.math));
  }
  // One block's results over every row (a masked call) or each piece's over its rows.
  void add(const OpCall& c, const SequencePlan& p, const std::vector<c10::IValue>& base, const at::Tensor& key,
           const at::Tensor& value, const RingBlock& block) {
    if (block.pieces.empty()) {
      const auto results = call_block(c, p, base, key, value, block);
      merge(out, lse, results[0].toTensor(), results[1].toTensor().to(out.scalar_type()), block.hidden_rows);
      return;
    }
    for (const Piece& piece : block.pieces) {
      const auto results = call_piece(c, p, base, key, value, piece);
      at::Tensor rows_out = out.narrow(2, piece.rows_begin, piece.rows);
      at::Tensor rows_lse = lse.narrow(2, piece.rows_begin, piece.rows);
      at::Tensor merged_out = rows_out, merged_lse = rows_lse;
      merge(merged_out, merged_lse, results[0].toTensor(), results[1].toTensor().to(out.scalar_type()), {});
      rows_out.copy_(merged_out);
      rows_lse.copy_(merged_lse);
    }
  }
  void push(torch::jit::Stack& stack, at::ScalarType dtype) {
    lse.masked_fill_(lse.isinf(), 0);  // a row every key is hidden from: the kernel's 0 and 0
    stack.emplace_back(out.to(dtype));
    stack.emplace_back(lse);
  }
};

// Adds the backward of this rank's rows against key/value block `key`, `value` to the query's
// gradient and the block's key/value gradients (views are added to in place).
void add_gradients(const OpCall& c, const SequencePlan& p, const Blockwise& b, const at::Tensor& key,
                   const at::Tensor& value, const RingBlock& block, at::Tensor grad_query, at::Tensor grad_key,
                   at::Tensor grad_value) {
  if (block.skip) return;
  if (block.pieces.empty()) {
    const auto results = call_block(c, p, b.base, key, value, block);
    grad_query.add_(results[0].toTensor());
    grad_key.add_(results[1].toTensor());
    grad_value.add_(results[2].toTensor());
    return;
  }
  for (const Piece& piece : block.pieces) {
    const auto results = call_piece(c, p, b.base, key, value, piece);
    grad_query.narrow(2, piece.rows_begin, piece.rows).add_(results[0].toTensor());
    grad_key.narrow(2, piece.columns_begin, piece.columns).add_(results[1].toTensor());
    grad_value.narrow(2, piece.columns_begin, piece.columns).add_(results[2].toTensor());
  }
}

void run_ring_forward(const OpCall& c, const SequencePlan& p, torch::jit::Stack& stack) {
  Blockwise b(c, p, stack);
  at::Tensor key = b.base[p.key_arg].toTensor().contiguous(), value = b.base[p.value_arg].toTensor().contiguous();
  const int64_t axis = p.axes[0], n = c.mesh->mesh()->shape()[axis], me = c.mesh->coordinate(axis);
  MergedRows rows(b, value.size(3));
  for (int64_t step = 0; step < n; ++step) {
    std::optional<RingPass> pass;
    if (step + 1 < n) pass.emplace(c, axis, pack(key, value), kKeyValueTag);
    const RingBlock block = b.masks->at((me + n - step) % n);
    if (!block.skip) rows.add(c, p, b.base, key, value, block);
    if (pass) unpack(pass->wait(), key, value);
  }
  rows.push(stack, b.query.scalar_type());
}

void run_ring_backward(const OpCall& c, const SequencePlan& p, torch::jit::Stack& stack) {
  Blockwise b(c, p, stack);
  at::Tensor key = b.base[p.key_arg].toTensor().contiguous(), value = b.base[p.value_arg].toTensor().contiguous();
  const int64_t axis = p.axes[0], n = c.mesh->mesh()->shape()[axis], me = c.mesh->coordinate(axis);
  at::Tensor grad_query = b.zeros(b.query);
  // The key/value gradient of the block this rank holds, travelling with it.
  at::Tensor grad_key = b.zeros(key), grad_value = b.zeros(value);
  for (int64_t step = 0; step < n; ++step) {
    std::optional<RingPass> pass;
    if (step + 1 < n) pass.emplace(c, axis, pack(key, value), kKeyValueTag);
    add_gradients(c, p, b, key, value, b.masks->at((me + n - step) % n), grad_query, grad_key, grad_value);
    // After the last step the accumulator goes home: n passes, the block owner's receives its own.
    RingPass gradients(c, axis, pack(grad_key, grad_value), kGradientTag);
    if (pass) unpack(pass->wait(), key, value);
    unpack(gradients.wait(), grad_key, grad_value);
  }
  stack.emplace_back(grad_query.to(b.query.scalar_type()));
  stack.emplace_back(grad_key.to(key.scalar_type()));
  stack.emplace_back(grad_value.to(value.scalar_type()));
}

// Block `source` of a gathered key or value (S in equal blocks).
at::Tensor block_of(const at::Tensor& whole, const SequencePlan& p, int64_t source) {
  const int64_t length = block_length(p);
  return whole.narrow(2, source * length, length).contiguous();
}

// All-gather-KV on a causal call: the gathered key/value taken block by block like the ring's (a
// mask per block, not one of rows x S; a block hidden from every row skipped).
void run_gathered_forward(const OpCall& c, const SequencePlan& p, torch::jit::Stack& stack) {
  Blockwise b(c, p, stack);
  const at::Tensor key = gathered(c, p, b.base.data(), 0), value = gathered(c, p, b.base.data(), 1);
  MergedRows rows(b, value.size(3));
  for (int64_t source = 0; source < dim_parts(*p.query, 2); ++source) {
    const RingBlock block = b.masks->at(source);
    if (!block.skip) rows.add(c, p, b.base, block_of(key, p, source), block_of(value, p, source), block);
  }
  rows.push(stack, b.query.scalar_type());
}

void run_gathered_backward(const OpCall& c, const SequencePlan& p, torch::jit::Stack& stack) {
  Blockwise b(c, p, stack);
  const at::Tensor key = gathered(c, p, b.base.data(), 0), value = gathered(c, p, b.base.data(), 1);
  const int64_t parts = dim_parts(*p.query, 2), length = block_length(p);
  at::Tensor grad_query = b.zeros(b.query);
  // This rank's rows' part of every key/value gradient: a Partial(sum), reduce-scattered below.
  at::Tensor grad_key = b.zeros(key), grad_value = b.zeros(value);
  for (int64_t source = 0; source < parts; ++source)
    add_gradients(c, p, b, block_of(key, p, source), block_of(value, p, source), b.masks->at(source), grad_query,
                  grad_key.narrow(2, source * length, length), grad_value.narrow(2, source * length, length));
  stack.emplace_back(grad_query.to(b.query.scalar_type()));
  for (int i = 0; i < 2; ++i) {
    const at::Tensor grad = (i == 0 ? grad_key : grad_value).to((i == 0 ? key : value).scalar_type());
    stack.emplace_back(runtime::redistribute_local(grad, p.partial_grad[i], p.scattered_grad[i], *c.mesh));
  }
}

}  // namespace

at::Tensor stored_positions(int64_t begin, int64_t count, int64_t length, int64_t chunks) {
  const at::Tensor stored = at::arange(begin, begin + count, at::kLong);
  if (chunks == 0) return stored;
  const int64_t chunk = length / chunks;
  const at::Tensor block = stored.div(2 * chunk, "floor"), within = stored.remainder(2 * chunk);
  const at::Tensor head = block * chunk + within;                           // chunk `block`
  const at::Tensor tail = (chunks - 1 - block) * chunk + (within - chunk);  // chunk 2n-1-block
  return at::where(within < chunk, head, tail);
}

int64_t head_tail_chunks(const DeviceMesh& mesh) {
  const int64_t axis = mesh.load_balanced_sequence_axis();
  return axis >= 0 && mesh.mesh()->shape()[axis] > 1 ? 2 * mesh.mesh()->shape()[axis] : 0;
}

at::Tensor causal_mask(const OpCall& c, const SequencePlan& p, int64_t local_rows, const at::Tensor& query,
                       const c10::IValue& caller_mask) {
  const int64_t chunks = head_tail_chunks(*c.mesh);
  if (chunks > 0) check_head_tail(c, p, chunks);
  const int64_t begin = p.query->global_offset_at(c.mesh->position())[2];
  const at::Tensor rows = stored_positions(begin, local_rows, p.length_q, chunks);
  const at::Tensor cols = stored_positions(0, p.length_k, p.length_k, chunks);
  const at::Tensor hidden = cols.unsqueeze(0).gt(rows.unsqueeze(1));
  at::Tensor mask = at::zeros({1, 1, local_rows, p.length_k}, query.options()).masked_fill(hidden, -kInf);
  if (const at::Tensor m = caller_mask_of(caller_mask); m.defined()) mask = additive(m, query.options()) + mask;
  at::Tensor aligned = aligned_mask(mask.sizes(), mask.options());
  aligned.copy_(mask);
  return aligned;
}

void plan_even_split(const OpCall& call, SequencePlan& p, std::vector<LayoutPtr>& inputs,
                     const std::vector<LayoutPtr>& outputs, int64_t key, int64_t value, int64_t mask,
                     int64_t query_heads, bool backward) {
  // The CPU kernel only: the others keep the plan that gathers key and value (Ulysses and ring
  // are not tested on them).
  if (!p.query_sharded || p.length_q != p.length_k || call.schema().name().find("_for_cpu") == std::string::npos)
    return;
  const auto& axes = p.query->dim_axes()[2];
  for (int64_t t : {key, value})
    if (call.layout(t).dim_axes()[2] != axes || !inputs[t]->dim_axes()[2].empty()) return;
  const int64_t parts = dim_parts(*p.query, 2);
  if (parts <= 1 || p.length_q % parts != 0) return;
  p.even = true;
  p.axes = axes;
  for (int i = 0; i < 2; ++i) {
    const int64_t t = i == 0 ? key : value;
    p.kv_whole[i] = inputs[t];
    auto dims = inputs[t]->dim_axes();
    dims[2] = axes;
    p.kv_sharded[i] = make_layout(*inputs[t], inputs[t]->global_shape(), std::move(dims), inputs[t]->partial());
    inputs[t] = p.kv_sharded[i];
  }
  p.blockwise = true;
  p.row_args = {p.query_arg};
  if (backward)
    for (const auto& names : {std::initializer_list<const char*>{"grad_out", "grad_out_"}, {"out"}, {"logsumexp"}})
      if (const int64_t t = call.tensor_named(names); t >= 0) p.row_args.push_back(call.tensors[t].arg);
  if (axes.size() != 1) return;
  p.ring = true;
  // Ulysses: every rank's query and key/value heads split into n blocks.
  const int64_t n = parts;
  for (int64_t pos = 0; pos < call.mesh->mesh()->size(); ++pos)
    if (p.query->local_shape_at(pos)[1] % n != 0 || p.kv_sharded[0]->local_shape_at(pos)[1] % n != 0) return;
  auto rows = [&](int64_t index, const LayoutPtr& l) { return HeadsMove{index, l, moved(l, 2, 1, axes), 2, -1}; };
  auto columns = [&](int64_t index, const LayoutPtr& l) { return HeadsMove{index, l, moved(l, 2, 1, axes), -1, 2}; };
  p.ulysses_in = {rows(p.query_arg, p.query), columns(p.key_arg, p.kv_sharded[0]),
                  columns(p.value_arg, p.kv_sharded[1])};
  if (mask >= 0) {
    // Its rows gathered (sharded like the query's, or broadcast), its heads split where it has them.
    const LayoutPtr& l = inputs[mask];
    const auto& shape = l->global_shape();
    const int64_t nd = static_cast<int64_t>(shape.size());
    const int64_t heads = nd >= 3 && shape[nd - 3] == query_heads ? nd - 3 : -1;
    HeadsMove m{p.mask_arg, l, nd >= 2 ? moved(l, nd - 2, heads, axes) : l, -1, -1};
    if (nd >= 2 && shape[nd - 2] == p.length_q) m.rows_dim = nd - 2;
    if (shape[nd - 1] == p.length_k) m.columns_dim = nd - 1;
    p.ulysses_in.push_back(std::move(m));
  }
  if (!backward) {
    p.ulysses_out = {rows(0, outputs[0]), rows(1, outputs[1])};
    return;
  }
  const auto tensor_arg = [&](std::initializer_list<const char*> names) {
    return call.tensors[call.tensor_named(names)].arg;
  };
  p.ulysses_in.push_back(
      rows(tensor_arg({"grad_out", "grad_out_"}), inputs[call.tensor_named({"grad_out", "grad_out_"})]));
  p.ulysses_in.push_back(rows(tensor_arg({"out"}), inputs[call.tensor_named({"out"})]));
  p.ulysses_in.push_back(rows(tensor_arg({"logsumexp"}), inputs[call.tensor_named({"logsumexp"})]));
  p.ulysses_out = {rows(0, outputs[0]), columns(1, outputs[1]), columns(2, outputs[2])};
}

std::array<int64_t, 3> calls_per_algorithm() {
  std::array<int64_t, 3> calls{};
  for (size_t i = 0; i < calls.size(); ++i) calls[i] = g_calls[i].load(std::memory_order_relaxed);
  return calls;
}

void reset_calls_per_algorithm() {
  for (auto& c : g_calls) c.store(0, std::memory_order_relaxed);
}

bool run_even_split(const OpCall& c, const SequencePlan& p, torch::jit::Stack& stack, bool backward) {
  const auto algorithm = c.mesh->sequence_attention();
  if (algorithm == DeviceMesh::SequenceAttention::kRing && p.ring) {
    count(algorithm);
    backward ? run_ring_backward(c, p, stack) : run_ring_forward(c, p, stack);
    return true;
  }
  if (algorithm == DeviceMesh::SequenceAttention::kUlysses && !p.ulysses_in.empty()) {
    count(algorithm);
    run_ulysses(c, p, stack);
    return true;
  }
  count(DeviceMesh::SequenceAttention::kAllGatherKv);
  const size_t n = c.schema().arguments().size();
  if (p.blockwise && is_causal(p, stack.data() + (stack.size() - n))) {
    backward ? run_gathered_backward(c, p, stack) : run_gathered_forward(c, p, stack);
    return true;
  }
  c10::IValue* args = stack.data() + (stack.size() - n);
  for (int i = 0; i < 2; ++i) args[i == 0 ? p.key_arg : p.value_arg] = gathered(c, p, args, i);
  return false;
}

}  // namespace hypershard::ops::sequence_attention
