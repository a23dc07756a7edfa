// The gradient layout policy and data-parallel gradient buckets.
//
// A leaf DTensor gets one tensor hook (install_grad_hook): the incoming gradient is brought to
// the leaf's layout before autograd accumulates it into .grad. Most of those conversions are
// data-parallel sums: the parameter is Replicate on `dp`, its gradient arrives Partial(sum) on
// `dp`. Reducing each one in its hook costs one blocking collective per parameter, and at small
// sizes a collective's latency, not its bytes, is what a step pays (gloo: ~1-4 ms each here).
//
// So such a gradient is left Partial when autograd is about to accumulate it into .grad and
// nothing else can read it before backward ends (a .grad that already holds a reduced value first
// becomes the same value as a Partial, with no communication: make_partial_in_place). At the end
// of the backward pass (an engine callback, the hook DDP's reducer uses too) the gradients left
// Partial are grouped by (mesh, Partial axes, dtype, device), packed into buckets of at most
// grad_bucket_bytes(), summed with one in-place all-reduce per axis per bucket, and each .grad
// takes the leaf's layout with its reduced slice of the bucket as local tensor.
//
// Overlap: a bucket need not wait for the end. A leaf's hook runs right before autograd
// accumulates into its .grad, on the thread that runs that device's nodes, so when the next
// deferred gradient of the same device arrives the previous one is final for this pass. Such
// settled gradients fill buckets as they come; a full bucket starts its all-reduce over its first
// Partial axis at once (async), and each member's .grad becomes its slice of the bucket (still
// Partial: nobody reads it before the end, and its old memory is freed). The end callback waits
// for those sums and starts each bucket's next axis (dp x cp gradients are Partial on both) in
// the order of the end-of-pass path, so the values are the same; then it gives each .grad the
// leaf's layout and reduces what is left as above.
//
// Every rank makes the same decisions in the same order: they depend only on layouts, on the
// layout of .grad and on the graph task, all the same on every rank running the same program, and
// a bucket's members have the same local shapes on every rank of its group (a Partial axis is
// never a sharded one).
#include "runtime/grad_sync.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <iterator>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "layout/error.h"
#include "runtime/dispatch_internal.h"
#include "runtime/async_sum.h"
#include "runtime/dtensor_impl.h"
#include "runtime/gil.h"
#include "runtime/in_flight.h"
#include "runtime/redistribute.h"

namespace hypershard::runtime {
namespace {

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

std::atomic<int64_t> g_bucket_bytes{int64_t{25} << 20};
std::atomic<int64_t> g_reduced_on_arrival{0};
std::atomic<int64_t> g_bucketed{0};
std::atomic<int64_t> g_buckets{0};

// A gradient left Partial in its hook, to be reduced when the backward pass ends.
struct Deferred {
  WeakTensor leaf;
  LayoutPtr partial;  // the gradient's layout as the hook saw it
  LayoutPtr target;   // the leaf's layout
  c10::Device device = c10::kCPU;
  bool started = false;  // its bucket's all-reduce started during the pass
};

// The gradients of one bucket group: same mesh, Partial axes, dtype and device.
struct Group {
  DeviceMeshPtr mesh;
  std::vector<int64_t> axes;
  at::ScalarType dtype;
  c10::Device device;
  std::vector<std::pair<at::Tensor, LayoutPtr>> grads;  // (.grad, target layout)
  int64_t bytes = 0;                                    // of the grads not yet in a started bucket
  std::vector<size_t> items;                            // their Deferred indices (overlap only)
};

// A bucket whose all-reduce started during the pass: over axes[0] then, at the end, the others.
struct Started {
  std::vector<std::pair<at::Tensor, LayoutPtr>> grads;  // (.grad, target layout)
  DeviceMeshPtr mesh;
  std::vector<int64_t> axes;
  PendingSum sum;  // of the bucket's buffer over axes[next - 1]
  size_t next = 1;
};

void finish_started(std::vector<Started>& started);

struct Batch {
  std::mutex mutex;
  std::vector<Deferred> items;
  size_t settled = 0;          // items before this one were looked at for overlap
  std::vector<Group> filling;  // groups filling during the pass
  std::vector<Started> started;
  // A pass that raised drops its callback unrun: the started sums still finish, and their .grad
  // (summed in place) take the leaf's layout, so every .grad keeps a right value.
  ~Batch() {
    try {
      finish_started(started);
    } catch (...) {  // a destructor must not throw; c10d reported the collective's own error
    }
  }
};

std::atomic<bool> g_overlap{true};
std::atomic<int64_t> g_overlapped{0};

// Per graph task (backward pass) being run. The engine callback owns its batch and removes the
// entry; a backward pass that raises drops its callbacks unrun, and its entry expires.
std::mutex g_batches_mutex;
std::unordered_map<int, std::weak_ptr<Batch>> g_batches;

// `grad` differs from `target` only by Partial(sum) axes: one sum over those axes makes it
// `target`.
bool is_pending_sum(const LayoutPtr& grad, const LayoutPtr& target) {
  if (!grad->has_partial()) return false;
  for (const auto& op : grad->partial())
    if (op && *op != layout::ReduceOp::Sum) return false;
  return without_partial(grad) == target;
}

// Whether this backward pass will accumulate into `leaf`.grad (not so under torch.autograd.grad,
// which hands the gradient back instead, or for a leaf outside backward(inputs=...)).
bool accumulates_into(const at::Tensor& leaf) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr) return false;
  if (exec_info->empty()) return true;  // backward() without inputs: every node runs
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(leaf);
  if (!accumulator) return false;
  const auto it = exec_info->find(accumulator.get());
  return it != exec_info->end() && it->second.needed_ && !it->second.captures_;
}

void reduce_batch(Batch& batch);
void fill_buckets(Batch& batch);

// Held gradients (hold_grad_sync): the deferred gradients of every backward pass run while held,
// each leaf once, reduced together when the hold ends (pipelining: once per step, not once per
// microbatch). A leaf's .grad stays Partial in between, so the next pass accumulates locally.
std::atomic<bool> g_hold{false};
std::shared_ptr<Batch> g_held;                  // guarded by g_batches_mutex
std::unordered_set<const void*> g_held_leaves;  // guarded by g_batches_mutex

// Queues `item` for the current backward pass; false when there is no graph task to attach to.
bool defer(Deferred item) {
  if (g_hold.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> lock(g_batches_mutex);
    if (!g_held) g_held = std::make_shared<Batch>();
    if (g_held_leaves.insert(item.leaf._unsafe_get_target()).second) {
      std::lock_guard<std::mutex> batch_lock(g_held->mutex);
      g_held->items.push_back(std::move(item));
    }
    return true;
  }
  const int task = torch::autograd::get_current_graph_task_id();
  if (task < 0) return false;
  std::shared_ptr<Batch> batch;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(g_batches_mutex);
    auto& slot = g_batches[task];
    batch = slot.lock();
    if (!batch) {
      for (auto it = g_batches.begin(); it != g_batches.end();)  // entries of passes that raised
        it = it->second.expired() && it->first != task ? g_batches.erase(it) : std::next(it);
      batch = std::make_shared<Batch>();
      g_batches[task] = batch;
      first = true;
    }
  }
  if (first) {
    torch::autograd::Engine::get_default_engine().queue_callback([task, batch] {
      {
        std::lock_guard<std::mutex> lock(g_batches_mutex);
        g_batches.erase(task);
      }
      reduce_batch(*batch);
    });
  }
  std::lock_guard<std::mutex> lock(batch->mutex);
  batch->items.push_back(std::move(item));
  if (g_overlap.load(std::memory_order_relaxed)) fill_buckets(*batch);
  return true;
}

using BucketGrads = c10::ArrayRef<std::pair<at::Tensor, LayoutPtr>>;  // (.grad, target layout)

// Copies `grads`' locals into one contiguous buffer and makes each .grad's local its slice of it
// (layout unchanged: still Partial until the buffer is summed).
at::Tensor pack_bucket(BucketGrads grads, at::ScalarType dtype, c10::Device device) {
  int64_t total = 0;
  for (const auto& [grad, target] : grads) total += dtensor_impl(grad)->local().numel();
  auto buffer = at::empty({total}, at::TensorOptions().dtype(dtype).device(device));
  int64_t offset = 0;
  for (const auto& [grad, target] : grads) {
    auto* impl = dtensor_impl(grad);
    const int64_t n = impl->local().numel();
    at::Tensor slice = buffer.narrow(0, offset, n).view(impl->local().sizes());
    slice.copy_(impl->local());
    impl->replace(std::move(slice), impl->layout());
    offset += n;
  }
  return buffer;
}

// After the bucket's sum: each .grad (a slice of it) takes its leaf's layout; counted.
void settle_bucket(BucketGrads grads, bool overlapped) {
  for (const auto& [grad, target] : grads) {
    auto* impl = dtensor_impl(grad);
    impl->replace(impl->local(), target);
  }
  g_buckets.fetch_add(1, std::memory_order_relaxed);
  if (overlapped) g_overlapped.fetch_add(1, std::memory_order_relaxed);
  g_bucketed.fetch_add(static_cast<int64_t>(grads.size()), std::memory_order_relaxed);
}

void reduce_bucket(Group& group, size_t begin, size_t end) {
  const BucketGrads grads = BucketGrads(group.grads).slice(begin, end - begin);
  at::Tensor buffer = pack_bucket(grads, group.dtype, group.device);
  for (const int64_t axis : group.axes) {
    CollectiveInFlight in_flight(CollectiveKind::kAllReduce, *group.mesh, axis, static_cast<int64_t>(buffer.nbytes()),
                                 "a gradient bucket");
    sum_in_place_along(buffer, *group.mesh, axis);
  }
  settle_bucket(grads, /*overlapped=*/false);
}

// `item`'s .grad when it still holds the Partial gradient its hook left (with the Partial axes);
// an undefined tensor when there is nothing to reduce, or when something changed .grad since the
// hook (then converted here, alone).
at::Tensor pending_grad(const Deferred& item, std::vector<int64_t>& axes) {
  const at::Tensor leaf(item.leaf.lock());
  if (!leaf.defined() || !leaf.grad().defined()) return {};
  auto* impl = dtensor_impl(leaf.grad());
  if (impl == nullptr || impl->layout() == item.target) return {};
  if (impl->layout() != item.partial) {
    leaf.mutable_grad() = redistribute(leaf.grad(), item.target);
    return {};
  }
  axes.clear();
  for (int64_t a = 0; a < item.partial->mesh()->ndim(); ++a)
    if (item.partial->is_partial(a)) axes.push_back(a);
  return leaf.grad();
}

// The group of `grad` (with Partial `axes`) in `groups`, made when missing.
Group& group_of(std::vector<Group>& groups, const at::Tensor& grad, const std::vector<int64_t>& axes) {
  auto* impl = dtensor_impl(grad);
  const auto& local = impl->local();
  for (auto& g : groups)
    if (g.mesh->same_mesh(*impl->device_mesh()) && g.axes == axes && g.dtype == local.scalar_type() &&
        g.device == local.device())
      return g;
  return groups.emplace_back(Group{impl->device_mesh(), axes, local.scalar_type(), local.device(), {}, 0, {}});
}

int64_t local_bytes(const at::Tensor& grad) {
  const auto& local = dtensor_impl(grad)->local();
  return local.numel() * static_cast<int64_t>(local.element_size());
}

// Starts the all-reduce of `group`'s filled bucket; its members' .grad become slices of it.
void start_bucket(Batch& batch, Group& group) {
  at::Tensor buffer = pack_bucket(group.grads, group.dtype, group.device);
  PendingSum sum(buffer, *group.mesh, group.axes.front());
  batch.started.push_back(Started{std::move(group.grads), group.mesh, group.axes, std::move(sum)});
  for (size_t i : group.items) batch.items[i].started = true;
  group.grads.clear();
  group.items.clear();
  group.bytes = 0;
}

void fill_buckets(Batch& batch) {
  at::NoGradGuard no_grad;
  const int64_t cap = g_bucket_bytes.load(std::memory_order_relaxed);
  const c10::Device device = batch.items.back().device;
  std::vector<int64_t> axes;
  // Every item before the newest of its device is settled (see the header comment).
  for (; batch.settled + 1 < batch.items.size() && batch.items[batch.settled].device == device; ++batch.settled) {
    const at::Tensor grad = pending_grad(batch.items[batch.settled], axes);
    if (!grad.defined()) continue;
    Group& group = group_of(batch.filling, grad, axes);
    const int64_t size = local_bytes(grad);
    if (!group.grads.empty() && group.bytes + size > cap) start_bucket(batch, group);
    group.grads.emplace_back(grad, batch.items[batch.settled].target);
    group.items.push_back(batch.settled);
    group.bytes += size;
  }
}

// Waits for the buckets started during the pass (without the GIL: c10d's wait may need it),
// summing each over its remaining axes in turn (every bucket's next axis started before any is
// waited for), and gives each member's .grad its leaf's layout.
void finish_started(std::vector<Started>& started) {
  for (bool more = true; more;) {
    more = false;
    for (auto& bucket : started) {
      {
        CollectiveInFlight in_flight(CollectiveKind::kAllReduce, *bucket.mesh, bucket.axes[bucket.next - 1],
                                     static_cast<int64_t>(bucket.sum.buffer().nbytes()), "a gradient bucket");
        without_gil([&] { bucket.sum.wait(); });
      }
      if (bucket.next < bucket.axes.size()) {
        bucket.sum = PendingSum(bucket.sum.buffer(), *bucket.mesh, bucket.axes[bucket.next++]);
        more = true;
      }
    }
  }
  for (const auto& bucket : started) settle_bucket(bucket.grads, /*overlapped=*/true);
  started.clear();
}

void reduce_batch(Batch& batch) {
  at::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(batch.mutex);
  finish_started(batch.started);
  std::vector<Group> groups;  // in first-arrival order, the same on every rank
  std::vector<int64_t> axes;
  for (const auto& item : batch.items) {
    if (item.started) continue;
    const at::Tensor grad = pending_grad(item, axes);
    if (grad.defined()) group_of(groups, grad, axes).grads.emplace_back(grad, item.target);
  }
  const int64_t cap = g_bucket_bytes.load(std::memory_order_relaxed);
  for (auto& group : groups) {
    size_t begin = 0;
    int64_t bytes = 0;
    for (size_t i = 0; i < group.grads.size(); ++i) {
      const int64_t size = local_bytes(group.grads[i].first);
      if (i > begin && bytes + size > cap) {
        reduce_bucket(group, begin, i);
        begin = i;
        bytes = 0;
      }
      bytes += size;
    }
    if (begin < group.grads.size()) reduce_bucket(group, begin, group.grads.size());
  }
}

// Whether the hook may leave this gradient Partial for the bucket.
bool may_defer(const at::Tensor& leaf, const LayoutPtr& grad, const LayoutPtr& target) {
  return g_bucket_bytes.load(std::memory_order_relaxed) > 0 && is_pending_sum(grad, target) &&
         !torch::autograd::impl::post_acc_grad_hooks(leaf) &&  // it would read .grad before the bucket
         accumulates_into(leaf);
}

// What `leaf`.grad holds when a Partial gradient is about to be accumulated into it.
enum class GradSlot { kEmpty, kPartial, kReduced, kOther };

GradSlot grad_slot(const at::Tensor& leaf, const LayoutPtr& partial, const LayoutPtr& target) {
  const auto& grad = leaf.grad();
  if (!grad.defined()) return GradSlot::kEmpty;
  const auto* impl = dtensor_impl(grad);
  if (impl == nullptr) return GradSlot::kOther;
  if (impl->layout() == partial) return GradSlot::kPartial;
  return impl->layout() == target ? GradSlot::kReduced : GradSlot::kOther;
}

// A reduced .grad (gradient accumulation over micro-batches, zero_grad(set_to_none=False)) becomes
// the same value as a Partial(sum), without communication: the ranks at coordinate 0 of every
// Partial axis keep it, the others hold zeros. The Partial gradient then accumulates into it
// locally, and the bucket reduces the sum once.
void make_partial_in_place(DTensorImpl& grad, const LayoutPtr& partial) {
  const auto& mesh = *grad.device_mesh();
  bool keeps = true;
  for (int64_t a = 0; a < partial->mesh()->ndim(); ++a)
    if (partial->is_partial(a) && mesh.coordinate(a) != 0) keeps = false;
  at::Tensor local = grad.local();
  if (!keeps) {
    at::NoGradGuard no_grad;
    local.zero_();
  }
  grad.replace(std::move(local), partial);
}

}  // namespace

namespace {

at::Tensor grad_to_leaf_layout(const WeakTensor& weak, const at::Tensor& grad) {
  const at::Tensor strong(weak.lock());
  auto* grad_impl = dtensor_impl(grad);
  if (!strong.defined() || !grad_impl) return grad;
  const auto& target = static_cast<DTensorImpl*>(strong.unsafeGetTensorImpl())->layout();
  if (grad_impl->layout() == target) return grad;
  const auto& partial = grad_impl->layout();
  if (may_defer(strong, partial, target)) {
    const GradSlot slot = grad_slot(strong, partial, target);
    if (slot != GradSlot::kOther && defer(Deferred{weak, partial, target, grad.device()})) {
      if (slot == GradSlot::kReduced) make_partial_in_place(*dtensor_impl(strong.grad()), partial);
      // AccumulateGrad keeps a gradient only in the leaf's strides; otherwise it copies it into
      // an empty tensor of the leaf's (Replicate) layout, and that copy_ sums the Partial right
      // there, one blocking collective per gradient (a transposed weight gradient: a linear run
      // as bmm on two sequences per rank). A local copy in the leaf's order keeps it Partial.
      if (slot == GradSlot::kEmpty && strong.is_contiguous() && !grad.is_contiguous()) return grad.contiguous();
      return grad;
    }
  }
  g_reduced_on_arrival.fetch_add(1, std::memory_order_relaxed);
  return redistribute(grad, target);
}

struct GradLayoutHook final : torch::autograd::FunctionPreHook {
  explicit GradLayoutHook(WeakTensor leaf) : leaf(std::move(leaf)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (grads.empty() || !grads[0].defined()) return grads;
    auto out = grads;
    out[0] = grad_to_leaf_layout(leaf, grads[0]);
    return out;
  }
  WeakTensor leaf;
};

}  // namespace

// torch keeps a leaf's tensor hooks in one list that each kind of registration CLEARS on first
// use: C++ Tensor::register_hook wipes the Python hooks already there, and Python's first
// register_hook wipes the C++ ones (torch::autograd::impl::clear_hooks). Registered that way,
// hypershard's hook silently dropped a user's hooks or was dropped by them (then .grad stayed
// Partial). So hypershard appends its own hook object to that list without clearing anything,
// whenever the leaf reaches an op and the list lacks it (the first forward, and again after a
// user's Python registration removed it: the next forward, or the backward ops that read it).
void detail::install_grad_hook(const at::Tensor& leaf) {
  auto& hooks = torch::autograd::impl::hooks(leaf);  // a requires-grad leaf has autograd meta
  for (const auto& hook : hooks)
    if (dynamic_cast<const GradLayoutHook*>(hook.get()) != nullptr) return;
  // Appended, not add_hook: add_hook insists on an empty list (torch allows one tensor pre-hook
  // per leaf); the engine runs every hook in the list, in order.
  hooks.push_back(std::make_unique<GradLayoutHook>(WeakTensor(leaf.getIntrusivePtr())));
}

void hold_grad_sync(bool hold) {
  if (hold) {
    g_hold.store(true, std::memory_order_relaxed);
    return;
  }
  std::shared_ptr<Batch> held;
  {
    std::lock_guard<std::mutex> lock(g_batches_mutex);
    g_hold.store(false, std::memory_order_relaxed);
    held = std::move(g_held);
    g_held.reset();
    g_held_leaves.clear();
  }
  if (held) reduce_batch(*held);
}

bool grad_sync_held() { return g_hold.load(std::memory_order_relaxed); }

void set_grad_bucket_bytes(int64_t bytes) {
  HS_CHECK(bytes >= 0, "set_grad_bucket_bytes", "bytes must be >= 0 (0 reduces each gradient on arrival), got ", bytes);
  g_bucket_bytes.store(bytes, std::memory_order_relaxed);
}

int64_t grad_bucket_bytes() { return g_bucket_bytes.load(std::memory_order_relaxed); }

void set_grad_overlap(bool overlap) { g_overlap.store(overlap, std::memory_order_relaxed); }

bool grad_overlap() { return g_overlap.load(std::memory_order_relaxed); }

GradSyncStats grad_sync_stats() {
  return {g_reduced_on_arrival.load(std::memory_order_relaxed), g_bucketed.load(std::memory_order_relaxed),
          g_buckets.load(std::memory_order_relaxed), g_overlapped.load(std::memory_order_relaxed)};
}

void reset_grad_sync_stats() {
  g_reduced_on_arrival.store(0, std::memory_order_relaxed);
  g_bucketed.store(0, std::memory_order_relaxed);
  g_buckets.store(0, std::memory_order_relaxed);
  g_overlapped.store(0, std::memory_order_relaxed);
}

}  // namespace hypershard::runtime
