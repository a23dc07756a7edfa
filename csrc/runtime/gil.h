// Running C++ that may block on another thread which itself needs the GIL (joining a process
// group's worker, starting or waiting for a collective) must not hold the GIL. The runtime is
// called both from Python (GIL held: pybind11 calls, Python-side tensor frees, a tensor's
// __getitem__, whose binding keeps the GIL) and from threads without it (autograd workers, ops
// that torch's bindings already run without the GIL).
//
// Every collective is therefore started and waited for inside without_gil: gloo's worker thread
// copies the starting thread's thread-local state, Python objects included (saved-tensor hooks,
// dispatch and function modes, which torch.utils.checkpoint installs), and takes the GIL to copy
// it and again to free it -- the latter while holding the queue's lock that the next start needs.
// A caller holding the GIL then waits forever (both ranks stuck in the collective).
#pragma once

#include <functional>

namespace hypershard::runtime {

// Runs `fn` with the GIL released when this thread holds it, else just runs it. Exceptions
// propagate after the GIL is taken back.
void without_gil(const std::function<void()>& fn);

}  // namespace hypershard::runtime
