// The operation in flight (in_flight.h).
#include "runtime/in_flight.h"

#include <ATen/core/operator_name.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "runtime/device_mesh.h"

namespace hypershard::runtime {
namespace {

thread_local InFlight t_in_flight;

// The record of the collective that last raised, formatted, and the thread it raised on.
std::mutex g_failed_mutex;
std::optional<OperationReport> g_failed;
std::thread::id g_failed_thread;
std::atomic<bool> g_has_failed{false};
thread_local bool t_failed = false;  // this thread published g_failed

std::string op_name(const c10::OperatorName* op) {
  if (!op) return {};
  return op->name + "." + (op->overload_name.empty() ? "default" : op->overload_name);
}

OperationReport format(const InFlight& r) {
  OperationReport report;
  report.op = op_name(r.op);
  if (r.collective != CollectiveKind::kNone) {
    report.collective = collective_name(r.collective);
    if (r.what) report.what = r.what;
    if (r.mesh && r.axis >= 0) {
      const auto& names = r.mesh->mesh()->axis_names();
      if (r.axis < static_cast<int64_t>(names.size())) report.axis = names[r.axis];
    }
    report.bytes = r.bytes;
  }
  return report;
}

}  // namespace

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllToAll:
      return "all_to_all";
    case CollectiveKind::kNone:
      break;
  }
  return "";
}

namespace detail {

InFlight& in_flight() { return t_in_flight; }

void collective_failed(const InFlight& record) {
  try {  // called from a destructor while an exception unwinds: never throw
    OperationReport report = format(record);
    report.failed = true;
    std::lock_guard<std::mutex> lock(g_failed_mutex);
    g_failed = std::move(report);
    g_failed_thread = std::this_thread::get_id();
    g_has_failed.store(true, std::memory_order_relaxed);
    t_failed = true;
  } catch (...) {
  }
}

void collective_started() {
  if (!t_failed) return;  // the common case: one thread-local load
  t_failed = false;
  std::lock_guard<std::mutex> lock(g_failed_mutex);
  if (g_failed_thread == std::this_thread::get_id()) {
    g_failed.reset();
    g_has_failed.store(false, std::memory_order_relaxed);
  }
}

}  // namespace detail

std::optional<OperationReport> operation_in_flight() {
  const InFlight& r = t_in_flight;
  if (r.op || r.collective != CollectiveKind::kNone) return format(r);
  if (!g_has_failed.load(std::memory_order_relaxed)) return std::nullopt;
  std::lock_guard<std::mutex> lock(g_failed_mutex);
  return g_failed;
}

}  // namespace hypershard::runtime
