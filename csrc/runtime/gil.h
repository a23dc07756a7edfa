// Running C++ that may block on another thread which itself needs the GIL (joining a process
// group's worker, waiting for a collective) must not hold the GIL. The runtime is called both
// from Python (GIL held: pybind11 calls, Python-side tensor frees) and from threads without it
// (autograd workers, ops that torch's bindings already run without the GIL).
#pragma once

#include <functional>

namespace hypershard::runtime {

// Runs `fn` with the GIL released when this thread holds it, else just runs it. Exceptions
// propagate after the GIL is taken back.
void without_gil(const std::function<void()>& fn);

}  // namespace hypershard::runtime
