// _C.operation_in_flight(): what this thread's runtime is doing (runtime/in_flight.h), for the
// report of a hung or failed collective (hypershard/launch/faults.py).
#include <pybind11/pybind11.h>

#include "runtime/in_flight.h"

namespace py = pybind11;

namespace hypershard::python {

void bind_in_flight(py::module_& m) {
  m.def(
      "operation_in_flight",
      []() -> py::object {
        const auto report = runtime::operation_in_flight();
        if (!report) return py::none();
        auto text = [](const std::string& s) -> py::object {
          return s.empty() ? py::object(py::none()) : py::object(py::str(s));
        };
        py::dict d;
        d["op"] = text(report->op);
        d["collective"] = text(report->collective);
        d["what"] = text(report->what);
        d["axis"] = text(report->axis);
        d["bytes"] = report->collective.empty() ? py::object(py::none()) : py::int_(report->bytes);
        d["failed"] = py::bool_(report->failed);
        return std::move(d);
      },
      "What this thread's runtime is doing: {'op': 'aten::sum.default', 'collective': 'all_reduce', "
      "'what': None, 'axis': 'dp', 'bytes': 8, 'failed': False}; a collective that raised stays "
      "(failed: True) until its thread issues its next collective; None when there is nothing.");
}

}  // namespace hypershard::python
