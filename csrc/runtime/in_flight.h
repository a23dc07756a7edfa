// What this thread's runtime is doing, for a hung or failed collective's report
// (hypershard/launch/faults.py, docs/faults.md): the ATen op the operator flow runs and the
// collective it waits in (kind, mesh axis, bytes). Setting it stores pointers and ints in a
// thread-local record -- no allocation, no formatting; the record is formatted only when read.
//
// A collective that raises (a timeout, a dead peer) never finished: its record, formatted while
// its mesh is alive, stays readable (operation_in_flight) until this thread issues its next
// collective, so the report made after the error unwound to Python can name it.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>

namespace c10 {
struct OperatorName;
}

namespace hypershard::runtime {

class DeviceMesh;

enum class CollectiveKind : uint8_t { kNone, kAllReduce, kAllGather, kReduceScatter, kAllToAll };

struct InFlight {
  const c10::OperatorName* op = nullptr;  // the operator flow's op (owned by the dispatcher)
  CollectiveKind collective = CollectiveKind::kNone;
  const char* what = nullptr;  // a collective outside any op: "a gradient bucket", ...
  const DeviceMesh* mesh = nullptr;
  int64_t axis = -1;
  int64_t bytes = 0;
};

namespace detail {
InFlight& in_flight();                           // this thread's record
void collective_failed(const InFlight& record);  // keeps the record formatted (cold)
void collective_started();                       // forgets this thread's failed record, if any
}  // namespace detail

// The op the operator flow runs on this thread, for the scope.
class OpInFlight {
 public:
  explicit OpInFlight(const c10::OperatorName& name) : record_(detail::in_flight()), previous_(record_.op) {
    record_.op = &name;
  }
  ~OpInFlight() { record_.op = previous_; }
  OpInFlight(const OpInFlight&) = delete;
  OpInFlight& operator=(const OpInFlight&) = delete;

 private:
  InFlight& record_;
  const c10::OperatorName* previous_;
};

// A collective this thread issues or waits in, for the scope; kept when the scope unwinds on an
// exception (the collective raised).
class CollectiveInFlight {
 public:
  CollectiveInFlight(CollectiveKind kind, const DeviceMesh& mesh, int64_t axis, int64_t bytes,
                     const char* what = nullptr)
      : record_(detail::in_flight()), exceptions_(std::uncaught_exceptions()) {
    detail::collective_started();
    record_.collective = kind;
    record_.what = what;
    record_.mesh = &mesh;
    record_.axis = axis;
    record_.bytes = bytes;
  }
  ~CollectiveInFlight() {
    if (std::uncaught_exceptions() > exceptions_) detail::collective_failed(record_);
    record_.collective = CollectiveKind::kNone;
    record_.what = nullptr;
    record_.mesh = nullptr;
  }
  CollectiveInFlight(const CollectiveInFlight&) = delete;
  CollectiveInFlight& operator=(const CollectiveInFlight&) = delete;

 private:
  InFlight& record_;
  int exceptions_;
};

// The record, formatted.
struct OperationReport {
  std::string op;          // "aten::sum.default"; empty outside the operator flow
  std::string collective;  // "all_reduce", "all_gather", "reduce_scatter", "all_to_all"; empty: none
  std::string what;        // a collective outside any op: what it is for; else empty
  std::string axis;        // the mesh axis' name
  int64_t bytes = 0;       // this rank's buffer handed to the collective
  bool failed = false;     // the collective raised (it is kept after its scope ended)
};

// This thread's operation in flight; else the collective that last raised (on this thread, or
// on another, such as autograd's device threads, until that thread issues its next collective);
// nullopt when there is neither.
std::optional<OperationReport> operation_in_flight();

const char* collective_name(CollectiveKind kind);

}  // namespace hypershard::runtime
